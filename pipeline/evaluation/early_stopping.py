"""Early stopping per path (`eval.early_stopping`): each path keeps the round whose modules gave
its own validation shard the lowest perplexity.

DiPaCo (Douillard et al. 2024) early-stops every path on its own held-out shard: paths see
different data and stop improving at different rounds, so one stopping round for the whole model
is worse than one per path. `eval/best.json` records that choice over every evaluated round so far,
recomputed from the `eval/round=<r>.json` files alone (so a rerun, or an island that wrote it from
an older listing, is corrected by the next write):

    {"paths": {id: {"round": r, "perplexity": x, "bits_per_byte": y}},
     "perplexity": …, "bits_per_byte": …, "tokens": …, "bytes": …}

The overall figures are those of the early-stopped model, combined exactly as `combine_paths`
does: per-path summed NLL (tokens × ln perplexity) over all tokens and bytes.
"""

from __future__ import annotations

import logging
import math
import re

from pipeline.state import layout
from pipeline.state.storage import RunRoot

log = logging.getLogger("dipaco.eval")
BEST_FILE = f"{layout.EVAL_DIR}/best.json"
_EVAL_FILE = re.compile(r"round=(\d{1,9})\.json")


def choose_rounds(evals: dict[int, dict]) -> dict[str, dict]:
    """{path: {"round", "perplexity", "bits_per_byte", "tokens", "bytes"}}: each path's round of
    lowest perplexity over `evals` ({round: eval/round=<r>.json}); a tie keeps the earliest round
    (less training for the same score)."""
    best: dict[str, dict] = {}
    for round_index in sorted(evals):
        for path_id, scores in (evals[round_index].get("paths") or {}).items():
            perplexity = scores.get("perplexity")
            if not isinstance(perplexity, (int, float)) or not math.isfinite(perplexity):
                continue
            if path_id not in best or perplexity < best[path_id]["perplexity"]:  # strict: ties keep the earliest
                best[path_id] = {
                    "round": round_index,
                    "perplexity": float(perplexity),
                    "bits_per_byte": scores.get("bits_per_byte"),
                    "tokens": int(scores.get("tokens") or 0),
                    "bytes": int(scores.get("bytes") or 0),
                }
    return dict(sorted(best.items()))


def early_stopped(evals: dict[int, dict]) -> dict:
    """best.json's content: the chosen round per path and the early-stopped model's overall figures."""
    chosen = choose_rounds(evals)
    nll = sum(p["tokens"] * math.log(p["perplexity"]) for p in chosen.values())  # summed nats
    tokens = sum(p["tokens"] for p in chosen.values())
    n_bytes = sum(p["bytes"] for p in chosen.values())
    return {
        "paths": {pid: {k: p[k] for k in ("round", "perplexity", "bits_per_byte")} for pid, p in chosen.items()},
        "perplexity": math.exp(nll / tokens) if tokens else None,
        "bits_per_byte": nll / math.log(2) / n_bytes if n_bytes else None,
        "tokens": tokens,
        "bytes": n_bytes,
        "rounds_evaluated": sorted(evals),
    }


def path_rounds(best: dict) -> dict[str, int]:
    """{path: chosen round}, the part of best.json a registered model needs."""
    return {pid: int(entry["round"]) for pid, entry in best.get("paths", {}).items()}


def evaluated_rounds(root: RunRoot) -> list[int]:
    """The rounds with an eval/round=<r>.json, in order."""
    return sorted(int(m.group(1)) for n in root.listdir(layout.EVAL_DIR) if (m := _EVAL_FILE.fullmatch(n)))


def read_evals(root: RunRoot, up_to: int | None = None) -> dict[int, dict]:
    """{round: eval file} for every evaluated round (those <= up_to, when given)."""
    return {r: root.read_json(layout.eval_file(r)) for r in evaluated_rounds(root) if up_to is None or r <= up_to}


def best_up_to(root: RunRoot, up_to: int | None = None) -> dict:
    """The early-stopped model over the rounds evaluated so far (up to round `up_to`)."""
    return early_stopped(read_evals(root, up_to))


def write_best(root: RunRoot) -> dict:
    """eval/best.json from every eval file present (atomic: RunRoot writes a temp name and renames)."""
    best = best_up_to(root)
    root.write_json(BEST_FILE, best)
    if best["perplexity"] is not None:
        log.info(
            "early stopping: perplexity %.2f, %s bits per byte; rounds %s",
            best["perplexity"],
            f"{best['bits_per_byte']:.3f}" if best["bits_per_byte"] is not None else "-",
            " ".join(f"{p}={r}" for p, r in path_rounds(best).items()),
        )
    return best

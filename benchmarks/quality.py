"""Quality: does dipaco reproduce the *shape* of the DiPaCo / DiLoCo papers' results?

`python -m benchmarks.quality [--quick] [--plan] [size flags]` (also run by `make bench`). Every row
is a real run of the pipeline (`pipeline.stages.run`: init_run, prepare, then rounds of training,
merging and evaluation on islands) on the bundled Wikipedia sample (9,531 training documents, ~4.7 MB,
12 topics), with one trained BPE tokenizer (4,096 ids), the same 502 held-out documents and the same
scored tokens (every token after the 32-token routing prefix) in every row.

Rows (`variants`), each at the same inner steps per path and tokens per step unless named otherwise:

| row | run |
|---|---|
| `dense` (2 seeds) | grid [1], one worker, outer lr 1 / momentum 0: plain training of one path's model |
| `dense_x4` | the same trained 4x the steps (the compute of the 4-job rows) |
| `diloco_m4` (2 seeds) | grid [1], 4 DiLoCo workers on iid quarters of the data |
| `dipaco_2x2` (2 seeds) | [2, 2] grid routed by MiniLM product k-means (4 paths, 2 blocks a level) |
| `dipaco_4x4` | [4, 4] grid (16 paths): 4x the non-embedding parameters of a path in all |
| `dense_big` | the flagship analogue: grid [1], hidden 2x (4x the path's non-embedding parameters), same steps |
| `reroute64` | `dipaco_2x2` seed 0's last round evaluated with `eval.reroute_every: 64` (no training) |
| `early_stop` | `dipaco_2x2` seed 0's `eval/best.json` (`eval.early_stopping`, no training) |
| `pathblocks` | [2, 2] grid with blocks [2, 1] + 1 `model.path_specific_blocks`: a path as deep as the others |
| `int8`, `int4` | `dipaco_2x2` with `outer.compression: int8 / int4` |
| `discriminative` | `dipaco_2x2` with `router.discriminative_after` (only when the config has that key) |

How it runs on 2 cores: every trained row is one real `deepspeed` island (one rank, one OMP thread),
and two rows train at a time (`--lanes 2`, one per core), the longest first, so both cores stay busy
to the end; the wall-clock time of a row is that of one core. Rows of the same grid and router share
one prepare (router, shards and the one tokenizer are copied between run roots): 3 prepares, grid
[1] with the cheap tf-idf embedder (every document lands in the one path anyway), [2, 2] and [4, 4]
with MiniLM (~95 s each on 2 cores for the 10,033 documents).

Budget of the default run (`--plan` prints it from the same formula): a step of the path (hidden 128,
4 blocks, vocab 4,096, seq_len 128, micro batch 6 = 768 tokens) costs ~0.17 s on one idle core under
ZeRO-2 in fp32, ~0.12 s with DeepSpeed's torch_autocast to bfloat16 (train.precision: auto picks it on
this AVX-512 BF16 CPU for every row, as for the demo: 0.29 against 0.41 s at 256 x 8; the estimates below are fp32's,
a margin) (measured 0.25 s at seq 128 x 6, 0.32-0.37 s at 128 x 8 and 0.62 s at 256 x 8 on a core
shared with other work, against the demo's 0.41 s at 256 x 8 on an idle one: x0.66); hidden 256
~2.8x that. 300 steps per path (6 rounds x H=50), plus ~15 s per island start and ~5 s per
evaluation (7 a row) and merge:

| row | path-steps | est. core-s |
|---|---|---|
| dense (x2 seeds) | 300 each | 100 each |
| dense_x4 | 1,200 | 250 |
| diloco_m4 (x2) | 1,200 each | 270 each |
| dipaco_2x2 (x2) | 1,200 each | 270 each (+~25 s re-routed evaluation on seed 0) |
| dipaco_4x4 | 4,800 | 900 |
| dense_big | 300 (hidden 256) | 190 |
| pathblocks, int8, int4 (, discriminative +~120) | 1,200 each | 270 each |

~3,400 core-s over 2 lanes is ~28 min, plus ~4 min of prepares: ~32 min (`--plan`); the
`discriminative` row, once main has `router.discriminative_after`, adds ~3 min (its re-sharding
Beam job included). The perf part, shortened for this, takes ~5 min: ~40 min for `make bench`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
import math
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import stages
from pipeline.core.config import Config, RouterConfig, config_from_dict
from pipeline.evaluation.evaluate import evaluate_round
from pipeline.scaling.spec import non_embedding_params
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.sweep import copy_committed

log = logging.getLogger("dipaco.bench.quality")
OUT = Path("benchmarks/out")
STEP_SECONDS = 0.17  # one step of the default path on one idle core (module docstring)
HAS_DISCRIMINATIVE = "discriminative_after" in {f.name for f in dataclasses.fields(RouterConfig)}


@dataclass
class QualityArgs:
    """Sizes of the quality benchmark; the defaults are the budget in the module docstring."""

    rounds: int = 6
    inner_steps: int = 50  # H per round; the papers use 150 (DiPaCo) and 500 (DiLoCo)
    workers: int = 4  # M: DiLoCo workers and the step multiple of dense_x4
    hidden: int = 128
    heads: int = 4
    blocks: int = 4  # blocks per path, split evenly over the levels of a 2-level grid
    seq_len: int = 128  # the sample's documents average ~120 tokens: longer windows mostly pack
    micro_batch: int = 6
    lr: float = 3.0e-3  # the demo's inner lr for this path (tuned there)
    warmup: int = 20
    outer_lr: float = 1.0  # plain averaging: at 6 rounds Nesterov has nothing to build on and its
    outer_momentum: float = 0.0  # first step overshoots (the demo measured 2.055 vs 2.175 bits/byte)
    seeds: int = 2  # seeds of dense, diloco and dipaco_2x2
    train_docs: int = 0  # 0: every training document
    eval_docs: int = 0  # 0: every held-out document (502)
    embedder: str = "minilm"
    router_docs: int = 2000  # documents the k-means is fitted on
    vocab: int = 4096
    lanes: int = 2  # rows trained at once, one island (one core) each
    launcher: str = "deepspeed"  # deepspeed | inprocess (debugging: one lane, in this process)
    only: str = ""  # comma-separated row names to run (debugging); empty: all
    train_glob: str = "data/sample/train/*.json.gz"
    eval_glob: str = "data/sample/validation/*.json.gz"
    out: str = str(OUT / "quality")
    keep_rounds: int = 0  # 1: keep each run's rounds/ (modules, DeepSpeed states)


QUICK = {"rounds": 2, "inner_steps": 3, "hidden": 32, "blocks": 4, "seq_len": 128, "micro_batch": 2, "warmup": 1,
         "train_docs": 400, "eval_docs": 40, "embedder": "tfidf", "router_docs": 200, "vocab": 512,
         "launcher": "deepspeed", "lanes": 2}  # every row through real islands in a few minutes: a smoke check


@dataclass(frozen=True)
class Variant:
    name: str  # the row; seeds share it
    grid: tuple[int, ...]
    seed: int = 0
    workers: int = 1
    step_multiple: int = 1
    hidden_multiple: int = 1
    outer_identity: bool = False  # dense rows: outer lr 1, momentum 0 = no outer optimizer
    blocks: tuple[int, ...] | None = None  # blocks per level (default: split evenly)
    path_blocks: int = 0
    compression: str = "none"
    discriminative: bool = False
    early_stopping: bool = False
    reroute_after: bool = False  # evaluate the last round re-routed every 64 tokens too

    @property
    def run_name(self) -> str:
        return f"{self.name}_s{self.seed}"

    @property
    def prep_key(self) -> str:
        """Runs with the same grid and router share a prepare."""
        return "x".join(map(str, self.grid))

    def cost(self, args: QualityArgs) -> float:
        """Estimated core-seconds (the module docstring's formula), to train the longest rows first."""
        jobs = math.prod(self.grid) * self.workers
        steps = args.rounds * args.inner_steps * self.step_multiple
        step = STEP_SECONDS * (2.8 if self.hidden_multiple > 1 else 1.0)
        evals = (args.rounds + 1) * 5 * (2 if jobs > 4 else 1)
        return jobs * steps * step + 15 + evals + (25 if self.reroute_after else 0) + (120 if self.discriminative else 0)


def variants(args: QualityArgs) -> list[Variant]:
    seeds = range(args.seeds)
    m = args.workers
    rows = [*(Variant("dense", (1,), seed=s, outer_identity=True) for s in seeds),
            Variant(f"dense_x{m}", (1,), step_multiple=m, outer_identity=True),
            *(Variant(f"diloco_m{m}", (1,), seed=s, workers=m) for s in seeds),
            *(Variant("dipaco_2x2", (2, 2), seed=s, early_stopping=s == 0, reroute_after=s == 0) for s in seeds),
            Variant("dipaco_4x4", (4, 4)),
            Variant("dense_big", (1,), hidden_multiple=2, outer_identity=True),
            Variant("pathblocks", (2, 2), blocks=(args.blocks // 2, args.blocks // 2 - 1), path_blocks=1),
            Variant("int8", (2, 2), compression="int8"),
            Variant("int4", (2, 2), compression="int4")]
    if HAS_DISCRIMINATIVE:
        rows.append(Variant("discriminative", (2, 2), discriminative=True))
    wanted = {n for n in args.only.split(",") if n}
    return [v for v in rows if not wanted or v.name in wanted]


def write_eval_docs(args: QualityArgs) -> str:
    """The held-out documents (the first `eval_docs`, 0: all) as one file: the same for every row."""
    target = Path(args.out) / "data" / "validation" / "c4-validation.00000-of-00001.json.gz"
    target.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for file in sorted(Path().glob(args.eval_glob)):
        with gzip.open(file, "rt", encoding="utf-8") as handle:
            lines.extend(handle)
    with gzip.open(target, "wt", encoding="utf-8") as handle:
        handle.writelines(lines[: args.eval_docs or None])
    return str(target.parent / "*.json.gz")


def variant_config(args: QualityArgs, v: Variant, run_root: str, eval_glob: str) -> Config:
    levels = len(v.grid)
    blocks = list(v.blocks) if v.blocks else [args.blocks // levels] * levels
    outer = ({"lr": 1.0, "momentum": 0.0, "nesterov": False} if v.outer_identity else
             {"lr": args.outer_lr, "momentum": args.outer_momentum, "nesterov": args.outer_momentum > 0})
    # grid [1]: every document lands in the one path, so the cheap tf-idf embedder routes as well as MiniLM.
    router = {"embedder": "tfidf" if v.grid == (1,) else args.embedder, "prefix_tokens": 32,
              "sample_docs": args.router_docs, "balanced": True}
    if v.discriminative:
        router["discriminative_after"] = args.rounds // 2 - 1  # halfway: later rounds train on the new shards
    return config_from_dict({
        "run_root": run_root,
        "data": {"train": args.train_glob, "eval": eval_glob, "max_docs": args.train_docs or None},
        "router": router,
        "model": {"grid": list(v.grid), "blocks_per_level": blocks, "hidden_size": args.hidden * v.hidden_multiple,
                  "num_heads": args.heads * v.hidden_multiple, "seq_len": args.seq_len, "tokenizer": "bpe",
                  "vocab_size": args.vocab, "tokenizer_sample_docs": 4000, "init_seed": v.seed,
                  "path_specific_blocks": v.path_blocks},
        "train": {"rounds": args.rounds, "inner_steps": args.inner_steps * v.step_multiple,
                  "micro_batch_size": args.micro_batch, "lr": args.lr, "warmup_steps": args.warmup,
                  "min_lr_ratio": 1.0,  # constant after warmup, as the demo measured best far from convergence
                  "ds_config": "ds_configs/zero2.json", "precision": "auto", "workers_per_path": v.workers, "seed": v.seed,
                  "launcher": args.launcher, "parallel_paths": 1, "islands": 1, "threads_per_proc": 1},
        "outer": {**outer, "compression": v.compression},
        "eval": {"max_docs": None, "batch_size": 16, "early_stopping": v.early_stopping},
        "mlflow": {"enabled": False},  # run.py logs the benchmark itself to dipaco-bench
    }, source=f"<benchmark row {v.run_name}>")


# -- prepare: once per grid and router, one tokenizer for all ------------------------------------
def prepare_all(args: QualityArgs, rows: list[Variant], eval_glob: str) -> dict[str, dict]:
    """One prepare per grid; the first trains the BPE tokenizer, the others are given it, so every
    row cuts the held-out text into the same tokens."""
    preps: dict[str, dict] = {}
    tokenizer_root: str | None = None
    for v in sorted(rows, key=lambda r: r.grid != (1,)):  # grid [1] first: its prepare is the cheapest
        if v.prep_key in preps:
            continue
        prep_root = Path(args.out) / f"prep-{v.prep_key}"
        shutil.rmtree(prep_root, ignore_errors=True)  # another run's sizes would not match; and honest timings
        config = variant_config(args, dataclasses.replace(v, discriminative=False), str(prep_root), eval_glob)
        root = stages.init_run(config)
        if tokenizer_root:
            copy_committed(root, tokenizer_root, (layout.TOKENIZER_DIR,))
        start = time.perf_counter()
        manifest = stages.prepare(config)
        tokenizer_root = tokenizer_root or config.run_root
        preps[v.prep_key] = {"root": config.run_root, "seconds": time.perf_counter() - start, "manifest": manifest}
        log.info("prepare %s: %.0f s", v.prep_key, preps[v.prep_key]["seconds"])
    return preps


# -- one row -------------------------------------------------------------------------------------
def run_variant(args: QualityArgs, v: Variant, prep: dict, eval_glob: str) -> dict:
    """One row through `stages.run` on its own island; its evaluations, timings and merge bytes."""
    run_root = Path(args.out) / v.run_name
    shutil.rmtree(run_root, ignore_errors=True)  # timings are only honest from a clean start
    config = variant_config(args, v, str(run_root), eval_glob)
    root = stages.init_run(config)
    copy_committed(root, prep["root"], (layout.TOKENIZER_DIR, layout.ROUTER_DIR, layout.SHARDS_DIR))
    start = time.time()
    stages.run(config)
    seconds = time.time() - start
    evals = read_curve(root, config, v, start)
    result = {
        "name": v.name, "run": v.run_name, "seed": v.seed, "grid": list(v.grid), "workers": v.workers,
        "jobs": len(stages.list_paths(config)), "steps_per_path": config.train.rounds * config.train.inner_steps,
        "tokens_per_step": config.train.micro_batch_size * config.model.seq_len,
        "hidden": config.model.hidden_size, "non_embedding_params": non_embedding_params(config),
        "perplexity": evals[-1]["perplexity"], "bits_per_byte": evals[-1]["bits_per_byte"],
        "eval_tokens": evals[-1]["tokens"], "evals": evals, "seconds": seconds, "merge": merge_bytes(root, config),
    }
    if v.early_stopping:
        best = root.read_json("eval/best.json")
        result["early_stopped"] = {k: best[k] for k in ("perplexity", "bits_per_byte", "tokens")} | {
            "rounds": {p: e["round"] for p, e in best["paths"].items()}}
    if v.reroute_after:
        result["rerouted"] = rerouted_eval(config, root)
    if not args.keep_rounds:
        shutil.rmtree(run_root / "rounds", ignore_errors=True)  # ~50 MB a path and round; results are in eval/
    log.info("%s: %.2f ppl, %.3f bits/byte in %.0f s", v.run_name, result["perplexity"], result["bits_per_byte"], seconds)
    return result


def read_curve(root: RunRoot, config: Config, v: Variant, start: float) -> list[dict]:
    """Each round's evaluation with its steps per path and the seconds since the run started
    (when its eval file was written: the wall-clock axis of the curves)."""
    curve = []
    for r in range(config.train.rounds + 1):
        e = root.read_json(layout.eval_file(r))
        written = Path(root.local_path(layout.eval_file(r))).stat().st_mtime
        curve.append({"round": r, "steps_per_path": r * config.train.inner_steps, "perplexity": e["perplexity"],
                      "bits_per_byte": e["bits_per_byte"], "tokens": e["tokens"], "seconds": max(0.0, written - start)})
    return curve


def merge_bytes(root: RunRoot, config: Config) -> dict:
    """merge.json's bytes of the last round: what islands send and receive, and data-parallel's."""
    report = root.read_json(f"{layout.round_dir(config.train.rounds - 1)}/merge.json")
    return {k: report.get(k) for k in ("bytes_outer", "bytes_data_parallel", "bytes_outer_uncompressed")}


_EVAL_LOCK = threading.Lock()


def rerouted_eval(config: Config, root: RunRoot) -> dict:
    """The last round's modules scored with `eval.reroute_every: 64`; the route-once eval file is
    put back afterwards (evaluate_round writes the same name)."""
    last = config.train.rounds
    cfg = dataclasses.replace(config, eval=dataclasses.replace(config.eval, reroute_every=64, early_stopping=False))
    original = root.read_json(layout.eval_file(last))
    with _EVAL_LOCK:  # one evaluation at a time in this process, beside the islands
        result = evaluate_round(cfg, last)
    root.write_json(layout.eval_file(last), original)
    return {k: result[k] for k in ("perplexity", "bits_per_byte", "tokens")}


# -- all rows ------------------------------------------------------------------------------------
def run_quality(args: QualityArgs) -> dict:
    """Prepare once per grid, then every row, `lanes` at a time, longest first."""
    start = time.perf_counter()
    eval_glob = write_eval_docs(args)
    rows = variants(args)
    preps = prepare_all(args, rows, eval_glob)
    prepare_seconds = time.perf_counter() - start
    if args.launcher == "inprocess":
        args.lanes = 1  # one process cannot hold two in-process DeepSpeed ranks
    else:
        import torch

        torch.set_num_threads(1)  # this process's own evaluations (round 0, re-routing) beside two islands
    results: list[dict] = []
    partial = Path(args.out) / "quality.partial.json"

    def one(v: Variant) -> dict:
        result = run_variant(args, v, preps[v.prep_key], eval_glob)
        results.append(result)
        partial.write_text(json.dumps(results, indent=2))  # a run cut short still reports what it measured
        return result

    ordered = sorted(rows, key=lambda v: -v.cost(args))
    with ThreadPoolExecutor(max_workers=max(1, args.lanes)) as pool:
        for future in [pool.submit(one, v) for v in ordered]:
            future.result()
    order = {v.run_name: i for i, v in enumerate(rows)}
    results.sort(key=lambda r: order[r["run"]])
    tokens = {r["run"]: r["eval_tokens"] for r in results}
    return {"args": dataclasses.asdict(args), "runs": results, "rows": summarize_rows(results, args),
            "same_eval_tokens": len(set(tokens.values())) == 1, "eval_tokens": tokens,
            "seconds": time.perf_counter() - start, "prepare_seconds": prepare_seconds,
            "prepare": {k: {"seconds": p["seconds"], "routed": p["manifest"].get("routed"),
                            "docs_per_path": _docs_per_path(p["manifest"])} for k, p in preps.items()}}


def _docs_per_path(manifest: dict) -> dict:
    return {p: {split: entry.get("documents") for split, entry in splits.items()}
            for p, splits in (manifest.get("paths") or {}).items()}


def summarize_rows(runs: list[dict], args: QualityArgs) -> list[dict]:
    """One row per name: the mean over seeds and their spread, then the eval-only option rows."""
    rows: list[dict] = []
    for name in dict.fromkeys(r["name"] for r in runs):
        group = [r for r in runs if r["name"] == name]
        ppl = [r["perplexity"] for r in group]
        rows.append({"name": name, "seeds": len(group), "perplexity": float(np.mean(ppl)),
                     "bits_per_byte": float(np.mean([r["bits_per_byte"] for r in group])),
                     "spread": (max(ppl) - min(ppl)) / float(np.mean(ppl)) if len(group) > 1 else None,
                     "values": ppl, "steps_per_path": group[0]["steps_per_path"], "jobs": group[0]["jobs"],
                     "non_embedding_params": group[0]["non_embedding_params"], "eval_tokens": group[0]["eval_tokens"],
                     "seconds": float(np.mean([r["seconds"] for r in group])), "merge": group[0]["merge"]})
    base = next((r for r in runs if r["name"] == "dipaco_2x2" and r["seed"] == 0), None)
    if base and "rerouted" in base:
        rows.append(_derived("reroute64", base, base["rerouted"]))
    if base and "early_stopped" in base:
        rows.append(_derived("early_stop", base, base["early_stopped"]))
    dense = next((r for r in rows if r["name"] == "dense"), None)
    for row in rows:
        row["vs_dense"] = row["perplexity"] / dense["perplexity"] - 1 if dense else None
    return rows


def _derived(name: str, base: dict, scores: dict) -> dict:
    """An eval-only row of dipaco_2x2 seed 0 (no training of its own: 0 s)."""
    return {"name": name, "seeds": 1, "perplexity": scores["perplexity"], "bits_per_byte": scores["bits_per_byte"],
            "spread": None, "values": [scores["perplexity"]], "steps_per_path": base["steps_per_path"],
            "jobs": base["jobs"], "non_embedding_params": base["non_embedding_params"], "eval_tokens": scores["tokens"],
            "seconds": 0.0, "merge": base["merge"], "of": base["run"]}


# -- targets -------------------------------------------------------------------------------------
def targets(q: dict) -> list[dict]:
    """Issue 17's targets and issue 15's option goals on this run's rows: met or missed, and
    whether the gap is larger than the spread over seeds (else it cannot be told from noise)."""
    rows = {r["name"]: r for r in q["rows"]}
    runs = {r["run"]: r for r in q["runs"]}
    h, m = q["args"]["inner_steps"], q["args"]["workers"]
    noise = max([r["spread"] for r in rows.values() if r["spread"] is not None] or [0.0])
    out: list[dict] = []

    def check(what: str, a: str, b: str, bound: float, goal: str, pa: float | None = None, pb: float | None = None) -> None:
        if (a not in rows and pa is None) or (b not in rows and pb is None):
            return
        pa = rows[a]["perplexity"] if pa is None else pa
        pb = rows[b]["perplexity"] if pb is None else pb
        gap = pa / pb - 1
        out.append({"target": what, "goal": goal, "measured": f"{100 * gap:+.1f}% ({pa:.2f} vs {pb:.2f})",
                    "met": gap <= bound, "gap": gap, "beyond_noise": abs(gap) > noise, "a": a, "b": b})

    check("DiPaCo 2x2 vs dense of path size", "dipaco_2x2", "dense", -0.08, "<= -8% ppl")
    check(f"DiPaCo 2x2 vs DiLoCo M={m}", "dipaco_2x2", f"diloco_m{m}", 0.0, "<= 0%")
    check(f"DiLoCo M={m} vs dense trained {m}x the steps", f"diloco_m{m}", f"dense_x{m}", 0.05, "<= +5%")
    check("DiPaCo 4x4 vs 2x2", "dipaco_4x4", "dipaco_2x2", 0.0, "< 0%")
    check("flagship: DiPaCo 4x4 vs dense of 4x the non-embedding parameters", "dipaco_4x4", "dense_big", 0.02, "<= +2%")
    base = runs.get("dipaco_2x2_s0")
    if base:  # the options against plain DiPaCo 2x2 seed 0: same data, steps and seed
        p0 = base["perplexity"]
        check("re-routing every 64 tokens vs route once", "reroute64", "dipaco_2x2", -1e-12, "< 0%", pb=p0)
        check("discriminative router vs k-means alone", "discriminative", "dipaco_2x2", -1e-12, "< 0%", pb=p0)
        check("early stopping vs last round", "early_stop", "dipaco_2x2", 0.0, "(report)", pb=p0)
        check("path-specific blocks (1 of 4) vs shared", "pathblocks", "dipaco_2x2", 0.0, "(report)", pb=p0)
        check("int8 outer gradients vs uncompressed", "int8", "dipaco_2x2", 0.01, "<= +1%", pb=p0)
        check("int4 outer gradients vs uncompressed", "int4", "dipaco_2x2", 0.02, "<= +2%", pb=p0)
        for kind, share in (("int8", 4), ("int4", 8)):
            merge = rows.get(kind, {}).get("merge") or {}
            if merge.get("bytes_outer") and merge.get("bytes_data_parallel"):
                ratio = merge["bytes_outer"] / merge["bytes_data_parallel"]
                out.append({"target": f"{kind} bytes per round / data-parallel (merge.json)",
                            "goal": f"<= 1/({share}H) = {1 / (share * h):.5f}", "measured": f"{ratio:.5f}",
                            "met": ratio <= 1 / (share * h), "gap": None, "beyond_noise": None})
    for t in out:
        if t["goal"] == "(report)":
            t["met"] = None
    return out


def why_missed(q: dict, t: dict) -> str:
    """From the curves: is the gap closing (and at how many steps per path would the two lines
    cross, extrapolating bits per byte linearly in log steps over the last two rounds), or not."""
    curves = {}
    for key in (t.get("a"), t.get("b")):
        run = next((r for r in q["runs"] if r["name"] == key and r["seed"] == 0), None)
        if run is None or len(run["evals"]) < 3:
            return ""
        curves[key] = run["evals"]
    ea, eb = curves.values()
    if len(ea) != len(eb):
        return ""
    # Rounds align the rows (dense_x4's round r is DiLoCo's round r at the same compute); the steps are a's.
    steps = np.log([ea[-2]["steps_per_path"], ea[-1]["steps_per_path"]])
    gap0 = ea[-2]["bits_per_byte"] - eb[-2]["bits_per_byte"]
    gap1 = ea[-1]["bits_per_byte"] - eb[-1]["bits_per_byte"]
    slope = (gap1 - gap0) / (steps[1] - steps[0])
    if gap1 <= 0 or slope >= 0:
        return (f"gap in bits/byte {gap0:+.3f} -> {gap1:+.3f} over the last round: not closing at this scale, "
                f"so more steps alone are unlikely to meet it")
    cross = math.exp(steps[1] + gap1 / -slope)
    return (f"gap in bits/byte {gap0:+.3f} -> {gap1:+.3f} over the last round: closing; a straight line in "
            f"log steps crosses at ~{cross:,.0f} steps per path")


# -- plots ---------------------------------------------------------------------------------------
def plot_quality(q: dict, out: Path) -> list[Path]:
    """Bits per byte against steps per path and against wall-clock seconds (seed 0 of each row),
    and the final perplexity of every row."""
    from pipeline.tracking import plots  # Agg backend set there
    from matplotlib import pyplot as plt

    fig, (ax_steps, ax_wall) = plt.subplots(1, 2, figsize=(13, 5))
    for r in q["runs"]:
        if r["seed"] != 0:
            continue
        bpb = [e["bits_per_byte"] for e in r["evals"]]
        style = {"marker": "o", "markersize": 3, "label": r["name"], "linewidth": 1.2}
        ax_steps.plot([e["steps_per_path"] for e in r["evals"]], bpb, **style)
        ax_wall.plot([e["seconds"] for e in r["evals"]], bpb, **style)
    for ax, xlabel in ((ax_steps, "inner steps per path"), (ax_wall, "wall-clock seconds (one core per row)")):
        ax.set(xlabel=xlabel, ylabel="held-out bits per byte (routed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_steps.set_title("Learning curves against steps")
    ax_wall.set_title("Learning curves against wall-clock time")
    fig.tight_layout()
    curves = out / "quality_curves.png"
    fig.savefig(curves, dpi=110)
    plots.close(fig)

    fig, ax = plt.subplots(figsize=(11, 4))
    rows = q["rows"]
    bars = ax.bar([r["name"] for r in rows], [r["perplexity"] for r in rows], color="tab:blue")
    for bar, r in zip(bars, rows):
        note = f"{r['perplexity']:.1f}" + (f"\n{100 * r['vs_dense']:+.1f}%" if r.get("vs_dense") is not None else "")
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set(ylabel="routed perplexity", title="Final held-out perplexity (same scored tokens in every row)")
    ax.set_ylim(0, max(r["perplexity"] for r in rows) * 1.25)
    plt.setp(ax.get_xticklabels(), rotation=20, fontsize=8)
    fig.tight_layout()
    bars_png = out / "quality_ppl.png"
    fig.savefig(bars_png, dpi=110)
    plots.close(fig)
    return [curves, bars_png]


# -- command line --------------------------------------------------------------------------------
def plan_lines(args: QualityArgs) -> list[str]:
    """The rows, their estimated core-seconds and the estimated wall-clock time (`--plan`)."""
    rows = variants(args)
    lines = [f"{v.run_name:>20}: {v.cost(args):6.0f} core-s" for v in rows]
    lanes = [0.0] * max(1, args.lanes)
    for v in sorted(rows, key=lambda r: -r.cost(args)):  # the same greedy order run_quality uses
        lanes[lanes.index(min(lanes))] += v.cost(args)
    prepares = 30 + 95 * len({v.prep_key for v in rows if v.grid != (1,)})
    return [*lines, f"lanes: {', '.join(f'{s:.0f}' for s in lanes)} s; prepares ~{prepares} s; "
                    f"total ~{(max(lanes) + prepares) / 60:.0f} min"]


def parse_args(argv: list[str] | None = None) -> QualityArgs:
    defaults = QualityArgs()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, every row: a smoke check in a few minutes")
    parser.add_argument("--plan", action="store_true", help="print the rows and the estimated time, run nothing")
    for name, value in vars(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=None)
    raw = vars(parser.parse_args(argv))
    quick, plan = raw.pop("quick"), raw.pop("plan")
    values = {**vars(defaults), **(QUICK if quick else {}), **{k: v for k, v in raw.items() if v is not None}}
    args = QualityArgs(**values)
    if plan:
        print("\n".join(plan_lines(args)))
        raise SystemExit(0)
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    result = run_quality(args)
    out = Path(args.out)
    (out / "quality.json").write_text(json.dumps(result, indent=2))
    plot_quality(result, out)
    for r in result["rows"]:
        log.info("%-14s ppl %8.2f  %+6.1f%%", r["name"], r["perplexity"], 100 * (r["vs_dense"] or 0))


if __name__ == "__main__":
    main()

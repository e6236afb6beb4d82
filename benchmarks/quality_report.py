"""The quality half of benchmarks/RESULTS.md: the claims table per corpus, the targets, the options.

Pure markdown from `benchmarks.quality`'s result (benchmarks/claims.py does the arithmetic), so
`python -m benchmarks.run --render-only` re-renders a stored run without training anything.
Every interval says what it is: over seeds (the row's spread between initialisations and data
orders) or over documents (the evaluation noise: what the choice of held-out text alone moves).
"""

from __future__ import annotations

import math

from benchmarks import claims
from benchmarks.results import table_head
from benchmarks.stats import Estimate

SOURCES = {
    "wiki": "the Wikipedia sample, `data/sample`",
    "mixed": "four sources (Wikipedia, stdlib code, stdlib docstrings, licences), `data/mixed`",
}


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.2f} MB"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.4f} (1/{1 / value:,.0f})" if value < 1 else f"{value:.2f}"


def _count(value: float) -> str:
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.1f}k" if value >= 1e3 else f"{value:.0f}"


def _noise(value: float | None, digits: int = 4) -> str:
    return "-" if value is None or math.isnan(value) else f"± {value:.{digits}f}"


def _estimate(e: Estimate, digits: int = 4) -> str:
    return e.text(digits)


def rows_table(rows: list[dict]) -> list[str]:
    """One line per row of one corpus: bits per byte over seeds, evaluation noise, tokens and bytes."""
    lines = table_head(
        "| row | run | seeds | tokens (x dense) | steps per worker | bits/byte, mean ± 95 % over seeds "
        "| evaluation noise (± 95 %, documents) | perplexity | bytes per round | bytes / sync's | s (one core) |"
    )
    for r in rows:
        if not r["seeds"]:
            lines.append(f"| {r['name']} | {r['what']} | 0 | | | **failed**: {'; '.join(r['failed'])} | | | | | |")
            continue
        failed = f" ({len(r['failed'])} failed)" if r["failed"] else ""
        bytes_round = "0 (one worker)" if r["communication"] == "none" else _mb(r["bytes_per_round"])
        lines.append(
            f"| {r['name']} | {r['what']} | {r['seeds']}{failed} | {r['token_multiple']:g} ({_count(r['tokens'])}) "
            f"| {r['steps_per_worker']} | {_estimate(r['bits_per_byte'])} | {_noise(r['eval_noise'])} "
            f"| {_estimate(r['perplexity'], 1)} | {bytes_round} | {_ratio(r['ratio_to_sync'])} | {r['seconds']:.0f} |"
        )
    return lines


def targets_table(targets: list[dict]) -> list[str]:
    """Each target's two rows, the difference's interval over seeds, the documents' noise of it, the verdict."""
    lines = table_head(
        "| corpus | target | a | b | a − factor × b, ± 95 % over seeds | evaluation noise of it (± 95 %, documents) "
        "| verdict |"
    )
    for t in targets:
        verdict = t["verdict"] if t["verdict"].startswith("met") else f"**{t['verdict']}**"
        digits = 2 if t["metric"] == "perplexity" else 4
        lines.append(
            f"| {t['corpus']} | {t['target']} | {t['a_estimate']} | {t['b_estimate']} | {t['difference']} "
            f"| {_noise(t['eval_noise'], digits)} | {verdict} |"
        )
    notes = [f"- {t['corpus']}, {t['target']}: {t['trend']}." for t in targets if t["trend"]]
    return [*lines, "", *notes] if notes else lines


def options_lines(q: dict) -> list[str]:
    """The option rows (one seed each) and their goals against `dipaco_2x2` seed 0."""
    runs = [r for r in q["runs"] if r.get("suite") == "options"]
    if not runs:
        return []
    lines = [
        "### Options (one seed each, against `dipaco_2x2` seed 0 of the same corpus)",
        "",
        *table_head("| row | run | steps per worker | perplexity | bits/byte | s (one core) |"),
    ]
    for r in runs:
        if r.get("failed"):
            lines.append(f"| {r['name']} | {r['what']} | | **failed**: {r['failed']} | | |")
        else:
            lines.append(
                f"| {r['name']} | {r['what']} | {r['steps_per_path']} | {r['perplexity']:.2f} "
                f"| {r['bits_per_byte']:.4f} | {r['seconds']:.0f} |"
            )
    goals = claims.option_targets(q["runs"], q["args"]["inner_steps"], corpus=runs[0]["corpus"])
    if goals:
        lines += [
            "",
            *table_head("| goal | measured | verdict |"),
            *[f"| {g['target']} | {g['measured']} | {g['verdict']} |" for g in goals],
        ]
    return [*lines, ""]


def quality_lines(q: dict, carried: str, title: str = "Quality: the claims against their baselines") -> list[str]:
    """The quality section: settings, one table per corpus, the targets, the options."""
    if q.get("format") != 2:
        return [f"## {title}", "", "(a result of the earlier format: rerun `make bench` for the claims table)", ""]
    a = q["args"]
    runs = q["runs"]
    rows = claims.summarize(runs)
    same = ", ".join(f"{c}: {'yes' if ok else '**no**'}" for c, ok in q["same_eval_tokens"].items())
    lines = [
        f"## {title}{carried}",
        "",
        f"Path: hidden {a['hidden']}, {a['blocks']} blocks, BPE {a['vocab']:,} ids (one tokenizer per corpus), "
        f"seq_len {a['seq_len']} x micro batch {a['micro_batch']} ({a['seq_len'] * a['micro_batch']:,} tokens a step); "
        f"{a['rounds']} rounds x H={a['inner_steps']} = {a['rounds'] * a['inner_steps']} steps per worker; inner lr "
        f"{a['lr']} (constant after {a['warmup']} warmup steps); DiLoCo and DiPaCo rows: outer Nesterov, lr "
        f"{a['outer_lr']}, momentum {a['outer_momentum']}; dense and sync: no outer step. Seeds 0..{a['seeds'] - 1}, "
        f"paired (seed s: the same initialisation and data order in every row). Every row one `{a['launcher']}` "
        f"island of one core, {a['lanes']} at a time; {q['seconds']:.0f} s in all, of which prepares "
        f"{q['prepare_seconds']:.0f} s. Same scored tokens in every row of a corpus: {same}.",
        "",
        "Tokens: `sync_mM` processes M x dense's tokens (M micro batches a step), as DiLoCo with M workers and "
        "DiPaCo with M paths do; `dense` and `diloco_m1` process dense's. Bytes per round: merge.json's "
        "`bytes_outer` for the rows with an outer step; for sync, the data-parallel all-reduce its M ranks would "
        "do (`bytes_data_parallel` x M: twice the fp32 gradient a rank and step, x H); the last column divides by "
        "that of sync at the same tokens. Evaluation noise: the 95 % half-width from the held-out documents of "
        "each run (its last round's modules re-scored document by document), beside the interval over seeds.",
        "",
    ]
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        shown = [
            r
            for r in rows
            if r["corpus"] == corpus
            and any(x["suite"] == "claims" for x in runs if x["corpus"] == corpus and x["name"] == r["name"])
        ]
        if shown:
            lines += [f"### {corpus}: {SOURCES.get(corpus, corpus)}", "", *rows_table(shown), ""]
    targets = claims.evaluate_targets(runs)
    if targets:
        lines += [
            "### Targets (issue 27)",
            "",
            "met: the whole 95 % interval of the difference (over seeds, paired) is within the goal; missed: the "
            "whole interval is outside; unresolved: it straddles the bound, and more seeds would be needed. The "
            "pool's goal is two-sided (within 1 % either way).",
            "",
            *targets_table(targets),
            "",
        ]
    gaps = claims.warm_start_gaps(runs)
    if gaps:
        lines += [
            "### Warm start (issue 44)",
            "",
            "DiLoCo's gap to synchronous training (`diloco_m4` − `sync_m4`, bits per byte, paired by seed), from "
            "scratch and warm-started (`warm_diloco_m4` − `warm_sync_m4`: a dense quarter of the rounds first), "
            "at equal tokens; `closed` is the first minus the second.",
            "",
            "| corpus | seeds | gap from scratch | gap warm-started | closed | share closed |",
            "|---|---|---|---|---|---|",
            *(
                f"| {g['corpus']} | {g['seeds']} | {g['scratch_gap']} | {g['warm_gap']} | {g['closed']} | "
                + (f"{g['closed_share']:.0%}" if g["closed_share"] is not None else "-")
                + " |"
                for g in gaps
            ),
            "",
        ]
    lines += options_lines(q)
    lines += [
        "Curves (bits per byte, mean over seeds, against steps per worker and against bytes communicated): "
        "`quality_curves.png`; final bits per byte with intervals: `quality_rows.png`.",
        "",
    ]
    return lines

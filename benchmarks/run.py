"""`make bench`: performance, then quality, in one run; one markdown table, PNG plots, MLflow.

`python -m benchmarks.run [quality flags] [--skip-perf] [--skip-quality] [--quick | --long] [--plan]`
writes `benchmarks/out/results.md` (+ `results.json`, `*.png`), logs everything to the MLflow
experiment `dipaco-bench` at `sqlite:///benchmarks/out/mlflow.db`, and puts the table into
`benchmarks/RESULTS.md` between its `bench` markers (`--long`, i.e. `make bench-long`: the claims
suite at full length, quality only, between its `bench-long` markers; the committed copy, the one
place benchmark results live; the notes written by hand around the markers stay). `--plan` prints
the estimated time and runs nothing. Every performance figure is a ratio of two measurements taken
in this one run on this machine, printed with its core count, because absolute numbers on a shared
2-core box mean little and ratios measured side by side do; every quality figure a mean over seeds
with its interval (benchmarks/quality_report.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from benchmarks import claims, perf, quality
from benchmarks.quality_report import quality_lines
from benchmarks.results import commit_block, table_head

log = logging.getLogger("dipaco.bench")
OUT = Path("benchmarks/out")
TARGETS = {"trainer": 0.95, "prepare": 0.85, "merge": 1.5}
# perf measured 8 minutes on 2 cores (2026-11-25, benchmarks/RESULTS.md) before its trainer rows took three
# launches (+2 launch starts and +2 blocks per mode each: ~1.5 minutes a row, estimated); chaos 9 minutes.
PERF_MINUTES, CHAOS_MINUTES = 10, 9  # the rest of `make bench`
SHARED_FLAGS = (
    "--hidden",
    "--seq-len",
    "--micro-batch",
    "--inner-steps",
)  # perf's diagnostic and quality both take them
LONG_TITLE = "**The latest `make bench-long`**"  # under RESULTS.md's own heading for it


def machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
        f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end of the run"
    )


def ok(value: float, target: float, higher_is_better: bool = True) -> str:
    return "meets" if (value >= target if higher_is_better else value <= target) else "**misses**"


def launches_verdict(ratios: list[float], target: float) -> str:
    """A ratio measured over several launches meets its target only if every launch did, misses it
    only if none did; otherwise the launches' spread straddles it and no verdict is honest."""
    if min(ratios) >= target:
        return "meets"
    if max(ratios) < target:
        return "**misses**"
    return f"unresolved (launches {min(ratios):.3f}-{max(ratios):.3f})"


def trainer_run_label(key: str, args: dict) -> tuple[str, int]:
    """("default path (hidden 256, 4 blocks)", tokens per optimizer step) of one trainer measurement."""
    tokens = args.get("accum", 1) * args["micro_batch"] * args["seq_len"]
    which = "small-step" if key == "trainer_small_step" else "default"
    return f"{which} path (hidden {args['hidden']}, {args['blocks']} blocks, {args.get('precision', 'fp32')})", tokens


def zero_cost_table(p: dict) -> list[str]:
    """ZeRO's cost per optimizer step, and the step size at which it falls under 5%.

    The trainer ratio depends on how many tokens a step carries, because DeepSpeed's extra work is
    per optimizer step and proportional to the parameters. From paired blocks: extra seconds per
    step d, plain seconds per step t at T tokens; the ratio r = t / (t + d) reaches 0.95 once a step
    carries 19 * d / t * T tokens (more micro batches or gradient accumulation), with d / t taken
    from the measured ratio (1/r - 1) so the estimate agrees with the figure."""
    rows = [
        "ZeRO's fixed cost per optimizer step (medians of paired blocks; the last column estimates, from the "
        "measured ratio, the step size from which it reaches 0.95, the plain step growing with its tokens):",
        "",
        *table_head(
            "| path | tokens/step | plain s/step | mode | extra ms/step | share of a plain step "
            "| tokens/step for 0.95 (estimate) |"
        ),
    ]
    for key in ("trainer", "trainer_bf16", "trainer_small_step"):
        run = p.get(key)
        if not run or "extra_seconds_per_step" not in run:
            continue
        plain = run["plain_seconds_per_step"]
        name, tokens = trainer_run_label(key, run["args"])
        for mode in ("zero1", "zero2", "zero3"):
            extra = run["extra_seconds_per_step"].get(mode)
            if extra is None:
                continue
            # From the measured ratio r = t / (t + d): d / t = 1/r - 1, so r reaches 0.95 at 19 (1/r - 1) T tokens.
            needed = 19 * (1 / run["ratio_to_plain"][mode] - 1) * tokens
            rows.append(
                f"| {name} | {tokens:,} | {plain:.3f} | ZeRO-{mode[4]} "
                f"| {1000 * extra:+.0f} | {extra / plain:.1%} | {needed:,.0f} |"
            )
    return [*rows, ""] if len(rows) > 4 else []


def perf_table(p: dict) -> list[str]:
    rows = table_head("| figure | measured | reference | ratio | target | |")
    t = p["trainer"]
    for key, target in (("trainer", "target"), ("trainer_bf16", "target"), ("trainer_small_step", "diagnostic")):
        if not p.get(key):
            continue
        run = p[key]
        name, tokens = trainer_run_label(key, run["args"])
        what = f"{name}, {tokens:,} tokens/step"
        for mode in ("zero1", "zero2", "zero3", "zero2_bare"):
            if mode not in run["ratio_to_plain"]:
                continue
            ratio = run["ratio_to_plain"][mode]
            label = (
                "ZeRO-2 engine without the trainer's loop" if mode == "zero2_bare" else f"path trainer, ZeRO-{mode[4]}"
            )
            extra_ms = 1000 * run["extra_seconds_per_step"][mode]
            by_launch = run.get("ratio_by_launch", {}).get(mode, [ratio])
            verdict = (
                f">= 0.95 | {launches_verdict(by_launch, 0.95)}"
                if target == "target"
                else f"(diagnostic: {extra_ms:+.0f} ms/step) |"
            )
            rows.append(
                f"| {label}, {what} tokens/s | {run['tokens_per_s'][mode]:.0f} "
                f"| plain PyTorch {run['tokens_per_s']['plain']:.0f} | {ratio:.3f} | {verdict} |"
            )
    if p.get("trainer_bf16_skipped"):
        rows.append(f"| path trainer, bf16 | not measured: {p['trainer_bf16_skipped']} | | | >= 0.95 | |")
    for mode in ("plain", "zero2"):
        rows.append(
            f"| MFU, {mode} | {t['tokens_per_s'][mode] * t['model_flops_per_token'] / 1e9:.2f} GFLOP/s "
            f"| fp32 matmul {t['matmul_flops'] / 1e9:.1f} GFLOP/s | {t['mfu'][mode]:.3f} | (report) | |"
        )
    if p.get("prepare"):
        pr = p["prepare"]
        sample = pr.get("sample_docs")
        fitted = f"router fitted on {sample} docs" if sample else "router fitted on a tenth"
        rows.append(
            f"| prepare, whole Beam job ({pr['n_docs']:,} docs, {fitted}, {' '.join(pr['options'])}) docs/s "
            f"| {pr['beam_full_docs_per_s']:.1f} | raw MiniLM {pr['raw_embedder_docs_per_s']:.1f} "
            f"| {pr['full_ratio']:.3f} | >= 0.85 | {ok(pr['full_ratio'], 0.85)} |"
        )
        rows.append(
            f"| prepare, routing only (router committed) docs/s | {pr['beam_route_docs_per_s']:.1f} "
            f"| raw MiniLM {pr['raw_embedder_docs_per_s']:.1f} | {pr['route_ratio']:.3f} | >= 0.85 "
            f"| {ok(pr['route_ratio'], 0.85)} |"
        )
        for name, other in pr.get("other_options", {}).items():
            rows.append(
                f"| prepare, routing only, {' '.join(other['options'])} docs/s | {other['route_docs_per_s']:.1f} "
                f"| raw MiniLM {pr['raw_embedder_docs_per_s']:.1f} | {other['route_ratio']:.3f} | (diagnostic) | |"
            )
    else:
        rows.append("| prepare | not measured: benchmarks/bench_prepare.py absent | | | >= 0.85 | |")
    m = p["merge"]
    med = sorted(m["merge_seconds"])[len(m["merge_seconds"]) // 2]
    io = sorted(m["plain_io_seconds"])[len(m["plain_io_seconds"]) // 2]
    rows.append(
        f"| merge, {m['paths']} paths [4, 4] ({(m['bytes_read'] + m['bytes_written']) / 1e6:.0f} MB) s | {med:.2f} "
        f"| plain read+write {io:.2f} | {m['ratio']:.2f} | <= 1.5 | {ok(m['ratio'], 1.5, False)} |"
    )
    if "ratio_vs_verified_io" in m:
        verified = m.get("plain_io_fsync_crc32_seconds") or m["plain_io_fsync_sha256_seconds"]
        rows.append(
            f"| merge vs read+write+fsync+checksum of every byte (same integrity guarantee) | {med:.2f} "
            f"| {sorted(verified)[len(verified) // 2]:.2f} "
            f"| {m['ratio_vs_verified_io']:.2f} | (diagnostic) | |"
        )
    b = p["bytes"]
    rows.append(
        f"| bytes per round, outer vs data-parallel (H={b['inner_steps']}) | {b['bytes_outer'] / 1e6:.0f} MB "
        f"| ring all-reduce every step {b['bytes_data_parallel_ring'] / 1e6:.0f} MB | {b['ratio_ring']:.4f} "
        f"| <= {b['target']:.4f} | {ok(b['ratio_ring'], b['target'] + 1e-12, False)} |"
    )
    return rows


def render(result: dict, command: str, title: str = "# dipaco benchmarks") -> str:
    lines = [
        title,
        "",
        f"- date: {result['date']}",
        f"- machine: {result['machine']}",
        f"- command: `{command}`",
        f"- total wall-clock: {result['seconds']:.0f} s",
        "",
    ]
    if "perf" in result:
        when = result["perf"].get("carried_over_from")
        title = f"carried over from the run of {when}" if when else "ratios measured side by side in this run"
        lines += [f"## Performance ({title})", "", *perf_table(result["perf"]), ""]
        lines += zero_cost_table(result["perf"])
        prof = result["perf"]["merge"]["profile"]
        lines += [
            "Merge profile (cProfile of the merging threads: merge_round's and each module's merge_module; "
            "cumulative seconds; the reads on the I/O threads overlap them and are not in it):",
            "",
            *table_head("| function | s |"),
            *[f"| `{r['function']}` | {r['seconds']} |" for r in prof],
            "",
        ]
    if "quality" in result:
        when = result["quality"].get("carried_over_from")
        lines += quality_lines(result["quality"], f" (carried over from the run of {when})" if when else "")
    return "\n".join(lines)


def plot_perf(p: dict, out: Path) -> Path:
    from matplotlib import pyplot as plt

    from pipeline.tracking import plots

    names, values, targets = [], [], []
    for mode in ("zero1", "zero2", "zero3"):  # the figures with a target; the toy step is a diagnostic
        names.append(f"ZeRO-{mode[4]} / plain")
        values.append(p["trainer"]["ratio_to_plain"][mode])
        targets.append(0.95)
    if p.get("prepare"):
        names.append("Beam job / raw embedder")
        values.append(p["prepare"]["full_ratio"])
        targets.append(0.85)
    names.append("plain I/O / merge")
    values.append(1 / p["merge"]["ratio"])
    targets.append(1 / 1.5)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(names, values, color=["tab:green" if v >= t else "tab:red" for v, t in zip(values, targets)])
    ax.scatter(names, targets, marker="_", s=600, color="black", label="target", zorder=3)
    ax.set(ylabel="ratio (higher is better)", title=f"dipaco overhead vs the frameworks ({os.cpu_count()} cores)")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=15, fontsize=8)
    fig.tight_layout()
    path = out / "perf_ratios.png"
    fig.savefig(path, dpi=110)
    plots.close(fig)
    return path


def log_mlflow(result: dict, files: list[Path]) -> None:
    """One run in the `dipaco-bench` experiment: every ratio and perplexity as a metric."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{OUT.resolve()}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("dipaco-bench")
    experiment_id = (
        experiment.experiment_id
        if experiment
        else client.create_experiment("dipaco-bench", artifact_location=(OUT.resolve() / "mlartifacts").as_uri())
    )
    run = client.create_run(experiment_id, run_name=f"bench-{result['date']}")
    rid = run.info.run_id
    client.log_param(rid, "cpu_count", os.cpu_count())
    client.log_param(rid, "command", result["command"][:500])
    metrics: dict[str, float] = {}
    if "perf" in result:
        p = result["perf"]
        metrics.update({f"trainer_ratio_{m}": v for m, v in p["trainer"]["ratio_to_plain"].items()})
        metrics.update({f"trainer_mfu_{m}": v for m, v in p["trainer"]["mfu"].items()})
        if p.get("trainer_bf16"):
            metrics.update({f"trainer_bf16_ratio_{m}": v for m, v in p["trainer_bf16"]["ratio_to_plain"].items()})
        if p.get("trainer_small_step"):
            metrics.update(
                {f"trainer_small_step_ratio_{m}": v for m, v in p["trainer_small_step"]["ratio_to_plain"].items()}
            )
        metrics["merge_ratio"] = p["merge"]["ratio"]
        metrics["bytes_ratio"] = p["bytes"]["ratio_ring"]
        if p.get("prepare"):
            metrics["prepare_full_ratio"] = p["prepare"]["full_ratio"]
            metrics["prepare_route_ratio"] = p["prepare"]["route_ratio"]
    q = result.get("quality", {})
    fresh = q.get("format") == 2 and not q.get("carried_over_from")
    for r in claims.summarize(q["runs"]) if fresh else []:
        if r["seeds"]:
            key = f"{r['corpus']}_{r['name']}"
            metrics[f"bpb_{key}"] = r["bits_per_byte"].mean
            metrics[f"ppl_{key}"] = r["perplexity"].mean
            metrics[f"seconds_{key}"] = r["seconds"]
    for run in q["runs"] if fresh else []:
        for e in run.get("evals", []):
            client.log_metric(rid, f"bpb_curve_{run['run']}", e["bits_per_byte"], step=e["steps_per_path"])
    for t in claims.evaluate_targets(q["runs"]) if fresh else []:
        name = "".join(c if c.isalnum() else "_" for c in f"{t['corpus']}_{t['a']}_vs_{t['b']}")[:200]
        metrics[f"target_{name}"] = {"met": 1.0, "missed": 0.0}.get(t["verdict"].split(" ")[0], 0.5)
    for key, value in metrics.items():
        client.log_metric(rid, key, float(value))
    for file in files:
        client.log_artifact(rid, str(file))
    client.set_terminated(rid)


def publish(
    result: dict, command: str, out: Path = OUT, commit: bool = True, track: bool = True, block: str = "bench"
) -> str:
    """Table, plots, the committed copy (`make bench`'s between the `bench` markers, `make
    bench-long`'s between `bench-long`) and the MLflow run."""
    files: list[Path] = []
    if "quality" in result:
        files += quality.plot_quality(result["quality"], out)
    if "perf" in result:
        files.append(plot_perf(result["perf"], out))
    text = render(result, command, LONG_TITLE if block == "bench-long" else "# dipaco benchmarks")
    (out / "results.md").write_text(text)
    if commit:
        commit_block(block, text)
    if not track:  # a re-render: the run is in MLflow already
        return text
    try:
        log_mlflow(result, [out / "results.md", out / "results.json", *files])
    except Exception:  # the table on disk matters more than the tracking copy
        log.exception("MLflow logging failed; results are in %s", OUT)
    return text


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--skip-perf", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke check: every quality row at tiny sizes in a few "
        "minutes, perf skipped, written to benchmarks/out/quick/",
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help="make bench-long: the claims suite at full length "
        "(quality only), written to benchmarks/out/long/ and "
        "RESULTS.md's bench-long block",
    )
    parser.add_argument("--plan", action="store_true", help="print the estimated time of this command and run nothing")
    parser.add_argument("--render-only", action="store_true", help="re-render benchmarks/out/results.json")
    parser.add_argument(
        "--tag",
        default="",
        help="write to benchmarks/out/TAG/ and leave RESULTS.md alone "
        "(scaled-up or experimental runs beside the default one)",
    )
    perf.add_arguments(parser)
    args, rest = parser.parse_known_args(argv)
    argv = argv or []
    for flag in SHARED_FLAGS:  # given explicitly: the quality rows take them too
        rest += [a for i, a in enumerate(argv) if a.startswith(flag + "=")]
        rest += [x for i, a in enumerate(argv) if a == flag and i + 1 < len(argv) for x in (a, argv[i + 1])]
    return args, rest  # the rest are quality flags (python -m benchmarks.quality --help)


def plan_text(args: argparse.Namespace, quality_argv: list[str]) -> str:
    """The estimate of this command: the quality rows' plan and, for `make bench`, perf and chaos."""
    qargs = quality.parse_args([a for a in quality_argv if a != "--plan"])
    lines = quality.plan_lines(qargs)
    minutes = quality.plan(qargs)["seconds"] / 60 if not args.skip_quality else 0
    perf_minutes = 0 if args.skip_perf else PERF_MINUTES
    what = "make bench-long" if args.long else "this command" if args.quick or args.tag else "make bench"
    chaos = CHAOS_MINUTES if what == "make bench" else 0
    lines.append(
        f"{what}: perf ~{perf_minutes} min + quality ~{minutes:.0f} min"
        + (f" + chaos ~{chaos} min" if chaos else "")
        + f" = ~{perf_minutes + minutes + chaos:.0f} min"
        + (" (budget 60)" if what == "make bench" else "")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("apache_beam", "preprocessing.transforms", "sentence_transformers", "DeepSpeed", "deepspeed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else argv
    args, quality_argv = parse_args(argv)
    args.inner_steps = args.inner_steps or quality.QualityArgs().inner_steps  # the perf bytes figure's H
    if args.quick:
        args.tag, args.skip_perf = args.tag or "quick", True
        quality_argv = ["--quick", *quality_argv]
    if args.long:
        args.skip_perf = True
        quality_argv = ["--long", *quality_argv]
    if args.plan:
        print(plan_text(args, quality_argv))
        return
    out = OUT / args.tag if args.tag else OUT / "long" if args.long else OUT
    block = "bench-long" if args.long else "bench"
    if (args.tag or args.long) and not any(a.startswith("--out") for a in quality_argv):
        quality_argv += ["--out", str(out / "quality")]
    if args.render_only:
        result = json.loads((out / "results.json").read_text())
        print(publish(result, result["command"], out, commit=not args.tag, track=False, block=block))
        return
    command = (
        "make bench"
        if not argv
        else "make bench-long"
        if argv == ["--long"]
        else "python -m benchmarks.run " + shlex.join(argv)
    )
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result: dict = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "command": command}
    previous = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    for half, skipped in (("perf", args.skip_perf), ("quality", args.skip_quality)):
        if skipped and half in previous:  # refresh one half; the other stays from its own run
            result[half] = {
                **previous[half],
                "carried_over_from": previous[half].get("carried_over_from") or previous.get("date"),
            }
    if not args.skip_perf:
        result["perf"] = perf.run_perf(args)
        (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    if not args.skip_quality:
        result["quality"] = quality.run_quality(quality.parse_args(quality_argv))
    result["seconds"] = time.perf_counter() - start
    result["machine"] = machine()
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    text = publish(result, command, out, commit=not args.tag, block=block)
    print(text)  # the final table to stdout


if __name__ == "__main__":
    main()

"""Quality: does dipaco reproduce the shape of the DiPaCo / DiLoCo papers' results?

`python -m benchmarks.quality [--rounds R --inner-steps H ...]` (also run by `make bench`).
Every variant runs through the real pipeline functions (`pipeline.stages`: init_run -> prepare ->
for each round: train_path for every job, merge, evaluate), with the same tokenizer, the same
held-out documents and the same scoring (tokens after `router.prefix_tokens`). At the same inner
steps per path and the same tokens per step:

- `dense`: grid [1], one worker, outer lr 1 / momentum 0 (the merge is then the identity, so this
  is plain continued training with its inner optimizer state kept across rounds);
- `diloco_m{M}`: grid [1] with M DiLoCo workers on iid parts of the data, Nesterov outer step;
- `dipaco_{a}x{b}`: the grid with MiniLM product-k-means routing, Nesterov outer step;
- `dense_x{M}`: grid [1] trained for M times the inner steps (the compute-matched reference).

The validation split is routed per path by the same router; for grid [1] every held-out document
lands in the one path, so every variant scores the same tokens (checked and reported). Variants
with the same grid share one prepare output (router + shards), copied into their run roots.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.state import layout
from pipeline import stages
from pipeline.core.config import Config, config_from_dict
from pipeline.state.storage import RunRoot

log = logging.getLogger("dipaco.bench.quality")
OUT = Path("benchmarks/out")


@dataclass
class QualityArgs:
    """Sizes of the quality benchmark; defaults fit `make bench` in ~20 min on 2 cores shared with
    other work (steps there took 1-3 s); scale every one of them up with the flags."""

    rounds: int = 3
    inner_steps: int = 10  # H per round; the paper uses 150 (DiPaCo) and 500 (DiLoCo)
    workers: int = 4  # M: DiLoCo workers and the compute multiple of the big dense baseline
    grids: list[list[int]] = field(default_factory=lambda: [[2, 2], [4, 4]])  # [4, 4]: 16 of the 29 jobs a round
    hidden: int = 64
    heads: int = 4
    blocks: int = 2  # blocks per path, split evenly over the levels of a 2-level grid
    seq_len: int = 128
    micro_batch: int = 4
    lr: float = 2.0e-3  # the demo's tiny-model inner lr; not tuned for this benchmark
    warmup: int = 10
    train_docs: int = 4000  # 0: every document (the sample has ~9,500); 4000 keeps every shard under one epoch
    eval_docs: int = 200
    embedder: str = "minilm"
    train_glob: str = "data/sample/train/*.json.gz"
    eval_glob: str = "data/sample/validation/*.json.gz"
    out: str = str(OUT / "quality")
    keep_rounds: int = 0  # 1: keep each variant's rounds/ (modules, paths, DeepSpeed states: ~2 GB a 4x4 variant)


@dataclass(frozen=True)
class Variant:
    name: str
    grid: tuple[int, ...]
    workers: int = 1
    step_multiple: int = 1
    outer_identity: bool = False  # dense baselines: outer lr 1, momentum 0 = no outer optimizer

    @property
    def grid_key(self) -> str:
        return "x".join(map(str, self.grid))


def variants(args: QualityArgs) -> list[Variant]:
    grids = [Variant(f"dipaco_{'x'.join(map(str, g))}", tuple(g)) for g in args.grids]
    return [Variant("dense", (1,), outer_identity=True),
            Variant(f"diloco_m{args.workers}", (1,), workers=args.workers),
            *grids,
            Variant(f"dense_x{args.workers}", (1,), step_multiple=args.workers, outer_identity=True)]


def write_eval_docs(args: QualityArgs) -> str:
    """The first `eval_docs` held-out documents as one C4 file: the same documents for every variant."""
    target = Path(args.out) / "data" / "validation" / "c4-validation.00000-of-00001.json.gz"
    target.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for file in sorted(Path().glob(args.eval_glob)):
        with gzip.open(file, "rt", encoding="utf-8") as handle:
            lines.extend(line for line, _ in zip(handle, range(args.eval_docs - len(lines))))
    with gzip.open(target, "wt", encoding="utf-8") as handle:
        handle.writelines(lines)
    return str(target.parent / "*.json.gz")


def variant_config(args: QualityArgs, variant: Variant, run_root: str, eval_glob: str) -> Config:
    levels = len(variant.grid)
    outer = {"lr": 1.0, "momentum": 0.0} if variant.outer_identity else {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    return config_from_dict({
        "run_root": run_root,
        "data": {"train": args.train_glob, "eval": eval_glob, "max_docs": args.train_docs or None},
        "router": {"embedder": args.embedder, "prefix_tokens": 32, "sample_docs": 2000,
                   "balanced": True},
        "model": {"grid": list(variant.grid), "blocks_per_level": [args.blocks // levels] * levels,
                  "hidden_size": args.hidden, "num_heads": args.heads, "seq_len": args.seq_len},
        "train": {"rounds": args.rounds, "inner_steps": args.inner_steps * variant.step_multiple,
                  "micro_batch_size": args.micro_batch, "lr": args.lr, "warmup_steps": args.warmup,
                  "ds_config": "ds_configs/zero2.json", "workers_per_path": variant.workers,
                  # In process: a `deepspeed` launch costs ~15 s of imports per job and round here,
                  # more than the training itself at these sizes; perf.py measures the launched trainer.
                  "launcher": "inprocess", "parallel_paths": 1},
        "outer": outer,
        "eval": {"max_docs": None, "batch_size": 16},
        "mlflow": {"enabled": False},  # run.py logs the benchmark itself to dipaco-bench
        "beam": {"options": ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]},
    }, source=f"<benchmark variant {variant.name}>")


def prepare_grid(args: QualityArgs, variant: Variant, eval_glob: str) -> dict:
    """Run the Beam prepare job once per grid; variants of that grid copy its router and shards."""
    config = variant_config(args, variant, str(Path(args.out) / f"prep-{variant.grid_key}"), eval_glob)
    stages.init_run(config)
    start = time.perf_counter()
    manifest = stages.prepare(config)
    return {"root": config.run_root, "seconds": time.perf_counter() - start, "manifest": manifest}


def seed_from_prepare(root: RunRoot, prep_root: str) -> None:
    for rel in (layout.ROUTER_DIR, layout.SHARDS_DIR):
        if not root.is_committed(rel):
            root.remove(rel)
            shutil.copytree(Path(prep_root) / rel, root.local_path(rel))


def run_variant(args: QualityArgs, variant: Variant, prep: dict, eval_glob: str) -> dict:
    """All rounds of one variant through the pipeline's stage functions; curves and timings."""
    run_root = Path(args.out) / variant.name
    shutil.rmtree(run_root, ignore_errors=True)  # timings are only honest from a clean start
    config = variant_config(args, variant, str(run_root), eval_glob)
    root = stages.init_run(config)
    seed_from_prepare(root, prep["root"])
    stages.prepare(config)  # committed: returns the shared manifest
    losses: dict[str, list[float]] = {}
    evals, seconds = [], {"train": 0.0, "merge": 0.0, "eval": 0.0}
    start = time.perf_counter()
    for round_index in range(config.train.rounds):
        for job in stages.list_paths(config):
            t0 = time.perf_counter()
            metrics = stages.train_path(config, round_index, job)
            seconds["train"] += time.perf_counter() - t0
            if metrics is None:
                raise RuntimeError(f"{variant.name}: path {job} failed in round {round_index}")
            losses.setdefault(job, []).extend(metrics["loss"])
        t0 = time.perf_counter()
        report = stages.merge(config, round_index)
        seconds["merge"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        result = stages.evaluate(config, round_index + 1)
        seconds["eval"] += time.perf_counter() - t0
        evals.append({"round": round_index + 1, "steps_per_path": (round_index + 1) * config.train.inner_steps,
                      "perplexity": result["perplexity"], "bits_per_byte": result.get("bits_per_byte"),
                      "tokens": result["tokens"]})
        log.info("%s round %d: ppl %.2f (%d tokens)", variant.name, round_index + 1, result["perplexity"], result["tokens"])
    if not args.keep_rounds:
        shutil.rmtree(run_root / "rounds", ignore_errors=True)  # results are in eval/ and the return value
    return {
        "name": variant.name, "grid": list(variant.grid), "workers": variant.workers,
        "steps_per_path": config.train.rounds * config.train.inner_steps,
        "tokens_per_step": config.train.micro_batch_size * config.model.seq_len,
        "jobs": len(stages.list_paths(config)),
        "perplexity": evals[-1]["perplexity"], "bits_per_byte": evals[-1].get("bits_per_byte"),
        "eval_tokens": evals[-1]["tokens"],
        "eval_docs_per_path": {p: v["docs"] for p, v in result["paths"].items()},
        "evals": evals, "losses": losses, "seconds": {**seconds, "total": time.perf_counter() - start},
        "prepare_seconds": prep["seconds"], "bytes_outer_per_round": report["bytes_outer"],
        "bytes_data_parallel_per_round": report["bytes_data_parallel"],
    }


def run_quality(args: QualityArgs) -> dict:
    """Prepare once per grid, run every variant, and compare each with the dense baseline."""
    eval_glob = write_eval_docs(args)
    preps: dict[str, dict] = {}
    results = []
    for variant in variants(args):
        if variant.grid_key not in preps:
            preps[variant.grid_key] = prepare_grid(args, variant, eval_glob)
        results.append(run_variant(args, variant, preps[variant.grid_key], eval_glob))
        # Progress on disk after every variant: a long run cut short still reports what it measured.
        (Path(args.out) / "quality.partial.json").write_text(json.dumps(results, indent=2))
    dense = results[0]["perplexity"]
    for r in results:
        r["rel_to_dense"] = r["perplexity"] / dense - 1
    tokens = {r["name"]: r["eval_tokens"] for r in results}
    return {
        "args": dataclasses.asdict(args),
        "variants": results, "same_eval_tokens": len(set(tokens.values())) == 1, "eval_tokens": tokens,
        "prepare": {k: {"seconds": v["seconds"], "routed": v["manifest"].get("routed"),
                        "docs_per_path": _docs_per_path(v["manifest"])} for k, v in preps.items()},
    }


def _docs_per_path(manifest: dict) -> dict:
    """{path: {split: documents}} from the prepare manifest (how balanced the routing was)."""
    return {p: {split: entry.get("documents") for split, entry in splits.items()}
            for p, splits in (manifest.get("paths") or {}).items()}


def smoothed(values: list[float], window: int = 5) -> np.ndarray:
    """Moving mean, so the curves show trends rather than batch noise."""
    arr = np.asarray(values, dtype=float)
    if len(arr) < window:
        return arr
    return np.convolve(arr, np.ones(window) / window, mode="valid")


def mean_curve(losses: dict[str, list[float]]) -> list[float]:
    """Mean training loss over a variant's jobs at each inner step (paths see different data)."""
    width = min(len(v) for v in losses.values())
    return [float(np.mean([v[i] for v in losses.values()])) for i in range(width)]


def plot_quality(result: dict, out: Path) -> list[Path]:
    """Learning curves (train loss, held-out ppl) per variant, and the final perplexity bars."""
    from pipeline.tracking import plots  # Agg backend set there
    from matplotlib import pyplot as plt

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v in result["variants"]:
        curve = smoothed(mean_curve(v["losses"]))
        ax_loss.plot(np.arange(len(curve)) + 1, curve, label=v["name"], linewidth=1)
        ax_ppl.plot([e["steps_per_path"] for e in v["evals"]], [e["perplexity"] for e in v["evals"]], marker="o", label=v["name"])
    ax_loss.set(xlabel="inner step per path", ylabel="train loss (mean over jobs, 5-step mean)", title="Training loss")
    ax_ppl.set(xlabel="inner steps per path", ylabel="routed perplexity (held-out)", title="Held-out perplexity", yscale="log")
    ax_loss.legend(fontsize=8)
    ax_ppl.legend(fontsize=8)
    fig.tight_layout()
    curves = out / "quality_curves.png"
    fig.savefig(curves, dpi=110)
    plots.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [v["name"] for v in result["variants"]]
    values = [v["perplexity"] for v in result["variants"]]
    bars = ax.bar(names, values, color=["0.5", "tab:blue", *["tab:green"] * (len(names) - 3), "0.3"])
    for bar, v in zip(bars, result["variants"]):
        ax.annotate(f"{v['perplexity']:.1f}\n{100 * v['rel_to_dense']:+.1f}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="routed perplexity", title="Final held-out perplexity (same tokens for all)")
    ax.set_ylim(0, max(values) * 1.2)
    fig.tight_layout()
    bars_png = out / "quality_ppl.png"
    fig.savefig(bars_png, dpi=110)
    plots.close(fig)
    return [curves, bars_png]


def parse_args(argv: list[str] | None = None) -> QualityArgs:
    defaults = QualityArgs()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.splitlines()[0])
    for name, value in vars(defaults).items():
        flag = "--" + name.replace("_", "-")
        if name == "grids":
            parser.add_argument(flag, default="2x2,4x4", help="comma-separated grids, e.g. 2x2,4x4")
        else:
            parser.add_argument(flag, type=type(value), default=value)
    raw = vars(parser.parse_args(argv))
    raw["grids"] = [[int(k) for k in g.split("x")] for g in raw["grids"].split(",") if g]
    return QualityArgs(**raw)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    result = run_quality(args)
    out = Path(args.out)
    (out / "quality.json").write_text(json.dumps(result, indent=2))
    plot_quality(result, out)
    for v in result["variants"]:
        log.info("%-12s ppl %8.2f  %+6.1f%%  %6.0fs", v["name"], v["perplexity"], 100 * v["rel_to_dense"], v["seconds"]["total"])


if __name__ == "__main__":
    main()

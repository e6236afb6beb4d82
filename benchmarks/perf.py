"""Performance: what dipaco costs on top of the frameworks it wraps, each figure a ratio in one run.

`python -m benchmarks.perf` (also run by `make bench`). Four figures:
- trainer: the path trainer's tokens/s under ZeRO-1/2/3 over a plain PyTorch loop, same model,
  batches and steps, interleaved in a launched process (`benchmarks.perf_worker`; three launches,
  each ratio the median of theirs, met or missed only where all three agree), on the path
  `dipaco run` trains by default (its 2,048-token step); and model FLOP utilisation against an
  fp32 matmul measured in that process. Target >= 0.95x. Beside it, as a diagnostic, a small
  path (hidden 128, 4 blocks) at a 768-token step, where DeepSpeed's
  fixed per-optimizer-step work (its flat
  gradient buffers, float64 norm, fp32 master copy) is a visible share of a step.
- prepare: documents/s of the whole Beam job over the raw embedder on the same documents
  (`benchmarks.bench_prepare.bench_prepare`, another engineer's, called when present). Target >= 0.85x.
- merge: `pipeline.outer.merge.merge_round` seconds for a 16-path [4, 4] grid over plainly reading and
  writing the same bytes. Target <= 1.5x. A cProfile of one merge names where the time goes.
- bytes: outer bytes per round over data-parallel training for the same steps. Target <= 1/H.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import logging
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from benchmarks.perf_worker import block_rates
from models.grid import all_path_ids
from models.modular import ModelShape, assemble_path_state
from pipeline import stages
from pipeline.core.config import Config, config_from_dict
from pipeline.outer.merge import merge_round
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.module_store import load_path_modules
from pipeline.state.storage import RunRoot
from pipeline.train.distributed import free_port, set_runtime_env

log = logging.getLogger("dipaco.bench.perf")
OUT = Path("benchmarks/out/perf")
MERGE_HIDDEN = 64


# -- trainer throughput and MFU ------------------------------------------------------------------
def default_path_shape() -> dict[str, int]:
    """The path `dipaco run` trains when a config says nothing (docs/config.md: hidden 256, 4 heads,
    2 + 2 blocks, seq_len 256, micro batch 8): the trainer figure is measured on it."""
    defaults = Config()
    model, train = defaults.model, defaults.train
    return {
        "hidden": model.hidden_size,
        "heads": model.num_heads,
        "blocks": sum(model.blocks_per_level),
        "seq_len": model.seq_len,
        "micro_batch": train.micro_batch_size,
        "accum": train.gradient_accumulation_steps,
    }


def trainer_throughput(
    args: argparse.Namespace,
    name: str,
    shape: dict[str, int],
    steps: int,
    reps: int,
    modes: str,
    precision: str = "fp32",
    launches: int = 1,
) -> dict:
    """The worker's figures over `launches` launches of it, `reps` blocks per mode in all.

    On the 2-core VMs the same configuration launched twice minutes apart moved ZeRO's ratio by up
    to 7 points (ZeRO-3 in fp32: 0.910 and 0.984; benchmarks/RESULTS.md, Zen 4), more than the
    blocks inside one launch scatter (why is not known: the memory layout a launch gets, where its
    threads land, the VM's neighbours). A figure from several launches shows that spread, and the
    verdict against 0.95 is given only where every launch agrees."""
    if launches <= 1:
        return launch_worker(args, name, shape, steps, reps, modes, precision)
    per_launch = max(2, -(-reps // launches))  # ceil: at least the blocks asked for
    runs = [launch_worker(args, f"{name}_{i}", shape, steps, per_launch, modes, precision) for i in range(launches)]
    return merge_launches(runs)


def merge_launches(runs: list[dict]) -> dict:
    """One result from several launches of the same modes: each mode's ratio and extra seconds the
    median over the launches (each launch's own paired-block median), with every launch's ratio
    kept; tokens/s and the plain step over all the blocks; the peak matmul the fastest seen."""
    first = runs[0]
    result = {key: first[key] for key in ("world_size", "threads", "cpu_count", "device", "tokens_per_block")}
    result.update({key: first[key] for key in ("steps_per_block", "model_flops_per_token", "args")})
    result["reps"] = sum(run["reps"] for run in runs)
    result["launches"] = len(runs)
    modes = list(first["seconds"])
    result["seconds"] = {mode: [s for run in runs for s in run["seconds"][mode]] for mode in modes}
    result["matmul_flops"] = max(run["matmul_flops"] for run in runs)
    result.update(
        block_rates(
            result["seconds"],
            result["tokens_per_block"],
            result["steps_per_block"],
            result["model_flops_per_token"],
            result["matmul_flops"],
        )
    )
    result["ratio_by_launch"] = {mode: [run["ratio_to_plain"][mode] for run in runs] for mode in modes}
    result["ratio_to_plain"] = {mode: statistics.median(r) for mode, r in result["ratio_by_launch"].items()}
    result["extra_seconds_per_step"] = {
        mode: statistics.median(run["extra_seconds_per_step"][mode] for run in runs) for mode in modes
    }
    result["launch_seconds"] = sum(run["launch_seconds"] for run in runs)
    return result


def launch_worker(
    args: argparse.Namespace, name: str, shape: dict[str, int], steps: int, reps: int, modes: str, precision: str
) -> dict:
    """Launch the worker exactly as a path job is launched (deepspeed launcher, OMP threads set)."""
    set_runtime_env()
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{name}.json"
    out.unlink(missing_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.procs)
    command = [
        str(Path(sys.executable).with_name("deepspeed")),
        "--num_nodes",
        "1",
        "--num_gpus",
        str(args.procs),
        "--master_port",
        str(free_port()),
        "--no_local_rank",
        "--module",
        "benchmarks.perf_worker",
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--reps",
        str(reps),
        "--modes",
        modes,
        "--precision",
        precision,
    ]
    for key, value in shape.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    log.info("trainer benchmark: %s", " ".join(command))
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"perf worker failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    result = json.loads(out.read_text())
    result["launch_seconds"] = time.perf_counter() - start
    return result


# -- prepare throughput --------------------------------------------------------------------------
def prepare_throughput(n_docs: int) -> dict | None:
    """The prepare benchmark with the default Beam options, the router fitted on 2% of the corpus,
    and the DirectRunner's 2-worker multi-processing mode timed beside it.

    The fit embeds its sample once more before routing embeds everything, so a sample as large
    as the corpus doubles the embedding work, a set-up no real run has (DESIGN: 20,000 sampled
    documents of C4's 365M, 0.005%); 2% is still far above real proportions. The corpus is
    `--prepare-docs` of the bundled source (3,000 by default, to fit `make bench`), over which the
    job's start-up (pipeline construction, model load) still shows: on the AMX Xeon 0.82 of raw
    MiniLM at 3,000 documents and 0.94 at all 10,000 (benchmarks/RESULTS.md)."""
    if importlib.util.find_spec("benchmarks.bench_prepare") is None:
        log.warning("benchmarks/bench_prepare.py is absent: no prepare figure")
        return None
    from benchmarks.bench_prepare import MULTI_PROCESSING, bench_prepare

    return bench_prepare(
        n_docs, sample_docs=max(200, n_docs // 50), other_options={"multi_processing_2": MULTI_PROCESSING}
    )


# -- merge against plain file I/O ----------------------------------------------------------------
def merge_config(args: argparse.Namespace, run_root: Path) -> Config:
    return config_from_dict(
        {
            "run_root": str(run_root),
            # hidden 64 (GPT-2's vocab): the merge figure's 837 MB, as measured before the toy path grew
            "model": {
                "grid": [4, 4],
                "blocks_per_level": [1, 1],
                "hidden_size": MERGE_HIDDEN,
                "num_heads": 4,
                "seq_len": args.seq_len,
            },
            "train": {"inner_steps": args.inner_steps, "launcher": "inprocess"},
            "mlflow": {"enabled": False},
        }
    )


def fake_path(root: RunRoot, config: Config, round_index: int, path_id: str, shift: float, tokens: int) -> None:
    """Commit a path's output as the trainer would (as tests/test_merge.py::fake_path does)."""
    shape = ModelShape.from_config(config.model)
    modules = load_path_modules(root, round_index, tuple(int(k) for k in path_id[1:].split("-")))
    trained = [{k: v + shift * torch.randn_like(v) for k, v in m.items()} for m in modules]
    rel = layout.path_dir(round_index, path_id)
    root.write_bytes(f"{rel}/model.safetensors", st_save(assemble_path_state(shape, trained)))
    root.write_json(f"{rel}/metrics.json", {"tokens": tokens})
    root.commit(rel, info={"tokens": tokens})


def fake_round(root: RunRoot, config: Config, round_index: int) -> None:
    torch.manual_seed(round_index)
    for index, path_id in enumerate(all_path_ids(config.model.grid)):
        fake_path(root, config, round_index, path_id, shift=1e-3, tokens=1000 + 10 * index)


def merge_io_files(root: RunRoot, config: Config, round_index: int) -> tuple[list[Path], list[Path]]:
    """(files merge_round reads, files it writes) for one round: the bytes the baseline moves."""
    local = Path(root.path())
    reads = [local / layout.path_dir(round_index, p) / "model.safetensors" for p in all_path_ids(config.model.grid)]
    reads += sorted((local / layout.modules_dir(round_index)).rglob("*.safetensors"))
    reads += sorted((local / layout.outer_state_dir(round_index)).rglob("*.safetensors"))
    writes = sorted((local / layout.modules_dir(round_index + 1)).rglob("*.safetensors"))
    writes += sorted((local / layout.outer_state_dir(round_index + 1)).rglob("*.safetensors"))
    return reads, writes


def plain_io(reads: list[Path], writes: list[Path], scratch: Path, fsync: bool, verify: bool = False) -> float:
    """Read every input file, write the same bytes to as many new files: the I/O floor.

    `verify` adds one CRC-32 pass over every byte read and written, the integrity guarantee the
    run root gives (a checksum per committed file): the floor for any merge that keeps it."""
    import zlib

    scratch.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    blobs = [path.read_bytes() for path in reads]
    if verify:
        for blob in blobs:
            zlib.crc32(blob)
    for index, path in enumerate(writes):
        data = blobs[index % len(blobs)][: path.stat().st_size]
        with open(scratch / f"out-{index}.bin", "wb") as handle:
            handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        if verify:
            zlib.crc32(data)
    seconds = time.perf_counter() - start
    shutil.rmtree(scratch)
    return seconds


def timed_merge(root: RunRoot, config: Config, round_index: int) -> float:
    """One merge from scratch, as a round meets it: round r+1's outputs do not exist yet (the
    plain I/O baseline writes new files too; overwriting costs an unlink per file)."""
    root.remove(f"{layout.round_dir(round_index)}/_SUCCESS")  # make the committed merge run again
    root.remove(layout.merged_dir(round_index))  # each module's merge too
    root.remove(layout.modules_dir(round_index + 1))
    root.remove(layout.outer_state_dir(round_index + 1))
    start = time.perf_counter()
    merge_round(config, round_index)
    return time.perf_counter() - start


def hash_speeds(paths: list[Path]) -> dict:
    """MB/s of CRC-32 (what the run root uses) and of cryptographic hashes on the merge's input bytes."""
    import hashlib
    import zlib

    blobs = [p.read_bytes() for p in paths[:4]]
    size = sum(len(b) for b in blobs)
    start = time.perf_counter()
    for blob in blobs:
        zlib.crc32(blob)
    speeds = {"crc32": size / 1e6 / (time.perf_counter() - start)}
    for name in ("sha256", "blake2b", "md5"):
        start = time.perf_counter()
        for blob in blobs:
            hashlib.new(name, blob).digest()
        speeds[name] = size / 1e6 / (time.perf_counter() - start)
    return speeds


def merge_profile(root: RunRoot, config: Config, round_index: int) -> list[dict]:
    """Where one merge spends its time: the functions with the most cumulative seconds, on the
    thread that runs merge_round and on the threads that merge its modules (each merge_module
    call profiled on its own thread: cProfile sees one thread only)."""
    from pipeline.outer import merge

    root.remove(f"{layout.round_dir(round_index)}/_SUCCESS")
    for rel in (
        layout.merged_dir(round_index),
        layout.modules_dir(round_index + 1),
        layout.outer_state_dir(round_index + 1),
    ):
        root.remove(rel)  # every module merged again, as in timed_merge
    profiler, module_profilers = cProfile.Profile(), []
    merge_module = merge.merge_module

    def profiled(*args, **kwargs):
        module_profilers.append(cProfile.Profile())
        return module_profilers[-1].runcall(merge_module, *args, **kwargs)

    merge.merge_module = profiled  # merge_round looks the name up at each call
    try:
        profiler.runcall(merge_round, config, round_index)
    finally:
        merge.merge_module = merge_module
    stats = pstats.Stats(profiler, *module_profilers)
    wanted = (
        "crc32",
        "fsync",
        "map_io",
        "read_committed",
        "decode",
        "encode",
        "outer_gradient",
        "outer_step",
        "write_bytes",
        "commit",
        "load_modules",
        "write_states",
        "split_path_state",
        "_file_record",
        "module_grad",
        "read_state",
        "write_state",
        "read_bytes",
        "st_save",
        "save",
        "load",
    )
    rows = []
    for (file, _, name), (_, _, _, cumulative, _) in stats.stats.items():
        if any(w == name or w in name for w in wanted) and (
            "pipeline" in file or "zlib" in name or "{" in file or "safetensors" in file
        ):
            rows.append({"function": f"{Path(file).name}:{name}", "seconds": round(cumulative, 3)})
    total = sum(v[3] for k, v in stats.stats.items() if k[2] == "merge_round")
    rows.sort(key=lambda r: -r["seconds"])
    return [{"function": "merge_round (total)", "seconds": round(total, 3)}, *rows[:14]]


def merge_vs_io(args: argparse.Namespace) -> dict:
    """Two merged rounds of fabricated paths (round 1 has momentum), then interleaved timings."""
    run_root = OUT / "merge"
    shutil.rmtree(run_root, ignore_errors=True)
    config = merge_config(args, run_root)
    root = stages.init_run(Run(config))
    fake_round(root, config, 0)
    merge_round(config, 0)
    fake_round(root, config, 1)
    report = merge_round(config, 1)
    reads, writes = merge_io_files(root, config, 1)
    merge_s, plain_s, fsync_s, verified_s = [], [], [], []
    for _ in range(args.merge_reps):
        merge_s.append(timed_merge(root, config, 1))
        plain_s.append(plain_io(reads, writes, OUT / "plain-io", fsync=False))
        fsync_s.append(plain_io(reads, writes, OUT / "plain-io", fsync=True))
        verified_s.append(plain_io(reads, writes, OUT / "plain-io", fsync=True, verify=True))
    read_bytes, written_bytes = sum(p.stat().st_size for p in reads), sum(p.stat().st_size for p in writes)
    return {
        "paths": len(all_path_ids(config.model.grid)),
        "grid": config.model.grid,
        "bytes_read": read_bytes,
        "bytes_written": written_bytes,
        "merge_seconds": merge_s,
        "plain_io_seconds": plain_s,
        "plain_io_fsync_seconds": fsync_s,
        "ratio": statistics.median(m / p for m, p in zip(merge_s, plain_s)),
        "ratio_vs_fsync_io": statistics.median(m / p for m, p in zip(merge_s, fsync_s)),
        "plain_io_fsync_crc32_seconds": verified_s,
        "ratio_vs_verified_io": statistics.median(m / p for m, p in zip(merge_s, verified_s)),
        "hash_mb_per_s": hash_speeds(reads),
        "profile": merge_profile(root, config, 1),  # last: leaves the pipeline's own merge committed
        "report": {k: report[k] for k in ("bytes_outer", "bytes_data_parallel")},
        "config": config,
    }


# -- communication -------------------------------------------------------------------------------
def bytes_ratio(merge: dict, config: Config) -> dict:
    """Outer bytes per round over data-parallel bytes for the same steps.

    The merge report computes `bytes_data_parallel` as 2 x the fp32 path bytes x inner_steps, which
    with `outer.compression: none` (this benchmark) is `bytes_outer * inner_steps`, so its ratio
    is 1/H by construction; the independent figure counts a ring all-reduce of every path's
    gradient (2 x its parameter bytes per island) at every one of the H inner steps.
    """
    root = RunRoot(config.run_root)
    dp = 0
    for path_id in all_path_ids(config.model.grid):
        modules = load_path_modules(root, 0, tuple(int(k) for k in path_id[1:].split("-")))
        path_bytes = sum(t.numel() * t.element_size() for m in modules for t in m.values())
        dp += 2 * path_bytes * config.train.inner_steps
    report = merge["report"]
    return {
        "inner_steps": config.train.inner_steps,
        "bytes_outer": report["bytes_outer"],
        "bytes_data_parallel_report": report["bytes_data_parallel"],
        "bytes_data_parallel_ring": dp,
        "ratio_report": report["bytes_outer"] / report["bytes_data_parallel"],
        "ratio_ring": report["bytes_outer"] / dp,
        "target": 1 / config.train.inner_steps,
    }


def bf16_skip_reason() -> str | None:
    """Why the bf16 trainer row is not measured on this machine (None: it is)."""
    from pipeline.train.precision import accelerator, cpu_native_bf16

    if accelerator() == "cuda":
        return None
    native, isa = cpu_native_bf16()
    return None if native else f"this CPU ({isa}) has no native bfloat16 (emulated; train.precision auto picks fp32)"


def run_perf(args: argparse.Namespace) -> dict:
    OUT.mkdir(parents=True, exist_ok=True)
    result: dict = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    # The figure: the default path at its default step (2,048 tokens). The diagnostic: the quality
    # runs' path at a 768-token step, where DeepSpeed's fixed per-step work shows (benchmarks/RESULTS.md).
    toy = {
        "hidden": args.hidden,
        "heads": 4,
        "blocks": 4,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "accum": 1,
    }
    stages_ = [
        ("merge", lambda: merge_vs_io(args)),
        (
            "trainer",
            lambda: trainer_throughput(
                args,
                "trainer",
                default_path_shape(),
                1,
                args.trainer_reps,
                "plain,zero1,zero2,zero3",
                launches=args.trainer_launches,
            ),
        ),
        # a row per precision: bf16 autocast where this CPU has it natively (what auto measures)
        (
            "trainer_bf16",
            lambda: trainer_throughput(
                args,
                "trainer_bf16",
                default_path_shape(),
                1,
                args.trainer_reps,
                "plain,zero1,zero2,zero3",
                precision="bf16",
                launches=args.trainer_launches,
            ),
        ),
        (
            "trainer_small_step",
            lambda: trainer_throughput(
                args, "trainer_small_step", toy, args.steps, args.reps, "plain,zero1,zero2,zero3,zero2_bare"
            ),
        ),
    ]
    stages_.append(("prepare", lambda: prepare_throughput(args.prepare_docs)))
    skip = bf16_skip_reason()
    if skip:  # emulated bf16 costs ~10x fp32: 30 minutes of a 60-minute budget, to measure what auto never picks
        result["trainer_bf16_skipped"] = skip
        stages_ = [(name, run) for name, run in stages_ if name != "trainer_bf16"]
        log.info("perf: trainer_bf16 skipped: %s", skip)
    for name, run in stages_:
        start = time.perf_counter()
        log.info("perf: %s ...", name)
        result[name] = run()
        log.info("perf: %s done in %.0fs", name, time.perf_counter() - start)
    result["bytes"] = bytes_ratio(result["merge"], result["merge"].pop("config"))
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The small-step diagnostic runs on a small path (hidden 128, 4 blocks, 768 tokens).
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=6)
    # Shortened to leave the quality rows their 300 steps within `make bench`'s 45 minutes: 10 blocks
    # (was 16) and 3,000 prepare documents (was 10,000, ~4 min of MiniLM in four measurements).
    parser.add_argument(
        "--trainer-reps",
        type=int,
        default=10,
        help="timed one-step blocks per mode on the default path, interleaved in shuffled order",
    )
    parser.add_argument(
        "--trainer-launches",
        type=int,
        default=3,
        help="launches the default path's blocks are spread over (their ratios' spread is reported)",
    )
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block of the small-step diagnostic")
    parser.add_argument("--reps", type=int, default=12, help="timed blocks per mode of the small-step diagnostic")
    parser.add_argument("--procs", type=int, default=1, help="ranks of the trainer launch (the island)")
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default: the quality benchmark's)")
    parser.add_argument("--merge-reps", type=int, default=5)
    parser.add_argument("--prepare-docs", type=int, default=3000)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    from benchmarks.quality import QualityArgs

    args.inner_steps = args.inner_steps or QualityArgs().inner_steps
    result = run_perf(args)
    (OUT / "perf.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()

"""Where ZeRO's fixed cost per step goes on a GPU: forward, backward and optimizer step timed apart.

`python -m benchmarks.gpu_phases` on a host with a CUDA device (refused in one line elsewhere). The
trainer benchmark (`benchmarks.gpu`) measures ZeRO-1/2 at ~9-11 ms a step over plain PyTorch on an
H100 or H200, at every model size; this says in which phase those milliseconds are spent, so that a
fix is aimed at the right place. Each variant (plain, ZeRO-1, ZeRO-2; gradient clipping on and off)
trains 14 steps with the device synchronized between phases (the first 4 not counted), then 30
steps without (the `async` column, what a run sees), in bf16 autocast as `train.precision: auto`
picks on such a GPU. One process, no launcher: a one-rank job (pipeline.train.distributed).

Writes `benchmarks/out/gpu/phases.json` (or `--out`) after each shape and prints one line per
variant; RESULTS.md's GPU section holds a run's figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    "large": {"hidden": 1024, "heads": 16, "blocks": 8, "seq_len": 1024, "micro_batch": 16},  # benchmarks.gpu's
    "default": {"hidden": 256, "heads": 4, "blocks": 4, "seq_len": 256, "micro_batch": 8},  # dipaco run's path
}
SYNCED_STEPS, WARMUP_STEPS, ASYNC_STEPS = 14, 4, 10


def drained(device: torch.device) -> float:
    """The clock once the device has finished what was queued."""
    from benchmarks.perf_worker import synchronize

    synchronize(device)
    return time.perf_counter()


def timed_step(loop, inputs: torch.Tensor, labels: torch.Tensor, device: torch.device) -> list[float]:
    """One step of a perf-worker loop with the device drained before each clock read: [forward +
    loss, backward, optimizer step]."""
    marks = [drained(device)]
    loss = loop.loss(inputs, labels)
    marks.append(drained(device))
    loop.backward(loss)
    marks.append(drained(device))
    loop.step()
    marks.append(drained(device))
    return [b - a for a, b in zip(marks, marks[1:])]


def shape_phases(dims: dict[str, int], precision: str, rank: int, world: int) -> dict[str, dict[str, float]]:
    """Milliseconds per phase (median) of each variant on one path shape."""
    from benchmarks.perf_worker import PlainLoop, TrainerLoop, bench_config, bench_device, load_rows
    from models.modular import ModelShape, build_path_model, initial_level_states
    from pipeline.train.data import RowStream

    args = argparse.Namespace(accum=1, steps=1, precision=precision, **dims)
    config = bench_config(args)
    shape = ModelShape.from_config(config.model)
    stream = RowStream(load_rows("data/sample/train/*.json.gz", 400, dims["seq_len"]), seed=0)
    init = initial_level_states(shape, seed=0)
    device = bench_device()
    result = {}
    for clip in (1.0, 0.0):
        clipped = copy.deepcopy(config)
        clipped.train.grad_clip = clip
        for kind in ("plain", "zero1", "zero2"):
            model = build_path_model(shape, [{k: v.clone() for k, v in m.items()} for m in init])
            if kind == "plain":
                loop = PlainLoop(model, clipped, world)
            else:
                loop = TrainerLoop(model, clipped, int(kind[4]), world, bare=True)
            phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
            for step in range(SYNCED_STEPS):
                batch = stream.micro_batch(step * dims["micro_batch"], dims["micro_batch"])
                inputs, labels = (t.to(device) for t in batch)
                times = timed_step(loop, inputs, labels, device)
                if step >= WARMUP_STEPS:
                    for name, seconds in zip(phases, times):
                        phases[name].append(seconds)
            loop.config.train.inner_steps = ASYNC_STEPS
            phases["async"] = [loop.run(stream, 100 + rep, rank, world) / ASYNC_STEPS for rep in range(3)]
            name = f"{kind}_clip{clip:g}"
            result[name] = {phase: round(statistics.median(s) * 1e3, 2) for phase, s in phases.items()}
            print(f"{name:>12}: " + "  ".join(f"{p} {ms:7.2f} ms" for p, ms in result[name].items()), flush=True)
            del loop, model
            torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_phases", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out/gpu/phases.json")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu_phases: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    os.environ["DS_ACCELERATOR"] = "cuda"
    from pipeline.train.distributed import init_distributed

    rank, world = init_distributed()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "precision": args.precision}
    for shape_name, dims in SHAPES.items():
        print(f"{shape_name} path ({dims}), {args.precision}:", flush=True)
        result[shape_name] = shape_phases(dims, args.precision, rank, world)
        out.write_text(json.dumps(result, indent=2))  # each shape kept as it ends: a lent GPU can go
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

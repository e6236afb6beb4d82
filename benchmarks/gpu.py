"""The GPU check: the CUDA code paths run, and what the path trainer costs over plain PyTorch there.

`python -m benchmarks.gpu` on a host with a CUDA device (refused in one line elsewhere). It runs
what a CPU machine cannot:
- the tests marked `gpu` (tests/test_gpu.py: a tiny path on one `deepspeed` rank under ZeRO-2
  and ZeRO-3, the precision chosen by `train.precision: auto`);
- the trainer benchmark of `benchmarks.perf` on the GPU: the path trainer under ZeRO-1/2/3 against
  a plain PyTorch loop on the same model, batches and steps, interleaved in one launched rank, in
  the precision `auto` picks there (bf16 where the GPU has it, else fp16), and in fp32 beside it.
  Two shapes: the path `dipaco run` trains by default (hidden 256, 2,048 tokens a step: far too
  small to fill a GPU, so its step is launch-bound) and a 1,024-wide, 8-block path at 16,384
  tokens a step, big enough for the GPU's matmuls to count.
MFU is the model's FLOPs per second (6N + attention per token) over an 8192² matmul's rate
measured on the same GPU in the same precision, not a data sheet's peak.

Writes `benchmarks/out/gpu/gpu.json` (or `--out`) after the tests and after each trainer row, and
prints one table at the end; RESULTS.md's `gpu` section is the committed copy of a run (written by
hand: a GPU run is rare here).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("dipaco.bench.gpu")
OUT = Path("benchmarks/out/gpu")

# name -> the perf worker's shape flags (benchmarks.perf_worker)
LARGE_SHAPE = {"hidden": 1024, "heads": 16, "blocks": 8, "seq_len": 1024, "micro_batch": 16, "accum": 1}


def gpu_precision() -> str:
    """What `train.precision: auto` resolves to on this GPU (pipeline.train.precision's own rule)."""
    from pipeline.train.precision import resolve_cuda

    return resolve_cuda("auto").name


def run_gpu_tests() -> dict:
    """pytest -m gpu: exit status, seconds, and the tests' printed step times."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
    )
    wanted = ("ZeRO-", "passed", "failed", "skipped")
    lines = [line for line in done.stdout.splitlines() if any(word in line for word in wanted)]
    return {
        "returncode": done.returncode,
        "seconds": time.perf_counter() - start,
        "lines": lines,
        "tail": (done.stdout + done.stderr)[-3000:] if done.returncode else "",
    }


def trainer_rows(reps: int, rows: dict, on_row: Callable[[], None] = lambda: None) -> dict:
    """The perf trainer benchmark, one launch per (shape, precision), each into `rows` as it ends.

    `on_row` runs after each: a device lent for minutes can be taken back mid-run, and the rows
    already measured (each a minute or more of GPU time) must survive that."""
    from benchmarks.perf import default_path_shape, trainer_throughput

    args = argparse.Namespace(procs=1)
    for shape_name, shape, steps in (("default", default_path_shape(), 5), ("large", LARGE_SHAPE, 3)):
        for precision in dict.fromkeys((gpu_precision(), "fp32")):
            name = f"gpu_{shape_name}_{precision}"
            log.info("gpu: %s ...", name)
            try:
                rows[name] = trainer_throughput(
                    args, name, shape, steps, reps, "plain,zero1,zero2,zero3", precision=precision
                )
            except RuntimeError as error:  # one failed row does not hide the others
                rows[name] = {"error": str(error)[-2000:]}
            on_row()
    return rows


def table(result: dict) -> str:
    lines = [
        f"GPU: {result['device']} (torch {result['torch']}); auto picks {result['auto']}",
        "| shape | precision | plain ms/step | ZeRO-1/2/3 vs plain | MFU plain | MFU ZeRO-1/2/3 |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in result["trainer"].items():
        _, shape, precision = name.split("_")
        if "error" in row:
            lines.append(f"| {shape} | {precision} | failed: {row['error'][-200:]!r} | | | |")
            continue
        ratio = " / ".join(f"{row['ratio_to_plain'][m]:.3f}" for m in ("zero1", "zero2", "zero3"))
        mfu = " / ".join(f"{row['mfu'][m]:.1%}" for m in ("zero1", "zero2", "zero3"))
        lines.append(
            f"| {shape} ({row['tokens_per_block'] // row['steps_per_block']} tokens) | {precision} | "
            f"{row['plain_seconds_per_step'] * 1e3:.2f} | {ratio} | {row['mfu']['plain']:.1%} | {mfu} |"
        )
    peaks = [
        f"{name}: {row['matmul_flops'] / 1e12:.0f} TFLOP/s"
        for name, row in result["trainer"].items()
        if "matmul_flops" in row
    ]
    lines.append("peak matmul measured: " + ", ".join(peaks))
    lines += result["tests"]["lines"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="timed blocks per mode, interleaved")
    parser.add_argument("--out", default=str(OUT / "gpu.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    os.environ["DS_ACCELERATOR"] = "cuda"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "auto": gpu_precision()}
    result["tests"] = run_gpu_tests()
    result["trainer"] = {}

    def save() -> None:  # after the tests and after each row: what was measured outlives a lost device
        partial = out.with_name(out.name + ".tmp")
        partial.write_text(json.dumps(result, indent=2, default=str))
        partial.replace(out)

    save()
    trainer_rows(args.reps, result["trainer"], on_row=save)
    print(table(result))
    return 0 if result["tests"]["returncode"] == 0 and not any("error" in r for r in result["trainer"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

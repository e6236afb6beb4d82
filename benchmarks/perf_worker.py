"""One launched rank of the trainer-throughput benchmark: a plain PyTorch loop and the path trainer
under ZeRO-1/2/3, on the same model, the same batches and the same steps, in one process.

Launched by `benchmarks.perf` through the `deepspeed` launcher (`--num_gpus N --no_local_rank
--module benchmarks.perf_worker --out FILE ...`), so it runs exactly as a path job does: same
environment, same `OMP_NUM_THREADS`, same process group. Why one process for all modes: on a
shared 2-core machine the load of other users drifts by minutes; interleaving short blocks of
steps (every mode once per rep, in a shuffled order) and comparing each block with the plain
block of the same rep cancels that drift, where separate launches minutes apart would not; the
median over many short reps keeps one disturbed block from deciding the figure.

Modes, each with its own model copy (same init) and optimizer:
- `plain`: the loop a PyTorch user writes (AdamW, warmup+cosine lr, clip 1.0; DDP when N > 1);
- `zero1|2|3`: `pipeline.train.train_path.run_inner_loop` (the trainer's own loop) on a ZeRO engine;
- `zero2_bare`: the ZeRO-2 engine stepped without the trainer's per-step logging collective, to
  separate the cost of DeepSpeed from the cost of the loop around it.
Each block is timed after a warm-up block; the first steps (allocator, autograd graph, DeepSpeed
buffers) never count.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import logging
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models.modular import ModelShape, build_path_model, eos_token_id, initial_level_states
from pipeline.core.config import Config, config_from_dict
from pipeline.core.errors import InputError
from pipeline.train.data import RowStream, micro_batch_start, pack_documents
from pipeline.train.distributed import close_distributed, init_distributed
from pipeline.train.precision import accelerator
from pipeline.train.train_path import adamw_for, lr_at, path_loss, run_inner_loop
from pipeline.train.zero import load_ds_config, wrap_with_zero

log = logging.getLogger("dipaco.bench.perf_worker")
MODES = ("plain", "zero1", "zero2", "zero3", "zero2_bare")


def bench_config(args: argparse.Namespace) -> Config:
    """The path trainer's config for this benchmark (the model the quality runs train)."""
    return config_from_dict(
        {
            "run_root": "/tmp/dipaco-perf-unused",
            "model": {
                "grid": [1],
                "blocks_per_level": [args.blocks],
                "hidden_size": args.hidden,
                "num_heads": args.heads,
                "seq_len": args.seq_len,
            },
            "train": {
                "rounds": 10_000,
                "inner_steps": args.steps,
                "micro_batch_size": args.micro_batch,
                "gradient_accumulation_steps": args.accum,
                "lr": 2.0e-3,
                "warmup_steps": 10,
                "precision": args.precision,
            },  # explicit: the plain loop runs in the same one
            "mlflow": {"enabled": False},
        }
    )


def load_rows(data_glob: str, n_docs: int, seq_len: int) -> np.ndarray:
    """Real sample text, tokenized and packed exactly as the trainer packs a shard."""
    from pipeline.routing.tokenizer import encode

    files = sorted(Path().glob(data_glob))
    if not files:  # an empty stream would fail deep in the packing (a division by zero) instead
        raise InputError(f"--data {data_glob}: no file matches (relative to {Path.cwd()}); run `make sample`")
    texts: list[str] = []
    for file in files:
        with gzip.open(file, "rt", encoding="utf-8") as handle:
            texts.extend(json.loads(line)["text"] for line, _ in zip(handle, range(n_docs - len(texts))))
        if len(texts) >= n_docs:
            break
    docs = [np.asarray(t, dtype=np.int32) for t in encode(texts)]
    return pack_documents(docs, seq_len, seed=0, eos=eos_token_id(50257))


# A ZeRO-3 engine built with memory_efficient_linear replaces torch.nn.functional.linear for the
# whole process. Every mode here shares one process, so each block runs with the linear its own
# path job would have: torch's for the plain loop and ZeRO-1/2, whatever ZeRO-3 installed for it.
TORCH_LINEAR = torch.nn.functional.linear


def bench_device() -> torch.device:
    """Where every mode trains: the CUDA device of this rank under DS_ACCELERATOR=cuda, else the CPU."""
    if accelerator() == "cuda":  # the launcher set DS_ACCELERATOR (pipeline.train.distributed)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device | None) -> None:
    """Wait for the device's queued kernels: a CUDA block's time is its kernels' time, not its launches'.
    (DeepSpeed's CPU accelerator may leave an engine's device None.)"""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class PlainLoop:
    """The reference: what a user writes in PyTorch, with the trainer's schedule and clipping."""

    linear = staticmethod(TORCH_LINEAR)

    def __init__(self, model: torch.nn.Module, config: Config, world: int):
        self.device = bench_device()
        model = model.to(self.device)
        ddp_devices = [self.device.index] if self.device.type == "cuda" else None
        self.model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ddp_devices) if world > 1 else model
        self.optimizer = adamw_for(model, config.train)
        self.config = config

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with autocast(self.config.train.precision):  # what DeepSpeed's torch_autocast block does around the forward
            logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        """Clip (unless train.grad_clip is 0, as DeepSpeed's gradient_clipping 0 turns it off), step
        the optimizer, drop the gradients."""
        if self.config.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, stream: RowStream, round_index: int, rank: int, world: int) -> float:
        """`inner_steps` steps at the same global steps the trainer would take; returns seconds."""
        train = self.config.train
        synchronize(self.device)
        start = time.perf_counter()
        for step in range(train.inner_steps):
            global_step = round_index * train.inner_steps + step
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(global_step, train.rounds * train.inner_steps, train)
            accum = train.gradient_accumulation_steps
            for micro in range(accum):
                first = micro_batch_start(global_step, micro, rank, train.micro_batch_size, accum, world)
                inputs, labels = (t.to(self.device) for t in stream.micro_batch(first, train.micro_batch_size))
                self.backward(self.loss(inputs, labels) / accum)
            self.step()
        synchronize(self.device)
        return time.perf_counter() - start


class TrainerLoop:
    """The path trainer's own inner loop on a ZeRO engine (what `dipaco train-path` runs)."""

    def __init__(self, model: torch.nn.Module, config: Config, stage: int, world: int, bare: bool = False):
        config = copy.deepcopy(config)
        config.train.ds_config = f"ds_configs/zero{stage}.json"
        shape = ModelShape.from_config(config.model)
        self.engine = wrap_with_zero(model, adamw_for(model, config.train), load_ds_config(config.train, shape, world))
        self.config, self.bare = config, bare
        self.linear = torch.nn.functional.linear if stage == 3 else TORCH_LINEAR

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return path_loss(self.engine, inputs, labels)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def run(self, stream: RowStream, round_index: int, rank: int, world: int) -> float:
        if not self.bare:
            synchronize(self.engine.device)  # the loop synchronizes before it reads its own clock
            return run_inner_loop(self.engine, stream, self.config, round_index, rank, world)["seconds"]
        train = self.config.train
        synchronize(self.engine.device)
        start = time.perf_counter()
        for step in range(train.inner_steps):  # the trainer's loop minus the per-step all_reduce/log
            global_step = round_index * train.inner_steps + step
            for group in self.engine.optimizer.param_groups:
                group["lr"] = lr_at(global_step, train.rounds * train.inner_steps, train)
            accum = train.gradient_accumulation_steps
            for micro in range(accum):
                first = micro_batch_start(global_step, micro, rank, train.micro_batch_size, accum, world)
                inputs, labels = (t.to(self.engine.device) for t in stream.micro_batch(first, train.micro_batch_size))
                self.backward(self.loss(inputs, labels))
                self.step()  # steps the optimizer at the accumulation boundary only
        synchronize(self.engine.device)
        return time.perf_counter() - start


def block_rates(
    seconds: dict[str, list[float]], tokens: int, steps: int, flops_per_token: float, matmul_flops: float
) -> dict:
    """Each mode's tokens/s (its median block), the plain step's seconds and each mode's MFU, from
    timed blocks of `tokens` tokens and `steps` steps: one launch's, or several launches' pooled."""
    tokens_per_s = {mode: tokens / statistics.median(blocks) for mode, blocks in seconds.items()}
    return {
        "tokens_per_s": tokens_per_s,
        "plain_seconds_per_step": statistics.median(seconds["plain"]) / steps,
        "mfu": {mode: rate * flops_per_token / matmul_flops for mode, rate in tokens_per_s.items()},
    }


def autocast(precision: str):
    """torch.autocast for bf16/fp16 (DeepSpeed's torch_autocast runs the engine's forward in one)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(bench_device().type, dtype=dtype or torch.float32, enabled=dtype is not None)


MATMUL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_flops(precision: str = "fp32", repeats: int = 20) -> float:
    """FLOP/s of a square matmul where the modes train: the MFU denominator, measured, not a data
    sheet's. On the CPU an fp32 1024² product on this process's threads (the CPU rows train fp32
    matmuls, or bf16 ones where measured faster); on CUDA a 8192² product in the training precision
    (bf16 on an H100: ~790 TFLOP/s), the tensor cores' rate the model's matmuls could reach."""
    device = bench_device()
    size = 8192 if device.type == "cuda" else 1024
    dtype = MATMUL_DTYPES[precision] if device.type == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * repeats / best


def model_flops_per_token(model: torch.nn.Module, shape: ModelShape) -> float:
    """6*N (+ attention 12*L*d*T) per trained token, N without the input embedding (a lookup)."""
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    layers = sum(shape.blocks_per_level)
    return 6 * n + 12 * layers * shape.hidden_size * shape.max_positions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf_worker")
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", default="data/sample/train/*.json.gz")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=1, help="micro batches per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--reps", type=int, default=12, help="timed blocks per mode, interleaved")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16", "fp16"),
        help="train.precision of every mode (the plain loop autocasts the same way)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rank, world = init_distributed()
    torch.manual_seed(0)
    config = bench_config(args)
    shape = ModelShape.from_config(config.model)
    stream = RowStream(load_rows(args.data, 400, args.seq_len), seed=0)
    init = initial_level_states(shape, seed=0)
    loops = {}
    for mode in args.modes.split(","):
        model = build_path_model(shape, [{k: v.clone() for k, v in m.items()} for m in init])
        loops[mode] = (
            PlainLoop(model, config, world)
            if mode == "plain"
            else TrainerLoop(model, config, int(mode[4]), world, bare=mode.endswith("bare"))
        )
    peak = [matmul_flops(args.precision)]
    seconds: dict[str, list[float]] = {mode: [] for mode in loops}
    order = list(loops)
    for rep in range(args.reps + 1):  # rep 0 is the warm-up block
        # A fixed order would always give one mode the slot after the same neighbour (its
        # allocator leftovers, its cache state); a seeded shuffle per rep spreads that evenly.
        random.Random(rep).shuffle(order)
        if world > 1:
            torch.distributed.broadcast_object_list(order, src=0)
        for mode in order:
            torch.nn.functional.linear = loops[mode].linear
            elapsed = loops[mode].run(stream, rep, rank, world)
            if rep:
                seconds[mode].append(elapsed)
    peak.append(matmul_flops(args.precision))
    tokens = args.steps * args.accum * args.micro_batch * args.seq_len * world
    flops_token = model_flops_per_token(build_path_model(shape), shape)
    result = {
        "world_size": world,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "device": torch.cuda.get_device_name() if bench_device().type == "cuda" else "cpu",
        "tokens_per_block": tokens,
        "steps_per_block": args.steps,
        "reps": args.reps,
        "seconds": seconds,
        # Each block against the plain block of the same rep (adjacent in time): drift cancels.
        "ratio_to_plain": {m: statistics.median(p / s for p, s in zip(seconds["plain"], seconds[m])) for m in seconds},
        # What a mode adds to each optimizer step, from the same paired blocks. ZeRO's extra work
        # (flat gradient buffers, its own norm, the master copy written back) is paid per step,
        # whatever the step's token count: this is the number that predicts other step sizes.
        "extra_seconds_per_step": {
            m: statistics.median((s - p) / args.steps for p, s in zip(seconds["plain"], seconds[m])) for m in seconds
        },
        "matmul_flops": max(peak),
        "model_flops_per_token": flops_token,
        "args": vars(args),
    }
    result.update(block_rates(seconds, tokens, args.steps, flops_token, result["matmul_flops"]))
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=2))
    close_distributed()  # as a path job ends (pipeline.train.train_path.main)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

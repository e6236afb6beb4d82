"""`train.precision`: the number format a path trains in, chosen by what this machine does well.

The same defaults are a trap on another host: bfloat16 autocast made the demo 1.3x faster on a CPU
with AVX-512 BF16, and 10x slower (4.8 s against 0.47 s a step) on an AVX2-only AMD EPYC, where
bfloat16 is emulated. So `auto` decides per machine:

- CUDA: bf16 where the GPU has it (`torch.cuda.is_bf16_supported()`), else fp16 with loss scaling.
- CPU without native bfloat16 (oneDNN says so): fp32, no measurement needed.
- CPU with native bfloat16: a few forward+backward+AdamW steps of the actual path model are timed
  in fp32 and bf16 at the rank's thread count, and the faster one wins. The timings are cached per
  host and model shape (`~/.cache/dipaco/precision.json`, or `$DIPACO_CACHE_DIR`), so a host pays
  for the probe once (a few seconds), not every run.

Every reduced precision goes through DeepSpeed's `torch_autocast` block: fp32 master weights and
optimizer state, the forward's matmuls in the low format (DeepSpeed adds a GradScaler for fp16).
The `ds_configs/` files therefore describe ZeRO only; `ds_blocks` writes the precision part.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from models.modular import ModelShape

log = logging.getLogger("dipaco.precision")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # DeepSpeed's torch_autocast.dtype names
PROBE_STEPS = 3  # timed steps per precision, after one warm-up step each; the median counts
CACHE_FILE = "precision.json"

# step seconds per precision, e.g. {"fp32": 0.29, "bf16": 0.21}
Probe = Callable[[], dict[str, float]]


@dataclass(frozen=True)
class Precision:
    """What a run trains in, and why (printed once per run, an MLflow param, in metrics.json)."""

    name: str  # fp32 | bf16 | fp16, never auto
    reason: str
    device: str  # cpu | cuda


def accelerator() -> str:
    """cuda or cpu: DS_ACCELERATOR when set (pipeline.train.distributed sets it per machine)."""
    named = os.environ.get("DS_ACCELERATOR")
    if named:
        return "cuda" if named == "cuda" else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_native_bf16() -> tuple[bool, str]:
    """(whether the CPU computes bfloat16 in hardware, torch's name for its vector ISA).

    oneDNN answers the first (AVX-512 BF16 or AMX on x86, BF16 extensions on Arm); without it
    bfloat16 matmuls are emulated in fp32 and cost more than fp32 itself."""
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return native, torch.backends.cpu.get_cpu_capability()


def resolve(
    train,
    shape: ModelShape,
    *,
    threads: int | None = None,
    device: str | None = None,
    native_bf16: tuple[bool, str] | None = None,
    probe: Probe | None = None,
    cache_dir: Path | None = None,
) -> Precision:
    """The precision of `train.precision` on this machine.

    `native_bf16` and `probe` default to asking the hardware; tests pass them to stand in for a
    CPU they do not have. A probe runs at most once per host, shape and thread count (cached)."""
    device = device or accelerator()
    wanted = train.precision
    if device == "cuda":
        return resolve_cuda(wanted)
    native, isa = native_bf16 if native_bf16 is not None else cpu_native_bf16()
    threads = threads or torch.get_num_threads()
    timings = lambda: cached_probe(train, shape, threads, probe, cache_dir)  # noqa: E731
    if wanted == "auto":
        if not native:
            return Precision("fp32", f"auto: this CPU ({isa}) has no native bfloat16, which would be emulated", device)
        seconds = timings()
        best = min(("fp32", "bf16"), key=lambda name: seconds[name])
        return Precision(
            best,
            f"auto: {_compare(seconds)} per step on this CPU ({isa}, native bfloat16, "
            f"{threads} threads), measured once and cached",
            device,
        )
    if wanted == "bf16" and not native:
        seconds = timings()
        log.warning(
            "train.precision is bf16 but this CPU (%s) has no native bfloat16: it is emulated, %s per "
            "step (%.1fx slower); train.precision: auto would choose fp32",
            isa,
            _compare(seconds),
            seconds["bf16"] / seconds["fp32"],
        )
        return Precision(
            "bf16", f"train.precision: bf16 (emulated on this CPU, {isa}: {_compare(seconds)} per step)", device
        )
    return Precision(wanted, f"train.precision: {wanted}", device)


def resolve_cuda(wanted: str) -> Precision:
    """On a CUDA device: the explicit precision, or auto's pick (bf16 where the GPU has it)."""
    if wanted != "auto":
        return Precision(wanted, f"train.precision: {wanted}", "cuda")
    if torch.cuda.is_bf16_supported():
        return Precision("bf16", f"auto: {torch.cuda.get_device_name()} supports bfloat16", "cuda")
    return Precision("fp16", f"auto: {torch.cuda.get_device_name()} has no bfloat16: fp16 with loss scaling", "cuda")


def _compare(seconds: dict[str, float]) -> str:
    return " vs ".join(f"{name} {seconds[name]:.3f} s" for name in ("bf16", "fp32"))


def ds_blocks(precision: Precision | str) -> dict:
    """The DeepSpeed config's precision blocks for a resolved precision (never auto)."""
    name = precision.name if isinstance(precision, Precision) else precision
    blocks: dict = {"fp16": {"enabled": False}, "bf16": {"enabled": False}}
    if name in AUTOCAST_DTYPES:
        blocks["torch_autocast"] = {"enabled": True, "dtype": AUTOCAST_DTYPES[name]}
    return blocks


# -- the probe and its cache ----------------------------------------------------------------------
def cache_path(cache_dir: Path | None = None) -> Path:
    base = cache_dir or Path(os.environ.get("DIPACO_CACHE_DIR") or Path.home() / ".cache" / "dipaco")
    return Path(base) / CACHE_FILE


def probe_key(train, shape: ModelShape, threads: int) -> str:
    """What a step time depends on: the host and its CPU, torch, the model shape, the batch and
    the thread count (an island of 1 thread and a run of 16 may choose differently)."""
    isa = torch.backends.cpu.get_cpu_capability()
    return json.dumps(
        {
            "host": socket.gethostname(),
            "isa": isa,
            "torch": torch.__version__,
            "threads": threads,
            "blocks": sum(shape.blocks_per_level) + shape.path_blocks,
            "hidden": shape.hidden_size,
            "heads": shape.num_heads,
            "intermediate": shape.intermediate_size,
            "vocab": shape.vocab_size,
            "seq_len": shape.max_positions,
            "micro_batch": train.micro_batch_size,
        },
        sort_keys=True,
    )


def cached_probe(
    train, shape: ModelShape, threads: int, probe: Probe | None = None, cache_dir: Path | None = None
) -> dict[str, float]:
    """Step seconds per precision for this host and shape: from the cache, or measured and cached."""
    path, key = cache_path(cache_dir), probe_key(train, shape, threads)
    entries = _read_cache(path)
    if key in entries:
        return entries[key]["seconds"]
    started = time.perf_counter()
    seconds = probe() if probe is not None else probe_step_seconds(train, shape, threads)
    log.info(
        "precision probe: %s per step (%.1f s to measure, cached in %s)",
        _compare(seconds),
        time.perf_counter() - started,
        path,
    )
    entries = _read_cache(path)  # another process may have added its own key meanwhile
    entries[key] = {"seconds": seconds, "measured_at": time.time()}
    _write_atomic(path, entries)
    return seconds


def probe_step_seconds(train, shape: ModelShape, threads: int, steps: int = PROBE_STEPS) -> dict[str, float]:
    """Median seconds of a forward, backward and AdamW step of a fresh path model, per precision.

    fp32 and bf16 steps alternate so that a neighbour's load on a shared machine hits both alike."""
    from models.modular import build_path_model

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng():  # the trainer's seeded RNG stream is left as it was
            model = build_path_model(shape, None, seed=0)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tokens = torch.randint(0, shape.vocab_size, (train.micro_batch_size, shape.max_positions + 1))
            times: dict[str, list[float]] = {"fp32": [], "bf16": []}
            for step in range(steps + 1):
                for name in times:
                    started = time.perf_counter()
                    _step(model, optimizer, tokens, name)
                    if step:  # the first step of each warms its kernels up
                        times[name].append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return {name: statistics.median(values) for name, values in times.items()}


def _step(model, optimizer, tokens: torch.Tensor, name: str) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "bf16"):
        logits = model(input_ids=tokens[:, :-1]).logits  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _read_cache(path: Path) -> dict:
    """The cache's entries; an unreadable or foreign file counts as empty (it is only a cache)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and _timings(v.get("seconds"))}


def _timings(value) -> bool:
    return (
        isinstance(value, dict)
        and set(value) >= {"fp32", "bf16"}
        and all(isinstance(v, (int, float)) and v > 0 for v in value.values())
    )


def _write_atomic(path: Path, data: dict) -> None:
    """Temp file + rename: a reader sees the old cache or the new one, never half of one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: the choice still stands, it is only measured again next time
        log.warning("precision cache %s not written: %s", path, exc)


def agree(precision: Precision | None, rank: int, world: int) -> Precision:
    """Rank 0's precision on every rank of an island (`precision` is None elsewhere): ranks that
    chose differently would all-reduce gradients of different dtypes, and only rank 0 probes.
    The choice goes out as an index into PRECISIONS, no pickle."""
    if world == 1:
        assert precision is not None
        return precision
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    index = torch.tensor([PRECISIONS.index(precision.name) if rank == 0 else 0], dtype=torch.long, device=device)
    dist.broadcast(index, 0)
    name = PRECISIONS[int(index.item())]
    return precision if rank == 0 else Precision(name, f"rank 0's choice ({name})", accelerator())

"""ZeRO wrapping, in one place: the model code knows nothing of DeepSpeed (STYLE.md, torchtitan).

The shipped `ds_configs/*.json` use `"auto"` values the way the Hugging Face integration does;
they are filled here from the run config so one JSON serves every model size and island width.
Parameters are read and written through DeepSpeed's full-fp32 accessors because DeepSpeed keeps
its own fp32 master copy: a plain write into a live engine is undone at the next step.
"""

from __future__ import annotations

import copy
import logging
import shutil
from typing import Any

import torch

from models.modular import ModelShape
from pipeline.core.bounds import load_json
from pipeline.core.config import read_config_text, resolve_ds_config
from pipeline.core.errors import ConfigError, CorruptStateError
from pipeline.state.module_store import decode, encode
from pipeline.train.distributed import init_distributed
from pipeline.train.precision import Precision, ds_blocks, resolve


def fill_ds_config(
    raw: dict[str, Any], train, shape: ModelShape, world_size: int, source: str, precision: Precision | str = "fp32"
) -> dict[str, Any]:
    """Replace every "auto" with the value our config implies, and write the precision blocks of
    the resolved `train.precision`; refuse contradictions by key."""
    hidden_size = shape.hidden_size
    config = copy.deepcopy(raw)
    for key in ("fp16", "bf16", "torch_autocast"):
        block = config.get(key)
        if isinstance(block, dict) and block.get("enabled", False) is not False:
            # one place decides the precision, per machine (pipeline/train/precision.py)
            raise ConfigError(
                f"{source}: remove the {key} block; set train.precision (auto, fp32, bf16 or fp16) instead"
            )
    config.update(ds_blocks(precision))
    batch = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "train_batch_size": train.micro_batch_size * train.gradient_accumulation_steps * world_size,
        "gradient_clipping": train.grad_clip,
    }
    for key, value in batch.items():
        given = config.get(key, "auto")
        if given == "auto":
            config[key] = value
        elif given != value:
            raise ConfigError(f'{source}: {key} is {given} but the run config implies {value}; use "auto"')
    zero = config.setdefault("zero_optimization", {"stage": 0})
    reduce_scatter = zero.get("reduce_scatter", True)  # DeepSpeed's default
    scatters = world_size > 1 if reduce_scatter == "auto" else reduce_scatter
    one_bucket = world_size == 1 and zero.get("stage", 0) in (1, 2)
    zero_auto = {
        # On one rank ZeRO-1/2 have nothing to reduce, yet they flush their gradient bucket (through
        # DeepSpeed's bookkeeping and a gloo call) each time it fills: ~116 times a step on the
        # demo's path with the HF integration's hidden² bucket. One bucket the size of the path
        # flushes once. Measured on an AVX2 EPYC, one process, the default path, 12 interleaved
        # steps against plain PyTorch: ZeRO-1 +33 ms a step instead of +127; ZeRO-2 within the
        # noise of the hidden² bucket there, -23 ms on the demo's path (benchmarks/RESULTS.md).
        # ZeRO-3 on one rank keeps a bucket as large as its largest tensor (+12 ms; the whole path,
        # +111): without the reduce-scatter it all-reduces only a bucket that holds its gradients,
        # and a gradient larger than the bucket goes back to the reduce-scatter. With more ranks:
        # hidden² (the HF integration's value) where ZeRO reduce-scatters. DeepSpeed's own default
        # is 5e8.
        "reduce_bucket_size": min(shape.parameter_count, int(5e8))
        if one_bucket
        else hidden_size * hidden_size
        if scatters
        else max(hidden_size * hidden_size, shape.largest_parameter),
        "allgather_bucket_size": int(5e8),
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        # DeepSpeed's memory-efficient linear lets ZeRO-3 free a gathered weight right after its
        # forward. On one rank nothing is gathered (every parameter is its own whole partition), so
        # it saves nothing there, yet it replaces torch.nn.functional.linear for the rest of the
        # process and slows the step (benchmarks/RESULTS.md). DeepSpeed's default (true) wherever
        # parameters are really partitioned.
        "memory_efficient_linear": world_size > 1,
        # ZeRO-3 averages gradients by a reduce-scatter, which on one rank scatters to itself: gloo
        # still copies every gradient through it (13 ms for the default path's 12.9M-element
        # embedding). Off, ZeRO-3 all-reduces its contiguous gradient bucket instead, a no-op on
        # one rank. DeepSpeed's default (true) wherever there is more than one rank to scatter to.
        "reduce_scatter": world_size > 1,
    }
    for key, value in list(zero.items()):
        if value == "auto":
            if key not in zero_auto:
                raise ConfigError(f'{source}: zero_optimization.{key} cannot be "auto"')
            zero[key] = zero_auto[key]
    if "checkpoint" in config:
        # DeepSpeed reads checkpoint.load_universal (and friends) at load time and then unpickles
        # what it finds there; dipaco saves and loads its own checkpoints without pickle.
        raise ConfigError(
            f"{source}: remove the checkpoint section; dipaco saves and loads the inner optimizer "
            f"state itself, and DeepSpeed's checkpoint options lead to a pickle load"
        )
    if "optimizer" in config:
        # A config-declared optimizer JIT-compiles FusedAdam/CPUAdam (~95 s on this CPU); the
        # trainer passes a torch AdamW instead, built from train.lr/betas/weight_decay.
        raise ConfigError(f"{source}: remove the optimizer section; dipaco passes torch AdamW from the train config")
    leftover = [k for k, v in _walk(config) if v == "auto"]
    if leftover:
        raise ConfigError(f'{source}: {leftover[0]} cannot be "auto"')
    return config


def load_ds_config(
    train, shape: ModelShape, world_size: int, precision: Precision | str | None = None
) -> dict[str, Any]:
    """The run's ds_config filled in; `precision` defaults to resolving train.precision here."""
    path = resolve_ds_config(train.ds_config)
    try:
        raw = load_json(read_config_text(path), str(path))
    except CorruptStateError as exc:  # not JSON, too deep, or not an object: the user's file, so a config error
        raise ConfigError(f"train.ds_config: {exc}") from None
    if precision is None:
        precision = resolve(train, shape)
    return fill_ds_config(raw, train, shape, world_size, str(path), precision)


def wrap_with_zero(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict[str, Any]):
    """deepspeed.initialize with our torch optimizer; returns the engine, loading checkpoints
    without unpickling code (see WeightsOnlyCheckpointEngine)."""
    import deepspeed
    from deepspeed.runtime import torch_autocast

    init_distributed()  # launched ranks join their group; anything else becomes a one-rank job
    # DeepSpeed records torch_autocast in module globals that only an autocast engine sets and
    # nothing clears: after one fp16 engine, every later fp32 engine of the process got a
    # GradScaler and stepped differently (the in-process launcher, the benchmarks, the tests).
    torch_autocast.TORCH_AUTOCAST_INITIALIZED, torch_autocast.TORCH_AUTOCAST_DTYPE = False, None
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    engine.checkpoint_engine = weights_only_checkpoint_engine(engine.checkpoint_engine)
    return engine


def release_engine(engine) -> None:
    """Free what a finished engine holds, so a process that trains path after path (the in-process
    launcher, the quality benchmark, the tests) does not keep every engine it ever built.

    `engine.destroy()` is DeepSpeed's release (hooks off, buffers dropped); without it each ZeRO-2
    engine of the toy path stayed alive (+120 MB per job; a quality benchmark's process, which
    trains every job of every variant in process, had reached 11 GB when it ran out of memory).
    ZeRO-3 also keeps each engine's parameter coordinator, and through it the model and its
    optimizer state, in an unbounded `functools.lru_cache` on a method
    (`PartitionedParameterCoordinator.__params_to_release`); clearing that cache only makes a live
    engine recompute which parameters a submodule releases. And every ZeRO-3 engine pushes its
    model onto a module-level stack (`parameter_offload.FWD_MODULE_STACK`) that nothing pops.
    """
    module = engine.module
    engine.destroy()
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    method = getattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release", None)
    for cell in getattr(method, "__closure__", None) or ():  # DeepSpeed's NVTX wrapper hides the cache
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", [])  # each ZeRO-3 engine pushes its model, never pops
    stack[:] = [entry for entry in stack if entry is not module]


def weights_only_checkpoint_engine(original):
    """DeepSpeed's checkpoint engine, but `torch.load(weights_only=True)`.

    DeepSpeed 0.19 loads its own checkpoints with `weights_only=False`, i.e. full pickle: a
    tampered optimizer-state file could run code. Its files hold tensors, plain containers and
    three small DeepSpeed classes, which are allow-listed here and nothing else.
    """
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed = [LossScaler, ZeroStageEnum, fragment_address]

    class WeightsOnlyCheckpointEngine(type(original)):
        def load(self, path, map_location=None):
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

    if not isinstance(original, TorchCheckpointEngine):
        return original  # another engine (e.g. Nebula) keeps its own loader
    original.__class__ = WeightsOnlyCheckpointEngine
    return original


def full_state(engine) -> dict[str, torch.Tensor]:
    """Every parameter as a full fp32 tensor on every rank (a collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    state = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)
        state[name] = (full if full is not None else param.detach()).detach().cpu().clone()
    return state


def set_full_state(engine, state: dict[str, torch.Tensor]) -> None:
    """Write parameters so that they persist: DeepSpeed's master copy and the module's tensors.

    Call on every rank. A plain write into `param.data` is undone at the next step (docs/design.md,
    known traps); a path's inner state between rounds holds no weights, so resuming needs none.
    """
    from deepspeed.utils import safe_set_full_fp32_param

    stage = engine.zero_optimization_stage()
    for name, param in engine.module.named_parameters():
        value = state[name].to(torch.float32)
        if stage > 0:
            safe_set_full_fp32_param(param, value)
        if stage < 3:
            with torch.no_grad():
                param.data.copy_(value.to(param.dtype))


def _walk(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), node


# -- the inner optimizer state between rounds ----------------------------------------------------
# A path's inner optimizer state between rounds: what the torch optimizer under DeepSpeed holds
# for this rank (AdamW's step and moments over its ZeRO partition), in safetensors, one file a rank.
#
# Why not DeepSpeed's own checkpoint, which this replaced: the next round starts from the merged
# modules, so the module weights and fp32 master weights a DeepSpeed checkpoint also carries are
# overwritten the moment they were loaded (set_full_state). They were ~half its bytes, carried up to
# an object store every round and down the next (benchmarks/RESULTS.md, "Object-store run roots"),
# and the checkpoint was a pickle in the run root beside a copy of DeepSpeed's zero_to_fp32.py. The
# moments alone are data: safetensors, verified against the directory's `_SUCCESS`, and loading them
# leaves the engine's weights (built from the merged modules) untouched.
#
# The partition a rank's optimizer holds depends on the world size and ZeRO stage, which the
# directory's `_SUCCESS` records; resume_inner_state restarts the optimizer when they differ.
OPTIMIZER_STATE_FORMAT = "dipaco-optimizer-state-1"  # in its _SUCCESS: older runs kept DeepSpeed checkpoints
_SCALAR = ".scalar"  # a state entry that was a Python number, stored as a 0-d float64 tensor


def optimizer_state_file(rank: int) -> str:
    return f"optimizer-rank-{rank:05d}.safetensors"


def optimizer_state_files(world_size: int) -> list[str]:
    """Every rank's file: rank 0 names them in the commit without listing the store."""
    return [optimizer_state_file(rank) for rank in range(world_size)]


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed steps: inside its ZeRO (or bf16) wrapper, or the engine's own."""
    optimizer = engine.optimizer
    base = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(base, torch.optim.Optimizer):
        raise TypeError(f"DeepSpeed's optimizer {type(optimizer).__name__} wraps no torch optimizer")
    return base


# Where DeepSpeed's ZeRO wrappers keep the fp32 tensors the torch optimizer steps, in a fixed order:
# ZeRO-3 hands each to the optimizer only for the length of a step (its param_groups are empty
# otherwise), ZeRO-1/2 keep one flat partition per group.
_FLAT_PARTITIONS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups")


def _params(engine) -> list[torch.Tensor]:
    """The tensors this rank's optimizer keeps state for, in an order every process agrees on."""
    for attr in _FLAT_PARTITIONS:
        flat = getattr(engine.optimizer, attr, None)
        if flat:
            return list(flat)
    return [param for group in base_optimizer(engine).param_groups for param in group["params"]]


def optimizer_state_bytes(engine) -> bytes:
    """This rank's optimizer state as safetensors bytes: `<index>.<key>` for each parameter of the
    optimizer (in param_groups order) and each entry of its state (step, exp_avg, exp_avg_sq)."""
    optimizer, params = base_optimizer(engine), _params(engine)
    unknown = len(optimizer.state) - sum(param in optimizer.state for param in params)
    if unknown:  # never a file that silently leaves state behind (ZeRO-3's empty param_groups did)
        raise TypeError(f"the optimizer holds state for {unknown} tensor(s) outside its known partitions")
    tensors: dict[str, torch.Tensor] = {}
    for index, param in enumerate(params):
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().cpu().clone()
            elif isinstance(value, (int, float)):
                tensors[f"{index}.{key}{_SCALAR}"] = torch.tensor(float(value), dtype=torch.float64)
            else:
                raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}, not a tensor or number")
    return encode(tensors, {"format": OPTIMIZER_STATE_FORMAT})


def read_optimizer_state(engine, data: bytes | bytearray, where: str) -> dict[torch.Tensor, dict[str, object]]:
    """Decode and check a saved state against this rank's optimizer, touching nothing yet: a file
    for another partition (its moments' shapes differ) or with entries past its parameters is a
    CorruptStateError naming it."""
    params = _params(engine)
    state: dict[torch.Tensor, dict[str, object]] = {}
    for name, tensor in decode(data, where).items():
        index, _, key = name.partition(".")
        if not index.isdigit() or int(index) >= len(params) or not key:
            raise CorruptStateError(f"{where}: entry {name!r} names no parameter of this optimizer ({len(params)})")
        param = params[int(index)]
        if key.endswith(_SCALAR):
            state.setdefault(param, {})[key.removesuffix(_SCALAR)] = tensor.item()
            continue
        if tensor.dim() > 0 and tensor.shape != param.shape:
            raise CorruptStateError(
                f"{where}: {name} has shape {list(tensor.shape)}, this rank's parameter {list(param.shape)} "
                f"(saved for another partition of the optimizer)"
            )
        state.setdefault(param, {})[key] = tensor
    return state


def load_optimizer_state(engine, state: dict[torch.Tensor, dict[str, object]]) -> None:
    """Put a state `read_optimizer_state` returned into the optimizer. Tensors the optimizer already holds are
    filled in place (DeepSpeed's ZeRO keeps references to them, as its own loader does), others set."""
    optimizer = base_optimizer(engine)
    for param, entries in state.items():
        held = optimizer.state[param]
        for key, value in entries.items():
            current = held.get(key)
            if torch.is_tensor(value) and torch.is_tensor(current) and current.shape == value.shape:
                with torch.no_grad():
                    current.copy_(value)
            elif torch.is_tensor(value):
                held[key] = value.to(param.device) if value.dim() > 0 else value
            else:
                held[key] = value


# -- train.compile ------------------------------------------------------------------------------
# `train.compile`: torch.compile (inductor) of the path model's forward, where it pays.
#
# Measured on the demo's path (hidden 128, 4 blocks, vocab 4,096, 8 x 256 tokens), one rank, one
# thread, ZeRO-2, median of 12 steps, on a Xeon with AVX-512 BF16: bf16 autocast 0.295 -> 0.238 s per
# step (-19%), fp32 0.335 -> 0.286 s (-15%). On a 2-core AMD EPYC with AVX2 only, in fp32 (what auto
# picks there): one process, medians of 24 steps, eager 0.454 s and compiled 0.461 s; two at once, as the
# demo's islands run, 0.41-0.43 s both; in the demo itself, 200-step tasks of rounds 1-3 took 100.2 s
# compiled and 102.7 s eager (means of 6), within the run-to-run noise, while round 0 took 152 s compiled
# (the first compile on that host) against 113 s eager. On a 2-core AMD EPYC Zen 4 (AVX-512 and
# AVX-512 BF16, no AMX), in bf16 (what auto picks there), the demo's 200-step tasks of rounds 1-3 took
# 51.5-52.9 s compiled and 53.9-57.9 s eager (-7%), while round 0 took 93 s compiled (the first compile)
# against 58 s eager: the whole demo 6m08s compiled, 5m30s eager, so there 800 steps do not win back a
# first compile. Compiling costs ~30 s the first time on a host
# and ~5 s in a later process (inductor keeps its kernels on disk); a second path model in the same
# island process reused the compiled code. Fused or foreach AdamW gained nothing measurable (0.286-0.292
# s against 0.292 s): ZeRO hands the optimizer one flat tensor per group, so there is no per-tensor loop
# to remove.
#
# `auto` therefore compiles where it measured faster by more than a first compile costs: on a CPU
# with AVX-512 and AMX (AMX is what tells the Xeon where it paid from the Zen 4 where it did not;
# why it paid there, faster matmuls leaving the unfused elementwise work a larger share of the
# step, is a guess), and on CUDA (a small path's step there is bound by kernel launches, which
# compiling fuses). An AVX-512 CPU without AMX (AMD Zen 4; Xeons before AMX, not measured) trains
# eagerly; `train.compile: true` compiles anywhere.
#
# Only the forward is replaced (`model.forward = torch.compile(model.forward)`), so parameter names,
# the state dict and DeepSpeed's hooks stay those of the plain module.
_log = logging.getLogger("dipaco.train")
_TOLD: set[str] = set()  # the auto decisions this process has logged


def compile_choice(
    train, device: str | None = None, isa: str | None = None, amx: bool | None = None
) -> tuple[bool, str]:
    """(whether train.compile compiles on this machine, why); `device`/`isa`/`amx` stand in for
    the hardware in tests."""
    wanted = train.compile
    if wanted is not True and wanted is not False and wanted != "auto":
        raise ConfigError(f"train.compile is {wanted!r}; use true, false or auto")
    if wanted != "auto":
        return bool(wanted), f"train.compile: {str(wanted).lower()}"
    from pipeline.train.precision import accelerator

    device = device or accelerator()
    if device == "cuda":
        return True, "auto: CUDA, where a small path's step is bound by kernel launches"
    isa = isa or torch.backends.cpu.get_cpu_capability()
    if amx is None:  # a private torch helper (2.13); a torch without it reports no AMX: eager, the safe side
        amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    if isa.upper().startswith("AVX512"):
        if amx:
            return True, f"auto: this CPU ({isa} with AMX) runs inductor's kernels 15-19% faster per step"
        return False, (
            f"auto: on this CPU ({isa}, no AMX) compiled steps measured 7% faster, less than a first "
            "compile's ~40 s wins back over a run"
        )
    return False, f"auto: on this CPU ({isa}) compiled steps measured no faster than eager; a first compile costs ~40 s"


def compile_forward(model: torch.nn.Module, train, ds_config: dict) -> bool:
    """Compile `model.forward` in place when train.compile asks (or auto finds it pays) and it can
    work; True if it did."""
    wanted, reason = compile_choice(train)
    if not wanted:
        if train.compile == "auto" and reason not in _TOLD:  # once per island process, not per task
            _TOLD.add(reason)
            _log.info("train.compile: eager (%s)", reason)
        return False
    if ds_config.get("zero_optimization", {}).get("stage", 0) >= 3:
        # not measured under ZeRO-3, whose gather/release hooks on every block split the graph
        _log.info("train.compile: skipped under ZeRO-3; training eagerly")
        return False
    if not torch.cuda.is_available() and shutil.which("g++") is None and shutil.which("c++") is None:
        _log.warning("train.compile: inductor needs a C++ compiler on the CPU (none on PATH); training eagerly")
        return False
    from torch import _dynamo

    if reason not in _TOLD:
        _TOLD.add(reason)
        _log.info("train.compile: compiling the forward (%s)", reason)
    _dynamo.config.suppress_errors = True  # a backend failure falls back to eager, never fails a path
    model.forward = torch.compile(model.forward)
    return True

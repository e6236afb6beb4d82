"""A path's inner optimizer state between rounds: what the torch optimizer under DeepSpeed holds
for this rank (AdamW's step and moments over its ZeRO partition), in safetensors, one file a rank.

Why not DeepSpeed's own checkpoint, which this replaced: the next round starts from the merged
modules, so the module weights and fp32 master weights a DeepSpeed checkpoint also carries are
overwritten the moment they were loaded (zero.set_full_state). They were ~half its bytes, carried up to
an object store every round and down the next (benchmarks/RESULTS.md, "Object-store run roots"),
and the checkpoint was a pickle in the run root beside a copy of DeepSpeed's zero_to_fp32.py. The
moments alone are data: safetensors, verified against the directory's `_SUCCESS`, and loading them
leaves the engine's weights (built from the merged modules) untouched.

The partition a rank's optimizer holds depends on the world size and ZeRO stage, which the
directory's `_SUCCESS` records; resume_inner_state restarts the optimizer when they differ."""

from __future__ import annotations

import torch

from pipeline.core.errors import CorruptStateError
from pipeline.state.module_store import decode, encode

FORMAT = "dipaco-optimizer-state-1"  # in the directory's _SUCCESS: older runs kept DeepSpeed checkpoints
_SCALAR = ".scalar"  # a state entry that was a Python number, stored as a 0-d float64 tensor


def rank_file(rank: int) -> str:
    return f"optimizer-rank-{rank:05d}.safetensors"


def files(world_size: int) -> list[str]:
    """Every rank's file: rank 0 names them in the commit without listing the store."""
    return [rank_file(rank) for rank in range(world_size)]


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


def to_bytes(engine) -> bytes:
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
    return encode(tensors, {"format": FORMAT})


def read(engine, data: bytes | bytearray, where: str) -> dict[torch.Tensor, dict[str, object]]:
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


def load(engine, state: dict[torch.Tensor, dict[str, object]]) -> None:
    """Put a state `read` returned into the optimizer. Tensors the optimizer already holds are
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

"""Compressed outer gradients: what an island sends for the merge (`outer.compression`).

The outer gradient delta = start - end of one module (a dict of tensors) is what crosses the
network between poorly connected islands once per round, so it is what is worth compressing.
Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512 §3) reports outer gradients quantised
to 4 bits with no loss in quality; DiPaCo exchanges the same per-module deltas.

Encodings, each a dict of safetensors-compatible tensors keyed `<name>` or `<name>:<part>`:

  none  the fp32 tensor as it is (also the "lossless" form of a module that must stay exact)
  bf16  the tensor cast to bfloat16: |x - x'| <= 2^-8 |x| (round to nearest, 8 significant bits)
  int8  symmetric absmax quantisation per block of BLOCK consecutive elements of the flattened
        tensor: scale_b = max|x| / 127 over block b (fp32), q = round(x / scale_b) in [-127, 127];
        |x - q * scale_b| <= scale_b / 2 (up to fp32 rounding), an all-zero block is exact
  int4  as int8 with 7 levels each side, q in [-7, 7], |x - q * scale_b| <= scale_b / 2 with
        scale_b = max|x| / 7; two values per uint8 (q + 8 in the low nibble for even positions,
        the high nibble for odd ones), the tensor's shape kept as an int64 tensor

Bytes per element: 4 (none), 2 (bf16), 1 + 4/BLOCK (int8), 1/2 + 4/BLOCK (int4). The functions
are pure and deterministic, so a rerun path job writes the same bytes and a rerun merge reads them.
"""

from __future__ import annotations

import math

import torch

KINDS = ("none", "bf16", "int8", "int4")
BLOCK = 128  # elements per scale: 3% overhead in int8 (6% in int4), and a rare outlier only
#              coarsens its own 128 neighbours
LEVELS = {"int8": 127, "int4": 7}  # largest |q|: symmetric, so zero is exact and no code is wasted
SCALE, CODES, SHAPE = "scale", "q", "shape"

Tensors = dict[str, torch.Tensor]


def encode(grad: Tensors, kind: str) -> Tensors:
    """One module's outer gradient -> the tensors that store it in `kind` (see the module doc)."""
    if kind not in KINDS:
        raise ValueError(f"unknown compression {kind!r}: expected one of {', '.join(KINDS)}")
    out: Tensors = {}
    for name, tensor in grad.items():
        x = tensor.detach().float()
        if kind == "none":
            out[name] = x
        elif kind == "bf16":
            out[name] = x.to(torch.bfloat16)
        else:
            out.update({f"{name}:{part}": t for part, t in quantise(x, LEVELS[kind]).items()})
    return out


def decode(stored: Tensors, kind: str) -> Tensors:
    """The tensors `encode` wrote -> fp32 outer gradient tensors, in the order they were stored."""
    if kind not in KINDS:
        raise ValueError(f"unknown compression {kind!r}: expected one of {', '.join(KINDS)}")
    if kind in ("none", "bf16"):
        return {name: t.float() for name, t in stored.items()}
    names = [key.rsplit(":", 1)[0] for key in stored if key.endswith(f":{SCALE}")]
    missing = [f"{n}:{p}" for n in names for p in (CODES, SHAPE) if f"{n}:{p}" not in stored]
    if missing or len(stored) != 3 * len(names):
        raise ValueError(
            f"not an {kind} outer gradient: expected <name>:{CODES}, :{SCALE}, :{SHAPE} per tensor"
            + (f", missing {missing[:3]}" if missing else "")
        )
    return {
        n: dequantise(stored[f"{n}:{CODES}"], stored[f"{n}:{SCALE}"], stored[f"{n}:{SHAPE}"], LEVELS[kind])
        for n in names
    }


def quantise(x: torch.Tensor, levels: int) -> Tensors:
    """Symmetric absmax quantisation per block: {q: codes, scale: fp32 per block, shape: int64}."""
    flat = x.reshape(-1)
    blocks = _padded(flat).view(-1, BLOCK)  # (n_blocks, BLOCK)
    scale = blocks.abs().amax(dim=1) / levels  # (n_blocks,)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block stays all zero
    q = torch.round(blocks / safe[:, None]).clamp_(-levels, levels).to(torch.int8).view(-1)[: flat.numel()]
    codes = q if levels > 7 else _pack_nibbles(q)
    return {CODES: codes, SCALE: scale, SHAPE: torch.tensor(list(x.shape), dtype=torch.int64)}


def dequantise(codes: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes and per-block scales -> the fp32 tensor q * scale_b in its stored shape."""
    dims = [int(d) for d in shape.tolist()]
    count = math.prod(dims)
    q = codes.to(torch.int8) if levels > 7 else _unpack_nibbles(codes, count)
    if q.numel() != count or scale.numel() != -(-count // BLOCK):
        raise ValueError(f"codes ({q.numel()}) or scales ({scale.numel()}) do not fit shape {dims}")
    blocks = _padded(q.float()).view(-1, BLOCK) * scale.float()[:, None]  # (n_blocks, BLOCK)
    return blocks.view(-1)[:count].reshape(dims)


def error_bound(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Per element, the largest |x - decode(encode(x))| the encoding allows (rounding of fp32
    arithmetic aside): half a quantisation step of the element's block, or bf16's half ulp."""
    if kind == "none":
        return torch.zeros_like(x, dtype=torch.float32)
    if kind == "bf16":
        return x.float().abs() * 2.0**-8
    flat = x.float().reshape(-1)
    step = _padded(flat).view(-1, BLOCK).abs().amax(dim=1) / LEVELS[kind]  # (n_blocks,)
    return (step / 2).repeat_interleave(BLOCK)[: flat.numel()].reshape(x.shape)


def stored_bytes(stored: Tensors) -> int:
    """Bytes of the tensors' data (a safetensors file adds its JSON header)."""
    return sum(t.numel() * t.element_size() for t in stored.values())


def _padded(flat: torch.Tensor) -> torch.Tensor:
    """The flattened tensor with zeros up to a whole number of blocks (zeros change no absmax)."""
    return torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] -> uint8, two a byte: q + 8 (1..15) in the low nibble for even
    positions, the high nibble for odd ones (an odd count pads with a zero nibble)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    u = torch.nn.functional.pad(u, (0, u.numel() % 2))
    return u[0::2] | (u[1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor, count: int) -> torch.Tensor:
    u = packed.to(torch.uint8)
    pairs = torch.stack([u & 0x0F, u >> 4], dim=1).view(-1)[:count]  # (2 * bytes,) -> (count,)
    return pairs.to(torch.int16).sub_(8).to(torch.int8)

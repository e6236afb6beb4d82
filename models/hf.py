"""Hugging Face checkpoints in and out, through models/modular.py's key map.

In: a `save_pretrained` directory (config.json, model.safetensors or its index and shards) -> one
state per level of a path (`read_config`, `checkpoint_shape`, `load_checkpoint`,
`checkpoint_to_modules`). Out: a path's modules -> a `save_pretrained` directory that
`AutoModelForCausalLM.from_pretrained` reads (`path_to_hf`, `save_path`). As in transformers' own
`convert_*_to_hf.py` scripts the map is the contract: a table of the tensors a decoder block holds
(BLOCK_TENSORS), a loop over the layers, and every name and shape checked against the safetensors
headers before a byte of weights is read. Only safetensors are read: `pytorch_model.bin` is a
pickle, which runs code when it is loaded, so it is refused unopened.

Errors are CheckpointError (a ValueError): one line naming the directory and what is wrong; the
pipeline turns it into exit status 2.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from models.modular import (
    EMBED,
    HEAD,
    NORM,
    ModelShape,
    ModuleState,
    assemble_path_state,
    build_path_model,
    split_path_state,
)

# config.json's architectures[0] -> model_type: the Llama-shaped families (models/modular.py MODEL_CLASSES).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
# The tensors of decoder block i, under `model.layers.<i>.`: the key map's table. Biases are the
# family's (Qwen2: q/k/v always) or the config's (Llama: attention_bias adds o too, mlp_bias).
BLOCK_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
MLP_BIASES = ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")
CONFIG, SAFETENSORS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.ckpt.index", "tf_model.h5")
TOKENIZER_FILE = "tokenizer.json"
MAX_JSON_BYTES = 16 << 20  # config.json, the shard index, the tokenizer's small files
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on a header
DEFAULT_SHARD_SIZE = "2GB"  # save_path: model.safetensors is split into shards above this


class CheckpointError(ValueError):
    """A checkpoint that cannot start a run: one line naming the directory and what is wrong."""


def _read_json(path: Path) -> dict:
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_JSON_BYTES + 1)
        value = json.loads(data) if len(data) <= MAX_JSON_BYTES else None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON ({str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object of at most {MAX_JSON_BYTES:,} bytes")
    return value


def read_config(directory: str | Path) -> dict:
    """config.json of a checkpoint of a supported family; refuses any other architecture by name."""
    directory = Path(directory)
    if not (directory / CONFIG).is_file():
        raise CheckpointError(f"{directory}: no {CONFIG} (not a Hugging Face checkpoint directory)")
    config = _read_json(directory / CONFIG)
    names = config.get("architectures") or []
    name = names[0] if isinstance(names, list) and names else config.get("model_type")
    if name not in ARCHITECTURES or config.get("model_type") != ARCHITECTURES[name]:
        raise CheckpointError(
            f"{directory / CONFIG}: architecture {str(name)[:80]!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return config


def checkpoint_shape(
    config: dict, blocks_per_level: list[int], path_blocks: int, seq_len: int, where: str = "checkpoint"
) -> ModelShape:
    """The path's shape from the checkpoint: its layers split over the levels as `blocks_per_level`
    (then `path_blocks` private ones) asks, every other dimension the checkpoint's."""
    layers = config.get("num_hidden_layers")
    wanted = sum(blocks_per_level) + path_blocks
    if layers != wanted:
        private = f" + model.path_specific_blocks {path_blocks}" if path_blocks else ""
        raise CheckpointError(
            f"{where}: the checkpoint's {layers} layers do not split as model.blocks_per_level "
            f"{list(blocks_per_level)}{private} asks ({wanted} blocks)"
        )
    return ModelShape.from_checkpoint(config, blocks_per_level, path_blocks, seq_len)


def expected_tensors(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor a path of this shape holds, by Hugging Face name: the table expanded over the
    layers, checked against a meta-device model of the family (no memory)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = shape.model_class(shape.llama_config())
    found = {name: tuple(p.shape) for name, p in model.named_parameters()}
    settings = json.loads(shape.hf) if shape.hf else {}
    per_block = list(BLOCK_TENSORS)
    if settings.get("model_type") == "qwen2" or settings.get("attention_bias"):
        per_block += QKV_BIASES + (("self_attn.o_proj.bias",) if settings.get("attention_bias") else ())
    if settings.get("mlp_bias"):
        per_block += MLP_BIASES
    table = {EMBED, NORM, HEAD} | {
        f"model.layers.{i}.{name}" for i in range(sum(shape.module_blocks)) for name in per_block
    }
    if table != found.keys():  # the table is the contract: a family that grew a tensor must be added to it
        raise CheckpointError(
            f"key map out of date for {shape.model_class.__name__}: {sorted(table ^ found.keys())[:3]}"
        )
    return found


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (one, or the shards its index names); a pickle is refused unread."""
    directory = Path(directory)
    if (directory / INDEX).is_file():
        index = _read_json(directory / INDEX).get("weight_map")
        if not isinstance(index, dict) or not all(isinstance(f, str) and "/" not in f for f in index.values()):
            raise CheckpointError(f"{directory / INDEX}: weight_map must map tensor names to shard files beside it")
        files = [directory / name for name in sorted(set(index.values()))]
    elif (directory / SAFETENSORS).is_file():
        files = [directory / SAFETENSORS]
    else:
        pickles = [name for name in PICKLES if (directory / name).exists()]
        if pickles:
            raise CheckpointError(
                f"{directory / pickles[0]}: pickle weights are never loaded (unpickling runs code); convert them "
                f"to safetensors (e.g. from_pretrained(...).save_pretrained(dir, safe_serialization=True) where "
                f"you trust the file)"
            )
        raise CheckpointError(f"{directory}: no {SAFETENSORS} or {INDEX}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{directory}: shard {missing[0]} named in {INDEX} is missing")
    return files


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors file's tensors: name -> (dtype, shape), from its header alone (no weights read)."""
    try:
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"header of {size:,} bytes")
            header = json.loads(handle.read(size))
        return {
            name: (entry["dtype"], tuple(int(d) for d in entry["shape"]))
            for name, entry in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file ({str(exc)[:200]})") from None


def check_checkpoint(directory: str | Path, shape: ModelShape) -> list[Path]:
    """The weight files, once every tensor name and shape in their headers is what config.json
    gives (a tied checkpoint may leave the head out: it is the embedding's copy)."""
    files = weight_files(directory)
    found: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for path in files:
        for name, (_, dims) in read_header(path).items():
            found[name], where[name] = dims, path
    expected = expected_tensors(shape)
    tied = bool(json.loads(shape.hf or "{}").get("tie_word_embeddings"))
    for name, dims in expected.items():
        if name not in found:
            if name == HEAD and tied:
                continue
            raise CheckpointError(f"{directory}: tensor {name} is missing from the safetensors files")
        if found[name] != dims:
            raise CheckpointError(
                f"{where[name]}: tensor {name} has shape {list(found[name])}, {CONFIG} gives {list(dims)}"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise CheckpointError(f"{where[extra[0]]}: tensor {extra[0]} belongs to no module of a {CONFIG} path")
    return files


def load_checkpoint(directory: str | Path, shape: ModelShape) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as a path's state dict in fp32 (the trainer's master weights), after
    check_checkpoint; a tied head becomes a copy of the embedding (they belong to different levels)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in check_checkpoint(directory, shape):
        state.update(load_file(str(path)))
    state = {name: t.float() if t.is_floating_point() else t for name, t in state.items()}
    if HEAD not in state:
        state[HEAD] = state[EMBED].clone()
    return state


def checkpoint_to_modules(shape: ModelShape, state: dict[str, torch.Tensor]) -> list[ModuleState]:
    """A checkpoint's state dict -> one module state per level (models/modular.py's key map)."""
    return split_path_state(shape, state)


def path_to_hf(shape: ModelShape, modules: list[ModuleState]):
    """One module state per level -> (a Hugging Face state dict, its transformers config)."""
    config = shape.llama_config()
    config.architectures = [shape.model_class.__name__]
    return assemble_path_state(shape, modules), config


def save_path(
    directory: str | Path,
    shape: ModelShape,
    modules: list[ModuleState],
    tokenizer=None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
) -> Path:
    """A path as a `save_pretrained` directory: config.json, model.safetensors (sharded above
    max_shard_size), generation_config.json (end of text = the run's EOS) and, given one, the tokenizer."""
    from transformers import GenerationConfig

    model = build_path_model(shape, modules)
    model.config.architectures = [shape.model_class.__name__]
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=shape.eos_id,
        pad_token_id=shape.eos_id,
    )
    model.save_pretrained(str(directory), max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return Path(directory)

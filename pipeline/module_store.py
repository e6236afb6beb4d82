"""Module parameters and outer-optimizer state per round, as safetensors under the run root.

`rounds/round=<r>/modules/level=<l>/module=<k>.safetensors` holds a module at the start of
round r; the directory's `_SUCCESS` records each file's checksum and the module map, so every
load is verified and a corrupted file is refused by name (never unpickled: safetensors is data).
"""

from __future__ import annotations

import json
import posixpath

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from models.grid import ModuleKey, all_modules, parse_path_id, path_modules
from models.modular import ModelShape, ModuleState, build_path_model, initial_level_states
from pipeline import layout
from pipeline.errors import CorruptStateError
from pipeline.storage import RunRoot, map_io


def encode(state: ModuleState, metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes, bitwise-reproducible: the metadata goes in as one sorted-JSON entry
    (safetensors orders several entries arbitrarily), so a rerun merge writes identical files."""
    header = {"dipaco": json.dumps(metadata, sort_keys=True)} if metadata else None
    return st_save({k: v.detach().contiguous().cpu() for k, v in state.items()}, metadata=header)


def decode(data: bytes, where: str) -> ModuleState:
    try:
        return st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CorruptStateError(f"{where}: not a valid safetensors file ({exc})") from None


def write_states(root: RunRoot, rel_dir: str, states: dict[ModuleKey, ModuleState], info: dict) -> None:
    """Write one safetensors file per module (several at once), then commit the directory."""

    def write(key: ModuleKey) -> None:
        meta = {"level": str(key.level), "module": str(key.index), **{k: str(v) for k, v in info.items()}}
        root.write_bytes(posixpath.join(rel_dir, layout.module_file(key)), encode(states[key], meta))

    map_io(write, sorted(states))
    root.commit(rel_dir, info={**info, "modules": [[k.level, k.index] for k in sorted(states)]})


def read_state(root: RunRoot, rel_dir: str, key: ModuleKey) -> ModuleState:
    name = layout.module_file(key)
    return decode(root.read_committed(rel_dir, name), root.path(rel_dir, name))


def init_modules(root: RunRoot, model_config, grid: list[int]) -> bool:
    """Write round 0 from the seed unless it is committed already; True when it wrote."""
    if root.is_committed(layout.modules_dir(0)):
        return False
    shape = ModelShape.from_config(model_config)
    levels = initial_level_states(shape, seed=model_config.init_seed)
    states = {key: {k: v.clone() for k, v in levels[key.level].items()} for key in all_modules(grid)}
    write_states(root, layout.modules_dir(0), states, {"round": 0, "grid": list(grid), "seed": model_config.init_seed})
    return True


def load_modules(root: RunRoot, round_index: int, keys: list[ModuleKey]) -> dict[ModuleKey, ModuleState]:
    rel = layout.modules_dir(round_index)
    return dict(zip(keys, map_io(lambda key: read_state(root, rel, key), keys)))


def load_path_modules(root: RunRoot, round_index: int, modules: tuple[int, ...]) -> list[ModuleState]:
    keys = path_modules(modules)
    loaded = load_modules(root, round_index, keys)
    return [loaded[key] for key in keys]


def load_path_model(root: RunRoot, config, round_index: int, path_id: str) -> torch.nn.Module:
    """The LlamaForCausalLM of one path at the start of a round (for evaluation and inference)."""
    modules = parse_path_id(path_id, config.model.grid)
    shape = ModelShape.from_config(config.model)
    return build_path_model(shape, load_path_modules(root, round_index, modules))


def load_outer_state(root: RunRoot, round_index: int, keys: list[ModuleKey]) -> dict[ModuleKey, ModuleState]:
    """Momentum buffers at the start of a round; modules without a buffer yet are absent."""
    rel = layout.outer_state_dir(round_index)
    if not root.is_committed(rel):
        return {}
    listed = root.marker(rel)["files"]
    present = [key for key in keys if layout.module_file(key) in listed]
    return dict(zip(present, map_io(lambda key: read_state(root, rel, key), present)))

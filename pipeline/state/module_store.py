"""Module parameters and outer-optimizer state per round, as safetensors under the run root.

`rounds/round=<r>/modules/level=<l>/module=<k>.safetensors` holds a module at the start of
round r (with `model.path_specific_blocks`, level=<len(grid)>/module=<path index> holds a path's
private blocks: models/grid.py); the directory's `_SUCCESS` records each file's checksum and the module map, so every
load is verified and a corrupted file is refused by name (never unpickled: safetensors is data).

A path's weights (model.safetensors) are read by level too: its commit records, in its `_SUCCESS`
(`parts`), each level's byte runs with their CRC-32 (level_runs), and a merge of one module reads
only those (RunRoot.read_committed_runs, decode_runs). Across hosts that read is on the round's
critical path: the island that published first reads the last path before its next round starts,
and in the demo the level two paths share is 3.8 of the file's 7.6 MB (0.6 s at 50 Mbit/s). Where
the record does not serve (none, malformed, a run that does not match), the file is read whole.
"""

from __future__ import annotations

import functools
import json
import math
import posixpath
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from models.grid import ModuleKey, all_modules, parse_path_id, path_modules
from models.modular import ModelShape, ModuleState, build_path_model, initial_level_states, path_state, split_path_state
from pipeline.core.bounds import MAX_JSON_DEPTH, SHOWN_CHARS, one_line, shown, too_deep
from pipeline.core.config import Config
from pipeline.core.errors import CorruptStateError
from pipeline.state import layout
from pipeline.state.storage import RunRoot, checksum_bytes, map_io


def encode(state: ModuleState, metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes, bitwise-reproducible: the metadata goes in as one sorted-JSON entry
    (safetensors orders several entries arbitrarily), so a rerun merge writes identical files."""
    header = {"dipaco": json.dumps(metadata, sort_keys=True)} if metadata else None
    return st_save({k: v.detach().contiguous().cpu() for k, v in state.items()}, metadata=header)


GAP_BYTES = 64 << 10  # a path's level runs closer than this are read as one: a request costs more
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on the JSON header (MAX_HEADER_SIZE)
# The dtypes viewed in place; any other goes through safetensors' own (copying) loader.
_VIEW_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
}


def decode(data: bytes | bytearray, where: str) -> ModuleState:
    """safetensors bytes -> tensors. A bytearray (`read_committed(..., writable=True)`) is viewed
    in place: a merge reads hundreds of MB of path files, and copying them into fresh memory
    costs as much as reading them. Either way a malformed file is refused by name."""
    try:
        views = _views(data) if isinstance(data, bytearray) else None
        return views if views is not None else st_load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptStateError(f"{where}: not a valid safetensors file ({one_line(str(exc), SHOWN_CHARS)})") from None


def _views(buffer: bytearray) -> ModuleState | None:
    """Tensors over the buffer, after the checks safetensors makes (header inside the file, each
    tensor's byte range inside the data and exactly its shape's size); None for other dtypes."""
    header, base = read_header(buffer)
    state = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        view = tensor_view(buffer, base, name, entry, len(buffer) - base)
        if view is None:
            return None
        state[name] = view
    return state


def read_header(buffer: bytes | bytearray) -> tuple[dict, int]:
    """A safetensors file's header (at the buffer's start) and where its data begins, after
    safetensors' own checks; ValueError names what is wrong."""
    if len(buffer) < 8:
        raise ValueError("shorter than the 8-byte header length")
    size = int.from_bytes(buffer[:8], "little")
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"header of {size:,} bytes is over safetensors' limit of {MAX_HEADER_BYTES:,}")
    if 8 + size > len(buffer):
        raise ValueError("header runs past the end of the file")
    if too_deep(buffer[8 : 8 + size]):
        raise ValueError(f"header nests deeper than {MAX_JSON_DEPTH} levels")
    header = json.loads(bytes(buffer[8 : 8 + size]))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + size


def tensor_view(buffer: bytearray, offset: int, name: str, entry: dict, data_bytes: int) -> torch.Tensor | None:
    """Header entry `name` as a tensor over `buffer`, whose byte `offset` is the data section's
    start (negative where the buffer is a run of the file past it), checked to lie inside a data
    section of `data_bytes`; None for a dtype it does not view."""
    dtype = _VIEW_DTYPES.get(entry["dtype"])
    if dtype is None:
        return None
    (begin, end), shape = entry["data_offsets"], entry["shape"]
    if not all(type(d) is int and d >= 0 for d in [begin, end, *shape]):
        raise ValueError(f"tensor {shown(name)}: offsets and shape must be non-negative integers")
    count = math.prod(shape)
    if not 0 <= begin <= end <= data_bytes or end - begin != count * dtype.itemsize:
        raise ValueError(f"tensor {shown(name)}: bytes {begin}..{end} do not fit its shape {shape} or the file")
    if not 0 <= offset + begin <= offset + end <= len(buffer):
        raise ValueError(f"tensor {shown(name)}: bytes {begin}..{end} lie outside what was read")
    return (
        torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset + begin).view(shape)
        if count
        else torch.empty(shape, dtype=dtype)
    )


def level_runs(data: bytes, level_of: Callable[[str], int], n_levels: int) -> list[list[list]]:
    """For a commit: each level's runs [begin, end, crc32] of `data`, a safetensors file whose
    tensor `name` belongs to level `level_of(name)`: the level's tensors' bytes and the header."""
    header, base = read_header(data)
    spans: list[list[tuple[int, int]]] = [[(0, base)] for _ in range(n_levels)]
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            spans[level_of(name)].append((base + begin, base + end))
    return [[[b, e, checksum_bytes(data[b:e])["crc32"]] for b, e in _joined(level)] for level in spans]


def _joined(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for begin, end in sorted(spans):
        if out and begin - out[-1][1] <= GAP_BYTES:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([begin, end])
    return [(b, e) for b, e in out]


def decode_runs(runs: dict[tuple[int, int], bytearray], size: int) -> dict[str, torch.Tensor] | None:
    """The tensors that the runs of a safetensors file of `size` bytes hold whole, by name, viewed in
    place; None for a dtype it does not view (the caller reads the file whole). ValueError names
    what is malformed, as module_store.decode's checks do."""
    head = next((data for (begin, _), data in runs.items() if begin == 0), None)
    if head is None:
        raise ValueError("no run holds the header")
    header, base = read_header(head)
    state = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ValueError(f"tensor {shown(name)}: data_offsets must be two integers")
        begin, end = offsets
        held = next(((b, e) for b, e in runs if b <= base + begin and base + end <= e), None)
        if held is None:
            continue  # a level nobody asked for
        view = tensor_view(runs[held], base - held[0], name, entry, size - base)
        if view is None:
            return None
        state[name] = view
    return state


def write_state(
    root: RunRoot, rel_dir: str, key: ModuleKey, state: ModuleState, info: dict, name: str | None = None
) -> None:
    """One module's safetensors file (atomic; `name` defaults to its place in a modules/ directory);
    the directory counts once it is committed."""
    root.write_bytes(posixpath.join(rel_dir, name or layout.module_file(key)), encode(state, state_metadata(key, info)))


def state_metadata(key: ModuleKey, info: dict) -> dict[str, str]:
    """What a module file's safetensors metadata holds: its place in the grid and `info`."""
    return {"level": str(key.level), "module": str(key.index), **{k: str(v) for k, v in info.items()}}


def commit_states(
    root: RunRoot, rel_dir: str, keys: list[ModuleKey], info: dict, linked: dict[str, dict | None] | None = None
) -> None:
    root.commit(rel_dir, info={**info, "modules": [[k.level, k.index] for k in sorted(keys)]}, linked=linked)


def write_states(root: RunRoot, rel_dir: str, states: dict[ModuleKey, ModuleState], info: dict) -> None:
    """Write one safetensors file per module (several at once), then commit the directory."""
    map_io(lambda key: write_state(root, rel_dir, key, states[key], info), sorted(states))
    commit_states(root, rel_dir, list(states), info)


@functools.lru_cache(maxsize=8)
def level_shapes(shape: ModelShape) -> tuple[dict[str, tuple[int, ...]], ...]:
    """Every tensor name and shape a module of each level holds, from a model built on the meta
    device (no memory, and the caller's random state untouched)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = shape.model_class(shape.llama_config())
    return tuple({k: tuple(t.shape) for k, t in level.items()} for level in split_path_state(shape, path_state(model)))


def check_state(state: ModuleState, expected: dict[str, tuple[int, ...]], where: str) -> ModuleState:
    """A decoded module holds exactly the expected tensors with their shapes: the math that reads
    it indexes by name and adds tensors, and would fail deep inside torch instead of naming the file."""
    if state.keys() != expected.keys():
        missing, extra = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
        raise CorruptStateError(
            f"{where}: tensors do not fit the model config (missing {shown(missing[:3])}, "
            f"unexpected {shown(extra[:3])})"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != expected[name]:
            raise CorruptStateError(
                f"{where}: tensor {shown(name)} has shape {tuple(tensor.shape)}, "
                f"the model config gives {expected[name]}"
            )
    return state


def read_state(
    root: RunRoot, rel_dir: str, key: ModuleKey, shape: ModelShape | None = None, marker: dict | None = None
) -> ModuleState:
    """One committed module, checked against the model's shapes when `shape` is given; `marker`:
    the directory's `_SUCCESS`, when the caller has just read it."""
    return read_module_file(root, rel_dir, layout.module_file(key), key.level, shape, marker)


def read_module_file(
    root: RunRoot, rel_dir: str, name: str, level: int, shape: ModelShape | None = None, marker: dict | None = None
) -> ModuleState:
    """A committed file holding one module of grid level `level` (a module, its momentum, where it
    was merged or gathered), decoded and, with `shape`, checked against the model's shapes;
    `marker`: the directory's `_SUCCESS`, when the caller has just read it."""
    where = root.path(rel_dir, name)
    state = decode(root.read_committed(rel_dir, name, writable=True, marker=marker), where)
    return state if shape is None else check_state(state, level_shapes(shape)[level], where)


def init_modules(root: RunRoot, model_config, grid: list[int]) -> bool:
    """Write round 0 from the seed unless it is committed already; True when it wrote."""
    if root.is_committed(layout.modules_dir(0)):
        return False
    shape = ModelShape.from_config(model_config)
    levels = initial_level_states(shape, seed=model_config.init_seed)
    keys = all_modules(grid, private=shape.path_blocks > 0)
    states = {key: {k: v.clone() for k, v in levels[key.level].items()} for key in keys}
    write_states(root, layout.modules_dir(0), states, {"round": 0, "grid": list(grid), "seed": model_config.init_seed})
    return True


def module_location(root: RunRoot, round_index: int, key: ModuleKey) -> tuple[str, str] | None:
    """(committed directory, file name) of a module at the start of a round: round r's modules/
    once the whole round is committed, or, before that, the module merged on its own as soon as
    its paths of round r-1 were in (islands); None while neither is committed."""
    if root.is_committed(layout.modules_dir(round_index)):
        return layout.modules_dir(round_index), layout.module_file(key)
    if round_index > 0 and root.is_committed(layout.merged_module_dir(round_index - 1, key)):
        return layout.merged_module_dir(round_index - 1, key), layout.MERGED_MODULE
    return None


def read_module(
    root: RunRoot,
    round_index: int,
    key: ModuleKey,
    shape: ModelShape | None = None,
    modules_marker: dict | None = None,
) -> ModuleState:
    """A module at the start of a round, wherever it is committed (module_location);
    `modules_marker`: round r's committed modules/ record, when the caller has just read it."""
    if modules_marker is None:
        found = module_location(root, round_index, key)
    else:
        found = layout.modules_dir(round_index), layout.module_file(key)
    if found is None:  # never reached through the stages, which check first; a clear error if it is
        raise CorruptStateError(
            f"{root.path(layout.modules_dir(round_index))}: module {key.level}/{key.index} "
            f"of round {round_index} is not committed"
        )
    rel_dir, name = found
    return read_module_file(root, rel_dir, name, key.level, shape, modules_marker)


def load_modules(
    root: RunRoot, round_index: int, keys: list[ModuleKey], shape: ModelShape | None = None
) -> dict[ModuleKey, ModuleState]:
    """Several modules at once. Every marker that can say where they lie is read in one wave, each
    one GET: round r's modules/ and, for round r > 0, each module's merge of round r-1 (what a
    train task that starts before round r-1 is gathered reads). On an object store that is one
    round trip before the files, where asking module_location for each took four in a row."""
    staged = [layout.merged_module_dir(round_index - 1, key) for key in keys] if round_index > 0 else []
    gathered, *merged = map_io(root.marker_if_committed, [layout.modules_dir(round_index), *staged], root.io_threads)

    def load(i: int) -> ModuleState:
        if gathered is not None or not merged or merged[i] is None:  # None: module_location asks again
            return read_module(root, round_index, keys[i], shape, gathered)
        return read_module_file(root, staged[i], layout.MERGED_MODULE, keys[i].level, shape, merged[i])

    return dict(zip(keys, map_io(load, range(len(keys)))))


def load_path_modules(
    root: RunRoot,
    round_index: int,
    modules: tuple[int, ...],
    shape: ModelShape | None = None,
    grid: list[int] | None = None,
) -> list[ModuleState]:
    """A path's modules in level order; its private module last when the shape has path blocks
    (the grid then names which one: it is indexed by the path's place in the grid)."""
    keys = path_modules(modules, grid, private=shape is not None and shape.path_blocks > 0)
    loaded = load_modules(root, round_index, keys, shape)
    return [loaded[key] for key in keys]


def load_path_model(root: RunRoot, config: Config, round_index: int, path_id: str) -> torch.nn.Module:
    """The LlamaForCausalLM of one path at the start of a round (for evaluation and inference)."""
    modules = parse_path_id(path_id, config.model.grid)
    shape = ModelShape.from_config(config.model)
    return build_path_model(shape, load_path_modules(root, round_index, modules, shape, config.model.grid))

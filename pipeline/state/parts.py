"""A committed safetensors file read by module level, from the byte ranges its commit recorded.

A path's weights are one Hugging Face file (model.safetensors: it loads anywhere) holding every
level's module, yet a merge reads one level of it, and an early start (pipeline/outer/early.py)
only the levels its path shares with the path's peers. Across hosts that read is on the round's
critical path: the path published last goes up, and the island that published first reads it
down before its next round can start (benchmarks/RESULTS.md, "Islands on separate hosts"). In
the demo the level the two paths share is 3.8 of the file's 7.6 MB: 0.6 s at 50 Mbit/s.

So a path's commit records, for each level, the runs of the file's bytes that hold the level's
tensors and the header every reader needs, each run with its CRC-32 (the `_SUCCESS` key `parts`:
{file name: [[[begin, end, crc32], ...] for each level]}); runs closer than GAP_BYTES are joined.
A reader of some levels reads those runs with ranged GETs (RunRoot.read_committed_runs), checks
each against its CRC-32, and views the tensors they hold whole. Where the record is missing (a run
committed before it) or malformed, a run does not match, or the runs are most of the file, the
file is read whole and checked against its whole record, as every file is.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Iterable

import torch

from pipeline.core.bounds import shown
from pipeline.state.module_store import read_header, tensor_view

PARTS = "parts"  # the `_SUCCESS` key: {file name: each level's runs}
GAP_BYTES = 64 << 10  # runs closer than this are read as one: a request costs more than the gap's bytes
WHOLE_ABOVE = 0.75  # runs that are more of the file than this: read it whole, in one request

Run = tuple[int, int, str]  # [begin, end) of the file and the CRC-32 of those bytes


def level_runs(data: bytes, level_of: Callable[[str], int], n_levels: int) -> list[list[list]]:
    """For a commit: each level's runs [begin, end, crc32] of `data`, a safetensors file whose
    tensor `name` belongs to level `level_of(name)`: the level's tensors' bytes and the header."""
    header, base = read_header(data)
    spans: list[list[tuple[int, int]]] = [[(0, base)] for _ in range(n_levels)]
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            spans[level_of(name)].append((base + begin, base + end))
    return [[[b, e, f"{zlib.crc32(data[b:e]):08x}"] for b, e in _joined(level)] for level in spans]


def _joined(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for begin, end in sorted(spans):
        if out and begin - out[-1][1] <= GAP_BYTES:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([begin, end])
    return [(b, e) for b, e in out]


def runs_to_read(record: Any, size: int, levels: Iterable[int]) -> list[Run] | None:
    """The distinct runs of a file of `size` bytes that hold `levels`, by its `parts` record; None
    where the file is better read whole: no record, a malformed one, or runs that are most of it."""
    if not isinstance(record, list):
        return None
    runs: set[Run] = set()
    for level in levels:
        if not (0 <= level < len(record)) or not isinstance(record[level], list):
            return None
        for run in record[level]:
            if not (
                isinstance(run, list)
                and len(run) == 3
                and type(run[0]) is int
                and type(run[1]) is int
                and isinstance(run[2], str)
                and 0 <= run[0] < run[1] <= size
            ):
                return None
            runs.add((run[0], run[1], run[2]))
    if not any(begin == 0 for begin, _, _ in runs) or sum(e - b for b, e, _ in runs) > WHOLE_ABOVE * size:
        return None
    return sorted(runs)


def recorded_runs(marker: dict, name: str, levels: Iterable[int] | None) -> list[Run] | None:
    """runs_to_read for file `name` of a committed directory, by its `_SUCCESS` (`marker`)."""
    record, parts = marker["files"].get(name), marker.get(PARTS)
    if levels is None or not isinstance(record, dict) or not isinstance(parts, dict):
        return None
    return runs_to_read(parts.get(name), record["bytes"], levels)


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
        if not isinstance(entry, dict) or not isinstance(entry.get("data_offsets"), list):
            raise ValueError(f"tensor {shown(name)}: no data_offsets")
        begin, end = entry["data_offsets"][:2] if len(entry["data_offsets"]) == 2 else (None, None)
        if type(begin) is not int or type(end) is not int:
            raise ValueError(f"tensor {shown(name)}: offsets must be integers")
        held = next(((b, e) for b, e in runs if b <= base + begin and base + end <= e), None)
        if held is None:
            continue  # a level nobody asked for
        view = tensor_view(runs[held], base - held[0], name, entry, size - base)
        if view is None:
            return None
        state[name] = view
    return state

"""The module grid: which modules exist, which paths run through them, and how paths are named.

A grid `[4, 2]` has 4 modules at level 0 and 2 at level 1; a path picks one module per level,
so there are 8 paths, named `p<k_0>-<k_1>` (docs/design.md, vocabulary). With `model.path_specific_blocks` > 0
each path also owns a private module, `ModuleKey(len(grid), <the path's index in all_paths>)`:
one level past the grid, one module per path (the `private` arguments below). Path ids arrive from configs, shard
directory names and CLI arguments, so parsing them is also where untrusted names are checked.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

_PATH_ID = re.compile(r"^p(\d+(?:-\d+)*)$")
_JOB_ID = re.compile(r"^(p\d+(?:-\d+)*)(?:\.w(\d+))?$")


@dataclass(frozen=True, order=True)
class ModuleKey:
    level: int
    index: int

    def __str__(self) -> str:
        return f"level={self.level}/module={self.index}"


def path_id(modules: tuple[int, ...]) -> str:
    """(3, 1) -> 'p3-1'."""
    return "p" + "-".join(str(k) for k in modules)


def parse_path_id(text: str, grid: list[int]) -> tuple[int, ...]:
    """'p3-1' -> (3, 1), refusing anything that is not a path of this grid."""
    match = _PATH_ID.match(text)
    if not match:
        raise ValueError(f"path id {text!r} is not of the form p<k0>-<k1>-... (e.g. p3-1)")
    modules = tuple(int(k) for k in match.group(1).split("-"))
    if len(modules) != len(grid) or any(k >= n for k, n in zip(modules, grid)):
        raise ValueError(f"path id {text!r} is not a path of the grid {grid}")
    return modules


def all_paths(grid: list[int]) -> list[tuple[int, ...]]:
    """Every path of the grid in a fixed order (level 0 slowest)."""
    return list(itertools.product(*(range(n) for n in grid)))


def all_path_ids(grid: list[int]) -> list[str]:
    return [path_id(p) for p in all_paths(grid)]


def path_index(modules: tuple[int, ...], grid: list[int]) -> int:
    """A path's place in all_paths (level 0 slowest): (1, 0) of [2, 3] -> 3."""
    index = 0
    for k, n in zip(modules, grid):
        index = index * n + k
    return index


def private_module(modules: tuple[int, ...], grid: list[int]) -> ModuleKey:
    """A path's own module (its path-specific blocks): one level past the grid, indexed by path."""
    return ModuleKey(len(grid), path_index(modules, grid))


def is_private(module: ModuleKey, grid: list[int]) -> bool:
    return module.level == len(grid)


def all_modules(grid: list[int], private: bool = False) -> list[ModuleKey]:
    """Every module of the run: the grid's, then (private) each path's own, in path order."""
    shared = [ModuleKey(level, k) for level, n in enumerate(grid) for k in range(n)]
    return shared + ([ModuleKey(len(grid), i) for i in range(n_paths(grid))] if private else [])


def path_modules(modules: tuple[int, ...], grid: list[int] | None = None, private: bool = False) -> list[ModuleKey]:
    """A path's modules, one per level; with `private` (which needs the grid) its own module last."""
    shared = [ModuleKey(level, k) for level, k in enumerate(modules)]
    if not private:
        return shared
    if grid is None:
        raise ValueError("a path's private module is indexed by its place in the grid: pass the grid")
    return shared + [private_module(modules, grid)]


def paths_through(module: ModuleKey, grid: list[int]) -> list[tuple[int, ...]]:
    """The paths that share a module: prod(grid) / grid[level] of them (a private module: its one)."""
    if is_private(module, grid):
        return [all_paths(grid)[module.index]]
    return [p for p in all_paths(grid) if p[module.level] == module.index]


def n_paths(grid: list[int]) -> int:
    return math.prod(grid)


def job_id(path: str, worker: int, workers_per_path: int) -> str:
    """The id of one training job: the path id, plus `.w<k>` when a path has several DiLoCo
    workers (each trains on its own iid part of the path's shard)."""
    return path if workers_per_path == 1 else f"{path}.w{worker}"


def all_job_ids(grid: list[int], workers_per_path: int) -> list[str]:
    return [job_id(p, w, workers_per_path) for p in all_path_ids(grid) for w in range(workers_per_path)]


def round_job_ids(grid: list[int], workers_per_path: int, workers: int) -> list[str]:
    """The jobs of a round that trains `workers` of the run's workers_per_path DiLoCo workers per path
    (train.workers_schedule): each path's first `workers`, named as in every other round."""
    return [job_id(p, w, workers_per_path) for p in all_path_ids(grid) for w in range(workers)]


def parse_job_id(text: str, grid: list[int], workers_per_path: int) -> tuple[str, tuple[int, ...], int]:
    """'p3-1.w2' -> ('p3-1', (3, 1), 2), refusing ids that are not jobs of this run."""
    match = _JOB_ID.match(text)
    if not match:
        raise ValueError(f"job id {text!r} is not of the form p<k0>-<k1>... or p<k0>-...-<kn>.w<worker>")
    path, worker = match.group(1), int(match.group(2) or 0)
    modules = parse_path_id(path, grid)
    if text != job_id(path, worker, workers_per_path) or worker >= workers_per_path:
        raise ValueError(f"job id {text!r} is not a job of this run ({workers_per_path} worker(s) per path)")
    return path, modules, worker

"""The DiLoCo outer step over the module grid (DiPaCo, Douillard et al. 2024, arXiv 2403.10616 §2;
DiLoCo, Douillard et al. 2023, arXiv 2311.08105, Algorithm 1).

For module m: delta_p = theta_m(before) - theta_{p,m}(after) for every path p through m that
committed; the outer gradient g_m = sum_p alpha_p * delta_p with alpha_p the path's share of the
tokens (or uniform); optionally g_m *= sqrt(paths through m); then a stock
torch.optim.SGD(nesterov=True) step with the module's persisted momentum buffer. A module that
no path finished keeps its parameters and its buffer.

With outer.compression other than none, each path job wrote its delta_p compressed
(pipeline/outer/compression.py) and the merge reads those instead of the trained weights:
g_m = sum_p alpha_p * decode(delta_p), the same formula on what crossed the network.

A path's private module (`model.path_specific_blocks`, DiPaCo's path-specific parameters) takes
no outer step: its new value is its path's trained weights, read from its committed
model.safetensors whatever the compression (it never leaves the island, so it stays lossless); a
path that did not finish leaves it as it was.

One orchestration: merge_module merges one module as soon as its paths are in (an island's merge
task), finish_round gathers a round's merged modules and commits the round (its commit task), and
merge_round (`dipaco merge`) is merge_module over every module followed by finish_round.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from models.grid import ModuleKey, all_modules, is_private, parse_job_id, path_modules, round_job_ids
from models.modular import ModelShape, ModuleState, split_path_state
from pipeline.core.bounds import SHOWN_CHARS, one_line, shown
from pipeline.core.config import Config
from pipeline.core.errors import CorruptStateError
from pipeline.outer import compression
from pipeline.state import layout
from pipeline.state.module_store import (
    check_state,
    commit_states,
    decode,
    decode_runs,
    level_shapes,
    load_modules,
    read_module_file,
    read_state,
    write_state,
)
from pipeline.state.storage import IO_THREADS, SUCCESS, RunRoot, map_io, recorded_runs

log = logging.getLogger("dipaco.merge")


class OuterOptimizer:
    """One outer step for one module: the math of the papers, written literally."""

    def __init__(self, lr: float, momentum: float, nesterov: bool, sqrt_paths_rescale: bool = False):
        if lr <= 0:
            raise ValueError(f"outer lr must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        self.lr, self.momentum = lr, momentum
        self.nesterov = nesterov and momentum > 0  # torch refuses Nesterov without momentum
        self.sqrt_paths_rescale = sqrt_paths_rescale

    def outer_gradient(self, before: ModuleState, afters: list[ModuleState], weights: list[float]) -> ModuleState:
        """g = sum_p alpha_p * (before - after_p) with the alphas summing to 1, computed as
        before - sum_p alpha_p * after_p: one pass over each path's tensors, in place."""
        total = sum(weights)
        grad = {}
        for key, tensor in before.items():
            mean_after = torch.zeros_like(tensor, dtype=torch.float32)
            for after, weight in zip(afters, weights):
                mean_after.add_(after[key].float(), alpha=weight / total)
            grad[key] = tensor.float() - mean_after  # the pseudo-gradient
        return self.rescaled(grad, len(afters))

    def outer_gradient_from_deltas(self, deltas: list[ModuleState], weights: list[float]) -> ModuleState:
        """g = sum_p alpha_p * delta_p from the paths' own (decoded) deltas: the outer gradient
        when the islands send compressed deltas instead of their weights (outer.compression)."""
        total = sum(weights)
        grad = {}
        for key, first in deltas[0].items():
            grad[key] = torch.zeros_like(first, dtype=torch.float32)
            for delta, weight in zip(deltas, weights):
                grad[key].add_(delta[key].float(), alpha=weight / total)
        return self.rescaled(grad, len(deltas))

    def rescaled(self, grad: ModuleState, paths: int) -> ModuleState:
        if self.sqrt_paths_rescale:
            # Averaging n roughly independent deltas shrinks the norm by ~sqrt(n) (DiPaCo §2.7).
            grad = {k: g * math.sqrt(paths) for k, g in grad.items()}
        return grad

    def outer_step(
        self, before: ModuleState, grad: ModuleState, momentum: ModuleState | None
    ) -> tuple[ModuleState, ModuleState]:
        """SGD(lr, momentum, nesterov) from torch: returns (new parameters, new momentum buffers).
        The gradient and buffers become the optimizer's own (the merge owns them, read fresh)."""
        params = {k: v.detach().float().clone().requires_grad_(True) for k, v in before.items()}
        sgd = torch.optim.SGD(params.values(), lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)
        for key, param in params.items():
            param.grad = grad[key]
            if momentum is not None and self.momentum > 0:
                sgd.state[param]["momentum_buffer"] = momentum[key].float()
        sgd.step()
        new_buffers = (
            {k: sgd.state[p]["momentum_buffer"].detach() for k, p in params.items()} if self.momentum > 0 else {}
        )
        return {k: p.detach() for k, p in params.items()}, new_buffers


@contextlib.contextmanager
def one_torch_thread():
    """The merge's math on one torch thread: its pieces are small, and torch's spinning worker
    threads would take the cores from the threads reading and writing module files."""
    threads = torch.get_num_threads()
    # Already one (merge_round's module threads), or a thread beside the main one (an island's
    # merges while it trains: pipeline/outer/early.py): the setting is the process's, and the
    # main thread's inner loop would run on one thread meanwhile.
    if threads == 1 or threading.current_thread() is not threading.main_thread():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def module_bytes(state: ModuleState) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def merge_round(config: Config, round_index: int) -> dict:
    """Merge round r into round r+1's modules and momentum; commits `rounds/round=<r>/_SUCCESS`.

    The one merge there is: every module's merge_module (what islands run as each module's paths
    come in), then finish_round. Here they share one RoundInputs, so every file is read once and
    all of them at once, and the modules are computed on a few threads while others read and
    write; the files are those of merging one module at a time, bitwise. Rerunning after a crash
    reuses the modules already committed and recomputes the rest from round r's committed state.
    """
    root = RunRoot(config.run_root)
    if root.is_committed(layout.round_dir(round_index)):
        return root.read_json(f"{layout.round_dir(round_index)}/merge.json")
    keys = all_modules(config.model.grid, private=config.model.path_specific_blocks > 0)
    with (
        one_torch_thread(),
        ThreadPoolExecutor(root.io_threads) as io,
        ThreadPoolExecutor(min(IO_THREADS, len(keys))) as modules,
    ):
        inputs = RoundInputs(root, config, round_index, io)
        inputs.prefetch(keys)  # every read queued before any module waits on one
        for _ in modules.map(lambda key: merge_module(config, round_index, key, inputs), keys):
            pass
    return finish_round(config, round_index)


def merged_info(config: Config, round_index: int) -> dict:
    """What every module file a merge of round r writes records of it (in its safetensors metadata
    and the directory's marker)."""
    return {"round": round_index + 1, "grid": list(config.model.grid), "merged_from_round": round_index}


def update_module(
    outer: OuterOptimizer,
    config: Config,
    before: ModuleState,
    momentum: ModuleState | None,
    inputs: list[ModuleState],
    tokens: list[int],
    private: bool = False,
) -> tuple[ModuleState, ModuleState | None, float | None]:
    """One module's outer step: (new parameters, new momentum, outer-gradient norm); a module no
    path finished keeps its parameters and momentum (norm None). `inputs` are the paths' trained
    modules, or their decoded deltas with outer.compression (read_path_inputs; a private module's
    input is always its trained weights, carried over)."""
    if not inputs:
        return before, momentum, None
    if private:
        return carry_over(before, inputs)
    weights = [float(t) if config.outer.weighting == "tokens" else 1.0 for t in tokens]
    if config.outer.compression == "none":
        grad = outer.outer_gradient(before, inputs, weights)
    else:
        grad = outer.outer_gradient_from_deltas(inputs, weights)
    new, buffers = outer.outer_step(before, grad, momentum)
    return new, buffers, math.hypot(*(float(torch.linalg.vector_norm(g)) for g in grad.values()))


def carry_over(before: ModuleState, afters: list[ModuleState]) -> tuple[ModuleState, None, float]:
    """A private module's merge: exactly its one path's trained weights (DiPaCo's path-specific
    parameters are never averaged), no momentum; the norm reported is how far the path moved it."""
    (after,) = afters  # one path, one worker (config validation)
    new = {k: after[k].to(before[k].dtype) for k in before}
    return new, None, math.hypot(*(float(torch.linalg.vector_norm(before[k].float() - new[k].float())) for k in before))


def read_path_levels(
    root: RunRoot,
    shape: ModelShape,
    round_index: int,
    path_id: str,
    marker: dict | None = None,
    levels: list[int] | None = None,
) -> dict[int, ModuleState]:
    """A committed path's trained weights at `levels` (default: all), one module state per level,
    shape-checked; `marker`: the path's `_SUCCESS`, when the caller has just read it. Fewer levels
    than the path has are read as the byte runs its commit recorded (pipeline/state/module_store.py):
    across hosts a merge reads of a peer's path only the module it merges."""
    rel = layout.path_dir(round_index, path_id)
    where = root.path(rel, layout.PATH_WEIGHTS)
    marker = marker or root.marker(rel)
    wanted = list(range(shape.n_module_levels)) if levels is None else sorted(set(levels))
    if len(wanted) < shape.n_module_levels:
        try:
            found = _levels_from_runs(root, shape, rel, marker, wanted, where)
        except (CorruptStateError, ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
            log.info("%s: read whole, its recorded runs did not serve levels %s (%s)", where, wanted, exc)
            found = None
        if found is not None:
            return found
    state = decode(root.read_committed(rel, layout.PATH_WEIGHTS, writable=True, marker=marker), where)
    return _split_levels(shape, state, wanted, where)


def _levels_from_runs(
    root: RunRoot, shape: ModelShape, rel: str, marker: dict, levels: list[int], where: str
) -> dict[int, ModuleState] | None:
    """read_path_levels from the runs its marker records, or None where they do not serve (no
    record, a run that does not match it, a dtype not viewed in place): the file is read whole."""
    runs = recorded_runs(marker, layout.PATH_WEIGHTS, levels)
    data = None if runs is None else root.read_committed_runs(rel, layout.PATH_WEIGHTS, runs, marker, levels=levels)
    state = None if data is None else decode_runs(data, marker["files"][layout.PATH_WEIGHTS]["bytes"])
    return None if state is None else _split_levels(shape, state, levels, where)


def _split_levels(shape: ModelShape, state: dict, levels: list[int], where: str) -> dict[int, ModuleState]:
    """A path's (or part of a path's) Hugging Face state -> {level: module state} at `levels`, checked."""
    try:
        split = split_path_state(shape, state)
    except KeyError as exc:  # a tensor name that belongs to no module of this grid
        raise CorruptStateError(f"{where}: {one_line(str(exc.args[0] if exc.args else exc), SHOWN_CHARS)}") from None
    expected = level_shapes(shape)
    return {level: check_state(split[level], expected[level], where) for level in levels}


def read_path_inputs(
    root: RunRoot, config: Config, shape: ModelShape, round_index: int, path_id: str, levels, marker: dict | None = None
) -> dict[int, ModuleState]:
    """What the merge reads of a committed path, one module state per level in `levels`: its
    trained weights, or with outer.compression its decoded outer gradients; its private module
    (the level past the grid's) always as trained weights: it is carried over, never averaged.
    `marker`: the path's `_SUCCESS` (RoundInputs read it to find the committed paths)."""
    compressed = config.outer.compression != "none"
    as_trained = [level for level in levels if not compressed or level >= shape.n_levels]
    trained = read_path_levels(root, shape, round_index, path_id, marker, as_trained) if as_trained else {}
    return {
        level: trained[level]
        if level in trained
        else read_outer_gradient(root, shape, round_index, path_id, level, marker)
        for level in levels
    }


def read_outer_gradient(
    root: RunRoot, shape: ModelShape, round_index: int, path_id: str, level: int, marker: dict | None = None
) -> ModuleState:
    """A committed path's outer gradient at one level, decoded to fp32 and shape-checked; its
    encoding is the one the path's `_SUCCESS` records (a lossless level says none)."""
    rel, name = layout.path_dir(round_index, path_id), layout.outer_grad_file(level)
    where = root.path(rel, name)
    marker = marker or root.marker(rel)
    kind = (marker.get("outer_grad") or {}).get(str(level))
    if kind not in compression.KINDS:
        raise CorruptStateError(
            f"{where}: no outer gradient recorded in its {SUCCESS} (outer.compression is on; "
            f"the path was trained without it: remove its directory to train it again)"
        )
    stored = decode(root.read_committed(rel, name, writable=True, marker=marker), where)
    try:
        grad = compression.decode(stored, kind)
    except (ValueError, RuntimeError) as exc:
        raise CorruptStateError(f"{where}: {one_line(str(exc), SHOWN_CHARS)}") from None
    return check_state(grad, level_shapes(shape)[level], where)


def gradient_file_bytes(root: RunRoot, round_index: int, committed: dict[str, int]) -> dict[str, int]:
    """{path id: bytes of the outer-gradient files it wrote}, from each path's `_SUCCESS` record."""
    sizes = {}
    for path_id in committed:
        files = root.marker(layout.path_dir(round_index, path_id))["files"]
        sizes[path_id] = sum(record["bytes"] for name, record in files.items() if name.startswith("outer_grad/"))
    return sizes


def outer_optimizer(config: Config) -> OuterOptimizer:
    return OuterOptimizer(
        config.outer.lr, config.outer.momentum, config.outer.nesterov, config.outer.sqrt_paths_rescale
    )


def read_momentum(root: RunRoot, round_index: int, key: ModuleKey, shape: ModelShape) -> ModuleState | None:
    """A module's outer momentum at the start of a round (None before its first merge), from
    round r's outer_state/ or, before that is committed, the module's own merge of round r-1. Both
    markers are read at once, one GET each: over a slow link every request a merge makes in a row
    is a round trip on the round's critical path."""
    rel_outer = layout.outer_state_dir(round_index)
    staged = layout.merged_module_dir(round_index - 1, key) if round_index > 0 else None
    gathered, *merged_of = map_io(root.marker_if_committed, [rel_outer, *([staged] if staged else [])], root.io_threads)
    merged = merged_of[0] if merged_of else None
    if gathered is not None:
        listed = layout.module_file(key) in gathered["files"]
        return read_state(root, rel_outer, key, shape, marker=gathered) if listed else None
    if merged is not None and layout.MERGED_MOMENTUM in merged["files"]:
        return read_module_file(root, staged, layout.MERGED_MOMENTUM, key.level, shape, merged)
    return None


class RoundInputs:
    """What merges of round r read, each file once, on an I/O pool: the modules the round started
    from, their momentum, and the committed paths' inputs at the levels of the modules in `keys`
    (read_path_inputs). A read starts when first asked for (or prefetched) and runs on the pool;
    file I/O and checksums release the GIL, so reads overlap each other and the math. merge_round
    shares one across all modules (a path's file is read once, not once per level); an island's
    merge_module and an early start have their own, which read of a path only the modules they
    compute (pipeline/state/module_store.py)."""

    def __init__(
        self,
        root: RunRoot,
        config: Config,
        round_index: int,
        pool: ThreadPoolExecutor,
        keys: list[ModuleKey] | None = None,
    ):
        self.root, self.config, self.round = root, config, round_index
        self.shape = ModelShape.from_config(config.model)
        self.keys = keys  # the modules it merges (default: every one); of a path it reads only their levels
        self.markers: dict[str, dict] = {}  # each committed path's `_SUCCESS`, read once for its files
        self.committed, _ = committed_paths(root, config, round_index, self.markers)
        self._pool, self._reads, self._lock = pool, {}, threading.Lock()

    def _read(self, what: tuple, fn, *args) -> Future:
        with self._lock:  # module merges on several threads ask for the same path's file
            if what not in self._reads:
                self._reads[what] = self._pool.submit(fn, *args)
            return self._reads[what]

    def through(self, key: ModuleKey) -> list[str]:
        """The committed paths that trained module `key` this round, in job order."""
        grid, private = self.config.model.grid, is_private(key, self.config.model.grid)
        return [
            pid for pid in self.committed if key in path_modules(_modules_of(pid, self.config), grid, private=private)
        ]

    def before(self, key: ModuleKey) -> Future:
        return self._read(("before", key), lambda: load_modules(self.root, self.round, [key], self.shape)[key])

    def momentum(self, key: ModuleKey) -> Future:
        return self._read(("momentum", key), read_momentum, self.root, self.round, key, self.shape)

    def levels_of(self, path_id: str) -> list[int]:
        """The levels of a path's modules among those it merges: what is read of the path."""
        if self.keys is None:
            return list(range(self.shape.n_module_levels))
        return sorted({key.level for key in self.keys if path_id in self.through(key)})

    def path(self, path_id: str) -> Future:
        return self._read(
            ("path", path_id),
            read_path_inputs,
            self.root,
            self.config,
            self.shape,
            self.round,
            path_id,
            self.levels_of(path_id),
            self.markers.get(path_id),
        )

    def prefetch(self, keys: list[ModuleKey]) -> None:
        for key in keys:
            self.before(key)
            self.momentum(key)
        for path_id in self.committed:
            self.path(path_id)

    def trained(self, key: ModuleKey) -> list[ModuleState]:
        """Module `key` as each path through it left it (or, compressed, its decoded delta)."""
        return [self.path(pid).result()[key.level] for pid in self.through(key)]


def merge_module(config: Config, round_index: int, key: ModuleKey, inputs: RoundInputs | None = None) -> dict:
    """Merge one module of round r, once every path through it is in: its outer step (or a private
    module's carry-over), committed on its own under rounds/round=<r>/merged/ with a marker that
    holds what merge.json reports of it. Islands run it as a task; merge_round runs it for every
    module with shared `inputs`. A committed module is not merged again."""
    root = RunRoot(config.run_root) if inputs is None else inputs.root
    rel = layout.merged_module_dir(round_index, key)
    done = root.marker_if_committed(rel)
    if done is not None:
        return done
    if inputs is None:
        with ThreadPoolExecutor(root.io_threads) as pool:  # its paths' files read at once
            return _merge_module(config, round_index, key, RoundInputs(root, config, round_index, pool, [key]))
    return _merge_module(config, round_index, key, inputs)


def _merge_module(config: Config, round_index: int, key: ModuleKey, inputs: RoundInputs) -> dict:
    """merge_module's outer step, once it found the module not merged yet."""
    root, rel = inputs.root, layout.merged_module_dir(round_index, key)
    written, info = merged_files(config, round_index, key, inputs)
    meta = merged_info(config, round_index)
    map_io(lambda name: write_state(root, rel, key, written[name], meta, name), list(written), root.io_threads)
    return root.commit(rel, files=list(written), info=info)


def merged_files(
    config: Config, round_index: int, key: ModuleKey, inputs: RoundInputs
) -> tuple[dict[str, ModuleState], dict]:
    """Module `key`'s outer step of round r: the states its merge writes ({file name: state}) and
    what its marker records. A pure function of round r's committed inputs: an island that trains
    a path's next round computes its modules with it before their merges are committed
    (pipeline/outer/early.py), and they come out bitwise the files the merge writes."""
    start = time.perf_counter()
    through = inputs.through(key)
    for path_id in through:  # every read it needs asked for at once: one wave, not three in a row
        inputs.path(path_id)
    with one_torch_thread():
        before, momentum = inputs.before(key), inputs.momentum(key)
        before, momentum = before.result(), momentum.result()
        new, buffers, grad_norm = update_module(
            outer_optimizer(config),
            config,
            before,
            momentum,
            inputs.trained(key),
            [inputs.committed[p] for p in through],
            private=is_private(key, config.model.grid),
        )
    written = {layout.MERGED_MODULE: new, **({layout.MERGED_MOMENTUM: buffers} if buffers else {})}
    return written, {
        "round": round_index,
        "module": [key.level, key.index],
        "paths": through,
        "grad_norm": grad_norm,
        "bytes": module_bytes(before),
        "seconds": time.perf_counter() - start,
    }


def finish_round(config: Config, round_index: int) -> dict:
    """Once every module of round r is merged on its own: gather them into round r+1's modules/
    and outer_state/, then merge.json and the round's `_SUCCESS`, written last: the round counts
    from here. Then the round before's staged modules go (everything reads round r's modules/ now)."""
    root = RunRoot(config.run_root)
    rel_round = layout.round_dir(round_index)
    if root.is_committed(rel_round):
        return root.read_json(f"{rel_round}/merge.json")
    keys = all_modules(config.model.grid, private=config.model.path_specific_blocks > 0)
    markers = dict(zip(keys, map_io(lambda key: root.marker(layout.merged_module_dir(round_index, key)), keys)))
    info = merged_info(config, round_index)
    rel_modules, rel_outer = layout.modules_dir(round_index + 1), layout.outer_state_dir(round_index + 1)
    momentum_keys = [key for key in keys if layout.MERGED_MOMENTUM in markers[key]["files"]]

    def gather(key: ModuleKey) -> tuple[dict | None, dict | None]:
        """The staged module (and momentum) at its place in round r+1; their records when linked."""
        staged, name = layout.merged_module_dir(round_index, key), layout.module_file(key)
        module = root.copy_committed(staged, layout.MERGED_MODULE, f"{rel_modules}/{name}")
        momentum = (
            root.copy_committed(staged, layout.MERGED_MOMENTUM, f"{rel_outer}/{name}") if key in momentum_keys else None
        )
        return module, momentum

    records = dict(zip(keys, map_io(gather, keys)))
    # modules/, outer_state/ and the report's reads at once: each is a few requests in a row, and a
    # reader of either directory falls back on the staged merges until its marker is in (module_location,
    # read_momentum). Across hosts the plan's last round ends with this commit: claim to marker, it
    # took 1.12 s over a 40 ms link one after the other, 0.84 s at once (a run each, RESULTS.md).
    *_, report = map_io(
        lambda step: step(),
        [
            lambda: commit_states(root, rel_modules, keys, info, {layout.module_file(k): records[k][0] for k in keys}),
            lambda: commit_states(
                root, rel_outer, momentum_keys, info, {layout.module_file(k): records[k][1] for k in momentum_keys}
            ),
            lambda: round_report(root, config, round_index, markers),
        ],
    )
    root.write_json(f"{rel_round}/merge.json", report)
    # merged_at: when the round's last module was merged, the end of its work (utilisation's end of
    # the round): islands commit a round in the gaps, after the next round's training is claimed.
    merged_at = max(float(marker["committed_at"]) for marker in markers.values())
    root.commit(
        rel_round,
        info={"round": round_index, "next_round": round_index + 1, "merged_at": merged_at},
        files=["merge.json"],
    )
    log.info(
        "merged round %d: %d paths in, %d left out %s; %.1f MB outer vs %.1f MB data-parallel",
        round_index,
        len(report["paths_merged"]),
        len(report["paths_left_out"]),
        report["paths_left_out"] or "",
        report["bytes_outer"] / 1e6,
        report["bytes_data_parallel"] / 1e6,
    )
    if round_index > 0:  # the markers first, all at once (no existence check: removing none is a no-op)
        staged_markers = [f"{layout.merged_module_dir(round_index - 1, key)}/{SUCCESS}" for key in keys]
        map_io(root.remove, staged_markers, root.io_threads)  # a half-removed module never counts
        root.remove(layout.merged_dir(round_index - 1))
    return report


def round_report(root: RunRoot, config: Config, round_index: int, markers: dict[ModuleKey, dict]) -> dict:
    """merge.json: which paths went in, each module's paths and outer-gradient norm (from its
    merge's marker), and the bytes an island sends per round against data-parallel training."""
    committed, left_out = committed_paths(root, config, round_index)
    # Shared modules only: a path's private module stays on its island, nothing is sent for it.
    path_bytes = {pid: sum(markers[k]["bytes"] for k in path_modules(_modules_of(pid, config))) for pid in committed}
    # Per island and round, twice what it sends (docs/design.md, communication): its outer
    # gradient out and the averaged one back, as a ring all-reduce of it moves; uncompressed,
    # the fp32 modules' bytes; compressed, the gradient files it wrote (scales and headers included).
    sent = gradient_file_bytes(root, round_index, committed) if config.outer.compression != "none" else path_bytes
    report = {
        "round": round_index,
        "paths_merged": sorted(committed),
        "paths_left_out": left_out,
        "modules_untouched": [str(k) for k, m in markers.items() if m["grad_norm"] is None],
        "module_paths": {str(k): m["paths"] for k, m in markers.items()},
        "module_grad_norms": {str(k): m["grad_norm"] for k, m in markers.items() if m["grad_norm"] is not None},
        "tokens": {pid: int(t) for pid, t in committed.items()},
        "bytes_outer": 2 * sum(sent.values()),
        # Data-parallel training of the same islands ring-all-reduces fp32 gradients every inner
        # step: about 2 x the gradient's bytes per island and step.
        "bytes_data_parallel": 2 * sum(path_bytes.values()) * config.train.inner_steps,
        "seconds": sum(m["seconds"] for m in markers.values()),  # the modules' merges, not the gathering
    }
    if config.outer.compression != "none":
        report.update(compression=config.outer.compression, bytes_outer_uncompressed=2 * sum(path_bytes.values()))
    return report


def round_jobs(config: Config, round_index: int) -> list[str]:
    """The jobs round r trains, the round's workers only (train.workers_schedule): its merge
    averages those that ran."""
    return round_job_ids(config.model.grid, config.train.workers_per_path, config.train.workers_in_round(round_index))


def committed_paths(
    root: RunRoot, config: Config, round_index: int, markers: dict[str, dict] | None = None
) -> tuple[dict[str, int], list[str]]:
    """({path id: tokens trained} for paths that committed, [path ids that did not]); `markers`, when
    given, receives each committed path's `_SUCCESS` (its files are read through it)."""
    committed, left_out = {}, []
    jobs = round_jobs(config, round_index)  # their markers read at once, each one GET (no existence check before it)
    found = map_io(lambda job: root.marker_if_committed(layout.path_dir(round_index, job)), jobs, root.io_threads)
    for path_id, marker in zip(jobs, found):
        rel = layout.path_dir(round_index, path_id)
        if marker is not None:
            tokens = marker.get("tokens")
            if type(tokens) is not int or tokens < 1:  # weights divide by the tokens' sum
                raise CorruptStateError(f"{root.path(rel, SUCCESS)}: tokens must be a token count, got {shown(tokens)}")
            committed[path_id] = tokens
            if markers is not None:
                markers[path_id] = marker
        else:
            left_out.append(path_id)
    return committed, left_out


def _modules_of(job: str, config: Config) -> tuple[int, ...]:
    return parse_job_id(job, config.model.grid, config.train.workers_per_path)[1]

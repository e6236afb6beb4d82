"""A path's next round, started from its modules as their merges will write them.

Across hosts a round ends in a chain of transfers that the next round's training waits for: the
last path's weights go up, an island merges the modules it shares and puts them up, the other
islands read them back, and only then does the next round start (benchmarks/RESULTS.md, "Islands
on separate hosts": 3.4-3.7 s over a 50 Mbit/s link, each round). Yet a merge is a pure function of
what is already committed: the module at the round's start, its momentum, and the trained paths
through it (merge.merged_files). So an island that keeps a path's inner state (it trained the
path's round r) computes the modules of the path's round r+1 itself, once every path through them
is published, and trains from them at once; the merges are committed meanwhile, by this island
behind its training or by any other, and their files go up while the inner loop runs.

Nothing is trusted that was not committed: before the attempt publishes, each module's committed
merge is compared with what it started from, by the record of the merge's file (its length and
CRC-32). Equal, the attempt is the one a start after the merge would have trained, bitwise; else
the attempt is cancelled and the path trains again from the committed module. A merge nobody
has committed by then is merged by the caller (`merge_here`), and one that never comes cancels
the attempt after `wait_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from models.grid import ModuleKey, parse_job_id, path_modules
from models.modular import ModelShape, ModuleState
from pipeline.core.config import Config
from pipeline.outer.merge import RoundInputs, merged_files, merged_info, round_jobs
from pipeline.state import layout
from pipeline.state.module_store import decode, encode, load_modules, state_metadata
from pipeline.state.storage import RunRoot, checksum_bytes, map_io
from pipeline.state.store import RECENT

log = logging.getLogger("dipaco.early")
POLL_S = 0.5  # how often a publish that waits for a merge asks again


class CommittedOnce:
    """A run root whose directories' `_SUCCESS` are each read once, by one thread. An early start's
    merges ask for the same few markers over and over (the round's modules/ and outer_state/, each
    module's merge before them, each path's), each a round trip on an object store: 0.2-0.4 s of a
    train task's load. The answers are one snapshot of the store for one computation, and what that
    computation gives is compared with the committed merges before anything is published."""

    def __init__(self, root: RunRoot):
        self.run_root = root  # not `root`: that is the RunRoot's own path, which callers may ask for
        self._markers: dict[str, Future] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.run_root, name)

    def marker_if_committed(self, rel: str) -> dict | None:
        with self._lock:
            known, first = self._markers.get(rel), rel not in self._markers
            if first:
                known = self._markers[rel] = Future()
        if first:
            try:
                known.set_result(self.run_root.marker_if_committed(rel))
            except BaseException as exc:
                known.set_exception(exc)
        return known.result()

    def marker(self, rel: str) -> dict:
        known = self.marker_if_committed(rel)
        return known if known is not None else self.run_root.marker(rel)  # the error it gives


class EarlyStart:
    """Round r's modules of one path, those in `pending` computed here from round r-1's committed
    paths (the others read as committed), and the check that their merges wrote the same bytes."""

    def __init__(self, config: Config, round_index: int, path_id: str, pending: list[ModuleKey]):
        self.config, self.round, self.path_id = config, round_index, path_id
        self.root = RunRoot(config.run_root)
        self.reads = CommittedOnce(self.root)  # what modules() reads: each committed marker once
        self.shape = ModelShape.from_config(config.model)
        modules = parse_job_id(path_id, config.model.grid, config.train.workers_per_path)[1]
        self.keys = path_modules(modules, config.model.grid, private=self.shape.path_blocks > 0)
        self.pending = [key for key in self.keys if key in set(pending)]
        self.expected: dict[ModuleKey, dict] = {}  # key -> the record of the merged file computed here
        self._check: Future | None = None  # difference() asked beside the commit (check_beside)
        self._stopped = threading.Event()

    def modules(self) -> list[ModuleState]:
        """The path's modules in level order (train_path's start_modules): the pending ones as
        their merge of round r-1 will write them, byte for byte, the rest as committed."""
        before = self.round - 1
        committed = [key for key in self.keys if key not in self.pending]
        meta = merged_info(self.config, before)
        with ThreadPoolExecutor(self.root.io_threads) as pool:
            for rel in self.markers_read(before):  # one wave of GETs, where asking as needed made four
                pool.submit(self.reads.marker_if_committed, rel)
            loading = pool.submit(load_modules, self.reads, self.round, committed, self.shape) if committed else None
            inputs = RoundInputs(self.reads, self.config, before, pool, self.pending)
            inputs.prefetch(self.pending)
            loaded = loading.result() if loading is not None else {}
            for key in self.pending:
                written, _ = merged_files(self.config, before, key, inputs)
                data = encode(written[layout.MERGED_MODULE], state_metadata(key, meta))
                self.expected[key] = checksum_bytes(data)
                where = self.root.path(layout.merged_module_dir(before, key), layout.MERGED_MODULE)
                if not self.root.is_local:  # the next round reads it as its start, from memory once
                    RECENT.keep(where, data, self.expected[key]["crc32"])  # a committed record names these bytes
                loaded[key] = decode(bytearray(data), where)  # what reading the merge's file gives
        return [loaded[key] for key in self.keys]

    def markers_read(self, before: int) -> list[str]:
        """Every `_SUCCESS` that modules() reads before it knows where files lie: round r's and
        r-1's modules/, r-1's outer_state/, the merges of r-1 and r-2 that a module not gathered
        yet is read from, and each path of round r-1 (committed_paths' round_jobs). Asked for in a row
        as the computation got to them, they were four round trips of a train task's load on an
        object store (about 0.1 s of its 0.16 s on moto over loopback); CommittedOnce reads each
        once, whoever asks first."""
        merges = [layout.merged_module_dir(r, key) for r in (before, before - 1) if r >= 0 for key in self.keys]
        rounds = [layout.modules_dir(self.round), layout.modules_dir(before), layout.outer_state_dir(before)]
        return [*rounds, *merges, *(layout.path_dir(before, job) for job in round_jobs(self.config, before))]

    def check_beside(self, wait_s: float, merge_here: Callable[[ModuleKey], bool] | None = None) -> None:
        """Start difference() on a thread, once (at the inner loop's end): a committed merge never
        changes, so its answer can be asked while the path's weights go up, and the publish then
        waits for no round trip of it (one per pending module, in a row, over the host's link)."""
        if self._check is None:
            self._check = Future()
            threading.Thread(target=self._run_check, args=(wait_s, merge_here), daemon=True, name="early-check").start()

    def _run_check(self, wait_s: float, merge_here: Callable[[ModuleKey], bool] | None) -> None:
        try:
            self._check.set_result(self.difference(wait_s, merge_here))
        except BaseException as exc:  # noqa: BLE001 - the publish's check raises it
            self._check.set_exception(exc)

    def checked(self, wait_s: float, merge_here: Callable[[ModuleKey], bool] | None = None) -> str | None:
        """difference(), as check_beside asked it (or now, when it was not)."""
        return self._check.result() if self._check is not None else self.difference(wait_s, merge_here)

    def stop(self) -> None:
        """The attempt is over: a check beside it that still waits for a merge gives up."""
        self._stopped.set()

    def difference(self, wait_s: float, merge_here: Callable[[ModuleKey], bool] | None = None) -> str | None:
        """None once every pending module's merge is committed with the bytes computed here; else
        why not (a merge that differs, or none committed within `wait_s`). `merge_here(key)` may
        run a merge nobody has taken (True when it did): the islands may all be training. The
        pending modules' markers are asked in one wave."""
        deadline = time.monotonic() + wait_s
        before = self.round - 1
        rels = [layout.merged_module_dir(before, key) for key in self.pending]
        markers = dict(zip(self.pending, map_io(self.root.marker_if_committed, rels)))
        for key, rel in zip(self.pending, rels):
            marker = markers[key]
            while marker is None:
                if self._stopped.is_set():
                    return "the attempt ended before its merges were committed"
                if not (merge_here is not None and merge_here(key)):
                    if time.monotonic() > deadline:
                        return f"module {key.level}/{key.index} of round {before} was not merged within {wait_s:.0f} s"
                    time.sleep(POLL_S)
                marker = self.root.marker_if_committed(rel)
            record = (marker.get("files") or {}).get(layout.MERGED_MODULE) or {}
            mine = self.expected.get(key, {})
            if (record.get("bytes"), record.get("crc32")) != (mine.get("bytes"), mine.get("crc32")):
                log.warning(
                    "%s: its merge wrote %s, this attempt of %s started from %s",
                    self.root.path(rel, layout.MERGED_MODULE),
                    record,
                    self.path_id,
                    mine,
                )
                return f"module {key.level}/{key.index} of round {before} was merged differently from its early start"
        return None

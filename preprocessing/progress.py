"""Progress of a Beam job on any runner: the workers leave their counters in files, the driver sums them.

Beam relays its workers' log lines to the driver on the DirectRunner only; on Dask (as on
Dataflow, Flink or Spark) they stay in the workers' logs, and a prepare job showed nothing for
minutes. So each worker process writes its counters of one job as one small JSON file,
`<scratch>/progress/<job>/<host>-<pid>-<id>.json` ({"lines read": n, "documents routed": m}):
at most every WRITE_EVERY_S seconds while it counts, and at the end of each bundle (so the last
count is in when the job is), through a temporary name and a rename. The driver's ProgressMonitor
sums the files every PROGRESS_EVERY_S seconds and logs one line when the sums moved, and once
more when the job is done. One code path for every runner: the workers log no progress.

Assumption: the workers write to the run root the driver reads, as they must already for the
shards: one file system (the DirectRunner; Dask on loopback or on hosts sharing the disk) or an
object store. A progress file is advice, never state: a write that fails is reported once and
the job goes on without it, an unreadable file is skipped, and the files go with the job's
scratch directory, which is removed before the commit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid

from pipeline.core.errors import InputError, StorageError
from pipeline.state.storage import RunRoot

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 10.0  # how often the driver logs a progress line
WRITE_EVERY_S = 2.0  # how often a worker rewrites its file while it counts
LINES_READ, DOCUMENTS_ROUTED = "lines read", "documents routed"


@dataclasses.dataclass(frozen=True)
class ProgressFiles:
    """Where one job's workers leave their counters; pickled into its DoFns. `directory` is the
    job's own (a fresh id), so a second job in the same process (the in-memory DirectRunner, an
    island re-sharding) never continues the first one's counts."""

    root_url: str
    directory: str
    write_every_s: float

    @classmethod
    def new(cls, root_url: str, scratch: str) -> ProgressFiles:
        return cls(root_url, f"{scratch}/progress/{uuid.uuid4().hex[:12]}", WRITE_EVERY_S)

    def counts(self) -> ProcessCounts:
        """This process's counters of the job: one object (and file) shared by every DoFn instance
        and thread of the process, so the driver reads one file per worker process."""
        with _REGISTRY_LOCK:
            if self not in _REGISTRY:
                _REGISTRY[self] = ProcessCounts(self)
            return _REGISTRY[self]


_REGISTRY: dict[ProgressFiles, ProcessCounts] = {}  # one entry per job the process worked on: bytes each
_REGISTRY_LOCK = threading.Lock()


class ProcessCounts:
    """One worker process's counters of one job, written to its own file (rate-limited)."""

    def __init__(self, files: ProgressFiles):
        self.files, self.root = files, RunRoot(files.root_url)
        self.rel = f"{files.directory}/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}.json"
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.written_at, self.dirty, self.broken = float("-inf"), False, False

    def add(self, what: str, n: int = 1) -> None:
        """Count; rewrite the file when the last write is WRITE_EVERY_S old (the first at once)."""
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n
            self.dirty = True
            if time.monotonic() - self.written_at >= self.files.write_every_s:
                self._write()

    def flush(self) -> None:
        """Write what is not written yet: a DoFn's finish_bundle, so the job's last counts are in
        the files by the time the runner reports it done (Dask calls it too, and drops only the
        elements it would emit)."""
        with self.lock:
            if self.dirty:
                self._write()

    def _write(self) -> None:
        self.written_at, self.dirty = time.monotonic(), False
        if self.broken:
            return
        try:
            self.root.write_note(self.rel, json.dumps(self.counts, sort_keys=True).encode())
        except StorageError as exc:
            self.broken = True
            log.warning("prepare worker: progress not reported (%s); the job goes on", exc)


class _NoCounts:
    """The counters of a DoFn built without ProgressFiles (a test, a job that reports nothing)."""

    def add(self, what: str, n: int = 1) -> None:
        pass

    def flush(self) -> None:
        pass


NO_COUNTS = _NoCounts()


def counts_of(files: ProgressFiles | None) -> ProcessCounts | _NoCounts:
    return files.counts() if files is not None else NO_COUNTS


def read_totals(files: ProgressFiles) -> dict[str, int]:
    """The sum of every worker's file of the job; a file gone or unreadable is skipped (advice)."""
    root, totals = RunRoot(files.root_url), {}
    try:
        names = root.listdir(files.directory)
    except OSError as exc:
        log.debug("progress: %s not listed: %s", root.path(files.directory), exc)
        return totals
    for name in names:
        try:
            counts = root.read_json(f"{files.directory}/{name}")
        except (InputError, OSError) as exc:  # CorruptStateError is an InputError
            log.debug("progress: %s skipped: %s", name, exc)
            continue
        for what, n in counts.items():
            if isinstance(n, int) and not isinstance(n, bool):
                totals[what] = totals.get(what, 0) + n
    return totals


def describe(totals: dict[str, int], order: tuple[str, ...], when: str) -> str:
    """'1,200 documents routed so far (5,000 lines read)': the first counter of `order` the job
    has, then the others in brackets; empty when it has none yet."""
    present = [what for what in order if what in totals]
    if not present:
        return ""
    head, *rest = present
    tail = ", ".join(f"{totals[what]:,} {what}" for what in rest)
    return f"{totals[head]:,} {head} {when}" + (f" ({tail})" if tail else "")


class ProgressMonitor:
    """The driver's side: a thread that logs '<label>: N <counter> so far (...)' every
    PROGRESS_EVERY_S seconds while the sums move, and '<label>: N <counter> in all (...)' once the
    job is done. A context manager around the run (the DirectRunner's run() returns only when the
    job is done, Dask's wait_until_finish())."""

    def __init__(self, files: ProgressFiles, label: str, order: tuple[str, ...]):
        self.files, self.label, self.order = files, label, order
        self.every_s = PROGRESS_EVERY_S
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name=f"progress-{label}", daemon=True)
        self.last: dict[str, int] = {}

    def __enter__(self) -> ProgressMonitor:
        self.thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop.set()
        self.thread.join()
        if exc_type is None:
            self._report("in all")

    def _watch(self) -> None:
        while not self.stop.wait(self.every_s):
            self._report("so far")

    def _report(self, when: str) -> None:
        totals = read_totals(self.files)
        line = describe(totals, self.order, when)
        if line and totals != self.last:
            self.last = totals
            log.info("%s: %s", self.label, line)

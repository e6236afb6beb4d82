"""While a train task's weights go up, the files its round's merges would read of the paths that
share a module with it and are already published come down into this process's memory.

Across hosts, the path published last sets when a round's merges end: the merge of the module two
paths share then read the other path's weights over the link after that publish (7.6 MB, 1.09 s at
50 Mbit/s, on the round's critical path: benchmarks/RESULTS.md, "Islands on separate hosts"). The
island that publishes last is the one whose downlink is idle while its own weights go up, and the
one free first for that merge; with the peers' files in memory (pipeline.state.store.RecentFiles),
the merge reads nothing over the link, and the queue offers it first those merges whose paths it
holds (TaskQueue.merge_preference).

The island that publishes first needs the others' weights too: its next round starts from the
modules they share, computed from every path through them (pipeline/outer/early.py). So once its
task has published, the watch goes on for the peers still training (`published`), for at most
PEER_AFTER_S, while the island merges or waits: their weights come down as soon as they are
published, not after the island's next claim (they were 1.1 s of a round's hand-over). A look
that finds a publish also ends the island's wait for its next look at the queue (`TaskQueue.news`):
its next round is claimed while the weights come down, not up to a poll later. In the
plan's last round there is no next round: the watch ends with the publish (across hosts it had
read the last path's weights, 7.6 MB, for a merge the island that published last then ran).

Only where it pays: a run root on an object store, a file the memory keeps (RecentFiles'
bounds), a path of the same round that shares a module with this task's (its private module, never
shared, aside), and of its weights only the bytes of the levels they share (the runs the path's
commit recorded: pipeline/state/module_store.py; the demo's shared level is half the file). What is
read is checked against the path's `_SUCCESS` as every read is, and named in the task's lease
record (`peer_reads`; a run as `<file>#<begin>-<end>`): a read is bytes on the link
(benchmarks.hosts counts them). A failure costs nothing but the read: the merge reads the file again.
"""

from __future__ import annotations

import logging
import threading
import time

from pipeline.islands.task_queue import Task, TaskQueue, read_plan
from pipeline.state import layout
from pipeline.state.storage import ListedRoot, map_io, recorded_runs
from pipeline.state.store import RECENT

log = logging.getLogger("dipaco.island")
PEER_POLL_S = 0.25  # how often, while this task's weights go up, it looks for the peers' publishes
PEER_WATCH_S = 600.0  # a bound on the watch, should its task never say it ended
PEER_AFTER_S = 120.0  # how long the watch goes on once its task has published (the peers still training)
PEER_POLL_AFTER_S = 0.2  # and how often it looks then: the round's next start waits on what it finds
PEER_MARKER_LOOKS = 4  # up to this many peers, a look reads each one's `_SUCCESS`; past it, one listing


class PeerReads:
    """One train task's watch for its peers' published files (start once its inner loop ends; once
    it has published, `published` bounds the rest of the watch, else `stop` ends it). `read` lists
    the files read, by their names in the run root."""

    def __init__(self, queue: TaskQueue, task: Task):
        self.root, self.round, self.news = queue.root, task.round, queue.news
        config, mine = queue.config, set(queue.job_modules.get(task.target, []))
        compressed = config.outer.compression != "none"
        # peer job -> the files its merges read, each with the levels read of it (None: whole)
        self.wanted: dict[str, list[tuple[str, list[int] | None]]] = {}
        for job in queue.jobs_of(task.round):
            shared = sorted(
                {key.level for key in queue.job_modules[job] if key in mine and len(queue.jobs_through[key]) > 1}
            )
            if job == task.target or not shared:
                continue
            self.wanted[job] = (
                [(layout.outer_grad_file(level), None) for level in shared]
                if compressed
                else [(layout.PATH_WEIGHTS, shared)]  # the shared modules' bytes of it (pipeline/state/module_store.py)
            )
        self.read: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._deadline = time.monotonic() + PEER_WATCH_S
        self._after = False  # its task has published
        self._plan_goes_on: bool | None = None  # a next round after this task's (_next_round)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None or not self.wanted or self.root.is_local:
            return
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"peers-r{self.round}")
        self._thread.start()

    def stop(self) -> None:
        """No new read starts; one under way finishes in its thread (the merge that needs it then
        waits for it instead of reading it again: RecentFiles.one_reader)."""
        self._stop.set()

    def published(self) -> None:
        """Its task published: the peers still training are watched for PEER_AFTER_S more."""
        self._after = True
        self._deadline = min(self._deadline, time.monotonic() + PEER_AFTER_S)

    def _watch(self) -> None:
        paths = f"{layout.round_dir(self.round)}/paths"
        try:
            while self.wanted and not self._stop.is_set() and time.monotonic() < self._deadline:
                if self._after and not self._next_round():
                    return
                found = self._look(paths)
                if found:  # the island's look for its next task need not wait for its poll
                    self.news.set()
                for job, marker in found.items():
                    if self._stop.is_set():
                        return
                    self._read(job, self.wanted.pop(job), marker)
                self._stop.wait(PEER_POLL_AFTER_S if self._after else PEER_POLL_S)
        except Exception as exc:  # noqa: BLE001 - a watch's last word: the merge reads what it needs itself
            log.info("reading the peers' published files of round %d stopped: %s", self.round, exc)

    def _look(self, paths: str) -> dict[str, dict | None]:
        """The wanted peers now published, each with its marker where the look read it. Once its
        task has published, the watch's look is on the round's critical path: the island that
        published first waits for the last path (benchmarks/RESULTS.md, "Islands on separate hosts":
        its watch noticed that publish 0.2-0.5 s late, then read the marker, one more round trip).
        A few peers' markers are read at once, one GET each, and the one found is the one the read
        uses; many peers are one listing, and each found marker is read then."""
        jobs = sorted(self.wanted)
        if len(jobs) <= PEER_MARKER_LOOKS:
            markers = map_io(
                lambda job: self.root.marker_if_committed(layout.path_dir(self.round, job)), jobs, self.root.io_threads
            )
            return {job: marker for job, marker in zip(jobs, markers) if marker is not None}
        listed = ListedRoot(self.root, [paths])
        return {job: None for job in jobs if listed.is_committed(layout.path_dir(self.round, job))}

    def _next_round(self) -> bool:
        """Whether the plan goes on past this task's round (read once, after the publish): only a
        next round starts early from the peers' weights."""
        if self._plan_goes_on is None:
            until = read_plan(self.root)
            self._plan_goes_on = until is not None and self.round + 1 < until
        return self._plan_goes_on

    def _read(self, job: str, names: list[tuple[str, list[int] | None]], marker: dict | None) -> None:
        rel = layout.path_dir(self.round, job)
        marker = marker or self.root.marker(rel)
        for name, levels in names:
            record = marker["files"].get(name)
            if not (isinstance(record, dict) and RECENT.worth_keeping(record["bytes"])):
                continue
            runs = recorded_runs(marker, name, levels)
            if runs is not None and self.root.read_committed_runs(rel, name, runs, marker, levels=levels) is not None:
                self.read.extend(f"{rel}/{name}#{begin}-{end}" for begin, end, _ in runs)  # as RecentFiles keeps them
                continue
            self.root.read_committed(rel, name, marker=marker)
            self.read.append(f"{rel}/{name}")

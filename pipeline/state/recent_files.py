"""What this process wrote to an object store, or read from it, lately: kept in memory so that
reading it again costs no transfer.

Across hosts, a path's task reads back mostly what its own island wrote a moment before: the
inner optimizer state it saved last round (2x the weights, the largest object of a task), the
weights it trained (read again by the merge of a module only its paths pass through), the modules
it merged. Over a 50 Mbit/s link the inner state alone took 2.4 s a task to come down again. And it
reads the same committed files round after round: its path's shard, a module shared by the paths
it trains.

A read is served from here only through RunRoot.read_committed, after the directory's `_SUCCESS`
has been read from the store as always, and only when the kept bytes match the record it keeps of
the file (length and CRC-32): the store stays the authority, this is a copy of bytes it certifies.
A local root keeps nothing (its reads are the page cache's). The budget bounds the memory: the
least recently used files go first; a file larger than a quarter of it is not kept, nor one under
64 KiB (records and metrics: a transfer of one is a short request, and a long run writes thousands).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

BUDGET_BYTES = 512 << 20  # the demo's island keeps ~40 MB a round; a paper-scale path's state is not kept
SMALLEST_BYTES = 64 << 10  # records, markers and metrics are read in one short request: not worth a slot


class RecentFiles:
    """Full object path -> the bytes this process last wrote or read there, least recently used first."""

    def __init__(self, budget: int = BUDGET_BYTES):
        self.budget = budget
        self._files: OrderedDict[str, bytes] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def worth_keeping(self, size: int) -> bool:
        return SMALLEST_BYTES <= size <= self.budget // 4

    def keep(self, full: str, data: bytes) -> None:
        """Remember what was just written to `full`, or read from it (a write that failed must not call this)."""
        with self._lock:
            self._drop(full)
            if not self.worth_keeping(len(data)):
                return
            self._files[full] = bytes(data)
            self._held += len(data)
            while self._held > self.budget:
                self._drop(next(iter(self._files)))

    def alias(self, src: str, dst: str) -> None:
        """A server-side copy from `src` to `dst`: the same bytes under a second name."""
        with self._lock:
            data = self._files.get(src)
        if data is not None:
            self.keep(dst, data)

    def get(self, full: str) -> bytes | None:
        """The bytes last written to `full`, or None; the caller checks them against their record."""
        with self._lock:
            data = self._files.get(full)
            if data is not None:
                self._files.move_to_end(full)
            return data

    def holds_under(self, prefix: str) -> bool:
        """Whether any kept file lies below the directory `prefix` (full path)."""
        below = prefix.rstrip("/") + "/"
        with self._lock:
            return any(name.startswith(below) for name in self._files)

    def forget_under(self, full: str) -> None:
        """A removal: the file `full` and everything below it as a directory."""
        below = full.rstrip("/") + "/"
        with self._lock:
            for name in [n for n in self._files if n == full or n.startswith(below)]:
                self._drop(name)

    def _drop(self, full: str) -> None:
        data = self._files.pop(full, None)
        if data is not None:
            self._held -= len(data)


RECENT = RecentFiles()  # one per process: every RunRoot of a run root shares it

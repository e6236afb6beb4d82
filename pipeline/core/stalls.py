"""The spans in which a reader's own small requests to the run root hung: silence it must not count.

A reader expires a lease once it has seen the holder's beat count unchanged for
`train.lease_seconds` on its own monotonic clock (pipeline/islands/task_queue.py), and a waiting
orchestrator takes over a run lock it saw unchanged for STALE_AFTER_S (pipeline/state/lock.py). A
store that froze, or a link that stopped for a while, holds back the holder's beats and the reader's
requests alike: when it answers again, a reader that asks at once finds the count as it was, and
counted the freeze as the holder's silence. Measured before this record existed (tiny config on
moto, 6 islands on 2 cores, the store stopped by SIGSTOP for 20 s mid-training): idle islands took
over a training island's task right after the store came back; its attempt was thrown away and
trained again.

So a reader keeps the spans in which its own lease listings and record reads took longer than a
tenth of a lease (a metadata request of a few hundred bytes), and counts a holder's silence
without them. Such a span says the store (or this reader's link to it) was not answering, so the
holder's beats could not land either; a dead holder is still expired, once it has been silent for a
lease while the store answered. Only the time past `slow_s` counts as a stall, so a store that is
slow throughout delays an expiry (by its latency over `slow_s`, a share of each read) without ever
preventing one. Large transfers are not timed here: their length is their bytes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, TypeVar

T = TypeVar("T")
KEEP = 256  # spans remembered: a reader asks a few a second, a lease is seconds


class Stalls:
    """Spans (monotonic seconds) in which a request of this reader hung past `slow_s`."""

    def __init__(self, slow_s: float):
        self.slow_s = slow_s
        self._spans: deque[tuple[float, float]] = deque(maxlen=KEEP)
        self._lock = threading.Lock()

    def timed(self, request: Callable[[], T]) -> T:
        """Run one small request; its time past `slow_s` becomes a stall span."""
        asked = time.monotonic()
        try:
            return request()
        finally:
            answered = time.monotonic()
            if answered - asked > self.slow_s:
                with self._lock:
                    self._spans.append((asked + self.slow_s, answered))

    def within(self, begin: float, end: float) -> float:
        """Seconds of [begin, end] covered by stall spans (overlapping spans counted once)."""
        with self._lock:
            spans = sorted((max(a, begin), min(b, end)) for a, b in self._spans if b > begin and a < end)
        total, reach = 0.0, begin
        for a, b in spans:
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total

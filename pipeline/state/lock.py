"""One orchestrator per run root: a second `dipaco run` (or DAG run) on the same root is refused.

Local roots use an advisory `flock` on `<run_root>/.lock`: the kernel drops it when the holder
dies, even by `kill -9`, so a crash never leaves the run stuck. Object-store roots have no
locks, so there the lock is a JSON record made with a conditional create, renewed by
compare-and-swap, and taken over once this reader saw it unchanged for STALE_AFTER_S.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from contextlib import contextmanager
from typing import IO, Iterator

from pipeline.core.bounds import SHOWN_CHARS, load_json, one_line, shown
from pipeline.core.errors import CorruptStateError, InputError, RunLockedError, StorageError
from pipeline.core.stalls import Stalls
from pipeline.state import layout
from pipeline.state.storage import RunRoot

HEARTBEAT_S = 5.0  # an object-store lock's renewal: a second orchestrator sees a live holder beat within this
STALE_AFTER_S = 4 * HEARTBEAT_S  # unchanged this long, as the reader's monotonic clock measures it: dead
POLL_S = 1.0
log = logging.getLogger("dipaco.lock")


def _holder() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "heartbeat": time.time()}


@contextmanager
def run_lock(root: RunRoot) -> Iterator[None]:
    if root.is_local:
        with _flock(root):
            yield
    else:
        with _heartbeat_lock(root):
            yield


@contextmanager
def _flock(root: RunRoot) -> Iterator[None]:
    path = root.local_path(layout.LOCK)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = _open_lock_file(path)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = one_line(
                handle.read(SHOWN_CHARS * 4), SHOWN_CHARS
            )  # the record, bounded: it is a file anyone can write
            raise RunLockedError(
                f"{root.path()}: another dipaco run holds this run root ({holder or 'unknown holder'})"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder()))
        handle.flush()
        yield
    finally:
        handle.close()  # closing releases the flock


def _open_lock_file(path) -> IO[str]:
    """The lock file, opened for update without following a link (O_NOFOLLOW) and refused when
    it is a link or has a second name (a hard link): the lock record is written in place, and
    through either it would overwrite a file outside the run root."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise CorruptStateError(
            f"{path}: cannot open the run lock ({exc.strerror}); it must be a plain file, not a link"
        ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise CorruptStateError(
            f"{path}: the run lock must be a plain file with one name; remove it if no dipaco run is live"
        )
    return open(fd, "a+", errors="replace")


@contextmanager
def _heartbeat_lock(root: RunRoot) -> Iterator[None]:
    """An object store's lock: a record created only if absent, renewed by compare-and-swap on the
    version this holder last wrote, released by a compare-and-swap to "released" (so a release never
    removes a lock someone else took over). A holder is judged dead only when this reader saw its
    record unchanged for STALE_AFTER_S on its own monotonic clock, up to when it asked the read that
    found it so and without the time its own reads hung (a frozen store holds the renewals back
    too): hosts' wall clocks are never compared, so a live holder whose clock is behind is never
    taken over."""
    version = _acquire(root)
    lost = threading.Event()
    stop = threading.Event()

    def beat() -> None:
        nonlocal version
        while not stop.wait(HEARTBEAT_S):
            try:
                renewed = root.replace_if(layout.LOCK, _record(), version)
            except StorageError as exc:  # a flaky store: the next beat tries again
                log.warning("%s: renewing the run lock failed (%s)", root.path(layout.LOCK), exc)
                continue
            if renewed is None:
                lost.set()
                log.error("%s: the run lock was taken over by another dipaco run; stop this one", root.url)
                return
            version = renewed

    thread = threading.Thread(target=beat, daemon=True, name="run-lock")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if not lost.is_set():
            try:
                root.replace_if(layout.LOCK, _record(state="released"), version)
            except StorageError as exc:
                log.warning("%s: releasing the run lock failed (%s); it expires by itself", root.url, exc)


def _record(state: str = "held") -> bytes:
    return json.dumps({**_holder(), "state": state}).encode()  # ownership is the version we last wrote


def _acquire(root: RunRoot) -> str:
    """Create the lock, or take over a released or dead one; RunLockedError while it is live."""
    seen, since = None, time.monotonic()
    # a store that stops answering holds the holder's renewals back too: the time this process's own
    # reads of the lock hung is no silence of the holder's, nor is the wait for an answer (pipeline/core/stalls.py)
    stalls = Stalls(slow_s=STALE_AFTER_S / 10)
    while True:
        created = root.create(layout.LOCK, _record())
        if created is not None:
            return created
        asked = time.monotonic()
        try:
            held = stalls.timed(lambda: root.read_versioned(layout.LOCK))
        except InputError:  # released and removed meanwhile: create again
            continue
        record = load_json(held.data, root.path(layout.LOCK), dict)  # damage: one line naming the file
        heartbeat, state = record.get("heartbeat", 0), record.get("state", "held")
        if not isinstance(heartbeat, (int, float)) or isinstance(heartbeat, bool) or state not in ("held", "released"):
            raise CorruptStateError(
                f"{root.path(layout.LOCK)}: heartbeat must be a time and state held or released, got "
                f"{shown(heartbeat)} and {shown(record.get('state'))}; remove the file if no dipaco run is live"
            )
        silent = asked - since - stalls.within(since, asked)
        if record.get("state") == "released" or (seen == held.version and silent >= STALE_AFTER_S):
            taken = root.replace_if(layout.LOCK, _record(), held.version)
            if taken is not None:
                if record.get("state") != "released":
                    log.warning(
                        "%s: took over a run lock unchanged for %.0f s (%s)", root.url, STALE_AFTER_S, shown(record)
                    )
                return taken
            continue  # someone else changed it first: look again
        if seen is not None and held.version != seen:  # it beat while we watched: a live holder
            raise RunLockedError(f"{root.url}: another dipaco run holds this run root ({shown(record)})")
        if seen is None:
            seen, since = held.version, time.monotonic()
            log.info("%s: a run lock exists; watching it for up to %.0f s", root.url, STALE_AFTER_S)
        time.sleep(min(POLL_S, max(0.05, since + STALE_AFTER_S - time.monotonic())))

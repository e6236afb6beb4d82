"""One orchestrator per run root: a second `dipaco run` (or DAG run) on the same root is refused.

Local roots use an advisory `flock` on `<run_root>/.lock`: the kernel drops it when the holder
dies, even by `kill -9`, so a crash never leaves the run stuck. Object-store roots have no
locks, so there the lock is a JSON record refreshed by a heartbeat and taken over once stale.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import threading
import time
from contextlib import contextmanager
from typing import IO, Iterator

from pipeline.core.bounds import SHOWN_CHARS, one_line, shown
from pipeline.core.errors import CorruptStateError, RunLockedError
from pipeline.state import layout
from pipeline.state.storage import RunRoot

HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0


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
    if root.exists(layout.LOCK):
        held = root.read_json(layout.LOCK)
        heartbeat = held.get("heartbeat", 0)
        if not isinstance(heartbeat, (int, float)) or isinstance(heartbeat, bool):
            raise CorruptStateError(
                f"{root.path(layout.LOCK)}: heartbeat must be a time, got {shown(heartbeat)}; "
                f"remove the file if no dipaco run is live"
            )
        if time.time() - heartbeat < STALE_AFTER_S:
            raise RunLockedError(f"{root.url}: another dipaco run holds this run root ({shown(held)})")
    root.write_json(layout.LOCK, _holder())
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            root.write_json(layout.LOCK, _holder())

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        root.remove(layout.LOCK)

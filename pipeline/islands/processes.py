"""Stopping what a run started: every process of a launch, found by pid, signalled, waited for.

A `deepspeed` launch is three generations (the runner, deepspeed.launcher.launch, one process per
rank) in one process group. Signalling only the runner is not enough: it dies at once on SIGTERM
and its children live on, reparented, while a rank blocked in a gloo collective only sees the
signal once its peer is gone (measured before this module: 14-40 s of orphaned launchers and
ranks after Ctrl-C). So a stop takes a snapshot of the tree first (the group and every
descendant), signals each pid, waits until none of them is alive, and kills what is left after
a bounded grace period. Read from /proc (Linux); elsewhere only the process group is signalled.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("dipaco.launch")
STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL: a rank releases its lease within a second when it is not blocked
_PROC = Path("/proc")


def process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state letter) of every process this user can see."""
    table = {}
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone between the listing and the read
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ")"
        fields = stat[stat.rfind(")") + 2 :].split()
        table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def descendants(pid: int, table: dict[int, tuple[int, int, str]] | None = None) -> set[int]:
    """Every living process below `pid` (children, their children, ...)."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for child, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def group_members(pgid: int, table: dict[int, tuple[int, int, str]] | None = None) -> set[int]:
    table = process_table() if table is None else table
    return {pid for pid, (_, group, _) in table.items() if group == pgid}


def alive(pids: set[int]) -> set[int]:
    """The pids that still run (a zombie has finished: only its parent's wait is missing)."""
    table = process_table()
    if not table:  # no /proc: ask the kernel, which cannot tell a zombie
        return {pid for pid in pids if _exists(pid)}
    return {pid for pid in pids if pid in table and table[pid][2] != "Z"}


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _signal(pids: set[int], groups: set[int], signum: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def tree(leaders: list[int], groups: list[int]) -> set[int]:
    """A snapshot of what to stop: the leaders, their descendants and the members of the groups."""
    table = process_table()
    found = set(leaders)
    for pid in leaders:
        found |= descendants(pid, table)
    for pgid in groups:
        found |= group_members(pgid, table)
    return found - {os.getpid()}


def stop(pids: set[int], groups: set[int] = frozenset(), grace_s: float = STOP_GRACE_S) -> dict:
    """SIGTERM to every pid and group, wait up to `grace_s` for all of them, SIGKILL the rest and
    wait for those too. Returns how many were stopped and how many had to be killed."""
    pids = set(pids) - {os.getpid()}
    _signal(pids, set(groups), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive(left)
    killed = len(left)
    if left:
        log.warning("killing %d processes still running %.0f s after SIGTERM: %s", len(left), grace_s, sorted(left))
        _signal(left, set(groups), signal.SIGKILL)
        deadline = time.monotonic() + 5.0  # SIGKILL cannot be ignored; this only waits for the kernel
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = alive(left)
    return {"processes": len(pids), "killed": killed, "still_running": sorted(left)}

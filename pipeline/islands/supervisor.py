"""The island launches this process starts, watched until the plan is done or stopped together.

`dipaco run` starts `train.islands` islands and supervises them (Supervisor): it reports each
round as the islands finish it (a callback, since tracking is above this package), starts again
an island that crashed (its running attempt failed at once, so another island may take the task;
pipeline.islands.attempts counts the restarts) and, on an interrupt or an error, stops every
island it started and releases their tasks. A DAG island task and `dipaco island` run one island
each (run_island, join), stopped the same way when their process is told to stop.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import threading
import time
from typing import Callable

from pipeline.core.config import Config
from pipeline.core.errors import InputError, IslandError
from pipeline.islands.attempts import Attempts
from pipeline.islands.launch import INPUT_ERROR_EXIT, IslandProcess, island_names, stop_launches, trainer_message
from pipeline.islands.task_queue import ISLANDS, TaskQueue, read_plan
from pipeline.state.storage import RunRoot

log = logging.getLogger("dipaco")
POLL_S = 0.5  # how often the supervisor looks at its islands (and a local root's round)
# How often it asks an object store whether the round finished: two requests, each a round trip
# that the store serves on its own CPU; twice a second they were a quarter of a run's requests on
# two hosts (benchmarks/RESULTS.md, "Islands on separate hosts"), for reports a second sooner.
STORE_POLL_S = 2.0


class Supervisor:
    """The islands of one `dipaco run` on this machine, from start to the end of the plan."""

    def __init__(self, config: Config, root: RunRoot, reshard: Callable | None = None):
        self.config, self.root, self.reshard = config, root, reshard
        self.queue = TaskQueue(root, config)
        self.allowed = Attempts.of_islands(config.train)
        self.islands: dict[str, IslandProcess] = {}
        self.crashes: dict[str, int] = {}
        self.left: set[str] = set()  # islands that left on SIGTERM: not started again

    def run(self, todo: range, report: Callable[[int], object]) -> None:
        """Train the rounds `todo` on the islands, calling `report(r)` as each round finishes."""
        if self.config.train.launcher == "inprocess":  # tests and debugging: one one-rank island, here
            run_island(self.config, self.root, island_names(self.config.train)[0], reshard=self.reshard)
            for r in todo:
                report(r)
            return
        self.islands = {name: IslandProcess(self.config, name) for name in island_names(self.config.train)}
        pending = list(todo)
        every = POLL_S if self.root.is_local else STORE_POLL_S
        asked = -math.inf  # when the store was last asked about the pending round
        try:
            while pending:
                if time.monotonic() - asked >= every:
                    asked = time.monotonic()
                    if self.queue.round_finished(pending[0]):
                        report(pending.pop(0))
                        asked = -math.inf  # the next round may be finished too
                        continue
                for name, process in list(self.islands.items()):
                    self._look_at(name, process)
                if self._all_gone() and not self.queue.round_finished(pending[0]):
                    raise IslandError(
                        f"every island left before round {pending[0]} finished; start one with "
                        f"`dipaco island --config ...` or rerun `dipaco run` to resume"
                    )
                time.sleep(POLL_S)
        except BaseException as exc:  # Ctrl-C, SIGTERM (pipeline.cli), an error: stop them all, release their tasks
            interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
            stop_islands(
                self.config,
                self.root,
                self.islands,
                "interrupted" if interrupted else f"stopping after {type(exc).__name__}",
            )
            raise
        for process in self.islands.values():  # the plan is done: they are leaving by themselves
            try:
                process.wait(timeout=60)
            except Exception:
                stop_islands(self.config, self.root, self.islands, "still running after the plan was done")

    def _look_at(self, name: str, process: IslandProcess) -> None:
        """An island that exited with an error left on SIGTERM (not started again), or crashed:
        started again while its launches allow (its running attempt failed at once), else the
        run fails with the island's own message."""
        returncode = process.poll()
        if returncode is None or returncode == 0 or name in self.left:
            return
        process.wait()
        if island_left(self.root, name):  # it released its task and left, as asked
            log.info("%s left the run (SIGTERM); the other islands go on", name)
            self.left.add(name)
            return
        self.crashes[name] = self.crashes.get(name, 0) + 1
        if not self.allowed.may_try_again(self.crashes[name], input_error=returncode == INPUT_ERROR_EXIT):
            del self.islands[name]
            island_failed(self.config, self.root, name, returncode, process.tail, process.island_id)
        log.warning(
            "%s exited with status %s; starting it again (restart %d of at most %d)",
            name,
            returncode,
            self.crashes[name],
            self.allowed.limit - 1,
        )
        self.queue.fail_running(process.island_id, f"island exited with status {returncode}")
        self.islands[name] = IslandProcess(self.config, name)

    def _all_gone(self) -> bool:
        return all(p.poll() is not None and (p.poll() == 0 or n in self.left) for n, p in self.islands.items())


def run_island(
    config: Config, root: RunRoot, island: str, ds_config: str | None = None, reshard: Callable | None = None
) -> dict:
    """One island until the plan is done: a `deepspeed` launch of pipeline.island_rank (with
    `train.launcher: inprocess`, this process as a one-rank island, given the Beam job `reshard`
    for its reroute tasks by the stages above). Raises when it failed."""
    if config.train.launcher == "inprocess":
        from pipeline.islands.island import Island

        return Island(config, island, reshard=reshard).run()
    process = IslandProcess(config, island, ds_config)
    try:
        with sigterm_raises():
            returncode = process.wait()
    except BaseException:  # Ctrl-C, SIGTERM, an Airflow task killed: nothing the island started outlives it
        stop_islands(config, root, {island: process}, "interrupted")
        raise
    if returncode != 0 and island_left(root, island):
        return {"island": island, "returncode": returncode, "left": True}
    if returncode != 0:
        island_failed(config, root, island, returncode, process.tail, process.island_id)
    return {"island": island, "returncode": returncode}


def join(config: Config, root: RunRoot, name: str | None = None, reshard: Callable | None = None) -> dict:
    """One more island on a run that `dipaco run` (or a DAG run) planned; it leaves when the plan
    is done, or on SIGTERM (releasing its task)."""
    if read_plan(root) is None:
        raise InputError(f"{root.path()}: no run planned here yet (no queue/plan.json); start `dipaco run` first")

    def leave(signum, frame):  # SIGTERM to `dipaco island`: the island releases its task and leaves
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, leave)
    return run_island(
        config, root, name or f"{socket.gethostname()}-{os.getpid()}", ds_config=config.train.ds_config, reshard=reshard
    )


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises SystemExit here (after the handler it replaces ran), so the caller can stop
    what it started. Airflow 3's task runner only calls the operator's on_kill on SIGTERM and
    SIGKILLs the task later: the island launch, in a session of its own, would outlive it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        if callable(previous):
            previous(signum, frame)  # the CLI's raises Interrupted; Airflow's calls on_kill
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def island_failed(config: Config, root: RunRoot, island: str, returncode: int, tail: list[str], island_id: str) -> None:
    """An island exited with an error for good: its running attempt is failed at once (no need to
    wait out the lease); a config or input error is raised with the trainer's own message."""
    TaskQueue(root, config).fail_running(
        island_id, f"island exited with status {returncode}: {tail[-1] if tail else ''}"[:2000]
    )
    if returncode == INPUT_ERROR_EXIT:
        raise InputError(f"{island}: {trainer_message(tail)}")
    raise IslandError(f"{island} exited with status {returncode}: {tail[-1] if tail else 'no output'}")


def island_left(root: RunRoot, name: str) -> bool:
    """The island's record says it left on SIGTERM (pipeline.islands.island)."""
    rel = f"{ISLANDS}/{name}.json"
    return root.exists(rel) and root.read_json(rel).get("state") == "left"


def stop_islands(config: Config, root: RunRoot, islands: dict[str, IslandProcess], why: str) -> dict:
    """Stop the island launches this process started (every launcher and rank, signalled by pid,
    killed after a grace period) and release the tasks they held, so that a rerun started now
    neither overlaps them nor waits out their leases. Says what it did."""
    if not islands:
        return {}
    started = time.time()
    outcome = stop_launches(list(islands.values()))
    queue, now = TaskQueue(root, config), time.time()
    released = [
        task for process in islands.values() for task in queue.release_running(process.island_id, why, since=started)
    ]
    for name in islands:  # a killed island could not say when it stopped: utilisation needs its end
        rel = f"{ISLANDS}/{name}.json"
        record = root.read_json(rel) if root.exists(rel) else None
        if record and record.get("state") == "running":
            root.write_json(rel, {**record, "state": "stopped", "finished_at": now})
    log.warning(
        "%s: stopped %d island(s) (%d processes, %d killed after the grace period); %s",
        why,
        len(islands),
        outcome.get("processes", 0),
        outcome.get("killed", 0),
        f"released {', '.join(released)}" if released else "they held no task",
    )
    return {**outcome, "released": released}

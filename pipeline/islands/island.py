"""An island: one `deepspeed` launch that lives for the whole run and pulls tasks from the queue.

    deepspeed [--hostfile H --num_nodes N] --num_gpus G --no_local_rank \
        --module pipeline.island_rank --run-root URL --island NAME [--ds-config FILE] [--config FILE --set K=V]

Its ranks form one process group for their whole life, so the launch, the interpreter starts and
DeepSpeed's first-start costs are paid once per run instead of once per (path, round). Rank 0
claims a task (pipeline.islands.task_queue) and broadcasts it; every rank runs a train task (a fresh
ZeRO engine per task, released after it, the path's modules and inner optimizer state loaded as
for a one-shot launch); rank 0 alone runs the small ones (a module's merge, a round's commit,
a path's evaluation and the round's evaluation file, the re-routing of router.discriminative_after
with its in-memory Beam job) while the others wait for the next task. That Beam job is the
Beam app's (preprocessing), which this package may not import: the island is given it as
`reshard` by whoever starts it (pipeline.island_rank, the entry point of each launched rank, or
pipeline.stages for an in-process island).

An island leaves when the plan (`queue/plan.json`) is done. SIGTERM makes it release the task it
holds (another island takes it at once, no attempt lost) and leave. A task that raises ends the
island with its error (the launcher then stops every rank), the attempt is marked failed, and
whoever started the island decides whether to start it again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Callable

from pipeline.core.config import Config
from pipeline.core.errors import DipacoError
from pipeline.islands.peers import PeerReads
from pipeline.islands.task_queue import BEHIND_KINDS, ISLANDS, Lease, Task, TaskQueue, module_target, read_plan
from pipeline.state import layout
from pipeline.state.storage import RunRoot

if TYPE_CHECKING:
    from pipeline.evaluation.reroute import Reshard

log = logging.getLogger("dipaco.island")
POLL_S = 0.5  # how often an idle island looks for ready work
PLAN_TTL_S = 2.0  # how long an island's read of the plan stands (Island._plan)
BESIDE_WAIT_S = 10.0  # the longest the tasks beside an early start wait for its first step
IDLE_BROADCAST_S = 5.0  # an idle rank 0 tells its peers so every few seconds (keeps collectives short)
LEFT_EXIT = 0


def early_wait_s(lease_seconds: float) -> float:
    """How long an early start's publish waits for the merges it started from (pipeline/outer/early.py):
    a holder that died is expired after a lease, and its merge then taken over."""
    return max(60.0, 4 * lease_seconds)


class Island:
    """The loop every rank of an island runs; rank 0 talks to the queue."""

    def __init__(self, config: Config, name: str, island_id: str | None = None, *, reshard: Reshard):
        # The name is what people read (queue/islands/<name>.json); the id is this process's own,
        # so failing "island-0"'s leases never fails another run's island-0 (a DAG beside the CLI).
        # `reshard` is the Beam job of a reroute task: required, so an island can run every task.
        self.config, self.name, self.reshard = config, name, reshard
        self.id = island_id or new_island_id(name)
        self.root = RunRoot(config.run_root)
        self.queue = TaskQueue(self.root, config)
        self.lease: Lease | None = None
        self.keeping: list[tuple[Lease, threading.Thread]] = []  # published tasks whose inner state uploads
        self.next_up: list[Lease] = []  # merges claimed with the one it runs (TaskQueue.claim_held_merges)
        self.until: int | None = None  # the plan's until_round, as its last look at the queue read it
        self._plan_read_at: float | None = None  # monotonic time of that read
        self.finishing: list[threading.Thread] = []  # records of done small tasks still going up
        self.behind: list[tuple[list[Lease], threading.Thread]] = []  # small tasks run beside (_run_beside)
        self._keeping_lock = threading.Lock()  # start_keeping runs on the main thread and the one behind
        self._finishing_lock = threading.Lock()
        self.leaving = False
        self.done: list[dict] = []
        self.rank, self.world = 0, 1

    def run(self) -> dict:
        from pipeline.train.distributed import init_distributed

        rank, world = init_distributed()
        self.rank, self.world = rank, world
        if rank == 0:
            self._record(
                state="running",
                world_size=world,
                started_at=time.time(),
                finished_at=None,
                lifetimes=self._past_lifetimes(),
            )
        while True:
            message = broadcast_json(self._next_message() if rank == 0 else None, rank, world)
            if "exit" in message:
                if rank == 0:
                    self.wait_for_keeping(self.queue.lease_seconds)
                    self._record(state=message["exit"], finished_at=time.time())
                    log.info("island %s leaves: %s (%d tasks done)", self.name, message["exit"], len(self.done))
                return {"island": self.name, "tasks": self.done, "exit": message["exit"]}
            if "task" in message:
                self._execute(Task.from_json(message["task"]), message.get("attempt"))

    def _next_message(self) -> dict:
        """The next task for every rank, an exit, or (after IDLE_BROADCAST_S) an idle beat."""
        waited = time.monotonic()
        while True:
            if self.leaving:
                return {"exit": "left"}
            while self.next_up:  # claimed already, and beating since: no look at the queue between
                self.lease = self.next_up.pop(0)
                if not self.lease.lost.is_set():
                    return {"task": self.lease.task.to_json(), "attempt": self.lease.number}
            until = self._plan()
            if until is None:  # gone, or the cached read is: leave only on what the plan says now
                until = self._plan(fresh=True)
                if until is None:
                    return {"exit": "finished"}
            # Ready work first: a finished plan has none, and on an object store every question
            # before a claim is a round trip between one task and the next.
            self.lease = self.queue.next_claim(self.name, until, self.id, early_first=self.world == 1)
            if self.lease is not None and self.lease.early:  # its path's next round, claimed first
                self._start_early(self.lease)
                return {"task": self.lease.task.to_json(), "attempt": self.lease.number}
            if self.lease is not None:
                self.next_up = self.queue.claim_held_merges(self.lease.task, self.name, self.id)
            if (self.lease is None or self.lease.task.kind != "train") and self._start_early():
                return {"task": self.lease.task.to_json(), "attempt": self.lease.number}
            if self._small_beside():
                continue
            if self.lease is not None:
                if self.lease.task.kind != "merge":
                    self.start_keeping()
                return {"task": self.lease.task.to_json(), "attempt": self.lease.number}
            if not self._merging_beside():  # idle: nothing for the uplink to carry first
                self.start_keeping()
            if self.queue.finished(until):
                if self._plan(fresh=True) == until:  # leave on what the plan says now
                    return {"exit": "finished"}
                continue
            if self.world > 1 and time.monotonic() - waited > IDLE_BROADCAST_S:
                return {"idle": True}
            self.queue.news.wait(POLL_S)  # or less: a peer's publish that this process saw (peers.PeerReads)
            self.queue.news.clear()

    def _start_early(self, early: Lease | None = None) -> bool:
        """Claim a path's next round to start before its merges are committed (TaskQueue.claim_early,
        pipeline/outer/early.py; `early`: next_claim claimed it) and make it this island's task; the
        merges and round commits ready at this look are claimed and run on a thread beside it,
        from its first step (their uploads overlap the inner loop), then the inner states kept
        later go up. Claimed on that thread, each create (and each refused one) is no round trip
        before the training starts. An evaluation or re-routing claimed at this look is released:
        it would take the cores from the training. One-rank islands only: only they keep an inner
        state in memory (keep_later)."""
        if self.world > 1:
            return False
        claimed = [] if early is not None else ([self.lease] if self.lease is not None else []) + self.next_up
        tried = early is None  # next_claim tried the ready merges when it did not claim the early start itself
        early = early or self.queue.claim_early(self.name, self.id)
        if early is None:
            return False
        self.next_up = []
        behind = [lease for lease in claimed if lease.task.kind in BEHIND_KINDS]
        for lease in claimed:
            if lease.task.kind not in BEHIND_KINDS:
                lease.finish("released")
        self.lease = early
        log.info(
            "island %s: %s starts before the merges of %s (%d claimed run beside it; claimed beside it: %s)",
            self.name,
            early.task.name,
            ", ".join(module_target(key) for key in early.early),
            len(behind),
            "the ready commits" if tried else "the ready merges and commits",
        )
        # one claimed already is held: skipped
        claims = self.queue.behind_claims(self.name, self.id, None if tried else early.early)
        self._run_beside(behind, early.task.name, after=early.training, claims=claims)
        return True

    def _small_beside(self) -> bool:
        """Run a merge or round commit this island just claimed (with the merges claimed beside it)
        on a thread, and look again at once (one-rank islands on an object store). A commit is
        server-side copies and a few small writes; claimed in the wait for a peer's path, it held
        back the early start that path's publish allowed (1-2 s across hosts). A merge is claimed
        by the island that published first, of the module only its path feeds, while its peers
        still train: run in the foreground it took 1.1-1.3 s across hosts (its 3.8 MB go up), and a
        peer that published meanwhile found this island busy, its next round's start that late.
        An idle island starts no upload of the inner states kept later while they run (they start
        with its next other task, or after them): the merges gate the round's next tasks, and on a
        host's one uplink the state (2x the weights) slowed them."""
        if self.world > 1 or self.root.is_local or self.lease is None or self.lease.task.kind not in BEHIND_KINDS:
            return False
        self._run_beside([self.lease, *self.next_up], "")
        self.lease, self.next_up = None, []
        return True

    def _merging_beside(self) -> bool:
        """Whether a merge or commit still runs on a thread beside (_run_beside, _small_beside)."""
        return any(thread.is_alive() for _, thread in self.behind)

    def _run_beside(
        self,
        leases: list[Lease],
        beside: str,
        after: threading.Event | None = None,
        claims: tuple[Callable[[], list[Lease]], Callable[[], list[Lease]]] | None = None,
    ) -> None:
        """Small tasks (merges, commits) on a thread beside what the island runs next, then the inner
        states kept later go up; a task that fails ends its lease failed (another island retakes it).
        `after`: they wait for it first (an early start's first step, at most BESIDE_WAIT_S): the
        start's own load computes the same merges and reads the same files, and on an object
        store the two at once took a train task's load from 0.3-0.4 s to 0.5-0.75 s. `claims`: more
        of them to claim on the thread, before waiting for `after` and after it (TaskQueue.behind_claims;
        their leases join `leases`, which SIGTERM releases)."""

        def claim(which: Callable[[], list[Lease]]) -> None:
            try:
                leases.extend(which())
            except Exception as exc:  # noqa: BLE001 - unclaimed, they are another island's to take
                log.warning("island %s: claiming the tasks beside %s failed: %s", self.name, beside, exc)

        def run() -> None:
            if claims is not None:
                claim(claims[0])
            if after is not None:
                after.wait(BESIDE_WAIT_S)
            if claims is not None:
                claim(claims[1])
            for lease in leases:
                if lease.lost.is_set():  # taken by another island meanwhile: its output is that one's
                    continue
                began = time.time()
                try:
                    run_task(self.config, lease.task, 0, lease.number, lease, reshard=self.reshard)
                except Exception as exc:  # noqa: BLE001 - the lease records it; the task is retaken
                    log.warning("island %s: %s (on a thread beside) failed: %s", self.name, lease.task.name, exc)
                    lease.finish("failed", error=f"{type(exc).__name__}: {exc}"[:2000])
                    continue
                self._end(lease.task, lease, True, time.time() - began, {"beside": beside} if beside else {})
            self.start_keeping()

        if not leases and after is None:
            self.start_keeping()
            return
        name = beside or (leases[0].task.name if leases else "keep")
        thread = threading.Thread(target=run, daemon=True, name=f"beside-{name}")
        self.behind = [(held, alive) for held, alive in self.behind if alive.is_alive()] + [(leases, thread)]
        thread.start()

    def _plan(self, fresh: bool = False) -> int | None:
        """The plan's until_round, read again after PLAN_TTL_S (or `fresh`): on an object store a
        read is a round trip before a look at the queue, between a merge and the next task across
        hosts. A run that raises the plan is seen that much later; an island leaves only on a
        fresh read."""
        now = time.monotonic()
        if fresh or self._plan_read_at is None or now - self._plan_read_at >= PLAN_TTL_S:
            self.until, self._plan_read_at = read_plan(self.root), now
        return self.until

    def _execute(self, task: Task, attempt: int | None = None) -> None:
        from pipeline.train.train_path import AttemptCancelled

        claimed = time.time()
        try:
            outcome = run_task(
                self.config, task, self.rank, attempt, self.lease if self.rank == 0 else None, reshard=self.reshard
            )
        except AttemptCancelled as exc:  # another attempt published first, or this one lost its lease
            if self.rank == 0 and self.lease is not None:
                self.lease.finish("cancelled", seconds=time.time() - claimed, error=str(exc)[:2000])
                self.lease = None
            log.info("island %s: %s stopped: %s", self.name, task.name, exc)
            return
        except BaseException as exc:
            if self.rank == 0 and self.lease is not None and not isinstance(exc, SystemExit):
                self.lease.finish(
                    "failed", error=f"{type(exc).__name__}: {exc}"[:2000], input_error=isinstance(exc, DipacoError)
                )
                self.lease = None
            for lease in self.next_up:  # claimed with it, not started: another island takes them at once
                lease.finish("released")
            raise
        if self.rank == 0 and self.lease is not None:
            finished, lease, self.lease = time.time(), self.lease, None
            outcome = dict(outcome or {})
            published = outcome.pop("published", True)
            inner = outcome.pop("inner_state", published)  # kept (True), not (False), or still to keep
            if isinstance(inner, bool):
                self._end(task, lease, inner, finished - claimed, outcome)
            else:
                self.keep_later(task, lease, inner, published, finished - claimed, outcome)

    def keep_later(self, task: Task, lease: Lease, inner, published: bool, seconds: float, outcome: dict) -> None:
        """Keep a published path's inner state (train_path.keep_inner_state) in a thread while the
        island takes its next task: on an object store the state is 2x the weights, and only the
        path's next round reads it; the round's commit waits for it (TaskQueue). The lease stays
        held and beating until the state is in, so an island that dies meanwhile has its task taken
        over: the taker trains the path again and keeps its state, byte for byte. `seconds` (claim
        to publish) is what the task kept the island busy.

        Meanwhile the path's next round may start here, from the state in memory (its bytes are the
        ones going up: TaskQueue.keeping_here, train_path's held_inner_state); elsewhere it waits for
        the state to be kept. The upload starts once the island runs something other than a merge
        (start_keeping): the merges that follow a publish gate the round's next tasks, and on a
        host's one uplink the state (2x the weights) slowed their uploads down. In the plan's last
        round it starts at once: the round's commit waits for it, and no next round for the merges."""
        from pipeline.train.train_path import keep_inner_state

        if not published and self.queue.task_done(task):  # a peer's output and state are in: nothing to keep
            self._end(task, lease, False, seconds, outcome)
            return
        held = (task.round, task.target)

        def keep() -> None:
            began = time.monotonic()
            try:
                kept = keep_inner_state(inner, lease.held)
            except Exception as exc:  # noqa: BLE001 - a thread's last word: the lease records it, the task is retaken
                log.warning("island %s: keeping the inner state of %s failed: %s", self.name, task.name, exc)
                outcome["error"] = f"keeping its inner state: {type(exc).__name__}: {exc}"[:2000]
                kept = False
            outcome["inner_state_s"] = round(time.monotonic() - began, 3)
            self.queue.keeping_here.pop(held, None)
            self.queue.news.set()  # a look now, not at the next poll: the round's commit may be ready
            self._end(task, lease, kept, seconds, outcome)

        thread = threading.Thread(target=keep, daemon=True, name=f"keep-{task.name}")
        self.queue.keeping_here[held] = inner
        self.keeping.append((lease, thread))
        if self.until is None or task.round + 1 >= self.until:  # no next round for the merges to gate
            thread.start()

    def start_keeping(self) -> None:
        """Start the uploads of the inner states keep_later deferred (each thread starts once)."""
        with self._keeping_lock:
            for _, thread in self.keeping:
                if thread.ident is None:
                    thread.start()

    def _end(self, task: Task, lease: Lease, ok: bool, seconds: float, outcome: dict) -> None:
        """Record how an attempt ended. A train attempt that published nothing and kept no inner
        state is cancelled (not counted) only when another attempt did the task; an attempt that
        could not otherwise (it lost its lease, debris in the way) is a failed attempt toward
        train.max_attempts: such attempts once ended cancelled forever."""
        if not ok:
            lost_to_peer = self.queue.task_done(task)
            if not lost_to_peer:
                outcome.setdefault("error", "its output could not be published, or its inner state kept")
            lease.finish("cancelled" if lost_to_peer else "failed", seconds=seconds, **outcome)
            return
        if task.kind == "train":
            lease.finish("done", seconds=seconds, **outcome)
        else:  # its output is committed: the record goes up while the island looks for its next task
            done = threading.Thread(
                target=lease.finish, args=("done",), kwargs={"seconds": seconds, **outcome}, daemon=True
            )
            done.start()
            with self._finishing_lock:  # ended on the main thread and on those beside at once
                self.finishing = [t for t in self.finishing if t.is_alive()] + [done]
        self.done.append({"task": task.name, "seconds": seconds})
        log.info("island %s: %s done in %.1f s", self.name, task.name, seconds)

    def wait_for_keeping(self, timeout: float) -> None:
        """Let the inner states still uploading finish (the plan's end needs them anyway); what is
        still running after `timeout` is released, so another island keeps it."""
        deadline = time.monotonic() + timeout
        for leases, thread in self.behind:  # merges and commits beside an early start: they keep after them
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                for lease in leases:
                    lease.finish("released")
        self.start_keeping()
        for thread in self.finishing:
            thread.join(max(0.0, deadline - time.monotonic()))
        for lease, thread in self.keeping:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                lease.finish("released")

    def on_sigterm(self, signum, frame) -> None:
        """Release the task held (no attempt is lost) and leave; idle, leave at the next poll."""
        self.leaving = True
        for lease, _ in self.keeping:  # an inner state not in yet: another island trains the path again
            lease.finish("released")
        for lease in self.next_up:  # claimed, not started: another island takes it at once
            lease.finish("released")
        for leases, _ in self.behind:  # those done are ended already: finish() ends a lease once
            for lease in leases:
                lease.finish("released")
        if self.rank == 0 and self.lease is not None:
            self.lease.finish("released")
            self._record(state="left", finished_at=time.time())
            log.info("island %s: SIGTERM, released %s and left", self.name, self.lease.task.name)
            logging.shutdown()
            os._exit(LEFT_EXIT)
        if self.rank != 0:
            os._exit(LEFT_EXIT)

    def _past_lifetimes(self) -> list:
        """The earlier lives of this island name, [started_at, finished_at or None], kept so that
        utilisation counts the time the island ran and not the pauses between runs. A life that is
        not two times (a record anyone could have written) is dropped with one warning naming the file."""
        rel = f"{ISLANDS}/{self.name}.json"
        record = self._read_record(rel)
        lives = record.get("lifetimes") or []
        good = [list(life) for life in lives if is_lifetime(life)] if isinstance(lives, list) else []
        if not isinstance(lives, list) or len(good) != len(lives):
            log.warning("%s: lifetimes must be a list of [start, end] times; dropped the bad ones", self.root.path(rel))
        if _time(record.get("started_at")):
            finished = record.get("finished_at")
            good.append([record["started_at"], finished if _time(finished) else None])
        return good

    def _read_record(self, rel: str) -> dict:
        """This island's record, or {} when there is none or it is not one (warned, naming the file)."""
        if not self.root.exists(rel):
            return {}
        try:
            return self.root.read_json(rel)
        except DipacoError as exc:
            log.warning("%s; starting a new island record", exc)
            return {}

    def _record(self, **fields) -> None:
        rel = f"{ISLANDS}/{self.name}.json"
        record = self._read_record(rel)
        record.update(island=self.name, island_id=self.id, host=socket.gethostname(), pid=os.getpid(), **fields)
        self.root.write_json(rel, record)


def _time(value) -> bool:
    """A wall-clock time a holder could have written: a finite number, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_lifetime(life) -> bool:
    """[started_at, finished_at or None], as Island._past_lifetimes keeps them."""
    return isinstance(life, (list, tuple)) and len(life) == 2 and _time(life[0]) and (life[1] is None or _time(life[1]))


def new_island_id(name: str) -> str:
    """An island process's identity: its name and a random suffix, unique per process."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def run_task(
    config: Config,
    task: Task,
    rank: int,
    attempt: int | None = None,
    lease: Lease | None = None,
    reshard: Reshard | None = None,
) -> dict | None:
    """Do one task on this rank; what the lease records of it (rank 0). A train task writes into
    its attempt's staging directory and publishes only while rank 0's `lease` is held, and under a
    lease returns its inner state still to keep (`inner_state`, Island.keep_later) on a one-rank
    island; a reroute task re-shards with `reshard` (the Beam job)."""
    root = RunRoot(config.run_root)
    if task.kind == "train":
        from pipeline.train.train_path import AttemptCancelled, train_path

        stop = (lambda: lease.cancelled.is_set() or lease.lost.is_set()) if lease is not None else (lambda: False)
        peers = PeerReads(lease.queue, task) if lease is not None else None
        held = lease.queue.keeping_here.get((task.round - 1, task.target)) if lease is not None else None
        early = _early_start(config, task, lease) if lease is not None and lease.early else None
        merge_here = _merge_here(config, task, lease) if early is not None else None

        def early_checked() -> bool:  # the merges it started from committed, bitwise, and the lease held
            why = early.checked(early_wait_s(lease.queue.lease_seconds), merge_here)
            if why is not None:
                raise AttemptCancelled(f"{task.name}: {why}")
            return lease.held()  # asked last, right before the publish: the fence

        may_publish = early_checked if early is not None else lease.held if lease is not None else None

        def on_step(step: int, from_step: int, inner_s: float) -> None:
            lease.report_step(step, from_step, inner_s)
            lease.training.set()
            if step >= config.train.inner_steps:  # the inner loop is over: its weights go up next
                peers.start()
                if early is not None:  # its merges' check too, while the weights go up
                    early.check_beside(early_wait_s(lease.queue.lease_seconds), merge_here)

        published = False
        try:
            metrics = train_path(
                config,
                task.round,
                task.target,
                attempt=f"attempt-{attempt}" if attempt else None,
                may_publish=may_publish,
                should_stop=stop,
                on_step=on_step if lease is not None else None,
                keep_inner_state_later=lease is not None,
                held_inner_state=held,
                start_modules=early.modules if early is not None else None,
            )
            published = bool(metrics.get("published", True))
        finally:
            if peers is not None:  # published: the peers still training are watched a while more
                peers.published() if published else peers.stop()
            if early is not None:
                early.stop()
            if lease is not None:  # what waits for the first step waits no longer
                lease.training.set()
        return {
            "inner_started_at": metrics["started_at"],
            "inner_finished_at": metrics["finished_at"],
            "inner_seconds": metrics["seconds"],
            "resumed_from_step": metrics.get("resumed_from_step", 0),
            "published": metrics.get("published", True),
            "inner_state": metrics.get("inner_state", True),  # kept, or an InnerState still to keep
            **({"peer_reads": peers.read} if peers is not None and peers.started else {}),  # filled as they come
            **({"early_start": [module_target(key) for key in early.pending]} if early is not None else {}),
        }
    if rank != 0:
        return None
    if task.kind == "merge":
        from pipeline.outer.merge import merge_module

        merge_module(config, task.round, task.module)
    elif task.kind == "commit":
        from pipeline.outer.merge import finish_round

        finish_round(config, task.round)
    elif task.kind == "eval":
        from pipeline.evaluation.evaluate import evaluate_path

        root.write_json(
            layout.eval_part(task.round, task.target),
            {"path": task.target, "result": evaluate_path(config, task.round, task.target)},
        )
    elif task.kind == "evalsum":
        from pipeline.evaluation.evaluate import combine_paths

        parts = {
            p: root.read_json(layout.eval_part(task.round, p)).get("result")
            for p in TaskQueue(root, config).eval_paths(task.round)
        }
        combine_paths(config, task.round, parts)
    elif task.kind == "reroute":
        from pipeline.evaluation.reroute import reroute

        if reshard is None:
            raise DipacoError(
                f"{task.name}: this island was started without the Beam job that re-shards "
                f"(start islands with `python -m pipeline.island_rank`)"
            )
        reroute(config, task.round, reshard)
    return None


def _early_start(config: Config, task: Task, lease: Lease):
    from pipeline.outer.early import EarlyStart

    return EarlyStart(config, task.round, task.target, lease.early)


def _merge_here(config: Config, task: Task, lease: Lease):
    """For an early start's publish: merge module `key` of the round before here, when nobody
    holds that merge (its holder died, and the other islands are training); True when it did."""

    def merge_here(key) -> bool:
        merge = Task.of("merge", task.round - 1, module_target(key))
        held = lease.queue.claim(merge, lease.record["island"], lease.record.get("island_id"))
        if held is None:
            return False
        began = time.time()
        try:
            run_task(config, merge, 0, held.number, held)
        except BaseException as exc:
            held.finish("failed", error=f"{type(exc).__name__}: {exc}"[:2000])
            raise
        held.finish("done", seconds=time.time() - began, beside=task.name)
        return True

    return merge_here


def broadcast_json(message: dict | None, rank: int, world: int) -> dict:
    """Rank 0's message to every rank of the island, as JSON bytes (no pickle crosses the wire)."""
    if world == 1:
        assert message is not None
        return message
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = json.dumps(message).encode() if rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    dist.broadcast(size, 0)
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if rank == 0
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buffer, 0)
    return json.loads(buffer.cpu().numpy().tobytes())


def island_config(run_root: str, ds_config: str | None = None, own: Config | None = None) -> Config:
    """The run's config (run.yaml), with this island's own ZeRO config when it has one: islands
    may differ in ranks and ZeRO stage, never in the model they train. What chooses code (the
    Beam runner and options of a reroute task, hostfile, ds_config) comes from the island's own
    command line (`own`: its --config; `ds_config`), never from run.yaml (layout.read_run_config)."""
    return layout.read_run_config(RunRoot(run_root), own, ds_config)

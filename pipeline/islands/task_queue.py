"""The run root's task queue: the work islands pull, with leases that expire when a holder dies.

There is no queue server: which tasks exist and which are ready follows from the committed
layout (a train task of round r is ready once the modules its path reads are committed; a
module's merge once every path through it committed or gave up; ...), and the only state the
queue adds is its leases, one file per attempt:

    queue/plan.json                          {"until_round": R}: rounds < R are trained
    queue/leases/<task>/attempt-<n>.json     who holds attempt n of a task, and how it ended

A claim is an exclusive create of the next attempt's file (a hard link on a local or shared
filesystem, a `mode="xb"` conditional write on an object store), so two islands never hold the
same attempt. The holder heartbeats into its file; an attempt whose heartbeat is older than
`train.lease_seconds` is expired (its island died) and the next island creates attempt n+1. A
holder that finds a later attempt than its own has lost the lease and stops. A task is done when
its output is committed (`_SUCCESS`), so the layout contract between stages is unchanged; after
`train.max_attempts` failed or expired attempts a train task is given up and its round merges
without it, as before.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from models.grid import ModuleKey, all_job_ids, all_modules, all_path_ids, parse_job_id, path_modules
from pipeline.state import layout
from pipeline.core.bounds import shown
from pipeline.core.errors import ConfigError, CorruptStateError
from pipeline.state.storage import RunRoot

log = logging.getLogger("dipaco.queue")
PLAN = "queue/plan.json"
LEASES = "queue/leases"
ISLANDS = "queue/islands"
_ATTEMPT = re.compile(r"attempt-(\d{1,6})\.json")
# Claim order within a round: what unblocks other work first.
KIND_ORDER = {"merge": 0, "commit": 1, "reroute": 2, "evalsum": 3, "train": 4, "eval": 5}


@dataclass(frozen=True, order=True)
class Task:
    """One unit of island work. `round` is the round it belongs to (for eval: the modules' round)."""

    round: int
    order: int
    kind: str
    target: str = ""  # job id (train), path id (eval), "l<level>m<index>" (merge); none for reroute (round = R)

    @property
    def name(self) -> str:
        return f"{self.kind}.r{self.round}" + (f".{self.target}" if self.target else "")

    @property
    def module(self) -> ModuleKey:
        level, index = self.target[1:].split("m")
        return ModuleKey(int(level), int(index))

    def to_json(self) -> dict:
        return {"round": self.round, "kind": self.kind, "target": self.target}

    @staticmethod
    def of(kind: str, round_index: int, target: str = "") -> "Task":
        return Task(round_index, KIND_ORDER[kind], kind, target)

    @staticmethod
    def from_json(data: dict) -> "Task":
        return Task.of(data["kind"], int(data["round"]), data.get("target", ""))


def module_target(key: ModuleKey) -> str:
    return f"l{key.level}m{key.index}"


def write_plan(root: RunRoot, until_round: int) -> dict:
    """Rounds below `until_round` are trained; islands exit once that round is committed and
    evaluated. A later run raises it (never lowers it while islands may be working)."""
    plan = {"until_round": until_round}
    root.write_json(PLAN, plan)
    return plan


def read_plan(root: RunRoot) -> int | None:
    if not root.exists(PLAN):
        return None
    until = root.read_json(PLAN).get("until_round")
    if type(until) is not int or until < 0:
        raise CorruptStateError(f"{root.path(PLAN)}: until_round must be a round number, got {shown(until)}")
    return until


@dataclass
class Attempt:
    number: int
    record: dict

    def expired(self, lease_seconds: float, now: float) -> bool:
        return self.record.get("state") == "running" and now - float(self.record.get("heartbeat", 0)) > lease_seconds

    def counts_as_failed(self, lease_seconds: float, now: float) -> bool:
        return self.record.get("state") == "failed" or self.expired(lease_seconds, now)


class TaskQueue:
    """Readiness from the layout, claims and leases from `queue/leases/`."""

    def __init__(self, root: RunRoot, config):
        self.root, self.config = root, config
        self.grid = config.model.grid
        self.jobs = all_job_ids(self.grid, config.train.workers_per_path)
        self.lease_seconds = float(config.train.lease_seconds)
        self.max_attempts = config.train.max_attempts
        # Fixed by the config: worked out once, not on every poll of ready().
        # A path's private module (model.path_specific_blocks) is one of its modules like any other.
        self.private = config.model.path_specific_blocks > 0
        self.job_modules = {job: path_modules(parse_job_id(job, self.grid, config.train.workers_per_path)[1],
                                              self.grid, self.private) for job in self.jobs}
        self.jobs_through = {key: [j for j in self.jobs if key in self.job_modules[j]]
                             for key in all_modules(self.grid, self.private)}
        self._eval_paths: dict[str, list[str]] = {}
        self.after = config.router.discriminative_after  # re-routing after this round (None: k-means throughout)
        self._shards_ready: set[str] = set()

    # -- leases --------------------------------------------------------------------------------
    def attempts(self, task: Task) -> list[Attempt]:
        return self._attempts_in(f"{LEASES}/{task.name}")

    def _attempts_in(self, rel: str) -> list[Attempt]:
        found = []
        for name in self.root.listdir(rel):
            match = _ATTEMPT.fullmatch(name)
            if match:
                try:
                    record = self.root.read_json(f"{rel}/{name}")
                except CorruptStateError:  # torn by a crash of its writer: an attempt that died
                    record = {"state": "failed", "error": "unreadable lease record"}
                found.append(Attempt(int(match.group(1)), record))
        return sorted(found, key=lambda a: a.number)

    def given_up(self, task: Task, now: float | None = None) -> bool:
        """Every allowed attempt failed or expired: the round goes on without this task."""
        return self._failures(self.attempts(task), time.time() if now is None else now) >= self.max_attempts

    def _failures(self, attempts: list[Attempt], now: float) -> int:
        return sum(a.counts_as_failed(self.lease_seconds, now) for a in attempts)

    def claim(self, task: Task, island: str) -> "Lease | None":
        """The next attempt of `task` for `island`, or None when it is held, done or given up."""
        now = time.time()
        attempts = self.attempts(task)
        if attempts:
            last = attempts[-1]
            if last.record.get("state") == "running" and not last.expired(self.lease_seconds, now):
                return None
            if last.record.get("state") == "done":
                return None
        if task.kind == "train" and self._failures(attempts, now) >= self.max_attempts:
            return None
        number = attempts[-1].number + 1 if attempts else 1
        record = {"task": task.to_json(), "island": island, "host": socket.gethostname(), "pid": os.getpid(),
                  "claimed_at": now, "heartbeat": now, "state": "running"}
        rel = f"{LEASES}/{task.name}/attempt-{number}.json"
        if not self._create_exclusive(rel, record):
            return None  # another island took this attempt first
        return Lease(self, task, number, record)

    def _create_exclusive(self, rel: str, record: dict) -> bool:
        data = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
        full = self.root.path(rel)
        self.root.fs.makedirs(os.path.dirname(full), exist_ok=True)
        if self.root.is_local:
            # Write it whole under a private name, then link it into place: link(2) fails when the
            # name exists, so the claim is exclusive and nobody ever reads half a record.
            tmp = f"{full}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, full)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        try:
            with self.root.fs.open(full, "xb") as handle:
                handle.write(data)
            return True
        except FileExistsError:
            return False
        except (NotImplementedError, ValueError) as exc:
            raise ConfigError(f"{self.root.url}: islands need a run root with exclusive create (a local or shared "
                              f"filesystem, or an object store with conditional writes): {exc}") from None

    def fail_running(self, island: str, reason: str) -> None:
        """Mark `island`'s running attempts failed at once (its process is known to be gone), so
        another island need not wait out the lease."""
        for name in self.root.listdir(LEASES):
            attempts = self._attempts_in(f"{LEASES}/{name}")
            last = attempts[-1] if attempts else None
            if last and last.record.get("island") == island and last.record.get("state") == "running":
                self.root.write_json(f"{LEASES}/{name}/attempt-{last.number}.json",
                                     {**last.record, "state": "failed", "error": reason, "finished_at": time.time()})

    def release_running(self, island: str, reason: str, since: float = float("inf")) -> list[str]:
        """Release `island`'s running attempts (its processes were stopped on an interrupt): like
        Lease.finish("released"), no attempt is lost and another island may take the task at once.
        The tasks released, with those the island released itself at or after `since`."""
        released = []
        for name in self.root.listdir(LEASES):
            attempts = self._attempts_in(f"{LEASES}/{name}")
            last = attempts[-1] if attempts else None
            if not last or last.record.get("island") != island:
                continue
            if last.record.get("state") == "running":
                self.root.write_json(f"{LEASES}/{name}/attempt-{last.number}.json",
                                     {**last.record, "state": "released", "reason": reason, "finished_at": time.time()})
                released.append(name)
            elif last.record.get("state") == "released" and float(last.record.get("finished_at", 0)) >= since:
                released.append(name)
        return released

    # -- readiness -----------------------------------------------------------------------------
    def modules_ready(self, round_index: int, keys: list[ModuleKey]) -> bool:
        from pipeline.state.module_store import module_location

        return all(module_location(self.root, round_index, key) is not None for key in keys)

    def job_settled(self, round_index: int, job: str) -> bool:
        """Committed, or given up after max_attempts."""
        return self.root.is_committed(layout.path_dir(round_index, job)) or self.given_up(Task.of("train", round_index, job))

    def shards_ready(self, round_index: int) -> bool:
        """The shards round r trains and is evaluated on are committed (the re-routed ones for
        rounds after router.discriminative_after wait for the reroute task)."""
        shards = layout.routing(self.after, round_index).shards
        if shards not in self._shards_ready and self.root.is_committed(shards):
            self._shards_ready.add(shards)  # committed shards never change
        return shards in self._shards_ready

    def reroute_pending(self, until_round: int) -> bool:
        """The plan trains round R = router.discriminative_after and its re-routing is not done."""
        return (self.after is not None and self.after < until_round
                and not self.root.exists(layout.reroute_report(self.after + 1)))

    def ready(self, until_round: int) -> list[Task]:
        """Every task that can start now, in claim order (held ones included: claim() skips them)."""
        tasks: list[Task] = []
        if self.reroute_pending(until_round) and self.root.is_committed(layout.round_dir(self.after)):
            tasks.append(Task.of("reroute", self.after))
        for r in range(until_round):
            if self.root.is_committed(layout.round_dir(r)):
                continue
            staged = {key: self.root.is_committed(layout.merged_module_dir(r, key)) for key in self.jobs_through}
            settled = {job: self.job_settled(r, job) for job in self.jobs}
            shards_ready = self.shards_ready(r)
            tasks += [Task.of("train", r, job) for job in self.jobs
                      if not settled[job] and shards_ready and self.modules_ready(r, self.job_modules[job])]
            tasks += [Task.of("merge", r, module_target(key)) for key, done in staged.items()
                      if not done and all(settled[j] for j in self.jobs_through[key])]
            if all(staged.values()):
                tasks.append(Task.of("commit", r))
        for r in range(1, until_round + 1):
            if self.root.exists(layout.eval_file(r)) or not self.shards_ready(r):
                continue
            missing = [p for p in self.eval_paths(r) if not self.root.exists(layout.eval_part(r, p))]
            for path_id in missing:
                if self.modules_ready(r, path_modules(parse_job_id(path_id, self.grid, 1)[1], self.grid, self.private)):
                    tasks.append(Task.of("eval", r, path_id))
            if not missing and self.root.is_committed(layout.round_dir(r - 1)):
                tasks.append(Task.of("evalsum", r))
        return sorted(tasks)

    def eval_paths(self, round_index: int) -> list[str]:
        """The paths with held-out documents in the validation shards round r is evaluated on."""
        from pipeline.state.shards import shard_parts

        shards = layout.routing(self.after, round_index).shards
        if shards not in self._eval_paths:  # committed validation shards never change
            self._eval_paths[shards] = [p for p in all_path_ids(self.grid)
                                        if shard_parts(self.root, p, split="validation", shards=shards)
                                        or self.config.eval.reroute_every is not None]  # re-routed chunks reach any path
        return self._eval_paths[shards]

    def finished(self, until_round: int) -> bool:
        """Every round of the plan committed and evaluated (and re-routed, if the plan reaches
        router.discriminative_after): islands may leave."""
        return until_round == 0 or (self.root.is_committed(layout.round_dir(until_round - 1))
                                    and self.root.exists(layout.eval_file(until_round))
                                    and not self.reroute_pending(until_round))

    def next_claim(self, island: str, until_round: int) -> "Lease | None":
        for task in self.ready(until_round):
            lease = self.claim(task, island)
            if lease is not None:
                return lease
        return None


class Lease:
    """An island's hold on one attempt of a task, kept alive by a heartbeat thread."""

    def __init__(self, queue: TaskQueue, task: Task, number: int, record: dict):
        self.queue, self.task, self.number, self.record = queue, task, number, record
        self.rel = f"{LEASES}/{task.name}/attempt-{number}.json"
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"lease-{task.name}")
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.queue.lease_seconds / 4):
            if self._superseded():
                log.warning("lost the lease of %s (a later attempt exists)", self.task.name)
                self.lost.set()
                return
            self._write(heartbeat=time.time())

    def _superseded(self) -> bool:
        return any(a.number > self.number for a in self.queue.attempts(self.task))

    def _write(self, **fields) -> None:
        with self._lock:
            self.record.update(fields)
            self.queue.root.write_json(self.rel, self.record)

    def finish(self, state: str, **fields) -> None:
        """End the lease: `done`, `failed` (counts toward max_attempts) or `released` (does not)."""
        self._stop.set()
        self._thread.join()
        if not self._superseded():
            self._write(state=state, finished_at=time.time(), **fields)

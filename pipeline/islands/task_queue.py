"""The run root's task queue: the work islands pull, with leases that expire when a holder dies.

There is no queue server: which tasks exist and which are ready follows from the committed
layout (a train task of round r is ready once the modules its path reads are committed; a
module's merge once every path through it committed or gave up; ...), and the only state the
queue adds is its leases, one file per attempt:

    queue/plan.json                          {"until_round": R}: rounds < R are trained
    queue/leases/<task>/attempt-<n>.json     who holds attempt n of a task, and how it ended

A claim is an exclusive create of the next attempt's file (RunRoot.create: a hard link on a local
or shared filesystem, `If-None-Match: *` on S3, `ifGenerationMatch=0` on GCS), so two islands never
hold the same attempt. The holder heartbeats into its file, counting its beats (`beats`), each beat a
compare-and-swap on the version it last wrote (`If-Match` on the ETag): when anyone else ended its
record (fail_running, release_running), the store refuses the beat and the holder stops. An attempt is
expired when a reader saw its count unchanged for `train.lease_seconds` on the reader's own
monotonic clock (to when it asked the read that found it so: an answer the store or the link held
back proves no more), so no two hosts' wall clocks are ever compared and clock skew cannot expire a
live holder. A holder that finds a later attempt than its own (a backup attempt aside) has lost
the lease and stops. A task is done when its output is committed (`_SUCCESS`), so the layout
contract between stages is unchanged; a train attempt writes into its own staging directory and
publishes it with an exclusive create after re-checking its lease (pipeline.train.train_path), so
a late attempt's output is discarded, never mixed in. After `train.max_attempts` failed or
expired attempts a train task is given up and its round merges without it, as before.

A lease record that is not what a holder writes (broken JSON, a heartbeat that is not a number)
counts as a failed attempt, with one warning naming the file. `train.backup_after` lets an idle
island start a backup attempt of a train task that has run that many times longer than the
median finished train task of its round (MapReduce's backup tasks), or sooner when the steps its
holder heartbeats project a finish that late and a backup from the newest mid-task checkpoint would
finish first (LATE); the first to publish wins, the other is cancelled at its next heartbeat.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import socket
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from models.grid import ModuleKey, all_job_ids, all_modules, all_path_ids, parse_job_id, path_modules, round_job_ids
from pipeline.core.bounds import shown
from pipeline.core.config import Config
from pipeline.core.errors import CorruptStateError, DipacoError, StorageError
from pipeline.core.stalls import Stalls
from pipeline.islands.attempts import Attempts
from pipeline.state import layout
from pipeline.state.storage import ListedRoot, RunRoot, map_io
from pipeline.state.store import RECENT

log = logging.getLogger("dipaco.queue")
PLAN = "queue/plan.json"
LEASES = "queue/leases"
ISLANDS = "queue/islands"
# An attempt number of any length a file name can hold (a stray attempt-999999.json once stalled
# its task: the next name, attempt-1000000.json, was never listed again); no leading zeros.
_ATTEMPT = re.compile(r"attempt-(0|[1-9][0-9]{0,999})\.json")
# Claim order within a round: what unblocks other work first.
KIND_ORDER = {"merge": 0, "commit": 1, "reroute": 2, "evalsum": 3, "train": 4, "eval": 5}
# Evaluations unblock no training, only the round's report: an island claims them after every
# ready train, merge, commit or reroute task of any round (next_claim), so they fill the gaps
# while another island finishes its path. Claimed first, the evaluations of the modules round r
# starts from ran between round r's merges and round r+1's training: 2-4 s a round on two hosts
# over a 50 Mbit/s link (benchmarks/RESULTS.md, "Islands on separate hosts").
REPORT_ONLY = frozenset({"eval", "evalsum"})
BEHIND_KINDS = ("merge", "commit")  # small tasks an early start runs on a thread beside its training
CHECK_EVERY = 3  # a lease's beats per look at its task's attempts (Lease._beat)
HELD_MERGES_AT_ONCE = 4  # merges an island claims at once, of paths it holds (TaskQueue.claim_held_merges)
STATES = ("running", "done", "failed", "released", "cancelled")
# Test-only: seconds added to every wall-clock time this process writes into lease records, to
# show that expiry never compares hosts' clocks (tests, benchmarks.chaos). Unset in real runs.
CLOCK_OFFSET_ENV = "DIPACO_TEST_CLOCK_OFFSET"


def clock_offset() -> float:
    return float(os.environ.get(CLOCK_OFFSET_ENV, "0") or 0)


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
    plan = root.read_json_if_exists(PLAN)
    if plan is None:
        return None
    until = plan.get("until_round")
    if type(until) is not int or until < 0:
        raise CorruptStateError(f"{root.path(PLAN)}: until_round must be a round number, got {shown(until)}")
    return until


@dataclass
class Attempt:
    number: int
    record: dict
    expired: bool = False  # running, but its beats did not change for lease_seconds as this reader saw them
    running_for: float = 0.0  # seconds this reader has seen it running

    @property
    def state(self) -> str:
        return self.record.get("state", "failed")

    @property
    def live(self) -> bool:
        return self.state == "running" and not self.expired

    @property
    def counts_as_failed(self) -> bool:
        return self.state == "failed" or self.expired

    @property
    def backup(self) -> bool:
        return self.record.get("backup") is True


def _finite(value) -> bool:
    """A JSON number a holder could have written: not a bool, not NaN or infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def finite_number(value) -> bool:
    """_finite for the other readers of queue records (utilisation, the sweep's lanes)."""
    return _finite(value)


def attempt_number(name: str) -> int | None:
    """attempt-<n>.json -> n (any length, no leading zeros), else None."""
    match = _ATTEMPT.fullmatch(name)
    return int(match.group(1)) if match else None


def malformed(record: dict) -> str | None:
    """Why a lease record is not one a holder writes, or None."""
    state = record.get("state")
    if state not in STATES:
        return f"state must be one of {', '.join(STATES)}, got {shown(state)}"
    for key in ("heartbeat", "claimed_at"):
        value = record.get(key)
        if not _finite(value):
            return f"{key} must be a finite number, got {shown(value)}"
    beats = record.get("beats", 0)
    if type(beats) is not int or beats < 0:
        return f"beats must be a count, got {shown(beats)}"
    for key in ("finished_at", "running_s", "seconds"):  # written by holders when they end or beat
        value = record.get(key)
        if value is not None and not _finite(value):
            return f"{key} must be a finite number, got {shown(value)}"
    return None


def step_progress(record: dict) -> tuple[int, int, float] | None:
    """(step, from_step, inner_s) as a holder heartbeats them (Lease.report_step), or None when the
    record has none or they are not what a holder writes (then only the elapsed-time rule applies)."""
    step, from_step, inner_s = record.get("step"), record.get("from_step", 0), record.get("inner_s")
    if type(step) is not int or type(from_step) is not int or not _finite(inner_s):
        return None
    return step, from_step, float(inner_s)


@dataclass(frozen=True)
class TaskTimes:
    """A round's finished train attempts (medians): what a backup started now would take."""

    seconds: float  # a whole attempt, claim to finish
    step_seconds: float  # one inner step
    overhead: float  # the rest: engine build, loading, publishing


class TaskQueue:
    """Readiness from the layout, claims and leases from `queue/leases/`."""

    # Kinds given up after train.max_attempts failed attempts; the others are tried until done.
    limited_kinds: tuple[str, ...] = ("train",)

    def __init__(self, root: RunRoot, config: Config):
        self.root, self.config = root, config
        self.grid = config.model.grid
        self.jobs = all_job_ids(self.grid, config.train.workers_per_path)
        self.lease_seconds = float(config.train.lease_seconds)
        self.allowed = Attempts.of_tasks(config.train)  # train.max_attempts (pipeline.islands.attempts)
        # Fixed by the config: worked out once, not on every poll of ready().
        # A path's private module (model.path_specific_blocks) is one of its modules like any other.
        self.private = config.model.path_specific_blocks > 0
        self.job_modules = {
            job: path_modules(parse_job_id(job, self.grid, config.train.workers_per_path)[1], self.grid, self.private)
            for job in self.jobs
        }
        self.jobs_through = {
            key: [j for j in self.jobs if key in self.job_modules[j]] for key in all_modules(self.grid, self.private)
        }
        self._eval_paths: dict[str, list[str]] = {}
        self.backup_after = config.train.backup_after
        self.clock_offset = clock_offset()
        # rel -> (the holder's last beat token, monotonic time this reader first saw it, first seen running)
        self._seen: dict[str, tuple[tuple, float, float]] = {}
        # when this reader's own lease listings and reads hung (a frozen store, a stopped link): the
        # holders' beats were held back too, so that time is no holder's silence (pipeline/core/stalls.py)
        self.stalls = Stalls(slow_s=self.lease_seconds / 10)
        self._warned: set[str] = set()
        self._medians: dict[int, TaskTimes | None] = {}
        self._last_ready: list[Task] = []  # the last look's ready tasks (next_claim), in claim order
        self._claim_found_live = False  # the last claim refused: another island holds the task
        self._listed: TaskQueue | None = None  # the last look's view through its listings (ready())
        self._early: list[tuple[Task, list[ModuleKey]]] = []  # the last look's early starts (early_trains)
        # (round, job) -> the inner state this process holds while it keeps it (Island.keep_later)
        self.keeping_here: dict[tuple[int, str], Any] = {}
        # Set by a watch in this process that saw the run root change (a peer's publish: peers.PeerReads);
        # an idle island's wait between two looks ends on it, so its next look is not a poll late.
        self.news = threading.Event()
        self.after = config.router.discriminative_after  # re-routing after this round (None: k-means throughout)
        self._shards_ready: set[str] = set()
        self._done_rounds: set[int] = set()  # committed rounds and written round evaluations never change
        self._evaluated: set[int] = set()

    def jobs_of(self, round_index: int) -> list[str]:
        """The jobs round r trains: every path's first train.workers_in_round(r) DiLoCo workers."""
        return round_job_ids(
            self.grid, self.config.train.workers_per_path, self.config.train.workers_in_round(round_index)
        )

    # -- leases --------------------------------------------------------------------------------
    def attempts(self, task: Task) -> list[Attempt]:
        return self._attempts_in(f"{LEASES}/{task.name}")

    def _attempts_in(self, rel: str) -> list[Attempt]:
        found = []
        for name in self.stalls.timed(lambda: self.root.listdir(rel)):
            match = _ATTEMPT.fullmatch(name)
            if match:
                found.append(self._attempt(f"{rel}/{name}", int(match.group(1))))
        return sorted(found, key=lambda a: a.number)

    def _attempt(self, rel: str, number: int) -> Attempt:
        """One attempt as this reader sees it now: expiry from its own observations of the beats.

        An answer tells how the record was when it was asked, not when it came: a store that froze
        (or a link that held the answer back) delivers the record as it stood before, while the
        holder's beats waited in the same queue. So the silence a reader counts runs from when it
        first saw the beat token to when it asked the read that found it unchanged: counted to the
        answer's arrival, a read held back for longer than the lease expired a live holder. Nor does
        it count the spans in which its own lease listings and reads hung (pipeline/core/stalls.py): a read asked
        just after the store came back finds the count as the freeze left it."""
        asked = time.monotonic()
        try:
            record = self.stalls.timed(lambda: self.root.read_json(rel))
            problem = malformed(record)
        except CorruptStateError as exc:  # torn by a crash of its writer, or written by hand
            record, problem = {}, str(exc).removeprefix(f"{self.root.path(rel)}: ")
        except DipacoError:  # removed while we listed (a cleaned-up run): nothing to count
            return Attempt(number, {"state": "released"})
        if problem is not None:
            if rel not in self._warned:
                self._warned.add(rel)
                log.warning(
                    "%s: malformed lease record (%s); counting it as a failed attempt", self.root.path(rel), problem
                )
            return Attempt(number, {**record, "state": "failed", "error": f"malformed lease record: {problem}"})
        now = time.monotonic()
        token = (record.get("beats", 0), record["heartbeat"], record["state"])
        seen = self._seen.get(rel)
        if seen is None or seen[0] != token:
            seen = (token, now, seen[2] if seen else now)
            self._seen[rel] = seen
        running = record["state"] == "running"
        # How long it has run: as this reader saw it, or as its holder measured it on its own
        # monotonic clock (a duration, never a wall time: skew cannot enter), whichever is longer.
        held = record.get("running_s")
        held = float(held) if _finite(held) else 0.0
        return Attempt(
            number,
            record,
            expired=running and asked - seen[1] - self.stalls.within(seen[1], asked) > self.lease_seconds,
            running_for=max(now - seen[2], held) if running else 0.0,
        )

    def given_up(self, task: Task) -> bool:
        """Every allowed attempt failed or expired: the round goes on without this task."""
        return not self._may_try_again(task, self.attempts(task))

    def _may_try_again(self, task: Task, attempts: list[Attempt]) -> bool:
        """`train.max_attempts` failures, counted afresh for a train task whose path is published:
        what is left of it is keeping its inner state, and its path's next round resumes that
        state. Given up, that round started from fresh AdamW moments: a faults run lost one
        attempt of a path to a partition before the publish and the retake to a kill while it kept
        the state, and its final modules were not the one-host run's. A published path's task
        may fail max_attempts times more; the path proved it trains."""
        failures = self._failures(attempts)
        if self.allowed.may_try_again(failures):
            return True
        published = task.kind == "train" and self.output_committed(task)
        return published and self.allowed.may_try_again(failures - self.allowed.limit)

    @staticmethod
    def _failures(attempts: list[Attempt]) -> int:
        return sum(a.counts_as_failed for a in attempts)

    def output_committed(self, task: Task) -> bool:
        """A train task's path is published (whoever published it): the merges may read it."""
        return task.kind == "train" and self.root.is_committed(layout.path_dir(task.round, task.target))

    def inner_kept(self, round_index: int, job: str) -> bool:
        """A path's inner state of a round is kept (train_path.keep_inner_state): what its next
        round resumes. It is uploaded after the path is published, off the task's critical path."""
        return self.root.has_file(layout.inner_state_kept(round_index, job))

    def task_done(self, task: Task) -> bool:
        """A task that is never run again: a train task once its path is published and its inner
        state kept (a published path whose holder died before its state was in is trained again,
        and that attempt keeps the state); any other once its output is committed."""
        return self.output_committed(task) and (task.kind != "train" or self.inner_kept(task.round, task.target))

    def claim(
        self, task: Task, island: str, island_id: str | None = None, listed: "TaskQueue | None" = None
    ) -> "Lease | None":
        """The next attempt of `task` for `island`, or None when it is held, done or given up.
        `listed`: the queue as next_claim's look listed it (ready()): the listings it took answer
        which attempts exist and whether the task is done, so a claim is the attempts' record
        reads and the create, not a listing and a HEAD before them (two round trips between a task
        and the next across hosts). A listing may miss what came since; the create, conditional,
        refuses a second taker, and a task whose output came meanwhile stops at its own check."""
        seen = listed or self
        attempts = seen.attempts(task)
        self._claim_found_live = any(a.live for a in attempts)
        if self._claim_found_live or any(a.state == "done" for a in attempts) or seen.task_done(task):
            return None
        if task.kind in self.limited_kinds and not seen._may_try_again(task, attempts):
            return None
        return self._create_attempt(task, attempts, island, island_id)

    def claim_backup(self, task: Task, island: str, island_id: str | None = None) -> "Lease | None":
        """A backup attempt of a train task whose one live attempt is a straggler, judged against
        the finished train tasks of its round (`backup_after`, a multiple of their median time):

        - it has run `backup_after` x the median (MapReduce's rule: it needs no progress report);
        - or, sooner, its heartbeated progress projects a finish beyond `backup_after` x the median,
          and a backup started now, from the newest mid-task checkpoint at the peers' step rate, is
          expected to finish first (LATE's rule, Zaharia et al. 2008): a quarter-speed island is
          recognised at the first idle island's poll instead of 1.2 task-times later."""
        if self.backup_after is None or task.kind != "train" or self.output_committed(task):
            return None
        attempts = self.attempts(task)
        live = [a for a in attempts if a.live]
        if len(live) != 1 or live[0].backup or any(a.state == "done" for a in attempts):
            return None
        if task.round not in self._medians:  # once per next_claim: it reads every attempt of the round
            self._medians[task.round] = self.round_task_times(task.round)
        peers = self._medians[task.round]
        if peers is None:
            return None
        why = self._straggling(live[0], peers)
        if why is None:
            return None
        lease = self._create_attempt(task, attempts, island, island_id, backup=True)
        if lease is not None:
            log.info("%s: backup attempt %d beside attempt %d (%s)", task.name, lease.number, live[0].number, why)
        return lease

    def _straggling(self, attempt: Attempt, peers: TaskTimes) -> str | None:
        """Why `attempt` deserves a backup now (for the log), or None."""
        limit = self.backup_after * peers.seconds
        if attempt.running_for > limit:
            return f"running {attempt.running_for:.1f} s, round median {peers.seconds:.1f} s"
        progress = step_progress(attempt.record)
        if progress is None:
            return None
        step, from_step, inner_s = progress
        steps = self.config.train.inner_steps
        # A rate from fewer than a tenth of the steps is mostly the first steps' warm-up.
        if step - from_step < max(1, steps // 10) or step >= steps or inner_s <= 0:
            return None
        step_s = attempt.record.get("step_s")  # its pace over the last beats, else since it started
        pace = float(step_s) if _finite(step_s) and step_s > 0 else inner_s / (step - from_step)
        remaining = (steps - step) * pace
        every = self.config.train.checkpoint_every
        resume_from = step - step % every if every else 0  # the newest checkpoint a backup could load
        backup = peers.overhead + (steps - resume_from) * peers.step_seconds
        # Both estimates are rough (a rate measured while islands share cores, a median): the
        # backup must be expected to beat the holder by backup_after too.
        if attempt.running_for + remaining <= limit or remaining <= self.backup_after * backup:
            return None
        return (
            f"at step {step}/{steps} after {attempt.running_for:.1f} s, projected to finish in {remaining:.1f} s; "
            f"a backup from step {resume_from}: ~{backup:.1f} s (round median {peers.seconds:.1f} s)"
        )

    def median_task_seconds(self, round_index: int) -> float | None:
        """Median seconds (each holder's own measure) of round r's finished train attempts that ran
        every step (one resumed from a mid-task checkpoint ran fewer, and would make peers look slow)."""
        times = self.round_task_times(round_index)
        return None if times is None else times.seconds

    def round_task_times(self, round_index: int) -> TaskTimes | None:
        """What round r's finished train attempts that ran every step took (None: none yet)."""
        seconds, step_seconds, overhead = [], [], []
        steps = self.config.train.inner_steps
        for job in self.jobs_of(round_index):
            for attempt in self.attempts(Task.of("train", round_index, job)):
                record = attempt.record
                total, inner = record.get("seconds"), record.get("inner_seconds")
                if attempt.state != "done" or record.get("resumed_from_step") or not _finite(total):
                    continue
                seconds.append(float(total))
                if _finite(inner) and 0 < inner <= total:
                    step_seconds.append(float(inner) / steps)
                    overhead.append(float(total) - float(inner))
        if not seconds:
            return None
        median = statistics.median(seconds)
        return TaskTimes(
            seconds=median,
            step_seconds=statistics.median(step_seconds) if step_seconds else median / steps,
            overhead=statistics.median(overhead) if overhead else 0.0,
        )

    def _create_attempt(
        self, task: Task, attempts: list[Attempt], island: str, island_id: str | None, backup: bool = False
    ) -> "Lease | None":
        number = attempts[-1].number + 1 if attempts else 1
        now = time.time() + self.clock_offset
        record = {
            "task": task.to_json(),
            "island": island,
            "island_id": island_id or island,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "claimed_at": now,
            "heartbeat": now,
            "beats": 0,
            "state": "running",
            **({"backup": True} if backup else {}),
        }
        rel = f"{LEASES}/{task.name}/attempt-{number}.json"
        version = self.root.create(rel, _record_bytes(record))
        if version is None:
            return None  # another island took this attempt first
        return Lease(self, task, number, record, version)

    def _end_record(self, rel: str, attempt: Attempt, fields: dict) -> bool:
        """End another holder's record by compare-and-swap on the version read: a beat written
        meanwhile is never overwritten back to running, nor this end by that beat."""
        try:
            current = self.root.read_versioned(rel)
            record = json.loads(current.data)
        except (DipacoError, ValueError):
            return False
        record = record if isinstance(record, dict) else attempt.record
        return self.root.replace_if(rel, _record_bytes({**record, **fields}), current.version) is not None

    def fail_running(self, island_id: str, reason: str) -> None:
        """Mark the running attempts of one island process (`island_id`, unique per process: a
        DAG's island-0 and a CLI's island-0 never share one) failed at once, as its process is
        known to be gone, so another island need not wait out the lease."""
        for name in self.root.listdir(LEASES):
            for attempt in self._attempts_in(f"{LEASES}/{name}"):
                if attempt.record.get("island_id") == island_id and attempt.state == "running":
                    self._end_record(
                        f"{LEASES}/{name}/attempt-{attempt.number}.json",
                        attempt,
                        {"state": "failed", "error": reason, "finished_at": time.time() + self.clock_offset},
                    )

    def release_running(self, island_id: str, reason: str, since: float = float("inf")) -> list[str]:
        """Release the running attempts of one island process (`island_id`, as fail_running), whose
        processes were stopped on an interrupt: like Lease.finish("released"), no attempt is lost and
        another island may take the task at once.
        The tasks released, with those the island released itself at or after `since`."""
        released = []
        for name in self.root.listdir(LEASES):
            attempts = self._attempts_in(f"{LEASES}/{name}")
            last = attempts[-1] if attempts else None
            if not last or last.record.get("island_id") != island_id:
                continue
            if last.record.get("state") == "running":
                if self._end_record(
                    f"{LEASES}/{name}/attempt-{last.number}.json",
                    last,
                    {"state": "released", "reason": reason, "finished_at": time.time() + self.clock_offset},
                ):
                    released.append(name)
            elif last.record.get("state") == "released" and float(last.record.get("finished_at") or 0) >= since:
                released.append(name)  # finished_at checked by malformed(): a bad one made the record failed
        return released

    # -- readiness -----------------------------------------------------------------------------
    def modules_ready(self, round_index: int, keys: list[ModuleKey]) -> bool:
        from pipeline.state.module_store import module_location

        return all(module_location(self.root, round_index, key) is not None for key in keys)

    def job_settled(self, round_index: int, job: str) -> tuple[bool, bool]:
        """(settled, done): settled once published or given up after max_attempts (the merges may
        go on without it); done once its inner state is kept too, or given up (the round's commit
        may go on, and the task is not trained again)."""
        published = self.root.is_committed(layout.path_dir(round_index, job))
        if published and self.inner_kept(round_index, job):
            return True, True
        given_up = self.given_up(Task.of("train", round_index, job))
        return published or given_up, given_up

    def _committed(self, round_index: int) -> bool:
        """Round r is committed (remembered: a committed round never changes)."""
        if round_index in self._done_rounds:
            return True
        if self.root.is_committed(layout.round_dir(round_index)):
            self._done_rounds.add(round_index)
            return True
        return False

    def resumable(self, round_index: int, job: str) -> bool:
        """The inner state a job of round r resumes is kept, or never will be: round r-1's (round r
        may start before round r-1 commits, as soon as its modules are merged, and the state is
        kept after the path is published, off that task's critical path)."""
        before = round_index - 1
        if before < 0 or before in self._done_rounds or job not in self.jobs_of(before):
            return True
        if (before, job) in self.keeping_here:  # this process resumes it from memory (train_path)
            return True
        return self.inner_kept(before, job) or self.given_up(Task.of("train", before, job))

    def shards_ready(self, round_index: int) -> bool:
        """The shards round r trains and is evaluated on are committed (the re-routed ones for
        rounds after router.discriminative_after wait for the reroute task)."""
        shards = layout.routing(self.after, round_index).shards
        if shards not in self._shards_ready and self.root.is_committed(shards):
            self._shards_ready.add(shards)  # committed shards never change
        return shards in self._shards_ready

    def reroute_pending(self, until_round: int) -> bool:
        """The plan trains round R = router.discriminative_after and its re-routing is not done."""
        return (
            self.after is not None
            and self.after < until_round
            and not self.root.has_file(layout.reroute_report(self.after + 1))
        )

    def ready(self, until_round: int) -> list[Task]:
        """Every task that can start now, in claim order (held ones included: claim() skips them).

        An idle island asks this twice a second, and each answer takes a few dozen existence checks.
        On an object store each is a round trip: one after the other they took seconds a poll over a
        40 ms link, between every task and the next. There they are answered from one listing of
        each open round's directory, the round evaluations' and the leases', taken at once
        (ListedRoot), and what is left goes out at once (each round's, and each job's within a
        round); a local root answers in microseconds and keeps to one thread."""
        if self.root.is_local:
            return self._ready(until_round)
        view = copy.copy(self)  # the same caches of what never changes, the root seen through listings
        view.root = self.stalls.timed(lambda: ListedRoot(self.root, self._listed_directories(until_round)))
        self._listed = view  # next_claim's claims ask it too
        return view._ready(until_round)

    def _listed_directories(self, until_round: int) -> list[str]:
        """What a poll lists on an object store: every round not yet committed or evaluated (its
        paths, merged modules and modules), their evaluation parts, and the leases."""
        rounds = [r for r in range(until_round + 1) if r not in self._done_rounds or r not in self._evaluated]
        return [
            LEASES,
            *(layout.round_dir(r) for r in rounds),
            *(layout.eval_parts_dir(r) for r in rounds if r and r not in self._evaluated),
        ]

    def _ready(self, until_round: int) -> list[Task]:
        tasks: list[Task] = []
        if self.reroute_pending(until_round) and self.root.is_committed(layout.round_dir(self.after)):
            tasks.append(Task.of("reroute", self.after))
        threads = 1 if self.root.is_local else self.root.io_threads
        for found in map_io(lambda r: self._ready_to_train(r, threads), range(until_round), threads):
            tasks += found
        for found in map_io(self._ready_to_evaluate, range(1, until_round + 1), threads):
            tasks += found
        return sorted(tasks)

    def _ready_to_train(self, r: int, threads: int) -> list[Task]:
        """Round r's train, merge and commit tasks that can start now (none once it is committed)."""
        if self._committed(r):
            return []
        keys, jobs = list(self.jobs_through), self.jobs_of(r)

        def job_state(job: str) -> tuple[bool, bool, bool]:
            """(settled, done, its inputs ready): the inputs only asked for while it is not done."""
            settled, done = self.job_settled(r, job)
            return settled, done, not done and self.modules_ready(r, self.job_modules[job]) and self.resumable(r, job)

        def check(item: ModuleKey | str) -> bool | tuple[bool, bool, bool]:
            if isinstance(item, str):
                return job_state(item)
            return self.root.is_committed(layout.merged_module_dir(r, item))  # merged on its own

        found = map_io(check, [*keys, *jobs], threads)
        staged = dict(zip(keys, found[: len(keys)]))
        settled = {job: state[0] for job, state in zip(jobs, found[len(keys) :])}
        done = {job: state[1] for job, state in zip(jobs, found[len(keys) :])}
        inputs = {job: state[2] for job, state in zip(jobs, found[len(keys) :])}
        shards_ready = self.shards_ready(r)
        tasks = [Task.of("train", r, job) for job in jobs if not done[job] and shards_ready and inputs[job]]
        tasks += [
            Task.of("merge", r, module_target(key))
            for key, merged in staged.items()
            if not merged and all(settled[j] for j in self.jobs_through[key] if j in settled)
        ]
        # The next round resumes every kept inner state; the round before must be gathered first
        # (finish_round removes its merged modules, which that round's commit copies).
        if all(staged.values()) and all(done.values()) and (r == 0 or self._committed(r - 1)):
            tasks.append(Task.of("commit", r))
        return tasks

    def _ready_to_evaluate(self, r: int) -> list[Task]:
        """The evaluations of the modules round r starts from, and their summary, that can start now."""
        if r in self._evaluated:
            return []
        if self.root.has_file(layout.eval_file(r)):
            self._evaluated.add(r)
            return []
        if not self.shards_ready(r):
            return []
        tasks = []
        missing = [p for p in self.eval_paths(r) if not self.root.has_file(layout.eval_part(r, p))]
        for path_id in missing:
            if self.modules_ready(r, path_modules(parse_job_id(path_id, self.grid, 1)[1], self.grid, self.private)):
                tasks.append(Task.of("eval", r, path_id))
        if not missing and self.root.is_committed(layout.round_dir(r - 1)):
            tasks.append(Task.of("evalsum", r))
        return tasks

    def eval_paths(self, round_index: int) -> list[str]:
        """The paths with held-out documents in the validation shards round r is evaluated on."""
        from pipeline.state.shards import shard_parts

        shards = layout.routing(self.after, round_index).shards
        if shards not in self._eval_paths:  # committed validation shards never change
            self._eval_paths[shards] = [
                p
                for p in all_path_ids(self.grid)
                if shard_parts(self.root, p, split="validation", shards=shards)
                or self.config.eval.reroute_every is not None
            ]  # re-routed chunks reach any path
        return self._eval_paths[shards]

    def round_finished(self, round_index: int) -> bool:
        """Round r merged, the modules it wrote evaluated and, when r is router.discriminative_after,
        the splits re-routed: ready to report and register."""
        rerouted = round_index != self.after or self.root.has_file(layout.reroute_report(round_index + 1))
        return (
            self.root.is_committed(layout.round_dir(round_index))
            and self.root.has_file(layout.eval_file(round_index + 1))
            and rerouted
        )

    def finished(self, until_round: int) -> bool:
        """Every round of the plan finished (and re-routed, if the plan reaches
        router.discriminative_after): islands may leave."""
        return until_round == 0 or (self.round_finished(until_round - 1) and not self.reroute_pending(until_round))

    def merge_preference(self, task: Task) -> tuple[float, int]:
        """A merge task's claim order among its round's merges, lowest first: minus the share of its
        jobs whose trained paths this process holds in memory at the module's level (it trained or
        read them, on an object store: pipeline.state.store.RecentFiles), then minus how many of its
        round's jobs it reads (the longest first); (0, 0) for other tasks."""
        if task.kind != "merge":
            return 0.0, 0
        round_jobs = set(self.jobs_of(task.round))
        jobs = [job for job in self.jobs_through.get(task.module, []) if job in round_jobs]
        if not jobs or self.root.is_local:
            return 0.0, -len(jobs)
        held = sum(self._holds_module_of(task.round, job, task.module.level) for job in jobs)
        return -held / len(jobs), -len(jobs)

    def _holds_module_of(self, round_index: int, job: str, level: int) -> bool:
        """Whether this process holds in memory what a merge at `level` reads of a trained path: its
        weights whole, their runs read for that level (a peer's watch reads only those), or, with
        outer.compression, its outer gradient at that level."""
        rel = layout.path_dir(round_index, job)
        names = (layout.PATH_WEIGHTS, layout.outer_grad_file(level))
        return any(RECENT.holds_level(self.root.path(rel, name), level) for name in names)

    def holds_all(self, task: Task) -> bool:
        """A merge task every one of whose round's paths this process holds in memory."""
        preference = self.merge_preference(task)
        return task.kind == "merge" and preference[1] < 0 and preference[0] == -1.0

    def _for_its_holder(self, task: Task, seen_before: set[Task]) -> bool:
        """A merge that became ready since this island's last look, of which it does not hold
        every path, is left one look to an island that may (on an object store): the island that
        published the merge's last path holds it and its peers' (peers.PeerReads) and claims its
        merges right after the publish, while an idle island, polling, took the merge first and
        downloaded that path (1.2 s over 50 Mbit/s, on the round's critical path). Found again at
        the next look, it is claimed."""
        return task.kind == "merge" and not self.root.is_local and task not in seen_before and not self.holds_all(task)

    def claim_held_merges(self, claimed: Task, island: str, island_id: str | None = None) -> list["Lease"]:
        """After a claim of a merge whose every path this process holds: the other merges of its
        round, ready at that look (next_claim's), whose paths it holds too, claimed now for it to run
        next (at most HELD_MERGES_AT_ONCE). Another island would read those paths over its link
        first; across hosts it claimed them while this one merged the first (an idle island looks
        every POLL_S), and the round's last merge then waited for that download."""
        if not self.holds_all(claimed):
            return []
        leases = []
        for task in self._last_ready:
            if len(leases) >= HELD_MERGES_AT_ONCE:
                break
            if task != claimed and task.kind == "merge" and task.round == claimed.round and self.holds_all(task):
                lease = self.claim(task, island, island_id, self._listed)
                leases += [lease] if lease is not None else []
        return leases

    def _held_here(self, task: Task) -> bool:
        """Whether this process still holds what a train task resumes (it trained the path last
        round, on an object store): claimed first, that task reads its inner state, the largest
        object of a task, from memory instead of over the link (pipeline.state.store.RecentFiles).
        The task is the same wherever it runs; only who runs it changes."""
        if task.kind != "train" or task.round == 0 or self.root.is_local:
            return False
        if (task.round - 1, task.target) in self.keeping_here:
            return True
        return RECENT.holds_under(self.root.path(layout.inner_state_dir(task.round - 1, task.target)))

    def _held_next_rounds(self, until_round: int) -> list[Task]:
        """The planned train tasks not published yet whose inner state this process holds in memory
        (it trained the path's round before: _held_here), on an object store."""
        if self.root.is_local:
            return []
        seen = self._listed or self  # the look's listings: a round's marker is no request of its own
        return [
            task
            for r in range(1, until_round)
            if not seen._committed(r)
            for task in (Task.of("train", r, job) for job in self.jobs_of(r))
            if self._held_here(task) and not seen.output_committed(task)
        ]

    def early_trains(self, until_round: int, held: list[Task] | None = None) -> list[tuple[Task, list[ModuleKey]]]:
        """Train tasks this process may start before the merges they start from are committed
        (pipeline/outer/early.py), each with those merges' modules: on an object store, a path's
        next round whose inner state this process holds in memory (it trained the round before:
        the state is resumed from memory, whether it is still going up or kept), once every path
        through each of its modules not merged yet is published. A path given up leaves its
        merges as they are: they wait. Asked of the last look's listings (next_claim), no request
        of its own; `held`: _held_next_rounds, when the caller has it."""
        seen = self._listed or self
        found = []
        for task in self._held_next_rounds(until_round) if held is None else held:
            r, job, before = task.round, task.target, task.round - 1
            if not seen.shards_ready(r) or not seen.resumable(r, job):
                continue
            keys = self.job_modules[job]
            pending = [key for key in keys if not seen.root.is_committed(layout.merged_module_dir(before, key))]
            if not pending or seen.modules_ready(r, keys):
                continue  # ready as it is: a plain claim takes it
            jobs_before = set(self.jobs_of(before))
            through = {j for key in pending for j in self.jobs_through[key] if j in jobs_before}
            if all(seen.output_committed(Task.of("train", before, j)) for j in through):
                found.append((task, pending))
        return found

    def behind_claims(
        self, island: str, island_id: str | None, modules: list[ModuleKey] | None
    ) -> tuple[Callable[[], list["Lease"]], Callable[[], list["Lease"]]]:
        """The claims, to make later on the thread beside an early start (Island._run_beside), of
        the merges and round commits ready at the last look, for the island that starts a path
        early (claim_early) to run them beside its training: (now, after its first step). Commits
        otherwise waited for an idle island, and islands that start early are never idle: three
        rounds' commits piled up at the end of a demo run across hosts, and every look listed the
        rounds they left open.
        - now: the commits and the merges of `modules`, those the early start computes (their
          inputs are in this process's memory);
        - after its first step: the other merges, still unclaimed by then. Each is left that long
          to the island whose path it is: claimed at once, it downloaded that path's level and its
          module (7.6 MB over the host's link). Yet a merge whose island is gone is taken here,
          not a round later.
        `modules` None: next_claim tried the merges already; the commits alone. The look is taken
        now: the next one may come while they are claimed."""
        ready, listed = list(self._last_ready), self._listed
        mine = set(modules or [])

        def claim(wanted: Callable[[Task], bool]) -> list["Lease"]:
            leases = []
            for task in ready:
                if wanted(task):
                    lease = self.claim(task, island, island_id, listed)
                    leases += [lease] if lease is not None else []
            return leases

        def now() -> list["Lease"]:
            return claim(lambda task: task.kind == "commit" or (task.kind == "merge" and task.module in mine))

        def later() -> list["Lease"]:
            if modules is None:
                return []
            return claim(lambda task: task.kind == "merge" and task.module not in mine)

        return now, later

    def claim_early(self, island: str, island_id: str | None = None) -> "Lease | None":
        """A claim of the first of the last look's early starts (early_trains) nobody holds; the
        lease names the modules it starts from before their merges are committed (`early`)."""
        for task, pending in self._early:
            lease = self.claim(task, island, island_id, self._listed)
            if lease is not None:
                lease.early = pending
                return lease
        return None

    def next_claim(
        self, island: str, until_round: int, island_id: str | None = None, early_first: bool = False
    ) -> "Lease | None":
        """The first ready task nobody holds; else, with train.backup_after, a backup of a straggler.

        Evaluations after everything else (REPORT_ONLY), and a round's commit after every ready
        train, merge and reroute task of any round: nothing trains from what it gathers (a round
        starts from its modules merged on their own), and claimed first it held one island back
        from the next round's training on two hosts (benchmarks/RESULTS.md, "Islands on separate
        hosts"); it runs in the gaps, while islands wait for a path to be published or a merge. No
        evaluation is claimed while another island runs a merge: its end makes the next round's
        train tasks ready, and an island that took an evaluation just before started its next path
        1-2 s late (the same benchmark); commits, which the run's end waits for, are (withheld too,
        they piled up there: 4 in a row, 5 s). Nor while this process keeps an inner state: its
        end may make a round's commit ready.
        Among a round's merges, first those whose paths' weights this island holds in memory (it
        trained them: no download), then those of the modules most paths share (the longest);
        among its train tasks, first those whose inner state this island still holds.
        `early_first` (a one-rank island): this island's early start (early_trains) is claimed
        before the first ready merge or commit, which then run beside it (Island._start_early,
        behind_claims). Claimed after them, it waited for their creates, and for those another
        island won, one round trip each: across hosts the island that published first claimed
        its next round 1.2-1.6 s after the last publish (benchmarks/RESULTS.md, "Islands on
        separate hosts"). A ready train or reroute task still comes first."""
        self._listed = None
        ready = sorted(
            self.ready(until_round),
            key=lambda task: (
                task.kind in REPORT_ONLY,
                task.kind == "commit",
                task.round,
                task.order,
                self.merge_preference(task),
                not self._held_here(task),
            ),
        )
        self._medians: dict[int, TaskTimes | None] = {}
        seen_before, self._last_ready = set(self._last_ready), ready
        held = self._held_next_rounds(until_round)
        self._early = self.early_trains(until_round, held)
        early_tried = not (early_first and self._early)
        merging = False  # a merge another island runs (or will): its end makes train tasks ready
        # A path's next round this island holds the state of starts as soon as its peers publish
        # (early_trains): an evaluation claimed just before held it back 2-3 s across hosts.
        training_soon = bool(held)
        # An inner state this process is keeping may be the last one its round's commit waits for:
        # in the plan's last round, an island that took an evaluation while its state went up held
        # that commit back 1.7 s across hosts (it ran the evaluation first), and the last round's
        # evaluations wait for that commit.
        keeping = bool(self.keeping_here)
        for task in ready:
            if (merging or training_soon or keeping) and task.kind in REPORT_ONLY:
                continue
            if not early_tried and task.kind in BEHIND_KINDS:
                early_tried = True
                lease = self.claim_early(island, island_id)
                if lease is not None:
                    return lease
                self._early = []  # each one refused: Island._start_early does not ask again at this look
            if self._for_its_holder(task, seen_before):
                merging = True
                continue
            lease = self.claim(task, island, island_id, self._listed)
            if lease is not None:
                return lease
            merging = merging or (task.kind == "merge" and self._claim_found_live)
        if self.backup_after is None:
            return None
        # LATE's speculative cap: backups of a round at once, a tenth of its train tasks (at least
        # one). Each backup takes a share of the machine; on islands that share cores, uncapped
        # backups slow the tasks beside them, which then look like stragglers in turn.
        running: dict[int, int] = {}
        for task in ready:
            if task.kind == "train":
                running[task.round] = running.get(task.round, 0) + sum(a.live and a.backup for a in self.attempts(task))
        for task in ready:
            if task.kind == "train" and running[task.round] >= max(1, len(self.jobs_of(task.round)) // 10):
                continue
            lease = self.claim_backup(task, island, island_id)
            if lease is not None:
                return lease
        return None


def _record_bytes(record: dict) -> bytes:
    return (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()


class LeaseLost(DipacoError):
    """Our lease record was ended by someone else (the store refused our compare-and-swap)."""


class Lease:
    """An island's hold on one attempt of a task, kept alive by a heartbeat thread.

    A beat that fails to write (a flaky store) is retried with backoff; the lease is given up only
    after `lease_seconds` without a successful beat, when readers may have expired it anyway.
    `cancelled` is set when another attempt's output of the task got committed first."""

    def __init__(self, queue: TaskQueue, task: Task, number: int, record: dict, version: str):
        self.queue, self.task, self.number, self.record = queue, task, number, record
        self.version = version  # of the record as this holder last wrote it: each write is a compare-and-swap
        self.rel = f"{LEASES}/{task.name}/attempt-{number}.json"
        self.lost = threading.Event()
        self.cancelled = threading.Event()
        self._claimed = time.monotonic()
        self.early: list[ModuleKey] = []  # modules a train attempt starts from before their merge (claim_early)
        self.training = threading.Event()  # a train attempt's first step is done: its load no longer needs the cores
        self._progress: dict = {}  # the trainer's last step report, written with the next beat
        self._recent: deque[tuple[float, int]] = deque()  # (inner seconds, step) of the last reports
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ended = False  # finish() ends a lease once (a keeping thread and SIGTERM may both try)
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name=f"lease-{task.name}")
        self._thread.start()

    def _heartbeat(self) -> None:
        """The heartbeat thread: any exception at all ends the lease as lost (the holder stops at its
        next check), never a dead thread beside a lease that still looks held."""
        try:
            self._beat()
        except BaseException as exc:  # noqa: BLE001 - a thread's last word: nothing may escape unreported
            log.warning("heartbeat of %s died (%s: %s); giving up the lease", self.task.name, type(exc).__name__, exc)
            self.lost.set()

    def _beat(self) -> None:
        """A beat every quarter lease: a compare-and-swap of the record, which the store refuses once
        someone ended it. Every CHECK_EVERY beats, and at the first beat after a failed one, it also
        lists the task's attempts (a reader that found it expired made a later one) and asks whether
        another attempt did the task: those are 3-4 requests, and on every beat they were a third
        of a demo run's requests to the store (benchmarks/RESULTS.md, "Islands on separate hosts").
        What they find only stops the work sooner: a publish re-checks the lease itself (held)."""
        interval = self.queue.lease_seconds / 4
        delay, last_ok, failures, beats = interval, time.monotonic(), 0, 0
        while not self._stop.wait(delay):
            try:
                if failures or beats % CHECK_EVERY == 0:
                    if not self._still_mine():
                        log.warning("lost the lease of %s (a later attempt exists, or it was failed)", self.task.name)
                        self.lost.set()
                        return
                    if self.queue.task_done(self.task):
                        self.cancelled.set()  # another attempt did it first: stop working on it
                beats += 1
                self._write(
                    beats=int(self.record.get("beats", 0)) + 1,
                    heartbeat=time.time() + self.queue.clock_offset,
                    running_s=round(time.monotonic() - self._claimed, 3),
                    **self._progress,
                )
                delay, last_ok, failures = interval, time.monotonic(), 0
            except LeaseLost as exc:  # the store says so: no clock involved
                log.warning("lost the lease of %s (%s)", self.task.name, exc)
                return
            except (DipacoError, StorageError, OSError) as exc:
                failures += 1
                if time.monotonic() - last_ok > self.queue.lease_seconds:
                    log.warning(
                        "giving up the lease of %s: no heartbeat written for %.1f s (%s)",
                        self.task.name,
                        time.monotonic() - last_ok,
                        exc,
                    )
                    self.lost.set()
                    return
                # Backoff from a tenth of a beat, doubling, never slower than a normal beat: three
                # failures in a row cost under half a lease.
                delay = min(interval, interval / 10 * 2 ** (failures - 1))
                log.warning("heartbeat of %s failed (%s); retrying in %.2f s", self.task.name, exc, delay)

    def report_step(self, step: int, from_step: int, inner_s: float) -> None:
        """The trainer's progress (steps done, the step it resumed from, its inner loop's seconds
        on its own monotonic clock), beaten into the record: a reader estimates from it when this
        attempt will finish (TaskQueue.claim_backup). Called every step: a dict swap, no I/O."""
        recent = self._recent
        recent.append((inner_s, step))
        # Its pace now, over the last two beats' interval of reports: a rate since the start would
        # carry the speed of a minute ago (islands sharing cores run at half speed while all train).
        while len(recent) > 2 and inner_s - recent[1][0] >= self.queue.lease_seconds / 2:
            recent.popleft()
        since_s, since_step = recent[0]
        self._progress = {"step": step, "from_step": from_step, "inner_s": round(inner_s, 3)}
        if step > since_step and inner_s > since_s:
            self._progress["step_s"] = round((inner_s - since_s) / (step - since_step), 6)

    def _superseded(self, attempts: list | None = None) -> bool:
        """A later attempt that is not a backup of this one exists: a reader expired this one.
        `attempts`: the task's attempts, when the caller has just listed them."""
        attempts = self.queue.attempts(self.task) if attempts is None else attempts
        return any(a.number > self.number and not a.backup for a in attempts)

    def _still_mine(self) -> bool:
        """Not superseded, and our record not ended by someone else (fail_running)."""
        attempts = self.queue.attempts(self.task)  # one listing and its reads, asked once
        if self._superseded(attempts):
            return False
        mine = next((a for a in attempts if a.number == self.number), None)
        return mine is not None and mine.state == "running"

    def held(self) -> bool:
        """Whether this attempt may still publish its output: re-checked right before publishing."""
        return not self.lost.is_set() and self._still_mine()

    def _write(self, **fields) -> None:
        """Replace our record if it is still the one we wrote; else someone ended it (a lost lease)."""
        with self._lock:
            record = {**self.record, **fields}
            version = self.queue.root.replace_if(self.rel, _record_bytes(record), self.version)
            if version is None:
                self.lost.set()
                raise LeaseLost(f"{self.queue.root.path(self.rel)}: changed by another island since our last beat")
            self.record, self.version = record, version

    def finish(self, state: str, **fields) -> None:
        """End the lease: `done`, `failed` (counts toward max_attempts), `released` or `cancelled`
        (do not). Written with retries: a transient storage error must not lose the outcome."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._stop.set()
        self._thread.join()
        for tries in range(5):
            try:
                if self._superseded():
                    return
                self._write(state=state, finished_at=time.time() + self.queue.clock_offset, **self._progress, **fields)
                return
            except LeaseLost:  # someone else ended the record: theirs stands
                return
            except (DipacoError, StorageError, OSError) as exc:
                log.warning("recording %s of %s failed (%s); retrying", state, self.task.name, exc)
                time.sleep(0.05 * 2**tries)

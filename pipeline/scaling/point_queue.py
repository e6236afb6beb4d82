"""A sweep's points as leased tasks: the islands' queue and leases (pipeline.islands.task_queue),
one level up. Every process that trains points of a sweep (the CLI's lanes, the dipaco_sweep DAG's
mapped tasks, a second host) claims a point before it trains it, so a point is never trained by two
live holders at once, and a holder that died is replaced once its lease expires:

    <sweep_root>/queue/leases/point.r0.<point id>/attempt-<n>.json

The rules are the islands' own: a claim is an exclusive create of the next attempt's file; expiry
is judged on the reader's monotonic clock from the holder's beat count (`train.lease_seconds` of
the sweep's first point); a point whose output (`points/<id>/_SUCCESS`) is committed is never run
again; after `train.max_attempts` failed or expired attempts a point is given up and the fit goes
on without it (`rm -r` its lease folder to try it again). A holder re-checks its lease right
before it commits, so a paused holder whose lease expired cannot commit over its successor. The
attempts' records (island, seconds) are the sweep's utilisation accounting (`lane_utilisation`).
"""

from __future__ import annotations

import logging
import time

from pipeline.core.config import Config
from pipeline.islands.island import new_island_id
from pipeline.islands.task_queue import LEASES, Lease, Task, TaskQueue, finite_number
from pipeline.state.storage import RunRoot

log = logging.getLogger("dipaco.sweep")
KIND = "point"


def point_task(point_id: str) -> Task:
    return Task(round=0, order=0, kind=KIND, target=point_id)


class PointQueue(TaskQueue):
    """The claims and leases of a sweep's points; readiness is simply "not committed"."""

    limited_kinds = (KIND,)

    def __init__(self, sweep_root: str, config: Config, points_dir: str):
        super().__init__(RunRoot(sweep_root), config)
        self.points_dir = points_dir

    def output_committed(self, task: Task) -> bool:
        return task.kind == KIND and self.root.is_committed(f"{self.points_dir}/{task.target}")

    def held_elsewhere(self, task: Task) -> bool:
        """A live attempt that this process may wait for: it commits or its lease expires."""
        return any(a.live for a in self.attempts(task))

    def next_point(self, point_ids: list[str], island: str, island_id: str) -> tuple[Lease | None, bool]:
        """The first of `point_ids` (in order) this island may train now, and whether any other
        is still to wait for (held by a live holder elsewhere)."""
        waiting = False
        for point_id in point_ids:
            task = point_task(point_id)
            if self.output_committed(task):
                continue
            lease = self.claim(task, island, island_id)  # None when held, or given up
            if lease is not None:
                return lease, True
            waiting = waiting or self.held_elsewhere(task)
        return None, waiting

    def given_up_points(self, point_ids: list[str]) -> list[dict]:
        """The points given up after train.max_attempts failures, each with its last error."""
        out = []
        for point_id in point_ids:
            task = point_task(point_id)
            if not self.output_committed(task) and self.given_up(task):
                last = self.attempts(task)[-1].record
                out.append(
                    {
                        "point": point_id,
                        "attempts": len(self.attempts(task)),
                        "error": last.get("error") or "its lease expired",
                        "retry": f"rm -r {self.root.path(f'{LEASES}/{task.name}')}",
                    }
                )
        return out

    def poll_seconds(self) -> float:
        return max(0.05, self.lease_seconds / 4)


def island_name(lane: int) -> tuple[str, str]:
    """A lane's name and its identity, unique per process (a DAG task's and a CLI's never meet)."""
    name = f"sweep-lane-{lane}"
    return name, new_island_id(name)


def wait_for(queue: PointQueue, point_id: str, island: str, island_id: str) -> Lease | None:
    """Claim one point, waiting while a live holder elsewhere has it: None once it is committed
    (by that holder) or given up. The dipaco_sweep DAG's mapped tasks train through this."""
    task = point_task(point_id)
    while (lease := queue.claim(task, island, island_id)) is None:
        if queue.output_committed(task) or queue.given_up(task):
            return None
        time.sleep(queue.poll_seconds())
    return lease


def lane_utilisation(queue: PointQueue, point_ids: list[str], lanes: int, since: float, seconds: float) -> dict:
    """The share of the lanes' time (lanes x wall seconds of this invocation) spent in point
    attempts that committed, from the attempts' own records: the islands' utilisation, per sweep."""
    busy, wasted = 0.0, 0.0
    for point_id in point_ids:
        for attempt in queue.attempts(point_task(point_id)):
            record = attempt.record
            took, claimed = record.get("seconds"), record.get("claimed_at")
            if not finite_number(took) or not finite_number(claimed):
                continue  # a malformed record: the queue counted it failed and warned, naming the file
            if float(claimed) - queue.clock_offset < since:
                continue  # an earlier invocation's
            if attempt.state == "done":
                busy += float(took)
            else:
                wasted += float(took)
    capacity = lanes * seconds
    return {
        "lanes": lanes,
        "busy_seconds": round(busy, 3),
        "lost_seconds": round(wasted, 3),
        "utilisation": round(busy / capacity, 4) if capacity > 0 else None,
    }

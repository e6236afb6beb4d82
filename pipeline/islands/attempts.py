"""`train.max_attempts`, counted in one place.

Three things fail and are tried again, and each asks `Attempts.may_try_again` after a failure:

- a one-shot path launch (`dipaco train-path`, pipeline.islands.launch.train_path_job): its
  failed launches;
- a task in the run root's queue (pipeline.islands.task_queue): its failed or expired leases
  (a released or cancelled attempt is no failure); a train task given up is left out of its
  round's merge (one whose path is published may fail as many times more: its inner state is
  still to keep, TaskQueue._may_try_again);
- an island launch that `dipaco run` supervises (pipeline.islands.supervisor): its crashes.

A config or input error is never tried again: the next attempt would fail the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Attempts:
    """How many failed attempts something may have before it is given up."""

    limit: int

    @classmethod
    def of_tasks(cls, train) -> "Attempts":
        """A path's launches and a queued task's leases: `train.max_attempts` failures."""
        return cls(train.max_attempts)

    @classmethod
    def of_islands(cls, train) -> "Attempts":
        """An island's launches: one more than a task's. A task that fails ends the island it ran
        in, so an island must outlive a task's last failure to see it given up and go on (its
        round then merges without the path) instead of failing the whole run."""
        return cls(train.max_attempts + 1)

    def may_try_again(self, failures: int, input_error: bool = False) -> bool:
        """Whether another attempt may start after `failures` failed ones, the last of which
        was (or was not) a config or input error."""
        return not input_error and failures < self.limit

"""Compute utilisation of a run: how much of the islands' time went into inner-loop steps.

    utilisation(r) = sum of inner-loop seconds of every train task of rounds <= r
                     / (islands x (round r's `_SUCCESS` committed_at - earliest inner-loop start))

The rest is overhead: launching, claiming, loading modules and inner state, building engines,
committing, merging, evaluating, and waiting for work. OpenDiLoCo reports 90-95 %; a one-shot
launch per (path, round) measured 0.24 on the demo. Every figure comes from committed records
(each path's metrics.json, the round markers, the queue's lease and island records), so any
process can compute it after the fact.
"""

from __future__ import annotations

from models.grid import all_job_ids
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.islands.task_queue import ISLANDS, LEASES


def round_utilisation(config, round_index: int) -> dict | None:
    """Utilisation up to round r, the islands counted and the mean per-task overhead; None when
    round r is not committed or none of its paths trained."""
    root = RunRoot(config.run_root)
    if not root.is_committed(layout.round_dir(round_index)):
        return None
    inner, starts = 0.0, []
    for r in range(round_index + 1):
        for job in all_job_ids(config.model.grid, config.train.workers_per_path):
            rel = layout.path_dir(r, job)
            if root.is_committed(rel):
                metrics = root.read_json(f"{rel}/metrics.json")
                if isinstance(metrics.get("started_at"), (int, float)):
                    inner += float(metrics["seconds"])
                    starts.append(float(metrics["started_at"]))
    if not starts:
        return None
    end = float(root.marker(layout.round_dir(round_index))["committed_at"])
    islands = island_count(root) or config.train.islands or config.train.parallel_paths
    wall = end - min(starts)
    overheads = task_overheads(root, round_index)
    return {
        "utilisation": inner / (islands * wall) if wall > 0 else None,
        "islands": islands,
        "inner_seconds": inner,
        "wall_seconds": wall,
        "task_overhead_seconds": sum(overheads) / len(overheads) if overheads else None,
    }


def island_count(root: RunRoot) -> int:
    return sum(1 for name in root.listdir(ISLANDS) if name.endswith(".json"))


def task_overheads(root: RunRoot, round_index: int) -> list[float]:
    """Per train task of rounds <= r: its lease's seconds (claim to done) minus its inner loop:
    claim, shard and module loading, engine build, checkpoint and commit."""
    found = []
    for name in root.listdir(LEASES):
        if not name.startswith("train.r"):
            continue
        if int(name.split(".")[1][1:]) > round_index:
            continue
        for attempt in root.listdir(f"{LEASES}/{name}"):
            record = root.read_json(f"{LEASES}/{name}/{attempt}")
            if record.get("state") == "done" and isinstance(record.get("inner_seconds"), (int, float)):
                found.append(float(record["seconds"]) - float(record["inner_seconds"]))
    return found

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
from pipeline.islands.task_queue import ISLANDS, LEASES, Task


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
    islands = islands_recorded(root) or config.train.islands or config.train.parallel_paths
    wall = end - min(starts)
    overheads = task_overheads(config, round_index)
    return {
        "utilisation": inner / (islands * wall) if wall > 0 else None,
        "islands": islands,
        "inner_seconds": inner,
        "wall_seconds": wall,
        "task_overhead_seconds": sum(overheads) / len(overheads) if overheads else None,
        **{f"task_{phase}_seconds": v for phase, v in (overhead_breakdown(config, round_index) or {}).items()},
    }


def islands_recorded(root: RunRoot) -> int:
    return sum(1 for name in root.listdir(ISLANDS) if name.endswith(".json"))


def overhead_breakdown(config, round_index: int) -> dict[str, float] | None:
    """Mean seconds per train task of round r besides its inner loop, by phase: `load` (process
    group check, shard, modules, model), `engine` (ZeRO engine and inner-state load) and `commit`
    (checkpoint, weights, metrics, marker; with the claim: the lease's time minus the others)."""
    root = RunRoot(config.run_root)
    phases: dict[str, list[float]] = {"load": [], "engine": [], "commit": []}
    for job in all_job_ids(config.model.grid, config.train.workers_per_path):
        rel = layout.path_dir(round_index, job)
        lease = _done_lease(root, Task.of("train", round_index, job).name)
        if not root.is_committed(rel) or lease is None:
            continue
        metrics = root.read_json(f"{rel}/metrics.json")
        setup = metrics.get("setup_seconds")
        if not isinstance(setup, dict):
            continue
        phases["load"].append(float(setup["load"]))
        phases["engine"].append(float(setup["engine"]))
        phases["commit"].append(float(lease["seconds"]) - float(metrics["seconds"]) - float(setup["load"]) - float(setup["engine"]))
    return {k: sum(v) / len(v) for k, v in phases.items()} if phases["load"] else None


def _done_lease(root: RunRoot, task: str) -> dict | None:
    for attempt in reversed(root.listdir(f"{LEASES}/{task}")):
        record = root.read_json(f"{LEASES}/{task}/{attempt}")
        if record.get("state") == "done":
            return record
    return None


def task_overheads(config, round_index: int) -> list[float]:
    """Per train task of rounds <= r: its lease's seconds (claim to done) minus its inner loop:
    claim, shard and module loading, engine build, checkpoint and commit."""
    root, found = RunRoot(config.run_root), []
    for r in range(round_index + 1):
        for job in all_job_ids(config.model.grid, config.train.workers_per_path):
            lease = _done_lease(root, Task.of("train", r, job).name)
            if lease is not None and isinstance(lease.get("inner_seconds"), (int, float)):
                found.append(float(lease["seconds"]) - float(lease["inner_seconds"]))
    return found

"""The straggler benchmark's figure: each island's utilisation, computed from the run root's lease
and island records alone (benchmarks/chaos.py `island_utilisation`), checked against hand
arithmetic on records written the way islands write them."""

from benchmarks.chaos import island_utilisation
from conftest import tiny_config
from pipeline.islands.task_queue import ISLANDS, LEASES
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.tracking.utilisation import island_seconds


def _lease(root: RunRoot, task: str, attempt: int, island: str, claimed: float, **fields) -> None:
    root.write_json(f"{LEASES}/{task}/attempt-{attempt}.json", {"island": island, "claimed_at": claimed, **fields})


def test_each_islands_utilisation_counts_only_published_inner_seconds_within_the_training_span(run_root):
    config = tiny_config(run_root, "train.rounds=1")
    root = RunRoot(config.run_root)
    # island-0 starts 10 s before the first train claim (t=100): those seconds are not counted.
    root.write_json(f"{ISLANDS}/island-0.json", {"started_at": 90.0, "finished_at": 300.0})
    root.write_json(f"{ISLANDS}/island-1.json", {"started_at": 100.0})  # killed: no end of its own
    root.write_json(f"{ISLANDS}/island-2.json", {"lifetimes": [[100.0, 150.0]], "started_at": 160.0})
    _lease(root, "train.r0.p0-0", 1, "island-0", 100.0, state="done", inner_seconds=80.0, finished_at=185.0)
    _lease(root, "train.r0.p0-1", 1, "island-2", 101.0, state="done", inner_seconds=30.0, finished_at=150.0)
    # A straggler's attempt that a backup beat: its seconds published nothing.
    _lease(root, "train.r0.p1-0", 1, "island-2", 160.0, state="cancelled", heartbeat=190.0)
    _lease(
        root, "train.r0.p1-0", 2, "island-1", 170.0, state="done", inner_seconds=25.0, backup=True, finished_at=196.0
    )
    _lease(root, "merge.r0.l0-m0", 1, "island-0", 197.0, state="done")  # not a train task: not counted
    root.commit(layout.round_dir(0), {"committed_at": 200.0})

    figures = island_utilisation(root, config)

    assert set(figures) == {"island-0", "island-1", "island-2"}
    assert figures["island-0"]["running_s"] == 100.0  # 100..200, its start at 90 clipped
    assert figures["island-0"]["utilisation"] == 80.0 / 100.0
    assert figures["island-1"]["utilisation"] == 25.0 / 100.0
    assert figures["island-2"]["running_s"] == 90.0  # 100..150 and 160..200: the pause between lives left out
    assert figures["island-2"]["utilisation"] == 30.0 / 90.0
    assert figures["island-2"]["wasted_s"] == 30.0  # 160..190
    assert figures["island-0"]["wasted_s"] == figures["island-1"]["wasted_s"] == 0.0


def test_island_seconds_clips_each_life_to_the_window(run_root):
    root = RunRoot(run_root)
    root.write_json(
        f"{ISLANDS}/a.json", {"lifetimes": [[0.0, 10.0], [20.0, 40.0]], "started_at": 50.0, "finished_at": 60.0}
    )
    assert island_seconds(root, until=55.0) == {"a": 10.0 + 20.0 + 5.0}
    assert island_seconds(root, until=55.0, since=25.0) == {"a": 15.0 + 5.0}
    assert island_seconds(root, until=30.0, since=5.0) == {"a": 5.0 + 10.0}

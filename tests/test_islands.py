"""Islands: long-lived trainers pulling tasks from the run root's queue, leases that expire,
per-module merges as paths arrive (tests/test_merge.py checks their numbers), utilisation, SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, start_island, tiny_cli_args, tiny_config, wait_for, write_synthetic_shards
from models.grid import ModuleKey
from pipeline import stages
from pipeline.core.errors import InputError, IslandError
from pipeline.islands import supervisor
from pipeline.islands.attempts import Attempts
from pipeline.islands.task_queue import Task, TaskQueue, write_plan
from pipeline.outer.merge import merge_module, merge_round
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.train.train_path import train_path

pytestmark = pytest.mark.usefixtures("no_collector_pauses")  # lease timing: conftest says why


def test_a_claim_is_exclusive_and_a_dead_holders_lease_expires(any_root):
    config = tiny_config(any_root, "train.lease_seconds=0.4")
    root = stages.init_run(Run(config))
    a, b = TaskQueue(root, config), TaskQueue(root, config)
    task = Task.of("train", 0, "p0-0")
    held = a.claim(task, "island-a")
    assert held is not None and held.number == 1
    assert b.claim(task, "island-b") is None  # held and heartbeating: nobody else gets it
    time.sleep(0.6)
    assert b.claim(task, "island-b") is None  # still held: its heartbeat runs every lease/4

    held._stop.set()  # the holder dies: no more heartbeats
    held._thread.join()
    stopped = time.monotonic()
    # b expires it once it saw the beat count unchanged for lease_seconds on its own clock.
    taken = wait_for(lambda: b.claim(task, "island-b"), 3.0, "the dead holder's lease to expire")
    assert time.monotonic() - stopped > 0.4
    assert taken.number == 2
    assert a.claim(task, "island-a") is None
    held.finish("done")  # the dead holder's late word changes nothing: attempt 2 superseded it
    records = [x.record for x in a.attempts(task)]
    assert [r["island"] for r in records] == ["island-a", "island-b"]
    assert records[0]["state"] == "running" and records[1]["state"] == "running"
    taken.finish("done")
    assert a.attempts(task)[-1].record["state"] == "done" and a.claim(task, "island-a") is None


def test_a_lease_holder_that_was_superseded_learns_it_lost(run_root):
    config = tiny_config(run_root, "train.lease_seconds=0.2")
    root = stages.init_run(Run(config))
    queue = TaskQueue(root, config)
    task = Task.of("train", 0, "p0-0")
    lease = queue.claim(task, "slow")
    record = json.loads((run_root / lease.rel).read_text())
    (run_root / lease.rel.replace("attempt-1", "attempt-2")).write_text(json.dumps({**record, "island": "other"}))
    assert lease.lost.wait(2.0)
    lease.finish("done")
    assert queue.attempts(task)[0].record["state"] == "running"  # never marked done by the loser


def test_a_task_that_failed_max_attempts_times_is_given_up_and_the_round_merges_without_it(run_root):
    config = tiny_config(run_root, "train.rounds=1", "train.inner_steps=2", "train.max_attempts=2")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    queue = TaskQueue(root, config)
    task = Task.of("train", 0, "p0-0")
    for island in ("crashed-1", "crashed-2"):
        queue.claim(task, island).finish("failed", error="killed")
    assert queue.given_up(task) and queue.claim(task, "island-0") is None
    stages.run(Run(config))
    report = root.read_json(f"{layout.round_dir(0)}/merge.json")
    assert report["paths_left_out"] == ["p0-0"] and "p0-0" not in report["paths_merged"]
    assert not root.is_committed(layout.path_dir(0, "p0-0"))


def test_train_max_attempts_counts_failed_tasks_and_launches_and_one_more_for_islands(run_root):
    config = tiny_config(run_root, "train.max_attempts=2")
    tasks, islands = Attempts.of_tasks(config.train), Attempts.of_islands(config.train)
    assert [tasks.may_try_again(n) for n in (0, 1, 2)] == [True, True, False]
    assert [islands.may_try_again(n) for n in (1, 2, 3)] == [True, True, False]  # outlives a task's last failure
    assert not tasks.may_try_again(0, input_error=True) and not islands.may_try_again(0, input_error=True)


@pytest.mark.parametrize("returncode,error,launches", [(1, IslandError, 3), (2, InputError, 1)])
def test_a_crashing_island_is_started_again_while_its_attempts_allow_then_the_run_fails(
    run_root, monkeypatch, returncode, error, launches
):
    """train.max_attempts=2: an island that keeps crashing is launched 3 times (two restarts),
    its running attempt failed each time; a config or input error (status 2) is not retried."""
    config = tiny_config(run_root, "train.launcher=deepspeed", "train.islands=1", "train.max_attempts=2")
    root = stages.init_run(Run(config))
    started = []

    class Crashed:  # what the supervisor sees of a `deepspeed` launch that exited
        def __init__(self, config, name, ds_config=None):
            self.island_id, self.tail = f"{name}-{len(started)}", ["dipaco island: boom"]
            started.append(self)

        def poll(self):
            return returncode

        def wait(self, timeout=None):
            return returncode

    monkeypatch.setattr(supervisor, "IslandProcess", Crashed)
    lease = TaskQueue(root, config).claim(Task.of("train", 0, "p0-0"), "island-0", island_id="island-0-0")
    with pytest.raises(error, match="island-0.*boom"):
        supervisor.Supervisor(config, root).run(range(1), report=lambda r: None)
    assert len(started) == launches
    assert TaskQueue(root, config).attempts(Task.of("train", 0, "p0-0"))[0].record["state"] == "failed"
    lease.finish("failed")


def test_a_module_is_merged_as_soon_as_its_paths_are_in_and_round_1_starts_before_round_0_commits(run_root):
    config = tiny_config(run_root, "train.rounds=2", "train.inner_steps=2")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 2)
    queue = TaskQueue(root, config)
    for job in ("p0-0", "p0-1", "p1-0"):  # p1-1 is still training somewhere
        train_path(config, 0, job)
    ready = {t.name for t in queue.ready(2)}
    assert {"merge.r0.l0m0", "merge.r0.l1m0", "train.r0.p1-1"} <= ready
    assert not {"merge.r0.l0m1", "merge.r0.l1m1", "commit.r0"} & ready  # they wait for p1-1
    merge_module(config, 0, ModuleKey(0, 0))
    merge_module(config, 0, ModuleKey(1, 0))
    ready = {t.name for t in queue.ready(2)}
    assert "train.r1.p0-0" in ready and "eval.r1.p0-0" in ready  # both its modules of round 1 are in
    assert "train.r1.p0-1" not in ready and not root.is_committed(layout.round_dir(0))
    metrics = train_path(config, 1, "p0-0")  # trains from the modules merged on their own
    assert metrics["round"] == 1
    # Its inner state of round 0 is pruned (round 1's is resumed next), and round 0 still commits.
    train_path(config, 0, "p1-1")
    merge_module(config, 0, ModuleKey(0, 1))
    merge_module(config, 0, ModuleKey(1, 1))
    assert "commit.r0" in {t.name for t in queue.ready(2)}


def one_path_two_rounds(run_root: str, *sets: str) -> tuple:
    """A one-path grid planned for two rounds of two steps, leases of 0.3 s: (config, root, queue)."""
    config = tiny_config(
        run_root,
        "model.grid=[1]",
        "model.blocks_per_level=[1]",
        "train.rounds=2",
        "train.inner_steps=2",
        "train.lease_seconds=0.3",
        *sets,
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 2)
    return config, root, TaskQueue(root, config)


def test_a_path_whose_island_died_before_its_inner_state_was_in_is_trained_again_and_keeps_the_same_state(run_root):
    """An island publishes a path, then keeps its inner state (AdamW's moments, 2x the weights) off
    the task's critical path. If it dies in between, the merges still go on, but neither the round's
    commit nor the path's next round starts (it would resume an older state); the task is retaken
    once the lease expires, and the retake keeps the very state that was lost, byte for byte."""
    from pipeline.train.train_path import inner_state_of

    config, root, queue = one_path_two_rounds(run_root)
    task = Task.of("train", 0, "p0")
    dies = queue.claim(task, "dies")
    first = train_path(config, 0, "p0", attempt="attempt-1", may_publish=dies.held, keep_inner_state_later=True)
    assert first["published"] and not isinstance(first["inner_state"], bool)  # still in the island's memory
    lost = first["inner_state"].data
    dies._stop.set()  # the island dies before it uploads it: no more beats
    dies._thread.join()
    ready = {t.name for t in queue.ready(2)}
    assert "merge.r0.l0m0" in ready and "commit.r0" not in ready
    merge_module(config, 0, ModuleKey(0, 0))
    ready = {t.name for t in queue.ready(2)}
    assert not {"commit.r0", "train.r1.p0"} & ready, ready  # round 1 would resume no state, or an older one
    retake = wait_for(lambda: queue.claim(task, "taker"), 3.0, "the dead holder's lease to expire")
    again = train_path(config, 0, "p0", attempt="attempt-2", may_publish=retake.held)
    assert not again["published"] and again["inner_state"] is True  # the path stays the first's; the state is in
    retake.finish("done")
    assert root.read_json(layout.inner_state_kept(0, "p0"))["attempt"] == "attempt-2"
    assert root.read_committed(inner_state_of(root, 0, "p0"), "optimizer-rank-00000.safetensors") == lost
    assert {"commit.r0", "train.r1.p0"} <= {t.name for t in queue.ready(2)}
    assert queue.claim(task, "late") is None


def test_a_published_path_whose_attempts_all_died_is_not_given_up_its_next_round_waits_for_its_state(run_root):
    """train.max_attempts (2) attempts of a path lost: the first to a partition before it published,
    the second, which published, to a kill while it kept the inner state. Given up, the path's next
    round would start from fresh AdamW moments (a faults run's final modules differed so from the
    one-host run's); the task is retaken instead, and the retake keeps the state that was lost."""
    from pipeline.train.train_path import inner_state_of

    config, root, queue = one_path_two_rounds(run_root, "train.max_attempts=2")
    task = Task.of("train", 0, "p0")
    partitioned = queue.claim(task, "partitioned")
    partitioned._stop.set()  # no more beats: its lease expires
    partitioned._thread.join()
    dies = wait_for(lambda: queue.claim(task, "dies"), 3.0, "the partitioned holder's lease to expire")
    first = train_path(config, 0, "p0", attempt="attempt-2", may_publish=dies.held, keep_inner_state_later=True)
    assert first["published"]
    lost = first["inner_state"].data
    dies._stop.set()  # killed before its state is in
    dies._thread.join()
    retake = wait_for(lambda: queue.claim(task, "taker"), 3.0, "the killed holder's lease to expire")
    assert not queue.given_up(task)
    assert "train.r1.p0" not in {t.name for t in queue.ready(2)}  # it would resume no state
    again = train_path(config, 0, "p0", attempt="attempt-3", may_publish=retake.held)
    assert again["inner_state"] is True
    retake.finish("done")
    assert root.read_committed(inner_state_of(root, 0, "p0"), "optimizer-rank-00000.safetensors") == lost


def test_a_run_root_from_before_kept_json_resumes_with_its_paths_inner_state(run_root):
    """Before kept.json, a published path's `_SUCCESS` named the attempt whose inner state it kept.
    Resumed as it was, such a run would never commit a round stopped midway (its commit waits for
    kept.json) and would start the next round from fresh moments; `dipaco run` (init_run) adopts
    the old records instead."""
    from pipeline.train.train_path import latest_inner_state

    config = tiny_config(
        run_root, "model.grid=[1]", "model.blocks_per_level=[1]", "train.rounds=2", "train.inner_steps=2"
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 2)
    train_path(config, 0, "p0", attempt="attempt-1")
    # the older layout: no kept.json; the path's _SUCCESS names the attempt
    root.remove(layout.inner_state_kept(0, "p0"))
    marker = root.read_json(f"{layout.path_dir(0, 'p0')}/_SUCCESS")
    root.write_json(f"{layout.path_dir(0, 'p0')}/_SUCCESS", {**marker, "inner_state": "attempt-1"})
    merge_module(config, 0, ModuleKey(0, 0))
    queue = TaskQueue(root, config)
    assert "commit.r0" not in {t.name for t in queue.ready(2)} and latest_inner_state(root, 1, "p0") is None

    stages.init_run(Run(config))  # what a resumed `dipaco run` does first
    assert root.read_json(layout.inner_state_kept(0, "p0"))["attempt"] == "attempt-1"
    assert {"commit.r0", "train.r1.p0"} <= {t.name for t in TaskQueue(root, config).ready(2)}
    assert latest_inner_state(root, 1, "p0")[1] == layout.inner_state_dir(0, "p0", "attempt-1")


def test_an_island_claims_the_next_rounds_training_before_the_evaluations_left_of_an_earlier_round(run_root):
    """Evaluations feed only the round's report: with round 1's evaluations still to do and round 2's
    training ready, islands train first (the evaluations had delayed every round's start by 2-4 s
    on two hosts over a slow link), then evaluate when nothing else is ready."""
    config = tiny_config(run_root, "train.rounds=3", "train.inner_steps=2")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 3)
    queue = TaskQueue(root, config)
    for r in (0, 1):
        for job in queue.jobs_of(r):
            train_path(config, r, job)
        merge_round(config, r)
    ready = [t.name for t in queue.ready(3)]
    assert "eval.r1.p0-0" in ready and "train.r2.p0-0" in ready  # sorted by round, the evaluation comes first
    leases = [queue.next_claim(f"island-{k}", 3, island_id=f"island-{k}-x") for k in range(len(queue.jobs_of(2)) + 1)]
    for lease in leases:
        lease.finish("released")
    claimed = [lease.task for lease in leases]
    assert [t.kind for t in claimed] == ["train"] * len(queue.jobs_of(2)) + ["eval"]
    assert {t.target for t in claimed[:-1]} == set(queue.jobs_of(2)) and claimed[-1].round == 1


def test_islands_claim_the_merge_of_the_module_most_paths_share_first(run_root):
    """A round's merges, longest first: the shared module reads every path through it, the others
    one each. Claimed last (its name sorts last), it was the round's last merge alone on one island
    while the other waited (benchmarks/RESULTS.md, "Islands on separate hosts")."""
    config = tiny_config(run_root, "model.grid=[2,1]", "model.blocks_per_level=[1,1]", "train.inner_steps=1")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 1)
    queue = TaskQueue(root, config)
    for job in queue.jobs_of(0):
        train_path(config, 0, job)
    leases = [queue.next_claim(f"island-{k}", 1) for k in range(3)]
    assert [lease.task.name for lease in leases] == ["merge.r0.l1m0", "merge.r0.l0m0", "merge.r0.l0m1"]
    for lease in leases:
        lease.finish("released")


def test_a_rounds_commit_is_claimed_after_the_next_rounds_training_and_before_the_next_rounds_commit(run_root):
    """Nothing trains from what a round's commit gathers (round r+1 starts from its modules merged on
    their own), so islands train first and commit in the gaps; round r+1's commit waits for round
    r's, which copies the merged modules round r+1's commit removes."""
    from pipeline.outer.merge import finish_round
    from pipeline.tracking.utilisation import round_end

    config = tiny_config(
        run_root, "model.grid=[1]", "model.blocks_per_level=[1]", "train.rounds=2", "train.inner_steps=1"
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 2)
    queue = TaskQueue(root, config)
    train_path(config, 0, "p0")
    merge_module(config, 0, ModuleKey(0, 0))
    leases = [queue.next_claim(name, 2) for name in ("a", "b")]
    assert [lease.task.name for lease in leases] == ["train.r1.p0", "commit.r0"]
    for lease in leases:
        lease.finish("released")
    train_path(config, 1, "p0")
    merge_module(config, 1, ModuleKey(0, 0))
    ready = {t.name for t in queue.ready(2)}
    assert "commit.r0" in ready and "commit.r1" not in ready
    merged_at = root.marker(layout.merged_module_dir(0, ModuleKey(0, 0)))["committed_at"]
    finish_round(config, 0)
    assert "commit.r1" in {t.name for t in queue.ready(2)}
    # Round 0 ended at its last merge, not at its commit a round later: what utilisation counts to.
    marker = root.marker(layout.round_dir(0))
    assert marker["merged_at"] == merged_at < marker["committed_at"] and round_end(root, 0) == merged_at


def test_an_idle_islands_poll_lists_an_object_store_at_once_and_asks_a_disk_one_by_one(any_root, monkeypatch):
    """ready() is asked twice a second by every idle island: on an object store each existence
    check is a round trip (seconds a poll over a 40 ms link, one by one; 1.2-1.5 s in ~20 waves at
    once), so it lists each open round's directory, the evaluations' and the leases' together and
    answers from the listings; the answer is the same either way."""
    config = tiny_config(any_root, "train.rounds=2", "train.inner_steps=2")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 2)
    for job in ("p0-0", "p0-1"):
        train_path(config, 0, job)
    queue = TaskQueue(root, config)
    if not root.is_local:
        queue.ready(2)  # the shards' marker is asked once, then known
        sent: list[str] = []
        in_flight, most = [0], [0]
        call = root.store.fs.call_s3

        def counted(method: str, *args, **kwargs):
            sent.append(method)
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            try:
                time.sleep(0.05)  # a round trip over a slow link
                return call(method, *args, **kwargs)
            finally:
                in_flight[0] -= 1

        monkeypatch.setattr(root.store.fs, "call_s3", counted)
        ready = {t.name for t in queue.ready(2)}
        assert ready == {"train.r0.p1-0", "train.r0.p1-1", "merge.r0.l0m0"}  # p1-* still to train
        # the leases, rounds 0-2, rounds 1-2's evaluation parts: one listing each, all at once
        assert sent.count("list_objects_v2") == 6 and most[0] >= 6, (sent, most)
        assert sent.count("head_object") <= 2, sent  # the round evaluations' files (eval/round=<r>.json)
        return
    asked = RunRoot.is_committed
    in_flight, most = [0], [0]

    def slow_is_committed(rel: str) -> bool:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        time.sleep(0.05)  # a round trip over a slow link
        try:
            return asked(root, rel)
        finally:
            in_flight[0] -= 1

    root.is_committed = slow_is_committed
    ready = {t.name for t in queue.ready(2)}
    assert ready == {"train.r0.p1-0", "train.r0.p1-1", "merge.r0.l0m0"}  # p1-* still to train
    assert most[0] == 1


@pytest.mark.slow  # ~40 s: three island processes
def test_sigterm_releases_the_task_and_another_island_finishes_the_run(run_root):
    config = tiny_config(run_root, "train.rounds=1", "train.inner_steps=400", "train.max_attempts=1")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 1)
    queue = TaskQueue(root, config)
    leaving = start_island(run_root, "leaving")

    def running_lease():
        if leaving.poll() is not None:
            raise AssertionError(f"the island exited ({leaving.returncode}): {leaving.stdout.read()[-2000:]}")
        for job in stages.list_paths(config):
            attempts = queue.attempts(Task.of("train", 0, job))
            if attempts and attempts[-1].record.get("island") == "leaving":
                return Task.of("train", 0, job)
        return None

    task = wait_for(running_lease, 120, "the island to claim a train task")
    time.sleep(1.0)  # inside its inner loop
    os.killpg(leaving.pid, signal.SIGTERM)
    output, _ = leaving.communicate(timeout=60)
    assert leaving.returncode == 0, output[-2000:]
    assert queue.attempts(task)[-1].record["state"] == "released"
    assert not root.is_committed(layout.path_dir(0, task.target))
    assert root.read_json("queue/islands/leaving.json")["state"] == "left"
    assert not queue.given_up(task)  # a release costs no attempt, even with max_attempts=1

    # Another island joins through the CLI, with a ZeRO stage of its own (the run's is 2).
    stayer = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "island",
            "--name",
            "stayer",
            *tiny_cli_args(run_root, "train.ds_config=ds_configs/zero3.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert stayer.returncode == 0, (stayer.stdout + stayer.stderr)[-2000:]
    for job in stages.list_paths(config):
        metrics = root.read_committed_json(layout.path_dir(0, job), "metrics.json")
        assert metrics["ds_config"]["zero_optimization"]["stage"] == 3
    assert root.is_committed(layout.round_dir(0)) and root.exists(layout.eval_file(1))
    assert root.read_json(f"{layout.round_dir(0)}/merge.json")["paths_left_out"] == []
    assert queue.attempts(task)[-1].record["island"] == "stayer"


@pytest.mark.slow  # ~60 s: two deepspeed islands, 32 path tasks
def test_two_deepspeed_islands_train_sixteen_paths_and_report_utilisation(run_root):
    config = tiny_config(
        run_root,
        "train.rounds=2",
        "train.inner_steps=10",
        "train.launcher=deepspeed",
        "train.islands=2",
        "train.parallel_paths=2",
        "model.grid=[4, 4]",
    )  # 16 paths, 2 islands
    write_synthetic_shards(stages.init_run(Run(config)), config.model.grid)
    summary = stages.run(Run(config))
    root = RunRoot(config.run_root)
    assert summary["rounds_committed"] == 2 and sorted(summary["eval"]) == [0, 1, 2]
    by_island: dict[str, list[str]] = {}
    for name in root.listdir("queue/leases"):
        for attempt in root.listdir(f"queue/leases/{name}"):
            record = root.read_json(f"queue/leases/{name}/{attempt}")
            assert record["state"] == "done", (name, record)
            by_island.setdefault(record["island"], []).append(name)
    assert set(by_island) == {"island-0", "island-1"}
    trained = sorted(n for names in by_island.values() for n in names if n.startswith("train."))
    assert trained == sorted(f"train.r{r}.{job}" for r in (0, 1) for job in stages.list_paths(config))  # each once
    use = summary["utilisation"]
    assert use["islands"] == 2 and use["round"] == 1 and 0 < use["utilisation"] <= 1
    assert use["task_overhead_seconds"] > 0 and use["task_engine_seconds"] > 0 and use["task_commit_seconds"] > 0

    metrics = root.read_committed_json(layout.path_dir(1, "p3-3"), "metrics.json")
    assert metrics["started_at"] < metrics["finished_at"] <= root.marker(layout.round_dir(1))["committed_at"]


def test_utilisation_is_logged_to_mlflow_by_round_and_printed(run_root):
    import mlflow

    from pipeline.tracking.report import format_summary
    from pipeline.tracking.uris import tracking_uri

    config = tiny_config(
        run_root, "train.rounds=2", "train.inner_steps=3", "mlflow.enabled=true", "model.vocab_size=50257"
    )  # the real prepare: GPT-2 ids
    summary = stages.run(Run(config))  # prepares tests/data/c4 with Beam, trains on one in-process island
    use = summary["utilisation"]
    assert use["round"] == 1 and use["islands"] == 1 and 0 < use["utilisation"] <= 1
    assert f"compute utilisation {use['utilisation']:.2f} through round 1" in format_summary(summary)
    client = mlflow.MlflowClient(tracking_uri(config))
    parent = RunRoot(config.run_root).read_json("tracking.json")["parent_run_id"]
    logged = {m.step: m.value for m in client.get_metric_history(parent, "utilisation")}
    assert sorted(logged) == [0, 1] and logged[1] == pytest.approx(use["utilisation"])
    assert client.get_metric_history(parent, "islands_task_overhead_seconds")


def test_an_input_error_on_a_deepspeed_island_reaches_dipaco_run_in_one_line_without_retries(run_root):
    from pipeline.core.errors import InputError

    config = tiny_config(
        run_root, "train.rounds=1", "train.inner_steps=2", "train.launcher=deepspeed", "train.islands=1"
    )
    write_synthetic_shards(
        stages.init_run(Run(config)), config.model.grid, docs_per_path={"p0-0": 0, "p0-1": 8, "p1-0": 8, "p1-1": 8}
    )
    with pytest.raises(InputError, match=r"island-0: .*shards/path=p0-0: too few tokens for one row"):
        stages.run(Run(config))
    queue = TaskQueue(RunRoot(config.run_root), config)
    attempts = queue.attempts(Task.of("train", 0, "p0-0"))
    assert len(attempts) == 1 and attempts[0].record["state"] == "failed" and attempts[0].record["input_error"]


@pytest.mark.slow  # ~35 s: one island of two gloo ranks
def test_an_island_of_two_ranks_trains_every_task_with_both(run_root):
    config = tiny_config(
        run_root,
        "train.rounds=1",
        "train.inner_steps=3",
        "train.launcher=deepspeed",
        "train.islands=1",
        "train.procs_per_path=2",
    )
    write_synthetic_shards(stages.init_run(Run(config)), config.model.grid)
    summary = stages.run(Run(config))  # rank 0 broadcasts each task; both ranks train, rank 0 merges
    root = RunRoot(config.run_root)
    assert summary["rounds_committed"] == 1 and sorted(summary["eval"]) == [0, 1]
    for job in stages.list_paths(config):
        assert root.read_committed_json(layout.path_dir(0, job), "metrics.json")["world_size"] == 2
    assert root.read_json("queue/islands/island-0.json")["world_size"] == 2


def _kept(root: RunRoot, r: int, job: str) -> None:
    """A path's inner state of round r kept (its record only: what the queue reads)."""
    root.write_json(layout.inner_state_kept(r, job), {"attempt": "attempt-1"})


def _published(root: RunRoot, r: int, job: str, kept: bool = True) -> None:
    """A path of round r published (a stand-in for its weights), with its inner state kept unless not `kept`."""
    root.write_bytes(f"{layout.path_dir(r, job)}/model.safetensors", b"w")
    root.commit(layout.path_dir(r, job))
    if kept:
        _kept(root, r, job)


def _merged(root: RunRoot, r: int, key: ModuleKey) -> None:
    """A module's merge of round r committed (a stand-in for its file)."""
    root.write_bytes(f"{layout.merged_module_dir(r, key)}/{layout.MERGED_MODULE}", b"m")
    root.commit(layout.merged_module_dir(r, key), files=[layout.MERGED_MODULE])


def test_no_evaluation_is_claimed_while_another_island_runs_a_merge_and_a_commit_is(run_root):
    """A merge's end makes the next round's train tasks ready: an island that took an evaluation
    just before started its next path 1-2 s late across hosts. While another island runs a merge,
    an idle island takes no evaluation; it takes a round's commit (the run's end waits for those:
    withheld too, they piled up there). Once no merge runs, it evaluates."""
    config = tiny_config(run_root, "model.grid=[2]", "model.blocks_per_level=[1]")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 2)

    for job in ("p0", "p1"):
        _published(root, 0, job)
    for key in (ModuleKey(0, 0), ModuleKey(0, 1)):
        _merged(root, 0, key)
    _published(root, 1, "p0")
    merging = TaskQueue(root, config).claim(Task.of("merge", 1, "l0m0"), "island-a")
    training = TaskQueue(root, config).claim(Task.of("train", 1, "p1"), "island-c")
    queue = TaskQueue(root, config)
    assert {"commit.r0", "eval.r1.p0"} <= {task.name for task in queue.ready(2)}
    commit = queue.next_claim("island-b", 2)
    assert commit is not None and commit.task.name == "commit.r0"
    assert queue.next_claim("island-d", 2) is None  # the evaluations wait while island-a merges

    _merged(root, 1, ModuleKey(0, 0))
    merging.finish("done")
    lease = queue.next_claim("island-d", 2)
    assert lease is not None and lease.task.kind == "eval"
    for held in (lease, training, commit):
        held.finish("released")


def test_an_island_keeping_an_inner_state_takes_no_evaluation_and_commits_the_round_once_it_is_kept(run_root):
    """The plan's last round commits once every path's inner state is kept. Across hosts the island
    keeping the last one took an evaluation while its state went up, ran it, and claimed the commit
    1.7 s after the state was in. While this process keeps a state it takes no evaluation; the
    state kept, its next look takes the commit (another process, keeping nothing, evaluates)."""
    config = tiny_config(run_root, "model.grid=[2]", "model.blocks_per_level=[1]")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 1)
    _published(root, 0, "p0")
    _published(root, 0, "p1", kept=False)  # its state still going up
    for key in (ModuleKey(0, 0), ModuleKey(0, 1)):
        _merged(root, 0, key)
    queue = TaskQueue(root, config)
    keeping = queue.claim(Task.of("train", 0, "p1"), "island-a")  # held and beating while p1's state goes up
    queue.keeping_here[(0, "p1")] = "p1's inner state of round 0"
    ready = {task.name for task in queue.ready(1)}
    assert "eval.r1.p0" in ready and "commit.r0" not in ready
    assert queue.next_claim("island-a", 1) is None  # the evaluations wait for the state

    other = TaskQueue(root, config).next_claim("island-b", 1)  # an island keeping nothing evaluates
    assert other is not None and other.task.kind == "eval"

    _kept(root, 0, "p1")
    del queue.keeping_here[(0, "p1")]
    keeping.finish("done")
    commit = queue.next_claim("island-a", 1)
    assert commit is not None and commit.task.name == "commit.r0"
    for held in (commit, other):
        held.finish("released")

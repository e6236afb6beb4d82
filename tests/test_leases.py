"""Leases under faults: a paused holder that lost its lease cannot publish, clock skew expires
nothing live, heartbeats survive a flaky store, malformed lease records count as failed attempts,
island identities are per process, and a straggler's task is finished by a backup attempt."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, start_island, tiny_config, wait_for, write_synthetic_shards
from pipeline import stages
from pipeline.island_rank import reshard
from pipeline.islands.island import Island
from pipeline.islands.task_queue import CLOCK_OFFSET_ENV, Task, TaskQueue, write_plan
from pipeline.run import Run
from pipeline.state import layout, storage
from pipeline.state.storage import RunRoot
from pipeline.train.train_path import train_path

pytestmark = pytest.mark.usefixtures("no_collector_pauses")  # lease timing: conftest says why

ONE_PATH = ("model.grid=[1]", "model.blocks_per_level=[1]", "train.rounds=1")


def unpublished_staging(root: RunRoot, round_index: int, path_id: str) -> list[str]:
    """What is left in a path's staging place besides what its `_SUCCESS` names (on an object store
    the published attempt stays there and holds the path's files; a local root renamed it away)."""
    kept = root.marker(layout.path_dir(round_index, path_id)).get(storage.FILES_AT)
    base = layout.staging_dir(round_index, path_id)
    return [name for name in root.listdir(base) if f"{base}/{name}" != kept]


def test_a_holder_that_lost_its_lease_cannot_publish_and_the_output_stays_readable(any_root):
    """The issue's wedge: two attempts of one train task both finish. The one whose lease expired
    publishes nothing; the round's path directory is exactly the other's, and it verifies."""
    config = tiny_config(any_root, *ONE_PATH, "train.inner_steps=2", "train.lease_seconds=0.3")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    a, b = TaskQueue(root, config), TaskQueue(root, config)
    task = Task.of("train", 0, "p0")
    zombie = a.claim(task, "paused")
    zombie._stop.set()  # paused: no more beats (a GC pause, SIGSTOP, a VM migration)
    zombie._thread.join()
    successor = wait_for(lambda: b.claim(task, "successor"), 3.0, "the paused holder's lease to expire")
    fresh = train_path(config, 0, "p0", attempt="attempt-2", may_publish=successor.held)
    late = train_path(config, 0, "p0", attempt="attempt-1", may_publish=zombie.held)  # it wakes up and finishes
    assert fresh["published"] and not late["published"]
    rel = layout.path_dir(0, "p0")
    root.verify(rel)
    assert root.read_committed_json(rel, "metrics.json")["started_at"] == fresh["started_at"]
    assert unpublished_staging(root, 0, "p0") == []  # the late attempt's output is gone
    # the inner state kept is the publisher's; the late attempt's, written before it lost, is gone
    assert root.read_json(layout.inner_state_kept(0, "p0"))["attempt"] == "attempt-2"
    assert root.listdir(layout.inner_state_dir(0, "p0")) == ["attempt-2", "kept.json"]
    assert b.claim(task, "another") is None  # committed output: never run again, whatever the leases say
    successor.finish("done")


@pytest.mark.slow  # ~20 s: a real island process, stopped and resumed
def test_a_sigstopped_holder_resumed_after_expiry_cannot_publish_and_the_run_finishes(any_root):
    config = tiny_config(any_root, *ONE_PATH, "train.inner_steps=300", "train.lease_seconds=1.0")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 1)
    queue, task = TaskQueue(root, config), Task.of("train", 0, "p0")
    zombie = start_island(any_root, "zombie")
    try:
        wait_for(lambda: queue.attempts(task), 120, "the island to claim the train task")
        time.sleep(1.0)
        os.killpg(zombie.pid, signal.SIGSTOP)
        Island(config, "successor", reshard=reshard).run()  # waits out the lease, trains, merges, evaluates
        assert root.is_committed(layout.round_dir(0)) and root.exists(layout.eval_file(1))
        published = root.read_committed_json(layout.path_dir(0, "p0"), "metrics.json")
        os.killpg(zombie.pid, signal.SIGCONT)
        output, _ = zombie.communicate(timeout=60)
    finally:
        if zombie.poll() is None:
            os.killpg(zombie.pid, signal.SIGKILL)
    assert zombie.returncode == 0, output[-3000:]
    records = [a.record for a in queue.attempts(task)]
    assert [r["island"] for r in records] == ["zombie", "successor"]
    assert records[0]["state"] == "running" and records[1]["state"] == "done"  # the zombie wrote no outcome
    assert root.read_committed_json(layout.path_dir(0, "p0"), "metrics.json") == published  # untouched
    root.verify(layout.path_dir(0, "p0"))
    assert root.read_json(f"{layout.round_dir(0)}/merge.json")["paths_left_out"] == []
    # it stops by whichever sees it first: its heartbeat (a later attempt exists) or its inner loop
    # (the path got published meanwhile); either way it says why and publishes nothing
    assert "lost the lease" in output or "the lease was lost" in output, output[-3000:]


@pytest.mark.parametrize("holder, reader", [(-120, 120), (120, -120)])
def test_clock_skew_of_two_minutes_expires_no_live_holder_and_still_expires_a_dead_one(
    run_root, monkeypatch, holder, reader
):
    config = tiny_config(run_root, "train.lease_seconds=0.3")
    root = stages.init_run(Run(config))
    task = Task.of("train", 0, "p0-0")
    monkeypatch.setenv(CLOCK_OFFSET_ENV, str(holder))
    lease = TaskQueue(root, config).claim(task, "holder")
    monkeypatch.setenv(CLOCK_OFFSET_ENV, str(reader))
    other = TaskQueue(root, config)
    deadline = time.monotonic() + 1.2  # four leases
    while time.monotonic() < deadline:
        assert other.claim(task, "skewed") is None, "a live holder was expired"
        time.sleep(0.05)
    assert not lease.lost.is_set()
    lease._stop.set()  # now it dies: the skewed reader still expires it, after one lease of its own clock
    lease._thread.join()
    taken = wait_for(lambda: other.claim(task, "skewed"), 2.0, "the dead holder's lease to expire")
    assert taken.number == 2
    taken.finish("released")


def test_a_heartbeat_survives_three_storage_errors(any_root, caplog):
    # 1 s: the three retries take 0.07 s. With 0.4 s the S3 case failed on a loaded 2-core machine: a
    # lease that short measures moto's round trips, not the retries (it passed there on a local root)
    config = tiny_config(any_root, "train.lease_seconds=1.0")
    root = stages.init_run(Run(config))
    task = Task.of("train", 0, "p0-0")
    lease = TaskQueue(root, config).claim(task, "holder")
    other = TaskQueue(root, config)
    storage.inject_write_errors(3, lease.rel)
    try:
        with caplog.at_level(logging.WARNING, logger="dipaco.queue"):
            deadline = time.monotonic() + 4.0  # four leases
            while time.monotonic() < deadline:
                assert other.claim(task, "other") is None, "the holder's lease expired"
                time.sleep(0.05)
    finally:
        storage.inject_write_errors(0)
    assert not lease.lost.is_set() and lease.record["beats"] >= 4
    assert caplog.text.count("heartbeat of train.r0.p0-0 failed") == 3
    lease.finish("done")
    assert other.attempts(task)[0].record["state"] == "done"


def test_a_heartbeat_gives_the_lease_up_after_lease_seconds_without_a_write(run_root):
    config = tiny_config(run_root, "train.lease_seconds=0.3")
    root = stages.init_run(Run(config))
    lease = TaskQueue(root, config).claim(Task.of("train", 0, "p0-0"), "holder")
    storage.inject_write_errors(1000, lease.rel)
    try:
        assert lease.lost.wait(2.0) and not lease.held()
    finally:
        storage.inject_write_errors(0)


@pytest.mark.parametrize(
    "content",
    [
        '{"state": "running", "heartbeat": "soon", "claimed_at": 1}',
        '{"state": "running", "heartbeat": NaN, "claimed_at": 1}',
        '{"state": "running", "heartb',
    ],
)
def test_a_malformed_lease_record_counts_as_a_failed_attempt_with_one_warning(run_root, caplog, content):
    config = tiny_config(run_root, "train.lease_seconds=60", "train.max_attempts=2")
    root = stages.init_run(Run(config))
    task = Task.of("train", 0, "p0-0")
    rel = f"queue/leases/{task.name}/attempt-1.json"
    (run_root / rel).parent.mkdir(parents=True)
    (run_root / rel).write_text(content)
    queue = TaskQueue(root, config)
    with caplog.at_level(logging.WARNING, logger="dipaco.queue"):
        assert queue.attempts(task)[0].counts_as_failed and not queue.given_up(task)
        lease = queue.claim(task, "island")  # no waiting out a lease that can never expire
        assert lease is not None and lease.number == 2
    warnings = [r.getMessage() for r in caplog.records if "malformed lease record" in r.getMessage()]
    assert len(warnings) == 1 and str(run_root / rel) in warnings[0] and "\n" not in warnings[0]
    lease.finish("failed")
    assert queue.given_up(task)  # the malformed one counts toward max_attempts


def test_failing_an_islands_leases_never_touches_another_process_of_the_same_name(run_root):
    config = tiny_config(run_root)
    root = stages.init_run(Run(config))
    queue = TaskQueue(root, config)
    dag = queue.claim(Task.of("train", 0, "p0-0"), "island-0", "island-0-dag")
    cli = queue.claim(Task.of("train", 0, "p0-1"), "island-0", "island-0-cli")
    queue.fail_running("island-0-cli", "exited")
    assert [a.state for a in queue.attempts(dag.task)] == ["running"] and dag.held()
    assert [a.state for a in queue.attempts(cli.task)] == ["failed"] and not cli.held()
    dag.finish("released")
    assert Island(config, "island-0", reshard=reshard).id != Island(config, "island-0", reshard=reshard).id


def test_a_stragglers_task_is_completed_by_a_backup_attempt(any_root):
    config = tiny_config(
        any_root,
        "model.grid=[2]",
        "model.blocks_per_level=[1]",
        "train.rounds=1",
        "train.inner_steps=3",
        "train.lease_seconds=0.4",
        "train.backup_after=1.5",
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 1)
    queue = TaskQueue(root, config)
    straggler = queue.claim(Task.of("train", 0, "p1"), "straggler")  # beats on, never finishes
    Island(config, "idle", reshard=reshard).run()  # trains p0, then backs p1 up once it ran 1.5x p0's time
    attempts = queue.attempts(straggler.task)
    assert [a.number for a in attempts] == [1, 2] and attempts[1].backup and attempts[1].state == "done"
    assert root.read_json(f"{layout.round_dir(0)}/merge.json")["paths_left_out"] == []
    median = queue.median_task_seconds(0)
    assert (
        attempts[1].record["claimed_at"] - attempts[0].record["claimed_at"]
        > 1.5 * queue.attempts(Task.of("train", 0, "p0"))[0].record["seconds"] * 0.9
        and median > 0
    )
    assert straggler.cancelled.wait(1.0)  # its next heartbeat saw the committed output
    straggler.finish("cancelled")
    assert not queue.given_up(straggler.task)
    # the trainer heartbeats its steps into the lease (what the progress rule below reads)
    assert queue.attempts(Task.of("train", 0, "p0"))[0].record["step"] == 3


def test_a_backup_starts_as_soon_as_a_holders_reported_steps_show_it_is_a_straggler(run_root):
    """LATE's rule: no waiting out backup_after x the median when the heartbeated steps already
    project a late finish, no backup of a holder whose steps keep its peers' pace, and one backup
    of a round at a time (LATE's speculative cap)."""
    config = tiny_config(
        run_root,
        "model.grid=[3]",
        "model.blocks_per_level=[1]",
        "train.inner_steps=100",
        "train.lease_seconds=0.4",
        "train.backup_after=1.5",
        "train.checkpoint_every=25",
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 1)
    queue = TaskQueue(root, config)
    peer = queue.claim(Task.of("train", 0, "p0"), "peer")
    peer.finish("done", seconds=10.0, inner_seconds=9.0)  # the round's median: 10 s, 0.09 s a step
    holder, other = (queue.claim(Task.of("train", 0, p), "holder") for p in ("p1", "p2"))

    def reported(lease, step: int, inner_s: float) -> None:
        lease.report_step(step, 0, inner_s)
        wait_for(lambda: queue.attempts(lease.task)[0].record.get("step") == step, 5, "a heartbeat")

    reported(holder, 5, 0.5)  # a twentieth of the steps: too few to tell a rate from the first steps' warm-up
    assert queue.claim_backup(holder.task, "idle") is None
    reported(holder, 50, 4.5)  # its peers' pace: finishes in ~4.5 s
    assert queue.next_claim("idle", 1) is None
    reported(holder, 60, 24.0)  # now 1.95 s a step: 78 s more; a backup from step 50: 1 + 50 x 0.09 = 5.5 s
    reported(other, 60, 24.0)
    backup = queue.next_claim("idle", 1)
    assert backup is not None and backup.task == holder.task and backup.record["backup"] and backup.number == 2
    assert queue.attempts(holder.task)[0].running_for < 1.5 * 10.0  # sooner than the elapsed-time rule
    assert queue.next_claim("idle-2", 1) is None  # p2 straggles too, but one backup of the round runs
    backup.finish("cancelled")
    second = queue.next_claim("idle-2", 1)
    assert second is not None and second.record["backup"]
    for lease in (second, holder, other):
        lease.finish("released")


@pytest.mark.slow  # ~15 s: a real trainer process killed mid-task, and two in-process runs
def test_an_attempt_killed_mid_task_resumes_from_its_checkpoint_with_the_identical_loss_curve(any_root):
    from pipeline.train.distributed import child_env
    from pipeline.train.midtask import checkpoints_dir

    sets = (*ONE_PATH, "train.inner_steps=120", "train.checkpoint_every=30")
    whole = tiny_config(f"{any_root}/whole", *sets)
    write_synthetic_shards(stages.init_run(Run(whole)), whole.model.grid)
    expected = train_path(whole, 0, "p0")
    assert expected["resumed_from_step"] == 0

    config = tiny_config(f"{any_root}/crashed", *sets)
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.train.train_path",
            "--run-root",
            f"{any_root}/crashed",
            "--round",
            "0",
            "--path",
            "p0",
        ],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: root.glob(f"{checkpoints_dir(0, 'p0')}/*/step=*/_SUCCESS"), 120, "a mid-task checkpoint")
    finally:
        trainer.kill()  # SIGKILL: the attempt dies between two checkpoints
        trainer.wait()
    assert not root.is_committed(layout.path_dir(0, "p0"))
    resumed = train_path(config, 0, "p0")  # a new attempt
    assert resumed["resumed_from_step"] in (30, 60, 90)
    assert resumed["loss"] == expected["loss"] and resumed["lr"] == expected["lr"]  # bitwise, every step
    rel = layout.path_dir(0, "p0")
    assert root.read_committed(rel, "model.safetensors") == RunRoot(whole.run_root).read_committed(
        rel, "model.safetensors"
    )
    assert unpublished_staging(root, 0, "p0") == []  # published: the checkpoints are gone


@pytest.mark.parametrize(
    "setting, key",
    [
        ("train.backup_after=0.5", "train.backup_after"),
        ("train.checkpoint_every=0", "train.checkpoint_every"),
        ("train.backup_after=soon", "train.backup_after"),
    ],
)
def test_bad_backup_and_checkpoint_settings_are_refused_naming_the_key(run_root, setting, key):
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"tiny.yaml.*{key}") as error:
        tiny_config(run_root, setting)
    assert "\n" not in str(error.value)


def test_publishing_survives_a_backup_attempt_still_writing_its_checkpoint_beside_it(run_root):
    """The winner cleans the path's staging place while the other attempt keeps writing its own
    checkpoint files there; the publish must stand and the island must not crash (it did in the
    chaos benchmark's fault-free run: "Directory not empty")."""
    import threading

    from pipeline.train.train_path import publish_path

    root = RunRoot(run_root)
    mine, other = layout.staging_dir(0, "p0", "attempt-1"), layout.staging_dir(0, "p0", "attempt-2")
    root.write_json(f"{mine}/metrics.json", {"loss": [1.0]})
    root.commit(mine)
    writing, stop = root.local_path(f"{other}/checkpoints"), threading.Event()

    def backup_writes() -> None:  # a live attempt writes file after file, as a DeepSpeed checkpoint does
        n = 0
        while not stop.is_set():
            writing.mkdir(parents=True, exist_ok=True)
            (writing / f"shard-{n}").write_bytes(b"x")
            n += 1

    writer = threading.Thread(target=backup_writes)
    writer.start()
    try:
        time.sleep(0.05)
        assert publish_path(root, 0, "p0", mine) is True
    finally:
        stop.set()
        writer.join()
    assert root.read_committed_json(layout.path_dir(0, "p0"), "metrics.json") == {"loss": [1.0]}


def test_a_readers_stalls_are_the_time_its_own_requests_hung_past_a_tenth_of_a_lease_counted_once():
    from pipeline.core.stalls import Stalls

    stalls = Stalls(slow_s=0.05)
    assert stalls.timed(lambda: 7) == 7 and stalls.within(0, 1e12) == 0.0  # a prompt answer: no stall
    began = time.monotonic()
    stalls.timed(lambda: time.sleep(0.3))
    hung = stalls.within(began, time.monotonic())
    assert 0.2 <= hung <= 0.3  # its time past slow_s
    stalls._spans.extend([(10.0, 14.0), (12.0, 16.0), (20.0, 21.0)])  # overlapping: counted once
    assert stalls.within(11.0, 20.5) == pytest.approx(5.0 + 0.5)
    assert stalls.within(0.0, 9.0) == 0.0

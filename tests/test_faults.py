"""Faults that really happen on preemptible workers: processes killed with SIGKILL, two
orchestrators on one root, corrupted files, a full disk. dipaco must lose nothing."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_cli_args, tiny_config, write_synthetic_shards
from models.grid import ModuleKey
from pipeline import stages
from pipeline.core.errors import CorruptStateError, StorageError
from pipeline.outer.merge import merge_round
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.module_store import load_modules
from pipeline.state.storage import RunRoot
from pipeline.train.distributed import child_env
from pipeline.train.train_path import inner_state_of, train_path


def cli(args: list[str], run_root: Path, *sets: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`dipaco` in a fresh process (so SIGKILL hits a real process, not the test)."""
    command = [sys.executable, "-m", "pipeline.cli", *args, *tiny_cli_args(run_root, *sets)]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=child_env(env), **kwargs)


def rank_pids(path_id: str) -> list[int]:
    """PIDs of the DeepSpeed ranks training a path (`python -u -m pipeline.train.train_path ... --path ID`)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if (
            b"pipeline.train.train_path" in argv
            and b"-m" in argv
            and path_id.encode() in argv
            and b"--module" not in argv
        ):
            pids.append(int(proc.name))
    return pids


class KillAtStep(logging.Handler):
    """Kill -9 a path's ranks when its progress line for a chosen step shows up, on chosen attempts."""

    def __init__(self, path_id: str, kills: int):
        super().__init__()
        self.path_id, self.kills_left, self.killed_at = path_id, kills, []
        self.step = random.randint(1, 30)  # dies at the first progress line from this step on (of 60)

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if self.kills_left and f"[{self.path_id}]" in line and " step " in line:
            step = int(line.split(" step ")[1].split("/")[0])
            if step >= self.step:
                for pid in rank_pids(self.path_id):
                    os.kill(pid, signal.SIGKILL)
                self.kills_left -= 1
                self.killed_at.append(step)


@pytest.mark.slow
def test_a_path_killed_mid_round_is_retried_or_left_out_and_trained_again_next_round(run_root, caplog):
    launched = tiny_config(
        run_root,
        "model.grid=[2]",
        "model.blocks_per_level=[1]",
        "train.launcher=deepspeed",
        "train.inner_steps=60",
        "train.max_attempts=2",
        "train.rounds=3",
    )
    inprocess = tiny_config(
        run_root, "model.grid=[2]", "model.blocks_per_level=[1]", "train.inner_steps=60", "train.rounds=3"
    )
    root = stages.init_run(Run(launched))
    write_synthetic_shards(root, [2])
    logger = logging.getLogger("dipaco.launch")
    logger.setLevel(logging.INFO)

    # Round 0: the first attempt dies by SIGKILL, the retry succeeds, the round commits with p0.
    train_path(inprocess, 0, "p1")
    killer = KillAtStep("p0", kills=1)
    logger.addHandler(killer)
    try:
        metrics = stages.train_path(Run(launched), 0, "p0")
    finally:
        logger.removeHandler(killer)
    assert killer.killed_at, "the trainer was never killed"
    assert metrics is not None and len(metrics["loss"]) == 60
    failed = root.read_json(f"{layout.attempts_dir(0, 'p0')}/attempt-1.json")
    assert failed["returncode"] != 0
    assert merge_round(launched, 0)["paths_merged"] == ["p0", "p1"]

    # Round 1: the only attempt allowed dies; the round commits without p0 and the merge names it.
    train_path(inprocess, 1, "p1")
    killer = KillAtStep("p0", kills=1)
    logger.addHandler(killer)
    try:
        assert stages.train_path(Run(replace(launched, train=replace(launched.train, max_attempts=1))), 1, "p0") is None
    finally:
        logger.removeHandler(killer)
    assert not root.is_committed(layout.path_dir(1, "p0"))  # whatever it wrote is never read
    report = merge_round(launched, 1)
    assert report["paths_left_out"] == ["p0"] and report["modules_untouched"] == ["level=0/module=0"]
    kept = ModuleKey(0, 0)
    before, after = load_modules(root, 1, [kept])[kept], load_modules(root, 2, [kept])[kept]
    assert all(torch.equal(before[name], after[name]) for name in before)

    # Round 2: p0 trains again from the last committed modules, with its newest inner state.
    again = train_path(inprocess, 2, "p0")
    assert again["resumed_inner_state_from"] == 0


# run.yaml; each of 3 modules merged on its own (module, buffer, marker); gathered into round 1
# (3 modules and 3 buffers linked, 2 markers); merge.json and the round's marker.
MERGE_WRITES = 20


@pytest.mark.slow
@pytest.mark.parametrize(
    "compression,points", [("none", (2, 5, 10, 13, 18, MERGE_WRITES)), ("int4", (4, 12, MERGE_WRITES))]
)
def test_merge_killed_at_several_points_reruns_to_bitwise_identical_files(tmp_path, compression, points):
    """kill -9 of `dipaco merge` before its Nth write; the rerun writes the reference's bytes, also
    when the merge reads compressed outer gradients (outer.compression)."""
    sets = ["model.grid=[2, 1]", f"outer.compression={compression}"]
    base = tmp_path / "base"
    config = tiny_config(base, *sets, "train.inner_steps=2", "train.lr=0.01")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    for path_id in stages.list_paths(config):
        train_path(config, 0, path_id)
    reference = tmp_path / "reference"
    shutil.copytree(base, reference)
    merge_round(tiny_config(reference, *sets), 0)
    expected = {name: (reference / name).read_bytes() for name in _merge_outputs(reference)}

    for point in points:
        crashed = tmp_path / f"crash{point}"
        shutil.copytree(base, crashed)
        result = cli(["merge", "--round", "0"], crashed, *sets, env={"DIPACO_FAULT_KILL_BEFORE_WRITE": str(point)})
        assert result.returncode == -signal.SIGKILL, result.stderr[-500:]
        assert not RunRoot(str(crashed)).is_committed(layout.round_dir(0))
        merge_round(tiny_config(crashed, *sets), 0)  # the rerun
        assert _merge_outputs(crashed) == sorted(expected)
        for name, data in expected.items():
            assert (crashed / name).read_bytes() == data, f"{name} differs after a crash before write {point}"


def _merge_outputs(run: Path) -> list[str]:
    """Module and momentum files of round 1 (merge.json holds timings, so it is compared by key)."""
    return sorted(str(p.relative_to(run)) for p in (run / "rounds" / "round=1").rglob("*.safetensors"))


def test_a_second_run_is_refused_and_a_killed_holder_leaves_no_stale_lock(run_root):
    config = tiny_config(run_root)
    stages.init_run(Run(config))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pipeline.state.lock import run_lock; "
                "from pipeline.state.storage import RunRoot\n"
                f"with run_lock(RunRoot({str(run_root)!r})):\n    print('held', flush=True); time.sleep(120)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        second = cli(["run"], run_root)
        assert second.returncode == 2
        assert "another dipaco run holds this run root" in second.stderr and "Traceback" not in second.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    from pipeline.state.lock import run_lock

    with run_lock(RunRoot(str(run_root))):  # the kernel released the dead holder's lock
        pass


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip":
        path.write_bytes(data[:-9] + bytes([data[-9] ^ 0xFF]) + data[-8:])
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # a valid safetensors file, just not the one that was committed
        path.write_bytes((path.parent / "module=1.safetensors").read_bytes())


@pytest.mark.parametrize("how", ["flip", "truncate", "swap"])
def test_a_corrupted_module_file_is_refused_by_name_never_loaded(how, run_root):
    config = tiny_config(run_root, "model.grid=[2, 1]")
    root = stages.init_run(Run(config))
    target = run_root / layout.modules_dir(0) / "level=0" / "module=0.safetensors"
    _corrupt(target, how)
    with pytest.raises(CorruptStateError, match="level=0/module=0.safetensors"):
        load_modules(root, 0, [ModuleKey(0, 0)])
    write_synthetic_shards(root, config.model.grid)
    result = cli(
        ["train-path", "--round", "0", "--path", "p0-0"], run_root, "model.grid=[2, 1]", "train.max_attempts=2"
    )
    assert result.returncode == 2  # the trainer refused the file: an input error, not retried
    assert "module=0.safetensors" in result.stderr and "Traceback" not in result.stderr
    assert root.listdir(layout.attempts_dir(0, "p0-0")) == ["attempt-1.json"]
    failure = root.read_json(f"{layout.attempts_dir(0, 'p0-0')}/attempt-1.json")["output_tail"][-1]
    assert "module=0.safetensors" in failure and "checksum" in failure
    assert not root.is_committed(layout.path_dir(0, "p0-0"))


def test_a_corrupted_path_output_stops_the_merge_naming_the_file(run_root):
    config = tiny_config(run_root, "model.grid=[1]", "model.blocks_per_level=[1]")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    train_path(config, 0, "p0")
    _corrupt(run_root / layout.path_dir(0, "p0") / "model.safetensors", "flip")
    result = cli(["merge", "--round", "0"], run_root, "model.grid=[1]", "model.blocks_per_level=[1]")
    assert result.returncode == 2
    assert "path=p0/model.safetensors" in result.stderr and "Traceback" not in result.stderr
    assert not root.is_committed(layout.round_dir(0)) and not root.exists(layout.modules_dir(1))


def test_a_corrupted_inner_state_is_not_loaded_and_the_path_still_trains(any_root, caplog):
    config = tiny_config(any_root, "model.grid=[1]", "model.blocks_per_level=[1]")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    train_path(config, 0, "p0")
    merge_round(config, 0)
    inner = inner_state_of(root, 0, "p0")
    optim = "optimizer-rank-00000.safetensors"  # AdamW's step and moments, in safetensors (no pickle)
    assert root.files_under(inner) == [optim]
    data = root.read_bytes(f"{inner}/{optim}")  # one byte flipped behind its marker's back (local or S3)
    root.write_bytes(f"{inner}/{optim}", data[:-9] + bytes([data[-9] ^ 0xFF]) + data[-8:])
    with caplog.at_level(logging.WARNING):
        metrics = train_path(config, 1, "p0")
    assert metrics["resumed_inner_state_from"] is None
    assert optim in caplog.text and "checksum" in caplog.text

    # an inner state an older dipaco saved (a DeepSpeed checkpoint: its marker has no format) restarts too
    merge_round(config, 1)
    kept = inner_state_of(root, 1, "p0")
    marker = root.marker(kept)
    root.write_json(f"{kept}/_SUCCESS", {k: v for k, v in marker.items() if k != "format"})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert train_path(config, 2, "p0")["resumed_inner_state_from"] is None
    assert "an older dipaco's DeepSpeed checkpoint" in caplog.text
    root.write_json(f"{kept}/_SUCCESS", marker)

    # a record that points the kept inner state out of its place (whoever can write the run root)
    token = layout.inner_state_kept(1, "p0")
    root.write_json(token, {"round": 1, "path": "p0", "attempt": ".."})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert train_path(config, 2, "p0")["resumed_inner_state_from"] is None
    assert "refusing unsafe file name '..'" in caplog.text


def test_unsafe_names_in_a_commit_record_are_refused(run_root):
    config = tiny_config(run_root)
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    marker = root.read_json("shards/_SUCCESS")
    marker["files"]["path=p0-0/../../../../etc/passwd"] = {"sha256": "0", "bytes": 1}
    root.write_json("shards/_SUCCESS", marker)
    from pipeline.state.shards import read_path_documents

    with pytest.raises(CorruptStateError, match="unsafe file name"):
        read_path_documents(root, "p0-0")


def _small_filesystem(path: Path, size_kb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_disk_full_during_a_merge_is_a_clear_error_and_the_previous_round_stays_intact(tmp_path):
    mount = tmp_path / "small"
    if not _small_filesystem(mount, 4096):
        pytest.skip(
            "cannot mount a small tmpfs here (needs root); "
            "test_storage covers the write-error path with a kernel file-size limit"
        )
    try:
        config = tiny_config(mount / "run", "model.grid=[2, 1]", "train.inner_steps=1")
        root = stages.init_run(Run(config))
        write_synthetic_shards(root, config.model.grid)
        for path_id in stages.list_paths(config):
            train_path(config, 0, path_id)
        free = shutil.disk_usage(mount).free
        (mount / "filler").write_bytes(b"\0" * max(0, free - 60_000))  # leave less than one round needs
        with pytest.raises(StorageError, match="cannot write .*No space left on device.*previous state is intact"):
            merge_round(config, 0)
        root.verify(layout.modules_dir(0))  # round 0 is intact and still verifies
        assert not root.is_committed(layout.round_dir(0)) and not root.is_committed(layout.modules_dir(1))
        assert not list(mount.rglob("*.tmp-*"))  # no temporary left behind
        (mount / "filler").unlink()  # space freed: the rerun completes
        assert merge_round(config, 0)["paths_merged"] == ["p0-0", "p1-0"]
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)

"""Ctrl-C and SIGTERM on `dipaco run`: every process the run started stops (launchers and ranks),
the tasks they held are released, and the user is told so."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, tiny_cli_args, tiny_config, write_synthetic_shards
from pipeline import stages
from pipeline.islands import processes
from pipeline.islands.task_queue import Task, TaskQueue
from pipeline.run import Run
from pipeline.state.storage import RunRoot


def _processes_naming(text: str) -> list[str]:
    """Command lines of the living processes that mention `text` (an island's --run-root)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and processes.alive({int(entry.name)}):
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if text in line:
                    found.append(f"{entry.name}: {line}")
        except OSError:
            continue
    return found


def _start_and_interrupt(
    command: list[str], queue: TaskQueue, tasks: list[Task], run_root, signum: int, to_group: bool
) -> tuple[str, int, list[Task]]:
    """Start `dipaco run`, wait until both islands train, send `signum`; within 10 s nothing of
    the run may be left. Its output, exit status and the tasks the islands held."""
    run = subprocess.Popen(
        command, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )

    def held() -> list[Task]:
        return [t for t in tasks if (a := queue.attempts(t)) and a[-1].record.get("state") == "running"]

    deadline = time.monotonic() + 180
    while len(held()) < 2:  # both islands inside their inner loop
        assert run.poll() is None, run.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the islands never claimed a task"
        time.sleep(0.2)
    tree = processes.tree([run.pid], [])
    assert len(tree) >= 6, tree  # 2 x (deepspeed runner, deepspeed.launcher.launch, rank)
    holding = held()
    # Ctrl-C in a terminal signals the foreground process group; `kill` (or Airflow) one pid.
    os.killpg(run.pid, signum) if to_group else os.kill(run.pid, signum)
    signalled = time.monotonic()
    output, _ = run.communicate(timeout=30)
    while (processes.alive(tree) or _processes_naming(str(run_root))) and time.monotonic() - signalled < 10:
        time.sleep(0.1)
    assert not processes.alive(tree) and not _processes_naming(str(run_root)), _processes_naming(str(run_root))
    assert not held(), output[-3000:]
    return output, run.returncode, holding


@pytest.mark.slow  # ~40 s: two deepspeed islands start twice
def test_ctrl_c_then_sigterm_on_dipaco_run_stop_every_island_process_and_release_its_tasks(run_root):
    sets = ["train.launcher=deepspeed", "train.islands=2", "train.rounds=1", "train.inner_steps=100000"]
    config = tiny_config(run_root, *sets)
    write_synthetic_shards(stages.init_run(Run(config)), config.model.grid)
    command = [sys.executable, "-m", "pipeline.cli", "run", *tiny_cli_args(run_root, *sets)]
    queue = TaskQueue(RunRoot(config.run_root), config)
    tasks = [Task.of("train", 0, job) for job in stages.list_paths(config)]

    output, returncode, holding = _start_and_interrupt(command, queue, tasks, run_root, signal.SIGINT, to_group=True)
    assert returncode == 130, output[-3000:]
    assert "interrupted (SIGINT); every process it started has stopped" in output
    assert "released" in output and all(t.name in output for t in holding), output[-3000:]
    for task in holding:  # no attempt lost: the rerun takes these tasks at once
        assert queue.attempts(task)[-1].record["state"] == "released" and not queue.given_up(task)

    # Rerun at once (nothing of the first run is left to overlap it), then SIGTERM to its pid alone.
    output, returncode, holding = _start_and_interrupt(command, queue, tasks, run_root, signal.SIGTERM, to_group=False)
    assert returncode == 143, output[-3000:]
    assert "interrupted (SIGTERM); every process it started has stopped" in output
    assert all(queue.attempts(t)[-1].record["state"] == "released" for t in holding)


def test_a_resumed_runs_utilisation_is_within_0_05_of_an_uninterrupted_runs(tmp_path):
    """Utilisation counts the time islands ran (their lifetimes), not the pause before a resume."""
    warm = tiny_config(tmp_path / "warm", "train.rounds=1", "train.inner_steps=2")
    write_synthetic_shards(stages.init_run(Run(warm)), warm.model.grid)
    stages.run(Run(warm))  # this process's first engine and imports (about 1 s) would count for the first run only
    figures = {}
    for name, plan in (("straight", [2]), ("resumed", [1, 2])):
        for rounds in plan:
            # 150 steps a task: the resume's second island start (~0.3 s) is ~1.5 % of the islands' time
            config = tiny_config(tmp_path / name, f"train.rounds={rounds}", "train.inner_steps=150")
            if rounds == plan[0]:
                write_synthetic_shards(stages.init_run(Run(config)), config.model.grid)
            summary = stages.run(Run(config))
            if rounds != plan[-1]:
                time.sleep(4)  # the pause between the stopped run and its resume
        figures[name] = summary["utilisation"]
    straight, resumed = figures["straight"], figures["resumed"]
    assert straight["round"] == resumed["round"] == 1 and straight["islands"] == resumed["islands"] == 1
    assert abs(straight["utilisation"] - resumed["utilisation"]) <= 0.05, (straight, resumed)
    record = RunRoot(tmp_path / "resumed").read_json("queue/islands/island-0.json")
    assert len(record["lifetimes"]) == 1 and record["lifetimes"][0][1] <= record["started_at"]


def test_sigterm_to_an_airflow_island_task_unwinds_it_so_its_launch_is_stopped():
    """Airflow 3's task runner only calls on_kill on SIGTERM (then SIGKILLs the task later): inside
    supervisor.run_island SIGTERM must raise, so the island launch is stopped and its lease released."""
    script = (
        "import signal, time\n"
        "from pipeline.islands import supervisor\n"
        "calls = []\n"
        "signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))  # like Airflow's: on_kill, no raise\n"
        "try:\n"
        "    with supervisor.sigterm_raises():\n"
        "        print('ready', flush=True)\n"
        "        time.sleep(60)\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code, calls, signal.getsignal(signal.SIGTERM).__name__, flush=True)\n"
    )
    task = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert task.stdout.readline().strip() == "ready"
    task.send_signal(signal.SIGTERM)
    output, _ = task.communicate(timeout=30)
    assert output.strip() == "exit 143 [15] <lambda>"  # Airflow's handler ran, then restored

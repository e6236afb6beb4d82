"""Start trainers as `deepspeed` subprocesses, so torch.distributed never starts inside the
orchestrator (the CLI or an Airflow worker): islands (IslandProcess: one launch for the whole run,
pulling tasks) and one-shot path launches (train_path_job: `dipaco train-path`, one path for one
round, retried up to `train.max_attempts`, pipeline.islands.attempts; leftovers of a failed
attempt are removed before the next, so no partial file is read). A launch that exits with
status 2 hit a config or input error (pipeline.train.train_path.main, pipeline.island_rank.main):
another attempt would fail the same way, so it is not retried and its own message is raised to
the caller.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import yaml

from pipeline.core.bounds import shown
from pipeline.core.config import Config, load_config
from pipeline.core.errors import ConfigError, CorruptStateError, DipacoError, InputError
from pipeline.core.trust import RUN_ROOT_CODE_KEYS, RUN_ROOT_RE
from pipeline.islands import processes
from pipeline.islands.attempts import Attempts
from pipeline.islands.processes import STOP_GRACE_S
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.train.distributed import (
    child_env,
    free_port,
    rank_threads,
    set_runtime_env,
)  # each rank also sets its own threads

log = logging.getLogger("dipaco.launch")
_FORWARD = ("dipaco.", "Error", "error", "Traceback", "Killed")
INPUT_ERROR_EXIT = 2  # a trainer's exit status for a config or input error: retrying cannot help
_TRAINER_PREFIX = "dipaco train-path: "  # how a trainer rank reports such an error on stderr
_RANK_PREFIXES = (_TRAINER_PREFIX, "dipaco island: ")  # pipeline.train.distributed.run_rank, both entries


def launcher_command(
    run_root: str, round_index: int, path_id: str, train, port: int, own: list[str] | tuple[str, ...] = ()
) -> list[str]:
    """The `deepspeed` launcher command for one path's island: `procs_per_path` ranks on each of
    `num_nodes` nodes (the hosts of `hostfile`, or this machine). `own`: own_config_args."""
    return _deepspeed(
        train,
        port,
        "pipeline.train.train_path",
        ["--run-root", run_root, "--round", str(round_index), "--path", path_id, *own],
    )


def own_config_args(config: Config) -> list[str]:
    """`--config FILE` and a `--set` for each code-choosing key (trust.RUN_ROOT_CODE_KEYS) this run
    changed from that file: a launched rank takes its Beam runner and options, hostfile and
    ds_config from these, its own command line, never from the run root's run.yaml (which anyone
    who can write the run root could rewrite). None when the config is no file (a test's dict)."""
    source = Path(config.source)
    try:
        base = load_config(source) if source.is_file() else None
    except (DipacoError, OSError):  # the file changed since it was loaded: the rank checks run.yaml
        base = None
    if base is None:
        return []
    args = ["--config", str(source.resolve())]
    for key in RUN_ROOT_CODE_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value != getattr(getattr(base, section), name):
            plain = isinstance(value, str) and RUN_ROOT_RE.fullmatch(value) and yaml.safe_load(value) == value
            args += ["--set", f"{key}={value if plain else json.dumps(value)}"]
    return args


def _deepspeed(train, port: int, module: str, args: list[str]) -> list[str]:
    launcher = Path(sys.executable).with_name("deepspeed")
    hosts = ["--hostfile", train.hostfile] if train.hostfile else []
    if train.num_nodes > 1:
        args = shell_args(args)
    return [
        str(launcher),
        *hosts,
        "--num_nodes",
        str(train.num_nodes),
        "--num_gpus",
        str(train.procs_per_path),
        "--master_port",
        str(port),
        "--no_local_rank",
        "--module",
        module,
        *args,
    ]


def shell_args(args: list[str]) -> list[str]:
    """The module's arguments as words of a remote shell line. DeepSpeed's multi-node runner (pdsh)
    joins them into one line that each node's shell runs, quoting none (it wraps an argument with a
    space in double quotes, inside which `$(...)` still runs). So each value is checked against the
    run root's character set (trust.RUN_ROOT_RE: no whitespace, quote or shell syntax; refused
    otherwise) and shlex-quoted, which leaves the shell nothing to interpret."""
    for value in args:
        if not RUN_ROOT_RE.fullmatch(value):
            raise ConfigError(
                f"train.num_nodes > 1: {shown(value)} would reach the nodes' shell; a multi-node "
                f"launch takes only letters, digits and _ . / : + = @ , ~ - in its arguments"
            )
    return [shlex.quote(value) for value in args]


def island_names(train, host: str | None = None) -> list[str]:
    """The islands a run starts on this machine: `train.islands` (default `train.parallel_paths`);
    on `host` (a Celery queue of airflow.queues), named after it: island names are the run's own."""
    prefix = f"{host}-" if host else ""
    return [f"{prefix}island-{i}" for i in range(train.islands or train.parallel_paths)]


def island_command(
    run_root: str,
    island: str,
    train,
    port: int,
    ds_config: str | None = None,
    island_id: str | None = None,
    own: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The `deepspeed` launcher command of one island: it lives for the whole run and pulls tasks
    (pipeline.island_rank); the same ranks and hosts as a one-shot path launch."""
    return _deepspeed(
        train,
        port,
        "pipeline.island_rank",
        [
            "--run-root",
            run_root,
            "--island",
            island,
            *(["--island-id", island_id] if island_id else []),
            *(["--ds-config", ds_config] if ds_config else []),
            *own,
        ],
    )


class Launch:
    """A running `deepspeed` launch in its own session, its output forwarded under `name`, a tail
    kept for failure reports."""

    def __init__(self, command: list[str], name: str, threads: int):
        set_runtime_env()
        env = child_env({"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"})
        log.info("launch %s: %s", name, " ".join(command))
        self.name, self.tail = name, []
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.reader = threading.Thread(target=_forward_output, args=(self.process, name, self.tail), daemon=True)
        self.reader.start()

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        returncode = self.process.wait(timeout)
        self.reader.join()
        return returncode

    def stop(self, grace_s: float = STOP_GRACE_S) -> dict:
        """Stop the launch and every process it started (pipeline.islands.processes.stop)."""
        return stop_launches([self], grace_s)


def stop_launches(launches: list[Launch], grace_s: float = STOP_GRACE_S) -> dict:
    """SIGTERM to every launch's process group and descendants at once (an island's rank 0
    releases its task and leaves), wait up to `grace_s` for all of them, then SIGKILL; returns
    when none of their processes runs any more, so a rerun never overlaps them."""
    running = [launch for launch in launches if launch.process.poll() is None]
    pids = processes.tree([launch.process.pid for launch in running], [launch.process.pid for launch in running])
    outcome = processes.stop(pids, {launch.process.pid for launch in running}, grace_s)
    for launch in launches:
        try:
            launch.process.wait(5.0)  # reap the runner (a zombie by now)
        except subprocess.TimeoutExpired:
            launch.process.kill()
            launch.process.wait()
        launch.reader.join(5.0)
    return outcome


def _run_root_url(config: Config) -> str:
    root = RunRoot(config.run_root)
    return root.path() if root.is_local else root.url  # absolute: ranks may start elsewhere


class IslandProcess(Launch):
    """A running island (pipeline.islands.island) of this config's ranks and hosts."""

    def __init__(self, config: Config, name: str, ds_config: str | None = None):
        # This launch's own identity (what fail_running matches), fresh for every start of `name`.
        self.island_id = f"{name}-{uuid.uuid4().hex[:8]}"
        command = island_command(
            _run_root_url(config), name, config.train, free_port(), ds_config, self.island_id, own_config_args(config)
        )
        super().__init__(command, name, rank_threads(config.train, islands=True))


def train_path_job(config: Config, round_index: int, path_id: str) -> dict | None:
    """Train one path with retries; its metrics once committed, None if every attempt failed.

    Raises InputError, after one attempt, when the trainer refused its config or input."""
    root = RunRoot(config.run_root)
    rel = layout.path_dir(round_index, path_id)
    allowed, attempt = Attempts.of_tasks(config.train), 0
    while not root.is_committed(rel):
        attempt += 1
        root.remove(rel)  # an earlier attempt's partial output is never read, only replaced
        started = time.perf_counter()
        returncode, tail = _run_attempt(config, round_index, path_id)
        if returncode == 0 and root.is_committed(rel):
            break
        root.write_json(
            f"{layout.attempts_dir(round_index, path_id)}/attempt-{attempt}.json",
            {
                "returncode": returncode,
                "seconds": time.perf_counter() - started,
                "output_tail": tail,
            },
        )
        if returncode == INPUT_ERROR_EXIT:
            raise InputError(f"path {path_id} round {round_index}: {trainer_message(tail)}")
        log.warning(
            "path %s round %d attempt %d/%d failed (exit %s)%s",
            path_id,
            round_index,
            attempt,
            allowed.limit,
            returncode,
            (": " + tail[-1]) if tail else "",
        )
        if not allowed.may_try_again(attempt):
            return read_metrics(root, rel) if root.is_committed(rel) else None
    return read_metrics(root, rel)


def read_metrics(root: RunRoot, rel: str) -> dict:
    """A committed path's metrics.json, with the fields the CLI, the DAG and tracking index into."""
    metrics = root.read_committed_json(rel, "metrics.json")
    where = root.path(rel, "metrics.json")

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    loss = metrics.get("loss")
    checks = {
        "loss": isinstance(loss, list) and bool(loss) and all(number(x) for x in loss),
        "tokens": type(metrics.get("tokens")) is int,
        "tokens_per_s": number(metrics.get("tokens_per_s")),
        "seconds": number(metrics.get("seconds")),
        "round": type(metrics.get("round")) is int,
        "path": isinstance(metrics.get("path"), str),
    }
    bad = next((key for key, ok in checks.items() if not ok), None)
    if bad is not None:
        raise CorruptStateError(f"{where}: {bad} is missing or of the wrong type ({shown(metrics.get(bad))})")
    return metrics


def _run_attempt(config: Config, round_index: int, path_id: str) -> tuple[int, list[str]]:
    if config.train.launcher == "inprocess":
        from pipeline.train.train_path import train_path

        try:
            train_path(config, round_index, path_id)
            return 0, []
        except DipacoError as exc:  # what main() turns into exit status 2 in a launched rank
            return INPUT_ERROR_EXIT, [f"{_TRAINER_PREFIX}{exc}"]
        except Exception as exc:  # an in-process attempt fails like a launch would: recorded, retried
            log.exception("path %s failed in process", path_id)
            return 1, [f"{type(exc).__name__}: {exc}"]
    command = launcher_command(
        _run_root_url(config), round_index, path_id, config.train, free_port(), own_config_args(config)
    )
    launch = Launch(command, path_id, rank_threads(config.train))
    return launch.wait(), launch.tail[-20:]


def trainer_message(tail: list[str]) -> str:
    """The trainer's own one-line error from a launch's output (the last line if it wrote none)."""
    for line in reversed(tail):
        for prefix in _RANK_PREFIXES:
            if prefix in line:
                return line.split(prefix, 1)[1].strip()
    return tail[-1] if tail else "the trainer exited with a config or input error"


def _forward_output(process: subprocess.Popen, path_id: str, tail: list[str]) -> None:
    """Show the trainer's own progress lines, prefixed by path; keep a tail for failure reports."""
    assert process.stdout is not None
    for line in process.stdout:
        line = line.rstrip()
        tail.append(line)
        del tail[:-40]
        if any(marker in line for marker in _FORWARD):
            log.info("[%s] %s", path_id, line.split("dipaco.train ")[-1])

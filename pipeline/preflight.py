"""What a command needs before it writes anything: its arguments fit the config, its input files
exist, and the run root holds the stages it reads.

Every check here is a refusal (ConfigError or InputError, exit status 2) that names what is wrong
and what to run instead. They read only the config and committed markers, and import neither
torch nor DeepSpeed, so a mistake is reported in well under a second and leaves the run root as it
was: the CLI (and `stages.run`, and the DAG's configure task) call them before `init_run` writes
run.yaml and round 0.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from models.grid import parse_job_id
from pipeline.core.config import Config
from pipeline.core.errors import ConfigError, InputError
from pipeline.state import layout
from pipeline.state.storage import RunRoot

PREPARE_FIRST = "shards are not committed; run `dipaco prepare` first"
PLAN_POLL_S = 1.0  # how often `dipaco island --wait` looks for the run's plan: an island's rank starts within it
log = logging.getLogger("dipaco")


def check_job_id(config: Config, path_id: str) -> None:
    """`--path` names a path of the grid (or a DiLoCo worker of one: `p0-1.w1`)."""
    try:
        parse_job_id(path_id, config.model.grid, config.train.workers_per_path)
    except ValueError as exc:
        raise ConfigError(f"--path: {exc}") from None


def check_data(config: Config) -> None:
    """Every data glob matches a file, unless the shards are committed (then none is read again).

    Relative globs resolve against the current directory, as relative paths do everywhere in a
    config; the error says which directory that was."""
    if RunRoot(config.run_root).is_committed(layout.SHARDS_DIR):
        return
    for key in ("train", "eval"):
        globs = getattr(config.data, key)
        for pattern in [] if globs is None else [globs] if isinstance(globs, str) else globs:
            if _matches_a_file(pattern, f"data.{key}"):
                continue
            where = (
                ""
                if "://" in pattern or Path(pattern).is_absolute()
                else f"; relative globs resolve against the current directory {Path.cwd()}"
            )
            raise InputError(f"{config.source}: {pattern}: no input files match (data.{key}){where}")


def _matches_a_file(pattern: str, key: str) -> bool:
    """Local globs through the filesystem (no Beam import: instant and quiet); remote ones the way
    the Beam job will list them."""
    if "://" in pattern and not pattern.startswith("file://"):
        from preprocessing.c4 import list_input_files

        try:
            return bool(list_input_files(pattern, key))
        except InputError:
            return False
    import glob

    local = pattern.removeprefix("file://")
    return any(Path(p).is_file() for p in glob.iglob(local, recursive=True))


def wait_for_plan(config: Config, seconds: float) -> None:
    """`dipaco island --wait S`: an island started before the run is planned waits for the plan
    (queue/plan.json, written once prepare is done), for at most `seconds`, instead of exiting.
    Hosts can then be started in any order (a service manager, a queue per host), and every
    host's island starts its ranks within a poll of the plan, where one started once the plan was
    seen began seconds after the planning host's (benchmarks/RESULTS.md, "Islands on separate
    hosts"). A run that is never planned still ends in one line, after the bound."""
    from pipeline.islands.task_queue import PLAN, read_plan  # no torch: the queue's records only

    if not seconds >= 0:  # nan too: a deadline it never reaches
        raise ConfigError(f"--wait: {seconds:g} seconds; use 0 (do not wait) or more")
    root = RunRoot(config.run_root)
    deadline = time.monotonic() + seconds
    if read_plan(root) is not None:
        return
    log.info("island: waiting up to %g s for a run to be planned at %s", seconds, root.path(PLAN))
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(PLAN_POLL_S, left))
        if read_plan(root) is not None:
            return
    raise InputError(
        f"{root.path(PLAN)}: no run planned here after waiting {seconds:g} s; start `dipaco run` "
        "(or the DAG) on this run root"
    )


def require_prepared(config: Config) -> None:
    """The shards exist: training, merging and evaluation read them."""
    root = RunRoot(config.run_root)
    if not root.is_committed(layout.SHARDS_DIR):
        raise InputError(f"{root.path(layout.SHARDS_DIR)}: {PREPARE_FIRST}")


def require_modules(config: Config, round_index: int) -> None:
    """Round r's modules exist (round 0's are written by init_run; round r+1's by `merge --round r`)."""
    root = RunRoot(config.run_root)
    if round_index == 0 or root.is_committed(layout.modules_dir(round_index)):
        return
    latest = 0
    while root.is_committed(layout.modules_dir(latest + 1)):
        latest += 1
    raise InputError(
        f"{root.path(layout.modules_dir(round_index))}: round {round_index}'s modules are not committed "
        f"(the latest are round {latest}'s); `dipaco merge --round {round_index - 1}` writes them"
    )


def require_trained_path(config: Config, round_index: int) -> None:
    """A merge that has not committed needs at least one path of its round trained."""
    from models.grid import all_job_ids

    root = RunRoot(config.run_root)
    if root.is_committed(layout.round_dir(round_index)):
        return
    jobs = all_job_ids(config.model.grid, config.train.workers_per_path)
    if not any(root.is_committed(layout.path_dir(round_index, job)) for job in jobs):
        raise InputError(
            f"{root.path(layout.round_dir(round_index))}: no path of round {round_index} has been trained; "
            f"run `dipaco train-path --round {round_index} --path {jobs[0]}` (each path) first"
        )


def check_init_from(config: Config) -> None:
    """model.init_from resolves to a checkpoint whose architecture, layers, safetensors headers and
    tokenizer fit (pipeline.init_from), unless the run root already started from it; no weight is read."""
    if RunRoot(config.run_root).exists(layout.RUN_CONFIG):
        return
    from pipeline.init_from import check

    check(config)


def check_run_root(config: Config) -> None:
    """A local run root can be created and written: a probe file is created, written, renamed (as
    every commit renames) and removed. Without it an unwritable root (`/proc/x`, a path under a
    file) failed 12 s later, inside the first stage, with a raw NotADirectoryError and exit 1.
    An object store was probed first (check_object_store)."""
    root = RunRoot(config.run_root)
    if not root.is_local:
        return
    path = Path(root.path())
    probe = path / f".dipaco-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.with_suffix(".tmp").write_bytes(b"probe\n")
        os.replace(probe.with_suffix(".tmp"), probe)
        probe.unlink()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise InputError(
            f"{config.source}: run_root {path}: cannot create and write files there ({why}); "
            f"choose a writable directory (--set run_root=...)"
        ) from None


def check_object_store(config: Config) -> None:
    """An object-store run root, first of all (every other check reads the store): a tracking server
    is named (the embedded SQLite store needs a local file), the bucket exists, the credentials
    write, and the store honours conditional writes (a probe object created twice: the second
    create must be refused), each a one-line refusal within seconds (store.PROBE_TIMEOUT_S).
    Nothing else is written. A local root: nothing to do here (check_run_root)."""
    from pipeline.core.errors import StorageError
    from pipeline.state.store import check_writable

    root = RunRoot(config.run_root)
    if root.is_local:
        return
    if config.mlflow.enabled:
        from pipeline.tracking.uris import tracking_uri

        tracking_uri(config)  # ConfigError when none is set
    try:
        check_writable(root.url, root.root)
    except StorageError as exc:
        raise InputError(f"{config.source}: run_root {exc}") from None


def before_a_run(config: Config) -> None:
    """What `dipaco run`, `stages.run` and the DAG's configure task check before a run writes
    anything, in order: the store (every later check reads it), the data, the checkpoint it starts
    from (model.init_from), a local root's writability (last: it creates the root)."""
    check_object_store(config)
    check_data(config)
    if config.model.init_from:
        check_init_from(config)
    check_run_root(config)

"""The pipeline's stages as plain functions: the CLI and the Airflow DAG call exactly these.

Each stage reads committed state from the run root, does its work, commits its output and
reports to the tracker; each can be rerun and resumes where it stopped (a committed stage
returns its recorded result at once).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

from models.grid import all_job_ids
from pipeline.state import layout
from pipeline import preflight
from pipeline.core.config import Config, dump_yaml
from pipeline.core.errors import ConfigError, CorruptStateError, InputError, IslandError
from pipeline.evaluation.early_stopping import evaluated_rounds
from pipeline.evaluation.evaluate import evaluate_round
from pipeline.islands.launch import train_path_job
from pipeline.islands.task_queue import ISLANDS
from pipeline.state.lock import run_lock
from pipeline.outer.merge import merge_round
from pipeline.state.module_store import init_modules
from pipeline.state.storage import RunRoot

log = logging.getLogger("dipaco")
# Sections that fix what the committed state means; a run root refuses a config that changes them.
_FIXED = ("model", "router")


def init_run(config: Config) -> RunRoot:
    """Write run.yaml and the round-0 modules, unless the run root already holds them."""
    root = RunRoot(config.run_root)
    check_same_run(config)
    root.write_text(layout.RUN_CONFIG, dump_yaml(config))
    if init_modules(root, config.model, config.model.grid):
        log.info("initialised round 0: %d modules for %d paths", sum(config.model.grid), config.n_paths)
    return root


def check_same_run(config: Config) -> None:
    """A config may change how a run trains, never what it trains: `model` and `router` must be
    those of the run root's run.yaml, if it has one."""
    root = RunRoot(config.run_root)
    if root.exists(layout.RUN_CONFIG):
        previous = layout.read_run_config(root)
        for section in _FIXED:
            if getattr(previous, section) != getattr(config, section):
                raise ConfigError(f"{config.source}: {section} differs from the run in {root.path()} "
                                  f"(its run.yaml); use a new run_root to change it")


def prepare(config: Config) -> dict:
    """The Beam job: router and shards (skipped when shards/ is committed)."""
    from preprocessing.prepare import run_prepare
    from pipeline.tracking.tracker import get_tracker

    manifest = run_prepare(config)
    get_tracker(config).log_prepare(manifest)
    return manifest


def list_paths(config: Config) -> list[str]:
    """The training jobs of a round: path ids (`p0-1`), with `.w<k>` when a path has several
    DiLoCo workers. The DAG maps its path tasks over this list."""
    return all_job_ids(config.model.grid, config.train.workers_per_path)


def next_round(config: Config) -> int:
    """The first round whose merge has not committed."""
    root = RunRoot(config.run_root)
    r = 0
    while root.is_committed(layout.round_dir(r)):
        r += 1
    return r


def train_path(config: Config, round_index: int, path_id: str) -> dict | None:
    """One path's DeepSpeed job with retries; its metrics, or None when every attempt failed."""
    from pipeline.tracking.tracker import get_tracker

    metrics = train_path_job(config, round_index, path_id)
    if metrics is not None:
        get_tracker(config).log_path(round_index, path_id, metrics)
    return metrics


def merge(config: Config, round_index: int) -> dict:
    from pipeline.tracking.tracker import get_tracker

    report = merge_round(config, round_index)
    get_tracker(config).log_merge(round_index, report)
    return report


def evaluate(config: Config, round_index: int) -> dict:
    """Routed perplexity of the modules at the start of a round (round r+1 after merge r)."""
    from pipeline.tracking.tracker import get_tracker

    started = time.time()
    result = evaluate_round(config, round_index)
    get_tracker(config).log_eval(round_index, result, started_at=started)
    return result


def evaluate_initial(config: Config) -> dict | None:
    """Round 0's modules, before any training: the first row of the summary, evaluated once
    (None when training has begun, or round 0 is evaluated already)."""
    root = RunRoot(config.run_root)
    if next_round(config) > 0 or root.exists(layout.eval_file(0)):
        return None
    return evaluate(config, 0)


def rounds_to_train(config: Config, rounds: int | None = None) -> range:
    """The rounds a run trains: from the first uncommitted one up to `train.rounds`, at most `rounds`
    of them (a scheduled DAG run's `airflow.rounds_per_run`); empty once every round is committed."""
    first = next_round(config)
    last = config.train.rounds if rounds is None else min(config.train.rounds, first + rounds)
    return range(first, max(first, last))


def nothing_to_train(config: Config) -> str:
    """Why a run trained nothing: the message a DAG run and `dipaco run` give."""
    return (f"nothing to train: all train.rounds={config.train.rounds} rounds are committed in "
            f"{RunRoot(config.run_root).path()}; raise train.rounds to continue")


def register(config: Config, round_index: int, result: dict) -> str | None:
    from pipeline.tracking.tracker import get_tracker

    return get_tracker(config).register(round_index, result)


def list_islands(config: Config) -> list[str]:
    """The islands a run starts on this machine (`train.islands`); the DAG maps over this list."""
    from pipeline.islands.launch import island_count

    return [f"island-{i}" for i in range(island_count(config.train))]


def plan_rounds(config: Config, rounds: int | None = None) -> range:
    """The rounds this run trains, written to queue/plan.json for every island (joiners too)."""
    from pipeline.islands.task_queue import write_plan

    todo = rounds_to_train(config, rounds)
    if todo:
        write_plan(RunRoot(config.run_root), todo.stop)
    return todo


def run_island(config: Config, island: str, ds_config: str | None = None) -> dict:
    """One island until the plan is done: a `deepspeed` launch of pipeline.islands.island (with
    `train.launcher: inprocess`, this process as a one-rank island). Raises when it failed."""
    from pipeline.island_rank import reshard
    from pipeline.islands.island import Island
    from pipeline.islands.launch import IslandProcess

    if config.train.launcher == "inprocess":
        return Island(config, island, reshard=reshard).run()
    process = IslandProcess(config, island, ds_config)
    try:
        with sigterm_raises():
            returncode = process.wait()
    except BaseException:  # Ctrl-C, SIGTERM, an Airflow task killed: nothing the island started outlives it
        stop_islands(config, {island: process}, "interrupted")
        raise
    if returncode != 0 and island_left(config, island):
        return {"island": island, "returncode": returncode, "left": True}
    if returncode != 0:
        island_failed(config, island, returncode, process.tail, process.island_id)
    return {"island": island, "returncode": returncode}


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises SystemExit here (after the handler it replaces ran), so the caller can stop
    what it started. Airflow 3's task runner only calls the operator's on_kill on SIGTERM and
    SIGKILLs the task later: the island launch, in a session of its own, would outlive it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        if callable(previous):
            previous(signum, frame)  # the CLI's raises Interrupted; Airflow's calls on_kill
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def island_failed(config: Config, island: str, returncode: int, tail: list[str], island_id: str) -> None:
    """An island exited with an error: its running attempt is failed at once (no need to wait out
    the lease); a config or input error is raised with the trainer's own message."""
    from pipeline.islands.launch import INPUT_ERROR_EXIT, trainer_message
    from pipeline.islands.task_queue import TaskQueue

    queue = TaskQueue(RunRoot(config.run_root), config)
    queue.fail_running(island_id, f"island exited with status {returncode}: {tail[-1] if tail else ''}"[:2000])
    if returncode == INPUT_ERROR_EXIT:
        raise InputError(f"{island}: {trainer_message(tail)}")
    raise IslandError(f"{island} exited with status {returncode}: {tail[-1] if tail else 'no output'}")


def join_run(config: Config, name: str | None = None) -> dict:
    """`dipaco island`: one more island on a run that `dipaco run` (or a DAG run) planned, with
    this config's ranks and ZeRO config; it leaves when the plan is done."""
    import os
    import socket

    from pipeline.islands.task_queue import read_plan

    root = RunRoot(config.run_root)
    check_same_run(config)
    until = read_plan(root)
    if until is None:
        raise InputError(f"{root.path()}: no run planned here yet (no queue/plan.json); start `dipaco run` first")

    def leave(signum, frame):  # SIGTERM to `dipaco island`: the island releases its task and leaves
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, leave)
    return run_island(config, name or f"{socket.gethostname()}-{os.getpid()}", ds_config=config.train.ds_config)


def round_finished(config: Config, round_index: int) -> bool:
    """Round r merged and the modules it produced evaluated (and, after round
    router.discriminative_after, re-routed): ready to log and register."""
    root = RunRoot(config.run_root)
    rerouted = round_index != config.router.discriminative_after or root.exists(layout.reroute_report(round_index + 1))
    return root.is_committed(layout.round_dir(round_index)) and root.exists(layout.eval_file(round_index + 1)) and rerouted


def reroute(config: Config, after_round: int) -> dict:
    """`router.discriminative_after`: the discriminative router fitted after round R's merge and
    the splits re-sharded with it (islands run this as their `reroute.r<R>` task); its report.
    Committed pieces are reused, so a rerun recomputes nothing."""
    from pipeline.evaluation.reroute import reroute as run_reroute
    from preprocessing.prepare import reshard

    return run_reroute(config, after_round, reshard)


def read_reroute(config: Config) -> dict | None:
    """The re-routing's report (reroute/round=<R+1>/report.json), once written."""
    after, root = config.router.discriminative_after, RunRoot(config.run_root)
    if after is None or not root.exists(layout.reroute_report(after + 1)):
        return None
    return root.read_json(layout.reroute_report(after + 1))


def report_round(config: Config, round_index: int) -> dict:
    """After islands finished round r: its paths, merge, evaluation and utilisation to the tracker,
    and round r+1's modules registered. Logging twice logs nothing twice (tracking is idempotent)."""
    from pipeline.islands.launch import read_metrics
    from pipeline.tracking.tracker import get_tracker
    from pipeline.tracking.utilisation import round_utilisation

    root, tracker = RunRoot(config.run_root), get_tracker(config)
    for job in list_paths(config):
        rel = layout.path_dir(round_index, job)
        if root.is_committed(rel):
            tracker.log_path(round_index, job, read_metrics(root, rel))
    report = root.read_json(f"{layout.round_dir(round_index)}/merge.json")
    tracker.log_merge(round_index, report)
    rerouted = read_reroute(config) if round_index == config.router.discriminative_after else None
    if rerouted:
        tracker.log_reroute(round_index, rerouted)
    result = read_eval(root, round_index + 1)
    tracker.log_eval(round_index + 1, result)
    figures = round_utilisation(config, round_index)
    if figures:
        tracker.log_utilisation(round_index, figures)
        log.info("round %d: utilisation %.2f over %d islands (mean overhead %.1f s per task)", round_index,
                 figures["utilisation"] or 0, figures["islands"], figures["task_overhead_seconds"] or 0)
    version = register(config, round_index + 1, result)
    best = early_stop(config, round_index + 1) if config.eval.early_stopping else None
    prune_rounds(config, round_index)
    return {"merge": report, "eval": result, "model_version": version, "utilisation": figures, "reroute": rerouted,
            "early_stopping": best}


def prune_rounds(config: Config, round_index: int) -> int:
    """`train.keep_rounds: N` once round r is merged, evaluated and registered: the weights of all
    but the N newest rounds go, except those a later champion or the re-routing still reads
    (pipeline.state.retention). Returns the bytes freed (0 with keep_rounds null: keep all)."""
    from pipeline.state.retention import prune_round, rounds_to_prune

    keep, root = config.train.keep_rounds, RunRoot(config.run_root)
    if keep is None:
        return 0
    protected: set[int] = set()
    if config.eval.early_stopping:
        from pipeline.evaluation.early_stopping import best_up_to

        protected |= {entry["round"] for entry in best_up_to(root).get("paths", {}).values()}
    after = config.router.discriminative_after
    if after is not None and not root.exists(layout.reroute_report(after + 1)):
        protected.add(after + 1)
    freed = sum(prune_round(root, r, list_paths(config)) for r in rounds_to_prune(round_index + 1, keep, protected))
    if freed:
        log.info("train.keep_rounds=%d: freed %.1f MB of older rounds' weights", keep, freed / 1e6)
    return freed


def clean(config: Config, keep_registry: bool = False) -> dict:
    """`dipaco clean`: remove this config's run root (refused while a run holds it, and unless it
    holds a run.yaml: a typo must not delete some other directory). With `keep_registry`, the
    MLflow store in it (mlflow.db, mlartifacts/) stays, so the registered versions still load."""
    from pipeline.state.retention import run_root_size

    root = RunRoot(config.run_root)
    where = root.path() if root.is_local else root.url
    if not root.exists(""):
        return {"run_root": where, "removed": False, "why": "nothing there"}
    if not root.exists(layout.RUN_CONFIG):
        raise InputError(f"{where}: not a dipaco run root (no {layout.RUN_CONFIG}); remove it yourself if you mean to")
    keep = ("mlflow.db", "mlartifacts", "tracking.json") if keep_registry else ()
    before = run_root_size(root)
    with run_lock(root):  # refused while a run or an island holds it
        for name in root.listdir(""):
            if name not in keep and name != layout.LOCK:
                root.remove(name)
    if not keep_registry:
        root.remove("")
    return {"run_root": where, "removed": True, "freed_mb": round((before - run_root_size(root)) / 1e6, 1),
            "kept": [name for name in keep if root.exists(name)]}


def early_stop(config: Config, round_index: int) -> dict:
    """eval.early_stopping once round r's modules are evaluated: eval/best.json rewritten from every
    eval file (an island may have written it from an older listing), and the early-stopped model
    over rounds <= r logged and registered as the champion. Rerunnable: logged and registered once."""
    from pipeline.evaluation.early_stopping import best_up_to, write_best
    from pipeline.tracking.tracker import get_tracker

    root, tracker = RunRoot(config.run_root), get_tracker(config)
    write_best(root)
    best = best_up_to(root, round_index)
    tracker.log_early_stopping(round_index, best)
    return {**best, "model_version": tracker.register_early_stopped(round_index, best)}


ISLAND_POLL_S = 0.5


def train_on_islands(config: Config, todo: range) -> None:
    """Start `train.islands` islands, report and register each round as it finishes, and restart
    an island that crashed (its task's lease is failed and another island may take it)."""
    from pipeline.islands.launch import INPUT_ERROR_EXIT, IslandProcess
    from pipeline.islands.task_queue import TaskQueue

    if config.train.launcher == "inprocess":  # tests and debugging: one one-rank island, here
        run_island(config, list_islands(config)[0])
        for r in todo:
            report_round(config, r)
        return
    islands = {name: IslandProcess(config, name) for name in list_islands(config)}
    restarts = {name: 0 for name in islands}
    left: set[str] = set()  # islands that left on SIGTERM: not started again
    pending = list(todo)
    try:
        while pending:
            if round_finished(config, pending[0]):
                report_round(config, pending.pop(0))
                continue
            for name, process in list(islands.items()):
                returncode = process.poll()
                if returncode is None or returncode == 0 or name in left:
                    continue
                process.wait()
                if island_left(config, name):  # it released its task and left, as asked
                    log.info("%s left the run (SIGTERM); the other islands go on", name)
                    left.add(name)
                    continue
                restarts[name] += 1
                if returncode == INPUT_ERROR_EXIT or restarts[name] > config.train.max_attempts:
                    del islands[name]
                    island_failed(config, name, returncode, process.tail, process.island_id)
                log.warning("%s exited with status %s; starting it again (%d/%d)", name, returncode,
                            restarts[name], config.train.max_attempts)
                TaskQueue(RunRoot(config.run_root), config).fail_running(process.island_id,
                                                                         f"island exited with status {returncode}")
                islands[name] = IslandProcess(config, name)
            if all(p.poll() is not None and (p.poll() == 0 or n in left) for n, p in islands.items()) \
                    and not round_finished(config, pending[0]):
                raise IslandError(f"every island left before round {pending[0]} finished; start one with "
                                  f"`dipaco island --config ...` or rerun `dipaco run` to resume")
            time.sleep(ISLAND_POLL_S)
    except BaseException as exc:  # Ctrl-C, SIGTERM (pipeline.cli), an error: stop them all, release their tasks
        stop_islands(config, islands, "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit))
                     else f"stopping after {type(exc).__name__}")
        raise
    for process in islands.values():  # the plan is done: they are leaving by themselves
        try:
            process.wait(timeout=60)
        except Exception:
            stop_islands(config, islands, "still running after the plan was done")


def stop_islands(config: Config, islands: dict, why: str) -> dict:
    """Stop the island launches this process started (every launcher and rank, signalled by pid,
    killed after a grace period) and release the tasks they held, so that a rerun started now
    neither overlaps them nor waits out their leases. Says what it did."""
    from pipeline.islands.launch import stop_launches
    from pipeline.islands.task_queue import TaskQueue

    if not islands:
        return {}
    started = time.time()
    outcome = stop_launches(list(islands.values()))
    root, queue, now = RunRoot(config.run_root), TaskQueue(RunRoot(config.run_root), config), time.time()
    released = [task for process in islands.values() for task in queue.release_running(process.island_id, why, since=started)]
    for name in islands:  # a killed island could not say when it stopped: utilisation needs its end
        rel = f"{ISLANDS}/{name}.json"
        record = root.read_json(rel) if root.exists(rel) else None
        if record and record.get("state") == "running":
            root.write_json(rel, {**record, "state": "stopped", "finished_at": now})
    log.warning("%s: stopped %d island(s) (%d processes, %d killed after the grace period); %s", why, len(islands),
                outcome.get("processes", 0), outcome.get("killed", 0),
                f"released {', '.join(released)}" if released else "they held no task")
    return {**outcome, "released": released}


def island_left(config: Config, name: str) -> bool:
    """The island's record says it left on SIGTERM (pipeline.islands.island)."""
    root, rel = RunRoot(config.run_root), f"{ISLANDS}/{name}.json"
    return root.exists(rel) and root.read_json(rel).get("state") == "left"


def run(config: Config, rounds: int | None = None) -> dict:
    """Every stage that has not committed: prepare, then rounds up to `train.rounds` (or `rounds`
    more, as a scheduled DAG run does), evaluation and registration after each merge."""
    from pipeline.tracking.tracker import get_tracker

    root = RunRoot(config.run_root)
    preflight.check_data(config)  # before the lock and init_run write anything
    preflight.check_run_root(config)
    with run_lock(root):
        init_run(config)
        tracker = get_tracker(config)
        tracker.log_run_config()
        precision = choose_precision(config)
        tracker.log_precision(precision.name, precision.reason)
        prepare(config)
        evaluate_initial(config)
        todo = plan_rounds(config, rounds)
        if not todo:
            log.info("%s", nothing_to_train(config))
        else:
            train_on_islands(config, todo)
        summary = summarize(config)
        if config.eval.sample_prompt and summary.get("model_version"):
            from pipeline.tracking.registry import champion_continuation

            prompt = config.eval.sample_prompt
            summary["sample"] = {"prompt": prompt, "continuation": champion_continuation(config, prompt)}
        tracker.finish(summary)
        return summary


def choose_precision(config: Config):
    """train.precision on this machine, said once per run. Measured (when auto needs it) at an
    island's thread count, so the islands this run starts here find the choice in the cache."""
    import torch

    from models.modular import ModelShape
    from pipeline.islands.launch import rank_threads
    from pipeline.train.precision import resolve

    inprocess = config.train.launcher == "inprocess"  # its island trains in this process, at its threads
    threads = torch.get_num_threads() if inprocess else rank_threads(config.train, islands=True)
    precision = resolve(config.train, ModelShape.from_config(config.model), threads=threads)
    log.info("precision: %s (%s)", precision.name, precision.reason)
    return precision


def summarize(config: Config) -> dict:
    """Perplexity per path and overall by round, from the committed eval files, and where the
    registered model and the tracking store are."""
    from pipeline.tracking.tracker import STATE_FILE, get_tracker, redact, tracking_uri

    root = RunRoot(config.run_root)
    rounds = evaluated_rounds(root)
    summary = {"run_root": root.path() if root.is_local else root.url,
               "rounds_committed": next_round(config), "train_rounds": config.train.rounds,
               "eval": {r: read_eval(root, r) for r in rounds}}
    from pipeline.tracking.utilisation import round_utilisation

    last = next_round(config) - 1
    figures = round_utilisation(config, last) if last >= 0 else None
    if figures:
        summary["utilisation"] = {"round": last, **figures}
    if config.eval.early_stopping and rounds:
        from pipeline.evaluation.early_stopping import best_up_to

        summary["early_stopping"] = best_up_to(root)
    rerouted = read_reroute(config)
    if rerouted:
        summary["reroute"] = rerouted
    if config.mlflow.enabled:
        summary.update(tracking_uri=redact(tracking_uri(config)), registered_model=config.mlflow.registered_model,
                       model_version=get_tracker(config).newest_version(), experiment=config.mlflow.experiment)
        if root.exists(STATE_FILE):  # where the MLflow UI shows this run (pipeline.tracking.report)
            state = root.read_json(STATE_FILE)
            summary.update({k: state[k] for k in ("experiment_id", "parent_run_id") if isinstance(state.get(k), str)})
    return summary


def read_eval(root: RunRoot, round_index: int) -> dict:
    """eval/round=<r>.json with the numbers the run summary prints (perplexity and bits per byte,
    overall and per path)."""
    result = root.read_json(layout.eval_file(round_index))
    paths = result.get("paths", {})
    entries = [result] + [p if isinstance(p, dict) else {"perplexity": "?"} for p in
                          (paths.values() if isinstance(paths, dict) else ["?"])]
    numbers = [entry.get(key) for entry in entries for key in ("perplexity", "bits_per_byte")]
    if not all(v is None or isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        raise CorruptStateError(f"{root.path(layout.eval_file(round_index))}: perplexity and bits_per_byte (overall "
                                f"and per path under \"paths\") must be numbers")
    return result

"""dipaco_train: the pipeline as an Airflow DAG. Wiring only: every task calls the function the
`dipaco` CLI calls (pipeline.stages), so a DAG run and `dipaco run` do the same work.

    configure -> prepare -> plan -> evaluate_initial --+--> islands -> island x n (mapped, pooled) ------+--> report
        |                                              |                                                  |
        +--> warm_up (beside prepare)                  +--> round_0 [finished (sensor) -> register]       |
                                                            -> round_1 [...] -> ... -> export ------------+

Training runs on islands, as in `dipaco run`: `island` is mapped over `train.islands` names, each
task one long-lived `deepspeed` launch (a subprocess, inside stages.run_island, so torch.distributed
never starts in an Airflow worker) that pulls the planned rounds' work (train a path, merge a
module, commit a round, evaluate) from the lease-based queue in the run root until the plan is
done. The pool `airflow.pool` caps how many islands run at once. There are no path tasks: a path
whose island crashed is retaken by another island when its attempt is failed or its lease expires
(up to train.max_attempts), and an Airflow retry of an island task starts that island again.

Islands on several hosts (docs/operations.md, "Run across hosts"): with `airflow.queues` set, one
`islands_<queue>` -> `island_<queue>` pair per queue replaces `islands` -> `island`, each island task
sent to its Celery queue (the operator's `queue`): a Celery worker started on a host with
`airflow celery worker --queues <queue>` runs that host's islands, `<queue>-island-<i>`, and only
the object store and the MLflow server are shared. The other tasks go to the default queue, but
for one `warm_up_<queue>` per queue.

`warm_up` (per host queue with `airflow.queues`) is the host's first torch.compile, beside prepare,
where the islands compile (`train.compile`: true, or auto on CUDA or a CPU with AMX): the island
tasks on that worker then find inductor's kernels in its cache instead of compiling at their first
step (pipeline/compile_warmup.py, as `dipaco run` does beside prepare). It holds nothing up and
never fails a run on its own account: where it cannot compile it says so, and the islands compile
at their first step as before. Skipped where they train eagerly.

Beside the islands there is one task group per round of `train.rounds`, named after the round it
trains: in `round_1`, `finished` (a sensor) waits until the islands merged round 1 and evaluated
the modules it wrote, then `register` logs the round to MLflow and registers those modules as a
model version. The groups follow one another, so versions are registered in round order. Each DAG
run trains `airflow.rounds_per_run` rounds from the first uncommitted one; the groups of other
rounds are skipped, saying why (committed already, or left to a later DAG run). A DAG run once
every round of `train.rounds` is committed trains nothing: `plan` is skipped with "nothing to train
... raise train.rounds to continue". `evaluate_initial` scores round 0's modules once, as `dipaco
run` does, and `report` ends every DAG run, after the last round group and the islands, with the
same summary table. `export` follows the last round group: once train.rounds are all committed it
writes every path as a Hugging Face checkpoint under the run root's exports/ and attaches it to the
registered version (`dipaco export`).

The sensors poke in mode="reschedule": between pokes they give their worker slot back, so a
scheduler runs them beside long islands at no cost, and `dag.test()`, which runs the ready tasks one
after the other in its own process, runs the islands after a sensor's first unanswered poke and
pokes again once ROUND_POKE_S has passed (a sensor in mode="poke" would block it until its
timeout). If every island fails for good, the round's sensor keeps waiting (until ROUND_TIMEOUT_S):
clear the failed island tasks to start them again, and the waiting groups register what they train.

The DAG's shape (schedule, pool, retries, queues, one group per round) is read from the config named by
$DIPACO_CONFIG when the file is parsed, and a config that cannot be read fails the parse with a
one-line message; what a run trains is read at run time from the `config` and `overrides` params.
Tasks pass a config reference, never data. Nothing heavy is imported here at parse time: pipeline
and torch load inside the tasks.
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import Param, dag, task, task_group
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

PROJECT_DIR = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = os.environ.get("DIPACO_CONFIG", str(PROJECT_DIR / "configs" / "demo.yaml"))
log = logging.getLogger("dipaco.dag")
ROUND_POKE_S = 30  # how often a round's sensor looks whether the islands finished its round
ROUND_TIMEOUT_S = 24 * 3600  # a round's sensor fails after waiting this long (from its first poke)


class _SensorWaitIsNotAFailure(logging.Filter):
    """`airflow dags test` (dag.test) warns "No tasks to run. unrunnable tasks: ..." every second
    a round's sensor waits in up_for_reschedule, which reads like a failure; it is the sensor's
    normal wait. The warning stays when no sensor is waiting (a real deadlock)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("No tasks to run. unrunnable tasks") or not record.args:
            return True
        waiting = record.args[0] if isinstance(record.args, tuple) else ()
        return not any(getattr(ti, "state", None) == "up_for_reschedule" for ti in waiting)


logging.getLogger("airflow.sdk.definitions.dag").addFilter(_SensorWaitIsNotAFailure())


def _dag_settings():
    """The `airflow` section and `train.rounds` of $DIPACO_CONFIG: the DAG's shape, known at parse
    time. A config that cannot be used fails the parse: the import error is its one-line message."""
    from pipeline.core.config import load_config
    from pipeline.core.errors import ConfigError

    try:
        config = load_config(DEFAULT_CONFIG)
    except ConfigError as exc:
        error = exc
    else:
        return config.airflow, config.train.rounds
    raise ConfigError(f"$DIPACO_CONFIG: {error}") from None  # raised here: no frames from inside pipeline/


SETTINGS, ROUNDS = _dag_settings()


def _config(ref: dict):
    """Load the run's config the way the CLI does, from the project directory (relative paths).
    The overrides come from whoever triggered the run: untrusted, so they may set only the keys of
    pipeline.core.trust.TRIGGER_KEYS (hyper-parameters, rounds, a run root under a set prefix)."""
    from pipeline.core.config import load_config

    os.chdir(ref["project_dir"])
    return load_config(ref["config"], ref["overrides"], trusted=False)


def _run(ref: dict):
    """The Run the stages take (pipeline.run), from the run's config: one per task, as each task
    is a process of its own."""
    from pipeline.run import Run

    return Run(_config(ref))


def trusted_dirs() -> list[Path]:
    """Where a trigger's project_dir may point: this project and $DIPACO_CONFIG's folder, both
    chosen by whoever deployed the DAG, never by whoever triggers a run."""
    return [PROJECT_DIR, Path(DEFAULT_CONFIG).resolve().parent]


def config_dirs() -> list[Path]:
    """Where a trigger's config may lie: configs/ and $DIPACO_CONFIG's folder (not the whole
    project, whose data and run roots hold files others may write)."""
    return [PROJECT_DIR / "configs", Path(DEFAULT_CONFIG).resolve().parent]


@task
def configure(params: dict | None = None) -> dict:
    """Validate the params, the config and its data, write run.yaml and round 0 (stages.init_run),
    log it to MLflow."""
    from pipeline import preflight, stages
    from pipeline.core.config import check_dag_params

    ref = check_dag_params(
        {k: params[k] for k in ("config", "overrides", "project_dir")}, trusted_dirs(), config_dirs()
    )
    run = _run(ref)
    preflight.before_a_run(run.config)
    stages.init_run(run)
    run.tracker.log_run_config()
    return ref


@task
def prepare(ref: dict) -> None:
    """The Beam job; shown as skipped when the shards are committed already."""
    from pipeline import stages
    from pipeline.state import layout

    run = _run(ref)
    if run.root.is_committed(layout.SHARDS_DIR):
        raise AirflowSkipException("shards/ is committed")
    stages.prepare(run)


@task
def warm_up(ref: dict) -> str:
    """This host's first torch.compile of the path model, beside prepare, so that its island
    tasks' first step reads inductor's kernels from the host's cache (pipeline/compile_warmup.py,
    as `dipaco run` and `dipaco island --wait` do). Skipped where the islands train eagerly or
    nothing is left to train; a warm-up that fails says so and succeeds: it holds nothing up."""
    from pipeline import compile_warmup, stages

    run = _run(ref)
    if not stages.rounds_to_train(run):
        raise AirflowSkipException(stages.nothing_to_train(run))
    said = compile_warmup.compile_now(run.config)
    if said is None:
        raise AirflowSkipException("the islands train eagerly here (train.compile): nothing to compile")
    return said


@task(trigger_rule="none_failed")
def plan(ref: dict) -> dict:
    """The rounds this DAG run trains: airflow.rounds_per_run of them from the first uncommitted
    one, within train.rounds, written to the run root's queue for the islands. Skipped, saying so,
    when every round is committed. Planned under the run lock, so a DAG run never plans beside a
    live `dipaco run`; its islands then need no lock (docs/design.md, "Faults and stragglers")."""
    from pipeline import stages
    from pipeline.core.errors import ConfigError

    run = _run(ref)
    config = run.config
    if config.train.rounds > ROUNDS:
        raise ConfigError(
            f"{config.source}: train.rounds={config.train.rounds} but this DAG was parsed with "
            f"{ROUNDS} round groups; set train.rounds in $DIPACO_CONFIG ({DEFAULT_CONFIG}) too"
        )
    from pipeline.state.lock import run_lock

    with run_lock(run.root):  # refused while a `dipaco run` orchestrates this root
        todo = stages.plan_rounds(run, config.airflow.rounds_per_run)
    if not todo:
        raise AirflowSkipException(stages.nothing_to_train(run))
    log.info("this DAG run trains round(s) %s", ", ".join(map(str, todo)))
    return {"first": todo.start, "stop": todo.stop}


@task
def evaluate_initial(ref: dict) -> dict:
    """Routed perplexity of round 0's modules before any training (row 0 of the summary)."""
    from pipeline import stages

    result = stages.evaluate_initial(_run(ref))
    if result is None:
        raise AirflowSkipException("round 0 is evaluated already")
    return {"round": 0, "perplexity": result["perplexity"]}


def _skip_outside(window: dict | None, round_index: int) -> None:
    """Skip, saying why, a task of a round that this DAG run does not train."""
    if window is None:
        raise AirflowSkipException("nothing to train in this DAG run (see plan)")
    if round_index < window["first"]:
        raise AirflowSkipException(f"round {round_index} is committed already")
    if round_index >= window["stop"]:
        first, last = window["first"], window["stop"] - 1
        these = f"round {first}" if first == last else f"rounds {first} to {last}"
        raise AirflowSkipException(
            f"round {round_index} is left to a later DAG run: this one trains {these} (airflow.rounds_per_run)"
        )


@task(trigger_rule="none_failed")
def islands(ref: dict, window: dict | None, queue: str | None = None) -> list[str]:
    """The islands this DAG run starts (`train.islands`; on one host's queue of airflow.queues,
    named after it), or a skip when it trains nothing."""
    from pipeline import stages

    if window is None:
        raise AirflowSkipException("nothing to train in this DAG run (see plan)")
    return stages.list_islands(_config(ref), queue)


@task(
    pool=SETTINGS.pool,
    pool_slots=SETTINGS.pool_slots,
    retries=SETTINGS.retries,
    retry_delay=timedelta(seconds=SETTINGS.retry_delay_s),
    map_index_template="{{ task.op_kwargs['name'] }}",
)
def island(ref: dict, name: str) -> dict:
    """One island until the plan is done: a long-lived `deepspeed` launch (a subprocess, inside
    stages.run_island; with train.launcher=inprocess, this worker process as a one-rank island, which
    does the whole plan) taking tasks of the planned rounds from the run root's queue. An Airflow retry
    starts it again; the task it held is failed at once, or its lease expires if the worker died, and
    any island takes it again. A config or input error fails the task without Airflow retries."""
    from pipeline import stages
    from pipeline.core.errors import DipacoError

    try:
        return stages.run_island(_run(ref), name)
    except DipacoError as exc:
        raise AirflowFailException(str(exc)) from None


# mode="reschedule": no worker slot held between pokes, and dag.test() runs the islands between them
# (in mode="poke" the first poke would block dag.test() until the timeout; see the module docstring).
@task.sensor(poke_interval=ROUND_POKE_S, timeout=ROUND_TIMEOUT_S, mode="reschedule", trigger_rule="none_failed")
def finished(ref: dict, window: dict | None, round_index: int) -> bool:
    """Waits until the islands merged this round and evaluated the modules it wrote; skipped, saying
    why, when this DAG run does not train the round."""
    from pipeline import stages

    _skip_outside(window, round_index)
    return stages.round_finished(_run(ref), round_index)


@task
def register(ref: dict, round_index: int) -> dict:
    """Logs the round's paths, merge, evaluation and utilisation to MLflow and registers the modules
    round R+1 starts from as a model version (tagged dipaco.round=R+1)."""
    from pipeline import stages

    done = stages.report_round(_run(ref), round_index)
    return {
        "round": round_index + 1,
        "model_version": done["model_version"],
        "perplexity": done["eval"]["perplexity"],
        "bits_per_byte": done["eval"].get("bits_per_byte"),
        "utilisation": (done["utilisation"] or {}).get("utilisation"),
    }


@task(trigger_rule="none_failed")
def export(ref: dict) -> dict:
    """After the last round group: every path of the final modules as a Hugging Face checkpoint under
    the run root's exports/, attached to the registered version (stages.export_final); skipped,
    saying why, until every round of train.rounds is committed."""
    from pipeline import stages

    done = stages.export_final(_run(ref))
    if isinstance(done, str):
        raise AirflowSkipException(done)
    return {"out": done["out"], "round": done["round"], "paths": len(done["paths"])}


@task(trigger_rule="none_failed", show_return_value_in_logs=False)  # the table is printed once, below
def report(ref: dict) -> str:
    """Plots in MLflow and the summary table that `dipaco run` ends with (in the log and the XCom)."""
    from pipeline import stages
    from pipeline.tracking.report import format_summary

    run = _run(ref)
    summary = stages.summarize(run)
    run.tracker.finish(summary)
    table = format_summary(summary)
    print(table, flush=True)
    return table


@task_group
def outer_round(ref, window, round_index: int):
    """Wait for the islands to finish the round, then log it and register the modules it wrote."""
    finished(ref, window, round_index=round_index) >> register(ref, round_index=round_index)


@dag(
    dag_id="dipaco_train",
    schedule=SETTINGS.schedule,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["dipaco"],
    params={
        # The bounds of pipeline.core.config.check_dag_params, as the JSON schema Airflow checks on trigger.
        "config": Param(
            DEFAULT_CONFIG, type="string", minLength=1, maxLength=4096, description="the run's YAML config"
        ),
        "overrides": Param(
            [],
            type="array",
            maxItems=256,
            items={"type": "string", "maxLength": 65536, "pattern": r"^[A-Za-z_][\w.]*="},
            description="key.path=value overrides of hyper-parameters, rounds and the run "
            "root (docs/security.md lists the keys a trigger may set)",
        ),
        "project_dir": Param(
            str(PROJECT_DIR), type="string", minLength=1, maxLength=4096, description="where relative paths resolve"
        ),
    },
    doc_md=__doc__,
)
def dipaco_train():
    ref = configure()
    prepared = prepare(ref)
    window = plan(ref)
    prepared >> window
    initial = evaluate_initial(ref)
    window >> initial
    trained = []
    for queue in SETTINGS.queues or [None]:  # airflow.queues: one host's islands on its own Celery queue
        # the host's first compile beside prepare, on the worker whose island tasks read its cache
        (warm_up.override(task_id=f"warm_up_{queue}", queue=queue) if queue else warm_up)(ref)
        listed = islands.override(task_id=f"islands_{queue}") if queue else islands
        names = listed(ref, window, queue=queue)
        initial >> names
        launch = island.override(task_id=f"island_{queue}", queue=queue) if queue else island
        trained.append(launch.partial(ref=ref).expand(name=names))
    previous = initial  # the round groups wait beside the islands, one round after the other
    for k in range(ROUNDS):
        done = outer_round.override(group_id=f"round_{k}")(ref, window, k)
        previous >> done
        previous = done
    exported = export(ref)
    previous >> exported
    [exported, *trained] >> report(ref)


dipaco_train()

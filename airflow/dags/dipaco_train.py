"""dipaco_train: the pipeline as an Airflow DAG. Wiring only: every task calls the function the
`dipaco` CLI calls (pipeline.stages), so a DAG run and `dipaco run` do the same work.

    configure -> prepare -> plan -> evaluate_initial -> round_0 [paths -> train_path x n (mapped)
    -> merge -> evaluate -> register] -> round_1 [...] -> ... -> report

There is one task group per round of `train.rounds`, named after the round it trains: `round_1`
trains round 1 from round 1's modules, merges them into round 2's, then evaluates and registers
those. Each DAG run trains `airflow.rounds_per_run` rounds from the first uncommitted one; the
groups of other rounds are skipped, saying why (committed already, or left to a later DAG run).
A DAG run once every round of `train.rounds` is committed trains nothing: `plan` is skipped with
"nothing to train ... raise train.rounds to continue". `evaluate_initial` scores round 0's modules
once, as `dipaco run` does, and `report` ends every DAG run with the same summary table.

The DAG's shape (schedule, pool, retries, one group per round) is read from the config named by
$DIPACO_CONFIG when the file is parsed, and a config that cannot be read fails the parse with a
one-line message; what a run trains is read at run time from the `config` and `overrides` params.
Path trainers run the `deepspeed` launcher as a subprocess (inside stages.train_path), so
torch.distributed never starts in an Airflow worker, and the pool `airflow.pool` caps how many run
at once. Tasks pass a config reference, never data. Nothing heavy is imported here at parse time:
pipeline and torch load inside the tasks.
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


def _dag_settings():
    """The `airflow` section and `train.rounds` of $DIPACO_CONFIG: the DAG's shape, known at parse
    time. A config that cannot be used fails the parse: the import error is its one-line message."""
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    try:
        config = load_config(DEFAULT_CONFIG)
    except ConfigError as exc:
        error = exc
    else:
        return config.airflow, config.train.rounds
    raise ConfigError(f"$DIPACO_CONFIG: {error}") from None  # raised here: no frames from inside pipeline/


SETTINGS, ROUNDS = _dag_settings()


def _config(ref: dict):
    """Load the run's config the way the CLI does, from the project directory (relative paths)."""
    from pipeline.config import load_config

    os.chdir(ref["project_dir"])
    return load_config(ref["config"], ref["overrides"])


@task
def configure(params: dict | None = None) -> dict:
    """Validate the params, the config and its data, write run.yaml and round 0 (stages.init_run),
    log it to MLflow."""
    from pipeline import preflight, stages
    from pipeline.config import check_dag_params
    from pipeline.tracking import get_tracker

    ref = check_dag_params({k: params[k] for k in ("config", "overrides", "project_dir")})
    config = _config(ref)
    preflight.check_data(config)
    stages.init_run(config)
    get_tracker(config).log_run_config()
    return ref


@task
def prepare(ref: dict) -> None:
    """The Beam job; shown as skipped when the shards are committed already."""
    from pipeline import layout, stages
    from pipeline.storage import RunRoot

    config = _config(ref)
    if RunRoot(config.run_root).is_committed(layout.SHARDS_DIR):
        raise AirflowSkipException("shards/ is committed")
    stages.prepare(config)


@task(trigger_rule="none_failed")
def plan(ref: dict) -> dict:
    """The rounds this DAG run trains: airflow.rounds_per_run of them from the first uncommitted
    one, within train.rounds. Skipped, saying so, when every round is committed."""
    from pipeline import stages
    from pipeline.errors import ConfigError

    config = _config(ref)
    if config.train.rounds > ROUNDS:
        raise ConfigError(f"{config.source}: train.rounds={config.train.rounds} but this DAG was parsed with "
                          f"{ROUNDS} round groups; set train.rounds in $DIPACO_CONFIG ({DEFAULT_CONFIG}) too")
    todo = stages.rounds_to_train(config, config.airflow.rounds_per_run)
    if not todo:
        raise AirflowSkipException(stages.nothing_to_train(config))
    log.info("this DAG run trains round(s) %s", ", ".join(map(str, todo)))
    return {"first": todo.start, "stop": todo.stop}


@task
def evaluate_initial(ref: dict) -> dict:
    """Routed perplexity of round 0's modules before any training (row 0 of the summary)."""
    from pipeline import stages

    result = stages.evaluate_initial(_config(ref))
    if result is None:
        raise AirflowSkipException("round 0 is evaluated already")
    return {"round": 0, "perplexity": result["perplexity"]}


@task(trigger_rule="none_failed")
def paths(ref: dict, window: dict | None, round_index: int) -> list[str]:
    """The path jobs of this round, or a skip saying why this DAG run does not train it."""
    from pipeline import stages

    if window is None:
        raise AirflowSkipException("nothing to train in this DAG run (see plan)")
    if round_index < window["first"]:
        raise AirflowSkipException(f"round {round_index} is committed already")
    if round_index >= window["stop"]:
        first, last = window["first"], window["stop"] - 1
        these = f"round {first}" if first == last else f"rounds {first} to {last}"
        raise AirflowSkipException(f"round {round_index} is left to a later DAG run: this one trains {these} "
                                   f"(airflow.rounds_per_run)")
    return stages.begin_round(_config(ref), round_index)


@task(pool=SETTINGS.pool, pool_slots=SETTINGS.pool_slots, retries=SETTINGS.retries,
      retry_delay=timedelta(seconds=SETTINGS.retry_delay_s), map_index_template="{{ task.op_kwargs['path_id'] }}")
def train_path(ref: dict, round_index: int, path_id: str) -> dict:
    """One path's DeepSpeed job (a subprocess); a path that failed every attempt is left out. A config
    or input error fails the task without Airflow retries: another try would fail the same way."""
    from pipeline import stages
    from pipeline.errors import DipacoError

    try:
        metrics = stages.train_path(_config(ref), round_index, path_id)
    except DipacoError as exc:
        raise AirflowFailException(str(exc)) from None
    if metrics is None:
        return {"path": path_id, "trained": False}
    return {"path": path_id, "trained": True, "tokens": metrics.get("tokens"),
            "final_loss": (metrics.get("loss") or [None])[-1]}


# A path task that failed for good is left out of the average (DiLoCo); with no path trained, or
# the round skipped, there is nothing to merge.
@task(trigger_rule="all_done_min_one_success")
def merge(ref: dict, round_index: int) -> dict:
    """The outer step of this round: writes the modules of the next round."""
    from pipeline import stages

    return stages.merge(_config(ref), round_index)


@task
def evaluate(ref: dict, round_index: int) -> dict:
    """Routed perplexity of what this round's merge wrote: the modules round R+1 starts from."""
    from pipeline import stages

    return stages.evaluate(_config(ref), round_index + 1)


@task
def register(ref: dict, round_index: int, result: dict) -> str | None:
    """Registers the modules round R+1 starts from as a model version (tagged dipaco.round=R+1)."""
    from pipeline import stages

    return stages.register(_config(ref), round_index + 1, result)


@task(trigger_rule="none_failed")
def report(ref: dict) -> str:
    """Plots in MLflow and the summary table that `dipaco run` ends with (in the log and the XCom)."""
    from pipeline import stages
    from pipeline.report import format_summary
    from pipeline.tracking import get_tracker

    config = _config(ref)
    summary = stages.summarize(config)
    get_tracker(config).finish(summary)
    table = format_summary(summary)
    print(table, flush=True)
    return table


@task_group
def outer_round(ref, window, round_index: int):
    """Train every path of the grid (mapped), merge into the next round's modules, evaluate, register."""
    trained = train_path.partial(ref=ref, round_index=round_index).expand(path_id=paths(ref, window, round_index))
    merged = merge(ref, round_index)
    trained >> merged
    result = evaluate(ref, round_index)
    merged >> result
    register(ref, round_index, result)


@dag(
    dag_id="dipaco_train",
    schedule=SETTINGS.schedule,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["dipaco"],
    params={
        # The bounds of pipeline.config.check_dag_params, as the JSON schema Airflow checks on trigger.
        "config": Param(DEFAULT_CONFIG, type="string", minLength=1, maxLength=4096,
                        description="the run's YAML config"),
        "overrides": Param([], type="array", maxItems=256,
                           items={"type": "string", "maxLength": 65536, "pattern": r"^[A-Za-z_][\w.]*="},
                           description="key.path=value overrides, as `dipaco --set`"),
        "project_dir": Param(str(PROJECT_DIR), type="string", minLength=1, maxLength=4096,
                             description="where relative paths resolve"),
    },
    doc_md=__doc__,
)
def dipaco_train():
    ref = configure()
    prepared = prepare(ref)
    window = plan(ref)
    prepared >> window
    previous = evaluate_initial(ref)
    window >> previous
    for k in range(ROUNDS):
        done = outer_round.override(group_id=f"round_{k}")(ref, window, k)
        previous >> done
        previous = done
    previous >> report(ref)


dipaco_train()

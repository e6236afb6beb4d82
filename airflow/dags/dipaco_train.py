"""dipaco_train: the pipeline as an Airflow DAG. Wiring only: every task calls the function the
`dipaco` CLI calls (pipeline.stages), so a DAG run and `dipaco run` do the same work.

    configure -> prepare -> plan -> round_0 [paths -> train_path x n (mapped) -> merge -> evaluate
    -> register] -> round_1 [...] -> ... -> report

Each scheduled run continues from the last committed round and trains `airflow.rounds_per_run`
further rounds. The DAG's shape (schedule, pool, retries, number of round groups) is read from
the config named by $DIPACO_CONFIG when the file is parsed; what a run trains is read at run time
from the `config` and `overrides` params. Path trainers run the `deepspeed` launcher as a
subprocess (inside stages.train_path), so torch.distributed never starts in an Airflow worker, and
the pool `airflow.pool` caps how many run at once. Tasks pass a config reference, never data.
Nothing heavy is imported here at parse time: pipeline and torch load inside the tasks.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import Param, dag, task, task_group
from airflow.sdk.exceptions import AirflowSkipException

PROJECT_DIR = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = os.environ.get("DIPACO_CONFIG", str(PROJECT_DIR / "configs" / "demo.yaml"))


def _dag_settings():
    """The `airflow` section of the default config: what must be known when the DAG is parsed."""
    from pipeline.config import AirflowConfig, load_config

    if not Path(DEFAULT_CONFIG).is_file():
        return AirflowConfig()
    return load_config(DEFAULT_CONFIG).airflow


SETTINGS = _dag_settings()


def _config(ref: dict):
    """Load the run's config the way the CLI does, from the project directory (relative paths)."""
    from pipeline.config import load_config

    os.chdir(ref["project_dir"])
    return load_config(ref["config"], ref["overrides"])


def _this_round(round_index: int | None) -> int:
    """Round groups past this run's rounds_per_run are skipped, and so is all that follows them."""
    if round_index is None:
        raise AirflowSkipException("this DAG run trains fewer rounds")
    return round_index


@task
def configure(params: dict | None = None) -> dict:
    """Validate the config, write run.yaml and round 0 (stages.init_run), log it to MLflow."""
    from pipeline import stages
    from pipeline.config import check_dag_params
    from pipeline.tracking import get_tracker

    ref = check_dag_params({k: params[k] for k in ("config", "overrides", "project_dir")})
    config = _config(ref)
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


@task(trigger_rule="none_failed", multiple_outputs=True)
def plan(ref: dict, slots: int) -> dict:
    """The rounds this DAG run trains: rounds_per_run of them, from the first uncommitted one."""
    from pipeline import stages
    from pipeline.errors import ConfigError

    config = _config(ref)
    wanted = config.airflow.rounds_per_run
    if wanted > slots:
        raise ConfigError(f"{config.source}: airflow.rounds_per_run={wanted} but this DAG was parsed with "
                          f"{slots} round groups; set it in $DIPACO_CONFIG ({DEFAULT_CONFIG}) too")
    first = stages.next_round(config)
    return {f"round_{k}": first + k if k < wanted else None for k in range(slots)}


@task
def paths(ref: dict, round_index: int | None) -> list[str]:
    from pipeline import stages

    _this_round(round_index)
    return stages.list_paths(_config(ref))


@task(pool=SETTINGS.pool, pool_slots=SETTINGS.pool_slots, retries=SETTINGS.retries,
      retry_delay=timedelta(seconds=SETTINGS.retry_delay_s))
def train_path(ref: dict, round_index: int, path_id: str) -> dict:
    """One path's DeepSpeed job (a subprocess); a path that failed every attempt is left out."""
    from pipeline import stages

    metrics = stages.train_path(_config(ref), round_index, path_id)
    if metrics is None:
        return {"path": path_id, "trained": False}
    return {"path": path_id, "trained": True, "tokens": metrics.get("tokens"),
            "final_loss": (metrics.get("loss") or [None])[-1]}


# A path task that failed for good is left out of the average (DiLoCo); with no path trained, or
# the round skipped, there is nothing to merge.
@task(trigger_rule="all_done_min_one_success")
def merge(ref: dict, round_index: int) -> dict:
    from pipeline import stages

    return stages.merge(_config(ref), round_index)


@task
def evaluate(ref: dict, round_index: int) -> dict:
    """Routed perplexity of what the merge produced: the modules at the start of the next round."""
    from pipeline import stages

    return stages.evaluate(_config(ref), round_index + 1)


@task
def register(ref: dict, round_index: int, result: dict) -> str | None:
    from pipeline import stages

    return stages.register(_config(ref), round_index + 1, result)


@task(trigger_rule="none_failed")
def report(ref: dict) -> dict:
    """Plots and the run summary in MLflow (what `dipaco run` ends with)."""
    from pipeline import stages
    from pipeline.tracking import get_tracker

    config = _config(ref)
    summary = stages.summarize(config)
    get_tracker(config).finish(summary)
    return {"rounds_committed": summary["rounds_committed"]}


@task_group
def outer_round(ref, round_index):
    """Train every path of the grid (mapped), merge, evaluate, register."""
    trained = train_path.partial(ref=ref, round_index=round_index).expand(path_id=paths(ref, round_index))
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
    rounds = plan(ref, SETTINGS.rounds_per_run)
    prepared >> rounds
    previous = rounds
    for k in range(SETTINGS.rounds_per_run):
        done = outer_round.override(group_id=f"round_{k}")(ref, rounds[f"round_{k}"])
        previous >> done
        previous = done
    previous >> report(ref)


dipaco_train()

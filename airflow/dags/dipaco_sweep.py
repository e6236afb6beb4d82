"""dipaco_sweep: `dipaco sweep` as an Airflow DAG. Wiring only: every task calls the function the CLI
calls (pipeline.sweep), so a DAG run and `dipaco sweep` train, fit and log the same things.

    plan -> train_point x N (mapped over the sweep's points, pooled) -> fit

`plan` reads the sweep file (every point built and checked), writes sweep.json, starts the sweep's
MLflow run and prepares the shared data once per data, router and tokenizer config. `train_point`
is mapped over the point ids, each shown by its id: one normal run (stages.run, on its own islands)
per task, claimed under the point's lease (pipeline.scaling.point_queue: a retry of a task whose
first try still runs somewhere waits for it instead of training beside it) and committed under
points/<id>/; a committed point returns its result without training, so clearing or rerunning the
DAG resumes the sweep. `fit` fits the laws, writes fit.json, the plots and
points.csv, logs it all to MLflow and returns the report `dipaco sweep` prints.

The sweep file is the deployer's ($DIPACO_SWEEP, default configs/sweep.yaml), never a trigger's; a
trigger may only ask for its quick section (param `quick`). Nothing heavy is imported at parse time.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

from airflow.sdk import Param, dag, task

PROJECT_DIR = Path(__file__).resolve().parents[2]
SWEEP = os.environ.get("DIPACO_SWEEP", str(PROJECT_DIR / "configs" / "sweep.yaml"))
POOL = os.environ.get("DIPACO_SWEEP_POOL", "dipaco_paths")  # points at once: the islands' pool


def _plan(quick: bool):
    """The sweep and its points, read as the CLI reads them (relative paths from the project)."""
    from pipeline import sweep

    os.chdir(PROJECT_DIR)
    return sweep.plan(SWEEP, quick)


@task
def plan(params: dict | None = None) -> list[str]:
    """Check the sweep, start its MLflow run, prepare its data; the ids of its points."""
    from pipeline import sweep

    spec, points = _plan(bool(params["quick"]))
    sweep.start(spec, points)
    sweep.prepare_data(spec, points)
    return [p.id for p in points]


@task(pool=POOL, map_index_template="{{ task.op_kwargs['point_id'] }}")
def train_point(point_id: str, params: dict | None = None) -> dict:
    """One point's run (or its committed result): final bits per byte and seconds."""
    from pipeline import sweep

    spec, points = _plan(bool(params["quick"]))
    result = sweep.train_point(spec, points, point_id)
    if result is None:
        raise RuntimeError(f"sweep point {point_id} was given up after train.max_attempts failed attempts")
    return {
        "id": result["id"],
        "N": result["N"],
        "bits_per_byte": result["bits_per_byte"],
        "seconds": result["seconds"],
    }


@task(show_return_value_in_logs=False)  # the report is printed once, below
def fit(results: list[dict], params: dict | None = None) -> str:
    """The laws, fit.json, plots and points.csv, all logged to MLflow; the report `dipaco sweep` prints."""
    from pipeline import sweep
    from pipeline.scaling.report import format_report

    spec, points = _plan(bool(params["quick"]))
    text = format_report(sweep.finish(spec, points))
    print(text, flush=True)
    return text


@dag(
    dag_id="dipaco_sweep",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["dipaco"],
    params={"quick": Param(False, type="boolean", description="the sweep file's quick section (tiny sizes)")},
    doc_md=__doc__,
)
def dipaco_sweep():
    fit(train_point.expand(point_id=plan()))


dipaco_sweep()

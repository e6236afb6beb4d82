"""The Airflow DAG: it parses cleanly (or fails in one line naming a bad $DIPACO_CONFIG), has the
promised shape (one task group per round, named after it), and real dag.test() runs on a tiny
config (SQLite metadata DB) train a round, merge, evaluate and register a model version, end with
the summary table, and train nothing once every round of train.rounds is committed."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO

# Airflow reads its configuration when first imported: point it at a private home and SQLite DB,
# with no example DAGs, before anything imports it. The DAG's parse-time settings come from
# $DIPACO_CONFIG: tiny.yaml (train.rounds 2: two round groups), a test pool and a schedule.
AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="dipaco-airflow-"))
atexit.register(shutil.rmtree, AIRFLOW_HOME, ignore_errors=True)
DAGS = REPO / "airflow" / "dags"
DAG_CONFIG = AIRFLOW_HOME / "dipaco.yaml"
POOL = "dipaco_test_paths"
_raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
_raw["airflow"] = {"schedule": "@daily", "rounds_per_run": 2, "pool": POOL, "retries": 1, "retry_delay_s": 5}
DAG_CONFIG.write_text(yaml.safe_dump(_raw))
os.environ.update({
    "AIRFLOW_HOME": str(AIRFLOW_HOME),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{AIRFLOW_HOME}/airflow.db",
    "DIPACO_CONFIG": str(DAG_CONFIG),
})

ROUND_TASKS = ["paths", "train_path", "merge", "evaluate", "register"]


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


@pytest.fixture(scope="module")
def dag(dagbag):
    return dagbag.dags["dipaco_train"]


@pytest.fixture(scope="module")
def airflow_db():
    """`airflow db migrate` in-process (~4 s), plus the pool that caps path trainers."""
    from airflow.models.pool import Pool
    from airflow.utils import db

    db.initdb()
    Pool.create_or_update_pool(POOL, slots=2, description="dipaco path trainers", include_deferred=False)


def test_dag_folder_imports_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert list(dagbag.dags) == ["dipaco_train"]
    assert not (DAGS.parent / "__init__.py").exists()  # would shadow the airflow package


def test_a_wrong_dipaco_config_fails_the_parse_in_one_line(tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    bad_key = tmp_path / "bad.yaml"
    bad_key.write_text("train:\n  roundz: 3\n")
    for config, why in ((tmp_path / "missing.yaml", "cannot read config file"), (bad_key, "unknown key train.roundz")):
        monkeypatch.setenv("DIPACO_CONFIG", str(config))
        errors = DagBag(dag_folder=str(DAGS)).import_errors
        (error,) = errors.values()
        message = error.strip().splitlines()[-1]  # the error itself, under Airflow's short traceback
        assert message.startswith(f"pipeline.errors.ConfigError: $DIPACO_CONFIG: {config}: {why}"), message
        assert "pipeline/config.py" not in error  # raised by the DAG file: no frames from deep inside


def test_task_graph_wires_prepare_rounds_and_report(dag):
    downstream = {t.task_id: set(t.downstream_task_ids) for t in dag.tasks}
    expected = {"configure", "prepare", "plan", "evaluate_initial", "report"} | \
        {f"round_{k}.{t}" for k in (0, 1) for t in ROUND_TASKS}
    assert set(downstream) == expected
    assert "plan" in downstream["prepare"] and "prepare" in downstream["configure"]
    assert {"evaluate_initial", "round_0.paths", "round_1.paths"} <= downstream["plan"]
    assert downstream["evaluate_initial"] == {"round_0.paths"}  # round 0 is scored before training
    for k in (0, 1):
        group = f"round_{k}"
        assert downstream[f"{group}.paths"] == {f"{group}.train_path"}
        assert downstream[f"{group}.train_path"] == {f"{group}.merge"}
        assert downstream[f"{group}.merge"] == {f"{group}.evaluate"}
        assert downstream[f"{group}.evaluate"] == {f"{group}.register"}
    assert downstream["round_0.register"] == {"round_1.paths"}  # rounds run one after the other
    assert downstream["round_1.register"] == {"report"}


def test_path_trainers_are_mapped_pooled_and_retried(dag):
    from airflow.sdk.definitions.xcom_arg import XComArg

    train = dag.task_dict["round_0.train_path"]
    assert type(train).__name__ == "DecoratedMappedOperator"
    mapped = train.op_kwargs_expand_input.value
    assert list(mapped) == ["path_id"] and isinstance(mapped["path_id"], XComArg)
    assert mapped["path_id"].operator.task_id == "round_0.paths"
    assert sorted(train.partial_kwargs["op_kwargs"]) == ["ref", "round_index"]  # constants in .partial()
    for k in (0, 1):  # each group trains the round it is named after
        assert dag.task_dict[f"round_{k}.train_path"].partial_kwargs["op_kwargs"]["round_index"] == k
    assert (train.pool, train.pool_slots, train.retries, train.retry_delay.total_seconds()) == (POOL, 1, 1, 5)
    assert dag.task_dict["round_0.merge"].trigger_rule == "all_done_min_one_success"
    assert dag.catchup is False and dag.max_active_runs == 1
    assert dag.timetable.expression == "0 0 * * *"  # @daily
    assert set(dag.params) == {"config", "overrides", "project_dir"}


def task_states(run) -> dict[tuple[str, int], str]:
    from airflow.models.taskinstance import TaskInstance
    from airflow.settings import Session

    with Session() as session:
        tis = session.query(TaskInstance).filter(TaskInstance.run_id == run.run_id).all()
        return {(ti.task_id, ti.map_index): ti.state for ti in tis}


def xcom(run, task_id: str):
    from airflow.models.xcom import XComModel
    from airflow.settings import Session

    with Session() as session:
        row = session.query(XComModel).filter(XComModel.run_id == run.run_id, XComModel.task_id == task_id).one()
        return XComModel.deserialize_value(row)


@pytest.mark.slow  # ~60 s: dag.test() starts an in-process API server (~8 s), Beam, 4 path trainers
def test_dag_test_trains_a_round_and_registers_a_version(dag, airflow_db, tmp_path, monkeypatch):
    from airflow.models.taskinstance import TaskInstance
    from airflow.sdk.exceptions import AirflowSkipException
    from airflow.settings import Session
    from mlflow.tracking import MlflowClient
    from test_registry import write_c4

    from models.grid import all_path_ids
    from pipeline import layout
    from pipeline.config import load_config
    from pipeline.storage import RunRoot
    from pipeline.tracking import tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = write_c4(tmp_path / "c4")
    overrides = [
        f"run_root={tmp_path / 'run'}", "model.vocab_size=50257", f"data.train={data['train']}",
        f"data.eval={data['eval']}", "train.launcher=inprocess", "train.inner_steps=2", "eval.max_docs=4",
        "mlflow.enabled=true", "mlflow.experiment=test-dag", "airflow.rounds_per_run=1",
    ]
    run = dag.test(run_conf={"config": str(DAG_CONFIG), "overrides": overrides, "project_dir": str(REPO)})
    assert run.state == "success"

    states = task_states(run)
    # one mapped trainer per path of the [2, 2] grid, all done, each shown by its path id
    trainers = sorted(m for (t, m) in states if t == "round_0.train_path")
    assert trainers == [0, 1, 2, 3]
    assert {states[("round_0.train_path", m)] for m in trainers} == {"success"}
    with Session() as session:
        labels = [ti.rendered_map_index for ti in session.query(TaskInstance).filter(
            TaskInstance.run_id == run.run_id, TaskInstance.task_id == "round_0.train_path")]
    assert sorted(labels) == all_path_ids([2, 2])
    for name in ("configure", "prepare", "plan", "evaluate_initial", "round_0.merge", "round_0.evaluate",
                 "round_0.register", "report"):
        assert states[(name, -1)] == "success", name
    # rounds_per_run=1: round 1's group is left to the next DAG run, skipped, not failed
    assert {s for (t, _), s in states.items() if t.startswith("round_1.")} == {"skipped"}

    config = load_config(DAG_CONFIG, overrides)
    root = RunRoot(config.run_root)
    assert root.is_committed(layout.round_dir(0)) and not root.exists(layout.modules_dir(2))
    assert root.exists(layout.eval_file(0)) and root.exists(layout.eval_file(1))  # round 0 scored, as `dipaco run` does
    assert sorted(n.split("=", 1)[1] for n in root.listdir(layout.round_dir(0) + "/paths")) == all_path_ids([2, 2])
    client = MlflowClient(tracking_uri=tracking_uri(config), registry_uri=tracking_uri(config))
    (version,) = client.search_model_versions(f"name = '{config.mlflow.registered_model}'")
    assert version.tags["dipaco.round"] == "1"
    assert str(client.get_model_version_by_alias(config.mlflow.registered_model, "champion").version) == "1"
    # the DAG run ends with the table `dipaco run` prints
    table = xcom(run, "report")
    assert "round(s) of train.rounds=2 committed" in table and "models:/" in table
    assert [line.split()[0] for line in table.splitlines()[3:5]] == ["0", "1"]

    # the next scheduled run continues from the first uncommitted round
    ref = {"config": str(DAG_CONFIG), "overrides": overrides, "project_dir": str(REPO)}
    assert dag.task_dict["plan"].python_callable(ref) == {"first": 1, "stop": 2}

    # once every round of train.rounds is committed a DAG run trains nothing and says why
    done = [*overrides, "train.rounds=1"]
    with pytest.raises(AirflowSkipException, match="nothing to train.*raise train.rounds to continue"):
        dag.task_dict["plan"].python_callable({**ref, "overrides": done})
    before = sorted(p.relative_to(root.local_path()) for p in root.local_path().rglob("*") if "mlflow" not in str(p))
    again = dag.test(run_conf={"config": str(DAG_CONFIG), "overrides": done, "project_dir": str(REPO)})
    assert again.state == "success"
    states = task_states(again)
    assert states[("plan", -1)] == "skipped"
    assert {s for (t, _), s in states.items() if t.startswith("round_")} == {"skipped"}
    after = sorted(p.relative_to(root.local_path()) for p in root.local_path().rglob("*") if "mlflow" not in str(p))
    assert [p for p in after if p not in before and not str(p).startswith("mlartifacts")] == []  # trained nothing
    assert len(client.search_model_versions(f"name = '{config.mlflow.registered_model}'")) == 1
    assert "raise train.rounds to train further" in xcom(again, "report")


@pytest.mark.parametrize("params, expected", [
    ({"overrides": ["beam.options=[lol]"] * 300}, "is too long"),
    ({"overrides": ["no key before the equals sign"]}, "does not match"),
    ({"overrides": ["run_root=" + "r" * 70_000]}, "is too long"),
    ({"config": ""}, "should be non-empty"),
])
def test_a_trigger_whose_params_break_the_schema_is_refused(dag, params, expected):
    """Airflow checks the params' JSON schema when a run is triggered, before any task runs;
    configure then checks them again (pipeline.config.check_dag_params) and loads the config."""
    import copy

    from airflow.sdk.exceptions import ParamValidationError

    dag.params.validate()  # the defaults pass
    changed = copy.deepcopy(dag.params)
    with pytest.raises(ParamValidationError, match=expected):
        changed.update(params)  # a ParamsDict checks each value as it is set, as a trigger does
        changed.validate()

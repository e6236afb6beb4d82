"""The Airflow DAG: it parses cleanly (or fails in one line naming a bad $DIPACO_CONFIG), has the
promised shape (islands mapped, pooled and retried; beside them one task group per round, named
after it, whose rescheduling sensor waits for the round before it registers), and real dag.test()
runs on a tiny config (SQLite metadata DB) train a round on an island, register a model version,
end with the summary table, and train nothing once every round of train.rounds is committed."""

from __future__ import annotations

import atexit
import os
import re
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import ONE_ROUND_DAG_TASKS, REPO

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
os.environ.update(
    {
        "AIRFLOW_HOME": str(AIRFLOW_HOME),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{AIRFLOW_HOME}/airflow.db",
        "DIPACO_CONFIG": str(DAG_CONFIG),
    }
)

ROUND_TASKS = ["finished", "register"]


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


@pytest.fixture(scope="module")
def dag(dagbag):
    return dagbag.dags["dipaco_train"]


@pytest.fixture(scope="module")
def airflow_db():
    """`airflow db migrate` in-process (~4 s), plus the pool that caps islands."""
    from airflow.models.pool import Pool
    from airflow.utils import db

    db.initdb()
    Pool.create_or_update_pool(POOL, slots=2, description="dipaco islands", include_deferred=False)


def test_dag_folder_imports_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert sorted(dagbag.dags) == ["dipaco_sweep", "dipaco_train"]
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
        assert message.startswith(f"pipeline.core.errors.ConfigError: $DIPACO_CONFIG: {config}: {why}"), message
        assert "pipeline/core/config.py" not in error  # raised by the DAG file: no frames from deep inside


def test_task_graph_wires_islands_beside_one_group_per_round(dag):
    downstream = {t.task_id: set(t.downstream_task_ids) for t in dag.tasks}
    expected = {"configure", "prepare", "warm_up", "plan", "evaluate_initial", "islands", "island", "export"} | {
        "report",
        *(f"round_{k}.{t}" for k in (0, 1) for t in ROUND_TASKS),
    }
    assert set(downstream) == expected  # no path-level tasks any more: islands pull them from the queue
    assert "plan" in downstream["prepare"] and {"prepare", "warm_up"} <= downstream["configure"]
    # the host's first compile beside prepare, holding nothing up
    assert downstream["warm_up"] == set() and dag.task_dict["warm_up"].upstream_task_ids == {"configure"}
    assert {"evaluate_initial", "islands", "round_0.finished", "round_1.finished"} <= downstream["plan"]
    # round 0 is scored before training; then the islands and the round groups run side by side
    assert downstream["evaluate_initial"] == {"islands", "round_0.finished"}
    assert downstream["islands"] == {"island"}
    assert downstream["island"] == {"report"}
    for k in (0, 1):
        assert downstream[f"round_{k}.finished"] == {f"round_{k}.register"}  # register once the round is in
    assert downstream["round_0.register"] == {"round_1.finished"}  # versions registered in round order
    assert downstream["round_1.register"] == {"export"}  # the final modules, as Hugging Face checkpoints
    assert downstream["export"] == {"report"} and dag.task_dict["export"].trigger_rule == "none_failed"
    report = dag.task_dict["report"]
    assert {"island", "export"} <= report.upstream_task_ids and report.trigger_rule == "none_failed"


def test_islands_are_mapped_pooled_and_retried(dag):
    from airflow.sdk.definitions.xcom_arg import XComArg

    island = dag.task_dict["island"]
    assert type(island).__name__ == "DecoratedMappedOperator"
    mapped = island.op_kwargs_expand_input.value
    assert list(mapped) == ["name"] and isinstance(mapped["name"], XComArg)
    assert mapped["name"].operator.task_id == "islands"
    assert sorted(island.partial_kwargs["op_kwargs"]) == ["ref"]  # constants in .partial()
    assert island.partial_kwargs["map_index_template"] == "{{ task.op_kwargs['name'] }}"
    assert (island.pool, island.pool_slots, island.retries, island.retry_delay.total_seconds()) == (POOL, 1, 1, 5)
    assert dag.task_dict["islands"].trigger_rule == "none_failed"  # runs when round 0 was evaluated already
    assert dag.catchup is False and dag.max_active_runs == 1
    assert dag.timetable.expression == "0 0 * * *"  # @daily
    assert set(dag.params) == {"config", "overrides", "project_dir"}


def test_islands_on_several_hosts_each_go_to_their_hosts_celery_queue(tmp_path, monkeypatch):
    """airflow.queues: one islands -> island pair per host queue, each island task on its queue
    (a worker started with `airflow celery worker --queues <queue>` runs it), named after its host."""
    from airflow.dag_processing.dagbag import DagBag

    from pipeline import stages
    from pipeline.core.config import load_config
    from pipeline.core.errors import ConfigError

    raw = {**_raw, "airflow": {**_raw["airflow"], "queues": ["host-a", "host-b"]}}
    raw["train"] = {**raw.get("train", {}), "islands": 2}
    config = tmp_path / "hosts.yaml"
    config.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("DIPACO_CONFIG", str(config))
    dag = DagBag(dag_folder=str(DAGS)).dags["dipaco_train"]
    downstream = {t.task_id: set(t.downstream_task_ids) for t in dag.tasks}
    assert "island" not in downstream and "islands" not in downstream
    for queue in ("host-a", "host-b"):
        island = dag.task_dict[f"island_{queue}"]
        assert island.queue == queue and island.pool == POOL
        assert island.op_kwargs_expand_input.value["name"].operator.task_id == f"islands_{queue}"
        assert dag.task_dict[f"islands_{queue}"].op_kwargs["queue"] == queue
        assert downstream[f"islands_{queue}"] == {f"island_{queue}"} and downstream[f"island_{queue}"] == {"report"}
        assert f"islands_{queue}" in downstream["evaluate_initial"]
        assert dag.task_dict["configure"].queue != queue  # the other tasks stay on the default queue
        warm = dag.task_dict[f"warm_up_{queue}"]  # but for the host's first compile, on its worker
        assert warm.queue == queue and warm.upstream_task_ids == {"configure"} and not warm.downstream_task_ids
    assert "warm_up" not in downstream
    loaded = load_config(config)
    assert stages.list_islands(loaded, "host-b") == ["host-b-island-0", "host-b-island-1"]
    assert stages.list_islands(loaded) == ["island-0", "island-1"]
    raw["airflow"]["queues"] = ["host-a", "host a"]
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="airflow.queues must be a non-empty list of Celery queue names"):
        load_config(config)


def test_each_round_group_waits_for_its_round_with_a_rescheduling_sensor(dag):
    from airflow.sdk import BaseSensorOperator

    for k in (0, 1):  # each group waits for the round it is named after
        sensor = dag.task_dict[f"round_{k}.finished"]
        assert isinstance(sensor, BaseSensorOperator)
        assert sensor.mode == "reschedule"  # no worker slot held, and dag.test() runs the islands between pokes
        assert 0 < sensor.poke_interval <= 60 and sensor.timeout >= 3600
        assert sensor.trigger_rule == "none_failed"  # after a skipped round group, or a skipped evaluate_initial
        assert sensor.op_kwargs["round_index"] == k
        register = dag.task_dict[f"round_{k}.register"]
        assert register.op_kwargs["round_index"] == k and register.upstream_task_ids == {"configure", sensor.task_id}
        assert register.pool != POOL  # only islands take the trainers' pool


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
        row = (
            session.query(XComModel)
            .filter(XComModel.run_id == run.run_id, XComModel.task_id == task_id, XComModel.key == "return_value")
            .one()
        )  # a dict also pushes its keys
        return XComModel.deserialize_value(row)


@pytest.mark.slow  # ~60 s: dag.test() starts an in-process API server (~8 s), Beam, an in-process island
def test_dag_test_trains_a_round_and_registers_a_version(dag, airflow_db, tmp_path, monkeypatch):
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskreschedule import TaskReschedule
    from airflow.sdk.exceptions import AirflowSkipException
    from airflow.settings import Session
    from mlflow.tracking import MlflowClient
    from test_registry import write_c4

    from models.grid import all_path_ids
    from pipeline.core.config import load_config
    from pipeline.state import layout
    from pipeline.state.storage import RunRoot
    from pipeline.tracking.uris import tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = write_c4(tmp_path / "c4")
    # what a trigger may not set (data, launcher, MLflow) is the config file's, in a folder the DAG trusts
    run_config = AIRFLOW_HOME / f"{tmp_path.name}.yaml"
    run_config.write_text(
        yaml.safe_dump(
            {
                **_raw,
                "data": {"train": data["train"], "eval": data["eval"]},
                "model": {**_raw["model"], "tokenizer": "gpt2", "vocab_size": 50257},
                "train": {**_raw["train"], "launcher": "inprocess"},
                "mlflow": {"enabled": True, "experiment": "test-dag"},
                "airflow": {**_raw["airflow"], "trigger_run_roots": str(tmp_path)},
            }
        )
    )
    overrides = [f"run_root={tmp_path / 'run'}", "train.inner_steps=2", "eval.max_docs=4", "airflow.rounds_per_run=1"]
    run = dag.test(run_conf={"config": str(run_config), "overrides": overrides, "project_dir": str(REPO)})
    assert run.state == "success"

    states = task_states(run)
    # one mapped island per train.islands (tiny: parallel_paths=2), each shown by its name; in-process
    # the first one to run does the whole plan and the other finds nothing left, both succeed
    assert sorted(m for (t, m) in states if t == "island") == [0, 1]
    assert {states[("island", m)] for m in (0, 1)} == {"success"}
    with Session() as session:
        labels = [
            ti.rendered_map_index
            for ti in session.query(TaskInstance).filter(
                TaskInstance.run_id == run.run_id, TaskInstance.task_id == "island"
            )
        ]
        # the sensor poked before the islands ran, gave its slot back, and found the round in later
        reschedules = (
            session.query(TaskReschedule)
            .join(TaskInstance, TaskReschedule.ti_id == TaskInstance.id)
            .filter(TaskInstance.run_id == run.run_id, TaskInstance.task_id == "round_0.finished")
            .count()
        )
    assert sorted(labels) == ["island-0", "island-1"]
    assert reschedules >= 1
    for name in ONE_ROUND_DAG_TASKS:
        assert states[(name, -1)] == "success", name
    assert states[("warm_up", -1)] == "skipped"  # tiny trains eagerly: nothing to compile
    # rounds_per_run=1: round 1's group is left to the next DAG run, skipped, not failed
    assert {s for (t, _), s in states.items() if t.startswith("round_1.")} == {"skipped"}

    config = load_config(run_config, overrides)
    root = RunRoot(config.run_root)
    assert root.is_committed(layout.round_dir(0)) and not root.exists(layout.modules_dir(2))
    assert root.exists(layout.eval_file(0)) and root.exists(layout.eval_file(1))  # round 0 scored, as `dipaco run` does
    assert sorted(n.split("=", 1)[1] for n in root.listdir(layout.round_dir(0) + "/paths")) == all_path_ids([2, 2])
    client = MlflowClient(tracking_uri=tracking_uri(config), registry_uri=tracking_uri(config))
    (version,) = client.search_model_versions(f"name = '{config.mlflow.registered_model}'")
    assert version.tags["dipaco.round"] == "1"
    registered = xcom(run, "round_0.register")  # what the group registered, from report_round
    assert registered["round"] == 1 and registered["model_version"] == str(version.version)
    assert registered["perplexity"] == pytest.approx(root.read_json(layout.eval_file(1))["perplexity"])
    assert str(client.get_model_version_by_alias(config.mlflow.registered_model, "champion").version) == "1"
    # the DAG run ends with the table `dipaco run` prints
    table = xcom(run, "report")
    assert "round(s) of train.rounds=2 committed" in table and "models:/" in table
    assert [line.split()[0] for line in table.splitlines()[3:5]] == ["0", "1"]

    # the next scheduled run continues from the first uncommitted round
    ref = {"config": str(run_config), "overrides": overrides, "project_dir": str(REPO)}
    assert dag.task_dict["plan"].python_callable(ref) == {"first": 1, "stop": 2}

    # once every round of train.rounds is committed a DAG run trains nothing and says why
    done = [*overrides, "train.rounds=1"]
    with pytest.raises(AirflowSkipException, match="nothing to train.*raise train.rounds to continue"):
        dag.task_dict["plan"].python_callable({**ref, "overrides": done})
    before = sorted(p.relative_to(root.local_path()) for p in root.local_path().rglob("*") if "mlflow" not in str(p))
    again = dag.test(run_conf={"config": str(run_config), "overrides": done, "project_dir": str(REPO)})
    assert again.state == "success"
    states = task_states(again)
    assert states[("plan", -1)] == "skipped"
    assert {s for (t, _), s in states.items() if t.startswith(("round_", "island"))} == {"skipped"}
    after = sorted(p.relative_to(root.local_path()) for p in root.local_path().rglob("*") if "mlflow" not in str(p))
    new = [p for p in after if p not in before and not str(p).startswith("mlartifacts")]
    # trained nothing; the export task did write train.rounds=1's final modules, which the first run had not reached
    assert [p for p in new if not str(p).startswith("exports")] == [] and root.exists("exports/round=1/export.json")
    assert len(client.search_model_versions(f"name = '{config.mlflow.registered_model}'")) == 1
    assert "raise train.rounds to train further" in xcom(again, "report")
    # nor does a host compile for it: with train.compile on, the warm-up is skipped before it starts
    compiled = AIRFLOW_HOME / f"{tmp_path.name}-compiled.yaml"
    raw = yaml.safe_load(run_config.read_text())
    compiled.write_text(yaml.safe_dump({**raw, "train": {**raw["train"], "compile": True}}))
    with pytest.raises(AirflowSkipException, match="nothing to train.*raise train.rounds to continue"):
        dag.task_dict["warm_up"].python_callable({**ref, "config": str(compiled), "overrides": done})


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"overrides": ["beam.options=[lol]"] * 300}, "is too long"),
        ({"overrides": ["no key before the equals sign"]}, "does not match"),
        ({"overrides": ["run_root=" + "r" * 70_000]}, "is too long"),
        ({"config": ""}, "should be non-empty"),
    ],
)
def test_a_trigger_whose_params_break_the_schema_is_refused(dag, params, expected):
    """Airflow checks the params' JSON schema when a run is triggered, before any task runs;
    configure then checks them again (pipeline.core.config.check_dag_params) and loads the config."""
    import copy

    from airflow.sdk.exceptions import ParamValidationError

    dag.params.validate()  # the defaults pass
    changed = copy.deepcopy(dag.params)
    with pytest.raises(ParamValidationError, match=expected):
        changed.update(params)  # a ParamsDict checks each value as it is set, as a trigger does
        changed.validate()


@pytest.mark.parametrize(
    "override",
    [
        "beam.runner=os.getcwd",
        "mlflow.tracking_uri=http://127.0.0.1:1",
        "beam.options=['--environment_type=beam:env:harness_subprocess_python:v1', '--environment_config=id>pwned']",
    ],
)
def test_a_trigger_that_would_run_code_is_refused_by_configure_before_anything_runs(dag, tmp_path, override):
    """The first task refuses an override outside the allow-list (pipeline.core.trust) before it
    loads the config: no run root, no Beam, no MLflow."""
    from pipeline.core.errors import ConfigError

    params = {
        "config": str(DAG_CONFIG),
        "project_dir": str(REPO),
        "overrides": [f"run_root={tmp_path / 'run'}", override],
    }
    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError, match=rf"overrides\[1\]: a DAG trigger may not set '{key}'"):
        dag.task_dict["configure"].python_callable(params=params)
    assert not (tmp_path / "run").exists()
    for config in ("/etc/passwd", "tests/data/c4/train/c4-train.00000-of-00002.json"):  # JSON lines parse as YAML
        with pytest.raises(ConfigError, match="outside the directories this DAG trusts"):
            dag.task_dict["configure"].python_callable(params={**params, "config": config, "overrides": []})


def test_the_sweep_dag_maps_one_pooled_task_per_point_between_plan_and_fit(dagbag):
    """dipaco_sweep only wires pipeline.sweep: plan -> train_point (mapped over the point ids) -> fit."""
    sweep = dagbag.dags["dipaco_sweep"]
    assert set(sweep.task_dict) == {"plan", "train_point", "fit"}
    point = sweep.task_dict["train_point"]
    assert point.upstream_task_ids == {"plan"} and point.downstream_task_ids == {"fit"}
    assert point.pool == "dipaco_paths" and "point_id" in point.map_index_template
    assert sweep.params["quick"] is False


def documented_trigger() -> list[str]:
    """The `airflow dags trigger` command docs/operations.md prints, as argv after `airflow`."""
    text = (REPO / "docs" / "operations.md").read_text().replace("\\\n", " ")
    line = re.search(r"^.*\.venv/bin/airflow dags trigger .*$", text, flags=re.M).group(0)
    argv = shlex.split(line.split("&&", 1)[1], comments=True)
    assert argv[0] == ".venv/bin/airflow", argv
    return argv[1:]


def test_the_documented_trigger_prints_the_new_run_one_field_a_line(dag, airflow_db, capsys):
    """The command the docs and `make services` print: Airflow's default output is a table of the
    run's 12 fields, 200 columns wide (garbage once a terminal wraps its cells); the command asks
    for yaml, one field a line, which fits 80 columns."""
    from airflow.cli import cli_parser
    from airflow.models.dagrun import DagRun
    from airflow.settings import Session

    sys.path.insert(0, str(REPO / "scripts"))
    import services  # scripts/services.py: what `make services` prints

    argv = documented_trigger()
    assert shlex.split(services.TRIGGER)[1:] == argv  # one command, printed twice
    parser = cli_parser.get_parser()
    for command in (["dags", "reserialize"], argv):  # as a DAG processor would, then the trigger
        capsys.readouterr()
        args = parser.parse_args(command)
        args.func(args)
    out = capsys.readouterr().out  # Airflow's own log lines (a timestamp first), then the run
    printed = "".join(line for line in out.splitlines(True) if not re.match(r"\d{4}-\d\d-\d\dT", line))
    assert max(len(line) for line in printed.splitlines()) <= 80, printed
    (run,) = yaml.safe_load(printed)
    assert run["dag_id"] == "dipaco_train" and run["conf"] == {"overrides": ["run_root=runs/services-dag"]}
    with Session() as session:  # the queued run goes: the DAG's other tests start from no run
        session.query(DagRun).filter(DagRun.run_id == run["dag_run_id"]).delete()
        session.commit()

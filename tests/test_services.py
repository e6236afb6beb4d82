"""The pipeline on real services, on loopback: the Beam job on a Dask cluster, a tiny run tracked by
an `mlflow server` on PostgreSQL, and a DAG run on an Airflow deployment (PostgreSQL, the
CeleryExecutor with Redis). Every process a test starts is stopped by its pid in a finally, and
every test that needs a database creates and drops its own. Where PostgreSQL or Redis cannot be
reached, those tests skip with a line naming what is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from contextlib import closing
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from conftest import ONE_ROUND_DAG_TASKS, REPO, dipaco_run, run_script_json, tiny_config, wait_for
from pipeline.core.errors import ConfigError
from pipeline.state import layout
from preprocessing import progress
from preprocessing.prepare import DASK_RUNNER, make_runner, pipeline_options, run_prepare

sys.path.insert(0, str(REPO / "scripts"))
import services as svc  # noqa: E402  (scripts/services.py: what `make services` runs)

BAD_LINES = b'{not json\n{"url": "https://example.com/no-text"}\n[1, 2, 3]\n'


def tree_digest(root: Path, rel: str) -> dict[str, str]:
    """sha256 of every file under root/rel but the _SUCCESS markers (commit times) and the
    manifest (its "seconds"; compared as data)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / rel).rglob("*"))
        if p.is_file() and p.name not in ("_SUCCESS", "manifest.json")
    }


def stop_pids(pids: list[int]) -> None:
    """SIGKILL whatever of these processes is still alive (after a clean stop, nothing is)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- Beam on Dask --------------------------------------------------------------------------------
def test_dask_runner_is_accepted_by_name_and_by_class_and_a_bad_runner_is_one_line():
    from apache_beam.runners.dask.dask_runner import DaskRunner

    config = tiny_config(Path("/tmp/unused"), "beam.runner=DaskRunner", "beam.options=[]")
    options = pipeline_options(config)
    assert isinstance(make_runner("DaskRunner", options), DaskRunner)
    assert isinstance(make_runner(DASK_RUNNER, options, extra=[DASK_RUNNER]), DaskRunner)  # a class path, listed
    with pytest.raises(ConfigError, match=r"tiny.yaml: beam.runner must be one of DirectRunner.*got 'os.getcwd'"):
        make_runner("os.getcwd", options, config.source)  # refused before Beam imports it
    with pytest.raises(ConfigError, match=r"tiny.yaml: beam.runner 'NoSuchRunner' cannot be created") as err:
        make_runner("NoSuchRunner", options, config.source, extra=["NoSuchRunner"])
    assert "\n" not in str(err.value)


@pytest.fixture
def dask_cluster():
    """A distributed.LocalCluster of 2 worker processes (1 thread each) on 127.0.0.1."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None)
    pids = []
    try:
        with Client(cluster) as client:
            pids = list(client.run(os.getpid).values())
        assert len(pids) == 2
        yield cluster.scheduler_address
    finally:
        cluster.close()
        stop_pids(pids)


@pytest.mark.slow  # ~25 s (80 s on a machine loaded 4x): two prepare jobs of tiny.yaml, a 2-worker cluster
@pytest.mark.timeout(180)
def test_prepare_on_a_dask_cluster_writes_what_the_direct_runner_writes(dask_cluster, tmp_path, monkeypatch, caplog):
    from test_prepare import routed_progress

    data = tmp_path / "c4"
    shutil.copytree(REPO / "tests" / "data" / "c4" / "train", data)
    (data / "c4-train.bad.json").write_bytes(BAD_LINES)  # the rejected branch runs on the cluster too
    train = f"data.train={data}/*.json*"
    direct = run_prepare(tiny_config(tmp_path / "direct", train))
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.05)
    monkeypatch.setattr(progress, "WRITE_EVERY_S", 0.0)  # the workers get it with the job
    caplog.set_level(logging.INFO, logger="preprocessing")
    caplog.clear()
    start = time.time()
    dask = run_prepare(
        tiny_config(
            tmp_path / "dask",
            train,
            "beam.runner=DaskRunner",
            f"beam.options=['--dask_client_address={dask_cluster}', '--dask_npartitions=2']",
        )
    )

    print(f"prepare on Dask: {time.time() - start:.1f}s")
    assert direct.pop("seconds") > 0 and dask.pop("seconds") > 0
    assert dask == direct
    assert dask["rejected"] == 3 and dask["routed"] > 100
    # the Dask workers' log lines never reach this process: their progress comes through files
    counts = routed_progress(caplog.text)
    assert counts and counts == sorted(counts) and counts[-1] == (dask["routed"], dask["lines_read"])
    for rel in (layout.ROUTER_DIR, layout.SHARDS_DIR):
        assert (tmp_path / "dask" / rel / "_SUCCESS").is_file()
        direct_files = tree_digest(tmp_path / "direct", rel)
        assert tree_digest(tmp_path / "dask", rel) == direct_files
    assert sum(1 for name in direct_files if name.endswith(".parquet")) == 8  # 4 paths x 2 splits
    assert any("rejected" in name for name in direct_files)


# -- shared by the PostgreSQL-backed services ----------------------------------------------------
PG_URL = os.environ.get("DIPACO_PG_URL", "postgresql://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("DIPACO_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def require(redis: bool = False) -> None:
    reason = svc.missing_backends(PG_URL, REDIS_URL if redis else None)
    if reason:
        pytest.skip(f"needs {reason}")


@pytest.fixture
def pg_database():
    """A PostgreSQL database of this test's own, dropped afterwards."""
    require()
    name = f"dipaco_test_{uuid.uuid4().hex[:12]}"
    svc.create_database(PG_URL, name)
    try:
        yield name
    finally:
        svc.drop_database(PG_URL, name)


@pytest.fixture
def pg_service(pg_database, tmp_path):
    """The server URL of a role of the test database's own, its owner, with a password (what
    `make services` gives each service: svc.service_database), instead of the superuser."""
    url = svc.service_database(PG_URL, pg_database, tmp_path / "secrets")
    try:
        yield url
    finally:
        svc.drop_database(PG_URL, pg_database)  # a role that owns a database cannot be dropped
        svc.drop_role(PG_URL, pg_database)


@pytest.fixture
def deployment():
    """The processes a test starts; every process group stopped by its pid at the end."""
    started = svc.Deployment()
    try:
        yield started
    finally:
        svc.stop(started.pids)
        assert not [s.name for s in started.services if svc.alive(s.pid)]


def loopback_only(deployment) -> list[str]:
    """Every socket the deployment's processes (and their children) listen on, unless on 127.0.0.1."""
    import psutil

    wide = []
    for pid in deployment.pids:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            try:
                sockets = proc.net_connections(kind="inet")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            wide += [
                f"{proc.name()} {c.laddr.ip}:{c.laddr.port}"
                for c in sockets
                if c.status == psutil.CONN_LISTEN and c.laddr.ip != "127.0.0.1"
            ]
    return wide


def private_files(folder: Path) -> dict[str, str]:
    """Mode of every file in a secrets folder that anyone but its owner could read."""
    return {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir() if p.stat().st_mode & 0o077}


def http_status(url: str, headers: dict | None = None) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def query(database: str, sql: str, *args) -> list[tuple]:
    import psycopg2

    with closing(psycopg2.connect(svc.database_url(PG_URL, database))) as conn, conn.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchall()


# -- MLflow server -------------------------------------------------------------------------------
@pytest.mark.slow  # ~65 s (210 s loaded 4x): the server and its PostgreSQL migrations, a one-round run
@pytest.mark.timeout(400)
def command_lines_holding(secret: str) -> list[int]:
    """The pids whose command line (/proc/<pid>/cmdline: readable by every local user) holds `secret`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and secret.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return found


def test_a_run_tracked_by_an_mlflow_server_on_postgresql_registers_a_model_that_loads_over_http(
    pg_database, pg_service, deployment, tmp_path
):
    import base64

    from test_registry import PROMPTS, write_c4

    artifacts, keys = tmp_path / "server-artifacts", tmp_path / "secrets"
    uri = svc.start_mlflow(deployment, pg_service, pg_database, artifacts, svc.free_port(), tmp_path / "logs", keys)
    credentials = svc.mlflow_credentials(keys)
    search = f"{uri}/api/2.0/mlflow/experiments/search?max_results=1"
    basic = base64.b64encode(
        f"{credentials['MLFLOW_TRACKING_USERNAME']}:{credentials['MLFLOW_TRACKING_PASSWORD']}".encode()
    )
    assert http_status(search) == 401  # the basic-auth app: nothing without credentials
    assert http_status(search, {"Authorization": f"Basic {basic.decode()}"}) == 200
    assert private_files(keys) == {} and loopback_only(deployment) == []
    role_password = urlsplit(pg_service).password  # in the store URI: through the environment only
    assert role_password and command_lines_holding(role_password) == []
    data = write_c4(tmp_path / "c4")
    name = "dipaco-services"
    overrides = [
        f"run_root={tmp_path / 'run'}",
        f"data.train={data['train']}",
        f"data.eval={data['eval']}",
        "train.launcher=inprocess",
        "train.rounds=1",
        "train.inner_steps=2",
        "eval.max_docs=4",
        "mlflow.enabled=true",
        f"mlflow.tracking_uri={uri}",
        "mlflow.experiment=services",
        f"mlflow.registered_model={name}",
    ]
    env = {**svc.base_env(), "OMP_NUM_THREADS": "1", **credentials}  # the pipeline logs in as MLflow's client does
    env.pop("MLFLOW_TRACKING_URI", None)
    dipaco_run(overrides, REPO, env)

    # the server's PostgreSQL store holds the runs and the registry; its artifact store the files
    assert not (tmp_path / "run" / "mlflow.db").exists()
    assert query(pg_database, "SELECT count(*) FROM runs")[0][0] >= 4  # parent, prepare, round, paths...
    # the server's store belongs to its own password-protected role, not to the superuser
    assert query(pg_database, "SELECT tableowner FROM pg_tables WHERE tablename = 'runs'") == [(pg_database,)]
    assert query(
        pg_database, "SELECT rolsuper, rolpassword IS NOT NULL FROM pg_authid WHERE rolname = %s", pg_database
    ) == [(False, True)]
    assert query(pg_database, "SELECT version FROM model_versions WHERE name = %s", name) == [(1,)]
    assert query(
        pg_database, "SELECT version FROM registered_model_aliases WHERE name = %s AND alias = 'champion'", name
    ) == [(1,)]
    assert list(artifacts.rglob("MLmodel")) and list(artifacts.rglob("router.json"))

    # a fresh process that knows only the server's address loads the champion and generates
    script = (
        "import json, sys, mlflow\n"
        f"model = mlflow.pyfunc.load_model('models:/{name}@champion')\n"
        "print(json.dumps(model.predict(json.loads(sys.argv[1]), params={'max_new_tokens': 4})))\n"
    )
    fresh = {**env, "MLFLOW_TRACKING_URI": uri, "TMPDIR": str(tmp_path)}  # MLflow's download stays there
    texts = run_script_json(script, PROMPTS, tmp_path, fresh)
    assert len(texts) == len(PROMPTS) and all(isinstance(t, str) and t for t in texts)


# -- Airflow: PostgreSQL, CeleryExecutor on Redis ------------------------------------------------
DAG_ID = "dipaco_train"
POOL, POOL_SLOTS, CONCURRENCY = "dipaco_services_paths", 2, 3  # the pool, not the worker, must cap islands


class AirflowApi:
    """The public REST API of the deployment's api-server (simple auth manager, its admin)."""

    def __init__(self, address: str, password: str):
        self.address, self.token = address, None
        self.token = self.call("POST", "/auth/token", {"username": svc.AIRFLOW_ADMIN, "password": password}, api=False)[
            "access_token"
        ]

    def call(self, method: str, path: str, body: dict | None = None, api: bool = True):
        import urllib.request

        request = urllib.request.Request(
            f"{self.address}{'/api/v2' if api else ''}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {self.token}"} if api and self.token else {}),
            },
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")


def kill_an_island_holding_a_train_lease(database: str, run_id: str, run_root: Path, timeout_s: float) -> tuple:
    """SIGKILL the task process (`airflow worker -- <ti id>`; an in-process island runs in it) of the
    first island task seen running while it holds a train task's lease; returns (island, lease file)."""
    import psutil
    import psycopg2

    def holder():
        for attempt in sorted((run_root / "queue" / "leases").glob("train.*/attempt-*.json")):
            try:
                record = json.loads(attempt.read_text())
            except (OSError, ValueError):  # being replaced, or gone
                continue
            if record.get("state") != "running":
                continue
            try:
                rows = query(
                    database,
                    "SELECT id FROM task_instance WHERE run_id = %s AND task_id = 'island' "
                    "AND rendered_map_index = %s AND state = 'running'",
                    run_id,
                    record["island"],
                )
            except psycopg2.Error:
                return None
            for (ti_id,) in rows:
                for proc in psutil.process_iter(["cmdline"]):
                    if f"airflow worker -- {ti_id}" in " ".join(proc.info["cmdline"] or []):
                        proc.kill()
                        return record["island"], attempt
        return None

    return wait_for(holder, timeout_s, "an island holding a train lease to kill", every=0.2)


@pytest.mark.slow  # ~2 min (3 min loaded 4x): migrations, 5 Airflow components, a DAG run on Celery
@pytest.mark.timeout(600)
def test_airflow_on_postgresql_with_celery_runs_a_dag_run_whose_killed_island_is_retried_and_its_lease_retaken(
    pg_database, pg_service, deployment, tmp_path
):
    require(redis=True)
    dag_config = tmp_path / "dipaco.yaml"
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    # what a trigger may not set (launcher, leases, MLflow, where run roots go) is the config file's
    raw["airflow"] = {
        "rounds_per_run": 1,
        "pool": POOL,
        "retries": 1,
        "retry_delay_s": 1,
        "trigger_run_roots": str(tmp_path),
    }
    raw["train"].update(launcher="inprocess", lease_seconds=10)
    raw["mlflow"] = {"enabled": False}
    dag_config.write_text(yaml.safe_dump(raw))
    queue = f"dipaco-test-{uuid.uuid4().hex[:8]}"
    keys = tmp_path / "secrets"
    env = svc.airflow_env(
        tmp_path / "airflow", pg_service, pg_database, REDIS_URL, queue, svc.free_port(), dag_config, CONCURRENCY, keys
    )
    env["OMP_NUM_THREADS"] = "1"
    try:
        address = svc.start_airflow(deployment, env, POOL, POOL_SLOTS, queue, tmp_path / "logs")
        assert http_status(f"{address}/api/v2/dags") == 401  # no anonymous admins any more
        assert http_status(f"{address}/auth/token") in (401, 403, 405)  # nor a token for the asking
        api = AirflowApi(address, (keys / "airflow-admin-password").read_text().strip())
        assert private_files(keys) == {} and len(list(keys.iterdir())) == 6  # 5 of Airflow's, PostgreSQL's
        assert (
            len(
                {
                    env[k]
                    for k in ("AIRFLOW__API__SECRET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__CORE__FERNET_KEY")
                }
            )
            == 3
        )  # separate secrets, a Fernet key

        def dag_parsed():
            try:
                return api.call("GET", f"/dags/{DAG_ID}")
            except OSError:  # 404 until the dag processor has serialized it
                return None

        assert wait_for(dag_parsed, 120, "the parsed DAG", every=1.0)["is_paused"] is False
        assert loopback_only(deployment) == []  # the five components, the api-server included
        # in-process islands (each in its task's process), trained long enough to be caught holding a lease
        overrides = [f"run_root={tmp_path / 'run'}", "train.inner_steps=20", "eval.max_docs=4"]
        run = api.call(
            "POST",
            f"/dags/{DAG_ID}/dagRuns",
            {
                "logical_date": None,
                "conf": {"config": str(dag_config), "overrides": overrides, "project_dir": str(REPO)},
            },
        )
        run_id = run["dag_run_id"]
        killed, lease = kill_an_island_holding_a_train_lease(pg_database, run_id, tmp_path / "run", 240)

        def finished():
            state = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
            return state if state in ("success", "failed") else None

        assert wait_for(finished, 360, "a finished DAG run", every=2.0) == "success"
    finally:
        svc.clear_celery_queue(REDIS_URL, queue)

    tis = {
        (t, m): (state, tries, pool, start, end, label)
        for t, m, state, tries, pool, start, end, label in query(
            pg_database,
            "SELECT task_id, map_index, state, try_number, pool, start_date, end_date, rendered_map_index "
            "FROM task_instance WHERE run_id = %s",
            run_id,
        )
    }
    for name in ONE_ROUND_DAG_TASKS:
        assert tis[(name, -1)][0] == "success", name
    assert {s[0] for (t, _), s in tis.items() if t.startswith("round_1.")} == {"skipped"}  # rounds_per_run=1
    islands = {v[5]: (m, *v) for (t, m), v in tis.items() if t == "island"}
    assert sorted(islands) == ["island-0", "island-1"]
    assert {v[1] for v in islands.values()} == {"success"} and {v[3] for v in islands.values()} == {POOL}
    # the killed island's try failed, and the scheduler ran a second one, which succeeded
    assert islands[killed][2] == 2 and all(v[2] == 1 for name, v in islands.items() if name != killed)
    history = query(
        pg_database,
        "SELECT try_number, state FROM task_instance_history WHERE run_id = %s AND "
        "task_id = 'island' AND map_index = %s",
        run_id,
        islands[killed][0],
    )
    assert history == [(1, "failed")]
    # no path task was retried by Airflow: the killed island's lease expired (never finished) and an
    # island took the next attempt of its task, which is done
    attempts = {f.name: json.loads(f.read_text()) for f in lease.parent.glob("attempt-*.json")}
    assert attempts[lease.name]["island"] == killed and attempts[lease.name]["state"] == "running"
    assert [a["state"] for name, a in sorted(attempts.items()) if name != lease.name] == ["done"]
    # the pool, not the worker's concurrency, capped the islands running at once
    spans = [(v[4], v[5]) for v in islands.values()] + query(
        pg_database,
        "SELECT start_date, end_date FROM task_instance_history WHERE run_id = %s AND task_id = 'island'",
        run_id,
    )
    assert max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans) <= POOL_SLOTS
    from pipeline.state.storage import RunRoot

    root = RunRoot(tmp_path / "run")
    assert root.is_committed(layout.round_dir(0)) and root.exists(layout.eval_file(1))

"""`python -m benchmarks.hosts_airflow` (root): the Airflow DAG with each host's islands on a Celery
worker inside that host, one queue per host (`airflow.queues`), shown once on one machine.

Two hosts are network namespaces of a benchmarks.netns lab, with moto's S3 server and an MLflow
server in the store's namespace, as `python -m benchmarks.hosts` makes them. Airflow's scheduler,
api-server, dag-processor and triggerer run where this command runs, on the machine's PostgreSQL
(a database of their own, dropped at the end) and Redis, as `make services` runs them. That machine
joins the lab's bridge at GATEWAY_IP, where a plain TCP relay (benchmarks.linkdelay, no delay) lets
the hosts reach Redis and PostgreSQL and the api-server listens: what a host's Celery worker needs
(the broker, the result backend, Airflow 3's execution API). Nothing else of the machine is
reachable from a host.

Each host runs `airflow celery worker --queues <its queue>` in its own UTS namespace, with the
hostname `dipaco-h<i>`, so the task instances' and the leases' host names say where each task ran;
host 0's worker also takes the default queue (configure, prepare, the round sensors, export,
report). The run trains the tiny config on `s3://` across both hosts (`--set K=V`: more
overrides, e.g. `train.compile=true`, where each host's `warm_up_<queue>` compiles beside prepare).
It prints every task instance (queue, hostname, state), what each host's warm-up did, the islands'
lease records by host with their round-0 train task's seconds, and each host's link bytes; exit 0
when the DAG run succeeded and every island and warm-up ran on the host its queue names.
Everything it started, the namespaces, the database and the Redis keys go on every exit path.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import hosts, netns

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import services as svc  # noqa: E402  (scripts/services.py: what `make services` runs)

GATEWAY_IP = f"{netns.SUBNET}.254"  # this machine's address on the lab's bridge
REDIS_DB = 11  # a Redis database of its own (`make services` uses 1)
QUEUES = ["host-0", "host-1"]
RUN_TIMEOUT_S = 1200.0


def attach_gateway(lab: netns.Lab) -> None:
    """A veth from this namespace onto the lab's bridge, GATEWAY_IP on our end. Its other end lives
    in the lab's switch namespace, so deleting the lab deletes the pair."""
    ours = f"dph{os.getpid() % 100000}"
    netns.ip("link", "add", "name", ours, "type", "veth", "peer", "name", "gw", "netns", lab.switch)
    netns.ip("-n", lab.switch, "link", "set", "gw", "master", "br0")
    netns.ip("-n", lab.switch, "link", "set", "gw", "up")
    netns.ip("addr", "add", f"{GATEWAY_IP}/24", "dev", ours)
    netns.ip("link", "set", ours, "up")


def write_config(path: Path, spec: hosts.Spec) -> Path:
    """The run's whole config in one file: $DIPACO_CONFIG for the DAG's shape and the run itself."""
    from pipeline.core.config import dump_yaml, load_config

    overrides = [
        *hosts.base_overrides(spec),
        *hosts.s3_overrides("airflow", f"http://{netns.STORE_IP}:{hosts.S3_PORT}", True),
        "train.islands=1",
        f"airflow.queues=[{', '.join(QUEUES)}]",
        "airflow.retries=0",
        "airflow.rounds_per_run=2",  # the tiny config's two rounds in one DAG run
        *spec.overrides,
    ]
    path.write_text(dump_yaml(load_config(REPO / spec.config, overrides)))
    return path


def redis_url() -> str:
    return svc.Settings().redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"


def airflow_env(home: Path, config: Path, pg_url: str, database: str, port: int, queue: str) -> dict[str, str]:
    """`make services`' Airflow environment, its api-server on the lab's bridge."""
    env = svc.airflow_env(home / "airflow", pg_url, database, redis_url(), queue, port, config, 1, home / "secrets")
    url = f"http://{GATEWAY_IP}:{port}"
    env.update(
        {
            "AIRFLOW__API__HOST": GATEWAY_IP,
            "AIRFLOW__API__BASE_URL": url,
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
            **hosts.DUMMY_AWS,
        }
    )
    return env


def worker_env(lab: netns.Lab, i: int, env: dict[str, str]) -> dict[str, str]:
    """A host's worker: its own home, TMPDIR and Airflow home; the broker and the result backend
    through the gateway's relay."""
    home = lab.host_dir(i)
    mine = {k: v for k, v in env.items() if k.startswith("AIRFLOW__") or k in ("DIPACO_CONFIG", *hosts.DUMMY_AWS)}
    for key in (
        "AIRFLOW__CELERY__BROKER_URL",
        "AIRFLOW__CELERY__RESULT_BACKEND",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    ):
        mine[key] = env[key].replace(svc.HOST, GATEWAY_IP)  # Redis and PostgreSQL through the gateway's relay
    extra = {"AIRFLOW_HOME": str(home / "airflow"), "PYTHONPATH": env["PYTHONPATH"], **mine}
    return hosts.host_env(home, extra)


def wait_for_run(pg_url: str, database: str, run_id: str, timeout_s: float) -> str:
    """The DAG run's final state (success or failed), or 'timeout'."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = query(
            pg_url, database, "SELECT state FROM dag_run WHERE dag_id = 'dipaco_train' AND run_id = %s", run_id
        )
        if found and found[0][0] in ("success", "failed"):
            return found[0][0]
        time.sleep(10)
    return "timeout"


def query(pg_url: str, database: str, sql: str, *args) -> list[tuple]:
    """Rows of one query on the deployment's metadata database (as the superuser, read only)."""
    import psycopg2

    with psycopg2.connect(svc.database_url(pg_url, database)) as conn, conn.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchall()


def task_instances(pg_url: str, database: str, run_id: str) -> list[tuple]:
    return query(
        pg_url,
        database,
        "SELECT task_id, map_index, rendered_map_index, queue, hostname, state FROM task_instance "
        "WHERE dag_id = 'dipaco_train' AND run_id = %s ORDER BY task_id, map_index",
        run_id,
    )


def warm_ups(pg_url: str, database: str, run_id: str) -> dict[str, str]:
    """Each warm_up_<queue> task's line (its XCom: what the host's warm-up did)."""
    rows = query(
        pg_url,
        database,
        "SELECT task_id, value FROM xcom WHERE dag_id = 'dipaco_train' AND run_id = %s "
        "AND key = 'return_value' AND task_id LIKE 'warm_up_%%'",
        run_id,
    )
    return {task: value for task, value in rows}  # the JSON column, decoded by the driver


def train_attempts() -> list[tuple[str, dict]]:
    """(task, lease record) of every train attempt, from the run root."""
    import s3fs

    fs = s3fs.S3FileSystem(
        endpoint_url=f"http://{netns.STORE_IP}:{hosts.S3_PORT}",
        key=hosts.DUMMY_AWS["AWS_ACCESS_KEY_ID"],
        secret=hosts.DUMMY_AWS["AWS_SECRET_ACCESS_KEY"],
    )
    keys = sorted(fs.glob(f"{hosts.BUCKET}/airflow/queue/leases/train.*/attempt-*.json"))
    return [(key.split("/")[-2], json.loads(fs.cat_file(key))) for key in keys]


def first_trains(attempts: list[tuple[str, dict]]) -> dict[str, list[str]]:
    """Each island's round-0 train attempts that finished: task, seconds and inner-loop seconds (a
    first step that compiled shows in both)."""
    found: dict[str, list[str]] = {}
    for task, record in attempts:
        if task.startswith("train.r0.") and record.get("state") == "done":
            total, inner = (record.get(k, float("nan")) for k in ("seconds", "inner_seconds"))
            found.setdefault(record["island"], []).append(f"{task} {total:.1f} s, inner loop {inner:.1f} s")
    return found


def island_leases(attempts: list[tuple[str, dict]]) -> dict[str, set[str]]:
    """Hostnames of each island's train attempts, from their lease records."""
    found: dict[str, set[str]] = {}
    for _, record in attempts:
        found.setdefault(record["island"], set()).add(record.get("host", "?"))
    return found


def show(base: Path, overrides: list[str]) -> int:
    spec = hosts.Spec(
        config="configs/tiny.yaml",
        overrides=overrides,
        hosts=2,
        islands_per_host=1,
        shape=netns.LinkShape(None, None),
        store="s3",
        lease_seconds=6.0,
        partition_leases=3.0,
        throttle_s=0,
        timeout_s=RUN_TIMEOUT_S,
        store_python=sys.executable,
        mlflow=True,
    )
    settings = svc.Settings()
    database = f"dipaco_hosts_airflow_{os.getpid()}"
    home = base / "services"
    config = write_config(base / "dipaco.yaml", spec)
    deployment = svc.Deployment()
    with netns.Lab(2, spec.shape, base / "lab", store_ports=(hosts.S3_PORT, hosts.MLFLOW_PORT)) as lab:
        try:
            hosts.Store(lab, spec).start()
            attach_gateway(lab)
            relay = [sys.executable, "-m", "benchmarks.linkdelay", "--listen", GATEWAY_IP, "--upstream", "127.0.0.1"]
            relay += ["--ports", "6379,5432", "--one-way-ms", "0"]
            svc.spawn(deployment, "gateway-relay", relay, svc.base_env(), home / "logs")
            pg = svc.service_database(settings.pg_url, database, home / "secrets")
            port = svc.free_port()
            default_queue = f"dipaco-hosts-{os.getpid()}"
            env = airflow_env(home, config, pg, database, port, default_queue)
            # `make services`' components but the worker: each host runs its own, below
            svc.start_airflow(deployment, env, "dipaco_paths", 2, default_queue, home / "logs", worker=False)
            command = str(svc.BIN / "airflow")
            for i, queue in enumerate(QUEUES):
                queues = f"{default_queue},{queue}" if i == 0 else queue
                script = f"hostname dipaco-h{i} && exec {command} celery worker --queues {queues} --skip-serve-logs"
                argv = ["unshare", "--uts", "sh", "-c", script + " --concurrency 3"]
                lab.spawn(lab.hosts[i], argv, base / f"worker-h{i}.log", env=worker_env(lab, i, env))
            deadline = time.monotonic() + 120
            while "dipaco_train" not in svc.airflow(env, "dags", "list", "-o", "plain") and time.monotonic() < deadline:
                time.sleep(5)
            run_id = f"hosts-{os.getpid()}"
            svc.airflow(env, "dags", "trigger", "dipaco_train", "--run-id", run_id, "-c", "{}")
            started = time.monotonic()
            state = wait_for_run(settings.pg_url, database, run_id, RUN_TIMEOUT_S)
            seconds = time.monotonic() - started
            rows = task_instances(settings.pg_url, database, run_id)
            attempts = train_attempts()
            leases, trained = island_leases(attempts), first_trains(attempts)
            warmed = warm_ups(settings.pg_url, database, run_id)
            links = [lab.counters(i) for i in range(2)]
        finally:
            svc.stop(deployment.pids)
            svc.drop_database(settings.pg_url, database)
            svc.drop_role(settings.pg_url, database)
            import redis

            redis.Redis.from_url(redis_url()).flushdb()  # the broker's and the results' keys: our database only
    return report(state, seconds, rows, leases, links, warmed, trained, overrides)


def report(
    state: str,
    seconds: float,
    rows: list[tuple],
    leases: dict,
    links: list[tuple[int, int]],
    warmed: dict[str, str],
    trained: dict[str, list[str]],
    overrides: list[str],
) -> int:
    settings = f", {' '.join(overrides)}" if overrides else ""
    lines = [
        f"DAG run: {state} in {seconds:.0f} s (tiny config{settings}, s3:// run root, 2 hosts x 1 island, "
        "unshaped links)",
        "",
        "| task | map index | queue | hostname | state |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {t} | {m if m < 0 else (r or m)} | {q} | {h or '-'} | {s} |" for t, m, r, q, h, s in rows]
    lines += [
        "",
        "- Train attempts' lease records, by island: "
        + "; ".join(f"{island} on {', '.join(sorted(names))}" for island, names in sorted(leases.items())),
    ]
    lines += [f"- {task}: {said}" for task, said in sorted(warmed.items())]
    lines += [f"- {island}'s round-0 train tasks: {'; '.join(done)}" for island, done in sorted(trained.items())]
    lines += [
        f"- Host {i}'s link: {up / 1e6:.1f} MB up, {down / 1e6:.1f} MB down" for i, (up, down) in enumerate(links)
    ]
    text = "\n".join(lines)
    print(text)
    out = REPO / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "hosts_airflow.md").write_text(text + "\n")
    placed = all(
        h == f"dipaco-h{QUEUES.index(q)}"
        for t, _, _, q, h, s in rows
        if t.startswith(("island_", "warm_up_")) and s == "success"
    )
    islands_placed = all(names == {f"dipaco-h{island[len('host-')]}"} for island, names in leases.items())
    return 0 if state == "success" and placed and islands_placed and leases else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hosts_airflow", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the lab's directories (logs) after the run")
    parser.add_argument("--set", action="append", default=[], metavar="K=V", help="a config override (repeatable)")
    args = parser.parse_args(argv)
    why = netns.can_make_namespaces()
    if why:
        print(f"benchmarks.hosts_airflow: {why}", file=sys.stderr)
        return 2
    settings = svc.Settings()
    missing = svc.missing_backends(settings.pg_url, settings.redis_url)
    if missing:
        print(f"benchmarks.hosts_airflow: missing {missing}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    base = Path(tempfile.mkdtemp(prefix="dipaco-hosts-airflow-"))
    try:
        return show(base, args.set)
    finally:
        if args.keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

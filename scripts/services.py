"""`make services`: the pipeline's real services on loopback, for a run that looks like production.

    python scripts/services.py start    # Dask, MLflow, Airflow; prints their addresses
    python scripts/services.py status
    python scripts/services.py stop     # every process it started, by pid

- a Dask scheduler and 2 worker processes (Beam's DaskRunner: `beam.runner: DaskRunner`);
- an MLflow tracking server: backend store in PostgreSQL database `dipaco_mlflow`, artifacts
  served by the server (`--serve-artifacts`) from `.services/mlflow-artifacts`;
- an Airflow deployment: metadata DB in PostgreSQL database `dipaco_airflow`, the CeleryExecutor
  with Redis as broker (its own Redis DB number and queue), one Celery worker, the scheduler, the
  dag processor, the triggerer and the api-server Airflow 3 tasks report to.

Each service keeps to its own database, Redis DB number and queue, so neither collides with the
other nor with a team's own databases on the same server.

Authentication is on (docs/security.md, "Services"): Airflow's simple auth manager with one admin
whose generated password is printed once and kept in .services/secrets/ (0600, like the Fernet key
and the separate JWT and API secrets); a PostgreSQL role of its own, with a password, for each
service (owner of its database, not a superuser); MLflow's basic-auth app, whose admin credentials the
pipeline reads as MLFLOW_TRACKING_USERNAME/PASSWORD from .services/mlflow.env (0600); Dask and
every other listener on 127.0.0.1 only (the Dask scheduler has no credentials: it must never listen
beyond loopback). PostgreSQL and Redis themselves are not
started here: point $DIPACO_PG_URL (default postgresql://postgres@127.0.0.1:5432) and
$DIPACO_REDIS_URL (default redis://127.0.0.1:6379/1) at yours. Every process is started in its own
session, its pid recorded in .services/services.json; `stop` ends each process group (SIGTERM,
then SIGKILL after a grace period). tests/test_services.py starts the same services through these
functions, on free ports and throw-away databases.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's dask, mlflow and airflow commands
HOST = "127.0.0.1"
STATE_FILE = "services.json"
# A DAG run from the command line, in a run root of its own. `-o yaml`: the CLI's default output is
# a table of the run's 12 fields, whose cells wrap into garbage on an 80- or 100-column terminal
# (200 columns when piped); yaml is one field a line. docs/operations.md prints the same command.
TRIGGER = """airflow dags trigger dipaco_train -o yaml -c '{"overrides": ["run_root=runs/services-dag"]}'"""


@dataclass
class Settings:
    """Where the services run and what they sit on; defaults are this machine's loopback."""

    home: Path = REPO / ".services"
    pg_url: str = os.environ.get("DIPACO_PG_URL", "postgresql://postgres@127.0.0.1:5432")
    redis_url: str = os.environ.get("DIPACO_REDIS_URL", "redis://127.0.0.1:6379/1")
    dask_port: int = 8786
    mlflow_port: int = 5000
    airflow_port: int = 8080
    mlflow_db: str = "dipaco_mlflow"
    airflow_db: str = "dipaco_airflow"
    celery_queue: str = "dipaco"
    dask_workers: int = 2
    celery_concurrency: int = 2
    pool_slots: int = 2  # the dipaco_paths pool: path trainers at once
    dipaco_config: Path = REPO / "configs" / "services.yaml"


@dataclass
class Service:
    """One started process (the leader of its own process group)."""

    name: str
    pid: int
    address: str
    log: str


@dataclass
class Deployment:
    services: list[Service] = field(default_factory=list)

    def add(self, service: Service) -> Service:
        self.services.append(service)
        return service

    @property
    def pids(self) -> list[int]:
        return [s.pid for s in self.services]


# -- secrets -------------------------------------------------------------------------------------
def secret(path: Path, make=lambda: secrets.token_urlsafe(32)) -> tuple[str, bool]:
    """The secret kept in `path`, made (mode 0600 from its creation on, in a 0700 folder) when
    missing; (value, whether it was made now). An older file is tightened to 0600."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    made = False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as handle:
            handle.write(make())
        made = True
    path.chmod(0o600)
    return path.read_text().strip(), made


def fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600 before anything is written into it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    path.chmod(0o600)


# -- PostgreSQL and Redis ------------------------------------------------------------------------
def database_url(pg_url: str, database: str, driver: str = "") -> str:
    """postgresql://u@h:p + 'db' -> postgresql[+driver]://u@h:p/db."""
    parts = urlsplit(pg_url)
    scheme = f"postgresql+{driver}" if driver else "postgresql"
    return urlunsplit((scheme, parts.netloc, f"/{database}", parts.query, ""))


def _admin(pg_url: str):
    import psycopg2

    conn = psycopg2.connect(database_url(pg_url, "postgres"), connect_timeout=3)
    conn.autocommit = True  # CREATE/DROP DATABASE cannot run in a transaction (nor in `with conn`)
    return conn


def create_database(pg_url: str, name: str, owner: str | None = None) -> bool:
    """Create database `name` (owned by `owner`) unless it exists; True if it was created."""
    from psycopg2 import sql

    with closing(_admin(pg_url)) as conn, conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
        if cur.fetchone():
            if owner:
                cur.execute(
                    sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(name), sql.Identifier(owner))
                )
            return False
        cur.execute(
            sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
            + (sql.SQL(" OWNER {}").format(sql.Identifier(owner)) if owner else sql.SQL(""))
        )
        return True


def create_role(pg_url: str, role: str, password: str) -> None:
    """A login role of one service, with a password and no privilege beyond its own database's
    (no superuser, no CREATEDB, no CREATEROLE); its password is (re)set."""
    from psycopg2 import sql

    with closing(_admin(pg_url)) as conn, conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
        verb = sql.SQL("ALTER" if cur.fetchone() else "CREATE")
        cur.execute(
            sql.SQL("{} ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %s").format(
                verb, sql.Identifier(role)
            ),
            (password,),
        )


def drop_role(pg_url: str, role: str) -> None:
    from psycopg2 import sql

    with closing(_admin(pg_url)) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def service_database(pg_url: str, name: str, secrets_dir: Path) -> str:
    """The service's own database, owned by a role of the same name whose password is kept in
    secrets_dir (0600); returns the server URL that logs in as that role, not as the superuser."""
    password, _ = secret(secrets_dir / f"postgres-{name}-password")
    create_role(pg_url, name, password)
    create_database(pg_url, name, owner=name)
    return role_url(pg_url, name, password)


def role_url(pg_url: str, role: str, password: str) -> str:
    """postgresql://postgres@h:p -> postgresql://role:password@h:p."""
    parts = urlsplit(pg_url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(
        (parts.scheme, f"{quote(role, safe='')}:{quote(password, safe='')}@{host}", parts.path, parts.query, "")
    )


def drop_database(pg_url: str, name: str) -> None:
    """Drop database `name`, disconnecting whoever is still connected (PostgreSQL >= 13)."""
    with closing(_admin(pg_url)) as conn, conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def missing_backends(pg_url: str, redis_url: str | None = None) -> str | None:
    """None when PostgreSQL (and Redis, if given) answer; else one line naming what is missing."""
    missing = []
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        missing.append("psycopg2 (pip install -e '.[services]')")
    else:
        try:
            _admin(pg_url).close()
        except Exception as exc:  # psycopg2.OperationalError: refused, unknown host, auth
            missing.append(f"PostgreSQL at {pg_url} ({str(exc).strip().splitlines()[0]})")
    if redis_url is not None:
        try:
            import redis
        except ImportError:
            missing.append("the redis client (pip install -e '.[services]')")
        else:
            try:
                redis.Redis.from_url(redis_url, socket_connect_timeout=3).ping()
            except Exception as exc:  # redis.ConnectionError
                missing.append(f"Redis at {redis_url} ({exc})")
    return "; ".join(missing) or None


def clear_celery_queue(redis_url: str, queue: str) -> None:
    """Remove what kombu left in Redis for this queue (the queue list and its bindings)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"*{queue}*"):
        client.delete(key)


# -- processes -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def spawn(
    deployment: Deployment, name: str, argv: list[str], env: dict[str, str], logs: Path, address: str = ""
) -> Service:
    """Start argv in its own session (so stop() can end its whole tree), output to logs/NAME.log."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            start_new_session=True,
        )
    return deployment.add(Service(name, proc.pid, address, str(log)))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def stop(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM each process group, wait up to grace_s, then SIGKILL what is left."""
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0  # SIGKILL is not instant on a loaded machine either
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the leader's pid is its group id (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _log_tail(service: Service, lines: int = 30) -> str:
    try:
        return "\n".join(Path(service.log).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_until(ready, service: Service, timeout_s: float, what: str) -> None:
    """Poll ready() until true; fail early, with the log's tail, if the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if not alive(service.pid):
            raise RuntimeError(f"{service.name} exited before {what}; {service.log}:\n{_log_tail(service)}")
        time.sleep(0.5)
    raise TimeoutError(f"{service.name}: no {what} after {timeout_s:.0f}s; {service.log}:\n{_log_tail(service)}")


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((HOST, port)) == 0


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def base_env() -> dict[str, str]:
    """The caller's environment with this checkout first on the path (also in every child)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# -- Dask ----------------------------------------------------------------------------------------
def start_dask(deployment: Deployment, port: int, workers: int, logs: Path, timeout_s: float = 60) -> str:
    """A scheduler and `workers` single-threaded worker processes; returns tcp://HOST:port."""
    address = f"tcp://{HOST}:{port}"
    env = base_env()
    scheduler = spawn(
        deployment,
        "dask-scheduler",
        [str(BIN / "dask"), "scheduler", "--host", HOST, "--port", str(port), "--no-dashboard"],
        env,
        logs,
        address,
    )
    wait_until(lambda: port_open(port), scheduler, timeout_s, "open port")
    spawn(
        deployment,
        "dask-workers",
        [
            str(BIN / "dask"),
            "worker",
            address,
            "--nworkers",
            str(workers),
            "--nthreads",
            "1",
            "--host",
            HOST,
            "--no-dashboard",
        ],
        env,
        logs,
    )
    from distributed import Client

    with Client(address, timeout=timeout_s) as client:
        client.wait_for_workers(workers, timeout=timeout_s)
    return address


# -- MLflow --------------------------------------------------------------------------------------
MLFLOW_ADMIN = "admin"


def mlflow_credentials(secrets_dir: Path) -> dict[str, str]:
    """What a client of the server sets: MLflow reads MLFLOW_TRACKING_USERNAME/PASSWORD itself."""
    password, _ = secret(secrets_dir / "mlflow-admin-password")
    return {"MLFLOW_TRACKING_USERNAME": MLFLOW_ADMIN, "MLFLOW_TRACKING_PASSWORD": password}


def mlflow_server_command(
    store_uri: str, artifacts: Path, port: int, auth_ini: Path, secrets_dir: Path
) -> tuple[list[str], dict[str, str]]:
    """`mlflow server`'s argv and environment. No secret goes on the command line, which any local
    user reads in /proc/<pid>/cmdline: the backend store's URI (it holds the role's PostgreSQL
    password) goes in MLFLOW_BACKEND_STORE_URI, which `mlflow server` reads itself and hands its
    workers through their environment (readable only by the owner), like the admin's password."""
    argv = [
        str(BIN / "mlflow"),
        "server",
        "--host",
        HOST,
        "--port",
        str(port),
        "--workers",
        "1",
        "--serve-artifacts",
        "--artifacts-destination",
        str(artifacts),
        "--app-name",
        "basic-auth",
    ]
    # MLflow 3.17 starts a job runner with 7 huey consumer processes beside a database-backed server
    # (for GenAI jobs); the pipeline runs none, and on 2 cores they slowed every request
    env = {
        **base_env(),
        "MLFLOW_BACKEND_STORE_URI": store_uri,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_AUTH_CONFIG_PATH": str(auth_ini),
        "MLFLOW_AUTH_ADMIN_PASSWORD": mlflow_credentials(secrets_dir)["MLFLOW_TRACKING_PASSWORD"],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secret(secrets_dir / "mlflow-flask-secret")[0],
    }
    return argv, env


def start_mlflow(
    deployment: Deployment,
    pg_url: str,
    database: str,
    artifacts: Path,
    port: int,
    logs: Path,
    secrets_dir: Path,
    timeout_s: float = 180,
) -> str:
    """`mlflow server` on PostgreSQL with proxied artifacts behind its basic-auth app (every
    request but /health needs the admin's credentials, mlflow_credentials); returns its address."""
    address = f"http://{HOST}:{port}"
    artifacts.mkdir(parents=True, exist_ok=True)
    auth_ini, auth_db = secrets_dir / "mlflow-auth.ini", secrets_dir / "mlflow-auth.db"
    if not auth_db.exists():  # password hashes: 0600 before SQLite writes to it (an empty file is an empty DB)
        write_private(auth_db, "")
    auth_db.chmod(0o600)
    # users and permissions in a SQLite file of their own; nobody but the admin may read or write
    write_private(
        auth_ini,
        "[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
        f"database_uri = sqlite:///{auth_db}\n"
        f"admin_username = {MLFLOW_ADMIN}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
    )
    store = database_url(pg_url, database, "psycopg2")
    argv, env = mlflow_server_command(store, artifacts, port, auth_ini, secrets_dir)
    server = spawn(deployment, "mlflow", argv, env, logs, address)
    wait_until(lambda: http_ok(f"{address}/health"), server, timeout_s, "answer on /health")
    return address


# -- Airflow -------------------------------------------------------------------------------------
AIRFLOW_ADMIN = "admin"


def airflow_secrets(secrets_dir: Path) -> dict[str, str]:
    """The deployment's secrets, each in its own 0600 file: the admin's password (printed once by
    `make services`, when it is made), the Fernet key that encrypts connections and variables, the
    JWT secret that signs tokens, and the api-server's own secret key."""
    password, made = secret(secrets_dir / "airflow-admin-password")
    passwords = secrets_dir / "airflow-passwords.json"  # the simple auth manager's users file
    write_private(passwords, json.dumps({AIRFLOW_ADMIN: password}) + "\n")
    if made:
        print(
            f"Airflow: user {AIRFLOW_ADMIN!r}, password {password} (printed once; kept in "
            f"{secrets_dir / 'airflow-admin-password'}, mode 0600)",
            flush=True,
        )
    return {
        "passwords_file": str(passwords),
        "password": password,
        "fernet": secret(secrets_dir / "airflow-fernet-key", fernet_key)[0],
        "jwt": secret(secrets_dir / "airflow-jwt-secret")[0],
        "api": secret(secrets_dir / "airflow-api-secret")[0],
    }


def airflow_env(
    home: Path,
    pg_url: str,
    database: str,
    redis_url: str,
    queue: str,
    port: int,
    dipaco_config: Path,
    concurrency: int,
    secrets_dir: Path,
) -> dict[str, str]:
    """One environment for every Airflow process: PostgreSQL, CeleryExecutor on Redis, the
    api-server the task runners report to (Airflow 3's execution API), the simple auth manager
    with one admin (no anonymous admins), a Fernet key, separate JWT and API secrets."""
    db = database_url(pg_url, database, "psycopg2")
    keys = airflow_secrets(secrets_dir)
    env = base_env()
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "airflow" / "dags"),
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://{HOST}:{port}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{AIRFLOW_ADMIN}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": keys["passwords_file"],
            "AIRFLOW__CORE__FERNET_KEY": keys["fernet"],
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db,
            "AIRFLOW__CELERY__BROKER_URL": redis_url,
            "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{db}",
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(concurrency),
            "AIRFLOW__OPERATORS__DEFAULT_QUEUE": queue,
            "AIRFLOW__API__HOST": HOST,
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": f"http://{HOST}:{port}",
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__SECRET_KEY": keys["api"],
            "AIRFLOW__API_AUTH__JWT_SECRET": keys["jwt"],
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",  # new DAG files within seconds
            "DIPACO_CONFIG": str(dipaco_config),
        }
    )
    # airflow/config/airflow_local_settings.py: the Celery worker preloads the pipeline
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], str(REPO / "airflow" / "config")))
    return env


def airflow(env: dict[str, str], *args: str, timeout_s: float = 300) -> str:
    """Run one `airflow` CLI command to completion; its output, or RuntimeError with it."""
    done = subprocess.run(
        [str(BIN / "airflow"), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise RuntimeError(f"airflow {' '.join(args)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def start_airflow(
    deployment: Deployment,
    env: dict[str, str],
    pool: str,
    pool_slots: int,
    queue: str,
    logs: Path,
    timeout_s: float = 180,
    task_env: dict[str, str] | None = None,
    worker: bool = True,
) -> str:
    """Migrate the metadata DB, create the path trainers' pool, start the five components (the
    Celery worker only with `worker`: benchmarks.hosts_airflow starts one inside each host). The
    Celery worker, which runs the DAG's tasks, also gets `task_env` (the MLflow server's credentials:
    without them the tasks' tracking calls are answered 401)."""
    airflow(env, "db", "migrate")
    airflow(env, "pools", "set", pool, str(pool_slots), "dipaco path trainers")
    address = env["AIRFLOW__API__BASE_URL"]
    command = str(BIN / "airflow")
    api = spawn(deployment, "airflow-api-server", [command, "api-server"], env, logs, address)
    for component in ("scheduler", "dag-processor"):
        spawn(deployment, f"airflow-{component}", [command, component], env, logs)
    # one machine, one AIRFLOW_HOME: the api-server reads task logs from disk, so neither the worker
    # nor the triggerer serves its own (they would listen on every interface)
    spawn(deployment, "airflow-triggerer", [command, "triggerer", "--skip-serve-logs"], env, logs)
    if worker:
        spawn(
            deployment,
            "airflow-celery-worker",
            [
                command,
                "celery",
                "worker",
                "--queues",
                queue,
                "--skip-serve-logs",
                "--concurrency",
                env["AIRFLOW__CELERY__WORKER_CONCURRENCY"],
            ],
            {**env, **(task_env or {})},
            logs,
        )
    wait_until(lambda: http_ok(f"{address}/api/v2/monitor/health"), api, timeout_s, "answer on /api/v2/monitor/health")
    return address


# -- the CLI -------------------------------------------------------------------------------------
def start_all(settings: Settings) -> Deployment:
    """Start everything (stopping what started if any part fails) and record it in STATE_FILE."""
    home, logs = settings.home, settings.home / "logs"
    home.mkdir(parents=True, exist_ok=True)
    reason = missing_backends(settings.pg_url, settings.redis_url)
    if reason:
        raise SystemExit(f"services: cannot start: missing {reason}")
    deployment = Deployment()
    try:
        start_dask(deployment, settings.dask_port, settings.dask_workers, logs)
        mlflow_pg = service_database(settings.pg_url, settings.mlflow_db, home / "secrets")  # its own role
        mlflow = start_mlflow(
            deployment,
            mlflow_pg,
            settings.mlflow_db,
            home / "mlflow-artifacts",
            settings.mlflow_port,
            logs,
            home / "secrets",
        )
        write_private(
            home / "mlflow.env",
            "".join(
                f"export {k}={shlex.quote(v)}\n"
                for k, v in {"MLFLOW_TRACKING_URI": mlflow, **mlflow_credentials(home / "secrets")}.items()
            ),
        )
        airflow_pg = service_database(settings.pg_url, settings.airflow_db, home / "secrets")
        env = airflow_env(
            home / "airflow",
            airflow_pg,
            settings.airflow_db,
            settings.redis_url,
            settings.celery_queue,
            settings.airflow_port,
            settings.dipaco_config,
            settings.celery_concurrency,
            home / "secrets",
        )
        start_airflow(
            deployment,
            env,
            "dipaco_paths",
            settings.pool_slots,
            settings.celery_queue,
            logs,
            task_env=mlflow_credentials(home / "secrets"),
        )
        write_env_file(home / "airflow.env", env)
    except BaseException:
        stop(deployment.pids)
        raise
    finally:
        (home / STATE_FILE).write_text(json.dumps([asdict(s) for s in deployment.services], indent=2))
    return deployment


def write_env_file(path: Path, env: dict[str, str]) -> None:
    """The deployment's settings as `export` lines, so `airflow ...` in a shell talks to it too."""
    keys = sorted(k for k in env if k.startswith("AIRFLOW") or k in ("DIPACO_CONFIG", "PYTHONPATH"))
    write_private(path, "".join(f"export {k}={shlex.quote(env[k])}\n" for k in keys))  # it holds the secrets


def load_state(home: Path) -> list[Service]:
    path = home / STATE_FILE
    return [Service(**s) for s in json.loads(path.read_text())] if path.exists() else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["start", "stop", "status"])
    args = parser.parse_args(argv)
    settings = Settings()
    running = [s for s in load_state(settings.home) if alive(s.pid)]
    if args.action == "start":
        if running:
            print(f"services: already running ({', '.join(s.name for s in running)}); `make services-stop` first")
            return 1
        started = time.monotonic()
        start_all(settings)
        print(f"services started in {time.monotonic() - started:.0f}s (logs in {settings.home / 'logs'}):")
        print(f"  Dask scheduler  tcp://{HOST}:{settings.dask_port}  ({settings.dask_workers} workers)")
        print(
            f"  MLflow          http://{HOST}:{settings.mlflow_port}  "
            f"(PostgreSQL database {settings.mlflow_db}, artifacts {settings.home / 'mlflow-artifacts'}; "
            f"basic auth: . {settings.home / 'mlflow.env'})"
        )
        print(
            f"  Airflow         http://{HOST}:{settings.airflow_port}  (PostgreSQL database "
            f"{settings.airflow_db}, CeleryExecutor on {settings.redis_url}, queue {settings.celery_queue}; "
            f"user {AIRFLOW_ADMIN}, password in {settings.home / 'secrets' / 'airflow-admin-password'})"
        )
        print(  # the MLflow server answers 401 without the credentials mlflow.env exports
            f"run on them:      . {settings.home / 'mlflow.env'} && "
            f"dipaco run --config {settings.dipaco_config.relative_to(REPO)}"
        )
        print(
            f"                  . {settings.home / 'airflow.env'} && {TRIGGER}  "
            f"(or the UI, http://{HOST}:{settings.airflow_port}; "
            f"a run root other than the CLI's)"
        )
        return 0
    if args.action == "status":
        for service in load_state(settings.home):
            state = "running" if alive(service.pid) else "stopped"
            print(f"  {service.name:<22} pid {service.pid:<8} {state:<8} {service.address}")
        return 0
    stop([s.pid for s in running])
    print(f"services: stopped {len(running)} process group(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

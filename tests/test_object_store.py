"""Object-store run roots against a real S3 endpoint (moto's server, tests/s3_endpoint.py): the
store's operations (conditional create, compare-and-swap, reads of objects replaced meanwhile,
multipart, retries), the run lock, lease fencing by compare-and-swap, and the preflight's refusals.

A small HTTP proxy in front of the server plays the stores moto cannot be: one that ignores
conditional writes (it drops If-None-Match and If-Match, as some S3-compatible stores do), one
that throttles (503 SlowDown for its first N requests), a link that corrupts the bodies of its
first N answers to a GET (a byte flipped in transit), and one that holds back the answers to GETs
of some keys (fetched when asked, delivered seconds later)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zlib
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_YAML, set_args, tiny_config, wait_for, write_synthetic_shards
from pipeline.core.errors import ConfigError, RunLockedError
from pipeline.state import lock as lock_module
from pipeline.state.lock import run_lock
from pipeline.state.storage import RunRoot
from pipeline.state.store import configure

CONDITIONAL_HEADERS = ("if-none-match", "if-match")


class Proxy(http.server.ThreadingHTTPServer):
    """Forwards to `upstream`, dropping conditional headers (`ignore_conditions`), answering 503
    SlowDown to its first `throttle` requests, flipping a byte of its first `corrupt` GET bodies, or,
    while `late_s` is set, delivering the answers to the next `late_left` GETs of keys containing
    `late_key` that long after they were fetched (a store that froze, or a link that held them back)."""

    daemon_threads = True

    def __init__(self, upstream: str, ignore_conditions: bool = False, throttle: int = 0, corrupt: int = 0):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.ignore_conditions, self.throttle, self.throttled = ignore_conditions, throttle, 0
        self.corrupt, self.corrupted = corrupt, 0
        self.late_s, self.late_key, self.late_left = 0.0, "", 1 << 30
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _forward(self) -> None:
        server: Proxy = self.server  # type: ignore[assignment]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if server.throttled < server.throttle:
            server.throttled += 1
            payload = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        headers = {
            k: v for k, v in self.headers.items() if not (server.ignore_conditions and k.lower() in CONDITIONAL_HEADERS)
        }
        upstream = http.client.HTTPConnection(server.upstream.hostname, server.upstream.port, timeout=30)
        upstream.request(self.command, self.path, body=body, headers=headers)
        response = upstream.getresponse()
        data = response.read()
        if self.command == "GET" and response.status == 200 and data and server.corrupted < server.corrupt:
            server.corrupted += 1
            data = bytes([data[0] ^ 0xFF]) + data[1:]  # the same length: only a checksum can tell
        if self.command == "GET" and server.late_s and server.late_key and server.late_key in self.path:
            if server.late_left > 0:
                server.late_left -= 1
                time.sleep(server.late_s)  # the record as it was when asked, delivered late
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        upstream.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


@pytest.fixture
def s3(s3_server, s3_root):
    """A RunRoot on a fresh bucket of the session's moto server."""
    url, _ = s3_root
    configure(url, {"endpoint_url": s3_server.endpoint})
    return RunRoot(url)


# -- the store's operations ------------------------------------------------------------------------
def test_a_conditional_create_is_refused_the_second_time_and_compare_and_swap_refuses_a_stale_version(s3):
    first = s3.create("queue/x.json", b"one")
    assert first and s3.create("queue/x.json", b"two") is None
    assert s3.read_bytes("queue/x.json") == b"one"
    second = s3.replace_if("queue/x.json", b"three", first)
    assert second and second != first
    assert s3.replace_if("queue/x.json", b"four", first) is None  # stale: someone wrote since
    assert not s3.delete_if("queue/x.json", first)
    assert s3.read_bytes("queue/x.json") == b"three"
    assert s3.delete_if("queue/x.json", second) and not s3.exists("queue/x.json")


def test_a_writer_stopped_inside_its_lock_on_a_disk_blocks_neither_its_neighbours_nor_itself_for_good(
    tmp_path, monkeypatch
):
    """A real process takes a record's compare-and-swap lock and is stopped there (SIGSTOP, as an
    island stopped mid-heartbeat): the record beside it (a successor's attempt) is replaced at once,
    and a swap of the held record fails within the bound, naming the file, instead of waiting on."""
    from pipeline.core.errors import StorageError
    from pipeline.state import store as store_module

    monkeypatch.setattr(store_module, "LOCK_WAIT_S", 0.5)
    root = RunRoot(tmp_path / "run")
    held_version = root.create("queue/leases/train.r0.p0/attempt-1.json", b"zombie")
    sibling_version = root.create("queue/leases/train.r0.p0/attempt-2.json", b"successor")
    # The island's own code, stopped right before it writes: inside whatever lock the swap takes.
    stop_inside = (
        "import os, signal, sys\n"
        "from pipeline.state.storage import RunRoot\n"
        "from pipeline.state.store import LocalStore\n"
        "write = LocalStore.write\n"
        "def stopped(self, path, data):\n"
        "    print('locked', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    return write(self, path, data)\n"
        "LocalStore.write = stopped\n"
        "RunRoot(sys.argv[1]).replace_if('queue/leases/train.r0.p0/attempt-1.json', b'late beat', sys.argv[2])\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", stop_inside, str(tmp_path / "run"), held_version],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        done: list = []
        sibling = "queue/leases/train.r0.p0/attempt-2.json"
        beat = threading.Thread(target=lambda: done.append(root.replace_if(sibling, b"beat", sibling_version)))
        beat.start()
        beat.join(5)
        assert done and done[0], "a neighbour's compare-and-swap waited on the stopped writer's lock"
        assert root.read_bytes("queue/leases/train.r0.p0/attempt-2.json") == b"beat"
        started = time.monotonic()
        with pytest.raises(StorageError, match="attempt-1.json.*held its lock"):
            root.replace_if("queue/leases/train.r0.p0/attempt-1.json", b"x", held_version)
        assert time.monotonic() - started < 3
        assert root.read_bytes("queue/leases/train.r0.p0/attempt-1.json") == b"zombie"
    finally:
        holder.kill()
        holder.wait(10)
    # Its process gone, its lock went with it: the swap goes through.
    assert root.replace_if("queue/leases/train.r0.p0/attempt-1.json", b"ended", held_version)


def test_an_object_replaced_while_it_is_read_is_read_whole_every_time(s3):
    """The island that died on "At least one of the pre-conditions you specified did not hold": a
    lease record rewritten while it was read. 300 reads beside a writer replacing it: every read is
    one whole version, none raises."""
    versions = [(f'{{"beats": {i}, "pad": "{"x" * (20_000 + i)}"}}').encode() for i in range(40)]
    s3.write_bytes("queue/lease.json", versions[0])
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            s3.write_bytes("queue/lease.json", versions[i % len(versions)])
            i += 1

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        seen = {s3.read_json("queue/lease.json")["beats"] for _ in range(300)}
    finally:
        stop.set()
        thread.join(30)
    assert len(seen) > 1  # it really was replaced while we read


def test_a_large_file_goes_up_in_parts_and_listings_see_writes_at_once(s3, s3_server, tmp_path, monkeypatch):
    from pipeline.state import store

    monkeypatch.setattr(store.S3Store, "PART_BYTES", 5 << 20)  # S3's smallest part: an 11 MB file is 3 parts
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(11 << 20))
    s3.put_file(big, "paths/p0/model.safetensors")
    assert s3.read_bytes("paths/p0/model.safetensors") == big.read_bytes()
    import boto3

    head = boto3.client("s3", endpoint_url=s3_server.endpoint).head_object(
        Bucket=s3.root.split("/")[0], Key=s3.root.split("/", 1)[1] + "/paths/p0/model.safetensors"
    )
    assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag names its parts
    for i in range(5):  # no listing cache: each new file is listed right after it is written
        s3.write_bytes(f"queue/islands/i{i}.json", b"{}")
        assert f"i{i}.json" in s3.listdir("queue/islands")


def _root_behind(url: str, proxy: Proxy) -> RunRoot:
    """A RunRoot of `url` whose requests go through `proxy` (the other readers and writers of the
    test reach the server directly)."""
    import s3fs

    from pipeline.state.store import S3Store

    root = RunRoot(url)
    root.fs = s3fs.S3FileSystem(endpoint_url=proxy.endpoint, skip_instance_cache=True, use_listings_cache=False)
    root.store = S3Store(root.fs)
    return root


@contextlib.contextmanager
def _store_behind(s3_server, **proxy_args):
    """(an S3Store that reaches the session's server through a Proxy(**proxy_args), the proxy)."""
    import s3fs

    from pipeline.state.store import S3Store

    proxy = Proxy(s3_server.endpoint, **proxy_args)
    try:
        fs = s3fs.S3FileSystem(endpoint_url=proxy.endpoint, skip_instance_cache=True, use_listings_cache=False)
        yield S3Store(fs, retry_s=30), proxy
    finally:
        proxy.shutdown()


def test_throttling_is_retried_with_backoff_and_a_permanent_error_is_not(s3_server, s3_root):
    url, _ = s3_root
    with _store_behind(s3_server, throttle=4) as (store, proxy):
        path = url.removeprefix("s3://") + "/throttled.json"
        started = time.monotonic()
        assert store.create(path, b"{}")  # after 4 SlowDowns
        assert proxy.throttled == 4 and time.monotonic() - started < 30
        with pytest.raises(FileNotFoundError):  # a 404 is an answer, not a reason to retry
            store.read(url.removeprefix("s3://") + "/absent.json")


def test_a_body_corrupted_in_transit_is_read_again_and_the_reader_gets_the_stored_bytes(s3_server, s3_root):
    """S3 keeps an object's checksum and botocore checks the body it reads against it: a body
    corrupted on the way fails that check (FlexibleChecksumError), and the next read is whole."""
    url, _ = s3_root
    with _store_behind(s3_server, corrupt=2) as (store, proxy):
        path = url.removeprefix("s3://") + "/queue/leases/train.r0.p0/attempt-1.json"
        record = b'{"holder": "island-0", "state": "running"}'
        assert store.create(path, record)
        assert store.read(path).data == record  # after two corrupted answers
        assert proxy.corrupted == 2


# -- the run lock ----------------------------------------------------------------------------------
@pytest.fixture
def fast_lock(monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(lock_module, "STALE_AFTER_S", 1.0)
    monkeypatch.setattr(lock_module, "POLL_S", 0.05)


def test_two_orchestrators_never_both_hold_an_object_store_lock(s3, fast_lock):
    with run_lock(s3):
        with pytest.raises(RunLockedError, match="another dipaco run holds this run root"):
            with run_lock(s3):
                pass
    with run_lock(s3):  # released: the next one takes it at once
        pass


def test_a_live_holder_whose_clock_is_far_behind_is_not_taken_over(s3, fast_lock, monkeypatch):
    real = time.time
    monkeypatch.setattr(lock_module.time, "time", lambda: real() - 3600)  # its wall clock an hour behind
    with run_lock(s3):
        monkeypatch.setattr(lock_module.time, "time", real)
        started = time.monotonic()
        with pytest.raises(RunLockedError):
            with run_lock(s3):
                pass
        assert time.monotonic() - started < 1.0  # refused as soon as it was seen to beat


def test_a_dead_holders_lock_is_taken_over_and_a_release_never_removes_anothers_lock(s3, fast_lock):
    dead = s3.create(".lock", b'{"pid": 1, "host": "gone", "state": "held"}')  # never renewed
    assert dead
    started = time.monotonic()
    with run_lock(s3):
        assert time.monotonic() - started >= lock_module.STALE_AFTER_S  # watched on our own clock first
        held = s3.read_versioned(".lock")
        assert b'"state": "held"' in held.data and str(os.getpid()).encode() in held.data
        # the dead holder comes back and "releases": its version is stale, nothing changes
        assert s3.replace_if(".lock", b'{"state": "released"}', dead) is None
        assert not s3.delete_if(".lock", dead)
        assert s3.read_versioned(".lock").data == held.data


def test_a_dead_holders_lock_is_taken_over_only_after_it_was_silent_while_the_store_answered(s3_server, s3, fast_lock):
    """A waiting orchestrator whose own read of the lock hung does not count that time as the
    holder's silence (a frozen store holds the holder's renewals back too): a dead holder's lock,
    one read held back 1.5 s (the lock stale after 1 s), is taken over a second of answered
    silence after that read, where it was taken at that read's answer."""
    dead = s3.create(".lock", b'{"pid": 1, "host": "gone", "state": "held"}')  # never renewed
    assert dead
    proxy = Proxy(s3_server.endpoint)
    try:
        behind = _root_behind(s3.url, proxy)  # the waiting orchestrator
        proxy.late_s, proxy.late_key, proxy.late_left = 1.5, ".lock", 2  # its first two reads (the first: no stall yet)
        started = time.monotonic()
        with run_lock(behind):
            waited = time.monotonic() - started
        assert waited >= 1.5 + 1.5 + 0.8, waited  # two late reads, then a stale period of answered silence
    finally:
        proxy.shutdown()


# -- leases ----------------------------------------------------------------------------------------
def test_a_holder_whose_record_was_ended_learns_it_from_the_store_at_its_next_beat(s3_root, no_collector_pauses):
    from pipeline.islands.task_queue import Task, TaskQueue

    url, storage_set = s3_root
    config = tiny_config(url, storage_set, "train.lease_seconds=0.4")
    configure(url, config.storage.options)
    queue = TaskQueue(RunRoot(url), config)
    lease = queue.claim(Task.of("train", 0, "p0-0"), "island-a", "island-a-1")
    assert lease is not None and queue.claim(Task.of("train", 0, "p0-0"), "island-b") is None
    wait_for(lambda: lease.record["beats"] >= 2, 10, "two beats")
    queue.fail_running("island-a-1", "its process is gone")
    wait_for(lease.lost.is_set, 5, "the holder to learn it lost its lease")
    assert not lease.held()
    lease.finish("done")  # a late finish does not overwrite the failure
    assert queue.attempts(Task.of("train", 0, "p0-0"))[0].state == "failed"


def test_a_lease_read_whose_answer_comes_late_expires_no_holder_until_a_read_asked_later_finds_it_silent(
    s3_server, s3_root, no_collector_pauses
):
    """A reader counts a holder's silence from when it first saw the beat token to when it asked the
    read that found it unchanged, not to when that answer came: a frozen store (or a link that held
    the answer back) delivers the record as it was, while the holder's beats wait in the same queue.
    Counted to the arrival, one read held back longer than the lease expired a live holder; and a read
    asked at once after the store answers again finds the count as the freeze left it, so the time
    the reader's own requests hung is no silence either. Here the holder is stopped: expired once it
    has been silent for a lease while the store answered."""
    from pipeline.islands.task_queue import Task, TaskQueue

    url, storage_set = s3_root
    config = tiny_config(url, storage_set, "train.lease_seconds=0.5")
    configure(url, config.storage.options)
    task = Task.of("train", 0, "p0-0")
    holder = TaskQueue(RunRoot(url), config).claim(task, "island-a", "island-a-1")
    assert holder is not None
    holder._stop.set()  # no more beats: what the reader reads stays the same
    proxy = Proxy(s3_server.endpoint)
    try:
        reader = TaskQueue(_root_behind(url, proxy), config)
        assert not reader.attempts(task)[0].expired  # first seen now
        proxy.late_s, proxy.late_key = 1.5, "queue/leases/"  # 3 leases
        asked = time.monotonic()
        late = reader.attempts(task)[0]
        assert time.monotonic() - asked >= 1.5 and late.state == "running"
        assert not late.expired  # it proves a few ms of silence, not 1.5 s: nothing to take over
        proxy.late_s = 0.0
        # Nor does a read asked at once after it: its own read hung those 1.5 s, so the store was
        # not answering, and a live holder's beats would have waited in the same queue.
        assert not reader.attempts(task)[0].expired
        time.sleep(0.6)  # a lease of silence while the store answers: a dead holder's
        assert reader.attempts(task)[0].expired
        taken = reader.claim(task, "island-b", "island-b-1")  # and taken over, as a dead holder's is
        assert taken is not None and [a.state for a in reader.attempts(task)] == ["running", "running"]
        taken.finish("released")
    finally:
        proxy.shutdown()


# -- preflight: bad input, each one line, exit 2, nothing written ------------------------------------
def _dipaco(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", "--config", str(TINY_YAML), *set_args(args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _objects(s3_server, bucket: str) -> list[str]:
    import boto3

    listed = boto3.client("s3", endpoint_url=s3_server.endpoint).list_objects_v2(Bucket=bucket)
    return [o["Key"] for o in listed.get("Contents", [])]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no_bucket", "the bucket does not exist"),
        ("no_credentials", "no credentials found"),
        ("unreachable", "endpoint cannot be reached"),
        ("ignores_conditions", "ignores conditional writes"),
        ("unknown_option", "storage.options.endpoint is not an option of S3FileSystem"),
        ("secret_option", "storage.options.secret is a credential"),
        ("no_tracking_server", "mlflow.tracking_uri must be set when run_root is not local"),
    ],
)
def test_an_object_store_the_run_cannot_use_is_refused_in_seconds_with_one_line(
    s3_server, s3_root, tmp_path, case, expected
):
    from s3_endpoint import free_port

    url, storage_set = s3_root
    bucket = url.removeprefix("s3://").split("/")[0]
    env = {**os.environ, "HOME": str(tmp_path), "AWS_EC2_METADATA_DISABLED": "true"}
    env.pop("FSSPEC_S3", None)
    sets = [f"run_root={url}", storage_set, "mlflow.enabled=false"]
    proxy = None
    if case == "no_bucket":
        sets[0] = "run_root=s3://dipaco-no-such-bucket/run"
    elif case == "no_credentials":
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            env.pop(key, None)
    elif case == "unreachable":
        sets[1] = f"storage.options={{endpoint_url: http://127.0.0.1:{free_port()}}}"
    elif case == "ignores_conditions":
        proxy = Proxy(s3_server.endpoint, ignore_conditions=True)
        sets[1] = f"storage.options={{endpoint_url: {proxy.endpoint}}}"
    elif case == "unknown_option":
        sets[1] = f"storage.options={{endpoint: {s3_server.endpoint}}}"
    elif case == "secret_option":
        sets[1] = f"storage.options={{endpoint_url: {s3_server.endpoint}, secret: hunter2}}"
    elif case == "no_tracking_server":
        sets[2] = "mlflow.enabled=true"
        env.pop("MLFLOW_TRACKING_URI", None)
    started = time.monotonic()
    try:
        done = _dipaco(sets, env)
    finally:
        if proxy:
            proxy.shutdown()
    seconds = time.monotonic() - started
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    # one line in all: no library's log line before it (botocore's "Found credentials ..." was one)
    assert len(lines) == 1 and lines[0].startswith("dipaco run: ") and expected in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "hunter2" not in done.stderr
    assert seconds < 10 + 5, seconds  # 10 s, plus the interpreter's start on a loaded 2-core machine
    assert _objects(s3_server, bucket) == []  # nothing written


def test_a_storage_option_the_store_does_not_know_or_that_carries_a_secret_is_refused_naming_it():
    with pytest.raises(ConfigError, match="storage.options.endpoint_urll is not an option of S3FileSystem"):
        configure("s3://bucket/run", {"endpoint_urll": "http://127.0.0.1:1"})
    with pytest.raises(ConfigError, match="storage.options.endpoint_url carries credentials") as refused:
        configure("s3://bucket/run", {"endpoint_url": "http://minio:hunter2@127.0.0.1:9000"})
    assert "hunter2" not in str(refused.value)


# -- the whole pipeline ----------------------------------------------------------------------------
@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on a free loopback port: a SQLite backend and served artifacts in tmp_path."""
    from s3_endpoint import free_port

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--artifacts-destination",
            str(tmp_path / "mlartifacts"),
            "--serve-artifacts",
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # no job runner (7 huey consumers, 16 CPU s to start, a /dev/shm directory left behind):
        # the pipeline submits no MLflow server jobs (docs/operations.md)
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        wait_for(lambda: _answers(urllib.request, f"{url}/health"), 120, "the MLflow server")
        yield url
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:  # a worker that ignores SIGTERM
            os.killpg(server.pid, 9)
            server.wait(10)


def _answers(request, url: str) -> bool:
    try:
        return request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


@pytest.mark.slow  # ~2 min on 2 cores: the tiny pipeline twice (Beam prepare, 2 islands, 2 rounds)
def test_the_tiny_pipeline_on_s3_with_an_mlflow_server_equals_the_local_run_bitwise(
    s3_server, s3_root, mlflow_server, tmp_path
):
    """prepare -> islands -> merges -> eval -> register on s3://, tracked by an MLflow server: its
    final modules and eval JSON are bitwise those of the same run on a local root."""
    from mlflow import MlflowClient

    from conftest import dipaco_run

    url, storage_set = s3_root
    # the run's own storage.options and tracking settings, nothing inherited from earlier tests
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "FSSPEC_"))}
    env.update(PYTHONUNBUFFERED="1", MLFLOW_DISABLE_TELEMETRY="true")
    tracked = ["mlflow.enabled=true", f"mlflow.tracking_uri={mlflow_server}", "mlflow.experiment=s3-vs-local"]
    tracked += ["mlflow.registered_model=dipaco-s3", "eval.sample_prompt=the"]  # the champion's sample ends the run
    temp = tmp_path / "tmp"  # the run's temp directory
    temp.mkdir()
    done = dipaco_run([f"run_root={url}", storage_set, *tracked], REPO, {**env, "TMPDIR": str(temp)})
    assert "registered model: models:/dipaco-s3/" in done.stdout, (done.stdout[-2000:], done.stderr[-3000:])
    # The sample loaded the champion over HTTP into a directory removed after; MLflow's own mkdtemp()
    # kept a copy of the whole model there, every run.
    assert "champion continues 'the'" in done.stdout, done.stdout[-2000:]
    assert list(temp.rglob("MLmodel")) == []
    dipaco_run([f"run_root={tmp_path / 'local'}", "mlflow.enabled=false"], REPO, env)
    configure(url, {"endpoint_url": s3_server.endpoint})
    s3, local = RunRoot(url), RunRoot(tmp_path / "local")
    final = "rounds/round=2/modules"
    names = local.marker(final)["files"]
    assert names and sorted(s3.marker(final)["files"]) == sorted(names)
    for name in names:
        assert s3.read_committed(final, name) == local.read_committed(final, name), name
    for r in (1, 2):
        assert s3.read_bytes(f"eval/round={r}.json") == local.read_bytes(f"eval/round={r}.json")
    client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)  # not a registry an earlier test set
    versions = client.search_model_versions("name='dipaco-s3'")
    assert versions, "the S3 run registered no model version"
    assert not s3.exists(".lock") or b"released" in s3.read_bytes(".lock")


def test_pruning_an_old_round_on_s3_leaves_every_marker_naming_only_what_is_there(s3):
    """train.keep_rounds on an object store: a round's modules go (marker first), a path keeps its
    metrics.json under a rewritten marker, and what is left verifies."""
    from pipeline.state import layout
    from pipeline.state.retention import prune_round

    modules, path = layout.modules_dir(0), layout.path_dir(0, "p0")
    s3.write_bytes(f"{modules}/level=0/module=0.safetensors", b"m" * 1000)
    s3.commit(modules)
    s3.write_bytes(f"{path}/model.safetensors", b"w" * 2000)
    s3.write_json(f"{path}/metrics.json", {"seconds": 1.0})
    s3.write_bytes(f"{path}/outer_grad/level=0.safetensors", b"g" * 10)
    s3.commit(path, info={"round": 0})
    freed = prune_round(s3, 0, ["p0"])
    assert freed >= 3000
    assert not s3.exists(modules) and not s3.exists(f"{path}/model.safetensors")
    assert not s3.exists(f"{path}/outer_grad/level=0.safetensors")
    assert list(s3.marker(path)["files"]) == ["metrics.json"] and s3.marker(path)["pruned"] is True
    s3.verify(path)


@pytest.fixture
def s3_requests(monkeypatch):
    """Every request s3fs's client sends from this process, as (operation, key or prefix), in order:
    a spy on its one request function (both of its names), the requests still go to the server."""
    import fsspec.asyn
    import s3fs.core

    sent: list[tuple[str, str]] = []
    original = s3fs.core.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        sent.append((method, kwargs.get("Key", kwargs.get("Prefix", ""))))
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", counted)
    monkeypatch.setattr(s3fs.core.S3FileSystem, "call_s3", fsspec.asyn.sync_wrapper(counted))
    return sent


def test_a_tasks_questions_to_an_object_store_take_one_request_each_and_a_removal_takes_only_its_tree(s3, s3_requests):
    """Over a 40 ms link every request is a round trip a task waits for (RESULTS.md, "Islands on
    separate hosts"): an absent directory's removal, a marker that is not there yet, a file's
    existence, an empty listing, a file not written yet and a publish each cost one
    request, and the one listing a removal makes (its prefix also matches `attempt-10` and
    `attempt-1.json`) removes only the tree it names."""
    staged = "rounds/round=0/staging/path=p0/attempt-1"
    s3.write_bytes(f"{staged}/model.safetensors", b"w" * 1000)
    s3.write_bytes(f"{staged}/outer_grad/level=0.safetensors", b"g" * 10)
    s3.commit(staged)
    siblings = ["rounds/round=0/staging/path=p0/attempt-10/model.safetensors", f"{staged}.json"]
    for name in siblings:
        s3.write_bytes(name, b"x")
    s3_requests.clear()

    s3.remove("rounds/round=0/staging/path=p0/attempt-2")
    assert [op for op, _ in s3_requests] == ["list_objects_v2"]
    s3_requests.clear()
    assert s3.marker_if_committed("rounds/round=0/paths/path=p0") is None
    assert not s3.has_file("eval/round=1.json")
    assert [op for op, _ in s3_requests] == ["get_object", "head_object"]
    s3_requests.clear()  # a claim lists its task's attempts (none yet), an idle island reads the plan
    assert s3.listdir("queue/leases/train.r0.p0-0") == [] and s3.read_json_if_exists("queue/plan.json") is None
    assert [op for op, _ in s3_requests] == ["list_objects_v2", "get_object"]
    assert s3.listdir("rounds/round=0/staging/path=p0") == ["attempt-1", "attempt-1.json", "attempt-10"]

    s3_requests.clear()  # a publish reads the staged marker, then creates the path's own naming it: no copy
    assert s3.publish_dir(staged, "rounds/round=0/paths/path=p0")
    assert s3_requests == [
        ("get_object", f"run/{staged}/_SUCCESS"),
        ("put_object", "run/rounds/round=0/paths/path=p0/_SUCCESS"),
    ]
    s3.verify("rounds/round=0/paths/path=p0")
    other = "rounds/round=0/staging/path=p1/attempt-1"
    s3.write_bytes(f"{other}/model.safetensors", b"v" * 1000)
    record = s3.commit(other)
    s3_requests.clear()  # the marker its trainer just committed names the files: one request
    assert s3.publish_dir(other, "rounds/round=0/paths/path=p1", record)
    assert [op for op, _ in s3_requests] == ["put_object"], s3_requests
    s3_requests.clear()  # a later attempt's publish is refused by the store; the marker there says whose it is
    assert not s3.publish_dir(staged, "rounds/round=0/paths/path=p1", record)
    assert [op for op, _ in s3_requests] == ["put_object", "get_object"], s3_requests
    assert s3.marker("rounds/round=0/paths/path=p1")["files_at"] == other
    s3.verify("rounds/round=0/paths/path=p1")

    s3_requests.clear()
    s3.remove(staged)
    assert [op for op, _ in s3_requests] == ["list_objects_v2", "delete_objects"]
    assert not s3.exists(staged)
    assert all(s3.has_file(name) for name in siblings), "a removal took a neighbour its prefix matched"


@pytest.mark.slow  # ~40 s: two 2-rank DeepSpeed launches against the S3 server
def test_each_rank_of_an_island_keeps_its_own_optimizer_partition_on_s3_and_resumes_it(s3_root):
    """ZeRO-2 on two ranks, an S3 run root: each rank uploads its own partition of the inner
    optimizer state, and the next round's two ranks each resume their own."""
    from pipeline import stages
    from pipeline.islands.launch import train_path_job
    from pipeline.outer.merge import merge_round
    from pipeline.run import Run
    from pipeline.train.train_path import inner_state_of

    url, storage_set = s3_root
    config = tiny_config(
        url,
        storage_set,
        "model.grid=[1]",
        "model.blocks_per_level=[1]",
        "train.launcher=deepspeed",
        "train.procs_per_path=2",
        "train.inner_steps=2",
        "train.ds_config=ds_configs/zero2.json",
    )
    configure(url, config.storage.options)
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    first = train_path_job(config, 0, "p0")
    assert first is not None and first["world_size"] == 2
    kept = inner_state_of(root, 0, "p0")
    assert sorted(root.marker(kept)["files"]) == [
        "optimizer-rank-00000.safetensors",
        "optimizer-rank-00001.safetensors",
    ]
    root.verify(kept)  # both ranks' files are there, as committed
    merge_round(config, 0)
    again = train_path_job(config, 1, "p0")
    assert again is not None and again["resumed_inner_state_from"] == 0


def test_a_path_published_on_an_object_store_is_read_where_its_marker_names_and_its_other_attempts_go(s3, s3_requests):
    """No rename on a store: a publish creates the path's `_SUCCESS` naming the staged attempt,
    whose files every reader then reads (checked against the record as always). Cleaning up
    keeps that attempt and removes the others; pruning the round's weights removes them there
    and keeps metrics.json. A marker that points outside the run root is refused by name."""
    import json

    from pipeline.core.errors import CorruptStateError
    from pipeline.state import layout
    from pipeline.state.retention import prune_round
    from pipeline.train.train_path import drop_unpublished

    rel = layout.path_dir(0, "p0")
    attempts = [layout.staging_dir(0, "p0", f"attempt-{i}") for i in (1, 2)]
    for i, staged in enumerate(attempts):
        s3.write_bytes(f"{staged}/model.safetensors", bytes([i]) * 100_000)
        s3.write_json(f"{staged}/metrics.json", {"tokens": 10 + i})
        s3.commit(staged)
    s3.write_json(f"{layout.staging_dir(0, 'p0')}/checkpoints/attempt-2/step=1/progress.json", {"step": 1})
    assert s3.publish_dir(attempts[1], rel) and not s3.publish_dir(attempts[0], rel)
    assert s3.read_committed_json(rel, "metrics.json") == {"tokens": 11}  # the winner's, from where it lies
    assert not s3.fs.exists(s3.path(rel, "model.safetensors"))  # nothing was copied

    drop_unpublished(s3, 0, "p0")
    assert s3.listdir(layout.staging_dir(0, "p0")) == ["attempt-2"]
    s3.verify(rel)

    s3_requests.clear()
    assert prune_round(s3, 0, ["p0"]) == 100_000
    assert sorted(s3.marker(rel)["files"]) == ["metrics.json"] and s3.marker(rel)["files_at"] == attempts[1]
    assert not s3.fs.exists(s3.path(attempts[1], "model.safetensors"))
    assert s3.read_committed_json(rel, "metrics.json") == {"tokens": 11}

    # A publish whose create went through but whose answer was lost is tried again: its own marker
    # refuses it, and the publisher must know it won (it would remove the files the marker names).
    second, staged = layout.path_dir(0, "p1"), layout.staging_dir(0, "p1", "attempt-1")
    s3.write_json(f"{staged}/metrics.json", {"tokens": 12})
    record = s3.commit(staged)
    s3.store.create(s3.path(second, "_SUCCESS"), json.dumps({**record, "files_at": staged}).encode())
    assert s3.publish_dir(staged, second, record) and not s3.publish_dir(attempts[1], second)

    for outside in ("../elsewhere", "/etc", 7):
        s3.write_bytes(f"{rel}/_SUCCESS", json.dumps({"files": {}, "files_at": outside}).encode())
        with pytest.raises(CorruptStateError, match="files_at|unsafe"):
            s3.marker(rel)


def test_a_train_task_finds_its_modules_with_one_wave_of_requests_on_an_object_store(s3, s3_requests):
    """Before round r-1 is gathered, a train task of round r reads each module where it was merged:
    all the markers that can say where go out at once (one round trip), then the files."""
    from models.grid import ModuleKey
    from pipeline.state import layout
    from pipeline.state.module_store import load_modules, write_state

    keys = [ModuleKey(0, 0), ModuleKey(1, 0)]
    for key in keys:
        rel = layout.merged_module_dir(0, key)
        write_state(s3, rel, key, {"w": torch.full((4,), float(key.level))}, {"round": 0}, layout.MERGED_MODULE)
        s3.commit(rel)
    s3_requests.clear()
    loaded = load_modules(s3, 1, keys)
    assert [float(loaded[key]["w"][0]) for key in keys] == [0.0, 1.0]
    markers = {f"run/{d}/_SUCCESS" for d in [layout.modules_dir(1), *(layout.merged_module_dir(0, k) for k in keys)]}
    assert {name for _, name in s3_requests[:3]} == markers  # the markers first, at once; asking took 9 requests
    assert [op for op, _ in s3_requests] == ["get_object"] * 5, s3_requests  # then the two (small) files


def test_a_merge_on_an_object_store_reads_each_marker_once_and_asks_no_existence_question_first(s3_root, s3_requests):
    """A merge of the module two paths share lies on a round's critical path across hosts, where
    every request in a row is a round trip: it reads its own marker (absent), the paths' markers,
    then where the module and its momentum lie, each marker once and one GET each; before, it asked
    HEAD after HEAD (is it merged, twice; is round r gathered; is the staged merge there) and read
    each path's marker again for its file."""
    from models.grid import ModuleKey
    from pipeline import stages
    from pipeline.outer.merge import merge_module, merge_round
    from pipeline.run import Run
    from pipeline.state import layout
    from pipeline.train.train_path import train_path

    url, storage_set = s3_root
    config = tiny_config(url, storage_set, "model.grid=[1]", "model.blocks_per_level=[1]", "train.inner_steps=2")
    configure(url, config.storage.options)
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    train_path(config, 0, "p0")
    merge_round(config, 0)
    train_path(config, 1, "p0")
    s3_requests.clear()
    merge_module(config, 1, ModuleKey(0, 0))
    first_put = next(i for i, (op, _) in enumerate(s3_requests) if op == "put_object")
    asked = s3_requests[:first_put]
    assert [op for op, _ in asked if op != "get_object"] == [], asked  # no HEAD, no listing
    markers = [key for _, key in asked if key.endswith("/_SUCCESS")]
    assert markers.count(f"run/{layout.path_dir(1, 'p0')}/_SUCCESS") == 1, markers
    assert markers.count(f"run/{layout.merged_module_dir(1, ModuleKey(0, 0))}/_SUCCESS") == 1, markers
    root.verify(layout.merged_module_dir(1, ModuleKey(0, 0)))


def test_what_a_process_wrote_or_read_it_reads_again_from_memory_only_while_the_stores_marker_certifies_it(
    s3, s3_requests
):
    """The next round's inner state, a merge of the island's own path, its shard: bytes this process
    wrote or read a moment ago come back from memory, never over the link; but the store's
    `_SUCCESS` decides what the file is: once another writer's version is committed there, that
    version is read."""
    from pipeline.state.store import RECENT

    rel = "rounds/round=0/inner/path=p0/attempt-1"
    ours, theirs = os.urandom(200_000), os.urandom(200_000)
    s3.write_bytes(f"{rel}/optimizer-rank-00000.safetensors", ours)
    s3.commit(rel)
    s3.publish_dir(rel, "rounds/round=0/inner/path=p0/published")  # a server-side copy keeps its bytes too
    s3_requests.clear()
    assert s3.read_committed(rel, "optimizer-rank-00000.safetensors") == ours
    assert s3.read_committed("rounds/round=0/inner/path=p0/published", "optimizer-rank-00000.safetensors") == ours
    assert [op for op, _ in s3_requests] == ["get_object", "get_object"]  # the two markers, no file

    s3.store.write(s3.path(rel, "optimizer-rank-00000.safetensors"), theirs)  # another process's attempt
    s3.commit(rel)  # its marker now certifies their bytes
    s3_requests.clear()
    assert s3.read_committed(rel, "optimizer-rank-00000.safetensors", writable=True) == theirs
    assert [op for op, _ in s3_requests] == ["get_object", "get_object"]  # the marker, then the file

    s3_requests.clear()  # what it read is kept the same way (a shard, a shared module: read every round)
    assert s3.read_committed(rel, "optimizer-rank-00000.safetensors") == theirs
    assert [op for op, _ in s3_requests] == ["get_object"]

    s3.remove(rel)  # what is removed is forgotten, and memory stays bounded
    assert RECENT.get(s3.path(rel, "optimizer-rank-00000.safetensors")) is None


def test_the_memory_of_recent_files_keeps_large_files_within_its_budget_least_recently_used_first():
    from pipeline.state.store import RecentFiles

    recent = RecentFiles(budget=1 << 20)
    recent.keep("s3://b/small.json", b"x" * 1000)  # a record: not worth a slot
    recent.keep("s3://b/huge", b"x" * (300 << 10))  # over a quarter of the budget
    for name in "abcd":
        recent.keep(f"s3://b/d/{name}", name.encode() * (250 << 10))  # four fill 1000 of its 1024 KiB
    assert recent.get("s3://b/small.json") is None and recent.get("s3://b/huge") is None
    assert recent.get("s3://b/d/a") is not None  # a read makes it the most recently used
    recent.keep("s3://b/d/e", b"e" * (250 << 10))  # over budget: b, the least recently used, goes
    assert recent.get("s3://b/d/b") is None and all(recent.get(f"s3://b/d/{n}") for n in "acde")
    assert recent.holds_under("s3://b/d") and not recent.holds_under("s3://b/dd")
    recent.forget_under("s3://b/d")
    assert not recent.holds_under("s3://b/d")


def test_the_memory_of_recent_files_knows_which_levels_of_a_paths_weights_it_holds():
    """A peer's watch reads of a path's weights only the runs of the level they share: a merge of
    another level must not count that path as held (holds_level), while it is read and after."""
    from pipeline.state.store import RecentFiles

    recent, weights = RecentFiles(budget=1 << 22), "s3://b/p1/model.safetensors"
    with recent.one_reader(f"{weights}#0-70000", [1]):  # a run read for level 1, under way
        assert recent.holds_level(weights, 1) and not recent.holds_level(weights, 0)
        recent.keep(f"{weights}#0-70000", b"r" * 70_000, levels=[1])
    assert recent.holds_level(weights, 1) and not recent.holds_level(weights, 0)
    assert recent.holds_under("s3://b/p1")  # something of the path, whatever its level
    recent.serves_levels(f"{weights}#0-70000", [0])  # the same run read again, for level 0: it holds both
    assert recent.holds_level(weights, 0)
    recent.forget_under("s3://b/p1", keep_bytes=False)
    assert not recent.holds_level(weights, 1)
    recent.keep(weights, b"w" * 70_000)  # the whole file: every level
    assert recent.holds_level(weights, 0) and recent.holds_level(weights, 1)
    assert not recent.holds_level("s3://b/p1/model.safetensors.tmp", 0)  # another name: not its runs


def test_an_island_claims_first_the_merges_of_the_paths_it_trained(s3_root):
    """On an object store an island holds in memory the paths it trained: of a round's merges it
    claims first those it reads nothing for, then the shared module, whose other paths it must
    download (a merge of another island's path cost ~1.2 s more per 7.6 MB over 50 Mbit/s)."""
    from pipeline.islands.task_queue import TaskQueue
    from pipeline.state import layout
    from pipeline.state.store import RECENT

    config, root = _two_published_paths(s3_root)
    RECENT.forget_under(root.path(layout.path_dir(0, "p0-0")), keep_bytes=False)  # as the island that trained p1-0 only
    queue = TaskQueue(root, config)
    leases = [queue.next_claim(f"island-{k}", 1) for k in range(3)]
    assert [lease.task.name for lease in leases] == ["merge.r0.l0m1", "merge.r0.l1m0", "merge.r0.l0m0"]
    for lease in leases:
        lease.finish("released")


@pytest.mark.slow  # ~20 s: a round of the tiny pipeline and one task of the next, on the S3 server
def _two_paths_to_train(s3_root, rounds: int) -> tuple:
    """(config, root): the tiny [2] grid on S3 with its shards, 2 inner steps a task, planned for `rounds`."""
    from pipeline import stages
    from pipeline.islands.task_queue import write_plan
    from pipeline.run import Run

    url, storage_set = s3_root
    config = tiny_config(url, storage_set, "model.grid=[2]", "model.blocks_per_level=[1]", "train.inner_steps=2")
    configure(url, config.storage.options)
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, rounds)
    return config, root


def test_an_island_claims_the_path_whose_inner_state_it_holds_and_reads_none_of_it_over_the_link(s3_root, s3_requests):
    """Islands on separate hosts: the train task an island claims first is the path it trained last
    round, whose inner state (2x the weights) it still holds; that task resumes it from memory.
    Which island trains a path changes nothing in what it trains (the run is bitwise the same).
    The task publishes the path before its own inner state goes up, which the island keeps while
    it goes on to its next task."""
    from pipeline.island_rank import reshard
    from pipeline.islands.island import Island, run_task
    from pipeline.islands.task_queue import TaskQueue, write_plan
    from pipeline.state import layout
    from pipeline.state.store import RECENT

    config, root = _two_paths_to_train(s3_root, 1)
    Island(config, "island-0", reshard=reshard).run()  # round 0: both paths, their merges and the commit
    only_p1 = root.path(layout.inner_state_dir(0, "p0"))
    RECENT.forget_under(only_p1, keep_bytes=False)  # as an island that trained only p1
    write_plan(root, 2)
    lease = TaskQueue(root, config).next_claim("island-1", 2)
    assert lease is not None and lease.task.name == "train.r1.p1"  # p0 sorts first otherwise
    s3_requests.clear()
    outcome = run_task(config, lease.task, 0, lease.number, lease)
    read = [key for op, key in s3_requests if op == "get_object"]
    assert not [key for key in read if "/inner/" in key and key.endswith(".safetensors")], read
    assert root.read_committed_json(layout.path_dir(1, "p1"), "metrics.json")["resumed_inner_state_from"] == 0

    # Published before its inner state (2x the weights) went up: the island keeps it meanwhile, and
    # its lease stays held until the state is kept.
    assert outcome["published"] and not isinstance(outcome["inner_state"], bool)
    written = [key for op, key in s3_requests if op in ("put_object", "copy_object", "create_multipart_upload")]
    assert not [key for key in written if "/inner/" in key], written
    queue = TaskQueue(root, config)
    assert queue.output_committed(lease.task) and not queue.task_done(lease.task)
    island = Island(config, "island-1", reshard=reshard)
    island.keep_later(lease.task, lease, outcome.pop("inner_state"), outcome.pop("published"), 1.0, outcome)
    island.wait_for_keeping(60.0)
    record = queue.attempts(lease.task)[-1].record
    assert record["state"] == "done" and record["seconds"] == 1.0 and record["inner_state_s"] > 0
    assert queue.task_done(lease.task) and root.read_json(layout.inner_state_kept(1, "p1"))["attempt"] == "attempt-1"


def test_a_look_asks_whether_the_rounds_it_may_start_early_are_committed_of_its_listings(s3_root, s3_requests):
    """An island that holds a path's inner state asks, at each look, which of its next rounds are
    not committed yet. It asked each round's marker one after the other, after the look's
    listings: three round trips in a row (0.15-0.2 s over a 40 ms link) between a publish and the
    next claim. The look's listings of the open rounds answer it."""
    from pipeline.islands.task_queue import TaskQueue

    config, root = _two_paths_to_train(s3_root, 4)
    queue = TaskQueue(root, config)
    queue.keeping_here[(0, "p0")] = object()  # as after training p0's round 0 here
    s3_requests.clear()
    queue.next_claim("island-0", 4)
    rounds = [key for op, key in s3_requests if op == "head_object" and re.search(r"rounds/round=\d+/_SUCCESS$", key)]
    assert rounds == [], s3_requests
    assert [task.name for task in queue._held_next_rounds(4)] == ["train.r1.p0"]  # the same answer


def _published(
    root,
    round_index: int,
    job: str,
    data: bytes,
    grads: dict[int, bytes] | None = None,
    info: dict | None = None,
    by_another_host: bool = False,
) -> None:
    """A path published as a train task leaves it: its weights (and outer gradients) and marker
    (with `info`, what a merge reads of it: its tokens). `by_another_host`: this process forgets
    the bytes it wrote before the marker appears, as a host that did not write them; forgotten
    after it, a watch running meanwhile could read them from memory first."""
    from pipeline.state import layout
    from pipeline.state.store import RECENT

    rel = layout.path_dir(round_index, job)
    root.write_bytes(f"{rel}/model.safetensors", data)
    for level, grad in (grads or {}).items():
        root.write_bytes(f"{rel}/{layout.outer_grad_file(level)}", grad)
    if by_another_host:
        RECENT.forget_under(root.path(rel), keep_bytes=False)
    root.commit(rel, info=info)


def _two_published_paths(s3_root, jobs: tuple[str, ...] = ("p0-0", "p1-0")) -> tuple:
    """(config, root): the tiny [2, 1] grid on S3, planned for one round, its paths (`jobs`: both)
    published as train tasks leave them (the module both share, l1m0, and one of its own each)."""
    from pipeline import stages
    from pipeline.islands.task_queue import write_plan
    from pipeline.run import Run

    url, storage_set = s3_root
    config = tiny_config(url, storage_set, "model.grid=[2,1]", "model.blocks_per_level=[1,1]")
    configure(url, config.storage.options)
    root = stages.init_run(Run(config))
    write_plan(root, 1)
    for job in jobs:
        _published(root, 0, job, os.urandom(100_000))
    return config, root


def test_a_train_task_reads_its_published_peers_files_while_it_publishes_and_its_merge_then_reads_none(
    s3_root, s3_requests
):
    """Across hosts the merge of the module two paths share waited, after the last path was
    published, for the other path's weights to come down (1.09 s of a round's critical path). The
    island that publishes last reads them while its own weights go up (its downlink is idle then):
    the merge finds them in memory, and a read under way is waited for, not repeated. It reads only
    what a merge of a module it shares would read (with outer.compression, the gradients at those
    levels), only of paths already published, and names each read in its lease record."""
    from pipeline import stages
    from pipeline.islands.peers import PeerReads
    from pipeline.islands.task_queue import Task, TaskQueue, write_plan
    from pipeline.run import Run
    from pipeline.state import layout
    from pipeline.state.store import RECENT

    url, storage_set = s3_root
    config = tiny_config(url, storage_set, "model.grid=[2,2]", "model.blocks_per_level=[1,1]")
    configure(url, config.storage.options)
    root = stages.init_run(Run(config))
    write_plan(root, 1)
    queue = TaskQueue(root, config)
    weights = {job: os.urandom(300_000) for job in ("p0-0", "p1-0", "p1-1")}
    peers = PeerReads(queue, Task(0, 0, "train", "p0-0"))
    # p1-0 shares l1m0 with p0-0, p0-1 shares l0m0; p1-1 shares nothing
    assert peers.wanted == {"p0-1": [("model.safetensors", [0])], "p1-0": [("model.safetensors", [1])]}
    compressed = tiny_config(
        url, storage_set, "model.grid=[2,2]", "model.blocks_per_level=[1,1]", "outer.compression=int8"
    )
    assert PeerReads(TaskQueue(root, compressed), Task(0, 0, "train", "p0-0")).wanted == {
        "p0-1": [(layout.outer_grad_file(0), None)],
        "p1-0": [(layout.outer_grad_file(1), None)],
    }
    _published(root, 0, "p1-0", weights["p1-0"], by_another_host=True)
    _published(root, 0, "p1-1", weights["p1-1"], by_another_host=True)

    peers.start()
    wait_for(lambda: peers.read, 30, "the published peer's weights read")
    peers.stop()
    assert peers.read == [f"{layout.path_dir(0, 'p1-0')}/model.safetensors"]
    s3_requests.clear()
    assert root.read_committed(layout.path_dir(0, "p1-0"), "model.safetensors") == weights["p1-0"]
    assert [op for op, _ in s3_requests] == ["get_object"], s3_requests  # its marker: the bytes are here
    assert not RECENT.holds_under(root.path(layout.path_dir(0, "p1-1")))  # shares nothing: not read
    assert queue.merge_preference(Task(0, 1, "merge", "l1m0")) == (-0.5, -2)  # p1-0 held, p0-0 not yet

    _published(root, 0, "p0-1", os.urandom(300_000))  # published after the watch stopped: not read
    time.sleep(0.6)
    assert peers.read == [f"{layout.path_dir(0, 'p1-0')}/model.safetensors"]

    # One reader at a time per file: a read under way (a peer's weights) is waited for, not repeated
    RECENT.forget_under(root.path(layout.path_dir(0, "p1-0")), keep_bytes=False)
    marker = root.marker(layout.path_dir(0, "p1-0"))
    s3_requests.clear()
    got: list = []
    readers = [
        threading.Thread(
            target=lambda: got.append(
                root.read_committed(layout.path_dir(0, "p1-0"), "model.safetensors", marker=marker)
            )
        )
        for _ in range(3)
    ]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join(30)
    assert got == [weights["p1-0"]] * 3
    assert [key for op, key in s3_requests if op == "get_object"] == [
        f"run/{layout.path_dir(0, 'p1-0')}/model.safetensors"
    ]


def test_a_path_published_first_reads_its_peers_weights_as_they_are_published_for_a_bounded_while(
    s3_root, monkeypatch, s3_requests
):
    """The island that publishes first starts its next round from the modules it shares, computed
    from every path through them: it downloaded the last path's weights after claiming that round
    (1.1 s of a round's hand-over over a 50 Mbit/s link). Its watch now goes on once its task has
    published, and reads a peer's weights as soon as the peer publishes; it ends by its bound. A
    look is a read of the peer's marker, not a listing, and the marker it finds is the one the read
    uses: one request between the peer's publish and its weights' read (two where a look raced the
    marker's PUT); and the island's wait for
    its next look ends (TaskQueue.news). In the plan's last round no round starts early: the watch
    ends with the publish, reading nothing."""
    from pipeline import stages
    from pipeline.islands import peers as peers_module
    from pipeline.islands.peers import PeerReads
    from pipeline.islands.task_queue import Task, TaskQueue, write_plan
    from pipeline.run import Run
    from pipeline.state import layout
    from pipeline.state.store import RECENT

    url, storage_set = s3_root
    config = tiny_config(url, storage_set, "model.grid=[2,1]")
    configure(url, config.storage.options)
    root = stages.init_run(Run(config))
    write_plan(root, 2)
    queue = TaskQueue(root, config)
    peers = PeerReads(queue, Task(0, 0, "train", "p0-0"))
    assert peers.wanted == {"p1-0": [("model.safetensors", [1])]}
    peers.start()
    peers.published()  # its own task published; p1-0 still trains
    time.sleep(0.6)
    weights = os.urandom(300_000)
    assert not queue.news.is_set()  # nothing found yet: the island's wait between looks is its poll
    s3_requests.clear()
    _published(root, 0, "p1-0", weights, by_another_host=True)
    wait_for(lambda: peers.read, 30, "the peer's weights, read after this task published")
    assert peers.read == [f"{layout.path_dir(0, 'p1-0')}/model.safetensors"]
    assert RECENT.holds_under(root.path(layout.path_dir(0, "p1-0")))
    marker_key = f"run/{layout.path_dir(0, 'p1-0')}/_SUCCESS"
    published_at = max(i for i, (op, key) in enumerate(s3_requests) if op == "put_object" and key == marker_key)
    looks = [sent for sent in s3_requests[published_at + 1 :] if not sent[1].endswith("model.safetensors")]
    # A look sent while the marker's PUT is still in flight finds nothing and the next finds it: the
    # log records a request as it is sent, so one look more may sit between the PUT and the read.
    assert looks[-1:] == [("get_object", marker_key)] and set(looks) == {("get_object", marker_key)}, s3_requests
    assert len(looks) <= 2, s3_requests
    assert queue.news.is_set()  # the island looks at the queue now: its next round may start
    watch_listings = [key for op, key in s3_requests if op.startswith("list") and key.endswith("/paths/")]
    assert watch_listings == [], s3_requests  # (the publish lists its own directory: it records the files)

    monkeypatch.setattr(peers_module, "PEER_AFTER_S", 1.0)  # a peer that never publishes: the watch ends
    write_plan(root, 3)
    waiting = PeerReads(TaskQueue(root, config), Task(1, 0, "train", "p0-0"))
    waiting.start()
    waiting.published()
    wait_for(lambda: not waiting._thread.is_alive(), 10, "the watch's end, PEER_AFTER_S after its publish")
    assert waiting.read == []

    monkeypatch.setattr(peers_module, "PEER_AFTER_S", 5.0)
    last = PeerReads(TaskQueue(root, config), Task(2, 0, "train", "p0-0"))  # round 2 of 3: the last
    last.start()
    last.published()
    _published(root, 2, "p1-0", os.urandom(300_000), by_another_host=True)
    last._thread.join(10)
    assert last.read == [] and not last._thread.is_alive()


def test_an_island_claims_at_once_every_merge_whose_paths_it_holds_and_another_island_gets_none(s3_root):
    """The island that published last holds every path of its module's merges (its own, and the
    peers' it read while publishing): it claims them all at once, so that another island does not
    take one and download its paths first; another island gets none of them. A merge only partly
    held is not claimed with them, and a lease lost meanwhile is skipped. (An island of many
    ranks runs them in turn, as here; one of one rank on a thread beside: the test below.)"""
    from pipeline.island_rank import reshard
    from pipeline.islands.island import Island
    from pipeline.islands.task_queue import TaskQueue
    from pipeline.state import layout
    from pipeline.state.store import RECENT

    config, root = _two_published_paths(s3_root)
    RECENT.forget_under(root.path(layout.path_dir(0, "p0-0")), keep_bytes=False)  # as the island that trained p1-0 only
    queue = TaskQueue(root, config)
    lease = queue.next_claim("island-1", 1)
    assert lease.task.name == "merge.r0.l0m1" and queue.claim_held_merges(lease.task, "island-1") == []
    lease.finish("released")

    root.read_committed(layout.path_dir(0, "p0-0"), "model.safetensors")  # read while it published
    island = Island(config, "island-1", reshard=reshard)
    island.world = 2  # runs what it claims in the foreground
    first = island._next_message()
    assert first["task"]["target"] == "l1m0"  # the shared one first: another island's longest wait
    assert [lease.task.name for lease in island.next_up] == ["merge.r0.l0m0", "merge.r0.l0m1"]
    other = TaskQueue(root, config).next_claim("island-0", 1)
    assert other is None or other.task.kind not in ("merge", "train"), other and other.task.name
    if other is not None:
        other.finish("released")
    leases = [island.lease, *island.next_up]
    island.next_up[0].lost.set()  # a claimed merge whose lease was taken: skipped
    assert island._next_message()["task"]["target"] == "l0m1" and island.next_up == []
    for held in leases:
        held.finish("released")


@pytest.mark.slow  # ~20 s: two train tasks and a merge of the tiny model on the S3 server
def test_a_paths_next_round_starts_here_before_its_merge_from_the_state_this_island_is_still_keeping(
    s3_root, s3_requests
):
    """Across hosts a round's end was a chain of transfers the next round waited for: the merges
    put up, read back, the inner state (2x the weights) kept first. The island that keeps a path's
    inner state now starts the path's next round at once, from the state in memory and from its
    modules as their merge will write them (computed here, pipeline/outer/early.py); the merge runs
    on a thread beside the training, the state goes up after it, and the publish waits until the
    merge is committed with those very bytes. Another island waits for the merge and the state."""
    from models.grid import ModuleKey
    from pipeline.island_rank import reshard
    from pipeline.islands.island import Island, run_task
    from pipeline.islands.task_queue import Task, TaskQueue
    from pipeline.state import layout

    config, root = _two_paths_to_train(s3_root, 2)
    island = Island(config, "island-0", reshard=reshard)
    first = island._next_message()
    assert first["task"]["target"] == "p0" and first["task"]["kind"] == "train"
    lease = island.lease
    other = TaskQueue(root, config).next_claim("island-1", 2)  # p1 is another island's
    assert other.task.name == "train.r0.p1"
    outcome = run_task(config, lease.task, 0, lease.number, lease)
    inner = outcome.pop("inner_state")
    island.lease = None
    island.keep_later(lease.task, lease, inner, outcome.pop("published"), 1.0, outcome)
    ((_, keeper),) = island.keeping
    assert keeper.ident is None and not island.queue.inner_kept(0, "p0")  # not started yet

    nxt = island._next_message()  # round 1 of p0 before its module's merge, which runs beside it
    assert nxt["task"] == {"round": 1, "kind": "train", "target": "p0"} and island.lease.early == [ModuleKey(0, 0)]
    ((behind, _),) = island.behind
    wait_for(lambda: behind, 10, "the merge, claimed on the thread beside the training")
    assert [held.task.name for held in behind] == ["merge.r0.l0m0"]
    s3_requests.clear()
    trained = run_task(config, island.lease.task, 0, island.lease.number, island.lease)
    island.wait_for_keeping(60.0)
    assert trained["published"] and trained["early_start"] == ["l0m0"]
    queue = TaskQueue(root, config)
    merge = queue.attempts(Task.of("merge", 0, "l0m0"))[-1].record
    assert merge["state"] == "done" and merge["beside"] == "train.r1.p0" and merge["island"] == "island-0"
    claimed = queue.attempts(island.lease.task)[-1].record["claimed_at"]
    assert claimed < merge["finished_at"]  # claimed, and trained, before the merge was in
    # the merge waited for the training's first step: the start's load computed it, alone on the cores
    assert merge["finished_at"] - merge["seconds"] > trained["inner_started_at"]
    staged = root.marker(layout.path_dir(1, "p0"))["files_at"]  # the published attempt: its record written
    assert staged.startswith("rounds/round=1/staging/") and not root.has_file(f"{staged}/_SUCCESS")  # once
    read = [key for op, key in s3_requests if op == "get_object"]
    assert not [key for key in read if "/inner/" in key and key.endswith(".safetensors")], read
    assert root.read_committed_json(layout.path_dir(1, "p0"), "metrics.json")["resumed_inner_state_from"] == 0
    kept = root.read_json(layout.inner_state_kept(0, "p0"))["attempt"]
    rel = layout.inner_state_dir(0, "p0", kept)
    assert root.read_committed(rel, "optimizer-rank-00000.safetensors") == inner.data  # what it resumed
    for held in (island.lease, other):
        held.finish("released")


def _two_trained_paths(s3_root, jobs: tuple[str, ...] = ("p0-0", "p1-0")) -> tuple:
    """Round 0's paths (`jobs`: both) published with weights a merge can read (the round's start,
    moved a little), not merged: (config, root, the modules of p0)."""
    from models.grid import ModuleKey
    from pipeline.state.module_store import load_path_model

    config, root = _two_published_paths(s3_root, jobs=())
    for job in jobs:
        model = load_path_model(root, config, 0, job)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01 * torch.randn_like(param))
        with tempfile.TemporaryDirectory() as out:
            model.save_pretrained(out)
            weights = (Path(out) / "model.safetensors").read_bytes()
        _published(root, 0, job, weights, info={"round": 0, "path": job, "tokens": 1000})
    return config, root, [ModuleKey(0, 0), ModuleKey(1, 0)]


def test_the_island_that_published_first_merges_its_own_module_beside_and_looks_again_at_once(s3_root):
    """Across hosts the island that published first claimed the merge of the module only its path
    feeds and ran it in the foreground (1.1-1.3 s, its 3.8 MB going up): a peer that published
    meanwhile found it busy, and its next round started that much later. The merge now runs on a
    thread and the island goes on looking at the queue while it does."""
    from models.grid import ModuleKey
    from pipeline.island_rank import reshard
    from pipeline.islands.island import Island
    from pipeline.islands.task_queue import Task, TaskQueue
    from pipeline.state import layout

    config, root, _ = _two_trained_paths(s3_root, jobs=("p0-0",))  # p1-0 still trains elsewhere
    training = TaskQueue(root, config).claim(Task.of("train", 0, "p1-0"), "island-1")
    island = Island(config, "island-0", reshard=reshard)
    answered: dict = {}
    looking = threading.Thread(target=lambda: answered.update(island._next_message()), daemon=True)
    looking.start()
    merge = Task.of("merge", 0, "l0m0")
    attempts = island.queue.attempts

    def merged() -> bool:
        return any(attempt.record.get("state") == "done" for attempt in attempts(merge)) or bool(answered)

    wait_for(merged, 60, "the merge of l0m0")
    assert answered == {} and looking.is_alive()  # merged while the island looked on: nothing held it
    assert root.is_committed(layout.merged_module_dir(0, ModuleKey(0, 0)))
    island.leaving = True
    looking.join(10)
    assert answered == {"exit": "left"}
    later = island.queue.claim(Task.of("merge", 0, "l1m0"), island.name)  # as if p1-0 were in
    later.lost.set()  # taken by another island before its turn: not run
    island._run_beside([later], "")
    island.wait_for_keeping(10)
    assert not root.is_committed(layout.merged_module_dir(0, ModuleKey(1, 0)))
    assert later.record.get("state") == "running", later.record  # not tried, not failed: untouched
    training.finish("released")


def test_an_early_starts_check_of_its_merges_runs_beside_its_commit_and_ends_with_the_attempt(s3_root):
    """An early start's publish asked, after its weights went up, each merge it started from
    whether it was committed with the same bytes: one round trip per module, in a row, over the
    host's link. The check now starts at the inner loop's end, on a thread beside the commit: it
    sees the merges committed meanwhile, and it gives up when the attempt ends, not after its wait."""
    from pipeline.outer.early import EarlyStart
    from pipeline.outer.merge import merge_module

    config, _, keys = _two_trained_paths(s3_root)
    start = EarlyStart(config, 1, "p0-0", keys)
    start.modules()
    start.check_beside(60.0)
    for key in keys:  # committed while the check runs
        merge_module(config, 0, key)
    assert start.checked(60.0) is None

    never = EarlyStart(config, 2, "p0-0", keys)  # round 1's merges: nobody runs them here
    never.check_beside(60.0)
    time.sleep(1.0)
    ended = time.monotonic()
    never.stop()
    assert "ended" in never.checked(60.0) and time.monotonic() - ended < 5


def test_an_early_start_reads_each_committed_marker_once_and_its_next_round_reads_the_module_from_memory(
    s3_root, s3_requests
):
    """An early start's merges asked for the same markers over and over (the round's modules/ and
    outer_state/, each path's), a round trip each: 0.2-0.4 s of a train task's load on an object
    store. Each is read once now; and the module it computed is what the next round starts from
    once its merge commits those bytes, read from memory, not downloaded."""
    from pipeline.outer.early import EarlyStart
    from pipeline.outer.merge import merge_module
    from pipeline.state import layout
    from pipeline.state.module_store import load_modules
    from pipeline.state.store import RECENT

    config, root, keys = _two_trained_paths(s3_root)
    s3_requests.clear()
    start = EarlyStart(config, 1, "p0-0", keys)
    start.modules()
    markers = [key for op, key in s3_requests if op == "get_object" and key.endswith("/_SUCCESS")]
    assert markers and len(markers) == len(set(markers)), markers
    # and every one of them asked for in its first wave, at once, not as the computation got to it
    wave = {root.path(rel, "_SUCCESS").removeprefix("s3://").split("/", 1)[1] for rel in start.markers_read(0)}
    assert set(markers) <= wave, sorted(set(markers) - wave)

    for key in keys:  # as if another island merged them: nothing of it left in this one's memory
        merge_module(config, 0, key)
    RECENT.forget_under(root.path("rounds/round=0/merged"), keep_bytes=False)
    assert start.difference(1.0) is None
    start.modules()  # computed here again: kept in memory, as after an early start
    s3_requests.clear()
    load_modules(root, 1, keys)
    read = [key for op, key in s3_requests if op == "get_object" and key.endswith(".safetensors")]
    assert read == [], read
    assert all(root.is_committed(layout.merged_module_dir(0, key)) for key in keys)


def test_an_early_start_waits_until_every_path_through_its_modules_is_published(s3_root):
    """A merge is a pure function of what is committed only once every path through its module is
    in: the path's next round starts early (TaskQueue.early_trains) only then, and only on the
    island that keeps its inner state; what it starts from before their merge is named."""
    from models.grid import ModuleKey
    from pipeline.islands.task_queue import TaskQueue, write_plan
    from pipeline.state import layout

    config, root = _two_published_paths(s3_root, jobs=("p0-0",))  # p1-0 still trains
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 2)
    queue = TaskQueue(root, config)
    assert queue.early_trains(2) == []  # keeps no inner state: another island's path
    queue.keeping_here[(0, "p0-0")] = object()
    assert queue.early_trains(2) == []  # l1m0 waits for p1-0
    assert queue.early_trains(1) == []  # no round 1 in the plan
    _published(root, 0, "p1-0", os.urandom(100_000))
    ((task, pending),) = queue.early_trains(2)
    assert task.name == "train.r1.p0-0" and pending == [ModuleKey(0, 0), ModuleKey(1, 0)]
    root.commit(layout.merged_module_dir(0, ModuleKey(0, 0)))  # merged already: read as committed
    assert queue.early_trains(2)[0][1] == [ModuleKey(1, 0)]

    # The state kept (its upload ended while the island waited for its peers), still in memory.
    del queue.keeping_here[(0, "p0-0")]
    assert queue.early_trains(2) == []
    rel = layout.inner_state_dir(0, "p0-0", "attempt-1")
    root.write_bytes(f"{rel}/optimizer-rank-00000.safetensors", os.urandom(100_000))  # kept in memory: written here
    root.commit(rel)
    root.write_json(layout.inner_state_kept(0, "p0-0"), {"attempt": "attempt-1"})
    assert [task.name for task, _ in queue.early_trains(2)] == ["train.r1.p0-0"]


def test_an_island_claims_its_early_start_before_the_ready_merges_and_claims_them_beside_it(s3_root):
    """Across hosts, once the last path of a round was published, the island that published first
    claimed the round's merges and commit first, each a create, and lost those another island
    had just taken, one round trip each: its next round was claimed 1.2-1.6 s after that publish,
    its peers' weights in memory since 0.5-0.7 s (benchmarks/RESULTS.md). A one-rank island's look
    now claims its early start first; the merges and commits it found ready are claimed after,
    on the thread beside the training (Island._run_beside): those of the modules it starts from
    (their inputs are in its memory) at once, the others after its first step if still unclaimed
    (their paths' islands claim them first, from memory), none another island holds."""
    from models.grid import ModuleKey
    from pipeline.islands.task_queue import Task, TaskQueue, write_plan

    config, root = _two_published_paths(s3_root)
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 2)
    merges = [Task.of("merge", 0, target).name for target in ("l0m0", "l0m1", "l1m0")]

    queue = TaskQueue(root, config)
    queue.keeping_here[(0, "p0-0")] = object()  # it trained p0-0's round 0: its next round may start early
    first = queue.next_claim("island-0", 2, early_first=True)
    assert first is not None and first.task.name == "train.r1.p0-0", first and first.task.name
    assert first.early == [ModuleKey(0, 0), ModuleKey(1, 0)]
    assert all(not queue.attempts(Task.of("merge", 0, t)) for t in ("l0m0", "l0m1", "l1m0"))  # none before it

    other = TaskQueue(root, config).next_claim("island-1", 2)  # another island takes one merge meanwhile
    assert other is not None and other.task.kind == "merge", other and other.task.name
    now, later = queue.behind_claims("island-0", None, first.early)
    beside = now()
    # the merges of the modules it starts from, but the one taken; p1-0's own module is p1-0's island's
    assert sorted(lease.task.name for lease in beside) == sorted(set(merges[0::2]) - {other.task.name})
    # after its first step, p1-0's module too if nobody took it by then (p1-0's island may be gone)
    beside += later()
    assert sorted(lease.task.name for lease in beside) == sorted(set(merges) - {other.task.name})

    # Without early_first (an island of several ranks) the look claims the merges first, as before.
    plain = TaskQueue(root, config)
    plain.keeping_here[(0, "p0-0")] = object()
    for lease in (first, other, *beside):
        lease.finish("released")
    lease = plain.next_claim("island-2", 2)
    assert lease is not None and lease.task.kind == "merge", lease and lease.task.name
    lease.finish("released")


def test_no_evaluation_is_claimed_by_an_island_whose_next_path_waits_for_its_peers(s3_root):
    """Across hosts, the island that published first waits for its peers' paths, then starts its
    next round at once (early_trains): an evaluation it claimed in that wait held the start back
    2-3 s. It leaves evaluations to islands with no path to train next (or to the plan's end)."""
    from models.grid import ModuleKey
    from pipeline.islands.task_queue import Task, TaskQueue, write_plan
    from pipeline.state import layout

    config, root = _two_published_paths(s3_root)
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 3)
    for key in (ModuleKey(0, 0), ModuleKey(0, 1), ModuleKey(1, 0)):
        root.commit(layout.merged_module_dir(0, key))  # round 1 starts from these
    for job in ("p0-0", "p1-0"):
        root.write_json(layout.inner_state_kept(0, job), {"attempt": "attempt-1"})  # round 0 done
    _published(root, 1, "p0-0", os.urandom(100_000))  # this island's; p1-0 still trains round 1
    root.commit(layout.merged_module_dir(1, ModuleKey(0, 0)))
    held = TaskQueue(root, config)
    held.keeping_here[(1, "p0-0")] = object()
    keeping = held.claim(Task.of("train", 1, "p0-0"), "island-0")  # its lease, held while the state goes up
    other = TaskQueue(root, config).next_claim("island-1", 3)
    assert other is not None and other.task.name == "train.r1.p1-0", other and other.task.name
    mine = []  # eval.r1.* are ready: not for it (round 0's commit is)
    while (lease := held.next_claim("island-0", 3)) is not None and len(mine) < 5:
        mine.append(lease)
    assert [lease.task.name for lease in mine] == ["commit.r0"]
    idle = TaskQueue(root, config).next_claim("island-2", 3)
    assert idle is not None and idle.task.name == "eval.r1.p0-0"  # an island with nothing to train next
    for lease in (keeping, other, idle, *mine):
        lease.finish("released")


@pytest.mark.slow  # ~25 s: three train tasks and a merge of the tiny model on the S3 server
def test_an_early_start_merges_what_nobody_merged_and_one_merged_differently_is_trained_again(s3_root, monkeypatch):
    """An early start's publish waits for the merges it started from. One whose holder left is
    merged by the island itself (the other islands may all be training); a merge whose file is not
    the bytes the attempt started from cancels the attempt (a cancel counts toward no limit), and
    the path trains again from the committed module and publishes."""
    from pipeline.island_rank import reshard
    from pipeline.islands.island import Island, run_task
    from pipeline.islands.task_queue import Task, TaskQueue
    from pipeline.outer.early import EarlyStart
    from pipeline.state import layout

    config, root = _two_paths_to_train(s3_root, 2)
    island = Island(config, "island-0", reshard=reshard)
    island._next_message()
    lease = island.lease
    other = TaskQueue(root, config).next_claim("island-1", 2)  # p1 is another island's
    outcome = run_task(config, lease.task, 0, lease.number, lease)
    island.lease = None
    island.keep_later(lease.task, lease, outcome.pop("inner_state"), outcome.pop("published"), 1.0, outcome)

    queue = island.queue
    left = queue.next_claim("island-9", 2)  # the merge's holder, gone before it ran it
    assert left.task.name == "merge.r0.l0m0"
    left.finish("released")
    island.lease = queue.claim_early(island.name, island.id)
    assert island.lease.task.name == "train.r1.p0"
    computed = EarlyStart.modules

    def off_by_one_bit(self):
        modules = computed(self)
        (record,) = self.expected.values()
        record["crc32"] = f"{int(record['crc32'], 16) ^ 1:08x}"  # as if computed on other hardware
        return modules

    monkeypatch.setattr(EarlyStart, "modules", off_by_one_bit)
    island._execute(island.lease.task, island.lease.number)
    merge = TaskQueue(root, config).attempts(Task.of("merge", 0, "l0m0"))[-1].record
    assert merge["state"] == "done" and merge["island"] == "island-0" and merge["beside"] == "train.r1.p0"
    cancelled = queue.attempts(Task.of("train", 1, "p0"))[-1].record
    assert cancelled["state"] == "cancelled" and "merged differently" in cancelled["error"]
    assert not root.is_committed(layout.path_dir(1, "p0"))

    monkeypatch.setattr(EarlyStart, "modules", computed)
    again = island._next_message()
    assert again["task"] == {"round": 1, "kind": "train", "target": "p0"} and island.lease.early == []
    island._execute(island.lease.task, island.lease.number)
    island.wait_for_keeping(60.0)
    assert root.is_committed(layout.path_dir(1, "p0"))
    assert [a.state for a in queue.attempts(Task.of("train", 1, "p0"))] == ["cancelled", "done"]
    other.finish("released")


def test_a_lease_beat_is_one_request_and_every_third_looks_at_the_tasks_attempts(s3_root, s3_requests):
    """A heartbeat's look at the task's attempts and output (a listing, its records, a HEAD) went
    out on every beat: a third of a demo run's requests to the store. A beat is now one
    compare-and-swap; every third also looks, and a holder still learns a later attempt took it."""
    from pipeline import stages
    from pipeline.islands.task_queue import CHECK_EVERY, Task, TaskQueue
    from pipeline.run import Run

    url, storage_set = s3_root
    config = tiny_config(url, storage_set, "train.lease_seconds=0.8")
    configure(url, config.storage.options)
    root = stages.init_run(Run(config))
    queue = TaskQueue(root, config)
    s3_requests.clear()
    lease = queue.claim(Task.of("train", 0, "p0-0"), "island-0")
    wait_for(lambda: lease.record.get("beats", 0) >= 3 * CHECK_EVERY, 30, "nine beats")
    lease._stop.set()
    lease._thread.join(10)
    beats = lease.record["beats"]
    puts = [key for op, key in s3_requests if op == "put_object" and key.endswith("attempt-1.json")]
    lists = [key for op, key in s3_requests if op == "list_objects_v2"]
    assert len(puts) == beats + 1  # the claim, then one compare-and-swap a beat
    assert 1 <= len(lists) - 1 <= beats // CHECK_EVERY + 1, (beats, lists)  # the claim's own listing aside

    late = TaskQueue(root, config).claim(Task.of("train", 0, "p0-1"), "island-1")  # a holder that is taken over
    record = root.read_json(late.rel)
    beats_before = late.record.get("beats", 0)
    root.write_json(late.rel.replace("attempt-1", "attempt-2"), {**record, "island": "island-2"})
    assert late.lost.wait(30)
    # within three beats (counted, not timed: on a loaded machine a beat comes late, not sooner)
    assert late.record.get("beats", 0) - beats_before <= CHECK_EVERY + 1, (beats_before, late.record)
    late.finish("released")


def test_a_file_another_process_copied_on_the_server_is_read_from_memory_by_its_bytes_record(s3, s3_requests):
    """A round's commit copies each merged module into modules/ on the server; the island that
    merged it held the bytes under the merged name only, and read them again over the link (3.8 MB
    on a round's critical path across hosts). A committed file whose record (length, CRC-32) matches
    bytes kept under another name (or removed since: the commit removes what it copied) is read from
    memory; other bytes under that record's name are not."""
    from pipeline.state.store import RECENT, RecentFiles

    merged, modules = "rounds/round=0/merged/level=0/module=0", "rounds/round=1/modules"
    data = os.urandom(300_000)
    s3.write_bytes(f"{merged}/module.safetensors", data)  # this process merged it: kept
    s3.commit(merged)
    s3.store.copy(s3.path(merged, "module.safetensors"), s3.path(modules, "level=0/module=0.safetensors"))
    s3.commit(modules)  # what another island's commit task wrote: this process kept nothing of it
    assert RECENT.get(s3.path(modules, "level=0/module=0.safetensors")) is None
    s3_requests.clear()
    assert s3.read_committed(modules, "level=0/module=0.safetensors") == data
    assert [op for op, _ in s3_requests] == ["get_object"], s3_requests  # the marker only

    other = os.urandom(300_000)  # a record no kept bytes match: read over the link
    s3.store.write(s3.path(modules, "level=0/module=1.safetensors"), other)  # another process's write
    s3.commit(modules)
    s3_requests.clear()
    assert s3.read_committed(modules, "level=0/module=1.safetensors") == other
    assert [op for op, _ in s3_requests] == ["get_object", "get_object"]

    recent = RecentFiles(budget=1 << 20)  # the index follows what is kept and dropped
    recent.keep("s3://b/a", b"x" * (100 << 10))
    recent.keep("s3://b/b", b"x" * (100 << 10))
    record = {"bytes": 100 << 10, "crc32": f"{zlib.crc32(b'x' * (100 << 10)):08x}"}
    recent.forget_under("s3://b/b")
    assert recent.get_same(record) == b"x" * (100 << 10)  # still under a
    recent.forget_under("s3://b/a")  # removed: its bytes stay, under no name, for a copy of them
    assert recent.get_same(record) == b"x" * (100 << 10) and recent.get("s3://b/a") is None
    for name in "cdefghijkl":  # until the budget needs their room
        recent.keep(f"s3://b/{name}", os.urandom(100 << 10))
    assert recent.get_same(record) is None


def test_a_merge_none_of_whose_paths_an_island_holds_is_left_one_look_to_an_island_that_does(s3_root):
    """The island that published a merge's last path holds its paths and claims the merge right
    after its publish; an idle island, polling, took it first and downloaded that path (1.2 s on
    the round's critical path across hosts). A merge newly ready that an island does not hold
    whole waits for its next look; found again, it is claimed."""
    from pipeline.islands.task_queue import TaskQueue
    from pipeline.state import layout
    from pipeline.state.store import RECENT

    config, root = _two_published_paths(s3_root)
    for job in ("p0-0", "p1-0"):
        RECENT.forget_under(root.path(layout.path_dir(0, job)), keep_bytes=False)  # as another host published them
    idle = TaskQueue(root, config)
    assert idle.next_claim("island-0", 1) is None  # three merges, none held, all new: one look's wait
    root.read_committed(layout.path_dir(0, "p1-0"), "model.safetensors")  # as its publisher holds it
    holder = TaskQueue(root, config).next_claim("island-1", 1)
    assert holder.task.name == "merge.r0.l0m1"  # every path held: at once
    again = idle.next_claim("island-0", 1)
    assert again.task.name == "merge.r0.l1m0"  # found again: claimed, the longest first
    for lease in (holder, again):
        lease.finish("released")


def test_a_peers_read_of_a_trained_path_brings_down_only_the_module_they_share_and_the_merge_reads_it_from_memory(
    s3_root, s3_requests
):
    """Across hosts the island that published first reads the last path's weights down before its
    next round can start (RESULTS.md, "Islands on separate hosts"). Of a path it needs only the
    module their paths share: the byte runs the path's commit recorded for that level
    (pipeline/state/module_store.py), not the whole file; the merge and the early start then find them
    in memory."""
    from models.modular import ModelShape
    from pipeline import stages
    from pipeline.islands.peers import PeerReads
    from pipeline.islands.task_queue import Task, TaskQueue, write_plan
    from pipeline.outer.merge import read_path_levels
    from pipeline.run import Run
    from pipeline.state import layout
    from pipeline.state.storage import PARTS, runs_to_read
    from pipeline.state.store import RECENT
    from pipeline.train.train_path import train_path

    url, storage_set = s3_root
    # a seed of its own: this process keeps what it wrote or read by its bytes too (RecentFiles.get_same)
    config = tiny_config(url, storage_set, "model.grid=[2,1]", "train.inner_steps=2", "train.seed=4711")
    configure(url, config.storage.options)
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    write_plan(root, 2)
    train_path(config, 0, "p1-0")
    rel = layout.path_dir(0, "p1-0")
    marker = root.marker(rel)
    for where in {rel, root.files_location(rel, marker)}:  # as another host published it
        RECENT.forget_under(root.path(where), keep_bytes=False)
    size = marker["files"]["model.safetensors"]["bytes"]
    runs = runs_to_read(marker[PARTS]["model.safetensors"], size, [1])
    assert runs is not None and sum(e - b for b, e, _ in runs) < size

    queue = TaskQueue(root, config)
    peers = PeerReads(queue, Task(0, 0, "train", "p0-0"))
    assert peers.wanted == {"p1-0": [("model.safetensors", [1])]}
    s3_requests.clear()
    peers.start()
    wait_for(lambda: peers.read, 30, "the published peer's shared module read")
    peers.stop()
    assert peers.read == [f"{rel}/model.safetensors#{b}-{e}" for b, e, _ in runs]
    # What it holds of p1-0 is level 1: the merge of the module both share reads it from memory;
    # that of p1-0's own module (level 0) is p1-0's island's, which holds the whole path.
    assert queue.merge_preference(Task.of("merge", 0, "l1m0")) == (-0.5, -2)  # p1-0 held, p0-0 not trained here
    assert queue.merge_preference(Task.of("merge", 0, "l0m1")) == (0.0, -1) and not queue.holds_all(
        Task.of("merge", 0, "l0m1")
    )
    assert len([key for op, key in s3_requests if op == "get_object" and key.endswith("model.safetensors")]) == len(
        runs
    )  # one ranged GET a run, none of the whole file

    s3_requests.clear()
    shape = ModelShape.from_config(config.model)
    (level,) = read_path_levels(root, shape, 0, "p1-0", levels=[1]).values()
    small = [(b, e) for b, e, _ in runs if e - b < 64 << 10]  # RecentFiles keeps 64 KiB and more
    weights_reads = [key for op, key in s3_requests if op == "get_object" and key.endswith("model.safetensors")]
    assert len(weights_reads) == len(small)
    assert set(level) == {k for k in level if k.startswith(("blocks.", "norm", "lm_head"))}

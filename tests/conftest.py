"""Shared fixtures: a tiny run config and synthetic shards, so engine tests need no Beam job."""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# train.precision: auto's probe cache, kept out of the user's ~/.cache for the session, and removed
# with it by the process that made it (subprocesses inherit the variable and leave it be)
if "DIPACO_CACHE_DIR" not in os.environ:
    os.environ["DIPACO_CACHE_DIR"] = tempfile.mkdtemp(prefix="dipaco-test-cache-")
    atexit.register(shutil.rmtree, os.environ["DIPACO_CACHE_DIR"], ignore_errors=True)
# The system temp dir, the session's own, removed with it: Beam, Dask and inductor write scratch
# there and left some (beam-temp-*, beam-requirements-cache, dask-scratch-space) in /tmp after
# every run. Subprocesses inherit it. pytest's own tmp_path dirs stay where pytest keeps them
# (its last three runs, for a failed test's files): PYTEST_DEBUG_TEMPROOT, read when first used.
if "DIPACO_TEST_TMPDIR" not in os.environ:
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    os.environ["DIPACO_TEST_TMPDIR"] = tempfile.mkdtemp(prefix="dipaco-test-tmp-")
    os.environ["TMPDIR"] = tempfile.tempdir = os.environ["DIPACO_TEST_TMPDIR"]
    atexit.register(shutil.rmtree, os.environ["DIPACO_TEST_TMPDIR"], ignore_errors=True)

from models.grid import all_path_ids  # noqa: E402
from pipeline.core.config import Config, load_config  # noqa: E402
from pipeline.state.shards import shard_table, write_shard_file  # noqa: E402
from pipeline.state.storage import RunRoot  # noqa: E402

TINY_VOCAB = 256
TINY_YAML = REPO / "configs" / "tiny.yaml"
# configs/tiny.yaml on a small vocabulary of GPT-2 ids (synthetic shards need no trained
# tokenizer), in-process launcher, tracking off: tiny_config's overrides, and tiny_cli_args'.
TINY_SETS = (
    "model.tokenizer=gpt2",
    f"model.vocab_size={TINY_VOCAB}",
    "train.launcher=inprocess",
    "mlflow.enabled=false",
)
# dipaco_train's unmapped tasks, every one of which succeeds in a DAG run of one round
# (airflow.rounds_per_run: 1); round 1's group is left to the next DAG run.
ONE_ROUND_DAG_TASKS = (
    "configure",
    "prepare",
    "plan",
    "evaluate_initial",
    "islands",
    "round_0.finished",
    "round_0.register",
    "report",
)


def synthetic_documents(path_index: int, n_docs: int, vocab: int, seed: int) -> list[list[int]]:
    """Documents whose tokens come from a path-specific band with a repeating motif: learnable,
    and different per path so that paths really diverge."""
    rng = np.random.default_rng([seed, path_index])
    band = max(8, (vocab - 1) // 8)
    low = (path_index * band) % (vocab - 1 - band)
    docs = []
    for _ in range(n_docs):
        motif = rng.integers(low, low + band, size=4)
        length = int(rng.integers(24, 72))
        docs.append(
            [int(motif[i % 4]) if rng.random() < 0.8 else int(rng.integers(0, vocab - 1)) for i in range(length)]
        )
    return docs


def write_synthetic_shards(
    root: RunRoot,
    grid: list[int],
    vocab: int = TINY_VOCAB,
    docs_per_path: int | dict = 40,
    seed: int = 0,
    same_shard: bool = False,
    validation_docs: int = 6,
) -> None:
    """Write and commit shards/ as the prepare job would (train and validation splits)."""
    for index, path_id in enumerate(all_path_ids(grid)):
        n = docs_per_path[path_id] if isinstance(docs_per_path, dict) else docs_per_path
        source = 0 if same_shard else index
        docs = synthetic_documents(source, n + validation_docs, vocab, seed)
        ids = [f"doc-{source}-{i}" for i in range(len(docs))]
        write_shard_file(root, f"shards/path={path_id}/part-00000.parquet", shard_table(ids[:n], docs[:n]))
        if validation_docs:
            write_shard_file(
                root, f"shards/validation/path={path_id}/part-00000.parquet", shard_table(ids[n:], docs[n:])
            )
    root.write_json("shards/manifest.json", {"synthetic": True})
    root.commit("shards")


def wait_for(predicate, timeout: float, what: str, every: float = 0.05):
    """predicate()'s first truthy value, polled every `every` s; fails the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def tiny_config(run_root: Path, *overrides: str) -> Config:
    """configs/tiny.yaml on a small vocabulary of GPT-2 ids (synthetic shards need no trained
    tokenizer), in-process launcher, tracking off."""
    return load_config(TINY_YAML, [f"run_root={run_root}", *TINY_SETS, *overrides])


def set_args(overrides) -> list[str]:
    """`--set KEY=VALUE` arguments of `dipaco`, one per override."""
    return [arg for override in overrides for arg in ("--set", override)]


def tiny_cli_args(run_root: Path, *overrides: str) -> list[str]:
    """tiny_config's config as `dipaco` arguments: --config configs/tiny.yaml and its --set overrides."""
    return ["--config", str(TINY_YAML), *set_args([f"run_root={run_root}", *TINY_SETS, *overrides])]


def dipaco_run(overrides, cwd: Path, env: dict, program: list[str] | None = None) -> subprocess.CompletedProcess:
    """`dipaco run --config <repository>/configs/tiny.yaml --set ...` in a fresh process, which must
    succeed; `program` starts dipaco (default: python -m pipeline.cli)."""
    done = subprocess.run(
        [*(program or [sys.executable, "-m", "pipeline.cli"]), "run", "--config", str(TINY_YAML), *set_args(overrides)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def start_island(run_root: Path, name: str, env: dict | None = None) -> subprocess.Popen:
    """`python -m pipeline.island_rank` joining the run in its own session (os.killpg reaches its
    whole tree), output unbuffered on its stdout, stderr included."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.island_rank", "--run-root", str(run_root), "--island", name],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_script_json(script: str, argument, cwd: Path, env: dict, timeout: float = 180):
    """What `python -c script json(argument)` prints last, as JSON, from a fresh process: one that
    shares nothing with the test's imports (a model loaded from the registry, say)."""
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argument)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture(autouse=True)
def _no_inherited_mlflow_uris():
    """mlflow.set_tracking_uri / set_registry_uri also set MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI
    in os.environ, and every subprocess a later test starts inherits them: a registry URI left by
    one test's sqlite store sent another test's fresh process to the wrong registry."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        os.environ.pop(name, None)
    yield
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        os.environ.pop(name, None)


@pytest.fixture
def no_collector_pauses():
    """For tests that time leases with a live holder and its reader as threads of this process. By
    the end of the suite this process holds ~2.5M objects, and a full collection of them stops every
    thread for 1.0-1.4 s (measured on 2 cores): the holder's beats stall while the reader's monotonic
    clock runs on, and a live holder of a 1 s lease looks dead (CI lost a sweep test to it). Islands
    are processes of their own with small heaps; here the heap that earlier tests left is frozen
    (gc.freeze: never scanned) while the test runs, and handed back to the collector after it."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server for the session (tests/s3.py); skipped with one line where moto is missing."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (make install brings it)")
    from s3_endpoint import CREDENTIALS, start_moto

    server = start_moto()
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)  # dummy credentials for this process, its islands and ranks
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def s3_root(s3_server):
    """An `s3://` run root in a fresh bucket of the session's moto server, and the override that
    points a config at the server (storage.options.endpoint_url); the bucket is removed after."""
    bucket = s3_server.new_bucket()
    yield f"s3://{bucket}/run", s3_server.storage_set()
    s3_server.remove_bucket(bucket)


@pytest.fixture(params=["local", "s3"])
def any_root(request, tmp_path):
    """A run root on a local disk, then on S3 (moto's server): the lease, fencing, zombie, backup
    and crash/resume tests that hold on one must hold on both. An S3 root is a URL string; its
    endpoint reaches this process and the islands it starts through fsspec's config
    (pipeline.state.store.configure), as `storage.options` would."""
    if request.param == "local":
        return tmp_path / "run"
    from pipeline.state.store import configure

    url, _ = request.getfixturevalue("s3_root")
    configure(url, {"endpoint_url": request.getfixturevalue("s3_server").endpoint})
    return url

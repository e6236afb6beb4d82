"""The pipeline on real services, on loopback: the Beam job on a Dask cluster, a tiny run tracked by
an `mlflow server` on PostgreSQL, and a DAG run on an Airflow deployment (PostgreSQL, the
CeleryExecutor with Redis). Every process a test starts is stopped by its pid in a finally, and
every test that needs a database creates and drops its own. Where PostgreSQL or Redis cannot be
reached, those tests skip with a line naming what is missing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from conftest import REPO, tiny_config

from pipeline import layout
from pipeline.errors import ConfigError
from preprocessing.prepare import DASK_RUNNER, make_runner, pipeline_options, run_prepare

BAD_LINES = b'{not json\n{"url": "https://example.com/no-text"}\n[1, 2, 3]\n'


def tree_digest(root: Path, rel: str) -> dict[str, str]:
    """sha256 of every file under root/rel but the _SUCCESS markers (commit times) and the
    manifest (its "seconds"; compared as data)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / rel).rglob("*")) if p.is_file() and p.name not in ("_SUCCESS", "manifest.json")}


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
    assert isinstance(make_runner(DASK_RUNNER, options), DaskRunner)
    with pytest.raises(ConfigError, match=r"tiny.yaml: beam.runner 'NoSuchRunner' cannot be created") as err:
        make_runner("NoSuchRunner", options, config.source)
    assert "\n" not in str(err.value)


@pytest.fixture
def dask_cluster():
    """A distributed.LocalCluster of 2 worker processes (1 thread each) on 127.0.0.1."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=None)
    pids = []
    try:
        with Client(cluster) as client:
            pids = list(client.run(os.getpid).values())
        assert len(pids) == 2
        yield cluster.scheduler_address
    finally:
        cluster.close()
        stop_pids(pids)


@pytest.mark.slow  # ~15 s: two prepare jobs of tiny.yaml and a 2-worker cluster
@pytest.mark.timeout(180)
def test_prepare_on_a_dask_cluster_writes_what_the_direct_runner_writes(dask_cluster, tmp_path):
    data = tmp_path / "c4"
    shutil.copytree(REPO / "tests" / "data" / "c4" / "train", data)
    (data / "c4-train.bad.json").write_bytes(BAD_LINES)  # the rejected branch runs on the cluster too
    train = f"data.train={data}/*.json*"
    direct = run_prepare(tiny_config(tmp_path / "direct", train))
    start = time.time()
    dask = run_prepare(tiny_config(
        tmp_path / "dask", train, "beam.runner=DaskRunner",
        f"beam.options=['--dask_client_address={dask_cluster}', '--dask_npartitions=2']"))

    print(f"prepare on Dask: {time.time() - start:.1f}s")
    assert direct.pop("seconds") > 0 and dask.pop("seconds") > 0
    assert dask == direct
    assert dask["rejected"] == 3 and dask["routed"] > 100
    for rel in (layout.ROUTER_DIR, layout.SHARDS_DIR):
        assert (tmp_path / "dask" / rel / "_SUCCESS").is_file()
        direct_files = tree_digest(tmp_path / "direct", rel)
        assert tree_digest(tmp_path / "dask", rel) == direct_files
    assert sum(1 for name in direct_files if name.endswith(".parquet")) == 8  # 4 paths x 2 splits
    assert any("rejected" in name for name in direct_files)

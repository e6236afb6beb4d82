"""A host's first torch.compile done beside prepare or the wait for the plan, or by the DAG's
warm_up task (pipeline/compile_warmup.py): the path's first train task then reads its kernels
instead of compiling them, nothing is started where the islands train eagerly, and a warm-up that
cannot start costs the run nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO, tiny_config
from pipeline import compile_warmup
from pipeline.compile_warmup import will_compile

AMX_CPU = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
ZEN4_CPU = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n"
# The tiny path as test_portability trains it compiled: one module, one block, 3 steps.
TINY_PATH = ("model.grid=[1]", "model.blocks_per_level=[1]", "train.inner_steps=3")

TRAIN_AND_COUNT = """
import json, sys
sys.path.insert(0, "tests")
from torch._dynamo.utils import counters
from conftest import tiny_config, write_synthetic_shards
from pipeline import stages
from pipeline.run import Run
from pipeline.train.train_path import train_path
config = tiny_config(sys.argv[1], *sys.argv[2:])
root = stages.init_run(Run(config))
write_synthetic_shards(root, config.model.grid)
metrics = train_path(config, 0, "p0")
print(json.dumps({"compiled": metrics["compiled"], "inductor": dict(counters["inductor"])}))
"""


def test_it_warms_where_the_islands_compile_and_nowhere_else(run_root):
    def train(value: str):
        return tiny_config(run_root, f"train.compile={value}").train

    assert will_compile(train("true"), cpuinfo=ZEN4_CPU, cuda=False) is True  # asked for: anywhere
    assert will_compile(train("false"), cpuinfo=AMX_CPU, cuda=True) is False
    assert will_compile(train("auto"), cpuinfo=AMX_CPU, cuda=False) is True  # as compile_choice: AMX
    assert will_compile(train("auto"), cpuinfo=ZEN4_CPU, cuda=False) is False
    assert will_compile(train("auto"), cpuinfo=ZEN4_CPU, cuda=True) is True
    assert will_compile(train("auto"), cpuinfo="", cuda=False) is False  # nothing known: no process


def warm_up_processes() -> list[str]:
    """The pids of the warm-up processes running now (`python -m pipeline.compile_warmup`)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"pipeline.compile_warmup" in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(pid)
        except OSError:
            continue
    return found


def test_an_eager_run_starts_no_warm_up_process(run_root):
    with compile_warmup.beside(tiny_config(run_root, "train.compile=false")):
        assert warm_up_processes() == []


def test_a_warm_up_past_its_bound_is_stopped_and_says_so(run_root):
    """compile_now's bound (the DAG's task waits at most WAIT_S): the process is stopped, nothing of
    it is left, and the line says the islands compile at their first step."""
    said = compile_warmup.compile_now(tiny_config(run_root, "train.compile=true"), wait_s=0.5)
    assert said == "warm-up: still compiling after 0.5 s; stopped, the islands compile at their first step"
    assert warm_up_processes() == []


def test_a_warm_up_that_cannot_start_costs_the_run_nothing(run_root, tmp_path, monkeypatch, caplog):
    """Its scratch directory cannot be made (a TMPDIR that is gone): the run goes on, one warning
    says the islands compile at their first step."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    ran = False
    with caplog.at_level("WARNING", logger="dipaco.warmup"):
        with compile_warmup.beside(tiny_config(run_root, "train.compile=true")):
            ran = True
    assert ran
    said = [r.getMessage() for r in caplog.records if r.name == "dipaco.warmup"]
    assert len(said) == 1 and "could not start" in said[0] and "compile at their first step" in said[0]


def test_a_warm_up_that_cannot_start_says_so_and_the_dag_task_goes_on(run_root, tmp_path, monkeypatch):
    """compile_now, the DAG's warm_up task: no exception, one line naming why (a TMPDIR that is gone)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    said = compile_warmup.compile_now(tiny_config(run_root, "train.compile=true"))
    assert said is not None and said.startswith("warm-up: could not start") and str(tmp_path / "gone") in said
    assert compile_warmup.compile_now(tiny_config(run_root, "train.compile=false")) is None  # eager: nothing


@pytest.mark.slow  # ~40 s: inductor compiles the tiny path once (cold cache), then a task reads it
def test_the_first_train_task_reads_the_warm_ups_kernels_instead_of_compiling(run_root, tmp_path, monkeypatch):
    host = tmp_path / "host-tmp"  # a host's TMPDIR, where inductor keeps its kernels: empty
    host.mkdir()
    monkeypatch.setenv("TMPDIR", str(host))  # this host's processes: the warm-up's and the task's
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    config = tiny_config(run_root, *TINY_PATH, "train.compile=true")

    # as the DAG's warm_up task runs it (`dipaco run` and `dipaco island --wait` start the same process)
    said = compile_warmup.compile_now(config)
    assert said is not None and said.startswith("warm-up: compiled the path model's forward and backward in"), said
    assert not run_root.exists()  # nothing of the run root: only the host's own cache
    task = subprocess.run(
        [sys.executable, "-c", TRAIN_AND_COUNT, str(run_root), *TINY_PATH, "train.compile=true"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert task.returncode == 0, task.stderr[-2000:]
    found = json.loads(task.stdout.strip().splitlines()[-1])
    assert found["compiled"] is True
    # the forward's and the backward's graphs, both from the warm-up's cache, none compiled again
    assert found["inductor"].get("fxgraph_cache_hit", 0) >= 2, found
    assert found["inductor"].get("fxgraph_cache_miss", 0) == 0, found

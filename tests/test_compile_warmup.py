"""A host's first torch.compile done beside prepare or the wait for the plan
(pipeline/compile_warmup.py): the path's first train task then reads its kernels instead of
compiling them, and nothing is started where the islands train eagerly."""

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
from pipeline.core.config import dump_yaml

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


def test_an_eager_run_starts_no_warm_up_process(run_root):
    before = set(os.listdir("/proc"))
    with compile_warmup.beside(tiny_config(run_root, "train.compile=false")):
        started = [p for p in set(os.listdir("/proc")) - before if p.isdigit()]
        commands = []
        for pid in started:
            try:
                commands.append(open(f"/proc/{pid}/cmdline", "rb").read())
            except OSError:
                continue
    assert not any(b"compile_warmup" in c for c in commands)


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


@pytest.mark.slow  # ~40 s: inductor compiles the tiny path once (cold cache), then a task reads it
def test_the_first_train_task_reads_the_warm_ups_kernels_instead_of_compiling(run_root, tmp_path):
    host = tmp_path / "host-tmp"  # a host's TMPDIR, where inductor keeps its kernels: empty
    host.mkdir()
    env = {**os.environ, "TMPDIR": str(host), "PYTHONPATH": str(REPO)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    config = tiny_config(run_root, *TINY_PATH, "train.compile=true")

    def on_the_host(argv: list[str]) -> subprocess.CompletedProcess:
        """A process of that host: its TMPDIR, so its inductor cache."""
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    dumped = tmp_path / "config.yaml"
    dumped.write_text(dump_yaml(config))
    warm = on_the_host([sys.executable, "-m", "pipeline.compile_warmup", "--config-yaml", str(dumped)])
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert "compiled the path model's forward and backward" in warm.stderr
    assert not run_root.exists()  # nothing of the run root: only the host's own cache
    task = on_the_host([sys.executable, "-c", TRAIN_AND_COUNT, str(run_root), *TINY_PATH, "train.compile=true"])
    assert task.returncode == 0, task.stderr[-2000:]
    found = json.loads(task.stdout.strip().splitlines()[-1])
    assert found["compiled"] is True
    # the forward's and the backward's graphs, both from the warm-up's cache, none compiled again
    assert found["inductor"].get("fxgraph_cache_hit", 0) >= 2, found
    assert found["inductor"].get("fxgraph_cache_miss", 0) == 0, found

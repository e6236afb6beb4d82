"""What must hold on any machine and from any directory: paths resolve against the repository, the
registered model ships the pipeline's code, each rank sizes its threads from the cores it is
given, and the accelerator is the code's choice, not the Makefile's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, dipaco_run, tiny_config, write_synthetic_shards
from pipeline import stages
from pipeline.core.config import REPO_ROOT, resolve_ds_config
from pipeline.core.errors import ConfigError
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.train.distributed import rank_threads
from pipeline.train.train_path import train_path
from pipeline.train.zero import compile_choice, compile_forward


def test_the_repository_root_is_the_repository(tmp_path, monkeypatch):
    assert (REPO_ROOT / "pyproject.toml").is_file() and REPO_ROOT == REPO
    monkeypatch.chdir(tmp_path)
    assert resolve_ds_config("ds_configs/zero2.json") == REPO / "ds_configs" / "zero2.json"


def test_dipaco_run_from_another_directory_registers_a_model_with_the_pipelines_code(tmp_path):
    """`dipaco run --config <absolute>/configs/tiny.yaml` from elsewhere: the relative ds_config
    resolves against the repository, and the registered pyfunc carries pipeline/ (its router in
    pipeline/routing/) and models/ (MLflow code_paths), so it loads without this checkout; the
    Beam app (preprocessing/) is not needed to load it and is not shipped."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    data = REPO / "tests" / "data" / "c4"
    run_root = tmp_path / "run"
    sets = [
        f"run_root={run_root}",
        f"data.train={data}/train/*.json",
        f"data.eval={data}/validation/*.json",
        "model.grid=[2]",
        "model.blocks_per_level=[1]",
        "train.rounds=1",
        "train.inner_steps=2",
        "train.launcher=inprocess",
        "train.precision=auto",
        "mlflow.enabled=true",
        "eval.max_docs=4",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    env["PYTHONPATH"] = str(REPO)  # this checkout's code, wherever the console script was installed from
    done = dipaco_run(sets, elsewhere, env, program=[str(Path(sys.executable).with_name("dipaco"))])
    assert sorted(p.name for p in elsewhere.iterdir()) == []  # nothing written where it ran

    (mlmodel,) = run_root.glob("mlartifacts/**/MLmodel")  # one registered round
    code_dir = mlmodel.parent / yaml.safe_load(mlmodel.read_text())["flavors"]["python_function"]["code"]
    for shipped in (
        "pipeline/core/config.py",
        "pipeline/train/precision.py",
        "models/modular.py",
        "pipeline/routing/router.py",
        "pipeline/routing/tokenizer.py",
        "pipeline/routing/embedders.py",
    ):
        assert (code_dir / shipped).is_file(), shipped
    assert not (code_dir / "preprocessing").exists()
    assert not list(code_dir.rglob("__pycache__"))

    # the precision it chose (auto: from this CPU and a probe) is a param of the run and what the path trained in
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("dipaco").experiment_id])
    (parent,) = [r for r in runs if r.data.params.get("precision.resolved")]
    resolved = parent.data.params["precision.resolved"]
    assert resolved in ("fp32", "bf16") and parent.data.params["train.precision"] == "auto"
    assert "precision.reason" in parent.data.params
    metrics = RunRoot(run_root).read_committed_json(layout.path_dir(0, "p0"), "metrics.json")
    assert metrics["precision"] == resolved
    assert {r.data.params["path.precision"] for r in runs if "path.id" in r.data.params} == {resolved}
    assert f"precision: {resolved} (" in done.stderr  # said once per run
    assert done.stderr.count("precision: ") == 1


def test_rank_threads_share_the_given_cores_among_the_ranks_at_once(run_root):
    config = tiny_config(run_root, "train.parallel_paths=2", "train.procs_per_path=1")
    assert rank_threads(config.train, islands=True, cores=2) == 1
    assert rank_threads(config.train, islands=True, cores=16) == 8
    config = tiny_config(run_root, "train.islands=3", "train.procs_per_path=2", "train.parallel_paths=1")
    assert rank_threads(config.train, islands=True, cores=24) == 4  # 3 islands x 2 ranks
    assert rank_threads(config.train, islands=False, cores=24) == 12  # one-shot launches: parallel_paths
    assert rank_threads(config.train, islands=True, cores=2) == 1  # more ranks than cores: 1 each
    config = tiny_config(run_root, "train.threads_per_proc=3")
    assert rank_threads(config.train, islands=True, cores=2) == 3  # configured: honoured


def test_a_launched_rank_sets_its_threads_from_its_cores_whatever_its_environment(run_root):
    """A path rank started on one core with OMP_NUM_THREADS=7 in its environment (as a launcher
    or a shell might leave it) trains with 1 thread, and says so in its metrics."""
    config = tiny_config(
        run_root, "model.grid=[1]", "model.blocks_per_level=[1]", "train.parallel_paths=1", "train.inner_steps=1"
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    env = {**os.environ, "OMP_NUM_THREADS": "7", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.train.train_path",
            "--run-root",
            str(run_root),
            "--round",
            "0",
            "--path",
            "p0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert root.read_committed_json(layout.path_dir(0, "p0"), "metrics.json")["threads"] == 1


def test_the_makefile_leaves_the_accelerator_to_the_code():
    makefile = (REPO / "Makefile").read_text()
    assert "DS_ACCELERATOR" not in makefile
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    code = (
        "import logging, os; logging.basicConfig(level=logging.INFO, format='%(message)s');"
        "from pipeline.train.distributed import set_runtime_env; set_runtime_env(); print(os.environ['DS_ACCELERATOR'])"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert done.stdout.strip() == expected, done.stderr
    lines = [line for line in done.stderr.splitlines() if "CUDA" in line]
    assert len(lines) == (0 if expected == "cuda" else 1)  # one line saying why not
    if expected == "cpu":
        assert lines[0].startswith("training on the CPU: ")


def test_compile_auto_compiles_only_where_it_measured_faster(run_root):
    """auto is decided by the hardware, not the file: inductor paid on an AVX-512 CPU with AMX and is
    taken on CUDA; it won back less than its first compile on an AVX-512 Zen 4 without AMX and
    measured no faster than eager on an AVX2-only EPYC (pipeline/train/zero.py); an explicit value
    is honoured everywhere, and a typo is refused naming the key."""
    auto = tiny_config(run_root / "auto", "train.compile=auto").train
    assert compile_choice(auto, device="cpu", isa="AVX512", amx=True)[0] is True
    compiled, reason = compile_choice(auto, device="cpu", isa="AVX512", amx=False)
    assert compiled is False and "no AMX" in reason
    compiled, reason = compile_choice(auto, device="cpu", isa="AVX2", amx=False)
    assert compiled is False and "AVX2" in reason
    assert compile_choice(auto, device="cpu", isa="DEFAULT", amx=False)[0] is False  # Arm, or no vector ISA
    assert compile_choice(auto, device="cuda")[0] is True
    for value in (True, False):
        explicit = tiny_config(run_root / str(value), f"train.compile={str(value).lower()}").train
        assert compile_choice(explicit, device="cpu", isa="AVX2")[0] is value
        assert compile_choice(explicit, device="cpu", isa="AVX512", amx=True)[0] is value
    with pytest.raises(ConfigError, match="train.compile"):
        tiny_config(run_root / "typo", "train.compile=always")
    eager = torch.nn.Linear(2, 2)
    forward = eager.forward
    if not torch.cuda.is_available() and not compile_choice(auto)[0]:  # this machine's own answer, end to end
        assert compile_forward(eager, auto, {"zero_optimization": {"stage": 2}}) is False
        assert eager.forward == forward


@pytest.mark.slow  # ~20 s: inductor compiles the tiny path once (cold cache)
def test_a_compiled_path_trains_like_the_eager_one(run_root):
    losses = {}
    for compiled in (False, True):
        config = tiny_config(
            run_root / str(compiled),
            "model.grid=[1]",
            "model.blocks_per_level=[1]",
            "train.inner_steps=3",
            f"train.compile={str(compiled).lower()}",
        )
        root = stages.init_run(Run(config))
        write_synthetic_shards(root, config.model.grid)
        metrics = train_path(config, 0, "p0")
        assert metrics["compiled"] is compiled
        losses[compiled] = metrics["loss"]
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] >= 1  # really compiled, not a silent fallback to eager
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
    zero3 = tiny_config(run_root / "z3", "train.compile=true", "train.ds_config=ds_configs/zero3.json")
    assert compile_forward(torch.nn.Linear(2, 2), zero3.train, {"zero_optimization": {"stage": 3}}) is False

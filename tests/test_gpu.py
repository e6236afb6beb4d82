"""The GPU code paths (CUDA device, NCCL, precision chosen by auto) on a real GPU: a tiny path on one
`deepspeed` rank under ZeRO-2 and ZeRO-3. Skipped with one line where there is no CUDA device."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config, write_synthetic_shards
from pipeline import stages
from pipeline.islands.launch import train_path_job
from pipeline.run import Run
from pipeline.state import layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (GPU tests need one)"),
]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_tiny_path_trains_on_cuda_in_the_precision_auto_picks(run_root, monkeypatch, stage):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # the suite's conftest pins cpu for everything else
    config = tiny_config(
        run_root,
        "model.grid=[1]",
        "model.blocks_per_level=[2]",
        "model.hidden_size=64",
        "train.launcher=deepspeed",
        "train.procs_per_path=1",
        "train.inner_steps=20",
        "train.lr=0.003",
        "train.precision=auto",
        f"train.ds_config=ds_configs/zero{stage}.json",
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    metrics = train_path_job(config, 0, "p0")
    assert metrics is not None, f"launch failed: {root.path(layout.attempts_dir(0, 'p0'))}"
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert metrics["precision"] == expected, metrics["precision_reason"]
    assert metrics["ds_config"]["torch_autocast"]["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[expected]
    assert metrics["ds_config"]["zero_optimization"]["stage"] == stage and metrics["world_size"] == 1
    assert metrics["loss"][-1] < metrics["loss"][0]
    print(
        f"ZeRO-{stage} on {torch.cuda.get_device_name()}: {metrics['seconds'] / config.train.inner_steps * 1e3:.1f} ms "
        f"per step, {metrics['tokens_per_s']:.0f} tokens/s ({expected})"
    )

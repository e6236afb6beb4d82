"""train.precision: auto decides from the hardware and a cached probe, never from the config file;
explicit values are honoured; the resolved precision is what the DeepSpeed engine trains in."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, run_script_json, tiny_config, write_synthetic_shards
from models.modular import ModelShape, build_path_model
from pipeline import stages
from pipeline.core.errors import ConfigError
from pipeline.run import Run
from pipeline.train import precision as P
from pipeline.train.train_path import adamw_for, train_path
from pipeline.train.zero import fill_ds_config, load_ds_config, release_engine, wrap_with_zero


class CountingProbe:
    """Stands in for timing the path model on a CPU this machine is not (an AVX2-only one, or
    one where bf16 loses): returns fixed step seconds and counts its calls."""

    def __init__(self, fp32: float, bf16: float):
        self.seconds, self.calls = {"fp32": fp32, "bf16": bf16}, 0

    def __call__(self) -> dict[str, float]:
        self.calls += 1
        return dict(self.seconds)


def _train_and_shape(run_root, precision: str = "auto"):
    config = tiny_config(run_root, f"train.precision={precision}")
    return config.train, ModelShape.from_config(config.model)


def test_auto_follows_the_hardware_not_the_config_file(run_root, tmp_path):
    train, shape = _train_and_shape(run_root)  # the same config file in every case
    no_bf16 = CountingProbe(fp32=0.47, bf16=4.8)
    chosen = P.resolve(train, shape, device="cpu", native_bf16=(False, "AVX2"), probe=no_bf16, cache_dir=tmp_path / "a")
    assert (chosen.name, no_bf16.calls) == ("fp32", 0)  # no native bf16: fp32, nothing to measure
    assert "AVX2" in chosen.reason and "no native bfloat16" in chosen.reason

    bf16_wins = CountingProbe(fp32=0.41, bf16=0.29)
    chosen = P.resolve(
        train, shape, device="cpu", native_bf16=(True, "AVX512"), probe=bf16_wins, cache_dir=tmp_path / "b"
    )
    assert (chosen.name, bf16_wins.calls) == ("bf16", 1)
    assert "bf16 0.290 s vs fp32 0.410 s" in chosen.reason

    fp32_wins = CountingProbe(fp32=0.20, bf16=0.25)  # native bf16 that measures slower (a tiny model)
    chosen = P.resolve(
        train, shape, device="cpu", native_bf16=(True, "AVX512"), probe=fp32_wins, cache_dir=tmp_path / "c"
    )
    assert chosen.name == "fp32"


def test_explicit_precisions_are_honoured_and_emulated_bf16_warns_with_the_slowdown(run_root, tmp_path, caplog):
    for name in ("fp32", "bf16", "fp16"):
        train, shape = _train_and_shape(run_root, name)
        probe = CountingProbe(fp32=0.41, bf16=0.29)
        chosen = P.resolve(train, shape, device="cpu", native_bf16=(True, "AVX512"), probe=probe, cache_dir=tmp_path)
        assert (chosen.name, probe.calls) == (name, 0)
        assert P.resolve(train, shape, device="cuda").name == name

    train, shape = _train_and_shape(run_root, "bf16")
    slow = CountingProbe(fp32=0.47, bf16=4.8)
    with caplog.at_level(logging.WARNING, logger="dipaco.precision"):
        chosen = P.resolve(
            train, shape, device="cpu", native_bf16=(False, "AVX2"), probe=slow, cache_dir=tmp_path / "x"
        )
    assert chosen.name == "bf16"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "emulated" in warning and "10.2x slower" in warning and "AVX2" in warning


def test_auto_on_cuda_is_bf16_where_supported_else_fp16(run_root, monkeypatch):
    train, shape = _train_and_shape(run_root)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert P.resolve(train, shape, device="cuda").name == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    chosen = P.resolve(train, shape, device="cuda")
    assert chosen.name == "fp16" and "loss scaling" in chosen.reason


def test_the_probe_runs_once_per_host_shape_and_threads(run_root, tmp_path):
    train, shape = _train_and_shape(run_root)
    probe = CountingProbe(fp32=0.41, bf16=0.29)
    for _ in range(3):
        assert (
            P.resolve(
                train, shape, threads=1, device="cpu", native_bf16=(True, "AVX512"), probe=probe, cache_dir=tmp_path
            ).name
            == "bf16"
        )
    assert probe.calls == 1
    cache = json.loads((tmp_path / P.CACHE_FILE).read_text())
    (key,) = cache
    assert json.loads(key)["threads"] == 1 and cache[key]["seconds"] == {"fp32": 0.41, "bf16": 0.29}
    P.resolve(train, shape, threads=2, device="cpu", native_bf16=(True, "AVX512"), probe=probe, cache_dir=tmp_path)
    assert probe.calls == 2 and len(json.loads((tmp_path / P.CACHE_FILE).read_text())) == 2
    (tmp_path / P.CACHE_FILE).write_text("{not json")  # a damaged cache is measured again, not an error
    P.resolve(train, shape, threads=1, device="cpu", native_bf16=(True, "AVX512"), probe=probe, cache_dir=tmp_path)
    assert probe.calls == 3


def test_the_real_probe_times_both_precisions_on_this_cpu(run_root, tmp_path):
    train, shape = _train_and_shape(run_root)
    seconds = P.probe_step_seconds(train, shape, threads=1, steps=1)
    assert set(seconds) == {"fp32", "bf16"} and all(0 < s < 10 for s in seconds.values())
    native, isa = P.cpu_native_bf16()
    chosen = P.resolve(train, shape, threads=1, device="cpu", cache_dir=tmp_path)
    assert chosen.name == "fp32" if not native else chosen.name in ("fp32", "bf16")
    assert isa in chosen.reason


def test_the_ds_config_gets_its_precision_blocks_from_train_precision(run_root):
    train, shape = _train_and_shape(run_root)
    raw = {"zero_optimization": {"stage": 2}}
    fp32 = fill_ds_config(raw, train, shape, 1, "f.json", "fp32")
    assert "torch_autocast" not in fp32 and fp32["bf16"] == fp32["fp16"] == {"enabled": False}
    filled = fill_ds_config(raw, train, shape, 1, "f.json", "bf16")
    assert filled["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert filled["bf16"] == {"enabled": False} and filled["fp16"] == {"enabled": False}  # fp32 master weights
    assert fill_ds_config(raw, train, shape, 1, "f.json", "fp16")["torch_autocast"]["dtype"] == "float16"
    for block in ({"bf16": {"enabled": True}}, {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}):
        with pytest.raises(ConfigError, match="f.json: remove the .* block; set train.precision"):
            fill_ds_config({**raw, **block}, train, shape, 1, "f.json", "fp32")


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_a_zero2_step_trains_in_the_resolved_precision(run_root, name):
    config = tiny_config(run_root, "model.grid=[1]", "model.blocks_per_level=[1]", f"train.precision={name}")
    shape = ModelShape.from_config(config.model)
    chosen = P.resolve(config.train, shape)
    model = build_path_model(shape, seed=0)
    engine = wrap_with_zero(model, adamw_for(model, config.train), load_ds_config(config.train, shape, 1, chosen))
    try:
        assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == getattr(
            torch, P.AUTOCAST_DTYPES[name]
        )
        inputs = torch.randint(0, shape.vocab_size, (2, config.model.seq_len))
        losses = []
        for _ in range(4):
            logits = engine(input_ids=inputs).logits
            assert logits.dtype == getattr(torch, P.AUTOCAST_DTYPES[name])  # the forward ran in it
            loss = F.cross_entropy(logits.flatten(0, 1).float(), inputs.flatten())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
        assert all(p.dtype == torch.float32 for p in engine.module.parameters())  # fp32 master weights
    finally:
        release_engine(engine)


def test_a_path_records_the_precision_it_trained_in(run_root):
    config = tiny_config(run_root, "model.grid=[1]", "model.blocks_per_level=[1]", "train.precision=auto")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    metrics = train_path(config, 0, "p0")
    expected = P.resolve(config.train, ModelShape.from_config(config.model))  # from the cache the path filled
    assert metrics["precision"] == expected.name and metrics["precision_reason"] == expected.reason
    assert ("torch_autocast" in metrics["ds_config"]) == (expected.name != "fp32")
    assert metrics["loss"][-1] < metrics["loss"][0]


def test_an_fp32_engine_after_an_fp16_one_in_the_same_process_has_no_grad_scaler(run_root):
    """DeepSpeed keeps torch_autocast in module globals; an in-process run that trains fp16 and
    then fp32 must not carry the fp16 engine's GradScaler into the fp32 one."""
    engines = []
    for name in ("fp16", "fp32"):
        config = tiny_config(run_root, "model.grid=[1]", "model.blocks_per_level=[1]", f"train.precision={name}")
        shape = ModelShape.from_config(config.model)
        model = build_path_model(shape, seed=0)
        engine = wrap_with_zero(
            model,
            adamw_for(model, config.train),
            load_ds_config(config.train, shape, 1, P.resolve(config.train, shape)),
        )
        engines.append(engine.optimizer.torch_autocast_gradscaler)
        release_engine(engine)
    assert engines[0] is not None and engines[1] is None


@pytest.mark.parametrize("native", [True, False])
def test_the_benchmark_measures_bf16_only_where_the_cpu_computes_it(monkeypatch, native):
    """Emulated bf16 took 30 of `make bench`'s 60 minutes on an AVX2 CPU, for a row auto never picks."""
    from benchmarks.perf import bf16_skip_reason

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    reason = bf16_skip_reason()
    assert (reason is None) if native else ("no native bfloat16" in reason and "fp32" in reason)


# The caps a user sets to see what an AVX2-only CPU does on a newer x86 one: torch's own kernels,
# oneDNN's and MKL's (docs/algorithm.md). torch and oneDNN then report AVX2 and no native bf16.
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
RESOLVE_IN_A_NEW_PROCESS = """
import json, sys
from pathlib import Path
from conftest import tiny_config
from models.modular import ModelShape
from pipeline.train import precision as P
run_root, cache_dir = json.loads(sys.argv[1])
config = tiny_config(Path(run_root), "train.precision=auto")
shape = ModelShape.from_config(config.model)
chosen = P.resolve(config.train, shape, threads=1, device="cpu", cache_dir=Path(cache_dir))
print(json.dumps({"name": chosen.name, "reason": chosen.reason, "native": P.cpu_native_bf16()[0]}))
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="not an x86 CPU with AVX2")
def test_auto_on_this_cpu_capped_to_avx2_trains_in_fp32_without_a_probe(run_root, tmp_path):
    """The AVX2 branch on real hardware, not a stand-in: this CPU restricted to AVX2 kernels (on an
    AVX2-only CPU the caps change nothing) has no native bfloat16 for torch, and auto picks fp32
    from that capability alone, timing nothing (no probe cache is written)."""
    env = {**os.environ, **AVX2_CAPS, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    chosen = run_script_json(RESOLVE_IN_A_NEW_PROCESS, [str(run_root), str(tmp_path / "cache")], REPO, env)
    assert chosen == {
        "name": "fp32",
        "reason": "auto: this CPU (AVX2) has no native bfloat16, which would be emulated",
        "native": False,
    }
    assert not (tmp_path / "cache" / P.CACHE_FILE).exists()

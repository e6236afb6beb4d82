"""Compressed outer gradients (outer.compression): the codec's error bounds, the path job's files,
and merges that read them (Streaming DiLoCo, arXiv 2501.18512: 4-bit outer gradients)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_config, write_synthetic_shards
from models.grid import ModuleKey, all_modules
from models.modular import ModelShape
from pipeline import stages
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.outer import compression
from pipeline.outer.merge import merge_round, read_outer_gradient, read_path_levels
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.module_store import load_modules
from pipeline.state.storage import RunRoot
from pipeline.train.train_path import train_path

SETS = ["model.grid=[2, 1]", "train.inner_steps=2", "train.lr=0.01"]


def _blocky(seed: int) -> dict[str, torch.Tensor]:
    """Tensors whose blocks differ in magnitude by orders, with an all-zero block and odd sizes."""
    g = torch.Generator().manual_seed(seed)
    matrix = torch.randn(10, 77, generator=g) * torch.logspace(-6, 0, 10)[:, None]
    matrix.view(-1)[128:256] = 0.0  # the second block of the flattened tensor
    return {
        "matrix": matrix,
        "odd": torch.randn(257, generator=g) * 1e-3,
        "tiny": torch.randn(3, generator=g),
        "zeros": torch.zeros(5),
    }


@pytest.mark.parametrize("kind,levels", [("int8", 127), ("int4", 7)])
def test_quantised_round_trip_is_within_half_a_step_of_each_blocks_scale(kind, levels):
    grad = _blocky(0)
    stored = compression.encode(grad, kind)
    decoded = compression.decode(stored, kind)
    assert list(decoded) == list(grad)
    for name, x in grad.items():
        flat = x.reshape(-1)
        blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % compression.BLOCK)).view(-1, compression.BLOCK)
        step = (blocks.abs().amax(dim=1) / levels).repeat_interleave(compression.BLOCK)[: flat.numel()]  # (n,)
        error = (decoded[name].reshape(-1) - flat).abs()
        assert decoded[name].shape == x.shape and decoded[name].dtype == torch.float32
        assert bool((error <= step / 2 * (1 + 1e-5) + 1e-30).all()), f"{name}: {float((error / step).max())} steps off"
        assert torch.equal(compression.error_bound(x, kind).reshape(-1), step / 2)
        zero = step == 0
        assert torch.equal(decoded[name].reshape(-1)[zero], flat[zero])  # all-zero blocks are exact
    assert torch.equal(decoded["matrix"].view(-1)[128:256], torch.zeros(128)) and torch.equal(
        decoded["zeros"], torch.zeros(5)
    )
    codes = stored["odd:q"]
    assert codes.dtype == (torch.int8 if kind == "int8" else torch.uint8)
    assert codes.numel() == (257 if kind == "int8" else 129)  # int4: two codes a byte
    assert stored["odd:scale"].numel() == math.ceil(257 / compression.BLOCK)


def test_bf16_round_trip_is_the_cast_within_half_an_ulp():
    grad = _blocky(1)
    decoded = compression.decode(compression.encode(grad, "bf16"), "bf16")
    for name, x in grad.items():
        assert torch.equal(decoded[name], x.to(torch.bfloat16).float())
        assert bool(((decoded[name] - x).abs() <= x.abs() * 2.0**-8).all())
    assert compression.decode(compression.encode(grad, "none"), "none").keys() == grad.keys()


def test_an_unknown_compression_is_refused_naming_the_key_and_the_file(run_root):
    with pytest.raises(ConfigError, match=r"outer\.compression.*int2|int2.*outer\.compression") as caught:
        load_config(REPO / "configs" / "tiny.yaml", [f"run_root={run_root}", "outer.compression=int2"])
    assert "tiny.yaml" in str(caught.value)
    with pytest.raises(ValueError, match="int2"):
        compression.encode({"w": torch.ones(2)}, "int2")


def test_a_private_module_stays_lossless_under_compression(run_root):
    """Path-specific blocks never leave their island: no gradient file is written for them, and the
    merge carries each path's trained private module over bitwise, while shared modules are int4."""
    config = tiny_config(run_root, *SETS, "model.path_specific_blocks=1", "outer.compression=int4")
    root, shape = stages.init_run(Run(config)), ModelShape.from_config(config.model)
    write_synthetic_shards(root, config.model.grid)
    for path_id in stages.list_paths(config):
        train_path(config, 0, path_id)
    marker = root.marker(layout.path_dir(0, "p0-0"))
    assert marker["outer_grad"] == {"0": "int4", "1": "int4"}  # the grid's two levels, not the private one
    merge_round(config, 0)
    for index, path_id in enumerate(stages.list_paths(config)):
        trained = read_path_levels(root, shape, 0, path_id)[shape.n_levels]
        (merged,) = load_modules(root, 1, [ModuleKey(len(config.model.grid), index)]).values()
        assert trained.keys() == merged.keys() and all(torch.equal(trained[k], merged[k]) for k in trained)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """Round 0 of a [2, 1] grid trained by the real path job once per encoding (training is
    seeded, so every run root holds the same trained weights)."""
    roots = {}
    for kind in ("none", "bf16", "int8", "int4"):
        run = tmp_path_factory.mktemp(kind) / "run"
        config = tiny_config(run, *SETS, f"outer.compression={kind}")
        write_synthetic_shards(stages.init_run(Run(config)), config.model.grid)
        for path_id in stages.list_paths(config):
            train_path(config, 0, path_id)
        roots[kind] = run
    return roots


def _copy(trained: dict[str, Path], kind: str, to: Path):
    shutil.copytree(trained[kind], to)
    return tiny_config(to, *SETS, f"outer.compression={kind}")


def test_the_path_job_writes_compressed_gradients_only_when_asked(trained):
    none, int4 = RunRoot(str(trained["none"])), RunRoot(str(trained["int4"]))
    plain = none.marker(layout.path_dir(0, "p0-0"))
    assert sorted(plain["files"]) == ["config.json", "metrics.json", "model.safetensors"] and "outer_grad" not in plain
    marker = int4.marker(layout.path_dir(0, "p0-0"))
    assert marker["outer_grad"] == {"0": "int4", "1": "int4"}
    assert {layout.outer_grad_file(0), layout.outer_grad_file(1)} <= set(marker["files"])
    weights = [r.read_committed(layout.path_dir(0, "p0-0"), "model.safetensors") for r in (none, int4)]
    assert weights[0] == weights[1]  # the full-precision weights stay as they are


@pytest.mark.parametrize(
    "kind,update_error,data_ratio", [("bf16", 0.01, 1 / 2), ("int8", 0.02, 1 / 4), ("int4", 0.25, 1 / 8)]
)
def test_a_compressed_merge_is_close_to_the_uncompressed_one_and_sends_fewer_bytes(
    trained, tmp_path, kind, update_error, data_ratio
):
    _copy(trained, "none", tmp_path / "none")
    plain, packed = tiny_config(tmp_path / "none", *SETS), _copy(trained, kind, tmp_path / kind)
    reference, report = merge_round(plain, 0), merge_round(packed, 0)
    keys = all_modules(plain.model.grid)
    before = load_modules(RunRoot(plain.run_root), 0, keys)
    exact, approx = load_modules(RunRoot(plain.run_root), 1, keys), load_modules(RunRoot(packed.run_root), 1, keys)
    for key in keys:
        update = torch.cat([(exact[key][n] - before[key][n]).reshape(-1) for n in before[key]])
        error = torch.cat([(approx[key][n] - exact[key][n]).reshape(-1) for n in before[key]])
        assert 0 < float(error.norm()) < update_error * float(update.norm()), (key, float(error.norm() / update.norm()))
    # Bytes: twice the gradient files each island wrote (out, and the average back), against
    # the fp32 modules uncompressed; data-parallel is the same fp32 all-reduce at every step.
    written = [p.read_bytes() for p in Path(packed.run_root).glob("rounds/round=0/paths/*/outer_grad/*.safetensors")]
    assert report["bytes_outer"] == 2 * sum(map(len, written)) and report["compression"] == kind
    assert report["bytes_outer_uncompressed"] == reference["bytes_outer"]
    assert (
        report["bytes_data_parallel"]
        == reference["bytes_data_parallel"]
        == plain.train.inner_steps * reference["bytes_outer"]
    )
    headers = sum(8 + int.from_bytes(data[:8], "little") for data in written)  # safetensors' JSON headers
    tensors = 2 * (sum(map(len, written)) - headers) / reference["bytes_outer"]
    assert data_ratio <= tensors < data_ratio * 1.1, tensors  # + 4 bytes of scale per 128 and the shapes
    assert report["bytes_outer"] / reference["bytes_outer"] < data_ratio * 1.4  # headers weigh on a tiny model


def test_a_compressed_merge_takes_the_outer_step_on_the_decoded_gradients(trained, tmp_path):
    """g_m = sum_p alpha_p * decode(delta_p), then the first Nesterov step (buffer = g):
    theta - lr * (g + momentum * g), computed here from the gradient files the paths wrote."""
    config = _copy(trained, "int4", tmp_path / "int4")
    root, shape = RunRoot(config.run_root), ModelShape.from_config(config.model)
    report = merge_round(config, 0)
    keys = all_modules(config.model.grid)
    before, after = load_modules(root, 0, keys), load_modules(root, 1, keys)
    lr, momentum = config.outer.lr, config.outer.momentum
    for key in keys:
        through = report["module_paths"][str(key)]
        tokens = [report["tokens"][p] for p in through]
        deltas = [read_outer_gradient(root, shape, 0, p, key.level) for p in through]
        for name, theta in before[key].items():
            grad = sum(t / sum(tokens) * delta[name] for t, delta in zip(tokens, deltas))
            torch.testing.assert_close(after[key][name], theta - lr * (grad + momentum * grad), rtol=1e-5, atol=1e-6)

"""The outer merge against hand computation and torch's own SGD (DiLoCo / DiPaCo outer step)."""

import math

import pytest
import torch
from safetensors.torch import save as st_save

from conftest import tiny_config, write_synthetic_shards
from models.grid import ModuleKey, all_modules
from models.modular import ModelShape, assemble_path_state, split_path_state
from pipeline import stages
from pipeline.outer.merge import OuterOptimizer, finish_round, merge_module, merge_round
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.module_store import load_modules, load_path_modules, read_state
from pipeline.state.storage import RunRoot
from pipeline.train.train_path import train_path

LR, MOMENTUM = 0.7, 0.9


def fake_path(root: RunRoot, config, round_index: int, path_id: str, shift: float, tokens: int) -> list[dict]:
    """Commit a path's training output as the trainer would: all its modules (its private one
    last, with path blocks) moved by `shift`; returned in level order."""
    shape = ModelShape.from_config(config.model)
    modules = load_path_modules(
        root, round_index, tuple(int(k) for k in path_id[1:].split("-")), shape, config.model.grid
    )
    trained = [
        {k: v + shift * (1 + torch.arange(v.numel()).reshape(v.shape) % 3) for k, v in m.items()} for m in modules
    ]
    rel = layout.path_dir(round_index, path_id)
    root.write_bytes(f"{rel}/model.safetensors", st_save(assemble_path_state(shape, trained)))
    root.write_json(f"{rel}/metrics.json", {"tokens": tokens})
    root.commit(rel, info={"tokens": tokens})
    return trained


def nesterov_by_hand(before, grad, buf):
    """torch's SGD(nesterov) written out: buf = m*buf + g (buf = g at first); p -= lr*(g + m*buf)."""
    buf = grad.clone() if buf is None else MOMENTUM * buf + grad
    return before - LR * (grad + MOMENTUM * buf), buf


def test_outer_step_equals_torch_sgd_applied_by_hand():
    torch.manual_seed(0)
    before = {"w": torch.randn(5, 3)}
    afters = [{"w": torch.randn(5, 3)}, {"w": torch.randn(5, 3)}]
    outer = OuterOptimizer(LR, MOMENTUM, nesterov=True)
    grad = outer.outer_gradient(before, afters, [30.0, 10.0])
    torch.testing.assert_close(grad["w"], 0.75 * (before["w"] - afters[0]["w"]) + 0.25 * (before["w"] - afters[1]["w"]))
    reference = torch.nn.Parameter(before["w"].clone())
    sgd = torch.optim.SGD([reference], lr=LR, momentum=MOMENTUM, nesterov=True)
    params, buffers = before, None
    for _ in range(2):  # two outer steps, the buffer carried between them as the merge persists it
        grad = outer.outer_gradient(params, afters, [30.0, 10.0])
        params, buffers = outer.outer_step(params, grad, buffers)
        reference.grad = grad["w"].clone()
        sgd.step()
    torch.testing.assert_close(params["w"], reference.detach())
    torch.testing.assert_close(buffers["w"], sgd.state[reference]["momentum_buffer"])


def test_merge_of_two_paths_sharing_a_module_over_two_rounds(run_root):
    config = tiny_config(run_root, "model.grid=[2, 1]")
    root = stages.init_run(Run(config))
    shared = ModuleKey(1, 0)
    before = load_modules(root, 0, [shared])[shared]
    buffers = {k: None for k in before}
    expected = {}
    for round_index in range(2):
        a = fake_path(root, config, round_index, "p0-0", shift=0.01 * (round_index + 1), tokens=30)
        b = fake_path(root, config, round_index, "p1-0", shift=-0.03, tokens=10)
        report = merge_round(config, round_index)
        for key, theta in before.items():
            grad = 0.75 * (theta - a[1][key]) + 0.25 * (theta - b[1][key])
            expected[key], buffers[key] = nesterov_by_hand(theta, grad, buffers[key])
        merged = load_modules(root, round_index + 1, [shared])[shared]
        for key in before:
            torch.testing.assert_close(merged[key], expected[key], rtol=1e-5, atol=1e-6)
        assert report["module_paths"][str(shared)] == ["p0-0", "p1-0"]
        assert report["tokens"] == {"p0-0": 30, "p1-0": 10}
        before = merged


def test_modules_merged_one_by_one_in_any_order_take_the_hand_computed_steps_before_their_round_commits(run_root):
    """What islands do: each module merged on its own as its paths come in, round 1's before round
    0 is committed (its modules and momentum then come from round 0's staged merges); finish_round
    commits each round with the same numbers and removes the round before's staged modules."""
    config = tiny_config(run_root, "model.grid=[2, 1]")
    root = stages.init_run(Run(config))
    shared, keys = ModuleKey(1, 0), all_modules([2, 1])
    before = load_modules(root, 0, [shared])[shared]
    buffers = {k: None for k in before}
    for round_index in range(2):
        a = fake_path(root, config, round_index, "p0-0", shift=0.01 * (round_index + 1), tokens=30)
        b = fake_path(root, config, round_index, "p1-0", shift=-0.03, tokens=10)
        for key in reversed(keys):
            marker = merge_module(config, round_index, key)
        assert marker["paths"] == ["p0-0"] and marker["module"] == [0, 0]  # the last one merged: (0, 0)
        expected = {}
        for name, theta in before.items():
            grad = 0.75 * (theta - a[1][name]) + 0.25 * (theta - b[1][name])
            expected[name], buffers[name] = nesterov_by_hand(theta, grad, buffers[name])
        merged = load_modules(root, round_index + 1, [shared])[shared]  # staged: round r is not committed
        for name in before:
            torch.testing.assert_close(merged[name], expected[name], rtol=1e-5, atol=1e-6)
        before = merged
    assert not root.is_committed(layout.round_dir(0)) and not root.is_committed(layout.round_dir(1))
    for round_index in range(2):
        report = finish_round(config, round_index)
        assert report["module_paths"][str(shared)] == ["p0-0", "p1-0"] and report["tokens"] == {"p0-0": 30, "p1-0": 10}
    committed = load_modules(root, 2, [shared])[shared]
    momentum = read_state(root, layout.outer_state_dir(2), shared)
    for name in before:
        assert torch.equal(committed[name], before[name])  # gathered bitwise
        torch.testing.assert_close(momentum[name], buffers[name], rtol=1e-5, atol=1e-6)
    assert not root.exists(layout.merged_dir(0)) and root.is_committed(layout.merged_module_dir(1, shared))


def test_left_out_path_is_named_and_a_module_no_path_trained_keeps_its_parameters(run_root):
    config = tiny_config(run_root, "model.grid=[2, 1]")
    root = stages.init_run(Run(config))
    fake_path(root, config, 0, "p0-0", shift=0.02, tokens=10)
    report = merge_round(config, 0)
    assert report["paths_left_out"] == ["p1-0"] and report["paths_merged"] == ["p0-0"]
    assert report["modules_untouched"] == ["level=0/module=1"]
    kept_before = load_modules(root, 0, [ModuleKey(0, 1)])[ModuleKey(0, 1)]
    kept_after = load_modules(root, 1, [ModuleKey(0, 1)])[ModuleKey(0, 1)]
    assert all(torch.equal(kept_before[k], kept_after[k]) for k in kept_before)
    assert merge_round(config, 0) == report  # committed: a rerun returns the recorded merge


def test_sqrt_paths_rescale_multiplies_the_outer_gradient():
    before, afters = {"w": torch.ones(4)}, [{"w": torch.zeros(4)}, {"w": torch.full((4,), 2.0)}, {"w": torch.zeros(4)}]
    plain = OuterOptimizer(LR, MOMENTUM, True).outer_gradient(before, afters, [1, 1, 1])
    scaled = OuterOptimizer(LR, MOMENTUM, True, sqrt_paths_rescale=True).outer_gradient(before, afters, [1, 1, 1])
    torch.testing.assert_close(scaled["w"], plain["w"] * math.sqrt(3))


def test_bad_outer_settings_are_refused():
    with pytest.raises(ValueError, match="momentum"):
        OuterOptimizer(0.7, 1.5, True)
    with pytest.raises(ValueError, match="lr"):
        OuterOptimizer(0.0, 0.9, True)


def test_degenerate_grid_one_path_lr_one_no_momentum_gives_the_trained_path(run_root):
    config = tiny_config(run_root, "model.grid=[1]", "model.blocks_per_level=[2]", "outer.lr=1.0", "outer.momentum=0.0")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    train_path(config, 0, "p0")
    merge_round(config, 0)
    shape = ModelShape.from_config(config.model)
    from pipeline.state.module_store import decode

    trained = split_path_state(shape, decode(root.read_committed(layout.path_dir(0, "p0"), "model.safetensors"), "p0"))
    merged = load_modules(root, 1, [ModuleKey(0, 0)])[ModuleKey(0, 0)]
    before = load_modules(root, 0, [ModuleKey(0, 0)])[ModuleKey(0, 0)]
    assert any(not torch.equal(before[k], trained[0][k]) for k in before)  # training moved it
    for key in merged:
        torch.testing.assert_close(merged[key], trained[0][key], rtol=0, atol=1e-6)


def test_grid_2x2_averages_each_shared_module_over_exactly_two_trained_paths(run_root):
    config = tiny_config(run_root, "train.inner_steps=2", "train.lr=0.01")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid, docs_per_path={"p0-0": 20, "p0-1": 40, "p1-0": 30, "p1-1": 10})
    for path_id in stages.list_paths(config):
        train_path(config, 0, path_id)
    report = merge_round(config, 0)
    shape = ModelShape.from_config(config.model)
    from pipeline.state.module_store import decode

    trained = {
        p: split_path_state(shape, decode(root.read_committed(layout.path_dir(0, p), "model.safetensors"), p))
        for p in stages.list_paths(config)
    }
    before = load_modules(root, 0, all_modules([2, 2]))
    after = load_modules(root, 1, all_modules([2, 2]))
    for key in all_modules([2, 2]):
        through = report["module_paths"][str(key)]
        assert len(through) == 2 and all(p.split("-")[key.level].lstrip("p") == str(key.index) for p in through)
        tokens = [report["tokens"][p] for p in through]
        for name, theta in before[key].items():
            grad = sum(t / sum(tokens) * (theta - trained[p][key.level][name]) for p, t in zip(through, tokens))
            torch.testing.assert_close(after[key][name], nesterov_by_hand(theta, grad, None)[0], rtol=1e-5, atol=1e-6)
    # Communication: each island sends a gradient and receives modules once per round, where
    # data-parallel training would all-reduce every inner step.
    assert report["bytes_data_parallel"] == config.train.inner_steps * report["bytes_outer"]
    path_params = sum(t.numel() for m in trained["p0-0"] for t in m.values())
    assert report["bytes_outer"] == 2 * 4 * 4 * path_params

"""model.path_specific_blocks: each path's own blocks after the grid's (DiPaCo's path-specific
parameters), a private module per path that the merge carries over from the path, never averaged."""

import pytest
import torch
from test_merge import fake_path

from conftest import tiny_config, write_synthetic_shards
from models.grid import ModuleKey, all_modules, path_modules, paths_through
from models.modular import (
    ModelShape,
    build_path_model,
    initial_level_states,
    path_state,
    split_path_state,
    to_hf_key,
    to_module_key,
)
from pipeline import stages
from pipeline.core.config import ModelConfig
from pipeline.core.errors import ConfigError
from pipeline.islands.task_queue import Task, TaskQueue
from pipeline.outer.merge import merge_round
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.module_store import decode, load_modules
from pipeline.state.storage import RunRoot

SHAPE = ModelShape.from_config(
    ModelConfig(
        grid=[2, 3],
        blocks_per_level=[1, 2],
        hidden_size=32,
        num_heads=2,
        vocab_size=64,
        seq_len=16,
        path_specific_blocks=2,
    )
)


def _module_files(run, round_index: int, directory: str = "modules") -> dict[str, bytes]:
    base = run / layout.round_dir(round_index) / directory
    return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*.safetensors"))}


def _trained_modules(root: RunRoot, shape: ModelShape, round_index: int, path_id: str) -> list[dict]:
    rel = layout.path_dir(round_index, path_id)
    return split_path_state(shape, decode(root.read_committed(rel, "model.safetensors"), path_id))


def test_a_path_model_has_its_own_blocks_after_the_grids_and_the_key_map_round_trips():
    assert SHAPE.llama_config().num_hidden_layers == 1 + 2 + 2
    original = build_path_model(SHAPE, seed=3)
    state = path_state(original)
    for hf_key in state:
        assert to_hf_key(SHAPE, *to_module_key(SHAPE, hf_key)) == hf_key
    modules = split_path_state(SHAPE, state)
    assert len(modules) == 3
    # Layers 3 and 4 are the private module's blocks 0 and 1; norm and head stay with the last grid level.
    assert to_module_key(SHAPE, "model.layers.3.mlp.up_proj.weight") == (2, "blocks.0.mlp.up_proj.weight")
    assert to_module_key(SHAPE, "model.layers.4.input_layernorm.weight") == (2, "blocks.1.input_layernorm.weight")
    assert to_module_key(SHAPE, "model.norm.weight")[0] == 1 and to_module_key(SHAPE, "lm_head.weight")[0] == 1
    assert {k.split(".")[1] for k in modules[2]} == {"0", "1"} and len(modules[2]) == 2 * 9
    with pytest.raises(KeyError):
        to_hf_key(SHAPE, 2, "blocks.2.mlp.up_proj.weight")
    with pytest.raises(KeyError):
        to_hf_key(SHAPE, 3, "blocks.0.mlp.up_proj.weight")
    rebuilt = build_path_model(SHAPE, modules, seed=99)  # every weight from the modules, none from the seed
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(original(input_ids=ids).logits, rebuilt(input_ids=ids).logits)
    # The private module is indexed by the path's place in the grid's path order.
    assert all_modules([2, 3], private=True)[5:] == [ModuleKey(2, i) for i in range(6)]
    assert path_modules((1, 2), [2, 3], private=True) == [ModuleKey(0, 1), ModuleKey(1, 2), ModuleKey(2, 5)]
    assert paths_through(ModuleKey(2, 4), [2, 3]) == [(1, 1)]


def test_bad_values_are_refused_by_key(run_root):
    with pytest.raises(ConfigError, match="model.path_specific_blocks must be >= 0"):
        tiny_config(run_root, "model.path_specific_blocks=-1")
    with pytest.raises(ConfigError, match="model.path_specific_blocks needs train.workers_per_path = 1"):
        tiny_config(run_root, "model.path_specific_blocks=1", "train.workers_per_path=2")


def test_zero_blocks_keep_todays_module_files_and_one_block_adds_a_private_module_per_path(tmp_path):
    plain = tiny_config(tmp_path / "plain", "model.path_specific_blocks=0")
    private = tiny_config(tmp_path / "private", "model.path_specific_blocks=1")
    stages.init_run(Run(plain))
    root = stages.init_run(Run(private))
    shared_names = [f"level={lvl}/module={k}.safetensors" for lvl in (0, 1) for k in (0, 1)]
    assert list(_module_files(tmp_path / "plain", 0)) == shared_names
    assert RunRoot(plain.run_root).marker(layout.modules_dir(0))["modules"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert all_modules([2, 2], private=False) == all_modules([2, 2])
    # N = 0: the files are exactly the seeded model's levels, as before the option existed.
    shape = ModelShape.from_config(plain.model)
    assert shape.llama_config().num_hidden_layers == 2 and shape.n_module_levels == 2
    levels = initial_level_states(shape, plain.model.init_seed)
    loaded = load_modules(RunRoot(plain.run_root), 0, all_modules([2, 2]))
    assert all(torch.equal(loaded[key][k], levels[key.level][k]) for key in loaded for k in levels[key.level])
    # N = 1: the same shared names plus level=2/module=<path index> for the 4 paths.
    assert list(_module_files(tmp_path / "private", 0)) == shared_names + [
        f"level=2/module={i}.safetensors" for i in range(4)
    ]
    assert root.marker(layout.modules_dir(0))["modules"][4:] == [[2, i] for i in range(4)]


def test_the_merge_carries_each_paths_private_module_over_and_steps_the_shared_ones(tmp_path):
    config = tiny_config(tmp_path / "whole", "model.grid=[2, 1]", "model.path_specific_blocks=1")
    root = stages.init_run(Run(config))
    trained = {
        p: fake_path(root, config, 0, p, shift, tokens)
        for p, shift, tokens in (("p0-0", 0.01, 30), ("p1-0", -0.02, 10))
    }
    report = merge_round(config, 0)
    after = load_modules(root, 1, all_modules([2, 1], private=True))
    for index, path_id in enumerate(("p0-0", "p1-0")):
        mine = after[ModuleKey(2, index)]
        assert mine.keys() == trained[path_id][2].keys()
        assert all(torch.equal(mine[k], trained[path_id][2][k]) for k in mine)  # lossless, no outer step
        assert report["module_paths"][f"level=2/module={index}"] == [path_id]
    # The shared module both paths run through took the outer step, not either path's weights.
    shared = after[ModuleKey(1, 0)]
    assert not any(torch.equal(shared[k], trained[p][1][k]) for p in trained for k in shared)
    assert list(_module_files(tmp_path / "whole", 1, "outer_state")) == [
        "level=0/module=0.safetensors",
        "level=0/module=1.safetensors",
        "level=1/module=0.safetensors",
    ]
    # Communication counts the shared modules only: the private ones never leave their island.
    shared_bytes = sum(t.numel() * 4 for lvl in (0, 1) for t in trained["p0-0"][lvl].values())
    assert report["bytes_outer"] == 2 * 2 * shared_bytes


def test_a_round_on_islands_carries_each_paths_blocks_over_and_a_failed_paths_blocks_stay(run_root):
    config = tiny_config(
        run_root,
        "model.grid=[3, 1]",
        "model.path_specific_blocks=1",
        "train.rounds=1",
        "train.inner_steps=2",
        "train.max_attempts=1",
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    TaskQueue(root, config).claim(Task.of("train", 0, "p2-0"), "crashed").finish("failed", error="killed")
    stages.run(Run(config))
    report = root.read_json(f"{layout.round_dir(0)}/merge.json")
    assert report["paths_merged"] == ["p0-0", "p1-0"] and report["paths_left_out"] == ["p2-0"]
    assert report["modules_untouched"] == ["level=0/module=2", "level=2/module=2"]
    shape = ModelShape.from_config(config.model)
    keys = all_modules([3, 1], private=True)
    before, after = load_modules(root, 0, keys), load_modules(root, 1, keys)
    trained = {p: _trained_modules(root, shape, 0, p) for p in ("p0-0", "p1-0")}
    for index, path_id in enumerate(("p0-0", "p1-0")):  # bitwise its path's committed weights
        mine = after[ModuleKey(2, index)]
        assert any(not torch.equal(before[ModuleKey(2, index)][k], mine[k]) for k in mine)  # training moved it
        assert all(
            torch.equal(mine[k], trained[path_id][2][k]) and mine[k].dtype == trained[path_id][2][k].dtype for k in mine
        )
    kept = ModuleKey(2, 2)  # p2-0 failed: its blocks keep round 0's values
    assert all(torch.equal(after[kept][k], before[kept][k]) for k in before[kept])
    # The shared head level: the token-weighted Nesterov step of DiLoCo over both paths (first step: buf = g).
    lr, momentum, tokens = config.outer.lr, config.outer.momentum, report["tokens"]
    total = tokens["p0-0"] + tokens["p1-0"]
    for name, theta in before[ModuleKey(1, 0)].items():
        grad = sum(tokens[p] / total * (theta - trained[p][1][name]) for p in trained)
        torch.testing.assert_close(
            after[ModuleKey(1, 0)][name], theta - lr * (1 + momentum) * grad, rtol=1e-5, atol=1e-6
        )
    assert "level=2/module=0.safetensors" not in root.marker(layout.outer_state_dir(1))["files"]
    assert root.exists(layout.eval_file(1))  # every path's model, private blocks included, was assembled

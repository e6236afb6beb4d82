"""The module <-> Hugging Face key map: a path assembled from its modules is the same model."""

import pytest
import torch

from models.grid import ModuleKey, all_job_ids, all_path_ids, parse_job_id, parse_path_id, paths_through
from models.modular import (
    ModelShape,
    assemble_path_state,
    build_path_model,
    path_state,
    split_path_state,
    to_hf_key,
    to_module_key,
)
from pipeline.core.config import ModelConfig

SHAPE = ModelShape.from_config(
    ModelConfig(grid=[2, 3], blocks_per_level=[1, 2], hidden_size=32, num_heads=2, seq_len=16, vocab_size=64)
)


def test_assembled_path_gives_the_same_logits_as_the_path_it_came_from():
    original = build_path_model(SHAPE, seed=3)
    modules = split_path_state(SHAPE, path_state(original))
    rebuilt = build_path_model(SHAPE, modules, seed=99)  # a different seed: every weight must come from modules
    tokens = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(rebuilt(input_ids=tokens).logits, original(input_ids=tokens).logits, rtol=0, atol=0)


def test_levels_own_blocks_embedding_and_head():
    modules = split_path_state(SHAPE, path_state(build_path_model(SHAPE)))
    assert "embed_tokens.weight" in modules[0] and "lm_head.weight" not in modules[0]
    assert {"norm.weight", "lm_head.weight"} <= set(modules[1])
    assert {k.split(".")[1] for k in modules[0] if k.startswith("blocks.")} == {"0"}
    assert {k.split(".")[1] for k in modules[1] if k.startswith("blocks.")} == {"0", "1"}
    assert to_module_key(SHAPE, "model.layers.2.mlp.up_proj.weight") == (1, "blocks.1.mlp.up_proj.weight")
    assert to_hf_key(SHAPE, 1, "blocks.1.mlp.up_proj.weight") == "model.layers.2.mlp.up_proj.weight"
    state = path_state(build_path_model(SHAPE))
    assert assemble_path_state(SHAPE, split_path_state(SHAPE, state)).keys() == state.keys()


def test_foreign_keys_are_refused():
    with pytest.raises(KeyError):
        to_hf_key(SHAPE, 0, "blocks.1.mlp.up_proj.weight")  # level 0 has one block
    with pytest.raises(KeyError):
        to_module_key(SHAPE, "model.layers.7.mlp.up_proj.weight")


def test_path_ids_are_validated_against_the_grid():
    assert all_path_ids([2, 3])[:4] == ["p0-0", "p0-1", "p0-2", "p1-0"]
    assert parse_path_id("p1-2", [2, 3]) == (1, 2)
    for bad in ["p2-0", "p1", "../p0-0", "p0-0/..", "p-1-0", "", "p0-0.w1"]:
        with pytest.raises(ValueError):
            parse_path_id(bad, [2, 3])
    assert len(paths_through(ModuleKey(1, 2), [2, 3])) == 2
    assert all_job_ids([1], 3) == ["p0.w0", "p0.w1", "p0.w2"]
    assert parse_job_id("p0.w2", [1], 3) == ("p0", (0,), 2)
    with pytest.raises(ValueError):
        parse_job_id("p0.w3", [1], 3)
    with pytest.raises(ValueError):
        parse_job_id("p0", [1], 3)


def test_models_built_in_parallel_threads_have_their_own_seeds_weights():
    """A sweep's lanes build round-0 models in threads of one process: each must be its seed's."""
    from concurrent.futures import ThreadPoolExecutor

    seeds = list(range(8)) * 3
    alone = {seed: path_state(build_path_model(SHAPE, seed=seed)) for seed in range(8)}
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda seed: path_state(build_path_model(SHAPE, seed=seed)), seeds))
    for seed, state in zip(seeds, together):
        for name, tensor in state.items():
            assert torch.equal(tensor, alone[seed][name]), f"seed {seed}: {name} differs when built beside others"

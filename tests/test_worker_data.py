"""DiLoCo workers' data: iid parts or k-means clusters of the path's shard (train.worker_data), and a
pool of workers that changes size from round to round (train.workers_schedule)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_config
from pipeline import stages
from pipeline.core.errors import ConfigError
from pipeline.routing.worker_split import cluster_labels, split_file
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.shards import read_path_doc_ids
from pipeline.state.storage import RunRoot


def test_each_worker_gets_exactly_one_planted_cluster():
    rng = np.random.default_rng(0)
    centers = np.eye(4, 16) * 6
    truth = rng.permutation(np.repeat(np.arange(4), 30))
    features = centers[truth] + rng.standard_normal((120, 16))
    labels = cluster_labels(features, 4, seed=0, capacity_factor=1.5)
    assert sorted(np.bincount(labels).tolist()) == [30, 30, 30, 30]
    for worker in range(4):  # worker k's documents are one planted cluster, all of it
        assert len(set(truth[labels == worker])) == 1
    assert len({int(truth[labels == w][0]) for w in range(4)}) == 4


def test_clusters_stay_within_the_capacity_factor_of_an_equal_share():
    rng = np.random.default_rng(1)
    features = np.concatenate([rng.standard_normal((90, 8)) + 5, rng.standard_normal((10, 8)) - 5])  # 90/10 split
    sizes = np.bincount(cluster_labels(features, 2, seed=0, capacity_factor=1.5), minlength=2)
    assert sizes.sum() == 100 and sizes.min() >= 100 // 3 and sizes.max() <= 75


@pytest.mark.slow  # ~40 s: a real prepare (tf-idf router) and one round of two workers
def test_clustered_workers_train_on_their_own_cluster_and_lose_no_document(run_root):
    config = tiny_config(
        run_root,
        "model.tokenizer=bpe",
        "model.vocab_size=512",
        "model.grid=[1]",
        "model.blocks_per_level=[2]",
        "train.workers_per_path=2",
        "train.worker_data=clustered",
        "train.rounds=1",
        "train.inner_steps=2",
        "train.islands=1",
    )
    stages.init_run(Run(config))
    stages.prepare(Run(config))
    summary = stages.run(Run(config))
    assert summary["rounds_committed"] == 1
    root = RunRoot(config.run_root)
    split = root.read_json(split_file(layout.KMEANS, "p0", 2))
    assert split["doc_ids"] == read_path_doc_ids(root, "p0")  # every document of the shard, once
    assert sorted(set(split["labels"])) == [0, 1] and sum(split["sizes"]) == len(split["doc_ids"])
    for worker in range(2):
        metrics = root.read_committed_json(layout.path_dir(0, f"p0.w{worker}"), "metrics.json")
        assert metrics["shard_docs"] == split["sizes"][worker] == split["labels"].count(worker)


def test_workers_schedule_is_validated_against_the_rounds_and_workers(tmp_path):
    with pytest.raises(ConfigError, match=r"train.workers_schedule has 2 entries for 3 rounds"):
        tiny_config(tmp_path, "train.rounds=3", "train.workers_per_path=4", "train.workers_schedule=[2, 4]")
    with pytest.raises(ConfigError, match=r"train.workers_schedule needs at least 1 worker a round"):
        tiny_config(tmp_path, "train.rounds=2", "train.workers_per_path=4", "train.workers_schedule=[0, 4]")
    with pytest.raises(
        ConfigError, match=r"train.workers_schedule its largest entry 2 must equal train.workers_per_path \(4\)"
    ):
        tiny_config(tmp_path, "train.rounds=2", "train.workers_per_path=4", "train.workers_schedule=[2, 2]")
    with pytest.raises(ConfigError, match=r"train.worker_data"):
        tiny_config(tmp_path, "train.worker_data=random")
    config = tiny_config(tmp_path, "train.rounds=3", "train.workers_per_path=4", "train.workers_schedule=[2, 4, 1]")
    assert [config.train.workers_in_round(r) for r in range(3)] == [2, 4, 1]


@pytest.mark.slow  # ~15 s: three rounds of one or two in-process workers
def test_a_changing_pool_trains_the_rounds_workers_and_merges_only_those_that_ran(run_root):
    from safetensors.torch import load_file

    from conftest import write_synthetic_shards
    from models.grid import ModuleKey
    from pipeline.state.module_store import load_modules

    config = tiny_config(
        run_root,
        "model.grid=[1]",
        "model.blocks_per_level=[1]",
        "train.rounds=3",
        "train.inner_steps=2",
        "train.workers_per_path=2",
        "train.workers_schedule=[1, 2, 1]",
        "train.islands=1",
        "outer.lr=1.0",
        "outer.momentum=0.0",
        "outer.nesterov=false",
        "outer.weighting=uniform",
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    assert stages.run(Run(config))["rounds_committed"] == 3
    ran = {r: sorted(j for j in ("p0.w0", "p0.w1") if root.is_committed(layout.path_dir(r, j))) for r in range(3)}
    assert ran == {0: ["p0.w0"], 1: ["p0.w0", "p0.w1"], 2: ["p0.w0"]}
    for r in range(3):
        assert (
            root.read_json(f"{layout.round_dir(r)}/merge.json")["paths_left_out"] == []
        )  # w1 was not due in rounds 0, 2
    # plain averaging (outer lr 1, no momentum): round r+1's module is the mean of round r's workers that ran
    checked = 0
    for r, workers in ran.items():
        trained = [load_file(root.path(f"{layout.path_dir(r, j)}/model.safetensors")) for j in workers]
        merged = load_modules(root, r + 1, [ModuleKey(0, 0)])[ModuleKey(0, 0)]
        for name, value in merged.items():
            mean = (
                sum(t[name].float() for t in trained if name in t) / len(workers)
                if all(name in t for t in trained)
                else None
            )
            checked += mean is not None
            if mean is not None:
                torch.testing.assert_close(value.float(), mean, rtol=1e-5, atol=1e-6)
    assert checked > 0

"""DiLoCo workers' data: iid parts or k-means clusters of the path's shard (train.worker_data), and a
pool of workers that changes size from round to round (train.workers_schedule)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_config
from pipeline import stages
from pipeline.core.errors import ConfigError
from pipeline.routing.worker_split import cluster_labels, split_file
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
    config = tiny_config(run_root, "model.tokenizer=bpe", "model.vocab_size=512", "model.grid=[1]",
                         "model.blocks_per_level=[2]", "train.workers_per_path=2",
                         "train.worker_data=clustered", "train.rounds=1", "train.inner_steps=2", "train.islands=1")
    stages.init_run(config)
    stages.prepare(config)
    summary = stages.run(config)
    assert summary["rounds_committed"] == 1
    root = RunRoot(config.run_root)
    split = root.read_json(split_file(layout.KMEANS, "p0", 2))
    assert split["doc_ids"] == read_path_doc_ids(root, "p0")  # every document of the shard, once
    assert sorted(set(split["labels"])) == [0, 1] and sum(split["sizes"]) == len(split["doc_ids"])
    for worker in range(2):
        metrics = root.read_json(f"{layout.path_dir(0, f'p0.w{worker}')}/metrics.json")
        assert metrics["shard_docs"] == split["sizes"][worker] == split["labels"].count(worker)


def test_workers_schedule_is_validated_against_the_rounds_and_workers(tmp_path):
    with pytest.raises(ConfigError, match=r"train.workers_schedule has 2 entries for 3 rounds"):
        tiny_config(tmp_path, "train.rounds=3", "train.workers_per_path=4", "train.workers_schedule=[2, 4]")
    with pytest.raises(ConfigError, match=r"train.workers_schedule needs at least 1 worker a round"):
        tiny_config(tmp_path, "train.rounds=2", "train.workers_per_path=4", "train.workers_schedule=[0, 4]")
    with pytest.raises(ConfigError, match=r"train.workers_schedule its largest entry 2 must equal train.workers_per_path \(4\)"):
        tiny_config(tmp_path, "train.rounds=2", "train.workers_per_path=4", "train.workers_schedule=[2, 2]")
    with pytest.raises(ConfigError, match=r"train.worker_data"):
        tiny_config(tmp_path, "train.worker_data=random")
    config = tiny_config(tmp_path, "train.rounds=3", "train.workers_per_path=4", "train.workers_schedule=[2, 4, 1]")
    assert [config.train.workers_in_round(r) for r in range(3)] == [2, 4, 1]

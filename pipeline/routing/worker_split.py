"""Non-iid DiLoCo workers: each of a path's M workers trains on its own k-means cluster of the shard.

`train.worker_data: clustered` reproduces the DiLoCo paper's non-iid ablation: instead of worker k
of M reading every M-th document (`iid`), the path's shard is clustered into M groups with the
router's own embedder (the same prefix features that chose the path) and worker k reads cluster k
only. The clusters are kept between 1/f and f times an equal share (f = router.capacity_factor,
as the router balances paths), so no worker is left without data.

The split is a pure function of the shard, the router and the seed, computed by the first train
task that needs it and written atomically to `<shards>/../worker_split/<shards name>/m=<M>/path=<id>.json`
(doc ids and labels); later tasks, rounds and backup attempts read it back, and a split whose doc
ids are not the shard's is recomputed.
"""

from __future__ import annotations

import logging

import numpy as np

from pipeline.core.config import Config
from pipeline.core.errors import CorruptStateError, InputError
from pipeline.routing import kmeans
from pipeline.state.layout import Routing
from pipeline.state.storage import RunRoot

log = logging.getLogger(__name__)


def split_file(routing: Routing, path_id: str, workers: int) -> str:
    return f"worker_split/{routing.shards.replace('/', '.')}/m={workers}/path={path_id}.json"


def cluster_labels(features: np.ndarray, workers: int, seed: int, capacity_factor: float) -> np.ndarray:
    """(n,) worker index of each feature row: k-means with k = workers, balanced so every worker
    holds between n / (f M) and f n / M rows."""
    n = len(features)
    if n < workers:
        raise InputError(f"{n} documents cannot be split into {workers} clustered workers")
    centroids = kmeans.kmeans(features, workers, seed=seed)
    cost = kmeans.squared_distances(np.asarray(features, dtype=np.float64), centroids)
    cap = kmeans.balanced_cap(n, workers, capacity_factor)
    floor = max(1, int(n / (workers * capacity_factor)))
    labels = (cost + kmeans.balance_biases(cost, cap, floor)[None, :]).argmin(1)
    if len(np.unique(labels)) < workers:  # the auction is best effort: never leave a worker without data
        raise InputError(
            f"clustering {n} documents left a worker empty (sizes {np.bincount(labels, minlength=workers).tolist()})"
        )
    return labels


def worker_labels(
    root: RunRoot,
    config: Config,
    routing: Routing,
    path_id: str,
    doc_ids: list[str],
    docs: list[np.ndarray],
    workers: int,
) -> np.ndarray:
    """The committed split of a path's shard into `workers` clusters, computed on first use."""
    rel = split_file(routing, path_id, workers)
    if root.exists(rel):
        try:
            found = root.read_json(rel)
            if found.get("doc_ids") == doc_ids and len(found.get("labels", [])) == len(doc_ids):
                return np.asarray(found["labels"], dtype=np.int64)
            log.warning("%s: not this shard's split; computing it again", root.path(rel))
        except (CorruptStateError, ValueError) as exc:
            log.warning("%s: %s; computing it again", root.path(rel), exc)
    from pipeline.routing.router import Router
    from pipeline.routing.tokenizer import load_tokenizer, prefix_texts

    router = Router.load(root, config, directory=routing.router)
    tokenizer = load_tokenizer(root, config.model.tokenizer)
    features = router.embed_prefixes(
        prefix_texts([d.tolist() for d in docs], router.header["prefix_tokens"], tokenizer)
    )
    labels = cluster_labels(features, workers, seed=config.train.seed, capacity_factor=config.router.capacity_factor)
    sizes = np.bincount(labels, minlength=workers).tolist()
    root.write_json(
        rel, {"path": path_id, "workers": workers, "sizes": sizes, "doc_ids": doc_ids, "labels": labels.tolist()}
    )
    log.info("path %s: %d documents clustered into %d workers of %s documents", path_id, len(doc_ids), workers, sizes)
    return labels

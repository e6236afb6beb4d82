"""The fitted router: one artifact, one class, used the same way by the Beam job, evaluation and
inference.

Artifact (`<run_root>/router/`, committed with `_SUCCESS`):
- `centroids.npy`: (sum(grid), dim) float64; level l owns rows `rows[l]` and only columns
  `splits[l]` are meaningful (the rest are 0), so one array holds every level of a product k-means;
- `router.json`: the header — embedder, dim, prefix_tokens, grid, splits, rows, path ids and the
  balancing biases (one per path, 0 when unbalanced);
- `tfidf.json` + `tfidf_svd.npy` for the tfidf embedder.

Routing a text: its first `prefix_tokens` GPT-2 tokens, decoded, are embedded; the path is the
cheapest `sum_l ||part_l - centroid_l||^2 + bias[path]` (preprocessing.kmeans).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from typing import Any

import numpy as np

from models.grid import all_path_ids
from pipeline import layout
from pipeline.errors import CorruptStateError, InputError
from pipeline.storage import RunRoot
from preprocessing import kmeans

log = logging.getLogger(__name__)

CENTROIDS = "centroids.npy"
HEADER = "router.json"
FORMAT_VERSION = 1


class Router:
    """Centroids per level plus path biases; embeds lazily (the assigner in Beam never needs to)."""

    def __init__(self, header: dict[str, Any], centroids: list[np.ndarray], root: RunRoot | None = None, config=None):
        self.header = header
        self.centroids = centroids  # per level: (grid[l], part_dim_l)
        self.bias = np.asarray(header["path_bias"], dtype=np.float64)
        self.path_ids: list[str] = list(header["path_ids"])
        self._root, self._config = root, config
        self._embedder = None

    # -- fitting ---------------------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        features: np.ndarray,
        grid: list[int],
        *,
        embedder: str,
        prefix_tokens: int,
        seed: int,
        iters: int = 50,
        balanced: bool = True,
        capacity_factor: float = 1.5,
        extra: dict[str, Any] | None = None,
    ) -> "Router":
        """Product k-means on the sample's features, then (optionally) balancing biases."""
        n_paths = int(np.prod(grid))
        if len(features) < max(grid):
            raise InputError(f"router fit: {len(features)} sample documents, need at least {max(grid)} for grid {grid}")
        centroids = kmeans.product_kmeans(features, grid, seed=seed, iters=iters)
        bias = np.zeros(n_paths)
        if balanced and n_paths > 1:
            cost = kmeans.path_costs(features, centroids)
            cap = kmeans.balanced_cap(len(features), n_paths, capacity_factor)
            floor = int(len(features) / n_paths / max(capacity_factor, 1.0))
            bias = kmeans.balance_biases(cost, cap, floor)
        header = {
            "format": FORMAT_VERSION,
            "embedder": embedder,
            "dim": int(features.shape[1]),
            "prefix_tokens": prefix_tokens,
            "grid": list(grid),
            "splits": [list(s) for s in kmeans.feature_splits(features.shape[1], len(grid))],
            "rows": _rows(grid),
            "path_ids": all_path_ids(grid),
            "path_bias": bias.tolist(),  # JSON floats round-trip exactly
            "balanced": bool(balanced),
            "capacity_factor": capacity_factor,
            "seed": seed,
            "sample_docs": int(len(features)),
            "tokenizer": "gpt2",  # extra names the run's tokenizer (bpe) when it is not GPT-2's
            **(extra or {}),
        }
        return cls(header, centroids)

    def save(self, root: RunRoot, embedder=None) -> dict:
        """Write the artifact and commit `router/` (the marker last); returns the marker."""
        full = np.zeros((sum(self.header["grid"]), self.header["dim"]))
        for (r0, r1), (c0, c1), c in zip(self.header["rows"], self.header["splits"], self.centroids):
            full[r0:r1, c0:c1] = c
        buffer = io.BytesIO()
        np.save(buffer, full, allow_pickle=False)
        root.write_bytes(f"{layout.ROUTER_DIR}/{CENTROIDS}", buffer.getvalue())
        root.write_json(f"{layout.ROUTER_DIR}/{HEADER}", self.header)
        if embedder is not None and hasattr(embedder, "save"):
            embedder.save(root, layout.ROUTER_DIR)
        return root.commit(layout.ROUTER_DIR, info={"embedder": self.header["embedder"], "grid": self.header["grid"]})

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, root: RunRoot, config=None) -> "Router":
        """The committed router of a run root; every file checked against `router/_SUCCESS`."""
        if not root.is_committed(layout.ROUTER_DIR):
            raise InputError(f"{root.path(layout.ROUTER_DIR)}: no committed router; run `dipaco prepare` first")
        try:
            header = json.loads(root.read_committed(layout.ROUTER_DIR, HEADER))
        except ValueError as exc:
            raise CorruptStateError(f"{root.path(layout.ROUTER_DIR, HEADER)}: not valid JSON ({exc})") from None
        full = np.load(io.BytesIO(root.read_committed(layout.ROUTER_DIR, CENTROIDS)), allow_pickle=False)
        expected = (sum(header.get("grid", [])), header.get("dim"))
        if header.get("format") != FORMAT_VERSION or full.shape != expected:
            raise CorruptStateError(
                f"{root.path(layout.ROUTER_DIR)}: router header and centroids disagree "
                f"(centroids {full.shape}, header says {expected}, format {header.get('format')})"
            )
        centroids = [full[r0:r1, c0:c1] for (r0, r1), (c0, c1) in zip(header["rows"], header["splits"])]
        return cls(header, centroids, root=root, config=config)

    @property
    def checksum(self) -> str:
        """A fingerprint of what routes: header and centroids (the manifest records it)."""
        digest = hashlib.sha256(json.dumps(self.header, sort_keys=True).encode())
        for c in self.centroids:
            digest.update(np.ascontiguousarray(c, dtype=np.float64).tobytes())
        return digest.hexdigest()

    # -- routing ---------------------------------------------------------------------------------
    def route_indices(self, features: np.ndarray) -> np.ndarray:
        """Path index (into `path_ids`) of each feature row."""
        features = np.asarray(features, dtype=np.float64)
        if features.ndim != 2 or features.shape[1] != self.header["dim"]:
            raise ValueError(f"router expects (n, {self.header['dim']}) features, got {features.shape}")
        return kmeans.assign(features, self.centroids, self.bias)

    def route_features(self, features: np.ndarray) -> list[str]:
        return [self.path_ids[i] for i in self.route_indices(features)]

    def prefixes(self, texts: list[str]) -> list[str]:
        """The text of each document's first prefix_tokens tokens (the run's tokenizer): what gets embedded."""
        from preprocessing.tokenizer import encode, load_tokenizer, prefix_texts

        tokenizer = load_tokenizer(self._root, self.header.get("tokenizer", "gpt2"))
        return prefix_texts(encode(texts, tokenizer), self.header["prefix_tokens"], tokenizer)

    @property
    def embedder(self):
        if self._embedder is None:
            self._embedder = load_embedder(self.header, self._root, self._config)
        return self._embedder

    def embed_prefixes(self, prefixes: list[str]) -> np.ndarray:
        return self.embedder.embed(prefixes) if prefixes else np.zeros((0, self.header["dim"]), np.float32)

    def route_texts(self, texts: list[str]) -> list[str]:
        """Path id of each whole document text (evaluation and inference call this)."""
        return self.route_features(self.embed_prefixes(self.prefixes(list(texts))))


def _rows(grid: list[int]) -> list[list[int]]:
    offsets = np.cumsum([0, *grid]).tolist()
    return [[offsets[i], offsets[i + 1]] for i in range(len(grid))]


def load_embedder(header: dict[str, Any], root: RunRoot | None, config=None, batch_size: int = 64):
    """The embedder a router was fitted with, rebuilt from its artifact."""
    from preprocessing import embedders

    name = header["embedder"]
    if name == "minilm":
        return embedders.MiniLMEmbedder(batch_size=batch_size)
    if root is None:
        raise InputError(f"the {name} embedder needs the run root its router was saved in")
    if name == "tfidf":
        return embedders.TfidfEmbedder.load(root, layout.ROUTER_DIR)
    if name == "model":
        if config is None:
            from pipeline.config import config_from_yaml

            config = config_from_yaml(root.read_bytes(layout.RUN_CONFIG), root.path(layout.RUN_CONFIG))
        return embedders.PathModelEmbedder.from_run(root, config, header["model_round"], header["model_path"])
    raise CorruptStateError(f"{root.path(layout.ROUTER_DIR, HEADER)}: unknown embedder {name!r}")

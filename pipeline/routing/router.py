"""The fitted router: one artifact, one class, used the same way by the Beam job, evaluation and
inference.

Artifact (`<run_root>/router/`, committed with `_SUCCESS`):
- `centroids.npy`: (sum(grid), dim) float64; level l owns rows `rows[l]` and only columns
  `splits[l]` are meaningful (the rest are 0), so one array holds every level of a product k-means;
- `router.json`: the header — embedder, dim, prefix_tokens, grid, splits, rows, path ids and the
  balancing biases (one per path, 0 when unbalanced);
- `tfidf.json` + `tfidf_svd.npy` for the tfidf embedder.

Routing a text: its first `prefix_tokens` GPT-2 tokens, decoded, are embedded; the path is the
cheapest `sum_l ||part_l - centroid_l||^2 + bias[path]` (pipeline.routing.kmeans).

`router.json` says which kind of router it is: `"kind": "kmeans"` (the above; a header without
"kind" reads as kmeans) or `"kind": "discriminative"` (`router.discriminative_after`: a linear
classifier of the same features, pipeline.routing.discriminative), whose `classifier.npy` holds
(n_paths, dim + 1) float64 rows [weights | intercept] and whose path is the cheapest
`-(w_p . x + b_p) + bias[path]`. Either lives in a directory of its own (`router/`, or
`reroute/round=<r>/router/`) with the embedder's files beside it, so each is self-contained.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from typing import Any

import numpy as np

from models.grid import all_path_ids
from pipeline.core.bounds import SHOWN_CHARS, load_npy, one_line, shown
from pipeline.core.config import Config
from pipeline.core.errors import CorruptStateError, InputError
from pipeline.routing import kmeans
from pipeline.state import layout
from pipeline.state.storage import RunRoot

log = logging.getLogger(__name__)

CENTROIDS = "centroids.npy"
CLASSIFIER = "classifier.npy"
HEADER = "router.json"
FORMAT_VERSION = 1
KINDS = ("kmeans", "discriminative")


class Router:
    """Centroids per level plus path biases; embeds lazily (the assigner in Beam never needs to)."""

    def __init__(
        self,
        header: dict[str, Any],
        centroids: list[np.ndarray],
        root: RunRoot | None = None,
        config: Config | None = None,
        directory: str = layout.ROUTER_DIR,
    ):
        self.header = header
        self.centroids = centroids  # per level: (grid[l], part_dim_l)
        self.bias = np.asarray(header["path_bias"], dtype=np.float64)
        self.path_ids: list[str] = list(header["path_ids"])
        self._root, self._config = root, config
        self.directory = directory  # where it is committed: its embedder's files are there too
        self._embedder = None

    @property
    def kind(self) -> str:
        return self.header.get("kind", "kmeans")

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
            "kind": "kmeans",
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

    def save(self, root: RunRoot, embedder=None, directory: str = layout.ROUTER_DIR) -> dict:
        """Write the artifact and commit `directory` (the marker last); returns the marker."""
        full = np.zeros((sum(self.header["grid"]), self.header["dim"]))
        for (r0, r1), (c0, c1), c in zip(self.header["rows"], self.header["splits"], self.centroids):
            full[r0:r1, c0:c1] = c
        return self._commit(root, embedder, directory, CENTROIDS, full)

    def _commit(self, root: RunRoot, embedder, directory: str, name: str, array: np.ndarray) -> dict:
        """The array, router.json and the embedder's files, then the marker."""
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        root.write_bytes(f"{directory}/{name}", buffer.getvalue())
        root.write_json(f"{directory}/{HEADER}", self.header)
        if embedder is not None and hasattr(embedder, "save"):
            embedder.save(root, directory)
        return root.commit(
            directory, info={"kind": self.kind, "embedder": self.header["embedder"], "grid": self.header["grid"]}
        )

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, root: RunRoot, config: Config | None = None, directory: str = layout.ROUTER_DIR) -> "Router":
        """The router committed in `directory` (k-means or discriminative, as its router.json says);
        every file checked against its `_SUCCESS`, the header checked field by field before
        anything indexes into it."""
        if not root.is_committed(directory):
            what = (
                "run `dipaco prepare` first"
                if directory == layout.ROUTER_DIR
                else "the re-routing has not committed yet"
            )
            raise InputError(f"{root.path(directory)}: no committed router; {what}")
        header = root.read_committed_json(directory, HEADER)
        check_header(header, root.path(directory, HEADER))
        if header.get("kind") == "discriminative":
            weights = load_npy(
                root.read_committed(directory, CLASSIFIER),
                root.path(directory, CLASSIFIER),
                shape=(len(header["path_ids"]), header["dim"] + 1),
            )
            return DiscriminativeRouter(header, weights, root=root, config=config, directory=directory)
        full = load_npy(
            root.read_committed(directory, CENTROIDS),
            root.path(directory, CENTROIDS),
            shape=(sum(header["grid"]), header["dim"]),
        )
        centroids = [full[r0:r1, c0:c1] for (r0, r1), (c0, c1) in zip(header["rows"], header["splits"])]
        return Router(header, centroids, root=root, config=config, directory=directory)

    def _arrays(self) -> list[np.ndarray]:
        return self.centroids

    @property
    def checksum(self) -> str:
        """A fingerprint of what routes: header and centroids (the manifest records it)."""
        digest = hashlib.sha256(json.dumps(self.header, sort_keys=True).encode())
        for c in self._arrays():
            digest.update(np.ascontiguousarray(c, dtype=np.float64).tobytes())
        return digest.hexdigest()

    # -- routing ---------------------------------------------------------------------------------
    def route_indices(self, features: np.ndarray) -> np.ndarray:
        """Path index (into `path_ids`) of each feature row."""
        features = np.asarray(features, dtype=np.float64)
        if features.ndim != 2 or features.shape[1] != self.header["dim"]:
            raise ValueError(f"router expects (n, {self.header['dim']}) features, got {features.shape}")
        return self._assign(features)

    def _assign(self, features: np.ndarray) -> np.ndarray:
        return kmeans.assign(features, self.centroids, self.bias)

    def route_features(self, features: np.ndarray) -> list[str]:
        return [self.path_ids[i] for i in self.route_indices(features)]

    def prefixes(self, texts: list[str]) -> list[str]:
        """The text of each document's first prefix_tokens tokens (the run's tokenizer): what gets embedded."""
        from pipeline.routing.tokenizer import encode, load_tokenizer, prefix_texts

        tokenizer = load_tokenizer(self._root, self.header.get("tokenizer", "gpt2"))
        return prefix_texts(encode(texts, tokenizer), self.header["prefix_tokens"], tokenizer)

    @property
    def embedder(self):
        if self._embedder is None:
            embedder = load_embedder(self.header, self._root, self._config, directory=self.directory)
            if getattr(embedder, "dim", self.header["dim"]) != self.header["dim"]:
                where = self._root.path(self.directory, HEADER) if self._root else HEADER
                raise CorruptStateError(
                    f"{where}: dim {self.header['dim']} but the {embedder.name} embedder "
                    f"gives {embedder.dim}-dimensional features"
                )
            self._embedder = embedder
        return self._embedder

    def embed_prefixes(self, prefixes: list[str]) -> np.ndarray:
        return self.embedder.embed(prefixes) if prefixes else np.zeros((0, self.header["dim"]), np.float32)

    def route_texts(self, texts: list[str]) -> list[str]:
        """Path id of each whole document text (evaluation and inference call this)."""
        return self.route_features(self.embed_prefixes(self.prefixes(list(texts))))

    def route_tokens(self, token_runs: list[list[int]]) -> list[str]:
        """Path id of each run of token ids (re-routing: the N tokens before a chunk), decoded with
        the run's tokenizer and embedded and routed as a decoded prefix is."""
        from pipeline.routing.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self._root, self.header.get("tokenizer", "gpt2"))
        texts = tokenizer.batch_decode([[int(t) for t in run] for run in token_runs])
        return self.route_features(self.embed_prefixes(texts))


class DiscriminativeRouter(Router):
    """A linear classifier of the prefix embedding (`router.discriminative_after`): the path is the
    cheapest `-(x @ W.T + b) + bias`, a pure function of the features, so the Beam job, evaluation
    and the registered model route a document alike. Fitted by pipeline.routing.discriminative."""

    def __init__(
        self,
        header: dict[str, Any],
        weights: np.ndarray,
        root: RunRoot | None = None,
        config: Config | None = None,
        directory: str = layout.ROUTER_DIR,
    ):
        super().__init__(header, [], root=root, config=config, directory=directory)
        self.weights = np.asarray(weights, dtype=np.float64)  # (n_paths, dim + 1): [W | b]

    def logits(self, features: np.ndarray) -> np.ndarray:
        """(n, dim) -> (n, n_paths) class scores of the linear classifier (no balancing biases)."""
        dim = self.header["dim"]
        return np.asarray(features, dtype=np.float64) @ self.weights[:, :dim].T + self.weights[:, dim][None, :]

    def _assign(self, features: np.ndarray) -> np.ndarray:
        return (self.bias[None, :] - self.logits(features)).argmin(1)

    def _arrays(self) -> list[np.ndarray]:
        return [self.weights]

    def save(self, root: RunRoot, embedder=None, directory: str = layout.ROUTER_DIR) -> dict:
        return self._commit(root, embedder, directory, CLASSIFIER, self.weights)


def _is_int(value: Any, low: int = 0, high: int | None = None) -> bool:
    return type(value) is int and value >= low and (high is None or value <= high)


def _is_ranges(value: Any, high: int, sizes: list[int] | None = None) -> bool:
    """One [begin, end] pair per level with 0 <= begin < end <= high (and end - begin == sizes[l])."""
    levels = len(sizes) if sizes is not None else None
    return (
        isinstance(value, list)
        and (levels is None or len(value) == levels)
        and all(
            isinstance(p, list)
            and len(p) == 2
            and _is_int(p[0], 0, high)
            and _is_int(p[1], p[0] + 1, high)
            and (sizes is None or p[1] - p[0] == sizes[i])
            for i, p in enumerate(value)
        )
    )


def check_header(header: dict[str, Any], where: str) -> None:
    """router.json as Router.fit writes it, or CorruptStateError naming the first field that is not."""
    from pipeline.core.config import MAX_LEVELS, MAX_PATHS

    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise CorruptStateError(f"{where}: {key} must be {what}, got {shown(header.get(key))}")

    need(header.get("format") == FORMAT_VERSION, "format", str(FORMAT_VERSION))
    need(header.get("kind", "kmeans") in KINDS, "kind", " or ".join(KINDS))
    grid = header.get("grid")
    need(
        isinstance(grid, list)
        and 1 <= len(grid) <= MAX_LEVELS
        and all(_is_int(k, 1, MAX_PATHS) for k in grid)
        and int(np.prod(grid)) <= MAX_PATHS,
        "grid",
        f"a list of module counts with at most {MAX_PATHS} paths",
    )
    need(_is_int(header.get("dim"), 1, 1 << 20), "dim", "a positive feature dimension")
    need(_is_int(header.get("prefix_tokens"), 1), "prefix_tokens", "a positive token count")
    need(isinstance(header.get("embedder"), str), "embedder", "a name")
    if header.get("kind", "kmeans") == "kmeans":
        need(
            _is_ranges(header.get("rows"), sum(grid), grid), "rows", "one [begin, end] range of grid[l] rows per level"
        )
        need(
            _is_ranges(header.get("splits"), header["dim"]) and len(header["splits"]) == len(grid),
            "splits",
            "one non-empty [begin, end] column range per level",
        )
    n_paths = int(np.prod(grid))
    ids = header.get("path_ids")
    need(
        isinstance(ids, list) and len(ids) == n_paths and all(isinstance(i, str) for i in ids),
        "path_ids",
        f"{n_paths} path ids",
    )
    bias = header.get("path_bias")
    need(
        isinstance(bias, list)
        and len(bias) == n_paths
        and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bias),
        "path_bias",
        f"{n_paths} numbers",
    )
    if header["embedder"] == "model":
        need(_is_int(header.get("model_round")), "model_round", "a round number")
        need(isinstance(header.get("model_path"), str), "model_path", "a path id")
        need(_is_int(header.get("model_layer", -1), -(1 << 10)), "model_layer", "a hidden-state index")


def _rows(grid: list[int]) -> list[list[int]]:
    offsets = np.cumsum([0, *grid]).tolist()
    return [[offsets[i], offsets[i + 1]] for i in range(len(grid))]


def load_embedder(
    header: dict[str, Any],
    root: RunRoot | None,
    config: Config | None = None,
    batch_size: int = 64,
    directory: str = layout.ROUTER_DIR,
):
    """The embedder a router was fitted with, rebuilt from its artifact in `directory`."""
    from pipeline.routing import embedders

    name = header["embedder"]
    if name == "minilm":
        return embedders.MiniLMEmbedder(batch_size=batch_size)
    if root is None:
        raise InputError(f"the {name} embedder needs the run root its router was saved in")
    if name == "tfidf":
        return embedders.TfidfEmbedder.load(root, directory)
    if name == "model":
        if config is None:
            config = layout.read_run_config(root, uses_code=False)  # the model only
        try:
            return embedders.PathModelEmbedder.from_run(
                root, config, header["model_round"], header["model_path"], header.get("model_layer", -1)
            )
        except ValueError as exc:  # a model_path that is no path of the grid
            raise CorruptStateError(f"{root.path(directory, HEADER)}: {one_line(str(exc), SHOWN_CHARS)}") from None
    raise CorruptStateError(f"{root.path(directory, HEADER)}: unknown embedder {shown(name)}")

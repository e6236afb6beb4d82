"""Routing math without Beam: product k-means, balancing, the Router artifact, the tokenizer,
and C4 line parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.metrics import normalized_mutual_info_score

from pipeline.core.errors import CorruptStateError, InputError
from pipeline.routing import kmeans
from pipeline.routing.router import CENTROIDS, Router
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from preprocessing import c4


def planted(seed: int = 0, n: int = 1200, grid=(4, 3), dim_per_level: int = 8):
    """Features whose level-l part is one of grid[l] well separated centres plus noise."""
    rng = np.random.default_rng(seed)
    labels = np.stack([rng.integers(k, size=n) for k in grid], axis=1)  # (n, L)
    parts = []
    for level, k in enumerate(grid):
        centres = rng.normal(size=(k, dim_per_level)) * 6.0
        parts.append(centres[labels[:, level]] + rng.normal(size=(n, dim_per_level)))
    return np.concatenate(parts, axis=1), labels


def test_feature_splits_cover_the_feature_in_near_equal_parts():
    assert kmeans.feature_splits(384, 2) == [(0, 192), (192, 384)]
    splits = kmeans.feature_splits(10, 3)
    assert splits[0][0] == 0 and splits[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(splits, splits[1:]))
    assert {b - a for a, b in splits} <= {3, 4}
    with pytest.raises(ValueError):
        kmeans.feature_splits(2, 3)


def test_product_kmeans_recovers_planted_clusters():
    x, labels = planted()
    centroids = kmeans.product_kmeans(x, [4, 3], seed=0)
    assert [c.shape for c in centroids] == [(4, 8), (3, 8)]
    index = kmeans.assign(x, centroids)
    level0, level1 = index // 3, index % 3  # path index = k0 * grid[1] + k1 (level 0 slowest)
    assert normalized_mutual_info_score(labels[:, 0], level0) == pytest.approx(1.0)
    assert normalized_mutual_info_score(labels[:, 1], level1) == pytest.approx(1.0)
    truth = labels[:, 0] * 3 + labels[:, 1]
    assert normalized_mutual_info_score(truth, index) == pytest.approx(1.0)


def test_unbiased_assignment_is_the_cheapest_path():
    x, _ = planted(seed=1)
    centroids = kmeans.product_kmeans(x, [4, 3], seed=3)
    np.testing.assert_array_equal(kmeans.assign(x, centroids), kmeans.path_costs(x, centroids).argmin(1))


def test_same_seed_same_router_and_different_seed_differs():
    x, _ = planted(seed=2)
    a = Router.fit(x, [4, 3], embedder="tfidf", prefix_tokens=32, seed=7)
    b = Router.fit(x, [4, 3], embedder="tfidf", prefix_tokens=32, seed=7)
    c = Router.fit(x, [4, 3], embedder="tfidf", prefix_tokens=32, seed=8)
    for ca, cb in zip(a.centroids, b.centroids):
        np.testing.assert_array_equal(ca, cb)
    assert a.checksum == b.checksum != c.checksum


def test_balancing_caps_and_floors_a_skewed_sample():
    rng = np.random.default_rng(0)
    sizes = [2000, 600, 150, 50]  # one huge cluster, one tiny one
    centres = rng.normal(size=(4, 6)) * 5
    x = np.concatenate([c + rng.normal(size=(s, 6)) for c, s in zip(centres, sizes)])
    plain = Router.fit(x, [4], embedder="tfidf", prefix_tokens=32, seed=0, balanced=False)
    assert np.bincount(plain.route_indices(x), minlength=4).max() > 1500
    router = Router.fit(x, [4], embedder="tfidf", prefix_tokens=32, seed=0, balanced=True, capacity_factor=1.2)
    counts = np.bincount(router.route_indices(x), minlength=4)
    share = len(x) / 4
    assert counts.max() <= np.ceil(1.2 * share) + 2  # within a row or two of the cap
    assert counts.min() >= int(share / 1.2) - 2  # no path starved


def test_balance_biases_respects_exact_bounds_when_feasible():
    rng = np.random.default_rng(4)
    cost = rng.random((400, 4)) + np.array([0.0, 0.5, 0.5, 0.9])  # everyone prefers path 0
    bias = kmeans.balance_biases(cost, cap=120, floor=80)
    counts = np.bincount((cost + bias).argmin(1), minlength=4)
    assert counts.max() <= 120 and counts.min() >= 80 and counts.sum() == 400


def test_router_round_trips_through_the_run_root(tmp_path):
    x, _ = planted(seed=5)
    router = Router.fit(x, [4, 3], embedder="tfidf", prefix_tokens=16, seed=0)
    root = RunRoot(tmp_path / "run")
    router.save(root)
    assert root.is_committed(layout.ROUTER_DIR)
    header = json.loads((tmp_path / "run/router/router.json").read_text())
    assert header["grid"] == [4, 3] and header["dim"] == 16 and header["prefix_tokens"] == 16
    assert header["splits"] == [[0, 8], [8, 16]] and header["embedder"] == "tfidf"
    stored = np.load(tmp_path / "run/router" / CENTROIDS, allow_pickle=False)
    assert stored.shape == (7, 16)
    loaded = Router.load(root)
    assert loaded.route_features(x) == router.route_features(x)
    assert loaded.checksum == router.checksum
    assert set(loaded.route_features(x)) <= set(loaded.path_ids) and loaded.path_ids[0] == "p0-0"


def test_router_refuses_uncommitted_or_corrupted_artifacts(tmp_path):
    root = RunRoot(tmp_path / "run")
    with pytest.raises(InputError, match="no committed router"):
        Router.load(root)
    x, _ = planted(seed=6)
    Router.fit(x, [4, 3], embedder="tfidf", prefix_tokens=16, seed=0).save(root)
    path = tmp_path / "run/router" / CENTROIDS
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError, match="centroids.npy"):
        Router.load(root)


def test_tokenizer_is_gpt2_and_not_empty():
    from pipeline.routing.tokenizer import encode, load_tokenizer, prefix_texts

    tokenizer = load_tokenizer()
    assert len(tokenizer) == 50257 and tokenizer.eos_token_id == 50256
    assert load_tokenizer() is tokenizer  # cached
    ids = encode(["Hello world"])[0]
    assert ids == [15496, 995]  # GPT-2's own ids
    assert prefix_texts([ids], 1) == ["Hello"]


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"{not json", c4.INVALID_JSON),
        (b"", c4.INVALID_JSON),
        (b"[1, 2]", c4.NOT_AN_OBJECT),
        (b'{"url": "u"}', c4.MISSING_TEXT),
        (b'{"text": "   "}', c4.MISSING_TEXT),
        (b'{"text": 5}', c4.MISSING_TEXT),
        (b'{"text": "caf\xe9"}', c4.INVALID_UTF8),
        (b'{"text": "\\ud800 lone surrogate"}', c4.INVALID_UTF8),
        (b'{"text": "' + b"x" * 200 + b'"}', c4.TOO_LARGE),
    ],
)
def test_parse_line_rejects_with_the_reason(raw, reason):
    record = c4.parse_line(raw + b"\n", "train", "f.json", 7, max_doc_bytes=100)
    assert isinstance(record, c4.Rejection)
    assert (record.reason, record.line, record.file) == (reason, 7, "f.json")


def test_parse_line_doc_id_is_url_else_text_hash():
    with_url = c4.parse_line(b'{"text": "a b", "url": "http://x"}', "train", "f", 1, 100)
    without = c4.parse_line(b'{"text": "a b", "timestamp": "t"}', "train", "f", 2, 100)
    assert with_url == c4.Document("train", "http://x", "a b")
    assert without.doc_id.startswith("sha256:") and len(without.doc_id) == 7 + 64


def test_missing_input_glob_names_it(tmp_path):
    with pytest.raises(InputError, match="nothing-here"):
        c4.list_input_files(str(tmp_path / "nothing-here" / "*.json.gz"))

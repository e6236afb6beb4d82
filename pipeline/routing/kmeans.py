"""Routing math as pure numpy functions: k-means, the product split, assignment and balancing.

DiPaCo routes a document by its prefix embedding. With one level the path is the nearest of
`grid[0]` centroids; with L levels the feature is split into L near-equal parts and level l runs
its own k-means with `grid[l]` centroids on part l (product k-means), so the path is the tuple of
nearest centroids and `prod(grid)` paths cost only `sum(grid)` centroids.

Balanced routing adds one bias per path to its cost (a price, as in an auction): the path chosen
is `argmin_p cost(x, p) + bias[p]`. The biases are fitted on the router's sample so that no path
holds more than its cap there; because the rule is per document it stays stateless, so a Beam
worker, evaluation and inference all route a document the same way without a global pass.
With zero biases it is exactly the tuple of nearest centroids.

Everything is deterministic for a given seed: k-means++ seeding from `numpy.random.default_rng`,
fixed iteration counts, float64 sums in a fixed order.
"""

from __future__ import annotations

import math

import numpy as np


def feature_splits(dim: int, levels: int) -> list[tuple[int, int]]:
    """[start, end) columns of each level's part: `dim` cut into `levels` near-equal parts."""
    if levels < 1 or dim < levels:
        raise ValueError(f"cannot split a {dim}-dim feature into {levels} parts")
    bounds = np.linspace(0, dim, levels + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def squared_distances(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """(n, d), (k, d) -> (n, k) squared Euclidean distances, clipped at 0 against rounding."""
    x = x.astype(np.float64, copy=False)
    c = centroids.astype(np.float64, copy=False)
    d = (x * x).sum(1)[:, None] - 2.0 * x @ c.T + (c * c).sum(1)[None, :]
    return np.maximum(d, 0.0)


def _kmeans_pp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: each new centroid drawn with probability proportional to D^2."""
    centroids = [x[rng.integers(len(x))]]
    closest = squared_distances(x, centroids[0][None])[:, 0]
    for _ in range(1, k):
        total = closest.sum()
        if total <= 0:  # fewer distinct points than k: repeat one, Lloyd leaves it empty
            idx = int(rng.integers(len(x)))
        else:
            idx = int(rng.choice(len(x), p=closest / total))
        centroids.append(x[idx])
        closest = np.minimum(closest, squared_distances(x, x[idx][None])[:, 0])
    return np.stack(centroids)


def kmeans(x: np.ndarray, k: int, seed: int, iters: int = 50, restarts: int = 3) -> np.ndarray:
    """Lloyd's k-means from k-means++ seeds; the best of `restarts` by inertia. Returns (k, d)."""
    if len(x) < k:
        raise ValueError(f"k-means needs at least {k} points, got {len(x)}")
    x = np.asarray(x, dtype=np.float64)
    best, best_inertia = None, math.inf
    for restart in range(restarts):
        rng = np.random.default_rng([seed, restart])
        centroids = _kmeans_pp(x, k, rng)
        for _ in range(iters):
            labels = squared_distances(x, centroids).argmin(1)
            new = centroids.copy()
            for j in range(k):
                members = x[labels == j]
                if len(members):
                    new[j] = members.mean(0)
                else:  # an empty cluster takes the point worst served by the others
                    far = squared_distances(x, new).min(1).argmax()
                    new[j] = x[far]
            if np.allclose(new, centroids, rtol=0, atol=1e-10):
                centroids = new
                break
            centroids = new
        inertia = squared_distances(x, centroids).min(1).sum()
        if inertia < best_inertia:
            best, best_inertia = centroids, inertia
    return best


def product_kmeans(x: np.ndarray, grid: list[int], seed: int, iters: int = 50) -> list[np.ndarray]:
    """One k-means per level on that level's part of the feature; a list of (grid[l], part) arrays."""
    splits = feature_splits(x.shape[1], len(grid))
    return [
        kmeans(x[:, a:b], k, seed=seed * 1000 + level, iters=iters)
        for level, ((a, b), k) in enumerate(zip(splits, grid))
    ]


def level_distances(x: np.ndarray, centroids: list[np.ndarray]) -> list[np.ndarray]:
    """Per level, the (n, grid[l]) squared distances of each part to that level's centroids."""
    splits = feature_splits(x.shape[1], len(centroids))
    return [squared_distances(x[:, a:b], c) for (a, b), c in zip(splits, centroids)]


def path_costs(x: np.ndarray, centroids: list[np.ndarray]) -> np.ndarray:
    """(n, prod(grid)) cost of each path = sum over levels of the distance to its module's centroid.

    Paths are in `models.grid.all_paths` order (level 0 slowest), so column p is path p.
    """
    cost = np.zeros((len(x), 1))
    for dist in level_distances(x, centroids):  # (n, P_so_far) + (n, k_l) -> (n, P_so_far * k_l)
        cost = (cost[:, :, None] + dist[:, None, :]).reshape(len(x), -1)
    return cost


def assign(x: np.ndarray, centroids: list[np.ndarray], bias: np.ndarray | None = None) -> np.ndarray:
    """Path index of each row: the tuple of nearest centroids, or the cheapest biased path."""
    if bias is None or not np.any(bias):
        # No biases: each level picks independently; same answer as path_costs().argmin(1), cheaper.
        index = np.zeros(len(x), dtype=np.int64)
        for dist in level_distances(x, centroids):
            index = index * dist.shape[1] + dist.argmin(1)
        return index
    return (path_costs(x, centroids) + bias[None, :]).argmin(1)


def balance_biases(cost: np.ndarray, cap: int, floor: int = 0, max_rounds: int = 300) -> np.ndarray:
    """Per-path biases so that `argmin(cost + bias)` puts between `floor` and `cap` rows on a path.

    An auction: an over-full path raises its price just enough to push out the rows that lose
    least by moving; an under-full path lowers its price just enough to pull in the rows that
    lose least by coming. Moved rows can overfill a neighbour, so it iterates, and keeps the
    biases with the smallest total violation seen (sizes within a row or two of the bounds on
    hard inputs; the sample only estimates the corpus anyway).
    """
    n, n_paths = cost.shape
    if cap * n_paths < n or floor * n_paths > n:
        raise ValueError(f"bounds [{floor}, {cap}] x {n_paths} paths cannot hold {n} documents")
    eps = 1e-6 * float(cost.std() or 1.0)  # strict preference: ties would undo the move
    bias, best, best_violation = np.zeros(n_paths), np.zeros(n_paths), math.inf
    for _ in range(max_rounds):
        total = cost + bias
        labels = total.argmin(1)
        counts = np.bincount(labels, minlength=n_paths)
        violation = np.maximum(counts - cap, 0).sum() + np.maximum(floor - counts, 0).sum()
        if violation < best_violation:
            best, best_violation = bias.copy(), violation
        if violation == 0:
            break
        current = total[np.arange(n), labels]
        step = np.zeros(n_paths)
        for p in np.flatnonzero(counts > cap):
            rows = np.flatnonzero(labels == p)
            loss = np.sort(np.delete(total[rows], p, axis=1).min(1) - current[rows])
            step[p] = loss[len(rows) - cap - 1] + eps  # the len(rows) - cap cheapest rows leave
        for p in np.flatnonzero(counts < floor):
            rows = np.flatnonzero(labels != p)
            loss = np.sort(total[rows, p] - current[rows])
            step[p] = -(loss[floor - counts[p] - 1] + eps)  # the cheapest missing rows come
        bias += step
    return best


def balanced_cap(n: int, n_paths: int, capacity_factor: float) -> int:
    """Most documents one path may hold: capacity_factor times an equal share, never below it."""
    return max(math.ceil(n / n_paths), math.ceil(capacity_factor * n / n_paths))

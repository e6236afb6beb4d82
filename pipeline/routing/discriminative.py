"""The discriminative router's classifier (`router.discriminative_after`; DiPaCo §2.4.2): pure functions.

After round R each sampled document is labelled with its lowest-loss path
(pipeline.evaluation.reroute scores them); the classifier maps the same prefix features the
k-means router uses to that label. It is multinomial logistic regression on standardized
features, folded back into one (n_paths, dim + 1) matrix [W | b] over the raw features, so routing
is `argmin(bias - (x @ W.T + b))`: a pure function of the features wherever it runs (the Beam job,
evaluation, the registered model). Its weights are saved and read by
pipeline.routing.router.DiscriminativeRouter (`classifier.npy`, "kind": "discriminative").
"""

from __future__ import annotations

import numpy as np

from pipeline.routing import kmeans

C = 1.0  # inverse L2 strength of the logistic regression (scikit-learn's default)
ABSENT_MARGIN = 10.0  # a path no fitted document chose: this far below every fitted logit


def fit_classifier(features: np.ndarray, labels: np.ndarray, n_paths: int, seed: int) -> np.ndarray:
    """(n, dim) features, (n,) path labels -> (n_paths, dim + 1) [W | b] over the raw features.

    Logistic regression on standardized features (lbfgs, deterministic), folded back:
    z = (x - mean) / scale, so z @ Wz.T + bz = x @ (Wz / scale).T + (bz - (Wz / scale) @ mean).
    A path that no document chose gets a logit below every fitted one (balancing may still
    give it documents)."""
    from sklearn.linear_model import LogisticRegression

    x = np.asarray(features, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    dim = x.shape[1]
    mean, scale = x.mean(0), x.std(0)
    scale[scale == 0] = 1.0
    z = (x - mean) / scale
    classes = np.unique(labels)
    wz, bz = np.zeros((n_paths, dim)), np.zeros(n_paths)
    if len(classes) > 1:
        model = LogisticRegression(C=C, max_iter=2000, random_state=seed).fit(z, labels)
        coef, intercept = model.coef_, model.intercept_
        if len(classes) == 2:  # binary: one row, the logit of classes[1] against classes[0] at 0
            coef, intercept = np.vstack([np.zeros(dim), coef[0]]), np.array([0.0, intercept[0]])
        wz[classes], bz[classes] = coef, intercept
    else:
        bz[classes] = 1.0  # one label: every document goes there
    absent = np.setdiff1d(np.arange(n_paths), classes)
    if len(absent):
        fitted = z @ wz[classes].T + bz[classes][None, :]
        bz[absent] = fitted.min() - ABSENT_MARGIN
    w = wz / scale[None, :]
    return np.hstack([w, (bz - w @ mean)[:, None]])


def lowest_loss_labels(losses: np.ndarray) -> np.ndarray:
    """(n, n_paths) summed nats (NaN rows: nothing scored) -> (n,) index of the lowest-loss path."""
    return np.nanargmin(losses, axis=1)


def balancing_biases(logits: np.ndarray, balanced: bool, capacity_factor: float) -> np.ndarray:
    """Per-path biases so that the sample's shards stay within the k-means router's bounds (an
    empty shard would starve its path); zeros when `router.balanced` is off."""
    n, n_paths = logits.shape
    if not balanced or n_paths == 1 or n == 0:
        return np.zeros(n_paths)
    cap = kmeans.balanced_cap(n, n_paths, capacity_factor)
    floor = int(n / n_paths / max(capacity_factor, 1.0))
    return kmeans.balance_biases(-logits, cap, floor)

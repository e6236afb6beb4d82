"""Scaling laws fitted to a sweep's points, with scipy, and the three findings they are checked for.

Loss is held-out bits per byte of the last round's modules; N a path's non-embedding parameters.
Per algorithm and M (one "group"), the loss at each size is that of the best point there (over the
hyper-parameter axes), and

    L(N) = A * N^-alpha + E                 (scipy.optimize.curve_fit, bounded: A, alpha, E >= 0, E < min L)

with 95% intervals from a bootstrap over those points (resampled with replacement, each draw refitted;
draws with too few distinct sizes are skipped and counted). With fewer than 4 sizes the saturating law
would have no degree of freedom left, so E is fixed at 0 (L = A * N^-alpha, fitted in log space), and
fit.json says so. Across M, per algorithm, where there are at least 2 values of M, 3 sizes and 5
(N, M) cells: L(N, M) = A * N^-alpha * M^beta + E (the joint law of Charles et al., 2025, "Scaling Laws
for DiLoCo", with an irreducible term); else fit.json says why not.

A hyper-parameter's optimum at one size is the vertex of a parabola through the loss against its log
(at least 3 values, convex, vertex inside the grid), else the grid's best value; its trend against N
is a power law c * N^b (curve_fit in log space). There is a trend when the fitted optimum moves by more
than half a grid step (the median ratio of neighbouring values) over the sweep's range of N; without
one, the prediction for a new size is the optima's geometric mean.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np
from scipy import stats
from scipy.optimize import curve_fit

LAW = "A * N^-alpha + E"
PURE = "A * N^-alpha"
JOINT = "A * N^-alpha * M^beta + E"
MIN_SATURATING_SIZES = 4  # 3 parameters and at least 1 degree of freedom
LEVEL = 95  # % of the bootstrap intervals


# -- one law --------------------------------------------------------------------------------------
def _saturating(x, a, alpha, e):
    return a * np.power(x, -alpha) + e


def _line(logx, c, slope):
    return c + slope * logx


def _fit_once(
    form: str, n: np.ndarray, loss: np.ndarray, starts: tuple[float, ...] = (0.1, 0.3, 0.7, 1.5)
) -> dict[str, float]:
    """One least-squares fit; N is scaled by its geometric mean (conditioning) and scaled back.
    The saturating law has shallow valleys: it starts from a few exponents and keeps the best."""
    if form == PURE:
        (c, slope), _ = curve_fit(_line, np.log(n), np.log(loss), p0=(float(np.log(loss).mean()), -0.3))
        return {"A": float(np.exp(c)), "alpha": float(-slope), "E": 0.0}
    n0 = float(np.exp(np.log(n).mean()))
    x, floor = n / n0, float(loss.min())
    best, best_sse = None, math.inf
    for alpha0 in starts:
        e0 = 0.5 * floor
        try:
            params, _ = curve_fit(
                _saturating,
                x,
                loss,
                p0=(max(float(loss.mean()) - e0, 1e-3), alpha0, e0),
                bounds=([0.0, 0.0, 0.0], [np.inf, 5.0, floor]),
                method="trf",
                maxfev=20000,
            )
        except (RuntimeError, ValueError):
            continue
        sse = float(((_saturating(x, *params) - loss) ** 2).sum())
        if sse < best_sse:
            best, best_sse = params, sse
    if best is None:
        raise RuntimeError("curve_fit found no solution")
    a, alpha, e = (float(v) for v in best)
    return {"A": a * n0**alpha, "alpha": alpha, "E": e}


def predict(law: dict, n: float) -> float:
    return law["A"] * n ** -law["alpha"] + law["E"]


def fit_law(n: list[float], loss: list[float], draws: int = 500, seed: int = 0) -> dict:
    """L(N) with bootstrap intervals; {"fitted": False, "why": ...} when the points cannot carry one."""
    n_arr, loss_arr = np.asarray(n, float), np.asarray(loss, float)
    sizes = len(set(n))
    if sizes < 2:
        return {"fitted": False, "why": f"{sizes} size(s): a law needs points at 2 or more sizes"}
    if (loss_arr <= 0).any():
        return {"fitted": False, "why": "a loss is not positive"}
    form = LAW if sizes >= MIN_SATURATING_SIZES else PURE
    law = _fit_once(form, n_arr, loss_arr)
    need = 3 if form == LAW else 2
    start = (max(law["alpha"], 0.05),)  # each draw starts from the whole fit: 4x fewer fits, same optima here
    # as many sizes as parameters: every draw with enough sizes is the same curve, so no interval
    samples = (
        []
        if sizes <= need
        else _bootstrap(
            lambda idx: _fit_once(form, n_arr[idx], loss_arr[idx], start),
            len(n_arr),
            draws,
            seed,
            lambda idx: len(set(n_arr[idx])) >= need,
        )
    )
    residuals = np.array([predict(law, v) for v in n_arr]) - loss_arr
    out = {
        "fitted": True,
        "form": form,
        **law,
        "rmse": float(np.sqrt((residuals**2).mean())),
        "sizes": sizes,
        "points": len(n_arr),
        "ci": _intervals(samples, ("A", "alpha", "E")),
        "bootstrap": {
            "draws": draws,
            "fitted": len(samples),
            "params": [[s["A"], s["alpha"], s["E"]] for s in samples],
        },
    }
    if form == PURE:
        out["note"] = (
            f"E fixed at 0: {sizes} sizes leave the 3-parameter law {LAW} no degree of freedom "
            f"(it needs {MIN_SATURATING_SIZES})"
        )
    if not samples:
        out["note"] = (
            out.get("note", "")
            + ("; " if form == PURE else "")
            + f"no interval: {sizes} sizes for {need} parameters leave the bootstrap nothing to vary"
        )
    return out


def predict_with_interval(law: dict, n: float) -> dict:
    """The law's loss at N, with the bootstrap's interval of predictions."""
    value = predict(law, n)
    samples = [predict({"A": a, "alpha": alpha, "E": e}, n) for a, alpha, e in law["bootstrap"]["params"]]
    low, high = _percentiles(samples)
    return {"value": value, "interval": [low, high], "level": LEVEL}


def _bootstrap(fit, n: int, draws: int, seed: int, usable) -> list[dict]:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(draws):
        idx = rng.integers(0, n, n)
        if not usable(idx):
            continue
        try:
            samples.append(fit(idx))
        except (RuntimeError, ValueError, np.linalg.LinAlgError):
            continue
    return samples


def _percentiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    tail = (100 - LEVEL) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def _intervals(samples: list[dict], keys: tuple[str, ...]) -> dict[str, list]:
    return {k: list(_percentiles([s[k] for s in samples])) for k in keys}


# -- the joint law across M -----------------------------------------------------------------------
def _joint(xm, a, alpha, beta, e):
    x, m = xm
    return a * np.power(x, -alpha) * np.power(m, beta) + e


def _fit_joint_once(
    n: np.ndarray, m: np.ndarray, loss: np.ndarray, starts: tuple[float, ...] = (0.1, 0.3, 0.7)
) -> dict[str, float]:
    n0, floor = float(np.exp(np.log(n).mean())), float(loss.min())
    best, best_sse = None, math.inf
    for alpha0 in starts:
        try:
            params, _ = curve_fit(
                _joint,
                (n / n0, m),
                loss,
                p0=(max(float(loss.mean()) / 2, 1e-3), alpha0, 0.0, floor / 2),
                bounds=([0.0, 0.0, -2.0, 0.0], [np.inf, 5.0, 2.0, floor]),
                method="trf",
                maxfev=20000,
            )
        except (RuntimeError, ValueError):
            continue
        sse = float(((_joint((n / n0, m), *params) - loss) ** 2).sum())
        if sse < best_sse:
            best, best_sse = params, sse
    if best is None:
        raise RuntimeError("curve_fit found no solution")
    a, alpha, beta, e = (float(v) for v in best)
    return {"A": a * n0**alpha, "alpha": alpha, "beta": beta, "E": e}


def fit_joint(cells: list[tuple[float, int, float]], draws: int, seed: int) -> dict:
    """L(N, M) over (N, M, best loss) cells of one algorithm, or why the points cannot carry it."""
    ms, sizes = sorted({m for _, m, _ in cells}), sorted({n for n, _, _ in cells})
    why = []
    if len(ms) < 2:
        why.append(f"one value of M ({ms[0] if ms else 'none'})")
    if len(sizes) < 3:
        why.append(f"{len(sizes)} size(s) (needs 3)")
    if len(cells) < 5:
        why.append(f"{len(cells)} (N, M) cells (needs 5 for 4 parameters and a degree of freedom)")
    if why:
        return {"fitted": False, "form": JOINT, "why": "; ".join(why)}
    n, m, loss = (np.asarray(v, float) for v in zip(*cells))
    law = _fit_joint_once(n, m, loss)
    start = (max(law["alpha"], 0.05),)
    samples = _bootstrap(
        lambda idx: _fit_joint_once(n[idx], m[idx], loss[idx], start),
        len(n),
        draws,
        seed,
        lambda idx: len(set(n[idx])) >= 3 and len(set(m[idx])) >= 2,
    )
    fitted = np.array([_joint((v, w), law["A"], law["alpha"], law["beta"], law["E"]) for v, w in zip(n, m)])
    return {
        "fitted": True,
        "form": JOINT,
        **law,
        "rmse": float(np.sqrt(((fitted - loss) ** 2).mean())),
        "cells": len(cells),
        "M": ms,
        "ci": _intervals(samples, ("A", "alpha", "beta", "E")),
        "bootstrap": {"draws": draws, "fitted": len(samples)},
    }


# -- hyper-parameter optima -----------------------------------------------------------------------
def optimum(profile: dict[Any, float]) -> dict:
    """The best value of one hyper-parameter at one size, from its best loss at each value."""
    values = sorted(profile, key=lambda v: (not _positive(v), v if _positive(v) else str(v)))
    best = min(values, key=lambda v: profile[v])
    spread = max(profile.values()) - min(profile.values())
    out = {"value": best, "method": "grid", "loss": profile[best], "spread": spread, "values": len(values)}
    if len(values) >= 3 and all(_positive(v) for v in values):
        logs = np.log(np.asarray(values, float))
        curve, slope, _ = np.polyfit(logs, [profile[v] for v in values], 2)
        vertex = -slope / (2 * curve) if curve > 0 else None
        if vertex is not None and logs[0] <= vertex <= logs[-1]:
            value = float(np.exp(vertex))
            out.update(value=int(round(value)) if all(isinstance(v, int) for v in values) else value, method="parabola")
    return out


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def grid_step(values: list) -> float | None:
    """ln of the median ratio of neighbouring grid values (None: not a positive numeric grid)."""
    numbers = sorted(v for v in values if _positive(v))
    if len(numbers) < 2 or len(numbers) != len(values):
        return None
    return float(np.median(np.diff(np.log(numbers))))


def fit_trend(sizes: list[float], optima: list[float], step: float | None) -> dict:
    """optimum(N) = c * N^b; a trend when it moves by more than half a grid step over the sweep's N."""
    if len(set(sizes)) < 2 or step is None:
        return {"fitted": False, "why": "optima at fewer than 2 sizes" if step else "not a positive numeric grid"}
    logs = np.log(np.asarray(sizes, float))
    (c, b), cov = curve_fit(_line, logs, np.log(np.asarray(optima, float)), p0=(float(np.log(optima).mean()), 0.0))
    stderr = float(np.sqrt(cov[1, 1])) if len(sizes) > 2 and np.isfinite(cov[1, 1]) else None
    moved = abs(b) * float(logs.max() - logs.min())
    return {
        "fitted": True,
        "c": float(np.exp(c)),
        "b": float(b),
        "b_stderr": stderr,
        "moved_grid_steps": moved / step if step else None,
        "trend": bool(moved > step / 2),
        "constant": float(np.exp(np.log(optima).mean())),
    }


def predict_optimum(trend: dict, n: float, integer: bool = False) -> float | None:
    if not trend.get("fitted"):
        return None
    value = trend["c"] * n ** trend["b"] if trend["trend"] else trend["constant"]
    return int(round(value)) if integer else float(value)


# -- a whole sweep --------------------------------------------------------------------------------
def group_name(algorithm: str, m: int) -> str:
    return f"{algorithm} M={m}"


def analyse(points: list[dict], draws: int = 500, seed: int = 0, tolerance: float = 0.02) -> dict:
    """Every law, optimum, gap and finding of a sweep's committed points: each point a dict with
    id, algorithm, M, N, bits_per_byte and hyper (its hyper-parameter axis values)."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for p in points:
        groups[(p["algorithm"], p["M"])].append(p)
    fits = {group_name(*key): analyse_group(key, members, draws, seed) for key, members in sorted(groups.items())}
    joint = {}
    for algorithm in sorted({a for a, _ in groups}):
        cells = [
            (s["N"], g["M"], s["bits_per_byte"])
            for g in fits.values()
            if g["algorithm"] == algorithm
            for s in g["sizes"]
        ]
        joint[algorithm] = fit_joint(cells, draws, seed)
    gaps = gap_by_size(fits)
    return {
        "groups": fits,
        "joint": joint,
        "gap": gaps,
        "findings": findings(fits, gaps, tolerance),
        "tolerance": tolerance,
    }


def analyse_group(key: tuple[str, int], members: list[dict], draws: int, seed: int) -> dict:
    by_size: dict[float, list[dict]] = defaultdict(list)
    for p in members:
        by_size[p["N"]].append(p)
    best = [min(by_size[n], key=lambda p: p["bits_per_byte"]) for n in sorted(by_size)]
    keep = ("N", "bits_per_byte", "hyper", "values")  # values: its axes, model ones too (a holdout's last source)
    sizes = [{"point": p["id"], **{k: p.get(k) for k in keep}} for p in best]
    law = fit_law([p["N"] for p in best], [p["bits_per_byte"] for p in best], draws, seed)
    optima = {}
    for name in sorted({k for p in members for k in p["hyper"]}):
        grid = sorted({_key(p["hyper"].get(name)) for p in members})
        if len(grid) < 2:
            continue
        per_size = []
        for n in sorted(by_size):
            profile: dict[Any, float] = {}
            for p in by_size[n]:
                value = _key(p["hyper"].get(name))
                profile[value] = min(profile.get(value, math.inf), p["bits_per_byte"])
            if len(profile) >= 2:
                per_size.append({"N": n, **optimum(profile)})
        values = [_key(v) for v in grid]
        step = grid_step(values)
        trend = (
            fit_trend([s["N"] for s in per_size], [s["value"] for s in per_size], step)
            if step
            else {"fitted": False, "why": "not a positive numeric grid"}
        )
        optima[name] = {
            "grid": values,
            "by_size": per_size,
            "trend": trend,
            "integer": all(isinstance(v, int) and not isinstance(v, bool) for v in values),
        }
    return {"algorithm": key[0], "M": key[1], "points": len(members), "sizes": sizes, "law": law, "optima": optima}


def _key(value: Any) -> Any:
    """Hashable axis values (a list axis, e.g. blocks_per_level, as a tuple)."""
    return tuple(value) if isinstance(value, list) else value


def gap_by_size(fits: dict) -> dict:
    """DiLoCo minus sync at each size and M both were trained at; the gap's slope per decade of N."""
    out = {}
    for m in sorted({g["M"] for g in fits.values()}):
        sync, diloco = fits.get(group_name("sync", m)), fits.get(group_name("diloco", m))
        if not sync or not diloco:
            continue
        s_best = {s["N"]: s["bits_per_byte"] for s in sync["sizes"]}
        rows = [
            {
                "N": s["N"],
                "diloco": s["bits_per_byte"],
                "sync": s_best[s["N"]],
                "gap": s["bits_per_byte"] - s_best[s["N"]],
            }
            for s in diloco["sizes"]
            if s["N"] in s_best
        ]
        entry: dict[str, Any] = {"by_size": rows}
        if len(rows) >= 2:
            logs, gap = np.log10([r["N"] for r in rows]), np.array([r["gap"] for r in rows])
            fit = stats.linregress(logs, gap)
            entry.update(
                slope_per_decade=float(fit.slope),
                slope_stderr=float(fit.stderr) if len(rows) > 2 else None,
                change=float(fit.slope * (logs.max() - logs.min())),
            )
        out[f"M={m}"] = entry
    return out


def findings(fits: dict, gaps: dict, tolerance: float) -> dict:
    return {
        "gap_shrinks_with_N": _gap_finding(gaps, tolerance),
        "diloco_m1_not_worse_than_sync": _m1_finding(gaps, tolerance),
        "outer_lr_independent_of_N": _outer_lr_finding(fits, tolerance),
    }


def _verdict(verdict: str, claim: str, criterion: str, **numbers) -> dict:
    return {"verdict": verdict, "claim": claim, "criterion": criterion, **numbers}


def _gap_finding(gaps: dict, tol: float) -> dict:
    claim = "the DiLoCo-minus-sync gap shrinks as N grows"
    criterion = (
        f"the fitted change of the gap (bits per byte) from the smallest to the largest N, averaged over "
        f"M >= 2 (M = 1 when that is all there is): < -{tol} reproduced, > +{tol} not reproduced"
    )
    changes = {m: g["change"] for m, g in gaps.items() if "change" in g}
    wide = {m: c for m, c in changes.items() if m != "M=1"} or changes
    if not wide:
        return _verdict(
            "unresolved", claim, criterion, why="needs sync and diloco points at the same M at 2 or more sizes"
        )
    mean = float(np.mean(list(wide.values())))
    verdict = "reproduced" if mean < -tol else "not reproduced" if mean > tol else "unresolved"
    return _verdict(
        verdict,
        claim,
        criterion,
        mean_change=mean,
        change_by_M=wide,
        gap_by_M={m: [[r["N"], r["gap"]] for r in gaps[m]["by_size"]] for m in wide},
    )


def _m1_finding(gaps: dict, tol: float) -> dict:
    claim = "DiLoCo with M = 1 is no worse than sync at every N"
    criterion = (
        f"DiLoCo M=1 minus sync M=1 at each N: all <= 0 reproduced, any > +{tol} not reproduced, "
        f"else (within the tolerance) unresolved"
    )
    rows = gaps.get("M=1", {}).get("by_size", [])
    if not rows:
        return _verdict("unresolved", claim, criterion, why="no size with both sync and diloco points at M = 1")
    worst = max(r["gap"] for r in rows)
    verdict = "reproduced" if worst <= 0 else "not reproduced" if worst > tol else "unresolved"
    return _verdict(verdict, claim, criterion, difference_by_N=[[r["N"], r["gap"]] for r in rows], worst=worst)


def _outer_lr_finding(fits: dict, tol: float) -> dict:
    claim = "the optimal outer lr is roughly independent of N"
    criterion = (
        "the fitted optimum's move over the sweep's N, in grid steps (median ratio of neighbouring "
        "outer.lr values), at sizes where the outer lr changes the loss by at least the tolerance: "
        "<= 0.5 reproduced, > 1 not reproduced, else unresolved"
    )
    moves, optima, flat = {}, {}, []
    for name, g in fits.items():
        entry = g["optima"].get("outer.lr") if g["algorithm"] != "sync" else None
        if not entry:
            continue
        determined = [s for s in entry["by_size"] if s["spread"] >= tol]
        optima[name] = [[s["N"], s["value"], s["method"]] for s in entry["by_size"]]
        if len(determined) < 2:
            flat.append(name)
            continue
        trend = fit_trend([s["N"] for s in determined], [s["value"] for s in determined], grid_step(entry["grid"]))
        if trend.get("fitted"):
            moves[name] = {"b": trend["b"], "moved_grid_steps": trend["moved_grid_steps"]}
    if not moves:
        why = (
            "no diloco points with 2 or more outer.lr values at 2 or more sizes"
            if not optima
            else f"the outer lr changes the loss by less than {tol} bits per byte at all but one size "
            f"({', '.join(flat)})"
        )
        return _verdict("unresolved", claim, criterion, why=why, optima_by_group=optima)
    worst = max(m["moved_grid_steps"] for m in moves.values())
    verdict = "reproduced" if worst <= 0.5 else "not reproduced" if worst > 1 else "unresolved"
    return _verdict(verdict, claim, criterion, moved_grid_steps=worst, exponent_by_group=moves, optima_by_group=optima)

"""Seed statistics for the quality table: a mean with its 95 % interval, and a target's verdict.

A row run with several seeds is reported as mean ± half-width of the 95 % Student-t interval. A
target "a <= b × factor" is judged on the interval of the difference a − b × factor: "met" when the
whole interval is at or below zero, "missed" when the whole interval is above, "unresolved" when it
straddles zero (the seeds cannot tell). Rows run with the same seeds share their data order and
initialisation, so their difference is taken seed by seed (paired); otherwise Welch's interval.
A single seed has no interval: its verdict is the plain comparison, marked as one seed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy import stats


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds with its 95 % interval's half-width (nan for one seed)."""

    mean: float
    half_width: float
    n: int

    def text(self, digits: int = 4) -> str:
        if self.n < 2:
            return f"{self.mean:.{digits}f} (1 seed)"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def estimate(values: list[float], level: float = 0.95) -> Estimate:
    """Mean of the seeds' values and the half-width of its Student-t interval."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to estimate from")
    mean = sum(values) / n
    if n < 2:
        return Estimate(mean, math.nan, n)
    sd = statistics.stdev(values)
    return Estimate(mean, stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n), n)


def difference(a: dict[int, float], b: dict[int, float], factor: float = 1.0, level: float = 0.95) -> Estimate:
    """Interval of mean(a) − factor × mean(b), seed-paired where the seeds are the same."""
    if set(a) == set(b) and len(a) >= 2:
        return estimate([a[s] - factor * b[s] for s in sorted(a)], level)
    ea, eb = estimate(list(a.values()), level), estimate([factor * v for v in b.values()], level)
    mean = ea.mean - eb.mean
    if ea.n < 2 or eb.n < 2:
        return Estimate(mean, math.nan, min(ea.n, eb.n))
    va, vb = statistics.variance(list(a.values())) / ea.n, statistics.variance([factor * v for v in b.values()]) / eb.n
    dof = (va + vb) ** 2 / (va**2 / (ea.n - 1) + vb**2 / (eb.n - 1)) if va + vb > 0 else ea.n + eb.n - 2
    return Estimate(mean, stats.t.ppf(0.5 + level / 2, dof) * math.sqrt(va + vb), min(ea.n, eb.n))


def verdict(a: dict[int, float], b: dict[int, float], factor: float = 1.0) -> tuple[str, Estimate]:
    """Whether "a <= b × factor" (lower is better) is met, missed or unresolved over the seeds."""
    diff = difference(a, b, factor)
    if math.isnan(diff.half_width):
        return ("met" if diff.mean <= 0 else "missed") + " (1 seed)", diff
    if diff.mean + diff.half_width <= 0:
        return "met", diff
    if diff.mean - diff.half_width > 0:
        return "missed", diff
    return "unresolved", diff


def evaluation_noise(per_document_bits: list[float], per_document_bytes: list[int]) -> float:
    """Standard error of a bits-per-byte figure from its documents (a ratio estimator: documents,
    not tokens, are the independent draws), to set beside the seed spread."""
    n = len(per_document_bits)
    if n < 2:
        return math.nan
    total_bytes = sum(per_document_bytes)
    ratio = sum(per_document_bits) / total_bytes
    residuals = [bits - ratio * size for bits, size in zip(per_document_bits, per_document_bytes)]
    return math.sqrt(n / (n - 1) * sum(r * r for r in residuals)) / total_bytes

"""The quality table's seed statistics: intervals and verdicts a sceptical reader can check by hand."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.stats import estimate, evaluation_noise, verdict


def test_the_interval_of_three_seeds_is_the_student_t_one():
    e = estimate([1.0, 2.0, 3.0])
    assert e.mean == 2.0 and e.n == 3
    assert e.half_width == pytest.approx(4.302653 * 1.0 / math.sqrt(3), rel=1e-5)  # t(0.975, 2) x sd / sqrt(n)
    assert estimate([1.5]).text() == "1.5000 (1 seed)"


def test_a_target_is_met_missed_or_unresolved_by_where_the_interval_lies():
    base = {0: 2.00, 1: 2.02, 2: 1.98}
    assert verdict({s: v - 0.10 for s, v in base.items()}, base)[0] == "met"  # paired: the same shift every seed
    assert verdict({s: v + 0.10 for s, v in base.items()}, base)[0] == "missed"
    noisy = {0: 1.90, 1: 2.10, 2: 2.01}
    assert verdict(noisy, base)[0] == "unresolved"  # seed by seed it is better, worse, worse
    assert verdict({0: 2.05}, {0: 2.00}, factor=1.02)[0] == "missed (1 seed)"  # 2.05 > 2.00 x 1.02
    assert verdict({0: 2.05}, {0: 2.00}, factor=1.02)[1].mean == pytest.approx(2.05 - 2.04)


def test_unpaired_rows_use_welchs_interval():
    rng = random.Random(0)
    a = {s: 2.0 + rng.gauss(0, 0.01) for s in range(5)}
    b = {s + 10: 2.2 + rng.gauss(0, 0.01) for s in range(5)}
    state, diff = verdict(a, b)
    assert state == "met" and diff.mean == pytest.approx(-0.2, abs=0.03) and 0 < diff.half_width < 0.05


def test_the_evaluation_noise_shrinks_with_more_documents():
    rng = random.Random(1)

    def noise(n):
        sizes = [rng.randint(200, 800) for _ in range(n)]
        return evaluation_noise([s * rng.uniform(1.5, 2.5) for s in sizes], sizes)

    small, large = noise(50), noise(5000)
    assert 0 < large < small / 5

"""The demo check's word count and its interval: the figure a user judges the demo's text by."""

import pytest

from benchmarks.demo_check import continuation_words, wilson_interval


def test_a_fragment_cut_off_by_the_token_budget_is_not_counted():
    assert continuation_words(" in the north of the Europ") == ["in", "the", "north", "of", "the"]
    assert continuation_words(" in the north.") == ["in", "the", "north"]


def test_the_known_word_interval_is_wilsons_and_narrows_with_more_words():
    low, high = wilson_interval(76, 88)  # the AVX2 demo's seed-0 figure: 86%
    assert (low, high) == pytest.approx((0.776, 0.920), abs=0.002)
    low4, high4 = wilson_interval(304, 352)  # the same share over four seeds
    assert low < low4 < 76 / 88 < high4 < high
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(0, 0) == (0.0, 1.0)

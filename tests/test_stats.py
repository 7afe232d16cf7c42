"""`mopd.stats.wilson`: the Wilson score interval of a proportion, against published figures."""

from __future__ import annotations

import math

import pytest

from mopd.stats import wilson

# Newcombe (1998), "Two-sided confidence intervals for the single proportion: comparison of seven
# methods", Statistics in Medicine 17:857-872, Table II, method 3 (score interval without continuity
# correction), 95%, printed to 4 decimals: a bound is right to within half the last digit.
NEWCOMBE = [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)]


@pytest.mark.parametrize(("successes", "n", "low", "high"), NEWCOMBE)
def test_wilson_matches_newcombes_published_intervals(successes, n, low, high):
    interval = wilson(successes, n)
    assert interval.mean == successes / n
    assert (interval.low, interval.high) == (pytest.approx(low, abs=5e-5), pytest.approx(high, abs=5e-5))


def test_wilson_matches_hand_computed_0_of_40_and_9_of_164():
    """Worked by the formula (z = 1.959964), to 3 decimals:
    0 of 40:  p̂ = 0, high = z²/(n + z²) = 3.8415/43.8415 = 0.0876;
    9 of 164: p̂ = 0.05488, centre (p̂ + z²/2n)/(1 + z²/n) = 0.06507, half
              z/(1 + z²/n)·√(p̂(1 − p̂)/n + z²/4n²) = 0.03593: [0.0291, 0.1010]."""
    assert (wilson(0, 40).low, wilson(0, 40).high) == (0.0, pytest.approx(0.0876, abs=5e-5))
    nine = wilson(9, 164)
    assert (nine.low, nine.high) == (pytest.approx(0.0291, abs=5e-5), pytest.approx(0.1010, abs=5e-5))
    assert (round(nine.low, 3), round(nine.high, 3)) == (0.029, 0.101)


def test_wilson_stays_in_0_1_and_widens_with_the_level():
    assert (wilson(40, 40).low, wilson(40, 40).high) == (pytest.approx(1 - 0.0876, abs=5e-5), 1.0)
    assert wilson(9, 164, level=0.99).low < wilson(9, 164).low < wilson(9, 164, level=0.5).low
    assert math.isinf(wilson(9, 164).df) and wilson(9, 164).se == pytest.approx(math.sqrt(9 / 164 * 155 / 164 / 164))


@pytest.mark.parametrize(("successes", "n"), [(-1, 10), (11, 10), (2.5, 10), (0, 0)])
def test_wilson_refuses_what_is_not_a_count_of_draws(successes, n):
    with pytest.raises(ValueError, match="wilson"):
        wilson(successes, n)

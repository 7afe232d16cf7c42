"""Intervals over a few repeats (seeds): the mean ± a Student-t quantile times the standard error.

Stdlib only, at the bottom of the import graph. scipy is not a dependency, so the t quantile is the
inverse of the t CDF by bisection, the CDF through the regularized incomplete beta function
(continued fraction, Numerical Recipes §6.4):

    P(T ≤ t) = 1 − ½ I_{ν/(ν+t²)}(ν/2, ½)   for t ≥ 0,  symmetric for t < 0.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

_TINY = 1e-300


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz); converges fast for x < (a + 1) / (a + b + 2)."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 1000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 ≤ x ≤ 1 and a, b > 0."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_tail(t: float, df: float) -> float:
    """P(T > |t|) for Student's t with `df` degrees of freedom (one tail, no cancellation near 1)."""
    return 0.5 * regularized_beta(df / (df + t * t), df / 2.0, 0.5)


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with `df` degrees of freedom."""
    tail = t_tail(t, df)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T ≤ t) = p, Student's t with `df` > 0 degrees of freedom (t_{0.975, 2} = 4.303)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"df must be positive, got {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    target = 1.0 - p  # the upper tail, compared directly: 1 − cdf would lose digits as p → 1
    if target == 0.5:
        return 0.0
    low, high = 0.0, 1.0
    while t_tail(high, df) > target:
        low, high = high, 2.0 * high
    while high - low > 1e-12 * high:
        middle = 0.5 * (low + high)
        if t_tail(middle, df) > target:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def mean_interval(values: Sequence[float], level: float = 0.95) -> dict[str, float | None]:
    """The mean and its two-sided `level` interval, mean ± t_{(1+level)/2, n−1} · s / √n
    (Student t, df = n − 1); no interval (None bounds) from a single value."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    values = list(values)
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": mean, "low": None, "high": None}
    half = (
        t_quantile((1.0 + level) / 2.0, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    )
    return {"mean": mean, "low": mean - half, "high": mean + half}

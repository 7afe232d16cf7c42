"""The project's statistics, at the bottom of the import graph: intervals over a few repeats
(seeds), over seeds × tasks (`two_way`, paired by subtracting matrices first), over seeds × contents
(`clustered`), ratios by the delta method (`ratio`), all as the mean ± a Student-t quantile times
the standard error; and the Wilson score interval of a proportion of 0/1 draws (`wilson`).

Stdlib only, at the bottom of the import graph. scipy is not a dependency, so the t quantile is the
inverse of the t CDF by bisection, the CDF through the regularized incomplete beta function
(continued fraction, Numerical Recipes §6.4):

    P(T ≤ t) = 1 − ½ I_{ν/(ν+t²)}(ν/2, ½)   for t ≥ 0,  symmetric for t < 0.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

_TINY = 1e-300
NORMAL_975 = 1.959964  # the t quantile's limit as df → ∞


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


# -------------------------------------------------------------- seeds × tasks matrices
@dataclass
class Interval:
    mean: float
    low: float
    high: float
    se: float
    df: float  # degrees of freedom behind the t quantile (Satterthwaite for the two-way case)

    def text(self, number: str = "{:.2f}") -> str:
        if math.isnan(self.mean):
            return "—"
        if math.isnan(self.low):
            return f"{number.format(self.mean)} (no interval: one draw)"
        return f"{number.format(self.mean)} [{number.format(self.low)}, {number.format(self.high)}]"


Matrix = list[list[float]]  # seeds × tasks (or seeds × contents)


def clustered(x: Matrix | None, keys: list[str] | None) -> Matrix | None:
    """seeds × contents: the tasks of one content averaged into one column. Answers to one content
    are not independent draws, so the intervals count each content once (each weighs once in the
    mean too); where every content is distinct this is the task matrix itself."""
    if x is None or keys is None:
        return x
    columns: dict[str, list[int]] = {}
    for j, key in enumerate(keys):
        columns.setdefault(key, []).append(j)
    return [[statistics.fmean(row[j] for j in js) for js in columns.values()] for row in x]


def subtract(a: Matrix, b: Matrix) -> Matrix:
    return [[x - y for x, y in zip(ra, rb, strict=True)] for ra, rb in zip(a, b, strict=True)]


def two_way(x: Matrix) -> Interval:
    """Mean of a seeds × tasks matrix with its 95% interval. Var(mean) = σ²_seed/S + σ²_task/T +
    σ²_noise/(S·T), estimated without bias by (MS_seed + MS_task − MS_noise)/(S·T) from the two-way
    ANOVA mean squares (floored at the noise term alone); degrees of freedom by Satterthwaite.
    With one seed it is the usual paired interval over tasks."""
    s, t = len(x), len(x[0])
    grand = statistics.fmean(v for row in x for v in row)
    if s * t < 2:
        return Interval(grand, math.nan, math.nan, math.nan, 0)
    seed_means = [statistics.fmean(row) for row in x]
    task_means = [statistics.fmean(col) for col in zip(*x, strict=True)]
    if s == 1:
        return with_t(grand, statistics.stdev(x[0]) / math.sqrt(t), t - 1)
    if t == 1:
        return with_t(grand, statistics.stdev(seed_means) / math.sqrt(s), s - 1)
    ms_seed = t * statistics.variance(seed_means)
    ms_task = s * statistics.variance(task_means)
    residual = sum((v - seed_means[i] - task_means[j] + grand) ** 2 for i, row in enumerate(x) for j, v in enumerate(row))
    ms_noise = residual / ((s - 1) * (t - 1))
    combined = max(ms_seed + ms_task - ms_noise, ms_noise)
    pieces = ms_seed**2 / (s - 1) + ms_task**2 / (t - 1) + ms_noise**2 / ((s - 1) * (t - 1))
    df = combined**2 / pieces if pieces > 0 else math.inf
    return with_t(grand, math.sqrt(combined / (s * t)), df)


def accuracy(x: Matrix) -> Interval:
    """`two_way` of scores in [0, 1], its interval cut to [0, 1]: an accuracy cannot leave it, though
    a t interval on a few seeds near the floor does."""
    a = two_way(x)
    return a if math.isnan(a.low) else Interval(a.mean, max(0.0, a.low), min(1.0, a.high), a.se, a.df)


def over_seeds(values: list[float]) -> Interval:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Interval(mean, math.nan, math.nan, math.nan, 0)
    return with_t(mean, statistics.stdev(values) / math.sqrt(len(values)), len(values) - 1)


def ratio(numerator: Matrix, denominator: Matrix) -> Interval:
    """mean(numerator) ÷ mean(denominator), by the delta method: the error of the ratio R is that of
    mean(numerator − R·denominator) ÷ mean(denominator)."""
    top, bottom = grand_mean(numerator), grand_mean(denominator)
    if bottom == 0:
        return Interval(math.nan, math.nan, math.nan, math.nan, 0)
    r = top / bottom
    z = two_way(subtract(numerator, scaled(denominator, r)))
    return with_t(r, z.se / abs(bottom), z.df)


def gain_share(student: Matrix, teacher: Matrix, base: Matrix) -> Interval:
    """(student − base) ÷ (teacher − base): the share of the teacher's gain over the base that the
    student keeps. Unstable where the teacher barely beats the base; NaN where it does not at all."""
    return ratio(subtract(student, base), subtract(teacher, base)) if grand_mean(subtract(teacher, base)) > 0 else (
        Interval(math.nan, math.nan, math.nan, math.nan, 0))


def scaled(x: Matrix, factor: float) -> Matrix:
    return [[v * factor for v in row] for row in x]


def grand_mean(x: Matrix) -> float:
    return statistics.fmean(v for row in x for v in row)


def detectable(x: Interval, power: float = 0.8) -> float:
    """The smallest true difference that a 95% interval with x's standard error and df excludes 0 for, with
    probability `power` (two-sided; (t_.975 + t_power) · se). A smaller difference "within noise" says nothing
    either way; NaN for one draw."""
    if not math.isfinite(x.se) or not x.df > 0:
        return math.nan
    if math.isinf(x.df):
        return (NORMAL_975 + statistics.NormalDist().inv_cdf(power)) * x.se
    return (t_quantile(0.975, x.df) + t_quantile(power, x.df)) * x.se


def with_t(mean: float, se: float, df: float) -> Interval:
    half = (t_quantile(0.975, df) if math.isfinite(df) else NORMAL_975) * se
    return Interval(mean, mean - half, mean + half, se, df)


def wilson(successes: float, n: int, level: float = 0.95) -> Interval:
    """The Wilson score interval of a proportion, `successes` of `n` 0/1 draws: the p whose score test
    |p̂ − p| ≤ z·√(p(1 − p)/n) accepts p̂ (z the normal quantile at (1 + level)/2), i.e.

        (p̂ + z²/2n ± z·√(p̂(1 − p̂)/n + z²/4n²)) / (1 + z²/n).

    Unlike p̂ ± z·se it stays in [0, 1] and is not a point at 0 or n successes. `mean` is p̂, `se` the
    binomial √(p̂(1 − p̂)/n), df infinite (a normal quantile)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n < 1 or not 0 <= successes <= n or successes != round(successes):
        raise ValueError(f"wilson: needs a whole number of successes in [0, n] of n ≥ 1 draws, got {successes} of {n}")
    z = statistics.NormalDist().inv_cdf((1.0 + level) / 2.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if successes == 0 else centre - half
    high = 1.0 if successes == n else centre + half
    return Interval(p, low, high, math.sqrt(p * (1 - p) / n), math.inf)


def accuracy_interval(rewards: list[float], keys: list[str] | None, samples: int, external: bool) -> Interval:
    """Accuracy over some tasks with its 95% interval: for an external suite's 0/1 answers, one sample
    a problem and each problem once, the Wilson interval of the proportion; otherwise `accuracy` of the
    1 × contents matrix (`clustered` by `keys`: a t interval over contents, cut to [0, 1])."""
    once = keys is not None and len(set(keys)) == len(keys)
    if external and samples == 1 and once and set(rewards) <= {0.0, 1.0}:
        return wilson(sum(rewards), len(rewards))
    return accuracy(clustered([rewards], keys))

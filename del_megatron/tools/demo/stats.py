"""Statistics of the loss comparison: means with Student-t 95% intervals over seeds, paired
differences against a baseline, and the standard error of one run's held-out metrics.
Standard library only."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence

CONFIDENCE = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((qam + 2 * m) * (a + 2 * m)),
            -(a + m) * (qab + m) * x / ((a + 2 * m) * (qap + 2 * m)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for 0 <= x <= 1."""
    if x <= 0.0 or x >= 1.0:
        return max(0.0, min(1.0, x))
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    log_front += a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (bisection on t_cdf; p in (0.5, 1))."""
    low, high = 0.0, 1e6
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


@dataclass(frozen=True)
class Interval:
    """A mean over n values with its 95% Student-t interval [low, high] (n = 1: no interval)."""

    mean: float
    low: float
    high: float
    n: int

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


def mean_interval(values: Sequence[float]) -> Interval:
    n = len(values)
    if n == 0:
        raise ValueError("no values to average")
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + CONFIDENCE / 2, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def paired_difference(values: Sequence[float], baseline: Sequence[float]) -> Interval:
    """The mean of values[i] - baseline[i] (the same seed: same data, same initial weights)."""
    if len(values) != len(baseline):
        raise ValueError(f"{len(values)} values paired with {len(baseline)} baseline values")
    return mean_interval([v - b for v, b in zip(values, baseline, strict=True)])


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of per-problem values (sample standard deviation / sqrt n)."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def ratio_standard_error(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Standard error of sum(numerators) / sum(denominators) with problems as the units (digits
    of one answer are not independent): the linearised ratio estimator."""
    n = len(numerators)
    total = sum(denominators)
    if n < 2 or total == 0:
        return math.nan
    ratio = sum(numerators) / total
    residuals: List[float] = [a - ratio * b for a, b in zip(numerators, denominators, strict=True)]
    mean_denominator = total / n
    return math.sqrt(sum(r * r for r in residuals) / (n * (n - 1))) / mean_denominator

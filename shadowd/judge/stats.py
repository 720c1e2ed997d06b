"""Exact binomial (Clopper–Pearson) bounds on the rate of exceeding verify steps.

Each bound is *one-sided* at the configured confidence: READY needs the upper bound below
the target rate, NOT_READY needs the lower bound above it, so each of the two decisions is
wrong with probability at most ``1 - confidence`` (together they form a two-sided interval
of level ``2·confidence - 1``). With zero exceedances the upper bound is the closed form
``1 - (1 - confidence)^(1/n)``: at 99 % and a target of 1e-4 that needs n ≥ 46 050 steps.
"""

from __future__ import annotations

import math

from scipy.stats import beta

__all__ = ["lower_bound", "steps_needed", "upper_bound"]


def upper_bound(k: int, n: int, confidence: float) -> float:
    """One-sided Clopper–Pearson upper bound on the rate after ``k`` events in ``n`` trials."""
    if n <= 0:
        return 1.0
    if k >= n:
        return 1.0
    if k <= 0:
        return float(1.0 - (1.0 - confidence) ** (1.0 / n))
    return float(beta.ppf(confidence, k + 1, n - k))


def lower_bound(k: int, n: int, confidence: float) -> float:
    """One-sided Clopper–Pearson lower bound on the rate after ``k`` events in ``n`` trials."""
    if n <= 0 or k <= 0:
        return 0.0
    if k >= n:
        return float((1.0 - confidence) ** (1.0 / n))
    return float(beta.ppf(1.0 - confidence, k, n - k + 1))


def steps_needed(k: int, target: float, confidence: float) -> int:
    """Smallest n with ``upper_bound(k, n) < target`` (no further exceedances assumed)."""
    if k <= 0:
        return math.floor(math.log(1.0 - confidence) / math.log1p(-target)) + 1
    lo, hi = k + 1, max(k + 2, int(2 * k / target) + 2)
    while upper_bound(k, hi, confidence) >= target:
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if upper_bound(k, mid, confidence) < target:
            hi = mid
        else:
            lo = mid + 1
    return lo

"""Exact binomial (Clopper–Pearson) bounds on the rate of exceeding verify steps.

Each bound is *one-sided* at the configured confidence: READY needs the upper bound below
the target rate, NOT_READY needs the lower bound above it, so each of the two decisions is
wrong with probability at most ``1 - confidence`` (together they form a two-sided interval
of level ``2·confidence - 1``). With zero exceedances the upper bound is the closed form
``1 - (1 - confidence)^(1/n)``: at 99 % and a target of 1e-4 that needs n ≥ 46 050 steps.

A bound within :data:`EDGE` (relative) of the target decides nothing (:func:`clearly_below`,
:func:`clearly_above`): ``confidence`` and the target are decimal numbers held in binary, so a bound that
equals the target exactly — one step of one exceeding at 0.99 against 0.01 — lands a rounding error to
either side of it, which must not make a verdict.
"""

from __future__ import annotations

import math

from scipy.stats import beta

__all__ = ["EDGE", "clearly_above", "clearly_below", "lower_bound", "steps_needed", "upper_bound"]

#: relative distance from the target within which a bound decides nothing
EDGE = 1e-9


def clearly_below(bound: float, target: float) -> bool:
    """``bound < target`` by more than rounding (:data:`EDGE`): the upper bound's test for READY."""
    return bound < target and not math.isclose(bound, target, rel_tol=EDGE, abs_tol=0.0)


def clearly_above(bound: float, target: float) -> bool:
    """``bound > target`` by more than rounding (:data:`EDGE`): the lower bound's test for NOT_READY."""
    return bound > target and not math.isclose(bound, target, rel_tol=EDGE, abs_tol=0.0)


def upper_bound(k: int, n: int, confidence: float) -> float:
    """One-sided Clopper–Pearson upper bound on the rate after ``k`` events in ``n`` trials."""
    if n <= 0:
        return 1.0
    if k >= n:
        return 1.0
    if k <= 0:  # 1 - (1 - confidence)^(1/n), without its cancellation at large n
        return float(-math.expm1(math.log1p(-confidence) / n))
    return float(beta.ppf(confidence, k + 1, n - k))


def lower_bound(k: int, n: int, confidence: float) -> float:
    """One-sided Clopper–Pearson lower bound on the rate after ``k`` events in ``n`` trials."""
    if n <= 0 or k <= 0:
        return 0.0
    if k >= n:
        return float((1.0 - confidence) ** (1.0 / n))
    return float(beta.ppf(1.0 - confidence, k, n - k + 1))


def steps_needed(k: int, target: float, confidence: float) -> int:
    """Smallest n with ``clearly_below(upper_bound(k, n), target)`` (no further exceedances assumed)."""
    lo = k + 1
    if k <= 0:  # the closed form's n, then the test itself across its rounding
        lo = max(1, math.floor(math.log(1.0 - confidence) / math.log1p(-target)))
    hi = max(lo + 1, int(2 * k / target) + 2)
    while not clearly_below(upper_bound(k, hi, confidence), target):
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if clearly_below(upper_bound(k, mid, confidence), target):
            hi = mid
        else:
            lo = mid + 1
    return lo

"""Quarter-octave histogram bins of per-call statistics, shared by the collector and the judge.

Value x > 0 lands in bin floor(4·log2 x), clipped to [BIN_MIN, BIN_MAX]; exact zeros land in
ZERO_BIN and NaN/Inf in NONFINITE_BIN. A changed threshold t can then be judged from a
histogram alone: every call in a bin whose lower edge is ≥ t exceeds; a bin straddling t
may (so a bound computed that way is conservative).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "BIN_MAX",
    "BIN_MIN",
    "HIST_STATS",
    "NONFINITE_BIN",
    "ZERO_BIN",
    "bin_lower",
    "bin_upper",
    "count_above",
    "hist_quantile_upper",
    "stat_bins",
]

BIN_MIN = -160  # 2^-40
BIN_MAX = 40  # 2^10
ZERO_BIN = -1000
NONFINITE_BIN = 1000
#: the per-call statistics the collector keeps histograms of
HIST_STATS = ("max_abs", "rel_l2", "cos_diff", "scaled", "oracle_ratio")


def stat_bins(x: np.ndarray) -> np.ndarray:
    """Quarter-octave histogram bin of each value."""
    with np.errstate(divide="ignore", invalid="ignore"):
        b = np.floor(4.0 * np.log2(np.where(x > 0, x, 1.0)))
    b = np.clip(np.nan_to_num(b, nan=0.0, posinf=0.0, neginf=0.0), BIN_MIN, BIN_MAX).astype(np.int64)
    b = np.where(x == 0, ZERO_BIN, b)
    return np.where(~np.isfinite(x), NONFINITE_BIN, b)


def bin_lower(b: int) -> float:
    """Smallest value of bin ``b`` (0 for ZERO_BIN, inf for NONFINITE_BIN)."""
    if b == ZERO_BIN:
        return 0.0
    if b == NONFINITE_BIN:
        return float("inf")
    return 0.0 if b <= BIN_MIN else float(2.0 ** (b / 4.0))


def bin_upper(b: int) -> float:
    """Exclusive upper edge of bin ``b``."""
    if b == ZERO_BIN:
        return 0.0
    if b == NONFINITE_BIN or b >= BIN_MAX:
        return float("inf")
    return float(2.0 ** ((b + 1) / 4.0))


def count_above(hist: dict[int, int], threshold: float) -> tuple[int, int]:
    """Calls in ``hist`` that surely exceed ``threshold`` and that may exceed it.

    Sure: the bin's lowest value is above the threshold (non-finite values always are).
    Possible: the bin reaches above the threshold (its exclusive upper edge is above it).
    """
    sure = possible = 0
    for b, count in hist.items():
        if b == NONFINITE_BIN or bin_lower(b) > threshold:
            sure += count
            possible += count
        elif bin_upper(b) > threshold:
            possible += count
    return sure, possible


def hist_quantile_upper(hist: dict[int, int], q: float) -> float:
    """An upper bound on the ``q``-quantile of the values in ``hist`` (the upper edge of its bin).

    NaN when the histogram is empty; inf when the quantile falls among non-finite values.
    """
    total = sum(hist.values())
    if total <= 0:
        return float("nan")
    need = q * total
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= need:
            return bin_upper(b)
    return float("inf")

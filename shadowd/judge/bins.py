"""Histogram bins of per-call statistics, shared by the collector and the judge.

Quarter-octave bins: value x > 0 lands in bin floor(4·log2 x), clipped to [BIN_MIN, BIN_MAX];
exact zeros land in ZERO_BIN and NaN/Inf in NONFINITE_BIN. A changed threshold t can then be
judged from a histogram alone: every call in a bin whose lower edge is ≥ t exceeds; a bin
straddling t may (so a bound computed that way is conservative).

Octave bins (``per_octave=1``, :func:`octave_bins`) are the same with floor(log2 x), clipped to
[BIN_MIN/4, BIN_MAX/4]: quarter-octave bin b lies in octave bin floor(b/4). The collector keeps
run-wide quarter-octave histograms and per-layer octave ones (stat names with OCTAVE_SUFFIX), see
shadowd.collector.rollups. Every function taking ``per_octave`` reads either.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "BIN_MAX",
    "BIN_MIN",
    "HIST_STATS",
    "NONFINITE_BIN",
    "OCTAVE_SUFFIX",
    "RUN_WIDE",
    "ZERO_BIN",
    "bin_lower",
    "bin_upper",
    "count_above",
    "hist_quantile_upper",
    "octave_bins",
    "octave_of",
    "stat_bins",
]

BIN_MIN = -160  # 2^-40
BIN_MAX = 40  # 2^10
ZERO_BIN = -1000
NONFINITE_BIN = 1000
#: the per-call statistics the collector keeps histograms of
HIST_STATS = ("max_abs", "rel_l2", "cos_diff", "scaled", "oracle_ratio")
#: a stat name ending in this holds octave bins (per layer); without it, quarter-octave bins
OCTAVE_SUFFIX = ":oct"
#: the ``layer`` of run-wide histograms (all layers together)
RUN_WIDE = -1


def stat_bins(x: np.ndarray) -> np.ndarray:
    """Quarter-octave histogram bin of each value."""
    with np.errstate(divide="ignore", invalid="ignore"):
        b = np.floor(4.0 * np.log2(np.where(x > 0, x, 1.0)))
    b = np.clip(np.nan_to_num(b, nan=0.0, posinf=0.0, neginf=0.0), BIN_MIN, BIN_MAX).astype(np.int64)
    b = np.where(x == 0, ZERO_BIN, b)
    return np.where(~np.isfinite(x), NONFINITE_BIN, b)


def octave_of(b: np.ndarray) -> np.ndarray:
    """The octave bin of each quarter-octave bin (sentinels kept)."""
    return np.where((b == ZERO_BIN) | (b == NONFINITE_BIN), b, np.floor_divide(b, 4))


def octave_bins(x: np.ndarray) -> np.ndarray:
    """Octave histogram bin of each value."""
    return octave_of(stat_bins(x))


def bin_lower(b: int, per_octave: int = 4) -> float:
    """Smallest value of bin ``b`` (0 for ZERO_BIN, inf for NONFINITE_BIN)."""
    if b == ZERO_BIN:
        return 0.0
    if b == NONFINITE_BIN:
        return float("inf")
    return 0.0 if b * (4 // per_octave) <= BIN_MIN else float(2.0 ** (b / per_octave))


def bin_upper(b: int, per_octave: int = 4) -> float:
    """Exclusive upper edge of bin ``b``."""
    if b == ZERO_BIN:
        return 0.0
    if b == NONFINITE_BIN or (b + 1) * (4 // per_octave) > BIN_MAX:
        return float("inf")
    return float(2.0 ** ((b + 1) / per_octave))


def count_above(hist: dict[int, int], threshold: float, per_octave: int = 4) -> tuple[int, int]:
    """Calls in ``hist`` that surely exceed ``threshold`` and that may exceed it.

    Sure: the bin's lowest value is above the threshold (non-finite values always are).
    Possible: the bin reaches above the threshold (its exclusive upper edge is above it).
    """
    sure = possible = 0
    for b, count in hist.items():
        if b == NONFINITE_BIN or bin_lower(b, per_octave) > threshold:
            sure += count
            possible += count
        elif bin_upper(b, per_octave) > threshold:
            possible += count
    return sure, possible


def hist_quantile_upper(hist: dict[int, int], q: float, per_octave: int = 4) -> float:
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
            return bin_upper(b, per_octave)
    return float("inf")

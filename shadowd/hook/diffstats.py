"""Diff statistics of one shadowed call: the torch (CPU) path and the shared raw layout.

Both paths — :func:`raw_stats_torch` here and the fused Triton kernel in
``shadowd.hook.triton_stats`` — produce the same *raw vector* (float64, layout ``R_*``):
maxima, counts and fp64 sums. :func:`finalize` turns a raw vector into the statistics
columns of ``shadowd.wire.COLUMNS``. Definitions (identical on both paths):

* ``d = float32(c) - float32(b)`` per element, rounded to fp32 (as the kernel does);
* a position is *compared* when both sides are finite; ``max_abs`` (with its first flat
  position), ``mean_abs``, ``max_rel = max |d| / max(|b|, TINY)``, and the sums
  Σd², Σb², Σc² (fp64) run over compared positions only;
* ``rel_l2 = sqrt(Σd² / Σb²)``, ``cos_diff = Σd² / (Σc² + Σb²)`` (no cancellation);
* ``out_scale`` = max |b| over finite b; NaN / Inf counts per side;
* ``cand_nonfinite`` counts positions non-finite in the candidate only (a hard failure),
  ``base_nonfinite`` those non-finite in the baseline only (a baseline event, not held
  against the candidate); when ``cand_nonfinite > 0`` the float statistics are NaN;
* ``hist``: bin 0 exact zeros, bins 1..38 ``floor(log2|d|)`` clipped to
  [HIST_EXP_MIN, HIST_EXP_MAX], last bin every position not compared; Σhist = numel.

Only the first ``valid_numel`` elements (the real, non-padded tokens, row-major) count.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shadowd.wire import HIST_BINS, HIST_EXP_MAX, HIST_EXP_MIN

__all__ = [
    "NRAW",
    "R_BASE_NF",
    "R_CAND_NF",
    "R_HIST",
    "R_INF_B",
    "R_INF_C",
    "R_MAX_ABS",
    "R_MAX_POS",
    "R_MAX_REL",
    "R_NAN_B",
    "R_NAN_C",
    "R_NUMEL",
    "R_N_CMP",
    "R_OUT_SCALE",
    "R_SUM_ABS",
    "R_SUM_B2",
    "R_SUM_C2",
    "R_SUM_D2",
    "STAT_COLUMNS",
    "TINY",
    "empty_stats",
    "finalize",
    "hard_failure",
    "max_abs_chunked",
    "raw_stats_torch",
    "stats_torch",
]

TINY = 2.0**-126  # smallest normal fp32: the floor of |b| in max_rel

R_MAX_ABS, R_MAX_POS, R_SUM_ABS, R_MAX_REL = 0, 1, 2, 3
R_SUM_D2, R_SUM_B2, R_SUM_C2, R_OUT_SCALE = 4, 5, 6, 7
R_NAN_B, R_INF_B, R_NAN_C, R_INF_C = 8, 9, 10, 11
R_CAND_NF, R_BASE_NF, R_NUMEL, R_N_CMP = 12, 13, 14, 15
R_HIST = 16
NRAW = R_HIST + HIST_BINS

#: the sample columns that statistics fill (the streamer fills the rest)
STAT_COLUMNS = ("numel", "max_abs", "mean_abs", "max_rel", "rel_l2", "cos_diff", "out_scale", "nan_base",
                "inf_base", "nan_cand", "inf_cand", "cand_nonfinite", "base_nonfinite", "hist")


def raw_stats_torch(cand: torch.Tensor, base: torch.Tensor, valid_numel: int | None = None) -> torch.Tensor:
    """The raw vector (float64[NRAW]) of ``cand`` against ``base`` over the first ``valid_numel``
    elements (row-major); both must have the same number of elements."""
    c = cand.detach().reshape(-1)
    b = base.detach().reshape(-1)
    if valid_numel is not None:
        c, b = c[:valid_numel], b[:valid_numel]
    c32 = c.to(torch.float32)
    b32 = b.to(torch.float32)
    fin_c = torch.isfinite(c32)
    fin_b = torch.isfinite(b32)
    cmp = fin_c & fin_b
    d = (c32 - b32).abs()
    d = torch.where(cmp, d, torch.zeros_like(d))
    raw = torch.zeros(NRAW, dtype=torch.float64)
    n = c32.numel()
    raw[R_NUMEL] = n
    if n == 0:
        raw[R_MAX_POS] = -1
        return raw
    d_or_neg = torch.where(cmp, d, torch.full_like(d, -1.0))
    pos = int(torch.argmax(d_or_neg))  # first maximal position
    best = float(d_or_neg[pos])
    raw[R_MAX_ABS] = max(best, 0.0)
    raw[R_MAX_POS] = pos if best >= 0 else -1
    d64 = d.double()
    b64 = torch.where(cmp, b32, torch.zeros_like(b32)).double()
    c64 = torch.where(cmp, c32, torch.zeros_like(c32)).double()
    raw[R_SUM_ABS] = d64.sum()
    rel = d / torch.clamp(b32.abs(), min=TINY)
    raw[R_MAX_REL] = float(torch.where(cmp, rel, torch.zeros_like(rel)).max())
    raw[R_SUM_D2] = (d64 * d64).sum()
    raw[R_SUM_B2] = (b64 * b64).sum()
    raw[R_SUM_C2] = (c64 * c64).sum()
    babs = torch.where(fin_b, b32.abs(), torch.zeros_like(b32))
    raw[R_OUT_SCALE] = float(babs.max())
    raw[R_NAN_B] = int(torch.isnan(b32).sum())
    raw[R_INF_B] = int(torch.isinf(b32).sum())
    raw[R_NAN_C] = int(torch.isnan(c32).sum())
    raw[R_INF_C] = int(torch.isinf(c32).sum())
    raw[R_CAND_NF] = int((~fin_c & fin_b).sum())
    raw[R_BASE_NF] = int((fin_c & ~fin_b).sum())
    raw[R_N_CMP] = int(cmp.sum())
    # log2 bins from the fp32 exponent: frexp gives |d| = m * 2^e with m in [0.5, 1)
    _, e = torch.frexp(d)
    bins = torch.clamp(e.to(torch.int64) - 1, HIST_EXP_MIN, HIST_EXP_MAX) + (1 - HIST_EXP_MIN)
    bins = torch.where(d == 0, torch.zeros_like(bins), bins)
    bins = torch.where(cmp, bins, torch.full_like(bins, HIST_BINS - 1))
    raw[R_HIST:] = torch.bincount(bins, minlength=HIST_BINS).double()
    return raw


def finalize(raw: Any) -> dict[str, Any]:
    """The statistics columns (wire names) of a raw vector (a sequence of NRAW floats)."""
    r = [float(x) for x in raw]
    n_cmp = r[R_N_CMP]
    cand_nf = int(r[R_CAND_NF])
    sd2, sb2, sc2 = r[R_SUM_D2], r[R_SUM_B2], r[R_SUM_C2]
    if cand_nf > 0:
        max_abs = mean_abs = max_rel = rel_l2 = cos_diff = math.nan
    else:
        max_abs = r[R_MAX_ABS]
        mean_abs = r[R_SUM_ABS] / n_cmp if n_cmp > 0 else 0.0
        max_rel = r[R_MAX_REL]
        rel_l2 = math.sqrt(sd2 / sb2) if sb2 > 0 else (0.0 if sd2 == 0 else math.inf)
        cos_diff = sd2 / (sc2 + sb2) if sc2 + sb2 > 0 else 0.0
    return {
        "numel": int(n_cmp),  # compared (the wire's definition): a call that compared nothing is no evidence
        "max_abs": max_abs,
        "mean_abs": mean_abs,
        "max_rel": max_rel,
        "rel_l2": rel_l2,
        "cos_diff": cos_diff,
        "out_scale": r[R_OUT_SCALE],
        "nan_base": int(r[R_NAN_B]),
        "inf_base": int(r[R_INF_B]),
        "nan_cand": int(r[R_NAN_C]),
        "inf_cand": int(r[R_INF_C]),
        "cand_nonfinite": cand_nf,
        "base_nonfinite": int(r[R_BASE_NF]),
        "hist": [int(x) for x in r[R_HIST:R_HIST + HIST_BINS]],
        "max_pos": int(r[R_MAX_POS]),
    }


def stats_torch(cand: torch.Tensor, base: torch.Tensor, valid_numel: int | None = None) -> dict[str, Any]:
    """:func:`finalize` of :func:`raw_stats_torch`."""
    return finalize(raw_stats_torch(cand, base, valid_numel).tolist())


def empty_stats(numel: int = 0) -> dict[str, Any]:
    """The statistics of a call whose candidate gave no comparable output (exception, shape, dtype):
    NaN errors (the judge counts them as failures), zero counts, an empty histogram."""
    nan = math.nan
    return {"numel": numel, "max_abs": nan, "mean_abs": nan, "max_rel": nan, "rel_l2": nan, "cos_diff": nan,
            "out_scale": nan, "nan_base": 0, "inf_base": 0, "nan_cand": 0, "inf_cand": 0, "cand_nonfinite": 0,
            "base_nonfinite": 0, "hist": [0] * HIST_BINS, "max_pos": -1}


def hard_failure(stats: dict[str, Any], hard_scaled_max_abs: float, hard_rel_l2: float) -> str | None:
    """Why a call's statistics are a hard failure (on-mode falls back), or None.

    Hard: a position non-finite in the candidate only; max-abs above ``hard_scaled_max_abs``
    times the output scale; rel-L2 above ``hard_rel_l2``; or any NaN statistic.
    """
    if stats["cand_nonfinite"] > 0:
        return "nonfinite"
    max_abs, rel_l2 = stats["max_abs"], stats["rel_l2"]
    if math.isnan(max_abs) or math.isnan(rel_l2):
        return "nan_stat"
    scale = stats["out_scale"] if math.isfinite(stats["out_scale"]) else 0.0
    if max_abs > hard_scaled_max_abs * max(scale, TINY):
        return "max_abs"
    if rel_l2 > hard_rel_l2:
        return "rel_l2"
    return None


def max_abs_chunked(a: torch.Tensor, b: torch.Tensor, rows: int) -> float:
    """max |a - b| in fp32 over row chunks (bounded memory); NaN if either side is non-finite."""
    a2 = a.reshape(a.shape[0], -1) if a.dim() else a.reshape(1, 1)
    b2 = b.reshape(b.shape[0], -1) if b.dim() else b.reshape(1, 1)
    out = 0.0
    for i in range(0, a2.shape[0], rows):
        d = (a2[i:i + rows].float() - b2[i:i + rows].float()).abs()
        m = float(d.max()) if d.numel() else 0.0
        if not math.isfinite(m):  # a NaN, or an Inf on either side
            return math.nan
        out = max(out, m)
    return out

"""Rollup deltas of one validated batch, computed with numpy (no per-sample Python loop).

Ingest turns a batch into a few hundred *deltas* — per (layer, shape bucket) cell, per
(layer, time bucket) slot, per (layer, statistic, histogram bin), per verify step, and the
run's own counters — which the store applies with atomic increments.

Histograms of per-call statistics use the quarter-octave bins of shadowd.judge.bins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shadowd.collector.batch import ValidBatch
from shadowd.judge.bins import HIST_STATS, stat_bins
from shadowd.judge.policy import Policy

__all__ = ["COUNTERS", "HIST_STATS", "MAXES", "SUMS", "Deltas", "compute_deltas"]

COUNTERS = ("n", "n_exceed", "n_error", "n_cand_nonfinite", "n_base_nonfinite", "n_nan_stat", "numel",
            "n_oracle", "n_timed")
SUMS = ("sum_max_abs", "sum_rel_l2", "sum_cos_diff", "sum_scaled", "sum_cand_us", "sum_base_us")
MAXES = ("max_max_abs", "max_rel_l2", "max_cos_diff", "max_max_rel", "max_scaled", "max_oracle_cand",
         "max_oracle_base", "max_oracle_ratio")


@dataclass
class Deltas:
    """Everything one batch adds to the rollups."""

    cells: list[dict[str, Any]]
    slots: list[dict[str, Any]]
    hists: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    run: dict[str, Any]
    exceeded: np.ndarray
    derived: dict[str, np.ndarray]


def _pow2_ceil(x: np.ndarray) -> np.ndarray:
    x = np.maximum(x, 1)
    return np.left_shift(1, np.ceil(np.log2(x)).astype(np.int64))


def _group(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Unique key rows and the inverse index of each sample (keys packed into one int64)."""
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    radix = []
    for k in keys:
        lo = int(k.min())
        span = int(k.max()) - lo + 1
        radix.append((lo, span))
        packed = packed * span + (k - lo)
    uniq, inverse = np.unique(packed, return_inverse=True)
    cols = []
    rest = uniq
    for lo, span in reversed(radix):
        cols.append(rest % span + lo)
        rest = rest // span
    return np.stack(cols[::-1], axis=1), inverse.reshape(-1)


def _aggregate(inv: np.ndarray, g: int, m: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in COUNTERS:
        out[name] = np.bincount(inv, weights=m[name], minlength=g).round().astype(np.int64)
    for name in SUMS:
        out[name] = np.bincount(inv, weights=m[name], minlength=g)
    for name in MAXES:
        acc = np.zeros(g)
        np.fmax.at(acc, inv, m[name])
        out[name] = acc
    return out


def _measures(b: ValidBatch, exceeded: np.ndarray, scaled: np.ndarray, ratio: np.ndarray) -> dict[str, Any]:
    c = b.cols
    stats = np.stack([c["max_abs"], c["rel_l2"], c["cos_diff"], scaled])
    nan_stat = ~np.isfinite(stats).all(axis=0)
    err = np.array([e is not None for e in c["error"]], dtype=bool)
    oracle = ~np.isnan(c["oracle_cand_err"]) & ~np.isnan(c["oracle_base_err"])
    timed = ~np.isnan(c["cand_us"]) & ~np.isnan(c["base_us"])

    def finite(x: np.ndarray) -> np.ndarray:
        return np.where(np.isfinite(x), x, 0.0)

    def maxable(x: np.ndarray) -> np.ndarray:
        # fmax ignores NaN; +inf is kept on purpose (a max of inf is worth seeing)
        return np.where(np.isnan(x), 0.0, x)

    return {
        "n": np.ones(b.n),
        "n_exceed": exceeded.astype(np.float64),
        "n_error": err.astype(np.float64),
        "n_cand_nonfinite": (c["cand_nonfinite"] > 0).astype(np.float64),
        "n_base_nonfinite": (c["base_nonfinite"] > 0).astype(np.float64),
        "n_nan_stat": nan_stat.astype(np.float64),
        "numel": c["numel"].astype(np.float64),
        "n_oracle": oracle.astype(np.float64),
        "n_timed": timed.astype(np.float64),
        "sum_max_abs": finite(c["max_abs"]),
        "sum_rel_l2": finite(c["rel_l2"]),
        "sum_cos_diff": finite(c["cos_diff"]),
        "sum_scaled": finite(scaled),
        "sum_cand_us": np.where(timed, finite(c["cand_us"]), 0.0),
        "sum_base_us": np.where(timed, finite(c["base_us"]), 0.0),
        "max_max_abs": maxable(c["max_abs"]),
        "max_rel_l2": maxable(c["rel_l2"]),
        "max_cos_diff": maxable(c["cos_diff"]),
        "max_max_rel": maxable(c["max_rel"]),
        "max_scaled": maxable(scaled),
        "max_oracle_cand": maxable(c["oracle_cand_err"]),
        "max_oracle_base": maxable(c["oracle_base_err"]),
        "max_oracle_ratio": maxable(ratio),
        "_err": err,
        "_oracle": oracle,
    }


def compute_deltas(run_id: int, b: ValidBatch, policy: Policy, time_bucket_s: int) -> Deltas:
    """All rollup increments for batch ``b`` of run ``run_id`` under ``policy``."""
    c = b.cols
    scale = c["out_scale"]
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(scale > 0, c["max_abs"] / np.where(scale > 0, scale, 1.0), c["max_abs"])
        floor = policy.ulp * np.where(np.isfinite(scale), scale, 0.0)
        ratio = c["oracle_cand_err"] / (c["oracle_base_err"] + floor)
    m = _measures(b, np.zeros(b.n, dtype=bool), scaled, ratio)
    exceeded = policy.exceeds({**c, "error_flag": m["_err"]})
    m["n_exceed"] = exceeded.astype(np.float64)

    layer = c["layer"]
    bs_b = _pow2_ceil(c["batch_size"])
    t_b = _pow2_ceil(c["draft_tokens"])
    p_b = np.frexp(c["prefix_len"].astype(np.float64))[1].astype(np.int64)  # == int.bit_length
    heads = c["heads"]
    ts = c["ts"]

    cells: list[dict[str, Any]] = []
    uniq, inv = _group([layer, bs_b, t_b, p_b, heads])
    agg = _aggregate(inv, len(uniq), m)
    first = np.full(len(uniq), np.inf)
    last = np.full(len(uniq), -np.inf)
    np.fmin.at(first, inv, ts)
    np.fmax.at(last, inv, ts)
    agg_lists = {k: v.tolist() for k, v in agg.items()}
    first_l, last_l = first.tolist(), last.tolist()
    for i, key in enumerate(uniq.tolist()):
        row = {"run_id": run_id, "layer": key[0], "bs_bucket": key[1], "t_bucket": key[2],
               "prefix_bucket": key[3], "heads": key[4], "first_ts": first_l[i], "last_ts": last_l[i]}
        row.update({k: v[i] for k, v in agg_lists.items()})
        cells.append(row)

    slots: list[dict[str, Any]] = []
    tb = (np.floor(ts / time_bucket_s) * time_bucket_s).astype(np.int64)
    uniq, inv = _group([layer, tb])
    agg = _aggregate(inv, len(uniq), m)
    agg_lists = {k: v.tolist() for k, v in agg.items()}
    for i, key in enumerate(uniq.tolist()):
        row = {"run_id": run_id, "layer": key[0], "t": key[1]}
        row.update({k: v[i] for k, v in agg_lists.items()})
        slots.append(row)

    hists: list[dict[str, Any]] = []
    for stat, values, mask in (
        ("max_abs", c["max_abs"], None),
        ("rel_l2", c["rel_l2"], None),
        ("cos_diff", c["cos_diff"], None),
        ("scaled", scaled, None),
        ("oracle_ratio", ratio, m["_oracle"]),
    ):
        sel = np.ones(b.n, dtype=bool) if mask is None else mask
        if not sel.any():
            continue
        uniq, inv = _group([layer[sel], stat_bins(values[sel])])
        counts = np.bincount(inv, minlength=len(uniq))
        for (lay, bn), cnt in zip(uniq.tolist(), counts.tolist(), strict=True):
            hists.append({"run_id": run_id, "layer": lay, "stat": stat, "bin": bn, "count": cnt})

    steps: list[dict[str, Any]] = []
    uniq_steps, inv = np.unique(c["step"], return_inverse=True)
    n_calls = np.bincount(inv, minlength=len(uniq_steps))
    step_exc = np.bincount(inv, weights=exceeded.astype(np.float64), minlength=len(uniq_steps)) > 0
    step_first = np.full(len(uniq_steps), np.inf)
    np.fmin.at(step_first, inv, ts)
    for i, s in enumerate(uniq_steps.tolist()):
        steps.append({"run_id": run_id, "step": s, "n_calls": int(n_calls[i]),
                      "exceeded": int(step_exc[i]), "first_ts": float(step_first[i])})

    rank0_layer0 = (c["rank"] == 0) & (layer == 0)
    run = {
        "n_samples": b.n,
        "n_errors": int(m["_err"].sum()),
        "n_cand_nonfinite": int((c["cand_nonfinite"] > 0).sum()),
        "n_base_nonfinite": int((c["base_nonfinite"] > 0).sum()),
        "n_exceed": int(exceeded.sum()),
        "n_requests": int(c["new_requests"][rank0_layer0].sum()),
        "n_oracle": int(m["_oracle"].sum()),
        "first_sample_ts": float(ts.min()),
        "last_sample_ts": float(ts.max()),
    }
    derived = {"scaled": scaled, "oracle_ratio": ratio}
    return Deltas(cells, slots, hists, steps, run, exceeded, derived)

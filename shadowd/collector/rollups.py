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

__all__ = ["COUNTERS", "HIST_STATS", "MAXES", "SUMS", "Deltas", "Rows", "compute_deltas"]

COUNTERS = ("n", "n_exceed", "n_error", "n_cand_nonfinite", "n_base_nonfinite", "n_nan_stat", "numel",
            "n_oracle", "n_timed")
SUMS = ("sum_max_abs", "sum_rel_l2", "sum_cos_diff", "sum_scaled", "sum_cand_us", "sum_base_us")
MAXES = ("max_max_abs", "max_rel_l2", "max_cos_diff", "max_max_rel", "max_scaled", "max_oracle_cand",
         "max_oracle_base", "max_oracle_ratio")


@dataclass
class Rows:
    """Rows for one table: column names and one tuple per row (ready for executemany)."""

    cols: tuple[str, ...]
    rows: list[tuple[Any, ...]]

    def dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.cols, r, strict=True)) for r in self.rows]


def _rows(columns: dict[str, list[Any]]) -> Rows:
    return Rows(tuple(columns), list(zip(*columns.values(), strict=True)))


@dataclass
class Deltas:
    """Everything one batch adds to the rollups."""

    cells: Rows
    slots: Rows
    hists: Rows
    steps: Rows
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


def _group_reduce(ufunc: np.ufunc, inv: np.ndarray, g: int, values: np.ndarray) -> np.ndarray:
    """Per-group ``ufunc.reduce`` of ``values`` (every group 0..g-1 must be present in ``inv``)."""
    order = np.argsort(inv, kind="stable")
    starts = np.searchsorted(inv[order], np.arange(g))
    return ufunc.reduceat(values[order], starts)


def _aggregate(inv: np.ndarray, g: int, m: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in COUNTERS:
        out[name] = np.bincount(inv, weights=m[name], minlength=g).round().astype(np.int64)
    for name in SUMS:
        out[name] = np.bincount(inv, weights=m[name], minlength=g)
    order = np.argsort(inv, kind="stable")
    starts = np.searchsorted(inv[order], np.arange(g))
    for name in MAXES:
        out[name] = np.fmax.reduceat(m[name][order], starts)
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

    uniq, inv = _group([layer, bs_b, t_b, p_b, heads])
    g = len(uniq)
    agg = _aggregate(inv, g, m)
    cells = _rows({
        "run_id": [run_id] * g,
        **{k: uniq[:, i].tolist() for i, k in enumerate(("layer", "bs_bucket", "t_bucket", "prefix_bucket", "heads"))},
        **{k: v.tolist() for k, v in agg.items()},
        "first_ts": _group_reduce(np.fmin, inv, g, ts).tolist(),
        "last_ts": _group_reduce(np.fmax, inv, g, ts).tolist(),
    })

    tb = (np.floor(ts / time_bucket_s) * time_bucket_s).astype(np.int64)
    uniq, inv = _group([layer, tb])
    g = len(uniq)
    agg = _aggregate(inv, g, m)
    slots = _rows({"run_id": [run_id] * g, "layer": uniq[:, 0].tolist(), "t": uniq[:, 1].tolist(),
                   **{k: v.tolist() for k, v in agg.items()}})

    hist_cols: dict[str, list[Any]] = {"run_id": [], "layer": [], "stat": [], "bin": [], "count": []}
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
        g = len(uniq)
        hist_cols["run_id"] += [run_id] * g
        hist_cols["layer"] += uniq[:, 0].tolist()
        hist_cols["stat"] += [stat] * g
        hist_cols["bin"] += uniq[:, 1].tolist()
        hist_cols["count"] += np.bincount(inv, minlength=g).tolist()
    hists = _rows(hist_cols)

    uniq_steps, inv = np.unique(c["step"], return_inverse=True)
    inv = inv.reshape(-1)
    g = len(uniq_steps)
    steps = _rows({
        "run_id": [run_id] * g,
        "step": uniq_steps.tolist(),
        "n_calls": np.bincount(inv, minlength=g).tolist(),
        "exceeded": (np.bincount(inv, weights=exceeded.astype(np.float64), minlength=g) > 0).astype(int).tolist(),
        "first_ts": _group_reduce(np.fmin, inv, g, ts).tolist(),
    })

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

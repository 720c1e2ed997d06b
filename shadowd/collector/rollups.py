"""Rollup deltas of one validated batch, computed with numpy (no per-sample Python loop).

Ingest turns a batch into a few hundred *deltas* — per (layer, shape bucket) cell, per
(layer, time bucket) slot, per (layer, statistic, histogram bin), per verify step, and the
run's own counters — which the store applies with atomic increments.

Histograms of per-call statistics use the bins of shadowd.judge.bins: quarter-octave run-wide,
octave per layer (and quarter-octave per layer for the oracle ratio).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shadowd.collector.batch import ValidBatch
from shadowd.judge.bins import (
    BIN_MAX,
    BIN_MIN,
    HIST_STATS,
    NONFINITE_BIN,
    OCTAVE_SUFFIX,
    RUN_WIDE,
    ZERO_BIN,
    octave_of,
    stat_bins,
)
from shadowd.judge.policy import Policy

__all__ = ["CAPPED", "COUNTERS", "HIST_STATS", "I64_MAX", "MAXES", "SUMS", "Deltas", "Rows", "compared",
           "compute_deltas"]

#: ``n_nan_unexplained``: calls with a non-finite statistic and neither a non-finite output on either side nor a
#: candidate error to explain it (the tolerance criterion's failures; counted per call: a baseline event in the same
#: cell explains only its own call)
COUNTERS = ("n", "n_exceed", "n_error", "n_cand_nonfinite", "n_base_nonfinite", "n_nan_stat", "numel",
            "n_oracle", "n_timed", "n_nan_unexplained")
SUMS = ("sum_max_abs", "sum_rel_l2", "sum_cos_diff", "sum_scaled", "sum_cand_us", "sum_base_us")
#: counters summed from values that may be large (element counts, ≤ 2^48 a call): their sums stop at I64_MAX (in a
#: batch's deltas and in the stored rollups: see Upserter's ``capped``) instead of wrapping around or overflowing
CAPPED = ("numel",)
I64_MAX = 2**63 - 1
MAXES = ("max_max_abs", "max_rel_l2", "max_cos_diff", "max_max_rel", "max_scaled", "max_oracle_cand",
         "max_oracle_base", "max_oracle_ratio")


@dataclass
class Rows:
    """Rows for one table, column by column: names and one list of values per column."""

    cols: tuple[str, ...]
    values: list[list[Any]]

    def __len__(self) -> int:
        return len(self.values[0]) if self.values else 0

    @property
    def rows(self) -> list[tuple[Any, ...]]:
        """One tuple per row (what executemany takes)."""
        return list(zip(*self.values, strict=True))

    def dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.cols, r, strict=True)) for r in self.rows]


def _rows(columns: dict[str, list[Any]]) -> Rows:
    return Rows(tuple(columns), list(columns.values()))


@dataclass
class Deltas:
    """Everything one batch adds to the rollups."""

    cells: Rows
    slots: Rows
    hists: Rows
    steps: Rows
    run: dict[str, Any]
    exceeded: np.ndarray
    #: candidate errors per kind: run_id, error, n, first_ts, last_ts
    errors: Rows = field(default_factory=lambda: Rows(("run_id", "error", "n", "first_ts", "last_ts"), []))
    #: per (rank, layer): run_id, rank, layer, n (compared calls), n_empty (calls that compared nothing), first_ts,
    #: last_ts
    ranks: Rows = field(default_factory=lambda: Rows(("run_id", "rank", "layer", "n", "n_empty", "first_ts",
                                                      "last_ts"), []))


def _pow2_ceil(x: np.ndarray) -> np.ndarray:
    x = np.maximum(x, 1)
    return np.left_shift(1, np.ceil(np.log2(x)).astype(np.int64))


@dataclass
class _Groups:
    """Samples grouped by a key: the distinct keys, each sample's group, and one sort shared by all
    reductions (``order`` sorts the samples by group, ``starts`` is where each group begins in it)."""

    keys: np.ndarray  # (g, k) distinct key rows
    inv: np.ndarray
    order: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    def reduce(self, ufunc: np.ufunc, values: np.ndarray) -> np.ndarray:
        return ufunc.reduceat(values[self.order], self.starts)


def _group(keys: list[np.ndarray]) -> _Groups:
    """Group samples by key columns (packed into one int64, sorted once)."""
    spans = [int(k.max()) - int(k.min()) + 1 for k in keys]
    if _product(spans) >= 1 << 63:
        # keys far apart (values validation accepts: batch sizes 1 and 2^30, head counts 1 and 2^31 - 1, ...)
        # would overflow the packed int64 and mix groups up: sort the key rows themselves (slower, same groups
        # in the same order)
        return _group_rows(keys)
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    radix = []
    for k, span in zip(keys, spans, strict=True):
        lo = int(k.min())
        radix.append((lo, span))
        packed = packed * span + (k - lo)
    order = np.argsort(packed, kind="stable")
    ps = packed[order]
    first = np.empty(len(ps), dtype=bool)
    first[:1] = True
    np.not_equal(ps[1:], ps[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    uniq = ps[starts]
    inv = np.empty(len(ps), dtype=np.int64)
    inv[order] = np.cumsum(first) - 1
    cols = []
    rest = uniq
    for lo, span in reversed(radix):
        cols.append(rest % span + lo)
        rest = rest // span
    return _Groups(np.stack(cols[::-1], axis=1), inv, order, starts)


def _capped_sums(grp: _Groups, values: np.ndarray) -> np.ndarray:
    """Per group the exact integer sum of ``values`` (whole numbers, each ≤ 2^53), at most I64_MAX: a float64 sum
    is inexact above 2^53 and an int64 one wraps around above I64_MAX (a batch may hold 2^17 calls of 2^48)."""
    ints = values.astype(np.int64)
    if float(values.sum()) < 2.0**62:  # no group's sum can come near the top: exact in int64
        return np.add.reduceat(ints[grp.order], grp.starts)
    ordered = ints[grp.order].tolist()
    bounds = [*grp.starts.tolist(), len(ordered)]
    return np.array([min(sum(ordered[a:b]), I64_MAX) for a, b in itertools.pairwise(bounds)],
                    dtype=np.int64)


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _group_rows(keys: list[np.ndarray]) -> _Groups:
    """:func:`_group` by sorting the key rows (lexicographically, as the packed keys sort)."""
    uniq, inv = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)
    inv = inv.reshape(-1).astype(np.int64)
    order = np.argsort(inv, kind="stable")
    starts = np.flatnonzero(np.r_[True, inv[order][1:] != inv[order][:-1]])
    return _Groups(uniq, inv, order, starts)


def _aggregate(grp: _Groups, m: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    g = len(grp)
    for name in COUNTERS:
        if name in CAPPED:
            out[name] = _capped_sums(grp, m[name])
        else:
            out[name] = np.bincount(grp.inv, weights=m[name], minlength=g).round().astype(np.int64)
    for name in SUMS:
        out[name] = np.bincount(grp.inv, weights=m[name], minlength=g)
    for name in MAXES:
        out[name] = grp.reduce(np.fmax, m[name])
    return out


def _bin_counts(bins: np.ndarray, layers: np.ndarray | None, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """Counts per (layer, bin) — or per bin when ``layers`` is None — of bins in [lo, hi] plus the two
    sentinels: (layers, bins, counts) of the non-empty ones, sorted."""
    k = hi - lo + 3  # regular bins, then ZERO_BIN, then NONFINITE_BIN
    code = np.where(bins == ZERO_BIN, k - 2, np.where(bins == NONFINITE_BIN, k - 1, bins - lo))
    if layers is None:
        counts = np.bincount(code, minlength=k)
        nz = np.flatnonzero(counts)
        return np.full(len(nz), RUN_WIDE), _decode_bins(nz, lo, k), counts[nz]
    l0 = int(layers.min())
    span = int(layers.max()) - l0 + 1
    if span * k > 1 << 20:  # very sparse layer ids: group by sorting instead
        grp = _group([layers, bins])
        return grp.keys[:, 0], grp.keys[:, 1], np.bincount(grp.inv, minlength=len(grp))
    counts = np.bincount((layers - l0) * k + code, minlength=span * k)
    nz = np.flatnonzero(counts)
    return nz // k + l0, _decode_bins(nz % k, lo, k), counts[nz]


def _decode_bins(code: np.ndarray, lo: int, k: int) -> np.ndarray:
    return np.where(code == k - 2, ZERO_BIN, np.where(code == k - 1, NONFINITE_BIN, code + lo))


def _measures(b: ValidBatch, exceeded: np.ndarray, scaled: np.ndarray, ratio: np.ndarray) -> dict[str, Any]:
    c = b.cols
    stats = np.stack([c["max_abs"], c["rel_l2"], c["cos_diff"], scaled])
    nan_stat = ~np.isfinite(stats).all(axis=0)
    errors = c["error"]
    err = (np.zeros(b.n, dtype=bool) if errors.count(None) == len(errors)
           else np.array([e is not None for e in errors], dtype=bool))
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
        "n_nan_unexplained": (nan_stat & ~err & (c["cand_nonfinite"] == 0) & (c["base_nonfinite"] == 0)
                              ).astype(np.float64),
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
    done = compared(c, m["_err"])
    exceeded = policy.exceeds({**c, "error_flag": m["_err"]}) & done
    m["n_exceed"] = exceeded.astype(np.float64)
    ranks = _rank_rows(run_id, c["rank"], c["layer"], done, c["ts"])
    errors = _error_kinds(run_id, c["error"], c["ts"])
    everything = {
        "n_samples": b.n,
        "n_errors": int(m["_err"].sum()),
        "n_cand_nonfinite": int((c["cand_nonfinite"] > 0).sum()),
        "n_base_nonfinite": int((c["base_nonfinite"] > 0).sum()),  # a baseline event, evidence or not
        "n_exceed": int(exceeded.sum()),
        "max_ts": float(c["ts"].max()),
    }
    if not done.all():
        # calls that compared nothing are stored (and counted in rollup_ranks) but are no evidence: the
        # cells, time slots, histograms, steps, requests and sample times below are of the others only
        keep = np.flatnonzero(done)
        c = {k: v[keep] for k, v in c.items() if isinstance(v, np.ndarray)}
        m = {k: v[keep] for k, v in m.items()}
        scaled, ratio = scaled[keep], ratio[keep]
        if not len(keep):
            none = Rows((), [])
            return Deltas(none, none, none, none, {**everything, **_NO_EVIDENCE}, exceeded, errors, ranks)

    layer = c["layer"]
    bs_b = _pow2_ceil(c["batch_size"])
    t_b = _pow2_ceil(c["draft_tokens"])
    p_b = np.frexp(c["prefix_len"].astype(np.float64))[1].astype(np.int64)  # == int.bit_length
    heads = c["heads"]
    ts = c["ts"]

    grp = _group([layer, bs_b, t_b, p_b, heads])
    g = len(grp)
    agg = _aggregate(grp, m)
    cells = _rows({
        "run_id": [run_id] * g,
        **{k: grp.keys[:, i].tolist()
           for i, k in enumerate(("layer", "bs_bucket", "t_bucket", "prefix_bucket", "heads"))},
        **{k: v.tolist() for k, v in agg.items()},
        "first_ts": grp.reduce(np.fmin, ts).tolist(),
        "last_ts": grp.reduce(np.fmax, ts).tolist(),
    })

    tb = (np.floor(ts / time_bucket_s) * time_bucket_s).astype(np.int64)
    grp = _group([layer, tb])
    g = len(grp)
    agg = _aggregate(grp, m)
    slots = _rows({"run_id": [run_id] * g, "layer": grp.keys[:, 0].tolist(), "t": grp.keys[:, 1].tolist(),
                   **{k: v.tolist() for k, v in agg.items()}})

    # histograms: run-wide quarter-octave ones (layer RUN_WIDE) of the four statistics, per-layer octave
    # ones of the same (stat + OCTAVE_SUFFIX: what the per-layer metrics and the per-layer bounds need, in
    # a quarter of the rows), and per-layer quarter-octave ones of the oracle ratio (the per-layer median)
    hist_cols: dict[str, list[Any]] = {"run_id": [], "layer": [], "stat": [], "bin": [], "count": []}

    def add_hist(stat: str, layers: np.ndarray | None, bins: np.ndarray, lo: int, hi: int) -> None:
        lays, bs, counts = _bin_counts(bins, layers, lo, hi)
        hist_cols["run_id"] += [run_id] * len(counts)
        hist_cols["layer"] += lays.tolist()
        hist_cols["stat"] += [stat] * len(counts)
        hist_cols["bin"] += bs.tolist()
        hist_cols["count"] += counts.tolist()

    for stat, values in (("max_abs", c["max_abs"]), ("rel_l2", c["rel_l2"]), ("cos_diff", c["cos_diff"]),
                         ("scaled", scaled)):
        quarter = stat_bins(values)
        add_hist(stat, None, quarter, BIN_MIN, BIN_MAX)
        add_hist(stat + OCTAVE_SUFFIX, layer, octave_of(quarter), BIN_MIN // 4, BIN_MAX // 4)
    if m["_oracle"].any():
        sel = m["_oracle"]
        add_hist("oracle_ratio", layer[sel], stat_bins(ratio[sel]), BIN_MIN, BIN_MAX)
    hists = _rows(hist_cols)

    grp = _group([c["step"]])
    g = len(grp)
    steps = _rows({
        "run_id": [run_id] * g,
        "step": grp.keys[:, 0].tolist(),
        "n_calls": np.bincount(grp.inv, minlength=g).tolist(),
        "exceeded": (np.bincount(grp.inv, weights=m["n_exceed"], minlength=g) > 0).astype(int).tolist(),
        "first_ts": grp.reduce(np.fmin, ts).tolist(),
    })

    rank0_layer0 = (c["rank"] == 0) & (layer == 0)
    run = {
        **everything,
        "n_requests": int(c["new_requests"][rank0_layer0].sum()),
        "n_oracle": int(m["_oracle"].sum()),
        "first_sample_ts": float(ts.min()),
        "last_sample_ts": float(ts.max()),
    }
    return Deltas(cells, slots, hists, steps, run, exceeded, errors, ranks)


#: the run counters of a batch in which no call compared anything (evidence: none)
_NO_EVIDENCE = {"n_requests": 0, "n_oracle": 0, "first_sample_ts": None, "last_sample_ts": None}


def compared(c: dict[str, Any], err: np.ndarray) -> np.ndarray:
    """Per call: did it compare anything? ``numel`` counts the output elements compared; a call with none, no
    candidate error and no candidate-only non-finite output (every baseline value non-finite, say) compared
    nothing: it is stored, but it is no evidence for the verdict."""
    return np.asarray((c["numel"] > 0) | err | (c["cand_nonfinite"] > 0), dtype=bool)


def _rank_rows(run_id: int, rank: np.ndarray, layer: np.ndarray, done: np.ndarray, ts: np.ndarray) -> Rows:
    # compared and empty calls per (rank, layer): what rank coverage reads
    grp = _group([rank, layer])
    g = len(grp)
    return _rows({
        "run_id": [run_id] * g, "rank": grp.keys[:, 0].tolist(), "layer": grp.keys[:, 1].tolist(),
        "n": np.bincount(grp.inv, weights=done, minlength=g).round().astype(np.int64).tolist(),
        "n_empty": np.bincount(grp.inv, weights=~done, minlength=g).round().astype(np.int64).tolist(),
        "first_ts": grp.reduce(np.fmin, ts).tolist(), "last_ts": grp.reduce(np.fmax, ts).tolist(),
    })


def _error_kinds(run_id: int, errors: list[str | None], ts: np.ndarray) -> Rows:
    # the batch's candidate errors per kind (almost always none: one C-level count says so)
    kinds: dict[str, list[float]] = {}
    if errors.count(None) != len(errors):
        for e, when in zip(errors, ts.tolist(), strict=True):
            if e is not None:
                k = kinds.setdefault(e, [0, when, when])
                k[0] += 1
                k[1], k[2] = min(k[1], when), max(k[2], when)
    return _rows({"run_id": [run_id] * len(kinds), "error": list(kinds), "n": [int(k[0]) for k in kinds.values()],
                  "first_ts": [k[1] for k in kinds.values()], "last_ts": [k[2] for k in kinds.values()]})

"""The judge's criteria: pure functions of one run's rollups and the policy.

Each returns a :class:`~shadowd.judge.report.Criterion`. Order matters only for reading:
hard failures first, then tolerance (scale-free statistics first), the oracle rule, the
exceedance rate, traffic volume and coverage. Drift is in :mod:`shadowd.judge.drift`, hysteresis and the
fingerprint in :mod:`shadowd.judge.hysteresis`.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Any

from shadowd.judge.bins import OCTAVE_SUFFIX, RUN_WIDE, count_above, hist_quantile_upper
from shadowd.judge.inputs import RunRollups
from shadowd.judge.policy import Policy
from shadowd.judge.ranks import rank_gaps
from shadowd.judge.report import FAIL, INSUFFICIENT, PASS, Criterion, bucket_label
from shadowd.judge.stats import clearly_above, clearly_below, lower_bound, steps_needed, upper_bound

__all__ = [
    "TOL_STATS",
    "baseline_events",
    "coverage",
    "covered_shapes",
    "exceedance",
    "fold_layers",
    "hard_failures",
    "mean_of",
    "not_le",
    "oracle",
    "requests",
    "time_span",
    "tolerance",
]

#: (report name, rollup sum column, policy tolerance) — scale-free statistics first
TOL_STATS = (
    ("rel_l2", "sum_rel_l2", "rel_l2_max"),
    ("cos_diff", "sum_cos_diff", "cos_diff_max"),
    ("scaled_max_abs", "sum_scaled", "scaled_max_abs_max"),
)

_FOLD = ("n", "n_exceed", "n_error", "n_cand_nonfinite", "n_base_nonfinite", "n_nan_stat", "n_nan_unexplained",
         "n_oracle", "sum_rel_l2", "sum_cos_diff", "sum_scaled", "sum_max_abs")


def _f(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    return 0.0 if v is None else float(v)


def fold_layers(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Sum cells (or time slots) per layer."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for c in rows:
        a = out[int(c["layer"])]
        for k in _FOLD:
            a[k] += _f(c, k)
    return out


def mean_of(total: float, n: float) -> float:
    return total / n if n > 0 else float("nan")


def not_le(x: float, limit: float) -> bool:
    """True unless ``x <= limit`` (NaN is never within a limit)."""
    return not x <= limit


# ---- hard failures -----------------------------------------------------------------------------
def hard_failures(r: RunRollups, p: Policy) -> Criterion:
    """Candidate non-finite where the baseline is finite, and candidate errors: sticky for the run."""
    nonfinite = int(_f(r.run, "n_cand_nonfinite"))
    errors = int(_f(r.run, "n_errors"))
    layers = sorted({int(c["layer"]) for c in r.cells if _f(c, "n_cand_nonfinite") or _f(c, "n_error")})
    buckets = sorted({bucket_label(c) for c in r.cells if _f(c, "n_cand_nonfinite") or _f(c, "n_error")})
    parts = []
    if nonfinite:
        parts.append(f"{nonfinite} calls non-finite in the candidate where the baseline is finite")
    if errors:
        kinds = sorted(r.errors.items(), key=lambda kv: (-kv[1], kv[0]))
        by_kind = (": " + ", ".join(f"{k} ×{n}" for k, n in kinds[:3]) + (f", {len(kinds) - 3} more kinds"
                                                                           if len(kinds) > 3 else "")) if kinds else ""
        parts.append(f"{errors} candidate errors (exception, shape or dtype mismatch, an error flag raised by its "
                     f"kernels, or a fault of the hook itself){by_kind}")
    status = FAIL if parts else PASS
    detail = "; ".join(parts) if parts else "no non-finite mismatches and no candidate errors"
    return Criterion("hard_failures", status, {"cand_nonfinite": nonfinite, "errors": errors},
                     {"cand_nonfinite": 0, "errors": 0}, detail, layers, buckets)


def baseline_events(r: RunRollups, p: Policy) -> Criterion:
    """Baseline non-finite where the candidate is finite: reported, never held against the candidate."""
    n = int(_f(r.run, "n_base_nonfinite"))
    per_layer = fold_layers(r.cells)
    layers = sorted(lay for lay, a in per_layer.items() if a["n_base_nonfinite"])
    oracle_n = int(sum(per_layer[lay]["n_oracle"] for lay in layers))
    detail = (f"{n} calls with the baseline non-finite where the candidate is finite (a baseline event); "
              f"{oracle_n} oracle-sampled calls in those layers attribute errors" if n
              else "no baseline-only non-finite outputs")
    return Criterion("baseline_events", PASS, n, None, detail, layers, informational=True,
                     extra={"oracle_samples_in_layers": oracle_n})


# ---- tolerance ---------------------------------------------------------------------------------
def tolerance(r: RunRollups, p: Policy) -> Criterion:
    """Per (layer, shape bucket): mean rel-L2, cosine difference and max-abs/scale within tolerance.

    NaN never passes: a NaN statistic, or calls whose statistics were NaN without a non-finite
    output or candidate error to explain them, fail the cell.
    """
    limits = {name: p.tol(tol) for name, _, tol in TOL_STATS}
    worst: dict[str, float] = dict.fromkeys(limits, 0.0)
    bad_layers: set[int] = set()
    bad_buckets: set[str] = set()
    problems: list[str] = []
    unexplained_total = 0
    seen = 0
    for c in r.cells:
        n = _f(c, "n")
        if n <= 0:
            continue
        seen += 1
        bad = False
        for name, col, _ in TOL_STATS:
            m = mean_of(_f(c, col), n)
            worst[name] = float("nan") if math.isnan(m) or math.isnan(worst[name]) else max(worst[name], m)
            if not_le(m, limits[name]):
                bad = True
        unexplained = _f(c, "n_nan_unexplained")  # (counted per call: shadowd.collector.rollups)
        if unexplained > 0:
            unexplained_total += int(unexplained)
            bad = True
        if bad:
            bad_layers.add(int(c["layer"]))
            bad_buckets.add(bucket_label(c))
    if not seen:
        return Criterion("tolerance", INSUFFICIENT, None, limits, "no samples yet")
    for name, limit in limits.items():
        if not_le(worst[name], limit):
            problems.append(f"mean {name} {worst[name]:.3g} > {limit:.3g}")
    if unexplained_total:
        problems.append(f"{unexplained_total} calls with NaN error statistics and no non-finite output "
                        "to explain it")
    status = FAIL if bad_layers else PASS
    detail = "; ".join(problems) or "mean statistics of every layer and shape bucket within tolerance"
    return Criterion("tolerance", status, {**{f"worst_mean_{k}": v for k, v in worst.items()},
                                           "unexplained_nan_stats": unexplained_total},
                     {f"max_mean_{k}": v for k, v in limits.items()}, detail, sorted(bad_layers),
                     sorted(bad_buckets))


def oracle(r: RunRollups, p: Policy) -> Criterion:
    """Where oracle samples exist: the median of cand_err / (base_err + ulp floor) per layer ≤ k.

    The per-call rule (candidate-vs-oracle ≤ k × baseline-vs-oracle + ulp floor) already
    counts in the exceedance rate; this catches a layer that is systematically worse than the
    baseline against the fp32 oracle. The median is read conservatively (its bin's upper edge).
    """
    medians: dict[int, float] = {}
    for (layer, stat), h in r.hists.items():
        if stat == "oracle_ratio" and sum(h.values()) > 0:
            medians[layer] = hist_quantile_upper(h, 0.5)
    if not medians:
        return Criterion("oracle", PASS, None, p.oracle_k, "no oracle samples (rule not applicable)")
    bad = sorted(lay for lay, m in medians.items() if not_le(m, p.oracle_k))
    worst = max(medians.values(), key=lambda v: float("inf") if math.isnan(v) else v)
    # (a median is read as its bin's upper edge: "≤")
    detail = (f"median candidate/baseline oracle-error ratio above the limit k={p.oracle_k:g} in layers {bad} "
              f"(worst ≤ {worst:.3g})"
              if bad else f"median candidate/baseline oracle-error ratio ≤ {worst:.3g} in every sampled layer "
              f"(limit k={p.oracle_k:g})")
    return Criterion("oracle", FAIL if bad else PASS, worst, p.oracle_k, detail, bad,
                     extra={"oracle_layers": len(medians)})


# ---- exceedance rate ---------------------------------------------------------------------------
def _hist_bound(r: RunRollups, p: Policy) -> tuple[int, int]:
    """(lower, upper) bound on exceeding steps under ``p`` from the per-call histograms alone.

    Possibly exceeding calls are counted from the finest histogram of each statistic (run-wide
    quarter-octave when there is one, else per layer); surely exceeding ones per layer (a layer's
    calls of one step are at most tp_size) and run-wide (at most tp_size × num_layers per step).
    """
    thresholds = {"rel_l2": p.tol("rel_l2_max"), "cos_diff": p.tol("cos_diff_max"),
                  "scaled": p.tol("scaled_max_abs_max")}
    per_layer = fold_layers(r.cells)
    calls_per_step = max(1, int(_f(r.run, "tp_size")) or 1)
    num_layers = int(_f(r.run, "num_layers"))
    hard = int(_f(r.run, "n_errors") + _f(r.run, "n_cand_nonfinite"))
    possible = hard
    sure_steps = 1 if hard else 0
    run_wide = {stat for (layer, stat) in r.hists if layer == RUN_WIDE}
    explained_all = sum(a["n_base_nonfinite"] for a in per_layer.values())
    for (layer, stat), h in r.hists.items():
        name, per_octave = (stat[:-len(OCTAVE_SUFFIX)], 1) if stat.endswith(OCTAVE_SUFFIX) else (stat, 4)
        if name in thresholds:
            sure, maybe = count_above(h, thresholds[name], per_octave)
        elif name == "oracle_ratio":
            sure, _ = count_above(h, max(p.oracle_k, 1.0), per_octave)
            _, maybe = count_above(h, min(p.oracle_k, 1.0), per_octave)
        else:
            continue
        if layer == RUN_WIDE:
            possible += maybe
            if num_layers > 0:
                per_step = calls_per_step * num_layers
                sure_steps = max(sure_steps, math.ceil(max(0.0, sure - explained_all) / per_step))
            continue
        if name not in run_wide:
            possible += maybe
        explained = per_layer[layer]["n_base_nonfinite"] if layer in per_layer else 0.0
        sure_steps = max(sure_steps, math.ceil(max(0.0, sure - explained) / calls_per_step))
    n = r.steps.total
    return min(sure_steps, n), min(possible, n)


def exceedance(r: RunRollups, p: Policy) -> Criterion:
    """Rate of exceeding verify steps against the target, with exact one-sided binomial bounds."""
    n = r.steps.total
    exact = r.steps.policy_hash == p.hash()
    if exact:
        k_lo = k_hi = r.steps.exceeded
    else:
        k_lo, k_hi = _hist_bound(r, p)
    lo = lower_bound(k_lo, n, p.confidence)
    hi = upper_bound(k_hi, n, p.confidence)
    layers = sorted({int(c["layer"]) for c in r.cells if _f(c, "n_exceed")}) if exact else []
    buckets = sorted({bucket_label(c) for c in r.cells if _f(c, "n_exceed")}) if exact else []
    rate = k_hi / n if n else float("nan")
    observed = {"steps": n, "exceeding_steps": k_hi, "rate": rate, "lower": lo, "upper": hi}
    if not exact:
        observed["exceeding_steps_lower"] = k_lo
    how = "exact count" if exact else "conservative bound from histograms (policy changed since ingest)"
    conf = f"{p.confidence:.4g}"
    if n == 0:
        status, detail = INSUFFICIENT, "no verify steps yet"
    elif clearly_below(hi, p.target_rate):
        status = PASS
        detail = f"{k_hi}/{n} steps exceed; upper bound {hi:.3g} < target {p.target_rate:.3g} at {conf}"
    elif clearly_above(lo, p.target_rate):
        status = FAIL
        detail = f"{k_lo}/{n} steps exceed; lower bound {lo:.3g} > target {p.target_rate:.3g} at {conf}"
    else:
        more = max(0, steps_needed(k_hi, p.target_rate, p.confidence) - n)
        status = INSUFFICIENT
        detail = (f"{k_hi}/{n} steps exceed; bounds [{lo:.3g}, {hi:.3g}] contain target {p.target_rate:.3g} "
                  f"at {conf}; about {more} more exceed-free steps needed ({how})")
        observed["more_steps_needed"] = more
    if status in (PASS, FAIL):
        detail = f"{detail} ({how})"
    threshold = {"target_rate": p.target_rate, "confidence": p.confidence}
    return Criterion("exceedance", status, observed, threshold, detail, layers, buckets,
                     conservative=not exact)


# ---- volume and coverage -----------------------------------------------------------------------
def requests(r: RunRollups, p: Policy) -> Criterion:
    n = int(_f(r.run, "n_requests"))
    ok = n >= p.min_requests
    return Criterion("requests", PASS if ok else INSUFFICIENT, n, p.min_requests,
                     f"{n} distinct requests seen (need {p.min_requests})")


def time_span(r: RunRollups, p: Policy) -> Criterion:
    """The time compared samples cover: the time buckets (rollup_time, ``time_bucket_s`` wide) that hold any,
    each counting its width (a gap between two counts at most one width), and never more than first-to-last
    sample time. One sample far from the rest (a clock behind, a stray batch) adds at most one bucket width,
    where first-to-last alone would count the whole distance; a pause in traffic counts nothing."""
    starts = sorted({float(s["t"]) for s in r.slots if _f(s, "n") > 0})
    width = float(r.time_bucket_s)
    covered = sum(min(width, b - a) for a, b in itertools.pairwise(starts)) + (width if starts else 0.0)
    first, last = r.run.get("first_sample_ts"), r.run.get("last_sample_ts")
    first_to_last = float(last - first) if first is not None and last is not None else 0.0
    span = min(covered, first_to_last)
    ok = span >= p.min_span_s
    detail = f"samples span {_seconds(span, p.min_span_s)} s (need {p.min_span_s:g} s)"
    if covered < first_to_last:
        detail += (f": the {len(starts)} time buckets of {width:g} s that hold samples; first to last sample "
                   f"{first_to_last:.0f} s")
    return Criterion("time_span", PASS if ok else INSUFFICIENT, span, p.min_span_s, detail,
                     extra={"covered_s": covered, "first_to_last_s": first_to_last})


def _seconds(value: float, bound: float) -> str:
    # whole seconds, unless rounding would show a shortfall as reaching the bound ("20 s (need 20 s)")
    text = f"{value:.0f}"
    return f"{math.floor(value * 10) / 10:.1f}" if value < bound and float(text) >= bound else text


#: a shape bucket's key in the rollup cells
_BUCKET_KEY = ("bs_bucket", "t_bucket", "prefix_bucket", "heads")


def _declared_layers(r: RunRollups) -> list[int]:
    # every declared layer and every layer seen
    return sorted(set(range(int(_f(r.run, "num_layers")))) | {int(c["layer"]) for c in r.cells})


def _bucket_floors(r: RunRollups, layers: list[int]) -> dict[tuple[int, ...], float]:
    # per shape bucket seen (compared calls), its fewest compared calls in any of ``layers`` (one that never ran in
    # it counts 0)
    by_bucket: dict[tuple[int, ...], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for c in r.cells:
        if _f(c, "n") > 0:
            by_bucket[tuple(int(c[k]) for k in _BUCKET_KEY)][int(c["layer"])] += _f(c, "n")
    return {b: min(by_layer.get(lay, 0.0) for lay in layers) for b, by_layer in by_bucket.items()}


def covered_shapes(r: RunRollups, p: Policy) -> list[list[int]]:
    """The shapes a verdict speaks for: ``[batch bucket, tree bucket, prefix bucket]`` of every shape bucket with at
    least ``min_cell_samples`` compared calls in every declared layer (what :func:`coverage` requires of every bucket
    seen), sorted; buckets that differ only in heads count once. On mode serves the candidate on these shapes
    only, once a promotion gate opened on this verdict (``shadowd.hook.coverage``)."""
    floors = _bucket_floors(r, _declared_layers(r))
    need = max(p.min_cell_samples, 1)
    return [list(k) for k in sorted({(bs, t, pb) for (bs, t, pb, _h), n in floors.items() if n >= need})]


def coverage(r: RunRollups, p: Policy) -> Criterion:
    """Every declared layer and every shape bucket seen has at least ``min_cell_samples`` samples, and so has
    every TP rank of the run in every layer (:func:`shadowd.judge.ranks.rank_gaps`).

    A bucket's count is its fewest calls in any layer (a layer that never ran in it counts 0): with samples
    lost for some layers, a bucket seen by one layer alone is not covered (it was, as calls per layer seen).
    """
    need = p.min_cell_samples
    per_layer = fold_layers(r.cells)
    layers = _declared_layers(r)
    short_layers = [lay for lay in layers if per_layer.get(lay, {}).get("n", 0.0) < need]
    per_bucket = {bucket_label(dict(zip(_BUCKET_KEY, key, strict=True))): n
                  for key, n in _bucket_floors(r, layers).items()}
    short_buckets = sorted(b for b, n in per_bucket.items() if n < need)
    empty = [lay for lay in short_layers if per_layer.get(lay, {}).get("n", 0.0) == 0]
    least_layer = min((per_layer.get(lay, {}).get("n", 0.0) for lay in layers), default=0.0)
    least_bucket = min(per_bucket.values(), default=0.0)
    rank_parts, rank_observed = rank_gaps(r, need)
    observed = {"layers": len(layers), "min_layer_samples": least_layer, "buckets": len(per_bucket),
                "min_bucket_samples": least_bucket, "empty_layers": len(empty), **rank_observed}
    if short_layers or short_buckets or not layers or rank_parts:
        parts = []
        if short_layers:
            parts.append(f"{len(short_layers)} of {len(layers)} layers below {need} samples "
                         f"({len(empty)} empty)")
        if short_buckets:
            parts.append(f"{len(short_buckets)} of {len(per_bucket)} shape buckets below {need} samples "
                         "per layer")
        if not layers:
            parts.append("the run declares no layers and none were seen")
        parts += rank_parts
        detail = "; ".join(parts)
        return Criterion("coverage", INSUFFICIENT, observed, need, detail, short_layers, short_buckets)
    ranks = int(rank_observed["ranks"])
    return Criterion("coverage", PASS, observed, need,
                     f"all {len(layers)} layers and {len(per_bucket)} shape buckets have ≥ {need} samples, "
                     f"in every layer on {'each of the ' + str(ranks) + ' ranks' if ranks > 1 else 'the one rank'}")

"""Drift: the run's recent window against its own earlier history (a pure function of the rollups and the policy).

A candidate that is equal enough on average can still be getting worse — a cache filling up, longer prefixes
arriving, a scale drifting. :func:`drift` compares the recent window's mean statistics with the history before it,
overall and per layer, and the recent window's own exceedance rate with the target.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from shadowd.judge.criteria import TOL_STATS, fold_layers, mean_of, not_le
from shadowd.judge.inputs import RunRollups
from shadowd.judge.policy import Policy
from shadowd.judge.report import FAIL, INSUFFICIENT, PASS, Criterion
from shadowd.judge.stats import clearly_above, lower_bound

__all__ = ["DRIFT_FLOOR", "drift"]

#: drift ignores recent-vs-history differences below this fraction of the tolerance (noise floor)
DRIFT_FLOOR = 0.01


# ---- drift -------------------------------------------------------------------------------------
def _drift_check(recent: dict[str, float], hist: dict[str, float], p: Policy) -> list[str]:
    """Statistics whose recent mean is worse than history × ratio (+ a noise floor).

    The cosine difference is a squared error (≈ rel-L2² / 2), so it is held to ratio².
    """
    worse = []
    for name, col, tol in TOL_STATS:
        rm, hm = mean_of(recent[col], recent["n"]), mean_of(hist[col], hist["n"])
        ratio = p.drift_ratio**2 if name == "cos_diff" else p.drift_ratio
        if not_le(rm, ratio * hm + DRIFT_FLOOR * p.tol(tol)):
            worse.append(name)
    return worse


def drift(r: RunRollups, p: Policy) -> Criterion:
    """The recent window (``drift_window_s`` before :attr:`RunRollups.recent_end`: the evaluation, or the newest
    sample of a run whose traffic stopped) vs the run's earlier history.

    Judged overall and per layer where both sides hold ``drift_min_samples``; also fails when
    the recent window's own exceedance rate is above the target with confidence. Too few samples on
    either side overall is insufficient data. The window never ends after the collector's clock, so no
    producer's clock moves it there.
    """
    cut = r.recent_end - p.drift_window_s
    recent_rows = [s for s in r.slots if float(s["t"]) >= cut]
    hist_rows = [s for s in r.slots if float(s["t"]) < cut]
    rl, hl = fold_layers(recent_rows), fold_layers(hist_rows)
    tot_r: dict[str, float] = defaultdict(float)
    tot_h: dict[str, float] = defaultdict(float)
    for a, tot in ((rl, tot_r), (hl, tot_h)):
        for row in a.values():
            for k, v in row.items():
                tot[k] += v
    need = p.drift_min_samples
    ratios = {name: mean_of(mean_of(tot_r[col], tot_r["n"]), mean_of(tot_h[col], tot_h["n"]))
              for name, col, _ in TOL_STATS}
    observed: dict[str, Any] = {"recent_samples": tot_r["n"], "history_samples": tot_h["n"],
                                **{f"{k}_ratio": v for k, v in ratios.items()}}
    problems: list[str] = []
    bad_layers: list[int] = []
    judged = tot_r["n"] >= need and tot_h["n"] >= need
    if judged:
        worse = _drift_check(tot_r, tot_h, p)
        if worse:
            problems.append("recent mean " + ", ".join(f"{w} is {ratios[w]:.3g}× history" for w in worse)
                            + f" (limit {p.drift_ratio:g}×)")
        for lay in sorted(set(rl) & set(hl)):
            if rl[lay]["n"] >= need and hl[lay]["n"] >= need and _drift_check(rl[lay], hl[lay], p):
                bad_layers.append(lay)
        if bad_layers and not worse:
            problems.append(f"{len(bad_layers)} layers' recent mean error above {p.drift_ratio:g}× "
                            "their history")
    if r.steps.policy_hash == p.hash() and r.steps.recent_total:
        lo = lower_bound(r.steps.recent_exceeded, r.steps.recent_total, p.confidence)
        observed["recent_exceedance_lower"] = lo
        if clearly_above(lo, p.target_rate):
            problems.append(f"recent window: {r.steps.recent_exceeded}/{r.steps.recent_total} steps exceed, "
                            f"lower bound {lo:.3g} > target {p.target_rate:.3g}")
    threshold = {"ratio": p.drift_ratio, "window_s": p.drift_window_s, "min_samples": need}
    if problems:
        return Criterion("drift", FAIL, observed, threshold, "; ".join(problems), bad_layers, extra={"judged": judged})
    if not judged:
        detail = (f"not enough samples to judge drift: {tot_r['n']:.0f} in the last {p.drift_window_s:g} s, "
                  f"{tot_h['n']:.0f} before (need {need} each)")
        return Criterion("drift", INSUFFICIENT, observed, threshold, detail, extra={"judged": judged})
    return Criterion("drift", PASS, observed, threshold, "recent window within the ratio of history",
                     extra={"judged": judged})

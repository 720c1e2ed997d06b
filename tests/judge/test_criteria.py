"""Unit tests of the judge on constructed rollups: each criterion on both sides of its threshold."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from shadowd.judge.bins import stat_bins
from shadowd.judge.inputs import StepCounts
from shadowd.judge.policy import Policy, PolicyError, load_policy
from shadowd.judge.stats import clearly_below, lower_bound, steps_needed, upper_bound
from shadowd.judge.verdict import INSUFFICIENT_DATA, NOT_READY, READY, judge
from tests.judge.builders import SMALL, T0, cell, criterion, rank_row, rollups, statuses


def test_baseline_is_ready() -> None:
    rep = judge(rollups(), SMALL)
    assert rep["verdict"] == READY and rep["reasons"] == []
    assert all(c["passed"] for c in rep["criteria"])
    json.dumps(rep, allow_nan=False)


def test_no_samples_is_insufficient() -> None:
    rep = judge(rollups(cells=[], steps=0, requests=0, span=0.0), SMALL)
    assert rep["verdict"] == INSUFFICIENT_DATA
    assert statuses(rep)["exceedance"] == "insufficient"
    assert criterion(rep, "coverage")["layers"] == [0, 1]


# ---- hard failures -------------------------------------------------------------------------------
def test_candidate_nonfinite_is_not_ready() -> None:
    cells = [cell(0, 1000), cell(1, 1000, n_cand_nonfinite=1)]
    rep = judge(rollups(cells=cells), SMALL)
    assert rep["verdict"] == NOT_READY
    hard = criterion(rep, "hard_failures")
    assert hard["status"] == "fail" and hard["layers"] == [1]
    assert any(r.startswith("hard_failures") for r in rep["reasons"])


def test_candidate_error_is_not_ready() -> None:
    rep = judge(rollups(cells=[cell(0, 1000, n_error=2), cell(1, 1000)]), SMALL)
    assert rep["verdict"] == NOT_READY
    assert criterion(rep, "hard_failures")["observed"]["errors"] == 2


def test_candidate_errors_are_named_by_kind_most_frequent_first() -> None:
    kinds = {"exception:RuntimeError": 3, "candidate_flag:0x1": 9, "shape": 1, "dtype": 1, "input_modified": 1}
    r = dataclasses.replace(rollups(cells=[cell(0, 1000, n_error=15), cell(1, 1000)]), errors=kinds)
    detail = criterion(judge(r, SMALL), "hard_failures")["detail"]
    assert detail.endswith(": candidate_flag:0x1 ×9, exception:RuntimeError ×3, dtype ×1, 2 more kinds"), detail
    plain = criterion(judge(rollups(cells=[cell(0, 1000, n_error=2), cell(1, 1000)]), SMALL), "hard_failures")
    assert "×" not in plain["detail"], "no kinds stored (an older collector's rollups): the count alone"


def test_baseline_only_nonfinite_is_reported_not_held_against_candidate() -> None:
    cells = [cell(0, 1000, n_base_nonfinite=3, n_nan_stat=3), cell(1, 1000)]
    rep = judge(rollups(cells=cells), SMALL)
    assert rep["verdict"] == READY
    ev = criterion(rep, "baseline_events")
    assert ev["observed"] == 3 and ev["layers"] == [0] and ev["informational"]


def test_a_producer_that_gave_up_on_the_candidate_is_not_ready() -> None:
    clean = {"rank": 0, "producer": "a", "disabled": 0, "fallback": 0, "disabled_reason": None,
             "fallback_reason": None, "first_seen": T0}
    assert judge(dataclasses.replace(rollups(), producers=[clean]), SMALL)["verdict"] == READY
    gave_up = {**clean, "rank": 3, "producer": "b", "disabled": 1, "disabled_reason": "candidate_flag:0x1",
               "first_seen": T0 + 1}
    rep = judge(dataclasses.replace(rollups(), producers=[clean, gave_up]), SMALL)
    assert rep["verdict"] == NOT_READY
    assert rep["reasons"][0] == "producers: FAIL: rank 3 (producer b): candidate disabled: candidate_flag:0x1"


def test_a_pipeline_stage_that_gave_up_is_named_by_stage_and_rank() -> None:
    # --pp-size 2 --tp 1: both stages report as rank 0; the reason must say which stage's process gave up
    base = {"rank": 0, "disabled": 0, "fallback": 0, "disabled_reason": None, "fallback_reason": None}
    stage0 = {**base, "stage": 0, "producer": "a", "first_seen": T0}
    stage1 = {**base, "stage": 1, "producer": "b", "fallback": 1, "fallback_reason": "spot check: rel_l2 0.3",
              "first_seen": T0 - 1}
    rep = judge(dataclasses.replace(rollups(), producers=[stage1, stage0]), SMALL)
    assert rep["verdict"] == NOT_READY
    assert rep["reasons"][0] == ("producers: FAIL: stage 1 rank 0 (producer b): on mode fell back to the baseline: "
                                 "spot check: rel_l2 0.3")
    assert criterion(rep, "producers")["flagged"] == [{"stage": 1, "rank": 0, "producer": "b",
                                                       "disabled_reason": None,
                                                       "fallback_reason": "spot check: rel_l2 0.3"}]


# ---- tolerance -----------------------------------------------------------------------------------
def test_tolerance_exactly_at_threshold_passes() -> None:
    tol = SMALL.tol("rel_l2_max")
    c0 = cell(0, 1000, sum_rel_l2=1000 * tol)
    rep = judge(rollups(cells=[c0, cell(1, 1000)]), SMALL)
    assert criterion(rep, "tolerance")["status"] == "pass"


def test_tolerance_just_above_fails_naming_layer_and_bucket() -> None:
    tol = SMALL.tol("rel_l2_max")
    c1 = cell(1, 1000, sum_rel_l2=1000 * tol * 1.01, bucket=(16, 8, 14, 8))
    rep = judge(rollups(cells=[cell(0, 1000), c1]), SMALL)
    t = criterion(rep, "tolerance")
    assert rep["verdict"] == NOT_READY and t["status"] == "fail"
    assert t["layers"] == [1] and t["buckets"] == ["bs16-t8-p14-h8"]
    assert rep["failing_layers"] == [1]


@pytest.mark.parametrize("col", ["sum_rel_l2", "sum_cos_diff", "sum_scaled"])
def test_nan_statistic_is_a_failure_never_a_pass(col: str) -> None:
    rep = judge(rollups(cells=[cell(0, 1000, **{col: float("nan")}), cell(1, 1000)]), SMALL)
    assert rep["verdict"] == NOT_READY
    assert criterion(rep, "tolerance")["status"] == "fail"
    json.dumps(rep, allow_nan=False)  # NaN is spelled out, the JSON stays valid


def test_unexplained_nan_statistics_fail() -> None:
    rep = judge(rollups(cells=[cell(0, 1000, n_nan_stat=1, n_nan_unexplained=1), cell(1, 1000)]), SMALL)
    assert criterion(rep, "tolerance")["status"] == "fail"
    assert rep["verdict"] == NOT_READY
    # a baseline event of another call in the same cell does not explain it away (it was 1 - 1 = 0: READY)
    hidden = cell(0, 1000, n_nan_stat=1, n_base_nonfinite=1, n_nan_unexplained=1)
    rep = judge(rollups(cells=[hidden, cell(1, 1000)]), SMALL)
    assert criterion(rep, "tolerance")["status"] == "fail" and rep["verdict"] == NOT_READY


def test_policy_exceeds_nan_is_exceeding_unless_baseline_event() -> None:
    nan = float("nan")
    cols = {"rel_l2": np.array([nan, nan, 1e-3, 0.5]), "cos_diff": np.array([1e-6, 1e-6, 1e-6, 1e-6]),
            "max_abs": np.array([1e-3] * 4), "out_scale": np.ones(4), "cand_nonfinite": np.zeros(4),
            "base_nonfinite": np.array([0, 5, 0, 5]), "error_flag": np.zeros(4, dtype=bool)}
    assert Policy().exceeds(cols).tolist() == [True, False, False, True]


# ---- oracle ----------------------------------------------------------------------------------------
def _with_oracle(ratio: float, policy: Policy = SMALL) -> dict:
    r = rollups()
    hist = {int(b): 100 for b in stat_bins(np.array([ratio]))}
    return judge(dataclasses.replace(r, hists={(0, "oracle_ratio"): hist}), policy)


def test_oracle_rule_both_sides() -> None:
    assert criterion(_with_oracle(1.0), "oracle")["status"] == "pass"
    rep = _with_oracle(4.0)
    assert criterion(rep, "oracle")["status"] == "fail" and rep["verdict"] == NOT_READY
    assert criterion(judge(rollups(), SMALL), "oracle")["status"] == "pass"  # no oracle samples
    # the detail names the ratio, the limit and (failing) the layers, as the readiness evidence line shows it
    ok, bad = criterion(_with_oracle(1.0), "oracle")["detail"], criterion(rep, "oracle")["detail"]
    assert "candidate/baseline oracle-error ratio ≤" in ok and "every sampled layer" in ok and "limit k=" in ok, ok
    assert "above the limit k=" in bad and "layers [0]" in bad and "worst ≤" in bad, bad


# ---- exceedance ----------------------------------------------------------------------------------
def test_zero_exceedances_but_too_few_steps_is_insufficient() -> None:
    need = steps_needed(0, SMALL.target_rate, SMALL.confidence)
    rep = judge(rollups(steps=need - 1), SMALL)
    ex = criterion(rep, "exceedance")
    assert rep["verdict"] == INSUFFICIENT_DATA and ex["status"] == "insufficient"
    assert ex["observed"]["more_steps_needed"] == 1
    assert criterion(judge(rollups(steps=need), SMALL), "exceedance")["status"] == "pass"


def test_upper_bound_exactly_at_target_is_not_ready_eligible() -> None:
    n = 500
    policy = SMALL.model_copy(update={"target_rate": upper_bound(0, n, SMALL.confidence)})
    assert criterion(judge(rollups(steps=n, policy=policy), policy), "exceedance")["status"] == "insufficient"


def test_a_bound_equal_to_the_target_but_for_rounding_decides_nothing() -> None:
    # one step, exceeding, at 0.99 / 0.01: the lower bound is (1 - 0.99)^1 = 0.01 exactly, which binary floats
    # hold as 0.010000000000000009 — above the target by rounding only, so not a failure
    policy = SMALL.model_copy(update={"confidence": 0.99, "target_rate": 0.01})
    assert lower_bound(1, 1, 0.99) > 0.01  # the rounding the judge must not act on
    ex = criterion(judge(rollups(steps=1, exceeded=1, policy=policy), policy), "exceedance")
    assert ex["status"] == "insufficient", ex["detail"]
    # two steps, both exceeding: 0.1 is clearly above 0.01
    assert criterion(judge(rollups(steps=2, exceeded=2, policy=policy), policy), "exceedance")["status"] == "fail"
    # the count of steps still needed agrees with the decision at its edge
    assert clearly_below(upper_bound(0, steps_needed(0, 0.01, 0.99), 0.99), 0.01)
    assert not clearly_below(upper_bound(0, steps_needed(0, 0.01, 0.99) - 1, 0.99), 0.01)
    # exactly the smallest such count also where the zero-exceedance bound's closed form loses digits
    for target in (1e-9, 1.12e-8, 3e-7):
        n = steps_needed(0, target, 0.99)
        assert clearly_below(upper_bound(0, n, 0.99), target)
        assert not clearly_below(upper_bound(0, n - 1, 0.99), target), target


def test_lower_bound_above_target_is_not_ready() -> None:
    rep = judge(rollups(steps=2000, exceeded=60), SMALL)  # 3 % ≫ 1 %
    ex = criterion(rep, "exceedance")
    assert rep["verdict"] == NOT_READY and ex["status"] == "fail"
    assert any(r.startswith("exceedance: FAIL") for r in rep["reasons"])


def test_interval_containing_target_is_insufficient() -> None:
    rep = judge(rollups(steps=1000, exceeded=10), SMALL)  # 1 % observed, target 1 %
    assert criterion(rep, "exceedance")["status"] == "insufficient"


def test_clopper_pearson_bounds() -> None:
    assert steps_needed(0, 1e-4, 0.99) == 46050
    assert upper_bound(0, 46050, 0.99) < 1e-4 <= upper_bound(0, 46049, 0.99)
    assert math.isclose(upper_bound(0, 100, 0.9), 1 - 0.1 ** (1 / 100))
    assert lower_bound(0, 100, 0.99) == 0.0
    assert lower_bound(5, 100, 0.99) < 0.05 < upper_bound(5, 100, 0.99)
    k = 7
    assert upper_bound(k, steps_needed(k, 0.01, 0.99), 0.99) < 0.01 <= upper_bound(k, steps_needed(k, 0.01, 0.99) - 1,
                                                                                    0.99)


def test_policy_change_uses_conservative_histogram_bound() -> None:
    r = rollups(steps=2000, policy_hash="other")
    low = {int(stat_bins(np.array([1e-3]))[0]): 2000}
    r = dataclasses.replace(r, hists={(0, "rel_l2"): low, (0, "cos_diff"): {int(stat_bins(np.array([1e-7]))[0]): 2000},
                                      (0, "scaled"): low})
    ex = criterion(judge(r, SMALL), "exceedance")
    assert ex["conservative"] and ex["status"] == "pass"
    high = {int(stat_bins(np.array([0.5]))[0]): 200, **low}
    r2 = dataclasses.replace(r, hists={**r.hists, (0, "rel_l2"): high})
    ex2 = criterion(judge(r2, SMALL), "exceedance")
    assert ex2["conservative"] and ex2["status"] == "fail"


# ---- volume, span, coverage --------------------------------------------------------------------
def test_requests_and_span_both_sides() -> None:
    assert statuses(judge(rollups(requests=10), SMALL))["requests"] == "pass"
    assert statuses(judge(rollups(requests=9), SMALL))["requests"] == "insufficient"
    assert statuses(judge(rollups(span=60.0), SMALL))["time_span"] == "pass"
    rep = judge(rollups(span=59.0), SMALL)
    assert statuses(rep)["time_span"] == "insufficient" and rep["verdict"] == INSUFFICIENT_DATA
    # a shortfall is never rounded up to the bound it misses
    assert "samples span 59.9 s (need 60 s)" in criterion(judge(rollups(span=59.97), SMALL), "time_span")["detail"]


def test_one_early_outlier_does_not_make_the_time_span() -> None:
    """The span is the time the buckets holding samples cover (at most first to last sample): a sample an
    hour early adds one bucket width, not an hour."""
    policy = SMALL.model_copy(update={"min_span_s": 600.0})
    r = rollups(span=200.0, now=T0 + 205)  # 200 s of traffic, in 60 s buckets
    r = dataclasses.replace(r, slots=[{**r.slots[0], "t": T0 + k * 60} for k in range(4)])
    assert criterion(judge(r, policy), "time_span")["observed"] == 200.0
    early = dataclasses.replace(r, run={**r.run, "first_sample_ts": T0 - 3600},
                                slots=[*r.slots, {**r.slots[0], "t": T0 - 3600, "n": 1}])
    span = criterion(judge(early, policy), "time_span")
    assert span["status"] == "insufficient" and span["observed"] == 300.0 and span["first_to_last_s"] == 3800.0
    assert span["detail"] == ("samples span 300 s (need 600 s): the 5 time buckets of 60 s that hold samples; "
                              "first to last sample 3800 s")


def test_empty_layer_is_insufficient_and_named() -> None:
    rep = judge(rollups(num_layers=3, cells=[cell(0, 1000), cell(1, 1000)]), SMALL)
    cov = criterion(rep, "coverage")
    assert rep["verdict"] == INSUFFICIENT_DATA and cov["layers"] == [2]
    assert cov["observed"]["empty_layers"] == 1


def test_short_bucket_is_named() -> None:
    cells = [cell(0, 1000), cell(1, 1000), cell(0, 9, bucket=(64, 16, 17, 8)), cell(1, 9, bucket=(64, 16, 17, 8))]
    cov = criterion(judge(rollups(cells=cells), SMALL), "coverage")
    assert cov["status"] == "insufficient" and cov["buckets"] == ["bs64-t16-p17-h8"]
    cells[2]["n"] = cells[3]["n"] = 10
    assert criterion(judge(rollups(cells=cells), SMALL), "coverage")["status"] == "pass"
    # a bucket one layer alone saw (samples lost for the other) is not covered, however many calls it has
    lone = [cell(0, 1000), cell(1, 1000), cell(0, 500, bucket=(64, 16, 17, 8))]
    cov = criterion(judge(rollups(cells=lone), SMALL), "coverage")
    assert cov["status"] == "insufficient" and cov["buckets"] == ["bs64-t16-p17-h8"], cov


def test_the_report_names_the_shapes_it_speaks_for() -> None:
    """``covered_shapes``: [batch, tree, prefix] bucket of every bucket with min_cell_samples in every layer — what
    an opening promotion gate lets on mode serve the candidate on — once per shape whatever the heads."""
    cells = [cell(0, 1000), cell(1, 1000), cell(0, 10, bucket=(64, 16, 17, 8)), cell(1, 10, bucket=(64, 16, 17, 8)),
             cell(0, 12, bucket=(64, 16, 17, 16)), cell(1, 12, bucket=(64, 16, 17, 16))]
    rep = judge(rollups(cells=cells), SMALL)
    assert rep["verdict"] == READY and rep["covered_shapes"] == [[4, 8, 13], [64, 16, 17]]
    short = [*cells, cell(0, 9, bucket=(1, 256, 18, 8)), cell(1, 9, bucket=(1, 256, 18, 8)),
             cell(0, 500, bucket=(2, 2, 3, 8))]  # below min_cell_samples; one layer alone
    rep = judge(rollups(cells=short), SMALL)
    assert rep["verdict"] == INSUFFICIENT_DATA and rep["covered_shapes"] == [[4, 8, 13], [64, 16, 17]]
    assert judge(rollups(cells=[]), SMALL)["covered_shapes"] == []


def test_every_tp_rank_needs_compared_samples_in_every_layer() -> None:
    full = [rank_row(k, lay, 500) for k in (0, 1) for lay in (0, 1)]
    rep = judge(rollups(tp_size=4, ranks=full), SMALL)
    cov = criterion(rep, "coverage")
    assert rep["verdict"] == INSUFFICIENT_DATA and cov["status"] == "insufficient"
    assert cov["detail"] == "rank 2, 3: no samples" and cov["observed"]["ranks_without_samples"] == [2, 3]
    assert "coverage: NEED MORE DATA: rank 2, 3: no samples" in rep["reasons"]
    # a rank whose calls all compared nothing, and one short in a layer, are named too
    rows = [*full, rank_row(2, 0, 0, n_empty=40), rank_row(3, 0, 500), rank_row(3, 1, 9)]
    cov = criterion(judge(rollups(tp_size=4, ranks=rows), SMALL), "coverage")
    assert cov["detail"] == ("rank 2: no compared samples (40 compared nothing: numel 0); "
                             "rank 3: 1 of 2 layers below 10 compared samples (layers 1)")
    rows[-1] = rank_row(3, 1, 10)
    rows[-3] = rank_row(2, 0, 10)
    rows.append(rank_row(2, 1, 10))
    assert judge(rollups(tp_size=4, ranks=rows), SMALL)["verdict"] == READY


# ---- drift ---------------------------------------------------------------------------------------
def test_drift_both_sides() -> None:
    assert criterion(judge(rollups(recent_rel=5.9e-3), SMALL), "drift")["status"] == "pass"
    rep = judge(rollups(recent_rel=1e-2), SMALL)  # 3.3× history, still within tolerance
    d = criterion(rep, "drift")
    assert rep["verdict"] == NOT_READY and d["status"] == "fail" and d["layers"] == [0, 1]
    assert statuses(rep)["tolerance"] == "pass"


def test_drift_not_judged_with_too_little_history_is_insufficient() -> None:
    policy = SMALL.model_copy(update={"min_cell_samples": 1})
    rep = judge(rollups(num_layers=1, n_per_layer=30, recent_rel=1e-2), policy)
    d = criterion(rep, "drift")
    assert d["status"] == "insufficient" and not d["judged"] and rep["verdict"] == INSUFFICIENT_DATA
    assert d["detail"] == "not enough samples to judge drift: 15 in the last 100 s, 15 before (need 20 each)"


def test_drift_window_ends_at_the_newest_sample_never_after_the_evaluation() -> None:
    """A run whose traffic stopped (a cutover restarts the server) keeps the verdict of its data: the window ends
    at its newest sample (it turned INSUFFICIENT_DATA a window after the stop, and the cutover alert fired); one
    sample from a clock an hour ahead neither switches drift off nor hides the recent window."""
    live = judge(rollups(), SMALL)
    stopped = judge(rollups(now=T0 + 600 + 3600), SMALL)  # the last sample an hour before the evaluation
    assert criterion(stopped, "drift")["status"] == criterion(live, "drift")["status"] == "pass"
    assert stopped["verdict"] == live["verdict"]
    assert criterion(stopped, "drift")["observed"]["recent_samples"] > 0
    r = rollups(recent_rel=1e-2)  # a drift, and one sample stamped an hour ahead of the collector
    ahead = dataclasses.replace(r, run={**r.run, "last_sample_ts": r.now + 3600},
                                slots=[*r.slots, {**r.slots[0], "t": r.now + 3600, "n": 1}])
    rep = judge(ahead, SMALL)
    assert criterion(rep, "drift")["status"] == "fail" and rep["verdict"] == NOT_READY


def test_recent_window_exceedance_turns_verdict() -> None:
    r = rollups(steps=20000, exceeded=60)
    r = dataclasses.replace(r, steps=StepCounts(20000, 60, SMALL.hash(), recent_total=1000, recent_exceeded=60))
    rep = judge(r, SMALL)
    assert criterion(rep, "exceedance")["status"] == "pass"
    assert criterion(rep, "drift")["status"] == "fail" and rep["verdict"] == NOT_READY


# ---- hysteresis and fingerprint ------------------------------------------------------------------
HYST = SMALL.model_copy(update={"hysteresis_k": 3, "hysteresis_minutes": 1.0})


def _ev(at: float, passing: bool = True, fp: str = "fp-1", policy: Policy = HYST) -> dict:
    return {"at": at, "passing": passing, "candidate_fingerprint": fp, "policy_hash": policy.identity(),
            "verdict": INSUFFICIENT_DATA}


def test_hysteresis_needs_k_evaluations_over_m_minutes() -> None:
    now = T0 + 605  # 5 s after the last sample (rollups(span=600))
    assert judge(rollups(policy=HYST, now=now, history=[_ev(now - 60), _ev(now - 30)]), HYST)["verdict"] == READY
    rep = judge(rollups(policy=HYST, now=now, history=[_ev(now - 59), _ev(now - 30)]), HYST)
    assert rep["verdict"] == INSUFFICIENT_DATA and criterion(rep, "hysteresis")["status"] == "insufficient"
    assert judge(rollups(policy=HYST, now=now, history=[_ev(now - 120)]), HYST)["verdict"] == INSUFFICIENT_DATA
    broken = [_ev(now - 120), _ev(now - 90), _ev(now - 60, passing=False), _ev(now - 30)]
    assert judge(rollups(policy=HYST, now=now, history=broken), HYST)["verdict"] == INSUFFICIENT_DATA


def test_new_fingerprint_starts_from_nothing() -> None:
    now = T0 + 605  # 5 s after the last sample (rollups(span=600))
    old = [_ev(now - 300 + 30 * i, fp="fp-old") for i in range(10)]
    rep = judge(rollups(policy=HYST, now=now, history=old, fingerprint="fp-new"), HYST)
    assert rep["verdict"] == INSUFFICIENT_DATA
    assert rep["hysteresis"]["streak"] == 1 and rep["hysteresis"]["other_fingerprints_ignored"] == 10
    assert rep["candidate_fingerprint"] == "fp-new"


def test_stored_streak_is_continued() -> None:
    now = T0 + 605  # 5 s after the last sample (rollups(span=600))
    prev = {**_ev(now - 15), "hysteresis": {"streak": 5, "since": now - 600}}
    rep = judge(rollups(policy=HYST, now=now, history=[prev]), HYST)
    assert rep["verdict"] == READY and rep["hysteresis"]["streak"] == 6


def test_unchanged_data_holds_the_streak() -> None:
    """An evaluation that judged no new samples neither advances the streak nor stretches its span."""
    now = T0 + 605  # 5 s after the last sample (rollups(span=600))
    r = rollups(policy=HYST, now=now)
    judged = int(sum(c["n"] for c in r.cells))
    prev = {**_ev(now - 120), "hysteresis": {"streak": 2, "since": now - 150, "advanced_at": now - 120,
                                             "evidence": judged}}
    rep = judge(dataclasses.replace(r, history=[prev]), HYST)
    h = rep["hysteresis"]
    assert rep["verdict"] == INSUFFICIENT_DATA and h["streak"] == 2 and h["span_s"] == 30 and not h["new_samples"]
    assert "no new samples since the previous evaluation" in criterion(rep, "hysteresis")["detail"]
    more = dataclasses.replace(r, history=[{**prev, "hysteresis": {**prev["hysteresis"], "evidence": judged - 1}}])
    assert judge(more, HYST)["verdict"] == READY  # new samples: 3 evaluations over 150 s
    ready = {**prev, "hysteresis": {"streak": 3, "since": now - 150, "advanced_at": now - 30, "evidence": judged}}
    assert judge(dataclasses.replace(r, history=[ready]), HYST)["verdict"] == READY  # READY holds on unchanged data


def test_streak_earned_under_another_policy_does_not_count() -> None:
    # the same tolerances (so the same per-call exceedance flags) but a looser confidence: its passing
    # evaluations are no evidence for READY under the stricter policy
    now = T0 + 605  # 5 s after the last sample (rollups(span=600))
    looser = HYST.model_copy(update={"confidence": HYST.confidence - 0.05})
    assert looser.hash() == HYST.hash() and looser.identity() != HYST.identity()
    history = [_ev(now - 60, policy=looser), _ev(now - 30, policy=looser)]
    rep = judge(rollups(policy=HYST, now=now, history=history), HYST)
    assert rep["verdict"] == INSUFFICIENT_DATA and rep["hysteresis"]["streak"] == 1
    assert rep["policy_hash"] == HYST.identity() and rep["tolerance_hash"] == HYST.hash()
    assert judge(rollups(policy=HYST, now=now, history=[_ev(now - 60), _ev(now - 30)]), HYST)["verdict"] == READY


def test_failing_evaluation_resets_streak() -> None:
    now = T0 + 605  # 5 s after the last sample (rollups(span=600))
    rep = judge(rollups(policy=HYST, now=now, recent_rel=1e-2, history=[_ev(now - 60), _ev(now - 30)]), HYST)
    assert rep["verdict"] == NOT_READY and rep["hysteresis"]["streak"] == 0 and not rep["passing"]


# ---- policy --------------------------------------------------------------------------------------
def test_policy_file_env_and_demo(tmp_path) -> None:
    f = tmp_path / "p.toml"
    f.write_text('dtype = "fp16"\ntarget_rate = 0.001\n')
    p = load_policy(f, {"SHADOWD_POLICY_MIN_REQUESTS": "7", "SHADOWD_POLICY_FILE": "ignored"})
    assert p.dtype == "fp16" and p.target_rate == 0.001 and p.min_requests == 7
    assert p.tol("rel_l2_max") == 1e-3 and p.hash() != Policy().hash()
    j = tmp_path / "p.json"
    j.write_text('{"confidence": 0.95}')
    assert load_policy(j, {}).confidence == 0.95
    assert load_policy(None, {}) == Policy()
    from importlib import resources

    demo = load_policy(str(resources.files("shadowd") / "policies" / "demo.toml"), {})
    assert demo.confidence == 0.9 and demo.target_rate == 0.05
    assert steps_needed(0, demo.target_rate, demo.confidence) < 100


@pytest.mark.parametrize(("text", "env", "named"), [
    ("rel_l2_max = inf\n", {}, "rel_l2_max"),  # an infinite tolerance turns a check off
    ("min_span_s = nan\n", {}, "min_span_s"),
    ("min_requests = true\n", {}, "min_requests"),  # not read as 1
    ("oracle_k = false\n", {}, "oracle_k"),
    ("", {"SHADOWD_POLICY_COS_DIFF_MAX": "inf"}, "cos_diff_max"),
    ("", {"SHADOWD_POLICY_DRIFT_WINDOW_S": "Infinity"}, "drift_window_s"),
])
def test_a_knob_that_is_no_finite_number_is_refused_by_name(tmp_path, text: str, env: dict[str, str],
                                                           named: str) -> None:
    f = tmp_path / "p.toml"
    f.write_text(text)
    with pytest.raises(PolicyError, match=named):
        load_policy(f, env)


def test_policy_change_bound_from_the_stored_histogram_layout() -> None:
    """The collector keeps run-wide quarter-octave and per-layer octave histograms: the possibly
    exceeding calls are the same as from per-layer quarter-octave ones, the surely exceeding ones a
    valid lower bound, and the verdicts agree with the old layout."""
    from shadowd.collector.batch import parse_batch
    from shadowd.collector.rollups import compute_deltas
    from shadowd.judge.bins import OCTAVE_SUFFIX, RUN_WIDE, octave_of
    from tests.factories import make_batch

    n_layers, n = 2, 4000
    rel = np.full(n, 1e-3)
    rel[::20] = 0.5  # one call in 20 far beyond tolerance, in both layers
    batch = make_batch(n, num_layers=n_layers, rel_l2=1.0)
    batch["samples"]["rel_l2"] = rel.tolist()
    batch["samples"]["cos_diff"] = (rel**2 / 2).tolist()
    batch["samples"]["max_abs"] = (rel / 4).tolist()
    d = compute_deltas(1, parse_batch(batch), SMALL, 60)
    stored: dict[tuple[int, str], dict[int, int]] = {}
    for _, layer, stat, b, count in d.hists.rows:
        stored.setdefault((layer, stat), {})[b] = count
    assert {s for (lay, s) in stored if lay == RUN_WIDE} == {"max_abs", "rel_l2", "cos_diff", "scaled"}
    assert {s for (lay, s) in stored if lay >= 0} == {s + OCTAVE_SUFFIX for s in ("max_abs", "rel_l2", "cos_diff",
                                                                                   "scaled")}
    # the old layout: per-layer quarter-octave, from the same values
    layer = np.arange(n) % n_layers
    old: dict[tuple[int, str], dict[int, int]] = {}
    for stat, values in (("rel_l2", rel), ("cos_diff", rel**2 / 2), ("scaled", rel / 4)):
        for lay, b in zip(layer.tolist(), stat_bins(values).tolist(), strict=True):
            h = old.setdefault((lay, stat), {})
            h[b] = h.get(b, 0) + 1
    # per-layer octave bins are the quarter-octave ones folded by four
    for (lay, stat), h in old.items():
        folded: dict[int, int] = {}
        for b, c in h.items():
            k = int(octave_of(np.array([b]))[0])
            folded[k] = folded.get(k, 0) + c
        assert stored[(lay, stat + OCTAVE_SUFFIX)] == folded
    steps = n // n_layers
    base = rollups(num_layers=n_layers, steps=steps, policy_hash="other", n_per_layer=n // n_layers)
    for policy, want in ((SMALL, "fail"), (SMALL.model_copy(update={"target_rate": 0.5}), "pass")):
        ex_old = criterion(judge(dataclasses.replace(base, hists=old), policy), "exceedance")
        ex_new = criterion(judge(dataclasses.replace(base, hists=stored), policy), "exceedance")
        assert ex_new["conservative"] and ex_old["status"] == ex_new["status"] == want
        assert ex_new["observed"]["exceeding_steps"] == ex_old["observed"]["exceeding_steps"]  # possible: same
        assert 0 < ex_new["observed"]["exceeding_steps_lower"] <= ex_old["observed"]["exceeding_steps_lower"]

"""The readiness judge: one run's rollups and a policy in, a verdict that explains itself out.

``judge`` is a pure function (no HTTP, no database): the collector's evaluator builds the
:class:`~shadowd.judge.inputs.RunRollups` snapshot, calls it on a fixed cadence and stores the
report. Verdicts:

- READY: every criterion passed, and kept passing for K evaluations over M minutes;
- NOT_READY: a criterion failed (hard failure, a producer that disabled its candidate or fell back, tolerance,
  oracle, exceedance rate, drift);
- INSUFFICIENT_DATA: nothing failed, but something still lacks evidence (too few steps for the
  binomial bound, requests, time span, coverage, or the hysteresis streak).
"""

from __future__ import annotations

from typing import Any

from shadowd.judge import criteria as c
from shadowd.judge.drift import drift
from shadowd.judge.hysteresis import hysteresis
from shadowd.judge.inputs import RunRollups
from shadowd.judge.policy import Policy
from shadowd.judge.ranks import producers
from shadowd.judge.report import INSUFFICIENT_DATA, NOT_READY, PASS, READY, Criterion, combine, jsonable

__all__ = ["CRITERIA", "INSUFFICIENT_DATA", "NOT_READY", "READY", "evaluate_criteria", "judge"]

#: the statistical criteria in report order (hysteresis comes last, from the stored history)
CRITERIA = (c.hard_failures, producers, c.tolerance, c.oracle, c.exceedance, c.requests, c.time_span, c.coverage,
            drift, c.baseline_events)


def evaluate_criteria(r: RunRollups, policy: Policy) -> list[Criterion]:
    """Every criterion except hysteresis."""
    return [f(r, policy) for f in CRITERIA]


def judge(r: RunRollups, policy: Policy) -> dict[str, Any]:
    """The full report for ``r`` evaluated at ``r.now`` (JSON-ready)."""
    crits = evaluate_criteria(r, policy)
    raw = combine(crits)
    fingerprint = str(r.run.get("candidate_fingerprint", ""))
    policy_hash = policy.identity()  # every knob: a streak earned under another policy does not count
    evidence = int(sum(float(c.get("n") or 0) for c in r.cells))  # compared samples judged
    hyst, state = hysteresis(raw, r.history, fingerprint, policy_hash, r.now, policy, evidence)
    crits.append(hyst)
    verdict = combine(crits)
    failing = [x for x in crits if x.status != PASS]
    reasons = [x.reason() for x in failing]
    if verdict == INSUFFICIENT_DATA and raw == READY:
        reasons = [hyst.reason()]
    return jsonable({
        "verdict": verdict,
        "raw_verdict": raw,
        "passing": raw == READY,
        "evaluated_at": r.now,
        "run_id": r.run.get("id"),
        "candidate_fingerprint": fingerprint,
        "policy_hash": policy_hash,
        "tolerance_hash": policy.hash(),
        "policy": policy.effective(),
        "reasons": reasons,
        "failing_layers": sorted({lay for x in failing for lay in x.layers}),
        "failing_buckets": sorted({b for x in failing for b in x.buckets}),
        "criteria": [x.to_dict() for x in crits],
        "hysteresis": state,
        # [batch bucket, tree bucket, prefix bucket] of the shapes this verdict speaks for (a promotion gate that
        # opens on it has on mode serve the candidate on these only)
        "covered_shapes": c.covered_shapes(r, policy),
    })

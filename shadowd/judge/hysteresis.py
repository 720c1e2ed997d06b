"""Hysteresis and the candidate fingerprint: READY only after K consecutive passing evaluations
spanning at least M minutes, all of the same candidate build and the same policy.

Evaluations run on a fixed cadence inside the collector and are stored; each stored
evaluation carries its streak (``hysteresis.streak`` and ``hysteresis.since``), so the next
one needs only its predecessor. A history without stored streaks (tests, old rows) is walked
backwards instead. Any evaluation that does not pass, or one of another fingerprint or policy,
ends the streak: a new build starts from nothing.
"""

from __future__ import annotations

from typing import Any

from shadowd.judge.policy import Policy
from shadowd.judge.report import INSUFFICIENT, PASS, READY, Criterion

__all__ = ["hysteresis"]


def _streak(history: list[dict[str, Any]], fingerprint: str, policy_hash: str,
            at: float) -> tuple[int, float]:
    """Passing evaluations before ``at`` that continue an unbroken streak: (count, first one's time)."""
    count, since = 0, at
    for ev in reversed(history):
        if float(ev.get("at", 0.0)) > at:
            continue
        if (ev.get("candidate_fingerprint") != fingerprint or ev.get("policy_hash") != policy_hash
                or not ev.get("passing")):
            break
        state = ev.get("hysteresis") or {}
        if "streak" in state and "since" in state:
            return count + int(state["streak"]), float(state["since"])
        count += 1
        since = float(ev["at"])
    return count, since


def hysteresis(raw_verdict: str, history: list[dict[str, Any]], fingerprint: str, policy_hash: str,
               at: float, p: Policy) -> tuple[Criterion, dict[str, Any]]:
    """The hysteresis criterion for an evaluation at ``at`` whose other criteria gave ``raw_verdict``.

    Returns the criterion and the streak state to store with the evaluation.
    """
    need_s = p.hysteresis_minutes * 60.0
    others = sum(1 for ev in history if ev.get("candidate_fingerprint") not in (None, fingerprint))
    if raw_verdict == READY:
        before, since = _streak(history, fingerprint, policy_hash, at)
        streak = before + 1
        since = since if before else at
    else:
        streak, since = 0, at
    span = at - since
    state = {"streak": streak, "since": since, "span_s": span, "need_evaluations": p.hysteresis_k,
             "need_span_s": need_s, "fingerprint": fingerprint, "other_fingerprints_ignored": others}
    observed = {"consecutive_passing": streak, "span_s": span}
    threshold = {"evaluations": p.hysteresis_k, "span_s": need_s}
    if raw_verdict != READY:
        detail = "streak of passing evaluations reset (another criterion did not pass)"
        return Criterion("hysteresis", INSUFFICIENT, observed, threshold, detail), state
    if streak >= p.hysteresis_k and span >= need_s:
        detail = f"{streak} consecutive passing evaluations over {span:.0f} s"
        return Criterion("hysteresis", PASS, observed, threshold, detail), state
    detail = (f"{streak}/{p.hysteresis_k} consecutive passing evaluations over {span:.0f}/{need_s:.0f} s "
              f"of candidate {fingerprint!r}")
    return Criterion("hysteresis", INSUFFICIENT, observed, threshold, detail), state

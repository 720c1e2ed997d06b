"""Hysteresis and the candidate fingerprint: READY only after K consecutive passing evaluations
spanning at least M minutes, all of the same candidate build and the same policy, each of which judged new
samples (an evaluation of unchanged data holds the streak: it neither advances nor resets it).

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
            at: float) -> tuple[int, float, float]:
    """Passing evaluations before ``at`` that continue an unbroken streak: (count, first one's time, time of the
    last one that advanced it)."""
    count, since, advanced = 0, at, at
    for ev in reversed(history):
        if float(ev.get("at", 0.0)) > at:
            continue
        if (ev.get("candidate_fingerprint") != fingerprint or ev.get("policy_hash") != policy_hash
                or not ev.get("passing")):
            break
        state = ev.get("hysteresis") or {}
        if count == 0:
            advanced = float(state.get("advanced_at", ev.get("at", ev.get("evaluated_at", at))))
        if "streak" in state and "since" in state:
            return count + int(state["streak"]), float(state["since"]), advanced
        count += 1
        since = float(ev["at"])
    return count, since, advanced


def _previous(history: list[dict[str, Any]], at: float) -> dict[str, Any]:
    """The latest evaluation at or before ``at`` (empty when none)."""
    before = [ev for ev in history if float(ev.get("at", 0.0)) <= at]
    return max(before, key=lambda ev: float(ev.get("at", 0.0))) if before else {}


def hysteresis(raw_verdict: str, history: list[dict[str, Any]], fingerprint: str, policy_hash: str,
               at: float, p: Policy, evidence: int | None = None) -> tuple[Criterion, dict[str, Any]]:
    """The hysteresis criterion for an evaluation at ``at`` whose other criteria gave ``raw_verdict``.

    ``evidence`` counts the samples the evaluation judged (stored with it): an evaluation that judged no
    more than the previous one holds the streak where it was (it neither advances nor resets it), and the
    span runs from the streak's first evaluation to the last one that advanced it, so evaluating the same
    stored data again and again, however long, promotes nothing. Returns the criterion and the state to store.
    """
    need_s = p.hysteresis_minutes * 60.0
    others = sum(1 for ev in history if ev.get("candidate_fingerprint") not in (None, fingerprint))
    prev_state = _previous(history, at).get("hysteresis") or {}
    stale = evidence is not None and prev_state.get("evidence") == evidence
    if raw_verdict == READY:
        before, since, advanced = _streak(history, fingerprint, policy_hash, at)
        if not before:
            since = advanced = at
        streak = before if stale else before + 1
        advanced = advanced if stale else at
    else:
        streak, since, advanced = 0, at, at
    span = advanced - since
    state = {"streak": streak, "since": since, "advanced_at": advanced, "span_s": span,
             "need_evaluations": p.hysteresis_k, "need_span_s": need_s, "fingerprint": fingerprint,
             "other_fingerprints_ignored": others, "evidence": evidence, "new_samples": not stale}
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
    if stale:
        detail += "; no new samples since the previous evaluation (the streak advances only with new samples)"
    return Criterion("hysteresis", INSUFFICIENT, observed, threshold, detail), state

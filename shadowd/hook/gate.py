"""The promotion gate: on mode serves the candidate only once the collector has judged *this* build READY.

Step 3 of the cutover (docs/deployment.md) is a gate a person or a pipeline runs: ``shadowd readiness --wait``.
Nothing stopped an on-mode deployment from starting without it, or with a rebuilt kernel that never ran in
validate. With ``SHADOWD_GATE_RUN=<id>`` the hook enforces the gate itself:

* an on-mode process starts **held**: its effective mode is ``validate`` (the baseline is served, the
  candidate compared as configured, samples stream to its own on-mode run) — graphs captured meanwhile are
  built for on mode (``HookRuntime.capture_code``), so they serve the candidate once the gate opens, with no
  recapture;
* once the process's run is registered, a thread of its own asks the collector for run ``<id>``
  (``GET /v1/runs/{id}``) and its stored verdict (``GET /readiness?run_id=<id>``) every :data:`GATE_POLL_S`;
* the gate **opens** when the verdict is READY *and* that run was judged for this deployment: the same
  candidate fingerprint, baseline fingerprint, model, layer count and TP size as this process's own run
  registration (:data:`IDENTITY`). A verdict is evidence for the build, the Triton kernel and the shapes it
  saw, nothing else — and only an answer about run ``<id>`` counts (HTTP 200, that run id, this candidate's
  fingerprint: :func:`gate_decision`);
* the verdict speaks for the shapes its run saw, no others: on opening, the hook takes the report's
  ``covered_shapes`` (:mod:`shadowd.hook.coverage`), and on mode serves the candidate on those shape buckets only —
  a call of any other shape (a first 200k-token prefix, a tree or a batch larger than any compared) is served by
  the baseline and shadowed as in validate; a READY report without them keeps the gate held;
* it stays open for the life of the process (the on-mode run's spot checks and the kill switch watch the
  candidate from then on); the collector's kill switch still lowers the mode whatever the gate says;
* once open, the thread keeps asking every :data:`FOLLOW_POLL_S`: a READY verdict that covers more shapes (the
  validate run kept collecting evidence) widens the set the candidate is served on (the union: a shape once
  covered by a READY verdict for this build stays covered), on the device too; a verdict that is no longer READY is
  logged (an error when NOT_READY) and changes nothing — lowering the mode is the kill switch's.

The thread never touches the serving path beyond :meth:`HookRuntime.open_gate`. A collector that is down
keeps the gate held (retried); a run judged for another deployment, an unknown run or a refused request keep
it held for good (logged once, as an error): the fix is a restart with the right build or ``SHADOWD_GATE_RUN``.
A held gate logs one line per state (the verdict and its first failing criterion), not one per question.
A forked child, which has none of its parent's threads, watches (held) or follows (open) with a thread of its own.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from shadowd.client import BatchRejected, CollectorError
from shadowd.hook.coverage import Coverage

__all__ = ["FOLLOW_POLL_S", "GATE_POLL_S", "IDENTITY", "PromotionGate", "gate_decision", "mismatches"]

log = logging.getLogger("shadowd.hook")

#: seconds between two questions to the collector while the gate is held
GATE_POLL_S = 10.0
#: seconds between two questions once it opened (the covered shapes may grow)
FOLLOW_POLL_S = 60.0
#: what must be equal between the gate run and this process's run: (label, path into the run's fields)
IDENTITY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("candidate fingerprint", ("candidate", "fingerprint")),
    ("baseline fingerprint", ("baseline", "fingerprint")),
    ("model", ("model",)),
    ("layer count", ("num_layers",)),
    ("TP size", ("tp_size",)),
)


#: the watchers of this process whose thread runs: a forked child (which has none of its threads) starts its own
_WATCHING: weakref.WeakSet[PromotionGate] = weakref.WeakSet()


def _watch_in_child() -> None:
    for gate in list(_WATCHING):
        gate._after_fork()


if hasattr(os, "register_at_fork"):  # (not on Windows, which cannot fork)
    os.register_at_fork(after_in_child=_watch_in_child)


def _at(fields: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    v: Any = fields
    for key in path:
        if not isinstance(v, Mapping):
            return None
        v = v.get(key)
    return v


def mismatches(gate_run: Mapping[str, Any], own: Mapping[str, Any]) -> list[str]:
    """What differs between the gate run and this process's run fields (only what this process declares is
    compared, but a candidate fingerprint must be declared)."""
    out = []
    for label, path in IDENTITY:
        mine = _at(own, path)
        if mine is None and label != "candidate fingerprint":
            continue
        theirs = _at(gate_run, path)
        if mine is None or theirs != mine:
            out.append(f"{label} {theirs!r} there, {mine!r} here")
    return out


def gate_decision(gate_id: int, gate_run: Any, report: Any, own: Mapping[str, Any],
                  status: int = 200) -> tuple[bool | None, str]:
    """Whether the gate opens: (True, why) READY for this deployment; (None, why) not yet (may change: wait);
    (False, why) never for this process (run ``gate_id`` was judged for another deployment).

    ``gate_run`` and ``report`` are the collector's answers to ``GET /v1/runs/{gate_id}`` and ``GET /readiness?run_id=
    {gate_id}`` (``status``: the latter's HTTP status). They must be *about run* ``gate_id``: a READY verdict opens
    the gate only with HTTP 200, the run id asked and the candidate fingerprint of this process (a collector or a
    proxy that ignores ``?run_id=`` answers the latest run's verdict — perhaps this very process's run, fed by its
    held validate traffic). An answer that is not is no evidence: the gate holds and asks again."""
    if not isinstance(gate_run, Mapping) or not isinstance(report, Mapping):
        return None, f"the collector's answers about run {gate_id} are not a run and a verdict (a proxy?)"
    if gate_run.get("id") != gate_id:
        return None, f"the collector answered run {gate_run.get('id')!r} when asked for run {gate_id}"
    diff = mismatches(gate_run, own)
    if diff:
        return False, f"run {gate_id} was judged for another deployment: " + "; ".join(diff)
    verdict = report.get("verdict")
    if report.get("run_id") != gate_id:
        return None, (f"the collector answered the verdict of run {report.get('run_id')!r} ({verdict}) when asked "
                      f"for run {gate_id}'s (does it take ?run_id=?)")
    if verdict != "READY":
        reasons = report.get("reasons") or [report.get("error") or "no reason given"]
        return None, f"run {gate_id} is {verdict or 'not judged'}: {reasons[0]}"
    mine = _at(own, ("candidate", "fingerprint"))
    if report.get("candidate_fingerprint") != mine:
        return None, (f"run {gate_id}'s READY verdict was judged for candidate {report.get('candidate_fingerprint')!r}"
                      f", not {mine!r}")
    if status != 200:
        return None, f"run {gate_id}'s verdict READY came with HTTP {status}, not 200"
    return True, f"run {gate_id} is READY for candidate {mine}"


def _state_of(why: str) -> str:
    # what a line about the gate says, in short: the verdict and its first failing criterion (up to the second
    # colon), not the numbers after it, which move with every evaluation of a run still collecting evidence
    return ":".join(why.split(":")[:2])


class PromotionGate:
    """Watches run ``gate_id`` at the collector (``client``) and opens ``rt``'s gate (see the module docstring).

    ``own`` is this process's run registration (what ``POST /v1/runs`` was sent)."""

    def __init__(self, rt: Any, client: Any, gate_id: int, own: Mapping[str, Any],
                 interval_s: float = GATE_POLL_S, follow_s: float = FOLLOW_POLL_S) -> None:
        self.rt = rt
        self.client = client
        self.gate_id = gate_id
        self.own = dict(own)
        self.interval_s = interval_s
        self.follow_s = follow_s
        self.opened = False
        self.done = threading.Event()  # set once the gate opened or can never open for this process
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state: str | None = None  # what the last line logged said, in short (see _settle)

    def check(self) -> bool | None:
        """One question to the collector; applies the answer. Returns :func:`gate_decision`'s first value (None
        also when the collector could not be asked)."""
        try:
            opened, why, report = self._ask()
        except BatchRejected as e:
            return self._settle(False, f"the collector refused the gate's questions about run {self.gate_id} ({e})")
        except CollectorError as e:
            return self._settle(None, f"the collector could not be asked about run {self.gate_id} ({e})",
                                "unreachable")
        coverage = None
        if opened:
            try:  # the verdict speaks for the shapes it saw: on mode serves the candidate on those only
                coverage = Coverage.from_report(report)
            except ValueError as e:
                return self._settle(None, f"run {self.gate_id} is READY, but {e}")
        return self._settle(opened, why, coverage=coverage)

    def _ask(self) -> tuple[bool | None, str, Any]:
        """The collector's run ``gate_id`` and its stored verdict: :func:`gate_decision`'s answer, and the report."""
        run = self.client.get_run(self.gate_id)
        status, report = self.client.readiness(self.gate_id)
        return (*gate_decision(self.gate_id, run, report, self.own, status), report)

    def _settle(self, opened: bool | None, why: str, state: str | None = None, coverage: Any = None) -> bool | None:
        """Apply a decision. One log line per *state* of a held gate (``state``; by default ``why`` up to its second
        colon: the verdict and its first failing criterion — not the numbers after it, which move with every
        evaluation of a run still collecting evidence); ``rt.gate_reason`` is always the latest ``why``."""
        rt = self.rt
        if opened:
            rt.open_gate(why, coverage)
            self.opened = True
            self._state = "open"
            self.done.set()
            return True
        state = state if state is not None else _state_of(why)
        if state != self._state:
            level = logging.ERROR if opened is False else logging.WARNING
            log.log(level, "shadowd: promotion gate held (the baseline is served)%s: %s",
                    " for the life of this process" if opened is False else "", why)
            self._state = state
        rt.gate_reason = why
        if opened is False:
            self.done.set()
        return opened

    def follow(self) -> int | None:
        """Once open: one more question. A READY verdict for this deployment widens the shapes served on to the
        union with its ``covered_shapes``; returns the buckets added (None: no READY answer, nothing changed)."""
        try:
            ready, why, report = self._ask()
        except CollectorError:
            return None  # (the set stays; asked again later)
        if not ready:
            state = _state_of(why)
            if state != self._state:
                level = logging.ERROR if isinstance(report, Mapping) and report.get("verdict") == "NOT_READY" else (
                    logging.WARNING)
                log.log(level, "shadowd: promotion gate: %s; the candidate is still served on the shapes the gate "
                        "opened on (the kill switch lowers the mode)", why)
                self._state = state
            return None
        try:
            added = self.rt.widen_coverage(Coverage.from_report(report))
        except ValueError:
            return None
        if added:
            log.warning("shadowd: promotion gate: run %d's verdict covers %d more shape buckets: the candidate is now "
                        "served on its %s", self.gate_id, added, self.rt.coverage.describe())
        self._state = "open"
        return added

    def _loop(self, forked: bool = False) -> None:
        if forked:  # (made here, not in the fork handler: the parent's connections are not this process's)
            self.client = self.client.fresh()
        while not self.done.is_set():
            try:
                self.check()
            except Exception as e:  # never let the thread die with the gate in an unknown state: it stays held
                if self._state != "check failed":  # (the traceback once, not every poll)
                    log.exception("shadowd: promotion gate check failed; retrying (the baseline is served)")
                    self._state = "check failed"
                self.rt.gate_reason = f"the promotion gate's check failed: {e!r}"
            if self.done.is_set() or self._stop.wait(self.interval_s):
                break
        while self.opened and not self._stop.wait(self.follow_s):
            try:
                self.follow()
            except Exception:  # the set stays as it is; the thread goes on asking
                if self._state != "follow failed":
                    log.exception("shadowd: promotion gate: following the verdict failed; the shapes stay as they are")
                    self._state = "follow failed"

    def start(self) -> PromotionGate:
        """Watch in a daemon thread (at once, then every ``interval_s`` until the gate opens or never can)."""
        self._thread = threading.Thread(target=self._loop, name="shadowd-gate", daemon=True)
        self._thread.start()
        _WATCHING.add(self)
        return self

    def _after_fork(self) -> None:
        """In a forked child: the parent's thread is not here, so the child's gate would stay held for good (or, once
        open, stop following the verdict); it watches with a thread (and connections) of its own, as the streamer
        does (``shadowd.hook.streamer``). A gate closed for good, or stopped, needs none."""
        if self._stop.is_set() or (self.done.is_set() and not self.opened):
            return
        done = self.done.is_set()
        self.done, self._stop = threading.Event(), threading.Event()  # (their locks may be the parent thread's)
        if done:  # open: the child's thread only follows
            self.done.set()
        self._thread = threading.Thread(target=self._loop, args=(True,), name="shadowd-gate", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

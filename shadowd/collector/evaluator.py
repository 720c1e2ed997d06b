"""Readiness evaluations on a fixed cadence, stored in the ``evaluations`` table.

A background task of the collector (started in the app's lifespan) evaluates every active
run every ``eval_interval_s`` seconds (a run with nothing ingested since its latest evaluation keeps that
one: the same evidence, the same verdict, nothing stored again): it builds the judge's snapshot from the rollup tables,
hands it the run's previous evaluation (which carries the hysteresis streak), stores the
report, and updates the verdict gauge and the verdict-change counter. ``GET /readiness``
serves the latest stored evaluation, so polling never promotes a candidate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from sqlalchemy import Engine, func, insert, select
from starlette.concurrency import run_in_threadpool

from shadowd.collector import queries
from shadowd.collector import tables as t
from shadowd.collector.metrics import CollectorMetrics
from shadowd.judge.layers import layer_table
from shadowd.judge.policy import Policy
from shadowd.judge.verdict import NOT_READY, READY, judge

__all__ = ["Evaluator"]

log = logging.getLogger("shadowd.collector")


class Evaluator:
    """Evaluates runs, stores the reports, exports the verdicts."""

    def __init__(self, engine: Engine, policy: Policy, metrics: CollectorMetrics | None = None,
                 interval_s: float = 15.0, active_hours: float = 24.0, time_bucket_s: float = 60.0) -> None:
        self.engine = engine
        self.time_bucket_s = time_bucket_s
        self.policy = policy
        self.metrics = metrics
        self.interval_s = interval_s
        self.active_s = active_hours * 3600.0
        #: an evaluation this long after a run's last ingest saw everything stored by then (an ingest's transaction
        #: takes far less): with nothing ingested since, the cadence does not evaluate the run again
        self.settle_s = 60.0

    def previous(self, run_id: int) -> dict[str, Any] | None:
        """The run's latest stored evaluation (its report, with ``evaluation_id``), or None."""
        e = t.evaluations.c
        with self.engine.connect() as conn:
            row = conn.execute(
                select(e.id, e.report).where(e.run_id == run_id).order_by(e.at.desc(), e.id.desc()).limit(1)
            ).first()
        if row is None:
            return None
        report: dict[str, Any] = json.loads(row[1])
        report["evaluation_id"] = int(row[0])
        return report

    def prune(self, older_than: float) -> int:
        """Retention: delete the evaluations made before ``older_than`` (unix seconds), except each run's latest
        (what ``GET /readiness`` serves and the next evaluation continues from) and those whose verdict differs from
        the run's evaluation before (its verdict changes stay on record). Returns how many were deleted."""
        e = t.evaluations.c
        w = select(
            e.id, e.at, e.verdict,
            func.lag(e.verdict).over(partition_by=e.run_id, order_by=(e.at, e.id)).label("before"),
            func.row_number().over(partition_by=e.run_id, order_by=(e.at.desc(), e.id.desc())).label("newest"),
        ).subquery()
        doomed = select(w.c.id).where(w.c.at < older_than, w.c.newest > 1, w.c.before == w.c.verdict)
        with self.engine.begin() as conn:
            return int(conn.execute(t.evaluations.delete().where(e.id.in_(doomed))).rowcount or 0)

    def evaluate(self, run_id: int, now: float | None = None) -> dict[str, Any]:
        """Evaluate run ``run_id`` at ``now`` (unix seconds), store and export the report."""
        now = time.time() if now is None else now
        prev = self.previous(run_id)
        snap = queries.load_rollups(self.engine, run_id, now=now, recent_s=self.policy.drift_window_s,
                                    history=[prev] if prev else [], time_bucket_s=self.time_bucket_s)
        report = judge(snap, self.policy)
        report["run_key"] = snap.run["run_key"]
        with self.engine.begin() as conn:
            res = conn.execute(insert(t.evaluations).values(
                run_id=run_id, candidate_fingerprint=report["candidate_fingerprint"], at=now,
                verdict=report["verdict"], passing=int(report["passing"]), policy_hash=report["policy_hash"],
                report=json.dumps(report),
            ))
            report["evaluation_id"] = int(res.inserted_primary_key[0]) if res.inserted_primary_key else None
        changed = prev is not None and prev.get("verdict") != report["verdict"]
        if changed:
            log.info("run %s: readiness %s -> %s", run_id, prev and prev.get("verdict"), report["verdict"])
        if self.metrics is not None:
            self.metrics.set_verdict(run_id, str(snap.run.get("candidate_name", "")), report["verdict"], changed)
        return report

    def latest_or_evaluate(self, run_id: int, now: float | None = None,
                           run: dict[str, Any] | None = None, gave_up: bool = False) -> dict[str, Any]:
        """The latest stored evaluation of the run; evaluates now when it has none yet.

        Hard failures are immediate: when the run (``run``, its row) has a candidate non-finite
        mismatch or error, or a producer of it disabled its candidate or fell back (``gave_up``), that the
        stored evaluation does not reflect yet, it is evaluated now. That can only demote, never promote,
        so polling still cannot make a candidate READY.

        A stored READY older than the run's last ingest by more than two evaluation intervals (the cadence fell
        behind: a slow or failing pass) is not served as it is: the run is evaluated now. Re-judging a READY can
        keep it or demote it, never promote anything. So is a stored READY without ``covered_shapes`` (stored before
        reports said which shapes they speak for: a promotion gate needs them).
        """
        prev = self.previous(run_id)
        if prev is None:
            return self.evaluate(run_id, now)
        if prev.get("verdict") == READY and "covered_shapes" not in prev:
            return self.evaluate(run_id, now)  # stored by a collector that did not say which shapes it covers
        hard = gave_up or (run is not None and (run.get("n_cand_nonfinite") or run.get("n_errors")))
        if hard and prev.get("verdict") != NOT_READY:
            return self.evaluate(run_id, now)
        if prev.get("verdict") == READY and run is not None and run.get("last_ingest_at") is not None:
            at = float(prev.get("evaluated_at") or 0.0)
            if float(run["last_ingest_at"]) > at + 2 * self.interval_s:
                return self.evaluate(run_id, now)
        return prev

    def evaluate_active(self, now: float | None = None) -> dict[int, str]:
        """One pass over every run with an ingest in the active window: {run id: verdict}."""
        now = time.time() if now is None else now
        out: dict[int, str] = {}
        for run in queries.runs_for_metrics(self.engine, now - self.active_s):
            run_id = int(run["id"])
            try:
                prev = self.previous(run_id)
                if self._unchanged(prev, run):  # the same evidence judges the same: nothing stored again
                    assert prev is not None
                    if self.metrics is not None:
                        self.metrics.set_verdict(run_id, str(run.get("candidate_name", "")), prev["verdict"], False,
                                                 stored=False)
                    out[run_id] = prev["verdict"]
                    continue
                out[run_id] = self.evaluate(run_id, now)["verdict"]
            except Exception:
                log.exception("readiness evaluation of run %s failed; will retry", run_id)
        return out

    def _unchanged(self, prev: dict[str, Any] | None, run: dict[str, Any]) -> bool:
        """Whether ``prev`` (the run's latest evaluation) already judged everything the run holds, under this
        policy: made ``settle_s`` after its last ingest. Its verdict then stands: every criterion reads the stored
        samples (the recent window ends at the newest one), and hysteresis advances only on new samples."""
        last = run.get("last_ingest_at")
        return (prev is not None and last is not None and prev.get("policy_hash") == self.policy.identity()
                and float(prev.get("evaluated_at") or 0.0) >= float(last) + self.settle_s)

    def layers(self, run_id: int, now: float | None = None) -> dict[str, Any]:
        """The per-layer readiness table of a run, from its rollups."""
        snap = queries.load_rollups(self.engine, run_id, now=now, recent_s=self.policy.drift_window_s,
                                    time_bucket_s=self.time_bucket_s)
        return {"run_id": run_id, "num_layers": snap.run["num_layers"], "policy_hash": self.policy.identity(),
                "tolerance_hash": self.policy.hash(), "layers": layer_table(snap, self.policy)}

    async def run_forever(self) -> None:
        """The cadence: one pass every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await run_in_threadpool(self.evaluate_active)
            except Exception:
                log.exception("readiness pass failed; will retry")

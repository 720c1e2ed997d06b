"""``GET /readiness``: the promotion verdict, HTTP 200 only when READY (else 503).

It serves the latest *stored* evaluation (the collector evaluates on a fixed cadence; a run
with none yet is evaluated once, synchronously), so polling cannot promote a candidate.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from shadowd.collector import queries
from shadowd.collector.deps import ROW_ID_MAX, AppState, Authorized, RunId, State
from shadowd.collector.evaluator import Evaluator
from shadowd.judge.verdict import READY

__all__ = ["get_evaluator", "router"]

router = APIRouter(tags=["readiness"], dependencies=[Authorized])


def get_evaluator(request: Request, state: AppState) -> Evaluator:
    """The app's evaluator (``app.state.evaluator``), created on first use when the app has none."""
    ev: Evaluator | None = getattr(request.app.state, "evaluator", None)
    if ev is None:
        ev = Evaluator(state.engine, state.policy, state.metrics, state.settings.eval_interval_s,
                       state.settings.metrics_active_hours, state.settings.time_bucket_s)
        request.app.state.evaluator = ev
    return ev


@router.get("/readiness")
async def readiness(request: Request, state: State,
                    run_id: int | None = Query(None, ge=1, le=ROW_ID_MAX)) -> JSONResponse:
    """The verdict of ``run_id`` (the latest run when omitted), with every criterion and the reasons; beside it
    SGLang's accept length per mode, per producer that reported one why its candidate was disabled or fell back
    (``producer_notes``), and the measured speed-up (``timing``: mean device time per call of both, overall and per
    shape bucket)."""
    ev = get_evaluator(request, state)

    def work() -> dict[str, Any]:
        run = queries.run_row(state.engine, run_id)
        notes = queries.producer_notes(state.engine, run["id"])
        report = ev.latest_or_evaluate(run["id"], run=run, gave_up=bool(notes))
        # the end-to-end effect beside the verdict: SGLang's accept length in each mode of the run
        spec = queries.speculative(state.engine, run["id"])
        # and the reason to switch: the candidate's measured speed-up over the baseline
        timed = queries.timing(state.engine, run["id"])
        return {"run_id": run["id"], "run_key": run["run_key"], **report, "speculative": spec,
                "producer_notes": notes, "timing": timed}

    report = await run_in_threadpool(work)
    return JSONResponse(report, status_code=200 if report["verdict"] == READY else 503)


@router.get("/readiness/{run_id}/layers")
async def readiness_layers(request: Request, state: State, run_id: RunId) -> dict[str, Any]:
    """Per-layer table: samples, exceedances, errors, mean statistics, drift ratio, problems."""
    ev = get_evaluator(request, state)
    await run_in_threadpool(queries.run_row, state.engine, run_id)
    return await run_in_threadpool(ev.layers, run_id)

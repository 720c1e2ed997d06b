"""``GET /readiness``: the promotion verdict, HTTP 200 only when READY (else 503)."""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from shadowd.collector import queries
from shadowd.collector.deps import Authorized, State
from shadowd.judge.verdict import READY, judge

__all__ = ["router"]

router = APIRouter(tags=["readiness"], dependencies=[Authorized])


@router.get("/readiness")
async def readiness(state: State, run_id: int | None = Query(None, ge=1)) -> JSONResponse:
    def work() -> dict[str, object]:
        run = queries.run_row(state.engine, run_id)
        snap = queries.load_rollups(state.engine, run["id"])
        report = judge(snap, state.policy)
        return {"run_id": run["id"], "run_key": run["run_key"], **report}

    report = await run_in_threadpool(work)
    return JSONResponse(report, status_code=200 if report["verdict"] == READY else 503)

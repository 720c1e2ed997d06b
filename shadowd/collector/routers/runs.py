"""Runs: registration (idempotent on run_key), listing, per-layer summary, the kill switch."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Response
from starlette.concurrency import run_in_threadpool

from shadowd.collector import queries
from shadowd.collector.deps import ROW_ID_MAX, Authorized, RunId, State
from shadowd.collector.schemas import ModeChange, RunCreate, RunOut

__all__ = ["router"]

router = APIRouter(prefix="/v1/runs", tags=["runs"], dependencies=[Authorized])


@router.post("", status_code=201)
async def register_run(body: RunCreate, state: State, response: Response) -> RunOut:
    """Create a run, or return the one registered under the same ``run_key`` (200)."""
    row, created = await run_in_threadpool(state.store.register_run, body.fields())
    if not created:
        response.status_code = 200
    state.metrics.declare_run(row["id"], row["num_layers"])
    return RunOut.of(row)


@router.get("")
async def list_runs(state: State, limit: int = Query(100, ge=1, le=1000),
                    offset: int = Query(0, ge=0, le=ROW_ID_MAX)) -> list[RunOut]:
    rows = await run_in_threadpool(queries.list_runs, state.engine, limit, offset)
    return [RunOut.of(r) for r in rows]


@router.get("/{run_id}")
async def get_run(run_id: RunId, state: State) -> RunOut:
    """One run with its counters, SGLang's accept length per hook mode and on mode's calls on covered shapes."""
    row = await run_in_threadpool(queries.run_row, state.engine, run_id)
    producers = await run_in_threadpool(queries.producers_of, state.engine, run_id)
    return RunOut.of(row, queries.speculative_of(producers), queries.on_mode_shapes_of(producers))


@router.get("/{run_id}/layers")
async def run_layers(run_id: RunId, state: State) -> dict[str, Any]:
    """Per-layer summary from the rollups: samples, exceedances, errors, mean/max statistics, timing."""
    run = await run_in_threadpool(queries.run_row, state.engine, run_id)
    layers = await run_in_threadpool(queries.layer_summary, state.engine, run_id)
    seen = {row["layer"] for row in layers}
    return {"run_id": run_id, "num_layers": run["num_layers"], "layers": layers,
            "missing_layers": [i for i in range(run["num_layers"]) if i not in seen]}


@router.get("/{run_id}/producers")
async def run_producers(run_id: RunId, state: State) -> list[dict[str, Any]]:
    """Producers (one per process) with their sequence gaps, spool depth and drops."""
    await run_in_threadpool(queries.run_row, state.engine, run_id)
    return await run_in_threadpool(queries.producers_of, state.engine, run_id)


@router.put("/{run_id}/mode")
async def set_mode(run_id: RunId, body: ModeChange, state: State) -> RunOut:
    """The kill switch: force every producer of the run to ``validate`` or ``off`` (null clears)."""
    return RunOut.of(await run_in_threadpool(state.store.set_mode_override, run_id, body.mode))

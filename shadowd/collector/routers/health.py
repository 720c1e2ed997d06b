"""Liveness (``/healthz``, for load balancers and compose health checks) and ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from shadowd import __version__
from shadowd.collector.deps import State
from shadowd.collector.errors import ApiError

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(state: State) -> dict[str, str]:
    """200 while the service and its database answer; 503 otherwise. Never depends on the verdict."""

    def ping() -> None:
        with state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    try:
        await run_in_threadpool(ping)
    except Exception as exc:
        raise ApiError(503, "database", f"database unreachable: {type(exc).__name__}") from None
    return {"status": "ok", "version": __version__, "database": state.engine.dialect.name}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    data = await run_in_threadpool(generate_latest, state.metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)

"""The collector's app factory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from shadowd import __version__
from shadowd.collector import queries
from shadowd.collector.db import check_schema, make_engine, upgrade
from shadowd.collector.deps import AppState
from shadowd.collector.errors import answer, install_error_handlers
from shadowd.collector.evaluator import Evaluator
from shadowd.collector.metrics import CollectorMetrics, RollupExporter
from shadowd.collector.routers import health, readiness, runs, samples, status
from shadowd.collector.settings import CollectorSettings
from shadowd.collector.store import Store
from shadowd.judge.policy import load_policy

__all__ = ["BodyLimit", "create_app"]

log = logging.getLogger("shadowd.collector")

NO_TOKEN_WARNING = (
    "SHADOWD_TOKEN is not set: the collector accepts samples and kill-switch changes from anyone who "
    "can reach it. Set SHADOWD_TOKEN (or --token) before exposing it beyond localhost."
)


async def _retention_loop(state: AppState, evaluator: Evaluator) -> None:
    s = state.settings
    while True:
        await asyncio.sleep(s.retention_interval_s)
        try:
            older_than = time.time() - s.retention_hours * 3600.0
            n = await run_in_threadpool(state.store.prune_samples, older_than)
            if n:
                log.info("retention: deleted %d raw samples older than %.1f h", n, s.retention_hours)
            n = await run_in_threadpool(evaluator.prune, older_than)
            if n:
                log.info("retention: deleted %d stored evaluations older than %.1f h (kept: each run's latest and "
                         "its verdict changes)", n, s.retention_hours)
        except Exception:
            log.exception("retention pass failed; will retry")


class BodyLimit:
    """Refuses (413) a request on any route whose declared Content-Length is over ``limit``, before its body is
    read (a refused sample batch is counted like any other). The samples route also counts a body sent without
    one as it reads it: ``deps.read_body``."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for key, value in scope["headers"]:
                if key == b"content-length" and value.isdigit() and int(value) > self.limit:
                    refusal = answer(Request(scope), 413, "body", f"{int(value)} bytes is over the {self.limit}-byte "
                                                                  "limit")
                    await refusal(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def create_app(settings: CollectorSettings | None = None, registry: CollectorRegistry | None = None) -> FastAPI:
    """Build the collector. The database must be at the migration head (or ``auto_upgrade``)."""
    settings = settings or CollectorSettings()
    registry = registry if registry is not None else CollectorRegistry()
    policy = load_policy(settings.policy_file)  # (first: a bad policy file is named before any database work)
    if settings.auto_upgrade:
        upgrade(settings.db_url)
    engine = make_engine(settings.db_url)
    check_schema(engine, settings.db_url)
    metrics = CollectorMetrics(registry)
    registry.register(RollupExporter(engine, settings.metrics_active_hours))
    store = Store(engine, policy, settings.time_bucket_s, settings.store_samples)
    state = AppState(settings=settings, engine=engine, store=store, policy=policy, metrics=metrics)
    evaluator = Evaluator(engine, policy, metrics, settings.eval_interval_s, settings.metrics_active_hours,
                          settings.time_bucket_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.token:
            log.warning(NO_TOKEN_WARNING)
        # the active runs' event counters at 0 before their first batch to this process (see declare_run)
        try:
            active = await run_in_threadpool(queries.runs_for_metrics, engine,
                                             time.time() - settings.metrics_active_hours * 3600.0)
        except Exception as e:  # the database away at this moment: the counters are made at their first event
            log.warning("could not list the active runs for their metrics (%r)", e)
            active = []
        for run in active:
            metrics.declare_run(run["id"], run["num_layers"])
        if settings.writer_process():
            from shadowd.collector.writer import IngestWriter

            state.writer = await run_in_threadpool(
                IngestWriter(settings.db_url, policy, settings.time_bucket_s, settings.store_samples,
                             settings.ingest_writer_processes).start)
        tasks = []
        if settings.retention_hours > 0:
            tasks.append(asyncio.create_task(_retention_loop(state, evaluator)))
        tasks.append(asyncio.create_task(evaluator.run_forever()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if state.writer is not None:
                await run_in_threadpool(state.writer.close)
                state.writer = None
            engine.dispose()

    app = FastAPI(title="shadowd collector", version=__version__, lifespan=lifespan,
                  default_response_class=JSONResponse)
    app.state.shadowd = state
    app.state.metrics = metrics
    app.state.evaluator = evaluator
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    for module in (health, runs, samples, readiness, status):
        app.include_router(module.router)
    return app

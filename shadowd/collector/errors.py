"""The one place that maps exceptions to HTTP answers. Every 4xx body names what was wrong:
``{"detail": {"field": "...", "error": "..."}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shadowd.collector.batch import BadBatch
from shadowd.collector.store import Conflict, UnknownRun, refused
from shadowd.collector.writer import WriterUnavailable

__all__ = ["ApiError", "answer", "install_error_handlers"]

log = logging.getLogger("shadowd.collector")


class ApiError(Exception):
    """An error answer: HTTP ``status``, the ``field`` at fault and a message."""

    def __init__(self, status: int, field: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.message = message
        self.headers = headers


def answer(request: Request, status: int, field: str, message: str,
           headers: dict[str, str] | None = None) -> JSONResponse:
    """The error answer of every 4xx (``{"detail": {"field", "error"}}``); a refused sample batch is counted."""
    if 400 <= status < 500 and request.url.path.endswith("/samples"):
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.rejected.labels(str(status)).inc()
    return JSONResponse({"detail": {"field": field, "error": message}}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc.status, exc.field, exc.message, exc.headers)

    @app.exception_handler(BadBatch)
    async def _bad(request: Request, exc: BadBatch) -> JSONResponse:
        return answer(request, 422, exc.field, exc.message)

    @app.exception_handler(UnknownRun)
    async def _unknown(request: Request, exc: UnknownRun) -> JSONResponse:
        return answer(request, 404, "run_id", str(exc))

    @app.exception_handler(Conflict)
    async def _conflict(request: Request, exc: Conflict) -> JSONResponse:
        return answer(request, 409, exc.field, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid request"}
        if first.get("type") == "json_invalid":  # its loc is a byte offset, not a field
            where = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
            ctx = first.get("ctx")
            error = ctx.get("error", "") if isinstance(ctx, dict) else ""
            return answer(request, 400, "body", "not valid JSON" + (f" at byte {where}" if where is not None else "")
                           + (f": {error}" if error else ""))
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        return answer(request, 422, ".".join(loc) or "body", str(first.get("msg")))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(request, exc.status_code, "request", str(exc.detail))

    async def _refused(request: Request, exc: Exception) -> JSONResponse:
        # a value the database refuses (out of its range, a character it cannot store, against a constraint): the
        # same request would fail again, so it is the client's error, not "retry later"; the transaction was
        # rolled back. (Ingest names the part of the batch itself: store.Store._storing.)
        bad = refused("body", exc)
        log.warning("database refused a value on %s: %s", request.url.path, bad.message)
        return answer(request, 422, bad.field, bad.message)

    app.add_exception_handler(DataError, _refused)
    app.add_exception_handler(IntegrityError, _refused)

    @app.exception_handler(DBAPIError)
    async def _database(request: Request, exc: DBAPIError) -> JSONResponse:
        # the transaction was rolled back: nothing of the request is stored; the producer retries
        log.warning("database error on %s: %s", request.url.path, type(exc.orig).__name__)
        return JSONResponse({"detail": {"field": "database", "error": "database unavailable; retry later"}},
                            status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(WriterUnavailable)
    async def _writer(request: Request, exc: WriterUnavailable) -> JSONResponse:
        # nothing of the batch was committed; the producer retries
        log.warning("ingest write failed on %s: %s", request.url.path, exc)
        return JSONResponse({"detail": {"field": "database", "error": "database unavailable; retry later"}},
                            status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse({"detail": {"field": "server", "error": type(exc).__name__}}, status_code=500)

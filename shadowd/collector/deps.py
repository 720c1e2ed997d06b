"""FastAPI dependencies, all in one place: the app state, the store, auth, body limits."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Path, Request
from sqlalchemy import Engine

from shadowd.collector.errors import ApiError
from shadowd.collector.metrics import CollectorMetrics
from shadowd.collector.settings import CollectorSettings
from shadowd.collector.store import Store
from shadowd.judge.policy import Policy

__all__ = ["ROW_ID_MAX", "AppState", "Authorized", "RunId", "State", "get_state", "read_body", "require_token"]

#: the largest row id (and list offset) a request may name: the databases' 64-bit integer
ROW_ID_MAX = 2**63 - 1
#: a run id in a path: a positive 64-bit integer (else 422 naming ``run_id``, never a database error)
RunId = Annotated[int, Path(ge=1, le=ROW_ID_MAX)]


@dataclass
class AppState:
    settings: CollectorSettings
    engine: Engine
    store: Store
    policy: Policy
    metrics: CollectorMetrics
    #: the ingest writer process (shadowd.collector.writer) while the app runs; None: write inline
    writer: Any = None


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.shadowd
    return state


State = Annotated[AppState, Depends(get_state)]


def require_token(request: Request, state: State) -> None:
    """Bearer-token check when a token is configured: 401 without one, 403 with a wrong one."""
    token = state.settings.token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise ApiError(401, "authorization", "a bearer token is required", {"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(403, "authorization", "the bearer token is not valid")


Authorized = Depends(require_token)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) one that grows over ``limit`` bytes as it is read (a declared length over
    it never gets here: ``app.BodyLimit`` refuses it first, on every route)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body", f"body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)

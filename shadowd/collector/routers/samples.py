"""Sample ingest: ``POST /v1/runs/{run_id}/samples`` (msgpack or JSON columnar batches)."""

from __future__ import annotations

import time

import orjson
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from shadowd.collector import queries
from shadowd.collector.batch import BadBatch, ValidBatch, check_clock, parse_batch
from shadowd.collector.deps import Authorized, RunId, State, read_body
from shadowd.collector.errors import ApiError
from shadowd.collector.schemas import IngestAnswer
from shadowd.collector.store import IngestResult
from shadowd.wire import MSGPACK, SENT_AT_HEADER, TS_MAX, decode_msgpack

__all__ = ["router"]

router = APIRouter(prefix="/v1/runs", tags=["samples"], dependencies=[Authorized])


def _decode(body: bytes, content_type: str) -> object:
    # the media type without its parameters (``application/json; charset=utf-8``); none at all: JSON
    media = content_type.split(";", 1)[0].strip().lower()
    if media in (MSGPACK, "application/x-msgpack"):
        try:
            return decode_msgpack(body)
        except Exception as exc:
            raise ApiError(400, "body", f"not valid msgpack: {exc}") from None
    if media in ("application/json", ""):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, "body", f"not valid JSON: {exc}") from None
    raise ApiError(415, "content-type", f"{content_type!r} is not application/msgpack or application/json")


def _sent_at(raw: str | None) -> float | None:
    # the producer's send stamp (optional; the hook's client always sets it): unix seconds
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not 0.0 <= v <= TS_MAX:  # (NaN fails too)
        raise ApiError(400, SENT_AT_HEADER, f"must be unix seconds between 0 and {TS_MAX:.0f}, got {raw[:40]!r}")
    return v


@router.post("/{run_id}/samples")
async def ingest(run_id: RunId, request: Request, state: State) -> IngestAnswer:
    """Store one batch (one transaction). A re-delivered batch is stored once and answered as duplicate."""
    received_at = time.time()
    sent_at = _sent_at(request.headers.get(SENT_AT_HEADER))
    body = await read_body(request, state.settings.max_body_bytes)
    decoded = _decode(body, request.headers.get("content-type", ""))

    def parse_and_store() -> tuple[ValidBatch, IngestResult]:
        try:
            batch = parse_batch(decoded)
            check_clock(batch, received_at, state.settings.max_clock_skew_s)
        except BadBatch:
            queries.run_row(state.engine, run_id)  # an unknown run is the first thing wrong: 404, not the 422
            raise
        return batch, state.store.ingest(run_id, batch, state.writer)

    batch, result = await run_in_threadpool(parse_and_store)
    m = state.metrics
    if result.duplicate:
        m.duplicates.labels(str(run_id)).inc()
    elif result.deltas is not None:
        c = batch.cols
        m.observe_ingest(run_id, result.accepted, c["layer"], result.deltas.exceeded, c["cand_nonfinite"] > 0)
    if sent_at is not None and batch.n:  # (a stats-only batch names no rank)
        m.observe_clock(run_id, int(batch.cols["rank"][0]), received_at - sent_at, batch.stage)
    return IngestAnswer(run_id=run_id, accepted=result.accepted, duplicate=result.duplicate,
                        mode_override=result.mode_override)

"""Small helpers for collector tests: posting batches and reading the database directly."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import create_engine, func, select

from shadowd.collector import tables as t
from shadowd.wire import MSGPACK, encode_msgpack

__all__ = ["count_rows", "post_msgpack", "register", "sample_rows"]


def post_msgpack(client: Any, run_id: int, batch: dict[str, Any], **headers: str) -> Any:
    return client.post(f"/v1/runs/{run_id}/samples", content=encode_msgpack(batch),
                       headers={"content-type": MSGPACK, **headers})


def register(client: Any, body: dict[str, Any], **headers: str) -> int:
    r = client.post("/v1/runs", json=body, headers=headers)
    assert r.status_code in (200, 201), r.text
    return int(r.json()["id"])


def count_rows(db_url: str, table: Any, **where: Any) -> int:
    """Rows of ``table`` matching ``where``; raw samples are matched on their batch's run and producer."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            source = table
            if table is t.samples and set(where) & {"run_id", "producer"}:
                source = t.samples.join(t.batches, t.batches.c.id == t.samples.c.batch_id)
            q = select(func.count()).select_from(source)
            for k, v in where.items():
                col = t.batches.c[k] if table is t.samples and k in ("run_id", "producer") else table.c[k]
                q = q.where(col == v)
            return int(conn.execute(q).scalar_one())
    finally:
        engine.dispose()


def sample_rows(db_url: str) -> list[dict[str, Any]]:
    """Every raw sample with its batch's run, producer and seq, in insertion order (hist decoded)."""
    from shadowd.collector import histblob

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(t.samples, t.batches.c.run_id, t.batches.c.producer, t.batches.c.seq)
                .join(t.batches, t.batches.c.id == t.samples.c.batch_id).order_by(t.samples.c.id)
            ).mappings().all()
    finally:
        engine.dispose()
    def norm(v: Any) -> Any:  # NaN (PostgreSQL keeps it, SQLite stores NULL) compares equal to itself here
        return "NaN" if isinstance(v, float) and math.isnan(v) else v

    return [{**{k: norm(v) for k, v in r.items()}, "hist": histblob.decode(r["hist"])} for r in rows]


TABLES = (t.samples, t.batches, t.cells, t.timeslots, t.hists, t.steps, t.producers, t.errors)

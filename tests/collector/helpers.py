"""Small helpers for collector tests: posting batches and reading the database directly."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, func, select

from shadowd.collector import tables as t
from shadowd.wire import MSGPACK, encode_msgpack

__all__ = ["count_rows", "post_msgpack", "register"]


def post_msgpack(client: Any, run_id: int, batch: dict[str, Any], **headers: str) -> Any:
    return client.post(f"/v1/runs/{run_id}/samples", content=encode_msgpack(batch),
                       headers={"content-type": MSGPACK, **headers})


def register(client: Any, body: dict[str, Any], **headers: str) -> int:
    r = client.post("/v1/runs", json=body, headers=headers)
    assert r.status_code in (200, 201), r.text
    return int(r.json()["id"])


def count_rows(db_url: str, table: Any, **where: Any) -> int:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            q = select(func.count()).select_from(table)
            for k, v in where.items():
                q = q.where(table.c[k] == v)
            return int(conn.execute(q).scalar_one())
    finally:
        engine.dispose()


TABLES = (t.samples, t.batches, t.cells, t.timeslots, t.hists, t.steps, t.producers)

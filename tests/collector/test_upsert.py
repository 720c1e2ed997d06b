"""The rollup upsert on both databases: counters add, maxima and minima keep the extreme, values stay exact."""

from __future__ import annotations

import math

from sqlalchemy import BigInteger, Column, Float, Integer, MetaData, String, Table, create_engine, select, text

from shadowd.collector.rollups import Rows
from shadowd.collector.upsert import Upserter, pg_array

META = MetaData()
CELLS = Table(
    "upsert_cells", META,
    Column("run_id", Integer, primary_key=True),
    Column("name", String, primary_key=True),
    Column("n", BigInteger, nullable=False, server_default=text("0")),
    Column("total", Float, nullable=False, server_default=text("0")),
    Column("top", Float, nullable=False, server_default=text("0")),
    Column("low", Float),
)


def _upsert(db_url: str, batches: list[Rows]) -> dict[str, tuple]:
    engine = create_engine(db_url)
    try:
        META.create_all(engine)
        up = Upserter(engine.dialect.name)
        for rows in batches:
            raw = engine.raw_connection()
            try:
                cur = raw.cursor()
                up.upsert(cur, CELLS, rows, ("run_id", "name"), add=("n", "total"), greatest=("top",), least=("low",))
                raw.commit()
            finally:
                raw.close()
        with engine.connect() as conn:
            got = conn.execute(select(CELLS.c.name, CELLS.c.n, CELLS.c.total, CELLS.c.top, CELLS.c.low)).all()
        return {r[0]: tuple(r[1:]) for r in got}
    finally:
        engine.dispose()


def test_upsert_adds_counters_and_keeps_extremes(db_url: str) -> None:
    first = Rows(("run_id", "name", "n", "total", "top", "low"),
                 [[1, 1], ['a "quoted" name', "back\\slash"], [2, 5], [0.5, 1.25], [3.0, 0.0], [-1.0, 2.0]])
    # the second batch: one conflicting row (adds, max, min) and one new row; its counters are 0 in every row,
    # so the statement leaves them out and the existing values stand
    second = Rows(("run_id", "name", "n", "total", "top", "low"),
                  [[1, 1], ['a "quoted" name', "new"], [0, 0], [0.25, 0.1], [7.5, 1.0], [-3.0, 4.0]])
    got = _upsert(db_url, [first, second])
    assert got['a "quoted" name'] == (2, 0.75, 7.5, -3.0)
    assert got["back\\slash"] == (5, 1.25, 0.0, 2.0)
    assert got["new"] == (0, 0.1, 1.0, 4.0)


def test_upsert_of_nothing_writes_nothing(db_url: str) -> None:
    assert _upsert(db_url, [Rows(("run_id", "name", "n"), [[], [], []])]) == {}


def test_pg_array_literals_are_exact() -> None:
    xs = [0.1, 1e-300, -2.5, math.inf, 7]
    lit = pg_array(xs)
    assert lit == "{0.1,1e-300,-2.5,inf,7}"
    assert [float(v) for v in lit[1:-1].split(",")] == [float(x) for x in xs]  # repr round-trips exactly
    assert pg_array(['a"b', "c\\d"]) == '{"a\\"b","c\\\\d"}'

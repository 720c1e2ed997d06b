"""Rollup upserts: ``INSERT … ON CONFLICT DO UPDATE`` that adds counters and sums and keeps maxima / minima.

One statement per table and batch: on PostgreSQL a single ``INSERT … SELECT FROM unnest(…)`` whose every column
travels as one array literal in text (PostgreSQL parses it in C; adapting thousands of Python numbers would take
longer than the upsert itself), on SQLite one driver-level ``executemany``. Statements are built once per
(table, columns, keys, update rule) and cached.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql

from shadowd.collector.rollups import I64_MAX, Rows

__all__ = ["Upserter", "pg_array"]


def pg_array(values: list[Any]) -> str:
    """A PostgreSQL array literal of ints, floats (repr: exact; nan, inf) or strings (quoted)."""
    if values and isinstance(values[0], str):
        return "{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}"
    return "{" + ",".join(map(repr, values)) + "}"


class Upserter:
    """Upserts of rollup rows for one SQL dialect (``postgresql`` or ``sqlite``), on a driver cursor."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        self._cache: dict[tuple[Any, ...], str] = {}

    def upsert(self, cur: Any, table: Table, rows: Rows, keys: tuple[str, ...], add: tuple[str, ...] = (),
               greatest: tuple[str, ...] = (), least: tuple[str, ...] = (), capped: tuple[str, ...] = ()) -> None:
        """Insert ``rows`` into ``table``; on a conflict of ``keys`` add the ``add`` columns and keep the larger
        ``greatest`` / smaller ``least`` values. The ``capped`` ones of the ``add`` columns (non-negative) stop at
        the largest 64-bit integer instead of overflowing it (PostgreSQL refused the statement, SQLite turned the
        value into a float)."""
        if not len(rows):
            return
        # a counter or maximum that is 0 in every row changes nothing (maxima are of values ≥ 0) and a
        # new row gets 0 by default: leave it out of the statement
        zero = {c for c, v in zip(rows.cols, rows.values, strict=True)
                if (c in add or c in greatest) and table.c[c].server_default is not None and not any(v)}
        if zero:
            keep = [i for i, c in enumerate(rows.cols) if c not in zero]
            rows = Rows(tuple(rows.cols[i] for i in keep), [rows.values[i] for i in keep])
            add = tuple(c for c in add if c not in zero)
            greatest = tuple(c for c in greatest if c not in zero)
        sql = self.sql(table, rows.cols, keys, add, greatest, least, tuple(c for c in capped if c in add))
        if self.dialect == "postgresql":
            cur.execute(sql, tuple(pg_array(v) for v in rows.values))
        else:
            cur.executemany(sql, rows.rows)

    def sql(self, table: Table, cols: tuple[str, ...], keys: tuple[str, ...], add: tuple[str, ...],
            greatest: tuple[str, ...], least: tuple[str, ...], capped: tuple[str, ...] = ()) -> str:
        """The upsert statement (driver paramstyle: ``%s`` arrays on PostgreSQL, ``?`` values on SQLite)."""
        cache_key = (table.name, cols, keys, add, greatest, least, capped)
        sql = self._cache.get(cache_key)
        if sql is None:
            pg = self.dialect == "postgresql"
            hi, lo = ("GREATEST", "LEAST") if pg else ("MAX", "MIN")
            q = ", ".join(f'"{c}"' for c in cols)
            sets = [f'"{c}" = {table.name}."{c}" + excluded."{c}"' if c not in capped else
                    f'"{c}" = CASE WHEN {table.name}."{c}" > {I64_MAX} - excluded."{c}" THEN {I64_MAX} '
                    f'ELSE {table.name}."{c}" + excluded."{c}" END' for c in add]
            sets += [f'"{c}" = {hi}({table.name}."{c}", excluded."{c}")' for c in greatest]
            sets += [f'"{c}" = {lo}({table.name}."{c}", excluded."{c}")' for c in least]
            if pg:
                arrays = ", ".join(f"%s::{table.c[c].type.compile(dialect=postgresql.dialect())}[]" for c in cols)
                source = f"SELECT * FROM unnest({arrays})"
            else:
                source = f"VALUES ({', '.join(['?'] * len(cols))})"
            sql = (f"INSERT INTO {table.name} ({q}) {source} "
                   f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {', '.join(sets)}")
            self._cache[cache_key] = sql
        return sql

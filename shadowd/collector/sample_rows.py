"""The raw samples' rows: which columns a batch writes, and the statements that write them.

Pure functions of a batch's columns (numpy arrays and lists, as :class:`shadowd.collector.store.WriteJob`
holds them); :class:`~shadowd.collector.store.Store` runs the statements in its write transaction.
PostgreSQL gets one binary ``COPY`` (shadowd.collector.pgcopy), SQLite one ``INSERT`` executed per row,
with the numbers that are equal in every row of the batch written into the statement once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import BigInteger, Float

from shadowd.collector import histblob
from shadowd.collector import tables as t
from shadowd.collector.pgcopy import binary_copy

__all__ = ["SAMPLE_COLUMNS", "pg_copy", "sample_values", "sqlite_plan", "sqlite_rows"]

SAMPLE_COLUMNS = (
    "batch_id", "rank", "layer", "step", "call", "ts", "batch_size", "draft_tokens", "prefix_len", "heads",
    "numel", "max_abs", "mean_abs", "max_rel", "rel_l2", "cos_diff", "out_scale", "nan_base", "inf_base",
    "nan_cand", "inf_cand", "cand_nonfinite", "base_nonfinite", "hist", "error", "mode", "oracle_cand_err",
    "oracle_base_err", "cand_us", "base_us", "new_requests", "exceeded",
)
# a batch's insert leaves out a column that holds the column's default in every row of the batch
_ZERO_DEFAULT = frozenset(("nan_base", "inf_base", "nan_cand", "inf_cand", "cand_nonfinite", "base_nonfinite",
                           "new_requests", "exceeded"))
_NULL_DEFAULT = frozenset(("error", "mode", "oracle_cand_err", "oracle_base_err", "cand_us", "base_us"))
# PostgreSQL wire type of each samples column (binary COPY); hist gets its width per batch
_PG_KIND: dict[str, str] = {
    name: "text" if name in ("error", "mode") else "hist" if name == "hist" else
    "float8" if isinstance(t.samples.c[name].type, Float) else
    "int8" if isinstance(t.samples.c[name].type, BigInteger) else "int4"
    for name in SAMPLE_COLUMNS
}


def sample_values(cols: dict[str, Any], exceeded: np.ndarray, stored_hist: np.ndarray | None = None
                  ) -> dict[str, Any]:
    """The values a batch writes into ``samples``, by column (all but ``batch_id``): numpy arrays, lists of
    str/None, and ``hist`` in its stored form (shadowd.collector.histblob; ``stored_hist`` when already
    encoded). Columns at their default in every row are left out."""
    out: dict[str, Any] = {}
    for name in SAMPLE_COLUMNS[1:]:
        v = exceeded.astype(np.int32) if name == "exceeded" else cols[name]
        if name in _ZERO_DEFAULT and not v.any():
            continue
        if name in _NULL_DEFAULT and (v.count(None) == len(v) if isinstance(v, list) else np.isnan(v).all()):
            continue
        if name == "hist":
            v = stored_hist if stored_hist is not None else histblob.encode_rows(v)
        out[name] = v
    return out


def pg_copy(c: dict[str, Any], n: int, batch_id: int) -> tuple[str, bytes]:
    """PostgreSQL: the ``COPY samples (...) FROM STDIN (FORMAT BINARY)`` of a batch's ``n`` samples (columns
    ``c`` as :func:`sample_values` returns them) and its binary stream."""
    names = ("batch_id", *c)
    quoted = ", ".join(f'"{name}"' for name in names)
    kinds = [(name, f"bytea:{c['hist'].shape[1]}" if name == "hist" else _PG_KIND[name]) for name in names]
    payload = binary_copy(kinds, {**c, "batch_id": np.full(n, batch_id, dtype=np.int64)}, n)
    return f"COPY samples ({quoted}) FROM STDIN (FORMAT BINARY)", payload


def sqlite_plan(c: dict[str, Any], n: int) -> tuple[str, list[str]]:
    """SQLite: the samples' INSERT (``{batch_id}`` in place of the batch id) and the columns its rows bind.

    A number that is the same in every row of the batch (mostly the rank and heads) is written into the
    statement once instead of being bound 4 000 times."""
    literals = {"batch_id": "{batch_id}"}
    bound: list[str] = []
    for name, v in c.items():
        if name != "hist" and not isinstance(v, list) and n and (v == v[0]).all() and np.isfinite(v[0]):
            literals[name] = repr(int(v[0]) if v.dtype.kind in "iu" else float(v[0]))
        else:
            bound.append(name)
    marks = [*literals.values(), *["?"] * len(bound)]
    quoted = ", ".join(f'"{name}"' for name in (*literals, *bound))
    return f"INSERT INTO samples ({quoted}) VALUES ({', '.join(marks)})", bound


def sqlite_rows(c: dict[str, Any], bound: list[str]) -> list[tuple[Any, ...]]:
    """SQLite: one tuple per sample of the ``bound`` columns (``hist``: one bytes per row, made by numpy)."""
    columns: list[list[Any]] = []
    for name in bound:
        v = c[name]
        if name == "hist":
            columns.append(v.view(f"V{v.shape[1]}").reshape(-1).tolist())
        else:
            columns.append(v if isinstance(v, list) else v.tolist())
    return list(zip(*columns, strict=False))  # equal lengths: validated

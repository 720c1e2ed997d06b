"""PostgreSQL's binary COPY format built from numpy columns, without a Python object per value.

A binary COPY stream is a signature, then per row a 16-bit field count and per field a 32-bit
length (-1 for NULL) and the value in network byte order, then a trailer. When every field of a
row has a fixed width the rows form a numpy structured array, so the whole stream is a handful of
vectorised assignments and one ``tobytes``. Variable-width text fields (``error``, ``mode``) are
handled by grouping the rows by their text values: within a group the layout is fixed (in the
normal batch there is one group).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["SIGNATURE", "TRAILER", "binary_copy"]

SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + (0).to_bytes(4, "big") + (0).to_bytes(4, "big")
TRAILER = b"\xff\xff"

#: wire type of each PostgreSQL column type used here
_FIXED = {"int4": ">i4", "int8": ">i8", "float8": ">f8"}


def _text_key(columns: Sequence[tuple[str, str]], values: Mapping[str, Any], n: int) -> tuple[list[Any], Any]:
    texts = [name for name, kind in columns if kind == "text"]
    if not texts:
        return [()], None
    keys = list(zip(*(values[name] for name in texts), strict=True))
    first = keys[0]
    if all(k == first for k in keys):
        return [first], None
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return list(groups), [np.asarray(ix, dtype=np.intp) for ix in groups.values()]


def binary_copy(columns: Sequence[tuple[str, str]], values: Mapping[str, Any], n: int) -> bytes:
    """The ``COPY ... FROM STDIN (FORMAT BINARY)`` stream of ``n`` rows.

    ``columns`` lists (name, kind) in the COPY's column order; kind is ``int4``, ``int8``,
    ``float8`` (numpy arrays of n values), ``bytea:W`` (an n × k array whose rows are W bytes, sent
    as they are in memory) or ``text`` (a list of n str or None). A 32-bit column must have been
    checked to fit; floats keep NaN and ±Inf.
    """
    keys, index = _text_key(columns, values, n)
    parts = [SIGNATURE]
    for g, key in enumerate(keys):
        rows = index[g] if index is not None else None
        texts = iter(key)
        fields: list[tuple[str, Any]] = [("nf", ">i2")]
        assign: list[tuple[str, Any]] = []
        for k, (name, kind) in enumerate(columns):
            if kind == "text":
                text = next(texts)
                if text is None:
                    fields.append((f"l{k}", ">i4"))
                    assign.append((f"l{k}", -1))
                    continue
                data = text.encode()
                fields += [(f"l{k}", ">i4"), (f"v{k}", f"S{len(data)}")] if data else [(f"l{k}", ">i4")]
                assign.append((f"l{k}", len(data)))
                if data:
                    assign.append((f"v{k}", data))
                continue
            col = values[name] if rows is None else values[name][rows]
            if kind.startswith("bytea:"):
                width = int(kind.split(":")[1])
                fields += [(f"l{k}", ">i4"), (f"v{k}", f"V{width}")]
                assign += [(f"l{k}", width), (f"v{k}", np.ascontiguousarray(col).view(f"V{width}").reshape(-1))]
            else:
                fields += [(f"l{k}", ">i4"), (f"v{k}", _FIXED[kind])]
                assign += [(f"l{k}", np.dtype(_FIXED[kind]).itemsize), (f"v{k}", col)]
        m = n if rows is None else len(rows)
        arr = np.empty(m, dtype=np.dtype(fields))
        arr["nf"] = len(columns)
        for name, v in assign:
            arr[name] = v
        parts.append(arr.tobytes())
    parts.append(TRAILER)
    return b"".join(parts)

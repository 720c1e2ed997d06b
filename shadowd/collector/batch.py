"""Validation of one columnar sample batch (see shadowd.wire) into numpy columns.

Every rejection raises :class:`BadBatch` naming the field (``samples.max_abs[17]``) and
what was wrong, before anything is written: a bad batch stores nothing.

Numeric columns arrive as lists or packed (msgpack ``bin``: little-endian int64 / float64, see
shadowd.wire); both become the same numpy arrays. The content digest used for duplicate
detection is computed over those arrays (:func:`columns_digest`), so a batch re-sent as JSON, as
lists or packed is the same content, and no re-encoding of the body is needed.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import orjson

from shadowd.collector import histblob
from shadowd.wire import (
    COLUMNS,
    COUNT_MAX,
    COUNTER_MAX,
    HIST_BINS,
    I32,
    PRODUCER_NOTE_MAX,
    PRODUCER_NOTES,
    PRODUCER_STATS,
    Column,
    samples_digest,
)

__all__ = ["DIGEST_PREFIX", "MAX_SAMPLES", "BadBatch", "ValidBatch", "check_clock", "columns_digest", "parse_batch"]

MAX_SAMPLES = 200_000
_BY_NAME = {c.name: c for c in COLUMNS}
_MODES = {"validate", "on"}
_I64_MAX = 2**63 - 1
#: digests computed over the decoded columns start with this; older ones (sha256 of a msgpack
#: re-encoding of the ``samples`` mapping) have no prefix
DIGEST_PREFIX = "v2:"


class BadBatch(ValueError):
    """A batch that must be rejected; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class ValidBatch:
    """A validated batch: one numpy array (or list of str/None) per column."""

    producer: str
    seq: int
    n: int
    cols: dict[str, Any]
    digest: str
    content_hash: str | None = None
    producer_stats: dict[str, int] = field(default_factory=dict)
    #: the producer's notes (``shadowd.wire.PRODUCER_NOTES``): why its candidate was disabled / fell back
    producer_notes: dict[str, str] = field(default_factory=dict)
    #: the producer's rank as the batch states it (``rank``: stats-only batches; the samples name their own)
    rank: int | None = None
    #: the producer's pipeline stage as the batch states it (0 when absent)
    stage: int = 0
    #: ``hist`` in its stored form (shadowd.collector.histblob), one row per sample
    stored_hist: np.ndarray | None = field(default=None, repr=False, compare=False)
    #: the decoded ``samples`` mapping as received (only for :meth:`legacy_digest`; not sent anywhere)
    raw: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    def legacy_digest(self) -> str | None:
        """The digest an earlier collector stored for this content (msgpack re-encoding), if known."""
        if self.raw is None:
            return None
        return samples_digest(msgpack.packb({k: self.raw[k] for k in sorted(self.raw)}, use_bin_type=True))


def columns_digest(cols: Mapping[str, Any], stored_hist: np.ndarray | None = None) -> str:
    """The content digest of validated columns: sha256 over every column in wire order.

    Numbers are hashed as little-endian int64 / float64 (NaN made canonical), strings as JSON,
    ``hist`` as one width byte and its counts as little-endian unsigned integers of that width (the
    narrowest of 1, 2, 4, 8 bytes that holds the batch's largest count; ``stored_hist`` when given),
    so the digest does not depend on how the batch was encoded.
    """
    h = hashlib.sha256()
    for col in COLUMNS:
        v = cols[col.name]
        h.update(col.name.encode() + b"\0")
        if col.kind == "str":
            h.update(orjson.dumps(v))
            continue
        if col.name == "hist":
            h.update(np.ascontiguousarray(stored_hist if stored_hist is not None else histblob.encode_rows(v)).data)
            continue
        a = np.ascontiguousarray(v, dtype="<f8" if col.kind == "float" else "<i8")
        if col.kind == "float" and (nan := np.isnan(a)).any():
            a = np.where(nan, np.nan, a)
        h.update(len(a).to_bytes(8, "little"))
        h.update(a.data)
    return DIGEST_PREFIX + h.hexdigest()[: 64 - len(DIGEST_PREFIX)]


def _as_array(raw: list[Any]) -> np.ndarray:
    """np.asarray, with ragged or odd input mapped to an object array (the slow, precise path)."""
    try:
        return np.asarray(raw)
    except (ValueError, TypeError, OverflowError):
        return np.empty(0, dtype=object)


def _has_bool(raw: list[Any]) -> bool:
    """Whether a list holds a JSON/msgpack boolean (numpy would silently read ``true`` as 1)."""
    return bool in set(map(type, raw))


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _packed(name: str, raw: bytes, n: int, dtype: str) -> np.ndarray:
    if len(raw) != n * 8:
        raise BadBatch(f"samples.{name}", f"packed column must be {n} × 8 bytes ({n * 8}), got {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype)


def _check_range(name: str, arr: np.ndarray, col: Column) -> None:
    if col.minimum is not None and arr.size and (low := arr < col.minimum).any():
        i = _first_bad(low)
        raise BadBatch(f"samples.{name}[{i}]", f"must be ≥ {col.minimum:g}, got {arr[i]}")
    if col.maximum is not None and arr.size and (high := arr > col.maximum).any():
        i = _first_bad(high)
        raise BadBatch(f"samples.{name}[{i}]", f"must be ≤ {col.maximum:g}, got {arr[i]}")


def _int_column(name: str, raw: list[Any] | bytes, col: Column, n: int) -> np.ndarray:
    if isinstance(raw, bytes):
        arr = _packed(name, raw, n, "<i8")
        _check_range(name, arr, col)
        return arr
    arr = _as_array(raw)
    if not len(raw):  # (numpy makes an empty list a float array: a stats-only batch's empty column)
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1 or _has_bool(raw):
        for i, v in enumerate(raw):
            if isinstance(v, bool) or not isinstance(v, int):
                what = "NaN" if isinstance(v, float) and math.isnan(v) else type(v).__name__
                raise BadBatch(f"samples.{name}[{i}]", f"must be an integer, got {what}")
            if abs(v) > _I64_MAX:
                raise BadBatch(f"samples.{name}[{i}]", f"integer out of range (at most {col.maximum or _I64_MAX:g})")
        raise BadBatch(f"samples.{name}", "must be a list of integers")
    arr = arr.astype(np.int64, copy=False)
    _check_range(name, arr, col)
    return arr


def _float_column(name: str, raw: list[Any] | bytes, col: Column, n: int) -> np.ndarray:
    if isinstance(raw, bytes):
        arr = _packed(name, raw, n, "<f8")
    else:
        arr = _as_array(raw)
        if arr.dtype.kind not in "fiu" or arr.ndim != 1 or _has_bool(raw):
            none_ok = col.nullable or col.nan_ok
            vals = []
            for i, v in enumerate(raw):
                if v is None and none_ok:
                    vals.append(math.nan)
                elif isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise BadBatch(f"samples.{name}[{i}]", f"must be a number, got {type(v).__name__}")
                else:
                    vals.append(float(v))
            arr = np.asarray(vals, dtype=np.float64)
        else:
            arr = arr.astype(np.float64, copy=False)
    nan = np.isnan(arr)
    if not (col.nan_ok or col.nullable) and nan.any():
        raise BadBatch(f"samples.{name}[{_first_bad(nan)}]", "must be a number, got NaN")
    if not col.nan_ok and (inf := np.isinf(arr)).any():
        raise BadBatch(f"samples.{name}[{_first_bad(inf)}]", "must be finite")
    if col.minimum is not None and (low := arr < col.minimum).any():
        i = _first_bad(low)
        raise BadBatch(f"samples.{name}[{i}]", f"must be ≥ {col.minimum:g}, got {arr[i]}")
    if col.maximum is not None and (high := arr > col.maximum).any():
        i = _first_bad(high)
        raise BadBatch(f"samples.{name}[{i}]", f"must be ≤ {col.maximum:g}, got {arr[i]:g}"
                       + (" (seconds since the epoch, not milliseconds)" if name == "ts" else ""))
    return arr


def _str_column(name: str, raw: list[Any]) -> list[str | None]:
    for i, v in enumerate(raw):
        if v is not None and not isinstance(v, str):
            raise BadBatch(f"samples.{name}[{i}]", f"must be a string or null, got {type(v).__name__}")
        if isinstance(v, str) and len(v) > 200:
            raise BadBatch(f"samples.{name}[{i}]", "longer than 200 characters")
        if isinstance(v, str) and "\x00" in v:
            raise BadBatch(f"samples.{name}[{i}]", "must not contain NUL characters")
        if name == "mode" and v is not None and v not in _MODES:
            raise BadBatch(f"samples.{name}[{i}]", f"must be one of {sorted(_MODES)}, got {v!r}")
    return list(raw)


def _hist_column(raw: list[Any] | bytes, n: int) -> np.ndarray:
    if isinstance(raw, bytes):  # packed form: n × HIST_BINS little-endian int64 (what the hook sends)
        if len(raw) != n * HIST_BINS * 8:
            raise BadBatch("samples.hist", f"packed histogram must be {n} × {HIST_BINS} int64 ({n * HIST_BINS * 8} "
                                           f"bytes), got {len(raw)} bytes")
        arr = np.frombuffer(raw, dtype="<i8").reshape(n, HIST_BINS)
        _check_hist_counts(arr)
        return arr
    arr = _as_array(raw) if raw else np.zeros((0, HIST_BINS), dtype=np.int64)
    if (arr.dtype.kind not in "iu" or arr.shape != (n, HIST_BINS)
            or any(_has_bool(row) for row in raw if isinstance(row, list))):
        for i, row in enumerate(raw):
            if not isinstance(row, list) or len(row) != HIST_BINS:
                raise BadBatch(f"samples.hist[{i}]", f"must be a list of {HIST_BINS} integer counts")
            for v in row:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise BadBatch(f"samples.hist[{i}]", f"counts must be integers, got {type(v).__name__}")
        raise BadBatch("samples.hist", f"must be {n} lists of {HIST_BINS} integer counts")
    arr = arr.astype(np.int64, copy=False)
    _check_hist_counts(arr)
    return arr


def _check_hist_counts(arr: np.ndarray) -> None:
    if (low := arr < 0).any():
        raise BadBatch(f"samples.hist[{int(np.argwhere(low)[0][0])}]", "counts must be ≥ 0")
    if (high := arr > COUNT_MAX).any():
        raise BadBatch(f"samples.hist[{int(np.argwhere(high)[0][0])}]", f"counts must be ≤ {COUNT_MAX}")


def _producer_fields(raw: Any, name: str, known: tuple[str, ...], ok: Callable[[Any], bool], want: str
                     ) -> dict[str, Any]:
    # an optional object of known fields, each value checked by ``ok`` (``want`` says what it must be)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise BadBatch(name, "must be an object")
    for k, v in raw.items():
        if k not in known:
            raise BadBatch(f"{name}.{k}", f"unknown field (known: {', '.join(known)})")
        if not ok(v):
            raise BadBatch(f"{name}.{k}", f"must be {want}")
    return dict(raw)


def _producer_stats(raw: Any) -> dict[str, int]:
    # counters (COUNTER_MAX keeps them exact as the float64 of /metrics and far inside the database's int64)
    return _producer_fields(raw, "producer_stats", PRODUCER_STATS,
                            lambda v: not isinstance(v, bool) and isinstance(v, int) and 0 <= v <= COUNTER_MAX,
                            f"a non-negative integer, at most {COUNTER_MAX}")


def _producer_notes(raw: Any) -> dict[str, str]:
    notes = _producer_fields(raw, "producer_notes", PRODUCER_NOTES,
                             lambda v: isinstance(v, str) and len(v) <= PRODUCER_NOTE_MAX and "\x00" not in v,
                             f"a string of at most {PRODUCER_NOTE_MAX} characters, without NUL characters")
    return {k: v for k, v in notes.items() if v}


def _empty(col: Column) -> list[Any] | bytes:
    # a stats-only batch's column: no entries, in the packed form where there is one (typed as the column)
    return [] if col.kind == "str" else b""


def parse_batch(body: Any) -> ValidBatch:
    """Validate a decoded batch (a mapping) and return its columns."""
    if not isinstance(body, Mapping):
        raise BadBatch("body", "must be an object with producer, seq and samples")
    producer = body.get("producer")
    if not isinstance(producer, str) or not 1 <= len(producer) <= 64 or "\x00" in producer:
        raise BadBatch("producer", "must be a string of 1 to 64 characters, without NUL characters")
    seq = body.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= _I64_MAX:
        raise BadBatch("seq", "must be a non-negative integer")
    content_hash = body.get("content_hash")
    if content_hash is not None and (not isinstance(content_hash, str) or len(content_hash) > 128):
        raise BadBatch("content_hash", "must be a string of at most 128 characters")
    rank = body.get("rank")  # (wire: a stats-only batch's rank, for a producer whose samples were never stored)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= I32):
        raise BadBatch("rank", f"must be an integer between 0 and {I32}")
    stage = body.get("stage", 0)  # (wire: a pipeline stage's producer states its stage; absent: 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= I32:
        raise BadBatch("stage", f"must be an integer between 0 and {I32}")
    for key in body:
        if key not in {"producer", "seq", "samples", "content_hash", "producer_stats", "producer_notes", "rank",
                       "stage"}:
            raise BadBatch(str(key), "unknown field")
    stats = _producer_stats(body.get("producer_stats"))
    notes = _producer_notes(body.get("producer_notes"))
    raw = body.get("samples")
    if not isinstance(raw, Mapping):
        raise BadBatch("samples", "must be an object mapping column names to lists")
    for name in raw:
        if name not in _BY_NAME:
            raise BadBatch(f"samples.{name}", "unknown column")
    # a stats-only batch (wire: an idle producer reporting figures that changed since its last batch): no
    # columns, or only empty ones, and producer figures or notes to store
    stats_only = all(isinstance(v, (list, bytes)) and not v for v in raw.values()) and bool(stats or notes)
    lengths: dict[str, int] = {}
    for col in COLUMNS:
        values = raw.get(col.name, _empty(col) if stats_only else None)
        if values is None:
            if col.required:
                raise BadBatch(f"samples.{col.name}", "missing required column")
            continue
        if isinstance(values, bytes):
            if col.kind == "str":
                raise BadBatch(f"samples.{col.name}", "must be a list")
            if col.name != "hist":  # packed: its exact length is checked when it is decoded
                lengths[col.name] = len(values) // 8
            continue
        if not isinstance(values, list):
            raise BadBatch(f"samples.{col.name}", "must be a list")
        lengths[col.name] = len(values)
    # every column needs the same number of entries: the most common count is the batch's, and the first
    # column that differs from it is the one named
    n = Counter(lengths.values()).most_common(1)[0][0] if lengths else None  # (ties: the first column's count)
    for name, k in lengths.items():
        if k != n:
            raise BadBatch(f"samples.{name}", f"has {k} entries, the other columns {n}")
    if not n and not stats_only:
        raise BadBatch("samples", "batch holds no samples (a batch without samples must carry producer_stats or "
                                  "producer_notes)")
    n = n or 0
    if n > MAX_SAMPLES:
        raise BadBatch("samples", f"{n} samples, at most {MAX_SAMPLES} per batch")

    cols: dict[str, Any] = {}
    for col in COLUMNS:
        values = raw.get(col.name, _empty(col) if stats_only else None)
        if values is None:
            continue
        if col.name == "hist":
            cols["hist"] = _hist_column(values, n)
        elif col.kind == "int" and col.nullable and not isinstance(values, bytes):
            cols[col.name] = _int_column(col.name, [0 if v is None else v for v in values], col, n)
        elif col.kind == "int":
            cols[col.name] = _int_column(col.name, values, col, n)
        elif col.kind == "float":
            cols[col.name] = _float_column(col.name, values, col, n)
        else:
            cols[col.name] = _str_column(col.name, values)
    for name in ("oracle_cand_err", "oracle_base_err", "cand_us", "base_us"):
        cols.setdefault(name, np.full(n, np.nan))
    cols.setdefault("new_requests", np.zeros(n, dtype=np.int64))
    cols.setdefault("error", [None] * n)
    cols.setdefault("mode", [None] * n)
    stored_hist = histblob.encode_rows(cols["hist"])
    return ValidBatch(
        producer=producer,
        seq=seq,
        n=n,
        cols=cols,
        digest=columns_digest(cols, stored_hist),
        content_hash=content_hash,
        producer_stats=stats,
        producer_notes=notes,
        rank=rank,
        stage=stage,
        stored_hist=stored_hist,
        raw=raw,
    )


def check_clock(b: ValidBatch, received_at: float, max_ahead_s: float) -> None:
    """Refuse a batch holding a sample time more than ``max_ahead_s`` after ``received_at`` (the collector's
    clock when the batch arrived): a producer whose clock runs ahead would put its samples in the future and
    skew every recency window. Past times stay accepted (a spooled batch is replayed hours late)."""
    ts = b.cols["ts"]
    if (ahead := ts > received_at + max_ahead_s).any():
        i = _first_bad(ahead)
        raise BadBatch(f"samples.ts[{i}]", f"{ts[i]:.3f} is {ts[i] - received_at:.0f} s ahead of the collector's "
                                           f"clock (at most {max_ahead_s:g} s, SHADOWD_MAX_CLOCK_SKEW_S): check the "
                                           "producer's clock")

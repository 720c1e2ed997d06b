"""The wire format between producers (the hook) and the collector.

A *sample* is the diff statistics of one shadowed call: one (run, rank, layer, call).
Producers send samples in **columnar batches**: ``samples`` maps each column name to a
list with one entry per sample, so a batch of thousands of samples is a handful of
arrays rather than thousands of small objects (cheap to encode, cheap to validate).

A batch is a mapping::

    {
      "producer": "4f9c...",        # random id per process: a restarted rank is a new producer
      "seq": 17,                    # per-producer sequence number, 0, 1, 2, ...
      "content_hash": "sha256...",  # optional; the collector computes its own digest
      "producer_stats": {...},      # optional: spool depth, drops, fallback state (PRODUCER_STATS)
      "producer_notes": {...},      # optional: why the candidate was disabled / fell back (PRODUCER_NOTES)
      "rank": 3,                    # optional, stats-only batches: the producer's rank
      "stage": 1,                   # optional: the producer's pipeline stage (PP rank); absent means 0
      "samples": {"layer": [...], "rank": [...], ...},
    }

It travels as msgpack (``application/msgpack``, what the hook sends) or JSON.

**Stats-only batches.** A batch whose ``samples`` is ``{}`` (or whose columns are all empty) carries only
``producer_stats`` / ``producer_notes``: an idle producer's figures that changed since its last batch (samples it
dropped while the collector was away, reported after the traffic stopped). It takes a seq like any batch (the
producer's sequence has no gap; a replay is a duplicate) and adds nothing to the run's samples or rollups. The
collector files the figures under the rank of the producer's earlier samples; a producer none of whose samples it
stored (all dropped on the way) is filed under the batch's ``rank`` (422 naming ``rank`` when it is not below the
run's ``tp_size``), and without one gets a 422 naming ``producer``. A batch with neither samples nor figures is
refused as before.

**Pipeline stages.** Under pipeline parallelism every stage runs other layers with the same TP ranks, so a
producer is known by (stage, rank). A producer of stage s > 0 states ``"stage": s`` in every batch; the collector
keeps each stage's producer figures (drops, fallback, disabled candidate, spool depth, clock offset) apart
instead of letting the latest producer of a rank hide another stage's. Samples carry no stage: their layer
places them.

**Packed columns.** In msgpack, a numeric column may also travel *packed*: one ``bin`` value
holding the n entries as little-endian int64 (``int`` columns) or float64 (``float`` columns),
and ``hist`` as n × HIST_BINS little-endian int64. A packed float column says "missing" with
NaN, a packed int column with 0 (exactly what a ``None`` in a list means). The collector
decodes packed columns with one ``numpy.frombuffer`` each; lists stay accepted everywhere, and
the two forms of the same values are the same content (same rows, same duplicate digest).
:func:`pack_column` builds them with the standard library only (the hook uses it).
This module is imported by both sides: it depends on nothing but msgpack.
"""

from __future__ import annotations

import hashlib
import math
import operator
import sys
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

__all__ = [
    "COLUMNS",
    "COUNTER_MAX",
    "COUNT_MAX",
    "DEVICE_US_MAX",
    "HIST_BINS",
    "HIST_EXP_MAX",
    "HIST_EXP_MIN",
    "MSGPACK",
    "PRODUCER_NOTES",
    "PRODUCER_NOTE_MAX",
    "PRODUCER_STATS",
    "SENT_AT_HEADER",
    "SPEC_MODES",
    "TS_MAX",
    "Column",
    "decode_msgpack",
    "encode_msgpack",
    "hist_bin_of",
    "pack_column",
    "pack_hist",
    "prefix_bucket_of",
    "sample_problem",
    "samples_digest",
]

MSGPACK = "application/msgpack"
#: HTTP header of every batch post: the producer's wall clock (unix seconds) when it sent this attempt. A spooled
#: batch's samples are legitimately old, but this stamp is new on every attempt, so the collector can tell a
#: producer whose clock is off (``shadowd_producer_clock_offset_seconds``) from a late delivery.
SENT_AT_HEADER = "X-Shadowd-Sent-At"

#: log2 histogram of |diff| per call: bin 0 counts exact zeros, bins 1..38 count
#: |d| with floor(log2|d|) = HIST_EXP_MIN .. HIST_EXP_MAX (clipped at both ends),
#: and the last bin counts non-finite differences.
HIST_EXP_MIN = -32
HIST_EXP_MAX = 5
HIST_BINS = (HIST_EXP_MAX - HIST_EXP_MIN + 1) + 2

Kind = Literal["int", "float", "str"]


@dataclass(frozen=True)
class Column:
    """One column of a sample batch.

    ``kind`` is the value type; ``required`` columns must be present; ``nullable``
    columns may hold ``None`` (a float column stores it as NaN); ``nan_ok`` float columns
    may carry NaN/Inf (an error statistic over a non-finite output is NaN, and the judge
    treats that as a failure, so it must reach the collector intact); ``minimum`` is the
    smallest allowed value of a number, ``maximum`` the largest (``I32``, ``BUCKETED_MAX``, ``COUNT_MAX``,
    ``COUNTER_MAX``, ``TS_MAX``, ``DEVICE_US_MAX``: bounds that keep the collector's rollups exact and in range).
    """

    name: str
    kind: Kind
    doc: str
    required: bool = True
    nullable: bool = False
    nan_ok: bool = False
    minimum: float | None = 0
    maximum: float | None = None


I32 = 2**31 - 1  # the largest value of a 32-bit integer column
#: batch size and tree size are rolled up by their power-of-two bucket (a 32-bit column too): 2^30 is the largest
#: bucket that fits, so the largest value
BUCKETED_MAX = 2**30
#: bounds that keep every sum and time bucket of the collector's rollups exact and in range: counts of
#: elements (2^48, far above any output), step and call counters (2^53: exact as float64) and unix times
#: in seconds before 2100 (a time in milliseconds, ~1.7e12, is refused rather than stored in year 55000)
COUNT_MAX = 2**48
COUNTER_MAX = 2**53
TS_MAX = 4_102_444_800.0
#: the longest device time of one call, microseconds (an hour): the timing rollups' sums and ratios stay finite
DEVICE_US_MAX = 3.6e9

COLUMNS: tuple[Column, ...] = (
    Column("layer", "int", "layer id (0-based); must be below the run's num_layers", maximum=I32),
    Column("rank", "int", "the worker's rank (TP rank; replica × TP size + TP rank under --dp-size); must be below "
           "the run's tp_size", maximum=I32),
    Column("step", "int", "verify step id, equal on every rank and layer of one step", maximum=COUNTER_MAX),
    Column("call", "int", "per-producer call counter", maximum=COUNTER_MAX),
    Column("ts", "float", "unix time of the call, seconds (before 2100)", maximum=TS_MAX),
    Column("batch_size", "int", "requests in the verify batch (padding excluded)", minimum=1,
           maximum=BUCKETED_MAX),
    Column("draft_tokens", "int", "largest tree size T in the batch", minimum=1, maximum=BUCKETED_MAX),
    Column("prefix_len", "int", "longest prefix length L in the batch", maximum=I32),
    Column("heads", "int", "query heads on this rank", minimum=1, maximum=I32),
    Column("numel", "int", "output elements compared", maximum=COUNT_MAX),
    Column("max_abs", "float", "max |candidate - baseline|", nan_ok=True),
    Column("mean_abs", "float", "mean |candidate - baseline|", nan_ok=True),
    Column("max_rel", "float", "max |c - b| / max(|b|, tiny)", nan_ok=True),
    Column("rel_l2", "float", "||c - b|| / ||b||", nan_ok=True),
    Column("cos_diff", "float", "sum (c-b)^2 / sum (c^2 + b^2)", nan_ok=True),
    Column("out_scale", "float", "max |baseline| over finite elements", nan_ok=True),
    Column("nan_base", "int", "NaN elements in the baseline output", maximum=COUNT_MAX),
    Column("inf_base", "int", "Inf elements in the baseline output", maximum=COUNT_MAX),
    Column("nan_cand", "int", "NaN elements in the candidate output", maximum=COUNT_MAX),
    Column("inf_cand", "int", "Inf elements in the candidate output", maximum=COUNT_MAX),
    Column("cand_nonfinite", "int", "positions non-finite in the candidate only (a hard failure)",
           maximum=COUNT_MAX),
    Column("base_nonfinite", "int", "positions non-finite in the baseline only (a baseline event)",
           maximum=COUNT_MAX),
    Column("hist", "int", f"list of {HIST_BINS} counts: log2 histogram of |diff| (see HIST_*); in msgpack also "
           f"packed: one bin value of n × {HIST_BINS} little-endian int64"),
    Column("error", "str", "candidate failure marker: exception:<Type>, shape, dtype, candidate_flag:0x<bits>, ...",
           required=False,
           nullable=True),
    Column("mode", "str", "hook mode of the call: validate or on", required=False, nullable=True),
    Column("oracle_cand_err", "float", "max |candidate - fp32 oracle|", required=False, nullable=True,
           nan_ok=True),
    Column("oracle_base_err", "float", "max |baseline - fp32 oracle|", required=False, nullable=True,
           nan_ok=True),
    Column("cand_us", "float", "candidate device time, microseconds (at most an hour)", required=False,
           nullable=True, maximum=DEVICE_US_MAX),
    Column("base_us", "float", "baseline device time, microseconds (at most an hour)", required=False,
           nullable=True, maximum=DEVICE_US_MAX),
    Column("new_requests", "int", "requests first seen in this step (counted on rank 0, layer 0)",
           required=False, nullable=True, maximum=I32),
)

SPEC_MODES = ("off", "validate", "on")

#: Optional per-batch producer figures (all integers from 0 to COUNTER_MAX): health, and cumulative
#: speculative-decoding counters per mode.
PRODUCER_STATS: tuple[str, ...] = (
    "spool_depth",     # batches waiting in the on-disk spool
    "dropped",         # samples dropped since start (spool bound hit)
    "rejected",        # samples given up since start: left out as invalid, or in a batch the collector refused
    "fallback",        # 1 when an on-mode hook has fallen back to the baseline
    "disabled",        # 1 when the candidate is disabled for the process
    "device_errors",   # kernel-side error flags (out-of-range indices) seen
    # on mode, cumulative: calls on a shape bucket the verdict (and the static limits) cover, and calls on one they
    # do not, which the baseline served (graph replays as of the latest record the hook drained)
    "on_covered_calls",
    "on_uncovered_calls",
    # SGLang's speculative decoding, cumulative per mode in effect (off / validate / on): accepted
    # tokens, request-steps (accept length = tokens / request-steps) and verify passes
    *(f"spec_{what}_{mode}" for mode in ("off", "validate", "on") for what in ("accept_tokens", "req_steps", "passes")),
)


#: Optional per-batch producer notes (strings of at most PRODUCER_NOTE_MAX characters): why the process's
#: candidate was disabled and why on mode fell back, in the hook's words (the first reason is kept).
PRODUCER_NOTES: tuple[str, ...] = ("disabled_reason", "fallback_reason")
PRODUCER_NOTE_MAX = 300


def hist_bin_of(abs_diff: float) -> int:
    """The |diff| histogram bin of one value (the GPU kernel computes the same)."""
    if abs_diff == 0.0:
        return 0
    if not math.isfinite(abs_diff):
        return HIST_BINS - 1
    exp = math.floor(math.log2(abs_diff))
    return 1 + min(max(exp, HIST_EXP_MIN), HIST_EXP_MAX) - HIST_EXP_MIN


def prefix_bucket_of(prefix_len: int) -> int:
    """Prefix-length bucket: 0 for L = 0, else ceil(log2(L + 1)); 200k tokens is bucket 18."""
    return int(prefix_len).bit_length()


def _le(a: array) -> bytes:
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def pack_column(kind: Kind, values: Iterable[Any]) -> bytes:
    """The packed form of a numeric column: little-endian int64 (``int``) or float64 (``float``).

    ``None`` becomes 0 in an int column and NaN in a float column (what the collector makes of a
    ``None`` in a list); NaN and ±Inf floats are kept bit for bit.
    """
    if kind == "int":
        return _le(array("q", [0 if v is None else v for v in values]))
    if kind == "float":
        return _le(array("d", [math.nan if v is None else v for v in values]))
    raise ValueError(f"only int and float columns can be packed, not {kind}")


def pack_hist(rows: Iterable[Iterable[int]]) -> bytes:
    """The packed form of ``hist``: every row's HIST_BINS counts as little-endian int64, row after row."""
    flat = array("q")
    for row in rows:
        before = len(flat)
        flat.extend(row)
        if len(flat) - before != HIST_BINS:
            raise ValueError(f"a histogram has {HIST_BINS} bins, got {len(flat) - before}")
    return _le(flat)


def sample_problem(sample: Mapping[str, Any], num_layers: int | None = None) -> tuple[str, str] | None:
    """The first field of one sample (a mapping of column name to value, as the hook builds them) that the
    collector would refuse once the sample is sent as the hook's streamer sends it (numeric columns packed), and
    why — ``None`` when it would take it. A producer checks its samples with this before batching them, so that
    one bad sample (a caller's negative prefix length, a layer beyond the run's ``num_layers``) is refused alone
    instead of taking a whole batch with it (the collector refuses a batch as a whole)."""
    for name, kind, required, keep_nan, lo, hi in _CHECKS:
        v = sample.get(name)
        if v is None:
            if required:
                return name, "missing"
            continue
        if kind == "int":
            try:
                v = operator.index(v)
            except TypeError:
                return name, f"must be an integer, got {type(v).__name__}"
        elif kind == "float":
            if isinstance(v, (str, bytes)) or not hasattr(v, "__float__"):
                return name, f"must be a number, got {type(v).__name__}"
            v = float(v)
            if v != v or v in (math.inf, -math.inf):
                if keep_nan:
                    continue
                return name, f"must be finite, got {v}"
        elif kind == "hist":
            try:
                counts = array("q", v)
            except (TypeError, OverflowError):
                return name, f"must be {HIST_BINS} integer counts"
            if len(counts) != HIST_BINS:
                return name, f"must be {HIST_BINS} counts, got {len(counts)}"
            if min(counts) < 0 or max(counts) > COUNT_MAX:
                return name, f"counts must be in [0, {COUNT_MAX}]"
            continue
        else:
            if not isinstance(v, str) or len(v) > 200 or "\x00" in v:
                return name, "must be a string of at most 200 characters without NUL"
            if name == "mode" and v not in SPEC_MODES[1:]:
                return name, f"must be one of {list(SPEC_MODES[1:])}, got {v!r}"
            continue
        if lo is not None and v < lo:
            return name, f"must be ≥ {lo:g}, got {v}"
        if hi is not None and v > hi:
            return name, f"must be ≤ {hi:g}, got {v}"
    if num_layers is not None and operator.index(sample["layer"]) >= num_layers:
        return "layer", f"{sample['layer']} is not below the run's num_layers {num_layers}"
    return None


#: what :func:`sample_problem` checks per column: name, kind ("hist" for the histogram), required, NaN / Inf
#: kept (a nan_ok column; a nullable one sends them as null), minimum, maximum
_CHECKS = tuple((c.name, "hist" if c.name == "hist" else c.kind, c.required, c.nan_ok or c.nullable, c.minimum,
                 c.maximum) for c in COLUMNS)


def encode_msgpack(batch: Mapping[str, Any]) -> bytes:
    """Encode a batch for the wire."""
    return bytes(msgpack.packb(batch, use_bin_type=True))


def decode_msgpack(body: bytes) -> Any:
    """Decode a msgpack body (raises ValueError-derived errors on garbage)."""
    return msgpack.unpackb(body, raw=False, strict_map_key=True)


def samples_digest(canonical: bytes) -> str:
    """The digest that identifies a batch's content for duplicate detection."""
    return hashlib.sha256(canonical).hexdigest()

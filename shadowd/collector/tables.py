"""The collector's schema (SQLAlchemy Core). Changes go through Alembic (migrations/) only.

Rollup tables are clustered on their keys (WITHOUT ROWID on SQLite): every write is an
upsert by key. Raw ``samples`` are kept for a retention period; everything the read API, the metrics and
the judge use lives in the rollup tables, which ingest keeps current with atomic
increments (``INSERT ... ON CONFLICT DO UPDATE SET n = n + excluded.n``), so two
collectors writing into one PostgreSQL lose nothing and no summary scans raw samples.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

__all__ = [
    "CELL_KEY",
    "batches",
    "cells",
    "errors",
    "evaluations",
    "hists",
    "metadata",
    "producers",
    "ranks",
    "runs",
    "samples",
    "steps",
    "timeslots",
]

metadata = MetaData()

# PostgreSQL: tables updated by every batch keep half of each page free, so updates stay on the page
_HOT: dict[str, Any] = {"postgresql_with": {"fillfactor": 50}}

# SQLite only auto-increments an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def _counter(name: str) -> Column[int]:
    return Column(name, BigInteger, nullable=False, server_default="0")


def _fmax(name: str) -> Column[float]:
    return Column(name, Float, nullable=False, server_default="0")


runs = Table(
    "runs",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("run_key", String(200), nullable=False, unique=True),
    Column("model", String(200), nullable=False),
    Column("num_layers", Integer, nullable=False),
    Column("tp_size", Integer, nullable=False),
    Column("gpu_name", String(200), nullable=False, server_default=""),
    Column("gpu_arch", String(50), nullable=False, server_default=""),
    Column("driver", String(100), nullable=False, server_default=""),
    Column("sglang_version", String(50), nullable=False, server_default=""),
    Column("candidate_name", String(200), nullable=False),
    Column("candidate_fingerprint", String(200), nullable=False),
    Column("baseline_name", String(200), nullable=False),
    Column("baseline_fingerprint", String(200), nullable=False),
    Column("labels", JSON, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("created_at", Float, nullable=False),
    # the kill switch: NULL (no override), "validate" or "off"; producers pick it up
    Column("mode_override", String(16), nullable=True),
    Column("policy_hash", String(64), nullable=False, server_default=""),
    _counter("n_samples"),
    _counter("n_batches"),
    _counter("n_duplicates"),
    _counter("n_errors"),
    _counter("n_cand_nonfinite"),
    _counter("n_base_nonfinite"),
    _counter("n_exceed"),
    _counter("n_requests"),
    _counter("n_oracle"),
    Column("first_sample_ts", Float, nullable=True),
    Column("last_sample_ts", Float, nullable=True),
    Column("last_ingest_at", Float, nullable=True),
    **_HOT
)

producers = Table(
    "producers",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("producer", String(64), primary_key=True),
    Column("rank", Integer, nullable=False, server_default="0"),
    # the pipeline stage (PP rank): stages share TP ranks, so a producer's figures are kept per (stage, rank)
    Column("stage", Integer, nullable=False, server_default="0"),
    Column("max_seq", BigInteger, nullable=False),
    _counter("batches"),
    _counter("gaps"),
    _counter("samples"),
    Column("first_seen", Float, nullable=False),
    Column("last_seen", Float, nullable=False),
    _counter("spool_depth"),
    _counter("dropped"),
    # samples the producer gave up: left out of their batch as invalid, or in a batch the collector refused
    _counter("rejected"),
    _counter("fallback"),
    _counter("disabled"),
    _counter("device_errors"),
    # on mode: calls on a shape the verdict covers, and on one it does not (the baseline served them)
    _counter("on_covered_calls"),
    _counter("on_uncovered_calls"),
    # why the producer's candidate was disabled / on mode fell back (its first reason; NULL: none reported)
    Column("disabled_reason", String(300)),
    Column("fallback_reason", String(300)),
    *(_counter(f"spec_{what}_{mode}") for mode in ("off", "validate", "on")
      for what in ("accept_tokens", "req_steps", "passes")),
    sqlite_with_rowid=False,
    **_HOT
)

# one row per stored batch: the (producer, seq) claim for duplicate detection, and what its samples
# have in common (run, producer). ``max_ts`` is its newest sample time: retention deletes a batch's
# samples once it is older than the window. On SQLite ``first_id``..``last_id`` is the rowid range of
# its samples (one transaction inserts them one after another), which retention deletes by; NULL once
# deleted. Rows with seq -1 stand for the samples stored before migration 0003.
batches = Table(
    "batches",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("producer", String(64), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("digest", String(64), nullable=False),
    Column("n_samples", Integer, nullable=False),
    Column("received_at", Float, nullable=False),
    Column("max_ts", Float, nullable=False),
    Column("first_id", BigInteger, nullable=True),
    Column("last_id", BigInteger, nullable=True),
    UniqueConstraint("run_id", "producer", "seq", name="uq_batches_run_producer_seq"),
)


def _count(name: str, kind: type[Integer] = BigInteger) -> Column[int]:
    return Column(name, kind, nullable=False, server_default="0")


# raw samples: one row per (run, rank, layer, call). Run and producer are the batch's
# (``batch_id`` references batches.id; no foreign key, so that inserting a row checks nothing).
# Counts default to 0 and optional values to NULL: ingest leaves out a column that is 0 / absent
# in the whole batch. ``hist`` is the |diff| histogram in the form of shadowd.collector.histblob.
# No secondary index on SQLite (retention deletes rowid ranges, see ``batches``); PostgreSQL, whose
# ids interleave between concurrent collectors, indexes ``batch_id`` instead.
samples = Table(
    "samples",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("batch_id", BigInteger, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("layer", Integer, nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("call", BigInteger, nullable=False),
    Column("ts", Float, nullable=False),
    Column("batch_size", Integer, nullable=False),
    Column("draft_tokens", Integer, nullable=False),
    Column("prefix_len", Integer, nullable=False),
    Column("heads", Integer, nullable=False),
    Column("numel", BigInteger, nullable=False),
    # statistics are nullable: SQLite stores NaN as NULL (the rollups count NaN separately)
    Column("max_abs", Float),
    Column("mean_abs", Float),
    Column("max_rel", Float),
    Column("rel_l2", Float),
    Column("cos_diff", Float),
    Column("out_scale", Float),
    _count("nan_base"),
    _count("inf_base"),
    _count("nan_cand"),
    _count("inf_cand"),
    _count("cand_nonfinite"),
    _count("base_nonfinite"),
    Column("hist", LargeBinary, nullable=False),
    Column("error", String(200)),
    Column("mode", String(16)),
    Column("oracle_cand_err", Float),
    Column("oracle_base_err", Float),
    Column("cand_us", Float),
    Column("base_us", Float),
    Column("new_requests", Integer, nullable=True, server_default="0"),
    _count("exceeded", Integer),
    Index("ix_samples_batch", "batch_id").ddl_if(dialect="postgresql"),
)

# shape-bucket columns shared by ``cells``
CELL_KEY = ("bs_bucket", "t_bucket", "prefix_bucket", "heads")

_cell_counters = (
    "n",
    "n_exceed",
    "n_error",
    "n_cand_nonfinite",
    "n_base_nonfinite",
    "n_nan_stat",
    "numel",
    "n_oracle",
    "n_timed",
    "n_nan_unexplained",
)
_cell_sums = ("sum_max_abs", "sum_rel_l2", "sum_cos_diff", "sum_scaled", "sum_cand_us", "sum_base_us")
_cell_maxes = ("max_max_abs", "max_rel_l2", "max_cos_diff", "max_max_rel", "max_scaled",
               "max_oracle_cand", "max_oracle_base", "max_oracle_ratio")

cells = Table(
    "rollup_cells",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("layer", Integer, primary_key=True),
    *(Column(k, Integer, primary_key=True) for k in CELL_KEY),
    *(_counter(c) for c in _cell_counters),
    *(_fmax(c) for c in _cell_sums),
    *(_fmax(c) for c in _cell_maxes),
    Column("first_ts", Float, nullable=False),
    Column("last_ts", Float, nullable=False),
    sqlite_with_rowid=False,
    **_HOT
)

timeslots = Table(
    "rollup_time",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("layer", Integer, primary_key=True),
    Column("t", BigInteger, primary_key=True),  # bucket start, unix seconds
    *(_counter(c) for c in _cell_counters),
    *(_fmax(c) for c in _cell_sums),
    *(_fmax(c) for c in _cell_maxes),
    sqlite_with_rowid=False,
    **_HOT
)

# histograms of per-call statistics, quarter-octave bins (see rollups.stat_bins)
hists = Table(
    "rollup_hist",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("layer", Integer, primary_key=True),
    Column("stat", String(16), primary_key=True),
    Column("bin", Integer, primary_key=True),
    _counter("count"),
    sqlite_with_rowid=False,
    **_HOT
)

steps = Table(
    "rollup_steps",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", BigInteger, primary_key=True),
    _counter("n_calls"),
    Column("exceeded", Integer, nullable=False, server_default="0"),
    Column("first_ts", Float, nullable=False),
    sqlite_with_rowid=False,
    **_HOT
)

# compared samples per (TP rank, layer): coverage needs every rank of the run. ``n`` counts calls that compared
# something (numel > 0, or a candidate error or non-finite output); ``n_empty`` those that compared nothing
# (numel 0 and no error: every baseline value non-finite, say), which are stored but are no evidence
ranks = Table(
    "rollup_ranks",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("rank", Integer, primary_key=True),
    Column("layer", Integer, primary_key=True),
    _counter("n"),
    _counter("n_empty"),
    Column("first_ts", Float, nullable=False),
    Column("last_ts", Float, nullable=False),
    sqlite_with_rowid=False,
    **_HOT
)

# candidate errors per kind (the samples' ``error`` marker: exception:<Type>, shape, candidate_flag:0x.., ...)
errors = Table(
    "rollup_errors",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("error", String(200), primary_key=True),
    _counter("n"),
    Column("first_ts", Float, nullable=False),
    Column("last_ts", Float, nullable=False),
    sqlite_with_rowid=False,
)

evaluations = Table(
    "evaluations",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("candidate_fingerprint", String(200), nullable=False),
    Column("at", Float, nullable=False),
    Column("verdict", String(32), nullable=False),
    Column("passing", Integer, nullable=False),  # this evaluation's criteria all passed
    Column("policy_hash", String(64), nullable=False),
    Column("report", Text, nullable=False),  # JSON
    Index("ix_evaluations_run_at", "run_id", "at"),
)

"""Writes: run registration and batch ingest, each one transaction.

Ingest of a batch: look up the run, check layers and ranks against it, claim the
(producer, seq) slot (a duplicate with the same digest is answered as such, a different
digest is a conflict), bulk-insert the raw samples (executemany on SQLite, COPY on
PostgreSQL), then apply the rollup deltas with atomic upserts. Any error rolls the whole
batch back.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, Table, case, func, literal, select, update
from sqlalchemy.dialects import postgresql, sqlite

from shadowd.collector import tables as t
from shadowd.collector.batch import BadBatch, ValidBatch
from shadowd.collector.rollups import COUNTERS, MAXES, SUMS, Deltas, Rows, compute_deltas
from shadowd.judge.policy import Policy
from shadowd.wire import PRODUCER_STATS

__all__ = ["Conflict", "IngestResult", "Store", "UnknownRun"]


class UnknownRun(LookupError):
    """No run with this id."""

    def __init__(self, run_id: int | str) -> None:
        super().__init__(f"run {run_id} does not exist")
        self.run_id = run_id


class Conflict(Exception):
    """The request contradicts what is stored (``field`` names what)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class IngestResult:
    run_id: int
    accepted: int
    duplicate: bool
    exceeded: int = 0
    cand_nonfinite: int = 0
    deltas: Deltas | None = None
    gap: int = 0
    mode_override: str | None = None


SAMPLE_COLUMNS = (
    "run_id", "producer", "rank", "layer", "step", "call", "ts", "batch_size", "draft_tokens", "prefix_len",
    "heads", "numel", "max_abs", "mean_abs", "max_rel", "rel_l2", "cos_diff", "out_scale", "nan_base",
    "inf_base", "nan_cand", "inf_cand", "cand_nonfinite", "base_nonfinite", "hist", "error", "mode",
    "oracle_cand_err", "oracle_base_err", "cand_us", "base_us", "new_requests", "exceeded",
)

RUN_FIELDS = (
    "model", "num_layers", "tp_size", "gpu_name", "gpu_arch", "driver", "sglang_version", "candidate_name",
    "candidate_fingerprint", "baseline_name", "baseline_fingerprint", "labels", "started_at",
)
# a run key re-used with any of these different is a different run: 409
RUN_IDENTITY = ("num_layers", "tp_size", "candidate_fingerprint", "baseline_fingerprint", "model")


class Store:
    """All database access of the collector."""

    def __init__(self, engine: Engine, policy: Policy, time_bucket_s: int = 60, store_samples: bool = True):
        self.engine = engine
        self.policy = policy
        self.policy_hash = policy.hash()
        self.time_bucket_s = time_bucket_s
        self.store_samples = store_samples
        self.dialect = engine.dialect.name
        self._sql_cache: dict[tuple[Any, ...], str] = {}
        # SQLite has one writer at a time: queue writers on a lock in the process instead of letting
        # them spin in SQLite's busy handler (which sleeps in growing steps); PostgreSQL needs none
        self._write_lock = threading.Lock() if self.dialect == "sqlite" else None

    @contextlib.contextmanager
    def _writing(self) -> Iterator[Connection]:
        """A write transaction (serialised within the process on SQLite)."""
        if self._write_lock is None:
            with self.engine.begin() as conn:
                yield conn
            return
        with self._write_lock, self.engine.begin() as conn:
            yield conn

    # ---- dialect helpers -------------------------------------------------------------------------
    def _insert(self, table: Table) -> Any:
        return postgresql.insert(table) if self.dialect == "postgresql" else sqlite.insert(table)

    def _greatest(self, a: Any, b: Any) -> Any:
        return func.greatest(a, b) if self.dialect == "postgresql" else func.max(a, b)

    def _least(self, a: Any, b: Any) -> Any:
        return func.least(a, b) if self.dialect == "postgresql" else func.min(a, b)

    def _upsert(self, conn: Connection, table: Table, rows: Rows, keys: tuple[str, ...],
                add: tuple[str, ...] = (), greatest: tuple[str, ...] = (), least: tuple[str, ...] = ()) -> None:
        """INSERT ... ON CONFLICT DO UPDATE with increments, as one driver-level executemany."""
        if not rows.rows:
            return
        sql = self._upsert_sql(table, rows.cols, keys, add, greatest, least)
        conn.exec_driver_sql(sql, rows.rows)

    def _upsert_sql(self, table: Table, cols: tuple[str, ...], keys: tuple[str, ...], add: tuple[str, ...],
                    greatest: tuple[str, ...], least: tuple[str, ...]) -> str:
        cache_key = (table.name, cols, keys, add, greatest, least)
        sql = self._sql_cache.get(cache_key)
        if sql is None:
            pg = self.dialect == "postgresql"
            mark = "%s" if pg else "?"
            hi, lo = ("GREATEST", "LEAST") if pg else ("MAX", "MIN")
            q = ", ".join(f'"{c}"' for c in cols)
            sets = [f'"{c}" = {table.name}."{c}" + excluded."{c}"' for c in add]
            sets += [f'"{c}" = {hi}({table.name}."{c}", excluded."{c}")' for c in greatest]
            sets += [f'"{c}" = {lo}({table.name}."{c}", excluded."{c}")' for c in least]
            sql = (f"INSERT INTO {table.name} ({q}) VALUES ({', '.join([mark] * len(cols))}) "
                   f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {', '.join(sets)}")
            self._sql_cache[cache_key] = sql
        return sql

    # ---- runs ------------------------------------------------------------------------------------
    def register_run(self, fields: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create the run for ``fields['run_key']`` or return the existing one (idempotent)."""
        now = time.time()
        values = {k: fields[k] for k in RUN_FIELDS}
        values["run_key"] = fields["run_key"]
        values["created_at"] = now
        if values["started_at"] is None:
            values["started_at"] = now
        with self._writing() as conn:
            stmt = self._insert(t.runs).values(**values).on_conflict_do_nothing(index_elements=["run_key"])
            created = conn.execute(stmt.returning(t.runs.c.id)).first() is not None
            row = conn.execute(select(t.runs).where(t.runs.c.run_key == values["run_key"])).mappings().one()
            if not created:
                for k in RUN_IDENTITY:
                    if row[k] != values[k]:
                        raise Conflict(k, f"run key {values['run_key']!r} is registered with {k}={row[k]!r}, "
                                          f"not {values[k]!r}; use a new run key for a different run")
            return dict(row), created

    def get_run(self, run_id: int) -> dict[str, Any]:
        with self.engine.connect() as conn:
            row = conn.execute(select(t.runs).where(t.runs.c.id == run_id)).mappings().first()
        if row is None:
            raise UnknownRun(run_id)
        return dict(row)

    def set_mode_override(self, run_id: int, mode: str | None) -> dict[str, Any]:
        with self._writing() as conn:
            res = conn.execute(update(t.runs).where(t.runs.c.id == run_id).values(mode_override=mode))
            if res.rowcount == 0:
                raise UnknownRun(run_id)
        return self.get_run(run_id)

    # ---- ingest ----------------------------------------------------------------------------------
    def ingest(self, run_id: int, b: ValidBatch) -> IngestResult:
        """Store one batch atomically; see the module docstring."""
        now = time.time()
        # everything that needs no database happens before the write transaction begins, so
        # concurrent requests overlap their CPU work with another's writes
        d = compute_deltas(run_id, b, self.policy, self.time_bucket_s)
        rows = self._sample_rows(run_id, b, d.exceeded) if self.store_samples else []
        with self._writing() as conn:
            run = conn.execute(
                select(t.runs.c.num_layers, t.runs.c.tp_size, t.runs.c.policy_hash, t.runs.c.mode_override)
                .where(t.runs.c.id == run_id)
            ).first()
            if run is None:
                raise UnknownRun(run_id)
            num_layers, tp_size, run_policy, mode_override = run
            layer, rank = b.cols["layer"], b.cols["rank"]
            if (bad := layer >= num_layers).any():
                i = int(np.flatnonzero(bad)[0])
                raise BadBatch(f"samples.layer[{i}]", f"{layer[i]} is not below the run's num_layers {num_layers}")
            if (bad := rank >= tp_size).any():
                i = int(np.flatnonzero(bad)[0])
                raise BadBatch(f"samples.rank[{i}]", f"{rank[i]} is not below the run's tp_size {tp_size}")

            claim = self._insert(t.batches).values(
                run_id=run_id, producer=b.producer, seq=b.seq, digest=b.digest, n_samples=b.n, received_at=now
            ).on_conflict_do_nothing()
            if conn.execute(claim.returning(t.batches.c.seq)).first() is None:
                stored = conn.execute(
                    select(t.batches.c.digest).where(
                        (t.batches.c.run_id == run_id) & (t.batches.c.producer == b.producer)
                        & (t.batches.c.seq == b.seq)
                    )
                ).scalar_one()
                if stored != b.digest:
                    raise Conflict("seq", f"producer {b.producer} already sent batch {b.seq} with other content")
                conn.execute(update(t.runs).where(t.runs.c.id == run_id).values(n_duplicates=t.runs.c.n_duplicates + 1))
                return IngestResult(run_id, 0, True, mode_override=mode_override)

            if rows:
                self._insert_samples(conn, rows)
            self._upsert(conn, t.cells, d.cells, ("run_id", "layer", *t.CELL_KEY), add=COUNTERS + SUMS,
                         greatest=(*MAXES, "last_ts"), least=("first_ts",))
            self._upsert(conn, t.timeslots, d.slots, ("run_id", "layer", "t"), add=COUNTERS + SUMS, greatest=MAXES)
            self._upsert(conn, t.hists, d.hists, ("run_id", "layer", "stat", "bin"), add=("count",))
            self._upsert(conn, t.steps, d.steps, ("run_id", "step"), add=("n_calls",), greatest=("exceeded",),
                         least=("first_ts",))
            r = d.run
            runs = t.runs.c
            policy_hash = self.policy_hash if run_policy in ("", self.policy_hash) else "mixed"
            conn.execute(
                update(t.runs).where(runs.id == run_id).values(
                    n_samples=runs.n_samples + r["n_samples"],
                    n_batches=runs.n_batches + 1,
                    n_errors=runs.n_errors + r["n_errors"],
                    n_cand_nonfinite=runs.n_cand_nonfinite + r["n_cand_nonfinite"],
                    n_base_nonfinite=runs.n_base_nonfinite + r["n_base_nonfinite"],
                    n_exceed=runs.n_exceed + r["n_exceed"],
                    n_requests=runs.n_requests + r["n_requests"],
                    n_oracle=runs.n_oracle + r["n_oracle"],
                    first_sample_ts=func.coalesce(self._least(runs.first_sample_ts, r["first_sample_ts"]),
                                                  r["first_sample_ts"]),
                    last_sample_ts=func.coalesce(self._greatest(runs.last_sample_ts, r["last_sample_ts"]),
                                                 r["last_sample_ts"]),
                    last_ingest_at=now,
                    policy_hash=policy_hash,
                )
            )
            gap = self._record_producer(conn, run_id, b, int(rank[0]), now)
        return IngestResult(run_id, b.n, False, int(d.exceeded.sum()), r["n_cand_nonfinite"], d, gap, mode_override)

    def _record_producer(self, conn: Connection, run_id: int, b: ValidBatch, rank: int, now: float) -> int:
        p = t.producers.c
        stats = {k: b.producer_stats.get(k, 0) for k in PRODUCER_STATS}
        stmt = self._insert(t.producers).values(
            run_id=run_id, producer=b.producer, rank=rank, max_seq=b.seq, batches=1, gaps=b.seq, samples=b.n,
            first_seen=now, last_seen=now, **stats,
        )
        ex = stmt.excluded
        # gaps: a jump past max_seq + 1 opens gaps; a late batch below max_seq fills one
        gaps = case(
            (ex.max_seq > p.max_seq + 1, p.gaps + ex.max_seq - p.max_seq - 1),
            (ex.max_seq < p.max_seq, self._greatest(p.gaps - 1, literal(0))),
            else_=p.gaps,
        )
        set_: dict[str, Any] = {
            "gaps": gaps,
            "max_seq": self._greatest(p.max_seq, ex.max_seq),
            "batches": p.batches + 1,
            "samples": p.samples + ex.samples,
            "last_seen": ex.last_seen,
            "rank": ex.rank,
        }
        # figures a producer reports are cumulative or sticky (drops, errors, fallback, spec counters):
        # keep the largest, so a late re-delivered batch cannot move them back; the spool depth is a
        # level, taken from the newest batch only
        for k in stats:
            if k not in b.producer_stats:
                continue
            if k == "spool_depth":
                set_[k] = case((ex.max_seq >= p.max_seq, ex[k]), else_=p[k])
            else:
                set_[k] = self._greatest(p[k], ex[k])
        conn.execute(stmt.on_conflict_do_update(index_elements=["run_id", "producer"], set_=set_))
        got = conn.execute(
            select(p.gaps).where((p.run_id == run_id) & (p.producer == b.producer))
        ).scalar_one()
        return int(got)

    def _sample_rows(self, run_id: int, b: ValidBatch, exceeded: np.ndarray) -> list[tuple[Any, ...]]:
        c = b.cols
        n = b.n
        buf = np.ascontiguousarray(c["hist"], dtype="<i8").tobytes()
        w = len(buf) // n if n else 0
        columns: list[list[Any]] = [
            [run_id] * n, [b.producer] * n, c["rank"].tolist(), c["layer"].tolist(), c["step"].tolist(),
            c["call"].tolist(), c["ts"].tolist(), c["batch_size"].tolist(), c["draft_tokens"].tolist(),
            c["prefix_len"].tolist(), c["heads"].tolist(), c["numel"].tolist(), c["max_abs"].tolist(),
            c["mean_abs"].tolist(), c["max_rel"].tolist(), c["rel_l2"].tolist(), c["cos_diff"].tolist(),
            c["out_scale"].tolist(), c["nan_base"].tolist(), c["inf_base"].tolist(), c["nan_cand"].tolist(),
            c["inf_cand"].tolist(), c["cand_nonfinite"].tolist(), c["base_nonfinite"].tolist(),
            [buf[i:i + w] for i in range(0, len(buf), w)], c["error"], c["mode"], c["oracle_cand_err"].tolist(),
            c["oracle_base_err"].tolist(), c["cand_us"].tolist(), c["base_us"].tolist(),
            c["new_requests"].tolist(), exceeded.astype(np.int64).tolist(),
        ]
        return list(zip(*columns, strict=True))

    def _insert_samples(self, conn: Connection, rows: list[tuple[Any, ...]]) -> None:
        names = ", ".join(f'"{name}"' for name in SAMPLE_COLUMNS)
        if self.dialect == "postgresql":
            raw = conn.connection.driver_connection
            with raw.cursor() as cur, cur.copy(f"COPY samples ({names}) FROM STDIN") as copy:  # type: ignore[union-attr]
                for row in rows:
                    copy.write_row(row)
        else:
            marks = ", ".join("?" * len(SAMPLE_COLUMNS))
            conn.exec_driver_sql(f"INSERT INTO samples ({names}) VALUES ({marks})", rows)

    # ---- retention -------------------------------------------------------------------------------
    def prune_samples(self, older_than: float) -> int:
        """Delete raw samples with ts before ``older_than`` (rollups are kept)."""
        with self._writing() as conn:
            res = conn.execute(t.samples.delete().where(t.samples.c.ts < older_than))
            conn.execute(t.batches.delete().where(t.batches.c.received_at < older_than))
        return int(res.rowcount or 0)

"""Writes: run registration and batch ingest, each one transaction.

Ingest of a batch: :meth:`Store.prepare` computes everything that needs no database (rollup
deltas, the stored sample columns, on SQLite the INSERT); :meth:`Store.write` — in the request
thread, or in a writer process (shadowd.collector.writer) — runs one transaction: look up the
run, check layers and ranks against it, claim the (producer, seq) slot (a duplicate with the
same digest is answered as such, a different digest is a conflict), bulk-insert the raw samples
(executemany on SQLite, binary COPY on PostgreSQL), then apply the rollup deltas with atomic
upserts. Any error rolls the whole batch back. A value the database refuses (out of its range, against a
constraint) is the batch's fault, not the database's: :class:`BadBatch` (422) naming what was refused.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, Table, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError

from shadowd.collector import tables as t
from shadowd.collector.batch import DIGEST_PREFIX, BadBatch, ValidBatch
from shadowd.collector.rollups import CAPPED, COUNTERS, MAXES, SUMS, Deltas, compute_deltas
from shadowd.collector.sample_rows import pg_copy, sample_values, sqlite_plan, sqlite_rows
from shadowd.collector.upsert import Upserter
from shadowd.judge.policy import Policy
from shadowd.wire import PRODUCER_NOTES, PRODUCER_STATS

__all__ = ["Conflict", "IngestResult", "Store", "UnknownRun", "WriteJob", "WriteOutcome", "refused"]


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


def refused(field: str, exc: BaseException) -> BadBatch:
    """A value the database refused (``exc``: the driver's error, or SQLAlchemy's around it) as the 422 naming
    ``field``: the same request would be refused again, so it is the client's error, not "retry later"."""
    orig = getattr(exc, "orig", None) or exc
    detail = next(iter(str(orig).splitlines()), "") or type(orig).__name__
    return BadBatch(field, f"the database refused a value: {detail}")


@dataclass
class WriteJob:
    """A batch ready for its write transaction: everything computed, nothing written (picklable)."""

    run_id: int
    producer: str
    seq: int
    digest: str
    n: int
    #: the samples' values by column (see :func:`shadowd.collector.sample_rows.sample_values`; only layer and
    #: rank without raw samples)
    cols: dict[str, Any]
    #: what the samples add to the rollups (None: a stats-only batch, which holds no samples)
    deltas: Deltas | None
    producer_stats: dict[str, int]
    now: float
    #: the producer's notes (``shadowd.wire.PRODUCER_NOTES``): reasons, kept as first reported
    producer_notes: dict[str, str] = field(default_factory=dict)
    #: the rank a stats-only batch states (used when the collector has stored none of the producer's samples)
    rank: int | None = None
    #: the producer's pipeline stage (0: none stated)
    stage: int = 0
    #: SQLite: the samples' INSERT (``{batch_id}`` in place of the batch id), the columns its rows bind, and
    #: (in-process writes) the rows, built before the transaction
    sample_sql: str | None = None
    sample_cols: list[str] = field(default_factory=list)
    sample_rows: list[tuple[Any, ...]] | None = None


@dataclass
class WriteOutcome:
    """What the write transaction of a batch found."""

    duplicate: bool
    gap: int = 0
    mode_override: str | None = None
    #: the stored digest of this (producer, seq) when it is of the older kind and differs from ours
    legacy_digest: str | None = None


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


RUN_FIELDS = (
    "model", "num_layers", "tp_size", "gpu_name", "gpu_arch", "driver", "sglang_version", "candidate_name",
    "candidate_fingerprint", "baseline_name", "baseline_fingerprint", "labels", "started_at",
)
# a run key re-used with any of these different is a different run: 409
RUN_IDENTITY = ("num_layers", "tp_size", "candidate_fingerprint", "baseline_fingerprint", "model")


class Store:
    """All database access of the collector."""

    def __init__(self, engine: Engine, policy: Policy, time_bucket_s: int = 60, store_samples: bool = True,
                 write_lock: Any = None, own_connection: bool = False):
        self.engine = engine
        self.policy = policy
        self.policy_hash = policy.hash()
        self.time_bucket_s = time_bucket_s
        self.store_samples = store_samples
        self.dialect = engine.dialect.name
        self._sql_cache: dict[tuple[Any, ...], Any] = {}
        self._upserter = Upserter(self.dialect)
        # SQLite has one writer at a time: queue writers on a lock in the process instead of letting
        # them spin in SQLite's busy handler (which sleeps in growing steps); PostgreSQL needs none
        # (the ingest writer processes share one lock across processes: ``write_lock``)
        self._write_lock = (write_lock or threading.Lock()) if self.dialect == "sqlite" else None
        dbapi = engine.dialect.loaded_dbapi
        self._driver_error: type[Exception] = dbapi.Error
        # what the driver raises for a value the database refuses: out of its range (sqlite3 raises OverflowError
        # for an integer beyond 64 bits before the database sees it) or against a constraint
        self._refusals: tuple[type[Exception], ...] = (OverflowError, dbapi.DataError, dbapi.IntegrityError)
        # a writer process keeps one SQLite connection for its ingest transactions (``own_connection``)
        self._own = engine.raw_connection() if own_connection and self.dialect == "sqlite" else None

    @contextlib.contextmanager
    def _writing(self) -> Iterator[Connection]:
        """A write transaction (serialised within the process on SQLite)."""
        if self._write_lock is None:
            with self.engine.begin() as conn:
                yield conn
            return
        with self._write_lock, self.engine.begin() as conn:
            yield conn

    def _driver(self, exc: Exception) -> Exception:
        """A driver error as SQLAlchemy's class for it (OperationalError, DataError, ...: see errors.py)."""
        return DBAPIError.instance(None, None, exc, self._driver_error, dialect=self.engine.dialect)

    @contextlib.contextmanager
    def _storing(self, field: str) -> Iterator[None]:
        """Statements that store ``field`` of a batch: a value of it the database refuses is :func:`refused` (422;
        the transaction rolls back, nothing of the batch is stored)."""
        try:
            yield
        except self._refusals as exc:
            raise refused(field, exc) from exc

    # ---- dialect helpers -------------------------------------------------------------------------
    def _insert(self, table: Table) -> Any:
        return postgresql.insert(table) if self.dialect == "postgresql" else sqlite.insert(table)

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
    def ingest(self, run_id: int, b: ValidBatch, writer: Callable[[WriteJob], WriteOutcome] | None = None
               ) -> IngestResult:
        """Store one batch atomically; see the module docstring.

        :meth:`prepare` does everything that needs no database (in the calling thread); the write
        transaction runs in ``writer`` (the collector's writer process) or, without one, here.
        """
        job = self.prepare(run_id, b, ship=writer is not None)
        out = writer(job) if writer is not None else self.write(job)
        if out.legacy_digest is not None:
            # the stored batch came from a collector that digested the encoded mapping: compare that way
            if b.legacy_digest() != out.legacy_digest:
                raise Conflict("seq", f"producer {b.producer} already sent batch {b.seq} with other content")
            with self._writing() as conn:
                conn.execute(update(t.runs).where(t.runs.c.id == run_id)
                             .values(n_duplicates=t.runs.c.n_duplicates + 1))
            return IngestResult(run_id, 0, True, mode_override=out.mode_override)
        if out.duplicate:
            return IngestResult(run_id, 0, True, mode_override=out.mode_override)
        d = job.deltas
        if d is None:  # a stats-only batch: the producer's figures, no samples
            return IngestResult(run_id, 0, False, gap=out.gap, mode_override=out.mode_override)
        return IngestResult(run_id, b.n, False, int(d.exceeded.sum()), d.run["n_cand_nonfinite"], d, out.gap,
                            out.mode_override)

    def prepare(self, run_id: int, b: ValidBatch, ship: bool = False) -> WriteJob:
        """Everything of a batch's write that needs no database: rollup deltas, the sample columns and, on
        SQLite, the samples' INSERT and rows — unless the job is shipped to a writer process (``ship``):
        a pipe moves numpy columns far more cheaply than Python objects, and building the rows there costs
        the writer no more than taking them apart would."""
        if b.n == 0:  # a stats-only batch (shadowd.wire): nothing for the rollups or the samples table
            return WriteJob(run_id=run_id, producer=b.producer, seq=b.seq, digest=b.digest, n=0, cols={}, deltas=None,
                            producer_stats=b.producer_stats, now=time.time(), producer_notes=b.producer_notes,
                            rank=b.rank, stage=b.stage)
        d = compute_deltas(run_id, b, self.policy, self.time_bucket_s)
        cols = (sample_values(b.cols, d.exceeded, b.stored_hist) if self.store_samples
                else {"layer": b.cols["layer"], "rank": b.cols["rank"]})
        job = WriteJob(run_id=run_id, producer=b.producer, seq=b.seq, digest=b.digest, n=b.n, cols=cols,
                       deltas=d, producer_stats=b.producer_stats, now=time.time(), producer_notes=b.producer_notes,
                       stage=b.stage)
        if self.store_samples and self.dialect != "postgresql":
            job.sample_sql, job.sample_cols = sqlite_plan(cols, b.n)
            job.cols = {k: cols[k] for k in {"layer", "rank", *job.sample_cols}}
            if not ship:  # in-process writes: the rows too are built outside the write lock
                job.sample_rows = sqlite_rows(job.cols, job.sample_cols)
        return job

    def write(self, job: WriteJob) -> WriteOutcome:
        """The write transaction of one prepared batch (one transaction; any error rolls it all back).

        Its statements are plain SQL on the driver (cached per dialect): this is the one hot write path.
        """
        run_id, now, d = job.run_id, job.now, job.deltas
        q = self._hot_sql()
        if self._own is not None:
            return self._write_own(job, q)
        with self._writing() as conn:
            # every statement on one DB-API cursor of the transaction's connection (no per-statement
            # SQLAlchemy result objects); a driver error is raised as SQLAlchemy's (OperationalError: 503)
            cur = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                return self._write(cur, job, q, run_id, now, d)
            except self._driver_error as exc:
                raise self._driver(exc) from exc
            finally:
                cur.close()

    def _write_own(self, job: WriteJob, q: dict[str, str]) -> WriteOutcome:
        """:meth:`write` on the store's own SQLite connection (a writer process): BEGIN IMMEDIATE ... COMMIT
        by hand, under the shared write lock."""
        assert self._own is not None and self._write_lock is not None
        con: Any = self._own.driver_connection
        with self._write_lock:
            cur = con.cursor()
            try:
                cur.execute("BEGIN IMMEDIATE")
                try:
                    out = self._write(cur, job, q, job.run_id, job.now, job.deltas)
                except BaseException:
                    con.rollback()
                    raise
                cur.execute("COMMIT")
                return out
            except self._driver_error as exc:
                if con.in_transaction:
                    con.rollback()
                raise self._driver(exc) from exc
            finally:
                cur.close()

    def _write(self, cur: Any, job: WriteJob, q: dict[str, str], run_id: int, now: float, d: Deltas | None
               ) -> WriteOutcome:
        cur.execute(q["run"], (run_id,))
        run = cur.fetchone()
        if run is None:
            raise UnknownRun(run_id)
        num_layers, tp_size, run_policy, mode_override = run
        if d is None:
            return self._write_stats_only(cur, job, q, mode_override, tp_size)
        layer, rank = job.cols["layer"], job.cols["rank"]
        if (bad := layer >= num_layers).any():
            i = int(np.flatnonzero(bad)[0])
            raise BadBatch(f"samples.layer[{i}]", f"{layer[i]} is not below the run's num_layers {num_layers}")
        if (bad := rank >= tp_size).any():
            i = int(np.flatnonzero(bad)[0])
            raise BadBatch(f"samples.rank[{i}]", f"{rank[i]} is not below the run's tp_size {tp_size}")

        r = d.run
        claimed, seen = self._claim(cur, job, q, r["max_ts"], mode_override)
        if seen is not None:
            return seen

        with self._storing("samples"):  # the samples, and the rollups and run counters they add to
            if self.store_samples:
                self._insert_samples(cur, job, int(claimed[0]))
            up = self._upserter.upsert
            up(cur, t.cells, d.cells, ("run_id", "layer", *t.CELL_KEY), add=COUNTERS + SUMS,
               greatest=(*MAXES, "last_ts"), least=("first_ts",), capped=CAPPED)
            up(cur, t.timeslots, d.slots, ("run_id", "layer", "t"), add=COUNTERS + SUMS, greatest=MAXES, capped=CAPPED)
            up(cur, t.hists, d.hists, ("run_id", "layer", "stat", "bin"), add=("count",))
            up(cur, t.steps, d.steps, ("run_id", "step"), add=("n_calls",), greatest=("exceeded",),
               least=("first_ts",))
            up(cur, t.errors, d.errors, ("run_id", "error"), add=("n",), greatest=("last_ts",), least=("first_ts",))
            up(cur, t.ranks, d.ranks, ("run_id", "rank", "layer"), add=("n", "n_empty"), greatest=("last_ts",),
               least=("first_ts",))
            policy_hash = self.policy_hash if run_policy in ("", self.policy_hash) else "mixed"
            cur.execute(q["run_update"], (
                r["n_samples"], r["n_errors"], r["n_cand_nonfinite"], r["n_base_nonfinite"], r["n_exceed"],
                r["n_requests"], r["n_oracle"], r["first_sample_ts"], r["first_sample_ts"], r["last_sample_ts"],
                r["last_sample_ts"], now, policy_hash, run_id))
        with self._storing("producer_stats"):  # the producer's row: its figures and notes
            gap = self._record_producer(cur, job, int(rank[0]))
        return WriteOutcome(False, gap=gap, mode_override=mode_override)

    def _claim(self, cur: Any, job: WriteJob, q: dict[str, str], max_ts: float, mode_override: str | None
               ) -> tuple[Any, WriteOutcome | None]:
        """The batch's row (its producer, seq, size and newest time): (the new row's id, None), or (None, the
        outcome) when the producer already sent this seq — a duplicate, or a conflict raised."""
        run_id = job.run_id
        with self._storing("seq"):
            cur.execute(q["claim"], (run_id, job.producer, job.seq, job.digest, job.n, job.now, max_ts))
        claimed = cur.fetchone()
        if claimed is not None:
            return claimed, None
        cur.execute(q["digest"], (run_id, job.producer, job.seq))
        stored = cur.fetchone()[0]
        if stored != job.digest:
            if not stored.startswith(DIGEST_PREFIX):
                return None, WriteOutcome(False, mode_override=mode_override, legacy_digest=stored)
            raise Conflict("seq", f"producer {job.producer} already sent batch {job.seq} with other content")
        cur.execute(q["duplicate"], (run_id,))
        return None, WriteOutcome(True, mode_override=mode_override)

    def _write_stats_only(self, cur: Any, job: WriteJob, q: dict[str, str], mode_override: str | None,
                          tp_size: int) -> WriteOutcome:
        """A batch without samples: its seq is claimed (so the producer's sequence has no gap and a replay is a
        duplicate) and its figures go to the producer's row, under the rank its samples named before — or, for a
        producer none of whose samples was stored (every one dropped), under the rank the batch states."""
        _, seen = self._claim(cur, job, q, job.now, mode_override)  # (retention: its time is its arrival)
        if seen is not None:
            return seen
        cur.execute(q["producer_rank"], (job.run_id, job.producer))
        row = cur.fetchone()
        # (raised inside the transaction: the claim above is rolled back with it)
        if row is not None:
            rank = int(row[0])
        elif job.rank is None:
            raise BadBatch("producer", f"{job.producer!r} has sent this run no samples yet and the batch states no "
                                       "rank: a batch without samples has no rank to report its figures under")
        elif job.rank >= tp_size:
            raise BadBatch("rank", f"{job.rank} is not below the run's tp_size {tp_size}")
        else:
            rank = job.rank
        cur.execute(q["batch_only"], (job.run_id,))
        with self._storing("producer_stats"):
            gap = self._record_producer(cur, job, rank)
        return WriteOutcome(False, gap=gap, mode_override=mode_override)

    def _hot_sql(self) -> dict[str, str]:
        sql = self._sql_cache.get(("hot",))
        if sql is None:
            m = "%s" if self.dialect == "postgresql" else "?"
            lo, hi = ("LEAST", "GREATEST") if self.dialect == "postgresql" else ("MIN", "MAX")
            sql = {
                "run": f"SELECT num_layers, tp_size, policy_hash, mode_override FROM runs WHERE id = {m}",
                "claim": "INSERT INTO batches (run_id, producer, seq, digest, n_samples, received_at, max_ts) "
                         f"VALUES ({m}, {m}, {m}, {m}, {m}, {m}, {m}) "
                         "ON CONFLICT (run_id, producer, seq) DO NOTHING RETURNING id",
                "digest": f"SELECT digest FROM batches WHERE run_id = {m} AND producer = {m} AND seq = {m}",
                "duplicate": f"UPDATE runs SET n_duplicates = n_duplicates + 1 WHERE id = {m}",
                "producer_rank": f"SELECT rank FROM producers WHERE run_id = {m} AND producer = {m}",
                "batch_only": f"UPDATE runs SET n_batches = n_batches + 1 WHERE id = {m}",
                "run_update": (
                    f"UPDATE runs SET n_samples = n_samples + {m}, n_batches = n_batches + 1, "
                    f"n_errors = n_errors + {m}, n_cand_nonfinite = n_cand_nonfinite + {m}, "
                    f"n_base_nonfinite = n_base_nonfinite + {m}, n_exceed = n_exceed + {m}, "
                    f"n_requests = n_requests + {m}, n_oracle = n_oracle + {m}, "
                    # a batch whose calls all compared nothing has no sample times (NULL): keep the run's
                    f"first_sample_ts = COALESCE({lo}(first_sample_ts, {m}), first_sample_ts, {m}), "
                    f"last_sample_ts = COALESCE({hi}(last_sample_ts, {m}), last_sample_ts, {m}), "
                    f"last_ingest_at = {m}, policy_hash = {m} WHERE id = {m}"
                ),
            }
            self._sql_cache[("hot",)] = sql
        return sql

    def _record_producer(self, cur: Any, job: WriteJob, rank: int) -> int:
        """Upsert the producer's row; returns its sequence gaps."""
        reported = tuple(k for k in PRODUCER_STATS if k in job.producer_stats)
        key = ("producer", reported)
        sql = self._sql_cache.get(key)
        if sql is None:
            m = "%s" if self.dialect == "postgresql" else "?"
            hi = "GREATEST" if self.dialect == "postgresql" else "MAX"
            cols = ("run_id", "producer", "rank", "stage", "max_seq", "batches", "gaps", "samples", "first_seen",
                    "last_seen", *PRODUCER_STATS, *PRODUCER_NOTES)
            p, x = "producers", "excluded"
            # gaps: a jump past max_seq + 1 opens gaps; a late batch below max_seq fills one. No intermediate
            # passes int64 whatever the seqs: max_seq + 1 could, seq - 1 cannot; gaps + seq could, gaps + the
            # jump cannot (there are fewer gaps than seqs)
            sets = [
                f"gaps = CASE WHEN {x}.max_seq - 1 > {p}.max_seq THEN {p}.gaps + ({x}.max_seq - {p}.max_seq - 1) "
                f"WHEN {x}.max_seq < {p}.max_seq THEN {hi}({p}.gaps - 1, 0) ELSE {p}.gaps END",
                f"max_seq = {hi}({p}.max_seq, {x}.max_seq)",
                f"batches = {p}.batches + 1",
                f"samples = {p}.samples + {x}.samples",
                f"last_seen = {x}.last_seen",
                f"rank = {x}.rank",
                f"stage = {x}.stage",
            ]
            # figures a producer reports are cumulative or sticky (drops, errors, fallback, spec counters):
            # keep the largest, so a late re-delivered batch cannot move them back; the spool depth is a
            # level, taken from the newest batch only
            for k in reported:
                if k == "spool_depth":
                    sets.append(f"{k} = CASE WHEN {x}.max_seq >= {p}.max_seq THEN {x}.{k} ELSE {p}.{k} END")
                else:
                    sets.append(f"{k} = {hi}({p}.{k}, {x}.{k})")
            # a reason is kept as first reported (a process is disabled / falls back once); NULL until then
            sets += [f"{k} = COALESCE({p}.{k}, {x}.{k})" for k in PRODUCER_NOTES]
            sql = (f"INSERT INTO producers ({', '.join(cols)}) VALUES ({', '.join([m] * len(cols))}) "
                   f"ON CONFLICT (run_id, producer) DO UPDATE SET {', '.join(sets)} RETURNING gaps")
            self._sql_cache[key] = sql
        now = job.now
        stats = [job.producer_stats.get(k, 0) for k in PRODUCER_STATS]
        notes = [job.producer_notes.get(k) for k in PRODUCER_NOTES]
        cur.execute(sql, (job.run_id, job.producer, rank, job.stage, job.seq, 1, job.seq, job.n, now, now, *stats,
                          *notes))
        return int(cur.fetchone()[0])

    def sample_insert(self, job: WriteJob, batch_id: int) -> tuple[str, Any]:
        """The statement and data that store the samples of ``job``: on SQLite an INSERT and one tuple per
        sample (executemany), on PostgreSQL a ``COPY ... (FORMAT BINARY)`` and its stream."""
        if self.dialect == "postgresql":
            return pg_copy(job.cols, job.n, batch_id)
        if job.sample_sql is None:
            job.sample_sql, job.sample_cols = sqlite_plan(job.cols, job.n)
        if job.sample_rows is None:
            job.sample_rows = sqlite_rows(job.cols, job.sample_cols)
        return job.sample_sql.replace("{batch_id}", str(int(batch_id))), job.sample_rows

    def _insert_samples(self, cur: Any, job: WriteJob, batch_id: int) -> None:
        sql, data = self.sample_insert(job, batch_id)
        if self.dialect == "postgresql":
            with cur.copy(sql) as copy:
                copy.write(data)
        else:
            cur.executemany(sql, data)
            # the rows took consecutive rowids (one writer): retention deletes the batch by this range
            cur.execute("UPDATE batches SET last_id = last_insert_rowid(), first_id = last_insert_rowid() - ? + 1 "
                        "WHERE id = ?", (job.n, batch_id))

    # ---- retention -------------------------------------------------------------------------------
    def prune_samples(self, older_than: float) -> int:
        """Delete the raw samples of batches whose newest sample is before ``older_than`` (rollups are
        kept), and the batch rows received before it too (duplicate detection forgets them)."""
        b = t.batches.c
        old = (b.max_ts < older_than)
        with self._writing() as conn:
            if self.dialect == "postgresql":
                res = conn.execute(t.samples.delete().where(
                    t.samples.c.batch_id.in_(select(b.id).where(old).scalar_subquery())))
                deleted = int(res.rowcount or 0)
            else:
                deleted = 0
                ranges = conn.execute(select(b.id, b.first_id, b.last_id).where(old & b.first_id.is_not(None))).all()
                for batch_id, first, last in ranges:
                    res = conn.exec_driver_sql(
                        "DELETE FROM samples WHERE id BETWEEN ? AND ? AND batch_id = ?", (first, last, batch_id))
                    deleted += int(res.rowcount or 0)
                if ranges:
                    conn.execute(update(t.batches).where(old & b.first_id.is_not(None))
                                 .values(first_id=None, last_id=None))
            conn.execute(t.batches.delete().where(old & (b.received_at < older_than)))
        return deleted

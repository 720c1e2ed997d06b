"""The ingest writer processes: run the write transactions of sample batches beside the HTTP process.

SQLite has one writer at a time, and Python's sqlite3 binds every value of every row while
holding the GIL and hands the GIL back around every row's ``sqlite3_step``: a bulk insert in the
HTTP process competes with the event loop and with the parsing of the next batch for one GIL, so
two cores do the work of one. The collector therefore gives the write transactions of ingest to
child processes (``SHADOWD_INGEST_WRITER=process``, the default for a SQLite file):

* the HTTP process receives, decodes, validates and digests a batch and computes its rollup deltas
  and stored columns (:meth:`Store.prepare`), then sends the prepared :class:`WriteJob` (numpy
  columns and delta rows) through a pipe to the writer with the fewest jobs in hand;
* a writer takes jobs off its pipe in a thread (the next job is in memory while the current one is
  written), builds the statement's rows, and runs :meth:`Store.write` — the same transaction as
  in-process ingest — inside **one lock shared by all writer processes** (:class:`WriteLock`): the
  semantics of the in-process lock (writers queue on a lock instead of polling in SQLite's busy
  handler), while one writer's preparation overlaps another's transaction;
* it answers with the :class:`WriteOutcome` or the error, which the HTTP process raises as if the
  write had run there.

Everything else — metrics, answers, run registration, the kill switch, retention, evaluations —
stays in the HTTP process; its few writes queue on SQLite's own lock (busy timeout) against the
writers. A writer that dies — also killed inside its transaction, by SIGKILL or the OOM killer —
fails the batches it had in hand with 503 (the producers retry; nothing of them was committed, or
the retry is answered as a duplicate) and is started again for the next batch: SQLite rolls its
transaction back and the kernel releases its hold on the writers' lock. A writer whose HTTP
process is gone (its jobs pipe closed without a stop) ends at once, whatever it is doing.

The writers' own commits do not checkpoint the WAL (``wal_autocheckpoint=0``): a thread of the
HTTP process does, every CHECKPOINT_INTERVAL_S with its own connection. SQLite runs a checkpoint
without the GIL, so it overlaps the writers' transactions on the other core instead of adding its
page copies and fsyncs to every thousandth commit (and touches no writer's GIL).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import sqlite3
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from shadowd.collector.batch import BadBatch
from shadowd.collector.db import make_engine
from shadowd.collector.store import Conflict, Store, UnknownRun, WriteJob, WriteOutcome
from shadowd.judge.policy import Policy

try:
    import fcntl
except ImportError:  # not a Unix: no lock between the writers (SQLite's own lock alone serialises them)
    fcntl = None  # type: ignore[assignment]

__all__ = ["CHECKPOINT_INTERVAL_S", "IngestWriter", "WriteLock", "WriterUnavailable", "checkpoint_loop"]

log = logging.getLogger("shadowd.collector")

_START_TIMEOUT_S = 120.0
CHECKPOINT_INTERVAL_S = 0.5


class WriterUnavailable(RuntimeError):
    """The write could not be done now (database error, writer process gone): answered 503, retry."""


class WriteLock:
    """The writer processes' lock around their write transactions: an exclusive ``flock(2)`` on one file.

    It is there for speed, not correctness: SQLite lets one writer in at a time anyway (``BEGIN IMMEDIATE``
    and the busy timeout), but a writer that finds the database locked polls in SQLite's busy handler, napping
    1, 2, 5 … 100 ms between tries, while one waiting here sleeps in the kernel until the holder lets go.
    Unlike a ``multiprocessing.Lock``, which a killed holder keeps for good (every later writer then waited
    on it forever), a flock is released by the kernel when its holder dies, SIGKILL included. Each process
    opens the file itself (a flock belongs to an open file description); without ``fcntl`` (not a Unix) it
    locks nothing.
    """

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if fcntl is not None else None

    def __enter__(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def _widen(conn: Connection) -> None:
    """Make a pipe's buffer as large as /proc/sys/fs/pipe-max-size allows (Linux; elsewhere nothing)."""
    try:
        import fcntl

        with open("/proc/sys/fs/pipe-max-size") as f:
            size = int(f.read())
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, min(size, 8 << 20))
    except (ImportError, OSError, ValueError, AttributeError):
        pass


def checkpoint_loop(path: str, stop: Any, interval_s: float) -> None:
    """Copy committed WAL frames into the database file every ``interval_s`` until ``stop`` is set (an
    Event), beside the writers (their connections do not)."""
    con = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    try:
        while not stop.wait(interval_s):
            try:
                con.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error as exc:  # busy or locked now: the next round tries again
                log.debug("WAL checkpoint skipped: %s", exc)
        con.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    finally:
        con.close()


def _sqlite_path(db_url: str) -> str | None:
    path = make_url(db_url).database
    return path if db_url.startswith("sqlite") and path and path != ":memory:" else None


def _serve(jobs: Connection, answers: Connection, lock_path: str | None, db_url: str, policy: Policy,
           time_bucket_s: int, store_samples: bool) -> None:
    """A writer process: one Store, one job at a time, until the HTTP process says stop (or is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the HTTP process decides when to stop
    engine = make_engine(db_url)
    # a job makes some 60 000 short-lived objects: collect the young generation rarely, and
    # never scan what exists at start again
    gc.freeze()
    gc.set_threshold(100_000, 20, 20)
    if _sqlite_path(db_url):
        @event.listens_for(engine, "connect")
        def _no_autocheckpoint(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.execute("PRAGMA wal_autocheckpoint=0")

    lock = WriteLock(lock_path) if lock_path is not None else None
    store = Store(engine, policy, time_bucket_s, store_samples, write_lock=lock, own_connection=True)
    # a thread takes jobs off the pipe as they come, so that the next one is in memory when the
    # current one is written (the transfer of a megabyte does not wait for the writer)
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def receive() -> None:
        while True:
            try:
                msg = jobs.recv()
            except (EOFError, OSError):
                # closed without a stop: the HTTP process is gone (killed). No answer can reach it and its
                # producers send again what was not answered: end now, even inside a transaction (SQLite rolls
                # back what was not committed), rather than live on as an orphan
                os._exit(1)
            inbox.put(msg)
            if msg is None:
                return

    threading.Thread(target=receive, name="shadowd-writer-inbox", daemon=True).start()
    answers.send(("ready", None))
    try:
        while True:
            msg = inbox.get()
            if msg is None:
                return
            req_id, job = msg
            out: tuple[str, Any]
            try:
                out = ("ok", store.write(job))
            except BadBatch as exc:
                out = ("bad", (exc.field, exc.message))
            except Conflict as exc:
                out = ("conflict", (exc.field, exc.message))
            except UnknownRun as exc:
                out = ("unknown", exc.run_id)
            except DBAPIError as exc:  # (a value the database refuses is a BadBatch already: Store._storing)
                out = ("unavailable", f"database error: {type(exc.orig).__name__}: {exc.orig}")
            except Exception as exc:  # answer it; the HTTP process logs and answers 500
                out = ("error", f"{type(exc).__name__}: {exc}")
            answers.send((req_id, out))
    finally:
        engine.dispose()


@dataclass
class _Worker:
    index: int
    conn: Connection | None = None
    proc: Any = None
    pending: dict[int, Future[tuple[str, Any]]] = field(default_factory=dict)
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class IngestWriter:
    """The HTTP process's handle on the writer processes: ``writer(job)`` blocks until the job is written.

    Thread-safe: many request threads may call it at once; each job goes to the writer with the
    fewest jobs in hand, and its answer is routed back by that writer's reader thread.
    """

    def __init__(self, db_url: str, policy: Policy, time_bucket_s: int, store_samples: bool,
                 processes: int = 2) -> None:
        self._args = (db_url, policy, time_bucket_s, store_samples)
        self._ctx = multiprocessing.get_context("spawn")
        self._lock_path: str | None = None  # the file of the writers' WriteLock (SQLite only)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._workers = [_Worker(i) for i in range(max(1, processes))]
        self._closed = False
        self._stop = threading.Event()
        self._checkpoints: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> IngestWriter:
        path = _sqlite_path(self._args[0])
        if path is not None:
            fd, self._lock_path = tempfile.mkstemp(prefix="shadowd-writers-", suffix=".lock")
            os.close(fd)
        with self._lock:
            for w in self._workers:
                self._start_locked(w)
        if path is not None:
            self._checkpoints = threading.Thread(target=checkpoint_loop, args=(path, self._stop, CHECKPOINT_INTERVAL_S),
                                                 name="shadowd-checkpoint", daemon=True)
            self._checkpoints.start()
        return self

    def _start_locked(self, w: _Worker) -> None:
        # two one-way pipes; the jobs pipe is made as large as the system allows
        jobs_in, jobs_out = self._ctx.Pipe(duplex=False)
        answers_in, answers_out = self._ctx.Pipe(duplex=False)
        _widen(jobs_out)
        proc = self._ctx.Process(target=_serve, args=(jobs_in, answers_out, self._lock_path, *self._args),
                                 name=f"shadowd-writer-{w.index}", daemon=True)
        proc.start()
        jobs_in.close()
        answers_out.close()
        if not answers_in.poll(_START_TIMEOUT_S):
            proc.kill()
            raise WriterUnavailable("the ingest writer process did not start")
        try:
            answers_in.recv()
        except EOFError:
            raise WriterUnavailable(f"the ingest writer process exited at start (code {proc.exitcode})") from None
        w.conn, w.proc = jobs_out, proc
        threading.Thread(target=self._read, args=(w, answers_in, jobs_out), name=f"shadowd-writer-reader-{w.index}",
                         daemon=True).start()

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed = True
            stopping = []
            for w in self._workers:
                if w.conn is not None:
                    with contextlib.suppress(OSError):
                        w.conn.send(None)
                stopping.append((w.proc, w.conn))
                w.conn = None
        for proc, conn in stopping:
            if proc is not None:
                proc.join(timeout)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout)
            if conn is not None:
                conn.close()
        self._stop.set()
        if self._checkpoints is not None:
            self._checkpoints.join(timeout)
        if self._lock_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._lock_path)

    @property
    def pids(self) -> list[int]:
        return [int(w.proc.pid) for w in self._workers if w.proc is not None]

    # ---- jobs -----------------------------------------------------------------------------------
    def _read(self, w: _Worker, answers: Connection, conn: Connection) -> None:
        while True:
            try:
                req_id, out = answers.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                fut = w.pending.pop(req_id, None)
            if fut is not None:
                fut.set_result(out)
        with self._lock:
            died = w.conn is conn and not self._closed
            if w.conn is conn:
                w.conn = None
            proc = w.proc
            # only this connection's jobs can be pending here: a new connection is made under the lock
            # after this one was dropped, and its jobs are registered under the lock as well
            lost, w.pending = w.pending, {}
        for fut in lost.values():
            fut.set_result(("unavailable", "the ingest writer process exited; retry"))
        answers.close()
        if died:
            log.error("ingest writer %d exited (code %s); it is started again for the next batch", w.index,
                      self._exit_code(proc))

    def _exit_code(self, proc: Any) -> int | None:
        """The exit code of a writer that has ended (as ``Process.exitcode``: -N for signal N), read without
        collecting the process.

        ``proc.exitcode`` here collected it (``waitpid``) in this reader thread while another thread may be collecting
        it too: :meth:`close`'s ``join``, multiprocessing's clean-up of ended children when the next writer starts, a
        caller's ``join`` or ``is_alive``. multiprocessing's ``Popen.poll`` is not thread-safe (python/cpython#130895):
        the thread that loses the race gets ECHILD, which it takes for "not started yet", so ``is_alive()`` said True
        for a writer that had ended. And it polled without waiting, often before the writer was a zombie (its answers
        pipe closes a moment earlier): the log said "code None". ``waitid(WNOWAIT)`` waits for the end and leaves the
        collection to the ``Process`` object. Where another thread collected it first (or there is no ``waitid``), the
        code is what that thread recorded, under the lock for the clean-up at a writer's start; after ECHILD there is
        nothing left for ``exitcode`` to collect.
        """
        waitid = getattr(os, "waitid", None)
        if waitid is not None:
            try:
                res = waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                res = None
            if res is not None:
                return int(res.si_status) if res.si_code == os.CLD_EXITED else -int(res.si_status)
        with self._lock:
            return proc.exitcode

    def __call__(self, job: WriteJob) -> WriteOutcome:
        fut: Future[tuple[str, Any]] = Future()
        with self._lock:
            if self._closed:
                raise WriterUnavailable("the collector is shutting down")
            w = min(self._workers, key=lambda x: (len(x.pending), x.index))
            if w.conn is None:
                self._start_locked(w)
            assert w.conn is not None
            req_id = next(self._ids)
            w.pending[req_id] = fut
            conn = w.conn
        try:
            with w.send_lock:  # one message at a time on a pipe; pickling happens outside the main lock
                conn.send((req_id, job))
        except (OSError, ValueError) as exc:
            with self._lock:
                w.pending.pop(req_id, None)
            raise WriterUnavailable(f"the ingest writer process is gone: {exc}") from None
        kind, payload = fut.result()
        if kind == "ok":
            result: WriteOutcome = payload
            return result
        if kind == "bad":
            raise BadBatch(*payload)
        if kind == "conflict":
            raise Conflict(*payload)
        if kind == "unknown":
            raise UnknownRun(payload)
        if kind == "unavailable":
            raise WriterUnavailable(payload)
        raise RuntimeError(f"ingest writer: {payload}")

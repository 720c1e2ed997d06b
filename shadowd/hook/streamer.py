"""The background streamer: samples → columnar wire batches → collector, never blocking the caller.

* :meth:`Streamer.submit` is what the serving thread calls: ``queue.put_nowait`` and nothing
  else (a full queue drops the sample and counts it). It never touches the network or disk.
* One daemon thread takes samples off the queue (and off any registered *pollers*, e.g. the
  GPU ring drainer), builds batches of up to ``batch_max`` samples in the layout of
  ``shadowd.wire`` (producer id random per process, seq 0, 1, 2, ...) with every numeric
  column packed (little-endian int64 / float64, ``hist`` n × HIST_BINS int64: one msgpack bin
  each, which the collector reads with one ``numpy.frombuffer``), and posts them as msgpack
  through :class:`shadowd.client.CollectorClient`.
* Collector down, slow, 5xx, 408 or 429 → the batch goes to the bounded on-disk :class:`Spool`;
  while the spool is non-empty new batches queue behind it, so delivery stays in order; while a batch can
  only be spooled the thread waits up to ``flush_interval_s`` for a full one (an outage spools few large
  batches). The spool is replayed oldest first once the collector answers (with backoff meanwhile),
  ``REPLAY_ROUND`` batches per round of the loop, the queue served between rounds, so a long outage's replay
  does not overflow the queue. A spool directory belongs to one run key: what a process of the same key left
  there (a restarted worker) goes to this run; a batch that can no longer be read (another process of the key
  delivered it) is skipped.
  A batch the spool cannot take is dropped and its samples counted in ``dropped``, which
  every later batch reports in ``producer_stats``; an idle producer (traffic stopped before the collector came
  back) reports it in a stats-only batch (``shadowd.wire``) once the spool is delivered.
* A sample the collector would refuse (``shadowd.wire.sample_problem``: a bad field, a layer beyond the run's)
  is left out of its batch, logged and counted in ``rejected``, so that it does not take the batch with it.
* A 4xx answer (bad batch, conflict, unknown run, too big) is logged and the batch dropped and counted in
  ``rejected``: it is never retried. Except a refusal of a producer figure the collector does not know (one
  older than this hook): the figure is left out of this batch, sent again at once, and of every later one.
  401 / 403 (a token the collector does not take: rotated, mistyped) keep the batch in the spool instead, for a
  process restarted with the right token to replay. A batch answered
  500 ``BUG_TRIES`` times in a row is dropped too (the collector failing on it; a 503, the database
  unavailable, is retried for as long as it lasts): it would otherwise hold every later batch behind it.
* :meth:`Streamer.close` (at exit) spools what a collector that does not answer still holds — the batch in
  flight and the queue — for the next start to replay; before its run is registered (``PENDING_RUN``) the
  streamer spools everything and sends it once :attr:`Streamer.run_id` is set.
* Every accepted batch's answer carries the run's ``mode_override`` (the kill switch); when no
  answer has come for ``poll_interval_s`` (nothing to send, or every batch rejected) the thread
  polls ``GET /v1/runs/{id}``. Changes go to ``on_mode_override``.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from shadowd.client import BatchRejected, CollectorClient, CollectorUnavailable
from shadowd.hook.spool import PENDING_RUN, Spool
from shadowd.wire import (
    COLUMNS,
    PRODUCER_NOTE_MAX,
    PRODUCER_NOTES,
    decode_msgpack,
    encode_msgpack,
    pack_column,
    pack_hist,
    sample_problem,
)

__all__ = ["Streamer", "build_batch"]

log = logging.getLogger("shadowd.hook")

_FLOAT_COLS = {c.name for c in COLUMNS if c.kind == "float"}
#: forks this process descends from (counted in the child): a streamer made before the last one is its parent's
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):  # (not on Windows, which cannot fork)
    os.register_at_fork(after_in_child=_count_fork)

#: spooled batches replayed per round of the thread's loop (the queue is served between rounds)
REPLAY_ROUND = 16
#: invalid samples (``Streamer._valid``) logged one by one; later ones are counted only
INVALID_LOGGED = 5
#: answers of 500 to one batch (a collector failing on it, not an outage: that is 503) before it is dropped
BUG_TRIES = 8


def build_batch(producer: str, seq: int, samples: list[dict[str, Any]],
                producer_stats: dict[str, int] | None = None, packed: bool = True,
                producer_notes: dict[str, str] | None = None, rank: int | None = None,
                stage: int = 0) -> dict[str, Any]:
    """A wire batch (``shadowd.wire``) of ``samples`` (dicts keyed by column name).

    Numeric columns are packed (``packed=False``: lists, the same content for the collector). A stats-only batch
    (no samples) states the producer's ``rank`` when given; every batch of a producer of pipeline stage > 0 states
    its ``stage``.
    """
    cols: dict[str, Any] = {}
    for col in COLUMNS if samples else ():  # (none: a stats-only batch, ``samples`` {})
        if col.required:
            vals = [s[col.name] for s in samples]
        else:
            vals = [s.get(col.name) for s in samples]
            if all(v is None for v in vals):
                continue
        if col.name in _FLOAT_COLS:
            vals = [None if v is None else float(v) for v in vals]
            if not col.nan_ok:
                vals = [None if v is not None and not math.isfinite(v) else v for v in vals]
        if packed and col.name == "hist":
            cols[col.name] = pack_hist(vals)
        elif packed and col.kind in ("int", "float"):
            cols[col.name] = pack_column(col.kind, vals)
        else:
            cols[col.name] = vals
    batch: dict[str, Any] = {"producer": producer, "seq": seq, "samples": cols}
    if not samples and rank is not None:
        batch["rank"] = rank
    if stage:
        batch["stage"] = stage
    if producer_stats:
        batch["producer_stats"] = producer_stats
    notes = {k: v[:PRODUCER_NOTE_MAX] for k, v in (producer_notes or {}).items() if k in PRODUCER_NOTES and v}
    if notes:
        batch["producer_notes"] = notes
    return batch


def _health(stats: dict[str, int], notes: dict[str, str]) -> dict[str, Any]:
    # the figures whose change an idle producer reports (all but the speculative-decoding and on-mode shape
    # counters, which move with every verify step and travel with the next batch of samples)
    return {**{k: v for k, v in stats.items() if not k.startswith(("spec_", "on_"))}, **notes}


class Streamer:
    """Streams samples of one run (``run_id``) to the collector behind ``client``.

    ``run_id`` may be ``PENDING_RUN`` (0) while the run is being registered: batches are then spooled, and sent
    to the run once :attr:`run_id` is set."""

    def __init__(self, client: CollectorClient, run_id: int, spool: Spool, *, queue_max: int = 100_000,
                 batch_max: int = 4096, flush_interval_s: float = 0.25, poll_interval_s: float = 2.0,
                 producer: str | None = None,
                 on_mode_override: Callable[[str | None], None] | None = None,
                 stats: Callable[[], dict[str, int]] | None = None,
                 notes: Callable[[], dict[str, str]] | None = None, rank: int | None = None,
                 stage: int = 0, num_layers: int | None = None) -> None:
        self.client = client
        #: the run's layer count, when known: a sample of a layer beyond it is refused here, alone
        self.num_layers = num_layers
        #: the producer's rank, stated in its stats-only batches: the collector files their figures under it when
        #: none of the producer's samples was stored (every one dropped); None: such a producer sends none
        self.rank = rank
        #: the producer's pipeline stage (PP rank), stated in every batch when above 0: the collector keeps the
        #: figures of the stages that share a TP rank apart
        self.stage = stage
        self.run_id = run_id
        self.spool = spool
        self.producer = producer or uuid.uuid4().hex
        self.batch_max = batch_max
        self.flush_interval_s = flush_interval_s
        self.poll_interval_s = poll_interval_s
        self.on_mode_override = on_mode_override
        self.stats = stats
        #: the producer's notes (``shadowd.wire.PRODUCER_NOTES``: why the candidate was disabled / fell back)
        self.notes = notes
        self.pollers: list[Callable[[], list[dict[str, Any]]]] = []
        self.seq = 0
        # samples dropped: the queue full (the serving thread counts), the spool bound hit or a batch that can
        # no longer be delivered (the streamer's thread counts) — two counters, one writer each
        self.queue_dropped = 0
        self.spool_dropped = 0
        # samples in batches the collector refused (4xx), or that kept failing it (500), and samples the collector
        # would refuse (``shadowd.wire.sample_problem``), left out of their batch
        self.rejected = 0
        self.invalid = 0  # of those, the samples left out of their batch
        #: producer figures the collector refused as unknown (an older collector): left out of every batch
        self.unknown_fields: set[str] = set()
        self.sent = 0  # samples acknowledged by the collector
        self.last_error: str | None = None
        self._q: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=queue_max)
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._lock = threading.Lock()  # sequence numbers and spool writes: the thread, and close() after it
        self._retry_at = 0.0
        self._backoff = 0.5
        self._last_contact = 0.0
        self._bug_tries = 0  # consecutive 500 answers to the batch at the head of the line
        self._inflight: tuple[int, bytes, int] | None = None  # (seq, body, samples) being posted directly
        # the health figures (:meth:`_health`) the newest batch posted directly carried: an idle producer whose
        # figures moved since (drops while the collector was away) reports them in a stats-only batch
        self._reported: dict[str, Any] | None = None
        self._encoded: dict[str, Any] | None = None  # ... and those the newest batch encoded carries
        self._forks = _forks  # a forked child (the count moved) makes its own thread and queue on its first submit
        self._accepted = 0  # samples put on the queue (serving thread)
        self._done = 0  # samples taken off it and shipped, spooled or dropped (streamer thread)
        self._thread = threading.Thread(target=self._run, name="shadowd-streamer", daemon=True)

    @property
    def dropped(self) -> int:
        """Samples lost, counted: the queue full, the spool bound hit, a spooled batch that could not be read."""
        return self.queue_dropped + self.spool_dropped

    # ---- the serving thread's side -------------------------------------------------------------
    def submit(self, sample: dict[str, Any]) -> bool:
        """Enqueue one sample without waiting; False (and counted) when the queue is full."""
        if self._forks != _forks:  # (a counter, not os.getpid(): a system call on every sample)
            self._after_fork()
        try:
            self._q.put_nowait(sample)
            self._accepted += 1
            return True
        except queue.Full:
            self.queue_dropped += 1
            return False

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Streamer:
        self._thread.start()
        return self

    def _after_fork(self) -> None:
        """The first submit in a forked child: the parent's thread, queue lock and connections do not exist here
        (a lock held at the fork would deadlock the child). The child streams as a producer of its own, into the
        same spool, from a thread of its own — only once it has samples to send."""
        self._forks = _forks
        started = self._thread.ident is not None
        self.producer = uuid.uuid4().hex
        self.seq = 0
        self.queue_dropped = self.spool_dropped = self.rejected = self.sent = 0
        self._accepted = self._done = 0
        self._inflight = None
        self._q = queue.Queue(maxsize=self._q.maxsize)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self.client = self.client.fresh()
        self.spool = Spool(self.spool.root, self.spool.max_bytes)
        self._thread = threading.Thread(target=self._run, name="shadowd-streamer", daemon=True)
        if started:
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Flush what can be flushed within ``timeout``, stop the thread, and spool what is left — the batch still
        being posted (a collector that never answers) and the queue — so that the next start replays it."""
        self.flush(timeout)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        self._spool_leftovers()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (not on the serving path!) until queue and spool are empty; True when they are."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._idle.clear()
            if self._done >= self._accepted and self.spool.depth() == 0:
                return True
            if not self._thread.is_alive():
                return False
            self._idle.wait(0.05)
        return False

    def _spool_leftovers(self) -> None:
        with self._lock:
            inflight, self._inflight = self._inflight, None
            if inflight is not None and self._thread.is_alive():  # (a post may still land: replays are idempotent)
                seq, body, n = inflight
                if not self.spool.push(self.run_id, self.producer, seq, body, n):
                    self.spool_dropped += n
            samples: list[dict[str, Any]] = []
            while True:
                try:
                    samples.append(self._q.get_nowait())
                except queue.Empty:
                    break
            for i in range(0, len(samples), self.batch_max):
                part = samples[i:i + self.batch_max]
                seq = self._next_seq()
                if not self.spool.push(self.run_id, self.producer, seq, self._encode(seq, part), len(part)):
                    self.spool_dropped += len(part)
            self._done += len(samples)
        if samples or inflight is not None:
            log.warning("shadowd: streamer closed with %d queued samples%s: spooled for the next start", len(samples),
                        " and a batch in flight" if inflight is not None else "")

    # ---- the background thread -------------------------------------------------------------------
    def producer_stats(self) -> dict[str, int]:
        out = dict(self.stats()) if self.stats else {}
        out["spool_depth"] = self.spool.depth()
        out["dropped"] = self.dropped
        out["rejected"] = self.rejected
        return {k: v for k, v in out.items() if k not in self.unknown_fields}

    def producer_notes(self) -> dict[str, str]:
        notes = self.notes() if self.notes else {}
        return {k: v for k, v in notes.items() if k not in self.unknown_fields}

    def _without_unknown(self, e: BatchRejected, body: bytes) -> bytes | None:
        """The batch ``body`` without the producer figure ``e`` refused as unknown, which every later batch leaves
        out too (None: refused for anything else)."""
        what = e.unknown_producer_field
        if what is None:
            return None
        group, key = what
        try:
            batch = decode_msgpack(body)
        except ValueError:
            return None
        part = batch.get(group) if isinstance(batch, dict) else None
        if not isinstance(part, dict) or key not in part:
            return None
        if key not in self.unknown_fields:
            self.unknown_fields.add(key)
            log.warning("shadowd: the collector does not know the producer figure %s.%s (it is older than this "
                        "hook): left out from now on", group, key)
        del part[key]
        if not part:
            del batch[group]
        return encode_msgpack(batch)

    def _can_post(self) -> bool:
        return self.run_id != PENDING_RUN and time.monotonic() >= self._retry_at

    def _take(self) -> tuple[list[dict[str, Any]], int]:
        """Samples for the next batch (pollers first, then the queue) and how many came off the queue. While the
        batch can only be spooled (collector down, run not registered), it waits up to ``flush_interval_s`` for a
        full batch, so an outage spools few large batches, not many small ones."""
        out: list[dict[str, Any]] = []
        for poll in self.pollers:
            try:
                out.extend(poll())
            except Exception as e:  # a poller's failure must not stop the streamer
                log.warning("shadowd: poller failed: %r", e)
        polled = len(out)
        try:
            out.append(self._q.get(timeout=self.flush_interval_s if not out else 0.001))
        except queue.Empty:
            return out, 0
        if not self._can_post():
            deadline = time.monotonic() + self.flush_interval_s
            while self._q.qsize() < self.batch_max and time.monotonic() < deadline and not self._stop.is_set():
                time.sleep(0.01)
        while len(out) < self.batch_max + polled:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                break
        return out, len(out) - polled

    def _answer(self, body: dict[str, Any], run_id: int) -> None:
        self._last_contact = time.monotonic()
        # (an earlier run's leftovers are answered with that run's kill switch: not this process's)
        if run_id == self.run_id and self.on_mode_override is not None and "mode_override" in body:
            self.on_mode_override(body["mode_override"])

    def _post(self, run_id: int, body: bytes, n: int) -> bool | None:
        """True delivered, False dropped (rejected, or failing the collector again and again), None unavailable."""
        try:
            self._answer(self.client.post_batch(run_id, body), run_id)
            self.sent += n
            self._backoff = 0.5
            self._bug_tries = 0
            return True
        except CollectorUnavailable as e:
            self.last_error = str(e)
            if e.status == 500:  # the collector failed on this batch: not an outage (503), but maybe a bug
                self._bug_tries += 1
                if self._bug_tries >= BUG_TRIES:
                    self._bug_tries = 0
                    self.rejected += n
                    log.error("shadowd: the collector failed %d times on a batch of %d samples (%s): dropped",
                              BUG_TRIES, n, e)
                    return False
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 10.0)
            return None
        except BatchRejected as e:
            self.last_error = str(e)
            if e.status in (401, 403):  # a token not (yet) valid there: kept for when it is (a restart replays)
                log.warning("shadowd: the collector refused this producer's token (%s): spooling", e)
                self._retry_at = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, 10.0)
                return None
            retry = self._without_unknown(e, body)
            if retry is not None:
                return self._post(run_id, retry, n)
            self.rejected += n
            log.warning("shadowd: collector rejected a batch of %d samples (%s): dropped", n, e)
            return False

    def _replay(self) -> None:
        # at most REPLAY_ROUND batches per round: the queue is served in between (its samples spooled behind them)
        for _ in range(REPLAY_ROUND):
            entry = self.spool.peek()
            if entry is None or not self._can_post():
                return
            try:
                body = entry.read()
            except OSError as e:  # gone (delivered by another producer sharing the directory) or unreadable
                log.warning("shadowd: spooled batch %s could not be read (%r): skipped", entry.path.name, e)
                self.spool.pop(entry)
                continue
            # A spool directory belongs to one run key (shadowd.sglang.process, HookRuntime.start_streaming): what
            # it holds goes to this streamer's run, whatever run id it was spooled under — PENDING_RUN (before the
            # registration), or another id for the same run key (a collector whose database was made anew). The
            # body names its producer and seq, so a batch another process of the key delivered first is a duplicate.
            if self._post(self.run_id, body, entry.samples) is None:
                return
            self.spool.pop(entry)

    def _next_seq(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    def _encode(self, seq: int, samples: list[dict[str, Any]]) -> bytes:
        stats, notes = self.producer_stats(), self.producer_notes()
        self._encoded = _health(stats, notes)
        return encode_msgpack(build_batch(self.producer, seq, samples, stats, producer_notes=notes, rank=self.rank,
                                              stage=self.stage))

    def _valid(self, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The samples the collector would take: one it would refuse (a bad field, usually a caller's bucket or
        layer) is counted in ``rejected``, logged (the first ``INVALID_LOGGED``) and left out, so that it does not
        take the rest of its batch with it (the collector refuses a batch as a whole)."""
        good = []
        for sample in samples:
            problem = sample_problem(sample, self.num_layers)
            if problem is None:
                good.append(sample)
                continue
            self.invalid += 1
            self.rejected += 1
            if self.invalid <= INVALID_LOGGED:
                log.warning("shadowd: a sample the collector would refuse was left out (%s: %s)%s", *problem,
                            "; further ones are counted only" if self.invalid == INVALID_LOGGED else "")
        return good

    def _ship(self, samples: list[dict[str, Any]]) -> None:
        if samples:  # (none: a stats-only batch, :meth:`_report_idle`)
            samples = self._valid(samples)
            if not samples:
                return
        with self._lock:
            seq = self._next_seq()
        body = self._encode(seq, samples)
        if self.spool.depth() == 0 and self._can_post():
            self._inflight = (seq, body, len(samples))
            done = self._post(self.run_id, body, len(samples))
            with self._lock:
                if self._inflight is None:  # close() spooled it meanwhile
                    return
                self._inflight = None
            if done is not None:
                # delivered, or refused: a refused stats-only batch (a collector that lost this producer) is
                # not sent again for the same figures
                if done or not samples:
                    self._reported = self._encoded
                return
        with self._lock:
            if not self.spool.push(self.run_id, self.producer, seq, body, len(samples)):
                self.spool_dropped += len(samples)

    def _report_idle(self) -> None:
        """Idle (nothing to send, the spool empty, the collector answering): when the health figures moved since
        the newest batch posted directly — samples dropped while the collector was away, reported only with a later
        batch, which an idle producer does not send — ship them in a stats-only batch. At most one per
        ``poll_interval_s`` without other contact; its answer carries the kill switch like any batch's. A producer
        none of whose samples reached the collector (all dropped: a spool bound or a spool disk that failed while
        the collector was away) sends one only when it knows its :attr:`rank` and has something to report (drops,
        a note): the collector files the figures under the rank of the producer's samples, else the stated one."""
        if self.spool.depth() or not self._can_post() or time.monotonic() - self._last_contact < self.poll_interval_s:
            return
        health = _health(self.producer_stats(), self.producer_notes())
        if self.sent == 0 and (self.rank is None or not any(health.values())):
            return
        if health != self._reported:
            self._ship([])

    def _poll_mode(self) -> None:
        if (time.monotonic() - self._last_contact < self.poll_interval_s or not self._can_post()):
            return
        try:
            self._answer(self.client.get_run(self.run_id), self.run_id)
        except CollectorUnavailable:
            self._retry_at = time.monotonic() + self._backoff
        except BatchRejected as e:
            self.last_error = str(e)
            self._last_contact = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            samples: list[dict[str, Any]] = []
            from_queue = 0
            try:
                # (the replay first: samples are taken off the queue only to be shipped at once, so a replay that
                # blocks on a collector that never answers holds none of them where close() cannot see them)
                self._replay()
                samples, from_queue = self._take()
                if samples:
                    self._ship(samples)
                else:
                    self._report_idle()
                # no answer for poll_interval_s (idle, or every batch rejected): ask for the kill switch
                self._poll_mode()
            except Exception as e:  # the thread must survive anything; the samples are lost and counted
                log.warning("shadowd: streamer error, %d samples dropped: %r", len(samples), e)
                self.spool_dropped += len(samples)
                time.sleep(0.1)
            finally:
                self._done += from_queue
                self._idle.set()

"""The background streamer: samples → columnar wire batches → collector, never blocking the caller.

* :meth:`Streamer.submit` is what the serving thread calls: ``queue.put_nowait`` and nothing
  else (a full queue drops the sample and counts it). It never touches the network or disk.
* One daemon thread takes samples off the queue (and off any registered *pollers*, e.g. the
  GPU ring drainer), builds batches of up to ``batch_max`` samples in the layout of
  ``shadowd.wire`` (producer id random per process, seq 0, 1, 2, ...) with every numeric
  column packed (little-endian int64 / float64, ``hist`` n × HIST_BINS int64: one msgpack bin
  each, which the collector reads with one ``numpy.frombuffer``), and posts them as msgpack
  through :class:`shadowd.client.CollectorClient`.
* Collector down, slow or 5xx → the batch goes to the bounded on-disk :class:`Spool`;
  while the spool is non-empty new batches queue behind it, so delivery stays in order;
  the spool is replayed oldest first once the collector answers (with backoff meanwhile).
  A batch the spool cannot take is dropped and its samples counted in ``dropped``, which
  every later batch reports in ``producer_stats``.
* A 4xx answer (bad batch, conflict, unknown run, too big, auth) is logged and the batch
  dropped and counted in ``rejected``: it is never retried.
* Every accepted batch's answer carries the run's ``mode_override`` (the kill switch); when no
  answer has come for ``poll_interval_s`` (nothing to send, or every batch rejected) the thread
  polls ``GET /v1/runs/{id}``. Changes go to ``on_mode_override``.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from shadowd.client import BatchRejected, CollectorClient, CollectorUnavailable
from shadowd.hook.spool import Spool
from shadowd.wire import COLUMNS, PRODUCER_NOTE_MAX, PRODUCER_NOTES, encode_msgpack, pack_column, pack_hist

__all__ = ["Streamer", "build_batch"]

log = logging.getLogger("shadowd.hook")

_FLOAT_COLS = {c.name for c in COLUMNS if c.kind == "float"}


def build_batch(producer: str, seq: int, samples: list[dict[str, Any]],
                producer_stats: dict[str, int] | None = None, packed: bool = True,
                producer_notes: dict[str, str] | None = None) -> dict[str, Any]:
    """A wire batch (``shadowd.wire``) of ``samples`` (dicts keyed by column name).

    Numeric columns are packed (``packed=False``: lists, the same content for the collector).
    """
    cols: dict[str, Any] = {}
    for col in COLUMNS:
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
    if producer_stats:
        batch["producer_stats"] = producer_stats
    notes = {k: v[:PRODUCER_NOTE_MAX] for k, v in (producer_notes or {}).items() if k in PRODUCER_NOTES and v}
    if notes:
        batch["producer_notes"] = notes
    return batch


class Streamer:
    """Streams samples of one run (``run_id``) to the collector behind ``client``."""

    def __init__(self, client: CollectorClient, run_id: int, spool: Spool, *, queue_max: int = 100_000,
                 batch_max: int = 4096, flush_interval_s: float = 0.25, poll_interval_s: float = 2.0,
                 producer: str | None = None,
                 on_mode_override: Callable[[str | None], None] | None = None,
                 stats: Callable[[], dict[str, int]] | None = None,
                 notes: Callable[[], dict[str, str]] | None = None) -> None:
        self.client = client
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
        self.dropped = 0  # samples: queue full, or spool bound hit
        self.rejected = 0  # samples in batches the collector refused (4xx)
        self.sent = 0  # samples acknowledged by the collector
        self.last_error: str | None = None
        self._q: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=queue_max)
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._retry_at = 0.0
        self._backoff = 0.5
        self._last_contact = 0.0
        self._accepted = 0  # samples put on the queue (serving thread)
        self._done = 0  # samples taken off it and shipped, spooled or dropped (streamer thread)
        self._thread = threading.Thread(target=self._run, name="shadowd-streamer", daemon=True)

    # ---- the serving thread's side -------------------------------------------------------------
    def submit(self, sample: dict[str, Any]) -> bool:
        """Enqueue one sample without waiting; False (and counted) when the queue is full."""
        try:
            self._q.put_nowait(sample)
            self._accepted += 1
            return True
        except queue.Full:
            self.dropped += 1
            return False

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Streamer:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Flush what can be flushed within ``timeout``, then stop the thread."""
        self.flush(timeout)
        self._stop.set()
        self._thread.join(timeout=timeout)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (not on the serving path!) until queue and spool are empty; True when they are."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._idle.clear()
            if self._done >= self._accepted and self.spool.depth() == 0:
                return True
            self._idle.wait(0.05)
        return False

    # ---- the background thread -------------------------------------------------------------------
    def producer_stats(self) -> dict[str, int]:
        out = dict(self.stats()) if self.stats else {}
        out["spool_depth"] = self.spool.depth()
        out["dropped"] = self.dropped
        return out

    def _take(self) -> tuple[list[dict[str, Any]], int]:
        """Samples for the next batch (pollers first, then the queue) and how many came off the queue."""
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
        while len(out) < self.batch_max + polled:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                break
        return out, len(out) - polled

    def _answer(self, body: dict[str, Any]) -> None:
        self._last_contact = time.monotonic()
        if self.on_mode_override is not None and "mode_override" in body:
            self.on_mode_override(body["mode_override"])

    def _post(self, body: bytes, n: int) -> bool | None:
        """True delivered, False rejected (dropped), None unavailable."""
        try:
            self._answer(self.client.post_batch(self.run_id, body))
            self.sent += n
            self._backoff = 0.5
            return True
        except CollectorUnavailable as e:
            self.last_error = str(e)
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 10.0)
            return None
        except BatchRejected as e:
            self.last_error = str(e)
            self.rejected += n
            log.warning("shadowd: collector rejected a batch of %d samples (%s): dropped", n, e)
            return False

    def _replay(self) -> None:
        while (entry := self.spool.peek()) is not None and time.monotonic() >= self._retry_at:
            if entry.run_id != self.run_id:
                self.spool.pop(entry)  # another run's leftovers: not ours to deliver
                continue
            if self._post(entry.read(), 0) is None:
                return
            self.spool.pop(entry)

    def _ship(self, samples: list[dict[str, Any]]) -> None:
        seq = self.seq
        self.seq += 1
        body = encode_msgpack(build_batch(self.producer, seq, samples, self.producer_stats(),
                                          producer_notes=self.notes() if self.notes else None))
        direct = self.spool.depth() == 0 and time.monotonic() >= self._retry_at
        if direct and self._post(body, len(samples)) is not None:
            return
        if not self.spool.push(self.run_id, self.producer, seq, body):
            self.dropped += len(samples)

    def _poll_mode(self) -> None:
        if time.monotonic() - self._last_contact < self.poll_interval_s or time.monotonic() < self._retry_at:
            return
        try:
            self._answer(self.client.get_run(self.run_id))
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
                samples, from_queue = self._take()
                self._replay()
                if samples:
                    self._ship(samples)
                # no answer for poll_interval_s (idle, or every batch rejected): ask for the kill switch
                self._poll_mode()
            except Exception as e:  # the thread must survive anything; the samples are lost and counted
                log.warning("shadowd: streamer error, %d samples dropped: %r", len(samples), e)
                self.dropped += len(samples)
                time.sleep(0.1)
            finally:
                self._done += from_queue
                self._idle.set()

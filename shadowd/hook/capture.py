"""Repro bundles on the CUDA path (eager calls): snapshot on the serving thread, copy and save on the streamer's.

On CUDA a call's statistics reach the host only through the ring (``shadowd.hook.device``), after the call
has returned and its inputs may have been overwritten; copying every sampled call's inputs (for the verify
site, the KV rows the call reads: hundreds of MB at 200k-token prefixes) would cost serving far more than
bundles are worth. So:

* a call whose candidate failed on the host (exception, wrong shape or dtype, modified input) is captured at
  once: its inputs are still there;
* a numeric breach (a hard failure, candidate-only non-finite values, or rel-L2 above ``bundle_rel_l2``), seen
  when the streamer's thread drains the ring, **arms** its call site and layer: the next sampled eager call
  there is snapshotted — device copies on the serving stream (a few launches, no synchronisation) — and the
  streamer's thread copies the snapshot to pinned host memory on a stream of its own, recomputes the
  statistics and writes the bundle only if that call breaches too. After ``ARM_TRIES`` snapshots that do not
  breach, the site is disarmed until its next breach.

A site may compact its inputs for a bundle (``ShadowSite(bundle_args=...)``: the SGLang verify site gathers
the KV rows the call reads instead of the whole cache); by default every tensor argument is copied. At most
one snapshot is in flight, and none is taken whose tensors exceed the bundle byte bound. Never under CUDA-graph
capture (a replay runs no Python); ``shadowd.sglang.graphs`` refuses bundles with captured graphs.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shadowd.hook.diffstats import empty_stats, hard_failure, stats_torch

if TYPE_CHECKING:
    from shadowd.hook.site import Bucket, ShadowSite

__all__ = ["ARM_TRIES", "Captures", "breach"]

log = logging.getLogger("shadowd.hook")

#: snapshots taken for one arming before the site is disarmed (until its next breach)
ARM_TRIES = 4


def breach(stats: dict[str, Any], hard_scaled: float, hard_rel_l2: float, bundle_rel_l2: float) -> str | None:
    """Why a call's statistics deserve a bundle (the CPU path's rule), or None."""
    hard = hard_failure(stats, hard_scaled, hard_rel_l2)
    if hard:
        return str(hard)
    rel = stats.get("rel_l2")
    if rel is not None and rel > bundle_rel_l2:
        return "tolerance"
    return None


def _nbytes(xs: Any) -> int:
    return sum(t.numel() * t.element_size() for t in xs if isinstance(t, torch.Tensor))


@dataclass
class _Snapshot:
    site: ShadowSite
    key: int
    layer: int
    bucket: Bucket
    mode: str
    reason: str | None  # known on the host (the candidate failed there), else decided from the statistics
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    refs: dict[str, str]
    outs: dict[str, torch.Tensor]
    valid: int | torch.Tensor | None  # real rows: an int, or a device tensor holding it (copied too)
    row_numel: int
    ready: Any  # torch.cuda.Event after the device copies (serving stream)
    host: dict[str, Any] = field(default_factory=dict)
    done: Any = None  # torch.cuda.Event after the host copies (the capture stream)


class Captures:
    """The arming state and the snapshot in flight of one process (owned by ``DeviceState``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, int] = {}  # call-site key -> snapshots left
        self._pending: _Snapshot | None = None
        self._reserved = False
        self._stream: Any = None
        self.taken = 0
        self.saved = 0
        self.dropped = 0  # snapshots that did not breach, or that a bound stopped

    def arm(self, key: int) -> None:
        """A breach was seen at call-site key ``key`` (streamer's thread)."""
        with self._lock:
            self._armed.setdefault(key, ARM_TRIES)

    def wants(self, key: int) -> bool:
        """Whether the current call at ``key`` should be snapshotted (serving thread: a dict lookup)."""
        return key in self._armed and self._pending is None and not self._reserved

    def snapshot(self, site: ShadowSite, key: int, layer: int, bucket: Bucket, mode: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any], out_b: torch.Tensor, out_c: Any, reason: str | None) -> bool:
        """Device copies of the call's (compacted) inputs and outputs, on the serving stream; no synchronisation.
        False when one is already in flight or the byte bound stops it."""
        writer = site._bundles
        if writer is not None and writer.full:
            return False  # the bundle directory is full: no more device copies
        with self._lock:
            if self._pending is not None or self._reserved:
                return False
            if reason is None:  # an armed site: count the try
                left = self._armed.get(key, 0) - 1
                if left < 0:
                    return False
                if left == 0:
                    self._armed.pop(key, None)
                else:
                    self._armed[key] = left
            self._reserved = True  # the one slot is this call's until its snapshot is in place (or dropped)
        try:
            snap = self._take(site, key, layer, bucket, mode, args, kwargs, out_b, out_c, reason)
        except BaseException:
            with self._lock:
                self._reserved = False
            raise
        with self._lock:
            self._reserved = False
            if snap is None:  # over the byte bound
                self.dropped += 1
                return False
            self._pending = snap
            self.taken += 1
        return True

    def _take(self, site: ShadowSite, key: int, layer: int, bucket: Bucket, mode: str, args: tuple[Any, ...],
              kwargs: dict[str, Any], out_b: torch.Tensor, out_c: Any, reason: str | None) -> _Snapshot | None:
        cfg = site.rt.config
        if site.bundle_args is not None:
            packed = site.bundle_args(args, kwargs, cfg.bundle_max_bytes)
            if packed is None:
                return None
            sargs, skw, refs = packed  # private copies already (the site's contract)
        else:
            if _nbytes(list(args) + list(kwargs.values())) > cfg.bundle_max_bytes:
                return None
            sargs = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
            skw = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            refs = dict(site.refs)
        outs = {name: t.detach().clone() for name, t in (("baseline", out_b), ("candidate", out_c))
                if isinstance(t, torch.Tensor)}
        valid = bucket.valid_rows.detach().clone() if isinstance(bucket.valid_rows, torch.Tensor) else bucket.valid_rows
        row = out_b[0].numel() if out_b.dim() and out_b.shape[0] else 1
        ready = torch.cuda.Event()
        ready.record()
        return _Snapshot(site, key, layer, bucket, mode, reason, sargs, skw, refs, outs, valid, row, ready)

    def service(self) -> None:
        """Streamer's thread: start the host copies of the snapshot in flight, or finish it once they landed
        (recompute the statistics, write the bundle if the call breaches)."""
        snap = self._pending
        if snap is None:
            return
        try:
            self._advance(snap)
        except Exception:
            with self._lock:  # a snapshot that cannot be copied or saved is dropped, not retried forever
                self._pending = None
                self.dropped += 1
            raise

    def _advance(self, snap: _Snapshot) -> None:
        if snap.done is None:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=snap.outs["baseline"].device)
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(snap.ready)
                snap.host = {name: self._host(t) for name, t in self._tensors(snap).items()}
                snap.done = torch.cuda.Event()
                snap.done.record(self._stream)
            return
        if not snap.done.query():
            return
        self._finish(snap)
        with self._lock:
            self._pending = None

    @staticmethod
    def _tensors(snap: _Snapshot) -> dict[str, torch.Tensor]:
        out = {f"arg.{i}": a for i, a in enumerate(snap.args) if isinstance(a, torch.Tensor)}
        out.update({f"kwarg.{k}": v for k, v in snap.kwargs.items() if isinstance(v, torch.Tensor)})
        out.update({f"out.{k}": v for k, v in snap.outs.items()})
        if isinstance(snap.valid, torch.Tensor):
            out["valid"] = snap.valid
        return out

    @staticmethod
    def _host(t: torch.Tensor) -> torch.Tensor:
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        return h

    def _finish(self, snap: _Snapshot) -> None:
        site, cfg, h = snap.site, snap.site.rt.config, snap.host
        args = tuple(h[f"arg.{i}"] if isinstance(a, torch.Tensor) else a for i, a in enumerate(snap.args))
        kwargs = {k: h[f"kwarg.{k}"] if isinstance(v, torch.Tensor) else v for k, v in snap.kwargs.items()}
        out_b, out_c = h.get("out.baseline"), h.get("out.candidate")
        reason = snap.reason
        rows = int(h["valid"].reshape(-1)[0]) if "valid" in h else snap.valid
        valid_numel = None if rows is None else int(rows) * snap.row_numel
        if out_b is not None and out_c is not None and out_c.shape == out_b.shape and out_c.dtype == out_b.dtype:
            stats = stats_torch(out_c, out_b, valid_numel)
        else:
            stats = empty_stats(0 if out_b is None else (valid_numel or out_b.numel()))
        if reason is None:
            reason = breach(stats, cfg.hard_scaled_max_abs, cfg.hard_rel_l2, cfg.bundle_rel_l2)
        if reason is None:
            self.dropped += 1  # this call was fine: the site stays armed for its remaining tries
            return
        sample = site._sample(snap.layer, snap.bucket, stats, error=snap.reason, mode=snap.mode, cand_us=None,
                              base_us=None)
        path, err = site._isolated("bundle", site._save_bundle, args, kwargs, out_b, out_c, sample, reason,
                                   snap.refs)
        if path is None or err is not None:
            self.dropped += 1
            return
        self.saved += 1
        with self._lock:
            self._armed.pop(snap.key, None)
        log.info("shadowd: repro bundle %s (%s)", path, reason)

"""The per-process hook state: configuration, effective mode (kill switch), counters, sample sink.

One :class:`HookRuntime` per process (:func:`get_runtime` builds it from the environment on
first use); every :class:`shadowd.hook.site.ShadowSite` of the process shares it. It owns:

* the **effective mode**: the configured mode lowered by the collector's kill switch
  (``mode_override``: ``validate`` or ``off``) and, in on mode with ``SHADOWD_GATE_RUN``, held at
  ``validate`` until the promotion gate opens (:mod:`shadowd.hook.gate`), mirrored into pinned host
  memory that the device control kernel reads on every call (so it reaches captured graphs too);
  ``capture_code`` is the mode a graph captured now is built for (the gate's hold aside, so a graph
  captured while the gate is held serves the candidate once it opens);
* the sticky process-wide ``disabled`` (candidate errors) and ``fallback`` (on-mode hard
  failure) flags, reported in every batch's ``producer_stats``;
* the verify-step counter (advanced by the first layer's call) and the sampling decisions;
* the sink: a :class:`shadowd.hook.streamer.Streamer` when a collector is configured, or any
  callable (tests, demos).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from shadowd.hook.config import MODE_CODE, MODES, HookConfig

__all__ = ["HookRuntime", "get_runtime", "set_runtime"]

log = logging.getLogger("shadowd.hook")

_LOCK = threading.Lock()
_RUNTIME: HookRuntime | None = None
#: every runtime made in this process: a forked child gets new mode locks (one held by a thread at the fork, a thread
#: the child does not have, would never be released there)
_RUNTIMES: weakref.WeakSet[HookRuntime] = weakref.WeakSet()


def _new_mode_locks() -> None:
    for rt in list(_RUNTIMES):
        rt._mode_lock = threading.RLock()


if hasattr(os, "register_at_fork"):  # (not on Windows, which cannot fork)
    os.register_at_fork(after_in_child=_new_mode_locks)


class HookRuntime:
    """Process-wide hook state (see the module docstring)."""

    def __init__(self, config: HookConfig | None = None,
                 sink: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.config = config or HookConfig.from_env()
        self.sink = sink
        self.override: str | None = None
        #: on mode with a promotion gate: the candidate is not served (validate) until the gate opens
        self.gate_held = self.config.mode == "on" and self.config.gate_run is not None
        self.gate_reason: str | None = "not checked yet" if self.gate_held else None
        self.mode = self.config.mode
        self.mode_code = MODE_CODE[self.mode]
        self.capture_code = self.mode_code
        self.disabled = False
        self.fallback = False
        self.fallback_reason: str | None = None
        self.disabled_reason: str | None = None
        self.device_errors = 0
        #: on-mode calls (neither fallen back nor disabled) on a shape the verdict and the static limits cover, and
        #: on one they do not (the baseline served those): eager calls counted by the host, graph replays by the
        #: control kernel (``device_on_calls``, as of the latest record drained)
        self.on_calls = [0, 0]
        self.device_on_calls = [0, 0]
        self.step = 0
        #: a weak reference to the ShadowSite whose first-layer calls advance ``step`` (the first one to make such a
        #: call; a site that replaces it once it is gone takes over)
        self.step_site: Any = None
        #: the names of the sites that feed this runtime (:meth:`join_site`)
        self.site_names: set[str] = set()
        self.calls = 0
        self.emitted = 0
        # compared calls whose candidate raised, raised its error word or wrote a NaN / Inf (eager calls as they
        # run; CUDA-graph calls as their records are drained)
        self.candidate_failures = 0
        self.sink_errors = 0
        self.run_id: int | None = None
        self.streamer: Any = None
        self._device: Any = None  # shadowd.hook.device.DeviceState, created on the first CUDA call
        self.gate: Any = None  # shadowd.hook.gate.PromotionGate, watching once the run is registered
        #: on mode: the shapes the promotion gate's verdict covered (``shadowd.hook.coverage.Coverage``), set when the
        #: gate opens; None: no verdict limits the shapes (no gate), only ``max_draft_tokens`` / ``max_prefix_len``
        self.coverage: Any = None
        # the mode is changed by more than one thread (the streamer's: the kill switch; the gate's: open_gate; the
        # serving thread's: disable / fall_back): each change computes the mode and writes it, and the control word,
        # whole, so a kill switch applied while the gate opens is never overwritten by the opening (the serving path
        # only reads mode_code: it never takes this lock)
        self._mode_lock = threading.RLock()
        _RUNTIMES.add(self)
        self._apply_mode()

    @classmethod
    def from_env(cls, run_key: str | None = None, *, env: Mapping[str, str] | None = None,
                 sink: Callable[[dict[str, Any]], Any] | None = None) -> HookRuntime:
        """A runtime configured from the environment (:meth:`HookConfig.from_env`), with ``run_key`` in place of
        ``SHADOWD_RUN_KEY`` when given.

        This is how one process shadows a second candidate apart from the first: the sites of each candidate take
        a runtime of their own (``ShadowSite(..., runtime=rt)``), which registers its own run
        (:meth:`start_streaming`) and so has its own verdict, kill switch, disabled / fallback state, step counter,
        producer and spool directory. Mode, sampling, collector and limits are the environment's, shared."""
        cfg = HookConfig.from_env(env)
        if run_key is not None:
            if not isinstance(run_key, str) or not run_key.strip():
                raise ValueError(f"run_key: a non-empty string names the run, got {run_key!r}")
            cfg = dataclasses.replace(cfg, run_key=run_key)
        return cls(cfg, sink=sink)

    # ---- mode and sticky states ----------------------------------------------------------------
    def set_override(self, override: str | None) -> None:
        """Apply the collector's kill switch (``None`` clears it); takes effect on the next call."""
        if override is not None and override not in MODES:
            log.warning("shadowd: ignoring unknown mode_override %r", override)
            return
        with self._mode_lock:
            self.override = override
            self._apply_mode()

    def open_gate(self, why: str, coverage: Any = None) -> None:
        """The promotion gate opened (:mod:`shadowd.hook.gate`): on mode serves the candidate from the next call, on
        the shapes ``coverage`` (:class:`shadowd.hook.coverage.Coverage`, the verdict's) holds — in place, on the
        device too, before the mode changes (raises, the gate still held, when they cannot be copied there)."""
        with self._mode_lock:
            if coverage is not None:
                if self._device is not None:
                    self._device.push_coverage(coverage)
                self.coverage = coverage
            if self.gate_held:  # (capture_code: the mode the kill switch lets it reach)
                lowered = self.capture_code < MODE_CODE[self.config.mode]
                shapes = "" if coverage is None else f"; the candidate is served on its {coverage.describe()}"
                log.warning("shadowd: promotion gate open: %s%s%s", why, shapes, "" if not lowered else
                            f" (the kill switch holds mode {MODES[self.capture_code]}: the candidate is served once "
                            "it is cleared)")
            self.gate_held = False
            self.gate_reason = None
            self._apply_mode()

    def widen_coverage(self, coverage: Any) -> int:
        """A later READY verdict of the gate run (:meth:`shadowd.hook.gate.PromotionGate.follow`): the shapes served on
        become the union with ``coverage`` — on the device first, then here; never fewer (a shape a READY verdict for
        this build covered stays covered). Returns the buckets added (0 without an opened set: every shape is then
        within the verdict's reach already, the static limits aside)."""
        with self._mode_lock:
            cur = self.coverage
            if cur is None or self.gate_held:
                return 0
            union = cur.union(coverage)
            added = len(union.shapes) - len(cur.shapes)
            if added:
                if self._device is not None:
                    self._device.push_coverage(union)
                self.coverage = union
            return added

    def start_gate(self, client: Any, own: dict[str, Any]) -> Any:
        """Watch the promotion gate (on mode with ``SHADOWD_GATE_RUN``) with a client of its own, once this
        process's run is registered (``own``: what the registration sent); returns the watcher, or None when no
        gate is held."""
        if not self.gate_held or self.config.gate_run is None or self.gate is not None:
            return None
        from shadowd.hook.gate import PromotionGate

        if self.run_id == self.config.gate_run:
            log.warning("shadowd: SHADOWD_GATE_RUN=%d is this process's own run (registered under the validate run's "
                        "key): the gate opens once the validate traffic it serves while held makes that run READY, "
                        "with no other validate run's verdict before it", self.run_id)
        self.gate = PromotionGate(self, client.fresh(), self.config.gate_run, own).start()
        return self.gate

    def _apply_mode(self) -> None:
        with self._mode_lock:
            mode = self.config.mode
            if self.override is not None and MODE_CODE[self.override] < MODE_CODE[mode]:
                mode = self.override
            self.capture_code = MODE_CODE[mode]
            if self.gate_held and MODE_CODE[mode] > MODE_CODE["validate"]:
                mode = "validate"
            if mode != self.mode:
                log.warning("shadowd: mode %s -> %s (kill switch %r%s)", self.mode, mode, self.override,
                            ", promotion gate held" if self.gate_held else "")
            self.mode = mode
            self.mode_code = MODE_CODE[mode]
            self._sync_device()

    def join_site(self, name: str) -> None:
        """A :class:`shadowd.hook.site.ShadowSite` named ``name`` feeds this runtime. Samples carry no site name: the
        statistics of differently named sites are stored and judged together, per layer and shape bucket, in the
        process's one run — say so once, when a second name joins."""
        if name not in self.site_names:
            self.site_names.add(name)
            if len(self.site_names) == 2:
                log.warning("shadowd: sites %s share one runtime and so one run: their samples carry no site name "
                            "and are stored and judged together per layer and shape bucket (one verdict, one kill "
                            "switch, one disabled / fallback state for all of them); to judge a candidate apart, give "
                            "its sites a runtime of their own: ShadowSite(..., runtime=HookRuntime.from_env("
                            "run_key=...)), registered with its start_streaming",
                            ", ".join(repr(n) for n in sorted(self.site_names)))

    def disable(self, reason: str) -> None:
        with self._mode_lock:
            if not self.disabled:
                log.error("shadowd: candidate disabled for this process: %s", reason)
            self.disabled = True
            self.disabled_reason = self.disabled_reason or reason
            self._sync_device()

    def fall_back(self, reason: str) -> None:
        with self._mode_lock:
            if not self.fallback:
                log.error("shadowd: on-mode fell back to the baseline for this process: %s", reason)
            self.fallback = True
            self.fallback_reason = self.fallback_reason or reason
            self._sync_device()

    def _sync_device(self) -> None:
        if self._device is not None:
            self._device.sync_host_control(self)

    def producer_stats(self) -> dict[str, int]:
        covered, uncovered = self.on_shape_calls()
        return {"fallback": int(self.fallback), "disabled": int(self.disabled),
                "device_errors": int(self.device_errors), "on_covered_calls": covered,
                "on_uncovered_calls": uncovered}

    def on_mode_covered(self, batch_size: int, draft_tokens: int, prefix_len: int) -> bool:
        """:meth:`covered`, for an eager on-mode call (neither fallen back nor disabled), which it counts."""
        covered = self.covered(batch_size, draft_tokens, prefix_len)
        self.on_calls[0 if covered else 1] += 1
        return covered

    def note_device_on(self, covered: int, uncovered: int) -> None:
        """The control kernel's counts of on-mode graph replays, as a drained record carries them (cumulative)."""
        dev = self.device_on_calls
        dev[0], dev[1] = max(dev[0], covered), max(dev[1], uncovered)

    def on_shape_calls(self) -> tuple[int, int]:
        """(on-mode calls on a covered shape, on-mode calls on a shape not covered) so far, eager and replayed."""
        return (self.on_calls[0] + self.device_on_calls[0], self.on_calls[1] + self.device_on_calls[1])

    def producer_notes(self) -> dict[str, str]:
        """Why the candidate was disabled / on mode fell back (``shadowd.wire.PRODUCER_NOTES``), once it was."""
        return {k: v for k, v in (("disabled_reason", self.disabled_reason), ("fallback_reason", self.fallback_reason))
                if v}

    # ---- per-step decisions --------------------------------------------------------------------
    def covered(self, batch_size: int, draft_tokens: int, prefix_len: int) -> bool:
        """Whether on mode may serve the candidate on a call of this shape: within the static limits
        (``max_draft_tokens`` / ``max_prefix_len``) and, once a promotion gate opened, in a shape bucket its
        verdict covered."""
        cov = self.coverage
        return self.config.covered(draft_tokens, prefix_len) and (
            cov is None or cov.covers(batch_size, draft_tokens, prefix_len))

    def sampled(self, step: int) -> bool:
        """Whether validate mode shadows this step (whole steps: every layer of a sampled step)."""
        s = self.config.sampling
        if s.fraction is not None:
            return ((step * 2654435761) & 0xFFFFFFFF) < s.fraction * 2**32
        return step % s.every == 0

    def spot_checked(self, step: int) -> bool:
        return step % self.config.spot_every == 0

    # ---- samples -------------------------------------------------------------------------------
    def emit(self, sample: dict[str, Any]) -> None:
        """Hand one sample to the sink without waiting (the streamer's submit is put_nowait)."""
        self.emitted += 1
        sink = self.sink
        if sink is None and self.streamer is not None:
            sink = self.streamer.submit
        if sink is not None:
            sink(sample)

    @property
    def has_device(self) -> bool:
        """Whether the device state exists (created by the first CUDA call)."""
        return self._device is not None

    def device(self) -> Any:
        """The shared device state (lazily; needs CUDA and Triton). Its ring is drained by the streamer's
        thread when one is attached, else by :meth:`drain_device`."""
        if self._device is None:
            from shadowd.hook.device import DeviceState

            with self._mode_lock:  # (a kill switch applied meanwhile is in the word: packed after it, or by it)
                self._device = DeviceState(self)
                self._device.sync_host_control(self)
            if self.streamer is not None:
                self.streamer.pollers.append(self._device.poll)
        return self._device

    def drain_device(self) -> int:
        """Move published GPU records to the sink (when no streamer drains them); returns how many."""
        if self._device is None or self.streamer is not None:
            return 0
        records = self._device.poll()
        for r in records:
            self.emit(r)
        return len(records)

    def start_streaming(self, run: dict[str, Any], client: Any = None) -> Any:
        """Register ``run`` (``POST /v1/runs``; ``run_key`` defaults to ``SHADOWD_RUN_KEY``) with the collector
        at ``SHADOWD_URL`` and start the background streamer; returns it. Idempotent per run_key, so every
        rank may call it. The kill switch of the answer is applied at once."""
        from shadowd.client import CollectorClient
        from shadowd.hook.spool import Spool, spool_dir
        from shadowd.hook.streamer import Streamer

        cfg = self.config
        if client is None:
            if not cfg.url:
                raise ValueError("no collector URL (SHADOWD_URL)")
            client = CollectorClient(cfg.url, token=cfg.token, timeout=cfg.http_timeout_s)
        body = dict(run)
        body.setdefault("run_key", cfg.run_key)
        answer = client.register_run(body)
        self.run_id = int(answer["id"])
        self.set_override(answer.get("mode_override"))
        self.start_gate(client, body)
        producer = uuid.uuid4().hex
        spool = Spool(spool_dir(cfg.spool_dir, body["run_key"], cfg.rank, producer, cfg.stage), cfg.spool_max_bytes)
        streamer = Streamer(client, self.run_id, spool, producer=producer, queue_max=cfg.queue_max,
                            batch_max=cfg.batch_max, flush_interval_s=cfg.flush_interval_s,
                            poll_interval_s=cfg.poll_interval_s, on_mode_override=self.set_override,
                            stats=self.producer_stats, notes=self.producer_notes, rank=cfg.rank, stage=cfg.stage,
                            num_layers=body.get("num_layers"))
        if self._device is not None:
            streamer.pollers.append(self._device.poll)
        self.streamer = streamer.start()
        # at exit, what is still queued is delivered or spooled for the next start (the SGLang plugin does the same)
        atexit.register(_close_at_exit, weakref.ref(streamer))
        return streamer


def _close_at_exit(ref: weakref.ref[Any]) -> None:
    streamer = ref()
    if streamer is not None:
        streamer.close(2.0)


def get_runtime() -> HookRuntime:
    """The process's runtime, built from the environment on first use."""
    global _RUNTIME
    with _LOCK:
        if _RUNTIME is None:
            _RUNTIME = HookRuntime()
        return _RUNTIME


def set_runtime(runtime: HookRuntime | None) -> None:
    """Install (or clear) the process's runtime (tests, the demo, the SGLang plugin)."""
    global _RUNTIME
    with _LOCK:
        _RUNTIME = runtime

"""The device state of the CUDA path: the control word (host and device mirror), the device counters, the
per-site scratch and the pinned record ring that the streamer's thread drains (:meth:`DeviceState.poll`).

The kernels and the per-call sequence that use it are in ``shadowd.hook.cuda_call`` (the call) and
``shadowd.hook.launch`` (the launches); the launch helpers are re-exported here.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from shadowd.hook.capture import Captures, breach
from shadowd.hook.coverage import WORDS as COVERAGE_WORDS
from shadowd.hook.coverage import Coverage
from shadowd.hook.diffstats import finalize
from shadowd.hook.launch import (
    NMETA,
    REC,
    REC_MAIN,
    REC_MAIN_ORACLE,
    REC_ORACLE_BASE,
    REC_ORACLE_CAND,
    RUN_BASE,
    RUN_CAND,
    TILE,
    fused_raw_stats,
    gated_copies,
    gated_copy,
    hist_mode_for,
    launch_stats,
    new_accumulator,
    pdl_options,
    pdl_supported,
)
from shadowd.hook.triton_control import mirror_kernel, pack_host_word, words_kernel

if TYPE_CHECKING:
    from shadowd.hook.runtime import HookRuntime
    from shadowd.hook.site import ShadowSite

# the launch helpers are re-exported: callers (tests, benches, older trees timed side by side) import them here
__all__ = ["NMETA", "REC", "REC_MAIN", "REC_MAIN_ORACLE", "REC_ORACLE_BASE", "REC_ORACLE_CAND", "RUN_BASE",
           "RUN_CAND", "TILE", "DeviceState", "fused_raw_stats", "gated_copies", "gated_copy", "hist_mode_for",
           "launch_stats", "new_accumulator", "oracle_error", "pdl_options", "pdl_supported"]

log = logging.getLogger("shadowd.hook")
_MODE_NAME = {1: "validate", 2: "on"}


class Slot:
    """Per (site, layer) device scratch: decisions of the current call and the statistics accumulator."""

    def __init__(self, site_id: int, device: torch.device) -> None:
        self.site_id = site_id
        self.sstate = torch.zeros(16, dtype=torch.int64, device=device)
        self.acc = new_accumulator(device)
        self.heads = 1


class DeviceState:
    """Process-wide device state: the control word (host and device mirror), device counters, the pinned
    record ring.

    The control word (``triton_control.HOST_WORD``: mode, sampling, spot checks, disabled, fallback) is what
    captured graphs obey. The host packs it into pinned memory and launches :func:`mirror_kernel` on a stream of
    its own, which copies it into device memory, where the control kernels of replays read it: a change reaches
    every call that starts after that 8-byte copy has run (microseconds later), and no call waits for host
    memory. A change made on a thread that is capturing (a candidate failing during capture) captures the copy
    into the graph at that point, and the next :meth:`poll` or eager call pushes it (``control_dirty``), as it
    does after a failed launch."""

    def __init__(self, rt: HookRuntime) -> None:
        self.rt = rt
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.hctrl = torch.zeros(8, dtype=torch.int64).pin_memory()
        self.dctrl = torch.zeros(1, dtype=torch.int64, device=self.device)
        #: the packed control word as last written (eager calls pass it to the control kernel)
        self.word = 0
        self.control_dirty = self._push_failing = False
        self._ctrl_version = 0  # bumped by every write of the word: a push covers the writes made before it
        self._ctrl_lock = threading.Lock()
        self._ctrl_stream = torch.cuda.Stream(self.device)
        self.dstate = torch.zeros(8, dtype=torch.int64, device=self.device)
        #: the shape buckets on mode may serve the candidate on (``shadowd.hook.coverage``'s bitmap, read by the control
        #: kernel once the control word's ``shapes`` bit says a promotion gate opened on a verdict)
        self.cov = torch.full((COVERAGE_WORDS,), -1, dtype=torch.int64, device=self.device)
        self._cov_host: torch.Tensor | None = None  # the pinned source of the latest push (alive until it has run)
        if rt.coverage is not None:  # (made on the serving thread's first eager call: a plain copy)
            self.cov.copy_(torch.tensor(rt.coverage.bitmap(), dtype=torch.int64))
        size = rt.config.ring_size
        self.ring = torch.zeros(size, REC, dtype=torch.float64).pin_memory()
        self.ring_seq = torch.zeros(size, dtype=torch.int64).pin_memory()
        self._h = self.hctrl.numpy()
        self._ring = self.ring.numpy()
        self._seq = self.ring_seq.numpy()
        self.next_seq = 0
        self.lost = 0
        #: per site id: the oracle errors of its latest oracle records, until their call's record arrives
        self._oracle: dict[int, dict[int, float]] = {}
        #: repro bundles of eager calls (shadowd.hook.capture): armed by breaches seen here
        self.captures = Captures()
        self.slots: dict[tuple[int, int], Slot] = {}
        self.sites: list[tuple[ShadowSite, int]] = []
        self.use_timer = True
        #: the hook's small kernels are launched with programmatic dependent launch (sm_90+), with these options
        self.pdl = pdl_supported(self.device)
        self.pdl_opts = pdl_options(self.pdl)

    def sync_host_control(self, rt: HookRuntime) -> None:
        """Write the host state into the control word (layout: ``triton_control.HOST_WORD``) and push it to the
        device mirror that captured graphs read (:meth:`push_control`)."""
        word = pack_host_word(rt.mode_code, rt.config.sampling.every_n(), rt.config.spot_every, rt.disabled,
                              rt.fallback, rt.coverage is not None)
        with self._ctrl_lock:
            self._h[0] = word  # one aligned 8-byte store: the mirror kernel never reads half an update
            self.word = word
            self._ctrl_version += 1
            self.control_dirty = True
        if self._capturing():
            self._capture_mirror()
        else:
            self.push_control()

    def _capture_mirror(self) -> None:
        # A change made on a thread that is capturing a graph (a candidate that failed there): the copy is
        # captured at this point, so every replay re-reads the word here (and later calls of that replay see
        # it); the replays before the next poll's push would otherwise read the mirror as it was.
        try:
            mirror_kernel[(1,)](self.hctrl, self.dctrl, num_warps=1)
        except Exception as e:
            log.warning("shadowd: could not capture the control word's copy: %r", e)

    def push_control(self) -> bool:
        """Copy the pinned control word into its device mirror on the control stream (no wait: the copy runs
        microseconds later and reads the word as it is then). Not from a thread that is capturing a graph (where
        :meth:`sync_host_control` captures the copy instead), nor after a failed launch: the word stays
        ``control_dirty`` and the next :meth:`poll` or eager call pushes it. True when the copy was launched."""
        if self._capturing():
            return False
        # the lock is not held across the launch (a first launch compiles the kernel: seconds), so a thread that
        # writes the word never waits for another's push; the version says whether a write came after this one
        with self._ctrl_lock:
            version = self._ctrl_version
        try:
            with torch.cuda.stream(self._ctrl_stream):  # (also makes the stream's device current)
                mirror_kernel[(1,)](self.hctrl, self.dctrl, num_warps=1)
        except Exception as e:  # stays dirty: pushed again later (reported once per failing streak)
            if not self._push_failing:
                log.warning("shadowd: could not push the control word to the device (will retry): %r", e)
            self._push_failing = True
            return False
        with self._ctrl_lock:
            self._push_failing = False
            if self._ctrl_version == version:  # (a later write has its own push coming)
                self.control_dirty = False
        return True

    def push_coverage(self, cov: Coverage) -> None:
        """Copy ``cov``'s bitmap into the device's (:attr:`cov`) on the control stream, before the control word
        that opens the gate (pushed after it on the same stream): no replay serves the candidate before its shapes
        are in place. Called by the promotion gate's thread (never one that captures); raises if the copy cannot
        be launched (the gate then stays held)."""
        host = torch.tensor(cov.bitmap(), dtype=torch.int64).pin_memory()
        with torch.cuda.stream(self._ctrl_stream):
            words_kernel[(1,)](host, self.cov, COVERAGE_WORDS, BLOCK=COVERAGE_WORDS, num_warps=4)
        self._cov_host = host

    @staticmethod
    def _capturing() -> bool:
        # this thread is capturing a graph: a launch on another stream would not be part of it
        return bool(torch.cuda.is_current_stream_capturing())

    def settle_control(self) -> None:
        """Wait until the pushed control word is in device memory (tests and benches: the next replay then sees
        it; serving never waits for it)."""
        self._ctrl_stream.synchronize()

    def slot(self, site: ShadowSite, layer: int) -> Slot:
        key = (id(site), layer)
        s = self.slots.get(key)
        if s is None:
            s = Slot(len(self.sites), self.device)
            self.sites.append((site, layer))
            self.slots[key] = s
        return s

    def poll(self) -> list[dict[str, Any]]:
        """Drain published ring slots into samples (the streamer's thread calls this)."""
        out: list[dict[str, Any]] = []
        size = len(self._seq)
        if self.control_dirty:
            self.push_control()
        if self.rt.config.bundle_dir is not None:
            try:
                self.captures.service()
            except Exception as e:  # a bundle's failure must not stop the draining
                log.warning("shadowd: repro-bundle capture failed: %r", e)
        while True:
            slot = self.next_seq % size
            published = int(self._seq[slot])
            if published <= self.next_seq:
                return out
            if published > self.next_seq + 1:  # lapped: the device overwrote unread slots
                self.lost += published - 1 - self.next_seq
                self.next_seq = published - 1
            rec = self._ring[slot].copy()
            if int(self._seq[slot]) != published:
                continue  # overwritten while copying; re-read on the next pass
            self.next_seq += 1
            kind = int(rec[11])
            if kind in (REC_ORACLE_CAND, REC_ORACLE_BASE):
                # they precede their call's own record (stream order): kept until it arrives
                held = self._oracle.setdefault(int(rec[10]), {})
                if held.get(-1) != int(rec[1]):
                    held.clear()
                    held[-1] = int(rec[1])
                held[kind] = oracle_error(rec[NMETA:])
                continue
            out.append(self._sample(rec))

    def _sample(self, rec: Any) -> dict[str, Any]:
        rt = self.rt
        site, layer = self.sites[int(rec[10])]
        rt.note_device_on(int(rec[13]), int(rec[14]))
        flags = int(rec[4])
        kflag = int(rec[12])  # the candidate's error word as the statistics kernel read it (0: none, or no flag)
        if flags & 4 and not rt.fallback:
            rt.fall_back("device spot check: " + (f"the candidate's error flag: {site.flag_text(kflag)}" if kflag
                                                  else "hard failure"))
        stats = finalize(rec[NMETA:])
        stats.pop("max_pos")
        cfg = rt.config
        if cfg.bundle_dir is not None and breach(stats, cfg.hard_scaled_max_abs, cfg.hard_rel_l2, cfg.bundle_rel_l2):
            self.captures.arm(int(rec[10]))  # the next sampled eager call there is snapshotted
        # the candidate's kernels raised their error word (sticky): a candidate error, the candidate disabled
        error = site.flag_error(kflag) if kflag else None
        if error is not None or stats["cand_nonfinite"] > 0:
            rt.candidate_failures += 1
        if stats["cand_nonfinite"] > 0:
            site.consecutive_errors += 1
            if site.consecutive_errors >= rt.config.disable_after:
                rt.disable("consecutive candidate non-finite outputs (device)")
        else:
            site.consecutive_errors = 0
        slot = self.slots[(id(site), layer)]
        base_ns, cand_ns = rec[5], rec[6]
        timed = self.use_timer
        held = self._oracle.pop(int(rec[10]), {}) if int(rec[11]) == REC_MAIN_ORACLE else {}
        same_call = held.get(-1) == int(rec[1])
        stats.update(oracle_cand_err=held.get(REC_ORACLE_CAND) if same_call else None,
                     oracle_base_err=held.get(REC_ORACLE_BASE) if same_call else None)
        stats.update(layer=layer, rank=rt.config.rank, step=int(rec[2]), call=int(rec[1]), ts=time.time(),
                     batch_size=max(1, int(rec[7])), draft_tokens=max(1, int(rec[8])), prefix_len=int(rec[9]),
                     heads=slot.heads, error=error, mode=_MODE_NAME.get(int(rec[3]), "validate"),
                     cand_us=cand_ns / 1e3 if timed else None, base_us=base_ns / 1e3 if timed else None)
        return stats


def oracle_error(raw: Any) -> float:
    """max |side − oracle| of an oracle record's raw vector: NaN when either holds a non-finite value (the
    CPU path's ``max_abs_chunked``)."""
    st = finalize(raw)
    if st["nan_base"] or st["inf_base"] or st["nan_cand"] or st["inf_cand"]:
        return math.nan
    return float(st["max_abs"])

"""The CUDA path of a shadowed call: no host synchronisation, no per-call allocation in the
statistics, and capturable in a CUDA graph (then no Python runs on replay).

Per call, on the current stream::

    control kernel   reads the mode / sampling / spot-check / disabled / fallback state
                     (the host's control word: an argument eagerly, its device mirror under a
                     graph, plus device words), advances the device step and call counters,
                     decides do_stats and use_cand for this call, stamps t0 (globaltimer)
    baseline(...)
    stamp kernel     t1
    candidate(...)   on protected inputs (clones of small tensors)
    stamp kernel     t2 (eager calls; under a graph the stats kernel reads t2 at its start)
    stats kernel     fused statistics over the real rows only (count read from device memory;
                     nothing when do_stats is 0): every program folds its partials into the
                     site's accumulator row with atomics, and the program drawing the last
                     ticket writes the ring slot in pinned host memory (record + metadata),
                     runs the on-mode hard check (sticky device fallback flag), publishes the
                     slot's sequence number last behind a system-scope release, and resets
                     the accumulator for the next call
    select kernel    (on mode only) the call's output: candidate, or baseline when use_cand is
                     0 or the fallback flag is set (so a failing spot check returns the baseline)

Eagerly, Python decides (``host_decides``): an unsampled validate call runs the baseline alone and
an unchecked on-mode call the candidate alone. Under capture the kernels decide on every replay,
so sampling, spot checks, the kill switch and the fallback all work without Python. A graph cannot
skip a node, so a captured on-mode call runs the baseline too — unless the call site has a
``baseline_gate`` (the SGLang verify site does): then a gate kernel hands the baseline zero work sizes
(``gated_copy``) on replays that are neither spot checks nor fallbacks, and the graph runs at the
candidate's speed; spot-check replays run both and are checked before the select kernel chooses.
Without a gate both run on every replay, so every on-mode call is checked (hard limits,
candidate-only non-finite) before its output is chosen. A record is published on spot-check steps
and for every hard failure. Likewise, in validate mode, a call site with a ``candidate_gate`` (the SGLang
verify site) hands the candidate zero work sizes on replays that do not compare it: unsampled calls, the
kill switch, a disabled candidate — so sampling 1 in N under a graph saves the candidate's time on the
other N − 1 replays, as it does eagerly. (In on mode the candidate is served on almost every replay, so it
is not gated: two more launches per call would cost more than the rare replays they would idle.)
:meth:`DeviceState.poll` (called by the streamer's thread) drains the ring into samples.

Eager calls only (a replay runs no Python): oracle sampling — 1 in ``oracle_every`` sampled validate calls
run the site's oracle, then candidate vs oracle and baseline vs oracle go through the statistics kernel as
records of their own (``REC_ORACLE_*``, published before their call's record, which says they precede it),
merged by :meth:`DeviceState.poll` into the call's sample (``oracle_cand_err`` / ``oracle_base_err``: max
|side − oracle|, NaN where either holds a non-finite value); and repro bundles, taken by
``shadowd.hook.capture`` (a failing call at once, a numeric breach on the next sampled call of that site and
layer). Limits of the CUDA path today: a fractional ``SHADOWD_SAMPLE`` becomes 1-in-round(1/f) steps; timing
comes from ``globaltimer`` stamps (graph-safe) rather than CUDA events; in eager on mode a fall-back found by
a spot check takes effect on device for that call at once and for later calls when the streamer's thread next
drains the ring.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import triton

from shadowd.hook.capture import Captures, breach
from shadowd.hook.diffstats import empty_stats, finalize
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
from shadowd.hook.triton_control import control_kernel, mirror_kernel, pack_host_word, select_kernel, stamp_kernel

if TYPE_CHECKING:
    from shadowd.hook.runtime import HookRuntime
    from shadowd.hook.site import Bucket, ShadowSite

# the launch helpers are re-exported: callers (tests, benches, older trees timed side by side) import them here
__all__ = ["NMETA", "REC", "REC_MAIN", "REC_MAIN_ORACLE", "REC_ORACLE_BASE", "REC_ORACLE_CAND", "RUN_BASE",
           "RUN_CAND", "TILE", "DeviceState", "device_call", "fused_raw_stats", "gated_copies", "gated_copy",
           "hist_mode_for", "launch_stats", "new_accumulator", "oracle_error", "pdl_options", "pdl_supported"]

log = logging.getLogger("shadowd.hook")
_MODE_NAME = {1: "validate", 2: "on"}
BLOCK = 1024  # elements per program of the select kernel


class _Slot:
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
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.sites: list[tuple[ShadowSite, int]] = []
        self.use_timer = True
        #: the hook's small kernels are launched with programmatic dependent launch (sm_90+)
        self.pdl = pdl_supported(self.device)

    def sync_host_control(self, rt: HookRuntime) -> None:
        """Write the host state into the control word (layout: ``triton_control.HOST_WORD``) and push it to the
        device mirror that captured graphs read (:meth:`push_control`)."""
        word = pack_host_word(rt.mode_code, rt.config.sampling.every_n(), rt.config.spot_every, rt.disabled,
                              rt.fallback)
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

    @staticmethod
    def _capturing() -> bool:
        # this thread is capturing a graph: a launch on another stream would not be part of it
        return bool(torch.cuda.is_current_stream_capturing())

    def settle_control(self) -> None:
        """Wait until the pushed control word is in device memory (tests and benches: the next replay then sees
        it; serving never waits for it)."""
        self._ctrl_stream.synchronize()

    def slot(self, site: ShadowSite, layer: int) -> _Slot:
        key = (id(site), layer)
        s = self.slots.get(key)
        if s is None:
            s = _Slot(len(self.sites), self.device)
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
        flags = int(rec[4])
        if flags & 4 and not rt.fallback:
            rt.fall_back("device spot check: hard failure")
        stats = finalize(rec[NMETA:])
        stats.pop("max_pos")
        cfg = rt.config
        if cfg.bundle_dir is not None and breach(stats, cfg.hard_scaled_max_abs, cfg.hard_rel_l2, cfg.bundle_rel_l2):
            self.captures.arm(int(rec[10]))  # the next sampled eager call there is snapshotted
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
                     heads=slot.heads, error=None, mode=_MODE_NAME.get(int(rec[3]), "validate"),
                     cand_us=cand_ns / 1e3 if timed else None, base_us=base_ns / 1e3 if timed else None)
        return stats


def oracle_error(raw: Any) -> float:
    """max |side − oracle| of an oracle record's raw vector: NaN when either holds a non-finite value (the
    CPU path's ``max_abs_chunked``)."""
    st = finalize(raw)
    if st["nan_base"] or st["inf_base"] or st["nan_cand"] or st["inf_cand"]:
        return math.nan
    return float(st["max_abs"])


def _oracle_records(site: ShadowSite, args: tuple[Any, ...], kwargs: dict[str, Any], out_c: torch.Tensor,
                    out_b: torch.Tensor, slot: _Slot, ds: DeviceState, b: Bucket) -> bool:
    """Eager validate, 1 in ``oracle_every`` sampled calls: the site's oracle over the original inputs, then
    candidate vs oracle and baseline vs oracle through the statistics kernel into the ring (fp32, no host
    synchronisation). True when both records were launched (the call's own record then says so)."""
    assert site.oracle is not None
    ref = site.oracle(*args, **kwargs)
    if not isinstance(ref, torch.Tensor) or ref.shape != out_b.shape or ref.device != out_b.device:
        raise TypeError(f"oracle output: expected a tensor of shape {tuple(out_b.shape)} on {out_b.device}")
    ref32 = ref.float()
    cfg = site.rt.config
    for kind, side in ((REC_ORACLE_CAND, out_c), (REC_ORACLE_BASE, out_b)):
        launch_stats(side.float(), ref32, slot.acc, ds.ring, ds.ring_seq, slot.sstate, ds.dstate,
                     valid_rows=b.valid_rows, hard_scaled=cfg.hard_scaled_max_abs, hard_rel_l2=cfg.hard_rel_l2,
                     site_id=slot.site_id, kind=kind)
    return True


def _capture_after_fallback(site: ShadowSite, ds: DeviceState, key: int, args: tuple[Any, ...],
                            kwargs: dict[str, Any], layer: int, b: Bucket) -> Any:
    """On mode after a fall-back, at a call site that the failure armed (eager): the failing call's inputs were
    gone when the ring showed its failure, so the candidate runs once more beside the baseline, on protected
    inputs, only to be snapshotted for a bundle; the baseline's result is returned. (A *disabled* candidate —
    repeated errors, a modified input — never runs again.)"""
    out_b = site.baseline(*args, **kwargs)
    cargs, ckwargs, watched = site._protect(args, kwargs)
    out_c, err = site._isolated("candidate", site.candidate, *cargs, **ckwargs)
    err = site._candidate_error(err, out_c, out_b, watched)
    site._isolated("bundle", ds.captures.snapshot, site, key, layer, b, "on", args, kwargs, out_b,
                   out_c if err is None else None, err)
    return out_b


def device_call(site: ShadowSite, args: tuple[Any, ...], kwargs: dict[str, Any], layer: int, b: Bucket) -> Any:
    """One shadowed call on CUDA tensors (eager or under CUDA-graph capture)."""
    rt = site.rt
    ds: DeviceState = rt.device()
    capturing = torch.cuda.is_current_stream_capturing()
    code = rt.mode_code
    blocked = rt.disabled or rt.fallback
    if blocked:
        if rt.fallback and not rt.disabled and not capturing and rt.config.bundle_dir is not None:
            key = ds.slot(site, layer).site_id
            if ds.captures.wants(key):
                return _capture_after_fallback(site, ds, key, args, kwargs, layer, b)
        return site.baseline(*args, **kwargs)
    host_decides, do_stats, use_cand = 1, 1, 0
    if not capturing:
        if code == 2 and rt.config.covered(b.draft_tokens, b.prefix_len):
            if not rt.spot_checked(rt.step):
                out, err = site._isolated("candidate", site.candidate, *args, **kwargs)
                if err is None:
                    return out
                rt.fall_back(f"candidate {err}")
                return site.baseline(*args, **kwargs)
            use_cand = 1
        elif not rt.sampled(rt.step):
            return site.baseline(*args, **kwargs)
    else:
        host_decides = 0
    if ds.control_dirty:  # a change made while this thread was capturing (or a failed push)
        ds.push_control()
    slot = ds.slot(site, layer)
    slot.heads = max(1, b.heads)
    # on mode captured with a baseline gate: the baseline works only on spot-check / fallback replays
    gated = capturing and code == 2 and site.baseline_gate is not None
    meta = b.meta
    cfg = rt.config
    control_kernel[(1,)](ds.dctrl, ds.word, ds.dstate, slot.sstate, meta if meta is not None else slot.sstate,
                         int(layer == site.first_layer), min(cfg.max_draft_tokens, 2**62),
                         min(cfg.max_prefix_len, 2**62), host_decides, do_stats, use_cand, rt.step,
                         b.batch_size, b.draft_tokens, b.prefix_len,
                         HAS_META=meta is not None, USE_TIMER=ds.use_timer, GATED=int(gated), PDL=ds.pdl,
                         **pdl_options(ds.pdl))
    if gated:
        assert site.baseline_gate is not None
        with site.baseline_gate(slot.sstate, args, kwargs):
            out_b = site.baseline(*args, **kwargs)
    else:
        out_b = site.baseline(*args, **kwargs)
    stamp_kernel[(1,)](slot.sstate, 7, USE_TIMER=ds.use_timer, PDL=ds.pdl, **pdl_options(ds.pdl))
    if capturing and code == 1 and site.candidate_gate is not None:  # zero work on replays that do not use it
        gargs, gkwargs = site.candidate_gate(slot.sstate, args, kwargs)
        # the gate's outputs are already private copies: they are not cloned a second time
        fresh = {id(x) for x in (*gargs, *gkwargs.values())} - {id(x) for x in (*args, *kwargs.values())}
        cargs, ckwargs, watched = site._protect(gargs, gkwargs, fresh, batch=True)
    else:
        cargs, ckwargs, watched = site._protect(args, kwargs, batch=capturing)
    out_c, err = site._isolated("candidate", site.candidate, *cargs, **ckwargs)
    # under a graph the statistics kernel reads the candidate's end at its start (one node fewer); eagerly a
    # stamp kernel follows the candidate at once, as the statistics kernel's start could wait for the host
    # (an oracle run, a first call's compile) after the candidate has finished
    if not capturing:
        stamp_kernel[(1,)](slot.sstate, 8, USE_TIMER=ds.use_timer, PDL=ds.pdl, **pdl_options(ds.pdl))
    err = site._candidate_error(err, out_c, out_b, watched)
    if err is not None:
        site.consecutive_errors += 1
        if site.consecutive_errors >= cfg.disable_after or capturing:
            rt.disable(f"candidate {err}" + (" during graph capture" if capturing else ""))
        if gated:
            # this call's control kernel decides on replay before the failure, from the word as it was: it may
            # gate the baseline above to nothing, so the layer's output is a baseline run of its own, ungated
            out_b = site.baseline(*args, **kwargs)
        sample = site._sample(layer, b, empty_stats(out_b.numel()), error=err,
                              mode="on" if code == 2 else "validate", cand_us=None, base_us=None)
        site._isolated("sink", rt.emit, sample)
        if cfg.bundle_dir is not None and not capturing:  # the failing call's inputs are still here
            site._isolated("bundle", ds.captures.snapshot, site, slot.site_id, layer, b, sample["mode"], args, kwargs,
                           out_b, out_c, err)
        if code == 2 and not capturing:
            rt.fall_back(f"spot check: {err}")
        return out_b
    kind = REC_MAIN
    if not capturing and code == 1 and site.oracle is not None and cfg.oracle_every > 0:
        site.oracle_calls += 1
        if site.oracle_calls % cfg.oracle_every == 0:
            done, _err = site._isolated("oracle", _oracle_records, site, args, kwargs, out_c, out_b, slot, ds, b)
            kind = REC_MAIN_ORACLE if done else REC_MAIN
    launch_stats(out_c, out_b, slot.acc, ds.ring, ds.ring_seq, slot.sstate, ds.dstate, valid_rows=b.valid_rows,
                 hard_scaled=cfg.hard_scaled_max_abs, hard_rel_l2=cfg.hard_rel_l2, site_id=slot.site_id, kind=kind,
                 stamp=capturing and ds.use_timer)
    if cfg.bundle_dir is not None and not capturing and ds.captures.wants(slot.site_id):
        site._isolated("bundle", ds.captures.snapshot, site, slot.site_id, layer, b,
                       "on" if code == 2 else "validate", args, kwargs, out_b, out_c, None)
    if code != 2:
        return out_b
    out = torch.empty_like(out_b)
    n = out.numel()
    select_kernel[(triton.cdiv(n, BLOCK),)](out, out_c.contiguous(), out_b.contiguous(), n, slot.sstate, ds.dstate,
                                          BLOCK=BLOCK, PDL=ds.pdl, **pdl_options(ds.pdl))
    return out

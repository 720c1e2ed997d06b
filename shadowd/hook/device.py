"""The CUDA path of a shadowed call: no host synchronisation, no per-call allocation in the
statistics, and capturable in a CUDA graph (then no Python runs on replay).

Per call, on the current stream::

    control kernel   reads the mode / sampling / spot-check / disabled / fallback state
                     (pinned host words written by Python at any time, plus device words),
                     advances the device step and call counters, decides do_stats and
                     use_cand for this call, stamps t0 (globaltimer)
    baseline(...)
    stamp kernel     t1
    candidate(...)   on protected inputs (clones of small tensors)
    stamp kernel     t2
    partial kernel   fused statistics over the real rows only (count read from device memory);
                     does nothing when do_stats is 0
    final kernel     fp64 reduction → ring slot in pinned host memory (record + metadata),
                     on-mode hard check → sticky device fallback flag, then the slot's
                     sequence number, last, behind a system-scope release
    select kernel    (on mode only) the call's output: candidate, or baseline when use_cand is
                     0 or the fallback flag is set (so a failing spot check returns the baseline)

Eagerly, Python decides (``host_decides``): an unsampled validate call runs the baseline alone and
an unchecked on-mode call the candidate alone. Under capture the kernels decide on every replay,
so sampling, spot checks, the kill switch and the fallback all work without Python; the price is
that a captured graph always runs both baseline and candidate (a graph cannot skip a node). Since
both ran, every on-mode call under a graph is checked (hard limits, candidate-only non-finite)
before the select kernel chooses its output; a record is published on spot-check steps and for
every hard failure.
:meth:`DeviceState.poll` (called by the streamer's thread) drains the ring into samples.

Limits of the CUDA path today: no oracle sampling and no repro bundles (both need the outputs on the
host, i.e. a synchronisation; use the CPU/eager path or ``shadowd replay`` on captured inputs); a
fractional ``SHADOWD_SAMPLE`` becomes 1-in-round(1/f) steps; timing comes from ``globaltimer`` stamps
(graph-safe) rather than CUDA events; in eager on mode a fall-back found by a spot check takes effect on
device for that call at once and for later calls when the streamer's thread next drains the ring.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch
import triton

from shadowd.hook.diffstats import NRAW, empty_stats, finalize
from shadowd.hook.triton_stats import NPART, control_kernel, final_kernel, partial_kernel, select_kernel, stamp_kernel

if TYPE_CHECKING:
    from shadowd.hook.runtime import HookRuntime
    from shadowd.hook.site import Bucket, ShadowSite

__all__ = ["NMETA", "REC", "DeviceState", "device_call", "fused_raw_stats"]

NMETA = 12  # record: seq, call, step, mode, flags, base_ns, cand_ns, batch, draft, prefix, site, spare
REC = NMETA + NRAW
BLOCK = 1024  # elements per program of the select kernel
#: statistics kernel: elements per tile, warps, programs per SM — the best of the variants measured on
#: the H200 (bench/results/hook-2026-11-29.md); fewer programs also mean fewer partial rows for the
#: single-program final reduction, which dominates today
TILE = (512, 4, 8)
MIN_TILES_PER_PROGRAM = 8
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MODE_NAME = {1: "validate", 2: "on"}


_SMS: dict[Any, int] = {}


def _sms(device: torch.device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _nprog_max(device: torch.device) -> int:
    """Rows of the partials buffer: the most programs any tile configuration launches."""
    return 32 * _sms(device)


class _Slot:
    """Per (site, layer) device scratch: decisions of the current call and statistics partials."""

    def __init__(self, site_id: int, device: torch.device, nprog: int) -> None:
        self.site_id = site_id
        self.sstate = torch.zeros(16, dtype=torch.int64, device=device)
        self.part = torch.zeros(nprog, NPART, dtype=torch.float64, device=device)
        self.heads = 1


def launch_stats(cand: torch.Tensor, base: torch.Tensor, part: torch.Tensor, rec: torch.Tensor,
                 seq: torch.Tensor, sstate: torch.Tensor, dstate: torch.Tensor, *, valid_rows: Any = None,
                 hard_scaled: float = 0.25, hard_rel_l2: float = 0.1, site_id: int = 0,
                 publish: bool = True, tile: tuple[int, int, int] | None = None, hist: bool = True) -> None:
    """Launch the two statistics kernels (no sync, no allocation when inputs are contiguous).

    ``tile`` (rows, vec, warps) and ``hist`` are benchmark knobs; the hook uses the defaults."""
    c = cand.reshape(-1) if cand.is_contiguous() else cand.contiguous().reshape(-1)
    b = base.reshape(-1) if base.is_contiguous() else base.contiguous().reshape(-1)
    n = b.numel()
    row = base[0].numel() if base.dim() and base.shape[0] else 1
    has_valid = isinstance(valid_rows, torch.Tensor)
    if isinstance(valid_rows, int):
        n = min(n, valid_rows * row)
    nprog_cap = part.shape[0]
    block, warps, per_sm = tile or TILE
    nprog = max(1, min(nprog_cap, per_sm * _sms(c.device), triton.cdiv(max(n, 1), block * MIN_TILES_PER_PROGRAM)))
    partial_kernel[(nprog,)](c, b, part, n, valid_rows if has_valid else sstate, row, sstate,
                             HAS_VALID=has_valid, HAS_FLAG=True, BLOCK=block, HIST=hist, num_warps=warps)
    final_kernel[(1,)](part, nprog, rec, seq, rec.shape[0], rec.shape[1], sstate, dstate,
                       hard_scaled, hard_rel_l2 * hard_rel_l2, site_id, PUBLISH=publish, FENCE=not _INTERPRET,
                       NMETA=NMETA, num_warps=4)


def fused_raw_stats(cand: torch.Tensor, base: torch.Tensor, valid_rows: Any = None) -> torch.Tensor:
    """The raw statistics vector (device float64[NRAW]) of the fused kernels; for tests and benches."""
    dev = base.device
    nprog = _nprog_max(dev)
    sstate = torch.zeros(16, dtype=torch.int64, device=dev)
    sstate[0] = 1  # do_stats
    sstate[12] = 1  # publish (into the one-record ring here)
    rec = torch.zeros(1, REC, dtype=torch.float64, device=dev)
    launch_stats(cand, base, torch.zeros(nprog, NPART, dtype=torch.float64, device=dev), rec,
                 torch.zeros(1, dtype=torch.int64, device=dev), sstate,
                 torch.zeros(8, dtype=torch.int64, device=dev), valid_rows=valid_rows, publish=False)
    return rec[0, NMETA:]


class DeviceState:
    """Process-wide device state: host control words, device counters, the pinned record ring."""

    def __init__(self, rt: HookRuntime) -> None:
        self.rt = rt
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.nprog = _nprog_max(self.device)
        self.hctrl = torch.zeros(8, dtype=torch.int64).pin_memory()
        self.dstate = torch.zeros(8, dtype=torch.int64, device=self.device)
        size = rt.config.ring_size
        self.ring = torch.zeros(size, REC, dtype=torch.float64).pin_memory()
        self.ring_seq = torch.zeros(size, dtype=torch.int64).pin_memory()
        self._h = self.hctrl.numpy()
        self._ring = self.ring.numpy()
        self._seq = self.ring_seq.numpy()
        self.next_seq = 0
        self.lost = 0
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.sites: list[tuple[ShadowSite, int]] = []
        self.use_timer = True

    def sync_host_control(self, rt: HookRuntime) -> None:
        """Mirror the host state into the pinned words the control kernel reads (no CUDA call)."""
        h = self._h
        h[1] = rt.config.sampling.every_n()
        h[2] = rt.config.spot_every
        h[3] = int(rt.disabled)
        h[4] = int(rt.fallback)
        h[0] = rt.mode_code

    def slot(self, site: ShadowSite, layer: int) -> _Slot:
        key = (id(site), layer)
        s = self.slots.get(key)
        if s is None:
            s = _Slot(len(self.sites), self.device, self.nprog)
            self.sites.append((site, layer))
            self.slots[key] = s
        return s

    def poll(self) -> list[dict[str, Any]]:
        """Drain published ring slots into samples (the streamer's thread calls this)."""
        out: list[dict[str, Any]] = []
        size = len(self._seq)
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
            out.append(self._sample(rec))

    def _sample(self, rec: Any) -> dict[str, Any]:
        rt = self.rt
        site, layer = self.sites[int(rec[10])]
        flags = int(rec[4])
        if flags & 4 and not rt.fallback:
            rt.fall_back("device spot check: hard failure")
        stats = finalize(rec[NMETA:])
        stats.pop("max_pos")
        if stats["cand_nonfinite"] > 0:
            site.consecutive_errors += 1
            if site.consecutive_errors >= rt.config.disable_after:
                rt.disable("consecutive candidate non-finite outputs (device)")
        else:
            site.consecutive_errors = 0
        slot = self.slots[(id(site), layer)]
        base_ns, cand_ns = rec[5], rec[6]
        timed = self.use_timer
        stats.update(layer=layer, rank=rt.config.rank, step=int(rec[2]), call=int(rec[1]), ts=time.time(),
                     batch_size=max(1, int(rec[7])), draft_tokens=max(1, int(rec[8])), prefix_len=int(rec[9]),
                     heads=slot.heads, error=None, mode=_MODE_NAME.get(int(rec[3]), "validate"),
                     cand_us=cand_ns / 1e3 if timed else None, base_us=base_ns / 1e3 if timed else None)
        return stats


def device_call(site: ShadowSite, args: tuple[Any, ...], kwargs: dict[str, Any], layer: int, b: Bucket) -> Any:
    """One shadowed call on CUDA tensors (eager or under CUDA-graph capture)."""
    rt = site.rt
    ds: DeviceState = rt.device()
    capturing = torch.cuda.is_current_stream_capturing()
    code = rt.mode_code
    blocked = rt.disabled or rt.fallback
    if blocked:
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
    slot = ds.slot(site, layer)
    slot.heads = max(1, b.heads)
    meta = b.meta
    cfg = rt.config
    control_kernel[(1,)](ds.hctrl, ds.dstate, slot.sstate, meta if meta is not None else slot.sstate,
                         int(layer == site.first_layer), min(cfg.max_draft_tokens, 2**62),
                         min(cfg.max_prefix_len, 2**62), host_decides, do_stats, use_cand, rt.step,
                         b.batch_size, b.draft_tokens, b.prefix_len,
                         HAS_META=meta is not None, USE_TIMER=ds.use_timer)
    out_b = site.baseline(*args, **kwargs)
    stamp_kernel[(1,)](slot.sstate, 7, USE_TIMER=ds.use_timer)
    cargs, ckwargs, watched = site._protect(args, kwargs)
    out_c, err = site._isolated("candidate", site.candidate, *cargs, **ckwargs)
    stamp_kernel[(1,)](slot.sstate, 8, USE_TIMER=ds.use_timer)
    if err is None and any(t._version != v for t, v in watched):
        err = "input_modified"
        rt.disable("candidate modified its inputs")
    if err is None:
        err = site._check(out_c, out_b)
    if err is not None:
        site.consecutive_errors += 1
        if site.consecutive_errors >= cfg.disable_after or capturing:
            rt.disable(f"candidate {err}" + (" during graph capture" if capturing else ""))
        sample = site._sample(layer, b, empty_stats(out_b.numel()), error=err,
                              mode="on" if code == 2 else "validate", cand_us=None, base_us=None)
        site._isolated("sink", rt.emit, sample)
        if code == 2 and not capturing:
            rt.fall_back(f"spot check: {err}")
        return out_b
    launch_stats(out_c, out_b, slot.part, ds.ring, ds.ring_seq, slot.sstate, ds.dstate, valid_rows=b.valid_rows,
                 hard_scaled=cfg.hard_scaled_max_abs, hard_rel_l2=cfg.hard_rel_l2, site_id=slot.site_id)
    if code != 2:
        return out_b
    out = torch.empty_like(out_b)
    n = out.numel()
    select_kernel[(triton.cdiv(n, BLOCK),)](out, out_c.contiguous(), out_b.contiguous(), n, slot.sstate, ds.dstate,
                                          BLOCK=BLOCK)
    return out

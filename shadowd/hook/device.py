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
from shadowd.hook.triton_control import control_kernel, gate_kernel, select_kernel, stamp_kernel
from shadowd.hook.triton_hist import COLS_WARPS
from shadowd.hook.triton_stats import ACC, ACC_WORDS, stats_kernel

if TYPE_CHECKING:
    from shadowd.hook.runtime import HookRuntime
    from shadowd.hook.site import Bucket, ShadowSite

__all__ = ["NMETA", "REC", "RUN_BASE", "RUN_CAND", "TILE", "DeviceState", "device_call", "fused_raw_stats",
           "gated_copy", "hist_mode_for", "launch_stats", "new_accumulator", "pdl_supported"]

NMETA = 12  # record: seq, call, step, mode, flags, base_ns, cand_ns, batch, draft, prefix, site, spare
#: decision words of a call (``_Slot.sstate``) read by the gate kernel: the baseline / the candidate must work
RUN_BASE, RUN_CAND = 13, 14
REC = NMETA + NRAW
BLOCK = 1024  # elements per program of the select kernel
#: statistics kernel: elements per tile, warps, programs per SM (bench/diffstats.py measures variants)
TILE = (4096, 8, 2)
#: outputs up to SMALL_NUMEL elements use SMALL_TILE: one short tile per program keeps the latency of a
#: per-layer call low (the launch configuration still depends only on the static size: graph-safe)
SMALL_NUMEL, SMALL_TILE = 2**17, (1024, 4, 4)
#: outputs up to MID_NUMEL elements (one to four tiles per program) use MID_TILE: four warps, registers
#: uncapped (on the H200: 64×16×512 bf16 3.74 µs per call against 4.12 µs with TILE, 128×32×512 6.0 against
#: 6.8 µs; bench/results/hook-2026-11-30.md)
MID_NUMEL, MID_TILE = 2**22, (4096, 4, 2)
#: outputs up to SPEC_NUMEL elements launched without PDL load their first tile before the call's decision
#: arrives (it saves a memory round trip on sampled calls and costs that read on unsampled ones; under PDL
#: the decision is read before the wait instead, at no cost); up to POS_NUMEL the pass
#: tracks the position of max |d| per element instead of re-reading it (latency over instructions)
SPEC_NUMEL = 2**17
POS_NUMEL = 2**22
REGS_PER_SM = 65536  # sm_80 .. sm_120
#: histogram (shadowd.hook.triton_hist): 1 tl.histogram, 2 warp ballots, 3 per-thread shared-memory columns
#: (compiled for COLS_WARPS warps; other warp counts fall back to ballots)
HIST_MODE = 3
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MODE_NAME = {1: "validate", 2: "on"}


_SMS: dict[Any, int] = {}


def _sms(device: torch.device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def new_accumulator(device: torch.device) -> torch.Tensor:
    """A zeroed accumulator row for :func:`launch_stats` (one per call site; reset by the kernel)."""
    return torch.zeros(ACC_WORDS, dtype=torch.int64, device=device)


class _Slot:
    """Per (site, layer) device scratch: decisions of the current call and the statistics accumulator."""

    def __init__(self, site_id: int, device: torch.device) -> None:
        self.site_id = site_id
        self.sstate = torch.zeros(16, dtype=torch.int64, device=device)
        self.acc = new_accumulator(device)
        self.heads = 1


_PDL: dict[Any, bool] = {}


def pdl_supported(device: torch.device) -> bool:
    """Whether the statistics kernel is launched with programmatic dependent launch on ``device``: sm_90+
    and a Triton with the ``launch_pdl`` option. Its launch then overlaps the previous kernel's tail: it
    zeroes its histogram and reads the call's decision and real count (see :func:`launch_stats`' contract),
    then waits for the previous kernel's writes (``griddepcontrol.wait``) before anything else
    (bench/results/hook-2026-11-30.md)."""
    if device not in _PDL:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions

            has_opt = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
        except ImportError:
            has_opt = False
        _PDL[device] = (not _INTERPRET and has_opt and device.type == "cuda"
                        and torch.cuda.get_device_capability(device)[0] >= 9)
    return _PDL[device]


def hist_mode_for(mode: int, warps: int) -> int:
    """The histogram mode really compiled for ``warps`` warps: the shared-memory columns (3) where they
    fit (COLS_WARPS), else warp ballots."""
    if mode == 3 and warps not in COLS_WARPS:
        return 2
    return mode


def launch_stats(cand: torch.Tensor, base: torch.Tensor, acc: torch.Tensor, rec: torch.Tensor,
                 seq: torch.Tensor, sstate: torch.Tensor, dstate: torch.Tensor, *, valid_rows: Any = None,
                 hard_scaled: float = 0.25, hard_rel_l2: float = 0.1, site_id: int = 0,
                 publish: bool = True, tile: tuple[int, int, int] | None = None, hist: bool = True,
                 hist_mode: int | None = None, spec: bool | None = None, pdl: bool | None = None) -> Any:
    """Launch the statistics kernel (one launch; no sync, no allocation when inputs are contiguous).

    Returns Triton's handle of the launched kernel. ``acc`` is the call site's accumulator
    (:func:`new_accumulator`); calls sharing one must be stream-ordered. Positions of max |d| are exact
    below 2^32 elements. ``tile`` (elements per tile, warps, programs per SM), ``hist`` and ``hist_mode``
    (1 tl.histogram, 2 warp ballots, 3 shared-memory columns) and ``spec`` (load the first tile before the
    decision word; default: outputs up to SPEC_NUMEL elements launched without PDL) and ``pdl`` (programmatic
    dependent launch; default: :func:`pdl_supported`) are benchmark knobs; the hook uses the defaults.

    Contract under PDL: the kernel reads the decision word ``sstate[0]`` and ``valid_rows`` before it waits
    for the previous kernel, so the kernel directly before it on the stream must not write them (in the
    hook that kernel is the timer stamp, which writes ``sstate[8]``); everything else it reads after."""
    c = cand.reshape(-1) if cand.is_contiguous() else cand.contiguous().reshape(-1)
    b = base.reshape(-1) if base.is_contiguous() else base.contiguous().reshape(-1)
    n = b.numel()
    row = base[0].numel() if base.dim() and base.shape[0] else 1
    has_valid = isinstance(valid_rows, torch.Tensor)
    if isinstance(valid_rows, int):
        n = min(n, valid_rows * row)
    block, warps, per_sm = tile or (SMALL_TILE if n <= SMALL_NUMEL else MID_TILE if n <= MID_NUMEL else TILE)
    # histogram by inline PTX on the GPU (shared-memory columns, or warp ballots where the columns are not
    # compiled for this many warps); tl.histogram in the interpreter
    mode = (hist_mode or (1 if _INTERPRET else HIST_MODE)) if hist else 0
    mode = hist_mode_for(mode, warps)
    vec = max(1, min(8, 16 // b.element_size()))  # one 16-byte vector per row of a tile
    nprog = max(1, min(per_sm * _sms(c.device), triton.cdiv(max(n, 1), block)))
    # registers capped so that per_sm programs fit one SM's 64 K registers (the loads in flight per SM
    # are what reaches the bandwidth); the interpreter takes no launch options
    # (allocated per warp in steps of 8 per thread; 255, the most a thread can address, when the share allows 256)
    share = REGS_PER_SM // (warps * 32 * per_sm)
    opts: dict[str, Any] = {} if _INTERPRET else {"maxnreg": 255 if share >= 256 else share // 8 * 8}
    pdl = pdl_supported(c.device) if pdl is None else (pdl and not _INTERPRET)
    if pdl:
        opts["launch_pdl"] = True
    if spec is None:  # under PDL the decision is read before the wait: a speculative load gains nothing
        spec = n <= SPEC_NUMEL and not pdl
    return stats_kernel[(nprog,)](c, b, acc, acc.view(torch.float64)[ACC:], n, valid_rows if has_valid else sstate, row,
                           sstate, rec, seq, rec.shape[0], rec.shape[1], dstate, hard_scaled,
                           hard_rel_l2 * hard_rel_l2, site_id, HAS_VALID=has_valid, BLOCK=block, VEC=vec, HIST=mode,
                           PUBLISH=publish, GPU=not _INTERPRET, NMETA=NMETA, NW=warps,
                           SPEC=spec, POS=n <= POS_NUMEL,
                           PDL=pdl, ONE=nprog * block >= n, num_warps=warps, **opts)


def gated_copy(src: torch.Tensor, sstate: torch.Tensor, word: int = RUN_BASE) -> torch.Tensor:
    """A copy of the small int tensor ``src`` that holds zeros on calls whose baseline (``word`` =
    RUN_BASE) or candidate (RUN_CAND) is gated off.

    ``sstate`` is the call site's decision words (what a ``baseline_gate`` / ``candidate_gate`` receives);
    one tiny launch, no sync, graph-safe (under capture the copy comes from the graph's pool and the
    kernel re-decides on every replay)."""
    if word not in (RUN_BASE, RUN_CAND):
        raise ValueError(f"word: expected RUN_BASE ({RUN_BASE}) or RUN_CAND ({RUN_CAND}), got {word!r}")
    src = src.contiguous()
    dst = torch.empty_like(src)
    n = src.numel()
    gate_kernel[(1,)](src, dst, n, sstate, WORD=word, BLOCK=max(16, triton.next_power_of_2(max(n, 1))),
                      num_warps=1)
    return dst


def fused_raw_stats(cand: torch.Tensor, base: torch.Tensor, valid_rows: Any = None, *,
                    tile: tuple[int, int, int] | None = None, hist_mode: int | None = None) -> torch.Tensor:
    """The raw statistics vector (device float64[NRAW]) of the fused kernels; for tests and benches
    (``tile`` and ``hist_mode`` as in :func:`launch_stats`)."""
    dev = base.device
    sstate = torch.zeros(16, dtype=torch.int64, device=dev)
    sstate[0] = 1  # do_stats
    sstate[12] = 1  # publish (into the one-record ring here)
    rec = torch.zeros(1, REC, dtype=torch.float64, device=dev)
    launch_stats(cand, base, new_accumulator(dev), rec,
                 torch.zeros(1, dtype=torch.int64, device=dev), sstate,
                 torch.zeros(8, dtype=torch.int64, device=dev), valid_rows=valid_rows, publish=False,
                 tile=tile, hist_mode=hist_mode)
    return rec[0, NMETA:]


class DeviceState:
    """Process-wide device state: host control words, device counters, the pinned record ring."""

    def __init__(self, rt: HookRuntime) -> None:
        self.rt = rt
        self.device = torch.device("cuda", torch.cuda.current_device())
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
            s = _Slot(len(self.sites), self.device)
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
    # on mode captured with a baseline gate: the baseline works only on spot-check / fallback replays
    gated = capturing and code == 2 and site.baseline_gate is not None
    meta = b.meta
    cfg = rt.config
    control_kernel[(1,)](ds.hctrl, ds.dstate, slot.sstate, meta if meta is not None else slot.sstate,
                         int(layer == site.first_layer), min(cfg.max_draft_tokens, 2**62),
                         min(cfg.max_prefix_len, 2**62), host_decides, do_stats, use_cand, rt.step,
                         b.batch_size, b.draft_tokens, b.prefix_len,
                         HAS_META=meta is not None, USE_TIMER=ds.use_timer, GATED=int(gated))
    if gated:
        assert site.baseline_gate is not None
        with site.baseline_gate(slot.sstate, args, kwargs):
            out_b = site.baseline(*args, **kwargs)
    else:
        out_b = site.baseline(*args, **kwargs)
    stamp_kernel[(1,)](slot.sstate, 7, USE_TIMER=ds.use_timer)
    if capturing and code == 1 and site.candidate_gate is not None:  # zero work on replays that do not use it
        gargs, gkwargs = site.candidate_gate(slot.sstate, args, kwargs)
        # the gate's outputs are already private copies: they are not cloned a second time
        fresh = {id(x) for x in (*gargs, *gkwargs.values())} - {id(x) for x in (*args, *kwargs.values())}
        cargs, ckwargs, watched = site._protect(gargs, gkwargs, fresh)
    else:
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
    launch_stats(out_c, out_b, slot.acc, ds.ring, ds.ring_seq, slot.sstate, ds.dstate, valid_rows=b.valid_rows,
                 hard_scaled=cfg.hard_scaled_max_abs, hard_rel_l2=cfg.hard_rel_l2, site_id=slot.site_id)
    if code != 2:
        return out_b
    out = torch.empty_like(out_b)
    n = out.numel()
    select_kernel[(triton.cdiv(n, BLOCK),)](out, out_c.contiguous(), out_b.contiguous(), n, slot.sstate, ds.dstate,
                                          BLOCK=BLOCK)
    return out

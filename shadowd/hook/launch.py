"""The statistics kernel's launch and the call path's record layout (``shadowd.hook.cuda_call`` uses them).

* :func:`launch_stats` — one launch of the fused statistics kernel (``shadowd.hook.triton_stats``): the tile
  from the output's static size (graph-safe), programmatic dependent launch on sm_90+, registers capped so
  that the programs meant to share an SM fit it;
* the ring record's layout: ``NMETA`` words of metadata (word 11: the record's kind, ``REC_*``; word 12: the
  candidate's error flag; words 13 and 14: the on-mode replays on covered / uncovered shapes so far), then the raw
  statistics vector of ``shadowd.hook.diffstats``;
* :func:`gated_copy` — the work-size copies of baseline and candidate gates (:func:`merged_gate_launches`: both
  sides' in one launch);
* :func:`fused_raw_stats` — the raw vector of two device tensors (tests, benches).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
import triton

from shadowd.hook.diffstats import NRAW
from shadowd.hook.triton_control import gate_kernel
from shadowd.hook.triton_hist import COLS_WARPS
from shadowd.hook.triton_stats import ACC, ACC_WORDS, stats_kernel

__all__ = ["HIST_MODE", "LARGE_HIST_MODE", "LARGE_NUMEL", "LARGE_TILE", "MID_NUMEL", "MID_TILE", "NMETA", "POS_NUMEL",
           "REC", "REC_MAIN", "REC_MAIN_ORACLE", "REC_ORACLE_BASE", "REC_ORACLE_CAND", "RUN_BASE", "RUN_CAND",
           "SMALL_NUMEL", "SMALL_TILE", "SPEC_NUMEL", "TILE", "fused_raw_stats", "gated_copies", "gated_copy",
           "hist_mode_for", "launch_stats", "merged_gate_launches", "new_accumulator", "pdl_options", "pdl_supported",
           "stats_config"]

#: record: seq, call, step, mode, flags, base_ns, cand_ns, batch, draft, prefix, site, kind, the candidate's
#: error flag as the call's statistics kernel read it (``launch_stats(cand_flag=...)``; 0 without one), and the
#: control kernel's counts of on-mode replays on covered / uncovered shapes
NMETA = 15
#: record kinds (word 11): candidate vs baseline; the same, preceded by this call's two oracle records
#: (eager validate, 1 in ``oracle_every`` sampled calls); candidate vs oracle; baseline vs oracle
REC_MAIN, REC_MAIN_ORACLE, REC_ORACLE_CAND, REC_ORACLE_BASE = range(4)
#: decision words of a call (``_Slot.sstate``) read by the gate kernel: the baseline / the candidate must work
RUN_BASE, RUN_CAND = 13, 14
REC = NMETA + NRAW
#: statistics kernel: elements per tile, warps, programs per SM (bench/diffstats.py measures variants)
TILE = (4096, 8, 2)
#: outputs up to SMALL_NUMEL elements use SMALL_TILE: one short tile per program keeps the latency of a
#: per-layer call low (the launch configuration still depends only on the static size: graph-safe)
SMALL_NUMEL, SMALL_TILE = 2**17, (1024, 4, 4)
#: outputs up to MID_NUMEL elements use MID_TILE: one program of four warps per SM, several 2048-element tiles
#: each (the next one's loads in flight while one is reduced), so half the programs fold into the accumulator row
#: and take a ticket; up to LARGE_NUMEL, LARGE_TILE: two such programs per SM. On an H100, per call of 20 in a graph
#: against the (4096, 4, 2) used before: 2^20 elements 4.36 against 5.28 µs, 2^21 5.62 against 6.11, 2^22 7.77
#: against 8.08, 2^23 12.66 against 13.79 (2^19 unchanged; bench/results/hook-2026-12-07.md, session 27)
MID_NUMEL, MID_TILE = 2**21, (2048, 4, 1)
LARGE_NUMEL, LARGE_TILE = 2**23, (2048, 4, 2)
#: outputs up to SPEC_NUMEL elements launched without PDL load their first tile before the call's decision
#: arrives (it saves a memory round trip on sampled calls and costs that read on unsampled ones; under PDL
#: the decision is read before the wait instead, at no cost); up to POS_NUMEL the pass
#: tracks the position of max |d| per element instead of re-reading it (latency over instructions)
SPEC_NUMEL = 2**17
POS_NUMEL = 2**22
REGS_PER_SM = 65536  # sm_80 .. sm_120
#: histogram (shadowd.hook.triton_hist): 1 tl.histogram, 2 warp ballots, 3 per-thread shared-memory columns,
#: 4 exponent rows per lane (3 and 4 compiled for COLS_WARPS warps; other warp counts fall back to ballots)
HIST_MODE = 3
#: the large tile's histogram: exponent rows (three instructions per element fewer than the columns, a fold of the
#: sparse rows after the pass): on an H100, 2^22 elements 7.23-7.25 against 7.56-7.57 µs per call (2^23: within the
#: spread between runs), while at 2^19-2^20 and on the 8-warp bandwidth tile the fold costs more than it saves
#: (bench/results/hook-2026-12-07.md, session 30)
LARGE_HIST_MODE = 4
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


_SMS: dict[Any, int] = {}


def _sms(device: torch.device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def new_accumulator(device: torch.device) -> torch.Tensor:
    """A zeroed accumulator row for :func:`launch_stats` (one per call site; reset by the kernel)."""
    return torch.zeros(ACC_WORDS, dtype=torch.int64, device=device)


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
    """The histogram mode really compiled for ``warps`` warps: the shared-memory columns (3) or exponent rows
    (4) where they are compiled (COLS_WARPS), else warp ballots."""
    if mode in (3, 4) and warps not in COLS_WARPS:
        return 2
    return mode


def launch_stats(cand: torch.Tensor, base: torch.Tensor, acc: torch.Tensor, rec: torch.Tensor,
                 seq: torch.Tensor, sstate: torch.Tensor, dstate: torch.Tensor, *, valid_rows: Any = None,
                 hard_scaled: float = 0.25, hard_rel_l2: float = 0.1, site_id: int = 0,
                 publish: bool = True, tile: tuple[int, int, int] | None = None, hist: bool = True,
                 hist_mode: int | None = None, spec: bool | None = None, pdl: bool | None = None,
                 kind: int = REC_MAIN, stamp: bool = False, cand_flag: torch.Tensor | None = None,
                 ew: bool | None = None, pos: bool | None = None) -> Any:
    """Launch the statistics kernel (one launch; no sync, no allocation when inputs are contiguous).

    Returns Triton's handle of the launched kernel. ``acc`` is the call site's accumulator
    (:func:`new_accumulator`); calls sharing one must be stream-ordered. Positions of max |d| are exact
    below 2^32 elements. ``tile`` (elements per tile, warps, programs per SM), ``hist`` and ``hist_mode``
    (1 tl.histogram, 2 warp ballots, 3 shared-memory columns, 4 exponent rows) and ``spec`` (load the first
    tile before the decision word; default: outputs up to SPEC_NUMEL elements launched without PDL) and ``pdl``
    (programmatic dependent launch; default: :func:`pdl_supported`) are benchmark knobs; the hook uses the
    defaults.
    ``ew`` (default: where a thread may hold 255 registers) keeps the fast pass's sums and maxima per element,
    reduced to rows once (fewer instructions per element, ~80 more registers per thread). ``pos`` (default: outputs
    up to POS_NUMEL elements) tracks the position of max |d| per element during the pass instead of re-reading the
    vectors that hold it after the last tile (fewer instructions against one dependent load). ``kind`` goes into the
    record's word 11 (``REC_*``: what the record compares). ``stamp``: the record's
    candidate time ends at this kernel's start (global timer, read after the PDL wait) instead of at the
    stamp kernel's ``sstate[8]`` — one launch fewer per call where the candidate directly precedes it.
    ``cand_flag``: the candidate's own device error word (int32, >= 1 element, on the outputs' device: the
    caller checks it once, ``cuda_call._flag_tensor``; bits the candidate's kernels OR in when they clamp bad
    input), read after the wait by the finishing program: a non-zero word goes into the record's word 12 and is
    a hard failure (on mode: the sticky device fallback).

    Contract under PDL: the kernel reads the decision word ``sstate[0]`` and ``valid_rows`` before it waits
    for the previous kernel, so the kernel directly before it on the stream must not write them (in the
    hook that kernel is the candidate's last one, or the timer stamp, which writes ``sstate[8]``); everything
    else it reads after."""
    c = cand.reshape(-1) if cand.is_contiguous() else cand.contiguous().reshape(-1)
    b = base.reshape(-1) if base.is_contiguous() else base.contiguous().reshape(-1)
    n = b.numel()
    row = base[0].numel() if base.dim() and base.shape[0] else 1
    has_valid = isinstance(valid_rows, torch.Tensor)
    if isinstance(valid_rows, int):
        n = min(n, valid_rows * row)
    pdl = pdl_supported(c.device) if pdl is None else (pdl and not _INTERPRET)
    nprog, config = stats_config(n, b.element_size(), _sms(c.device), tile=tile, hist=hist, hist_mode=hist_mode,
                                 spec=spec, pdl=pdl, publish=publish, stamp=stamp, has_valid=has_valid,
                                 has_flag=cand_flag is not None, ew=ew, pos=pos)
    return stats_kernel[(nprog,)](c, b, acc, acc.view(torch.float64)[ACC:], n, valid_rows if has_valid else sstate, row,
                           sstate, rec, seq, rec.shape[0], rec.shape[1], dstate, hard_scaled,
                           hard_rel_l2 * hard_rel_l2, site_id, kind, cand_flag if cand_flag is not None else sstate,
                           **config)


@functools.lru_cache(maxsize=256)
def stats_config(n: int, element_size: int, sms: int, *, tile: tuple[int, int, int] | None = None, hist: bool = True,
                 hist_mode: int | None = None, spec: bool | None = None, pdl: bool = False, publish: bool = True,
                 stamp: bool = False, has_valid: bool = False, has_flag: bool = False, ew: bool | None = None,
                 pos: bool | None = None, interpret: bool = _INTERPRET) -> tuple[int, Mapping[str, Any]]:
    """The statistics kernel's grid and compile-time configuration for ``n`` real elements of ``element_size``
    bytes on a GPU of ``sms`` SMs: (programs, the kernel's constexpr arguments with ``num_warps`` and the launch
    options, read-only). The knobs are :func:`launch_stats`' (``pdl`` already decided); what it launches, and what
    a compile-only check builds. Cached: a site's calls repeat a few static configurations, so a compared call pays
    one lookup for them."""
    block, warps, per_sm = tile or (SMALL_TILE if n <= SMALL_NUMEL else MID_TILE if n <= MID_NUMEL
                                    else LARGE_TILE if n <= LARGE_NUMEL else TILE)
    # histogram by inline PTX on the GPU (shared-memory columns; exponent rows on the large tile; warp ballots where
    # neither is compiled for this many warps); tl.histogram in the interpreter
    default = LARGE_HIST_MODE if tile is None and MID_NUMEL < n <= LARGE_NUMEL else HIST_MODE
    mode = (hist_mode or (1 if interpret else default)) if hist else 0
    mode = hist_mode_for(mode, warps)
    vec = max(1, min(8, 16 // element_size))  # one 16-byte vector per row of a tile
    nprog = max(1, min(per_sm * sms, triton.cdiv(max(n, 1), block)))
    # registers capped so that per_sm programs fit one SM's 64 K registers (the loads in flight per SM
    # are what reaches the bandwidth); the interpreter takes no launch options
    # (allocated per warp in steps of 8 per thread; 255, the most a thread can address, when the share allows 256)
    share = REGS_PER_SM // (warps * 32 * per_sm)
    opts: dict[str, Any] = {} if interpret else {"maxnreg": 255 if share >= 256 else share // 8 * 8}
    ew = share >= 256 if ew is None else ew
    if pdl:
        opts["launch_pdl"] = True
    if spec is None:  # under PDL the decision is read before the wait: a speculative load gains nothing
        spec = n <= SPEC_NUMEL and not pdl
    return nprog, MappingProxyType(dict(
        HAS_VALID=has_valid, HAS_FLAG=has_flag, BLOCK=block, VEC=vec, HIST=mode, PUBLISH=publish, GPU=not interpret,
        NMETA=NMETA, NW=warps, SPEC=spec, POS=n <= POS_NUMEL if pos is None else pos, PDL=pdl, ONE=nprog * block >= n,
        STAMP=stamp and not interpret, EW=ew, num_warps=warps, **opts))


def gated_copy(src: torch.Tensor, sstate: torch.Tensor, word: int = RUN_BASE) -> torch.Tensor:
    """A copy of the small int tensor ``src`` that holds zeros on calls whose baseline (``word`` =
    RUN_BASE) or candidate (RUN_CAND) is gated off.

    ``sstate`` is the call site's decision words (what a ``baseline_gate`` / ``candidate_gate`` receives);
    one tiny launch, no sync, graph-safe (under capture the copy comes from the graph's pool and the
    kernel re-decides on every replay)."""
    return gated_copies([src], sstate, word)[0]


def gated_copies(srcs: list[torch.Tensor], sstate: torch.Tensor, word: int = RUN_BASE) -> list[torch.Tensor]:
    """:func:`gated_copy` of every tensor of ``srcs``, up to four per launch (a gate's ``qo_indptr`` and
    ``kv_indptr`` in one). Inside :func:`merged_gate_launches` the copies are handed out at once and made when the
    block ends, together with the other gates' copies asked for in it."""
    if word not in (RUN_BASE, RUN_CAND):
        raise ValueError(f"word: expected RUN_BASE ({RUN_BASE}) or RUN_CAND ({RUN_CAND}), got {word!r}")
    srcs = [s.contiguous() for s in srcs]
    dsts = [torch.empty_like(s) for s in srcs]
    jobs = [(s, d, word) for s, d in zip(srcs, dsts, strict=True)]
    pending: list[tuple[torch.Tensor, list[_GateJob]]] | None = getattr(_MERGED, "pending", None)
    if pending is not None:
        pending.append((sstate, jobs))
    else:
        _launch_gates([(sstate, jobs)])
    return dsts


#: one gated copy: source, destination, the decision word that gates it (RUN_BASE or RUN_CAND)
_GateJob = tuple[torch.Tensor, torch.Tensor, int]
_MERGED = threading.local()


@contextlib.contextmanager
def merged_gate_launches() -> Iterator[None]:
    """Within the block (on this thread), :func:`gated_copies` launches nothing: the copies asked for are made
    when it ends, up to four per launch — so an on-mode call that gates both its baseline's and its candidate's
    work sizes adds one graph node, not two. The copies are made on leaving the block whatever it raised (a copy
    handed out before the error holds its values); a block inside another merges into the outer one."""
    if getattr(_MERGED, "pending", None) is not None:
        yield
        return
    _MERGED.pending = []
    try:
        yield
    finally:
        pending, _MERGED.pending = _MERGED.pending, None
        _launch_gates(pending)


def _launch_gates(batches: list[tuple[torch.Tensor, list[_GateJob]]]) -> None:
    # the copies that read one decision-word tensor go together, four per launch
    groups: dict[int, tuple[torch.Tensor, list[_GateJob]]] = {}
    for sstate, jobs in batches:
        groups.setdefault(id(sstate), (sstate, []))[1].extend(jobs)
    for sstate, jobs in groups.values():
        pdl = pdl_supported(sstate.device)
        for i in range(0, len(jobs), 4):
            part = jobs[i:i + 4]
            slots = part + [part[0]] * (4 - len(part))  # (unused slots repeat the first: never touched)
            block = max(16, triton.next_power_of_2(max(max(s.numel() for s, _, _ in part), 1)))
            flat = [x for s, d, _ in slots for x in (s, d, s.numel())]
            words = {f"WORD{j}": w for j, (_, _, w) in enumerate(slots)}
            gate_kernel[(1,)](*flat, sstate, **words, COUNT=len(part), BLOCK=block, PDL=pdl, num_warps=1,
                              **pdl_options(pdl))


def pdl_options(pdl: bool) -> dict[str, Any]:
    """The launch options of a kernel launched with programmatic dependent launch (none otherwise)."""
    return {"launch_pdl": True} if pdl else {}


def fused_raw_stats(cand: torch.Tensor, base: torch.Tensor, valid_rows: Any = None, *,
                    tile: tuple[int, int, int] | None = None, hist_mode: int | None = None,
                    ew: bool | None = None) -> torch.Tensor:
    """The raw statistics vector (device float64[NRAW]) of the fused kernels; for tests and benches
    (``tile``, ``hist_mode`` and ``ew`` as in :func:`launch_stats`)."""
    dev = base.device
    sstate = torch.zeros(16, dtype=torch.int64, device=dev)
    sstate[0] = 1  # do_stats
    sstate[12] = 1  # publish (into the one-record ring here)
    rec = torch.zeros(1, REC, dtype=torch.float64, device=dev)
    launch_stats(cand, base, new_accumulator(dev), rec,
                 torch.zeros(1, dtype=torch.int64, device=dev), sstate,
                 torch.zeros(8, dtype=torch.int64, device=dev), valid_rows=valid_rows, publish=False,
                 tile=tile, hist_mode=hist_mode, ew=ew)
    return rec[0, NMETA:]

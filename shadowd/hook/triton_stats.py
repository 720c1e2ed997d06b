# mypy: allow-untyped-defs
"""The fused diff-statistics pass on GPU (Triton); the graph path's control kernels are in ``triton_control``.

One launch per sampled call, no host synchronisation, no allocation (:func:`_stats_kernel`):

1. every program makes a grid-stride pass over its tiles of both outputs (each read once, in its own
   dtype, widened to fp32). A tile is [ROWS, VEC] with one 16-byte vector per row, so each thread owns
   whole rows and the running sums and maxima are per row (few registers, vectorised loads, the next
   tile loaded before the current one is reduced) — or, where a thread may hold 255 registers, per
   element, reduced to rows once after the last tile (``EW``: no reduction tree per tile). The common
   case — every value finite — takes a fast path without masks or non-finite bookkeeping; a NaN / Inf
   anywhere in the program's tiles makes Σ|d| non-finite and the program redoes its tiles exactly
   (counts per side, candidate-only and baseline-only positions). The log2 histogram is counted per
   thread in shared memory (or by warp ballots, or by ``tl.histogram`` in the interpreter:
   ``shadowd.hook.triton_hist``).
2. every program folds its partials into the call site's accumulator row with device-scope atomics
   (fp64 sums, integer counts, maxima as bit patterns, max |d| and its first position as one int64
   key; the row's layout is in ``shadowd.hook.triton_record``), reads the few words the record needs
   besides the row (``record_inputs``: they arrive during the ticket's round trip) and then takes a
   ticket; the program drawing the last ticket runs ``finish_record``: the row becomes the raw vector of
   ``shadowd.hook.diffstats`` (same layout, same definitions as the torch path) and is reset for the
   next call, the on-mode hard-failure check runs (sticky device fallback flag), and the record goes
   into a ring slot (pinned host memory or a device tensor) whose sequence number is published last,
   behind a CTA barrier and a system-scope fence.

On sm_90+ the kernel is launched with programmatic dependent launch (``PDL``): its launch overlaps the
previous kernel (the candidate), and ``griddepcontrol.wait`` precedes its first read of memory (the
histogram's shared memory is zeroed before it).

The number of real elements is read from device memory (``valid_ptr``: real token rows × row size),
so padded graph batches are excluded; the per-call decision (``sstate[0]``) is read from device
memory too, so the same captured graph computes statistics only on sampled replays — an unsampled
call's programs end right after reading it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shadowd.hook.diffstats import TINY
from shadowd.hook.triton_control import pdl_wait
from shadowd.hook.triton_hist import HB, bins, hist_add, hist_add_fast, hist_declare, hist_final, hist_init
from shadowd.hook.triton_record import (
    A_HIST,
    A_KEY,
    A_NAN_B,
    A_REL,
    A_TICKET,
    ACC,
    ACC_WORDS,
    F_ABS,
    F_B2,
    F_D2,
    POS_MASK,
    finish_record,
    record_inputs,
)
from shadowd.wire import HIST_BINS

__all__ = ["ACC", "ACC_WORDS", "stats_kernel"]

# kernels may only read constexpr globals: rebind every constant they use
TINY, HIST_BINS = tl.constexpr(TINY), tl.constexpr(HIST_BINS)


@triton.jit
def _fast_update(c, b, lane, cols, rem, t, best, best_t, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, ha, hb,
                 TAIL: tl.constexpr, HIST: tl.constexpr, NW: tl.constexpr, POS: tl.constexpr, ASM: tl.constexpr,
                 EW: tl.constexpr):
    # One [ROWS, VEC] tile, every value assumed finite: each thread owns whole rows of VEC contiguous
    # elements, so the axis-1 reductions stay inside the thread and the running state is per row.
    # ``lane`` indexes the tile; ``rem`` real elements remain from its start (the tail tile is partial).
    # POS: ``best_t`` = tile · VEC + column of the row's first maximum (< 2^31: a tile has >= 2 rows),
    # else the tile (the caller re-reads that vector: three instructions per element fewer). ASM: the GPU
    # (approximate reciprocal, bins inside the histogram's PTX), else the interpreter.
    d = tl.abs(c - b)
    ab = tl.abs(b)
    # zero-filled lanes past the real elements never win the maximum
    dmax = tl.max(tl.where(lane < rem, d, -1.0), axis=1) if TAIL else tl.max(d, axis=1)
    better = dmax > best
    best = tl.where(better, dmax, best)
    if POS:
        vec: tl.constexpr = cols.numel
        col = tl.min(tl.where(d == dmax[:, None], cols[None, :], vec), axis=1)  # the row's first maximum
        best_t = tl.where(better, t * vec + col, best_t)
    else:
        best_t = tl.where(better, t, best_t)
    if EW:  # per element ([ROWS, VEC]): one FFMA / FMNMX per element, no tree per tile
        s_abs += d
        s_d2 += d * d
        s_b2 += b * b
        s_c2 += c * c
        m_rel = tl.maximum(m_rel, _ratio(d, tl.maximum(ab, TINY), ASM))
        m_b = tl.maximum(m_b, ab)
    else:
        s_abs += tl.sum(d, axis=1)
        s_d2 += tl.sum(d * d, axis=1)
        s_b2 += tl.sum(b * b, axis=1)
        s_c2 += tl.sum(c * c, axis=1)
        m_rel = tl.maximum(m_rel, tl.max(_ratio(d, tl.maximum(ab, TINY), ASM), axis=1))
        m_b = tl.maximum(m_b, tl.max(ab, axis=1))
    if HIST:
        ha, hb = hist_add_fast(d, lane, rem, ha, hb, TAIL, HIST, NW)
    return best, best_t, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, ha, hb


@triton.jit
def _ratio(x, y, ASM: tl.constexpr):
    # x / y for TINY <= y: on the GPU x · rcp.approx.ftz(y), two instructions (div.approx.f32 costs about
    # six: it guards y >= 2^126, whose reciprocal is subnormal and flushed here; the fast path never sees
    # such a y, as |b| >= 2^64 overflows Σb² and sends the program to the exact redo), exact division in
    # the interpreter
    if ASM:
        r = x * tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [y], dtype=tl.float32,
                                          is_pure=True, pack=1)
    else:
        r = x / y
    return r


@triton.jit
def _first_max(c_ptr, b_ptr, best, best_t, n, rows, cols, EXACT: tl.constexpr, BLOCK: tl.constexpr,
               VEC: tl.constexpr):
    # (max |d|, its first flat position) of a pass that kept the tile of each row's maximum: the rows
    # holding the maximum re-read the one vector where they first reached it and take its first
    # maximal element (exactly the same arithmetic as the pass, so the comparison is exact).
    top = tl.max(best, axis=0)
    hit = (best == top) & (best >= 0)
    offs = best_t.to(tl.int64)[:, None] * BLOCK + rows[:, None] * VEC + cols[None, :]
    m = hit[:, None] & (offs < n)
    c = tl.load(c_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    d = tl.abs(c - b)
    if EXACT:
        d = tl.where((tl.abs(c) < float("inf")) & (tl.abs(b) < float("inf")), d, -1.0)
    pos = tl.min(tl.min(tl.where(m & (d == top), offs, 9223372036854775807), axis=1), axis=0)
    return top, pos


@triton.jit
def _row_state(ROWS: tl.constexpr):
    # per-row running state of a pass: best |d| (-1: none yet) and its tile, Σ|d|, Σd², Σb², Σc²,
    # max relative |d|, max |b|
    z = tl.zeros([ROWS], tl.float32)
    return tl.full([ROWS], -1.0, tl.float32), tl.zeros([ROWS], tl.int32), z, z, z, z, z, z


@triton.jit
def _element_state(ROWS: tl.constexpr, VEC: tl.constexpr):
    # the fast pass's running sums (Σ|d|, Σd², Σb², Σc²) and maxima (rel |d|, |b|) per element of a tile (EW)
    z = tl.zeros([ROWS, VEC], tl.float32)
    return z, z, z, z, z, z


@triton.jit
def _fold(k, a, d2, b2, c2, r, m, k2, a2, d22, b22, c22, r2, m2):
    # the combine of :func:`_program_totals`: a max, four sums, two maxima
    return tl.maximum(k, k2), a + a2, d2 + d22, b2 + b22, c2 + c22, tl.maximum(r, r2), tl.maximum(m, m2)


@triton.jit
def _program_totals(keys, s_abs, s_d2, s_b2, s_c2, m_rel, m_b):
    # the program's totals from its per-row state in ONE reduction (one exchange through shared memory
    # and its barriers instead of one per quantity): the max key, the four sums in fp64, the two fp32
    # maxima. Returns (key, [Σ|d|, Σd², Σb², Σc²] fp64 in accumulator order, max rel |d|, max |b|).
    key, a, d2, b2, c2, rel, outs = tl.reduce((keys, s_abs.to(tl.float64), s_d2.to(tl.float64), s_b2.to(tl.float64),
                                              s_c2.to(tl.float64), m_rel, m_b), 0, _fold)
    i4 = tl.arange(0, 4)
    sums = tl.where(i4 == F_ABS, a, tl.where(i4 == F_D2, d2, tl.where(i4 == F_B2, b2, c2)))
    return key, sums, rel, outs


@triton.jit
def _tile_lanes(BLOCK: tl.constexpr, VEC: tl.constexpr):
    # a tile's [ROWS, VEC] element offsets (int32) and its row and column indices
    rows = tl.arange(0, BLOCK // VEC)
    cols = tl.arange(0, VEC)
    return rows[:, None] * VEC + cols[None, :], rows, cols


@triton.jit
def _full_tile(c_ptr, b_ptr, t, bound, BLOCK: tl.constexpr, VEC: tl.constexpr):
    # tile t of both outputs in storage dtype if it is one of the full tiles of ``bound`` elements, else
    # zeros; t < bound // BLOCK as a per-lane mask that is uniform per tile (the loads stay vectorised)
    lane, _rows, _cols = _tile_lanes(BLOCK, VEC)
    go = lane < (bound // BLOCK - t).to(tl.int64) * BLOCK
    base = tl.cast(t, tl.int64) * BLOCK
    return tl.load(c_ptr + base + lane, mask=go, other=0.0), tl.load(b_ptr + base + lane, mask=go, other=0.0)


@triton.jit
def _fast_pass(c_ptr, b_ptr, c_nx, b_nx, ha, hb, pid, nprog, n, BLOCK: tl.constexpr, VEC: tl.constexpr,
               HIST: tl.constexpr, NW: tl.constexpr, POS: tl.constexpr, ASM: tl.constexpr, ONE: tl.constexpr,
               EW: tl.constexpr):
    # The common case, every value finite: no masks on full tiles (vectorised loads, the next tile
    # loaded before the current one is reduced), no non-finite bookkeeping. A NaN or Inf anywhere (or
    # an overflowing |d|) makes Σ|d| non-finite, and the caller then redoes the program exactly.
    # (c_nx, b_nx): the first tile (:func:`_full_tile`); (ha, hb): the histogram state (``hist_init``).
    # ONE: the grid covers the output, so a program has at most one tile: no loop and no next tile held
    # in registers (the latency path of per-layer outputs). EW: the sums and maxima are kept per element and
    # reduced to rows once at the end (fewer instructions per element; needs ~80 more registers per thread).
    ROWS: tl.constexpr = BLOCK // VEC
    lane, rows, cols = _tile_lanes(BLOCK, VEC)
    best, best_t, s_abs, s_d2, s_b2, s_c2, m_rel, m_b = _row_state(ROWS)
    if EW:
        s_abs, s_d2, s_b2, s_c2, m_rel, m_b = _element_state(ROWS, VEC)
    # addresses: one scalar base per tile plus the tile's (constant) int32 lane offsets
    nfull = (n // BLOCK).to(tl.int32)
    t = pid
    if ONE:
        if t < nfull:
            best, best_t, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, ha, hb = _fast_update(
                c_nx.to(tl.float32), b_nx.to(tl.float32), lane, cols, BLOCK, t, best, best_t, s_abs, s_d2, s_b2,
                s_c2, m_rel, m_b, ha, hb, False, HIST, NW, POS, ASM, EW)
    else:
        while t < nfull:
            c = c_nx.to(tl.float32)
            b = b_nx.to(tl.float32)
            tt = t
            t += nprog
            c_nx, b_nx = _full_tile(c_ptr, b_ptr, t, n, BLOCK, VEC)
            best, best_t, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, ha, hb = _fast_update(
                c, b, lane, cols, BLOCK, tt, best, best_t, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, ha, hb, False, HIST, NW,
                POS, ASM, EW)
    if nfull % nprog == pid:  # noqa: SIM102 - the partial last tile, if any, is the next program's
        if nfull.to(tl.int64) * BLOCK < n:
            base = nfull.to(tl.int64) * BLOCK
            rem = (n - base).to(tl.int32)
            m = lane < rem
            c = tl.load(c_ptr + base + lane, mask=m, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + base + lane, mask=m, other=0.0).to(tl.float32)
            best, best_t, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, ha, hb = _fast_update(
                c, b, lane, cols, rem, nfull, best, best_t, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, ha, hb, True, HIST,
                NW, POS, ASM, EW)
    # (max |d|, its first flat position) as int64 keys per row, reduced by the caller: from the rows'
    # first maxima (POS, small outputs: no second read on the latency path) or, found by re-reading the
    # vectors that hold them, the program's one key in every row
    if POS:
        keys = _key(best, (best_t // VEC).to(tl.int64) * BLOCK + rows * VEC + best_t % VEC)
    else:
        top, pos = _first_max(c_ptr, b_ptr, best, best_t, n, rows, cols, False, BLOCK, VEC)
        keys = tl.full([ROWS], _key(top, pos), tl.int64)
    if EW:  # the per-element state to rows, once
        s_abs, s_d2 = tl.sum(s_abs, axis=1), tl.sum(s_d2, axis=1)
        s_b2, s_c2 = tl.sum(s_b2, axis=1), tl.sum(s_c2, axis=1)
        m_rel, m_b = tl.max(m_rel, axis=1), tl.max(m_b, axis=1)
    return keys, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, hist_final(ha, hb, lane, HIST, NW)


@triton.jit
def _key(top, pos):
    # max |d| (fp32 >= 0, whose bit pattern orders like the value) and its flat position as one int64:
    # value bits high, inverted position low, so the larger key is the larger value and, among equal
    # values, the first position (0: nothing compared)
    return tl.where(top >= 0,
                    (top.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (tl.minimum(pos, POS_MASK - 1) ^ POS_MASK),
                    0)


@triton.jit
def _exact_pass(c_ptr, b_ptr, pid, nprog, n, BLOCK: tl.constexpr, VEC: tl.constexpr, HIST: tl.constexpr,
                NW: tl.constexpr):
    # Every definition of shadowd.hook.diffstats, non-finite values included (compared positions only
    # in the sums and maxima; NaN / Inf counts per side; candidate-only and baseline-only positions).
    ROWS: tl.constexpr = BLOCK // VEC
    lane, rows, cols = _tile_lanes(BLOCK, VEC)
    best, best_t, s_abs, s_d2, s_b2, s_c2, m_rel, m_b = _row_state(ROWS)
    nan_b = tl.zeros([ROWS], tl.int32)
    inf_b = tl.zeros([ROWS], tl.int32)
    nan_c = tl.zeros([ROWS], tl.int32)
    inf_c = tl.zeros([ROWS], tl.int32)
    c_only = tl.zeros([ROWS], tl.int32)
    b_only = tl.zeros([ROWS], tl.int32)
    ha, hb = hist_init(ROWS, HIST, NW)
    ntiles = tl.cdiv(n, BLOCK).to(tl.int32)
    t = pid
    # (a while loop, as the fast pass's: Triton 3.6's interpreter cannot range() over a count read from memory)
    while t < ntiles:
        base = tl.cast(t, tl.int64) * BLOCK
        rem = tl.minimum(n - base, BLOCK).to(tl.int32)
        m = lane < rem
        c = tl.load(c_ptr + base + lane, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + base + lane, mask=m, other=0.0).to(tl.float32)
        ac = tl.abs(c)
        ab = tl.abs(b)
        fc = ac < float("inf")  # False for NaN and Inf
        fb = ab < float("inf")
        cmp = fc & fb & m
        d = tl.where(cmp, tl.abs(c - b), 0.0)
        bz = tl.where(cmp, b, 0.0)
        cz = tl.where(cmp, c, 0.0)
        dmax = tl.max(tl.where(cmp, d, -1.0), axis=1)
        better = dmax > best
        best = tl.where(better, dmax, best)
        best_t = tl.where(better, t, best_t)
        s_abs += tl.sum(d, axis=1)
        s_d2 += tl.sum(d * d, axis=1)
        s_b2 += tl.sum(bz * bz, axis=1)
        s_c2 += tl.sum(cz * cz, axis=1)
        m_rel = tl.maximum(m_rel, tl.max(d / tl.maximum(ab, TINY), axis=1))
        m_b = tl.maximum(m_b, tl.max(tl.where(fb & m, ab, 0.0), axis=1))
        nan_b += tl.sum((m & (b != b)).to(tl.int32), axis=1)
        inf_b += tl.sum((m & (ab == float("inf"))).to(tl.int32), axis=1)
        nan_c += tl.sum((m & (c != c)).to(tl.int32), axis=1)
        inf_c += tl.sum((m & (ac == float("inf"))).to(tl.int32), axis=1)
        c_only += tl.sum((m & fb & (~fc)).to(tl.int32), axis=1)
        b_only += tl.sum((m & fc & (~fb)).to(tl.int32), axis=1)
        if HIST:
            ha, hb = hist_add(bins(d, lane, rem, cmp, True, False), ha, hb, HIST, NW)
        t += nprog
    top, pos = _first_max(c_ptr, b_ptr, best, best_t, n, rows, cols, True, BLOCK, VEC)
    keys = tl.full([ROWS], _key(top, pos), tl.int64)
    hist = hist_final(ha, hb, lane, HIST, NW)
    # counts in accumulator order from A_NAN_B: nan_b, inf_b, nan_c, inf_c, cand-only, base-only, 0, 0
    # (tl.join adds its new axis last, so nested joins interleave: this operand order flattens to it)
    z = nan_b * 0
    cnt = tl.join(tl.join(tl.join(nan_b, c_only), tl.join(nan_c, z)),
                  tl.join(tl.join(inf_b, b_only), tl.join(inf_c, z)))
    counts = tl.sum(tl.reshape(cnt, [ROWS, 8]).to(tl.int64), axis=0)
    return keys, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, hist, counts


@triton.jit(do_not_specialize=["n_static", "row_numel", "ring_size", "rec_size", "site_id", "kind"])
def _stats_kernel(c_ptr, b_ptr, acc_ptr, accf_ptr, n_static, valid_ptr, row_numel, sstate_ptr, rec_ptr, seq_ptr,
                  ring_size, rec_size, dstate_ptr, hard_scaled, hard_rel_l2_sq, site_id, kind, flag_ptr,
                  HAS_VALID: tl.constexpr, HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
                  HIST: tl.constexpr,
                  PUBLISH: tl.constexpr, GPU: tl.constexpr, NMETA: tl.constexpr, NW: tl.constexpr,
                  SPEC: tl.constexpr, POS: tl.constexpr, PDL: tl.constexpr, ONE: tl.constexpr,
                  STAMP: tl.constexpr, EW: tl.constexpr):
    # Phase 1 (every program of a sampled call): a grid-stride pass over its tiles of the real elements
    # (their count read from device memory): fp32 per-row sums and maxima, a per-program log2 histogram.
    # With PDL, what comes before the wait overlaps the previous kernel: the histogram's shared memory is
    # zeroed, and the real count and the call's decision are read — launch_stats' contract: the kernel
    # directly before this one on the stream does not write them (in the hook: the candidate's last kernel).
    # STAMP: the candidate's end time is this kernel's start, read from the global timer after the wait
    # (every program of the one wave starts there; the finishing program's own reading is used), in place of
    # a stamp kernel's sstate[8].
    hist_declare(HIST, NW)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = n_static.to(tl.int64)
    # (read through L2 only: no L1 line of the decision word's neighbours, which the previous kernel may
    # write — a timer stamp writes sstate[8] — survives into the reads after the wait)
    if HAS_VALID:
        n = tl.minimum(tl.load(valid_ptr, cache_modifier=".cg").to(tl.int64) * row_numel, n)
    go = tl.load(sstate_ptr, cache_modifier=".cg") != 0
    ha, hb = hist_init(BLOCK // VEC, HIST, NW)  # while those reads are under way
    if PDL:  # programmatic dependent launch (sm_90+): the previous kernel's writes are visible after the wait
        pdl_wait()
    t_end = tl.extra.cuda.globaltimer().to(tl.int64) if STAMP else 0
    if SPEC:  # small outputs without PDL: the first tile is read before the real count and the decision arrive
        c_nx, b_nx = _full_tile(c_ptr, b_ptr, pid, n_static.to(tl.int64), BLOCK, VEC)
    # do_stats, decided by the control kernel (or the host): an unsampled call's programs end here
    if go:
        if not SPEC:
            c_nx, b_nx = _full_tile(c_ptr, b_ptr, pid, n, BLOCK, VEC)
        keys, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, hist = _fast_pass(c_ptr, b_ptr, c_nx, b_nx, ha, hb, pid, nprog,
                                                                     n, BLOCK, VEC, HIST, NW, POS, GPU, ONE, EW)
        key, sums, rel, outs = _program_totals(keys, s_abs, s_d2, s_b2, s_c2, m_rel, m_b)
        counts = tl.zeros([8], tl.int64)
        # a non-finite value in this program's tiles (or |b| >= 2^64: Σb² overflows): redo exactly
        if not (tl.sum(sums, axis=0) < float("inf")):
            keys, s_abs, s_d2, s_b2, s_c2, m_rel, m_b, hist, counts = _exact_pass(c_ptr, b_ptr, pid, nprog, n,
                                                                                  BLOCK, VEC, HIST, NW)
            key, sums, rel, outs = _program_totals(keys, s_abs, s_d2, s_b2, s_c2, m_rel, m_b)

        # Phase 2 (every program that saw data): fold its totals into the accumulator row with
        # device-scope atomics, one vector atomic per kind: fp64 sums, integer counts and histogram, and
        # maxima of non-negative fp32 as their bit patterns — max |d| with its first position packed into
        # one int64 key (value bits high, inverted position low), so one atomic max keeps both.
        if tl.cdiv(n, BLOCK) > pid:
            i4 = tl.arange(0, 4)
            vmax = tl.where(i4 == A_KEY, key, tl.where(i4 == A_REL, rel.to(tl.int32, bitcast=True).to(tl.int64),
                                                       outs.to(tl.int32, bitcast=True).to(tl.int64)))
            tl.atomic_max(acc_ptr + i4, vmax, mask=(i4 < 3) & (vmax > 0), sem="relaxed")
            tl.atomic_add(accf_ptr + i4, sums, mask=sums != 0, sem="relaxed")
            i8 = tl.arange(0, 8)
            tl.atomic_add(acc_ptr + A_NAN_B + i8, counts, mask=(i8 < 6) & (counts != 0), sem="relaxed")
            if HIST:
                hbin = tl.arange(0, HB)
                tl.atomic_add(acc_ptr + A_HIST + hbin, hist.to(tl.int64), mask=(hbin < HIST_BINS) & (hist != 0),
                              sem="relaxed")
        # the finishing program's other inputs, read while the ticket's round trip is under way
        inputs = record_inputs(sstate_ptr, dstate_ptr, t_end, STAMP, flag_ptr, HAS_FLAG)
        # every thread's atomics are ordered before this program's ticket: a CTA barrier, then the
        # ticket's gpu-scope release by one thread (cumulative: it covers what the barrier ordered before
        # it, as in the CUDA grid-sync pattern); the program that draws the last ticket acquires them all
        # and finishes. An unsampled call added nothing and took no ticket (the row and the ticket count
        # stay zero for the next call).
        tl.debug_barrier()
        ticket = tl.atomic_add(acc_ptr + A_TICKET, 1, sem="acq_rel")
        if ticket == nprog - 1:
            finish_record(acc_ptr, accf_ptr, n, inputs, rec_ptr, seq_ptr, ring_size, rec_size, dstate_ptr,
                          hard_scaled, hard_rel_l2_sq, site_id, kind, PUBLISH, GPU, NMETA)


stats_kernel = _stats_kernel

# mypy: allow-untyped-defs
"""The fused diff-statistics pass on GPU (Triton), and the tiny control kernels of the graph path.

Two launches per sampled call, no host synchronisation, no allocation:

1. :func:`_partial_kernel` — a fixed grid of programs, each striding over the outputs once
   (both read once, in their own dtype, widened to fp32), keeping per-lane running maxima,
   fp32 per-lane sums and a per-program log2 histogram; per-program partials (fp64) go to a
   preallocated device buffer.
2. :func:`_final_kernel` — one program reduces the partials in fp64 into the raw vector of
   ``shadowd.hook.diffstats`` (same layout, same definitions as the torch path), writes it with
   the call's metadata into a ring slot (pinned host memory or a device tensor), runs the
   on-mode hard-failure check (setting the sticky device fallback flag), and publishes the
   slot's sequence number last, behind a CTA barrier and a system-scope fence.

The number of real elements is read from device memory (``valid_ptr``: real token rows ×
row size), so padded graph batches are excluded; the per-call decision (``flag_ptr``) is read
from device memory too, so the same captured graph computes statistics only on sampled replays.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shadowd.hook.diffstats import (
    NRAW,
    R_BASE_NF,
    R_CAND_NF,
    R_HIST,
    R_INF_B,
    R_INF_C,
    R_MAX_ABS,
    R_MAX_POS,
    R_MAX_REL,
    R_N_CMP,
    R_NAN_B,
    R_NAN_C,
    R_NUMEL,
    R_OUT_SCALE,
    R_SUM_ABS,
    R_SUM_B2,
    R_SUM_C2,
    R_SUM_D2,
    TINY,
)
from shadowd.wire import HIST_BINS, HIST_EXP_MAX, HIST_EXP_MIN

__all__ = ["NPART", "final_kernel", "partial_kernel", "select_kernel", "stamp_kernel"]

NPART = 64  # partial row width (NRAW padded); histogram bins 0..HIST_BINS-1 live at R_HIST..
assert NRAW <= NPART and HIST_BINS < 64

# kernels may only read constexpr globals: rebind every constant they use
HB = tl.constexpr(64)  # histogram bins computed per tile (power of two); bin HB-1 collects masked lanes
(R_MAX_ABS, R_MAX_POS, R_SUM_ABS, R_MAX_REL, R_SUM_D2, R_SUM_B2, R_SUM_C2, R_OUT_SCALE, R_NAN_B, R_INF_B,
 R_NAN_C, R_INF_C, R_CAND_NF, R_BASE_NF, R_NUMEL, R_N_CMP, R_HIST, NRAW, TINY, HIST_BINS, HIST_EXP_MIN,
 HIST_EXP_MAX) = (tl.constexpr(v) for v in (
    R_MAX_ABS, R_MAX_POS, R_SUM_ABS, R_MAX_REL, R_SUM_D2, R_SUM_B2, R_SUM_C2, R_OUT_SCALE, R_NAN_B, R_INF_B,
    R_NAN_C, R_INF_C, R_CAND_NF, R_BASE_NF, R_NUMEL, R_N_CMP, R_HIST, NRAW, TINY, HIST_BINS, HIST_EXP_MIN,
    HIST_EXP_MAX))


@triton.jit(do_not_specialize=["n_static", "row_numel"])
def _partial_kernel(c_ptr, b_ptr, part_ptr, n_static, valid_ptr, row_numel, flag_ptr,
                    HAS_VALID: tl.constexpr, HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr, HIST: tl.constexpr):
    # Few registers per element (occupancy is what keeps loads in flight): the max position is kept as
    # the iteration index, the six non-finite counters are packed in pairs (16-bit fields; a lane sees
    # < 65536 tiles), the compared count is derived at the end, and the next tile is loaded before the
    # current one is reduced (software prefetch).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = n_static.to(tl.int64)
    if HAS_VALID:
        n = tl.minimum(tl.load(valid_ptr).to(tl.int64) * row_numel, n)
    if HAS_FLAG:
        n = tl.where(tl.load(flag_ptr) != 0, n, 0)
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_it = tl.zeros([BLOCK], tl.int32)
    s_abs = tl.zeros([BLOCK], tl.float32)
    s_d2 = tl.zeros([BLOCK], tl.float32)
    s_b2 = tl.zeros([BLOCK], tl.float32)
    s_c2 = tl.zeros([BLOCK], tl.float32)
    m_rel = tl.zeros([BLOCK], tl.float32)
    m_b = tl.zeros([BLOCK], tl.float32)
    nf_b = tl.zeros([BLOCK], tl.int32)  # NaN + 65536 * Inf in the baseline
    nf_c = tl.zeros([BLOCK], tl.int32)  # same for the candidate
    mis = tl.zeros([BLOCK], tl.int32)  # candidate-only + 65536 * baseline-only non-finite positions
    hist = tl.zeros([HB], tl.int32)
    start = pid.to(tl.int64) * BLOCK
    step = nprog.to(tl.int64) * BLOCK
    offs = start + lane
    m_nx = offs < n
    c_nx = tl.load(c_ptr + offs, mask=m_nx, other=0.0)
    b_nx = tl.load(b_ptr + offs, mask=m_nx, other=0.0)
    it = 0
    while start < n:
        c = c_nx.to(tl.float32)
        b = b_nx.to(tl.float32)
        m = m_nx
        start += step
        offs = start + lane
        m_nx = offs < n
        c_nx = tl.load(c_ptr + offs, mask=m_nx, other=0.0)
        b_nx = tl.load(b_ptr + offs, mask=m_nx, other=0.0)
        ac = tl.abs(c)
        ab = tl.abs(b)
        fc = ac < float("inf")  # False for NaN and Inf
        fb = ab < float("inf")
        cmp = fc & fb & m
        d = tl.where(cmp, tl.abs(c - b), 0.0)
        bz = tl.where(cmp, b, 0.0)
        cz = tl.where(cmp, c, 0.0)
        dm = tl.where(cmp, d, -1.0)
        better = dm > best
        best = tl.where(better, dm, best)
        best_it = tl.where(better, it, best_it)
        s_abs += d
        s_d2 += d * d
        s_b2 += bz * bz
        s_c2 += cz * cz
        m_rel = tl.maximum(m_rel, d / tl.maximum(ab, TINY))
        m_b = tl.maximum(m_b, tl.where(fb & m, ab, 0.0))
        nf_b += tl.where(m & (b != b), 1, 0) + tl.where(m & (ab == float("inf")), 65536, 0)
        nf_c += tl.where(m & (c != c), 1, 0) + tl.where(m & (ac == float("inf")), 65536, 0)
        mis += tl.where(m & fb & (~fc), 1, 0) + tl.where(m & fc & (~fb), 65536, 0)
        if HIST:
            bits = d.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - 127
            bn = tl.minimum(tl.maximum(e, HIST_EXP_MIN), HIST_EXP_MAX) + (1 - HIST_EXP_MIN)
            bn = tl.where(d == 0.0, 0, bn)
            bn = tl.where(cmp, bn, HIST_BINS - 1)
            bn = tl.where(m, bn, HB - 1)
            hist += tl.histogram(bn, HB)
        it += 1
    top = tl.max(best, axis=0)
    best_i = pid.to(tl.int64) * BLOCK + best_it.to(tl.int64) * step + lane
    pos = tl.min(tl.where(best == top, best_i, 9223372036854775807), axis=0)
    nan_c = tl.sum((nf_c & 0xFFFF).to(tl.float64), axis=0)
    inf_c = tl.sum((nf_c >> 16).to(tl.float64), axis=0)
    b_only = tl.sum((mis >> 16).to(tl.float64), axis=0)
    row = part_ptr + pid.to(tl.int64) * 64
    tl.store(row + R_MAX_ABS, top.to(tl.float64))
    tl.store(row + R_MAX_POS, tl.where(top >= 0, pos, -1).to(tl.float64))
    tl.store(row + R_SUM_ABS, tl.sum(s_abs.to(tl.float64), axis=0))
    tl.store(row + R_MAX_REL, tl.max(m_rel, axis=0).to(tl.float64))
    tl.store(row + R_SUM_D2, tl.sum(s_d2.to(tl.float64), axis=0))
    tl.store(row + R_SUM_B2, tl.sum(s_b2.to(tl.float64), axis=0))
    tl.store(row + R_SUM_C2, tl.sum(s_c2.to(tl.float64), axis=0))
    tl.store(row + R_OUT_SCALE, tl.max(m_b, axis=0).to(tl.float64))
    tl.store(row + R_NAN_B, tl.sum((nf_b & 0xFFFF).to(tl.float64), axis=0))
    tl.store(row + R_INF_B, tl.sum((nf_b >> 16).to(tl.float64), axis=0))
    tl.store(row + R_NAN_C, nan_c)
    tl.store(row + R_INF_C, inf_c)
    tl.store(row + R_CAND_NF, tl.sum((mis & 0xFFFF).to(tl.float64), axis=0))
    tl.store(row + R_BASE_NF, b_only)
    # compared = all real positions minus those non-finite on either side
    # (every tile of this program but the last is full)
    last = pid.to(tl.int64) * BLOCK + (it - 1) * step
    mine = tl.where(it > 0, (it - 1) * BLOCK + tl.minimum(n - last, BLOCK), 0)
    tl.store(row + R_N_CMP, mine.to(tl.float64) - b_only - nan_c - inf_c)
    tl.store(row + R_NUMEL, n.to(tl.float64))
    hb = tl.arange(0, HB)
    tl.store(row + R_HIST + hb, hist.to(tl.float64), mask=hb < HIST_BINS)


@triton.jit(do_not_specialize=["nprog", "ring_size", "rec_size", "site_id"])
def _final_kernel(part_ptr, nprog, rec_ptr, seq_ptr, ring_size, rec_size, sstate_ptr, dstate_ptr,
                  hard_scaled, hard_rel_l2_sq, site_id, PUBLISH: tl.constexpr, FENCE: tl.constexpr,
                  NMETA: tl.constexpr):
    # sstate: [do_stats, use_cand, -, mode, step, call, t0, t1, t2, batch, draft, prefix, publish]
    # dstate: [step, call, seq, fallback]
    go = tl.load(sstate_ptr) != 0
    if go:
        # partials in chunks of 32 rows: vector sums / maxima over all 64 columns at once
        col = tl.arange(0, 64)
        sums = tl.zeros([64], tl.float64)
        maxs = tl.full([64], -1.0, tl.float64)
        top = tl.full([], -1.0, tl.float64)
        pos = tl.full([], 9.0e18, tl.float64)
        for p0 in range(0, nprog, 32):
            p = p0 + tl.arange(0, 32)
            pm = p < nprog
            tile = tl.load(part_ptr + p.to(tl.int64)[:, None] * 64 + col[None, :], mask=pm[:, None], other=0.0)
            sums += tl.sum(tile, axis=0)
            maxs = tl.maximum(maxs, tl.max(tl.where(pm[:, None], tile, -1.0), axis=0))
            mx = tl.where(pm, tl.sum(tl.where(col[None, :] == R_MAX_ABS, tile, 0.0), axis=1), -1.0)
            ps = tl.sum(tl.where(col[None, :] == R_MAX_POS, tile, 0.0), axis=1)
            ctop = tl.max(mx, axis=0)
            cpos = tl.min(tl.where((mx == ctop) & (ps >= 0) & pm, ps, 9.0e18), axis=0)
            pos = tl.where(ctop > top, cpos, tl.where(ctop == top, tl.minimum(pos, cpos), pos))
            top = tl.maximum(top, ctop)
        is_max = (col == R_MAX_ABS) | (col == R_MAX_REL) | (col == R_OUT_SCALE) | (col == R_NUMEL)
        red = tl.where(is_max, maxs, sums)
        pos = tl.where(top >= 0, pos, -1.0)
        red = tl.where(col == R_MAX_POS, pos, red)
        red = tl.where(col == R_MAX_ABS, tl.maximum(top, 0.0), red)
        sd2 = tl.sum(tl.where(col == R_SUM_D2, red, 0.0), axis=0)
        sb2 = tl.sum(tl.where(col == R_SUM_B2, red, 0.0), axis=0)
        cnf = tl.sum(tl.where(col == R_CAND_NF, red, 0.0), axis=0)
        scale = tl.sum(tl.where(col == R_OUT_SCALE, red, 0.0), axis=0)
        hard = (cnf > 0) | (top > hard_scaled * tl.maximum(scale, TINY)) | (sd2 > hard_rel_l2_sq * sb2)
        use_cand = tl.load(sstate_ptr + 1) != 0
        fb_old = tl.load(dstate_ptr + 3)
        if use_cand & hard:
            tl.store(dstate_ptr + 3, 1)
        # a record is published on sampled / spot-checked calls, and always for a hard failure that
        # the on-mode check caught; the ring position is taken here, in stream order
        pub = (tl.load(sstate_ptr + 12) != 0) | (use_cand & hard)
        if pub:
            seq = tl.load(dstate_ptr + 2)
            tl.store(dstate_ptr + 2, seq + 1)
            slot = seq % ring_size
            rec = rec_ptr + slot * rec_size
            raw = rec + NMETA
            tl.store(raw + col, red, mask=col < NRAW)
            flags = (use_cand.to(tl.int64) + 2 * hard.to(tl.int64)
                     + 4 * ((fb_old != 0) | (use_cand & hard)).to(tl.int64))
            tl.store(rec + 1, tl.load(sstate_ptr + 5).to(tl.float64))  # call
            tl.store(rec + 2, tl.load(sstate_ptr + 4).to(tl.float64))  # step
            tl.store(rec + 3, tl.load(sstate_ptr + 3).to(tl.float64))  # mode
            tl.store(rec + 4, flags.to(tl.float64))
            t0 = tl.load(sstate_ptr + 6)
            t1 = tl.load(sstate_ptr + 7)
            t2 = tl.load(sstate_ptr + 8)
            tl.store(rec + 5, (t1 - t0).to(tl.float64))  # baseline ns
            tl.store(rec + 6, (t2 - t1).to(tl.float64))  # candidate ns
            for j in tl.static_range(3):  # batch size, draft tokens, prefix length (set by the control kernel)
                tl.store(rec + 7 + j, tl.load(sstate_ptr + 9 + j).to(tl.float64))
            tl.store(rec + 10, site_id.to(tl.float64))
            tl.store(rec, seq.to(tl.float64))
            if PUBLISH:
                # every record store above happens-before the sequence number: CTA barrier, then a
                # system-scope fence whose output the store depends on (no host atomics needed)
                tl.debug_barrier()
                if FENCE:
                    pub_seq = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [seq + 1],
                                                        dtype=tl.int64, is_pure=False, pack=1)
                    tl.store(seq_ptr + slot, pub_seq)
                else:  # the CPU interpreter (tests) has no inline assembly
                    tl.store(seq_ptr + slot, seq + 1)


@triton.jit(do_not_specialize=["first_layer", "max_t", "max_l", "host_decides", "host_do_stats",
                               "host_use_cand", "host_step", "bs", "t", "plen"])
def _control_kernel(hctrl_ptr, dstate_ptr, sstate_ptr, meta_ptr, first_layer, max_t, max_l,
                    host_decides, host_do_stats, host_use_cand, host_step, bs, t, plen, HAS_META: tl.constexpr,
                    USE_TIMER: tl.constexpr):
    # hctrl (pinned host, written by Python at any time): [mode, sample_n, spot_n, disabled, fallback]
    mode = tl.load(hctrl_ptr, volatile=True)
    sample_n = tl.maximum(tl.load(hctrl_ptr + 1, volatile=True), 1)
    spot_n = tl.maximum(tl.load(hctrl_ptr + 2, volatile=True), 1)
    disabled = tl.load(hctrl_ptr + 3, volatile=True) != 0
    fallback = (tl.load(hctrl_ptr + 4, volatile=True) != 0) | (tl.load(dstate_ptr + 3) != 0)
    step = tl.load(dstate_ptr) + first_layer
    if host_decides != 0:  # eager: the host's step counter is the truth (replays continue from it)
        step = host_step.to(tl.int64)
    tl.store(dstate_ptr, step)
    call = tl.load(dstate_ptr + 1) + 1
    tl.store(dstate_ptr + 1, call)
    if HAS_META:
        bs_v = tl.load(meta_ptr).to(tl.int64)
        t_v = tl.load(meta_ptr + 1).to(tl.int64)
        l_v = tl.load(meta_ptr + 2).to(tl.int64)
    else:
        bs_v = bs.to(tl.int64)
        t_v = t.to(tl.int64)
        l_v = plen.to(tl.int64)
    tl.store(sstate_ptr + 9, bs_v)
    tl.store(sstate_ptr + 10, t_v)
    tl.store(sstate_ptr + 11, l_v)
    covered = (t_v <= max_t) & (l_v <= max_l)
    ok = (~disabled) & (~fallback)
    use_cand = (mode == 2) & ok & covered
    sampled = (step % sample_n) == 0
    spot = (step % spot_n) == 0
    publish = ok & (((mode == 1) & sampled) | ((mode == 2) & covered & spot) | ((mode == 2) & (~covered) & sampled))
    # under a graph both implementations run on every replay anyway, so every on-mode call is checked
    # before its output is chosen: a candidate failing between spot checks never reaches the caller
    do_stats = publish | use_cand
    if host_decides != 0:
        do_stats = host_do_stats != 0
        publish = do_stats
        use_cand = host_use_cand != 0
    tl.store(sstate_ptr, do_stats.to(tl.int64))
    tl.store(sstate_ptr + 1, use_cand.to(tl.int64))
    tl.store(sstate_ptr + 12, publish.to(tl.int64))
    tl.store(sstate_ptr + 3, mode)
    tl.store(sstate_ptr + 4, step)
    tl.store(sstate_ptr + 5, call)
    if USE_TIMER:
        tl.store(sstate_ptr + 6, tl.extra.cuda.globaltimer().to(tl.int64))


@triton.jit(do_not_specialize=["idx"])
def _stamp_kernel(sstate_ptr, idx, USE_TIMER: tl.constexpr):
    if USE_TIMER:
        tl.store(sstate_ptr + idx, tl.extra.cuda.globaltimer().to(tl.int64))


@triton.jit(do_not_specialize=["n"])
def _select_kernel(out_ptr, c_ptr, b_ptr, n, sstate_ptr, dstate_ptr, BLOCK: tl.constexpr):
    use = (tl.load(sstate_ptr + 1) != 0) & (tl.load(dstate_ptr + 3) == 0)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(c_ptr + offs, mask=m) if use else tl.load(b_ptr + offs, mask=m)
    tl.store(out_ptr + offs, v, mask=m)


partial_kernel = _partial_kernel
final_kernel = _final_kernel
control_kernel = _control_kernel
stamp_kernel = _stamp_kernel
select_kernel = _select_kernel

# mypy: allow-untyped-defs
"""The per-call-site accumulator row of the statistics kernel and the work of its last program.

Every program of ``shadowd.hook.triton_stats``' kernel folds its partials into the row with atomics
(layout below) and takes a ticket; the program drawing the last one calls :func:`finish_record`, which
turns the row into the raw vector of ``shadowd.hook.diffstats``, resets the row for the next call, runs
the on-mode hard-failure check (sticky device fallback flag; the candidate's error flag, when the site has one,
is a hard failure) and writes the call's record into a ring slot, publishing its sequence number last.
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
from shadowd.wire import HIST_BINS

__all__ = ["ACC", "ACC_WORDS", "A_HIST", "A_KEY", "A_NAN_B", "A_REL", "A_TICKET", "F_ABS", "F_B2", "F_C2", "F_D2",
           "POS_MASK", "finish_record", "record_inputs"]

#: accumulator row (int64 words; the fp64 sums live in the 8 words after it, see ``ACC_WORDS``)
ACC = 64
A_KEY, A_REL, A_OUTS, A_NAN_B, A_INF_B, A_NAN_C, A_INF_C, A_CNF, A_BNF, A_TICKET = range(10)
A_HIST = 16  # histogram bins 0..HIST_BINS-1
F_ABS, F_D2, F_B2, F_C2 = range(4)  # fp64 sums
#: words of one call site's accumulator buffer: ACC int64 words, then 8 fp64 words
ACC_WORDS = ACC + 8
POS_MASK = 2**32 - 1  # positions are kept in the key's low 32 bits (an output of < 2^32 elements)
assert A_HIST + HIST_BINS <= ACC and NRAW <= 64 and HIST_BINS < 64

# kernels may only read constexpr globals: rebind every constant they use
(A_KEY, A_REL, A_OUTS, A_NAN_B, A_INF_B, A_NAN_C, A_INF_C, A_CNF, A_BNF, A_TICKET, A_HIST, F_ABS, F_D2, F_B2,
 F_C2, POS_MASK) = (tl.constexpr(v) for v in (A_KEY, A_REL, A_OUTS, A_NAN_B, A_INF_B, A_NAN_C, A_INF_C, A_CNF,
                                              A_BNF, A_TICKET, A_HIST, F_ABS, F_D2, F_B2, F_C2, POS_MASK))
ACC_C = tl.constexpr(ACC)
(R_MAX_ABS, R_MAX_POS, R_SUM_ABS, R_MAX_REL, R_SUM_D2, R_SUM_B2, R_SUM_C2, R_OUT_SCALE, R_NAN_B, R_INF_B,
 R_NAN_C, R_INF_C, R_CAND_NF, R_BASE_NF, R_NUMEL, R_N_CMP, R_HIST, NRAW, TINY, HIST_BINS) = (
    tl.constexpr(v) for v in (R_MAX_ABS, R_MAX_POS, R_SUM_ABS, R_MAX_REL, R_SUM_D2, R_SUM_B2, R_SUM_C2, R_OUT_SCALE,
                              R_NAN_B, R_INF_B, R_NAN_C, R_INF_C, R_CAND_NF, R_BASE_NF, R_NUMEL, R_N_CMP, R_HIST,
                              NRAW, TINY, HIST_BINS))


@triton.jit
def record_inputs(sstate_ptr, dstate_ptr, t_end, STAMP: tl.constexpr, flag_ptr, HAS_FLAG: tl.constexpr):
    """The words the finishing program needs besides the row, as a tuple: (use_cand, pub, seq, fb_old,
    call, step, mode, baseline ns, candidate ns, batch, draft, prefix, the candidate's error flag (0 without
    one: HAS_FLAG), on-mode replays on covered / uncovered shapes (the control kernel's counts)). Every program
    reads them before
    its ticket, so they arrive while the ticket's round trip is under way and the last program's chain
    is one read of the row. They are stable during the call: the control and stamp kernels wrote them
    before this kernel's first read, and only the last program writes ``dstate`` — after reading them.
    The candidate's end is ``t_end`` (this kernel's start) with STAMP, else the stamp kernel's sstate[8]."""
    use_cand = tl.load(sstate_ptr + 1) != 0
    pub = tl.load(sstate_ptr + 12) != 0
    seq = tl.load(dstate_ptr + 2)
    fb_old = tl.load(dstate_ptr + 3)
    t0 = tl.load(sstate_ptr + 6)
    t1 = tl.load(sstate_ptr + 7)
    t2 = t_end if STAMP else tl.load(sstate_ptr + 8)
    # the candidate's flag through L2 (its kernels OR bits in with device-scope atomics), after the wait
    kflag = ((tl.load(flag_ptr, cache_modifier=".cg").to(tl.int64) & 0xFFFFFFFF) if HAS_FLAG
             else tl.full([], 0, tl.int64))
    return (use_cand, pub, seq, fb_old, tl.load(sstate_ptr + 5), tl.load(sstate_ptr + 4), tl.load(sstate_ptr + 3),
            t1 - t0, t2 - t1, tl.load(sstate_ptr + 9), tl.load(sstate_ptr + 10), tl.load(sstate_ptr + 11), kflag,
            tl.load(dstate_ptr + 4), tl.load(dstate_ptr + 5))


@triton.jit
def finish_record(acc_ptr, accf_ptr, n, inputs, rec_ptr, seq_ptr, ring_size, rec_size, dstate_ptr,
                  hard_scaled, hard_rel_l2_sq, site_id, kind, PUBLISH: tl.constexpr, GPU: tl.constexpr,
                  NMETA: tl.constexpr):
    # The last program of a sampled call: the raw vector (layout of shadowd.hook.diffstats) from the
    # accumulator row (L2 reads: the other programs' atomics live there), which it then resets for the
    # next call (stream order makes plain stores enough); the on-mode hard-failure check (sticky device
    # fallback flag); the record into a ring slot, and the slot's sequence number last, behind a CTA
    # barrier and a system-scope fence. ``inputs``: :func:`record_inputs`; ``kind``: what the record compares
    # (``shadowd.hook.launch``'s REC_* codes: candidate vs baseline, or one side vs the oracle).
    use_cand, pub, seq, fb_old, call, step, mode, base_ns, cand_ns, batch, draft, prefix, kflag, on_cov, on_unc = inputs
    key = tl.load(acc_ptr + A_KEY, cache_modifier=".cg")
    rel = tl.load(acc_ptr + A_REL, cache_modifier=".cg").to(tl.int32).to(tl.float32, bitcast=True)
    outs = tl.load(acc_ptr + A_OUTS, cache_modifier=".cg").to(tl.int32).to(tl.float32, bitcast=True)
    nan_b = tl.load(acc_ptr + A_NAN_B, cache_modifier=".cg")
    inf_b = tl.load(acc_ptr + A_INF_B, cache_modifier=".cg")
    nan_c = tl.load(acc_ptr + A_NAN_C, cache_modifier=".cg")
    inf_c = tl.load(acc_ptr + A_INF_C, cache_modifier=".cg")
    cnf = tl.load(acc_ptr + A_CNF, cache_modifier=".cg")
    bnf = tl.load(acc_ptr + A_BNF, cache_modifier=".cg")
    s_abs = tl.load(accf_ptr + F_ABS, cache_modifier=".cg")
    sd2 = tl.load(accf_ptr + F_D2, cache_modifier=".cg")
    sb2 = tl.load(accf_ptr + F_B2, cache_modifier=".cg")
    sc2 = tl.load(accf_ptr + F_C2, cache_modifier=".cg")
    rcol = tl.arange(0, 64)
    # raw-vector column j takes histogram bin j - R_HIST (the accumulator keeps bin k at A_HIST + k)
    hist = tl.load(acc_ptr + A_HIST + (rcol - R_HIST), mask=(rcol >= R_HIST) & (rcol < NRAW), other=0,
                   cache_modifier=".cg")
    tl.debug_barrier()  # every read of the row happens before its reset
    col = tl.arange(0, ACC_C)
    tl.store(acc_ptr + col, tl.zeros([ACC_C], tl.int64))
    tl.store(accf_ptr + tl.arange(0, 8), tl.zeros([8], tl.float64))
    has = key > 0
    top = tl.where(has, (key >> 32).to(tl.int32).to(tl.float32, bitcast=True).to(tl.float64), 0.0)
    pos = tl.where(has, ((key & POS_MASK) ^ POS_MASK).to(tl.float64), -1.0)
    # compared = real positions minus those non-finite on either side
    n_cmp = n - nan_c - inf_c - bnf
    red = tl.where((rcol >= R_HIST) & (rcol < NRAW), hist.to(tl.float64), 0.0)
    red = tl.where(rcol == R_MAX_ABS, top, red)
    red = tl.where(rcol == R_MAX_POS, pos, red)
    red = tl.where(rcol == R_SUM_ABS, s_abs, red)
    red = tl.where(rcol == R_MAX_REL, rel.to(tl.float64), red)
    red = tl.where(rcol == R_SUM_D2, sd2, red)
    red = tl.where(rcol == R_SUM_B2, sb2, red)
    red = tl.where(rcol == R_SUM_C2, sc2, red)
    red = tl.where(rcol == R_OUT_SCALE, outs.to(tl.float64), red)
    red = tl.where(rcol == R_NAN_B, nan_b.to(tl.float64), red)
    red = tl.where(rcol == R_INF_B, inf_b.to(tl.float64), red)
    red = tl.where(rcol == R_NAN_C, nan_c.to(tl.float64), red)
    red = tl.where(rcol == R_INF_C, inf_c.to(tl.float64), red)
    red = tl.where(rcol == R_CAND_NF, cnf.to(tl.float64), red)
    red = tl.where(rcol == R_BASE_NF, bnf.to(tl.float64), red)
    red = tl.where(rcol == R_NUMEL, n.to(tl.float64), red)
    red = tl.where(rcol == R_N_CMP, n_cmp.to(tl.float64), red)
    hard = ((cnf > 0) | (top > hard_scaled * tl.maximum(outs.to(tl.float64), TINY)) | (sd2 > hard_rel_l2_sq * sb2)
            | (kflag != 0))
    if use_cand & hard:
        tl.store(dstate_ptr + 3, 1)
    # a record is published on sampled / spot-checked calls, and always for a hard failure that the
    # on-mode check caught; the ring position is taken here, in stream order
    if pub | (use_cand & hard):
        tl.store(dstate_ptr + 2, seq + 1)
        slot = seq % ring_size
        rec = rec_ptr + slot * rec_size
        raw = rec + NMETA
        tl.store(raw + rcol, red, mask=rcol < NRAW)
        flags = (use_cand.to(tl.int64) + 2 * hard.to(tl.int64)
                 + 4 * ((fb_old != 0) | (use_cand & hard)).to(tl.int64))
        tl.store(rec + 1, call.to(tl.float64))
        tl.store(rec + 2, step.to(tl.float64))
        tl.store(rec + 3, mode.to(tl.float64))
        tl.store(rec + 4, flags.to(tl.float64))
        tl.store(rec + 5, base_ns.to(tl.float64))
        tl.store(rec + 6, cand_ns.to(tl.float64))
        tl.store(rec + 7, batch.to(tl.float64))  # batch size, draft tokens, prefix length (control kernel)
        tl.store(rec + 8, draft.to(tl.float64))
        tl.store(rec + 9, prefix.to(tl.float64))
        tl.store(rec + 10, site_id.to(tl.float64))
        tl.store(rec + 11, kind.to(tl.float64))
        tl.store(rec + 12, kflag.to(tl.float64))
        tl.store(rec + 13, on_cov.to(tl.float64))
        tl.store(rec + 14, on_unc.to(tl.float64))
        tl.store(rec, seq.to(tl.float64))
        if PUBLISH:
            # every record store above happens-before the sequence number: CTA barrier, then a
            # system-scope fence whose output the store depends on (no host atomics needed)
            tl.debug_barrier()
            if GPU:
                pub_seq = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [seq + 1],
                                                    dtype=tl.int64, is_pure=False, pack=1)
                tl.store(seq_ptr + slot, pub_seq)
            else:  # the CPU interpreter (tests) has no inline assembly
                tl.store(seq_ptr + slot, seq + 1)

# mypy: allow-untyped-defs
"""The tiny kernels around a shadowed call on the graph path (Triton): every per-call decision in device memory.

* :func:`control_kernel` — before the call: reads the control word (mode, sampling, spot checks,
  disabled / fallback packed into one int64: :func:`pack_host_word`) and the device counters, and writes the
  call's decisions (do statistics, use the candidate, publish, run the baseline, run the candidate) into the
  site's decision words. Eagerly the host passes the word as an argument; under a graph the kernel reads the
  word's device mirror, so a call never waits for host memory (a PCIe round trip, ~5 µs per call on the
  H200: bench/results/sglang-2026-11-30.md);
* :func:`words_kernel` — the covered shapes of the promotion gate's verdict into device memory, where the control
  kernel checks every call's shape bucket against them (``shadowd.hook.coverage``);
* :func:`mirror_kernel` — the host's change reaching graphs: one 8-byte load of the pinned host word and one
  store into its device mirror, launched by the host on a stream of its own whenever the word changes (a
  kill switch, a disabled candidate, a fall-back), so replays see it within microseconds, the serving stream
  never waits for it, and a 64-bit store never shows a half-updated word;
* :func:`gate_kernel` — copies of up to four small int tensors, each zeros when its side (the baseline or the
  candidate) is gated off;
* :func:`stamp_kernel` — a global-timer stamp between the implementations (device time per call);
* :func:`select_kernel` — the output served in on mode: the candidate's, unless the call's decision or
  the sticky fallback flag says the baseline's; a served candidate output holding a NaN or an Inf makes the
  layer's next call a spot check (``sstate[15]``, read by the control kernel).

On sm_90+ the hook launches them with programmatic dependent launch (``PDL``): each waits for the previous
kernel first (:func:`pdl_wait`), so only its launch overlaps that kernel's tail.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["HOST_WORD", "control_kernel", "gate_kernel", "mirror_kernel", "pack_host_word", "pdl_wait",
           "select_kernel", "stamp_kernel", "words_kernel"]

#: the host control word: bits 0-1 mode (0 off, 1 validate, 2 on), bit 2 disabled, bit 3 fallback, bits 4-33
#: validate sampling 1 in N, bits 34-61 on-mode spot check 1 in N (N clamped to the field: 2^30 − 1 and 2^28 − 1
#: steps, i.e. never in practice), bit 62 shapes: a promotion gate opened on a verdict, whose covered shape buckets
#: are in the device bitmap the control kernel then checks (one more load per call, so only then)
HOST_WORD = {"mode": (0, 2), "disabled": (2, 1), "fallback": (3, 1), "sample_n": (4, 30), "spot_n": (34, 28),
             "shapes": (62, 1)}
_SAMPLE_MAX, _SPOT_MAX = 2**30 - 1, 2**28 - 1
# kernels may only read constexpr globals
_SAMPLE_MAX_C, _SPOT_MAX_C = tl.constexpr(_SAMPLE_MAX), tl.constexpr(_SPOT_MAX)


@triton.jit
def pdl_wait():
    """Programmatic dependent launch (sm_90+; a no-op otherwise): wait for the previous kernel's writes, then let
    the next kernel launch. A small kernel launched with ``launch_pdl`` calls this before anything else, so it is
    ordered exactly as a plain launch while its own launch overlaps the previous kernel's tail."""
    tl.inline_asm_elementwise("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;",
                              "=r,r", [tl.program_id(0)], dtype=tl.int32, is_pure=False, pack=1)


def pack_host_word(mode: int, sample_n: int, spot_n: int, disabled: bool, fallback: bool,
                   shapes: bool = False) -> int:
    """The host control word (:data:`HOST_WORD`) of these settings."""
    if mode not in (0, 1, 2):
        raise ValueError(f"mode: expected 0, 1 or 2, got {mode!r}")
    sample = min(max(int(sample_n), 1), _SAMPLE_MAX)
    spot = min(max(int(spot_n), 1), _SPOT_MAX)
    return (mode | int(bool(disabled)) << 2 | int(bool(fallback)) << 3 | sample << 4 | spot << 34
            | int(bool(shapes)) << 62)


@triton.jit(do_not_specialize=["host_word", "first_layer", "max_t", "max_l", "host_decides", "host_do_stats",
                               "host_use_cand", "host_step", "bs", "t", "plen"])
def _control_kernel(dctrl_ptr, host_word, dstate_ptr, sstate_ptr, meta_ptr, flag_ptr, cov_ptr, first_layer, max_t,
                    max_l, host_decides, host_do_stats, host_use_cand, host_step, bs, t, plen, HAS_META: tl.constexpr,
                    HAS_FLAG: tl.constexpr, USE_TIMER: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl_wait()
    # the packed word of HOST_WORD: eagerly the host's (an argument), under a graph its device mirror
    # (dctrl[0], kept up to date by mirror_kernel), in one load from device memory
    if host_decides != 0:  # noqa: SIM108 - a branch on a runtime scalar: the load is skipped, not selected
        w = host_word.to(tl.int64)
    else:
        w = tl.load(dctrl_ptr, volatile=True)
    mode = w & 3
    disabled = ((w >> 2) & 1) != 0
    fallback = (((w >> 3) & 1) != 0) | (tl.load(dstate_ptr + 3) != 0)
    sample_n = tl.maximum((w >> 4) & _SAMPLE_MAX_C, 1)
    spot_n = tl.maximum((w >> 34) & _SPOT_MAX_C, 1)
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
    if ((w >> 62) & 1) != 0:  # a promotion gate opened on a verdict: its covered shape buckets only
        covered = covered & _verdict_covers(cov_ptr, bs_v, t_v, l_v)
    ok = (~disabled) & (~fallback)
    use_cand = (mode == 2) & ok & covered
    sampled = (step % sample_n) == 0
    spot = (step % spot_n) == 0
    publish = ok & (((mode == 1) & sampled) | ((mode == 2) & covered & spot) | ((mode == 2) & (~covered) & sampled))
    # a replay whose batch is all padding (a meta of 0 real requests: an idle data-parallel rank) has nothing to
    # compare: no sample
    publish = publish & (bs_v > 0)
    # on mode: a served candidate output held a NaN or an Inf (sstate[15], raised by the select kernel of an
    # earlier call whose output was served unchecked): this call is a spot check, so a candidate that makes
    # non-finite values where the baseline does not is caught now, not up to spot_n - 1 calls later (a word
    # consumed by this call, checked or not: it never carries over to a later mode)
    nonfinite = tl.load(sstate_ptr + 15)
    if nonfinite != 0:
        tl.store(sstate_ptr + 15, 0)
    publish = publish | ((mode == 2) & ok & covered & (nonfinite != 0))
    if HAS_FLAG:
        # on mode: the candidate's error word, raised by an earlier call that was no spot check (its output was
        # served unchecked), makes the device fall back now (the sticky flag the statistics kernel sets on a
        # hard failure) rather than at the next spot check, up to spot_n - 1 calls later: the baseline runs and
        # serves this call, and its record (published, with the word read by the statistics kernel) tells the host
        flagged = (mode == 2) & ok & (tl.load(flag_ptr, volatile=True) != 0)
        if flagged:
            tl.store(dstate_ptr + 3, 1)
        use_cand = use_cand & (~flagged)
        publish = publish | flagged
    # on mode's shapes, on replays (the host counts eager calls): calls on a covered shape in dstate[4], on one not
    # covered (the baseline serves it) in dstate[5]; every record carries both (shadowd.hook.triton_record)
    if (host_decides == 0) & (mode == 2) & ok & (bs_v > 0):
        if covered:
            tl.store(dstate_ptr + 4, tl.load(dstate_ptr + 4) + 1)
        else:
            tl.store(dstate_ptr + 5, tl.load(dstate_ptr + 5) + 1)
    # Under a graph, on mode: the candidate is checked against the baseline on spot-check replays only;
    # on the others the baseline's work is gated to nothing (run_base 0, read by the gate kernel when
    # the call site has a baseline gate) and, without a gate, it still runs and every call is checked
    # before its output is chosen.
    run_base = (~use_cand) | publish
    do_stats = publish if GATED else publish | use_cand
    if host_decides != 0:
        do_stats = host_do_stats != 0
        publish = do_stats
        use_cand = host_use_cand != 0
    run_base = run_base | (host_decides != 0)
    # the candidate works when its output is served or compared (eagerly: whenever the host calls it);
    # under a graph a call site with a candidate gate hands it zero work sizes on the other replays
    # (unsampled validate calls, the kill switch, a disabled or fallen-back candidate)
    run_cand = use_cand | do_stats | (host_decides != 0)
    tl.store(sstate_ptr, do_stats.to(tl.int64))
    tl.store(sstate_ptr + 1, use_cand.to(tl.int64))
    tl.store(sstate_ptr + 12, publish.to(tl.int64))
    tl.store(sstate_ptr + 13, run_base.to(tl.int64))
    tl.store(sstate_ptr + 14, run_cand.to(tl.int64))
    tl.store(sstate_ptr + 3, mode)
    tl.store(sstate_ptr + 4, step)
    tl.store(sstate_ptr + 5, call)
    if USE_TIMER:
        tl.store(sstate_ptr + 6, tl.extra.cuda.globaltimer().to(tl.int64))


@triton.jit
def _bit_length(v):
    # bit_length of an int64 0 <= v < 2^53 in scalar arithmetic: the exponent of its exact float64 (0 for 0)
    e = (v.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1022
    return tl.where(v > 0, e, 0)


@triton.jit
def _verdict_covers(cov_ptr, bs, t, plen):
    # whether the call's shape bucket is one the promotion gate's verdict covered (shadowd.hook.coverage: word
    # batch index * 32 + tree index, bit prefix index; all ones without a gate). The indices are the collector's
    # buckets: ceil(log2) of the batch and tree sizes (the bit length of size - 1), the prefix length's bit length
    b_i = tl.minimum(_bit_length(tl.maximum(bs, 1) - 1), 31)
    t_i = tl.minimum(_bit_length(tl.maximum(t, 1) - 1), 31)
    p_i = tl.minimum(_bit_length(tl.minimum(tl.maximum(plen, 0), 2**52)), 63)
    word = tl.load(cov_ptr + b_i * 32 + t_i)
    return ((word >> p_i) & 1) != 0


@triton.jit
def _words_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    # n int64 words from src (pinned host memory) to dst: the covered shapes reaching the device
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _mirror_kernel(hctrl_ptr, dctrl_ptr):
    # the pinned host word as it is when this runs (not when it was launched), in one 64-bit load and store
    tl.store(dctrl_ptr, tl.load(hctrl_ptr, volatile=True))


@triton.jit
def _gated(src_ptr, dst_ptr, n, sstate_ptr, offs, WORD: tl.constexpr):
    # dst = src when the side gated by sstate[WORD] must run this call, else zeros
    run = tl.load(sstate_ptr + WORD) != 0
    m = offs < n
    v = tl.load(src_ptr + offs, mask=m, other=0)
    tl.store(dst_ptr + offs, tl.where(run, v, 0), mask=m)


@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3"])
def _gate_kernel(src0_ptr, dst0_ptr, n0, src1_ptr, dst1_ptr, n1, src2_ptr, dst2_ptr, n2, src3_ptr, dst3_ptr, n3,
                 sstate_ptr, WORD0: tl.constexpr, WORD1: tl.constexpr, WORD2: tl.constexpr, WORD3: tl.constexpr,
                 COUNT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # up to four small int tensors in one launch (COUNT of them), tensor i gated by sstate[WORDi] (13: the
    # baseline, 14: the candidate): an on-mode call's baseline and candidate work sizes in one node
    if PDL:
        pdl_wait()
    offs = tl.arange(0, BLOCK)
    _gated(src0_ptr, dst0_ptr, n0, sstate_ptr, offs, WORD0)
    if COUNT > 1:
        _gated(src1_ptr, dst1_ptr, n1, sstate_ptr, offs, WORD1)
    if COUNT > 2:
        _gated(src2_ptr, dst2_ptr, n2, sstate_ptr, offs, WORD2)
    if COUNT > 3:
        _gated(src3_ptr, dst3_ptr, n3, sstate_ptr, offs, WORD3)


@triton.jit(do_not_specialize=["idx"])
def _stamp_kernel(sstate_ptr, idx, USE_TIMER: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl_wait()
    if USE_TIMER:
        tl.store(sstate_ptr + idx, tl.extra.cuda.globaltimer().to(tl.int64))


@triton.jit(do_not_specialize=["n", "row_numel", "limit"])
def _select_kernel(out_ptr, c_ptr, b_ptr, n, sstate_ptr, dstate_ptr, valid_ptr, row_numel, limit,
                   HAS_VALID: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl_wait()
    use = (tl.load(sstate_ptr + 1) != 0) & (tl.load(dstate_ptr + 3) == 0)
    # a checked call's output was compared before this kernel: a NaN / Inf it serves is one the baseline has too
    unchecked = tl.load(sstate_ptr) == 0
    # the real rows' elements (padded rows of a graph batch hold whatever): an int count of them, or read from
    # device memory beside the decision words (one round trip for all three)
    real_n = tl.load(valid_ptr).to(tl.int64) * row_numel if HAS_VALID else limit
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    if use:
        v = tl.load(c_ptr + offs, mask=m)
        f = v.to(tl.float32)
        real = offs < real_n
        # x - x is NaN exactly where x is NaN or ±Inf: an unchecked candidate output holds a non-finite value in a
        # real row, so the layer's next call is a spot check (the control kernel reads and clears sstate[15])
        # (every lane that holds one stores the same 1: no reduction, no barrier, nothing stored in the common case)
        if unchecked:
            tl.store(sstate_ptr + 15 + offs * 0, tl.full([BLOCK], 1, tl.int64), mask=((f - f) != 0.0) & real)
    else:
        v = tl.load(b_ptr + offs, mask=m)
    tl.store(out_ptr + offs, v, mask=m)


control_kernel = _control_kernel
mirror_kernel = _mirror_kernel
gate_kernel = _gate_kernel
stamp_kernel = _stamp_kernel
select_kernel = _select_kernel
words_kernel = _words_kernel

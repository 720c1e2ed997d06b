# mypy: allow-untyped-defs
"""The log2 histogram of |diff| inside the fused statistics pass: four ways to count, one contract.

A bin index per element comes from :func:`bins` (0 for exact zero, then floor(log2|d|) clipped,
``HIST_BINS - 1`` for positions not compared, ``HB - 1`` for lanes past the real elements, which are
dropped). A pass calls ``hist_init`` once, ``hist_add`` per [ROWS, VEC] tile and ``hist_final`` once,
which returns the program's counts as int32 [HB] (bins >= HIST_BINS are zero).

``HIST`` selects how:

* 1 — ``tl.histogram`` of each tile (portable; the CPU interpreter's path; ~2.8 warp instructions per
  element on the H200).
* 2 — warp ballots in inline PTX: six bit-plane ballots per element slot, each lane counting the two bins
  it owns over the warp's 32 elements (~1.5 warp instructions per element).
* 3 — per-thread columns in shared memory: every thread owns one column ``word = bin * THREADS + tid`` of
  a static ``.shared`` array declared by inline PTX, counts with ``red.shared.add`` (fire and forget, no
  read-modify-write chain in the thread) and never touches another thread's column until the final
  read-back, which follows a CTA barrier. Word addresses of one warp's lanes differ by the lane, so the
  32 lanes always hit 32 different banks: conflict-free whatever the distribution of |d|. Seven SASS
  instructions per element on the fast path (the abs, three clamps, the address, the count; sm_90). The
  array is 4 · HIST_BINS · THREADS bytes of static shared memory (40 KiB at 8 warps), so this mode is
  compiled for 1, 2, 4 and 8 warps only (``COLS_WARPS``).
* 4 — rows of |d|'s exponent in shared memory, one word per lane: on the fast path an element's word is
  ``row = biased exponent of |d| · 2^32`` (zero stays in row 0; a subnormal |d| becomes normal, so only an exact
  zero lands there), ``word = row · 32 + lane``, so the bin costs a multiply, a mask and a shift-add instead of
  clamps: four SASS instructions per element with the count. Rows 1–127 (bin 1, |d| < 2^-31) and 164–254 (bin
  38, |d| ≥ 64) are folded into two extra rows after the pass; the other bins are one row each. The warps of a
  program share the rows (the 32 lanes of one instruction still hit 32 banks), so the array is 33 KiB at any
  warp count: four programs of it would not fit one sm_120 SM, so the small tile keeps mode 3.

Two more schemes were measured and dropped (bench/results/hook-2026-11-30.md, runs B–C): the same columns
counted by plain load / add / store (58–60 % of copy bandwidth against 73–76 %), and one row per warp
with ``match.any`` leaders (47–51 %).
"""

from __future__ import annotations

import triton
import triton.language as tl

from shadowd.wire import HIST_BINS, HIST_EXP_MAX, HIST_EXP_MIN

__all__ = ["COLS_WARPS", "HB", "bins", "hist_add", "hist_add_fast", "hist_declare", "hist_final", "hist_init"]

#: warps per program for which the shared-memory columns (mode 3) fit the 48 KiB of static shared memory
COLS_WARPS = (1, 2, 4, 8)
HB = tl.constexpr(64)  # bins per program histogram (power of two); bin HB-1 collects masked lanes
HIST_BINS_C, HIST_EXP_MIN_C, HIST_EXP_MAX_C = (tl.constexpr(v) for v in (HIST_BINS, HIST_EXP_MIN, HIST_EXP_MAX))

# ---- mode 2: warp ballots ------------------------------------------------------------------------

_ELEM = """
and.b32 t, {x}, 1; setp.ne.b32 p, t, 0; vote.sync.ballot.b32 q0, p, 0xffffffff;
and.b32 t, {x}, 2; setp.ne.b32 p, t, 0; vote.sync.ballot.b32 q1, p, 0xffffffff;
and.b32 t, {x}, 4; setp.ne.b32 p, t, 0; vote.sync.ballot.b32 q2, p, 0xffffffff;
and.b32 t, {x}, 8; setp.ne.b32 p, t, 0; vote.sync.ballot.b32 q3, p, 0xffffffff;
and.b32 t, {x}, 16; setp.ne.b32 p, t, 0; vote.sync.ballot.b32 q4, p, 0xffffffff;
and.b32 t, {x}, 32; setp.ne.b32 p, t, 0; vote.sync.ballot.b32 q5, p, 0xffffffff;
xor.b32 q1, q1, m1; xor.b32 q2, q2, m2; xor.b32 q3, q3, m3; xor.b32 q4, q4, m4; xor.b32 q5, q5, m5;
or.b32 t, q1, q2; or.b32 t, t, q3; or.b32 t, t, q4; or.b32 t, t, q5; not.b32 t, t;
and.b32 u, t, q0; popc.b32 u, u; not.b32 q0, q0; and.b32 v, t, q0; popc.b32 v, v;
shl.b32 u, u, 16; or.b32 {y}, v, u;
"""
#: Warp-level histogram of 6-bit bin indices, four elements per call: bit-plane ballots, then each lane
#: counts the two bins it owns (2·lane and 2·lane + 1) over the warp's 32 elements; returned packed as
#: count(2·lane) + 65536 · count(2·lane + 1). Every lane of the warp must execute it (uniform code).
BALLOT_ASM = tl.constexpr(
    "{\n.reg .pred p;\n.reg .b32 l, m1, m2, m3, m4, m5, q0, q1, q2, q3, q4, q5, t, u, v;\n"
    "mov.u32 l, %laneid;\n"
    "bfe.s32 m1, l, 0, 1; bfe.s32 m2, l, 1, 1; bfe.s32 m3, l, 2, 1; bfe.s32 m4, l, 3, 1; bfe.s32 m5, l, 4, 1;\n"
    + "".join(_ELEM.format(x=f"${k + 4}", y=f"${k}") for k in range(4)) + "}"
)


@triton.jit
def _ballot_counts(bn):
    # [ROWS, VEC] bins -> [ROWS, VEC] packed per-slot counts of the holding lane's two bins
    return tl.inline_asm_elementwise(BALLOT_ASM, "=r,=r,=r,=r,r,r,r,r", [bn], dtype=tl.int32,
                                     is_pure=False, pack=4)


@triton.jit
def _lane_of_rows(like):
    # the warp lane that holds each row of a [ROWS, VEC] tile: a row is one 16-byte vector, which Triton
    # keeps in one thread (the GPU tests check the histogram for bf16, fp16 and fp32 outputs)
    lid = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [like], dtype=tl.int32, is_pure=True, pack=1)
    return tl.max(lid, axis=1)


# ---- mode 3: per-thread columns in shared memory declared by inline PTX -----------------------------

def _cols_asm(nw: int) -> dict[str, str]:
    """PTX of mode 3 for ``nw`` warps (keys: decl, zero, add, addf, read); word = bin · threads + tid."""
    nt = nw * 32
    a: dict[str, str] = {}
    a["decl"] = f".shared .align 16 .b32 shd_hcols[{HIST_BINS * nt}];\n\tmov.u32 $0, 0;"
    a["zero"] = ("{\n.reg .b32 t, s;\nmov.u32 t, %tid.x;\nshl.b32 t, t, 2;\nmov.u32 s, shd_hcols;\nadd.u32 $0, t, s;\n"
                 + "".join(f"st.shared.u32 [$0+{k * nt * 4}], 0;\n" for k in range(HIST_BINS)) + "}")
    a["add"] = ("{\n.reg .pred p;\n.reg .b32 a;\n"
                f"setp.lt.u32 p, $1, {HIST_BINS};\nmad.lo.u32 a, $1, {nt * 4}, $2;\n"
                "@p red.shared.add.u32 [a], 1;\nmov.u32 $0, 0;\n}")
    # on the fast path (no masked lanes, |d| finite or the pass is redone): the bin from |d|'s bits ($1)
    # in the same statement — exponent, zero → 0, clipped to [1, HIST_BINS - 2] otherwise
    a["addf"] = ("{\n.reg .b32 e, z, a;\nshr.u32 e, $1, 23;\nmin.u32 z, $1, 1;\n"
                 f"sub.s32 e, e, {HIST_EXP_MIN + 126};\nmax.s32 e, e, z;\nmin.s32 e, e, {HIST_BINS - 2};\n"
                 f"mad.lo.u32 a, e, {nt * 4}, $2;\nred.shared.add.u32 [a], 1;\nmov.u32 $0, 0;\n}}")
    # element (k, j) of a [HB, 32] tensor: Σ over the warps w of column word k·nt + 32·w + j
    a["read"] = ("{\n.reg .pred p;\n.reg .b32 k, j, a, v;\n"
                 "shr.u32 k, $1, 5;\nand.b32 j, $1, 31;\nmov.u32 $0, 0;\n"
                 f"setp.lt.u32 p, k, {HIST_BINS};\nmad.lo.u32 a, k, {nt}, j;\nshl.b32 a, a, 2;\n"
                 "mov.u32 v, shd_hcols;\nadd.u32 a, a, v;\n"
                 + "".join(f"@p ld.shared.u32 v, [a+{128 * w}];\n@p add.u32 $0, $0, v;\n" for w in range(nw)) + "}")
    return a


#: mode 4: rows 0-255 by |d|'s exponent (scaled by 2^32), 256 and 257 the folded low and high rows, then padding
ROWS4 = 264
_FOLD_LO, _FOLD_HI = 256, 257
_ROW_LO_END, _ROW_HI_START = 127, 164  # rows 1.._ROW_LO_END: bin 1; rows _ROW_HI_START..254: bin HIST_BINS - 2


def _rows_asm(nw: int) -> dict[str, str]:
    """PTX of mode 4 for ``nw`` warps (keys: decl, zero, addf, add, fold, read); word = row · 32 + lane."""
    nt = nw * 32
    chunks = ROWS4 * 8  # 16-byte chunks of the array
    a: dict[str, str] = {}
    a["decl"] = f".shared .align 16 .b32 shd_hrows[{ROWS4 * 32}];\n\tmov.u32 $0, 0;"
    z = ["{\n.reg .pred p;\n.reg .b32 t, s, c;\nmov.u32 t, %tid.x;\nmov.u32 s, shd_hrows;\nshl.b32 c, t, 4;\n"
         "add.u32 c, c, s;\n"]
    for k in range(-(-chunks // nt)):
        if (k + 1) * nt <= chunks:
            z.append(f"st.shared.v4.u32 [c+{k * nt * 16}], {{0, 0, 0, 0}};\n")
        else:
            z.append(f"setp.lt.u32 p, t, {chunks - k * nt};\n@p st.shared.v4.u32 [c+{k * nt * 16}], {{0, 0, 0, 0}};\n")
    # this thread's lane word of row 0
    z.append("and.b32 t, t, 31;\nshl.b32 t, t, 2;\nadd.u32 $0, s, t;\n}")
    a["zero"] = "".join(z)
    # fast path: $1 = the bits of |d| (finite, < 2^64: else the pass is redone), $2 = the lane's row-0 word
    a["addf"] = ("{\n.reg .f32 f;\n.reg .b32 y, w;\nmov.b32 f, $1;\nmul.f32 f, f, 0f4F800000;\nmov.b32 y, f;\n"
                 "and.b32 y, y, 0x7F800000;\nshr.u32 y, y, 16;\nadd.u32 w, y, $2;\n"
                 "red.shared.add.u32 [w], 1;\nmov.u32 $0, 0;\n}")
    # a known bin $1 (0 .. HIST_BINS - 1; larger: dropped) into a row of that bin
    a["add"] = ("{\n.reg .pred p, q;\n.reg .b32 r, w;\n"
                f"setp.lt.u32 p, $1, {HIST_BINS};\nadd.u32 r, $1, {_ROW_HI_START - (HIST_BINS - 2)};\n"
                "setp.eq.u32 q, $1, 0;\nselp.b32 r, 0, r, q;\n"
                f"setp.eq.u32 q, $1, {HIST_BINS - 1};\nselp.b32 r, 255, r, q;\n"
                "shl.b32 r, r, 7;\nadd.u32 w, r, $2;\n@p red.shared.add.u32 [w], 1;\nmov.u32 $0, 0;\n}")
    # fold rows 1.._ROW_LO_END into row _FOLD_LO and _ROW_HI_START..254 into _FOLD_HI: thread t takes the 16-byte
    # chunk t % 8 (lanes 4q .. 4q + 3) of every (nt / 8)-th row, from row 1 + t / 8 (resp. _ROW_HI_START + t / 8)
    ph = nt // 8
    f = ["{\n.reg .pred p;\n.reg .b32 t, q, s, b, l0, l1, l2, l3, h0, h1, h2, h3, v0, v1, v2, v3;\n",
         "mov.u32 t, %tid.x;\nand.b32 q, t, 7;\nshr.u32 t, t, 3;\nmov.u32 s, shd_hrows;\nshl.b32 q, q, 4;\n"
         "add.u32 s, s, q;\nshl.b32 b, t, 7;\nadd.u32 b, b, s;\n",
         "mov.u32 l0, 0; mov.u32 l1, 0; mov.u32 l2, 0; mov.u32 l3, 0;\n",
         "mov.u32 h0, 0; mov.u32 h1, 0; mov.u32 h2, 0; mov.u32 h3, 0;\n"]
    for name, first, last in (("l", 1, _ROW_LO_END), ("h", _ROW_HI_START, 254)):
        for i in range(-(-(last - first + 1) // ph)):
            r0 = first + i * ph  # this thread's row: r0 + tid / 8
            pred = ""
            if r0 + ph - 1 > last:
                f.append(f"setp.le.u32 p, t, {last - r0};\n")
                pred = "@p "
            f.append(f"{pred}ld.shared.v4.u32 {{v0, v1, v2, v3}}, [b+{r0 * 128}];\n")
            f.append("".join(f"{pred}add.u32 {name}{e}, {name}{e}, v{e};\n" for e in range(4)))
    for name, row in (("l", _FOLD_LO), ("h", _FOLD_HI)):
        f.append("".join(f"red.shared.add.u32 [s+{row * 128 + 4 * e}], {name}{e};\n" for e in range(4)))
    f.append("mov.u32 $0, 0;\n}")
    a["fold"] = "".join(f)
    # element (k, j) of a [HB, 32] tensor: lane j's count of bin k (its one row, or a folded row)
    a["read"] = ("{\n.reg .pred p, q;\n.reg .b32 k, j, r, v;\n"
                 "shr.u32 k, $1, 5;\nand.b32 j, $1, 31;\nmov.u32 $0, 0;\n"
                 f"setp.lt.u32 p, k, {HIST_BINS};\nadd.u32 r, k, {_ROW_HI_START - (HIST_BINS - 2)};\n"
                 "setp.eq.u32 q, k, 0;\nselp.b32 r, 0, r, q;\n"
                 f"setp.eq.u32 q, k, 1;\nselp.b32 r, {_FOLD_LO}, r, q;\n"
                 f"setp.eq.u32 q, k, {HIST_BINS - 2};\nselp.b32 r, {_FOLD_HI}, r, q;\n"
                 f"setp.eq.u32 q, k, {HIST_BINS - 1};\nselp.b32 r, 255, r, q;\n"
                 "shl.b32 r, r, 5;\nadd.u32 r, r, j;\nshl.b32 r, r, 2;\nmov.u32 v, shd_hrows;\nadd.u32 r, r, v;\n"
                 "@p ld.shared.u32 $0, [r];\n}")
    return a


_ASM = {w: {k: tl.constexpr(v) for k, v in _cols_asm(w).items()} for w in COLS_WARPS}
_ASM4 = {w: {k: tl.constexpr(v) for k, v in _rows_asm(w).items()} for w in COLS_WARPS}
R4DECL_1, R4DECL_2, R4DECL_4, R4DECL_8 = (_ASM4[w]["decl"] for w in COLS_WARPS)
R4ZERO_1, R4ZERO_2, R4ZERO_4, R4ZERO_8 = (_ASM4[w]["zero"] for w in COLS_WARPS)
R4ADD_1, R4ADD_2, R4ADD_4, R4ADD_8 = (_ASM4[w]["add"] for w in COLS_WARPS)
R4ADDF_1, R4ADDF_2, R4ADDF_4, R4ADDF_8 = (_ASM4[w]["addf"] for w in COLS_WARPS)
R4FOLD_1, R4FOLD_2, R4FOLD_4, R4FOLD_8 = (_ASM4[w]["fold"] for w in COLS_WARPS)
R4READ_1, R4READ_2, R4READ_4, R4READ_8 = (_ASM4[w]["read"] for w in COLS_WARPS)
DECL_1, DECL_2, DECL_4, DECL_8 = (_ASM[w]["decl"] for w in COLS_WARPS)
ZERO_1, ZERO_2, ZERO_4, ZERO_8 = (_ASM[w]["zero"] for w in COLS_WARPS)
ADD_1, ADD_2, ADD_4, ADD_8 = (_ASM[w]["add"] for w in COLS_WARPS)
ADDF_1, ADDF_2, ADDF_4, ADDF_8 = (_ASM[w]["addf"] for w in COLS_WARPS)
READ_1, READ_2, READ_4, READ_8 = (_ASM[w]["read"] for w in COLS_WARPS)


@triton.jit
def _asm0(A1, A2, A4, A8, NW: tl.constexpr):
    # a zero-operand statement (one instance per thread) for NW warps; returns an int32 scalar
    if NW == 1:
        r = tl.inline_asm_elementwise(A1, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    elif NW == 2:
        r = tl.inline_asm_elementwise(A2, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    elif NW == 4:
        r = tl.inline_asm_elementwise(A4, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.static_assert(NW == 8, "the shared-memory histogram is compiled for 1, 2, 4 or 8 warps")
        r = tl.inline_asm_elementwise(A8, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    return r


@triton.jit
def _asm2(x, y, A1, A2, A4, A8, NW: tl.constexpr):
    # an elementwise statement over x (int32) with the scalar y, for NW warps
    if NW == 1:
        r = tl.inline_asm_elementwise(A1, "=r,r,r", [x, y], dtype=tl.int32, is_pure=False, pack=1)
    elif NW == 2:
        r = tl.inline_asm_elementwise(A2, "=r,r,r", [x, y], dtype=tl.int32, is_pure=False, pack=1)
    elif NW == 4:
        r = tl.inline_asm_elementwise(A4, "=r,r,r", [x, y], dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(A8, "=r,r,r", [x, y], dtype=tl.int32, is_pure=False, pack=1)
    return r


@triton.jit
def _cols_read(A1, A2, A4, A8, NW: tl.constexpr):
    # the program's histogram [HB]: element (k, j) of [HB, 32] by the read statement A (after a CTA
    # barrier), summed over j
    kj = tl.arange(0, HB)[:, None] * 32 + tl.arange(0, 32)[None, :]
    if NW == 1:
        part = tl.inline_asm_elementwise(A1, "=r,r", [kj], dtype=tl.int32, is_pure=False, pack=1)
    elif NW == 2:
        part = tl.inline_asm_elementwise(A2, "=r,r", [kj], dtype=tl.int32, is_pure=False, pack=1)
    elif NW == 4:
        part = tl.inline_asm_elementwise(A4, "=r,r", [kj], dtype=tl.int32, is_pure=False, pack=1)
    else:
        part = tl.inline_asm_elementwise(A8, "=r,r", [kj], dtype=tl.int32, is_pure=False, pack=1)
    return tl.sum(part, axis=1)


# ---- the contract ------------------------------------------------------------------------------

@triton.jit
def bins(d, lane, rem, cmp, TAIL: tl.constexpr, FAST: tl.constexpr):
    """log2 bin of |d| >= 0 from its exponent bits: 0 for exact zero, then floor(log2) clipped;
    HIST_BINS - 1 for positions not compared (not on the fast path: every position is), HB - 1
    (dropped) past the real elements."""
    bits = d.to(tl.int32, bitcast=True)
    e = tl.minimum(tl.maximum(bits >> 23, HIST_EXP_MIN_C + 127), HIST_EXP_MAX_C + 127) - (HIST_EXP_MIN_C + 126)
    bn = tl.where(bits == 0, 0, e)
    if not FAST:
        bn = tl.where(cmp, bn, HIST_BINS_C - 1)
    if TAIL:
        bn = tl.where(lane < rem, bn, HB - 1)
    return bn


@triton.jit
def hist_declare(HIST: tl.constexpr, NW: tl.constexpr):
    """Once at the top of the kernel: modes 3 and 4 declare their static shared array (NW warps)."""
    if HIST == 3:
        _asm0(DECL_1, DECL_2, DECL_4, DECL_8, NW)
    elif HIST == 4:
        _asm0(R4DECL_1, R4DECL_2, R4DECL_4, R4DECL_8, NW)


@triton.jit
def hist_init(ROWS: tl.constexpr, HIST: tl.constexpr, NW: tl.constexpr):
    """The running state of one pass: (ha, hb)."""
    if HIST == 3:
        tl.debug_barrier()  # a previous pass's read-back of the columns is over before they are zeroed
        ha = _asm0(ZERO_1, ZERO_2, ZERO_4, ZERO_8, NW)  # this thread's column address
        hb = ha
    elif HIST == 4:
        tl.debug_barrier()  # as mode 3; then every word is zeroed before any thread counts (a barrier)
        ha = _asm0(R4ZERO_1, R4ZERO_2, R4ZERO_4, R4ZERO_8, NW)  # this lane's word of row 0
        tl.debug_barrier()
        hb = ha
    else:
        n: tl.constexpr = ROWS if HIST == 2 else HB
        ha = tl.zeros([n], tl.int32)
        hb = tl.zeros([n], tl.int32)
    return ha, hb


@triton.jit
def hist_add(bn, ha, hb, HIST: tl.constexpr, NW: tl.constexpr):
    """Count the bins bn [ROWS, VEC] of one tile."""
    if HIST == 3:
        _asm2(bn, ha, ADD_1, ADD_2, ADD_4, ADD_8, NW)
    elif HIST == 4:
        _asm2(bn, ha, R4ADD_1, R4ADD_2, R4ADD_4, R4ADD_8, NW)
    elif HIST == 2:
        row = tl.sum(_ballot_counts(bn), axis=1)  # per field <= VEC * 32: no carry into the high field
        ha += row & 0xFFFF
        hb += row >> 16
    else:
        ha += tl.histogram(tl.reshape(bn, [bn.numel]), HB)
    return ha, hb


@triton.jit
def hist_add_fast(d, lane, rem, ha, hb, TAIL: tl.constexpr, HIST: tl.constexpr, NW: tl.constexpr):
    """Count |d| [ROWS, VEC] of one fast-path tile (every value assumed finite; ``TAIL``: lanes from
    ``rem`` on are not real). Mode 3 on full tiles computes the bins inside its PTX statement."""
    if HIST == 3 and not TAIL:
        _asm2(d.to(tl.int32, bitcast=True), ha, ADDF_1, ADDF_2, ADDF_4, ADDF_8, NW)
    elif HIST == 4 and not TAIL:
        _asm2(d.to(tl.int32, bitcast=True), ha, R4ADDF_1, R4ADDF_2, R4ADDF_4, R4ADDF_8, NW)
    else:
        ha, hb = hist_add(bins(d, lane, rem, d == d, TAIL, True), ha, hb, HIST, NW)
    return ha, hb


@triton.jit
def hist_final(ha, hb, lane2d, HIST: tl.constexpr, NW: tl.constexpr):
    """The program's histogram, int32 [HB]."""
    if HIST == 3:
        tl.debug_barrier()  # every thread's counts are in before any column is read
        out = _cols_read(READ_1, READ_2, READ_4, READ_8, NW)
    elif HIST == 4:
        tl.debug_barrier()  # every count is in before the sparse rows are folded
        _asm0(R4FOLD_1, R4FOLD_2, R4FOLD_4, R4FOLD_8, NW)
        tl.debug_barrier()  # and the folds before any row is read
        out = _cols_read(R4READ_1, R4READ_2, R4READ_4, R4READ_8, NW)
    elif HIST == 2:
        rl = _lane_of_rows(lane2d)
        lanes = tl.arange(0, 32)
        sel = rl[:, None] == lanes[None, :]
        lo = tl.sum(tl.where(sel, ha[:, None], 0), axis=0)
        hi = tl.sum(tl.where(sel, hb[:, None], 0), axis=0)
        out = tl.reshape(tl.join(lo, hi), [HB])  # bin 2·lane + j
    else:
        out = ha
    return out

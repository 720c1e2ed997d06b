// MLA tree-verify attention: the forward kernel's building blocks (tree_verify_fwd.cuh uses them) —
// fragment moves between shared memory and registers (ldmatrix, named barriers, vector ld/st), the
// KV tile's cp.async, and the S k-steps.
#pragma once
#include "tree_verify_kernel.cuh"

namespace mtv {

constexpr int QK_HALF_STEPS = D_QK / 32;  // 18 k16 steps per K half

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Barrier of the G warps (G*32 threads) of m16 row tile smi: ids 1..4 (0 = __syncthreads).  G is
// fixed per CTA, so every id always counts the same threads.
__device__ __forceinline__ void group_sync(int smi, int G) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(smi + 1), "r"(G * 32) : "memory");
}
__device__ __forceinline__ uint32_t ldg_u32(const __nv_bfloat16* p) {
  return __ldg(reinterpret_cast<const unsigned int*>(p));
}
__device__ __forceinline__ void sts_f4(uint32_t addr, const float (&v)[4]) {
  asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
               : "memory");
}
__device__ __forceinline__ float4 lds_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
}
// Issue cp.async for one BN x 576 KV tile at smem byte address buf (rows from rowptr; nullptr:
// zero-fill).  Thread -> row tid/8, 16-byte chunks (tid%8) + 8k: one row address per thread and
// constant strides, so nothing per chunk stays live across the main loop.  Each warp instruction
// copies 4 rows x 128 contiguous bytes.  The nine copies go out back to back: spreading them over the
// S-phase steps was 3-6 % slower on the H200 (bench/results/verify-2026-11-30.md).
__device__ __forceinline__ void load_kv_tile(uint32_t buf, const __nv_bfloat16* const* rowptr,
                                                const void* dummy) {
  static_assert(BN * 8 == NTHREADS && CHUNKS_PER_ROW % 8 == 0, "tile loader mapping");
  const int i = threadIdx.x >> 3, c0 = threadIdx.x & 7;
  const __nv_bfloat16* src = rowptr[i];
  const uint32_t dst = buf + (uint32_t)((i * KV_STRIDE + c0 * 8) * 2);
  const int sz = src != nullptr ? 16 : 0;
  const char* sp = src != nullptr ? reinterpret_cast<const char*>(src + c0 * 8) : reinterpret_cast<const char*>(dummy);
  const int step = src != nullptr ? 128 : 0;
#pragma unroll
  for (int k = 0; k < CHUNKS_PER_ROW / 8; ++k)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + k * 128), "l"(sp + k * step), "r"(sz));
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// NB n8 column blocks of S for this thread (block n: columns j0 + 8n + c2 and the next one, of rows tA
// (x[n][0], x[n][1]) and tB (x[n][2], x[n][3]); t = -1: no row) into the log2 domain.  Unless every column is
// visible, the columns a row may not see become -inf (a select, never a multiply).
template <int NB>
__device__ __forceinline__ void scale_mask(float (&x)[NB][4], bool all_visible, int j0, int c2, float sc,
                                           const MtvArgs& a, const Req& R, int kend, int tA, int tB) {
  if (all_visible) {
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[n][e] *= sc;
  } else {
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = j0 + n * 8 + c2 + (e & 1);
        const int tr = (e < 2) ? tA : tB;
        const bool vis = j < kend && (j < R.L || (tr >= 0 && draft_visible(a, R, tr, j - R.L)));
        x[n][e] = vis ? x[n][e] * sc : -INFINITY;
      }
  }
}
// the maxima of rows A and B over the four lanes of a quad (the lanes holding a row of an m16n8 fragment)
__device__ __forceinline__ void quad_max2(float& m0, float& m1) {
  m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
  m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
  m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
  m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
}

// NKS k16 steps of one warp's S partial (16 rows x 32 KV columns): s += Q[:, part] . K[tile, part]^T.
// (ptxas schedules the ldmatrix ahead as far as registers allow: `<4>` keeps up to six fragments in
// flight, `<2>`, at 255 registers, two, so each is used two mma after it is issued (sm_90 SASS, session 8);
// a hand-pipelined version compiled to the same schedule.)
template <int NKS>
__device__ __forceinline__ void s_steps(float (&s)[4][4], const uint32_t (&qf)[QK_HALF_STEPS][4], uint32_t kaddr) {
#pragma unroll
  for (int ks = 0; ks < NKS; ++ks) {
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t bfr[4];
      ldsm_x4(bfr, kaddr + (uint32_t)((np * 16 * KV_STRIDE + ks * 16) * 2));
      mma_bf16(s[2 * np], qf[ks], bfr[0], bfr[1]);
      mma_bf16(s[2 * np + 1], qf[ks], bfr[2], bfr[3]);
    }
  }
}

// G = 4: one warp's S partial over its K quarter for both m16 row tiles (qf[mi * 9 + ks]) and 16 KV rows (two n8
// tiles): 9 x (1 ldmatrix.x4 + 4 mma), s[mi * 2 + f] = block (row tile mi, n8 tile f).  Each K fragment feeds four
// mma (the 16-row layout: two), so a tile's K is read from shared memory once.  `two` (warp-uniform): the second
// row tile holds a live row; otherwise only the first is computed.
template <bool TWO>
__device__ __forceinline__ void s_step_rows2(float (&s)[4][4], const uint32_t (&qf)[QK_HALF_STEPS][4], uint32_t kaddr,
                                             int ks) {
  constexpr int NKS = QK_HALF_STEPS / 2;
  uint32_t bfr[4];
  ldsm_x4(bfr, kaddr + (uint32_t)(ks * 32));
  mma_bf16(s[0], qf[ks], bfr[0], bfr[1]);
  mma_bf16(s[1], qf[ks], bfr[2], bfr[3]);
  if (TWO) {
    mma_bf16(s[2], qf[NKS + ks], bfr[0], bfr[1]);
    mma_bf16(s[3], qf[NKS + ks], bfr[2], bfr[3]);
  }
}
__device__ __forceinline__ void s_steps_rows2(float (&s)[4][4], const uint32_t (&qf)[QK_HALF_STEPS][4], uint32_t kaddr,
                                              bool two) {
  if (two) {
#pragma unroll
    for (int ks = 0; ks < QK_HALF_STEPS / 2; ++ks) s_step_rows2<true>(s, qf, kaddr, ks);
  } else {
#pragma unroll
    for (int ks = 0; ks < QK_HALF_STEPS / 2; ++ks) s_step_rows2<false>(s, qf, kaddr, ks);
  }
}

}  // namespace mtv

// MLA tree-verify attention: device code shared by the sm_120 and sm_90 builds (helpers, the combine
// kernel, and the v1 forward kernel described below; the default forward kernel is v2, see
// tree_verify_kernel_v2.cuh).
//
// One CTA = (KV split, 32-row tile of one request's (draft token, head) rows, request).
// All heads share the latent KV, so a CTA multiplies up to 32 query rows (T*H rows of the
// request, row r = t*H + h) against one pass over its slice of the request's KV:
// L scattered prefix rows (kv_indices) followed by the T draft rows (k_draft).
// S = Q K^T (K = all 576 columns), online softmax in the log2 domain, O += P V (V = first
// 512 columns of the same smem tile).  bf16 mma.sync m16n8k16, fp32 accumulation.
//
// Warp roles (8 warps): S phase  warp w -> rows (w&1)*16, K-dim quarter (w>>1)*144 (Q lives
//                                 in registers, 36 regs); partial S reduced through smem.
//                       PV phase warp w -> rows (w&1)*16, V columns (w>>1)*128.
// Masking is a select (-inf), never a multiply.  Non-finite V values in draft rows are
// zeroed in smem before P V and re-injected (as NaN) only into rows that may see them.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "mla_tree_verify.h"

// The default schedule is variant 2 (tree_verify_kernel_v2.cuh: 64 query rows per CTA, measured
// 1.1-2.1x faster than v1 on the H200, bench/results/verify-2026-11-30.md); -DMTV_V1 builds the
// previous 32-row schedule for comparison.
#if !defined(MTV_V1) && !defined(MTV_V2)
#define MTV_V2
#endif

namespace mtv {

constexpr int D_QK = 576;
constexpr int D_V = 512;
constexpr int BN = 32;                  // KV rows per tile
constexpr int NWARPS = 8;
constexpr int NTHREADS = NWARPS * 32;
constexpr int MAX_SPLITS = 128;
constexpr int CHUNKS_PER_ROW = D_QK / 8;  // 16-byte chunks per 576-wide row
constexpr int KV_STRIDE = D_QK + 8;       // smem row pitch in bf16 (pad: conflict-free ldmatrix)
constexpr int KV_TILE_BYTES = BN * KV_STRIDE * 2;
constexpr int RING = 3;  // KV row-address ring: tile i's addresses are fetched at iteration i-2
constexpr int ROWPTR_BYTES = RING * BN * 8;
#ifndef MTV_V2
// v1 schedule (-DMTV_V1); the default is tree_verify_kernel_v2.cuh (BM = 64).
constexpr int BM = 32;                  // query rows per CTA
constexpr int SRED_STRIDE = BN + 8;  // float2 stores and float4 loads conflict-free
constexpr int SRED_BYTES = 4 * BM * SRED_STRIDE * 4;
constexpr int P_STRIDE = BN + 8;
constexpr int P_BYTES = BM * P_STRIDE * 2;
constexpr int STAT_BYTES = 4 * BM * 4 + 16;
constexpr int SMEM_BYTES = 2 * KV_TILE_BYTES + SRED_BYTES + P_BYTES + ROWPTR_BYTES + STAT_BYTES;
static_assert(BM == BN, "Q staging reuses a KV tile buffer");
static_assert(KV_TILE_BYTES % 128 == 0 && SRED_BYTES % 16 == 0 && P_BYTES % 16 == 0, "alignment");
#endif

enum ErrorBits : int32_t {
  ERR_KV_SLOT_RANGE = 1,   // kv_indices entry outside [0, num_slots): clamped
  ERR_Q_TILES = 2,         // a request has more rows than max_q_len * heads: rows skipped
  ERR_INDPTR = 4,          // qo/kv indptr inconsistent (negative, decreasing, out of range)
  ERR_MASK_RANGE = 8,      // custom_mask read past its end: treated as invisible
};

struct Req {
  int64_t q_start;
  int64_t kv_start;
  int64_t mask_start;
  int T;
  int L;
};

__device__ __forceinline__ int64_t ld_idx(const void* p, int is64, int64_t i) {
  return is64 ? (int64_t)__ldg(reinterpret_cast<const long long*>(p) + i)
              : (int64_t)__ldg(reinterpret_cast<const int*>(p) + i);
}

__device__ __forceinline__ void set_err(int32_t* err, int32_t bits) {
  if (err != nullptr) atomicOr(err, bits);
}

__device__ __forceinline__ Req load_req(const MtvArgs& a, int b, bool report) {
  Req r;
  int64_t q0 = ld_idx(a.qo_indptr, a.qo_is64, b), q1 = ld_idx(a.qo_indptr, a.qo_is64, b + 1);
  int64_t k0 = ld_idx(a.kv_indptr, a.kvp_is64, b), k1 = ld_idx(a.kv_indptr, a.kvp_is64, b + 1);
  bool bad = false;
  if (q0 < 0 || q1 < q0 || q1 > a.total_tokens) { bad = true; q0 = 0; q1 = 0; }
  if (k0 < 0 || k1 < k0 || k1 > a.kv_indices_len) { bad = true; k0 = 0; k1 = 0; }
  if (bad && report) set_err(a.error_flag, ERR_INDPTR);
  r.q_start = q0;
  r.T = (int)(q1 - q0);
  r.kv_start = k0;
  r.L = (int)(k1 - k0);
  r.mask_start = a.custom_mask != nullptr ? ld_idx(a.mask_indptr, a.mp_is64, b) : 0;
  return r;
}

// KV range split: every split gets a multiple of BN rows; the same function is used by the
// combine kernel so both agree on which splits hold data.
__device__ __forceinline__ int split_chunk(int total, int splits) {
  int c = (total + splits - 1) / splits;
  return (c + BN - 1) / BN * BN;
}

__device__ __forceinline__ bool draft_visible(const MtvArgs& a, const Req& rq, int t, int d) {
  if (a.custom_mask == nullptr) return d <= t;
  int64_t idx = rq.mask_start + (int64_t)t * (rq.L + rq.T) + rq.L + d;
  if (idx < 0 || idx >= a.mask_len) {
    set_err(a.error_flag, ERR_MASK_RANGE);
    return false;
  }
  return __ldg(reinterpret_cast<const unsigned char*>(a.custom_mask) + idx) != 0;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
// Barrier of the 4 warps (128 threads) sharing one 16-row group: ids 1 and 2 (0 = __syncthreads).
__device__ __forceinline__ void group_sync(int rg) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(rg + 1), "r"(128) : "memory");
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x via ex2.approx (flushes denormal results; -inf -> 0, NaN -> NaN)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ bool bf16_nonfinite(uint32_t half16) { return (half16 & 0x7F80u) == 0x7F80u; }

// KV row j of the request: prefix rows come from kv_indices (one dependent index load, issued a
// tile ahead of use: fetch_slot only starts the load, row_ptr consumes it later), draft rows from
// k_draft; nullptr past kend (zero-filled).  Out-of-range slots are clamped and flagged.
__device__ __forceinline__ int64_t fetch_slot(const MtvArgs& a, const Req& rq, int j, int kend) {
  return (j < kend && j < rq.L) ? ld_idx(a.kv_indices, a.kvi_is64, rq.kv_start + j) : 0;
}
__device__ __forceinline__ const __nv_bfloat16* row_ptr(const MtvArgs& a, const Req& rq, int j, int kend,
                                                        int64_t slot) {
  if (j >= kend) return nullptr;
  if (j < rq.L) {
    if (slot < 0 || slot >= a.num_slots) {
      set_err(a.error_flag, ERR_KV_SLOT_RANGE);
      slot = slot < 0 ? 0 : a.num_slots - 1;
    }
    return reinterpret_cast<const __nv_bfloat16*>(a.kv_buffer) + slot * a.kv_s0;
  }
  return reinterpret_cast<const __nv_bfloat16*>(a.k_draft) + (rq.q_start + (j - rq.L)) * a.kd_s0;
}

// Issue cp.async for the BN rows whose addresses are in rowptr (nullptr: zero-fill).
__device__ __forceinline__ void load_kv_tile(__nv_bfloat16* buf, const __nv_bfloat16* const* rowptr,
                                             const void* dummy) {
#pragma unroll
  for (int it = 0; it < (BN * CHUNKS_PER_ROW) / NTHREADS; ++it) {
    int idx = threadIdx.x + it * NTHREADS;
    int i = idx / CHUNKS_PER_ROW, c = idx - i * CHUNKS_PER_ROW;
    const __nv_bfloat16* src = rowptr[i];
    cp_async16(buf + i * KV_STRIDE + c * 8, src != nullptr ? src + c * 8 : dummy, src != nullptr);
  }
  static_assert((BN * CHUNKS_PER_ROW) % NTHREADS == 0, "tile chunks divide threads");
}

#ifndef MTV_V2
__global__ void __launch_bounds__(NTHREADS, 1) mtv_fwd_kernel(const MtvArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* kvbuf0 = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* kvbuf1 = kvbuf0 + BN * KV_STRIDE;
  float* sred = reinterpret_cast<float*>(smem + 2 * KV_TILE_BYTES);
  __nv_bfloat16* psm = reinterpret_cast<__nv_bfloat16*>(smem + 2 * KV_TILE_BYTES + SRED_BYTES);
  const __nv_bfloat16** rowptr_sm =
      reinterpret_cast<const __nv_bfloat16**>(smem + 2 * KV_TILE_BYTES + SRED_BYTES + P_BYTES);
  float* alpha_sm = reinterpret_cast<float*>(smem + 2 * KV_TILE_BYTES + SRED_BYTES + P_BYTES + ROWPTR_BYTES);
  float* l_sm = alpha_sm + BM;
  float* m_sm = l_sm + BM;
  uint32_t* flag_sm = reinterpret_cast<uint32_t*>(m_sm + BM);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.x, mt = blockIdx.y, b = blockIdx.z;
  const int H = a.heads;
  const bool reporter = (split == 0 && mt == 0 && tid == 0);
  const Req rq = load_req(a, b, reporter);
  const int M = rq.T * H;
  if (mt == (int)gridDim.y - 1 && split == 0 && tid == 0 && M > (int)gridDim.y * BM)
    set_err(a.error_flag, ERR_Q_TILES);
  const int row0 = mt * BM;
  if (row0 >= M) return;
  const int Ltot = rq.L + rq.T;
  const int chunk = split_chunk(Ltot, a.num_splits);
  const int kbeg = split * chunk;
  if (kbeg >= Ltot) return;
  const int kend = min(Ltot, kbeg + chunk);
  const int ntiles = (kend - kbeg + BN - 1) / BN;

  // ---- Q tile -> kvbuf1 (staging), first KV tile -> kvbuf0
  {
    const __nv_bfloat16* qp = reinterpret_cast<const __nv_bfloat16*>(a.q);
#pragma unroll
    for (int it = 0; it < (BM * CHUNKS_PER_ROW) / NTHREADS; ++it) {
      int idx = tid + it * NTHREADS;
      int i = idx / CHUNKS_PER_ROW, c = idx - i * CHUNKS_PER_ROW;
      int r = row0 + i;
      bool valid = r < M;
      const __nv_bfloat16* src = qp;
      if (valid) {
        int t = r / H, h = r - t * H;
        src = qp + (rq.q_start + t) * a.q_s0 + (int64_t)h * a.q_s1 + c * 8;
      }
      cp_async16(kvbuf1 + i * KV_STRIDE + c * 8, src, valid);
    }
  }
  // row addresses of tiles 0 and 1 -> ring; tile 2's index load stays in flight in a register
  int64_t pending = 0;
  if (tid < BN) {
    int64_t s0 = fetch_slot(a, rq, kbeg + tid, kend), s1 = fetch_slot(a, rq, kbeg + BN + tid, kend);
    pending = fetch_slot(a, rq, kbeg + 2 * BN + tid, kend);
    rowptr_sm[tid] = row_ptr(a, rq, kbeg + tid, kend, s0);
    rowptr_sm[BN + tid] = row_ptr(a, rq, kbeg + BN + tid, kend, s1);
  }
  __syncthreads();
  load_kv_tile(kvbuf0, rowptr_sm, a.kv_buffer);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  const int rg = warp & 1;   // 16-row group
  const int kq = warp >> 1;  // K-dim quarter (S phase) / V-column quarter (PV phase)
  const int g = lane >> 2, c4 = lane & 3;
  uint32_t qf[9][4];
#pragma unroll
  for (int ks = 0; ks < 9; ++ks) {
    const __nv_bfloat16* p = kvbuf1 + (rg * 16 + (lane & 15)) * KV_STRIDE + kq * 144 + ks * 16 + (lane >> 4) * 8;
    ldsm_x4(qf[ks], p);
  }
  __syncthreads();

  float o_acc[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) o_acc[n][0] = o_acc[n][1] = o_acc[n][2] = o_acc[n][3] = 0.f;

  // softmax-phase ownership: the 128 threads of row group rg own its 16 rows, 4 columns each
  const int gtid = (warp >> 1) * 32 + lane;
  const int srow = rg * 16 + (gtid >> 3), scol = (gtid & 7) * 4;
  const int s_r = row0 + srow;
  const bool s_valid = s_r < M;
  const int s_t = s_valid ? s_r / H : 0;
  float m_run = -INFINITY, l_run = 0.f;

  for (int it = 0; it < ntiles; ++it) {
    __nv_bfloat16* cur = (it & 1) ? kvbuf1 : kvbuf0;
    __nv_bfloat16* nxt = (it & 1) ? kvbuf0 : kvbuf1;
    const int j0 = kbeg + it * BN;
    if (it > 0) {
      cp_async_wait_all();
      __syncthreads();
    }
    if (it + 1 < ntiles) load_kv_tile(nxt, rowptr_sm + ((it + 1) % RING) * BN, a.kv_buffer);
    cp_async_commit();
    if (tid < BN) {  // ring slot (it+2)%3 was last read at iteration it-1, before this iteration's barrier
      rowptr_sm[((it + 2) % RING) * BN + tid] = row_ptr(a, rq, j0 + 2 * BN + tid, kend, pending);
      pending = fetch_slot(a, rq, j0 + 3 * BN + tid, kend);
    }
    if (tid == 0) flag_sm[0] = 0u;

    // ---- S partial = Q[rg rows, kq quarter] . K[tile, kq quarter]^T
    {
      // two accumulator sets (even / odd k-steps): 8 independent mma chains instead of 4
      float s_acc[4][4], s_acc2[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        s_acc[n][0] = s_acc[n][1] = s_acc[n][2] = s_acc[n][3] = 0.f;
        s_acc2[n][0] = s_acc2[n][1] = s_acc2[n][2] = s_acc2[n][3] = 0.f;
      }
#pragma unroll
      for (int ks = 0; ks < 9; ++ks) {
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bfr[4];
          const __nv_bfloat16* p = cur + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * KV_STRIDE + kq * 144 +
                                   ks * 16 + ((lane >> 3) & 1) * 8;
          ldsm_x4(bfr, p);
          if (ks & 1) {
            mma_bf16(s_acc2[2 * np], qf[ks], bfr[0], bfr[1]);
            mma_bf16(s_acc2[2 * np + 1], qf[ks], bfr[2], bfr[3]);
          } else {
            mma_bf16(s_acc[2 * np], qf[ks], bfr[0], bfr[1]);
            mma_bf16(s_acc[2 * np + 1], qf[ks], bfr[2], bfr[3]);
          }
        }
      }
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s_acc[n][e] += s_acc2[n][e];
      float* sr = sred + (kq * BM + rg * 16) * SRED_STRIDE;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        *reinterpret_cast<float2*>(sr + g * SRED_STRIDE + n * 8 + 2 * c4) = make_float2(s_acc[n][0], s_acc[n][1]);
        *reinterpret_cast<float2*>(sr + (g + 8) * SRED_STRIDE + n * 8 + 2 * c4) =
            make_float2(s_acc[n][2], s_acc[n][3]);
      }
    }
    // Tiles holding draft rows are sanitised in place below (all rows, both groups): full barrier.
    // Prefix-only tiles: the two row groups run decoupled until the next iteration's barrier.
    const bool draft_tile = j0 + BN > rq.L;
    if (draft_tile) __syncthreads(); else group_sync(rg);

    // ---- softmax (select-masking), P -> smem
    {
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float4 v = *reinterpret_cast<const float4*>(sred + (q * BM + srow) * SRED_STRIDE + scol);
        s[0] += v.x; s[1] += v.y; s[2] += v.z; s[3] += v.w;
      }
      float mx = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int j = j0 + scol + e;
        bool vis = j < kend && (j < rq.L || (s_valid && draft_visible(a, rq, s_t, j - rq.L)));
        s[e] = vis ? s[e] * a.sm_scale * 1.4426950408889634f : -INFINITY;
        mx = fmaxf(mx, s[e]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      // Lazy rescaling: keep the running max unless this tile's max exceeds it by more than 8
      // (log2 units).  p <= 2^8 is harmless in fp32 / bf16, and O and l are then rescaled only
      // when the max really moves (alpha == 1 otherwise, and the PV phase skips the rescale).
      float m_new = fmaxf(m_run, mx);
      if (!(m_new > m_run + 8.f)) m_new = m_run;
      float m_use = (m_new == -INFINITY) ? 0.f : m_new;
      float alpha = (m_new == m_run) ? 1.f : fast_exp2(m_run - m_use);
      float rs = 0.f;
      __nv_bfloat16 pb[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pe = fast_exp2(s[e] - m_use);
        pb[e] = __float2bfloat16(pe);
        rs += pe;
      }
      rs += __shfl_xor_sync(0xffffffffu, rs, 1);
      rs += __shfl_xor_sync(0xffffffffu, rs, 2);
      rs += __shfl_xor_sync(0xffffffffu, rs, 4);
      l_run = l_run * alpha + rs;
      m_run = m_new;
      __nv_bfloat162 p01 = __halves2bfloat162(pb[0], pb[1]);
      __nv_bfloat162 p23 = __halves2bfloat162(pb[2], pb[3]);
      uint2 pk;
      pk.x = *reinterpret_cast<uint32_t*>(&p01);
      pk.y = *reinterpret_cast<uint32_t*>(&p23);
      *reinterpret_cast<uint2*>(psm + srow * P_STRIDE + scol) = pk;
      if ((gtid & 7) == 0) alpha_sm[srow] = alpha;

      // Draft rows in this tile: zero non-finite V values (they are re-injected below only
      // into rows that may see them), so a masked P of 0 never meets a NaN/Inf.
      if (draft_tile) {
#pragma unroll
        for (int k = 0; k < (BN * D_V / 8) / NTHREADS; ++k) {
          int idx = tid + k * NTHREADS;
          int i = idx / (D_V / 8), c = idx - i * (D_V / 8);
          int j = j0 + i;
          if (j >= rq.L && j < kend) {
            uint4* p = reinterpret_cast<uint4*>(cur + i * KV_STRIDE + c * 8);
            uint4 v = *p;
            uint32_t w[4] = {v.x, v.y, v.z, v.w};
            bool any = false;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              uint32_t lo = w[e] & 0xFFFFu, hi = w[e] >> 16;
              if (bf16_nonfinite(lo)) { lo = 0u; any = true; }
              if (bf16_nonfinite(hi)) { hi = 0u; any = true; }
              w[e] = lo | (hi << 16);
            }
            if (any) {
              *p = make_uint4(w[0], w[1], w[2], w[3]);
              atomicOr(flag_sm, 1u << i);
            }
          }
        }
      }
    }
    if (draft_tile) __syncthreads(); else group_sync(rg);

    // ---- O[rg rows, kq*128 ..] = alpha * O + P . V
    {
      const float a0 = alpha_sm[rg * 16 + g], a1 = alpha_sm[rg * 16 + g + 8];
      if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
        for (int n = 0; n < 16; ++n) {
          o_acc[n][0] *= a0; o_acc[n][1] *= a0; o_acc[n][2] *= a1; o_acc[n][3] *= a1;
        }
      }
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        uint32_t af[4];
        ldsm_x4(af, psm + (rg * 16 + (lane & 15)) * P_STRIDE + ks * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 8; ++np) {
          uint32_t bfr[4];
          const __nv_bfloat16* p =
              cur + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * KV_STRIDE + kq * 128 + np * 16 + (lane >> 4) * 8;
          ldsm_x4_t(bfr, p);
          mma_bf16(o_acc[2 * np], af, bfr[0], bfr[1]);
          mma_bf16(o_acc[2 * np + 1], af, bfr[2], bfr[3]);
        }
      }
      const uint32_t fl = flag_sm[0];
      if (fl != 0u) {  // rare path: a draft row of this tile holds NaN/Inf in its V part
        const __nv_bfloat16* kd = reinterpret_cast<const __nv_bfloat16*>(a.k_draft);
        for (int i = 0; i < BN; ++i) {
          if (!((fl >> i) & 1u)) continue;
          const int d = j0 + i - rq.L;
          const __nv_bfloat16* vrow = kd + (rq.q_start + d) * a.kd_s0;
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            int r = row0 + rg * 16 + g + hr * 8;
            if (r >= M || !draft_visible(a, rq, r / H, d)) continue;
#pragma unroll
            for (int n = 0; n < 16; ++n) {
              int col = kq * 128 + n * 8 + 2 * c4;
              uint32_t pair = *reinterpret_cast<const uint32_t*>(vrow + col);
              if (bf16_nonfinite(pair & 0xFFFFu)) o_acc[n][hr * 2] = __int_as_float(0x7fffffff);
              if (bf16_nonfinite(pair >> 16)) o_acc[n][hr * 2 + 1] = __int_as_float(0x7fffffff);
            }
          }
        }
      }
    }
  }

  if ((gtid & 7) == 0) {
    l_sm[srow] = l_run;
    m_sm[srow] = m_run;
  }
  __syncthreads();

  // ---- epilogue
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int lr = rg * 16 + g + hr * 8;
    const int r = row0 + lr;
    if (r >= M) continue;
    const int t = r / H, h = r - t * H;
    const float l = l_sm[lr], m = m_sm[lr];
    const float inv = (l > 0.f) ? 1.f / l : (l == 0.f ? 0.f : l);
    const float lse2 = (l > 0.f) ? m + log2f(l) : (l == 0.f ? -INFINITY : l);
    const int64_t tok = rq.q_start + t;
    if (a.num_splits == 1) {
      __nv_bfloat16* op = reinterpret_cast<__nv_bfloat16*>(a.o) + tok * a.o_s0 + (int64_t)h * a.o_s1;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        int col = kq * 128 + n * 8 + 2 * c4;
        *reinterpret_cast<__nv_bfloat162*>(op + col) =
            __floats2bfloat162_rn(o_acc[n][hr * 2] * inv, o_acc[n][hr * 2 + 1] * inv);
      }
      if (a.lse != nullptr && kq == 0 && c4 == 0)
        a.lse[tok * a.lse_s0 + (int64_t)h * a.lse_s1] = lse2 * 0.6931471805599453f;
    } else {
      const int64_t R = (int64_t)a.total_tokens * H;
      const int64_t rowg = tok * H + h;
      float* wo = a.workspace + ((int64_t)split * R + rowg) * D_V;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        int col = kq * 128 + n * 8 + 2 * c4;
        *reinterpret_cast<float2*>(wo + col) = make_float2(o_acc[n][hr * 2] * inv, o_acc[n][hr * 2 + 1] * inv);
      }
      if (kq == 0 && c4 == 0) a.workspace[(int64_t)a.num_splits * R * D_V + (int64_t)split * R + rowg] = lse2;
    }
  }
}

#else
}  // namespace mtv
#include "tree_verify_kernel_v2.cuh"
namespace mtv {
#endif  // MTV_V2

// Combine the per-split partial results of one (token, head) row.  128 threads x 4 columns.
__global__ void __launch_bounds__(128) mtv_combine_kernel(const MtvArgs a) {
  __shared__ float lse_s[MAX_SPLITS];
  __shared__ int64_t sh_b;
  const int H = a.heads;
  const int64_t rowg = blockIdx.x;
  const int64_t tok = rowg / H;
  const int h = (int)(rowg - tok * H);
  if (threadIdx.x == 0) {
    // request owning this token: largest b with qo_indptr[b] <= tok
    int lo = 0, hi = a.batch;  // invariant: answer in [lo, hi)
    while (hi - lo > 1) {
      int mid = (lo + hi) >> 1;
      if (ld_idx(a.qo_indptr, a.qo_is64, mid) <= tok) lo = mid; else hi = mid;
    }
    int64_t q0 = ld_idx(a.qo_indptr, a.qo_is64, lo), q1 = ld_idx(a.qo_indptr, a.qo_is64, lo + 1);
    sh_b = (tok >= q0 && tok < q1) ? lo : -1;
  }
  __syncthreads();
  if (sh_b < 0) return;
  const Req rq = load_req(a, (int)sh_b, false);
  if (tok - rq.q_start >= rq.T) return;
  const int Ltot = rq.L + rq.T;
  const int chunk = split_chunk(Ltot, a.num_splits);
  const int active = (Ltot + chunk - 1) / chunk;
  const int64_t R = (int64_t)a.total_tokens * H;
  const float* wl = a.workspace + (int64_t)a.num_splits * R * D_V;
  if ((int)threadIdx.x < active) lse_s[threadIdx.x] = wl[threadIdx.x * R + rowg];
  __syncthreads();
  float mx = -INFINITY;
  bool nan = false;
  for (int s = 0; s < active; ++s) {
    float v = lse_s[s];
    nan |= (v != v);
    mx = fmaxf(mx, v);
  }
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  const int col = threadIdx.x * 4;
#ifdef MTV_COMBINE_SERIAL
  for (int s = 0; s < active; ++s) {
    float v = lse_s[s];
    if (v == -INFINITY) continue;  // split saw nothing: its partial is exactly 0
    float w = exp2f(v - mx);
    float4 o = *reinterpret_cast<const float4*>(a.workspace + ((int64_t)s * R + rowg) * D_V + col);
    acc.x += w * o.x; acc.y += w * o.y; acc.z += w * o.z; acc.w += w * o.w;
    wsum += w;
  }
#else
  // The partials of COMBINE_BATCH splits are loaded before any is used (independent loads in
  // flight instead of one L2 round trip per split), then summed in split order: bit-identical
  // to the serial loop (MTV_COMBINE_SERIAL).
  constexpr int COMBINE_BATCH = 8;
  const float* wbase = a.workspace + rowg * D_V + col;
  for (int s0 = 0; s0 < active; s0 += COMBINE_BATCH) {
    float4 o[COMBINE_BATCH];
#pragma unroll
    for (int k = 0; k < COMBINE_BATCH; ++k) {
      const int s = s0 + k;
      o[k] = (s < active && lse_s[s] != -INFINITY)
                 ? __ldcs(reinterpret_cast<const float4*>(wbase + (int64_t)s * R * D_V))
                 : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < COMBINE_BATCH; ++k) {
      const int s = s0 + k;
      if (s >= active) break;
      const float v = lse_s[s];
      if (v == -INFINITY) continue;  // split saw nothing: its partial is exactly 0
      const float w = exp2f(v - mx);
      acc.x += w * o[k].x; acc.y += w * o[k].y; acc.z += w * o[k].z; acc.w += w * o[k].w;
      wsum += w;
    }
  }
#endif
  const float inv = wsum > 0.f ? 1.f / wsum : (wsum == 0.f ? 0.f : wsum);
  if (nan) acc.x = acc.y = acc.z = acc.w = __int_as_float(0x7fffffff);
  __nv_bfloat16* op = reinterpret_cast<__nv_bfloat16*>(a.o) + tok * a.o_s0 + (int64_t)h * a.o_s1 + col;
  *reinterpret_cast<__nv_bfloat162*>(op) = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  *reinterpret_cast<__nv_bfloat162*>(op + 2) = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  if (a.lse != nullptr && threadIdx.x == 0) {
    float lse2 = nan ? __int_as_float(0x7fffffff) : (wsum > 0.f ? mx + log2f(wsum) : -INFINITY);
    a.lse[tok * a.lse_s0 + (int64_t)h * a.lse_s1] = lse2 * 0.6931471805599453f;
  }
}

}  // namespace mtv

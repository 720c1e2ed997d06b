// MLA tree-verify attention: device code shared by the sm_120 and sm_90 builds — constants,
// request / index helpers, PTX wrappers and the split-KV combine kernel.  The forward kernel is
// tree_verify_fwd.cuh (it includes this file).
//
// Rows of a request are (draft token, head) pairs r = t*H + h; all heads share the latent KV, so
// one pass over a request's KV (L scattered prefix rows from kv_indices, then the T draft rows of
// k_draft) serves every row.  S = Q K^T (K = all 576 columns), online softmax in the log2 domain,
// O += P V (V = the first 512 columns of the same smem tile); bf16 mma.sync m16n8k16 with fp32
// accumulation.  Masking is a select (-inf), never a multiply.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "mla_tree_verify.h"

namespace mtv {

constexpr int D_QK = 576;
constexpr int D_V = 512;
constexpr int BN = 32;                  // KV rows per tile
constexpr int NWARPS = 8;
constexpr int NTHREADS = NWARPS * 32;
constexpr int MAX_SPLITS = 256;  // >= the SM count of the GPUs served (H200 132, RTX PRO 6000 188)
constexpr int CHUNKS_PER_ROW = D_QK / 8;  // 16-byte chunks per 576-wide row
constexpr int KV_STRIDE = D_QK + 8;       // smem row pitch in bf16 (pad: conflict-free ldmatrix)
constexpr int KV_TILE_BYTES = BN * KV_STRIDE * 2;
constexpr int RING = 3;  // KV row-address ring: tile i's addresses are fetched at iteration i-2
constexpr int ROWPTR_BYTES = RING * BN * 8;
// Slot-index ring: tile i's kv_indices entries (raw, 4 or 8 bytes in an 8-byte cell) are copied by
// cp.async in the commit group of iteration i-3 and read at iteration i-2 (after that group's wait):
// no register holds an index load in flight, so no instruction waits on one.
constexpr int IDX_RING = 2;
constexpr int IDX_BYTES = IDX_RING * BN * 8;

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

// a bf16 pair holds a NaN or an Inf: either half's exponent field is all ones
__device__ __forceinline__ bool nonfinite2(__nv_bfloat162 v) {
  const uint32_t u = *reinterpret_cast<const uint32_t*>(&v);
  return ((u & 0x7F80u) == 0x7F80u) | ((u & 0x7F800000u) == 0x7F800000u);
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

// Programmatic dependent launch (sm_90+; no-ops when the kernel was launched without it)
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }


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

#ifdef MTV_TIMING
// Diagnostic build only (-DMTV_TIMING): per-CTA global-timer stamps and per-phase clock stamps of CTA 0.
__device__ unsigned long long mtv_t_cta[2048][4];
__device__ long long mtv_t_iter[2][64][10];
__device__ unsigned long long mtv_t_comb[4096][2];
__device__ __forceinline__ unsigned long long mtv_gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define MTV_CTA_LIN ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)
#define MTV_STAMP_CTA(k) do { if (threadIdx.x == 0 && MTV_CTA_LIN < 2048) mtv_t_cta[MTV_CTA_LIN][k] = mtv_gtime(); } while (0)
#define MTV_STAMP_IT(it, k) do { if ((threadIdx.x == 0 || threadIdx.x == 160) && MTV_CTA_LIN == 0 && (it) < 64) mtv_t_iter[threadIdx.x != 0][it][k] = clock64(); } while (0)
#else
#define MTV_STAMP_CTA(k) do {} while (0)
#define MTV_STAMP_IT(it, k) do {} while (0)
#endif

__device__ __forceinline__ bool bf16_nonfinite(uint32_t half16) { return (half16 & 0x7F80u) == 0x7F80u; }

// KV row j of the request: prefix rows come from kv_indices (fetch_slot loads the entry now;
// fetch_slot_async copies it into an index-ring cell, which ring_step reads after the copy's wait),
// draft rows from k_draft; row_ptr gives nullptr past kend (zero-filled).  Out-of-range slots are
// clamped and flagged.
__device__ __forceinline__ int64_t fetch_slot(const MtvArgs& a, const Req& rq, int j, int kend) {
  return (j < kend && j < rq.L) ? ld_idx(a.kv_indices, a.kvi_is64, rq.kv_start + j) : 0;
}
// cp.async of kv_indices[kv_start + j] (4 or 8 bytes, raw) into the index cell at shared address `cell`
__device__ __forceinline__ void copy_slot_async(uint32_t cell, const MtvArgs& a, int64_t kv_start, int j) {
  if (a.kvi_is64)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(cell),
                 "l"(reinterpret_cast<const long long*>(a.kv_indices) + kv_start + j));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(cell),
                 "l"(reinterpret_cast<const int*>(a.kv_indices) + kv_start + j));
}
__device__ __forceinline__ void fetch_slot_async(uint32_t cell, const MtvArgs& a, const Req& rq, int j, int kend) {
  if (j < kend && j < rq.L) copy_slot_async(cell, a, rq.kv_start, j);
}
// a prefix row's slot, clamped into [0, num_slots) with the error bit raised when it was outside
__device__ __forceinline__ int64_t checked_slot(const MtvArgs& a, int64_t slot) {
  if (slot < 0 || slot >= a.num_slots) {
    set_err(a.error_flag, ERR_KV_SLOT_RANGE);
    slot = slot < 0 ? 0 : a.num_slots - 1;
  }
  return slot;
}
// One lane's share of the ring update (warp 0, lane i = row i of a tile): row jr's address from the
// index cell it was copied into (cell_read) -> *entry, then row jn's index copy into cell_next.  Every
// shared-memory read (the request's fields, the cell) is issued up front and unconditionally and the
// address is chosen by selects: under the other warps' ldmatrix traffic each dependent shared-memory
// round trip costs warp 0 ~150 cycles (bench/kernel_phases.py, session 7).  The cell is only used for a
// prefix row of this split, whose copy the caller has waited for (visible to the issuing thread).
__device__ __forceinline__ void ring_step(const MtvArgs& a, const Req& R, int jr, int jn, int kend,
                                          const __nv_bfloat16** entry, uint32_t cell_read, uint32_t cell_next) {
  const int L = R.L;
  const int64_t kv_start = R.kv_start, q_start = R.q_start;
  long long raw;
  if (a.kvi_is64) {
    asm volatile("ld.shared.s64 %0, [%1];\n" : "=l"(raw) : "r"(cell_read));
  } else {
    int w;
    asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(w) : "r"(cell_read));
    raw = w;
  }
  const bool pre = jr < L && jr < kend;
  int64_t slot = pre ? raw : 0;
  if (pre) slot = checked_slot(a, slot);
  const __nv_bfloat16* kv_row = reinterpret_cast<const __nv_bfloat16*>(a.kv_buffer) + slot * a.kv_s0;
  const __nv_bfloat16* draft_row =
      reinterpret_cast<const __nv_bfloat16*>(a.k_draft) + (q_start + (pre ? 0 : jr - L)) * a.kd_s0;
  *entry = jr >= kend ? nullptr : (pre ? kv_row : draft_row);
  if (jn < kend && jn < L) copy_slot_async(cell_next, a, kv_start, jn);
}
__device__ __forceinline__ const __nv_bfloat16* row_ptr(const MtvArgs& a, const Req& rq, int j, int kend,
                                                        int64_t slot) {
  if (j >= kend) return nullptr;
  if (j < rq.L) return reinterpret_cast<const __nv_bfloat16*>(a.kv_buffer) + checked_slot(a, slot) * a.kv_s0;
  return reinterpret_cast<const __nv_bfloat16*>(a.k_draft) + (rq.q_start + (j - rq.L)) * a.kd_s0;
}


// Combine, sliced: CTA (row, column slice y of S); 128 threads = (128 / S) column quads x S split
// groups.  Thread (quad, g) loads the partials of splits g, g + S, ... COMBINE_BATCH at a time (all of a
// batch in flight before any is used) and weights them; the S group sums are then added in group order
// through shared memory (fixed order: deterministic).  S is chosen on the host from the row count only
// (static under graph replay): many splits of few rows get S = 8 (enough CTAs and loads in flight),
// many rows get S = 1 (one CTA per row, as many loads in flight per thread).
// Nine splits per thread and batch: the common 64-split shapes have one split more (the draft rows' last tile,
// e.g. (1, 32768, 16, 8): 64 full splits + 1), which took a second dependent round trip at 8 per batch.
// (1, 32768, 16, 8) 56.9-57.0 -> 56.2 us, (1, 131072, 16, 8) -0.6 %, others the same (H200, session 14).
#ifndef MTV_COMBINE_BATCH
#define MTV_COMBINE_BATCH 9
#endif
constexpr int COMBINE_BATCH = MTV_COMBINE_BATCH;
template <int S>
__global__ void __launch_bounds__(128) mtv_combine_kernel(const MtvArgs a) {
  static_assert(S == 1 || S == 2 || S == 4 || S == 8, "slices");
  constexpr int QUADS = 128 / S;
  __shared__ float lse_s[MAX_SPLITS];
  __shared__ float4 part_s[S > 1 ? S : 1][S > 1 ? QUADS : 1];
  __shared__ float w_s[S];
  __shared__ float mx_s[4];
  __shared__ int nan_s[4];
  __shared__ int64_t sh_b;
#ifdef MTV_TIMING
  if (threadIdx.x == 0 && blockIdx.x < 4096 && blockIdx.y == 0) mtv_t_comb[blockIdx.x][0] = mtv_gtime();
#endif
  const int H = a.heads;
  const int64_t rowg = blockIdx.x;
  const int64_t tok = rowg / H;
  const int h = (int)(rowg - tok * H);
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  if (tid == 0) {
    int lo = 0, hi = a.batch;  // request owning this token: largest b with qo_indptr[b] <= tok
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
  griddep_wait();  // the forward kernel's partials are visible from here (a no-op without PDL)
  // the splits' LSEs (log2): their max and whether any is NaN, by a block reduction
  // (MAX_SPLITS may exceed the 128 threads: each thread takes splits tid, tid + 128, ...)
  float mx = -INFINITY;
  int nan = 0;
#pragma unroll
  for (int s = tid; s < MAX_SPLITS; s += 128) {
    const float v = s < active ? a.workspace[(int64_t)a.num_splits * R * D_V + (int64_t)s * R + rowg] : -INFINITY;
    lse_s[s] = v;
    mx = fmaxf(mx, v);
    nan |= v != v;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    nan |= __shfl_xor_sync(0xffffffffu, nan, o);
  }
  if (lane == 0) {
    mx_s[wid] = mx;
    nan_s[wid] = nan;
  }
  __syncthreads();
  mx = fmaxf(fmaxf(mx_s[0], mx_s[1]), fmaxf(mx_s[2], mx_s[3]));
  nan = nan_s[0] | nan_s[1] | nan_s[2] | nan_s[3];
  const int cq = tid % QUADS, grp = tid / QUADS;
  const int col = blockIdx.y * (D_V / S) + cq * 4;
  const float* wbase = a.workspace + rowg * D_V + col;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  for (int s0 = grp; s0 < active; s0 += COMBINE_BATCH * S) {
    float4 o[COMBINE_BATCH];
#pragma unroll
    for (int k = 0; k < COMBINE_BATCH; ++k) {
      const int s = s0 + k * S;
      o[k] = (s < active && lse_s[s] != -INFINITY)
                 ? __ldcs(reinterpret_cast<const float4*>(wbase + (int64_t)s * R * D_V))
                 : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < COMBINE_BATCH; ++k) {
      const int s = s0 + k * S;
      if (s >= active) break;
      const float l = lse_s[s];
      if (l == -INFINITY) continue;  // split saw nothing: its partial is exactly 0
      const float w = exp2f(l - mx);
      acc.x += w * o[k].x; acc.y += w * o[k].y; acc.z += w * o[k].z; acc.w += w * o[k].w;
      wsum += w;
    }
  }
  if (S > 1) {
    part_s[grp][cq] = acc;
    if (cq == 0) w_s[grp] = wsum;
    __syncthreads();
    if (grp != 0) return;
    acc = part_s[0][cq];
    wsum = w_s[0];
#pragma unroll
    for (int g = 1; g < S; ++g) {
      const float4 p = part_s[g][cq];
      acc.x += p.x; acc.y += p.y; acc.z += p.z; acc.w += p.w;
      wsum += w_s[g];
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : (wsum == 0.f ? 0.f : wsum);
  if (nan) acc.x = acc.y = acc.z = acc.w = __int_as_float(0x7fffffff);
  __nv_bfloat16* op = reinterpret_cast<__nv_bfloat16*>(a.o) + tok * a.o_s0 + (int64_t)h * a.o_s1 + col;
  const __nv_bfloat162 v01 = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  const __nv_bfloat162 v23 = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  *reinterpret_cast<__nv_bfloat162*>(op) = v01;
  *reinterpret_cast<__nv_bfloat162*>(op + 2) = v23;
  if (a.nonfinite_flag != nullptr && (nonfinite2(v01) | nonfinite2(v23))) atomicOr(a.nonfinite_flag, 1);
  if (a.lse != nullptr && blockIdx.y == 0 && tid == 0) {
    const float lse2 = nan ? __int_as_float(0x7fffffff) : (wsum > 0.f ? mx + log2f(wsum) : -INFINITY);
    a.lse[tok * a.lse_s0 + (int64_t)h * a.lse_s1] = lse2 * 0.6931471805599453f;
  }
#ifdef MTV_TIMING
  if (tid == 0 && blockIdx.x < 4096 && blockIdx.y == 0) mtv_t_comb[blockIdx.x][1] = mtv_gtime();
#endif
}

}  // namespace mtv

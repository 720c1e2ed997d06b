// MLA tree-verify attention: the forward kernel (its building blocks: tree_verify_tile.cuh; shared
// helpers and the combine kernel: tree_verify_kernel.cuh).
//
// One CTA = (KV split, 64-row tile of one request's (draft token, head) rows, request):
// every KV tile carries the math of 64 query rows (a 32-row schedule, measured until 2026-11-30,
// was 1.3-1.5x slower: bench/results/verify-2026-11-30.md).
//
// Q lives in registers during the KV loop (72 regs/thread).  G = 2 (64 x 576 bf16 = 73.7 KB) loads it straight
// from global memory in mma A-fragment layout (no wait before the first KV tile); G = 4 (32 rows, both row tiles
// per warp) stages it in the KV stages and takes its fragments by ldmatrix before tile 0 lands.
// Shared memory: 2 KV stages (2 x 37.4 KB), 16 KB S-partial exchange, P (5 KB), ring, stats.  After the
// KV loop the stages hold the split epilogue's staging: each warp's 64 columns of 32 rows at a time.
//
// Per KV tile (BN = 32 rows), 8 warps:
//   S   (template G = 2) warp w -> m16 row tile smi = w>>1, K half kp = w&1 (288 columns, 18 k-steps):
//       18 x (2 ldmatrix.x4 + 4 mma); partial S (16 x 32 fp32, 16 regs) exchanged with the
//       partner warp (w^1) through smem (one 64-thread named barrier); both warps then hold the
//       full 16 x 32 S (same fp32 sums, a+b == b+a) and compute the same row max, but each
//       exponentiates and stores only its own 16 columns of P (bf16).
//       (G = 4, calls with at most 32 rows per request) warp w -> K quarter w>>1 (144 columns, 9
//       k-steps) of both row tiles and KV rows (w&1)*16 .. +16: 9 x (1 ldmatrix.x4 + 4 mma), so the
//       tile's K is read from smem once; then warp w finishes one m16n8 block (row tile w>>2, n8 tile
//       kp) as (p0+p1)+(p2+p3) of the four K-quarter partials and exponentiates it, the row max
//       coming from the four warps' column maxima (a second group barrier): no warp idles in S and
//       the dependent mma chains are half as long (1.1x faster on (1, 200000, 4, 8) than G = 2,
//       verify-2026-11-30.md).
//   PV  warp w -> V columns w*64 .. +64 for all 64 rows (O: 4 x 8 m16n8 tiles, 128 regs):
//       per k16 step 4 ldmatrix.x4.trans (V) + 4 ldmatrix.x4 (P) + 32 mma.
//   per warp per tile: 136 mma, 52 ldmatrix (36 K + 8 V + 8 P), 2 barriers (1 CTA-wide after
//   the cp.async wait, 1 CTA-wide before P.V) + 1 group barrier.  m16 row tiles with no live row
//   (T*H - row0 < 64) are skipped in both phases (warp-uniform).
// Draft tiles (holding rows >= L): the group barrier becomes a CTA barrier so that non-finite V
// values can be zeroed in smem after every warp's S reads and before P.V, then re-injected (as
// NaN) only into rows that may see them; padded rows j >= kend get their V part zeroed too.
#pragma once
#include "tree_verify_tile.cuh"

namespace mtv {

constexpr int BM = 64;                        // query rows per CTA (4 m16 tiles)
constexpr int QUARTER_MAX_ROWS = 32;          // calls with at most this many rows per request: G = 4
constexpr int P_STRIDE = BN + 8;              // 80 B rows: conflict-free ldmatrix
constexpr int P_BYTES = BM * P_STRIDE * 2;    // 5120
constexpr int XCH_BYTES = NWARPS * 4 * 32 * 16;  // per warp 4 float4 per lane: 16384
// alpha, l (per K part), m, column maxima (G = 4), flag, Req
constexpr int STAT_BYTES = (BM + 4 * BM + BM + 4 * BM) * 4 + 16 + 32;
constexpr int SMEM_BYTES = 2 * KV_TILE_BYTES + XCH_BYTES + P_BYTES + ROWPTR_BYTES + IDX_BYTES + STAT_BYTES;
static_assert(KV_TILE_BYTES % 128 == 0 && XCH_BYTES % 16 == 0 && P_BYTES % 16 == 0, "alignment");
static_assert(D_QK % 32 == 0 && BN == 32 && NWARPS == 8 && D_V == NWARPS * 64, "warp layout");
static_assert(SMEM_BYTES <= 101376, "must fit the sm_120 shared-memory budget");
constexpr int EPI_PITCH = 64 + 8;  // split epilogue staging: floats per row (conflict-free float2 stores)
static_assert(NWARPS * 32 * EPI_PITCH * 4 <= 2 * KV_TILE_BYTES, "the split epilogue stages in the KV stages");

// a row's softmax denominator (the sum of its G K-part warps' sums), the output scale 1 / l (0 for a row that saw
// nothing; a NaN l stays NaN) and its log2 LSE (m + log2 l)
template <int G>
__device__ __forceinline__ float row_l(const float* l_sm, int lr) {
  return G == 2 ? l_sm[lr] + l_sm[BM + lr] : (l_sm[lr] + l_sm[BM + lr]) + (l_sm[2 * BM + lr] + l_sm[3 * BM + lr]);
}
__device__ __forceinline__ float row_inv(float l) { return (l > 0.f) ? 1.f / l : (l == 0.f ? 0.f : l); }
__device__ __forceinline__ float row_lse2(float l, float m) {
  return (l > 0.f) ? m + log2f(l) : (l == 0.f ? -INFINITY : l);
}

// The one-split epilogue: warp `warp` writes its 64 columns of every live row of O (bf16, scaled by 1 / l)
// and, if requested, the rows' natural-log LSE.
template <int G, int MI>
__device__ __forceinline__ void store_output(const MtvArgs& a, const float (&o_acc)[MI][8][4], const float* l_sm,
                                             const float* m_sm, int64_t q_start, int row0, int M, int H, int nmi,
                                             int warp, int g, int c4) {
  bool bad = false;  // a NaN or an Inf written by this thread (nonfinite_flag)
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int lr = mi * 16 + g + hr * 8;
      const int r = row0 + lr;
      if (mi >= nmi || r >= M) continue;
      const int t = r / H, h = r - t * H;
      const float l = row_l<G>(l_sm, lr);
      const float inv = row_inv(l);
      const int64_t tok = q_start + t;
      __nv_bfloat16* op = reinterpret_cast<__nv_bfloat16*>(a.o) + tok * a.o_s0 + (int64_t)h * a.o_s1;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int col = warp * 64 + n * 8 + 2 * c4;
        const __nv_bfloat162 v = __floats2bfloat162_rn(o_acc[mi][n][hr * 2] * inv, o_acc[mi][n][hr * 2 + 1] * inv);
        *reinterpret_cast<__nv_bfloat162*>(op + col) = v;
        bad |= nonfinite2(v);
      }
      if (a.lse != nullptr && warp == 0 && c4 == 0)
        a.lse[tok * a.lse_s0 + (int64_t)h * a.lse_s1] = row_lse2(l, m_sm[lr]) * 0.6931471805599453f;
    }
  }
  if (bad && a.nonfinite_flag != nullptr) atomicOr(a.nonfinite_flag, 1);
}

// G: warps per m16 row tile in the S phase (2: K halves, for CTAs with 3-4 live row tiles; 4: K
// quarters, for calls whose requests have at most 32 rows, T*H <= 32) - a template argument, chosen on
// the host from (max_q_len, heads) only, so that each instantiation keeps its registers (no spills).
// SPLIT: 1 for calls with num_splits > 1 (the epilogue writes fp32 partials for the combine), 0 for one split
// (bf16 output directly) - a template argument, chosen on the host, so that each kernel holds only its own
// epilogue: with both in one kernel, ptxas scheduled `<2>`'s KV loop differently and unsplit calls ran 1.6 %
// slower (bench/results/verify-2026-11-30.md, session 9).
template <int G, int SPLIT>
__global__ void __launch_bounds__(NTHREADS, 1) mtv_fwd_kernel(const MtvArgs a) {
  static_assert(G == 2 || G == 4, "2 or 4 warps per row tile");
  static_assert(SPLIT == 0 || SPLIT == 1, "split epilogue or not");
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* kvbuf0 = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* kvbuf1 = kvbuf0 + BN * KV_STRIDE;
  float* xch = reinterpret_cast<float*>(smem + 2 * KV_TILE_BYTES);
  __nv_bfloat16* psm = reinterpret_cast<__nv_bfloat16*>(smem + 2 * KV_TILE_BYTES + XCH_BYTES);
  const __nv_bfloat16** rowptr_sm =
      reinterpret_cast<const __nv_bfloat16**>(smem + 2 * KV_TILE_BYTES + XCH_BYTES + P_BYTES);
  unsigned char* idx_sm = smem + 2 * KV_TILE_BYTES + XCH_BYTES + P_BYTES + ROWPTR_BYTES;  // [IDX_RING][BN] cells
  float* alpha_sm = reinterpret_cast<float*>(idx_sm + IDX_BYTES);
  float* l_sm = alpha_sm + BM;  // [4][BM]: row sums of the G K-part warps (G = 2: the first two)
  float* m_sm = l_sm + 4 * BM;
  float* mx_sm = m_sm + BM;  // [BM][4]: G = 4, the four K-quarter warps' column maxima of each row
  uint32_t* flag_sm = reinterpret_cast<uint32_t*>(mx_sm + 4 * BM);
  Req* rq_sm = reinterpret_cast<Req*>(flag_sm + 4);  // the request, re-read from smem inside the loop

  // launched as a programmatic dependent (PDL): the previous kernel's writes are visible from here on, and
  // nothing global is read or written before (a no-op under a plain launch).  Reading the request and the slot
  // indices before it (which would bind callers to not writing them in the kernel just before) saved nothing
  // (bench/results/verify-2026-12-01.md, session 17).  The timing build's CTA start is stamped after it.
  griddep_wait();
  MTV_STAMP_CTA(0);
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
  // m16 row tiles holding at least one live row (G = 4 serves two; the host picks it only for calls of
  // at most QUARTER_MAX_ROWS rows per request, and a request beyond that is flagged, its rows skipped)
  if (G == 4 && M - row0 > QUARTER_MAX_ROWS && split == 0 && tid == 0) set_err(a.error_flag, ERR_Q_TILES);
  const int nmi = min(G == 4 ? 2 : 4, (M - row0 + 15) >> 4);

  // ---- G = 4: Q's 32 rows -> the KV stages (row lr at lr * KV_STRIDE: the K tiles' conflict-free pitch), by
  // cp.async, 16 bytes per thread: each warp instruction copies 4 whole rows of 128 contiguous bytes (rows past M
  // zero-filled).  They go out first, so their round trip overlaps warp 0's slot fetches below; the fragments
  // (both row tiles of the warp's K quarter) then come by ldmatrix, before tile 0 overwrites stage 0.
  if (G == 4) {
    const int lr = tid >> 3, r = row0 + lr, c0 = tid & 7;
    const bool ok = r < M;
    const int t = ok ? r / H : 0;
    const char* src = ok ? reinterpret_cast<const char*>(reinterpret_cast<const __nv_bfloat16*>(a.q) +
                                                         (rq.q_start + t) * a.q_s0 + (int64_t)(r - t * H) * a.q_s1 + c0 * 8)
                         : reinterpret_cast<const char*>(a.q);
    const uint32_t dst = smem_u32(kvbuf0) + (uint32_t)((lr * KV_STRIDE + c0 * 8) * 2);
#pragma unroll
    for (int k = 0; k < CHUNKS_PER_ROW / 8; ++k)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + k * 128), "l"(src + (ok ? k * 128 : 0)),
                   "r"(ok ? 16 : 0));
    cp_async_commit();
  }

  // ---- row addresses of tiles 0 and 1 -> ring; tile 2's indices -> index ring (cp.async, in tile 0's
  // commit group); tile 0 -> kvbuf0
  if (tid == 0) *rq_sm = rq;
  if (tid < BN) {  // warp 0 keeps the rings: entry tid of every tile (index cell idx_cell + slot * BN * 8)
    const uint32_t idx_cell = smem_u32(idx_sm) + (uint32_t)(tid * 8);
    int64_t s0 = fetch_slot(a, rq, kbeg + tid, kend), s1 = fetch_slot(a, rq, kbeg + BN + tid, kend);
    fetch_slot_async(idx_cell + (2 % IDX_RING) * BN * 8, a, rq, kbeg + 2 * BN + tid, kend);
    rowptr_sm[tid] = row_ptr(a, rq, kbeg + tid, kend, s0);
    rowptr_sm[BN + tid] = row_ptr(a, rq, kbeg + BN + tid, kend, s1);
  }
  // Q fragments, A-fragment layout of m16n8k16.  G = 2: qf[ks] = row tile smi, K half kq; G = 4: qf[mi * 9 + ks]
  // = row tile mi, K quarter kq.
  uint32_t qf[QK_HALF_STEPS][4];
  if (G == 4) {
    cp_async_wait_all();  // Q (warp 0's index copy is not committed yet: it joins tile 0's group)
    __syncthreads();
    const uint32_t q_addr =
        smem_u32(kvbuf0) + (uint32_t)(((lane & 15) * KV_STRIDE + (warp >> 1) * (D_QK / 4) + (lane >> 4) * 8) * 2);
#pragma unroll
    for (int ks = 0; ks < QK_HALF_STEPS; ++ks)
      ldsm_x4(qf[ks], q_addr + (uint32_t)((ks / 9) * 16 * KV_STRIDE * 2 + (ks % 9) * 32));
  }
  __syncthreads();  // the rings are published (G = 4: and every warp's Q reads are done)
  load_kv_tile(smem_u32(kvbuf0), rowptr_sm, a.kv_buffer);
  cp_async_commit();

  // S-phase roles.  G = 2: warps 2i, 2i+1 share m16 row tile smi = i and split K in halves (18 k-steps each);
  // each computes a 16 x 32 partial of S and both finish the tile's S rows.  G = 4 (calls of at most 2 row
  // tiles, 32 rows): warp w computes the partial of K quarter kq = w >> 1 (9 k-steps) for all 32 rows and the
  // KV rows nh * 16 .. +16, nh = w & 1, so every K element is read from shared memory once per tile (the
  // 16-row layout read it once per row tile); then it finishes one m16n8 block of S: row tile smi = w >> 2,
  // n8 tile kp, from the four K-quarter partials of that block.  No warp idles in the S phase of a small
  // (memory-bound) call and the mma chains are half as long as G = 2's.
  const int smi = warp / G;
  const int kp = G == 2 ? warp % G : 2 * (warp & 1) + ((warp >> 1) & 1);
  const int kq = G == 2 ? warp % G : (warp >> 1), nh = G == 2 ? 0 : (warp & 1);
  const int kcol0 = kq * (D_QK / G);  // first K column of this warp's part
  const int g = lane >> 2, c4 = lane & 3;
  const bool s_active = smi < nmi;  // warp-uniform (all warps of a group agree)

  const int rA = row0 + smi * 16 + g, rB = rA + 8;
  const bool vA = rA < M, vB = rB < M;
  const int tA = vA ? rA / H : -1, tB = vB ? rB / H : -1;  // draft token of the row, -1: no row
  if (G == 2) {  // G = 2: straight from global memory into registers (overlaps tile 0's copies).  Staging them
    // like G = 4's cost split calls 1.8 % (bench/results/verify-2026-11-30.md, session 10: ptxas then spilled
    // the row sums in the KV loop of the sm_90 build).
    const __nv_bfloat16* qp = reinterpret_cast<const __nv_bfloat16*>(a.q);
    const int ta = max(tA, 0), tb = max(tB, 0);
    const __nv_bfloat16* qa = qp + (rq.q_start + ta) * a.q_s0 + (int64_t)(rA - ta * H) * a.q_s1 + kcol0 + 2 * c4;
    const __nv_bfloat16* qb = qp + (rq.q_start + tb) * a.q_s0 + (int64_t)(rB - tb * H) * a.q_s1 + kcol0 + 2 * c4;
#pragma unroll
    for (int ks = 0; ks < QK_HALF_STEPS; ++ks) {
      const bool la = s_active && vA, lb = s_active && vB;
      qf[ks][0] = la ? ldg_u32(qa + ks * 16) : 0u;
      qf[ks][1] = lb ? ldg_u32(qb + ks * 16) : 0u;
      qf[ks][2] = la ? ldg_u32(qa + ks * 16 + 8) : 0u;
      qf[ks][3] = lb ? ldg_u32(qb + ks * 16 + 8) : 0u;
    }
  }

  // O accumulators of the row tiles this instantiation can hold (G = 4: two; 64 registers fewer)
  constexpr int MI = G == 4 ? 2 : 4;
  float o_acc[MI][8][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int n = 0; n < 8; ++n) o_acc[mi][n][0] = o_acc[mi][n][1] = o_acc[mi][n][2] = o_acc[mi][n][3] = 0.f;
  // online-softmax state of rows rA / rB (identical in every warp of a group); l is this
  // thread's partial sum over its own columns (reduced over quad and group at the end)
  float m_run0 = -INFINITY, m_run1 = -INFINITY, l_run0 = 0.f, l_run1 = 0.f;
  const float sc = a.sm_scale * 1.4426950408889634f;

  // per-lane smem byte offsets of the ldmatrix sources
  const uint32_t kv_base = smem_u32(kvbuf0);
  // S: K rows (n) lane-dependent (G = 4: from nh * 16), K columns kcol0 + ks*16 (+8 for lanes 8-15 / 24-31)
  const uint32_t k_off =
      (uint32_t)(((nh * 16 + (lane >> 4) * 8 + (lane & 7)) * KV_STRIDE + kcol0 + ((lane >> 3) & 1) * 8) * 2);
  // PV: V rows (k) lane-dependent, V columns warp*64 + np*16 (+8 for lanes 16-31)
  const uint32_t v_off = (uint32_t)((((lane & 7) + ((lane >> 3) & 1) * 8) * KV_STRIDE + warp * 64 + (lane >> 4) * 8) * 2);
  const uint32_t p_addr = smem_u32(psm) + (uint32_t)(((lane & 15) * P_STRIDE + (lane >> 4) * 8) * 2);
  // S-partial exchange: warp w's partial at w*2 KB (4 float4 per lane: G = 2 n8 tile n at n * 512, G = 4 block
  // (mi, n8 tile 2 nh + f) at (mi * 2 + f) * 512).  G = 2 reads the partner's partial; G = 4 reads its block
  // (smi, kp) from the four K-quarter warps 2 kq + (kp >> 1), 4 KB apart.
  const uint32_t xch_mine = smem_u32(xch) + (uint32_t)((warp * 4 * 32 + lane) * 16);
  const uint32_t xch_other =
      smem_u32(xch) + (uint32_t)(G == 2 ? ((warp ^ 1) * 4 * 32 + lane) * 16
                                        : (((kp >> 1) * 4 * 32 + lane) * 16 + (smi * 2 + (kp & 1)) * 512));

  cp_async_wait_all();
  __syncthreads();
  MTV_STAMP_CTA(1);

  for (int it = 0; it < ntiles; ++it) {
    MTV_STAMP_IT(it, 0);
    const uint32_t cur_b = kv_base + (uint32_t)((it & 1) * KV_TILE_BYTES);
    __nv_bfloat16* cur = (it & 1) ? kvbuf1 : kvbuf0;
    const int j0 = kbeg + it * BN;
    if (it > 0) {
      cp_async_wait_all();
      __syncthreads();
    }
    MTV_STAMP_IT(it, 1);
    const Req& R = *rq_sm;
    if (tid < BN) {  // ring slot (it+2)%3 was last read at iteration it-1, before this iteration's barrier;
      // updated before the S phase: 4-10 % faster on every shape than after the tile's cp.async
      // (bench/results/verify-2026-11-30.md, session 6). Tile it+2's indices were copied in the group
      // waited above; tile it+3's go into the cell tile it+1's indices held (read at iteration it-1).
      const uint32_t idx_cell = smem_u32(idx_sm) + (uint32_t)(tid * 8);
      ring_step(a, R, j0 + 2 * BN + tid, j0 + 3 * BN + tid, kend, &rowptr_sm[((it + 2) % RING) * BN + tid],
                idx_cell + (uint32_t)(((it + 2) % IDX_RING) * BN * 8),
                idx_cell + (uint32_t)(((it + 3) % IDX_RING) * BN * 8));
    }
    MTV_STAMP_IT(it, 2);
    if (tid == 0) flag_sm[0] = 0u;
    MTV_STAMP_IT(it, 3);
    const bool draft_tile = j0 + BN > R.L;

    // ---- S partial = Q[smi rows, K part kp] . K[tile, K part kp]^T, exchanged within the group
    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    if (G == 4 || s_active) {
      if (G == 2) s_steps<QK_HALF_STEPS>(s, qf, cur_b + k_off);
      else s_steps_rows2(s, qf, cur_b + k_off, nmi > 1);
#pragma unroll
      for (int n = 0; n < 4; ++n) sts_f4(xch_mine + n * 512, s[n]);
    }
    // Draft tiles are sanitised in place below (after every warp's S reads): CTA barrier.
    // Prefix tiles: group barrier, executed by EVERY group, live or not (G = 2: the pair of row tile smi,
    // which shares s_active, so barrier smi+1 always sees exactly its 64 threads; G = 4: the four K-quarter
    // warps of KV half nh, barrier nh+1, whose blocks those same warps finish).  Skipping it in groups without
    // a live row (nmi < 4) left warps with different barrier counts, and compute-sanitizer
    // racecheck, which orders accesses by barrier phase, then reported every later exchange
    // (alpha, P, l/m, V vs the next cp.async) as a race (15 hazards).
    MTV_STAMP_IT(it, 4);
    if (draft_tile) __syncthreads(); else group_sync(G == 2 ? smi : nh, G);
    // Tile it+1's cp.async into the other stage (free: every warp passed P.V(it-1) before this tile's
    // barrier), issued here rather than before the S phase: the S phase starts at the barrier, and the
    // copies go out while the warps wait on the exchange and run the softmax (LSU otherwise idle).
    // 0.8-5.1 % faster than before the S phase, three A/B rounds (bench/results/verify-2026-11-30.md,
    // session 8); after the pre-P.V barrier or just before it: slower.
    if (it + 1 < ntiles)
      load_kv_tile(kv_base + (uint32_t)(((it + 1) & 1) * KV_TILE_BYTES), rowptr_sm + ((it + 1) % RING) * BN, a.kv_buffer);
    cp_async_commit();
    MTV_STAMP_IT(it, 5);

    // ---- full S rows, select-masking, online softmax, own 32/G columns of P.
    // G = 2: own + partner partial (a + b == b + a), summed by both warps of the pair over all 32 columns:
    // both hold identical S and the same row max.  G = 4: each warp sums only its own 8 columns (n8 tile
    // kp) of the four K-quarter partials, (p0 + p1) + (p2 + p3), and the row max is the max of the four
    // warps' column maxima, exchanged through shared memory (a second group barrier): 4 instead of 16
    // 16-byte reads per thread, and the same S values and maxima as summing everything in every warp.
    // (every column is visible in a prefix-only tile inside the split: scale_mask's fast path)
    float mx0 = -INFINITY, mx1 = -INFINITY;
    float xo[1][4] = {{0.f, 0.f, 0.f, 0.f}};  // G = 4: this warp's own columns (n8 tile kp)
    if (G == 4) {
      if (s_active) {
        const float4 v0 = lds_f4(xch_other), v1 = lds_f4(xch_other + 4096);
        const float4 v2 = lds_f4(xch_other + 8192), v3 = lds_f4(xch_other + 12288);
        xo[0][0] = (v0.x + v1.x) + (v2.x + v3.x); xo[0][1] = (v0.y + v1.y) + (v2.y + v3.y);
        xo[0][2] = (v0.z + v1.z) + (v2.z + v3.z); xo[0][3] = (v0.w + v1.w) + (v2.w + v3.w);
        scale_mask(xo, !draft_tile && j0 + BN <= kend, j0 + kp * 8, 2 * c4, sc, a, R, kend, tA, tB);
        float pm0 = fmaxf(xo[0][0], xo[0][1]), pm1 = fmaxf(xo[0][2], xo[0][3]);
        quad_max2(pm0, pm1);
        if (c4 == 0) {
          mx_sm[(smi * 16 + g) * 4 + kp] = pm0;
          mx_sm[(smi * 16 + g + 8) * 4 + kp] = pm1;
        }
      }
      group_sync(smi + 2, G);  // ids 3, 4: the group's column maxima are written (every group, live or not)
      if (s_active) {
        const float4 ma = lds_f4(smem_u32(mx_sm + (smi * 16 + g) * 4));
        const float4 mb = lds_f4(smem_u32(mx_sm + (smi * 16 + g + 8) * 4));
        mx0 = fmaxf(fmaxf(ma.x, ma.y), fmaxf(ma.z, ma.w));
        mx1 = fmaxf(fmaxf(mb.x, mb.y), fmaxf(mb.z, mb.w));
      }
    }
    if (s_active) {
      if (G == 2) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const float4 v = lds_f4(xch_other + n * 512);
          s[n][0] += v.x; s[n][1] += v.y; s[n][2] += v.z; s[n][3] += v.w;
        }
        scale_mask(s, !draft_tile && j0 + BN <= kend, j0, 2 * c4, sc, a, R, kend, tA, tB);
        mx0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
        mx1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
        mx0 = fmaxf(mx0, fmaxf(fmaxf(s[2][0], s[2][1]), fmaxf(s[3][0], s[3][1])));
        mx1 = fmaxf(mx1, fmaxf(fmaxf(s[2][2], s[2][3]), fmaxf(s[3][2], s[3][3])));
        quad_max2(mx0, mx1);
      }
      // Lazy rescaling: the running max moves only when a tile's max exceeds it by > 8.
      float mn0 = fmaxf(m_run0, mx0), mn1 = fmaxf(m_run1, mx1);
      if (!(mn0 > m_run0 + 8.f)) mn0 = m_run0;
      if (!(mn1 > m_run1 + 8.f)) mn1 = m_run1;
      const float mu0 = (mn0 == -INFINITY) ? 0.f : mn0, mu1 = (mn1 == -INFINITY) ? 0.f : mn1;
      const float al0 = (mn0 == m_run0) ? 1.f : fast_exp2(m_run0 - mu0);
      const float al1 = (mn1 == m_run1) ? 1.f : fast_exp2(m_run1 - mu1);
      m_run0 = mn0;
      m_run1 = mn1;
      float rs0 = 0.f, rs1 = 0.f;
      __nv_bfloat16* prow = psm + (smi * 16 + g) * P_STRIDE + 2 * c4;
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        // own columns: n8 tiles 2kp, 2kp+1 (G = 2, selected without a runtime array index: s stays in
        // registers) or kp (G = 4: xo)
        if (G == 4 && h2 == 1) break;
        const int n = G == 2 ? kp * 2 + h2 : kp;
        float x[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = G == 2 ? (kp ? s[2 + h2][e] : s[h2][e]) : xo[0][e];
        const float p0 = fast_exp2(x[0] - mu0), p1 = fast_exp2(x[1] - mu0);
        const float p2 = fast_exp2(x[2] - mu1), p3 = fast_exp2(x[3] - mu1);
        rs0 += p0 + p1;
        rs1 += p2 + p3;
        *reinterpret_cast<uint32_t*>(prow + n * 8) = pack_bf16x2(p0, p1);
        *reinterpret_cast<uint32_t*>(prow + 8 * P_STRIDE + n * 8) = pack_bf16x2(p2, p3);
      }
      l_run0 = l_run0 * al0 + rs0;
      l_run1 = l_run1 * al1 + rs1;
      if (kp == 0 && c4 == 0) {
        alpha_sm[smi * 16 + g] = al0;
        alpha_sm[smi * 16 + g + 8] = al1;
      }
    }

    // Draft rows of this tile: zero non-finite V values (re-injected below only into rows that
    // may see them), and the V part of padded rows j >= kend (cp.async zero-fills them already).
    if (draft_tile) {
#pragma unroll
      for (int k = 0; k < (BN * D_V / 8) / NTHREADS; ++k) {
        const int idx = tid + k * NTHREADS;
        const int i = idx / (D_V / 8), c = idx - i * (D_V / 8);
        const int j = j0 + i;
        uint4* p = reinterpret_cast<uint4*>(cur + i * KV_STRIDE + c * 8);
        if (j >= kend) {
          *p = make_uint4(0u, 0u, 0u, 0u);
        } else if (j >= R.L) {
          const uint4 v = *p;
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
    MTV_STAMP_IT(it, 6);
    __syncthreads();  // P, alpha and the sanitised V tile are visible to every warp
    MTV_STAMP_IT(it, 7);

    // ---- O[:, warp*64 .. +64] = alpha * O + P . V   (live m16 row tiles only)
    {
      float al[MI][2];
      bool resc = false;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        al[mi][0] = (mi < nmi) ? alpha_sm[mi * 16 + g] : 1.f;
        al[mi][1] = (mi < nmi) ? alpha_sm[mi * 16 + g + 8] : 1.f;
        resc |= (al[mi][0] != 1.f) || (al[mi][1] != 1.f);
      }
      if (__any_sync(0xffffffffu, resc)) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int n = 0; n < 8; ++n) {
            o_acc[mi][n][0] *= al[mi][0]; o_acc[mi][n][1] *= al[mi][0];
            o_acc[mi][n][2] *= al[mi][1]; o_acc[mi][n][3] *= al[mi][1];
          }
      }
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        uint32_t vb[4][4];
#pragma unroll
        for (int np = 0; np < 4; ++np)
          ldsm_x4_t(vb[np], cur_b + v_off + (uint32_t)((ks * 16 * KV_STRIDE + np * 16) * 2));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          if (mi < nmi) {
            uint32_t pa[4];
            ldsm_x4(pa, p_addr + (uint32_t)((mi * 16 * P_STRIDE + ks * 16) * 2));
#pragma unroll
            for (int np = 0; np < 4; ++np) {
              mma_bf16(o_acc[mi][2 * np], pa, vb[np][0], vb[np][1]);
              mma_bf16(o_acc[mi][2 * np + 1], pa, vb[np][2], vb[np][3]);
            }
          }
        }
      }
      const uint32_t fl = flag_sm[0];
      if (fl != 0u) {  // rare path: a draft row of this tile holds NaN/Inf in its V part
        const __nv_bfloat16* kd = reinterpret_cast<const __nv_bfloat16*>(a.k_draft);
        for (int i = 0; i < BN; ++i) {
          if (!((fl >> i) & 1u)) continue;
          const int d = j0 + i - R.L;
          const __nv_bfloat16* vrow = kd + (R.q_start + d) * a.kd_s0;
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int r = row0 + mi * 16 + g + hr * 8;
              if (mi >= nmi || r >= M || !draft_visible(a, R, r / H, d)) continue;
#pragma unroll
              for (int n = 0; n < 8; ++n) {
                const int col = warp * 64 + n * 8 + 2 * c4;
                const uint32_t pair = *reinterpret_cast<const uint32_t*>(vrow + col);
                if (bf16_nonfinite(pair & 0xFFFFu)) o_acc[mi][n][hr * 2] = __int_as_float(0x7fffffff);
                if (bf16_nonfinite(pair >> 16)) o_acc[mi][n][hr * 2 + 1] = __int_as_float(0x7fffffff);
              }
            }
          }
        }
      }
    }
    MTV_STAMP_IT(it, 8);
    MTV_STAMP_IT(it, 9);
  }

  MTV_STAMP_CTA(2);
  griddep_launch_dependents();  // the combine (if any) may start launching: this CTA's loads are done
  // ---- row statistics: l = sum over the quad and the two K-half warps; m identical in both
  if (s_active) {
    l_run0 += __shfl_xor_sync(0xffffffffu, l_run0, 1);
    l_run1 += __shfl_xor_sync(0xffffffffu, l_run1, 1);
    l_run0 += __shfl_xor_sync(0xffffffffu, l_run0, 2);
    l_run1 += __shfl_xor_sync(0xffffffffu, l_run1, 2);
    if (c4 == 0) {
      l_sm[kp * BM + smi * 16 + g] = l_run0;
      l_sm[kp * BM + smi * 16 + g + 8] = l_run1;
      if (kp == 0) {
        m_sm[smi * 16 + g] = m_run0;
        m_sm[smi * 16 + g + 8] = m_run1;
      }
    }
  }
  __syncthreads();

  if (SPLIT == 0 || a.num_splits == 1) {
    // ---- epilogue: warp writes its 64 columns of every live row (bf16).  The split kernel keeps this
    // branch too (never taken there): without it ptxas spilled 16 B in sm_120's `<2, 1>`.
    store_output<G, MI>(a, o_acc, l_sm, m_sm, rq_sm->q_start, row0, M, H, nmi, warp, g, c4);
  } else {
    // ---- split epilogue: the O partial (fp32, scaled by 1 / l) and the log2 LSE of every live row.  A
    // CTA's rows are consecutive workspace rows (q_start * H + row0 + lr).  Each warp stages its 64 columns
    // of 32 rows at a time in the free KV stages (its own region: __syncwarp orders it) and stores them
    // back as whole 256-byte row slices (two 128-byte lines per half-warp store) instead of 32-byte pieces
    // of eight rows per store: up to 15 % faster on split shapes, none slower beyond noise
    // (bench/results/verify-2026-11-30.md, session 9).
    const int64_t R = (int64_t)a.total_tokens * H;
    const int64_t wrow0 = rq_sm->q_start * H + row0;
    if (tid < BM) {  // per row: 1 / l -> alpha_sm (free after the loop), the LSE -> workspace
      const int lr = tid;
      if (lr < nmi * 16 && row0 + lr < M) {
        const float l = row_l<G>(l_sm, lr);
        alpha_sm[lr] = row_inv(l);
        a.workspace[(int64_t)a.num_splits * R * D_V + (int64_t)split * R + wrow0 + lr] = row_lse2(l, m_sm[lr]);
      }
    }
    __syncthreads();
    float* stage = reinterpret_cast<float*>(smem) + warp * (32 * EPI_PITCH);
    float* wo = a.workspace + ((int64_t)split * R + wrow0) * D_V + warp * 64 + (lane & 15) * 4;
#pragma unroll
    for (int half = 0; half < MI / 2; ++half) {
#pragma unroll
      for (int m2 = 0; m2 < 2; ++m2) {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          float* sp = stage + (m2 * 16 + g) * EPI_PITCH + n * 8 + 2 * c4;
          *reinterpret_cast<float2*>(sp) = make_float2(o_acc[half * 2 + m2][n][0], o_acc[half * 2 + m2][n][1]);
          *reinterpret_cast<float2*>(sp + 8 * EPI_PITCH) =
              make_float2(o_acc[half * 2 + m2][n][2], o_acc[half * 2 + m2][n][3]);
        }
      }
      __syncwarp();
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const int rr = 2 * k + (lane >> 4), lr = half * 32 + rr;
        if (lr < nmi * 16 && row0 + lr < M) {
          const float inv = alpha_sm[lr];
          float4 v = *reinterpret_cast<const float4*>(stage + rr * EPI_PITCH + (lane & 15) * 4);
          v.x *= inv; v.y *= inv; v.z *= inv; v.w *= inv;
          *reinterpret_cast<float4*>(wo + (int64_t)lr * D_V) = v;
        }
      }
      __syncwarp();
    }
  }
  MTV_STAMP_CTA(3);
}

}  // namespace mtv

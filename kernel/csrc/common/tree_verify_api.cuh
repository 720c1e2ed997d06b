// Host launchers (extern "C") shared by every target; included once per build.
#pragma once
#include <cuda_runtime.h>

#include "mla_tree_verify.h"
#include "tree_verify_fwd.cuh"

namespace mtv {
enum ArgError : int { ARG_NULL = -1, ARG_SPLITS = -2, ARG_WORKSPACE = -3, ARG_SIZES = -4 };
}

extern "C" int64_t mtv_workspace_floats(int32_t total_tokens, int32_t heads, int32_t num_splits) {
  if (num_splits <= 1) return 0;
  return (int64_t)num_splits * total_tokens * heads * (mtv::D_V + 1);
}
#ifdef MTV_TIMING
// diagnostic build only (bench/kernel_phases.py): copy the timing stamps to host memory (which: 0 CTA,
// 1 iterations, 2 combine), or zero them
extern "C" int mtv_read_timing(void* host, int which) {
  if (which == 0) return (int)cudaMemcpyFromSymbol(host, mtv::mtv_t_cta, sizeof(mtv::mtv_t_cta));
  if (which == 1) return (int)cudaMemcpyFromSymbol(host, mtv::mtv_t_iter, sizeof(mtv::mtv_t_iter));
  return (int)cudaMemcpyFromSymbol(host, mtv::mtv_t_comb, sizeof(mtv::mtv_t_comb));
}
extern "C" int mtv_clear_timing(void) {
  void* p = nullptr;
  cudaError_t e = cudaGetSymbolAddress(&p, mtv::mtv_t_cta);
  if (e == cudaSuccess) e = cudaMemset(p, 0, sizeof(mtv::mtv_t_cta));
  if (e == cudaSuccess) e = cudaGetSymbolAddress(&p, mtv::mtv_t_iter);
  if (e == cudaSuccess) e = cudaMemset(p, 0, sizeof(mtv::mtv_t_iter));
  if (e == cudaSuccess) e = cudaGetSymbolAddress(&p, mtv::mtv_t_comb);
  if (e == cudaSuccess) e = cudaMemset(p, 0, sizeof(mtv::mtv_t_comb));
  return (int)e;
}
#endif
extern "C" int mtv_block_m(void) { return mtv::BM; }
extern "C" int mtv_max_splits(void) { return mtv::MAX_SPLITS; }
extern "C" int mtv_smem_bytes(void) { return mtv::SMEM_BYTES; }

extern "C" const char* mtv_error_string(int code) {
  switch (code) {
    case 0: return "ok";
    case mtv::ARG_NULL: return "a required pointer is NULL";
    case mtv::ARG_SPLITS: return "num_splits outside [1, mtv_max_splits()]";
    case mtv::ARG_WORKSPACE: return "workspace too small for num_splits";
    case mtv::ARG_SIZES: return "negative or zero size (batch, heads, max_q_len)";
    default: return cudaGetErrorString(static_cast<cudaError_t>(code));
  }
}

namespace mtv {
// Launch `kernel` as a programmatic dependent of the kernel before it on the stream (sm_90+): its CTAs may
// start while that kernel's last CTAs finish, and wait (griddepcontrol.wait) before their first global read
// or write.  The forward kernel waits at its very start, so any kernel may precede it; the combine waits before
// reading the partials (the forward kernel triggers after its KV loop).  Falls back to a plain launch where
// the attribute is refused.  MTV_NO_PDL: plain launches only; MTV_NO_FWD_PDL: the forward kernel's only.
inline cudaError_t launch_pdl(void (*kernel)(const MtvArgs), dim3 grid, dim3 block, int smem, const MtvArgs& a,
                              cudaStream_t st, bool pdl) {
#ifndef MTV_NO_PDL
  if (pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = (size_t)smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaLaunchKernelEx(&cfg, kernel, a) == cudaSuccess) return cudaSuccess;
    (void)cudaGetLastError();
  }
#else
  (void)pdl;
#endif
  kernel<<<grid, block, (size_t)smem, st>>>(a);
  return cudaGetLastError();
}
#ifdef MTV_NO_FWD_PDL
constexpr bool FWD_PDL = false;
#else
constexpr bool FWD_PDL = true;
#endif
}  // namespace mtv

// Launch configuration depends only on (num_splits, max_q_len, heads, batch, total_tokens):
// static under CUDA-graph replay.  No allocation, no synchronisation, no device reads.
extern "C" int mtv_tree_verify(const MtvArgs* args, void* stream) {
  const MtvArgs& a = *args;
  if (!a.q || !a.k_draft || !a.kv_buffer || !a.qo_indptr || !a.kv_indptr || !a.o || (!a.kv_indices && a.kv_indices_len > 0))
    return mtv::ARG_NULL;
  if (a.custom_mask && !a.mask_indptr) return mtv::ARG_NULL;
  if (a.batch < 0 || a.heads <= 0 || a.max_q_len < 0 || a.total_tokens < 0) return mtv::ARG_SIZES;
  if (a.num_splits < 1 || a.num_splits > mtv::MAX_SPLITS) return mtv::ARG_SPLITS;
  if (a.num_splits > 1 &&
      (!a.workspace || a.workspace_floats < mtv_workspace_floats(a.total_tokens, a.heads, a.num_splits)))
    return mtv::ARG_WORKSPACE;
  if (a.batch == 0 || a.total_tokens == 0 || a.max_q_len == 0) return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  static bool attr_done = false;  // benign race: setting the attribute twice is harmless
  if (!attr_done) {
    for (const void* k : {(const void*)mtv::mtv_fwd_kernel<2, 0>, (const void*)mtv::mtv_fwd_kernel<2, 1>,
                          (const void*)mtv::mtv_fwd_kernel<4, 0>, (const void*)mtv::mtv_fwd_kernel<4, 1>}) {
      const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, mtv::SMEM_BYTES);
      if (e != cudaSuccess) return e;
    }
    attr_done = true;
  }
  const int64_t m_tiles = ((int64_t)a.max_q_len * a.heads + mtv::BM - 1) / mtv::BM;
  if (m_tiles > 65535 || a.batch > 65535) return mtv::ARG_SIZES;
  dim3 grid(a.num_splits, (unsigned)m_tiles, a.batch);
  // at most 32 rows per request (one CTA, <= 2 live m16 tiles): every warp works in the S phase
  // (and the epilogue: fp32 partials for the combine when the KV is split, else the bf16 output)
  const bool quarter = (int64_t)a.max_q_len * a.heads <= mtv::QUARTER_MAX_ROWS, split = a.num_splits > 1;
  auto kernel = quarter ? (split ? mtv::mtv_fwd_kernel<4, 1> : mtv::mtv_fwd_kernel<4, 0>)
                        : (split ? mtv::mtv_fwd_kernel<2, 1> : mtv::mtv_fwd_kernel<2, 0>);
  cudaError_t e = mtv::launch_pdl(kernel, grid, dim3(mtv::NTHREADS), mtv::SMEM_BYTES, a, st, mtv::FWD_PDL);
  if (e != cudaSuccess) return e;
  if (a.num_splits > 1) {
    const int64_t rows = (int64_t)a.total_tokens * a.heads;
    // column slices per row: enough CTAs (and loads in flight) when few rows carry many splits
    const int64_t slices = rows >= 1024 ? 1 : rows >= 512 ? 2 : rows >= 256 ? 4 : 8;
    void (*combine)(const MtvArgs) = slices == 1   ? mtv::mtv_combine_kernel<1>
                                     : slices == 2 ? mtv::mtv_combine_kernel<2>
                                     : slices == 4 ? mtv::mtv_combine_kernel<4>
                                                   : mtv::mtv_combine_kernel<8>;
    // (launch_pdl reports its launch's error itself: reading cudaGetLastError again here would
    // find it already cleared)
    e = mtv::launch_pdl(combine, dim3((unsigned)rows, (unsigned)slices), dim3(128), 0, a, st, true);
    if (e != cudaSuccess) return e;
  }
  return 0;
}

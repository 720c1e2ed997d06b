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
    cudaError_t e = cudaFuncSetAttribute(mtv::mtv_fwd_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         mtv::SMEM_BYTES);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(mtv::mtv_fwd_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, mtv::SMEM_BYTES);
    if (e != cudaSuccess) return e;
    attr_done = true;
  }
  const int64_t m_tiles = ((int64_t)a.max_q_len * a.heads + mtv::BM - 1) / mtv::BM;
  if (m_tiles > 65535 || a.batch > 65535) return mtv::ARG_SIZES;
  dim3 grid(a.num_splits, (unsigned)m_tiles, a.batch);
  // at most 32 rows per request (one CTA, <= 2 live m16 tiles): every warp works in the S phase
  if ((int64_t)a.max_q_len * a.heads <= mtv::QUARTER_MAX_ROWS)
    mtv::mtv_fwd_kernel<4><<<grid, mtv::NTHREADS, mtv::SMEM_BYTES, st>>>(a);
  else
    mtv::mtv_fwd_kernel<2><<<grid, mtv::NTHREADS, mtv::SMEM_BYTES, st>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if (a.num_splits > 1) {
    const int64_t rows = (int64_t)a.total_tokens * a.heads;
    mtv::mtv_combine_kernel<<<(unsigned)rows, 128, 0, st>>>(a);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return 0;
}

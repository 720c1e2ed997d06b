// mla_tree_verify: C ABI of the MLA tree-verify attention kernel (torch-free).
// All pointers are device pointers; strides are in elements; the stream is a cudaStream_t.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct MtvArgs {
  const void* q;            // bf16 [total_tokens, heads, 576], last dim contiguous
  int64_t q_s0, q_s1;       // token / head strides
  const void* k_draft;      // bf16 [total_tokens, 1, 576] (v = first 512 columns)
  int64_t kd_s0;            // token stride
  const void* kv_buffer;    // bf16 [num_slots, 1, 576]
  int64_t kv_s0;            // slot stride
  int64_t num_slots;
  const void* qo_indptr;    // int32/int64 [batch+1]
  const void* kv_indptr;    // int32/int64 [batch+1]
  const void* kv_indices;   // int32/int64 [>= kv_indptr[batch]]
  const void* custom_mask;  // uint8/bool flattened FULL_MASK or NULL (causal among drafts)
  const void* mask_indptr;  // int32/int64 [batch+1] or NULL
  int32_t qo_is64, kvp_is64, kvi_is64, mp_is64;
  int64_t kv_indices_len, mask_len;
  void* o;                  // bf16 [total_tokens, heads, 512], last dim contiguous
  int64_t o_s0, o_s1;
  float* lse;               // fp32 [total_tokens, heads] natural-log LSE, or NULL
  int64_t lse_s0, lse_s1;
  float* workspace;         // fp32, >= mtv_workspace_floats(...) floats when num_splits > 1
  int64_t workspace_floats;
  int32_t* error_flag;      // int32 [1] device memory, bits OR-ed in (see README)
  int32_t batch, total_tokens, heads, max_q_len, num_splits;
  float sm_scale;
  int32_t* nonfinite_flag;  // int32 [1] device memory or NULL: set to 1 when an output element is NaN or +-Inf
} MtvArgs;

// Launches the kernel(s) on `stream`. Returns 0 or a cudaError_t / negative argument code.
int mtv_tree_verify(const MtvArgs* args, void* stream);
int64_t mtv_workspace_floats(int32_t total_tokens, int32_t heads, int32_t num_splits);
int mtv_block_m(void);
int mtv_max_splits(void);
int mtv_smem_bytes(void);
const char* mtv_error_string(int code);

#ifdef __cplusplus
}
#endif

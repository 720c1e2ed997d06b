// Single translation unit of the shared library; compiled once per target
// (-gencode sm_90, sm_120, compute_120 PTX).  Per-target configuration lives in
// sm120/config.cuh and sm90/config.cuh; both use the same tile shape today.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#include "sm120/config.cuh"
#else
#include "sm90/config.cuh"
#endif
#include "common/tree_verify_api.cuh"

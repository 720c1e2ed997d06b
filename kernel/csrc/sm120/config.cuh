// sm_120 (RTX PRO 6000 Blackwell workstation): mma.sync only, <= 101376 B smem per block.
#pragma once
#include "../common/tree_verify_fwd.cuh"
static_assert(mtv::SMEM_BYTES <= 101376, "sm_120: dynamic smem per block must be <= 101376 B");

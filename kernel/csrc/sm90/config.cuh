// sm_90 (H100/H200): the same mma.sync kernel (measured there); 227 KB smem per block allowed,
// but the sm_120 budget is kept so both targets run the identical schedule.
#pragma once
#include "../common/tree_verify_fwd.cuh"
static_assert(mtv::SMEM_BYTES <= 232448, "sm_90: dynamic smem per block must be <= 227 KB");
static_assert(mtv::SMEM_BYTES <= 101376, "kept within the sm_120 budget");

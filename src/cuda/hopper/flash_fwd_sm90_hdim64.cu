// Dispatch-table rows of the sm90 forward kernel for head_dim 64 (bf16, f16; causal or not).
// One file per head_dim so the build compiles them in parallel.
#include "cuda/hopper/flash_fwd_sm90.cuh"

namespace ioattn::cuda::sm90 {
using Hdim64Bf16 = Sm90Traits<64, __nv_bfloat16, false>;
using Hdim64Bf16Causal = Sm90Traits<64, __nv_bfloat16, true>;
using Hdim64F16 = Sm90Traits<64, __half, false>;
using Hdim64F16Causal = Sm90Traits<64, __half, true>;
IOATTN_SM90_INSTANTIATE(Hdim64Bf16, false)
IOATTN_SM90_INSTANTIATE(Hdim64Bf16Causal, true)
IOATTN_SM90_INSTANTIATE(Hdim64F16, false)
IOATTN_SM90_INSTANTIATE(Hdim64F16Causal, true)
// 3 consumer warpgroups (192-row tiles): the alternative rows (see Sm90Tile3).
using Hdim64Bf16Wg3 = Sm90Traits3<__nv_bfloat16, false>;
using Hdim64Bf16Wg3Causal = Sm90Traits3<__nv_bfloat16, true>;
using Hdim64F16Wg3 = Sm90Traits3<__half, false>;
using Hdim64F16Wg3Causal = Sm90Traits3<__half, true>;
IOATTN_SM90_INSTANTIATE(Hdim64Bf16Wg3, false)
IOATTN_SM90_INSTANTIATE(Hdim64Bf16Wg3Causal, true)
IOATTN_SM90_INSTANTIATE(Hdim64F16Wg3, false)
IOATTN_SM90_INSTANTIATE(Hdim64F16Wg3Causal, true)
IOATTN_SM90_INSTANTIATE_LOCAL(Hdim64Bf16Wg3Causal)
IOATTN_SM90_INSTANTIATE_CACHE(Hdim64Bf16Wg3Causal)
IOATTN_SM90_INSTANTIATE_LOCAL(Hdim64F16Wg3Causal)
IOATTN_SM90_INSTANTIATE_CACHE(Hdim64F16Wg3Causal)
}  // namespace ioattn::cuda::sm90

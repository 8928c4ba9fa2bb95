// Dispatch-table rows of the sm90 forward kernel for head_dim 256 (bf16, f16; causal or not).
// One file per head_dim so the build compiles them in parallel.
#include "cuda/hopper/flash_fwd_sm90.cuh"

namespace ioattn::cuda::sm90 {
using Hdim256Bf16 = Sm90Traits<256, __nv_bfloat16, false>;
using Hdim256Bf16Causal = Sm90Traits<256, __nv_bfloat16, true>;
using Hdim256F16 = Sm90Traits<256, __half, false>;
using Hdim256F16Causal = Sm90Traits<256, __half, true>;
IOATTN_SM90_INSTANTIATE(Hdim256Bf16, false)
IOATTN_SM90_INSTANTIATE(Hdim256Bf16Causal, true)
IOATTN_SM90_INSTANTIATE(Hdim256F16, false)
IOATTN_SM90_INSTANTIATE(Hdim256F16Causal, true)
IOATTN_SM90_INSTANTIATE_LOCAL(Hdim256Bf16Causal)
IOATTN_SM90_INSTANTIATE_CACHE(Hdim256Bf16Causal)
IOATTN_SM90_INSTANTIATE_LOCAL(Hdim256F16Causal)
IOATTN_SM90_INSTANTIATE_CACHE(Hdim256F16Causal)
}  // namespace ioattn::cuda::sm90

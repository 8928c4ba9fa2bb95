// Dispatch-table rows of the sm90 forward kernel for head_dim 128 (bf16, f16; causal or not).
// One file per head_dim so the build compiles them in parallel.
#include "cuda/hopper/flash_fwd_sm90.cuh"
#include "cuda/hopper/flash_fwd_sm90_v3.cuh"

namespace ioattn::cuda::sm90 {
using Hdim128Bf16 = Sm90Traits<128, __nv_bfloat16, false>;
using Hdim128Bf16Causal = Sm90Traits<128, __nv_bfloat16, true>;
using Hdim128F16 = Sm90Traits<128, __half, false>;
using Hdim128F16Causal = Sm90Traits<128, __half, true>;
IOATTN_SM90_INSTANTIATE(Hdim128Bf16, false)
IOATTN_SM90_INSTANTIATE(Hdim128Bf16Causal, true)
IOATTN_SM90_INSTANTIATE(Hdim128F16, false)
IOATTN_SM90_INSTANTIATE(Hdim128F16Causal, true)
IOATTN_SM90_INSTANTIATE_LOCAL(Hdim128Bf16Causal)
IOATTN_SM90_INSTANTIATE_CACHE(Hdim128Bf16Causal)
IOATTN_SM90_INSTANTIATE_LOCAL(Hdim128F16Causal)
IOATTN_SM90_INSTANTIATE_CACHE(Hdim128F16Causal)
// Q K^T with Q in registers: the causal rows' default.
using Hdim128Bf16CausalQRegs = Sm90TraitsQRegs128<__nv_bfloat16>;
using Hdim128F16CausalQRegs = Sm90TraitsQRegs128<__half>;
IOATTN_SM90_INSTANTIATE(Hdim128Bf16CausalQRegs, true)
IOATTN_SM90_INSTANTIATE(Hdim128F16CausalQRegs, true)
// The v3 body: the non-causal rows' default, and for causal an A/B option (IOATTN_SM90_BODY=v3);
// see flash_fwd_sm90_v3.cuh and the table in flash_fwd_sm90.cu.
IOATTN_SM90_V3_INSTANTIATE(Hdim128Bf16, false)
IOATTN_SM90_V3_INSTANTIATE(Hdim128F16, false)
IOATTN_SM90_V3_INSTANTIATE(Hdim128Bf16Causal, true)
IOATTN_SM90_V3_INSTANTIATE(Hdim128F16Causal, true)
}  // namespace ioattn::cuda::sm90

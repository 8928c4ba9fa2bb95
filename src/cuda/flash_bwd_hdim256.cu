// Instantiates the flash backward kernels for head dim 256 (bf16 and f16: the 8-warp
// tile for devices with 208 KB of shared memory per CTA and the 4-warp fallback); see flash_bwd_launch.cuh.
#include "cuda/flash_bwd_launch.cuh"

namespace ioattn::cuda {
BwdKernelInfo bwd_info_hdim256() { return make_bwd_info<BwdTraits<256>>(); }
BwdKernelInfo bwd_info_hdim256_wide() { return make_bwd_info<BwdTraits256Wide>(); }
}  // namespace ioattn::cuda

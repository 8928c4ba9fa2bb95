// Instantiates the flash backward kernels for head dim 256 (bf16 and f16); see flash_bwd_launch.cuh.
#include "cuda/flash_bwd_launch.cuh"

namespace ioattn::cuda {
BwdKernelInfo bwd_info_hdim256() { return make_bwd_info<BwdTraits<256>>(); }
}  // namespace ioattn::cuda

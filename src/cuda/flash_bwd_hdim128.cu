// Instantiates the flash backward kernels for head dim 128 (bf16 and f16); see flash_bwd_launch.cuh.
#include "cuda/flash_bwd_launch.cuh"

namespace ioattn::cuda {
BwdKernelInfo bwd_info_hdim128() { return make_bwd_info<BwdTraits<128>>(); }
}  // namespace ioattn::cuda

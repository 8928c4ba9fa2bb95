// Instantiates the flash forward kernel for head dim 128 (bf16 and f16); see flash_traits.cuh.
#include "cuda/flash_launch.cuh"
#include "cuda/flash_traits.cuh"

namespace ioattn::cuda {
FlashKernelInfo flash_info_hdim128() { return make_flash_info<FlashTraits<128>>(FlashTraits<128>::kReason); }
}  // namespace ioattn::cuda

// Instantiates the flash forward kernel for head dim 32 (bf16 and f16); see flash_traits.cuh.
#include "cuda/flash_launch.cuh"
#include "cuda/flash_traits.cuh"

namespace ioattn::cuda {
FlashKernelInfo flash_info_hdim32() { return make_flash_info<FlashTraits<32>>(FlashTraits<32>::kReason); }
}  // namespace ioattn::cuda

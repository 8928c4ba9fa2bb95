// Instantiates the flash forward kernel for head dim 192 (bf16 and f16); see flash_traits.cuh.
#include "cuda/flash_launch.cuh"
#include "cuda/flash_traits.cuh"

namespace ioattn::cuda {
FlashKernelInfo flash_info_hdim192() { return make_flash_info<FlashTraits<192>>(FlashTraits<192>::kReason); }
}  // namespace ioattn::cuda

// Instantiates the flash forward kernel for head dim 128 (bf16 and f16), and its KV-cache mode (bf16 / f16 q over
// a same-dtype, f8e4m3 or int8 cache); see flash_traits.cuh.
#include "cuda/flash_launch.cuh"
#include "cuda/flash_traits.cuh"

namespace ioattn::cuda {
FlashKernelInfo flash_info_hdim128() { return make_flash_info<FlashTraits<128>>(FlashTraits<128>::kReason); }
FlashCacheKernelInfo flash_cache_info_hdim128() { return make_flash_cache_info<FlashTraits<128>>(); }
}  // namespace ioattn::cuda

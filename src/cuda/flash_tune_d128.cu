// Tile variants for head dim 128 (ioattn_cuda_tune).
#include "cuda/flash_tune.cuh"
namespace ioattn::cuda::tune {
std::vector<Variant> variants_d128() {
  return {make_variant<FlashTile<128, 128, 64, 4, 1, false>>(), make_variant<FlashTile<128, 128, 32, 4, 2, false>>(),
          make_variant<FlashTile<128, 128, 128, 8, 1, true>>(), make_variant<FlashTile<128, 64, 64, 4, 2, true>>()};
}
}  // namespace ioattn::cuda::tune

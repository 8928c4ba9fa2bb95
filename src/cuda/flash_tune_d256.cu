// Tile variants for head dim 256 (ioattn_cuda_tune).
#include "cuda/flash_tune.cuh"
namespace ioattn::cuda::tune {
std::vector<Variant> variants_d256() {
  return {make_variant<FlashTile<256, 128, 64, 8, 1, false>>(), make_variant<FlashTile<256, 128, 64, 8, 2, false>>(),
          make_variant<FlashTile<256, 64, 64, 4, 1, false>>(), make_variant<FlashTile<256, 128, 32, 8, 2, true>>()};
}
}  // namespace ioattn::cuda::tune

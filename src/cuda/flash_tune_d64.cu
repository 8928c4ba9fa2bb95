// Tile variants for head dim 64 (ioattn_cuda_tune).
#include "cuda/flash_tune.cuh"
namespace ioattn::cuda::tune {
std::vector<Variant> variants_d64() {
  return {make_variant<FlashTile<64, 128, 64, 4, 2, true>>(), make_variant<FlashTile<64, 128, 64, 4, 1, true>>(),
          make_variant<FlashTile<64, 128, 96, 4, 1, false>>(), make_variant<FlashTile<64, 128, 128, 4, 1, false>>()};
}
}  // namespace ioattn::cuda::tune

// flash_tune.cuh — tile variants for tuning FlashTraits (ioattn_cuda_tune only, never in the
// library). Each variant is a FlashTile instantiated for bf16.
#pragma once

#include <string>
#include <vector>

#include "cuda/flash_launch.cuh"

namespace ioattn::cuda::tune {

struct Variant {
  std::string name;
  int head_dim, block_m;
  size_t smem_bytes;
  void (*launch)(const FlashParams& p, cudaStream_t stream);
};

template <class Tr>
Variant make_variant() {
  Variant v;
  v.name = std::to_string(Tr::kBlockM) + "x" + std::to_string(Tr::kBlockN) + " w" + std::to_string(Tr::kWarps) +
           (Tr::kQInRegs ? " qreg" : " qsmem") + " s" + std::to_string(Tr::kStages);
  v.head_dim = Tr::kHeadDim;
  v.block_m = Tr::kBlockM;
  v.smem_bytes = Tr::kSmemBytes;
  v.launch = [](const FlashParams& p, cudaStream_t st) {
    launch_flash_fwd<Tr, __nv_bfloat16>(p, st, static_cast<int64_t>(p.num_m_blocks) * p.heads_q * p.batch);
  };
  return v;
}

std::vector<Variant> variants_d64();
std::vector<Variant> variants_d128();
std::vector<Variant> variants_d256();

}  // namespace ioattn::cuda::tune

// Backward tile candidates for head dim 256 (ioattn_cuda_bwd_tune; see flash_bwd_tune.cuh).
// BwdTile<d, kBlockM, warps, minCTAs/SM, dQ-kernel keys, dQ-kernel warps, dQ-kernel CTAs/SM, col splits>;
// the dQ-kernel fields only matter in deterministic mode, which the sweep does not run.
// smem (atomic mode) = (2 kBlockN + 4 kBlockM) x 528 B + 16 kBlockM + kBlockN x (kBlockM + 8) x 2 B.
// Every candidate splits columns over 2 CTAs (dK+dV of 256 columns would need 256 regs/thread).
#include "cuda/flash_bwd_tune.cuh"
namespace ioattn::cuda::bwd_tune {
std::vector<Candidate> candidates_d256() {
  return {
      // BwdTraits<256> (the fallback below 208 KB of smem): 64 keys x 32 rows, 4 warps, 137 KB: 4 warps per SM
      make_candidate<BwdTile<256, 32, 4, 1, 32, 4, 1, 2>>(),
      // BwdTraits256Wide (shipped on sm_90): 128 keys x 32 rows, 8 warps, 208 KB: 8 warps/SM, half the Q/dO reads per key
      make_candidate<BwdTile<256, 32, 8, 1, 32, 4, 1, 2>>(),
      // 64 keys x 64 rows, 4 warps, 208 KB: S^T+dP^T 64 regs next to the 128 of dK+dV
      make_candidate<BwdTile<256, 64, 4, 1, 32, 4, 1, 2>>(),
  };
}
}  // namespace ioattn::cuda::bwd_tune

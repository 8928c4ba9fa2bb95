// Backward tile candidates for head dim 128 (ioattn_cuda_bwd_tune; see flash_bwd_tune.cuh).
// BwdTile<d, kBlockM, warps, minCTAs/SM, dQ-kernel keys, dQ-kernel warps, dQ-kernel CTAs/SM, col splits>;
// the dQ-kernel fields only matter in deterministic mode, which the sweep does not run.
// smem (atomic mode) = (2 kBlockN + 4 kBlockM) x 272 B + 16 kBlockM + kBlockN x (kBlockM + 8) x 2 B;
// 128x128 (240 KB) does not fit the 227 KB of an sm_90 CTA.
#include "cuda/flash_bwd_tune.cuh"
namespace ioattn::cuda::bwd_tune {
std::vector<Candidate> candidates_d128() {
  return {
      // shipped: 128 keys x 64 rows, 8 warps, 155 KB; ptxas: 255 regs + a small spill
      make_candidate<BwdTile<128, 64, 8, 1, 64, 4, 2>>(),
      // 32-row steps: S^T+dP^T 32 regs instead of 64 (no spill), Q/dO tiles half the size, 112 KB
      make_candidate<BwdTile<128, 32, 8, 1, 64, 4, 2>>(),
      // 64 keys x 64 rows, 4 warps, 112 KB: 2 CTAs/SM (255-reg cap still), twice the Q/dO reads per key
      make_candidate<BwdTile<128, 64, 4, 2, 64, 4, 2>>(),
      // 64 keys x 32 rows, 4 warps, 74 KB: 2 CTAs/SM at 255 regs ...
      make_candidate<BwdTile<128, 32, 4, 2, 64, 4, 2>>(),
      // ... or 3 (12 warps/SM) capped at 168 regs: dK+dV alone take 128, so ptxas spills ~300 B
      make_candidate<BwdTile<128, 32, 4, 3, 64, 4, 2>>(),
  };
}
}  // namespace ioattn::cuda::bwd_tune

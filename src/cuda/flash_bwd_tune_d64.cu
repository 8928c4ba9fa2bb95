// Backward tile candidates for head dim 64 (ioattn_cuda_bwd_tune; see flash_bwd_tune.cuh).
// BwdTile<d, kBlockM, warps, minCTAs/SM, dQ-kernel keys, dQ-kernel warps, dQ-kernel CTAs/SM, col splits>;
// the dQ-kernel fields only matter in deterministic mode, which the sweep does not run.
// smem (atomic mode) = (2 kBlockN + 4 kBlockM) x 144 B + 16 kBlockM + kBlockN x (kBlockM + 8) x 2 B.
#include "cuda/flash_bwd_tune.cuh"
namespace ioattn::cuda::bwd_tune {
std::vector<Candidate> candidates_d64() {
  return {
      // 128 keys x 64 rows, 91 KB (shipped before the 2026-11-29 sweep); 253 regs, so 1 CTA (8 warps) per SM
      make_candidate<BwdTile<64, 64, 8, 1, 64, 4, 2>>(),
      // same tile capped at 128 regs: 2 CTAs/SM (16 warps), 2 x 92 KB smem; ptxas spills ~600 B
      make_candidate<BwdTile<64, 64, 8, 2, 64, 4, 2>>(),
      // shipped: FlashAttention-2's hdim64 backward block: 128 keys x 128 rows (S^T+dP^T 128 regs), 144 KB
      make_candidate<BwdTile<64, 128, 8, 1, 64, 4, 2>>(),
      // 64 keys x 64 rows, 4 warps, 64 KB: 3 CTAs/SM (168-reg cap), 12 warps/SM
      make_candidate<BwdTile<64, 64, 4, 3, 64, 4, 2>>(),
      // 64 keys x 32 rows, 4 warps, 42 KB: 4 CTAs/SM (128-reg cap: S^T+dP^T only 32 regs), 16 warps/SM
      make_candidate<BwdTile<64, 32, 4, 4, 64, 4, 2>>(),
  };
}
}  // namespace ioattn::cuda::bwd_tune

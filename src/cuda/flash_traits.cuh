// flash_traits.cuh — the dispatch table of the mma.sync flash forward: one traits struct per
// head dim, each with the reason for its tile written next to it. Only these are instantiated
// (x2 dtypes = 12 kernels); any head_dim that is a multiple of 8 runs on the next size up.
//
// Budget on sm_80/sm_90 (H100/H200): 255 registers per thread at 2 CTAs x 4 warps or 1 CTA x 8
// warps per SM; 227 KB of shared memory per CTA on Hopper, 163 KB on A100 (every tile below
// fits both). The K/V ring depth is part of the tile: 2 stages where it costs no registers,
// 1 (FlashAttention-2's schedule) where a second stage measured no faster. A warp that owns 32 rows (2 row tiles) reuses
// every K/V fragment it loads from shared memory twice, halving ldmatrix traffic per mma — on
// Hopper, shared-memory bandwidth, not the mma pipe, is what caps an mma.sync attention kernel,
// so 32 rows/warp wins wherever the fp32 accumulators still fit in registers.
#pragma once

#include "cuda/flash_fwd.cuh"

namespace ioattn::cuda {

template <int kHeadDim>
struct FlashTraits;

template <>
struct FlashTraits<32> : FlashTile<32, 128, 128, 4, 2, false> {
  static constexpr const char* kReason =
      "hdim32: O is tiny (32 regs), so 32 rows/warp x 128 keys per step (S = 128 regs) amortises "
      "the softmax and loop overhead; Q read from smem (in registers it spills); 2 CTAs/SM";
};

template <>
struct FlashTraits<64> : FlashTile<64, 128, 128, 4, 1, false> {
  static constexpr const char* kReason =
      "hdim64: 32 rows/warp x 128 keys (S 128 + O 64 regs) halves K/V ldmatrix per mma and "
      "amortises the softmax over more keys; Q read from smem to stay under 255 regs; 1-stage "
      "ring, 2 CTAs/SM (H200 sweep 2026-11-29, 16k: 308 TFLOP/s vs 301 for 128x64 Q in regs)";
};

template <>
struct FlashTraits<96> : FlashTile<96, 128, 64, 4, 2, false> {
  static constexpr const char* kReason =
      "hdim96: 32 rows/warp (O 96 + S 64 regs) x 64 keys; Q read from smem; 2 CTAs/SM";
};

template <>
struct FlashTraits<128> : FlashTile<128, 128, 64, 4, 1, false> {
  static constexpr const char* kReason =
      "hdim128: 32 rows/warp (O 128 + S 64 regs) x 64 keys is the largest tile under 255 regs "
      "(H200 sweep: 299 TFLOP/s at 8k vs 243 for 128x32, 229 for 128x128x8 warps); Q read from "
      "smem; 1-stage ring (a 2nd stage measured equal and pushes ptxas into spills); 2 CTAs/SM";
};

template <>
struct FlashTraits<192> : FlashTile<192, 128, 64, 8, 1, true> {
  static constexpr const char* kReason =
      "hdim192: O = 192 regs at 32 rows/warp would spill, so 8 warps x 16 rows (O 96 + S 32 + "
      "Q 48 regs, Q kept in registers); 1-stage ring (104 KB, fits sm_80 too); 1 CTA/SM";
};

template <>
struct FlashTraits<256> : FlashTile<256, 128, 64, 8, 1, false> {
  static constexpr const char* kReason =
      "hdim256: 8 warps x 16 rows (O 128 + S 32 regs); Q (64 regs) read from smem (H200 sweep: "
      "238 TFLOP/s at 8k vs 221 for 64x64x4 warps, 215 for 128x32 Q in regs); 1-stage ring "
      "(135 KB, measured equal to 2 stages and fits sm_80's 163 KB); 1 CTA/SM";
};

}  // namespace ioattn::cuda

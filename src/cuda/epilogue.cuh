// Epilogue stores of tensor-core accumulators: the sm90 kernels' O (forward) and dK / dV (backward),
// and, behind IOATTN_SM80_EPI_VEC, the mma.sync kernels' (flash_fwd.cuh, flash_bwd.cuh).
//
// A wgmma m64nN fp32 accumulator gives lane l of a warp rows 16 w + l / 4 (+ 8) of its warpgroup's
// tile and, per row, the element pairs at columns 8 i + 2 (l % 4) (+ 1): acc[4 i + 2 r], acc[4 i +
// 2 r + 1] for row half r. An mma.sync m16n8 C fragment per 8-column tile i is the same (c0, c1 at
// row l / 4, c2, c3 at row l / 4 + 8), so a warp's [tiles][4] array, flattened, has that layout
// too. Stored as they are, each warp instruction writes 4 bytes per lane, 16 bytes of each of 8
// rows. store_acc_row first transposes 4 x 4 blocks of those 32-bit words inside each quad so that
// a lane holds 8 consecutive columns and writes them as one 16-byte vector: a quarter of the store
// instructions, whole 32-byte sectors (session 36: the forward's epilogue went from ~3,600 to
// ~2,600 cycles per hdim-128 tile; docs/PERF.md "Session 36").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ptx.cuh"  // pack2

namespace ioattn::cuda {

// Whether a tensor's base and strides (elements of T) allow store_acc_row's 16-byte vectors
// (warp-uniform; evaluate once per CTA).
template <class T>
__device__ __forceinline__ bool vec16_ok(const void* base, int64_t s0, int64_t s1, int64_t s2) {
  return ((reinterpret_cast<uintptr_t>(base) | static_cast<uint64_t>(s0 | s1 | s2) * sizeof(T)) & 15) == 0;
}

// One accumulator row (r = 0 / 1: this thread's rows m and m + 8) of kCols columns times mul, in
// Out, to row (the row's column 0). With vec the quad transposes each 4 x 4 block of 32-bit words
// (lanes q and q ^ 2 swap the off-diagonal 2 x 2 blocks, then lanes q and q ^ 1 the off-diagonal
// words of each block), so lane q holds columns 32 g + 8 q .. + 7; every lane of the warp must call
// it then (shuffles). Without vec: the element pairs as they are (row and strides need 4-byte
// alignment only). `in` masks the stores (rows past the sequence, padding rows).
template <class Out, int kCols>
__device__ __forceinline__ void store_acc_row(Out* row, const float* acc, int r, float mul, int lane, bool vec,
                                              bool in) {
  static_assert(kCols % 32 == 0, "16-byte groups of 4 column pairs per lane");
  const int q = lane & 3;
  if (vec) {
#pragma unroll
    for (int g = 0; g < kCols / 32; ++g) {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        w[k] = ptx::pack2<Out>(acc[4 * (4 * g + k) + 2 * r] * mul, acc[4 * (4 * g + k) + 2 * r + 1] * mul);
#pragma unroll
      for (int j = 0; j < 2; ++j) {  // lanes q, q ^ 2: words j (lanes 2, 3) <-> words 2 + j (lanes 0, 1)
        const uint32_t got = __shfl_xor_sync(0xffffffffu, (q & 2) ? w[j] : w[2 + j], 2);
        if (q & 2) w[j] = got; else w[2 + j] = got;
      }
#pragma unroll
      for (int j = 0; j < 4; j += 2) {  // lanes q, q ^ 1: words j (odd lanes) <-> words j + 1 (even lanes)
        const uint32_t got = __shfl_xor_sync(0xffffffffu, (q & 1) ? w[j] : w[j + 1], 1);
        if (q & 1) w[j] = got; else w[j + 1] = got;
      }
      if (in) *reinterpret_cast<uint4*>(row + 32 * g + 8 * q) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return;
  }
  if (in) {
#pragma unroll
    for (int i = 0; i < kCols / 8; ++i)
      *reinterpret_cast<uint32_t*>(row + 8 * i + 2 * q) =
          ptx::pack2<Out>(acc[4 * i + 2 * r] * mul, acc[4 * i + 2 * r + 1] * mul);
  }
}

}  // namespace ioattn::cuda

// sched_sm90.cuh — the dynamic tile scheduler of the sm90 kernels (persistent grid, balanced).
//
// A persistent CTA takes its first tile statically (blockIdx.x) and every later one from a global
// atomic counter (claim_tile): tiles gridDim.x, gridDim.x + 1, ... go to whichever CTA asks first,
// so CTAs that drew short tiles simply take more of them (causal tiles differ in length by up to
// num_m_blocks x). The counter is one int per launch, allocated and zeroed in stream order before
// the launch (flash_fwd_sm90.cu), so concurrent launches on other streams never share it.
//
// Only the producer thread claims, after issuing the current tile's last K/V load (the claim order
// then follows the order in which CTAs are about to finish). It hands the index to the consumer
// warps with the tile's Q: a shared-memory slot written before its arrival on the Q barrier
// (release) and read by the consumers after their wait on it (acquire); the consumers' arrivals
// on the Q-free barrier tell it when the slot may be rewritten (see flash_fwd_sm90.cuh).
// Tested on the GPU by test_ptx_sm90.cu ("dynamic tile claim + Q handshake").
#pragma once

namespace ioattn::cuda::sm90 {

// The next tile of a dynamically scheduled persistent grid (tiles below gridDim.x are the CTAs'
// first ones). `counter` starts the launch at 0.
__device__ __forceinline__ int claim_tile(int* counter) {
  return static_cast<int>(gridDim.x) + atomicAdd(counter, 1);
}

}  // namespace ioattn::cuda::sm90

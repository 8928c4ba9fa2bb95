// ioattn_cuda_redbw — the device's ceiling for fp32 reductions into global memory (the backward's dQ
// accumulation), session 19. Every CTA adds 64 KB per iteration into its own rows of a 1 GB buffer
// (256 fp32 per row, as the hdim-256 dQ workspace), 200 iterations, 132 and 264 CTAs:
//   red.v2 kernel pattern  the hdim-256 dK/dV kernel's fragment: each warp instruction 8 rows x 32 B
//   red.v2 contiguous      each warp instruction 256 contiguous bytes
//   red.v4 contiguous      512 contiguous bytes (red.global.add.v4.f32, sm_90)
//   st.v4 contiguous       plain stores, for the write bandwidth beside them
//   bulk reduce 64KB       cp.reduce.async.bulk.global.shared::cta.add.f32 from shared memory, 8 KB
//                          per instruction, one thread per CTA
// Output: TB/s of reduced bytes per form. H200 (session 19): 1.06 / 1.44 / 1.44 / 4.3 / 1.44 TB/s,
// which is why the hdim-256 backward gets dQ from a second pass instead of reductions.
#include <cstdio>
#include <cuda_runtime.h>
#include <cstdint>
__global__ void k_red(float* buf, int64_t rows, int iters, int mode) {
  const int tid = threadIdx.x, w = (tid & 127) >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3, wg = tid >> 7;
  for (int it = 0; it < iters; ++it) {
    int64_t blk = (static_cast<int64_t>(it) * gridDim.x + blockIdx.x) % (rows / 64);
    float* ws = buf + (blk * 64 + 16 * w + g) * 256 + 128 * wg + 2 * t;
    if (mode == 0) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(ws + 8 * i), "f"(1.f), "f"(2.f) : "memory");
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(ws + 8 * 256 + 8 * i), "f"(1.f), "f"(2.f) : "memory");
      }
    } else if (mode == 1) {  // rows contiguous per warp: each warp instr covers 256 contiguous bytes
      float* p = buf + blk * 64 * 256 + tid * 2;
#pragma unroll
      for (int i = 0; i < 32; ++i)
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p + 512 * i), "f"(1.f), "f"(2.f) : "memory");
    } else if (mode == 2) {  // v4 contiguous
      float* p = buf + blk * 64 * 256 + tid * 4;
#pragma unroll
      for (int i = 0; i < 16; ++i)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p + 1024 * i), "f"(1.f), "f"(2.f), "f"(1.f), "f"(2.f) : "memory");
    } else {  // plain stores (the write bandwidth for comparison)
      float* p = buf + blk * 64 * 256 + tid * 4;
#pragma unroll
      for (int i = 0; i < 16; ++i) *reinterpret_cast<float4*>(p + 1024 * i) = make_float4(1, 2, 3, 4);
    }
  }
}
__global__ void k_bulk(float* buf, int64_t rows, int iters) {  // cp.reduce.async.bulk from smem, 64 KB per iteration
  extern __shared__ __align__(128) float sm[];
  for (int i = threadIdx.x; i < 16384; i += blockDim.x) sm[i] = 1.f;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int it = 0; it < iters; ++it) {
      int64_t blk = (static_cast<int64_t>(it) * gridDim.x + blockIdx.x) % (rows / 64);
      float* dst = buf + blk * 64 * 256;
      for (int c = 0; c < 8; ++c) {
        uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(sm + c * 2048));
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], 8192;" ::"l"(dst + c * 2048), "r"(s) : "memory");
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}
int main() {
  const int64_t rows = 1 << 20;  // 1 GB
  float* buf;
  cudaMalloc(&buf, rows * 256 * 4);
  cudaMemset(buf, 0, rows * 256 * 4);
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  cudaFuncSetAttribute(k_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
  const char* names[5] = {"red.v2 kernel pattern", "red.v2 contiguous", "red.v4 contiguous", "st.v4 contiguous", "bulk reduce 64KB"};
  for (int ctas : {132, 264}) for (int mode = 0; mode < 5; ++mode) {
    const int iters = 200;
    for (int rep = 0; rep < 2; ++rep) {
      cudaEventRecord(a);
      if (mode < 4) k_red<<<ctas, 256>>>(buf, rows, iters, mode); else k_bulk<<<ctas, 128, 65536>>>(buf, rows, iters);
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float ms;
      cudaEventElapsedTime(&ms, a, b);
      if (rep) printf("%-24s ctas %d: %.2f TB/s (%.3f ms)\n", names[mode], ctas, (double)ctas * iters * 65536 / (ms * 1e-3) / 1e12, ms);
    }
  }
  printf("err %s\n", cudaGetErrorString(cudaGetLastError()));
}

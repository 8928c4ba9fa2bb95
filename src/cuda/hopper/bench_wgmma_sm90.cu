// bench_wgmma_sm90.cu — ioattn_sm90_wgmma_rate: how fast one SM runs back-to-back wgmmas of the
// shapes the kernels use (gpu-check stage `wgmmarate`; numbers in src/cuda/hopper/NOTES.md).
//
// The backward issues m64n64k16 with both operands in shared memory (S^T, dP^T, dQ) and m64n128k16
// with A from registers (dV, dK); whether the small-N shared-memory form runs at the tensor rate
// decides its next design (session 8). Each configuration: one CTA per SM (200 KB of shared memory
// requested), W warpgroups each issuing R rounds of 8 wgmmas (one commit group per round, at most
// two groups in flight: the pattern of a pipelined GEMM) on zeroed bf16 tiles; cycles from the CTA's
// first barrier to its last warpgroup's final wait, on every SM, mean over SMs. Reported per
// wgmma of the whole SM (all warpgroups' instructions) against the dense bf16 ideal of
// 64·N·16·2 / 4096 FLOP per cycle = N/2 cycles; "B shared" means every warpgroup reads the same
// B tile (the backward's Q / dO), A differs per warpgroup (its K / V rows). "+ st.shared": one more
// warpgroup stores 16 bytes per thread to shared memory (another 64 KB region) as fast as it can
// while the wgmmas run, as the backward's dS^T / dQ-piece stores do; its bytes per cycle are
// reported too.
// Also the backward's and the forward's hdim-128 steps as wgmmas only (bwd_step_kernel,
// fwd_step_kernel; the latter also beside a warpgroup storing its K / V volume).
// Output: one JSON line per configuration. Without a CUDA device: "skipped: no CUDA device".
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/hopper/ptx_sm90.cuh"

using namespace ioattn::cuda::sm90;

#define CHECK_CUDA(call)                                                                  \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));     \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

constexpr int kSmem = 200 * 1024;
constexpr int kRounds = 512;

// Every kernel's start: the first 96 KB of shared memory zeroed (the operand tiles) and visible to
// the async proxy before any wgmma reads them; returns the shared-memory address of smem.
__device__ __forceinline__ uint32_t zeroed_tiles(uint8_t* smem) {
  for (int i = threadIdx.x; i < 96 * 1024 / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  fence_proxy_async();
  __syncthreads();
  return smem_u32(smem);
}

// kMode 0: ss, A and B K-major (S^T = K Q^T); 1: ss, A MN-major (transposed), B MN-major (dQ = dS K
// from dS^T); 2: rs, B MN-major (dV += P^T dO); 3 / 4: e4m3 m64nNk32 ss / rs, K-major (the fp8
// forward's wgmmas; the same N / 2 cycles ideal as bf16 k16).
template <int N, int kMode, int kWGs, bool kTraffic>
__global__ void __launch_bounds__((kWGs + kTraffic) * 128, 1) rate_kernel(long long* cycles, float* sink) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ volatile int s_done;
  __shared__ long long s_end[4];
  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) s_done = 0;
  const uint32_t base = zeroed_tiles(smem);
  const uint32_t a_base = base + wg * 16384;  // A: per warpgroup, 64 rows x 64 dims (8 KB) + room
  const uint32_t b_base = base + 65536;       // B: shared, up to 256 rows x 64 dims (32 KB)
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  uint32_t a_reg[4] = {0u, 0u, 0u, 0u};
  __syncthreads();
  const long long t0 = clock64();
  if (kTraffic && wg == kWGs) {  // the store warpgroup: 16 B per thread per store, until the wgmmas end
    const uint32_t region = base + 98304;
    long long stores = 0;
    for (uint32_t it = 0; s_done == 0; ++it) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t addr = region + (((it * 8 + i) * 2048u + (tid & 127) * 16u) & 65535u);
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(it) : "memory");
      }
      stores += 8;
    }
    if ((tid & 127) == 0) cycles[gridDim.x + blockIdx.x] = stores;  // per thread
    __syncthreads();
    return;
  }
  for (int r = 0; r < kRounds; ++r) {
    wgmma_fence();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int kk = i & 3;
      if constexpr (kMode == 0) {
        Wgmma<N, __nv_bfloat16>::template ss<0>(acc, make_desc_sw128(a_base + kk * 32, 16, 1024),
                                                make_desc_sw128(b_base + kk * 32, 16, 1024), 1);
      } else if constexpr (kMode == 1) {
        Wgmma<N, __nv_bfloat16>::template ss<1, 1>(acc, make_desc_sw128(a_base + kk * 2048, 128 * 128, 1024),
                                                   make_desc_sw128(b_base + kk * 2048, 128 * 128, 1024), 1);
      } else if constexpr (kMode == 2) {
        Wgmma<N, __nv_bfloat16>::template rs<1>(acc, a_reg, make_desc_sw128(b_base + kk * 2048, 64 * 128, 1024), 1);
      } else if constexpr (kMode == 3) {  // e4m3 m64nNk32, both K-major (the fp8 forward's Q K^T)
        WgmmaFp8<N>::ss(acc, make_desc_sw128(a_base + kk * 32, 16, 1024), make_desc_sw128(b_base + kk * 32, 16, 1024), 1);
      } else {  // e4m3 rs, B K-major (the fp8 forward's P V on V^T)
        WgmmaFp8<N>::rs(acc, a_reg, make_desc_sw128(b_base + kk * 32, 16, 1024), 1);
      }
    }
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) reg_fence(acc[i]);
  const long long t1 = clock64();
  if ((tid & 127) == 0) s_end[wg] = t1;
  if (kTraffic) named_barrier_sync(1, kWGs * 128);  // every wgmma warpgroup done, then stop the stores
  if (kTraffic && tid == 0) s_done = 1;
  __syncthreads();
  if (tid == 0) {
    long long e = s_end[0];
    for (int w = 1; w < kWGs; ++w) e = e > s_end[w] ? e : s_end[w];
    cycles[blockIdx.x] = e - t0;
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += acc[i];
  if (s != 0.f) sink[blockIdx.x * blockDim.x + tid] = s;  // never true (zero tiles): keeps acc live
#endif
}

// The wgmma backward's step at hdim 128 without its other instructions (2 warpgroups): per step
// and warpgroup, dQ (8 x ss m64n64, A and B MN-major), S^T and dP^T (8 x ss m64n64 each, K-major)
// as three commit groups, wait, then dV and dK (4 x rs m64n128 each, B MN-major) as two groups,
// wait. Ideal: 2 x (24 x 32 + 8 x 64) = 2,560 cycles per step.
__global__ void __launch_bounds__(256, 1) bwd_step_kernel(long long* cycles, float* sink) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, wg = tid / 128;
  const uint32_t base = zeroed_tiles(smem);
  const uint32_t a_base = base + wg * 16384, b_base = base + 65536;
  float dq[32], s[32], dp[32], dv[64];  // dK's wgmmas accumulate into dv too (registers)
#pragma unroll
  for (int i = 0; i < 32; ++i) dq[i] = s[i] = dp[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) dv[i] = 0.f;
  const uint32_t a_reg[4] = {0u, 0u, 0u, 0u};
  constexpr int kSteps = 128;
  __syncthreads();
  const long long t0 = clock64();
  for (int r = 0; r < kSteps; ++r) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      Wgmma<64, __nv_bfloat16>::template ss<1, 1>(dq, make_desc_sw128(a_base + (kk & 3) * 2048, 128 * 128, 1024),
                                                  make_desc_sw128(b_base + (kk & 3) * 2048, 128 * 128, 1024), kk > 0);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      Wgmma<64, __nv_bfloat16>::template ss<0>(s, make_desc_sw128(a_base + (kk & 3) * 32, 16, 1024),
                                               make_desc_sw128(b_base + (kk & 3) * 32, 16, 1024), kk > 0);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      Wgmma<64, __nv_bfloat16>::template ss<0>(dp, make_desc_sw128(a_base + 8192 + (kk & 3) * 32, 16, 1024),
                                               make_desc_sw128(b_base + 16384 + (kk & 3) * 32, 16, 1024), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 32; ++i) reg_fence(dq[i]), reg_fence(s[i]), reg_fence(dp[i]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      Wgmma<128, __nv_bfloat16>::template rs<1>(dv, a_reg, make_desc_sw128(b_base + kk * 2048, 64 * 128, 1024), 1);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      Wgmma<128, __nv_bfloat16>::template rs<1>(dv, a_reg, make_desc_sw128(b_base + 16384 + kk * 2048, 64 * 128, 1024), 1);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) reg_fence(dv[i]);
  }
  const long long t1 = clock64();
  __shared__ long long s_end[2];
  if ((tid & 127) == 0) s_end[wg] = t1;
  __syncthreads();
  if (tid == 0) cycles[blockIdx.x] = (s_end[0] > s_end[1] ? s_end[0] : s_end[1]) - t0;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) acc += dq[i] + s[i] + dp[i];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc += dv[i];
  if (acc != 0.f) sink[blockIdx.x * blockDim.x + tid] = acc;
#endif
}

// Launches kernel k on one CTA per SM with `threads` threads twice (warm-up, then timed) and
// returns the mean over SMs of d_cycles[slot * sms + block] for slot 0 and 1 (slot 1: rate_kernel's
// store counts; 0 where a kernel writes none).
struct Timed {
  double cycles, slot1;
};
Timed launch_timed(void (*k)(long long*, float*), int threads, int sms, long long* d_cycles, float* d_sink) {
  CHECK_CUDA(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  for (int rep = 0; rep < 2; ++rep) k<<<sms, threads, kSmem>>>(d_cycles, d_sink);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<long long> c(2 * sms);
  CHECK_CUDA(cudaMemcpy(c.data(), d_cycles, 2 * sms * sizeof(long long), cudaMemcpyDeviceToHost));
  Timed t{0, 0};
  for (int i = 0; i < sms; ++i) t.cycles += static_cast<double>(c[i]), t.slot1 += static_cast<double>(c[sms + i]);
  t.cycles /= sms;
  t.slot1 /= sms;
  return t;
}

// 2^x for x <= 0 on the FMA / ALU pipes: x = n + f (n = round(x) by the 1.5 * 2^23 trick, f in
// [-0.5, 0.5]), 2^f by a degree-3 polynomial (relative error < 1e-4), n added into the exponent
// bits. x is clamped at -126 (2^-126 ~ 1e-38: far below the P values that matter).
__device__ __forceinline__ float exp2_fma(float x) {
  x = fmaxf(x, -126.0f);
  const float t = x + 12582912.0f;  // 1.5 * 2^23: round(x) in the low mantissa bits
  const float f = x - (t - 12582912.0f);
  float p = fmaf(fmaf(fmaf(0.0555041087f, f, 0.240226507f), f, 0.693147182f), f, 1.0f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// MUFU.EX2 throughput beside the tensor core (session 16: the fp8 forward's softmax takes ~1,800
// cycles for 96 exponentials per thread, where 8 cycles per warp instruction and scheduler give
// 768). Warpgroup 0 streams ex2 (16 independent chains per thread, kMufuRounds x 16 per thread).
// kMode 0: alone (128 threads). 1: warpgroup 1 issues fp8 wgmmas (ss m64n192k32, commit groups of
// 8, one in flight) until warpgroup 0 is done. 2: warpgroup 1 streams ex2 too. 3:
// warpgroup 0 alone, but each round of 96 ex2 beside its own 6 rs m64n128k32 fp8 wgmmas issued
// before them and waited for after them (the forward's P V under the softmax). 4: as 1 with
// warpgroup 1's wgmmas rs m64n128k32 (its P V; groups of 12). 5: as 3 with 4 ss m64n192k32 (a Q K^T
// of the same warpgroup writing register accumulators, FA3's order). 6: alone, 4 of the 16 chains
// on the FMA pipe (exp2_fma, a degree-3 polynomial: FlashAttention-4's MUFU offload). 7: 6 beside
// warpgroup 1's ss wgmmas (as 1). Reported: cycles per exponential warp instruction of warpgroup 0
// (ideal 8; 6 for modes 6-7 if the MUFU alone bounds them), and per 96.
constexpr int kMufuRounds = 256;
// Whether warpgroup 1 takes part (its wgmma load or, mode 2, its own ex2 stream): 256 threads, else 128.
constexpr bool mufu_uses_wg1(int mode) { return mode == 1 || mode == 2 || mode == 4 || mode == 7; }
template <int kMode>
__global__ void __launch_bounds__(256, 1) mufu_kernel(long long* cycles, float* sink) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ volatile int s_done;
  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) s_done = 0;
  const uint32_t base = zeroed_tiles(smem);
  __syncthreads();
  if (wg == 1 && kMode != 2) {  // the tensor-core load until told to stop (mode 2: ex2 below)
    float acc[96];
#pragma unroll
    for (int i = 0; i < 96; ++i) acc[i] = 0.f;
    const uint32_t a_reg[4] = {0u, 0u, 0u, 0u};
    while (s_done == 0) {
      wgmma_fence();
      // One group of ~768 tensor cycles per iteration, waited for before the next: with two groups
      // in flight on one accumulator (wait<1>) ptxas serialises every wgmma (C7514), which left
      // session 16's mode-1 rows with a half-idle tensor core.
      if constexpr (kMode == 4) {  // P V-shaped: rs m64n128k32
        float(&acc64)[64] = *reinterpret_cast<float(*)[64]>(acc);
#pragma unroll
        for (int kk = 0; kk < 12; ++kk)
          WgmmaFp8<128>::rs(acc64, a_reg, make_desc_sw128(base + 65536 + (kk % 4) * 32, 16, 1024), 1);
      } else {  // Q K^T-shaped: ss m64n192k32
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
          WgmmaFp8<192>::ss(acc, make_desc_sw128(base + (kk % 4) * 32, 16, 1024),
                            make_desc_sw128(base + 65536 + (kk % 4) * 32, 16, 1024), 1);
      }
      wgmma_commit();
      wgmma_wait<0>();
    }
    wgmma_wait<0>();
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 96; ++i) t += acc[i];
    if (t != 0.f) sink[blockIdx.x * blockDim.x + tid] = t;
    return;
  }
  float x[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = 0.25f + 0.01f * (i + (tid & 7));
  constexpr bool kOwn = kMode == 3 || kMode == 5;
  constexpr int kAcc = kMode == 5 ? 96 : 64;
  float o[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) o[i] = 0.f;
  const uint32_t a_reg[4] = {0u, 0u, 0u, 0u};
  const long long t0 = clock64();
  for (int r = 0; r < kMufuRounds; ++r) {
    if constexpr (kOwn) {
      if (r % 6 == 0) {
        wgmma_fence();
        if constexpr (kMode == 3) {
          float(&o64)[64] = *reinterpret_cast<float(*)[64]>(o);
#pragma unroll
          for (int kk = 0; kk < 6; ++kk) WgmmaFp8<128>::rs(o64, a_reg, make_desc_sw128(base + 65536 + (kk % 4) * 32, 16, 1024), 1);
        } else {
          float(&o96)[96] = *reinterpret_cast<float(*)[96]>(o);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            WgmmaFp8<192>::ss(o96, make_desc_sw128(base + kk * 32, 16, 1024), make_desc_sw128(base + 65536 + kk * 32, 16, 1024), 1);
        }
        wgmma_commit();
      }
    }
    if constexpr (kMode == 6 || kMode == 7) {
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = i % 4 == 3 ? exp2_fma(-x[i]) : exp2_approx(-x[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = exp2_approx(-x[i]);
    }
    if constexpr (kOwn) {
      if (r % 6 == 5) {
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kAcc; ++i) reg_fence(o[i]);
      }
    }
  }
  if constexpr (kOwn) wgmma_wait<0>();
  const long long t1 = clock64();
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
  if (wg == 0 && tid % 128 == 0) s_done = 1;
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) t += x[i];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) t += o[i];
  if (t == 12345.f) sink[blockIdx.x * blockDim.x + tid] = t;  // never (keeps x and o live)
#endif
}

template <int kMode>
void run_mufu(const char* name, int sms, long long* d_cycles, float* d_sink) {
  const double mean = launch_timed(&mufu_kernel<kMode>, mufu_uses_wg1(kMode) ? 256 : 128, sms, d_cycles, d_sink).cycles;
  const double per = mean / (kMufuRounds * 16.0);
  std::printf("{\"config\": \"mufu ex2 %s\", \"cycles_per_ex2_warp_instruction\": %.2f, \"ideal\": 8, "
              "\"cycles_per_96\": %.0f}\n", name, per, per * 96);
}

// The e4m3 packing's conversion (cvt.rn.satfinite.e4m3x2.f32: F2FP.SATFINITE.E4M3.F32.PACK_AB in
// SASS, two fp32 -> two e4m3) beside the exponentials: the fp8 forward packs P with 48 of them per
// 96 exponentials, and its packing phase takes ~190-400 cycles per step (session 17). Warpgroup 0
// alone; kMode 0: 16 independent cvts per round; 1: 16 ex2 per round; 2: 16 ex2 + 8 cvts per round
// (the forward's ratio). Reported: cycles per round (ex2 alone: 128 at 8 cycles each).
template <int kMode>
__global__ void __launch_bounds__(128, 1) cvt_kernel(long long* cycles, float* sink) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int tid = threadIdx.x;
  float x[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = 0.25f + 0.01f * (i + (tid & 7));
  uint32_t acc = 0;
  __syncthreads();
  const long long t0 = clock64();
  for (int r = 0; r < kMufuRounds; ++r) {
    if constexpr (kMode != 0) {
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = exp2_approx(-x[i]);
    }
    if constexpr (kMode != 1) {
#pragma unroll
      for (int i = 0; i < (kMode == 0 ? 16 : 8); ++i) {
        uint16_t h;
        asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(x[i]), "f"(x[(i + 8) % 16]));
        acc ^= h;
      }
    }
  }
  const long long t1 = clock64();
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
  float t = static_cast<float>(acc);
#pragma unroll
  for (int i = 0; i < 16; ++i) t += x[i];
  if (t == 12345.f) sink[blockIdx.x * blockDim.x + tid] = t;
#endif
}

template <int kMode>
void run_cvt(const char* name, int sms, long long* d_cycles, float* d_sink) {
  const double mean = launch_timed(&cvt_kernel<kMode>, 128, sms, d_cycles, d_sink).cycles;
  std::printf("{\"config\": \"e4m3 cvt %s\", \"cycles_per_round\": %.1f, \"ex2_alone_ideal\": 128}\n", name,
              mean / kMufuRounds);
}

void run_bwd_step(int sms, long long* d_cycles, float* d_sink) {
  const double mean = launch_timed(&bwd_step_kernel, 256, sms, d_cycles, d_sink).cycles;
  std::printf("{\"config\": \"bwd step hdim128 (wgmmas only)\", \"cycles_per_step\": %.0f, \"ideal\": 2560, "
              "\"efficiency\": %.3f}\n", mean / 128, 2560.0 / (mean / 128));
}

// The forward's key block at hdim 128 (the causal rows' 128 x 128 tile) as wgmmas only, 2
// warpgroups: per round and warpgroup, S = Q K^T (8 x ss m64n128, K-major) and O += P V (8 x rs
// m64n128, B MN-major), one commit group each, at most two in flight. Ideal: 2 x 16 x 64 = 2,048
// cycles per round. kStores: a third warpgroup stores the block's K and V volume (64 KB: 32 x 16
// bytes per thread) to shared memory each round, standing in for the TMA writes, and all three
// meet at a named barrier per round (the stores then cannot drift ahead or behind).
template <bool kStores>
__global__ void __launch_bounds__(kStores ? 384 : 256, 1) fwd_step_kernel(long long* cycles, float* sink) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, wg = tid / 128;
  const uint32_t base = zeroed_tiles(smem);
  constexpr int kRounds = 256, kThreadsAll = kStores ? 384 : 256;
  const long long t0 = clock64();
  if (wg == 2) {  // the store warpgroup (kStores only)
    const uint32_t region = base + 98304;
    for (int r = 0; r < kRounds; ++r) {
#pragma unroll 4
      for (int i = 0; i < 32; ++i) {
        const uint32_t addr = region + (((r * 32 + i) * 2048u + (tid & 127) * 16u) & 65535u);
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(r) : "memory");
      }
      named_barrier_sync(1, kThreadsAll);
    }
  } else {
    const uint32_t q_base = base + wg * 16384, k_base = base + 65536;
    float s[64];  // S and O share one accumulator (registers: 3 warpgroups allow 168 per thread)
#pragma unroll
    for (int i = 0; i < 64; ++i) s[i] = 0.f;
    const uint32_t a_reg[4] = {0u, 0u, 0u, 0u};
    for (int r = 0; r < kRounds; ++r) {
      wgmma_fence();
#pragma unroll
      // (always accumulating: with the first wgmma of a round overwriting S, a round's results were
      // dead and the compiler dropped every other round — session 9's run of this row read 1,059
      // cycles per "round", i.e. 2,118 per real one)
      for (int kk = 0; kk < 8; ++kk)
        Wgmma<128, __nv_bfloat16>::template ss<0>(s, make_desc_sw128(q_base + (kk & 3) * 32, 16, 1024),
                                                  make_desc_sw128(k_base + (kk & 3) * 32, 16, 1024), 1);
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        Wgmma<128, __nv_bfloat16>::template rs<1>(s, a_reg, make_desc_sw128(k_base + kk * 2048, 64 * 128, 1024), 1);
      wgmma_commit();
      wgmma_wait<1>();
      if (kStores) named_barrier_sync(1, kThreadsAll);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) reg_fence(s[i]);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc += s[i];
    if (acc != 0.f) sink[blockIdx.x * blockDim.x + tid] = acc;
  }
  const long long t1 = clock64();
  __shared__ long long s_end[3];
  if ((tid & 127) == 0) s_end[wg] = t1;
  __syncthreads();
  if (tid == 0) {
    long long e = s_end[0] > s_end[1] ? s_end[0] : s_end[1];
    if (kStores && s_end[2] > e) e = s_end[2];
    cycles[blockIdx.x] = e - t0;
  }
#endif
}

template <bool kStores>
void run_fwd_step(int sms, long long* d_cycles, float* d_sink) {
  const double per = launch_timed(&fwd_step_kernel<kStores>, kStores ? 384 : 256, sms, d_cycles, d_sink).cycles / 256;
  std::printf("{\"config\": \"fwd step hdim128 128x128 (wgmmas only)%s\", \"cycles_per_step\": %.0f, \"ideal\": 2048, "
              "\"efficiency\": %.3f, \"store_bytes_per_cycle\": %.1f}\n",
              kStores ? " + K/V volume stored" : "", per, 2048.0 / per, kStores ? 65536.0 / per : 0.0);
}

template <int N, int kMode, int kWGs, bool kTraffic = false>
void run(const char* name, int sms, long long* d_cycles, float* d_sink) {
  const Timed t = launch_timed(&rate_kernel<N, kMode, kWGs, kTraffic>, (kWGs + kTraffic) * 128, sms, d_cycles, d_sink);
  const double mean = t.cycles, stores = t.slot1;
  const double per = mean / (static_cast<double>(kRounds) * 8 * kWGs);
  std::printf("{\"config\": \"%s%s\", \"n\": %d, \"warpgroups\": %d, \"cycles_per_wgmma\": %.2f, \"ideal\": %.1f, "
              "\"efficiency\": %.3f, \"store_bytes_per_cycle\": %.1f}\n",
              name, kTraffic ? " + st.shared" : "", N, kWGs, per, N / 2.0, (N / 2.0) / per,
              kTraffic ? stores * 128 * 16 / mean : 0.0);
}

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("skipped: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::printf("skipped: needs sm_90, device is sm_%d%d\n", prop.major, prop.minor);
    return 0;
  }
  const int sms = prop.multiProcessorCount;
  long long* d_cycles = nullptr;
  float* d_sink = nullptr;
  CHECK_CUDA(cudaMalloc(&d_cycles, 2 * sms * sizeof(long long)));
  CHECK_CUDA(cudaMemset(d_cycles, 0, 2 * sms * sizeof(long long)));
  CHECK_CUDA(cudaMalloc(&d_sink, static_cast<size_t>(sms) * 512 * sizeof(float)));
  run<64, 0, 1>("ss kmajor", sms, d_cycles, d_sink);
  run<64, 0, 2>("ss kmajor", sms, d_cycles, d_sink);
  run<80, 0, 2>("ss kmajor", sms, d_cycles, d_sink);
  run<128, 0, 1>("ss kmajor", sms, d_cycles, d_sink);
  run<128, 0, 2>("ss kmajor", sms, d_cycles, d_sink);
  run<256, 0, 2>("ss kmajor", sms, d_cycles, d_sink);
  run<64, 1, 2>("ss a,b mn-major", sms, d_cycles, d_sink);
  run<128, 1, 2>("ss a,b mn-major", sms, d_cycles, d_sink);
  run<64, 2, 1>("rs b mn-major", sms, d_cycles, d_sink);
  run<64, 2, 2>("rs b mn-major", sms, d_cycles, d_sink);
  run<128, 2, 2>("rs b mn-major", sms, d_cycles, d_sink);
  run<256, 2, 2>("rs b mn-major", sms, d_cycles, d_sink);
  run<64, 0, 3>("ss kmajor", sms, d_cycles, d_sink);
  run<192, 3, 1>("fp8 ss kmajor", sms, d_cycles, d_sink);
  run<192, 3, 2>("fp8 ss kmajor", sms, d_cycles, d_sink);
  run<128, 4, 2>("fp8 rs kmajor", sms, d_cycles, d_sink);
  run<64, 0, 2, true>("ss kmajor", sms, d_cycles, d_sink);
  run<64, 1, 2, true>("ss a,b mn-major", sms, d_cycles, d_sink);
  run<128, 0, 2, true>("ss kmajor", sms, d_cycles, d_sink);
  run<128, 2, 2, true>("rs b mn-major", sms, d_cycles, d_sink);
  run_bwd_step(sms, d_cycles, d_sink);
  run_fwd_step<false>(sms, d_cycles, d_sink);
  run_fwd_step<true>(sms, d_cycles, d_sink);
  run_mufu<0>("alone", sms, d_cycles, d_sink);
  run_mufu<1>("beside fp8 wgmmas of the other warpgroup", sms, d_cycles, d_sink);
  run_mufu<2>("beside ex2 of the other warpgroup", sms, d_cycles, d_sink);
  run_mufu<3>("beside its own rs fp8 wgmmas (6 per 96 ex2)", sms, d_cycles, d_sink);
  run_mufu<4>("beside rs fp8 wgmmas of the other warpgroup", sms, d_cycles, d_sink);
  run_mufu<5>("beside its own ss fp8 wgmmas (4 m64n192k32 per 96 ex2)", sms, d_cycles, d_sink);
  run_mufu<6>("alone, 1 in 4 on the FMA pipe", sms, d_cycles, d_sink);
  run_mufu<7>("1 in 4 on the FMA pipe, beside ss fp8 wgmmas of the other warpgroup", sms, d_cycles, d_sink);
  run_cvt<0>("16 cvt e4m3x2.f32 alone", sms, d_cycles, d_sink);
  run_cvt<1>("16 ex2 alone", sms, d_cycles, d_sink);
  run_cvt<2>("16 ex2 + 8 cvt e4m3x2.f32", sms, d_cycles, d_sink);
  CHECK_CUDA(cudaFree(d_cycles));
  CHECK_CUDA(cudaFree(d_sink));
  return 0;
}

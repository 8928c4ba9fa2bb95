// bench_util.cuh — shared helpers of the CUDA benchmark executables (not part of the library):
// random device fills, CUDA-event timing (warm-up, median of repeats), JSON-line output.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/check.cuh"

namespace ioattn::cuda::bench {

// "64,128,256" -> {64, 128, 256} (command-line lists of the benchmark drivers).
inline std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) v.push_back(std::stoll(x));
  return v;
}

// Whether the comma-separated list s names item exactly ("bf16" does not name "f16"; spaces
// around an item are ignored).
inline bool list_has(const std::string& s, const std::string& item) {
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) {
    const size_t a = x.find_first_not_of(' '), b = x.find_last_not_of(' ');
    if (a != std::string::npos && x.substr(a, b - a + 1) == item) return true;
  }
  return false;
}

// Element i's 64-bit counter hash (splitmix64) for seed: the benchmarks' random inputs.
__device__ __forceinline__ uint64_t splitmix64(uint64_t seed, int64_t i) {
  uint64_t z = seed + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform values in [-amp, amp) from a counter hash (splitmix64): fresh, non-zero inputs.
template <typename T>
__global__ void fill_uniform_kernel(T* x, int64_t n, uint64_t seed, float amp) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t z = splitmix64(seed, i);
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    const float v = (2.f * u - 1.f) * amp;
    if constexpr (std::is_same_v<T, float>)
      x[i] = v;
    else if constexpr (std::is_same_v<T, __half>)
      x[i] = __float2half_rn(v);
    else
      x[i] = __float2bfloat16_rn(v);
  }
}

inline void fill_uniform(void* x, bool bf16, int64_t n, uint64_t seed, float amp = 1.f) {
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  if (bf16)
    fill_uniform_kernel<<<blocks, 256>>>(static_cast<__nv_bfloat16*>(x), n, seed, amp);
  else
    fill_uniform_kernel<<<blocks, 256>>>(static_cast<__half*>(x), n, seed, amp);
  IOATTN_CUDA_CHECK_LAUNCH("fill_uniform_kernel");
}

// IOATTN_BENCH_WARM_MS=N: every timing of more than one batch first runs N ms of back-to-back
// calls (0, the default: none). The H200 runs compute-bound kernels at its power cap; the limiter averages over about a
// second and overshoots after a step in load, so without this a row's clock depends on the rows
// before it (docs/PERF.md, session 11).
inline double warm_ms_from_env() {
  const char* e = std::getenv("IOATTN_BENCH_WARM_MS");
  return e != nullptr ? std::max(0.0, std::atof(e)) : 0.0;
}

// Median milliseconds per call of `fn` on the default stream: `warmup` calls (and
// IOATTN_BENCH_WARM_MS of them), then `repeats` timed batches of `inner` back-to-back calls (the
// queue stays full, so host-side validation never shows up as GPU idle time).
inline double time_ms(const std::function<void()>& fn, int warmup, int repeats, int inner) {
  cudaEvent_t a, b;
  IOATTN_CUDA_CHECK(cudaEventCreate(&a));
  IOATTN_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) fn();
  IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
  static const double warm_ms = warm_ms_from_env();
  if (warm_ms > 0 && repeats > 1) {  // (a one-call calibration, repeats == 1, does not warm)
    const auto t_end = std::chrono::steady_clock::now() + std::chrono::duration<double, std::milli>(warm_ms);
    while (std::chrono::steady_clock::now() < t_end) {
      for (int i = 0; i < 8; ++i) fn();
      IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  std::vector<float> ms;
  for (int r = 0; r < repeats; ++r) {
    IOATTN_CUDA_CHECK(cudaEventRecord(a));
    for (int i = 0; i < inner; ++i) fn();
    IOATTN_CUDA_CHECK(cudaEventRecord(b));
    IOATTN_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    IOATTN_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t / inner);
  }
  IOATTN_CUDA_CHECK(cudaEventDestroy(a));
  IOATTN_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Calls per timed batch so that one batch takes about 2 ms (given one call's rough time).
inline int inner_for(double ms_one) { return std::max(1, std::min(50, static_cast<int>(2.0 / std::max(ms_one, 1e-3)))); }

// Attention FLOPs: 4·b·h·sq·sk·d (two GEMMs), halved when causal (square problems).
inline double attn_flops(int64_t b, int64_t h, int64_t sq, int64_t sk, int64_t d, bool causal) {
  return 4.0 * b * h * sq * sk * d * (causal ? 0.5 : 1.0);
}

}  // namespace ioattn::cuda::bench

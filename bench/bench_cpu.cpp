// CPU benchmarks: the machine's FMA peak, then cpu/flash against cpu/naive in the same run.
//
// Build: cmake -S . -B build -G Ninja -DIOATTN_CUDA=OFF && ninja -C build ioattn_bench_cpu
// Run:   build/bench/ioattn_bench_cpu                       (everything, a few minutes)
//        build/bench/ioattn_bench_cpu --benchmark_filter='flash/f32/d128/s4096'
//
// 1. fma_peak/<target>/threads:N measures what this machine's cores can do: each thread runs
//    enough independent vector FMA chains (Highway, at the target ioattn's CPU backend chooses)
//    to hide the FMA latency. GFLOP/s counts 2 flops per lane per FMA.
// 2. <backend>/<dtype>/d<head_dim>/s<seqlen>/<mask>/threads:N runs ioattn::forward on
//    q, k, v of [batch 1, seqlen, 8 heads, head_dim] (naive: 2 heads, seqlen <= 4096; it is the
//    float64 materialising reference) and reports GFLOP/s with FLOPs = 4 * b * h * sq * sk * d,
//    halved for causal, and pct_peak: the share of the FMA peak, max(measured N-thread peak,
//    N x measured 1-thread peak), taken by the fastest iteration (best-of on both sides, so a
//    briefly busy machine lowers neither).
//
// Environment: IOATTN_CPU_TARGET=avx2 caps the Highway target (peak and kernel alike).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#ifndef IOATTN_BENCH_CPU_SHARED_
#define IOATTN_BENCH_CPU_SHARED_
#include <benchmark/benchmark.h>

#include "ioattn/ioattn.hpp"
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench_cpu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace ioattn_bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Independent accumulator chains: FMA latency (4 cycles) x FMA ports (2) = 8 in flight at
// least; use most of the register file so the loop is throughput-bound.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kChains = 24;
#else
constexpr int kChains = 12;
#endif

// Runs iters rounds of kChains vector FMAs; returns a value that depends on all of them.
HWY_NOINLINE float FmaChains(int64_t iters) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  V acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = hn::Set(d, 1.0f + 1e-3f * static_cast<float>(c));
  const V a = hn::Set(d, 0.9999999f), b = hn::Set(d, 1e-7f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) acc[c] = hn::MulAdd(acc[c], a, b);
  }
  for (int c = 1; c < kChains; ++c) acc[0] = hn::Add(acc[0], acc[c]);
  return hn::GetLane(acc[0]);
}

// Floating-point operations one FmaChains(iters) call performs.
double FmaChainsFlops(int64_t iters) {
  return 2.0 * static_cast<double>(iters) * kChains * static_cast<double>(hn::Lanes(hn::ScalableTag<float>()));
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace ioattn_bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ioattn_bench {

HWY_EXPORT(FmaChains);
HWY_EXPORT(FmaChainsFlops);

using ioattn::DType;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Measured FMA peak in GFLOP/s with `threads` threads (each thread runs its own chains): the best
// of many short runs, so a briefly busy machine does not lower it.
double measure_peak_gflops(int threads) {
  constexpr int64_t kIters = 4'000'000;  // ~50 ms at 64 flops/cycle, 3 GHz
  constexpr int kReps = 15;
  double best = 0;
  for (int rep = 0; rep < kReps; ++rep) {
    float sink = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += HWY_DYNAMIC_DISPATCH(FmaChains)(kIters);
    const double s = seconds_since(t0);
    benchmark::DoNotOptimize(sink);
    best = std::max(best, threads * HWY_DYNAMIC_DISPATCH(FmaChainsFlops)(kIters) / s * 1e-9);
  }
  return best;
}

// The best peak seen so far at this thread count (fma_peak runs first and fills it in).
std::map<int, double>& peak_cache() {
  static std::map<int, double> cache;
  return cache;
}

double peak_gflops(int threads) {
  double& best = peak_cache()[threads];
  if (best == 0) best = measure_peak_gflops(threads);
  return best;
}

void BM_FmaPeak(benchmark::State& state, int threads) {
  double gflops = 0;
  for (auto _ : state) gflops = measure_peak_gflops(threads);
  double& best = peak_cache()[threads];
  best = std::max(best, gflops);
  state.counters["GFLOP/s"] = gflops;
  state.counters["GFLOP/s/thread"] = gflops / threads;
}

struct AttnCase {
  ioattn::Backend backend = ioattn::Backend::flash;
  DType dtype = DType::f32;
  int64_t heads = 8, head_dim = 128, seqlen = 4096;
  bool causal = false;
  int threads = 1;
};

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void BM_Attention(benchmark::State& state, AttnCase c) {
  const int64_t b = 1, s = c.seqlen, h = c.heads, d = c.head_dim;
  const int64_t n = b * s * h * d;
  const size_t esize = static_cast<size_t>(ioattn::dtype_size(c.dtype));
  std::vector<uint8_t> q(n * esize), k(n * esize), v(n * esize), o(n * esize);
  std::vector<float> lse(static_cast<size_t>(b * h * s));
  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto* buf : {&q, &k, &v})
    for (int64_t i = 0; i < n; ++i) {
      const float x = dist(rng);
      if (c.dtype == DType::f32)
        std::memcpy(buf->data() + i * 4, &x, 4);
      else {
        const uint16_t y = to_bf16(x);
        std::memcpy(buf->data() + i * 2, &y, 2);
      }
    }
  using ioattn::TensorView;
  const TensorView qv = TensorView::contiguous(q.data(), c.dtype, {b, s, h, d});
  const TensorView kv = TensorView::contiguous(k.data(), c.dtype, {b, s, h, d});
  const TensorView vv = TensorView::contiguous(v.data(), c.dtype, {b, s, h, d});
  const TensorView ov = TensorView::contiguous(o.data(), c.dtype, {b, s, h, d});
  const TensorView lv = TensorView::contiguous(lse.data(), DType::f32, {b, h, s});
  ioattn::AttnParams params;
  params.causal = c.causal;
  ioattn::Context ctx;
  ctx.backend = c.backend;
  ctx.num_threads = c.threads;
  omp_set_num_threads(c.threads);  // the naive reference uses the OpenMP default
  // Judge against the larger of the measured T-thread peak and T x the 1-thread peak: on a
  // shared machine the T-thread measurement can lose a core to another process, and T x one core
  // can only overstate the peak (frequency drops with more active cores), never flatter us.
  const double peak = std::max(peak_gflops(c.threads), c.threads * peak_gflops(1));

  const double flops = 4.0 * b * h * s * s * d * (c.causal ? 0.5 : 1.0);
  double total_s = 0, best_s = 1e30;
  int64_t iters = 0;
  std::string kernel;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    kernel = ioattn::forward(qv, kv, vv, ov, lv, params, ctx).kernel;
    const double sec = seconds_since(t0);
    total_s += sec;
    best_s = std::min(best_s, sec);
    ++iters;
    benchmark::ClobberMemory();
  }
  // GFLOP/s over all iterations; best_GFLOP/s and pct_peak from the fastest one, the same
  // best-of rule as the peak (a shared machine only ever makes a run slower).
  state.counters["GFLOP/s"] = flops * iters / total_s * 1e-9;
  state.counters["best_GFLOP/s"] = flops / best_s * 1e-9;
  state.counters["pct_peak"] = 100.0 * flops / best_s * 1e-9 / peak;
  state.SetLabel(kernel);
}

}  // namespace ioattn_bench

int main(int argc, char** argv) {
  using namespace ioattn_bench;
  benchmark::Initialize(&argc, argv);
  const ioattn::BuildInfo info = ioattn::build_info();  // also applies IOATTN_CPU_TARGET

  std::vector<int> threads = {1};
  if (info.cpu_threads > 1) threads.push_back(info.cpu_threads);

  for (int t : threads)
    benchmark::RegisterBenchmark(
        ("fma_peak/" + info.cpu_best_target + "/threads:" + std::to_string(t)).c_str(), BM_FmaPeak, t)
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();

  for (auto backend : {ioattn::Backend::flash, ioattn::Backend::naive})
    for (DType dt : {DType::f32, DType::bf16})
      for (int64_t d : {64, 128})
        for (int64_t s : {512, 1024, 2048, 4096, 8192})
          for (bool causal : {false, true})
            for (int t : threads) {
              const bool naive = backend == ioattn::Backend::naive;
              if (naive && s > 4096) continue;
              AttnCase c;
              c.backend = backend;
              c.dtype = dt;
              c.heads = naive ? 2 : 8;
              c.head_dim = d;
              c.seqlen = s;
              c.causal = causal;
              c.threads = t;
              const std::string name = std::string(naive ? "naive/" : "flash/") + ioattn::dtype_name(dt) + "/d" +
                                       std::to_string(d) + "/s" + std::to_string(s) + "/" +
                                       (causal ? "causal" : "full") + "/threads:" + std::to_string(t);
              auto* bm = benchmark::RegisterBenchmark(name.c_str(), BM_Attention, c)
                             ->Unit(benchmark::kMillisecond)
                             ->UseRealTime();
              if (naive)
                bm->Iterations(1);  // seconds per call at the larger sizes
              else
                bm->MinTime(1.0);  // several iterations even at seqlen 8192
            }

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
#endif  // HWY_ONCE

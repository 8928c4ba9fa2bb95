// CPU decode (split-KV, src/cpu/serving_cpu.cpp): K+V bytes read per second, next to the
// machine's own read bandwidth over the same number of bytes (the peer: an OpenMP sum over one
// buffer, what a perfectly bandwidth-bound decode would reach).
//
// Shapes: GQA 32/8, head_dim 128, one query token, batch 1 / 16 x KV 4k / 32k tokens, caches
// f32 / bf16 (q in the cache dtype) and f8e4m3 / i8 (q bf16), contiguous vs paged (page 16,
// shuffled pages). Cases whose cache would exceed kMaxCacheBytes are skipped.
//
// Build: add to bench/CMakeLists.txt
//   add_executable(ioattn_bench_decode bench_decode.cpp)
//   target_link_libraries(ioattn_bench_decode PRIVATE ioattn::ioattn benchmark::benchmark OpenMP::OpenMP_CXX)
//   target_include_directories(ioattn_bench_decode PRIVATE ${PROJECT_SOURCE_DIR}/src)
// Run:
//   ./build/bench/ioattn_bench_decode --benchmark_counters_tabular=true
//   ./build/bench/ioattn_bench_decode --benchmark_filter='decode/.*/b:1/' (batch 1 only)
// prefill/...: a 512-row causal chunk (batch 1) against the same caches through decode() (more than
// 16 rows: the tiled flash forward reading the cache's layout), contiguous and paged, beside the
// peer forward() on the contiguous cache's buffers (16-bit / f32 caches only); GFLOP/s counts
// 4 * heads_q * head_dim per visible (row, key) pair.
// The "KV GB/s" column counts the bytes of K and V the decode must read (cache_seqlens x heads_kv
// x (d + dv) x element size); compare it with stream_read's row of the same b / kv / dtype.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/harness.hpp"
#include "ioattn/serving.hpp"

namespace {

using ioattn::DType;
using ioattn::detail::Buffer;

constexpr int64_t kHeadsQ = 32, kHeadsKv = 8, kHeadDim = 128, kPageSize = 16;
constexpr size_t kMaxCacheBytes = size_t{5} << 29;  // 2.5 GiB for K + V

const DType kCacheTypes[] = {DType::f32, DType::bf16, DType::f8e4m3, DType::i8};

size_t cache_bytes(int64_t batch, int64_t kv, DType t) {
  return static_cast<size_t>(batch * kv * kHeadsKv * kHeadDim * 2 * ioattn::dtype_size(t));
}

// Fills n bytes with a repeated random pattern (fast for GiB-sized caches). 8-bit codes stay
// below 0x70 (finite f8e4m3, |x| <= 128 for i8); float patterns are values in (-1, 1).
void fill(Buffer& b, DType t, std::mt19937_64& rng) {
  constexpr size_t kPattern = 1 << 16;
  std::vector<uint8_t> pat(kPattern);
  Buffer tmp(t, static_cast<int64_t>(kPattern / ioattn::dtype_size(t)));
  if (t == DType::f8e4m3 || t == DType::i8) {
    std::uniform_int_distribution<int> u(0, 0x6f);
    for (auto& x : pat) x = static_cast<uint8_t>(u(rng) | (u(rng) & 1) << 7);
  } else {
    tmp.fill_random(rng);
    std::memcpy(pat.data(), tmp.host(), kPattern);
  }
  auto* dst = static_cast<uint8_t*>(b.host());
  for (size_t at = 0; at < b.bytes(); at += kPattern) std::memcpy(dst + at, pat.data(), std::min(kPattern, b.bytes() - at));
}

struct Problem {
  int64_t batch, kv;
  DType cache_t, q_t;
  bool paged;
  Buffer q, o, lse, kc, vc, bt, lens, ks, vs;
  ioattn::KVCache cache;
  Problem(int64_t b, int64_t n, DType t, bool pg)
      : batch(b), kv(n), cache_t(t), q_t(t == DType::f32 ? DType::f32 : DType::bf16), paged(pg) {
    std::mt19937_64 rng(1);
    q = Buffer(q_t, batch * kHeadsQ * kHeadDim);
    o = Buffer(q_t, batch * kHeadsQ * kHeadDim);
    lse = Buffer(DType::f32, batch * kHeadsQ);
    q.fill_random(rng);
    const int64_t pages = paged ? batch * kv / kPageSize : batch;
    const int64_t ps = paged ? kPageSize : kv;
    kc = Buffer(t, pages * ps * kHeadsKv * kHeadDim);
    vc = Buffer(t, pages * ps * kHeadsKv * kHeadDim);
    fill(kc, t, rng);
    fill(vc, t, rng);
    lens = Buffer(DType::i32, batch);
    lens.fill_i32(std::vector<int32_t>(static_cast<size_t>(batch), static_cast<int32_t>(kv)));
    cache.k_cache = kc.view({pages, ps, kHeadsKv, kHeadDim});
    cache.v_cache = vc.view({pages, ps, kHeadsKv, kHeadDim});
    cache.cache_seqlens = lens.view({batch});
    if (paged) {
      std::vector<int32_t> perm(static_cast<size_t>(pages));
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      bt = Buffer(DType::i32, pages);
      bt.fill_i32(perm);
      cache.block_table = bt.view({batch, kv / kPageSize});
    }
    if (t == DType::f8e4m3 || t == DType::i8) {
      ks = Buffer(DType::f32, kHeadsKv);
      vs = Buffer(DType::f32, kHeadsKv);
      for (int64_t h = 0; h < kHeadsKv; ++h) ks.set(h, 1.0f / 128), vs.set(h, 1.0f / 128);
      cache.k_scale = ks.view({kHeadsKv});
      cache.v_scale = vs.view({kHeadsKv});
    }
  }
  void run() {
    ioattn::decode(q.view({batch, 1, kHeadsQ, kHeadDim}), cache, o.view({batch, 1, kHeadsQ, kHeadDim}),
                   lse.view({batch, kHeadsQ, 1}), ioattn::AttnParams{});
  }
};

// One problem alive at a time (the largest is GiBs): rebuilt when the arguments change.
Problem& problem(int64_t batch, int64_t kv, DType t, bool paged) {
  static std::unique_ptr<Problem> p;
  if (!p || p->batch != batch || p->kv != kv || p->cache_t != t || p->paged != paged) {
    p.reset();
    p = std::make_unique<Problem>(batch, kv, t, paged);
  }
  return *p;
}

// args: batch, kv tokens, cache dtype index, paged
void BM_decode(benchmark::State& st) {
  const int64_t batch = st.range(0), kv = st.range(1);
  const DType t = kCacheTypes[st.range(2)];
  const bool paged = st.range(3) != 0;
  Problem& p = problem(batch, kv, t, paged);
  p.run();  // warm-up (page faults)
  for (auto _ : st) {
    p.run();
    benchmark::DoNotOptimize(p.o.host());
    benchmark::ClobberMemory();
  }
  const double bytes = static_cast<double>(cache_bytes(batch, kv, t));
  st.counters["KV GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(std::string(ioattn::dtype_name(t)) + (paged ? " page16" : " contiguous"));
}

// The peer: read the same number of bytes as one decode, summing 64-bit words on all threads.
void BM_stream_read(benchmark::State& st) {
  const size_t bytes = cache_bytes(st.range(0), st.range(1), kCacheTypes[st.range(2)]);
  const size_t words = bytes / 8;
  std::vector<uint64_t> buf(words);
  std::iota(buf.begin(), buf.end(), uint64_t{1});
  uint64_t sink = 0;
  for (auto _ : st) {
    uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
    for (int64_t i = 0; i < static_cast<int64_t>(words); ++i) sum += buf[static_cast<size_t>(i)];
    sink += sum;
    benchmark::DoNotOptimize(sink);
  }
  st.counters["KV GB/s"] = benchmark::Counter(static_cast<double>(bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(std::to_string(bytes >> 20) + " MiB, " + std::to_string(omp_get_max_threads()) + " threads");
}

// args: kv tokens, cache dtype index, mode (0 decode() contiguous, 1 decode() page16, 2 forward())
void BM_prefill(benchmark::State& st) {
  constexpr int64_t kRows = 512;
  const int64_t kv = st.range(0), mode = st.range(2);
  const DType t = kCacheTypes[st.range(1)];
  Problem& p = problem(1, kv, t, mode == 1);
  Buffer q(p.q_t, kRows * kHeadsQ * kHeadDim), o(p.q_t, kRows * kHeadsQ * kHeadDim), lse(DType::f32, kHeadsQ * kRows);
  std::mt19937_64 rng(2);
  q.fill_random(rng);
  ioattn::AttnParams prm;
  prm.causal = true;
  const auto qv = q.view({1, kRows, kHeadsQ, kHeadDim}), ov = o.view({1, kRows, kHeadsQ, kHeadDim});
  const auto lv = lse.view({1, kHeadsQ, kRows});
  auto run = [&] {
    if (mode == 2)
      ioattn::forward(qv, p.kc.view({1, kv, kHeadsKv, kHeadDim}), p.vc.view({1, kv, kHeadsKv, kHeadDim}), ov, lv, prm);
    else
      ioattn::decode(qv, p.cache, ov, lv, prm);
  };
  run();  // warm-up
  for (auto _ : st) {
    run();
    benchmark::DoNotOptimize(o.host());
    benchmark::ClobberMemory();
  }
  // visible pairs: row i (of kRows, bottom-right aligned) sees kv - kRows + i + 1 keys
  const double pairs = static_cast<double>(kRows) * static_cast<double>(kv - kRows) + kRows * (kRows + 1) / 2.0;
  st.counters["GFLOP/s"] = benchmark::Counter(4.0 * kHeadsQ * kHeadDim * pairs * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(std::string(ioattn::dtype_name(t)) +
              (mode == 2 ? " forward() contiguous" : mode == 1 ? " decode() page16" : " decode() contiguous"));
}

void shapes(benchmark::internal::Benchmark* b, bool peer) {
  for (int64_t batch : {1, 16})
    for (int64_t kv : {4096, 32768})
      for (int64_t t = 0; t < 4; ++t) {
        if (cache_bytes(batch, kv, kCacheTypes[t]) > kMaxCacheBytes) continue;
        for (int64_t paged : {0, 1}) {
          if (peer && paged) continue;  // the peer depends on the byte count only
          b->Args({batch, kv, t, paged});
        }
      }
  b->ArgNames({"b", "kv", "dtype", "paged"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(BM_decode)->Name("decode")->Apply([](auto* b) { shapes(b, false); });
BENCHMARK(BM_stream_read)->Name("stream_read")->Apply([](auto* b) { shapes(b, true); });
BENCHMARK(BM_prefill)->Name("prefill")->Apply([](auto* b) {
  for (int64_t t : {0, 1, 3})  // f32, bf16, i8 (no forward() peer: its K / V are one dtype with q)
    for (int64_t mode : {0, 1, 2})
      if (mode < 2 || t < 2) b->Args({4096, t, mode});
  b->ArgNames({"kv", "dtype", "mode"})->Unit(benchmark::kMillisecond)->UseRealTime();
});

}  // namespace

BENCHMARK_MAIN();

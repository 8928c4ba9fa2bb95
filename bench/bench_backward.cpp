// CPU attention backward: the tiled flash backward against the float64 materialising (naive)
// backward, and forward + backward, at head_dim 64/128 and seqlen 512..4096.
//
// Counters: GFLOP/s with the forward counted as 4 * b * h * sq * sk * d (two GEMMs; halved for
// causal) and the backward as 2.5x the forward (five GEMMs), the convention of FlashAttention's
// benchmarks — so the figure is comparable across implementations, not a count of what runs
// (the flash backward recomputes S and dP once more for its deterministic dQ pass).
//
// Build: part of the bench/ CMake target list; run e.g.
//   ./build/bench/bench_backward --benchmark_filter='bwd/flash' --benchmark_counters_tabular=true
// The naive rows stop at seqlen 1024: the float64 materialising backward takes seconds per
// iteration there already (scalar double loops over three seqlen^2 matrices per head).
#include <benchmark/benchmark.h>

#include <random>
#include <string>

#include "core/harness.hpp"
#include "ioattn/ioattn.hpp"

namespace {

using ioattn::Backend;
using ioattn::DType;
using ioattn::detail::Buffer;

constexpr int64_t kBatch = 1;
constexpr int64_t kHeads = 8;

struct Problem {
  int64_t s, d, hkv;
  bool causal;
  DType t;
  Buffer q, k, v, o, dout, lse, dq, dk, dv;
  ioattn::AttnParams prm;
  Problem(int64_t seqlen, int64_t head_dim, bool is_causal, DType dtype, int64_t kv_heads)
      : s(seqlen), d(head_dim), hkv(kv_heads), causal(is_causal), t(dtype) {
    const int64_t n = kBatch * s * kHeads * d, nkv = kBatch * s * hkv * d;
    q = Buffer(t, n), k = Buffer(t, nkv), v = Buffer(t, nkv), o = Buffer(t, n), dout = Buffer(t, n);
    dq = Buffer(t, n), dk = Buffer(t, nkv), dv = Buffer(t, nkv);
    lse = Buffer(DType::f32, kBatch * kHeads * s);
    std::mt19937_64 rng(1);
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    dout.fill_random(rng);
    prm.causal = causal;
  }
  ioattn::TensorView t4(Buffer& b) { return b.view({kBatch, s, kHeads, d}); }
  ioattn::TensorView kv4(Buffer& b) { return b.view({kBatch, s, hkv, d}); }
  void forward(Backend be) {
    ioattn::Context ctx;
    ctx.backend = be;
    ioattn::forward(t4(q), kv4(k), kv4(v), t4(o), lse.view({kBatch, kHeads, s}), prm, ctx);
  }
  void backward(Backend be) {
    ioattn::Context ctx;
    ctx.backend = be;
    ioattn::Gradients g{t4(dq), kv4(dk), kv4(dv), {}};
    ioattn::backward(t4(q), kv4(k), kv4(v), t4(o), t4(dout), lse.view({kBatch, kHeads, s}), g, prm, ctx);
  }
  double fwd_flops() const {
    return 4.0 * kBatch * kHeads * static_cast<double>(s) * static_cast<double>(s) * static_cast<double>(d) *
           (causal ? 0.5 : 1.0);
  }
};

// args: seqlen, head_dim, causal, dtype (0 f32, 1 bf16, 2 f16), kv heads
void run(benchmark::State& st, Backend be, bool with_forward) {
  const int64_t hkv = st.range(4);
  const DType t = st.range(3) == 2 ? DType::f16 : st.range(3) == 1 ? DType::bf16 : DType::f32;
  Problem p(st.range(0), st.range(1), st.range(2) != 0, t, hkv);
  p.forward(Backend::naive);  // o, lse for the backward
  for (auto _ : st) {
    if (with_forward) p.forward(be);
    p.backward(be);
    benchmark::DoNotOptimize(p.dq.host());
    benchmark::ClobberMemory();
  }
  const double flops = p.fwd_flops() * (with_forward ? 3.5 : 2.5);
  st.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(std::string(ioattn::dtype_name(p.t)) + " b1 h8" + (hkv != kHeads ? "/" + std::to_string(hkv) : "") +
              " s" + std::to_string(p.s) + " d" + std::to_string(p.d) + (p.causal ? " causal" : ""));
}

void shapes(benchmark::internal::Benchmark* b, int64_t max_seqlen) {
  for (int64_t d : {64, 128})
    for (int64_t s = 512; s <= max_seqlen; s *= 2)
      for (int64_t causal : {0, 1})
        for (int64_t t : {1, 0}) b->Args({s, d, causal, t, kHeads});
  b->ArgNames({"s", "d", "causal", "bf16", "hkv"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

void BM_bwd_flash(benchmark::State& st) { run(st, Backend::flash, false); }
void BM_bwd_naive(benchmark::State& st) { run(st, Backend::naive, false); }
void BM_fwd_bwd_flash(benchmark::State& st) { run(st, Backend::flash, true); }
void BM_fwd_bwd_naive(benchmark::State& st) { run(st, Backend::naive, true); }

BENCHMARK(BM_bwd_flash)->Name("bwd/flash")->Apply([](auto* b) { shapes(b, 4096); });
// f16 (on a CPU with AMX-BF16: two bf16 parts per operand, else the fp32 products)
BENCHMARK(BM_bwd_flash)->Name("bwd/flash/f16")->Apply([](auto* b) {
  for (int64_t s : {1024, 4096})
    for (int64_t causal : {0, 1}) b->Args({s, 128, causal, 2, kHeads});
  b->ArgNames({"s", "d", "causal", "dtype", "hkv"})->Unit(benchmark::kMillisecond)->UseRealTime();
});
// GQA / MQA (8 query heads over 1, 2 or 8 kv heads): the fused and split single passes by group size
BENCHMARK(BM_bwd_flash)->Name("bwd/flash/gqa")->Apply([](auto* b) {
  for (int64_t s : {1024, 4096})
    for (int64_t causal : {0, 1})
      for (int64_t t : {1, 0})
        for (int64_t hkv : {1, 2, 8}) b->Args({s, 128, causal, t, hkv});
  b->ArgNames({"s", "d", "causal", "bf16", "hkv"})->Unit(benchmark::kMillisecond)->UseRealTime();
});
BENCHMARK(BM_bwd_naive)->Name("bwd/naive")->Apply([](auto* b) { shapes(b, 1024); });
BENCHMARK(BM_fwd_bwd_flash)->Name("fwd+bwd/flash")->Apply([](auto* b) { shapes(b, 4096); });
BENCHMARK(BM_fwd_bwd_naive)->Name("fwd+bwd/naive")->Apply([](auto* b) { shapes(b, 1024); });

}  // namespace

BENCHMARK_MAIN();

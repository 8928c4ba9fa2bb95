// Forward correctness: every target (CPU flash, CPU naive, CUDA flash, CUDA naive) against the
// float64 reference on odd shapes, masks and features, O and LSE both. CUDA targets report
// "skipped: no CUDA device" on machines without one.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "check.hpp"
#include "fuzz_cases.hpp"

namespace ioattn::test {
namespace {

Case mk(std::string name, int64_t sq, int64_t sk, int64_t d, DType t = DType::f32) {
  Case c;
  c.name = std::move(name);
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.head_dim = d;
  c.dtype = t;
  return c;
}

// The shared case list. Shapes follow the issue: 1, 17, 113x203, 1023x1024, 4097, sq != sk
// with causal, empty varlen entries, GQA 1/4/8, head dims 8..256 incl. 80 and 96, strides.
std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    const std::string ts = dtype_name(t);
    v.push_back(mk("len1_" + ts, 1, 1, 64, t));
    v.push_back(mk("len17_" + ts, 17, 17, 64, t));
    v.push_back(mk("q113_k203_" + ts, 113, 203, 128, t));
    { Case c = mk("q113_k203_causal_" + ts, 113, 203, 128, t); c.causal = true; v.push_back(c); }
    { Case c = mk("q203_k113_causal_" + ts, 203, 113, 64, t); c.causal = true; v.push_back(c); }  // rows with no key
    { Case c = mk("q1023_k1024_causal_" + ts, 1023, 1024, 64, t); c.causal = true; c.heads_q = c.heads_kv = 1; v.push_back(c); }
    { Case c = mk("gqa4_" + ts, 65, 97, 64, t); c.heads_q = 8; c.heads_kv = 2; c.causal = true; v.push_back(c); }
    { Case c = mk("gqa8_mqa_" + ts, 40, 77, 64, t); c.heads_q = 8; c.heads_kv = 1; v.push_back(c); }
    { Case c = mk("window_" + ts, 150, 150, 64, t); c.window_left = 20; c.window_right = 5; v.push_back(c); }
    { Case c = mk("softcap_" + ts, 70, 90, 64, t); c.softcap = 5.0f; c.input_range = 3.0f; v.push_back(c); }
    { Case c = mk("alibi_causal_" + ts, 60, 80, 64, t); c.alibi = true; c.causal = true; v.push_back(c); }
    { Case c = mk("sinks_" + ts, 33, 50, 64, t); c.sinks = true; c.causal = true; v.push_back(c); }
    { Case c = mk("bhsd_strided_" + ts, 45, 61, 64, t); c.bhsd = true; c.batch = 2; v.push_back(c); }
    { Case c = mk("padded_heads_" + ts, 31, 29, 64, t); c.pad_head = 8; c.heads_q = 4; c.heads_kv = 2; v.push_back(c); }
    { Case c = mk("varlen_empty_" + ts, 0, 0, 64, t); c.batch = 4; c.varlen_q = {5, 0, 37, 1}; c.varlen_k = {9, 3, 37, 0};
      c.causal = true; v.push_back(c); }
    { Case c = mk("varlen_gqa_" + ts, 0, 0, 128, t); c.batch = 3; c.heads_q = 4; c.heads_kv = 1; c.varlen_q = {17, 64, 2};
      c.varlen_k = {17, 100, 130}; v.push_back(c); }
    for (int64_t d : {8, 32, 80, 96, 160, 192, 256}) {
      Case c = mk("hdim" + std::to_string(d) + "_" + ts, 37, 75, d, t);
      c.causal = d % 64 == 0;
      v.push_back(c);
    }
  }
  { Case c = mk("len4097_f32", 4097, 4097, 32, DType::f32); c.heads_q = c.heads_kv = 1; c.causal = true; v.push_back(c); }
  { Case c = mk("len4097_bf16", 4097, 4097, 64, DType::bf16); c.heads_q = c.heads_kv = 1; v.push_back(c); }
  { Case c = mk("hdim_v_differs_f32", 20, 30, 64, DType::f32); c.head_dim_v = 40; v.push_back(c); }
  { Case c = mk("hdim1_f32", 19, 23, 1, DType::f32); v.push_back(c); }
  { Case c = mk("hdim512_f32", 9, 70, 512, DType::f32); v.push_back(c); }
  { Case c = mk("hdim320_bf16", 21, 40, 320, DType::bf16); v.push_back(c); }
  // Head dims of 32 k + 16 past one 128-key block (the CPU's AMX-BF16 path pads Q and K rows, or
  // f16's parts, with zeros to whole 32-element steps): causal GQA, f16, and a sliding window with
  // ALiBi and sinks.
  { Case c = mk("hdim80_causal_gqa_bf16", 300, 333, 80, DType::bf16); c.heads_q = 4; c.heads_kv = 2; c.causal = true; v.push_back(c); }
  { Case c = mk("hdim48_causal_f16", 200, 260, 48, DType::f16); c.causal = true; v.push_back(c); }
  { Case c = mk("hdim112_window_bf16", 150, 290, 112, DType::bf16); c.window_left = 60; c.window_right = 5; c.alibi = true;
    c.sinks = true; v.push_back(c); }
  { Case c = mk("scale_custom_f32", 30, 40, 64, DType::f32); c.scale = 0.3f; v.push_back(c); }
  { Case c = mk("large_logits_f16", 50, 50, 64, DType::f16); c.input_range = 4.0f; c.causal = true; v.push_back(c); }
  // Logits that keep growing along the keys: a row's running max rises block after block (the
  // CPU's AMX path keeps a stale max until a block's exceeds it by e^5.5, then rescales).
  for (bool causal : {false, true}) {
    Case c = mk(std::string("growing_logits_") + (causal ? "causal_" : "") + "bf16", 200, 1000, 128, DType::bf16);
    c.heads_q = 4;
    c.heads_kv = 2;
    c.k_ramp = 0.05f;
    c.input_range = 2.0f;
    c.causal = causal;
    v.push_back(c);
  }
  return v;
}

// Whether a target implements the case; anything else must be rejected by the dispatcher with
// a clear error (checked in UnsupportedIsAnError).
bool supported(const Target& tg, const Case& c) {
  if (tg.device == Device::cpu) return true;
  if (tg.backend == Backend::naive) return true;
  return c.dtype != DType::f32 && c.head_dim <= 256 && c.head_dim % 8 == 0 && c.dv() == c.head_dim;
}

const Target kTargets[] = {{Device::cpu, Backend::flash},
                           {Device::cpu, Backend::naive},
                           {Device::cuda, Backend::flash},
                           {Device::cuda, Backend::naive}};

class Forward : public ::testing::TestWithParam<std::tuple<Target, Case>> {};

TEST_P(Forward, MatchesFloat64Reference) {
  const auto& [tg, c] = GetParam();
  IOATTN_SKIP_IF_NO_DEVICE(tg);
  if (!supported(tg, c)) GTEST_SKIP() << "not in the dispatch table of " << tg.name() << " (rejection tested separately)";
  run_case(c, tg);
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<Target, Case>>& info) {
  return std::get<0>(info.param).name() + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(All, Forward,
                         ::testing::Combine(::testing::ValuesIn(kTargets), ::testing::ValuesIn(all_cases())),
                         case_name);

// Seeded random mixes of the features (tests/fuzz_cases.hpp) on every target; the CUDA flash
// kernels draw from the cases they take (f16 / bf16, head dims that are multiples of 8), and the
// CUDA targets from longer sequences (up to 400 tokens; session 30 ran them with 160).
constexpr int kFuzzSeeds = 48;

class FuzzForward : public ::testing::TestWithParam<std::tuple<Target, int>> {};

TEST_P(FuzzForward, MatchesFloat64Reference) {
  const auto& [tg, seed] = GetParam();
  IOATTN_SKIP_IF_NO_DEVICE(tg);
  FuzzSpace sp;
  sp.low_precision = sp.tensor_core_dims = tg.device == Device::cuda && tg.backend == Backend::flash;
  if (tg.device == Device::cuda) sp.max_len = 400;  // past several 128-row tiles (the reference stays cheap)
  const Case c = random_case(static_cast<uint64_t>(seed), sp);
  ASSERT_TRUE(supported(tg, c)) << c.name;
  run_case(c, tg);
}

std::string fuzz_name(const ::testing::TestParamInfo<std::tuple<Target, int>>& info) {
  return std::get<0>(info.param).name() + "_seed" + std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(All, FuzzForward,
                         ::testing::Combine(::testing::ValuesIn(kTargets), ::testing::Range(0, kFuzzSeeds)), fuzz_name);

class ForwardTarget : public ::testing::TestWithParam<Target> {};

// The edge tests' problem: q (sq rows), k and v (sk keys) in [1, s, H, D] memory, uniform random
// from seed, and o poisoned; run() calls forward (after any edit to k / v was uploaded).
struct EdgeProblem {
  int64_t sq, sk, H, D;
  detail::Buffer q, k, v, o;
  EdgeProblem(DType t, int64_t sq_, int64_t sk_, int64_t h, int64_t d, Device dev, uint64_t seed)
      : sq(sq_), sk(sk_), H(h), D(d), q(t, sq_ * h * d, dev), k(t, sk_ * h * d, dev), v(t, sk_ * h * d, dev),
        o(t, sq_ * h * d, dev) {
    std::mt19937_64 rng(seed);
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    o.poison();
  }
  void run(const AttnParams& prm, Backend backend, const TensorView& lse = TensorView{}) {
    Context ctx;
    ctx.backend = backend;
    forward(q.view({1, sq, H, D}), k.view({1, sk, H, D}), v.view({1, sk, H, D}), o.view({1, sq, H, D}), lse, prm, ctx);
    o.download();
  }
};

// A row with no visible key gives O = 0 and LSE = -inf, never NaN.
TEST_P(ForwardTarget, FullyMaskedRowsAreZeroWithNegInfLse) {
  const Target tg = GetParam();
  IOATTN_SKIP_IF_NO_DEVICE(tg);
  for (DType t : {DType::f32, DType::bf16}) {
    if (!supported(tg, mk("x", 1, 1, 64, t))) continue;
    const int64_t Sq = 40, Sk = 10, H = 2, D = 64;  // causal, bottom-right: rows 0..29 see nothing
    EdgeProblem e(t, Sq, Sk, H, D, tg.device, 7);
    detail::Buffer lse(DType::f32, H * Sq, tg.device);
    lse.poison();
    AttnParams prm;
    prm.causal = true;
    e.run(prm, tg.backend, lse.view({1, H, Sq}));
    lse.download();
    const detail::Buffer& o = e.o;
    for (int64_t i = 0; i < Sq; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const float l = static_cast<const float*>(lse.host())[h * Sq + i];
        if (i < Sq - Sk) {
          EXPECT_TRUE(std::isinf(l) && l < 0) << "row " << i << " LSE " << l;
          for (int64_t x = 0; x < D; ++x) ASSERT_EQ(o.get((i * H + h) * D + x), 0.0f) << "row " << i;
        } else {
          EXPECT_TRUE(std::isfinite(l)) << "row " << i;
        }
      }
  }
}

// NaN / Inf stored in keys that the mask hides must not reach the output (the mask overrides
// the score). Values of masked keys are read by the P.V product (0 x Inf = NaN) on tensor-core
// paths, so V stays finite here; keys outside [0, seqlen_k) are never read at all.
TEST_P(ForwardTarget, NaNInMaskedKeysDoesNotLeak) {
  const Target tg = GetParam();
  IOATTN_SKIP_IF_NO_DEVICE(tg);
  for (DType t : {DType::f32, DType::f16}) {
    if (!supported(tg, mk("x", 1, 1, 64, t))) continue;
    const int64_t S = 70, D = 64;
    EdgeProblem e(t, S, S, 1, D, tg.device, 9);
    // The last two key rows are visible only to the last two queries under causal masking.
    for (int64_t x = 0; x < D; ++x) {
      e.k.set((S - 1) * D + x, std::numeric_limits<float>::quiet_NaN());
      e.k.set((S - 2) * D + x, std::numeric_limits<float>::infinity());
    }
    e.k.upload();
    AttnParams prm;
    prm.causal = true;
    e.run(prm, tg.backend);
    for (int64_t i = 0; i + 2 < S; ++i)
      for (int64_t x = 0; x < D; ++x) ASSERT_TRUE(std::isfinite(e.o.get(i * D + x))) << "row " << i << " col " << x;
  }
}

// An inf in a visible V element reaches that output column as inf (P > 0 times inf), and every
// other column stays finite: on the CPU's AMX path for f16 (two bf16 parts per value) only the hi
// parts meet the inf, never an inf - inf of two parts. Every 16-bit dtype the target takes.
TEST_P(ForwardTarget, VisibleInfInVGivesInfInItsColumn) {
  const Target tg = GetParam();
  IOATTN_SKIP_IF_NO_DEVICE(tg);
  if (tg.backend != Backend::flash) GTEST_SKIP() << "the flash kernels";
  for (DType t : {DType::f16, DType::bf16}) {
    if (!supported(tg, mk("x", 1, 1, 64, t))) continue;
    const int64_t S = 150, H = 2, D = 64;
    EdgeProblem e(t, S, S, H, D, tg.device, 11);
    for (int64_t h = 0; h < H; ++h) e.v.set((5 * H + h) * D + 3, std::numeric_limits<float>::infinity());  // key 5, column 3
    e.v.upload();
    e.run(AttnParams{}, tg.backend);
    for (int64_t row = 0; row < S * H; ++row)
      for (int64_t x = 0; x < D; ++x) {
        const float y = e.o.get(row * D + x);
        if (x == 3)
          ASSERT_TRUE(std::isinf(y) && y > 0) << dtype_name(t) << " row " << row << ": " << y;
        else
          ASSERT_TRUE(std::isfinite(y)) << dtype_name(t) << " row " << row << " col " << x << ": " << y;
      }
  }
}

// The same inputs give the same outputs run to run (no races, no uninitialised reads).
TEST_P(ForwardTarget, Deterministic) {
  const Target tg = GetParam();
  IOATTN_SKIP_IF_NO_DEVICE(tg);
  Case c = mk("det", 130, 257, 64, tg.device == Device::cuda && tg.backend == Backend::flash ? DType::bf16 : DType::f32);
  c.causal = true;
  c.heads_q = 4;
  c.heads_kv = 2;
  const RunResult a = run_case(c, tg, 5), b = run_case(c, tg, 5);
  EXPECT_EQ(a.err_o, b.err_o);
  EXPECT_EQ(a.err_lse, b.err_lse);
}

// An explicit backend that cannot run the problem says why; nothing silently falls back.
TEST_P(ForwardTarget, UnsupportedIsAnError) {
  const Target tg = GetParam();
  IOATTN_SKIP_IF_NO_DEVICE(tg);
  if (tg.device != Device::cuda || tg.backend != Backend::flash) GTEST_SKIP() << "every CPU problem is supported";
  detail::Buffer q(DType::f32, 16 * 64, tg.device), o(DType::f32, 16 * 64, tg.device);
  std::mt19937_64 rng(1);
  q.fill_random(rng);
  o.poison();
  try {
    Context ctx;
    ctx.backend = Backend::flash;
    forward(q.view({1, 16, 1, 64}), q.view({1, 16, 1, 64}), q.view({1, 16, 1, 64}), o.view({1, 16, 1, 64}),
            TensorView{}, AttnParams{}, ctx);
    FAIL() << "f32 on the CUDA flash kernel should be rejected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("f32"), std::string::npos) << e.what();
  }
}

std::string target_name(const ::testing::TestParamInfo<Target>& info) { return info.param.name(); }
INSTANTIATE_TEST_SUITE_P(All, ForwardTarget, ::testing::ValuesIn(kTargets), target_name);

}  // namespace
}  // namespace ioattn::test

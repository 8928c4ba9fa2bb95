// Bad inputs: each is rejected with an ioattn::Error that names the argument, says what was
// expected and what came, and leaves the outputs untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <array>
#include <functional>
#include <limits>

#include "check.hpp"
#include "ioattn/explain.hpp"

namespace ioattn::test {
namespace {

// A valid problem: q [2, 16, 4, 32], k/v [2, 24, 2, 32], f32, plus varlen buffers.
struct Problem {
  detail::Buffer q{DType::f32, 2 * 16 * 4 * 32}, k{DType::f32, 2 * 24 * 2 * 32}, v{DType::f32, 2 * 24 * 2 * 32};
  detail::Buffer o{DType::f32, 2 * 16 * 4 * 32}, lse{DType::f32, 2 * 4 * 16};
  detail::Buffer q16{DType::f16, 2 * 16 * 4 * 32}, slopes{DType::f32, 4}, slopes_i{DType::i32, 4};
  detail::Buffer cu{DType::i32, 3}, cu_bad{DType::i32, 3};
  TensorView qv, kv, vv, ov, lv;
  AttnParams prm;
  Context ctx;
  Varlen varlen;
  bool use_varlen = false;
  Problem() {
    std::mt19937_64 rng(3);
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    q16.fill_random(rng);
    slopes.fill_random(rng);
    o.poison();
    lse.poison();
    qv = q.view({2, 16, 4, 32});
    kv = k.view({2, 24, 2, 32});
    vv = v.view({2, 24, 2, 32});
    ov = o.view({2, 16, 4, 32});
    lv = lse.view({2, 4, 16});
    cu.fill_i32({0, 10, 32});
    cu_bad.fill_i32({0, 20, 12});
  }
  void to_varlen() {  // q [32, 4, 32], k/v [48, 2, 32]
    use_varlen = true;
    qv = TensorView::contiguous(q.data(), DType::f32, {32, 4, 32});
    kv = TensorView::contiguous(k.data(), DType::f32, {48, 2, 32});
    vv = TensorView::contiguous(v.data(), DType::f32, {48, 2, 32});
    ov = TensorView::contiguous(o.data(), DType::f32, {32, 4, 32});
    lv = TensorView::contiguous(lse.data(), DType::f32, {4, 32});
    varlen.cu_seqlens_q = cu.view({3});
    varlen.cu_seqlens_k = cu.view({3});
  }
  void call() {
    if (use_varlen)
      forward_varlen(qv, kv, vv, ov, lv, varlen, prm, ctx);
    else
      forward(qv, kv, vv, ov, lv, prm, ctx);
  }
  bool outputs_untouched() const {
    for (int64_t i = 0; i < o.count(); ++i)
      if (!std::isnan(o.get(i))) return false;
    for (int64_t i = 0; i < lse.count(); ++i)
      if (!std::isnan(lse.get(i))) return false;
    return true;
  }
};

struct BadInput {
  const char* what;
  const char* argument;  // must appear in the message
  std::function<void(Problem&)> mutate;
};

const BadInput kBad[] = {
    {"null q pointer", "'q'", [](Problem& s) { s.qv.data = nullptr; }},
    {"null o pointer", "'o'", [](Problem& s) { s.ov.data = nullptr; }},
    {"q with 3 dims", "'q'", [](Problem& s) { s.qv.ndim = 3; }},
    {"int32 q", "q.dtype", [](Problem& s) { s.qv.dtype = DType::i32; }},
    {"k dtype differs from q", "k.dtype", [](Problem& s) { s.kv.dtype = DType::f16; }},
    {"o dtype differs from q", "o.dtype", [](Problem& s) { s.ov = s.q16.view({2, 16, 4, 32}); }},
    {"k batch mismatch", "k.shape[0]", [](Problem& s) { s.kv.shape[0] = 3; }},
    {"v seqlen mismatch", "v.shape[1]", [](Problem& s) { s.vv.shape[1] = 23; }},
    {"k head_dim mismatch", "k.shape[3]", [](Problem& s) { s.kv.shape[3] = 16; }},
    {"o heads mismatch", "o.shape[2]", [](Problem& s) { s.ov.shape[2] = 2; }},
    {"heads_q not divisible by heads_kv", "q.shape[2]",
     [](Problem& s) { s.kv.shape[2] = s.vv.shape[2] = 3; }},
    {"head_dim too large", "q.shape[3]",
     [](Problem& s) { s.qv.shape[3] = s.kv.shape[3] = 1024; }},
    {"head_dim 0", "q.shape[3]", [](Problem& s) { s.qv.shape[3] = s.kv.shape[3] = 0; }},
    {"non-unit last stride", "q.stride[3]", [](Problem& s) { s.qv.stride[3] = 2; }},
    {"negative stride", "k.stride[1]", [](Problem& s) { s.kv.stride[1] = -64; }},
    {"output stride 0", "o.stride[1]", [](Problem& s) { s.ov.stride[1] = 0; }},
    {"negative shape", "q.shape", [](Problem& s) { s.qv.shape[1] = -1; }},
    {"lse wrong shape", "lse.shape[2]", [](Problem& s) { s.lv.shape[2] = 15; }},
    {"lse wrong dtype", "lse.dtype", [](Problem& s) { s.lv.dtype = DType::f16; }},
    {"device mismatch", "k.device", [](Problem& s) { s.kv.device = Device::cuda; }},
    {"NaN scale", "params.scale", [](Problem& s) { s.prm.scale = std::numeric_limits<float>::quiet_NaN(); }},
    {"negative softcap", "params.softcap", [](Problem& s) { s.prm.softcap = -1.0f; }},
    {"window_left < -1", "params.window_left", [](Problem& s) { s.prm.window_left = -2; }},
    {"window_right < -1", "params.window_right", [](Problem& s) { s.prm.window_right = -5; }},
    {"alibi slopes wrong length", "params.alibi_slopes",
     [](Problem& s) { s.prm.alibi_slopes = s.slopes.view({3}); }},
    {"alibi slopes wrong dtype", "params.alibi_slopes.dtype",
     [](Problem& s) { s.prm.alibi_slopes = s.slopes_i.view({4}); }},
    {"sinks wrong length", "params.sinks", [](Problem& s) { s.prm.sinks = s.slopes.view({2}); }},
    {"negative threads", "ctx.num_threads", [](Problem& s) { s.ctx.num_threads = -1; }},
    {"cu_seqlens not monotonic", "cu_seqlens_q",
     [](Problem& s) { s.to_varlen(); s.varlen.cu_seqlens_q = s.cu_bad.view({3}); }},
    {"cu_seqlens past the packed tokens", "cu_seqlens_q[2]",
     [](Problem& s) { s.to_varlen(); s.qv.shape[0] = s.ov.shape[0] = 20; s.lv.shape[1] = 20; }},
    {"cu_seqlens wrong dtype", "cu_seqlens_k.dtype",
     [](Problem& s) { s.to_varlen(); s.varlen.cu_seqlens_k = s.slopes.view({3}); }},
    {"cu_seqlens_k missing", "cu_seqlens_k",
     [](Problem& s) { s.to_varlen(); s.varlen.cu_seqlens_k = TensorView{}; }},
    {"max_seqlen_q too small", "max_seqlen_q",
     [](Problem& s) { s.to_varlen(); s.varlen.max_seqlen_q = 5; }},
    {"varlen with 4-dim q", "'q'", [](Problem& s) { s.to_varlen(); s.qv = s.q.view({2, 16, 4, 32}); }},
};

class BadInputs : public ::testing::TestWithParam<BadInput> {};

TEST_P(BadInputs, RejectedWithClearMessageAndNothingWritten) {
  const BadInput& bad = GetParam();
  Problem s;
  bad.mutate(s);
  try {
    s.call();
    FAIL() << bad.what << ": accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(bad.argument), std::string::npos) << bad.what << ": message does not name " << bad.argument
                                                         << ": " << msg;
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
    EXPECT_NE(msg.find("got"), std::string::npos) << msg;
  }
  EXPECT_TRUE(s.outputs_untouched()) << bad.what << ": outputs were written";
}

INSTANTIATE_TEST_SUITE_P(Table, BadInputs, ::testing::ValuesIn(kBad),
                         [](const ::testing::TestParamInfo<BadInput>& info) {
                           std::string n = info.param.what;
                           for (char& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

TEST(Validation, TheValidSetupRuns) {
  Problem s;
  s.call();
  EXPECT_FALSE(s.outputs_untouched());
  Problem sv;
  sv.to_varlen();
  sv.call();
}

TEST(Validation, SelectNamesKernelAndLogs) {
  Problem s;
  const KernelChoice c = select_forward(s.qv, s.kv, s.vv, s.ov, s.lv, s.prm, s.ctx);
  EXPECT_NE(c.kernel.find("cpu/flash"), std::string::npos) << c.kernel;
  EXPECT_NE(c.kernel.find("hdim32"), std::string::npos) << c.kernel;
  EXPECT_FALSE(c.reason.empty());
  EXPECT_TRUE(s.outputs_untouched());
  s.ctx.backend = Backend::naive;
  EXPECT_NE(select_forward(s.qv, s.kv, s.vv, s.ov, s.lv, s.prm, s.ctx).kernel.find("cpu/naive"), std::string::npos);
}

// Empty tensors as frameworks hand them over (DLPack, contiguous views of a zero-size dim: every
// stride 0): seqlen_q = 0 or batch = 0 is a no-op, seqlen_k = 0 gives O = 0 and LSE = -inf (no row
// sees a key), and head_dim = 0 is an error naming head_dim, not a stride. Both backends.
TEST(Validation, EmptyTensorsWithZeroStrides) {
  for (Backend be : {Backend::flash, Backend::naive}) {
    for (const auto& dims : std::vector<std::array<int64_t, 3>>{{2, 0, 5}, {0, 3, 5}, {2, 3, 0}}) {
      const int64_t b = dims[0], sq = dims[1], sk = dims[2];
      detail::Buffer q{DType::f32, 2 * 3 * 4 * 32}, k{DType::f32, 2 * 5 * 2 * 32}, o{DType::f32, 2 * 3 * 4 * 32},
          lse{DType::f32, 2 * 4 * 3};
      std::mt19937_64 rng(5);
      q.fill_random(rng);
      k.fill_random(rng);
      o.poison();
      lse.poison();
      auto view = [](detail::Buffer& buf, std::initializer_list<int64_t> shape) {
        TensorView t = TensorView::contiguous(buf.data(), DType::f32, shape);
        for (int i = 0; i < t.ndim; ++i)
          if (t.numel() == 0) t.stride[i] = 0;  // as DLPack reports an empty tensor
        return t;
      };
      const TensorView qv = view(q, {b, sq, 4, 32}), kv = view(k, {b, sk, 2, 32}), ov = view(o, {b, sq, 4, 32}),
                       lv = view(lse, {b, 4, sq});
      Context ctx;
      ctx.backend = be;
      AttnParams prm;
      prm.causal = sk > 0 && sq > 0;
      ASSERT_NO_THROW(forward(qv, kv, kv, ov, lv, prm, ctx)) << "b " << b << " sq " << sq << " sk " << sk;
      for (int64_t i = 0; i < b * sq * 4 * 32; ++i) ASSERT_EQ(o.get(i), 0.0f) << i;
      for (int64_t i = 0; i < b * 4 * sq; ++i) ASSERT_TRUE(std::isinf(lse.get(i)) && lse.get(i) < 0) << lse.get(i);
      for (int64_t i = b * sq * 4 * 32; i < o.count(); ++i) ASSERT_TRUE(std::isnan(o.get(i)));  // past the view
    }
    detail::Buffer q{DType::f32, 8}, o{DType::f32, 8};
    o.poison();
    const TensorView qv = TensorView::contiguous(q.data(), DType::f32, {2, 3, 4, 0});
    const TensorView ov = TensorView::contiguous(o.data(), DType::f32, {2, 3, 4, 0});
    const TensorView kv = TensorView::contiguous(q.data(), DType::f32, {2, 5, 2, 0});
    Context ctx;
    ctx.backend = be;
    try {
      forward(qv, kv, kv, ov, TensorView{}, AttnParams{}, ctx);
      FAIL() << "head_dim 0 accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("q.shape[3]"), std::string::npos) << e.what();
    }
  }
}

TEST(Validation, CudaTensorsWithoutCudaAreAClearError) {
  if (detail::cuda_compiled()) GTEST_SKIP() << "this build has CUDA";
  Problem s;
  s.qv.device = s.kv.device = s.vv.device = s.ov.device = s.lv.device = Device::cuda;
  try {
    s.call();
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q.device"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(s.outputs_untouched());
}

// ---- explain: the seed arithmetic ---------------------------------------------------------
TEST(Explain, SeedNumbers) {
  const ExplainReport r = explain(ExplainInput{});
  EXPECT_EQ(r.score_bytes_per_head, 134217728.0);
  EXPECT_NEAR(r.naive_bytes_per_head / 1e6, 537, 0.5);
  EXPECT_NEAR(r.naive_bytes_per_layer / 1e9, 34.4, 0.05);
  EXPECT_NEAR(r.naive_bytes_per_model / 1e12, 2.75, 0.005);
  EXPECT_NEAR(r.flash_bytes_per_head / 1e6, 8.4, 0.05);
  EXPECT_NEAR(r.traffic_ratio, 64, 1e-9);
  EXPECT_NEAR(r.flops_per_head / 1e9, 34.4, 0.05);
  EXPECT_NEAR(r.flops_per_model / 1e12, 176, 0.5);
  EXPECT_NEAR(r.naive_traffic_seconds, 0.92, 0.005);
  EXPECT_NEAR(r.math_seconds, 0.35, 0.005);
  ExplainInput e2e;
  e2e.attention_share = 0.3;
  e2e.kernel_speedup = 2;
  EXPECT_NEAR(explain(e2e).end_to_end_speedup, 1.0 / (0.7 + 0.3 / 2), 1e-12);  // 1.18x
  EXPECT_NEAR(explain(e2e).end_to_end_limit, 1.0 / 0.7, 1e-12);               // Amdahl: 1.43x at most
  const std::string text = explain_text(e2e);
  for (const char* s : {"= 1.18x", "= 1.43x"}) EXPECT_NE(text.find(s), std::string::npos) << "explain text lacks " << s;
  e2e.attention_share = 1.0;  // all of the step is attention: the kernel speedup is the whole speedup
  EXPECT_NEAR(explain(e2e).end_to_end_speedup, 2.0, 1e-12);
  EXPECT_TRUE(std::isinf(explain(e2e).end_to_end_limit));
  EXPECT_EQ(explain(ExplainInput{}).end_to_end_speedup, 1.0);  // share 0: no estimate
}

TEST(Explain, OnlineSoftmaxWorkedExample) {
  const OnlineSoftmaxExample ex = online_softmax_example({2, 1, 3, 0}, {1, 2, 3, 4}, 2);
  ASSERT_EQ(ex.steps.size(), 2u);
  EXPECT_EQ(ex.steps[0].max_after, 2);
  EXPECT_NEAR(ex.steps[1].rescale, 0.368, 5e-4);
  EXPECT_NEAR(ex.steps[1].sum_after, 1.553, 5e-4);
  const double want[] = {0.237, 0.087, 0.644, 0.032};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(ex.probabilities[i], want[i], 5e-4);
  EXPECT_NEAR(ex.output, 2.471, 5e-4);
  EXPECT_NEAR(ex.output, ex.output_direct, 1e-12);
  const std::string text = explain_text(ExplainInput{});
  for (const char* s : {"134,217,728", "536.9 MB", "34.4 GB", "2.75 TB", "8.4 MB", "64x", "176 TFLOP", "0.92 s",
                        "0.35 s", "0.368", "1.553", "2.471"})
    EXPECT_NE(text.find(s), std::string::npos) << "explain text lacks " << s;
}

TEST(Explain, BadInputIsAnError) {
  ExplainInput in;
  in.seqlen = 0;
  EXPECT_THROW(explain(in), Error);
  EXPECT_THROW(online_softmax_example({1, 2}, {1}, 1), Error);
  auto arg_of = [](auto f) {
    try {
      f();
    } catch (const Error& e) {
      return e.argument();
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(arg_of([] { online_softmax_example({}, {}, 1); }), "scores");
  for (auto [field, name] : {std::pair{&ExplainInput::heads, "heads"}, {&ExplainInput::layers, "layers"},
                             {&ExplainInput::naive_passes, "naive_passes"}}) {
    ExplainInput bad;
    bad.*field = 0;
    EXPECT_EQ(arg_of([&] { explain(bad); }), name);
  }
  for (auto [field, name] : {std::pair{&ExplainInput::bandwidth_Bps, "bandwidth_Bps"},
                             {&ExplainInput::flops_per_s, "flops_per_s"}, {&ExplainInput::kernel_speedup, "kernel_speedup"}}) {
    ExplainInput bad;
    bad.*field = -1;
    EXPECT_EQ(arg_of([&] { explain(bad); }), name);
    bad.*field = std::numeric_limits<double>::infinity();
    EXPECT_EQ(arg_of([&] { explain(bad); }), name);
  }
  {
    ExplainInput bad;
    bad.attention_share = std::nan("");
    EXPECT_EQ(arg_of([&] { explain(bad); }), "attention_share");
  }
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(arg_of([&] { online_softmax_example({1, inf}, {1, 2}, 1); }), "scores[1]");
  EXPECT_EQ(arg_of([&] { online_softmax_example({std::nan(""), 1}, {1, 2}, 1); }), "scores[0]");
}

// -inf scores are masked keys, as in the kernels: weight 0; a row with none visible gives 0, not NaN.
TEST(Explain, OnlineSoftmaxMaskedKeys) {
  const double ninf = -std::numeric_limits<double>::infinity();
  const OnlineSoftmaxExample some = online_softmax_example({ninf, ninf, 1, ninf, 2}, {5, 6, 1, 7, 3}, 2);
  const OnlineSoftmaxExample same = online_softmax_example({1, 2}, {1, 3}, 1);
  EXPECT_NEAR(some.output, same.output, 1e-12);
  EXPECT_NEAR(some.output_direct, same.output, 1e-12);
  EXPECT_EQ(some.steps[0].sum_after, 0.0);
  EXPECT_EQ(some.probabilities[0], 0.0);
  const OnlineSoftmaxExample none = online_softmax_example({ninf, ninf, ninf}, {1, 2, 3}, 2);
  EXPECT_EQ(none.output, 0.0);
  EXPECT_EQ(none.output_direct, 0.0);
  for (const OnlineSoftmaxStep& st : none.steps) EXPECT_FALSE(std::isnan(st.sum_after) || std::isnan(st.acc_after));
  for (double p : none.probabilities) EXPECT_EQ(p, 0.0);
}

// ---- sampled check (ioattn bench on large problems) ------------------------------------------
// The last rows of one (batch, head) as a problem of their own have the same reference as the
// whole problem on those rows, with every feature that depends on the row position: bottom-right
// causal + window with seqlen_q != seqlen_k, ALiBi, sinks, GQA, [b, h, s, d] strides.
TEST(SampledCheck, LastRowsProblemMatchesTheWholeReference) {
  std::mt19937_64 rng(7);
  const int64_t B = 2, Sq = 37, Sk = 53, Hq = 4, Hk = 2, D = 24, Dv = 16;
  detail::Buffer q(DType::bf16, B * Sq * Hq * D), k(DType::bf16, B * Sk * Hk * D), v(DType::bf16, B * Sk * Hk * Dv);
  detail::Buffer o(DType::bf16, B * Sq * Hq * Dv), lse(DType::f32, B * Hq * Sq);
  detail::Buffer alibi(DType::f32, Hq), sinks(DType::f32, Hq);
  for (detail::Buffer* b : {&q, &k, &v, &alibi, &sinks}) b->fill_random(rng);
  o.poison();
  lse.poison();
  AttnParams prm;
  prm.causal = true;
  prm.window_left = 20;
  prm.alibi_slopes = alibi.view({Hq});
  prm.sinks = sinks.view({Hq});
  const TensorView qv = q.view({B, Hq, Sq, D}).transpose12(), kv = k.view({B, Hk, Sk, D}).transpose12();
  const TensorView vv = v.view({B, Hk, Sk, Dv}).transpose12(), ov = o.view({B, Hq, Sq, Dv}).transpose12();
  const TensorView lv = lse.view({B, Hq, Sq});
  Context ctx;
  forward(qv, kv, vv, ov, lv, prm, ctx);
  const detail::Validated val = detail::validate(qv, kv, vv, ov, lv, nullptr, prm, ctx);
  const detail::FwdProblem& p = val.p;
  const detail::RefResult full = detail::reference_forward(p, detail::RefPrecision::f64);
  const int64_t rows = 9;
  for (auto [b, h] : {std::pair<int64_t, int64_t>{1, 3}, {0, 1}}) {
    const detail::FwdProblem sp = detail::last_rows_problem(p, b, h, rows);
    const detail::RefResult part = detail::reference_forward(sp, detail::RefPrecision::f64);
    ASSERT_EQ(part.o.size(), static_cast<size_t>(rows * Dv));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = Sq - rows + r;
      EXPECT_EQ(part.lse[r], full.lse[(b * Hq + h) * Sq + i]) << "b " << b << " h " << h << " row " << i;
      for (int64_t x = 0; x < Dv; ++x)
        EXPECT_EQ(part.o[r * Dv + x], full.o[((b * Sq + i) * Hq + h) * Dv + x]) << "b " << b << " h " << h << " row " << i;
    }
  }

  // check_forward: whole when the budget allows, else the last rows of the first and last pairs.
  const detail::ForwardCheck whole = detail::check_forward(p, 1e12);
  EXPECT_FALSE(whole.sampled);
  const double row_flops = 2.0 * Sk * (D + Dv);
  const detail::ForwardCheck part = detail::check_forward(p, 2 * 5 * row_flops);
  EXPECT_TRUE(part.sampled);
  EXPECT_EQ(part.heads_checked, 2);
  EXPECT_EQ(part.rows_checked, 5);
  EXPECT_GT(part.o.max_abs, 0.0);  // bf16 output: rounding errors, never exactly the reference
  EXPECT_LE(part.o.max_abs, whole.o.max_abs);
  EXPECT_LE(whole.o.max_abs, 2 * whole.naive_o.max_abs + 1e-3);
  // A wrong value in a sampled row is caught; one outside the sample is not (the scope is stated
  // in every bench record).
  const int64_t last_row_last_head = ((B - 1) * Hq + (Hq - 1)) * Sq + (Sq - 1);  // [b, h, s] element row
  const float kept = o.get(last_row_last_head * Dv);
  o.set(last_row_last_head * Dv, 5.0f);  // |O| <= 1 here (a convex mix of values in [-1, 1])
  EXPECT_GT(detail::check_forward(p, 2 * 5 * row_flops).o.max_abs, 3.0);
  o.set(last_row_last_head * Dv, kept);
  o.set(((B - 1) * Hq + 1) * Sq * Dv, 5.0f);  // batch 1, head 1, row 0: outside the sample
  EXPECT_LE(detail::check_forward(p, 2 * 5 * row_flops).o.max_abs, whole.o.max_abs);
}

}  // namespace
}  // namespace ioattn::test

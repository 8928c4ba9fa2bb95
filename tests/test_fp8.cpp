// FP8 (e4m3) forward: validation errors and the CPU paths (naive = the float64 reference on the
// dequantised inputs, flash = tiled with dequantise-on-load) against the float64 reference.
//
// Tolerance (the project's rule, with the low precision of an fp8 attention):
//   max|O - O_ref| <= 2 * max|O_naive_fp8 - O_ref| + atol,  LSE likewise,
// where O_ref is the float64 attention of the dequantised inputs (code * descale) and
// O_naive_fp8 is standard attention with S in fp32, the unnormalised P = exp(S - max) rounded to
// e4m3 (as an fp8 kernel feeds P to its P V GEMM), V in e4m3 (its codes), O rounded to the
// output dtype (RefPrecision::emulated on an f8e4m3 problem, src/cpu/reference.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "core/harness.hpp"
#include "core/validate.hpp"
#include "cpu/reference.hpp"
#include "cpu/serving_quant.h"
#include "ioattn/ioattn.hpp"
#include "check.hpp"

namespace ioattn::test {
namespace {

struct Fp8Case {
  std::string name;
  int64_t b = 1, sq = 17, sk = 17, hq = 2, hkv = 2, d = 64;
  bool causal = false;
  DType out = DType::bf16;
  bool descale = true;
  // the score modifiers and masks beyond causal (the sm90 fp8 kernel's kLocal rows)
  int64_t wl = -1, wr = -1;
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
  // varlen (forward_varlen) when non-empty: the sequences' lengths (b, sq and sk are then derived:
  // the count and the longest); 3 NaN tokens follow the last sequence in q, k and v
  std::vector<int32_t> lens_q, lens_k;
  int nan_seq = -1;  // varlen: this sequence's K / V tokens are NaN (give it no query rows)
};

// A varlen case on top of `base` (its heads, head dim, mask and features).
Fp8Case with_lens(Fp8Case base, const std::string& name, std::vector<int32_t> lens_q, std::vector<int32_t> lens_k) {
  base.name = name;
  base.b = static_cast<int64_t>(lens_q.size());
  base.sq = *std::max_element(lens_q.begin(), lens_q.end());
  base.sk = *std::max_element(lens_k.begin(), lens_k.end());
  base.lens_q = std::move(lens_q);
  base.lens_k = std::move(lens_k);
  return base;
}

// A case with a sliding window / softcap / ALiBi / sinks on top of `base`.
Fp8Case with_features(Fp8Case base, const std::string& name, int64_t wl, int64_t wr, float softcap, bool alibi,
                      bool sinks) {
  base.name = name;
  base.wl = wl, base.wr = wr, base.softcap = softcap, base.alibi = alibi, base.sinks = sinks;
  return base;
}

struct Fp8Problem {
  Fp8Case c;
  std::vector<uint8_t> q, k, v;
  std::vector<uint16_t> o;
  std::vector<float> lse, qd, kd, vd, slopes, sink;
  std::vector<int32_t> cu_q, cu_k;  // varlen
  TensorView qv, kv, vv, ov, lv;
  AttnParams prm;
  Varlen vl;  // varlen: host views of cu_q / cu_k

  bool varlen() const { return !c.lens_q.empty(); }
  // Rows of q / o and of k / v: batch x seqlen, or varlen's packed tokens (q, k, v: + 3 NaN tokens).
  int64_t rows_q() const { return varlen() ? cu_q.back() : c.b * c.sq; }
  int64_t rows_k() const { return varlen() ? cu_k.back() : c.b * c.sk; }

  explicit Fp8Problem(const Fp8Case& cc, uint64_t seed = 7) : c(cc) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-3.0f, 3.0f), ud(0.25f, 1.5f);
    if (varlen()) {
      cu_q.assign(1, 0), cu_k.assign(1, 0);
      for (size_t i = 0; i < c.lens_q.size(); ++i) {
        cu_q.push_back(cu_q.back() + c.lens_q[i]);
        cu_k.push_back(cu_k.back() + c.lens_k[i]);
      }
    }
    const int64_t pad = varlen() ? 3 : 0;  // the NaN tail tokens
    q.resize((rows_q() + pad) * c.hq * c.d);
    k.resize((rows_k() + pad) * c.hkv * c.d);
    v.resize(k.size());
    for (auto& x : q) x = detail::float_to_e4m3(u(rng));
    for (auto& x : k) x = detail::float_to_e4m3(u(rng));
    for (auto& x : v) x = detail::float_to_e4m3(u(rng));
    constexpr uint8_t kNaN = 0x7f;  // e4m3 NaN
    std::fill(q.begin() + rows_q() * c.hq * c.d, q.end(), kNaN);
    std::fill(k.begin() + rows_k() * c.hkv * c.d, k.end(), kNaN);
    std::fill(v.begin() + rows_k() * c.hkv * c.d, v.end(), kNaN);
    if (c.nan_seq >= 0) {  // the sequence before it must not read it (gaps in the fp8 kernel's V^T)
      const auto lo = k.begin() + cu_k[c.nan_seq] * c.hkv * c.d, hi = k.begin() + cu_k[c.nan_seq + 1] * c.hkv * c.d;
      std::fill(lo, hi, kNaN);
      std::fill(v.begin() + (lo - k.begin()), v.begin() + (hi - k.begin()), kNaN);
    }
    o.assign(rows_q() * c.hq * c.d, 0x7fc0);  // NaN poison (bf16 and f16 both read it as NaN)
    lse.assign(rows_q() * c.hq, std::numeric_limits<float>::quiet_NaN());
    for (auto* ds : {&qd, &kd, &vd}) {
      ds->resize(c.b * c.hkv);
      for (auto& x : *ds) x = ud(rng);
    }
    if (varlen()) {
      qv = TensorView::contiguous(q.data(), DType::f8e4m3, {rows_q(), c.hq, c.d});
      kv = TensorView::contiguous(k.data(), DType::f8e4m3, {rows_k(), c.hkv, c.d});
      vv = TensorView::contiguous(v.data(), DType::f8e4m3, {rows_k(), c.hkv, c.d});
      ov = TensorView::contiguous(o.data(), c.out, {rows_q(), c.hq, c.d});
      lv = TensorView::contiguous(lse.data(), DType::f32, {c.hq, rows_q()});
      vl.cu_seqlens_q = TensorView::contiguous(cu_q.data(), DType::i32, {c.b + 1});
      vl.cu_seqlens_k = TensorView::contiguous(cu_k.data(), DType::i32, {c.b + 1});
      vl.max_seqlen_q = c.sq;
      vl.max_seqlen_k = c.sk;
    } else {
      qv = TensorView::contiguous(q.data(), DType::f8e4m3, {c.b, c.sq, c.hq, c.d});
      kv = TensorView::contiguous(k.data(), DType::f8e4m3, {c.b, c.sk, c.hkv, c.d});
      vv = TensorView::contiguous(v.data(), DType::f8e4m3, {c.b, c.sk, c.hkv, c.d});
      ov = TensorView::contiguous(o.data(), c.out, {c.b, c.sq, c.hq, c.d});
      lv = TensorView::contiguous(lse.data(), DType::f32, {c.b, c.hq, c.sq});
    }
    prm.causal = c.causal;
    if (c.descale) {
      prm.q_descale = TensorView::contiguous(qd.data(), DType::f32, {c.b, c.hkv});
      prm.k_descale = TensorView::contiguous(kd.data(), DType::f32, {c.b, c.hkv});
      prm.v_descale = TensorView::contiguous(vd.data(), DType::f32, {c.b, c.hkv});
    }
    prm.window_left = c.wl;
    prm.window_right = c.wr;
    prm.softcap = c.softcap;
    for (int64_t h = 0; h < c.hq; ++h) {
      slopes.push_back(0.05f * static_cast<float>(h + 1));
      sink.push_back(-1.0f + 0.75f * static_cast<float>(h));
    }
    if (c.alibi) prm.alibi_slopes = TensorView::contiguous(slopes.data(), DType::f32, {c.hq});
    if (c.sinks) prm.sinks = TensorView::contiguous(sink.data(), DType::f32, {c.hq});
  }
  float out_at(size_t i) const {
    return c.out == DType::bf16 ? detail::bf16_to_float(o[i]) : detail::f16_to_float(o[i]);
  }
  // forward() or forward_varlen() on the host views.
  KernelChoice run(const Context& ctx) {
    return varlen() ? forward_varlen(qv, kv, vv, ov, lv, vl, prm, ctx) : forward(qv, kv, vv, ov, lv, prm, ctx);
  }
};

// The argument an ioattn::Error names, or "" when nothing is thrown.
template <class F>
std::string error_arg(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.argument();
  }
  return "";
}

TEST(Fp8Validation, ErrorsNameTheArgumentAndWriteNothing) {
  Fp8Problem p({"v", 2, 16, 24, 4, 2, 32});
  std::vector<uint16_t> k16(p.k.size());
  const TensorView k_bf16 = TensorView::contiguous(k16.data(), DType::bf16, {2, 24, 2, 32});
  std::vector<uint8_t> o8(p.o.size());
  const TensorView o_fp8 = TensorView::contiguous(o8.data(), DType::f8e4m3, {2, 16, 4, 32});
  std::vector<float> o32(p.o.size());
  const TensorView o_f32 = TensorView::contiguous(o32.data(), DType::f32, {2, 16, 4, 32});
  auto run = [&](const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                 const AttnParams& prm) { return [&, prm] { forward(q, k, v, o, p.lv, prm); }; };

  EXPECT_EQ(error_arg(run(p.qv, k_bf16, p.vv, p.ov, p.prm)), "k.dtype");
  EXPECT_EQ(error_arg(run(p.qv, p.kv, p.vv, o_fp8, p.prm)), "o.dtype");
  EXPECT_EQ(error_arg(run(p.qv, p.kv, p.vv, o_f32, p.prm)), "o.dtype");
  {
    AttnParams prm = p.prm;  // descale of the wrong shape: [batch, heads_q] instead of heads_kv
    prm.k_descale = TensorView::contiguous(p.kd.data(), DType::f32, {2, 1});
    EXPECT_EQ(error_arg(run(p.qv, p.kv, p.vv, p.ov, prm)), "params.k_descale.shape[1]");
    prm.k_descale = TensorView::contiguous(p.kd.data(), DType::f32, {4});
    EXPECT_EQ(error_arg(run(p.qv, p.kv, p.vv, p.ov, prm)), "params.k_descale");
    prm.k_descale = TensorView::contiguous(p.kd.data(), DType::f32, {1, 2});
    EXPECT_EQ(error_arg(run(p.qv, p.kv, p.vv, p.ov, prm)), "params.k_descale.shape[0]");
    prm.k_descale = TensorView::contiguous(p.kd.data(), DType::i32, {2, 2});
    EXPECT_EQ(error_arg(run(p.qv, p.kv, p.vv, p.ov, prm)), "params.k_descale.dtype");
  }
  {
    // Descales with 16-bit inputs are an error, not ignored.
    std::vector<uint16_t> q16(p.q.size()), v16(p.v.size()), o16(p.o.size());
    const TensorView qb = TensorView::contiguous(q16.data(), DType::bf16, {2, 16, 4, 32});
    const TensorView vb = TensorView::contiguous(v16.data(), DType::bf16, {2, 24, 2, 32});
    const TensorView ob = TensorView::contiguous(o16.data(), DType::bf16, {2, 16, 4, 32});
    AttnParams prm;
    prm.v_descale = p.prm.v_descale;
    EXPECT_EQ(error_arg(run(qb, k_bf16, vb, ob, prm)), "params.v_descale");
  }
  {
    // The backward has no fp8 path.
    std::vector<uint16_t> g(p.o.size());
    const TensorView dout = TensorView::contiguous(g.data(), DType::bf16, {2, 16, 4, 32});
    Gradients grads;
    EXPECT_EQ(error_arg([&] { backward(p.qv, p.kv, p.vv, p.ov, dout, p.lv, grads, p.prm); }), "q.dtype");
  }
  // Nothing was written by any rejected call.
  for (size_t i = 0; i < p.o.size(); ++i) ASSERT_TRUE(std::isnan(p.out_at(i))) << i;
  for (float x : p.lse) ASSERT_TRUE(std::isnan(x));
}

TEST(Fp8Validation, SelectNamesFp8) {
  Fp8Problem p({"v", 1, 8, 8, 2, 2, 32});
  const KernelChoice kc = select_forward(p.qv, p.kv, p.vv, p.ov, p.lv, p.prm);
  EXPECT_NE(kc.kernel.find("f8e4m3"), std::string::npos) << kc.kernel;
  EXPECT_NE(kc.kernel.find("fp8-descale->bf16"), std::string::npos) << kc.kernel;
}

// The descales act (a reference and a kernel that both ignored them would agree with each other):
// v_descale = 2 doubles O exactly; q_descale = 2 equals scale doubled; on both CPU backends.
TEST(Fp8Forward, DescalesAct) {
  for (Backend be : {Backend::naive, Backend::flash}) {
    Context ctx;
    ctx.backend = be;
    Fp8Problem base({"d", 1, 9, 20, 2, 1, 32, false, DType::bf16, false});
    forward(base.qv, base.kv, base.vv, base.ov, base.lv, base.prm, ctx);
    Fp8Problem vd({"d", 1, 9, 20, 2, 1, 32, false, DType::bf16, false});
    std::vector<float> two(1, 2.0f);
    vd.prm.v_descale = TensorView::contiguous(two.data(), DType::f32, {1, 1});
    forward(vd.qv, vd.kv, vd.vv, vd.ov, vd.lv, vd.prm, ctx);
    Fp8Problem qd({"d", 1, 9, 20, 2, 1, 32, false, DType::bf16, false});
    qd.prm.q_descale = TensorView::contiguous(two.data(), DType::f32, {1, 1});
    forward(qd.qv, qd.kv, qd.vv, qd.ov, qd.lv, qd.prm, ctx);
    Fp8Problem sc({"d", 1, 9, 20, 2, 1, 32, false, DType::bf16, false});
    sc.prm.scale = 2.0f / std::sqrt(32.0f);
    forward(sc.qv, sc.kv, sc.vv, sc.ov, sc.lv, sc.prm, ctx);
    float diff_v = 0, diff_q = 0, moved = 0;
    for (size_t i = 0; i < base.o.size(); ++i) {
      diff_v = std::max(diff_v, std::fabs(vd.out_at(i) - 2.0f * base.out_at(i)));
      diff_q = std::max(diff_q, std::fabs(qd.out_at(i) - sc.out_at(i)));
      moved = std::max(moved, std::fabs(qd.out_at(i) - base.out_at(i)));
    }
    EXPECT_EQ(diff_v, 0.0f) << backend_name(be);
    EXPECT_LE(diff_q, 1e-6) << backend_name(be);
    EXPECT_GT(moved, 1e-2) << backend_name(be);
    for (size_t i = 0; i < base.lse.size(); ++i) EXPECT_NEAR(qd.lse[i], sc.lse[i], 1e-5) << backend_name(be);
  }
}

// The largest O and LSE errors of p's outputs (written by a backend) against the float64
// reference, and those of attention computed in fp8 (the emulated reference) as the baseline;
// an unwritten (NaN) element or a finite LSE where the reference's is -inf counts as infinite.
struct Fp8Errors {
  double err_o = 0, naive_o = 0, err_l = 0, naive_l = 0;
};
Fp8Errors fp8_errors(const Fp8Problem& p) {
  auto val = detail::validate(p.qv, p.kv, p.vv, p.ov, p.lv, p.varlen() ? &p.vl : nullptr, p.prm, Context{});
  const int64_t rows = p.varlen() ? p.rows_q() : -1;
  const detail::RefResult ref = detail::reference_forward(val.p, detail::RefPrecision::f64, rows);
  const detail::RefResult emu = detail::reference_forward(val.p, detail::RefPrecision::emulated, rows);
  Fp8Errors e;
  detail::for_each_output_row(val.p, ref, [&](int64_t oo, int64_t ro, int64_t lo, int64_t rl) {
    for (int64_t x = 0; x < p.c.d; ++x) {
      const double got = p.out_at(static_cast<size_t>(oo + x));
      e.err_o = std::max(e.err_o, std::isnan(got) ? INFINITY : std::fabs(got - ref.o[ro + x]));
      e.naive_o = std::max(e.naive_o, std::fabs(emu.o[ro + x] - ref.o[ro + x]));
    }
    const double gl = p.lse[lo], rlse = ref.lse[rl];
    if (std::isinf(rlse)) {
      if (!(std::isinf(gl) && gl < 0)) e.err_l = INFINITY;
    } else {
      e.err_l = std::max(e.err_l, std::isnan(gl) ? INFINITY : std::fabs(gl - rlse));
      e.naive_l = std::max(e.naive_l, std::fabs(emu.lse[rl] - rlse));
    }
  });
  return e;
}

// The harness's sampled check (check_forward on a budget: the last rows of the first and the last
// (batch, head) pair as sub-problems) on an fp8 problem whose descales differ per (batch, kv head):
// each sub-problem must carry its own pair's factors (and read O in bf16), so the sample passes
// the same rule as the whole problem.
TEST(Fp8Forward, SampledCheckFollowsTheDescales) {
  Fp8Problem p({"sampled", 2, 300, 300, 4, 2, 64, true});
  Context ctx;
  ctx.backend = Backend::flash;
  p.run(ctx);
  const detail::FwdProblem hp = detail::validate(p.qv, p.kv, p.vv, p.ov, p.lv, nullptr, p.prm, Context{}).p;
  const detail::ForwardCheck whole = detail::check_forward(hp, 1e18), part = detail::check_forward(hp, 2e6);
  ASSERT_FALSE(whole.sampled);
  ASSERT_TRUE(part.sampled);
  EXPECT_EQ(part.heads_checked, 2);
  EXPECT_LT(part.rows_checked, 300);
  EXPECT_LE(whole.o.max_abs, 2 * whole.naive_o.max_abs + 1e-3);
  EXPECT_LE(part.o.max_abs, 2 * part.naive_o.max_abs + 1e-3);
  EXPECT_LE(part.o.max_abs, whole.o.max_abs);  // a subset of the same rows
  EXPECT_LE(part.lse.max_abs, 1e-4);
  EXPECT_GT(p.qd[0], 0.0f);
  EXPECT_NE(p.qd[0], p.qd[3]);  // the first and the last pair's factors differ
}

class Fp8Forward : public ::testing::TestWithParam<std::tuple<Fp8Case, Backend>> {};

TEST_P(Fp8Forward, MatchesReference) {
  const Fp8Case& c = std::get<0>(GetParam());
  const Backend be = std::get<1>(GetParam());
  Fp8Problem p(c);
  Context ctx;
  ctx.backend = be;
  p.run(ctx);
  const auto [err_o, naive_o, err_l, naive_l] = fp8_errors(p);
  const double atol = 1e-3;
  EXPECT_LE(err_o, 2 * naive_o + atol) << "naive fp8 error " << naive_o;
  EXPECT_LE(err_l, 2 * naive_l + atol) << "naive fp8 error " << naive_l;
  // The fp8 emulation must be a real low-precision baseline (P in e4m3 loses ~2^-4 relative),
  // not the reference itself, on shapes with more than one key per row.
  if (c.sk > 1 && !c.causal) EXPECT_GT(naive_o, 1e-4);
}

// One fp8 case through the public API on CUDA device 0: sm90 with head_dim 64 / 128 / 256 runs the
// fp8 wgmma kernel (checked by name; `kernel_part` too, e.g. "local(" for the kLocal rows) and
// must match the reference by the rule above (O and LSE); anything else must fail with a reason
// naming the obstacle ("fp8: head_dim 96" on sm90, "sm90" elsewhere).
void run_cuda_fp8_case(const Fp8Case& c, int arch, const std::string& kernel_part = "") {
  Fp8Problem h(c);  // host copies: inputs for the reference, and the bytes we upload
  auto dev = [](const void* src, DType t, int64_t n) {
    detail::Buffer b(t, n, Device::cuda);
    std::memcpy(b.host(), src, b.bytes());
    b.upload();
    return b;
  };
  detail::Buffer q = dev(h.q.data(), DType::f8e4m3, static_cast<int64_t>(h.q.size()));
  detail::Buffer k = dev(h.k.data(), DType::f8e4m3, static_cast<int64_t>(h.k.size()));
  detail::Buffer v = dev(h.v.data(), DType::f8e4m3, static_cast<int64_t>(h.v.size()));
  detail::Buffer o = dev(h.o.data(), c.out, static_cast<int64_t>(h.o.size()));
  detail::Buffer l = dev(h.lse.data(), DType::f32, static_cast<int64_t>(h.lse.size()));
  detail::Buffer qd = dev(h.qd.data(), DType::f32, c.b * c.hkv), kd = dev(h.kd.data(), DType::f32, c.b * c.hkv),
                 vd = dev(h.vd.data(), DType::f32, c.b * c.hkv);
  detail::Buffer slopes = dev(h.slopes.data(), DType::f32, c.hq), sinks = dev(h.sink.data(), DType::f32, c.hq);
  AttnParams prm = h.prm;  // the host problem's mask and modifiers, with device views
  if (c.descale) {
    prm.q_descale = qd.view({c.b, c.hkv});
    prm.k_descale = kd.view({c.b, c.hkv});
    prm.v_descale = vd.view({c.b, c.hkv});
  }
  if (c.alibi) prm.alibi_slopes = slopes.view({c.hq});
  if (c.sinks) prm.sinks = sinks.view({c.hq});
  const int64_t tq = h.rows_q(), tk = h.rows_k();
  detail::Buffer cuq = dev(h.cu_q.data(), DType::i32, static_cast<int64_t>(h.cu_q.size()));
  detail::Buffer cuk = dev(h.cu_k.data(), DType::i32, static_cast<int64_t>(h.cu_k.size()));
  Varlen vl = h.vl;
  const bool varlen = h.varlen();
  if (varlen) vl.cu_seqlens_q = cuq.view({c.b + 1}), vl.cu_seqlens_k = cuk.view({c.b + 1});
  const TensorView qv = varlen ? q.view({tq, c.hq, c.d}) : q.view({c.b, c.sq, c.hq, c.d}),
                   kv = varlen ? k.view({tk, c.hkv, c.d}) : k.view({c.b, c.sk, c.hkv, c.d}),
                   vv = varlen ? v.view({tk, c.hkv, c.d}) : v.view({c.b, c.sk, c.hkv, c.d}),
                   ov = varlen ? o.view({tq, c.hq, c.d}) : o.view({c.b, c.sq, c.hq, c.d}),
                   lv = varlen ? l.view({c.hq, tq}) : l.view({c.b, c.hq, c.sq});
  auto run = [&] {
    return varlen ? forward_varlen(qv, kv, vv, ov, lv, vl, prm) : forward(qv, kv, vv, ov, lv, prm);
  };
  if (arch != 90 || (c.d != 64 && c.d != 128 && c.d != 256)) {
    try {
      run();
      ADD_FAILURE() << c.name << ": fp8 ran on sm" << arch << " hdim" << c.d;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(arch == 90 ? "fp8: head_dim 96" : "sm90"), std::string::npos) << msg;
    }
    return;
  }
  // Varlen's V^T workspace comes from the stream-ordered pool: poisoned first, so a gap column the
  // pre-pass did not zero reaches O as NaN (0 x NaN).
  if (varlen) EXPECT_TRUE(detail::cuda_poison_pool(size_t{16} << 20)) << c.name << ": the pool was not poisoned";
  const KernelChoice kc = run();
  EXPECT_NE(kc.kernel.find("f8e4m3"), std::string::npos) << kc.kernel;
  EXPECT_NE(kc.kernel.find(kernel_part), std::string::npos) << c.name << ": " << kc.kernel;
  o.download();
  l.download();
  std::memcpy(h.o.data(), o.host(), o.bytes());
  std::memcpy(h.lse.data(), l.host(), l.bytes());
  const auto [err_o, naive_o, err_l, naive_l] = fp8_errors(h);
  EXPECT_LE(err_o, 2 * naive_o + 1e-3) << c.name << " naive fp8 error " << naive_o;
  EXPECT_LE(err_l, 2 * naive_l + 1e-3) << c.name << " naive fp8 error " << naive_l;
}

// CUDA: the public API on a device (run_cuda_fp8_case). An fp8 problem the kernel cannot take
// (hdim 96) fails with the reason; other archs: fp8 fails with a reason naming the sm90 kernel.
TEST(Fp8Cuda, ApiOnDevice) {
  if (detail::cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA device";
  const int arch = detail::cuda_device_arch(0);
  for (const Fp8Case& c : {Fp8Case{"a", 2, 113, 203, 4, 1, 128, false}, Fp8Case{"b", 1, 300, 300, 2, 2, 128, true},
                           Fp8Case{"c", 1, 64, 64, 2, 2, 64, false}, Fp8Case{"d", 2, 77, 130, 4, 2, 256, false},
                           Fp8Case{"e", 1, 130, 130, 2, 1, 256, true}, Fp8Case{"f", 2, 300, 277, 4, 2, 64, true},
                           Fp8Case{"g", 1, 40, 40, 2, 2, 96, false}})
    run_cuda_fp8_case(c, arch);
}

// The cases with windows / softcap / ALiBi / sinks (fp8_feature_cases): on sm90 the kLocal rows of
// the fp8 wgmma kernel (session 27), every head dim.
std::vector<Fp8Case> fp8_feature_cases();
TEST(Fp8Cuda, WindowsSoftcapAlibiSinksOnDevice) {
  if (detail::cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA device";
  const int arch = detail::cuda_device_arch(0);
  for (const Fp8Case& c : fp8_feature_cases()) run_cuda_fp8_case(c, arch, "local(");
}

// Varlen (fp8_varlen_cases): on sm90 the kLocal rows with ragged Q / K maps and the packed V^T
// workspace (session 28), every head dim; the 3 NaN tokens after the last sequence must not reach it.
std::vector<Fp8Case> fp8_varlen_cases();
TEST(Fp8Cuda, VarlenOnDevice) {
  if (detail::cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA device";
  const int arch = detail::cuda_device_arch(0);
  for (const Fp8Case& c : fp8_varlen_cases()) run_cuda_fp8_case(c, arch, "varlen");
}

std::vector<Fp8Case> fp8_cases() {
  std::vector<Fp8Case> v;
  v.push_back({"one", 1, 1, 1, 1, 1, 64});
  v.push_back({"s17_gqa", 2, 17, 17, 4, 2, 64});
  v.push_back({"s17_gqa_causal", 2, 17, 17, 4, 2, 64, true});
  v.push_back({"q113_k203_d128", 1, 113, 203, 2, 1, 128});
  v.push_back({"q113_k203_d128_causal", 1, 113, 203, 2, 1, 128, true});
  v.push_back({"q203_k113_causal_f16", 1, 203, 113, 2, 2, 128, true, DType::f16});
  v.push_back({"no_descale", 1, 65, 130, 2, 2, 64, false, DType::bf16, false});
  for (const Fp8Case& c : fp8_feature_cases()) v.push_back(c);
  for (const Fp8Case& c : fp8_varlen_cases()) v.push_back(c);
  return v;
}

// Windows (bottom-right, left / right / both; blocks skipped whole at 300+ keys), softcap, ALiBi and
// sinks, alone and together, at head_dim 64 / 128 / 256, causal or not, GQA, seqlen_q != seqlen_k
// (rows with no visible key: O = 0, LSE = -inf, or the sink alone).
std::vector<Fp8Case> fp8_feature_cases() {
  std::vector<Fp8Case> v;
  v.push_back(with_features({"", 1, 300, 300, 4, 2, 128, true}, "window_causal_d128", 70, 0, 0.0f, false, false));
  v.push_back(with_features({"", 2, 113, 400, 4, 1, 64}, "window_both_d64", 90, 40, 0.0f, false, false));
  v.push_back(with_features({"", 1, 203, 113, 2, 2, 256, true}, "window_left_causal_d256_no_key_rows", 30, 0, 0.0f,
                            false, false));
  v.push_back(with_features({"", 1, 130, 257, 2, 1, 128}, "softcap_d128", -1, -1, 5.0f, false, false));
  v.push_back(with_features({"", 1, 150, 150, 4, 2, 64, true}, "alibi_causal_d64", -1, -1, 0.0f, true, false));
  v.push_back(with_features({"", 2, 77, 190, 2, 2, 256}, "sinks_d256", -1, -1, 0.0f, false, true));
  v.push_back(with_features({"", 1, 203, 113, 4, 2, 128, true, DType::f16}, "sinks_causal_no_key_rows_f16", -1, -1,
                            0.0f, false, true));
  v.push_back(with_features({"", 1, 260, 330, 4, 1, 128, true}, "all_d128", 100, 0, 20.0f, true, true));
  v.push_back(with_features({"", 1, 190, 190, 2, 2, 64}, "all_no_descale_d64", 50, 50, 8.0f, true, true));
  v.back().descale = false;
  return v;
}

// Packed sequences: empty ones (no query rows; no keys: O = 0, LSE = -inf), seqlen_q != seqlen_k,
// lengths around the tiles (1, 17, 113, 129, 193, 300), causal and not, GQA, every head dim, with a
// window and with softcap / ALiBi / sinks on top; NaN K / V in a query-less sequence (nan_seq) right
// after another's keys, which that sequence's key blocks reach past its end.
std::vector<Fp8Case> fp8_varlen_cases() {
  std::vector<Fp8Case> v;
  v.push_back(with_lens({"", 1, 1, 1, 2, 2, 64, true}, "varlen_nan_gap_causal_d64", {40, 0, 70}, {40, 9, 90}));
  v.back().nan_seq = 1;
  v.push_back(with_lens({"", 1, 1, 1, 4, 2, 128}, "varlen_d128", {17, 0, 300, 1, 129}, {17, 5, 300, 0, 200}));
  v.back().nan_seq = 1;  // 5 NaN keys right after sequence 0's 17 (its key block reaches past them)
  v.push_back(with_lens({"", 1, 1, 1, 4, 1, 128, true}, "varlen_causal_d128", {113, 193, 0, 64}, {250, 193, 9, 30}));
  v.push_back(with_lens({"", 1, 1, 1, 2, 2, 64, true, DType::f16}, "varlen_causal_d64_f16", {1, 200, 37},
                        {1, 300, 37}));
  v.push_back(with_lens({"", 1, 1, 1, 2, 1, 256}, "varlen_d256", {77, 0, 130}, {190, 64, 129}));
  v.back().nan_seq = 1;
  v.push_back(with_lens(with_features({"", 1, 1, 1, 4, 2, 128, true}, "", 60, 0, 0.0f, false, false),
                        "varlen_window_causal_d128", {300, 17, 250}, {300, 40, 251}));
  v.push_back(with_lens(with_features({"", 1, 1, 1, 2, 2, 64}, "", -1, -1, 10.0f, true, true), "varlen_all_d64",
                        {130, 5, 200}, {100, 260, 200}));
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cpu, Fp8Forward,
                         ::testing::Combine(::testing::ValuesIn(fp8_cases()),
                                            ::testing::Values(Backend::naive, Backend::flash)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" + backend_name(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace ioattn::test

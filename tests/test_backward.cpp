// Backward correctness: the CPU targets (flash, naive) against the float64 reference gradients
// (src/cpu/backward_ref.hpp) on odd shapes, masks and features, for dq, dk, dv and dsinks, with
// the rule
//   max|g - g_ref| <= 3 * max|g_emulated - g_ref| + atol     (atol 1e-5 f32, 1e-4 f16/bf16)
// where g_emulated is the unfused backward computed in the input precision (S, P, dP, dS and the
// gradients rounded to the dtype). o and lse come from the naive forward, gradients are poisoned
// with NaN first. The float64 reference itself is checked against central finite differences of
// the float64 forward. CUDA backward targets join kTargets when they exist.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>

#include "check.hpp"
#include "fuzz_cases.hpp"
#include "cpu/backward_ref.hpp"

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

// Inputs, forward outputs, dout and the gradient buffers of one backward problem on the CPU.
struct BwdSetup {
  Case c;
  bool varlen;
  int64_t B, Hq, Hk, D, Dv, rows_q, rows_k;
  std::vector<int32_t> cuq, cuk;
  detail::Buffer q, k, v, o, lse, dout, dq, dk, dv, alibi, sinks, dsinks, cu_q, cu_k;
  TensorView qv, kv, vv, ov, lv, dov, dqv, dkv, dvv;
  AttnParams prm;
  Varlen vl;
  Gradients grads;

  BwdSetup(const Case& cs, uint64_t seed)
      : c(cs), varlen(!cs.varlen_q.empty()), B(cs.batch), Hq(cs.heads_q), Hk(cs.heads_kv), D(cs.head_dim),
        Dv(cs.dv()) {
    std::mt19937_64 rng(seed);
    cuq = varlen ? prefix(c.varlen_q) : std::vector<int32_t>{};
    cuk = varlen ? prefix(c.varlen_k) : std::vector<int32_t>{};
    rows_q = varlen ? cuq.back() : B * c.seqlen_q;
    rows_k = varlen ? cuk.back() : B * c.seqlen_k;
    const DType t = c.dtype;
    q = detail::Buffer(t, rows_q * Hq * D);
    k = detail::Buffer(t, rows_k * Hk * D);
    v = detail::Buffer(t, rows_k * Hk * Dv);
    o = detail::Buffer(t, rows_q * Hq * Dv);
    dout = detail::Buffer(t, rows_q * Hq * Dv);
    lse = detail::Buffer(DType::f32, rows_q * Hq);
    dq = detail::Buffer(t, rows_q * Hq * D);
    dk = detail::Buffer(t, rows_k * Hk * D);
    dv = detail::Buffer(t, rows_k * Hk * Dv);
    alibi = detail::Buffer(DType::f32, Hq);
    sinks = detail::Buffer(DType::f32, Hq);
    dsinks = detail::Buffer(DType::f32, Hq);
    q.fill_random(rng, c.input_range);
    k.fill_random(rng, c.input_range);
    v.fill_random(rng);
    dout.fill_random(rng);
    o.poison();
    lse.poison();
    poison();

    const int64_t sq = varlen ? rows_q : c.seqlen_q, sk = varlen ? rows_k : c.seqlen_k;
    qv = view(q, sq, Hq, D);
    kv = view(k, sk, Hk, D);
    vv = view(v, sk, Hk, Dv);
    ov = view(o, sq, Hq, Dv);
    dov = view(dout, sq, Hq, Dv);
    dqv = view(dq, sq, Hq, D);
    dkv = view(dk, sk, Hk, D);
    dvv = view(dv, sk, Hk, Dv);
    lv = varlen ? lse.view({Hq, rows_q}) : lse.view({B, Hq, c.seqlen_q});
    prm.causal = c.causal;
    prm.window_left = c.window_left;
    prm.window_right = c.window_right;
    prm.softcap = c.softcap;
    prm.scale = c.scale;
    if (c.alibi) {
      for (int64_t h = 0; h < Hq; ++h) alibi.set(h, 0.5f / static_cast<float>(h + 1));
      prm.alibi_slopes = alibi.view({Hq});
    }
    if (c.sinks) {
      for (int64_t h = 0; h < Hq; ++h) sinks.set(h, static_cast<float>(h % 3) - 1.0f);
      prm.sinks = sinks.view({Hq});
    }
    if (varlen) {
      cu_q = detail::Buffer(DType::i32, B + 1);
      cu_k = detail::Buffer(DType::i32, B + 1);
      cu_q.fill_i32(cuq);
      cu_k.fill_i32(cuk);
      vl.cu_seqlens_q = cu_q.view({B + 1});
      vl.cu_seqlens_k = cu_k.view({B + 1});
    }
    grads.dq = dqv;
    grads.dk = dkv;
    grads.dv = dvv;
    if (c.sinks) grads.dsinks = dsinks.view({Hq});
    forward_naive();
  }

  // [b, s, h, d] by default, [b, h, s, d] memory when c.bhsd; varlen [total, h, d].
  TensorView view(detail::Buffer& buf, int64_t s, int64_t h, int64_t d) {
    if (varlen) return TensorView::contiguous(buf.data(), buf.dtype(), {s, h, d});
    if (c.bhsd) return TensorView::strided(buf.data(), buf.dtype(), {B, s, h, d}, {h * s * d, d, s * d, 1});
    return TensorView::contiguous(buf.data(), buf.dtype(), {B, s, h, d});
  }

  void poison() {
    dq.poison();
    dk.poison();
    dv.poison();
    dsinks.poison();
  }

  // o and lse from the float64 naive forward, so the backward sees consistent inputs.
  void forward_naive() {
    Context ctx;
    ctx.backend = Backend::naive;
    if (varlen)
      forward_varlen(qv, kv, vv, ov, lv, vl, prm, ctx);
    else
      forward(qv, kv, vv, ov, lv, prm, ctx);
  }

  KernelChoice backward(Backend backend, bool deterministic = false, int threads = 0) {
    Context ctx;
    ctx.backend = backend;
    ctx.deterministic = deterministic;
    ctx.num_threads = threads;
    if (varlen) return backward_varlen(qv, kv, vv, ov, dov, lv, grads, vl, prm, ctx);
    return ioattn::backward(qv, kv, vv, ov, dov, lv, grads, prm, ctx);
  }

  // The validated problem exactly as a backend receives it (p.f filled as run_backward does).
  detail::ValidatedBwd problem() {
    auto val = detail::validate_backward(qv, kv, vv, ov, dov, lv, grads, varlen ? &vl : nullptr, prm, Context{});
    val.p.f = val.fwd.p;
    return val;
  }
};

struct GradErrors {
  detail::ErrorStats dq, dk, dv, dsinks;
};

// Errors of the gradients the backend wrote (strided, as in p) against a reference.
GradErrors grad_errors(const detail::BwdProblem& bp, const detail::RefGrads& ref) {
  const detail::FwdProblem& p = bp.f;
  GradErrors e;
  const int64_t hq = p.heads_q, hkv = p.heads_kv, d = p.head_dim, dv = p.head_dim_v;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t q0 = p.varlen() ? p.cu_seqlens_q_host[b] : 0, k0 = p.varlen() ? p.cu_seqlens_k_host[b] : 0;
    const int64_t sq = p.varlen() ? p.cu_seqlens_q_host[b + 1] - q0 : p.seqlen_q;
    const int64_t sk = p.varlen() ? p.cu_seqlens_k_host[b + 1] - k0 : p.seqlen_k;
    const int64_t qrow0 = p.varlen() ? q0 : b * sq, krow0 = p.varlen() ? k0 : b * sk;
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t off = b * bp.dq_stride.batch + (q0 + i) * bp.dq_stride.seq + h * bp.dq_stride.head;
        for (int64_t x = 0; x < d; ++x)
          detail::accumulate_error(e.dq, detail::load_float(bp.dq, p.dtype, off + x),
                                   ref.dq[((qrow0 + i) * hq + h) * d + x], off + x);
      }
    for (int64_t j = 0; j < sk; ++j)
      for (int64_t h = 0; h < hkv; ++h) {
        const int64_t ko = b * bp.dk_stride.batch + (k0 + j) * bp.dk_stride.seq + h * bp.dk_stride.head;
        const int64_t vo = b * bp.dv_stride.batch + (k0 + j) * bp.dv_stride.seq + h * bp.dv_stride.head;
        for (int64_t x = 0; x < d; ++x)
          detail::accumulate_error(e.dk, detail::load_float(bp.dk, p.dtype, ko + x),
                                   ref.dk[((krow0 + j) * hkv + h) * d + x], ko + x);
        for (int64_t x = 0; x < dv; ++x)
          detail::accumulate_error(e.dv, detail::load_float(bp.dv, p.dtype, vo + x),
                                   ref.dv[((krow0 + j) * hkv + h) * dv + x], vo + x);
      }
  }
  if (bp.dsinks)
    for (int64_t h = 0; h < hq; ++h) detail::accumulate_error(e.dsinks, bp.dsinks[h], ref.dsinks[h], h);
  return e;
}

void ref_vs_ref(const std::vector<double>& a, const std::vector<double>& b, detail::ErrorStats* e) {
  for (size_t i = 0; i < a.size(); ++i) detail::accumulate_error(*e, a[i], b[i], static_cast<int64_t>(i));
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::fabs(x));
  return m;
}

struct BwdResult {
  GradErrors err, emu;
};

// Runs the backward of case c on `backend` and checks the tolerance rule for every gradient.
BwdResult run_bwd_case(const Case& c, Backend backend, uint64_t seed = 42) {
  BwdSetup s(c, seed);
  s.backward(backend);
  auto val = s.problem();
  const auto ref = detail::reference_backward(val.p, detail::RefPrecision::f64, s.rows_q, s.rows_k);
  const auto emu = detail::reference_backward(val.p, detail::RefPrecision::emulated, s.rows_q, s.rows_k);
  BwdResult r;
  r.err = grad_errors(val.p, ref);
  ref_vs_ref(emu.dq, ref.dq, &r.emu.dq);
  ref_vs_ref(emu.dk, ref.dk, &r.emu.dk);
  ref_vs_ref(emu.dv, ref.dv, &r.emu.dv);
  ref_vs_ref(emu.dsinks, ref.dsinks, &r.emu.dsinks);
  const double atol = atol_for(c.dtype);
  const char* ts = dtype_name(c.dtype);
  auto check = [&](const char* name, const detail::ErrorStats& got, const detail::ErrorStats& base, double mag) {
    EXPECT_LT(got.bad_index, 0) << c.name << ": non-finite or unwritten " << name << " at element " << got.bad_index;
    EXPECT_LE(got.max_abs, 3 * base.max_abs + atol)
        << c.name << ": " << name << " error vs float64 reference (emulated " << ts << " error " << base.max_abs
        << ", max|" << name << "| " << mag << ")";
  };
  check("dq", r.err.dq, r.emu.dq, max_abs(ref.dq));
  check("dk", r.err.dk, r.emu.dk, max_abs(ref.dk));
  check("dv", r.err.dv, r.emu.dv, max_abs(ref.dv));
  if (c.sinks) {
    check("dsinks", r.err.dsinks, r.emu.dsinks, max_abs(ref.dsinks));
    // (all zero is right when no row sees a key: O = 0 there; dq is all zero then too)
    if (max_abs(ref.dq) > 0)
      EXPECT_GT(max_abs(ref.dsinks), 0.0) << c.name << ": dsinks of the reference is all zero";
  }
  return r;
}

// The case list: 1, 17, 113x203 causal, 203x113 causal (rows with no keys), 257 with a window,
// GQA 4 and 8, softcap, ALiBi, sinks (dsinks), varlen with an empty sequence, head dims
// 8/64/80/128 and [b, h, s, d] strides, in f32, f16 and bf16.
std::vector<Case> bwd_cases() {
  std::vector<Case> v;
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    const std::string ts = dtype_name(t);
    v.push_back(mk("len1_" + ts, 1, 1, 64, t));
    v.push_back(mk("len17_" + ts, 17, 17, 64, t));
    { Case c = mk("q113_k203_causal_" + ts, 113, 203, 128, t); c.causal = true; v.push_back(c); }
    { Case c = mk("q203_k113_causal_" + ts, 203, 113, 64, t); c.causal = true; v.push_back(c); }  // rows with no key
    { Case c = mk("window257_" + ts, 257, 257, 64, t); c.window_left = 30; c.window_right = 10; c.heads_q = c.heads_kv = 1;
      v.push_back(c); }
    { Case c = mk("window_q100_k150_" + ts, 100, 150, 32, t); c.window_left = 20; c.window_right = 5; v.push_back(c); }
    { Case c = mk("gqa4_causal_" + ts, 65, 97, 64, t); c.heads_q = 8; c.heads_kv = 2; c.causal = true; v.push_back(c); }
    { Case c = mk("gqa8_mqa_" + ts, 40, 77, 64, t); c.heads_q = 8; c.heads_kv = 1; v.push_back(c); }
    { Case c = mk("softcap_" + ts, 70, 90, 64, t); c.softcap = 5.0f; c.input_range = 3.0f; v.push_back(c); }
    { Case c = mk("alibi_causal_" + ts, 60, 80, 64, t); c.alibi = true; c.causal = true; v.push_back(c); }
    { Case c = mk("sinks_causal_" + ts, 33, 50, 64, t); c.sinks = true; c.causal = true; v.push_back(c); }
    { Case c = mk("sinks_norows_" + ts, 90, 40, 64, t); c.sinks = true; c.causal = true; c.batch = 2; v.push_back(c); }
    { Case c = mk("varlen_empty_" + ts, 0, 0, 64, t); c.batch = 4; c.varlen_q = {5, 0, 37, 1}; c.varlen_k = {9, 3, 37, 0};
      c.causal = true; v.push_back(c); }
    { Case c = mk("varlen_gqa_sinks_" + ts, 0, 0, 128, t); c.batch = 3; c.heads_q = 4; c.heads_kv = 1;
      c.varlen_q = {17, 70, 2}; c.varlen_k = {17, 100, 130}; c.sinks = true; v.push_back(c); }
    for (int64_t d : {8, 64, 80, 128}) {
      Case c = mk("hdim" + std::to_string(d) + "_" + ts, 37, 75, d, t);
      c.causal = d % 64 == 0;
      v.push_back(c);
    }
    { Case c = mk("bhsd_strided_" + ts, 45, 61, 64, t); c.bhsd = true; c.batch = 2; v.push_back(c); }
  }
  { Case c = mk("hdim_v_differs_f32", 20, 30, 64, DType::f32); c.head_dim_v = 40; v.push_back(c); }
  { Case c = mk("all_features_bf16", 150, 170, 96, DType::bf16); c.heads_q = 6; c.heads_kv = 2; c.causal = true;
    c.window_left = 50; c.softcap = 10.0f; c.alibi = true; c.sinks = true; c.bhsd = true; c.batch = 2; v.push_back(c); }
  return v;
}

const Backend kCpuBackends[] = {Backend::flash, Backend::naive};

class Backward : public ::testing::TestWithParam<std::tuple<Backend, Case>> {};

TEST_P(Backward, MatchesFloat64Reference) {
  const auto& [backend, c] = GetParam();
  run_bwd_case(c, backend);
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<Backend, Case>>& info) {
  return std::string("cpu_") + backend_name(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(All, Backward, ::testing::Combine(::testing::ValuesIn(kCpuBackends), ::testing::ValuesIn(bwd_cases())),
                         case_name);

// Seeded random mixes of the features (tests/fuzz_cases.hpp), both CPU backends.
class FuzzBackward : public ::testing::TestWithParam<std::tuple<Backend, int>> {};

TEST_P(FuzzBackward, MatchesFloat64Reference) {
  const auto& [backend, seed] = GetParam();
  FuzzSpace sp;
  sp.max_len = 120;
  run_bwd_case(random_case(static_cast<uint64_t>(seed), sp), backend);
}

INSTANTIATE_TEST_SUITE_P(All, FuzzBackward, ::testing::Combine(::testing::ValuesIn(kCpuBackends), ::testing::Range(0, 40)),
                         [](const auto& info) {
                           return std::string("cpu_") + backend_name(std::get<0>(info.param)) + "_seed" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---- the oracle itself -------------------------------------------------------------------

// The float64 reference gradients equal central finite differences of the float64 forward's
// loss L = sum(dO * O). Inputs are multiples of 2^-12 so that x +- 2^-10 is exact in f32.
void finite_difference_check(Case c) {
  BwdSetup s(c, 11);
  auto quantise = [](detail::Buffer& buf) {
    for (int64_t i = 0; i < buf.count(); ++i) buf.set(i, std::round(buf.get(i) * 4096.0f) / 4096.0f);
  };
  quantise(s.q);
  quantise(s.k);
  quantise(s.v);
  s.forward_naive();  // o, lse of the quantised inputs
  auto val = s.problem();
  const auto ref = detail::reference_backward(val.p, detail::RefPrecision::f64, s.rows_q, s.rows_k);
  detail::FwdProblem fp = val.p.f;
  auto loss = [&]() {
    const auto r = detail::reference_forward(fp, detail::RefPrecision::f64, s.rows_q);
    double l = 0.0;
    for (int64_t i = 0; i < s.dout.count(); ++i) l += r.o[static_cast<size_t>(i)] * s.dout.get(i);
    return l;
  };
  const float h = 1.0f / 1024.0f;
  auto fd = [&](const std::function<float()>& get, const std::function<void(float)>& set) {
    const float x = get();
    set(x + h);
    const double lp = loss();
    set(x - h);
    const double lm = loss();
    set(x);
    return (lp - lm) / (2.0 * h);
  };
  auto compare = [&](const char* name, detail::Buffer& buf, const std::vector<double>& g) {
    ASSERT_EQ(static_cast<int64_t>(g.size()), buf.count()) << name;
    const double tol = 1e-6 + 1e-5 * max_abs(g);  // observed errors ~1e-7 (h^2 truncation, f32 o/lse)
    double worst = 0.0;
    for (int64_t i = 0; i < buf.count(); ++i) {
      const double want = fd([&] { return buf.get(i); }, [&](float x) { buf.set(i, x); });
      worst = std::max(worst, std::fabs(want - g[static_cast<size_t>(i)]));
      ASSERT_NEAR(g[static_cast<size_t>(i)], want, tol) << c.name << ": " << name << "[" << i << "]";
    }
    EXPECT_GT(max_abs(g), 1e-3) << c.name << ": " << name << " is (nearly) zero; the check would prove nothing";
    char text[32];
    std::snprintf(text, sizeof text, "%.3g", worst);
    ::testing::Test::RecordProperty(std::string(name) + "_max_fd_error", text);
  };
  compare("dq", s.q, ref.dq);
  compare("dk", s.k, ref.dk);
  compare("dv", s.v, ref.dv);
  if (c.sinks) {
    float* sk = static_cast<float*>(s.sinks.host());
    for (int64_t hh = 0; hh < s.Hq; ++hh) {
      const double want = fd([&] { return sk[hh]; }, [&](float x) { sk[hh] = x; });
      EXPECT_NEAR(ref.dsinks[static_cast<size_t>(hh)], want, 1e-6 + 1e-5 * max_abs(ref.dsinks)) << "dsinks[" << hh << "]";
    }
  }
}

TEST(BackwardReference, MatchesFiniteDifferencesCausalGqaAlibiSinks) {
  Case c = mk("fd_causal_gqa_alibi_sinks", 4, 7, 4);
  c.head_dim_v = 3;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.causal = true;
  c.alibi = true;
  c.sinks = true;
  c.batch = 2;
  finite_difference_check(c);
}

TEST(BackwardReference, MatchesFiniteDifferencesSoftcapWindowVarlen) {
  Case c = mk("fd_softcap_window_varlen", 0, 0, 4);
  c.softcap = 2.0f;
  c.input_range = 1.5f;
  c.scale = 0.7f;
  c.window_left = 3;
  c.window_right = 1;
  c.heads_q = 2;
  c.heads_kv = 1;
  c.batch = 3;
  c.varlen_q = {7, 0, 4};
  c.varlen_k = {5, 2, 9};
  finite_difference_check(c);
}

// ---- properties of the flash backend -----------------------------------------------------

Case det_case() {
  Case c = mk("det", 70, 150, 64, DType::bf16);  // 2 query tiles x 3 key tiles
  c.causal = true;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.sinks = true;
  return c;
}

bool same_bytes(const detail::Buffer& a, const detail::Buffer& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.host(), b.host(), a.bytes()) == 0;
}

// Deterministic mode: 100 runs give bitwise-equal dq, dk, dv, dsinks.
TEST(BackwardFlash, DeterministicBitwiseOver100Runs) {
  BwdSetup s(det_case(), 3);
  s.backward(Backend::flash, true);
  detail::Buffer dq0(s.dq.dtype(), s.dq.count()), dk0(s.dk.dtype(), s.dk.count()), dv0(s.dv.dtype(), s.dv.count());
  detail::Buffer ds0(DType::f32, s.Hq);
  std::memcpy(dq0.host(), s.dq.host(), s.dq.bytes());
  std::memcpy(dk0.host(), s.dk.host(), s.dk.bytes());
  std::memcpy(dv0.host(), s.dv.host(), s.dv.bytes());
  std::memcpy(ds0.host(), s.dsinks.host(), s.dsinks.bytes());
  for (int run = 1; run < 100; ++run) {
    s.poison();
    s.backward(Backend::flash, true);
    ASSERT_TRUE(same_bytes(s.dq, dq0)) << "dq differs in run " << run;
    ASSERT_TRUE(same_bytes(s.dk, dk0)) << "dk differs in run " << run;
    ASSERT_TRUE(same_bytes(s.dv, dv0)) << "dv differs in run " << run;
    ASSERT_TRUE(same_bytes(s.dsinks, ds0)) << "dsinks differs in run " << run;
  }
}

// In deterministic mode every output row has one owner task with a fixed loop order (fused or two
// passes, never the split), so the thread count does not change a bit either.
TEST(BackwardFlash, BitwiseEqualAcrossThreadCounts) {
  BwdSetup s(det_case(), 4);
  s.backward(Backend::flash, true, 1);
  detail::Buffer dq0(s.dq.dtype(), s.dq.count()), dk0(s.dk.dtype(), s.dk.count()), dv0(s.dv.dtype(), s.dv.count());
  std::memcpy(dq0.host(), s.dq.host(), s.dq.bytes());
  std::memcpy(dk0.host(), s.dk.host(), s.dk.bytes());
  std::memcpy(dv0.host(), s.dv.host(), s.dv.bytes());
  for (int threads : {2, 3, 7}) {
    s.poison();
    const KernelChoice k = s.backward(Backend::flash, true, threads);
    EXPECT_EQ(k.reason.find("split single pass"), std::string::npos) << k.reason;
    EXPECT_TRUE(same_bytes(s.dq, dq0)) << threads << " threads";
    EXPECT_TRUE(same_bytes(s.dk, dk0)) << threads << " threads";
    EXPECT_TRUE(same_bytes(s.dv, dv0)) << threads << " threads";
  }
}

// The split single pass (each (batch, kv head)'s keys cut into ranges, one dQ partial each,
// summed in range order) on every case of the suite against the float64 reference, with the
// same bits on a rerun; dK / dV (one owner per key) are those of the two passes.
TEST(BackwardFlash, SplitMatchesReferenceAndRepeats) {
  std::vector<Case> cases = bwd_cases();
  Case longer = mk("long_keys_causal_gqa", 150, 700, 64, DType::f32);  // 11 key blocks, several ranges
  longer.heads_q = 4;
  longer.heads_kv = 1;
  longer.causal = true;
  longer.sinks = true;
  cases.push_back(longer);
  for (const Case& c : cases) {
    ScopedEnv e("IOATTN_CPU_BWD", "split");
    run_bwd_case(c, Backend::flash);
    BwdSetup a(c, 9), b(c, 9), two(c, 9);
    const KernelChoice k = a.backward(Backend::flash, false, 5);
    EXPECT_NE(k.reason.find("split single pass"), std::string::npos) << k.reason;
    b.backward(Backend::flash, false, 5);
    EXPECT_TRUE(same_bytes(a.dq, b.dq)) << c.name << ": dq";
    EXPECT_TRUE(same_bytes(a.dk, b.dk)) << c.name << ": dk";
    EXPECT_TRUE(same_bytes(a.dv, b.dv)) << c.name << ": dv";
    {
      ScopedEnv t("IOATTN_CPU_BWD", "twopass");
      two.backward(Backend::flash, false, 5);
    }
    EXPECT_TRUE(same_bytes(a.dk, two.dk)) << c.name << ": dk vs two passes";
    EXPECT_TRUE(same_bytes(a.dv, two.dv)) << c.name << ": dv vs two passes";
  }
}

// The fused single pass (one task per (batch, kv head), dQ accumulated with dK / dV) and the two
// passes give the same bits on every case of the suite (the same products, summed in the same
// order; see backward_cpu.cpp; on the AMX products dQ only where the key blocks coincide), each
// matching the reference; the kernel choice names the mode.
TEST(BackwardFlash, FusedAndTwoPassAgreeBitwise) {
  for (const Case& c : bwd_cases()) {
    BwdSetup a(c, 9), b(c, 9);
    KernelChoice ka, kb;
    {
      ScopedEnv e("IOATTN_CPU_BWD", "fused");
      ka = a.backward(Backend::flash);
    }
    {
      ScopedEnv e("IOATTN_CPU_BWD", "twopass");
      kb = b.backward(Backend::flash);
    }
    EXPECT_NE(ka.reason.find("fused single pass"), std::string::npos) << ka.reason;
    EXPECT_NE(kb.reason.find("two passes"), std::string::npos) << kb.reason;
    // (A bf16 case on a CPU with AMX-BF16: both modes take the AMX products, whose sums go by
    // 32-key chunks of a block; the fused pass cuts dQ's keys at its key blocks, the second pass at
    // the query tile's first visible key, so dQ agrees only where those coincide. dK / dV come
    // from the same key-block task in both modes.)
    if (ka.reason.find("amx-bf16") == std::string::npos) EXPECT_TRUE(same_bytes(a.dq, b.dq)) << c.name << ": dq";
    EXPECT_TRUE(same_bytes(a.dk, b.dk)) << c.name << ": dk";
    EXPECT_TRUE(same_bytes(a.dv, b.dv)) << c.name << ": dv";
    if (c.sinks) EXPECT_TRUE(same_bytes(a.dsinks, b.dsinks)) << c.name << ": dsinks";
  }
  BwdSetup s(det_case(), 9);
  ScopedEnv e("IOATTN_CPU_BWD", "both");
  try {
    s.backward(Backend::flash);
    FAIL() << "IOATTN_CPU_BWD=both accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.argument(), "IOATTN_CPU_BWD");
  }
}

// The two passes (Context::deterministic's mode) on every bf16 / f16 case of the suite against the
// float64 reference: on a CPU with AMX-BF16 their own tile products (the second pass's S^T, dP^T,
// dQ; f16 as two bf16 parts).
TEST(BackwardFlash, TwoPassesMatchTheReference16Bit) {
  ScopedEnv e("IOATTN_CPU_BWD", "twopass");
  int n = 0;
  for (const Case& c : bwd_cases()) {
    if (c.dtype != DType::bf16 && c.dtype != DType::f16) continue;
    run_bwd_case(c, Backend::flash);
    ++n;
  }
  EXPECT_GT(n, 5);
}

// The mode by itself: fused where the (batch, kv head) pairs fill the threads; where they do not
// (one kv head on 2+ threads) the split, or under Context::deterministic the two passes; each
// against the float64 reference.
TEST(BackwardFlash, ModeFollowsTheTaskCount) {
  Case one = mk("one_kv_head", 150, 150, 64, DType::f32);
  one.heads_q = 4;
  one.heads_kv = 1;
  one.causal = true;
  BwdSetup s1(one, 5);
  EXPECT_NE(s1.backward(Backend::flash, false, 2).reason.find("split single pass"), std::string::npos);
  EXPECT_NE(s1.backward(Backend::flash, true, 2).reason.find("two passes"), std::string::npos);
  EXPECT_NE(s1.backward(Backend::flash, false, 1).reason.find("fused single pass"), std::string::npos);
  Case many = mk("four_kv_heads", 150, 150, 64, DType::f32);
  many.heads_q = 8;
  many.heads_kv = 4;
  BwdSetup s2(many, 5);
  EXPECT_NE(s2.backward(Backend::flash, false, 2).reason.find("fused single pass"), std::string::npos);
  EXPECT_NE(s2.backward(Backend::flash, false, 3).reason.find("split single pass"), std::string::npos);
  run_bwd_case(one, Backend::flash);
  run_bwd_case(many, Backend::flash);
}

// Large logits (inputs x3) with seqlen 1 and short rows: P is ~1 on one key, exp(s - LSE) with
// s slightly above the stored LSE, dP - D cancels — gradients stay finite and accurate.
TEST(BackwardFlash, LargeLogitsAreNaNFree) {
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 1}, {1, 2}, {1, 300}, {2, 1}, {64, 64}}) {
      Case c = mk(std::string("large_logits_") + dtype_name(t) + "_" + std::to_string(sq) + "x" + std::to_string(sk), sq,
                  sk, 128, t);
      c.input_range = 3.0f;
      c.causal = sq == 64;
      for (Backend be : kCpuBackends) run_bwd_case(c, be, 17);
    }
}

// A query row with no visible key (causal, seqlen_q > seqlen_k) gets dq = 0 exactly, and keys
// no query sees (a window) get dk = dv = 0 exactly.
TEST(BackwardFlash, UnreachedRowsGetZeroGradients) {
  for (DType t : {DType::f32, DType::bf16}) {
    Case c = mk("norows", 100, 30, 64, t);
    c.causal = true;
    BwdSetup s(c, 5);
    s.backward(Backend::flash);
    for (int64_t i = 0; i < 70; ++i)
      for (int64_t x = 0; x < s.Hq * 64; ++x) ASSERT_EQ(s.dq.get(i * s.Hq * 64 + x), 0.0f) << "row " << i;
    Case w = mk("unseen_keys", 10, 200, 64, t);  // off = 190, window (5, 0): keys < 185 unseen
    w.window_left = 5;
    w.window_right = 0;
    BwdSetup s2(w, 6);
    s2.backward(Backend::flash);
    for (int64_t j = 0; j < 185; ++j)
      for (int64_t x = 0; x < s2.Hk * 64; ++x) {
        ASSERT_EQ(s2.dk.get(j * s2.Hk * 64 + x), 0.0f) << "key " << j;
        ASSERT_EQ(s2.dv.get(j * s2.Hk * 64 + x), 0.0f) << "key " << j;
      }
  }
}

// ---- bad inputs --------------------------------------------------------------------------

struct BadBwd {
  const char* what;
  const char* argument;  // Error::argument() starts with it, and the message names it
  bool with_sinks;
  std::function<void(BwdSetup&, TensorView& lse)> mutate;
};

const BadBwd kBadBwd[] = {
    {"missing lse", "lse", false, [](BwdSetup&, TensorView& l) { l = TensorView{}; }},
    {"dq seqlen differs from q", "dq.shape[1]", false, [](BwdSetup& s, TensorView&) { s.grads.dq.shape[1] -= 1; }},
    {"dq head_dim differs from q", "dq.shape[3]", false, [](BwdSetup& s, TensorView&) { s.grads.dq.shape[3] = 16; }},
    {"dk with heads_q heads (GQA)", "dk.shape[2]", false, [](BwdSetup& s, TensorView&) { s.grads.dk.shape[2] = s.Hq; }},
    {"dsinks without sinks", "grads.dsinks", false,
     [](BwdSetup& s, TensorView&) { s.grads.dsinks = s.dsinks.view({s.Hq}); }},
    {"dsinks of the wrong length", "grads.dsinks", true,
     [](BwdSetup& s, TensorView&) { s.grads.dsinks.shape[0] = s.Hq - 1; }},
    {"dout dtype differs from o", "dout.dtype", false, [](BwdSetup& s, TensorView&) { s.dov.dtype = DType::f16; }},
    {"dout shape differs from o", "dout.shape[1]", false, [](BwdSetup& s, TensorView&) { s.dov.shape[1] += 1; }},
    {"null dv", "dv", false, [](BwdSetup& s, TensorView&) { s.grads.dv.data = nullptr; }},
    {"dq dtype differs from q", "dq.dtype", false, [](BwdSetup& s, TensorView&) { s.grads.dq.dtype = DType::bf16; }},
    {"dk with a zero stride", "dk.stride[1]", false, [](BwdSetup& s, TensorView&) { s.grads.dk.stride[1] = 0; }},
};

class BackwardBadInput : public ::testing::TestWithParam<BadBwd> {};

TEST_P(BackwardBadInput, RejectedWithArgumentNameAndOutputsUntouched) {
  const BadBwd& bad = GetParam();
  Case c = mk("bad", 16, 24, 32);
  c.heads_q = 4;
  c.heads_kv = 2;
  c.sinks = bad.with_sinks;
  for (Backend be : kCpuBackends) {
    BwdSetup s(c, 8);
    TensorView lse = s.lv;
    bad.mutate(s, lse);
    Context ctx;
    ctx.backend = be;
    try {
      ioattn::backward(s.qv, s.kv, s.vv, s.ov, s.dov, lse, s.grads, s.prm, ctx);
      ADD_FAILURE() << bad.what << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument().rfind(bad.argument, 0), 0u) << bad.what << ": argument() = " << e.argument();
      EXPECT_NE(std::string(e.what()).find(bad.argument), std::string::npos) << bad.what << ": " << e.what();
    }
    auto all_nan = [](const detail::Buffer& b) {
      for (int64_t i = 0; i < b.count(); ++i)
        if (!std::isnan(b.get(i))) return false;
      return true;
    };
    EXPECT_TRUE(all_nan(s.dq) && all_nan(s.dk) && all_nan(s.dv) && all_nan(s.dsinks)) << bad.what << ": outputs written";
  }
}

std::string bad_name(const ::testing::TestParamInfo<BadBwd>& info) {
  std::string n = info.param.what;
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(All, BackwardBadInput, ::testing::ValuesIn(kBadBwd), bad_name);

}  // namespace
}  // namespace ioattn::test

// CUDA flash backward (mma.sync) against the float64 reference gradients.
//
// Every case: fresh random inputs on the host; o and lse from the float64 CPU forward (so the
// backward sees consistent inputs), uploaded; dq, dk, dv, dsinks poisoned with NaN; the backward
// runs on Device::cuda views in both modes (fp32 atomic dQ, then deterministic). For each
// gradient, against src/cpu/backward_ref.cpp:
//   max|g - g_ref| <= 3 · max|g_emulated - g_ref| + atol        (atol 1e-4 for f16/bf16)
// where g_emulated is the unfused backward in the input precision (tests/test_backward.cpp's rule).
// Inputs carry NaN between heads (8 padding elements per row) and, for varlen, in 3 tokens past
// the last sequence: a kernel that reads outside the tensors shows up as NaN; outputs there must
// still hold the poison afterwards. Without a GPU every test prints "skipped: no CUDA device".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "fuzz_cases.hpp"
#include "core/backends.hpp"
#include "core/harness.hpp"
#include "core/validate.hpp"
#include "cpu/backward_ref.hpp"

namespace ioattn::test {
namespace {

#define SKIP_WITHOUT_GPU()                                        \
  do {                                                            \
    if (!cuda_available()) GTEST_SKIP() << "skipped: no CUDA device"; \
  } while (0)

Case mk(std::string name, int64_t sq, int64_t sk, int64_t d, DType t = DType::bf16) {
  Case c;
  c.name = std::move(name);
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.head_dim = d;
  c.dtype = t;
  c.pad_head = 8;  // NaN elements between heads: reads/writes outside the views show up
  return c;
}

constexpr int64_t kTailTokens = 3;  // varlen: NaN tokens past the last sequence

// One backward problem with host and device copies of everything.
struct BwdRun {
  Case c;
  bool varlen;
  int64_t B, Hq, Hk, D, Dv, hs_qk, hs_v, rows_q, rows_k, seq_q, seq_k;
  std::vector<int32_t> cuq, cuk;
  detail::Buffer q, k, v, o, dout, lse, dq, dk, dv, alibi, sinks, dsinks, cu_q, cu_k;
  AttnParams prm_h, prm_d;  // host / device views of alibi and sinks
  Varlen vl_h, vl_d;

  BwdRun(const Case& cs, uint64_t seed)
      : c(cs), varlen(!cs.varlen_q.empty()), B(cs.batch), Hq(cs.heads_q), Hk(cs.heads_kv), D(cs.head_dim),
        Dv(cs.dv()) {
    std::mt19937_64 rng(seed);
    const DType t = c.dtype;
    hs_qk = D + c.pad_head;
    hs_v = Dv + c.pad_head;
    cuq = varlen ? prefix(c.varlen_q) : std::vector<int32_t>{};
    cuk = varlen ? prefix(c.varlen_k) : std::vector<int32_t>{};
    rows_q = varlen ? cuq.back() + kTailTokens : B * c.seqlen_q;
    rows_k = varlen ? cuk.back() + kTailTokens : B * c.seqlen_k;
    seq_q = varlen ? rows_q : c.seqlen_q;
    seq_k = varlen ? rows_k : c.seqlen_k;
    const Device cu = Device::cuda;
    q = detail::Buffer(t, rows_q * Hq * hs_qk, cu);
    k = detail::Buffer(t, rows_k * Hk * hs_qk, cu);
    v = detail::Buffer(t, rows_k * Hk * hs_v, cu);
    o = detail::Buffer(t, rows_q * Hq * hs_v, cu);
    dout = detail::Buffer(t, rows_q * Hq * hs_v, cu);
    dq = detail::Buffer(t, rows_q * Hq * hs_qk, cu);
    dk = detail::Buffer(t, rows_k * Hk * hs_qk, cu);
    dv = detail::Buffer(t, rows_k * Hk * hs_v, cu);
    lse = detail::Buffer(DType::f32, rows_q * Hq, cu);
    alibi = detail::Buffer(DType::f32, Hq, cu);
    sinks = detail::Buffer(DType::f32, Hq, cu);
    dsinks = detail::Buffer(DType::f32, Hq, cu);
    fill(q, rng, Hq, D, hs_qk, rows_q, c.input_range, varlen ? cuq.back() : rows_q);
    fill(k, rng, Hk, D, hs_qk, rows_k, c.input_range, varlen ? cuk.back() : rows_k);
    fill(v, rng, Hk, Dv, hs_v, rows_k, 1.0f, varlen ? cuk.back() : rows_k);
    fill(dout, rng, Hq, Dv, hs_v, rows_q, 1.0f, varlen ? cuq.back() : rows_q);
    o.poison();
    lse.poison();
    poison_grads();

    for (AttnParams* prm : {&prm_h, &prm_d}) {
      prm->causal = c.causal;
      prm->window_left = c.window_left;
      prm->window_right = c.window_right;
      prm->softcap = c.softcap;
      prm->scale = c.scale;
    }
    if (c.alibi) {
      for (int64_t h = 0; h < Hq; ++h) alibi.set(h, 0.5f / static_cast<float>(h + 1));
      alibi.upload();
      prm_h.alibi_slopes = host_view(alibi, {Hq});
      prm_d.alibi_slopes = alibi.view({Hq});
    }
    if (c.sinks) {
      for (int64_t h = 0; h < Hq; ++h) sinks.set(h, static_cast<float>(h % 3) - 1.0f);
      sinks.upload();
      prm_h.sinks = host_view(sinks, {Hq});
      prm_d.sinks = sinks.view({Hq});
    }
    if (varlen) {
      cu_q = detail::Buffer(DType::i32, B + 1, cu);
      cu_k = detail::Buffer(DType::i32, B + 1, cu);
      cu_q.fill_i32(cuq);
      cu_k.fill_i32(cuk);
      vl_h.cu_seqlens_q = host_view(cu_q, {B + 1});
      vl_h.cu_seqlens_k = host_view(cu_k, {B + 1});
      vl_d.cu_seqlens_q = cu_q.view({B + 1});
      vl_d.cu_seqlens_k = cu_k.view({B + 1});
    }
    forward_host();
  }

  static TensorView host_view(detail::Buffer& b, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(b.host(), b.dtype(), shape, Device::cpu);
  }

  // Every element NaN, then uniform values in the rows of real tokens and the first `dim`
  // columns of each head; padding stays NaN. Uploads.
  void fill(detail::Buffer& buf, std::mt19937_64& rng, int64_t heads, int64_t dim, int64_t hs, int64_t rows,
            float range, int64_t real_rows) {
    buf.poison();
    std::uniform_real_distribution<float> u(-range, range);
    for (int64_t r = 0; r < std::min(rows, real_rows); ++r)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t x = 0; x < dim; ++x) buf.set((r * heads + h) * hs + x, u(rng));
    buf.upload();
  }

  void poison_grads() {
    dq.poison();
    dk.poison();
    dv.poison();
    dsinks.poison();
  }

  // [b, s, h, d] with head stride hs (bhsd: [b, h, s, d] memory); varlen [total, h, d].
  TensorView view(detail::Buffer& buf, bool host, int64_t s, int64_t h, int64_t d, int64_t hs) {
    void* ptr = host ? buf.host() : buf.data();
    const Device dev = host ? Device::cpu : Device::cuda;
    if (varlen) return TensorView::strided(ptr, buf.dtype(), {s, h, d}, {h * hs, hs, 1}, dev);
    if (c.bhsd) return TensorView::strided(ptr, buf.dtype(), {B, s, h, d}, {h * s * hs, hs, s * hs, 1}, dev);
    return TensorView::strided(ptr, buf.dtype(), {B, s, h, d}, {s * h * hs, h * hs, hs, 1}, dev);
  }
  TensorView lse_view(bool host) {
    void* ptr = host ? lse.host() : lse.data();
    const Device dev = host ? Device::cpu : Device::cuda;
    return varlen ? TensorView::contiguous(ptr, DType::f32, {Hq, rows_q}, dev)
                  : TensorView::contiguous(ptr, DType::f32, {B, Hq, c.seqlen_q}, dev);
  }
  Gradients grads(bool host) {
    Gradients g;
    g.dq = view(dq, host, seq_q, Hq, D, hs_qk);
    g.dk = view(dk, host, seq_k, Hk, D, hs_qk);
    g.dv = view(dv, host, seq_k, Hk, Dv, hs_v);
    if (c.sinks)
      g.dsinks = host ? host_view(dsinks, {Hq}) : dsinks.view({Hq});
    return g;
  }

  // o and lse from the float64 naive forward on the host, then uploaded.
  void forward_host() {
    Context ctx;
    ctx.backend = Backend::naive;
    const TensorView qv = view(q, true, seq_q, Hq, D, hs_qk), kv = view(k, true, seq_k, Hk, D, hs_qk);
    const TensorView vv = view(v, true, seq_k, Hk, Dv, hs_v), ov = view(o, true, seq_q, Hq, Dv, hs_v);
    if (varlen)
      forward_varlen(qv, kv, vv, ov, lse_view(true), vl_h, prm_h, ctx);
    else
      forward(qv, kv, vv, ov, lse_view(true), prm_h, ctx);
    o.upload();
    lse.upload();
  }

  // The backward on the device; downloads the gradients.
  KernelChoice backward_device(bool deterministic) {
    Context ctx;
    ctx.backend = Backend::flash;
    ctx.deterministic = deterministic;
    const TensorView qv = view(q, false, seq_q, Hq, D, hs_qk), kv = view(k, false, seq_k, Hk, D, hs_qk);
    const TensorView vv = view(v, false, seq_k, Hk, Dv, hs_v), ov = view(o, false, seq_q, Hq, Dv, hs_v);
    const TensorView dov = view(dout, false, seq_q, Hq, Dv, hs_v);
    KernelChoice kc = varlen ? backward_varlen(qv, kv, vv, ov, dov, lse_view(false), grads(false), vl_d, prm_d, ctx)
                             : ioattn::backward(qv, kv, vv, ov, dov, lse_view(false), grads(false), prm_d, ctx);
    detail::cuda_synchronize();
    dq.download();
    dk.download();
    dv.download();
    dsinks.download();
    return kc;
  }

  // The validated problem on host memory (what the reference reads); p.f filled as run_backward does.
  detail::ValidatedBwd host_problem() {
    const TensorView qv = view(q, true, seq_q, Hq, D, hs_qk), kv = view(k, true, seq_k, Hk, D, hs_qk);
    const TensorView vv = view(v, true, seq_k, Hk, Dv, hs_v), ov = view(o, true, seq_q, Hq, Dv, hs_v);
    const TensorView dov = view(dout, true, seq_q, Hq, Dv, hs_v);
    auto val = detail::validate_backward(qv, kv, vv, ov, dov, lse_view(true), grads(true), varlen ? &vl_h : nullptr,
                                         prm_h, Context{});
    val.p.f = val.fwd.p;
    return val;
  }
  // Varlen: every token of sequence b (Q, K, V, dO) becomes NaN on the device (the references and
  // o / lse, computed before, stay those of the finite inputs).
  void nan_sequence(int64_t b) {
    auto set_rows = [](detail::Buffer& buf, int64_t heads, int64_t hs, int64_t r0, int64_t r1) {
      for (int64_t i = r0 * heads * hs; i < r1 * heads * hs; ++i) buf.set(i, std::numeric_limits<float>::quiet_NaN());
      buf.upload();
    };
    set_rows(q, Hq, hs_qk, cuq[b], cuq[b + 1]);
    set_rows(dout, Hq, hs_v, cuq[b], cuq[b + 1]);
    set_rows(k, Hk, hs_qk, cuk[b], cuk[b + 1]);
    set_rows(v, Hk, hs_v, cuk[b], cuk[b + 1]);
  }
  int64_t ref_rows_q() const { return varlen ? cuq.back() : rows_q; }
  int64_t ref_rows_k() const { return varlen ? cuk.back() : rows_k; }
};

struct GradErrors {
  detail::ErrorStats dq, dk, dv, dsinks;
};

// Errors of the gradients the backend wrote (host copies, strided as in bp) against a reference
// (the same walk as tests/test_backward.cpp); sequence skip_seq is left out.
GradErrors grad_errors(const detail::BwdProblem& bp, const detail::RefGrads& ref, int64_t skip_seq = -1) {
  const detail::FwdProblem& p = bp.f;
  GradErrors e;
  const int64_t hq = p.heads_q, hkv = p.heads_kv, d = p.head_dim, dv = p.head_dim_v;
  for (int64_t b = 0; b < p.batch; ++b) {
    if (b == skip_seq) continue;
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

// Elements of a gradient buffer outside its view (head padding, varlen tail tokens) that are no
// longer NaN: the kernel wrote where it must not.
int64_t written_outside(const detail::Buffer& buf, int64_t heads, int64_t dim, int64_t hs, int64_t real_rows) {
  int64_t n = 0;
  const int64_t rows = buf.count() / (heads * hs);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t x = 0; x < hs; ++x)
        if ((r >= real_rows || x >= dim) && !std::isnan(buf.get((r * heads + h) * hs + x))) ++n;
  return n;
}

// The reference gradients of one setup (float64 and emulated input precision).
struct Refs {
  detail::RefGrads ref, emu;
  GradErrors base;  // |emu - ref|
};

Refs references(BwdRun& s) {
  auto val = s.host_problem();
  Refs r;
  r.ref = detail::reference_backward(val.p, detail::RefPrecision::f64, s.ref_rows_q(), s.ref_rows_k());
  r.emu = detail::reference_backward(val.p, detail::RefPrecision::emulated, s.ref_rows_q(), s.ref_rows_k());
  ref_vs_ref(r.emu.dq, r.ref.dq, &r.base.dq);
  ref_vs_ref(r.emu.dk, r.ref.dk, &r.base.dk);
  ref_vs_ref(r.emu.dv, r.ref.dv, &r.base.dv);
  ref_vs_ref(r.emu.dsinks, r.ref.dsinks, &r.base.dsinks);
  return r;
}

// Checks the gradients now in s (host copies) against the references with the 3x rule (all but
// sequence skip_seq).
void check_grads(BwdRun& s, const Refs& r, const std::string& what, int64_t skip_seq = -1) {
  auto val = s.host_problem();
  const GradErrors err = grad_errors(val.p, r.ref, skip_seq);
  const double atol = atol_for(s.c.dtype);
  const char* ts = dtype_name(s.c.dtype);
  auto check = [&](const char* name, const detail::ErrorStats& got, const detail::ErrorStats& base, double mag) {
    EXPECT_LT(got.bad_index, 0) << what << ": non-finite or unwritten " << name << " at element " << got.bad_index;
    EXPECT_LE(got.max_abs, 3 * base.max_abs + atol)
        << what << ": " << name << " error vs float64 reference (emulated " << ts << " error " << base.max_abs
        << ", max|" << name << "| " << mag << ")";
  };
  check("dq", err.dq, r.base.dq, max_abs(r.ref.dq));
  check("dk", err.dk, r.base.dk, max_abs(r.ref.dk));
  check("dv", err.dv, r.base.dv, max_abs(r.ref.dv));
  if (s.c.sinks) check("dsinks", err.dsinks, r.base.dsinks, max_abs(r.ref.dsinks));
  EXPECT_EQ(written_outside(s.dq, s.Hq, s.D, s.hs_qk, s.ref_rows_q()), 0) << what << ": dq written outside its view";
  EXPECT_EQ(written_outside(s.dk, s.Hk, s.D, s.hs_qk, s.ref_rows_k()), 0) << what << ": dk written outside its view";
  EXPECT_EQ(written_outside(s.dv, s.Hk, s.Dv, s.hs_v, s.ref_rows_k()), 0) << what << ": dv written outside its view";
}

// Runs case c in both dQ modes and checks both.
// IOATTN_BWD_KERNEL for a scope.
struct BwdKernelEnv : ScopedEnv {
  explicit BwdKernelEnv(const char* v) : ScopedEnv("IOATTN_BWD_KERNEL", v) {}
};

// The dispatcher's choice, atomic and deterministic; where the default was the wgmma kernel (sm_90,
// hdim 64 / 128) the mma.sync table runs the case too (IOATTN_BWD_KERNEL=mma, both modes), so both
// stay covered.
void run_case(const Case& c, uint64_t seed) {
  SKIP_WITHOUT_GPU();
  BwdRun s(c, seed);
  const Refs r = references(s);
  bool wgmma_ran = false;
  for (bool det : {false, true}) {
    s.poison_grads();
    const KernelChoice kc = s.backward_device(det);
    EXPECT_NE(kc.kernel.find("cuda/flash-backward"), std::string::npos) << kc.kernel;
    // (the hdim-256 wgmma row's default runs its atomic-free dQ pass: "dq pass")
    EXPECT_TRUE(det ? kc.kernel.find("dq deterministic") != std::string::npos
                    : kc.kernel.find("dq atomic") != std::string::npos || kc.kernel.find("dq pass") != std::string::npos)
        << kc.kernel;
    check_grads(s, r, c.name + (det ? " (deterministic)" : " (default dq)"));
    wgmma_ran = wgmma_ran || kc.kernel.find("sm90 wgmma") != std::string::npos;
  }
  if (wgmma_ran) {
    BwdKernelEnv env("mma");
    for (bool det : {false, true}) {
      s.poison_grads();
      const KernelChoice kc = s.backward_device(det);
      EXPECT_NE(kc.kernel.find("mma.sync"), std::string::npos) << kc.kernel;
      EXPECT_NE(kc.reason.find("IOATTN_BWD_KERNEL=mma"), std::string::npos) << kc.reason;
      check_grads(s, r, c.name + (det ? " (IOATTN_BWD_KERNEL=mma, deterministic)" : " (IOATTN_BWD_KERNEL=mma, atomic dq)"));
    }
  }
}

// Odd shapes, every mask and feature, GQA 4:1 and MQA, varlen with empty sequences, head dims
// 64/128/256 and zero-padded 40/96/200, [b, h, s, d] strides, f16 and bf16.
std::vector<Case> cases() {
  std::vector<Case> v;
  for (DType t : {DType::bf16, DType::f16}) {
    const std::string ts = dtype_name(t);
    v.push_back(mk("len1_" + ts, 1, 1, 64, t));
    v.push_back(mk("len17_" + ts, 17, 17, 128, t));
    { Case c = mk("q113_k203_causal_" + ts, 113, 203, 128, t); c.causal = true; v.push_back(c); }
    { Case c = mk("q203_k113_causal_" + ts, 203, 113, 64, t); c.causal = true; v.push_back(c); }  // rows with no key
    { Case c = mk("q1023_k1024_causal_" + ts, 1023, 1024, 128, t); c.causal = true; c.heads_q = c.heads_kv = 1;
      v.push_back(c); }
    { Case c = mk("q1024_k1023_" + ts, 1024, 1023, 64, t); c.heads_q = c.heads_kv = 1; v.push_back(c); }
    { Case c = mk("window257_" + ts, 257, 257, 64, t); c.window_left = 30; c.window_right = 10; v.push_back(c); }
    { Case c = mk("window_q100_k300_" + ts, 100, 300, 128, t); c.window_left = 20; c.window_right = 5; v.push_back(c); }
    { Case c = mk("gqa4_causal_" + ts, 130, 197, 128, t); c.heads_q = 8; c.heads_kv = 2; c.causal = true; v.push_back(c); }
    { Case c = mk("mqa8_" + ts, 40, 177, 64, t); c.heads_q = 8; c.heads_kv = 1; v.push_back(c); }
    { Case c = mk("softcap_" + ts, 70, 190, 64, t); c.softcap = 5.0f; c.input_range = 3.0f; v.push_back(c); }
    { Case c = mk("alibi_causal_" + ts, 160, 180, 128, t); c.alibi = true; c.causal = true; v.push_back(c); }
    { Case c = mk("sinks_causal_" + ts, 33, 150, 64, t); c.sinks = true; c.causal = true; v.push_back(c); }
    { Case c = mk("sinks_norows_" + ts, 190, 40, 128, t); c.sinks = true; c.causal = true; c.batch = 2; v.push_back(c); }
    { Case c = mk("varlen_empty_" + ts, 0, 0, 64, t); c.batch = 5; c.varlen_q = {5, 0, 137, 1, 0};
      c.varlen_k = {9, 3, 137, 0, 0}; c.causal = true; v.push_back(c); }
    { Case c = mk("varlen_gqa_sinks_" + ts, 0, 0, 128, t); c.batch = 3; c.heads_q = 4; c.heads_kv = 1;
      c.varlen_q = {17, 170, 2}; c.varlen_k = {17, 100, 230}; c.sinks = true; v.push_back(c); }
    { Case c = mk("hdim40_padded_" + ts, 77, 130, 40, t); c.causal = true; v.push_back(c); }
    { Case c = mk("hdim96_padded_" + ts, 90, 150, 96, t); v.push_back(c); }
    { Case c = mk("bhsd_" + ts, 65, 161, 64, t); c.bhsd = true; c.batch = 2; v.push_back(c); }
    { Case c = mk("scale_negative_" + ts, 50, 70, 64, t); c.scale = -0.2f; v.push_back(c); }
    { Case c = mk("hdim256_causal_" + ts, 150, 263, 256, t); c.causal = true; v.push_back(c); }
    { Case c = mk("hdim256_gqa_sinks_" + ts, 70, 100, 256, t); c.heads_q = 4; c.heads_kv = 2; c.sinks = true;
      v.push_back(c); }
    { Case c = mk("hdim200_padded_varlen_window_" + ts, 0, 0, 200, t); c.batch = 3; c.varlen_q = {5, 0, 70};
      c.varlen_k = {9, 3, 100}; c.window_left = 20; c.window_right = 3; v.push_back(c); }
  }
  // Dense empty dims (session 17; not yet run on a GPU): no keys (dQ = 0; the wgmma rows refuse, a
  // tensor map needs every dim >= 1) and no queries (dK = dV = 0).
  v.push_back(mk("dense_no_keys_bf16", 40, 0, 128));
  v.push_back(mk("dense_no_queries_bf16", 0, 50, 64));
  { Case c = mk("all_features_bf16", 150, 270, 96, DType::bf16); c.heads_q = 6; c.heads_kv = 2; c.causal = true;
    c.window_left = 50; c.softcap = 10.0f; c.alibi = true; c.sinks = true; c.bhsd = true; c.batch = 2; v.push_back(c); }
  { Case c = mk("all_features_hdim256_f16", 100, 170, 256, DType::f16); c.heads_q = 4; c.heads_kv = 1; c.causal = true;
    c.window_left = 40; c.softcap = 10.0f; c.alibi = true; c.sinks = true; c.bhsd = true; c.batch = 2; v.push_back(c); }
  return v;
}

class CudaBackward : public ::testing::TestWithParam<Case> {};

TEST_P(CudaBackward, MatchesFloat64Reference) { run_case(GetParam(), 7 + GetParam().name.size()); }

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackward, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// Seeded random mixes of the features (tests/fuzz_cases.hpp) in the kernels' space (f16 / bf16,
// head dims that are multiples of 8 up to 256, head_dim_v == head_dim), NaN between the heads.
class CudaBackwardFuzz : public ::testing::TestWithParam<int> {};

TEST_P(CudaBackwardFuzz, MatchesFloat64Reference) {
  FuzzSpace sp;
  sp.low_precision = sp.tensor_core_dims = true;
  sp.max_len = 300;
  Case c = random_case(static_cast<uint64_t>(GetParam()), sp);
  c.pad_head = 8;
  run_case(c, 11 + static_cast<uint64_t>(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Seeds, CudaBackwardFuzz, ::testing::Range(0, 40),
                         [](const auto& info) { return "seed" + std::to_string(info.param); });

// The wgmma backward (sm_90's default where it applies: hdim 64 and 128, causal, sliding windows,
// sinks, GQA, varlen; no softcap / ALiBi): the same reference checks, on an sm_90
// device, for each IOATTN_BWD_SM90_VARIANT (lag, the default, and redlag: dQ one step late; split
// and red: in its own step; by TMA reduce-add or red.global); where it does not apply the mma.sync
// row runs and says why.

std::vector<Case> sm90_cases() {
  std::vector<Case> v;
  for (DType t : {DType::bf16, DType::f16}) {
    const std::string ts = dtype_name(t);
    v.push_back(mk("len1_d128_" + ts, 1, 1, 128, t));
    v.push_back(mk("len17_" + ts, 17, 17, 128, t));
    { Case c = mk("q113_k203_causal_" + ts, 113, 203, 128, t); c.causal = true; v.push_back(c); }
    { Case c = mk("q203_k113_causal_norows_" + ts, 203, 113, 128, t); c.causal = true; v.push_back(c); }
    { Case c = mk("q1023_k1024_causal_" + ts, 1023, 1024, 128, t); c.causal = true; c.heads_q = c.heads_kv = 1;
      v.push_back(c); }
    { Case c = mk("q1024_k1023_" + ts, 1024, 1023, 128, t); c.heads_q = c.heads_kv = 1; v.push_back(c); }
    { Case c = mk("gqa4_causal_" + ts, 130, 197, 128, t); c.heads_q = 8; c.heads_kv = 2; c.causal = true; v.push_back(c); }
    // GQA with key blocks whose first query block is not the first (causal m_first > 0).
    { Case c = mk("gqa4_causal_long_" + ts, 333, 390, 128, t); c.heads_q = 4; c.heads_kv = 1; c.causal = true;
      v.push_back(c); }
    { Case c = mk("mqa8_" + ts, 40, 177, 128, t); c.heads_q = 8; c.heads_kv = 1; v.push_back(c); }
    { Case c = mk("bhsd_batch2_" + ts, 65, 300, 128, t); c.bhsd = true; c.batch = 2; v.push_back(c); }
    { Case c = mk("scale_negative_" + ts, 50, 70, 128, t); c.scale = -0.2f; v.push_back(c); }
    // Several (head, batch) planes of the dQ workspace, each with a tail block (rows past
    // seqlen_q must be clipped, not added into the next plane).
    { Case c = mk("gqa2_batch3_" + ts, 100, 150, 128, t); c.heads_q = 4; c.heads_kv = 2; c.batch = 3; c.causal = true;
      v.push_back(c); }
    // Sliding windows (left and right, and left with causal) and sinks (their gradient comes from
    // the preprocess; the kernel only needs the forward's LSE).
    { Case c = mk("window_l20_r5_" + ts, 100, 300, 128, t); c.window_left = 20; c.window_right = 5; v.push_back(c); }
    { Case c = mk("window_l50_causal_gqa2_" + ts, 333, 290, 128, t); c.heads_q = 4; c.heads_kv = 2; c.causal = true;
      c.window_left = 50; v.push_back(c); }
    { Case c = mk("sinks_gqa2_" + ts, 70, 100, 128, t); c.heads_q = 4; c.heads_kv = 2; c.sinks = true; v.push_back(c); }
    // A left window alone; a right window alone with more rows than keys (negative offset).
    { Case c = mk("window_l20_only_" + ts, 100, 300, 128, t); c.window_left = 20; v.push_back(c); }
    { Case c = mk("window_r7_only_q300_k100_" + ts, 300, 100, 128, t); c.window_right = 7; v.push_back(c); }
    // hdim 64.
    v.push_back(mk("d64_len17_" + ts, 17, 17, 64, t));
    { Case c = mk("d64_q113_k203_causal_" + ts, 113, 203, 64, t); c.causal = true; v.push_back(c); }
    { Case c = mk("d64_q1024_k1023_" + ts, 1024, 1023, 64, t); c.heads_q = c.heads_kv = 1; v.push_back(c); }
    { Case c = mk("d64_gqa4_causal_long_" + ts, 333, 390, 64, t); c.heads_q = 4; c.heads_kv = 1; c.causal = true;
      v.push_back(c); }
    { Case c = mk("d64_bhsd_batch2_" + ts, 65, 300, 64, t); c.bhsd = true; c.batch = 2; v.push_back(c); }
    { Case c = mk("d64_gqa2_batch3_" + ts, 100, 150, 64, t); c.heads_q = 4; c.heads_kv = 2; c.batch = 3;
      v.push_back(c); }
    { Case c = mk("d64_window_l30_causal_sinks_" + ts, 200, 170, 64, t); c.causal = true; c.window_left = 30;
      c.sinks = true; v.push_back(c); }
    // Key blocks that no row sees (steps == 0: dK = dV = 0) at hdim 64.
    { Case c = mk("d64_window_l20_r5_" + ts, 100, 300, 64, t); c.window_left = 20; c.window_right = 5; v.push_back(c); }
  }
  return v;
}

// One IOATTN_BWD_SM90_VARIANT of the wgmma backward (atomic dQ) on case c: it ran, at c's head
// dim, and its gradients pass the reference check.
void check_sm90_variant(BwdRun& s, const Refs& r, const Case& c, const char* variant) {
  ScopedEnv var("IOATTN_BWD_SM90_VARIANT", variant);
  s.poison_grads();
  const KernelChoice kc = s.backward_device(false);
  EXPECT_NE(kc.kernel.find("sm90 wgmma"), std::string::npos) << kc.kernel << ": " << kc.reason;
  EXPECT_NE(kc.kernel.find("hdim" + std::to_string(c.head_dim)), std::string::npos) << kc.kernel;
  EXPECT_NE(kc.kernel.find(std::string(" variant ") + variant), std::string::npos) << kc.kernel;
  check_grads(s, r, c.name + " (sm90 wgmma, variant " + variant + ")");
}

class CudaBackwardSm90 : public ::testing::TestWithParam<Case> {};

TEST_P(CudaBackwardSm90, MatchesFloat64Reference) {
  SKIP_WITHOUT_GPU();
  if (detail::cuda_device_arch(0) != 90) GTEST_SKIP() << "skipped: the wgmma backward needs sm_90";
  const Case& c = GetParam();
  BwdRun s(c, 11 + c.name.size());
  const Refs r = references(s);
  BwdKernelEnv env("sm90");
  for (const char* variant : {"lag", "redlag", "split", "red"}) check_sm90_variant(s, r, c, variant);
  // Deterministic mode: dK/dV by this kernel, dQ by the mma.sync table's atomic-free pass.
  s.poison_grads();
  const KernelChoice kc = s.backward_device(true);
  EXPECT_NE(kc.kernel.find("sm90 wgmma"), std::string::npos) << kc.kernel << ": " << kc.reason;
  EXPECT_NE(kc.kernel.find("dq deterministic"), std::string::npos) << kc.kernel;
  check_grads(s, r, c.name + " (sm90 wgmma, deterministic)");
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackwardSm90, ::testing::ValuesIn(sm90_cases()),
                         [](const auto& info) { return info.param.name; });

// One variant's own suite: case c through the wgmma backward with IOATTN_BWD_SM90_VARIANT=variant.
void run_sm90_variant_case(const Case& c, const char* variant) {
  BwdRun s(c, 11 + c.name.size());
  const Refs r = references(s);
  BwdKernelEnv env("sm90");
  check_sm90_variant(s, r, c, variant);
}

// A variant's suite: every case of cases() through run_sm90_variant_case (sm_90 only).
#define IOATTN_SM90_VARIANT_SUITE(Suite, cases, variant)                                                   \
  class Suite : public ::testing::TestWithParam<Case> {};                                                  \
  TEST_P(Suite, MatchesFloat64Reference) {                                                                 \
    SKIP_WITHOUT_GPU();                                                                                    \
    if (detail::cuda_device_arch(0) != 90) GTEST_SKIP() << "skipped: the wgmma backward needs sm_90";     \
    run_sm90_variant_case(GetParam(), variant);                                                            \
  }                                                                                                        \
  INSTANTIATE_TEST_SUITE_P(Cases, Suite, ::testing::ValuesIn(cases()),                                    \
                           [](const auto& info) { return info.param.name; })

// Variant tmald (Q / dO by TMA; the default at hdim 64 and from 2048 query rows at hdim 128 in
// session 8, where pp took its place in session 9): its own suite (written before it had run on a
// GPU, so a trap there gated nothing else).
IOATTN_SM90_VARIANT_SUITE(CudaBackwardSm90Tmald, sm90_cases, "tmald");

// Variant pp (no CTA barrier in the loop, the two warpgroups' wgmma issue alternating; at hdim 128
// the dS^T halves ordered by mbarriers; written in session 8, the default from 2048 query rows at
// hdim 128 since session 9, and at hdim 64 below 256 rows since session 23): its own suite, with two
// long cases (many steps: the warpgroups drift apart, every buffer turns over).
std::vector<Case> sm90_pp_cases() {
  std::vector<Case> v = sm90_cases();
  for (int64_t d : {64, 128}) {
    Case c = mk("long_q2048_k2048_gqa2_causal_d" + std::to_string(d) + "_bf16", 2048, 2048, d, DType::bf16);
    c.heads_q = 2;
    c.heads_kv = 1;
    c.causal = true;
    v.push_back(c);
  }
  return v;
}

IOATTN_SM90_VARIANT_SUITE(CudaBackwardSm90PingPong, sm90_pp_cases, "pp");

// Variant ppw (pp with each warp adding its own 16 rows of the dQ piece by TMA reduce-add: no
// warpgroup barrier before the reduce-adds; written in session 12 without a GPU): the pp suite.
IOATTN_SM90_VARIANT_SUITE(CudaBackwardSm90PingPongWarp, sm90_pp_cases, "ppw");

// Variant ppwide (pp at hdim 64 with 128-row steps, the dQ split by rows over the warpgroups;
// written in session 23): the pp suite's hdim-64 cases, plus tails of every length mod 128 that
// matters (a step half past the end, one row past a half) and a GQA case with many steps.
std::vector<Case> sm90_ppwide_cases() {
  std::vector<Case> v;
  for (const Case& c : sm90_pp_cases())
    if (c.head_dim == 64) v.push_back(c);
  for (DType t : {DType::bf16, DType::f16}) {
    const std::string ts = dtype_name(t);
    { Case c = mk("d64_q65_k129_" + ts, 65, 129, 64, t); v.push_back(c); }
    { Case c = mk("d64_q191_k300_causal_" + ts, 191, 300, 64, t); c.causal = true; v.push_back(c); }
    { Case c = mk("d64_q1000_k777_gqa3_" + ts, 1000, 777, 64, t); c.heads_q = 6; c.heads_kv = 2; v.push_back(c); }
  }
  return v;
}

IOATTN_SM90_VARIANT_SUITE(CudaBackwardSm90PingPongWide, sm90_ppwide_cases, "ppwide");

// Varlen on the wgmma backward (its kVarlen instance, the default since session 8;
// IOATTN_BWD_SM90_VARLEN=0 switches it off): packed sequences with empty ones on either side,
// causal and not, GQA with a window, sinks; hdim 128 and 64.
std::vector<Case> sm90_varlen_cases(const std::vector<int64_t>& hdims = {128, 64}) {
  std::vector<Case> v;
  for (DType t : {DType::bf16, DType::f16}) {
    const std::string ts = dtype_name(t);
    for (int64_t d : hdims) {
      const std::string ds = "d" + std::to_string(d) + "_";
      { Case c = mk("varlen_empty_" + ds + ts, 0, 0, d, t); c.batch = 5; c.varlen_q = {5, 0, 130, 64, 200};
        c.varlen_k = {7, 3, 200, 0, 150}; v.push_back(c); c.name = "varlen_empty_causal_" + ds + ts; c.causal = true;
        v.push_back(c); }
      { Case c = mk("varlen_gqa2_window_" + ds + ts, 0, 0, d, t); c.batch = 3; c.heads_q = 4; c.heads_kv = 2;
        c.varlen_q = {1, 300, 65}; c.varlen_k = {1, 310, 64}; c.window_left = 64; c.window_right = 16; v.push_back(c); }
      { Case c = mk("varlen_sinks_causal_" + ds + ts, 0, 0, d, t); c.batch = 3; c.varlen_q = {17, 170, 2};
        c.varlen_k = {17, 100, 230}; c.causal = true; c.sinks = true; v.push_back(c); }
    }
  }
  return v;
}

class CudaBackwardSm90Varlen : public ::testing::TestWithParam<Case> {};

TEST_P(CudaBackwardSm90Varlen, MatchesFloat64Reference) {
  SKIP_WITHOUT_GPU();
  if (detail::cuda_device_arch(0) != 90) GTEST_SKIP() << "skipped: the wgmma backward needs sm_90";
  const Case& c = GetParam();
  BwdRun s(c, 23 + c.name.size());
  const Refs r = references(s);
  BwdKernelEnv env(nullptr);
  s.poison_grads();
  const KernelChoice kc = s.backward_device(false);
  EXPECT_NE(kc.kernel.find("sm90 wgmma"), std::string::npos) << kc.kernel << ": " << kc.reason;
  // The default's variant follows the dense rule on the query length weighted by each sequence's
  // work, sq·sk (session 24): ppwide at hdim 64 from 256 query rows, pp below; pp at hdim 128 from
  // 2048, lag below. Lag is checked on request where it is not the default.
  double work = 0, weighted = 0;
  for (size_t i = 0; i < c.varlen_q.size(); ++i) {
    work += double(c.varlen_q[i]) * double(c.varlen_k[i]);
    weighted += double(c.varlen_q[i]) * double(c.varlen_q[i]) * double(c.varlen_k[i]);
  }
  const int64_t rows = work > 0 ? static_cast<int64_t>(weighted / work + 0.5)
                                : *std::max_element(c.varlen_q.begin(), c.varlen_q.end());
  const std::string want = c.head_dim == 64 ? (rows >= 256 ? "ppwide" : "pp") : rows >= 2048 ? "pp" : "lag";
  const std::string tail = " variant " + want;
  const bool ends = kc.kernel.size() >= tail.size() &&
                    kc.kernel.compare(kc.kernel.size() - tail.size(), tail.size(), tail) == 0;
  EXPECT_TRUE(ends) << kc.kernel << " (want variant " << want << ")";
  check_grads(s, r, c.name + " (sm90 wgmma varlen, variant " + want + ")");
  if (want != "lag") check_sm90_variant(s, r, c, "lag");
  // Deterministic mode on varlen (session 24): the wgmma dK/dV-only kernel over packed sequences,
  // then the atomic-free dQ pass.
  s.poison_grads();
  const KernelChoice det = s.backward_device(true);
  EXPECT_NE(det.kernel.find("sm90 wgmma"), std::string::npos) << det.kernel << ": " << det.reason;
  EXPECT_NE(det.kernel.find("dq deterministic"), std::string::npos) << det.kernel;
  check_grads(s, r, c.name + " (deterministic)");
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackwardSm90Varlen, ::testing::ValuesIn(sm90_varlen_cases()),
                         [](const auto& info) { return info.param.name; });

// Varlen through variants pp and ppwide (session 23; verified and the defaults by the dense rule since
// session 24: Q / dO by TMA over the packed tokens, a tail step's rows past its sequence read from
// the next sequence and masked): the varlen cases plus sequences of many steps with tails of every
// kind.
// Long packed sequences (many steps; tails that border the next sequence), causal and not.
std::vector<Case> varlen_long_cases(const std::vector<int64_t>& hdims) {
  std::vector<Case> v;
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t d : hdims) {
      const std::string ds = "d" + std::to_string(d) + "_" + dtype_name(t);
      Case c = mk("varlen_long_gqa2_" + ds, 0, 0, d, t);
      c.batch = 4;
      c.heads_q = 4;
      c.heads_kv = 2;
      c.varlen_q = {700, 129, 1, 1000};
      c.varlen_k = {650, 300, 64, 1000};
      v.push_back(c);
      c.name = "varlen_long_gqa2_causal_" + ds;
      c.causal = true;
      v.push_back(c);
    }
  return v;
}

std::vector<Case> sm90_varlen_pp_cases() {
  std::vector<Case> v = sm90_varlen_cases(), l = varlen_long_cases({128, 64});
  v.insert(v.end(), l.begin(), l.end());
  return v;
}

class CudaBackwardSm90VarlenPingPong : public ::testing::TestWithParam<Case> {};

TEST_P(CudaBackwardSm90VarlenPingPong, MatchesFloat64Reference) {
  SKIP_WITHOUT_GPU();
  if (detail::cuda_device_arch(0) != 90) GTEST_SKIP() << "skipped: the wgmma backward needs sm_90";
  const Case& c = GetParam();
  BwdRun s(c, 23 + c.name.size());
  const Refs r = references(s);
  BwdKernelEnv env("sm90");
  for (const char* variant : {"pp", "ppwide"})
    if (c.head_dim == 64 || std::string(variant) == "pp") check_sm90_variant(s, r, c, variant);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackwardSm90VarlenPingPong, ::testing::ValuesIn(sm90_varlen_pp_cases()),
                         [](const auto& info) { return info.param.name; });

// Varlen on the hdim-256 wgmma backward (session 23; the default since session 24): packed sequences
// with empty ones, GQA with a window, sinks, causal, and long ones whose tails border the next
// sequence.
std::vector<Case> sm90_d256_varlen_cases() {
  std::vector<Case> v = sm90_varlen_cases({256}), l = varlen_long_cases({256});
  v.insert(v.end(), l.begin(), l.end());
  return v;
}

class CudaBackwardSm90D256Varlen : public ::testing::TestWithParam<Case> {};

TEST_P(CudaBackwardSm90D256Varlen, MatchesFloat64Reference) {
  SKIP_WITHOUT_GPU();
  if (detail::cuda_device_arch(0) != 90) GTEST_SKIP() << "skipped: the wgmma backward needs sm_90";
  const Case& c = GetParam();
  BwdRun s(c, 29 + c.name.size());
  const Refs r = references(s);
  BwdKernelEnv env(nullptr);
  s.poison_grads();
  const KernelChoice kc = s.backward_device(false);
  EXPECT_NE(kc.kernel.find("sm90 wgmma"), std::string::npos) << kc.kernel << ": " << kc.reason;
  EXPECT_NE(kc.kernel.find("hdim256"), std::string::npos) << kc.kernel;
  check_grads(s, r, c.name + " (sm90 wgmma hdim-256 varlen)");
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackwardSm90D256Varlen, ::testing::ValuesIn(sm90_d256_varlen_cases()),
                         [](const auto& info) { return info.param.name; });

// A sequence of NaN tokens (Q, K, V, dO) between finite ones, at every head dim and variant of the
// wgmma backward (and the mma.sync table's): its neighbours' tail blocks must not read its rows or
// keys, and its own tail block must not add into the next sequence's dQ rows — the Hopper kernels'
// ragged TMA maps zero-fill / skip rows past a sequence (session 25; before, 0 x NaN leaked).
TEST(CudaBackwardVarlenNan, NanSequenceDoesNotReachItsNeighbours) {
  SKIP_WITHOUT_GPU();
  const bool sm90 = detail::cuda_device_arch(0) == 90;
  for (int64_t d : {64, 128, 256}) {
    Case c = mk("varlen_nan_neighbour_d" + std::to_string(d), 0, 0, d, d == 128 ? DType::f16 : DType::bf16);
    c.batch = 4;
    c.heads_q = 4;
    c.heads_kv = 2;
    c.varlen_q = {77, 130, 33, 20};
    c.varlen_k = {100, 150, 61, 0};
    c.causal = d == 64;
    BwdRun s(c, 31 + d);
    const Refs r = references(s);
    s.nan_sequence(1);
    for (const char* kernel : {"", "mma"}) {
      BwdKernelEnv env(*kernel ? kernel : nullptr);
      for (bool det : {false, true}) {
        s.poison_grads();
        const KernelChoice kc = s.backward_device(det);
        if (sm90 && !*kernel) EXPECT_NE(kc.kernel.find("sm90 wgmma"), std::string::npos) << kc.kernel;
        check_grads(s, r, c.name + " (" + kc.kernel + ")", 1);
      }
    }
    // Every varlen variant of the hdim-64 / 128 wgmma kernel (pp and ppwide load Q / dO by TMA, lag
    // by cp.async; all reduce dQ by TMA).
    if (sm90 && d != 256)
      for (const char* variant : {"lag", "pp", "ppwide"})
        if (d == 64 || std::string(variant) != "ppwide") {
          ScopedEnv var("IOATTN_BWD_SM90_VARIANT", variant);
          s.poison_grads();
          const KernelChoice kc = s.backward_device(false);
          EXPECT_NE(kc.kernel.find(std::string(" variant ") + variant), std::string::npos) << kc.kernel;
          check_grads(s, r, c.name + " (" + kc.kernel + ")", 1);
        }
  }
}

// The hdim-256 wgmma backward (session 19: 64 keys per CTA, the head dim split over the two
// warpgroups; sm_90's default at hdim 256 except softcap and ALiBi): odd shapes, rows and
// key blocks no one sees, GQA / MQA, windows, sinks, [b, h, s, d] strides, several (head, batch)
// planes of the dQ workspace with tail blocks, and two long cases (many steps: both Q / dO stages
// and both P / dS buffers turn over many times); dQ by the default pass, in deterministic mode, and
// by red.global (red, v4) from the dK/dV kernel. The mma.sync table
// runs each case too (IOATTN_BWD_KERNEL=mma), so that row stays covered on sm_90.
std::vector<Case> sm90_d256_cases() {
  std::vector<Case> v;
  for (DType t : {DType::bf16, DType::f16}) {
    const std::string ts = dtype_name(t);
    v.push_back(mk("d256_len1_" + ts, 1, 1, 256, t));
    v.push_back(mk("d256_len17_" + ts, 17, 17, 256, t));
    { Case c = mk("d256_q113_k203_causal_" + ts, 113, 203, 256, t); c.causal = true; v.push_back(c); }
    { Case c = mk("d256_q203_k113_causal_norows_" + ts, 203, 113, 256, t); c.causal = true; v.push_back(c); }
    { Case c = mk("d256_q1023_k1024_causal_" + ts, 1023, 1024, 256, t); c.causal = true; c.heads_q = c.heads_kv = 1;
      v.push_back(c); }
    { Case c = mk("d256_gqa4_causal_long_" + ts, 333, 390, 256, t); c.heads_q = 4; c.heads_kv = 1; c.causal = true;
      v.push_back(c); }
    { Case c = mk("d256_mqa8_" + ts, 40, 177, 256, t); c.heads_q = 8; c.heads_kv = 1; v.push_back(c); }
    { Case c = mk("d256_bhsd_batch2_" + ts, 65, 300, 256, t); c.bhsd = true; c.batch = 2; v.push_back(c); }
    { Case c = mk("d256_scale_negative_" + ts, 50, 70, 256, t); c.scale = -0.2f; v.push_back(c); }
    { Case c = mk("d256_gqa2_batch3_causal_" + ts, 100, 150, 256, t); c.heads_q = 4; c.heads_kv = 2; c.batch = 3;
      c.causal = true; v.push_back(c); }
    // Key blocks that no row sees (steps == 0: dK = dV = 0), a left window with causal and GQA, sinks.
    { Case c = mk("d256_window_l20_r5_" + ts, 100, 300, 256, t); c.window_left = 20; c.window_right = 5; v.push_back(c); }
    { Case c = mk("d256_window_l50_causal_gqa2_sinks_" + ts, 333, 290, 256, t); c.heads_q = 4; c.heads_kv = 2;
      c.causal = true; c.window_left = 50; c.sinks = true; v.push_back(c); }
    { Case c = mk("d256_window_r7_only_q300_k100_" + ts, 300, 100, 256, t); c.window_right = 7; v.push_back(c); }
  }
  { Case c = mk("d256_long_q2048_k2048_gqa2_causal_bf16", 2048, 2048, 256, DType::bf16); c.heads_q = 2; c.heads_kv = 1;
    c.causal = true; v.push_back(c); }
  { Case c = mk("d256_long_q1500_k1300_f16", 1500, 1300, 256, DType::f16); v.push_back(c); }
  return v;
}

class CudaBackwardSm90D256 : public ::testing::TestWithParam<Case> {};

TEST_P(CudaBackwardSm90D256, MatchesFloat64Reference) {
  SKIP_WITHOUT_GPU();
  if (detail::cuda_device_arch(0) != 90) GTEST_SKIP() << "skipped: the wgmma backward needs sm_90";
  const Case& c = GetParam();
  BwdRun s(c, 29 + c.name.size());
  const Refs r = references(s);
  {
    BwdKernelEnv env(nullptr);
    for (bool det : {false, true}) {
      s.poison_grads();
      const KernelChoice kc = s.backward_device(det);
      EXPECT_NE(kc.kernel.find("sm90 wgmma"), std::string::npos) << kc.kernel << ": " << kc.reason;
      EXPECT_NE(kc.kernel.find("hdim256"), std::string::npos) << kc.kernel;
      EXPECT_NE(kc.kernel.find(det ? "dq deterministic" : "dq pass variant dsplit-pass"), std::string::npos) << kc.kernel;
      check_grads(s, r, c.name + (det ? " (sm90 wgmma hdim 256, deterministic)" : " (sm90 wgmma hdim 256)"));
    }
    // dQ by red.global.add.v2 / .v4 (lanes swap a pair each) from the dK/dV kernel
    for (const char* mode : {"red", "v4"}) {
      ScopedEnv dq("IOATTN_BWD_SM90_D256_DQ", mode);
      s.poison_grads();
      const KernelChoice kc = s.backward_device(false);
      EXPECT_NE(kc.kernel.find(std::string("dq atomic variant dsplit") + (mode[0] == 'v' ? "-v4" : "")), std::string::npos)
          << kc.kernel;
      check_grads(s, r, c.name + " (sm90 wgmma hdim 256, IOATTN_BWD_SM90_D256_DQ=" + mode + ")");
    }
  }
  BwdKernelEnv env("mma");
  s.poison_grads();
  const KernelChoice kc = s.backward_device(false);
  EXPECT_NE(kc.kernel.find("mma.sync"), std::string::npos) << kc.kernel;
  check_grads(s, r, c.name + " (IOATTN_BWD_KERNEL=mma)");
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackwardSm90D256, ::testing::ValuesIn(sm90_d256_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(CudaBackwardSm90Select, SaysWhenItDoesNotApply) {
  SKIP_WITHOUT_GPU();
  if (detail::cuda_device_arch(0) != 90) GTEST_SKIP() << "skipped: the wgmma backward needs sm_90";
  {  // unset: the wgmma kernel where it applies, deterministic mode included (its dQ pass named);
     // softcap is the mma.sync table's, and the reason says why
    BwdKernelEnv env(nullptr);
    BwdRun s(mk("default_d128", 40, 50, 128), 5);
    const KernelChoice short_rows = s.backward_device(false);
    EXPECT_NE(short_rows.kernel.find("sm90 wgmma"), std::string::npos) << short_rows.kernel;
    EXPECT_NE(short_rows.kernel.find("variant lag"), std::string::npos) << short_rows.kernel;
    // from 2048 query rows at hdim 128: variant pp (Q / dO by TMA, warpgroups not in lockstep)
    BwdRun s2k(mk("default_d128_2k", 2048, 300, 128), 5);
    const KernelChoice long_rows = s2k.backward_device(false);
    EXPECT_NE(long_rows.kernel.find("variant pp"), std::string::npos) << long_rows.kernel;
    const KernelChoice kc = s.backward_device(true);
    EXPECT_NE(kc.kernel.find("sm90 wgmma"), std::string::npos) << kc.kernel;
    EXPECT_NE(kc.reason.find("atomic-free dQ pass"), std::string::npos) << kc.reason;
    Case c = mk("softcap_d128", 40, 50, 128);
    c.softcap = 10.0f;
    BwdRun sc(c, 5);
    const KernelChoice kcs = sc.backward_device(false);
    EXPECT_NE(kcs.kernel.find("mma.sync"), std::string::npos) << kcs.kernel;
    EXPECT_NE(kcs.reason.find("the wgmma backward does not apply (no softcap or ALiBi"), std::string::npos)
        << kcs.reason;
  }
  {
    BwdKernelEnv env("mma");
    BwdRun s(mk("mma_d128", 40, 50, 128), 5);
    EXPECT_NE(s.backward_device(false).kernel.find("mma.sync"), std::string::npos);
  }
  {  // hdim 64: the wgmma row is the default too; hdim 96 is not a row, and the reason says so
    BwdKernelEnv env(nullptr);
    BwdRun s(mk("default_d64", 40, 50, 64), 5);
    const KernelChoice kc = s.backward_device(false);
    EXPECT_NE(kc.kernel.find("sm90 wgmma"), std::string::npos) << kc.kernel;
    EXPECT_NE(kc.kernel.find("hdim64"), std::string::npos) << kc.kernel;
    // below 256 query rows variant pp (64-row steps), from 256 ppwide (128-row steps, session 23),
    // and the kernel string says which
    EXPECT_NE(kc.kernel.find("tile 64x128"), std::string::npos) << kc.kernel;
    EXPECT_NE(kc.kernel.find("variant pp"), std::string::npos) << kc.kernel;
    EXPECT_EQ(kc.kernel.find("variant ppwide"), std::string::npos) << kc.kernel;
    BwdRun s256(mk("default_d64_256", 256, 50, 64), 5);
    const KernelChoice k256 = s256.backward_device(false);
    EXPECT_NE(k256.kernel.find("tile 128x128"), std::string::npos) << k256.kernel;
    EXPECT_NE(k256.kernel.find("variant ppwide"), std::string::npos) << k256.kernel;
    // deterministic mode: the dK/dV-only instance, 64-row steps
    const KernelChoice k256det = s256.backward_device(true);
    EXPECT_NE(k256det.kernel.find("tile 64x128"), std::string::npos) << k256det.kernel;
    {  // asked at hdim 128: a clear error naming the switch
      ScopedEnv var("IOATTN_BWD_SM90_VARIANT", "ppwide");
      BwdRun s128(mk("ppwide_d128", 40, 50, 128), 5);
      try {
        s128.backward_device(false);
        ADD_FAILURE() << "IOATTN_BWD_SM90_VARIANT=ppwide accepted at hdim 128";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("hdim-64 variant, got head_dim 128"), std::string::npos) << e.what();
      }
    }
    BwdRun s96(mk("default_d96", 40, 50, 96), 5);
    const KernelChoice k96 = s96.backward_device(false);
    EXPECT_NE(k96.kernel.find("mma.sync"), std::string::npos) << k96.kernel;
    EXPECT_NE(k96.reason.find("head_dim 64, 128 or 256 only, got 96"), std::string::npos) << k96.reason;
  }
  {  // hdim 256: the wgmma row by default, varlen too; IOATTN_BWD_SM90_D256=0 goes to the mma.sync table
    BwdKernelEnv env(nullptr);
    BwdRun s(mk("default_d256", 40, 50, 256), 5);
    const KernelChoice kc = s.backward_device(false);
    EXPECT_NE(kc.kernel.find("sm90 wgmma"), std::string::npos) << kc.kernel;
    EXPECT_NE(kc.kernel.find("variant dsplit"), std::string::npos) << kc.kernel;
    {
      ScopedEnv off("IOATTN_BWD_SM90_D256", "0");
      const KernelChoice k = s.backward_device(false);
      EXPECT_NE(k.kernel.find("mma.sync"), std::string::npos) << k.kernel;
      EXPECT_NE(k.reason.find("IOATTN_BWD_SM90_D256=0"), std::string::npos) << k.reason;
    }
    Case c = mk("varlen_d256", 0, 0, 256);
    c.batch = 2;
    c.varlen_q = {5, 30};
    c.varlen_k = {7, 20};
    BwdRun sv(c, 5);
    const KernelChoice kv = sv.backward_device(false);  // varlen at hdim 256: wgmma (session 24)
    EXPECT_NE(kv.kernel.find("sm90 wgmma"), std::string::npos) << kv.kernel << ": " << kv.reason;
    EXPECT_NE(kv.kernel.find("hdim256 nomask+varlen"), std::string::npos) << kv.kernel;
    {  // its varlen instances take dQ by the pass only: reductions asked for go to the mma.sync table
      ScopedEnv red("IOATTN_BWD_SM90_D256_DQ", "red");
      const KernelChoice kr = sv.backward_device(false);
      EXPECT_NE(kr.kernel.find("mma.sync"), std::string::npos) << kr.kernel;
      EXPECT_NE(kr.reason.find("dQ by the wgmma pass only"), std::string::npos) << kr.reason;
    }
  }
  {
    BwdKernelEnv env(nullptr);
    ScopedEnv var("IOATTN_BWD_SM90_VARIANT", "fast");
    BwdRun s(mk("bad_variant", 10, 10, 128), 4);
    try {
      s.backward_device(false);
      ADD_FAILURE() << "IOATTN_BWD_SM90_VARIANT=fast accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("IOATTN_BWD_SM90_VARIANT"), std::string::npos) << e.what();
    }
  }
  {
    BwdKernelEnv env("sm90");
    Case c = mk("alibi_window_d128", 100, 300, 128);
    c.window_left = 20;
    c.window_right = 5;
    c.alibi = true;
    BwdRun s(c, 3);
    const Refs r = references(s);
    s.poison_grads();
    const KernelChoice kc = s.backward_device(true);  // ALiBi: refused, the mma.sync table runs it
    EXPECT_NE(kc.kernel.find("mma.sync"), std::string::npos) << kc.kernel;
    EXPECT_NE(kc.reason.find("IOATTN_BWD_KERNEL=sm90 does not apply"), std::string::npos) << kc.reason;
    check_grads(s, r, "ALiBi + window with IOATTN_BWD_KERNEL=sm90");
  }
  {
    BwdKernelEnv env("wgmma");
    BwdRun s(mk("bad_env", 10, 10, 128), 4);
    try {
      s.backward_device(false);
      ADD_FAILURE() << "IOATTN_BWD_KERNEL=wgmma accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("IOATTN_BWD_KERNEL"), std::string::npos) << e.what();
    }
  }
}

bool same_bytes(const detail::Buffer& a, const std::vector<uint8_t>& b) {
  return a.bytes() == b.size() && std::memcmp(a.host(), b.data(), b.size()) == 0;
}

std::vector<uint8_t> bytes_of(const detail::Buffer& a) {
  const auto* p = static_cast<const uint8_t*>(a.host());
  return std::vector<uint8_t>(p, p + a.bytes());
}

// Deterministic mode from the gradients already in s: `runs` - 1 more runs, each poisoned first,
// give the same bytes of dq, dk, dv and dsinks (a fatal failure names the first that differs).
void expect_same_bits_over_runs(BwdRun& s, const std::string& name, int runs) {
  const auto dq0 = bytes_of(s.dq), dk0 = bytes_of(s.dk), dv0 = bytes_of(s.dv), ds0 = bytes_of(s.dsinks);
  for (int run = 1; run < runs; ++run) {
    s.poison_grads();
    s.backward_device(true);
    ASSERT_TRUE(same_bytes(s.dq, dq0)) << name << ": dq differs in run " << run;
    ASSERT_TRUE(same_bytes(s.dk, dk0)) << name << ": dk differs in run " << run;
    ASSERT_TRUE(same_bytes(s.dv, dv0)) << name << ": dv differs in run " << run;
    ASSERT_TRUE(same_bytes(s.dsinks, ds0)) << name << ": dsinks differs in run " << run;
  }
}

// Deterministic mode: 100 runs give bitwise-equal dq, dk, dv, dsinks (GQA, causal, sinks,
// several key blocks per query block and several query blocks per key block).
TEST(CudaBackwardDeterministic, BitwiseEqualOver100Runs) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c = mk("det_hdim" + std::to_string(d), 300, 457, d, DType::bf16);
    c.causal = true;
    c.heads_q = 8;
    c.heads_kv = 2;
    c.sinks = true;
    c.batch = 2;
    BwdRun s(c, 3);
    s.backward_device(true);
    const auto dk0 = bytes_of(s.dk), dv0 = bytes_of(s.dv), ds0 = bytes_of(s.dsinks);
    expect_same_bits_over_runs(s, c.name, 100);
    if (::testing::Test::HasFatalFailure()) return;
    // dK, dV and dsinks never use atomics: the atomic-dQ mode gives the same bits for them. (At hdim
    // 64 the default variant from 256 rows, ppwide, forms dS from the bf16 P that its dV product reads, as pp does
    // at hdim 128 from 2048 rows, where these kernels use the fp32 P: there dV and dsinks are the
    // same bits and dK matches within rounding; variant lag is the deterministic instance's order.)
    s.poison_grads();
    s.backward_device(false);
    EXPECT_TRUE(same_bytes(s.dv, dv0)) << c.name << ": dv of the default mode differs";
    std::optional<ScopedEnv> lag;
    if (d == 64) lag.emplace("IOATTN_BWD_SM90_VARIANT", "lag");
    s.poison_grads();
    s.backward_device(false);
    EXPECT_TRUE(same_bytes(s.dk, dk0)) << c.name << ": dk of the atomic-dq mode differs";
    EXPECT_TRUE(same_bytes(s.dv, dv0)) << c.name << ": dv of the atomic-dq mode differs";
    EXPECT_TRUE(same_bytes(s.dsinks, ds0)) << c.name << ": dsinks of the atomic-dq mode differs";
  }
}

// Deterministic mode on packed sequences (the wgmma dK/dV-only kernel over cu_seqlens since session
// 24, hdim 256 its dQ pass as always): 20 runs give bitwise-equal dq, dk, dv, dsinks.
TEST(CudaBackwardDeterministic, VarlenBitwiseEqualOver20Runs) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c = mk("det_varlen_hdim" + std::to_string(d), 0, 0, d, DType::bf16);
    c.batch = 4;
    c.heads_q = 4;
    c.heads_kv = 2;
    c.causal = true;
    c.sinks = true;
    c.varlen_q = {300, 0, 129, 77};
    c.varlen_k = {457, 5, 129, 200};
    BwdRun s(c, 7);
    const Refs r = references(s);
    const KernelChoice kc = s.backward_device(true);
    if (detail::cuda_device_arch(0) == 90)
      EXPECT_NE(kc.kernel.find("sm90 wgmma"), std::string::npos) << kc.kernel << ": " << kc.reason;
    check_grads(s, r, c.name);
    expect_same_bits_over_runs(s, c.name, 20);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Large logits (inputs x3) with seqlen 1 and short rows: P is ~1 on one key, exp(s - LSE) with
// s slightly above the stored LSE, dP - D cancels; gradients stay finite and accurate.
TEST(CudaBackwardNumerics, LargeLogitsAreNaNFree) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::f16, DType::bf16})
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 1}, {1, 2}, {1, 300}, {2, 1}, {64, 64}, {129, 257}}) {
      Case c = mk(std::string("large_logits_") + dtype_name(t) + "_" + std::to_string(sq) + "x" + std::to_string(sk), sq,
                  sk, 128, t);
      c.input_range = 3.0f;
      c.causal = sq >= 64;
      run_case(c, 17);
    }
}

// A query row with no visible key (causal, seqlen_q > seqlen_k) gets dq = 0 exactly, and keys no
// query sees (a window) get dk = dv = 0 exactly, in both modes.
TEST(CudaBackwardNumerics, UnreachedRowsGetZeroGradients) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::f16, DType::bf16})
    for (bool det : {false, true}) {
      Case c = mk("norows", 100, 30, 64, t);
      c.causal = true;
      BwdRun s(c, 5);
      s.backward_device(det);
      for (int64_t i = 0; i < 70; ++i)
        for (int64_t h = 0; h < s.Hq; ++h)
          for (int64_t x = 0; x < s.D; ++x)
            ASSERT_EQ(s.dq.get((i * s.Hq + h) * s.hs_qk + x), 0.0f) << "row " << i << (det ? " det" : "");
      Case w = mk("unseen_keys", 10, 200, 128, t);  // off = 190, window (5, 0): keys < 185 unseen
      w.window_left = 5;
      w.window_right = 0;
      BwdRun s2(w, 6);
      s2.backward_device(det);
      for (int64_t j = 0; j < 185; ++j)
        for (int64_t h = 0; h < s2.Hk; ++h)
          for (int64_t x = 0; x < s2.D; ++x) {
            ASSERT_EQ(s2.dk.get((j * s2.Hk + h) * s2.hs_qk + x), 0.0f) << "key " << j;
            ASSERT_EQ(s2.dv.get((j * s2.Hk + h) * s2.hs_v + x), 0.0f) << "key " << j;
          }
    }
}

// The selector refuses what the kernels do not do, with a reason, instead of a slow path.
TEST(CudaBackwardSelect, RefusesWithAReason) {
  SKIP_WITHOUT_GPU();
  const int arch = detail::cuda_device_arch(0);
  detail::BwdProblem bp;
  detail::FwdProblem& p = bp.f;
  p.dtype = DType::f32, p.device = Device::cuda, p.batch = 1, p.heads_q = p.heads_kv = 1;
  p.seqlen_q = p.seqlen_k = 16, p.head_dim = p.head_dim_v = 64;
  auto sel = detail::cuda_backward_select(bp, arch);
  EXPECT_TRUE(sel.kernel.empty());
  EXPECT_NE(sel.reason.find("f16 or bf16"), std::string::npos) << sel.reason;
  p.dtype = DType::bf16, p.head_dim = p.head_dim_v = 60;
  sel = detail::cuda_backward_select(bp, arch);
  EXPECT_TRUE(sel.kernel.empty());
  EXPECT_NE(sel.reason.find("head_dim"), std::string::npos) << sel.reason;
  p.head_dim = 64, p.head_dim_v = 32;
  EXPECT_TRUE(detail::cuda_backward_select(bp, arch).kernel.empty());
  EXPECT_FALSE(detail::cuda_backward_select(bp, 75).reason.empty());
  // Supported problems are accepted and named: hdim 256 runs the wgmma row with its dQ pass on sm_90,
  // and elsewhere (or with IOATTN_BWD_KERNEL=mma) the mma.sync row that splits its columns over 2 CTAs.
  p.head_dim = p.head_dim_v = 256;
  sel = detail::cuda_backward_select(bp, arch);
  EXPECT_NE(sel.kernel.find("hdim256"), std::string::npos) << sel.reason;
  if (arch == 90) {
    EXPECT_NE(sel.kernel.find("sm90 wgmma"), std::string::npos) << sel.kernel;
    EXPECT_NE(sel.kernel.find("dq pass"), std::string::npos) << sel.kernel;
  } else {
    EXPECT_NE(sel.kernel.find("column splits"), std::string::npos) << sel.kernel;
  }
  {
    ScopedEnv mma("IOATTN_BWD_KERNEL", "mma");
    sel = detail::cuda_backward_select(bp, arch);
    EXPECT_NE(sel.kernel.find("column splits"), std::string::npos) << sel.kernel;
  }
  p.head_dim = p.head_dim_v = 128;
  sel = detail::cuda_backward_select(bp, arch);
  EXPECT_NE(sel.kernel.find("hdim128"), std::string::npos) << sel.reason;
  bp.deterministic = true;
  sel = detail::cuda_backward_select(bp, arch);
  EXPECT_NE(sel.kernel.find("dq deterministic"), std::string::npos) << sel.kernel;

  // Through the public API: head_dim 60 (not a multiple of 8) fails loudly (ioattn::Error naming
  // q, the reason naming head_dim) and writes nothing.
  Case c = mk("hdim60_refused", 16, 16, 60);
  BwdRun s(c, 9);
  try {
    s.backward_device(false);
    ADD_FAILURE() << "head_dim 60 backward was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos) << e.what();
  }
  s.dq.download();
  EXPECT_EQ(written_outside(s.dq, s.Hq, 0, s.hs_qk, 0), 0) << "dq written by a refused call";
}

}  // namespace
}  // namespace ioattn::test

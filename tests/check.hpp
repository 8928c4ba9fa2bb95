// Test harness: run one forward problem on a target (device + backend) and compare O and LSE
// with the float64 reference under FlashAttention's rule:
//   max|O - O_ref| <= 2 * max|O_naive_lowp - O_ref| + atol
// where O_naive_lowp is standard attention computed in the input precision (S, P, O rounded to
// the input dtype) — see src/cpu/reference.hpp. Outputs are poisoned with NaN before the run,
// so an unwritten element fails.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/harness.hpp"
#include "core/validate.hpp"
#include "cpu/reference.hpp"
#include "ioattn/ioattn.hpp"

namespace ioattn::test {

// Sets an environment variable for a scope (nullptr: unsets it) and restores the caller's value
// after: the tests' switches for the experimental kernel and loader paths.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    value ? setenv(name, value, 1) : unsetenv(name);
  }
  ~ScopedEnv() { had_ ? setenv(name_.c_str(), old_.c_str(), 1) : unsetenv(name_.c_str()); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

struct Target {
  Device device;
  Backend backend;
  std::string name() const { return std::string(device_name(device)) + "_" + backend_name(backend); }
};

struct Case {
  std::string name;
  int64_t batch = 1, seqlen_q = 17, seqlen_k = 17, heads_q = 2, heads_kv = 2, head_dim = 64, head_dim_v = -1;
  DType dtype = DType::f32;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
  bool bhsd = false;                  // inputs/outputs in [b, h, s, d] memory (strided views)
  int64_t pad_head = 0;               // extra elements between heads (non-contiguous rows)
  std::vector<int32_t> varlen_q, varlen_k;  // per-sequence lengths; non-empty = varlen
  float input_range = 1.0f;
  float k_ramp = 0.0f;  // > 0: key row j scaled by 1 + k_ramp * j, so the logits grow along the keys
                        // and a row's max keeps rising from block to block ([b, s, h, d], no varlen)
  float scale = 0.0f;
  int64_t dv() const { return head_dim_v < 0 ? head_dim : head_dim_v; }
};

// gtest prints parameters with these (instead of raw bytes).
inline void PrintTo(const Target& t, std::ostream* os) { *os << t.name(); }
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

inline double atol_for(DType t) { return t == DType::f32 ? 1e-5 : 1e-4; }

struct RunResult {
  double err_o = 0, err_lse = 0, naive_o = 0, naive_lse = 0;
  bool finite = true;
};

inline bool cuda_available() { return detail::cuda_device_count() > 0; }

// Skips (never passes silently) when the target's device is absent.
#define IOATTN_SKIP_IF_NO_DEVICE(target)                                              \
  do {                                                                                \
    if ((target).device == ::ioattn::Device::cuda && !::ioattn::test::cuda_available()) \
      GTEST_SKIP() << "skipped: no CUDA device";                                      \
  } while (0)

inline std::vector<int32_t> prefix(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

// Runs the case and returns errors vs the reference; checks the tolerance rule with gtest.
inline RunResult run_case(const Case& c, const Target& tg, uint64_t seed = 42) {
  std::mt19937_64 rng(seed);
  const bool varlen = !c.varlen_q.empty();
  const Device dev = tg.device;
  const int64_t B = c.batch, Hq = c.heads_q, Hk = c.heads_kv, D = c.head_dim, Dv = c.dv();
  const std::vector<int32_t> cuq = varlen ? prefix(c.varlen_q) : std::vector<int32_t>{};
  const std::vector<int32_t> cuk = varlen ? prefix(c.varlen_k) : std::vector<int32_t>{};
  const int64_t rows_q = varlen ? cuq.back() : B * c.seqlen_q;
  const int64_t rows_k = varlen ? cuk.back() : B * c.seqlen_k;
  const int64_t ph = c.pad_head;
  detail::Buffer q(c.dtype, rows_q * Hq * (D + ph), dev), k(c.dtype, rows_k * Hk * (D + ph), dev);
  detail::Buffer v(c.dtype, rows_k * Hk * (Dv + ph), dev), o(c.dtype, rows_q * Hq * (Dv + ph), dev);
  detail::Buffer lse(DType::f32, rows_q * Hq, dev);
  detail::Buffer alibi(DType::f32, Hq, dev), sinks(DType::f32, Hq, dev);
  q.fill_random(rng, c.input_range);
  k.fill_random(rng, c.input_range);
  v.fill_random(rng);
  if (c.k_ramp > 0) {
    EXPECT_TRUE(!varlen && !c.bhsd) << c.name << ": k_ramp takes the [b, s, h, d] layout";
    const int64_t row = Hk * (D + ph);
    for (int64_t e = 0; e < rows_k * row; ++e) k.set(e, k.get(e) * (1.0f + c.k_ramp * static_cast<float>(e / row % c.seqlen_k)));
    k.upload();
  }
  o.poison();
  lse.poison();

  // Views: [b, s, h, d] by default; [b, h, s, d] memory when bhsd; pad_head spaces the heads.
  auto view = [&](detail::Buffer& buf, int64_t s, int64_t h, int64_t d) {
    const int64_t hs = d + ph;  // head stride in [b, s, h, d]
    if (varlen) return TensorView::strided(buf.data(), buf.dtype(), {s, h, d}, {h * hs, hs, 1}, dev);
    if (c.bhsd) return TensorView::strided(buf.data(), buf.dtype(), {B, s, h, d}, {h * s * hs, hs, s * hs, 1}, dev);
    return TensorView::strided(buf.data(), buf.dtype(), {B, s, h, d}, {s * h * hs, h * hs, hs, 1}, dev);
  };
  const int64_t sq = varlen ? rows_q : c.seqlen_q, sk = varlen ? rows_k : c.seqlen_k;
  TensorView qv = view(q, sq, Hq, D), kv = view(k, sk, Hk, D), vv = view(v, sk, Hk, Dv), ov = view(o, sq, Hq, Dv);
  TensorView lv = varlen ? lse.view({Hq, rows_q}) : lse.view({B, Hq, c.seqlen_q});

  AttnParams prm;
  prm.causal = c.causal;
  prm.window_left = c.window_left;
  prm.window_right = c.window_right;
  prm.softcap = c.softcap;
  prm.scale = c.scale;
  if (c.alibi) {
    for (int64_t h = 0; h < Hq; ++h) alibi.set(h, 0.5f / static_cast<float>(h + 1));
    alibi.upload();
    prm.alibi_slopes = alibi.view({Hq});
  }
  if (c.sinks) {
    for (int64_t h = 0; h < Hq; ++h) sinks.set(h, static_cast<float>(h % 3) - 1.0f);
    sinks.upload();
    prm.sinks = sinks.view({Hq});
  }
  detail::Buffer cu_q(DType::i32, varlen ? B + 1 : 0, dev), cu_k(DType::i32, varlen ? B + 1 : 0, dev);
  Varlen vl;
  if (varlen) {
    cu_q.fill_i32(cuq);
    cu_k.fill_i32(cuk);
    vl.cu_seqlens_q = cu_q.view({B + 1});
    vl.cu_seqlens_k = cu_k.view({B + 1});
  }
  Context ctx;
  ctx.backend = tg.backend;
  if (varlen)
    forward_varlen(qv, kv, vv, ov, lv, vl, prm, ctx);
  else
    forward(qv, kv, vv, ov, lv, prm, ctx);
  o.download();
  lse.download();

  // The reference reads host copies of the same problem.
  detail::Validated val = detail::validate(qv, kv, vv, ov, lv, varlen ? &vl : nullptr, prm, ctx);
  detail::FwdProblem hp = val.p;
  hp.device = Device::cpu;
  hp.q = q.host();
  hp.k = k.host();
  hp.v = v.host();
  hp.alibi_slopes = c.alibi ? static_cast<const float*>(alibi.host()) : nullptr;
  hp.sinks = c.sinks ? static_cast<const float*>(sinks.host()) : nullptr;
  const auto ref = detail::reference_forward(hp, detail::RefPrecision::f64, rows_q);
  const auto emu = detail::reference_forward(hp, detail::RefPrecision::emulated, rows_q);
  detail::ErrorStats eo, el, no, nl;
  detail::output_errors(hp, o.host(), static_cast<const float*>(lse.host()), ref, &eo, &el);
  detail::ref_errors(emu, ref, &no, &nl);
  // Padding between heads is not part of o: it must still hold the poison.
  if (ph > 0) {
    int64_t written = 0;
    for (int64_t row = 0; row < rows_q * Hq; ++row)
      for (int64_t x = Dv; x < Dv + ph; ++x) written += !std::isnan(o.get(row * (Dv + ph) + x));
    EXPECT_EQ(written, 0) << c.name << ": elements outside o's view were written";
  }
  RunResult r{eo.max_abs, el.max_abs, no.max_abs, nl.max_abs, eo.bad_index < 0 && el.bad_index < 0};
  const double atol = atol_for(c.dtype);
  EXPECT_TRUE(r.finite) << c.name << ": non-finite or unwritten output at O[" << eo.bad_index << "] / LSE["
                        << el.bad_index << "]";
  EXPECT_LE(r.err_o, 2 * r.naive_o + atol) << c.name << ": O error vs float64 reference (naive "
                                           << dtype_name(c.dtype) << " error " << r.naive_o << ")";
  EXPECT_LE(r.err_lse, 2 * r.naive_lse + 10 * atol) << c.name << ": LSE error vs float64 reference (naive "
                                                    << dtype_name(c.dtype) << " error " << r.naive_lse << ")";
  return r;
}

}  // namespace ioattn::test

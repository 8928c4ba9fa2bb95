// Shared by the serving tests (test_serving.cpp on the CPU, test_cuda_serving.cpp on CUDA): the
// decode problem description (Spec), its values (Values), a cache built from them in any layout
// (Built: paged / contiguous, 8-bit, on the host or mirrored on a CUDA device), the float64
// reference per sequence, the tolerance check, and the append_kv helpers.
//
// Decode of sequence b is the forward of its seqlen_q query rows against its cache_seqlens[b]
// keys (bottom-right aligned masks), so the oracle is detail::reference_forward on a contiguous
// batch-1 problem built from the same (dequantised) values. Outputs are poisoned with NaN before
// every run; unused cache slots and pages hold NaN (or the 8-bit NaN code), so a read outside the
// live tokens shows up as a NaN output.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "check.hpp"
#include "fuzz_cases.hpp"
#include "core/serving_problem.hpp"
#include "cpu/serving_quant.h"
#include "ioattn/serving.hpp"

namespace ioattn::test {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- problem description and construction -------------------------------------------------

struct Spec {
  std::string name;
  int64_t hq = 4, hkv = 2, d = 64, dv = -1, sq = 1;
  std::vector<int32_t> lens{37};
  int64_t page_size = 0;  // 0 = contiguous [batch, capacity, hkv, d] cache
  bool shuffle = true;    // paged: pages of a sequence in random order
  DType dtype = DType::f32;
  DType cache = DType::f32;  // == dtype, or f8e4m3 / i8 (set by with_cache)
  bool causal = false;
  int64_t wl = -1, wr = -1;
  float softcap = 0.0f, scale = 0.0f, q_range = 1.0f;
  bool alibi = false, sinks = false;
  int splits = 0;
  int64_t pad_head = 0;  // elements between heads of q and o (o's padding must stay poisoned)
  Device device = Device::cpu;  // where the tensors live (CUDA: host mirrors, uploaded / downloaded)
  double tol_mul = 1.0;         // widens o_tol / lse_tol in expect_matches_reference
  int64_t DV() const { return dv < 0 ? d : dv; }
  int64_t B() const { return static_cast<int64_t>(lens.size()); }
};

inline Spec mk(std::string name, DType t) {
  Spec s;
  s.name = std::move(name);
  s.dtype = s.cache = t;
  return s;
}

// Logical values, independent of the cache layout (so paged / contiguous / single-sequence
// builds of one Values hold the same numbers).
struct Values {
  std::vector<float> q;                   // [B, sq, hq, d], rounded to the q dtype
  std::vector<std::vector<float>> k, v;   // per sequence [len, hkv, d|dv]: what append_kv receives
  std::vector<float> k_scale, v_scale;    // [hkv], 8-bit caches
  std::vector<float> alibi, sinks;        // [hq]
};

inline Values make_values(const Spec& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const DType t = c.dtype;
  Values v;
  v.q.resize(static_cast<size_t>(c.B() * c.sq * c.hq * c.d));
  for (float& x : v.q) x = detail::round_to(t, u(rng) * c.q_range);
  for (int64_t b = 0; b < c.B(); ++b) {
    const int64_t L = c.lens[static_cast<size_t>(b)];
    std::vector<float> kk(static_cast<size_t>(L * c.hkv * c.d)), vv(static_cast<size_t>(L * c.hkv * c.DV()));
    for (float& x : kk) x = detail::round_to(t, u(rng) * c.q_range);
    for (float& x : vv) x = detail::round_to(t, u(rng));
    v.k.push_back(std::move(kk));
    v.v.push_back(std::move(vv));
  }
  // 8-bit: the scale maps the value range (-range, range) onto (most of) the code range.
  const float code_max = c.cache == DType::i8 ? 127.0f : detail::kE4m3Max;
  for (int64_t h = 0; h < c.hkv; ++h) {
    v.k_scale.push_back(c.q_range * (1.0f + 0.125f * static_cast<float>(h)) / code_max);
    v.v_scale.push_back((1.0f + 0.25f * static_cast<float>(h)) / code_max);
  }
  for (int64_t h = 0; h < c.hq; ++h) {
    v.alibi.push_back(0.5f / static_cast<float>(h + 1));
    v.sinks.push_back(static_cast<float>(h % 3) - 1.0f);
  }
  return v;
}

// The values of sequences [b, b + 1) as a batch of one.
inline Values slice(const Spec& c, const Values& v, int64_t b) {
  Values s = v;
  const size_t per = static_cast<size_t>(c.sq * c.hq * c.d);
  s.q.assign(v.q.begin() + static_cast<std::ptrdiff_t>(b * per), v.q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per));
  s.k = {v.k[static_cast<size_t>(b)]};
  s.v = {v.v[static_cast<size_t>(b)]};
  return s;
}

inline uint8_t quantise(DType t, float x, float scale) {
  return t == DType::f8e4m3 ? detail::float_to_e4m3(x / scale)
                            : static_cast<uint8_t>(detail::float_to_i8(x / scale));
}
inline float dequantise(DType t, uint8_t code, float scale) {
  return (t == DType::f8e4m3 ? detail::e4m3_to_float(code) : detail::i8_to_float(static_cast<int8_t>(code))) * scale;
}

// A decode problem: q, o, lse and a KV cache holding Values in the spec's layout.
struct Built {
  Spec c;
  Values val;
  int64_t ps = 0, pages = 0, width = 1, capacity = 0;
  std::vector<int32_t> table;  // [B, width], -1 = unused
  detail::Buffer q, o, lse, kc, vc, bt, lens, ks, vs, alibi, sinks;
  std::vector<std::vector<float>> kdeq, vdeq;  // per sequence: the values the kernel sees
  KVCache cache;
  TensorView qv, ov, lv;
  AttnParams prm;

  Built(const Spec& spec, Values values, uint64_t layout_seed = 1) : c(spec), val(std::move(values)) {
    const int64_t B = c.B(), hq = c.hq, hkv = c.hkv, d = c.d, dv = c.DV(), sq = c.sq, ph = c.pad_head;
    const int32_t max_len = B ? *std::max_element(c.lens.begin(), c.lens.end()) : 0;
    if (c.page_size > 0) {
      ps = c.page_size;
      std::vector<int64_t> need;
      for (int32_t L : c.lens) need.push_back((L + ps - 1) / ps);
      pages = std::accumulate(need.begin(), need.end(), int64_t{0}) + 2;  // two pages nobody owns
      width = (need.empty() ? 0 : *std::max_element(need.begin(), need.end())) + 1;
      std::vector<int32_t> perm(static_cast<size_t>(pages));
      std::iota(perm.begin(), perm.end(), 0);
      if (c.shuffle) {
        std::mt19937_64 rng(layout_seed);
        std::shuffle(perm.begin(), perm.end(), rng);
      }
      table.assign(static_cast<size_t>(B * width), -1);
      size_t next = 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < need[static_cast<size_t>(b)]; ++j) table[static_cast<size_t>(b * width + j)] = perm[next++];
      capacity = width * ps;
    } else {
      capacity = max_len + 3;
      ps = capacity;
      pages = B;
    }
    q = detail::Buffer(c.dtype, B * sq * hq * (d + ph), c.device);
    o = detail::Buffer(c.dtype, B * sq * hq * (dv + ph), c.device);
    lse = detail::Buffer(DType::f32, B * hq * sq, c.device);
    kc = detail::Buffer(c.cache, pages * ps * hkv * d, c.device);
    vc = detail::Buffer(c.cache, pages * ps * hkv * dv, c.device);
    bt = detail::Buffer(DType::i32, std::max<int64_t>(1, B * width), c.device);
    lens = detail::Buffer(DType::i32, std::max<int64_t>(1, B), c.device);
    ks = detail::Buffer(DType::f32, hkv, c.device);
    vs = detail::Buffer(DType::f32, hkv, c.device);
    alibi = detail::Buffer(DType::f32, hq, c.device);
    sinks = detail::Buffer(DType::f32, hq, c.device);
    q.poison();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < sq; ++i)
        for (int64_t h = 0; h < hq; ++h)
          for (int64_t x = 0; x < d; ++x)
            q.set(((b * sq + i) * hq + h) * (d + ph) + x, val.q[static_cast<size_t>(((b * sq + i) * hq + h) * d + x)]);
    for (int64_t h = 0; h < hkv; ++h) {
      ks.set(h, val.k_scale[static_cast<size_t>(h)]);
      vs.set(h, val.v_scale[static_cast<size_t>(h)]);
    }
    for (int64_t h = 0; h < hq; ++h) {
      alibi.set(h, val.alibi[static_cast<size_t>(h)]);
      sinks.set(h, val.sinks[static_cast<size_t>(h)]);
    }
    if (!table.empty()) bt.fill_i32(table);
    lens.fill_i32(c.lens);
    clear_cache();
    kdeq.resize(static_cast<size_t>(B));
    vdeq.resize(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t L = c.lens[static_cast<size_t>(b)];
      kdeq[static_cast<size_t>(b)].resize(static_cast<size_t>(L * hkv * d));
      vdeq[static_cast<size_t>(b)].resize(static_cast<size_t>(L * hkv * dv));
      for (int64_t t = 0; t < L; ++t)
        for (int64_t h = 0; h < hkv; ++h) {
          for (int64_t x = 0; x < d; ++x) {
            const size_t li = static_cast<size_t>((t * hkv + h) * d + x);
            kdeq[static_cast<size_t>(b)][li] = put(kc, elem(b, t, h, d) + x, val.k[static_cast<size_t>(b)][li], val.k_scale[static_cast<size_t>(h)]);
          }
          for (int64_t x = 0; x < dv; ++x) {
            const size_t li = static_cast<size_t>((t * hkv + h) * dv + x);
            vdeq[static_cast<size_t>(b)][li] = put(vc, elem(b, t, h, dv) + x, val.v[static_cast<size_t>(b)][li], val.v_scale[static_cast<size_t>(h)]);
          }
        }
    }
    auto view4 = [&](detail::Buffer& buf, int64_t s, int64_t h, int64_t dd) {
      const int64_t hs = dd + ph;
      return TensorView::strided(buf.data(), buf.dtype(), {B, s, h, dd}, {s * h * hs, h * hs, hs, 1}, c.device);
    };
    qv = view4(q, sq, hq, d);
    ov = view4(o, sq, hq, dv);
    lv = lse.view({B, hq, sq});
    cache.k_cache = kc.view({pages, ps, hkv, d});
    cache.v_cache = vc.view({pages, ps, hkv, dv});
    if (c.page_size > 0) cache.block_table = bt.view({B, width});
    cache.cache_seqlens = lens.view({B});
    if (detail::is_8bit(c.cache)) {
      cache.k_scale = ks.view({hkv});
      cache.v_scale = vs.view({hkv});
    }
    prm.causal = c.causal;
    prm.window_left = c.wl;
    prm.window_right = c.wr;
    prm.softcap = c.softcap;
    prm.scale = c.scale;
    if (c.alibi) prm.alibi_slopes = alibi.view({hq});
    if (c.sinks) prm.sinks = sinks.view({hq});
    upload();
  }

  // Host -> device copies of every input (no-ops for CPU buffers). Call after editing the host
  // side of an input buffer of a CUDA spec.
  void upload() {
    for (detail::Buffer* x : {&q, &kc, &vc, &bt, &lens, &ks, &vs, &alibi, &sinks}) x->upload();
  }
  // Device -> host copies of the outputs (no-ops for CPU buffers).
  void download() {
    o.download();
    lse.download();
  }

  // Cache element of (sequence b, token t, kv head h, dim 0) for rows of `dim` elements.
  int64_t elem(int64_t b, int64_t t, int64_t h, int64_t dim) const {
    const int64_t page = c.page_size > 0 ? table[static_cast<size_t>(b * width + t / ps)] : b;
    return ((page * ps + t % ps) * c.hkv + h) * dim;
  }
  int64_t slot(int64_t b, int64_t t) const {
    const int64_t page = c.page_size > 0 ? table[static_cast<size_t>(b * width + t / ps)] : b;
    return page * ps + t % ps;
  }

  // Stores x (quantised for 8-bit) and returns the value a reader sees.
  float put(detail::Buffer& buf, int64_t idx, float x, float scale) {
    if (detail::is_8bit(c.cache)) {
      const uint8_t code = quantise(c.cache, x, scale);
      static_cast<uint8_t*>(buf.host())[idx] = code;
      return dequantise(c.cache, code, scale);
    }
    buf.set(idx, x);
    return buf.get(idx);
  }

  // Every cache byte poisoned: NaN (f32/f16/bf16), the f8 NaN code, or i8 -128.
  void clear_cache() {
    for (detail::Buffer* b : {&kc, &vc}) {
      if (c.cache == DType::f8e4m3)
        std::memset(b->host(), detail::kE4m3NaN, b->bytes());
      else if (c.cache == DType::i8)
        std::memset(b->host(), 0x80, b->bytes());
      else
        b->poison();
      b->upload();
    }
  }

  KernelChoice run(int splits = -1, const Context& ctx = {}) {
    o.poison();
    lse.poison();
    DecodeOptions opt;
    opt.num_splits = splits < 0 ? c.splits : splits;
    const KernelChoice k = decode(qv, cache, ov, lv, prm, opt, ctx);
    download();
    return k;
  }

  float o_at(int64_t b, int64_t i, int64_t h, int64_t x) const {
    return o.get(((b * c.sq + i) * c.hq + h) * (c.DV() + c.pad_head) + x);
  }
  float lse_at(int64_t b, int64_t h, int64_t i) const { return lse.get((b * c.hq + h) * c.sq + i); }

  // Logical outputs, [B, sq, hq, dv] and [B, hq, sq].
  std::vector<float> outputs() const {
    std::vector<float> r;
    for (int64_t b = 0; b < c.B(); ++b)
      for (int64_t i = 0; i < c.sq; ++i)
        for (int64_t h = 0; h < c.hq; ++h)
          for (int64_t x = 0; x < c.DV(); ++x) r.push_back(o_at(b, i, h, x));
    for (int64_t i = 0; i < lse.count(); ++i) r.push_back(lse.get(i));
    return r;
  }
};

// The float64 reference for sequence b: forward over its rows and its len keys.
inline detail::RefResult reference(const Built& bl, int64_t b, const std::vector<std::vector<float>>& k,
                            const std::vector<std::vector<float>>& v) {
  const Spec& c = bl.c;
  const int64_t L = c.lens[static_cast<size_t>(b)];
  std::vector<float> qb(bl.val.q.begin() + static_cast<std::ptrdiff_t>(b * c.sq * c.hq * c.d),
                        bl.val.q.begin() + static_cast<std::ptrdiff_t>((b + 1) * c.sq * c.hq * c.d));
  std::vector<float> ob(static_cast<size_t>(c.sq * c.hq * c.DV())), lb(static_cast<size_t>(c.hq * c.sq));
  const TensorView qv = TensorView::contiguous(qb.data(), DType::f32, {1, c.sq, c.hq, c.d});
  const TensorView kv = TensorView::contiguous(k[static_cast<size_t>(b)].data(), DType::f32, {1, L, c.hkv, c.d});
  const TensorView vv = TensorView::contiguous(v[static_cast<size_t>(b)].data(), DType::f32, {1, L, c.hkv, c.DV()});
  const TensorView ov = TensorView::contiguous(ob.data(), DType::f32, {1, c.sq, c.hq, c.DV()});
  const TensorView lv = TensorView::contiguous(lb.data(), DType::f32, {1, c.hq, c.sq});
  // bl.prm's ALiBi slopes / sinks live on the spec's device; the reference runs on the host.
  AttnParams prm = bl.prm;
  std::vector<float> alibi = bl.val.alibi, sinks = bl.val.sinks;
  if (prm.alibi_slopes.defined()) prm.alibi_slopes = TensorView::contiguous(alibi.data(), DType::f32, {c.hq});
  if (prm.sinks.defined()) prm.sinks = TensorView::contiguous(sinks.data(), DType::f32, {c.hq});
  detail::Validated val = detail::validate(qv, kv, vv, ov, lv, nullptr, prm, Context{});
  return detail::reference_forward(val.p, detail::RefPrecision::f64);
}

// O tolerance: fp32 accumulation error plus the rounding of O to its dtype (half an ulp).
inline double o_tol(DType t, double want) {
  const double rel = t == DType::bf16 ? std::ldexp(1.0, -8) : t == DType::f16 ? std::ldexp(1.0, -10) : 1e-6;
  return 2e-6 + rel * std::fabs(want);
}
inline double lse_tol(double want) { return 4e-6 + 1e-6 * std::fabs(want); }

inline bool close(double got, double want, double tol) {
  if (std::isinf(want) && want < 0) return std::isinf(got) && got < 0;
  return std::fabs(got - want) <= tol;  // false for NaN
}

// The tensor-core forwards' own roundings on top of the decode tolerance (expect_matches_reference's
// extra_o / extra_lse): P is rounded to q's dtype before P V (the decode kernels keep ~16 bits),
// which moves O by at most u * max |V| (unit roundoff u = 2^-8 bf16, 2^-11 f16); and on the GPU a
// softcap goes through tanh.approx (relative error <= 2^-11: approx_tanh), which moves each score
// by <= softcap * 2^-11, so LSE by as much and O by twice that times max |V|. The checks allow
// twice each bound. (The CUDA forwards, and the CPU forward's AMX-BF16 products.)
struct ForwardTol {
  double o = 0, lse = 0;
  std::function<double(int64_t, int64_t, int64_t)> extra_o() const {
    return [t = o](int64_t, int64_t, int64_t) { return t; };
  }
  std::function<double(int64_t, int64_t, int64_t)> extra_lse() const {
    return [t = lse](int64_t, int64_t, int64_t) { return t; };
  }
};
inline ForwardTol forward_tol(const Built& bl, bool approx_tanh = true) {
  double vmax = 0;
  for (const auto& seq : bl.vdeq)
    for (float x : seq)
      if (std::isfinite(x)) vmax = std::max(vmax, static_cast<double>(std::fabs(x)));
  ForwardTol t;
  const double cap = approx_tanh ? bl.c.softcap * std::ldexp(1.0, -11) : 0.0;
  t.lse = 2 * cap;
  t.o = 2 * (std::ldexp(1.0, bl.c.dtype == DType::bf16 ? -8 : -11) + 2 * cap) * vmax;
  return t;
}

// Decode output vs the float64 reference on the values the kernel sees; extra_o / extra_lse
// widen the tolerance per (b, h, i) row (8-bit vs unquantised values).
// `out` holds the outputs when they are not in bl (default: bl's own).
inline void expect_matches_reference(const Built& bl, const std::string& what, bool use_original = false,
                              const std::function<double(int64_t, int64_t, int64_t)>& extra_o = nullptr,
                              const std::function<double(int64_t, int64_t, int64_t)>& extra_lse = nullptr,
                              const Built* out = nullptr) {
  const Spec& c = bl.c;
  const Built& res = out ? *out : bl;
  int64_t bad = 0;
  std::ostringstream first;
  double worst_o = 0, worst_lse = 0;
  for (int64_t b = 0; b < c.B(); ++b) {
    const auto ref = use_original ? reference(bl, b, bl.val.k, bl.val.v) : reference(bl, b, bl.kdeq, bl.vdeq);
    for (int64_t i = 0; i < c.sq; ++i)
      for (int64_t h = 0; h < c.hq; ++h) {
        const double xo = extra_o ? extra_o(b, h, i) : 0.0, xl = extra_lse ? extra_lse(b, h, i) : 0.0;
        for (int64_t x = 0; x < c.DV(); ++x) {
          const double want = ref.o[static_cast<size_t>((i * c.hq + h) * c.DV() + x)], got = res.o_at(b, i, h, x);
          worst_o = std::max(worst_o, std::fabs(got - want));
          if (!close(got, want, o_tol(c.dtype, want) * c.tol_mul + xo) && bad++ == 0)
            first << "O[b" << b << " i" << i << " h" << h << " x" << x << "] = " << got << ", want " << want;
        }
        const double want = ref.lse[static_cast<size_t>(h * c.sq + i)], got = res.lse_at(b, h, i);
        if (std::isfinite(want)) worst_lse = std::max(worst_lse, std::fabs(got - want));
        if (!close(got, want, lse_tol(want) * c.tol_mul + xl) && bad++ == 0)
          first << "LSE[b" << b << " h" << h << " i" << i << "] = " << got << ", want " << want;
      }
  }
  if (std::getenv("IOATTN_TEST_VERBOSE"))
    std::printf("  %-28s max |dO| %.3g  max |dLSE| %.3g\n", what.c_str(), worst_o, worst_lse);
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements off; first: " << first.str() << " (max |dO| " << worst_o
                    << ", max |dLSE| " << worst_lse << ")";
  if (c.pad_head > 0) {
    int64_t written = 0;
    for (int64_t row = 0; row < c.B() * c.sq * c.hq; ++row)
      for (int64_t x = c.DV(); x < c.DV() + c.pad_head; ++x) written += !std::isnan(res.o.get(row * (c.DV() + c.pad_head) + x));
    EXPECT_EQ(written, 0) << what << ": elements outside o's view were written";
  }
}

// Max |a - b| over two output vectors (NaN anywhere = inf).
// The masked-bad-token cases (CPU and CUDA decode tests): 4 causal query rows over 100 tokens
// (page size 16) whose last token is bad, so only the last row can see it.
inline Spec masked_bad_token_spec(Spec c) {
  c.sq = 4;
  c.causal = true;
  c.lens = {100};
  c.page_size = 16;
  return c;
}

// An f32 cache's last token: NaN in every K row, inf in every V row.
inline void poison_last_token_f32(Built& bl) {
  const Spec& c = bl.c;
  for (int64_t h = 0; h < c.hkv; ++h) {
    for (int64_t x = 0; x < c.d; ++x) bl.kc.set(bl.elem(0, 99, h, c.d) + x, kNaN);
    for (int64_t x = 0; x < c.DV(); ++x) bl.vc.set(bl.elem(0, 99, h, c.DV()) + x, kInf);
  }
}

// Only the last row sees the bad token (NaN LSE, non-finite O); the others stay finite.
inline void expect_only_last_row_sees_bad_token(const Built& bl) {
  const Spec& c = bl.c;
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t h = 0; h < c.hq; ++h) {
      const bool sees = i == 3;
      EXPECT_EQ(std::isnan(bl.lse_at(0, h, i)), sees) << "row " << i << " lse " << bl.lse_at(0, h, i);
      for (int64_t x = 0; x < c.DV(); ++x)
        ASSERT_EQ(std::isfinite(bl.o_at(0, i, h, x)), !sees) << "row " << i << " x " << x;
    }
}

inline double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) && std::isinf(b[i]) && (a[i] < 0) == (b[i] < 0)) continue;
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (!(d == d)) return kInf;
    m = std::max(m, d);
  }
  return m;
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- decode vs the float64 reference --------------------------------------------------------

inline std::vector<Spec> reference_cases() {
  std::vector<Spec> v;
  for (DType t : {DType::f32, DType::bf16}) {
    const std::string ts = dtype_name(t);
    { Spec c = mk("contiguous_" + ts, t); v.push_back(c); }
    { Spec c = mk("paged16_ragged_" + ts, t); c.lens = {0, 1, 17, 300, 1000}; c.page_size = 16; c.hq = 8; c.d = 128; v.push_back(c); }
    { Spec c = mk("page1_" + ts, t); c.lens = {5, 40}; c.page_size = 1; v.push_back(c); }
    { Spec c = mk("page256_" + ts, t); c.lens = {700, 3, 256}; c.page_size = 256; v.push_back(c); }
    { Spec c = mk("gqa32_8_" + ts, t); c.hq = 32; c.hkv = 8; c.d = 128; c.lens = {513, 2048}; c.page_size = 16; v.push_back(c); }
    { Spec c = mk("causal_sq4_" + ts, t); c.sq = 4; c.causal = true; c.lens = {4, 9, 300}; c.hq = 8; c.page_size = 16; v.push_back(c); }
    { Spec c = mk("causal_sq16_mqa_" + ts, t); c.sq = 16; c.causal = true; c.lens = {16, 100}; c.hq = 8; c.hkv = 1; v.push_back(c); }
    { Spec c = mk("window_causal_" + ts, t); c.sq = 4; c.causal = true; c.wl = 50; c.lens = {400, 4, 0}; c.page_size = 16; v.push_back(c); }
    { Spec c = mk("window_both_" + ts, t); c.sq = 3; c.wl = 20; c.wr = 3; c.lens = {200, 70}; c.splits = 3; v.push_back(c); }
    { Spec c = mk("softcap_" + ts, t); c.softcap = 5.0f; c.q_range = 3.0f; c.lens = {90, 33}; c.page_size = 16; v.push_back(c); }
    { Spec c = mk("alibi_causal_" + ts, t); c.alibi = true; c.causal = true; c.sq = 2; c.lens = {150, 2}; v.push_back(c); }
    { Spec c = mk("sinks_" + ts, t); c.sinks = true; c.causal = true; c.sq = 2; c.lens = {0, 2, 64, 500}; c.page_size = 16; c.splits = 5; v.push_back(c); }
    { Spec c = mk("hdim72_dv40_" + ts, t); c.d = 72; c.dv = 40; c.lens = {33, 129}; c.page_size = 8; v.push_back(c); }
    // d = 88 = 2 x 32 + 16 + 8 (Q.K^T: whole 32-element steps, a 16-element vector, a tail) and
    // dv = 136 = 2 x 64 + 8 (P.V: whole 64-column tiles and a tail) on AVX-512.
    { Spec c = mk("hdim88_dv136_" + ts, t); c.d = 88; c.dv = 136; c.lens = {70, 1}; c.page_size = 16; v.push_back(c); }
    { Spec c = mk("splits7_" + ts, t); c.lens = {1000, 3, 0, 1}; c.splits = 7; c.page_size = 16; v.push_back(c); }
    { Spec c = mk("f8e4m3_" + ts, t); c.cache = DType::f8e4m3; c.lens = {300, 17}; c.page_size = 16; c.hq = 8; v.push_back(c); }
    { Spec c = mk("i8_" + ts, t); c.cache = DType::i8; c.lens = {300, 0, 5}; c.sq = 2; c.causal = true; v.push_back(c); }
    { Spec c = mk("padded_heads_" + ts, t); c.pad_head = 8; c.lens = {77, 20}; c.page_size = 16; v.push_back(c); }
    { Spec c = mk("scale_custom_" + ts, t); c.scale = 0.3f; c.lens = {50}; v.push_back(c); }
  }
  { Spec c = mk("hdim256_f32", DType::f32); c.d = 256; c.lens = {300}; c.splits = 2; v.push_back(c); }
  { Spec c = mk("hdim8_f16", DType::f16); c.d = 8; c.lens = {45, 1}; c.page_size = 4; v.push_back(c); }
  { Spec c = mk("f8e4m3_f16_sq8", DType::f16); c.cache = DType::f8e4m3; c.sq = 8; c.causal = true; c.lens = {64, 8}; v.push_back(c); }
  return v;
}


// A seeded random decode problem (1-16 query rows) mixing what reference_cases() tests one or two at
// a time: page sizes 1 / 3 / 16 / 64 / 256 or contiguous, ragged lengths with 0 and 1, GQA up to
// 8:1, 8-bit caches, masks, softcap, ALiBi, sinks, split counts, padded heads. The name spells out
// every parameter. cuda: head dims that are multiples of 8 up to 256, and K / V rows of a multiple
// of 16 bytes (the CUDA kernels' 16-byte copies; their refusal is tested on its own).
inline Spec random_spec(uint64_t seed, bool cuda = false) {
  SeededPicks r(0x51ed270b27a5f00dull, seed);
  static const DType kTypes[] = {DType::f32, DType::f16, DType::bf16};
  Spec c = mk("", kTypes[r.pick(3)]);
  if (r.chance(25)) c.cache = DType::f8e4m3;
  else if (r.chance(20)) c.cache = DType::i8;
  static const int64_t kDims[] = {8, 16, 32, 64, 72, 96, 128, 160, 256};
  static const int64_t kOddDims[] = {1, 5, 33, 100, 130};
  c.d = !cuda && r.chance(15) ? kOddDims[r.pick(5)] : kDims[r.pick(9)];
  if (r.chance(20)) c.dv = kDims[r.pick(9)];
  if (cuda && (c.d * dtype_size(c.cache) % 16 != 0 || c.DV() * dtype_size(c.cache) % 16 != 0)) c.cache = c.dtype;
  c.hkv = 1 + r.pick(4);
  static const int64_t kRatios[] = {1, 2, 4, 8};
  c.hq = c.hkv * kRatios[r.pick(4)];
  c.sq = r.chance(40) ? 1 : 1 + r.pick(16);
  c.lens.clear();
  const int64_t batch = 1 + r.pick(5);
  for (int64_t b = 0; b < batch; ++b) {  // 0, or at least sq tokens
    const int64_t len = r.chance(15) ? 0 : r.chance(10) ? c.sq : c.sq + r.pick(700);
    c.lens.push_back(static_cast<int32_t>(len));
  }
  static const int64_t kPages[] = {0, 0, 1, 3, 16, 64, 256};
  c.page_size = kPages[r.pick(7)];
  c.causal = r.chance(40);
  if (r.chance(25)) {
    c.wl = r.chance(30) ? -1 : r.pick(100);
    c.wr = r.chance(40) ? -1 : r.pick(10);
  }
  if (r.chance(20)) c.softcap = static_cast<float>(2 + r.pick(30));
  c.alibi = r.chance(20);
  c.sinks = r.chance(20);
  static const int kSplits[] = {0, 0, 1, 2, 3, 5, 7};
  c.splits = kSplits[r.pick(7)];
  c.pad_head = r.chance(15) ? 8 : 0;
  c.q_range = c.softcap > 0 || r.chance(15) ? 3.0f : 1.0f;
  if (r.chance(10)) c.scale = 0.05f + static_cast<float>(r.pick(100)) / 100.0f;

  std::string n = "seed" + std::to_string(seed) + "_" + dtype_name(c.dtype);
  if (c.cache != c.dtype) n += std::string("_") + dtype_name(c.cache) + "cache";
  n += "_sq" + std::to_string(c.sq) + "_lens";
  for (int32_t L : c.lens) n += "_" + std::to_string(L);
  n += (c.page_size ? "_page" + std::to_string(c.page_size) : std::string("_contiguous")) + "_h" + std::to_string(c.hq) +
       "x" + std::to_string(c.hkv) + "_d" + std::to_string(c.d);
  if (c.dv >= 0) n += "_dv" + std::to_string(c.dv);
  if (c.causal) n += "_causal";
  if (c.wl >= 0 || c.wr >= 0) n += "_window" + std::to_string(c.wl) + "_" + std::to_string(c.wr);
  if (c.softcap > 0) n += "_softcap" + std::to_string(static_cast<int>(c.softcap));
  if (c.alibi) n += "_alibi";
  if (c.sinks) n += "_sinks";
  if (c.splits) n += "_splits" + std::to_string(c.splits);
  if (c.pad_head) n += "_padheads";
  if (c.q_range != 1.0f) n += "_range3";
  if (c.scale > 0) n += scale_tag(c.scale);
  c.name = n;
  return c;
}

// ---- more than 16 query rows (a prefill chunk against the cache) ----------------------------

// The cases both backends run (CUDA: those with an f16 / bf16 q and head_dim == head_dim_v): block
// tables of page sizes 1 / 16 / 256, contiguous, ragged and empty sequences, GQA / MQA, masks,
// softcap, ALiBi, sinks, 8-bit caches with a bf16 / f16 q; checked against the float64 reference
// and with the fused append of the chunk itself.
inline std::vector<Spec> cache_prefill_cases() {
  std::vector<Spec> v;
  for (DType t : {DType::f32, DType::bf16}) {
    const std::string ts = dtype_name(t);
    { Spec c = mk("prefill_contiguous_" + ts, t); c.sq = 40; c.lens = {40, 100, 0}; v.push_back(c); }
    { Spec c = mk("prefill_paged16_causal_gqa4_" + ts, t); c.sq = 100; c.causal = true; c.hq = 8; c.hkv = 2; c.d = 128;
      c.lens = {300, 100, 0, 1000}; c.page_size = 16; v.push_back(c); }
    { Spec c = mk("prefill_page1_window_" + ts, t); c.sq = 33; c.causal = true; c.wl = 20; c.lens = {33, 70};
      c.page_size = 1; v.push_back(c); }
    { Spec c = mk("prefill_page256_mqa_" + ts, t); c.sq = 17; c.hq = 8; c.hkv = 1; c.lens = {700, 17, 256};
      c.page_size = 256; v.push_back(c); }
    { Spec c = mk("prefill_softcap_alibi_sinks_" + ts, t); c.sq = 24; c.causal = true; c.softcap = 5.0f; c.alibi = true;
      c.sinks = true; c.lens = {24, 90}; c.page_size = 16; v.push_back(c); }
  }
  { Spec c = mk("prefill_f8e4m3_bf16", DType::bf16); c.cache = DType::f8e4m3; c.sq = 48; c.causal = true;
    c.lens = {300, 48}; c.page_size = 16; c.hq = 8; v.push_back(c); }
  { Spec c = mk("prefill_i8_f16", DType::f16); c.cache = DType::i8; c.sq = 20; c.lens = {64, 0, 20}; v.push_back(c); }
  // bf16 q over 8-bit caches past one 128-key block, with windows (the CPU's AMX path stages the
  // codes as bf16 and folds the scales into the score scale and O's normaliser)
  { Spec c = mk("prefill_i8_bf16_d128_window", DType::bf16); c.cache = DType::i8; c.d = 128; c.sq = 70; c.causal = true;
    c.wl = 150; c.lens = {400, 70}; c.page_size = 16; c.hq = 4; v.push_back(c); }
  { Spec c = mk("prefill_f8e4m3_bf16_d128_long", DType::bf16); c.cache = DType::f8e4m3; c.d = 128; c.sq = 130;
    c.lens = {600, 130}; c.hq = 4; c.hkv = 2; v.push_back(c); }
  // head_dim 80 = 2 x 32 + 16 (the AMX path's zero-padded rows) over e4m3 codes, paged
  { Spec c = mk("prefill_f8e4m3_bf16_d80", DType::bf16); c.cache = DType::f8e4m3; c.d = 80; c.sq = 90; c.causal = true;
    c.lens = {350, 90}; c.page_size = 16; c.hq = 4; c.hkv = 2; v.push_back(c); }
  { Spec c = mk("prefill_hdim72_dv40_f32", DType::f32); c.d = 72; c.dv = 40; c.sq = 30; c.causal = true;
    c.lens = {45, 129}; c.page_size = 8; v.push_back(c); }
  return v;
}

// ---- append_kv helpers -----------------------------------------------------------------------

// k_new / v_new for every live token of bl (in shuffled order, with padding tokens), and the
// slot mapping.
struct NewTokens {
  std::vector<float> k, v;
  std::vector<int32_t> slots;
  int64_t T = 0;
};

inline NewTokens all_tokens(const Built& bl, uint64_t seed, int padding) {
  const Spec& c = bl.c;
  std::vector<std::pair<int64_t, int64_t>> order;
  for (int64_t b = 0; b < c.B(); ++b)
    for (int64_t t = 0; t < c.lens[static_cast<size_t>(b)]; ++t) order.emplace_back(b, t);
  for (int i = 0; i < padding; ++i) order.emplace_back(-1, -1);
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  NewTokens n;
  n.T = static_cast<int64_t>(order.size());
  for (const auto& [b, t] : order) {
    for (int64_t x = 0; x < c.hkv * c.d; ++x)
      n.k.push_back(b < 0 ? kNaN : bl.val.k[static_cast<size_t>(b)][static_cast<size_t>(t * c.hkv * c.d + x)]);
    for (int64_t x = 0; x < c.hkv * c.DV(); ++x)
      n.v.push_back(b < 0 ? kNaN : bl.val.v[static_cast<size_t>(b)][static_cast<size_t>(t * c.hkv * c.DV() + x)]);
    n.slots.push_back(b < 0 ? -1 - static_cast<int32_t>(n.slots.size()) : static_cast<int32_t>(bl.slot(b, t)));
  }
  return n;
}

inline std::vector<uint8_t> bytes_of(const detail::Buffer& b) {
  const auto* p = static_cast<const uint8_t*>(b.host());
  return std::vector<uint8_t>(p, p + b.bytes());
}

// ---- decode's fused append (KVCache::k_new / v_new) ------------------------------------------

// k_new / v_new [B, n, hkv, d|dv] in q's dtype on the spec's device for a fused append: the last n
// tokens of every sequence (NaN for sequences shorter than n: they must not be written).
struct FusedNew {
  detail::Buffer k, v;
  FusedNew(const Built& bl, int64_t n)
      : k(bl.c.dtype, bl.c.B() * n * bl.c.hkv * bl.c.d, bl.c.device),
        v(bl.c.dtype, bl.c.B() * n * bl.c.hkv * bl.c.DV(), bl.c.device) {
    const Spec& c = bl.c;
    k.poison();
    v.poison();
    for (int64_t b = 0; b < c.B(); ++b) {
      const int64_t L = c.lens[static_cast<size_t>(b)];
      if (L < n) continue;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = L - n + i;
        for (int64_t x = 0; x < c.hkv * c.d; ++x)
          k.set((b * n + i) * c.hkv * c.d + x,
                bl.val.k[static_cast<size_t>(b)][static_cast<size_t>(t * c.hkv * c.d + x)]);
        for (int64_t x = 0; x < c.hkv * c.DV(); ++x)
          v.set((b * n + i) * c.hkv * c.DV() + x,
                bl.val.v[static_cast<size_t>(b)][static_cast<size_t>(t * c.hkv * c.DV() + x)]);
      }
    }
    k.upload();
    v.upload();
  }
};

// Poisons (as clear_cache) the cache rows of the last n tokens of every sequence of bl.
inline void poison_last_tokens(Built& bl, int64_t n) {
  const Spec& c = bl.c;
  for (detail::Buffer* buf : {&bl.kc, &bl.vc}) {
    const int64_t dim = buf == &bl.kc ? c.d : c.DV();
    for (int64_t b = 0; b < c.B(); ++b) {
      const int64_t L = c.lens[static_cast<size_t>(b)];
      for (int64_t t = std::max<int64_t>(0, L - n); t < L; ++t)
        for (int64_t h = 0; h < c.hkv; ++h)
          for (int64_t x = 0; x < dim; ++x) {
            const int64_t idx = bl.elem(b, t, h, dim) + x;
            if (c.cache == DType::f8e4m3)
              static_cast<uint8_t*>(buf->host())[idx] = detail::kE4m3NaN;
            else if (c.cache == DType::i8)
              static_cast<uint8_t*>(buf->host())[idx] = 0x80;
            else
              buf->set(idx, kNaN);
          }
    }
    buf->upload();
  }
}

// decode with k_new / v_new (the last n tokens of each sequence, poisoned in the cache first)
// against decode over the cache that already holds them: the same cache bytes afterwards and
// bitwise the same O / LSE (the append is append_kv's per-element encoding; the decode is the
// same call), plus the float64 reference. Sequences of length 0 append nothing.
inline void expect_fused_append_equals_direct(const Spec& c, int64_t n, int splits, const std::string& what,
                                              const std::function<double(int64_t, int64_t, int64_t)>& extra_o = nullptr,
                                              const std::function<double(int64_t, int64_t, int64_t)>& extra_lse = nullptr) {
  const Values vals = make_values(c, 21);
  Built direct(c, vals), fused(c, vals);
  poison_last_tokens(fused, n);
  FusedNew nw(fused, n);
  fused.cache.k_new = nw.k.view({c.B(), n, c.hkv, c.d});
  fused.cache.v_new = nw.v.view({c.B(), n, c.hkv, c.DV()});
  const KernelChoice k = fused.run(splits);
  EXPECT_NE(k.kernel.find(" +append" + std::to_string(n)), std::string::npos) << what << ": " << k.kernel;
  EXPECT_NE(k.reason.find("fused append"), std::string::npos) << what << ": " << k.reason;
  fused.kc.download();
  fused.vc.download();
  EXPECT_TRUE(bytes_of(fused.kc) == bytes_of(direct.kc)) << what << ": k cache bytes differ";
  EXPECT_TRUE(bytes_of(fused.vc) == bytes_of(direct.vc)) << what << ": v cache bytes differ";
  direct.run(splits);
  EXPECT_TRUE(bitwise_equal(direct.outputs(), fused.outputs()))
      << what << ": max diff " << max_diff(direct.outputs(), fused.outputs());
  expect_matches_reference(fused, what, false, extra_o, extra_lse);
}

// The (q dtype, cache dtype, page size) combinations the fused-append tests walk.
struct FusedCombo {
  DType q, cache;
  int64_t page_size;
};
inline std::vector<FusedCombo> fused_combos() {
  return {{DType::f32, DType::f32, 16},  {DType::bf16, DType::bf16, 16},   {DType::bf16, DType::bf16, 0},
          {DType::f16, DType::f16, 1},   {DType::bf16, DType::f8e4m3, 16}, {DType::f32, DType::i8, 0},
          {DType::f16, DType::i8, 64}};
}

// The sweep both backends run: every fused_combos() entry with 1 or 2 new tokens (split 3 ways,
// and unsplit), causal, GQA hq / 2, a sequence of length 0 in the batch; `place` puts the spec on
// the backend's device.
inline void fused_append_sweep(const std::function<Spec(Spec)>& place, int64_t hq) {
  for (const FusedCombo& cb : fused_combos())
    for (int64_t n : {1, 2}) {
      Spec c = place(mk("fused", cb.q));
      c.cache = cb.cache;
      c.hq = hq;
      c.hkv = 2;
      c.sq = 2;
      c.causal = true;
      c.lens = {100, 0, 33, 2};
      c.page_size = cb.page_size;
      const std::string what = std::string(dtype_name(cb.q)) + "->" + dtype_name(cb.cache) + " page" +
                               std::to_string(cb.page_size) + " new " + std::to_string(n);
      expect_fused_append_equals_direct(c, n, n == 1 ? 3 : 1, what);
    }
}


}  // namespace ioattn::test

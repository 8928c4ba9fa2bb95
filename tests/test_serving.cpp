// Serving API on the CPU: decode (split-KV over a paged or contiguous cache, 8-bit KV), plans,
// append_kv and merge_states, against the float64 reference and against each other. The problem
// builder, the reference and the tolerance check live in serving_common.hpp (shared with
// test_cuda_serving.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/serving_problem.hpp"
#include "cpu/serving_quant.h"
#include "ioattn/serving.hpp"
#include "serving_common.hpp"

namespace ioattn::test {
namespace {

class DecodeReference : public ::testing::TestWithParam<Spec> {};

TEST_P(DecodeReference, MatchesFloat64Reference) {
  const Spec& c = GetParam();
  Built bl(c, make_values(c, 42));
  const KernelChoice k = bl.run();
  EXPECT_NE(k.kernel.find("cpu/splitkv"), std::string::npos) << k.kernel;
  expect_matches_reference(bl, c.name);
}

INSTANTIATE_TEST_SUITE_P(Cases, DecodeReference, ::testing::ValuesIn(reference_cases()),
                         [](const ::testing::TestParamInfo<Spec>& info) { return info.param.name; });

// Seeded random mixes (serving_common.hpp random_spec).
class DecodeFuzz : public ::testing::TestWithParam<int> {};

TEST_P(DecodeFuzz, MatchesFloat64Reference) {
  const Spec c = random_spec(static_cast<uint64_t>(GetParam()));
  Built bl(c, make_values(c, 100 + static_cast<uint64_t>(GetParam())));
  const KernelChoice k = bl.run();
  EXPECT_NE(k.kernel.find("cpu/splitkv"), std::string::npos) << k.kernel;
  expect_matches_reference(bl, c.name);
}

INSTANTIATE_TEST_SUITE_P(Seeds, DecodeFuzz, ::testing::Range(0, 48),
                         [](const ::testing::TestParamInfo<int>& info) { return "seed" + std::to_string(info.param); });

// ---- decode vs itself -----------------------------------------------------------------------

TEST(DecodeSplits, SplitMatchesUnsplitWithinFp32Rounding) {
  for (DType t : {DType::f32, DType::bf16}) {
    Spec c = mk("splits", t);
    c.hq = 32;
    c.hkv = 8;
    c.d = 128;
    c.sq = 4;
    c.causal = true;
    c.lens = {0, 4, 17, 2000, 777};
    c.page_size = 16;
    c.sinks = true;
    Built bl(c, make_values(c, 3));
    bl.run(1);
    const auto one = bl.outputs();
    for (int s : {7, 3, 0}) {
      bl.run(s);
      const auto many = bl.outputs();
      // f32: accumulation-order differences only; bf16: plus one bf16 rounding step of O.
      EXPECT_LE(max_diff(one, many), t == DType::f32 ? 2e-6 : 8e-3) << dtype_name(t) << " splits " << s;
    }
    expect_matches_reference(bl, std::string("heuristic splits ") + dtype_name(t));
  }
}

TEST(DecodePaged, PagedEqualsContiguousBitwise) {
  for (DType t : {DType::f32, DType::bf16}) {
    Spec c = mk("paged", t);
    c.hq = 8;
    c.hkv = 2;
    c.sq = 2;
    c.causal = true;
    c.lens = {513, 2, 0, 64, 257};
    const Values vals = make_values(c, 11);
    for (int splits : {1, 3}) {
      Spec cc = c;
      Built contiguous(cc, vals);
      contiguous.run(splits);
      const auto want = contiguous.outputs();
      for (int64_t ps : {1, 16, 256}) {
        Spec pc = c;
        pc.page_size = ps;
        Built paged(pc, vals, /*layout_seed=*/static_cast<uint64_t>(ps));
        const KernelChoice k = paged.run(splits);
        EXPECT_NE(k.kernel.find("page" + std::to_string(ps)), std::string::npos) << k.kernel;
        EXPECT_TRUE(bitwise_equal(paged.outputs(), want))
            << dtype_name(t) << " page_size " << ps << " splits " << splits << ": max diff "
            << max_diff(paged.outputs(), want);
      }
    }
  }
}

TEST(DecodeBatch, BatchEqualsSingleSequenceBitwise) {
  Spec c = mk("batch", DType::bf16);
  c.hq = 8;
  c.hkv = 4;
  c.sq = 3;
  c.causal = true;
  c.lens = {1000, 3, 0, 47};
  c.page_size = 16;
  const Values vals = make_values(c, 5);
  Built all(c, vals);
  all.run(4);
  for (int64_t b = 0; b < c.B(); ++b) {
    Spec one = c;
    one.lens = {c.lens[static_cast<size_t>(b)]};
    Built single(one, slice(c, vals, b), 99 + static_cast<uint64_t>(b));
    single.run(4);
    for (int64_t i = 0; i < c.sq; ++i)
      for (int64_t h = 0; h < c.hq; ++h) {
        for (int64_t x = 0; x < c.DV(); ++x) {
          const float a = all.o_at(b, i, h, x), s = single.o_at(0, i, h, x);
          ASSERT_EQ(std::memcmp(&a, &s, 4), 0) << "b" << b << " i" << i << " h" << h << " x" << x << ": " << a << " vs " << s;
        }
        const float a = all.lse_at(b, h, i), s = single.lse_at(0, h, i);
        ASSERT_EQ(std::memcmp(&a, &s, 4), 0) << "lse b" << b << " h" << h << " i" << i;
      }
  }
}

// cache_seqlens 0: O = 0 and LSE = -inf (with a sink: LSE = sink); 1: O = that token's V.
TEST(DecodeEdge, EmptyAndSingleTokenSequences) {
  for (bool sinks : {false, true})
    for (DType t : {DType::f32, DType::bf16})
      for (int splits : {1, 4}) {
        Spec c = mk("edge", t);
        c.lens = {0, 1, 0, 1};
        c.sinks = sinks;
        c.page_size = 16;
        Built bl(c, make_values(c, 8));
        bl.run(splits);
        for (int64_t b = 0; b < c.B(); ++b)
          for (int64_t h = 0; h < c.hq; ++h) {
            const int64_t hk = h / (c.hq / c.hkv);
            const float sink = bl.val.sinks[static_cast<size_t>(h)];
            if (c.lens[static_cast<size_t>(b)] == 0) {
              for (int64_t x = 0; x < c.DV(); ++x) ASSERT_EQ(bl.o_at(b, 0, h, x), 0.0f) << "b" << b;
              const float l = bl.lse_at(b, h, 0);
              if (sinks)
                EXPECT_EQ(l, sink);
              else
                EXPECT_TRUE(std::isinf(l) && l < 0) << l;
            } else if (!sinks) {
              for (int64_t x = 0; x < c.DV(); ++x)
                ASSERT_EQ(bl.o_at(b, 0, h, x), bl.vdeq[static_cast<size_t>(b)][static_cast<size_t>(hk * c.DV() + x)])
                    << "b" << b << " x" << x;
            }
          }
        expect_matches_reference(bl, std::string("edge ") + dtype_name(t));
      }
}

// A NaN key and an inf value that the causal mask hides from rows 0..2 stay out of their output;
// row 3 sees them and is NaN (as in the forward).
TEST(DecodeEdge, MaskedNaNDoesNotLeak) {
  for (int splits : {1, 3}) {
    const Spec c = masked_bad_token_spec(mk("nan", DType::f32));
    Built bl(c, make_values(c, 2));
    poison_last_token_f32(bl);
    bl.run(splits);
    expect_only_last_row_sees_bad_token(bl);
  }
}

// The same with an f8e4m3 cache: NaN codes in the last token's K and V rows (the AMX-BF16 path
// converts whole blocks of codes; masked rows must still not see them).
TEST(DecodeEdge, MaskedNaNCodeDoesNotLeakE4m3) {
  for (int splits : {1, 3}) {
    Spec c = mk("nan8", DType::f32);
    c.cache = DType::f8e4m3;
    c = masked_bad_token_spec(c);
    Built bl(c, make_values(c, 2));
    for (int64_t h = 0; h < c.hkv; ++h) {
      auto* kc = static_cast<uint8_t*>(bl.kc.host());
      auto* vc = static_cast<uint8_t*>(bl.vc.host());
      for (int64_t x = 0; x < c.d; ++x) kc[bl.elem(0, 99, h, c.d) + x] = x % 2 ? 0x7f : 0xff;  // the NaN codes
      for (int64_t x = 0; x < c.DV(); ++x) vc[bl.elem(0, 99, h, c.DV()) + x] = 0x7f;
    }
    bl.run(splits);
    expect_only_last_row_sees_bad_token(bl);
  }
}

// The same through the prefill path (40 query rows: the tiled flash forward over the cache, on a
// CPU with AMX-BF16 its tile products over codes staged as bf16): only the chunk's last row sees
// the NaN codes of token 99; every other row stays finite.
TEST(DecodeCachePrefill, MaskedNaNCodeDoesNotLeakE4m3) {
  Spec c = mk("nan8_prefill", DType::bf16);
  c.cache = DType::f8e4m3;
  c = masked_bad_token_spec(c);
  c.sq = 40;
  Built bl(c, make_values(c, 2));
  for (int64_t h = 0; h < c.hkv; ++h) {
    auto* kc = static_cast<uint8_t*>(bl.kc.host());
    auto* vc = static_cast<uint8_t*>(bl.vc.host());
    for (int64_t x = 0; x < c.d; ++x) kc[bl.elem(0, 99, h, c.d) + x] = x % 2 ? 0x7f : 0xff;
    for (int64_t x = 0; x < c.DV(); ++x) vc[bl.elem(0, 99, h, c.DV()) + x] = 0x7f;
  }
  const KernelChoice k = bl.run();
  EXPECT_NE(k.kernel.find("cpu/flash cache-prefill"), std::string::npos) << k.kernel;
  for (int64_t i = 0; i < c.sq; ++i)
    for (int64_t h = 0; h < c.hq; ++h) {
      const bool sees = i == c.sq - 1;
      EXPECT_EQ(std::isnan(bl.lse_at(0, h, i)), sees) << "row " << i << " lse " << bl.lse_at(0, h, i);
      for (int64_t x = 0; x < c.DV(); ++x)
        ASSERT_EQ(std::isfinite(bl.o_at(0, i, h, x)), !sees) << "row " << i << " x " << x;
    }
}

// ---- 8-bit KV ------------------------------------------------------------------------------

// Every e4m3 code through both passes, exactly: one cached token, scales 1, query row h one-hot
// at dim h. Then LSE_h = the score = e4m3(K[h]) (m + log 1) and O_h = V (P = 1), both exact in
// fp32, so any conversion error or element-order mistake (the table-lookup path converts 64 codes
// at a time through in-lane unpacks) shows up as an inequality. K holds no NaN code (a NaN
// anywhere in K makes every score NaN); V does, and only its column is NaN. d = 256 covers all
// 256 codes; d = 200 mixes 64-code blocks with a 16-code and an 8-code tail.
TEST(DecodeQuant, E4m3CodesExactThroughScoresAndPV) {
  for (int64_t d : {256, 200}) {
    Spec c = mk("e4m3codes", DType::f32);
    c.cache = DType::f8e4m3;
    c.hq = d;
    c.hkv = 1;
    c.d = d;
    c.lens = {1};
    c.scale = 1.0f;
    Built bl(c, make_values(c, 5));
    auto code_at = [&](int64_t x) { return static_cast<uint8_t>(d == 256 ? x : (7 * x + 3) & 255); };
    auto is_nan_code = [](uint8_t code) { return (code & 0x7f) == 0x7f; };
    auto* kc = static_cast<uint8_t*>(bl.kc.host());
    auto* vc = static_cast<uint8_t*>(bl.vc.host());
    for (int64_t x = 0; x < d; ++x) {
      kc[bl.elem(0, 0, 0, d) + x] = is_nan_code(code_at(x)) ? 0 : code_at(x);
      vc[bl.elem(0, 0, 0, d) + x] = code_at(x);
    }
    for (int64_t h = 0; h < d; ++h)
      for (int64_t x = 0; x < d; ++x) bl.q.set(h * d + x, x == h ? 1.0f : 0.0f);
    bl.ks.set(0, 1.0f);
    bl.vs.set(0, 1.0f);
    bl.upload();
    bl.run(1);
    int bad = 0;
    for (int64_t h = 0; h < d && bad < 8; ++h) {
      const uint8_t kcode = is_nan_code(code_at(h)) ? 0 : code_at(h);
      const float want_lse = detail::e4m3_to_float(kcode);
      if (!(bl.lse_at(0, h, 0) == want_lse)) {
        ++bad;
        ADD_FAILURE() << "d=" << d << " row " << h << ": LSE " << bl.lse_at(0, h, 0) << ", want e4m3(0x" << std::hex
                      << int{kcode} << std::dec << ") = " << want_lse;
      }
      for (int64_t x = 0; x < d && bad < 8; ++x) {
        const float got = bl.o_at(0, 0, h, x), want = detail::e4m3_to_float(code_at(x));
        if (is_nan_code(code_at(x)) ? !std::isnan(got) : !(got == want)) {
          ++bad;
          ADD_FAILURE() << "d=" << d << " row " << h << " dim " << x << ": O " << got << ", want " << want;
        }
      }
    }
  }
}

// The f8e4m3 score and P.V tiles convert without the NaN fix-up and watch the codes instead,
// redoing a tile exactly when one holds a NaN code. One NaN code at a time, in the rows' 64-code
// segments, vector-sized tails and scalar tails (head dims 8 ... 200, dv != d), in the first and
// the last (partial) key block: a NaN in K makes every row of that kv head that sees the key NaN
// (O and LSE); a NaN in V only their column. Everything else is bitwise the clean run (the redo
// computes the same sums). With 3 causal query rows only some rows of a tile see the last keys.
// tests/CMakeLists.txt runs the Decode suites under IOATTN_CPU_TARGET=avx2 / sse4 / scalar too.
TEST(DecodeQuant, E4m3NaNCodeAnywhereInARow) {
  struct Shape {
    int64_t d, dv, sq;
  };
  for (const Shape sh : {Shape{8, 8, 1}, Shape{12, 12, 1}, Shape{24, 24, 1}, Shape{64, 64, 1}, Shape{72, 100, 1},
                         Shape{80, 80, 1}, Shape{100, 24, 1}, Shape{112, 112, 1}, Shape{128, 128, 1},
                         Shape{200, 200, 1}, Shape{64, 64, 3}, Shape{96, 96, 3}}) {
    Spec c = mk("e4m3nan", DType::f32);
    c.cache = DType::f8e4m3;
    c.hq = 8;
    c.hkv = 2;
    c.d = sh.d;
    c.dv = sh.dv;
    c.sq = sh.sq;
    c.causal = sh.sq > 1;
    c.lens = {150};
    c.page_size = 16;
    const int64_t len = c.lens[0], d = c.d, dv = c.DV(), hq_per = c.hq / c.hkv;
    Built bl(c, make_values(c, 31));
    auto* kc = static_cast<uint8_t*>(bl.kc.host());
    auto* vc = static_cast<uint8_t*>(bl.vc.host());
    const size_t o_count = static_cast<size_t>(c.sq * c.hq * dv);
    for (int splits : {1, 3}) {
      bl.run(splits);
      const std::vector<float> clean = bl.outputs();
      for (int64_t t : {int64_t{5}, len - 2, len - 1})
        for (bool in_k : {true, false}) {
          const int64_t width = in_k ? d : dv;
          std::vector<int64_t> positions;
          for (int64_t pos : {int64_t{0}, int64_t{63}, width - 9, width - 1})
            if (pos >= 0 && pos < width && std::find(positions.begin(), positions.end(), pos) == positions.end())
              positions.push_back(pos);
          for (int64_t pos : positions) {
            uint8_t* at = (in_k ? kc : vc) + bl.elem(0, t, 1, width) + pos;
            const uint8_t saved = *at;
            *at = in_k ? detail::kE4m3NaN : static_cast<uint8_t>(0x80 | detail::kE4m3NaN);
            bl.run(splits);
            *at = saved;
            const std::vector<float> got = bl.outputs();
            int bad = 0;
            for (int64_t i = 0; i < c.sq; ++i)
              for (int64_t h = 0; h < c.hq && bad < 4; ++h) {
                const bool hit = h / hq_per == 1 && t <= len - c.sq + i;  // the row sees token t
                for (int64_t x = 0; x <= dv && bad < 4; ++x) {             // x == dv: the LSE
                  const size_t at_out = x < dv ? static_cast<size_t>((i * c.hq + h) * dv + x)
                                               : o_count + static_cast<size_t>(h * c.sq + i);
                  const bool want_nan = hit && (in_k || x == pos);
                  const bool ok = want_nan ? std::isnan(got[at_out])
                                           : std::memcmp(&got[at_out], &clean[at_out], 4) == 0;
                  if (!ok) {
                    ++bad;
                    ADD_FAILURE() << "d=" << d << " dv=" << dv << " sq=" << c.sq << " splits=" << splits << " token "
                                  << t << " pos " << pos << (in_k ? " K" : " V") << ": row " << i << " head " << h
                                  << (x < dv ? " dim " : " LSE ") << (x < dv ? x : 0) << " got " << got[at_out]
                                  << ", clean " << clean[at_out];
                  }
                }
              }
          }
        }
    }
  }
}

// Against the reference on the *unquantised* values, the error is bounded by the quantisation
// step. Per element, the stored value differs by at most ek (K) / ev (V) from the original
// (e4m3: half a step, 2^-4 relative for normals, 2^-10 * scale absolute for subnormals; i8:
// scale / 2). A score then moves by at most delta = scale * sum_x |q_x| * ek, so every softmax
// weight by a factor within exp(+-2 delta):
//   |dO| <= ev + (exp(2 delta) - 1) * max|V|,   |dLSE| <= delta.
TEST(DecodeQuant, EightBitWithinQuantisationBound) {
  for (DType cache : {DType::f8e4m3, DType::i8})
    for (DType t : {DType::f32, DType::bf16}) {
      Spec c = mk("q8", t);
      c.cache = cache;
      c.hq = 8;
      c.hkv = 2;
      c.d = 128;
      c.sq = 2;
      c.causal = true;
      c.lens = {700, 40};
      c.page_size = 16;
      Built bl(c, make_values(c, 21));
      bl.run();
      // fp32 level against what the kernel sees.
      expect_matches_reference(bl, std::string("vs dequantised ") + dtype_name(cache));
      // Derived bound against the original values: per key, |ds_j| <= scale * sum_x |q_x| |dk_jx|
      // with the actual quantisation errors dk (each within half a step); delta = max over keys.
      double ev = 0, vmax = 0;
      for (int64_t b = 0; b < c.B(); ++b)
        for (size_t j = 0; j < bl.vdeq[static_cast<size_t>(b)].size(); ++j) {
          ev = std::max(ev, std::fabs(static_cast<double>(bl.vdeq[static_cast<size_t>(b)][j]) - bl.val.v[static_cast<size_t>(b)][j]));
          vmax = std::max(vmax, std::fabs(static_cast<double>(bl.val.v[static_cast<size_t>(b)][j])));
        }
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
      const int64_t g = c.hq / c.hkv;
      auto delta = [&](int64_t b, int64_t h, int64_t i) {
        const auto& kd = bl.kdeq[static_cast<size_t>(b)];
        const auto& ko = bl.val.k[static_cast<size_t>(b)];
        double worst = 0;
        for (int64_t t = 0; t < c.lens[static_cast<size_t>(b)]; ++t) {
          double s = 0;
          for (int64_t x = 0; x < c.d; ++x) {
            const size_t e = static_cast<size_t>((t * c.hkv + h / g) * c.d + x);
            s += std::fabs(bl.val.q[static_cast<size_t>(((b * c.sq + i) * c.hq + h) * c.d + x)]) *
                 std::fabs(static_cast<double>(kd[e]) - ko[e]);
          }
          worst = std::max(worst, scale * s);
        }
        return worst;
      };
      EXPECT_GT(ev, 0.0);
      // The bound must be meaningful: well below the O scale.
      EXPECT_LT(ev + (std::exp(2 * delta(0, 0, 0)) - 1) * vmax, 0.5) << "bound too loose to test anything";
      expect_matches_reference(
          bl, std::string("vs original ") + dtype_name(cache), /*use_original=*/true,
          [&](int64_t b, int64_t h, int64_t i) { return ev + (std::exp(2 * delta(b, h, i)) - 1) * vmax; },
          [&](int64_t b, int64_t h, int64_t i) { return delta(b, h, i); });
    }
}

TEST(ServingQuant, E4m3ConversionIsExactAndRoundsToNearestEven) {
  using detail::e4m3_to_float;
  using detail::float_to_e4m3;
  // Every code round-trips (NaN codes stay NaN).
  for (int code = 0; code < 256; ++code) {
    const float f = e4m3_to_float(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << code;
      EXPECT_EQ(float_to_e4m3(f) & 0x7f, 0x7f);
    } else {
      EXPECT_EQ(float_to_e4m3(f), code) << code << " = " << f;
    }
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);                  // exponent 7 = bias
  EXPECT_EQ(float_to_e4m3(1000.0f), 0x7e);               // saturate
  EXPECT_EQ(float_to_e4m3(-kInf), 0xfe);
  EXPECT_EQ(float_to_e4m3(kNaN), 0x7f);
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);   // halfway 1.0 | 1.125: to even (1.0)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);   // halfway 1.125 | 1.25: to even (1.25)
  EXPECT_EQ(float_to_e4m3(1.07f), 0x39);     // above half: up
  EXPECT_EQ(float_to_e4m3(440.0f), 0x7e);    // 432 | 448 halfway -> even (448)
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: to even (0)
  EXPECT_EQ(float_to_e4m3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 subnormal steps: to even (2)
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  // Exhaustive: the encoder picks the nearest code for a dense sweep of values.
  for (int i = 0; i < 20000; ++i) {
    const float x = std::ldexp(static_cast<float>(i) / 20000.0f, 0) * 460.0f - 5.0f;
    const float y = e4m3_to_float(float_to_e4m3(x));
    float best = kInf;
    for (int code = 0; code < 256; ++code) {
      const float f = e4m3_to_float(static_cast<uint8_t>(code));
      if (!std::isnan(f)) best = std::min(best, std::fabs(f - std::min(x, 448.0f)));
    }
    ASSERT_EQ(std::fabs(y - std::min(x, 448.0f)), best) << x;
  }
  // i8: symmetric, round to nearest even, saturate to +-127.
  EXPECT_EQ(detail::float_to_i8(2.5f), 2);
  EXPECT_EQ(detail::float_to_i8(-3.5f), -4);
  EXPECT_EQ(detail::float_to_i8(300.0f), 127);
  EXPECT_EQ(detail::float_to_i8(-300.0f), -127);
  EXPECT_EQ(detail::float_to_i8(kNaN), 0);
}

// ---- plans ----------------------------------------------------------------------------------

struct AlignedBytes {
  std::unique_ptr<uint8_t[]> raw;
  uint8_t* ptr = nullptr;
  explicit AlignedBytes(size_t n, size_t offset = 0) : raw(new uint8_t[n + 128]) {
    ptr = raw.get() + (64 - reinterpret_cast<uintptr_t>(raw.get()) % 64) % 64 + offset;
    std::memset(ptr, 0xff, n);  // NaN-ish garbage: the kernel must not rely on zeroed memory
  }
};

Spec plan_spec() {
  Spec c = mk("plan", DType::bf16);
  c.hq = 8;
  c.hkv = 2;
  c.sq = 2;
  c.causal = true;
  c.lens = {700, 5, 0, 300};
  c.page_size = 16;
  return c;
}

TEST(DecodePlan, ReuseGivesIdenticalResults) {
  const Spec c = plan_spec();
  Built bl(c, make_values(c, 4));
  for (int splits : {0, 1, 6}) {
    DecodeOptions opt;
    opt.num_splits = splits;
    const DecodePlan plan = plan_decode(c.B(), c.hq, c.hkv, c.d, c.DV(), c.sq, bl.capacity, c.page_size, Device::cpu, opt);
    EXPECT_GE(plan.num_splits, 1);
    if (splits) {
      EXPECT_EQ(plan.num_splits, splits);
    }
    AlignedBytes ws(plan.workspace_bytes);
    std::vector<float> first;
    for (int rep = 0; rep < 12; ++rep) {
      bl.o.poison();
      bl.lse.poison();
      Context ctx;
      ctx.num_threads = rep % 3;  // any thread count: same result
      const KernelChoice k = decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, plan, ws.ptr, ctx);
      EXPECT_NE(k.reason.find("plan"), std::string::npos) << k.reason;
      if (rep == 0) {
        first = bl.outputs();
        expect_matches_reference(bl, "plan splits " + std::to_string(plan.num_splits));
      } else {
        ASSERT_TRUE(bitwise_equal(bl.outputs(), first)) << "rep " << rep;
      }
    }
    bl.run(plan.num_splits);  // the unplanned call with the same split count agrees bitwise
    EXPECT_TRUE(bitwise_equal(bl.outputs(), first)) << "splits " << plan.num_splits;
  }
}

// Serving loop: one plan for the cache capacity, a token appended and decoded per step.
TEST(DecodePlan, AppendDecodeLoopUnderOnePlan) {
  Spec c = mk("loop", DType::f32);
  c.hq = 4;
  c.hkv = 2;
  c.lens = {30, 0, 64};
  c.page_size = 16;
  c.causal = true;
  Spec full = c;
  const int steps = 20;
  for (int32_t& L : full.lens) L += steps;
  Values vals = make_values(full, 77);
  Built bl(full, vals);  // the final cache geometry; lengths grow from c.lens below
  const DecodePlan plan = plan_decode(c.B(), c.hq, c.hkv, c.d, c.DV(), c.sq, bl.capacity, c.page_size, Device::cpu);
  AlignedBytes ws(plan.workspace_bytes);
  bl.clear_cache();
  std::vector<int32_t> cur = c.lens;
  // Prefill: append the first cur[b] tokens.
  auto append = [&](int64_t b, int64_t t0, int64_t t1) {
    const int64_t T = t1 - t0;
    std::vector<float> kn(static_cast<size_t>(T * c.hkv * c.d)), vn(static_cast<size_t>(T * c.hkv * c.DV()));
    std::vector<int32_t> slots;
    for (int64_t t = t0; t < t1; ++t) {
      std::copy_n(vals.k[static_cast<size_t>(b)].begin() + t * c.hkv * c.d, c.hkv * c.d, kn.begin() + (t - t0) * c.hkv * c.d);
      std::copy_n(vals.v[static_cast<size_t>(b)].begin() + t * c.hkv * c.DV(), c.hkv * c.DV(), vn.begin() + (t - t0) * c.hkv * c.DV());
      slots.push_back(static_cast<int32_t>(bl.slot(b, t)));
    }
    append_kv(TensorView::contiguous(kn.data(), DType::f32, {T, c.hkv, c.d}),
              TensorView::contiguous(vn.data(), DType::f32, {T, c.hkv, c.DV()}),
              TensorView::contiguous(slots.data(), DType::i32, {T}), bl.cache);
  };
  for (int64_t b = 0; b < c.B(); ++b) append(b, 0, cur[static_cast<size_t>(b)]);
  for (int step = 0; step < steps; ++step) {
    for (int64_t b = 0; b < c.B(); ++b) {
      append(b, cur[static_cast<size_t>(b)], cur[static_cast<size_t>(b)] + 1);
      ++cur[static_cast<size_t>(b)];
    }
    bl.lens.fill_i32(cur);
    bl.o.poison();
    bl.lse.poison();
    decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, plan, ws.ptr);
    // Reference over the current prefix of every sequence.
    Spec now = full;
    now.lens = cur;
    const Built ref_view(now, vals);  // same values, lengths = cur
    expect_matches_reference(ref_view, "step " + std::to_string(step), false, nullptr, nullptr, &bl);
  }
}

TEST(DecodePlan, MismatchedPlanIsRejectedNamingPlan) {
  const Spec c = plan_spec();
  Built bl(c, make_values(c, 4));
  const auto make = [&](int64_t batch, int64_t hq, int64_t sq, int64_t max_k, int64_t ps) {
    return plan_decode(batch, hq, c.hkv, c.d, c.DV(), sq, max_k, ps, Device::cpu);
  };
  const DecodePlan good = make(c.B(), c.hq, c.sq, bl.capacity, c.page_size);
  AlignedBytes ws(good.workspace_bytes + 64);
  struct Bad {
    const char* what;
    DecodePlan plan;
    const char* arg;
    const char* says;
  };
  DecodePlan tampered = good;
  tampered.num_splits += 1;
  std::vector<Bad> bad = {
      {"batch", make(c.B() + 1, c.hq, c.sq, bl.capacity, c.page_size), "plan", "batch"},
      {"heads_q", make(c.B(), 2 * c.hq, c.sq, bl.capacity, c.page_size), "plan", "heads_q"},
      {"seqlen_q", make(c.B(), c.hq, 1, bl.capacity, c.page_size), "plan", "seqlen_q"},
      {"page_size", make(c.B(), c.hq, c.sq, bl.capacity, 32), "plan", "page_size"},
      {"contiguous plan for a paged cache", make(c.B(), c.hq, c.sq, bl.capacity, 0), "plan", "page_size"},
      {"max_seqlen_k too small", make(c.B(), c.hq, c.sq, 100, c.page_size), "plan", "max_seqlen_k"},
      {"edited plan", tampered, "plan", "fingerprint"},
  };
  for (const Bad& b : bad) {
    bl.o.poison();
    bl.lse.poison();
    try {
      decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, b.plan, ws.ptr);
      ADD_FAILURE() << b.what << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), b.arg) << b.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos) << b.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("'plan'"), std::string::npos) << e.what();
    }
    for (int64_t i = 0; i < bl.o.count(); ++i) ASSERT_TRUE(std::isnan(bl.o.get(i))) << b.what << ": o written";
    for (int64_t i = 0; i < bl.lse.count(); ++i) ASSERT_TRUE(std::isnan(bl.lse.get(i))) << b.what << ": lse written";
  }
  // The workspace: null, misaligned.
  for (int which = 0; which < 2; ++which) {
    try {
      decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, good, which == 0 ? nullptr : ws.ptr + 4);
      ADD_FAILURE() << "bad workspace accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "workspace") << e.what();
    }
  }
}

TEST(DecodePlan, PlanDecodeRejectsBadArguments) {
  auto expect_bad = [](const char* arg, const std::function<void()>& f) {
    try {
      f();
      ADD_FAILURE() << arg << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), arg) << e.what();
    }
  };
  expect_bad("heads_q", [] { plan_decode(1, 6, 4, 64, 64, 1, 100, 16, Device::cpu); });
  expect_bad("seqlen_q", [] { plan_decode(1, 8, 4, 64, 64, 0, 100, 16, Device::cpu); });
  expect_bad("seqlen_q", [] { plan_decode(1, 8, 4, 64, 64, 17, 100, 16, Device::cpu); });
  expect_bad("head_dim", [] { plan_decode(1, 8, 4, 0, 64, 1, 100, 16, Device::cpu); });
  expect_bad("page_size", [] { plan_decode(1, 8, 4, 64, 64, 1, 100, -1, Device::cpu); });
  expect_bad("opt.num_splits", [] {
    DecodeOptions o;
    o.num_splits = -1;
    plan_decode(1, 8, 4, 64, 64, 1, 100, 16, Device::cpu, o);
  });
  // Without CUDA: "device"; with CUDA but no GPU: "device_index" (with one, the plan is made).
  if (!detail::cuda_compiled())
    expect_bad("device", [] { plan_decode(1, 8, 4, 64, 64, 1, 100, 16, Device::cuda); });
  else if (!cuda_available())
    expect_bad("device_index", [] { plan_decode(1, 8, 4, 64, 64, 1, 100, 16, Device::cuda); });
}

// The split heuristic: documented examples (serving_cpu.cpp).
TEST(DecodePlan, SplitHeuristic) {
  EXPECT_EQ(detail::cpu_decode_num_splits(1, 8, 32768, 16, nullptr), 4);
  EXPECT_EQ(detail::cpu_decode_num_splits(16, 8, 32768, 16, nullptr), 1);
  EXPECT_EQ(detail::cpu_decode_num_splits(1, 1, 100, 64, nullptr), 1);     // too short to split
  EXPECT_EQ(detail::cpu_decode_num_splits(1, 1, 1 << 20, 256, nullptr), detail::kMaxSplits);
  EXPECT_EQ(detail::cpu_decode_num_splits(0, 8, 0, 4, nullptr), 1);
}

// ---- append_kv -------------------------------------------------------------------------------

// append_kv then decode == decode over the directly built cache: the same cache bytes (the
// unused slots keep their poison), the same outputs.
TEST(AppendKv, AppendThenDecodeEqualsDirectCache) {
  struct Combo {
    DType q, cache, input;
    int64_t page_size;
  };
  const Combo combos[] = {{DType::f32, DType::f32, DType::f32, 16},   {DType::bf16, DType::bf16, DType::bf16, 16},
                          {DType::bf16, DType::bf16, DType::f32, 0},  {DType::f32, DType::f8e4m3, DType::f32, 16},
                          {DType::bf16, DType::f8e4m3, DType::bf16, 1}, {DType::f32, DType::i8, DType::f32, 0},
                          {DType::f16, DType::i8, DType::f16, 16}};
  for (const Combo& cb : combos) {
    Spec c = mk("append", cb.q);
    c.cache = cb.cache;
    c.hq = 4;
    c.hkv = 2;
    c.sq = 2;
    c.causal = true;
    c.lens = {100, 0, 33, 2};
    c.page_size = cb.page_size;
    const std::string what = std::string(dtype_name(cb.input)) + "->" + dtype_name(cb.cache) + " page" +
                             std::to_string(cb.page_size);
    const Values vals = make_values(c, 13);
    Built direct(c, vals), appended(c, vals);
    appended.clear_cache();
    const NewTokens n = all_tokens(appended, 6, 5);
    detail::Buffer kn(cb.input, static_cast<int64_t>(n.k.size())), vn(cb.input, static_cast<int64_t>(n.v.size()));
    for (size_t i = 0; i < n.k.size(); ++i) kn.set(static_cast<int64_t>(i), n.k[i]);
    for (size_t i = 0; i < n.v.size(); ++i) vn.set(static_cast<int64_t>(i), n.v[i]);
    const KernelChoice k = append_kv(kn.view({n.T, c.hkv, c.d}), vn.view({n.T, c.hkv, c.DV()}),
                                     TensorView::contiguous(n.slots.data(), DType::i32, {n.T}), appended.cache);
    EXPECT_NE(k.kernel.find("cpu/append_kv"), std::string::npos) << k.kernel;
    EXPECT_TRUE(bytes_of(appended.kc) == bytes_of(direct.kc)) << what << ": k cache bytes differ";
    EXPECT_TRUE(bytes_of(appended.vc) == bytes_of(direct.vc)) << what << ": v cache bytes differ";
    direct.run(3);
    appended.run(3);
    EXPECT_TRUE(bitwise_equal(direct.outputs(), appended.outputs())) << what;
    expect_matches_reference(appended, what);
  }
}

// decode's fused append (KVCache::k_new / v_new): the cache bytes and the outputs of append_kv +
// decode, for float and 8-bit caches, paged (page sizes 1, 16, 64) and contiguous, 1 or 2 new
// tokens, a sequence of length 0 in the batch (nothing appended there), split and not.
TEST(DecodeFusedAppend, EqualsAppendThenDecode) {
  fused_append_sweep([](Spec c) { return c; }, 4);
}

// More than 16 query rows on the CPU (a prefill or a long chunk against the cache): the tiled flash
// forward reading K / V through the cache's layout; cache_prefill_cases() in serving_common.hpp.
class DecodeCachePrefill : public ::testing::TestWithParam<Spec> {};

TEST_P(DecodeCachePrefill, MatchesFloat64Reference) {
  const Spec& c = GetParam();
  Built bl(c, make_values(c, 43));
  const KernelChoice k = bl.run();
  EXPECT_NE(k.kernel.find("cpu/flash cache-prefill"), std::string::npos) << k.kernel;
  // The AMX-BF16 products round P to bf16 as the GPU kernels do: their tolerance (exact tanh).
  if (k.reason.find("amx-bf16") != std::string::npos || k.kernel.find("amx-bf16") != std::string::npos) {
    const ForwardTol tol = forward_tol(bl, false);
    expect_matches_reference(bl, c.name, false, tol.extra_o(), tol.extra_lse());
    if (c.cache == c.dtype)
      expect_fused_append_equals_direct(c, c.sq, 0, c.name + " +append", tol.extra_o(), tol.extra_lse());
  } else {
    expect_matches_reference(bl, c.name);
    // The chunk's own tokens appended in the same call (the rows they occupy poisoned first).
    if (c.cache == c.dtype) expect_fused_append_equals_direct(c, c.sq, 0, c.name + " +append");
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, DecodeCachePrefill, ::testing::ValuesIn(cache_prefill_cases()),
                         [](const ::testing::TestParamInfo<Spec>& info) { return info.param.name; });

// Plans are for 1..16 rows: a longer chunk under one is an error naming q.shape[1] (not a plan
// mismatch that would send the caller to plan_decode, which refuses that shape too).
TEST(DecodeCachePrefill, MoreThan16RowsUnderAPlanIsAClearError) {
  Spec c = mk("plan17", DType::f32);
  c.sq = 17;
  c.lens = {40};
  Built bl(c, make_values(c, 2));
  const DecodePlan plan = plan_decode(c.B(), c.hq, c.hkv, c.d, c.DV(), 16, bl.capacity, 0, Device::cpu);
  AlignedBytes ws(plan.workspace_bytes);
  try {
    decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, plan, ws.ptr);
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q.shape[1]") << e.what();
  }
}

// Under a plan, token by token: each step appends one token per sequence inside the decode call.
TEST(DecodeFusedAppend, DecodeLoopUnderOnePlan) {
  Spec c = mk("fused_loop", DType::bf16);
  c.hq = 4;
  c.hkv = 2;
  c.lens = {30, 0, 64};
  c.page_size = 16;
  c.causal = true;
  const int steps = 6;
  Spec full = c;
  for (int32_t& L : full.lens) L += L ? steps : 0;  // the empty slot stays empty
  const Values vals = make_values(full, 3);
  Built bl(full, vals), ref(full, vals);
  const DecodePlan plan = plan_decode(c.B(), c.hq, c.hkv, c.d, c.DV(), c.sq, bl.capacity, c.page_size, Device::cpu);
  AlignedBytes ws(plan.workspace_bytes);
  std::vector<int32_t> cur = c.lens;
  Spec grown = full;
  for (int step = 0; step < steps; ++step) {
    for (int32_t& L : cur) L += L ? 1 : 0;
    grown.lens = cur;
    const Built now(grown, vals);  // the reference view: the first cur tokens of every sequence
    FusedNew nw(now, 1);           // the step's token of every live sequence
    bl.lens.fill_i32(cur);
    KVCache cache = bl.cache;
    // bl's cache holds every token already; the step's token is poisoned there first, so it
    // reaches the cache only through k_new / v_new.
    for (int64_t b = 0; b < c.B(); ++b) {
      const int64_t t = cur[static_cast<size_t>(b)] - 1;
      if (t < 0) continue;
      for (int64_t h = 0; h < c.hkv; ++h) {
        for (int64_t x = 0; x < c.d; ++x) bl.kc.set(bl.elem(b, t, h, c.d) + x, kNaN);
        for (int64_t x = 0; x < c.DV(); ++x) bl.vc.set(bl.elem(b, t, h, c.DV()) + x, kNaN);
      }
    }
    cache.k_new = nw.k.view({c.B(), 1, c.hkv, c.d});
    cache.v_new = nw.v.view({c.B(), 1, c.hkv, c.DV()});
    bl.o.poison();
    bl.lse.poison();
    const KernelChoice k = decode(bl.qv, cache, bl.ov, bl.lv, bl.prm, plan, ws.ptr);
    EXPECT_NE(k.kernel.find("+append1"), std::string::npos) << k.kernel;
    EXPECT_TRUE(bytes_of(bl.kc) == bytes_of(ref.kc) && bytes_of(bl.vc) == bytes_of(ref.vc))
        << "step " << step << ": cache bytes differ from the full cache";
    expect_matches_reference(now, "step " + std::to_string(step), false, nullptr, nullptr, &bl);
  }
}

TEST(AppendKv, NegativeSlotsAreSkipped) {
  Spec c = mk("skip", DType::bf16);
  c.lens = {40};
  c.page_size = 16;
  Built bl(c, make_values(c, 1));
  bl.clear_cache();
  const auto k_before = bytes_of(bl.kc), v_before = bytes_of(bl.vc);
  const int64_t T = 4;
  detail::Buffer kn(DType::bf16, T * c.hkv * c.d), vn(DType::bf16, T * c.hkv * c.DV());
  std::mt19937_64 rng(3);
  kn.fill_random(rng);
  vn.fill_random(rng);
  const std::vector<int32_t> slots = {-1, 5, -7, 2};
  append_kv(kn.view({T, c.hkv, c.d}), vn.view({T, c.hkv, c.DV()}), TensorView::contiguous(slots.data(), DType::i32, {T}),
            bl.cache);
  const auto k_after = bytes_of(bl.kc), v_after = bytes_of(bl.vc);
  const int64_t row_k = c.hkv * c.d * 2, row_v = c.hkv * c.DV() * 2;  // bytes per slot
  for (int64_t s = 0; s < bl.pages * bl.ps; ++s) {
    const bool written = s == 5 || s == 2;
    const bool k_same = std::equal(k_after.begin() + s * row_k, k_after.begin() + (s + 1) * row_k, k_before.begin() + s * row_k);
    const bool v_same = std::equal(v_after.begin() + s * row_v, v_after.begin() + (s + 1) * row_v, v_before.begin() + s * row_v);
    EXPECT_EQ(k_same, !written) << "slot " << s;
    EXPECT_EQ(v_same, !written) << "slot " << s;
  }
  // Token 1 landed in slot 5, token 3 in slot 2, bit for bit (bf16 -> bf16).
  EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(bl.kc.host()) + 5 * row_k,
                        static_cast<const uint8_t*>(kn.host()) + 1 * row_k, static_cast<size_t>(row_k)), 0);
  EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(bl.vc.host()) + 2 * row_v,
                        static_cast<const uint8_t*>(vn.host()) + 3 * row_v, static_cast<size_t>(row_v)), 0);
}

// i64 slot mappings through the public API give the same cache bytes as building it directly.
TEST(AppendKv, Int64SlotMapping) {
  Spec c = mk("i64", DType::f32);
  c.cache = DType::f8e4m3;
  c.lens = {20, 7};
  c.page_size = 4;
  const Values vals = make_values(c, 9);
  Built direct(c, vals), appended(c, vals);
  appended.clear_cache();
  const NewTokens n = all_tokens(appended, 2, 3);
  const std::vector<int64_t> slots64(n.slots.begin(), n.slots.end());
  append_kv(TensorView::contiguous(n.k.data(), DType::f32, {n.T, c.hkv, c.d}),
            TensorView::contiguous(n.v.data(), DType::f32, {n.T, c.hkv, c.DV()}),
            TensorView::contiguous(slots64.data(), DType::i64, {n.T}), appended.cache);
  EXPECT_TRUE(bytes_of(appended.kc) == bytes_of(direct.kc));
  EXPECT_TRUE(bytes_of(appended.vc) == bytes_of(direct.vc));
}

TEST(AppendKv, QuantisesWithRoundingAndSaturation) {
  Spec c = mk("sat", DType::f32);
  c.cache = DType::f8e4m3;
  c.hkv = 1;
  c.hq = 1;
  c.d = 4;
  c.lens = {1};
  Built bl(c, make_values(c, 1));
  const float s = bl.val.k_scale[0];
  const std::vector<float> kn = {1000.0f * s, -1000.0f * s, 1.0625f * s, kNaN};
  const std::vector<float> vn = {0.0f, 0.0f, 0.0f, 0.0f};
  const int32_t slot = 0;
  append_kv(TensorView::contiguous(kn.data(), DType::f32, {1, 1, 4}), TensorView::contiguous(vn.data(), DType::f32, {1, 1, 4}),
            TensorView::contiguous(&slot, DType::i32, {1}), bl.cache);
  const auto* k = static_cast<const uint8_t*>(bl.kc.host());
  EXPECT_EQ(k[0], 0x7e);
  EXPECT_EQ(k[1], 0xfe);
  EXPECT_EQ(k[2], 0x38);
  EXPECT_EQ(k[3] & 0x7f, 0x7f);
}

// ---- merge_states ------------------------------------------------------------------------------

// Forward (float64 naive backend) over keys [k0, k1) of k/v; returns O in dtype t and LSE.
struct Partial {
  detail::Buffer o, lse;
};

Partial forward_part(const detail::Buffer& q, const detail::Buffer& k, const detail::Buffer& v, int64_t B, int64_t S,
                     int64_t H, int64_t D, int64_t Sk, int64_t k0, int64_t k1, DType t) {
  Partial r{detail::Buffer(t, B * S * H * D), detail::Buffer(DType::f32, B * H * S)};
  r.o.poison();
  r.lse.poison();
  const auto* kb = static_cast<const uint8_t*>(k.host()) + k0 * H * D * dtype_size(t);
  const auto* vb = static_cast<const uint8_t*>(v.host()) + k0 * H * D * dtype_size(t);
  const TensorView kv = TensorView::strided(kb, t, {B, k1 - k0, H, D}, {Sk * H * D, H * D, D, 1});
  const TensorView vv = TensorView::strided(vb, t, {B, k1 - k0, H, D}, {Sk * H * D, H * D, D, 1});
  Context ctx;
  ctx.backend = Backend::naive;
  forward(TensorView::contiguous(q.host(), t, {B, S, H, D}), kv, vv, r.o.view({B, S, H, D}), r.lse.view({B, H, S}),
          AttnParams{}, ctx);
  return r;
}

TEST(MergeStates, MatchesAttentionOverTheUnionOfKeys) {
  for (DType t : {DType::f32, DType::bf16}) {
    const int64_t B = 2, S = 7, H = 3, D = 64, Sk = 50, cut = 20;
    std::mt19937_64 rng(17);
    detail::Buffer q(t, B * S * H * D), k(t, B * Sk * H * D), v(t, B * Sk * H * D);
    q.fill_random(rng, 2.0f);
    k.fill_random(rng, 2.0f);
    v.fill_random(rng);
    Partial a = forward_part(q, k, v, B, S, H, D, Sk, 0, cut, t);
    Partial b = forward_part(q, k, v, B, S, H, D, Sk, cut, Sk, t);
    Partial all = forward_part(q, k, v, B, S, H, D, Sk, 0, Sk, t);
    // Rows (b=1, s=2, h=*) empty on side b, (b=0, s=5, h=1) empty on side a, (b=1, s=6, h=2) on
    // both: the empty side's O holds NaN, which must not be read.
    auto empty = [&](Partial& p, int64_t bb, int64_t s, int64_t h) {
      p.lse.set((bb * H + h) * S + s, -kInf);
      for (int64_t x = 0; x < D; ++x) p.o.set(((bb * S + s) * H + h) * D + x, kNaN);
    };
    for (int64_t h = 0; h < H; ++h) empty(b, 1, 2, h);
    empty(a, 0, 5, 1);
    empty(a, 1, 6, 2);
    empty(b, 1, 6, 2);
    for (bool alias : {false, true}) {
      detail::Buffer o(t, B * S * H * D), lse(DType::f32, B * H * S);
      o.poison();
      lse.poison();
      // Aliasing: the outputs are o_a / lse_a themselves (on a copy of a).
      Partial ac{detail::Buffer(t, B * S * H * D), detail::Buffer(DType::f32, B * H * S)};
      std::memcpy(ac.o.host(), a.o.host(), a.o.bytes());
      std::memcpy(ac.lse.host(), a.lse.host(), a.lse.bytes());
      detail::Buffer& out_o = alias ? ac.o : o;
      detail::Buffer& out_l = alias ? ac.lse : lse;
      const KernelChoice kc = merge_states(ac.o.view({B, S, H, D}), ac.lse.view({B, H, S}), b.o.view({B, S, H, D}),
                                           b.lse.view({B, H, S}), out_o.view({B, S, H, D}), out_l.view({B, H, S}));
      EXPECT_NE(kc.kernel.find("cpu/merge_states"), std::string::npos);
      for (int64_t bb = 0; bb < B; ++bb)
        for (int64_t s = 0; s < S; ++s)
          for (int64_t h = 0; h < H; ++h) {
            const bool no_a = (bb == 0 && s == 5 && h == 1) || (bb == 1 && s == 6 && h == 2);
            const bool no_b = (bb == 1 && s == 2) || (bb == 1 && s == 6 && h == 2);
            const int64_t li = (bb * H + h) * S + s;
            const float got_l = out_l.get(li);
            for (int64_t x = 0; x < D; ++x) {
              const int64_t oi = ((bb * S + s) * H + h) * D + x;
              const float got = out_o.get(oi);
              if (no_a && no_b) {
                ASSERT_EQ(got, 0.0f);
              } else if (no_a || no_b) {  // the other side, exactly
                ASSERT_EQ(got, (no_a ? b : a).o.get(oi)) << "row " << bb << "," << s << "," << h;
              } else {
                // bf16: the partials are rounded (half an ulp of each, weighted), the merged O
                // and the reference O once more each.
                const double want = all.o.get(oi), L = all.lse.get(li);
                const double wa = std::exp(a.lse.get(li) - L), wb = std::exp(b.lse.get(li) - L);
                const double u = t == DType::f32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -8);  // half an ulp, relative
                const double tol = u * (wa * std::fabs(a.o.get(oi)) + wb * std::fabs(b.o.get(oi)) + 2 * std::fabs(want)) + 2e-6;
                ASSERT_LE(std::fabs(got - want), tol) << dtype_name(t) << " alias " << alias << " row " << bb << "," << s
                                                      << "," << h << " x " << x;
              }
            }
            if (no_a && no_b)
              EXPECT_TRUE(std::isinf(got_l) && got_l < 0) << got_l;
            else if (no_a || no_b)
              EXPECT_EQ(got_l, (no_a ? b : a).lse.get(li));
            else
              EXPECT_NEAR(got_l, all.lse.get(li), 2e-6 * std::max(1.0, std::fabs(static_cast<double>(all.lse.get(li)))));
          }
    }
  }
}

// ---- bad inputs: a clear error naming the argument, nothing written ---------------------------

struct DecodeCall {
  TensorView q, o, lse;
  KVCache cache;
  AttnParams prm;
  DecodeOptions opt;
  Context ctx;
};

struct BadDecode {
  const char* what;
  const char* argument;  // must appear in the message
  std::function<void(Built&, DecodeCall&)> mutate;
};

Spec bad_spec() {
  Spec c = mk("bad", DType::f32);
  c.hq = 4;
  c.hkv = 2;
  c.d = 32;
  c.sq = 2;
  c.lens = {5, 20};
  c.page_size = 16;
  return c;
}

const BadDecode kBadDecode[] = {
    {"seqlen_q 0", "q.shape[1]", [](Built&, DecodeCall& k) { k.q.shape[1] = k.o.shape[1] = 0; }},
    {"int8 q", "q.dtype", [](Built&, DecodeCall& k) { k.q.dtype = DType::i8; }},
    {"cache_seqlens past capacity", "cache.cache_seqlens[1]", [](Built& b, DecodeCall&) { b.lens.fill_i32({5, 1000}); }},
    {"cache_seqlens below seqlen_q", "cache.cache_seqlens[0]", [](Built& b, DecodeCall&) { b.lens.fill_i32({1, 20}); }},
    {"negative cache_seqlens", "cache.cache_seqlens[0]", [](Built& b, DecodeCall&) { b.lens.fill_i32({-3, 20}); }},
    {"block_table entry past the pages", "cache.block_table[1][1]",
     [](Built& b, DecodeCall&) {
       b.table[static_cast<size_t>(b.width + 1)] = static_cast<int32_t>(b.pages);
       b.bt.fill_i32(b.table);
     }},
    {"negative block_table entry", "cache.block_table[0][0]",
     [](Built& b, DecodeCall&) {
       b.table[0] = -1;
       b.bt.fill_i32(b.table);
     }},
    {"block_table f32", "cache.block_table.dtype", [](Built&, DecodeCall& k) { k.cache.block_table.dtype = DType::f32; }},
    {"block_table batch", "cache.block_table.shape[0]", [](Built&, DecodeCall& k) { k.cache.block_table.shape[0] = 3; }},
    {"8-bit cache without scales", "cache.k_scale",
     [](Built&, DecodeCall& k) { k.cache.k_cache.dtype = k.cache.v_cache.dtype = DType::f8e4m3; }},
    {"scales on an f32 cache", "cache.v_scale", [](Built& b, DecodeCall& k) { k.cache.v_scale = b.vs.view({2}); }},
    {"zero scale", "cache.k_scale[1]",
     [](Built& b, DecodeCall& k) {
       k.cache.k_cache.dtype = k.cache.v_cache.dtype = DType::i8;
       b.ks.set(1, 0.0f);
       k.cache.k_scale = b.ks.view({2});
       k.cache.v_scale = b.vs.view({2});
     }},
    {"scale length", "cache.k_scale.shape[0]",
     [](Built& b, DecodeCall& k) {
       k.cache.k_cache.dtype = k.cache.v_cache.dtype = DType::i8;
       k.cache.k_scale = b.ks.view({1});
     }},
    {"bf16 cache with f32 q", "cache.k_cache.dtype",
     [](Built&, DecodeCall& k) { k.cache.k_cache.dtype = k.cache.v_cache.dtype = DType::bf16; }},
    {"v cache dtype differs", "cache.v_cache.dtype", [](Built&, DecodeCall& k) { k.cache.v_cache.dtype = DType::f16; }},
    {"o head_dim_v", "o.shape[3]", [](Built&, DecodeCall& k) { k.o.shape[3] = 16; }},
    {"o dtype", "o.dtype", [](Built&, DecodeCall& k) { k.o.dtype = DType::bf16; }},
    {"heads not divisible", "q.shape[2]",
     [](Built&, DecodeCall& k) { k.cache.k_cache.shape[2] = k.cache.v_cache.shape[2] = 3; }},
    {"cache head_dim", "cache.k_cache.shape[3]", [](Built&, DecodeCall& k) { k.cache.k_cache.shape[3] = 16; }},
    {"v cache pages", "cache.v_cache.shape[0]", [](Built&, DecodeCall& k) { k.cache.v_cache.shape[0] -= 1; }},
    {"page_size 0", "cache.k_cache.shape[1]",
     [](Built&, DecodeCall& k) { k.cache.k_cache.shape[1] = k.cache.v_cache.shape[1] = 0; }},
    {"contiguous cache of the wrong batch", "cache.k_cache.shape[0]",
     [](Built&, DecodeCall& k) { k.cache.block_table = TensorView{}; }},
    {"lse shape", "lse.shape[2]", [](Built&, DecodeCall& k) { k.lse.shape[2] = 1; }},
    {"cache_seqlens missing", "cache.cache_seqlens", [](Built&, DecodeCall& k) { k.cache.cache_seqlens = TensorView{}; }},
    {"cache_seqlens length", "cache.cache_seqlens.shape[0]", [](Built&, DecodeCall& k) { k.cache.cache_seqlens.shape[0] = 1; }},
    {"num_splits -1", "opt.num_splits", [](Built&, DecodeCall& k) { k.opt.num_splits = -1; }},
    {"num_splits too many", "opt.num_splits", [](Built&, DecodeCall& k) { k.opt.num_splits = 100000; }},
    {"window_left -2", "params.window_left", [](Built&, DecodeCall& k) { k.prm.window_left = -2; }},
    {"sinks length", "params.sinks", [](Built& b, DecodeCall& k) { k.prm.sinks = b.sinks.view({3}); }},
    {"negative threads", "ctx.num_threads", [](Built&, DecodeCall& k) { k.ctx.num_threads = -2; }},
    {"cache on another device", "cache.k_cache.device", [](Built&, DecodeCall& k) { k.cache.k_cache.device = Device::cuda; }},
    // Fused append (cache.k_new / v_new; q's and o's buffers stand in for the new tokens).
    {"k_new without v_new", "cache.v_new", [](Built& b, DecodeCall& k) { k.cache.k_new = b.q.view({2, 2, 2, 32}); }},
    {"v_new without k_new", "cache.k_new", [](Built& b, DecodeCall& k) { k.cache.v_new = b.o.view({2, 2, 2, 32}); }},
    {"k_new dtype", "cache.k_new.dtype",
     [](Built& b, DecodeCall& k) {
       k.cache.k_new = TensorView::contiguous(b.q.data(), DType::bf16, {2, 2, 2, 32});
       k.cache.v_new = b.o.view({2, 2, 2, 32});
     }},
    {"k_new batch", "cache.k_new.shape[0]",
     [](Built& b, DecodeCall& k) {
       k.cache.k_new = b.q.view({1, 2, 2, 32});
       k.cache.v_new = b.o.view({2, 2, 2, 32});
     }},
    {"k_new heads", "cache.k_new.shape[2]",
     [](Built& b, DecodeCall& k) {
       k.cache.k_new = b.q.view({2, 2, 4, 32});
       k.cache.v_new = b.o.view({2, 2, 2, 32});
     }},
    {"v_new seqlen_new", "cache.v_new.shape[1]",
     [](Built& b, DecodeCall& k) {
       k.cache.k_new = b.q.view({2, 2, 2, 32});
       k.cache.v_new = b.o.view({2, 1, 2, 32});
     }},
    {"k_new head_dim", "cache.k_new.shape[3]",
     [](Built& b, DecodeCall& k) {
       k.cache.k_new = b.q.view({2, 2, 2, 16});
       k.cache.v_new = b.o.view({2, 2, 2, 32});
     }},
    {"v_new dtype", "cache.v_new.dtype",
     [](Built& b, DecodeCall& k) {
       k.cache.k_new = b.q.view({2, 2, 2, 32});
       k.cache.v_new = TensorView::contiguous(b.o.data(), DType::f16, {2, 2, 2, 32});
     }},
    {"new tokens sharing a page", "cache.block_table",
     [](Built& b, DecodeCall& k) {  // sequence 1's positions 16..31 on sequence 0's first page
       static_cast<int32_t*>(b.bt.host())[b.width + 1] = b.table[0];
       k.cache.k_new = b.q.view({2, 2, 2, 32});
       k.cache.v_new = b.o.view({2, 2, 2, 32});
     }},
    {"seqlen_new above a length", "cache.cache_seqlens[0]",
     [](Built& b, DecodeCall& k) {  // sequence 0 holds 5 tokens; 6 new ones cannot end at position 5
       k.cache.k_new = TensorView::contiguous(b.kc.data(), DType::f32, {2, 6, 2, 32});
       k.cache.v_new = TensorView::contiguous(b.vc.data(), DType::f32, {2, 6, 2, 32});
     }},
    // Host pointers labelled cuda: "q.device" without CUDA, "q.data" (not a device pointer) with it.
    {"cuda tensors", "q.d",
     [](Built&, DecodeCall& k) {
       for (TensorView* t : {&k.q, &k.o, &k.lse, &k.cache.k_cache, &k.cache.v_cache, &k.cache.block_table,
                             &k.cache.cache_seqlens})
         t->device = Device::cuda;
     }},
};

class DecodeBadInputs : public ::testing::TestWithParam<BadDecode> {};

TEST_P(DecodeBadInputs, RejectedWithClearMessageAndNothingWritten) {
  const BadDecode& bad = GetParam();
  const Spec c = bad_spec();
  Built bl(c, make_values(c, 5));
  DecodeCall call{bl.qv, bl.ov, bl.lv, bl.cache, bl.prm, DecodeOptions{}, Context{}};
  bad.mutate(bl, call);
  bl.o.poison();
  bl.lse.poison();
  const auto k_before = bytes_of(bl.kc), v_before = bytes_of(bl.vc);
  try {
    decode(call.q, call.cache, call.o, call.lse, call.prm, call.opt, call.ctx);
    FAIL() << bad.what << ": accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(bad.argument), std::string::npos) << bad.what << ": message does not name " << bad.argument << ": " << msg;
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
    EXPECT_NE(msg.find("got"), std::string::npos) << msg;
  }
  for (int64_t i = 0; i < bl.o.count(); ++i) ASSERT_TRUE(std::isnan(bl.o.get(i))) << bad.what << ": o written";
  for (int64_t i = 0; i < bl.lse.count(); ++i) ASSERT_TRUE(std::isnan(bl.lse.get(i))) << bad.what << ": lse written";
  EXPECT_TRUE(bytes_of(bl.kc) == k_before && bytes_of(bl.vc) == v_before) << bad.what << ": cache written";
}

std::string bad_name(const char* what) {
  std::string s;
  for (const char* p = what; *p; ++p) s += std::isalnum(static_cast<unsigned char>(*p)) ? *p : '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Table, DecodeBadInputs, ::testing::ValuesIn(kBadDecode),
                         [](const ::testing::TestParamInfo<BadDecode>& info) { return bad_name(info.param.what); });

// Without CUDA built in, CUDA tensors get "no CUDA backend"; with it (and a GPU) they run the CUDA
// kernel (whose results test_cuda_serving.cpp checks).
TEST(DecodeDispatch, CudaTensorsFailLoudly) {
  if (detail::cuda_compiled() && !cuda_available()) GTEST_SKIP() << "skipped: no CUDA device";
  const Spec c = bad_spec();
  Built host(c, make_values(c, 5));
  if (!detail::cuda_compiled()) {
    TensorView q = host.qv;
    q.device = Device::cuda;
    try {
      decode(q, host.cache, host.ov, host.lv, host.prm);
      FAIL() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("no CUDA backend"), std::string::npos) << e.what();
    }
    return;
  }
  auto dev = [](detail::Buffer& b) {
    detail::Buffer d(b.dtype(), b.count(), Device::cuda);
    std::memcpy(d.host(), b.host(), b.bytes());
    d.upload();
    return d;
  };
  detail::Buffer q = dev(host.q), o = dev(host.o), l = dev(host.lse), k = dev(host.kc), v = dev(host.vc),
                 bt = dev(host.bt), lens = dev(host.lens);
  auto on = [](TensorView t, detail::Buffer& b) {
    t.data = b.data();
    t.device = Device::cuda;
    return t;
  };
  KVCache cache = host.cache;
  cache.k_cache = on(cache.k_cache, k);
  cache.v_cache = on(cache.v_cache, v);
  cache.block_table = on(cache.block_table, bt);
  cache.cache_seqlens = on(cache.cache_seqlens, lens);
  const KernelChoice choice = decode(on(host.qv, q), cache, on(host.ov, o), on(host.lv, l), host.prm);
  EXPECT_NE(choice.kernel.find("cuda/splitkv"), std::string::npos) << choice.kernel;
}

struct AppendCall {
  TensorView k_new, v_new, slots;
  KVCache cache;
};

struct BadAppend {
  const char* what;
  const char* argument;
  std::function<void(Built&, AppendCall&, std::vector<int32_t>&)> mutate;
};

const BadAppend kBadAppend[] = {
    {"slot past the cache", "slot_mapping[2]", [](Built& b, AppendCall&, std::vector<int32_t>& s) { s[2] = static_cast<int32_t>(b.pages * b.ps); }},
    {"duplicate slot", "slot_mapping", [](Built&, AppendCall&, std::vector<int32_t>& s) { s[3] = s[0]; }},
    {"f32 slot mapping", "slot_mapping.dtype", [](Built&, AppendCall& a, std::vector<int32_t>&) { a.slots.dtype = DType::f32; }},
    {"slot mapping length", "slot_mapping.shape[0]", [](Built&, AppendCall& a, std::vector<int32_t>&) { a.slots.shape[0] = 3; }},
    {"k_new heads", "k_new.shape[1]", [](Built&, AppendCall& a, std::vector<int32_t>&) { a.k_new.shape[1] = 1; }},
    {"v_new head_dim_v", "v_new.shape[2]", [](Built&, AppendCall& a, std::vector<int32_t>&) { a.v_new.shape[2] = 8; }},
    {"v_new dtype", "v_new.dtype", [](Built&, AppendCall& a, std::vector<int32_t>&) { a.v_new.dtype = DType::bf16; }},
    {"int8 k_new", "k_new.dtype", [](Built&, AppendCall& a, std::vector<int32_t>&) { a.k_new.dtype = DType::i8; }},
    {"8-bit cache without scales", "cache.k_scale",
     [](Built&, AppendCall& a, std::vector<int32_t>&) { a.cache.k_cache.dtype = a.cache.v_cache.dtype = DType::i8; }},
    {"cache page stride 0", "cache.k_cache.stride[0]",
     [](Built&, AppendCall& a, std::vector<int32_t>&) { a.cache.k_cache.stride[0] = 0; }},
    {"cache on another device", "cache.v_cache.device",
     [](Built&, AppendCall& a, std::vector<int32_t>&) { a.cache.v_cache.device = Device::cuda; }},
    {"decode's k_new given to append_kv", "cache.k_new",
     [](Built&, AppendCall& a, std::vector<int32_t>&) { a.cache.k_new = a.cache.v_new = a.k_new; }},
};

class AppendBadInputs : public ::testing::TestWithParam<BadAppend> {};

TEST_P(AppendBadInputs, RejectedWithClearMessageAndCacheUntouched) {
  const BadAppend& bad = GetParam();
  const Spec c = bad_spec();
  Built bl(c, make_values(c, 5));
  const auto k_before = bytes_of(bl.kc), v_before = bytes_of(bl.vc);
  const int64_t T = 4;
  std::vector<float> kn(static_cast<size_t>(T * c.hkv * c.d), 0.5f), vn(static_cast<size_t>(T * c.hkv * c.DV()), 0.5f);
  std::vector<int32_t> slots = {0, 1, 2, 3};
  AppendCall call{TensorView::contiguous(kn.data(), DType::f32, {T, c.hkv, c.d}),
                  TensorView::contiguous(vn.data(), DType::f32, {T, c.hkv, c.DV()}),
                  TensorView::contiguous(slots.data(), DType::i32, {T}), bl.cache};
  bad.mutate(bl, call, slots);
  try {
    append_kv(call.k_new, call.v_new, call.slots, call.cache);
    FAIL() << bad.what << ": accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(bad.argument), std::string::npos) << bad.what << ": " << msg;
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
  }
  EXPECT_TRUE(bytes_of(bl.kc) == k_before) << bad.what << ": k cache written";
  EXPECT_TRUE(bytes_of(bl.vc) == v_before) << bad.what << ": v cache written";
}

INSTANTIATE_TEST_SUITE_P(Table, AppendBadInputs, ::testing::ValuesIn(kBadAppend),
                         [](const ::testing::TestParamInfo<BadAppend>& info) { return bad_name(info.param.what); });

TEST(MergeBadInputs, RejectedWithClearMessageAndNothingWritten) {
  const int64_t B = 2, S = 3, H = 2, D = 16;
  detail::Buffer oa(DType::f32, B * S * H * D), ob(DType::f32, B * S * H * D), oo(DType::f32, B * S * H * D);
  detail::Buffer la(DType::f32, B * H * S), lb(DType::f32, B * H * S), lo(DType::f32, B * H * S);
  std::mt19937_64 rng(1);
  oa.fill_random(rng);
  ob.fill_random(rng);
  la.fill_random(rng);
  lb.fill_random(rng);
  struct Views {
    TensorView oa, la, ob, lb, oo, lo;
  };
  struct Bad {
    const char* what;
    const char* argument;
    std::function<void(Views&)> mutate;
  };
  const Bad bads[] = {
      {"o_b head_dim", "o_b.shape[3]", [](Views& v) { v.ob.shape[3] = 8; }},
      {"o_out seqlen", "o_out.shape[1]", [](Views& v) { v.oo.shape[1] = 2; }},
      {"lse_a dtype", "lse_a.dtype", [](Views& v) { v.la.dtype = DType::f16; }},
      {"lse_b shape", "lse_b.shape[2]", [](Views& v) { v.lb.shape[2] = 1; }},
      {"lse_a missing", "lse_a", [](Views& v) { v.la = TensorView{}; }},
      {"o_out int dtype", "o_out.dtype", [](Views& v) { v.oo.dtype = DType::i32; }},
      {"o_a int32", "o_a.dtype", [](Views& v) { v.oa.dtype = DType::i32; }},
      {"o_out stride 0", "o_out.stride[1]", [](Views& v) { v.oo.stride[1] = 0; }},
      {"lse_out on another device", "lse_out.device", [](Views& v) { v.lo.device = Device::cuda; }},
      {"head_dim past 512", "o_a.shape[3]",
       [](Views& v) { v.oa.shape[3] = v.ob.shape[3] = v.oo.shape[3] = 1024; }},
  };
  for (const Bad& bad : bads) {
    oo.poison();
    lo.poison();
    Views v{oa.view({B, S, H, D}), la.view({B, H, S}), ob.view({B, S, H, D}), lb.view({B, H, S}), oo.view({B, S, H, D}),
            lo.view({B, H, S})};
    bad.mutate(v);
    try {
      merge_states(v.oa, v.la, v.ob, v.lb, v.oo, v.lo);
      ADD_FAILURE() << bad.what << ": accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad.argument), std::string::npos) << bad.what << ": " << e.what();
    }
    for (int64_t i = 0; i < oo.count(); ++i) ASSERT_TRUE(std::isnan(oo.get(i))) << bad.what;
    for (int64_t i = 0; i < lo.count(); ++i) ASSERT_TRUE(std::isnan(lo.get(i))) << bad.what;
  }
}

// The log line / KernelChoice names the kernel and the split decision.
TEST(DecodeDispatch, KernelChoiceNamesSplitsAndLayout) {
  Spec c = mk("choice", DType::bf16);
  c.hq = 32;
  c.hkv = 8;
  c.d = 128;
  c.lens = {64};
  c.page_size = 16;
  Built bl(c, make_values(c, 1));
  KernelChoice k = bl.run(7);
  EXPECT_NE(k.kernel.find("cpu/splitkv"), std::string::npos) << k.kernel;
  EXPECT_NE(k.kernel.find("bf16 hdim128 gqa4 page16"), std::string::npos) << k.kernel;
  EXPECT_NE(k.kernel.find("splits 7"), std::string::npos) << k.kernel;
  EXPECT_NE(k.reason.find("requested"), std::string::npos) << k.reason;
  k = bl.run(0);
  EXPECT_NE(k.reason.find("heuristic"), std::string::npos) << k.reason;
}

}  // namespace
}  // namespace ioattn::test

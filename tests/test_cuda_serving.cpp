// Serving on CUDA: split-KV decode over paged / contiguous / 8-bit caches, plans + CUDA-graph
// capture, append_kv and merge_states, against the float64 reference and against the CPU backend
// on the same inputs. The problem builder (Built: host buffers mirrored on the device), the
// reference and the tolerance check are serving_common.hpp's, shared with test_serving.cpp; CUDA
// specs use twice the CPU test's tolerance (tol_mul = 2). Outputs are poisoned with NaN before
// every run and unused cache slots / pages hold NaN, so a read outside the live tokens shows up.
// Without a GPU every test prints "skipped: no CUDA device" (ctest reports it as skipped).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/serving_problem.hpp"
#include "ioattn/serving.hpp"
#include "serving_common.hpp"

namespace ioattn::test {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (!cuda_available()) GTEST_SKIP() << "skipped: no CUDA device"

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

Spec on_cuda(Spec c) {
  c.device = Device::cuda;
  c.tol_mul = 2.0;
  return c;
}

// Max |a - b| allowed between the CUDA and the CPU backend on the same inputs: fp32 accumulation
// order (f32), plus up to two roundings of O to its dtype (f16 / bf16 near |O| ~ 1).
double backend_tol(DType t) { return t == DType::f32 ? 2e-5 : t == DType::f16 ? 2e-3 : 1.6e-2; }

bool all_nan(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isnan(x); });
}

// Sets IOATTN_DECODE_KERNEL for a scope ("" = unset: the dispatcher's choice).
struct KernelEnv {
  explicit KernelEnv(const std::string& k) {
    if (k.empty())
      unsetenv("IOATTN_DECODE_KERNEL");
    else
      setenv("IOATTN_DECODE_KERNEL", k.c_str(), 1);
  }
  ~KernelEnv() { unsetenv("IOATTN_DECODE_KERNEL"); }
};

// The kernel the dispatcher picks by default: mma for bf16/f16 with the same cache dtype,
// head_dim == head_dim_v in {64, 128, 256} and one visible range per CTA; fma otherwise.
bool mma_shape(const Spec& c) {
  const bool masked = c.causal || c.wl >= 0 || c.wr >= 0;
  const bool cache_ok = c.cache == c.dtype || c.cache == DType::f8e4m3 || c.cache == DType::i8;
  return (c.dtype == DType::bf16 || c.dtype == DType::f16) && cache_ok && c.DV() == c.d &&
         (c.d == 64 || c.d == 128 || c.d == 256) && (c.sq == 1 || !masked);
}

// Device buffer of raw bytes (workspace), freed on scope exit.
struct DeviceBytes {
  void* ptr = nullptr;
  explicit DeviceBytes(size_t n) { ptr = detail::cuda_malloc(std::max<size_t>(n, 1)); }
  ~DeviceBytes() { detail::cuda_free(ptr); }
};

// ---- decode vs the float64 reference and vs the CPU backend ---------------------------------

std::vector<Spec> cuda_cases() {
  std::vector<Spec> v = reference_cases();
  // GQA shapes of the benchmark and the row-block paths: 8 rows (2 blocks), MQA 32/1 (8 blocks),
  // and one kv head with 16 query tokens x 8 heads (32 blocks).
  { Spec c = mk("gqa64_8_bf16", DType::bf16); c.hq = 64; c.hkv = 8; c.d = 128; c.lens = {1500, 9}; c.page_size = 16; v.push_back(c); }
  { Spec c = mk("mqa32_1_bf16", DType::bf16); c.hq = 32; c.hkv = 1; c.d = 128; c.lens = {700, 0, 33}; c.page_size = 64; v.push_back(c); }
  { Spec c = mk("mqa32_1_f16_causal_sq4", DType::f16); c.hq = 32; c.hkv = 1; c.d = 64; c.sq = 4; c.causal = true; c.lens = {300, 4}; v.push_back(c); }
  { Spec c = mk("hdim64_bf16_page1", DType::bf16); c.hq = 16; c.hkv = 4; c.lens = {129, 1, 64}; c.page_size = 1; v.push_back(c); }
  { Spec c = mk("hdim256_bf16_f8", DType::bf16); c.d = 256; c.cache = DType::f8e4m3; c.lens = {500, 2}; c.page_size = 16; v.push_back(c); }
  { Spec c = mk("hdim32_i8_f16", DType::f16); c.d = 32; c.cache = DType::i8; c.lens = {257, 31}; c.page_size = 16; v.push_back(c); }
  // The mma kernel on 8-bit caches (codes -> f16 in registers, permuted dims, bf16 q rescaled
  // into the f16 range): the benchmark's GQA 32/8 shape, 16 rows (two n-tiles) of int8, 4 tokens
  // x 4 heads with ALiBi, and bf16 queries far beyond and far below the f16 range (each row is
  // scaled by its own power of two).
  { Spec c = mk("f8_gqa32_8_bf16", DType::bf16); c.hq = 32; c.hkv = 8; c.d = 128; c.cache = DType::f8e4m3; c.lens = {1500, 9, 0}; c.page_size = 16; v.push_back(c); }
  { Spec c = mk("i8_group16_f16", DType::f16); c.hq = 32; c.hkv = 2; c.d = 64; c.cache = DType::i8; c.lens = {700, 3}; v.push_back(c); }
  { Spec c = mk("f8_sq4_alibi_f16", DType::f16); c.hq = 8; c.hkv = 2; c.sq = 4; c.d = 128; c.cache = DType::f8e4m3; c.alibi = true; c.lens = {600, 4}; c.page_size = 64; v.push_back(c); }
  { Spec c = mk("f8_tinyq_bf16", DType::bf16); c.hq = 8; c.hkv = 2; c.d = 64; c.cache = DType::f8e4m3; c.q_range = 1e-6f; c.scale = 0.1f / (1e-6f * 1e-6f); c.lens = {300, 17}; v.push_back(c); }
  { Spec c = mk("f8_bigq_bf16", DType::bf16); c.hq = 8; c.hkv = 2; c.d = 128; c.cache = DType::f8e4m3; c.q_range = 40000.0f; c.scale = 0.1f / (40000.0f * 40000.0f); c.lens = {300, 17}; c.page_size = 16; v.push_back(c); }
  // The mma kernel: 16 rows of 4 tokens x 4 heads without a mask, ALiBi with one token, f16 hdim 256.
  { Spec c = mk("sq4_nomask_f16", DType::f16); c.hq = 8; c.hkv = 2; c.sq = 4; c.d = 128; c.lens = {600, 4, 0}; c.page_size = 16; v.push_back(c); }
  { Spec c = mk("alibi_sq1_softcap_bf16", DType::bf16); c.alibi = true; c.softcap = 5.0f; c.q_range = 3.0f; c.hq = 16; c.hkv = 4; c.lens = {333, 70}; c.page_size = 16; v.push_back(c); }
  { Spec c = mk("hdim256_f16_sinks", DType::f16); c.d = 256; c.sinks = true; c.lens = {1000, 1, 0}; c.page_size = 16; v.push_back(c); }
  // q head strides that rule out the mma kernel's wide q loads (8 bytes per lane for 8-bit caches,
  // 4 for 16-bit ones: serving_decode_mma.cu's grid-uniform alignment test), so its 16-bit
  // fallback runs: an odd stride (every load path), and a stride of d + 2 (4-byte aligned, not
  // 8: the 16-bit cache keeps its wide loads, the 8-bit one falls back).
  { Spec c = mk("oddq_stride_bf16", DType::bf16); c.hq = 32; c.hkv = 8; c.d = 128; c.pad_head = 3; c.lens = {700, 5}; c.page_size = 16; v.push_back(c); }
  { Spec c = mk("oddq_stride_f8_f16", DType::f16); c.hq = 8; c.hkv = 2; c.d = 64; c.cache = DType::f8e4m3; c.pad_head = 1; c.lens = {300, 17}; v.push_back(c); }
  { Spec c = mk("q_stride_d2_f8_bf16", DType::bf16); c.hq = 32; c.hkv = 8; c.d = 128; c.cache = DType::f8e4m3; c.pad_head = 2; c.lens = {900, 1}; c.page_size = 16; v.push_back(c); }
  { Spec c = mk("q_stride_d2_bf16", DType::bf16); c.hq = 16; c.hkv = 4; c.d = 128; c.pad_head = 2; c.lens = {400, 33}; v.push_back(c); }
  for (Spec& c : v) c = on_cuda(c);
  return v;
}

class CudaDecodeReference : public ::testing::TestWithParam<Spec> {};

// Every case on the kernel the dispatcher picks and, where that is the mma kernel, on the FMA
// kernel too (IOATTN_DECODE_KERNEL=fma), each with the
// heuristic / the case's split count, 1 and 5.
TEST_P(CudaDecodeReference, MatchesFloat64ReferenceAndTheCpu) {
  SKIP_WITHOUT_GPU();
  const Spec& c = GetParam();
  const Values vals = make_values(c, 42);
  Built gpu(c, vals);
  Spec cc = c;
  cc.device = Device::cpu;
  Built cpu(cc, vals);
  std::vector<std::string> modes = {""};
  if (mma_shape(c)) {
    modes.push_back("fma");
  }
  for (const std::string& mode : modes) {
    KernelEnv env(mode);
    const std::string want = mode.empty() ? (mma_shape(c) ? " mma" : " fma") : " " + mode;
    for (int splits : {c.splits, 1, 5}) {
      const std::string what = c.name + " kernel" + want + " splits " + std::to_string(splits);
      const KernelChoice k = gpu.run(splits);
      EXPECT_NE(k.kernel.find("cuda/splitkv"), std::string::npos) << k.kernel;
      EXPECT_NE(k.kernel.find(want), std::string::npos) << what << ": " << k.kernel;
      if (splits > 0) EXPECT_NE(k.kernel.find("splits " + std::to_string(splits)), std::string::npos) << k.kernel;
      expect_matches_reference(gpu, what);
      cpu.run(splits);
      EXPECT_LE(max_diff(gpu.outputs(), cpu.outputs()), backend_tol(c.dtype)) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaDecodeReference, ::testing::ValuesIn(cuda_cases()),
                         [](const ::testing::TestParamInfo<Spec>& info) { return info.param.name; });

// Seeded random mixes (serving_common.hpp random_spec): the dispatcher's kernel at the case's split
// count vs the float64 reference and the CPU backend.
class CudaDecodeFuzz : public ::testing::TestWithParam<int> {};

TEST_P(CudaDecodeFuzz, MatchesFloat64ReferenceAndTheCpu) {
  SKIP_WITHOUT_GPU();
  const Spec c = on_cuda(random_spec(static_cast<uint64_t>(GetParam()), true));
  const Values vals = make_values(c, 100 + static_cast<uint64_t>(GetParam()));
  Built gpu(c, vals);
  const KernelChoice k = gpu.run();
  EXPECT_NE(k.kernel.find("cuda/splitkv"), std::string::npos) << k.kernel;
  expect_matches_reference(gpu, c.name + " (" + k.kernel + ")");
  Spec cc = c;
  cc.device = Device::cpu;
  Built cpu(cc, vals);
  cpu.run();
  EXPECT_LE(max_diff(gpu.outputs(), cpu.outputs()), backend_tol(c.dtype)) << c.name << " (" << k.kernel << ")";
}

INSTANTIATE_TEST_SUITE_P(Seeds, CudaDecodeFuzz, ::testing::Range(0, 48),
                         [](const ::testing::TestParamInfo<int>& info) { return "seed" + std::to_string(info.param); });

// ---- decode vs itself ---------------------------------------------------------------------------

TEST(CudaDecode, SplitMatchesUnsplitWithinFp32Rounding) {
  SKIP_WITHOUT_GPU();
  for (int variant = 0; variant < 3; ++variant) {  // fma f32 sq4, fma bf16 sq4, mma bf16 sq1
    const DType t = variant == 0 ? DType::f32 : DType::bf16;
    Spec c = on_cuda(mk("splits", t));
    c.hq = 32;
    c.hkv = 8;
    c.d = 128;
    c.sq = variant == 2 ? 1 : 4;
    c.causal = true;
    c.lens = {0, 4, 17, 2000, 777};
    c.page_size = 16;
    c.sinks = true;
    Built bl(c, make_values(c, 3));
    bl.run(1);
    const auto one = bl.outputs();
    for (int s : {7, 3, 64, 0}) {
      bl.run(s);
      EXPECT_LE(max_diff(one, bl.outputs()), t == DType::f32 ? 4e-6 : 8e-3) << dtype_name(t) << " splits " << s
                                                                              << " variant " << variant;
    }
    expect_matches_reference(bl, std::string("heuristic splits ") + dtype_name(t) + " variant " +
                                     std::to_string(variant));
  }
}

// The kernel's arithmetic does not depend on where a token lives: bitwise equal.
TEST(CudaDecode, PagedEqualsContiguousBitwise) {
  SKIP_WITHOUT_GPU();
  for (int variant = 0; variant < 3; ++variant) {  // fma f32, fma bf16 (sq 2, causal), mma bf16 (sq 1)
    const DType t = variant == 0 ? DType::f32 : DType::bf16;
    Spec c = on_cuda(mk("paged", t));
    c.hq = 8;
    c.hkv = 2;
    c.sq = variant == 2 ? 1 : 2;
    c.causal = true;
    c.lens = {513, 2, 0, 64, 257};
    const Values vals = make_values(c, 11);
    for (int splits : {1, 3}) {
      Built contiguous(c, vals);
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

TEST(CudaDecode, BatchEqualsSingleSequenceBitwise) {
  SKIP_WITHOUT_GPU();
  for (int64_t sq : {3, 1}) {  // fma, mma
    Spec c = on_cuda(mk("batch", DType::bf16));
    c.hq = 8;
    c.hkv = 4;
    c.sq = sq;
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
}

// cache_seqlens 0: O = 0 and LSE = -inf (with a sink: LSE = sink); 1: O = that token's V.
TEST(CudaDecode, EmptyAndSingleTokenSequences) {
  SKIP_WITHOUT_GPU();
  for (bool sinks : {false, true})
    for (DType t : {DType::f32, DType::bf16})
      for (int splits : {1, 4}) {
        Spec c = on_cuda(mk("edge", t));
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
TEST(CudaDecode, MaskedNaNDoesNotLeak) {
  SKIP_WITHOUT_GPU();
  for (int splits : {1, 3}) {
    const Spec c = masked_bad_token_spec(on_cuda(mk("nan", DType::f32)));
    Built bl(c, make_values(c, 2));
    poison_last_token_f32(bl);
    bl.upload();
    bl.run(splits);
    expect_only_last_row_sees_bad_token(bl);
  }
}

// Validation cannot read device tensors, so the kernel bound-checks: a length past the capacity or
// a block-table entry outside the cache poisons that sequence's rows (NaN), and only those.
TEST(CudaDecode, OutOfRangeLengthsAndPagesGiveNaNForThatSequenceOnly) {
  SKIP_WITHOUT_GPU();
  Spec c = on_cuda(mk("bounds", DType::bf16));
  c.hq = 8;
  c.hkv = 2;
  c.lens = {40, 70, 33};
  c.page_size = 16;
  Built bl(c, make_values(c, 6));
  for (int splits : {1, 3}) {
    bl.run(splits);
    for (int which = 0; which < 3; ++which) {
      Built t(c, bl.val);
      if (which == 0) t.lens.fill_i32({40, static_cast<int32_t>(t.capacity + 1), 33});  // past the capacity
      if (which == 1) t.lens.fill_i32({40, -5, 33});                                   // negative
      if (which == 2) {                                                                // a page outside the cache
        t.table[static_cast<size_t>(1 * t.width + 2)] = static_cast<int32_t>(t.pages + 7);
        t.bt.fill_i32(t.table);
      }
      t.run(splits);
      for (int64_t b = 0; b < c.B(); ++b)
        for (int64_t h = 0; h < c.hq; ++h) {
          const float l = t.lse_at(b, h, 0), want = bl.lse_at(b, h, 0);
          if (b == 1)
            EXPECT_TRUE(std::isnan(l)) << "case " << which << " splits " << splits;
          else
            EXPECT_EQ(std::memcmp(&l, &want, 4), 0) << "case " << which << " b" << b;
          for (int64_t x = 0; x < c.DV(); ++x) {
            const float o = t.o_at(b, 0, h, x), w = bl.o_at(b, 0, h, x);
            if (b == 1)
              ASSERT_TRUE(std::isnan(o)) << "case " << which << " splits " << splits;
            else
              ASSERT_EQ(std::memcmp(&o, &w, 4), 0) << "case " << which << " b" << b << " x" << x;
          }
        }
    }
  }
}

// A decode variant chosen by an environment variable (same tiles, same arithmetic) against the
// default, bitwise: bf16 / f16, head_dim 128, 8 and 16 rows per CTA (GQA 4 and 16), contiguous and
// paged (page 1 / 16 / 64) caches of the given lengths, 1 and 3 splits, and (paged) a block-table
// entry outside the cache (NaN for that sequence only); check_base / check_variant look at the two
// kernel choices.
template <class CheckBase, class CheckVariant>
void expect_env_variant_bitwise(const char* env, const char* value, const std::vector<int32_t>& lens, uint64_t seed,
                                CheckBase check_base, CheckVariant check_variant) {
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t hq : {32, 64})  // 4 and 8 rows per kv head: 8-row CTAs; 64/4 = 16 rows: two n-tiles
      for (int64_t ps : {0, 1, 16, 64}) {
        Spec c = on_cuda(mk(std::string(env) + "_" + value, t));
        c.hq = hq;
        c.hkv = hq == 32 ? 8 : 4;
        c.d = 128;
        c.lens = lens;
        c.page_size = ps;
        const Values vals = make_values(c, seed);
        for (int splits : {1, 3}) {
          for (int bad_page = 0; bad_page < (ps ? 2 : 1); ++bad_page) {
            Built base(c, vals), var(c, vals);
            if (bad_page) {
              for (Built* bl : {&base, &var}) {
                bl->table[static_cast<size_t>(0 * bl->width + 1)] = static_cast<int32_t>(bl->pages + 3);
                bl->bt.fill_i32(bl->table);
              }
            }
            {
              ScopedEnv e(env, nullptr);
              check_base(base.run(splits));
            }
            {
              ScopedEnv e(env, value);
              check_variant(var.run(splits));
            }
            const std::string what = std::string(env) + "=" + value + " " + dtype_name(t) + " hq " +
                                     std::to_string(hq) + " page " + std::to_string(ps) + " splits " +
                                     std::to_string(splits) + (bad_page ? " bad page" : "");
            EXPECT_TRUE(bitwise_equal(var.outputs(), base.outputs()))
                << what << ": max diff " << max_diff(var.outputs(), base.outputs());
            if (!bad_page) expect_matches_reference(var, what);
          }
        }
      }
}

// A bad value of an environment switch: the decode call throws an Error naming the variable.
void expect_env_rejected(const char* env, const char* bad) {
  ScopedEnv e(env, bad);
  Spec c = on_cuda(mk(std::string(env) + "_bad", DType::bf16));
  c.lens = {10};
  Built bl(c, make_values(c, 3));
  try {
    bl.run(1);
    ADD_FAILURE() << env << "=" << bad << " accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find(env), std::string::npos) << err.what();
  }
}

// IOATTN_DECODE_LOADER=bulk (sm_90, bf16/f16, head_dim 128): one 1-D bulk copy per K / V row
// instead of cp.async. Same arithmetic on the same bytes, so bitwise equal to the default loader:
// 8 and 16 rows per CTA, contiguous and paged (page 1 / 16 / 64), partial last tiles, empty
// sequences, splits, and a block-table entry outside the cache (NaN for that sequence only).
TEST(CudaDecode, BulkLoaderEqualsCpAsyncBitwise) {
  SKIP_WITHOUT_GPU();
  if (detail::cuda_device_arch(0) < 90) GTEST_SKIP() << "skipped: the bulk loader needs sm_90";
  expect_env_variant_bitwise("IOATTN_DECODE_LOADER", "bulk", {1500, 0, 63, 64, 65, 1}, 21,
                             [](const KernelChoice& k) { EXPECT_EQ(k.kernel.find(" bulk"), std::string::npos) << k.kernel; },
                             [](const KernelChoice& k) {
                               EXPECT_NE(k.kernel.find(" mma bulk"), std::string::npos) << k.kernel;
                               EXPECT_NE(k.reason.find("IOATTN_DECODE_LOADER=bulk"), std::string::npos) << k.reason;
                             });
  // Where it does not apply (head_dim 64) the choice says so and runs the cp.async loader.
  {
    ScopedEnv env("IOATTN_DECODE_LOADER", "bulk");
    Spec c = on_cuda(mk("bulk64", DType::bf16));
    c.lens = {100};
    Built bl(c, make_values(c, 3));
    const KernelChoice k = bl.run(1);
    EXPECT_EQ(k.kernel.find(" bulk"), std::string::npos) << k.kernel;
    EXPECT_NE(k.reason.find("IOATTN_DECODE_LOADER=bulk does not apply"), std::string::npos) << k.reason;
    expect_matches_reference(bl, "bulk requested at head_dim 64");
  }
  expect_env_rejected("IOATTN_DECODE_LOADER", "tma");
}

// IOATTN_DECODE_STAGES=2 (16-bit caches, head_dim 128): the mma kernel with a 2-stage cp.async ring
// (3 CTAs per SM). Same tiles, same arithmetic in the same order: bitwise equal to the 3-stage
// default, for 8 and 16 rows per CTA, contiguous and paged (page 1 / 16 / 64), partial last tiles,
// empty sequences, splits, a single-tile sequence and a bad block-table entry.
TEST(CudaDecode, TwoStageRingEqualsDefaultBitwise) {
  SKIP_WITHOUT_GPU();
  expect_env_variant_bitwise("IOATTN_DECODE_STAGES", "2", {1500, 0, 63, 64, 65, 1, 129}, 23,
                             [](const KernelChoice& k) {
                               EXPECT_EQ(k.kernel.find("stages2"), std::string::npos) << k.kernel;
                               EXPECT_NE(k.reason.find("3-stage cp.async ring"), std::string::npos) << k.reason;
                             },
                             [](const KernelChoice& k) {
                               EXPECT_NE(k.kernel.find(" mma stages2"), std::string::npos) << k.kernel;
                               EXPECT_NE(k.reason.find("2-stage cp.async ring"), std::string::npos) << k.reason;
                             });
  {  // head_dim 64: not the experiment's shape, the default ring runs
    ScopedEnv env("IOATTN_DECODE_STAGES", "2");
    Spec c = on_cuda(mk("stages2_d64", DType::bf16));
    c.lens = {100};
    Built bl(c, make_values(c, 3));
    const KernelChoice k = bl.run(1);
    EXPECT_EQ(k.kernel.find("stages2"), std::string::npos) << k.kernel;
    expect_matches_reference(bl, "IOATTN_DECODE_STAGES=2 at head_dim 64");
  }
  expect_env_rejected("IOATTN_DECODE_STAGES", "4");
}

// A few short sequences (batch * heads_kv * row blocks <= 8, max_seqlen_k <= 4096) take the 2-stage
// ring by default (mma_decode_stages); IOATTN_DECODE_STAGES=3 forces the 3-stage one: bitwise equal.
// Just past the bound (4097 keys) the default is the 3-stage ring.
TEST(CudaDecode, ShortSequencesTakeTheTwoStageRing) {
  SKIP_WITHOUT_GPU();
  expect_env_variant_bitwise("IOATTN_DECODE_STAGES", "3", {4000}, 31,
                             [](const KernelChoice& k) {
                               EXPECT_NE(k.kernel.find(" mma stages2"), std::string::npos) << k.kernel;
                               EXPECT_NE(k.reason.find("2-stage cp.async ring"), std::string::npos) << k.reason;
                             },
                             [](const KernelChoice& k) {
                               EXPECT_EQ(k.kernel.find("stages2"), std::string::npos) << k.kernel;
                               EXPECT_NE(k.reason.find("3-stage cp.async ring"), std::string::npos) << k.reason;
                             });
  Spec c = on_cuda(mk("short_4097", DType::bf16));
  c.hq = 32, c.hkv = 8, c.d = 128, c.lens = {4097};
  Built bl(c, make_values(c, 5));
  const KernelChoice k = bl.run();
  EXPECT_EQ(k.kernel.find("stages2"), std::string::npos) << k.kernel;
  expect_matches_reference(bl, "short_4097");
}

// IOATTN_DECODE_STAGES=5 (16-bit caches, head_dim 128): a 5-stage ring, one CTA per SM with four
// tiles in flight. Bitwise equal to the default as above.
TEST(CudaDecode, FiveStageRingEqualsDefaultBitwise) {
  SKIP_WITHOUT_GPU();
  expect_env_variant_bitwise("IOATTN_DECODE_STAGES", "5", {1500, 0, 63, 64, 65, 1, 129, 700}, 29,
                             [](const KernelChoice& k) {
                               EXPECT_EQ(k.kernel.find("stages5"), std::string::npos) << k.kernel;
                               EXPECT_NE(k.reason.find("3-stage cp.async ring"), std::string::npos) << k.reason;
                             },
                             [](const KernelChoice& k) {
                               EXPECT_NE(k.kernel.find(" mma stages5"), std::string::npos) << k.kernel;
                               EXPECT_NE(k.reason.find("5-stage cp.async ring"), std::string::npos) << k.reason;
                             });
}

// ---- 8-bit KV --------------------------------------------------------------------------------

// As DecodeQuant.EightBitWithinQuantisationBound (test_serving.cpp): at fp32 level against the
// dequantised values, and within the quantisation bound against the original ones.
TEST(CudaDecode, EightBitWithinQuantisationBound) {
  SKIP_WITHOUT_GPU();
  for (DType cache : {DType::f8e4m3, DType::i8})
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      Spec c = on_cuda(mk("q8", t));
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
      expect_matches_reference(bl, std::string("vs dequantised ") + dtype_name(cache) + " " + dtype_name(t));
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
        for (int64_t tk = 0; tk < c.lens[static_cast<size_t>(b)]; ++tk) {
          double s = 0;
          for (int64_t x = 0; x < c.d; ++x) {
            const size_t e = static_cast<size_t>((tk * c.hkv + h / g) * c.d + x);
            s += std::fabs(bl.val.q[static_cast<size_t>(((b * c.sq + i) * c.hq + h) * c.d + x)]) *
                 std::fabs(static_cast<double>(kd[e]) - ko[e]);
          }
          worst = std::max(worst, scale * s);
        }
        return worst;
      };
      expect_matches_reference(
          bl, std::string("vs original ") + dtype_name(cache), /*use_original=*/true,
          [&](int64_t b, int64_t h, int64_t i) { return ev + (std::exp(2 * delta(b, h, i)) - 1) * vmax; },
          [&](int64_t b, int64_t h, int64_t i) { return delta(b, h, i); });
    }
}

// ---- plans and CUDA graphs -------------------------------------------------------------------

Spec plan_spec() {
  Spec c = on_cuda(mk("plan", DType::bf16));
  c.hq = 32;
  c.hkv = 8;
  c.d = 128;
  c.sq = 2;
  c.causal = true;
  c.lens = {1700, 5, 0, 300};
  c.page_size = 16;
  return c;
}

TEST(CudaDecodePlan, ReuseGivesIdenticalResultsAndMatchesUnplanned) {
  SKIP_WITHOUT_GPU();
  const Spec c = plan_spec();
  Built bl(c, make_values(c, 4));
  for (int splits : {0, 1, 6}) {
    DecodeOptions opt;
    opt.num_splits = splits;
    const DecodePlan plan =
        plan_decode(c.B(), c.hq, c.hkv, c.d, c.DV(), c.sq, bl.capacity, c.page_size, Device::cuda, opt);
    EXPECT_GE(plan.num_splits, 1);
    if (splits) EXPECT_EQ(plan.num_splits, splits);
    EXPECT_EQ(plan.workspace_bytes,
              detail::cuda_decode_workspace_bytes(c.B(), c.hq, c.sq, c.DV(), plan.num_splits));
    DeviceBytes ws(plan.workspace_bytes);
    std::vector<float> first;
    for (int rep = 0; rep < 5; ++rep) {
      bl.o.poison();
      bl.lse.poison();
      const KernelChoice k = decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, plan, ws.ptr);
      bl.download();
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

// Capture decode under a plan into a CUDA graph; replays give bitwise the eager result, and a
// replay after the lengths (device memory) change decodes the new lengths.
void graph_replay(cudaStreamCaptureMode mode, const Spec& c) {
  Built bl(c, make_values(c, 9));
  const std::vector<int32_t> full = c.lens;
  std::vector<int32_t> shorter = full;
  for (int32_t& L : shorter) L = L > 3 ? L - 3 : L;
  for (int splits : {1, 5}) {
    DecodeOptions opt;
    opt.num_splits = splits;
    const DecodePlan plan =
        plan_decode(c.B(), c.hq, c.hkv, c.d, c.DV(), c.sq, bl.capacity, c.page_size, Device::cuda, opt);
    DeviceBytes ws(plan.workspace_bytes);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Context ctx;
    ctx.stream = stream;
    // Eager references at both lengths.
    std::vector<float> eager_short, eager_full;
    for (int pass = 0; pass < 2; ++pass) {
      bl.lens.fill_i32(pass == 0 ? shorter : full);
      bl.o.poison();
      bl.lse.poison();
      decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, plan, ws.ptr, ctx);
      CUDA_OK(cudaStreamSynchronize(stream));
      bl.download();
      (pass == 0 ? eager_short : eager_full) = bl.outputs();
    }
    // Capture with the short lengths in place (the graph must not bake them in).
    bl.lens.fill_i32(shorter);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream, mode));
    decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, plan, ws.ptr, ctx);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int pass = 0; pass < 4; ++pass) {  // short, full, short, full
      bl.lens.fill_i32(pass % 2 ? full : shorter);
      bl.o.poison();
      bl.lse.poison();
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      bl.download();
      EXPECT_TRUE(bitwise_equal(bl.outputs(), pass % 2 ? eager_full : eager_short))
          << "splits " << splits << " replay " << pass << ": max diff "
          << max_diff(bl.outputs(), pass % 2 ? eager_full : eager_short);
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(stream));
    Spec now = c;
    now.lens = full;
    now.device = Device::cpu;
    const Built ref_view(now, bl.val);
    expect_matches_reference(ref_view, "graph replay splits " + std::to_string(splits), false, nullptr, nullptr, &bl);
  }
}

// Relaxed capture allows any runtime call on this thread; global capture (PyTorch's default)
// refuses "potentially unsafe" ones, so it also checks that decode under a plan makes none.
TEST(CudaDecodePlan, GraphReplayEqualsEagerBitwiseRelaxedCapture) {
  SKIP_WITHOUT_GPU();
  graph_replay(cudaStreamCaptureModeRelaxed, plan_spec());
}

TEST(CudaDecodePlan, GraphReplayEqualsEagerBitwiseGlobalCapture) {
  SKIP_WITHOUT_GPU();
  Spec mma = plan_spec();  // sq 1: the mma kernel
  mma.sq = 1;
  graph_replay(cudaStreamCaptureModeGlobal, plan_spec());
  graph_replay(cudaStreamCaptureModeGlobal, mma);
}

TEST(CudaDecodePlan, MismatchedPlanIsRejectedNamingPlan) {
  SKIP_WITHOUT_GPU();
  const Spec c = plan_spec();
  Built bl(c, make_values(c, 4));
  const auto make = [&](int64_t batch, int64_t hq, int64_t sq, int64_t ps, Device dev) {
    DecodeOptions opt;
    opt.num_splits = 4;
    return plan_decode(batch, hq, c.hkv, c.d, c.DV(), sq, bl.capacity, ps, dev, opt);
  };
  const DecodePlan good = make(c.B(), c.hq, c.sq, c.page_size, Device::cuda);
  DeviceBytes ws(good.workspace_bytes + 4096);
  DecodePlan tampered = good;
  tampered.num_splits += 1;
  DecodePlan small_ws = good;
  small_ws.workspace_bytes = 64;
  small_ws.fingerprint = 0;  // edited: the fingerprint catches it first
  struct Bad {
    const char* what;
    DecodePlan plan;
    const char* says;
  };
  const std::vector<Bad> bad = {
      {"batch", make(c.B() + 1, c.hq, c.sq, c.page_size, Device::cuda), "batch"},
      {"heads_q", make(c.B(), 2 * c.hq, c.sq, c.page_size, Device::cuda), "heads_q"},
      {"seqlen_q", make(c.B(), c.hq, 1, c.page_size, Device::cuda), "seqlen_q"},
      {"page_size", make(c.B(), c.hq, c.sq, 32, Device::cuda), "page_size"},
      {"cpu plan", make(c.B(), c.hq, c.sq, c.page_size, Device::cpu), "device"},
      {"edited plan", tampered, "fingerprint"},
      {"edited workspace size", small_ws, "fingerprint"},
  };
  for (const Bad& b : bad) {
    bl.o.poison();
    bl.lse.poison();
    try {
      decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, b.plan, ws.ptr);
      ADD_FAILURE() << b.what << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "plan") << b.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos) << b.what << ": " << e.what();
    }
    bl.download();
    EXPECT_TRUE(all_nan(bl.outputs())) << b.what << ": outputs written";
  }
  // A host workspace, a null workspace.
  std::vector<uint8_t> host(good.workspace_bytes + 64);
  void* host_ptr = host.data() + (64 - reinterpret_cast<uintptr_t>(host.data()) % 64) % 64;
  for (void* w : {host_ptr, static_cast<void*>(nullptr)}) {
    try {
      decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, good, w);
      ADD_FAILURE() << "bad workspace accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "workspace") << e.what();
    }
  }
}

// The heuristic's documented examples (serving_decode.cu) on a 132-SM H200; bounds elsewhere.
TEST(CudaDecodePlan, SplitHeuristic) {
  SKIP_WITHOUT_GPU();
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::string why;
  // (batch, heads_q, heads_kv, seqlen_q, max_seqlen_k, cache dtype, head_dim, paged)
  auto splits = [](int64_t b, int64_t L, DType cache = DType::bf16, bool paged = false, std::string* w = nullptr) {
    return detail::cuda_decode_num_splits(b, 32, 8, 1, L, cache, 128, 128, paged, 0, w);
  };
  const int s = splits(1, 4096, DType::bf16, false, &why);
  EXPECT_NE(why.find(std::to_string(sms) + " SMs"), std::string::npos) << why;
  EXPECT_GE(s, 1);
  EXPECT_LE(s, 32);  // chunks >= 128 tokens
  EXPECT_EQ(splits(4096, 32768), 1);
  EXPECT_EQ(splits(4096, 32768, DType::f8e4m3, true), 1);
  EXPECT_EQ(detail::cuda_decode_num_splits(1, 1, 1, 1, 100, DType::bf16, 128, 128, false, 0, nullptr), 1);
  EXPECT_EQ(detail::cuda_decode_num_splits(0, 8, 8, 1, 0, DType::bf16, 128, 128, false, 0, nullptr), 1);
  // multi-token decode (the FMA kernel when masked) keeps the wave model: 4 sequences x 8 kv heads x
  // 4 row blocks put a CTA on ~every SM, and still split
  if (sms == 132) EXPECT_GE(detail::cuda_decode_num_splits(4, 32, 8, 4, 32768, DType::bf16, 128, 128, false, 0, nullptr), 2);
  // a contiguous 16-bit cache with a CTA on ~every SM runs unsplit, and the reason says why
  std::string why16;
  EXPECT_EQ(splits(sms, 32768, DType::f16, false, &why16), 1);
  EXPECT_NE(why16.find("unsplit"), std::string::npos) << why16;
  if (sms == 132) {
    EXPECT_EQ(s, 32);
    EXPECT_EQ(splits(1, 131072), 32);
    EXPECT_EQ(splits(16, 32768), 1);
    EXPECT_EQ(splits(16, 32768, DType::bf16, true), 2);  // paged: the wave model
    EXPECT_EQ(splits(64, 32768), 1);
    EXPECT_EQ(splits(128, 32768), 1);
    EXPECT_GE(splits(64, 32768, DType::f8e4m3), 2);  // 8-bit: 3 CTAs per SM, 512 per split
    // GQA 8 (64 / 8): one 8-row mma CTA per (sequence, kv head), so batch 8 is 64 CTAs: split
    EXPECT_GE(detail::cuda_decode_num_splits(8, 64, 8, 1, 32768, DType::bf16, 128, 128, false, 0, nullptr), 2);
  }
}

// ---- append_kv -------------------------------------------------------------------------------

// append_kv on the device, then decode == decode over the directly built cache: the same cache
// bytes as the host quantiser (the unused slots keep their poison), the same outputs.
TEST(CudaAppendKv, AppendThenDecodeEqualsDirectCache) {
  SKIP_WITHOUT_GPU();
  struct Combo {
    DType q, cache, input;
    int64_t page_size;
    bool i64;
  };
  const Combo combos[] = {{DType::f32, DType::f32, DType::f32, 16, false},   {DType::bf16, DType::bf16, DType::bf16, 16, true},
                          {DType::bf16, DType::bf16, DType::f32, 0, false},  {DType::f32, DType::f8e4m3, DType::f32, 16, false},
                          {DType::bf16, DType::f8e4m3, DType::bf16, 1, true}, {DType::f32, DType::i8, DType::f32, 0, false},
                          {DType::f16, DType::i8, DType::f16, 16, false},     {DType::f16, DType::f16, DType::f16, 64, false}};
  for (const Combo& cb : combos) {
    Spec c = on_cuda(mk("append", cb.q));
    c.cache = cb.cache;
    c.hq = 8;
    c.hkv = 2;
    c.sq = 2;
    c.causal = true;
    c.lens = {100, 0, 33, 2};
    c.page_size = cb.page_size;
    const std::string what = std::string(dtype_name(cb.input)) + "->" + dtype_name(cb.cache) + " page" +
                             std::to_string(cb.page_size) + (cb.i64 ? " i64" : " i32");
    const Values vals = make_values(c, 13);
    Built direct(c, vals), appended(c, vals);
    appended.clear_cache();
    const NewTokens n = all_tokens(appended, 6, 5);
    detail::Buffer kn(cb.input, static_cast<int64_t>(n.k.size()), Device::cuda),
        vn(cb.input, static_cast<int64_t>(n.v.size()), Device::cuda);
    for (size_t i = 0; i < n.k.size(); ++i) kn.set(static_cast<int64_t>(i), n.k[i]);
    for (size_t i = 0; i < n.v.size(); ++i) vn.set(static_cast<int64_t>(i), n.v[i]);
    kn.upload();
    vn.upload();
    detail::Buffer slots(cb.i64 ? DType::i64 : DType::i32, n.T, Device::cuda);
    for (int64_t t = 0; t < n.T; ++t) {
      if (cb.i64)
        static_cast<int64_t*>(slots.host())[t] = n.slots[static_cast<size_t>(t)];
      else
        static_cast<int32_t*>(slots.host())[t] = n.slots[static_cast<size_t>(t)];
    }
    slots.upload();
    const KernelChoice k =
        append_kv(kn.view({n.T, c.hkv, c.d}), vn.view({n.T, c.hkv, c.DV()}), slots.view({n.T}), appended.cache);
    EXPECT_NE(k.kernel.find("cuda/append_kv"), std::string::npos) << k.kernel;
    appended.kc.download();
    appended.vc.download();
    EXPECT_TRUE(bytes_of(appended.kc) == bytes_of(direct.kc)) << what << ": k cache bytes differ";
    EXPECT_TRUE(bytes_of(appended.vc) == bytes_of(direct.vc)) << what << ": v cache bytes differ";
    direct.run(3);
    appended.run(3);
    EXPECT_TRUE(bitwise_equal(direct.outputs(), appended.outputs())) << what;
    expect_matches_reference(appended, what);
  }
}

// decode's fused append (KVCache::k_new / v_new) on the device: the cache bytes and outputs of
// append_kv + decode (float and 8-bit caches, paged and contiguous, 1 or 2 new tokens, an empty
// sequence in the batch, split and not), the sq-16 kernel row too.
TEST(CudaDecodeFusedAppend, EqualsAppendThenDecode) {
  SKIP_WITHOUT_GPU();
  fused_append_sweep(on_cuda, 8);
  Spec c = plan_spec();
  c.sq = 16;
  c.lens = {1700, 16, 0, 300};  // every live sequence holds the 16 new tokens
  expect_fused_append_equals_direct(c, 16, 0, "plan_spec sq 16, 16 new tokens");
}

// ---- more than 16 query rows: the flash forward's KV-cache mode --------------------------------

// The CPU's cases that the CUDA kernel takes (f16 / bf16 q, head_dim == head_dim_v), and shapes of
// its own: the hdim 128 / 256 tiles and a zero-padded head_dim 96, several query blocks (300 rows:
// 3 blocks of 128) against ragged lengths with an empty sequence, page sizes 1 / 3 (not a power of
// two) / 16 / 64 / 256 and contiguous caches, 8-bit codes with either q dtype, a window, MQA, and
// lengths below seqlen_q (rows before the first key see nothing: O = 0, LSE = -inf).
std::vector<Spec> cuda_prefill_cases() {
  std::vector<Spec> v;
  for (const Spec& c : cache_prefill_cases())
    if (c.dtype != DType::f32 && c.DV() == c.d) v.push_back(c);
  { Spec c = mk("d128_sq300_page64_bf16", DType::bf16); c.d = 128; c.hq = 8; c.hkv = 2; c.sq = 300; c.causal = true;
    c.lens = {1000, 0, 300, 517}; c.page_size = 64; v.push_back(c); }
  { Spec c = mk("d256_page3_f16", DType::f16); c.d = 256; c.hq = 4; c.hkv = 4; c.sq = 70; c.lens = {70, 200};
    c.page_size = 3; v.push_back(c); }
  { Spec c = mk("d96_window_contiguous_mqa_bf16", DType::bf16); c.d = 96; c.hq = 4; c.hkv = 1; c.sq = 129;
    c.causal = true; c.wl = 50; c.lens = {129, 400}; v.push_back(c); }
  { Spec c = mk("d128_f8e4m3_f16_page16", DType::f16); c.d = 128; c.cache = DType::f8e4m3; c.hq = 8; c.hkv = 2;
    c.sq = 64; c.causal = true; c.lens = {64, 333}; c.page_size = 16; v.push_back(c); }
  { Spec c = mk("d256_i8_bf16_page256", DType::bf16); c.d = 256; c.cache = DType::i8; c.sq = 33; c.lens = {33, 600};
    c.page_size = 256; v.push_back(c); }
  { Spec c = mk("d64_softcap_alibi_sinks_page1_f16", DType::f16); c.sq = 17; c.softcap = 3.0f; c.alibi = true;
    c.sinks = true; c.q_range = 3.0f; c.lens = {17, 1023}; c.page_size = 1; v.push_back(c); }
  { Spec c = mk("d64_len_below_sq_bf16", DType::bf16); c.sq = 40; c.causal = true; c.lens = {10, 0, 41};
    c.page_size = 16; v.push_back(c); }
  { Spec c = mk("d256_f8e4m3_bf16_contiguous", DType::bf16); c.d = 256; c.cache = DType::f8e4m3; c.hq = 4; c.hkv = 2;
    c.sq = 50; c.causal = true; c.lens = {50, 129}; v.push_back(c); }
  { Spec c = mk("d128_i8_f16_page64_padded_heads", DType::f16); c.d = 128; c.cache = DType::i8; c.hq = 8; c.hkv = 2;
    c.sq = 130; c.lens = {400, 130}; c.page_size = 64; c.pad_head = 8; v.push_back(c); }
  // 8-bit head dims below the tile's: 96 (zero-filled columns, staged too) and 72 (not a multiple
  // of 16: the staged variant does not apply, the register path runs).
  { Spec c = mk("d96_i8_bf16_page16", DType::bf16); c.d = 96; c.cache = DType::i8; c.hq = 4; c.hkv = 2; c.sq = 40;
    c.causal = true; c.lens = {40, 300}; c.page_size = 16; v.push_back(c); }
  { Spec c = mk("d72_f8e4m3_f16_contiguous", DType::f16); c.d = 72; c.cache = DType::f8e4m3; c.hq = 2; c.hkv = 1;
    c.sq = 33; c.lens = {33, 100}; v.push_back(c); }
  // Shapes for the sm90 KV-cache rows too (session 27): hdim 256 with 80-key blocks in 16-row page
  // pieces, f16 with a sliding window over 8-row pages, page 128 at hdim 128 (one piece per block).
  { Spec c = mk("d256_page16_causal_bf16", DType::bf16); c.d = 256; c.hq = 4; c.hkv = 2; c.sq = 90; c.causal = true;
    c.lens = {90, 333, 0}; c.page_size = 16; v.push_back(c); }
  { Spec c = mk("d64_window_page8_f16", DType::f16); c.hq = 6; c.hkv = 2; c.sq = 70; c.causal = true; c.wl = 45;
    c.lens = {70, 250}; c.page_size = 8; v.push_back(c); }
  { Spec c = mk("d128_page128_softcap_f16", DType::f16); c.d = 128; c.sq = 150; c.softcap = 4.0f; c.lens = {700, 150};
    c.page_size = 128; v.push_back(c); }
  for (Spec& c : v) c = on_cuda(c);
  return v;
}

class CudaDecodeCachePrefill : public ::testing::TestWithParam<Spec> {};

// Against the float64 reference and the CPU backend on the same inputs, and with the chunk's own
// tokens appended in the same call (bitwise the same outputs and cache bytes as appending first).
TEST_P(CudaDecodeCachePrefill, MatchesFloat64ReferenceAndTheCpu) {
  SKIP_WITHOUT_GPU();
  const Spec& c = GetParam();
  const Values vals = make_values(c, 43);
  Built gpu(c, vals);
  const KernelChoice k = gpu.run();
  EXPECT_NE(k.kernel.find("cuda/flash cache-prefill"), std::string::npos) << k.kernel;
  EXPECT_NE(k.reason.find("seqlen_q " + std::to_string(c.sq)), std::string::npos) << k.reason;
  const ForwardTol tol = forward_tol(gpu);
  expect_matches_reference(gpu, c.name, false, tol.extra_o(), tol.extra_lse());
  const bool short_len = std::any_of(c.lens.begin(), c.lens.end(), [&](int32_t L) { return L != 0 && L < c.sq; });
  if (!short_len) {  // (the CPU refuses a length below seqlen_q)
    Spec cc = c;
    cc.device = Device::cpu;
    Built cpu(cc, vals);
    cpu.run();
    EXPECT_LE(max_diff(gpu.outputs(), cpu.outputs()), 2 * std::max(tol.o, tol.lse) + backend_tol(c.dtype)) << c.name;
    expect_fused_append_equals_direct(c, c.sq, 0, c.name + " +append", tol.extra_o(), tol.extra_lse());
  }
  // Bitwise the same on a second run (no atomics, fixed order).
  const std::vector<float> first = gpu.outputs();
  gpu.run();
  EXPECT_TRUE(bitwise_equal(first, gpu.outputs())) << c.name;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaDecodeCachePrefill, ::testing::ValuesIn(cuda_prefill_cases()),
                         [](const ::testing::TestParamInfo<Spec>& info) { return info.param.name; });

// On sm_90 the Hopper kernel's KV-cache rows take the 16-bit caches of q's dtype at head_dim 64 /
// 128 / 256: read directly when contiguous or when the page size is a multiple of 8 that divides
// the key block (128; 80 at head_dim 256) or is a multiple of it and the pieces (min(page, block))
// have >= 64 rows (IOATTN_SM90_CACHE=1: any such pieces); every other paged cache, and the 8-bit
// caches, through the gathered copy where it is on (kSm90CacheGatherByDefault, or
// IOATTN_SM90_CACHE_GATHER=1: then every paged cache; =0: none). The rest run on the mma.sync cache
// mode, whose reason says why the wgmma one did not. All against the float64 reference;
// IOATTN_SM90_CACHE=0 sends everything to mma.sync.
TEST(CudaDecodeCachePrefill, Sm90RowsTakeSixteenBitCaches) {
  SKIP_WITHOUT_GPU();
  if (detail::cuda_device_arch(0) != 90) GTEST_SKIP() << "skipped: the wgmma rows need sm_90";
  int sm90 = 0, mma = 0, sm90_default = 0, gathered_default = 0;
  for (const Spec& c : cuda_prefill_cases()) {
    const int64_t block_n = c.d == 256 ? 80 : 128, ps = c.page_size;
    const bool eight_bit = c.cache == DType::f8e4m3 || c.cache == DType::i8;  // (gathered only)
    const bool eligible = (c.cache == c.dtype || eight_bit) && (c.d == 64 || c.d == 128 || c.d == 256);
    const bool tma_pages = ps == 0 || (ps % 8 == 0 && (block_n % ps == 0 || ps % block_n == 0));
    const bool big_pieces = ps == 0 || std::min(ps, block_n) >= detail::kSm90CacheMinPieceRows;
    const Values vals = make_values(c, 31);
    // forced, the default (both unset), off, every paged cache gathered, the gathered copy off
    for (const std::string mode : {"1", "", "0", "gather", "nogather"}) {
      ScopedEnv e("IOATTN_SM90_CACHE", mode == "1" || mode == "0" ? mode.c_str() : nullptr);
      ScopedEnv g("IOATTN_SM90_CACHE_GATHER", mode == "gather" ? "1" : mode == "nogather" ? "0" : nullptr);
      Built gpu(c, vals);
      const KernelChoice k = gpu.run();
      const bool direct = !eight_bit && tma_pages && (big_pieces || mode == "1");
      const bool gather_on = mode == "gather" || (mode != "nogather" && detail::kSm90CacheGatherByDefault);
      const bool wgmma = eligible && mode != "0" && (direct || gather_on);
      const bool gather = wgmma && ((ps != 0 && mode == "gather") || !direct);
      EXPECT_EQ(k.kernel.find("sm90 wgmma+tma") != std::string::npos, wgmma) << c.name << ": " << k.kernel;
      EXPECT_EQ(k.kernel.find(" gathered") != std::string::npos, gather) << c.name << ": " << k.kernel;
      if (!wgmma)
        EXPECT_NE(k.reason.find("sm90 wgmma kernel not used"), std::string::npos) << c.name << ": " << k.reason;
      const ForwardTol tol = forward_tol(gpu);
      expect_matches_reference(gpu, c.name + (wgmma ? gather ? " wgmma gathered" : " wgmma" : " mma.sync") + " mode '" +
                                        mode + "'",
                               false, tol.extra_o(), tol.extra_lse());
      if (mode == "1") (wgmma ? sm90 : mma) += 1;
      if (mode.empty() && wgmma) (gather ? gathered_default : sm90_default) += 1;
    }
  }
  EXPECT_GE(sm90, 4);
  EXPECT_GE(mma, detail::kSm90CacheGatherByDefault ? 3 : 4);  // (head dims 72 / 96; 8-bit without the copy)
  EXPECT_GE(sm90_default, 2);
  EXPECT_GE(gathered_default, detail::kSm90CacheGatherByDefault ? 3 : 0);
  // A persistent grid of 2 CTAs: every CTA runs many tiles (the dynamic counter, the tile hand-over).
  ScopedEnv on("IOATTN_SM90_CACHE", "1"), ctas("IOATTN_SM90_MAX_CTAS", "2");
  for (const Spec& c : cuda_prefill_cases()) {
    if (c.name != "d128_sq300_page64_bf16" && c.name != "d256_page16_causal_bf16") continue;
    Built gpu(c, make_values(c, 37));
    const KernelChoice k = gpu.run();
    EXPECT_NE(k.kernel.find("sm90 wgmma+tma"), std::string::npos) << c.name << ": " << k.kernel;
    const ForwardTol tol = forward_tol(gpu);
    expect_matches_reference(gpu, c.name + " 2 CTAs", false, tol.extra_o(), tol.extra_lse());
  }
}

// Validation cannot read device tensors: a length past the capacity, a negative one, or a
// block-table entry outside the cache poisons that sequence's rows (NaN O and LSE), and only those;
// paged and contiguous caches.
TEST(CudaDecodeCachePrefill, OutOfRangeLengthsAndPagesGiveNaNForThatSequenceOnly) {
  SKIP_WITHOUT_GPU();
  // the mma.sync cache mode, and on sm_90 the wgmma rows: direct, and gathered (paged)
  for (const char* sm90 : {"0", "1", "gather"})
  for (int64_t ps : {16, 0})
  for (DType cache : {DType::bf16, DType::f8e4m3}) {  // (f8e4m3: mma.sync, or the gathered copy)
    ScopedEnv e("IOATTN_SM90_CACHE", sm90[0] == 'g' ? nullptr : sm90);
    ScopedEnv g("IOATTN_SM90_CACHE_GATHER", sm90[0] == 'g' ? "1" : nullptr);
    Spec c = on_cuda(mk("prefill_bounds", DType::bf16));
    c.cache = cache;
    c.hq = 8;
    c.hkv = 2;
    c.d = 128;
    c.sq = 40;
    c.causal = true;
    c.lens = {40, 170, 233};
    c.page_size = ps;
    Built bl(c, make_values(c, 6));
    bl.run();
    for (int which = 0; which < (ps ? 3 : 2); ++which) {
      Built t(c, bl.val);
      if (which == 0) t.lens.fill_i32({40, static_cast<int32_t>(t.capacity + 1), 233});  // past the capacity
      if (which == 1) t.lens.fill_i32({40, -5, 233});                                   // negative
      if (which == 2) {  // the last page of sequence 1 outside the cache
        t.table[static_cast<size_t>(1 * t.width + 10)] = static_cast<int32_t>(t.pages + 7);
        t.bt.fill_i32(t.table);
      }
      t.run();
      for (int64_t b = 0; b < c.B(); ++b)
        for (int64_t i = 0; i < c.sq; ++i)
          for (int64_t h = 0; h < c.hq; ++h) {
            const float l = t.lse_at(b, h, i), want = bl.lse_at(b, h, i);
            if (b == 1)
              ASSERT_TRUE(std::isnan(l)) << "case " << which << " i" << i << " h" << h;
            else
              ASSERT_EQ(std::memcmp(&l, &want, 4), 0) << "case " << which << " b" << b;
            for (int64_t x = 0; x < c.DV(); ++x) {
              const float o = t.o_at(b, i, h, x), w = bl.o_at(b, i, h, x);
              if (b == 1)
                ASSERT_TRUE(std::isnan(o)) << "case " << which << " page " << ps;
              else
                ASSERT_EQ(std::memcmp(&o, &w, 4), 0) << "case " << which << " page " << ps << " b" << b << " x" << x;
            }
          }
    }
  }
}

// The default staged 8-bit tiles (codes by cp.async into a staging buffer, converted after the
// wait) against IOATTN_PREFILL_8BIT=regs (the register path): the same converted tiles, so the same
// bits; the kernel choice says which ran; a bad value is an error naming the variable.
TEST(CudaDecodeCachePrefill, StagedEightBitTilesEqualRegisterPathBitwise) {
  SKIP_WITHOUT_GPU();
  ScopedEnv mma("IOATTN_SM90_CACHE", "0");  // (the mma.sync cache mode's two 8-bit paths)
  int ran = 0;
  for (const Spec& c : cuda_prefill_cases()) {
    if (c.cache != DType::f8e4m3 && c.cache != DType::i8) continue;
    const Values vals = make_values(c, 17);
    Built regs(c, vals), staged(c, vals);
    KernelChoice kr, ks;
    {
      ScopedEnv e("IOATTN_PREFILL_8BIT", "regs");
      kr = regs.run();
    }
    {
      ScopedEnv e("IOATTN_PREFILL_8BIT", nullptr);
      ks = staged.run();
    }
    EXPECT_EQ(kr.reason.find("staged by cp.async"), std::string::npos) << kr.reason;
    // (d % 16 != 0, or staging buffers the device's shared memory cannot hold: the register path, said so)
    const bool applies = ks.reason.find("staged not applicable") == std::string::npos;
    EXPECT_EQ(ks.reason.find("staged by cp.async") != std::string::npos, applies) << c.name << ": " << ks.reason;
    if (c.d % 16 != 0) EXPECT_FALSE(applies) << c.name << ": " << ks.reason;
    EXPECT_TRUE(bitwise_equal(regs.outputs(), staged.outputs()))
        << c.name << ": max diff " << max_diff(regs.outputs(), staged.outputs());
    ++ran;
  }
  EXPECT_GE(ran, 6);
  ScopedEnv e("IOATTN_PREFILL_8BIT", "sometimes");
  for (const Spec& s : cuda_prefill_cases()) {
    if (s.cache != DType::f8e4m3) continue;
    Built b8(s, make_values(s, 1));
    try {
      b8.run();
      FAIL() << "IOATTN_PREFILL_8BIT=sometimes accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.argument(), "IOATTN_PREFILL_8BIT") << err.what();
    }
    break;
  }
}

// A shape the CUDA kernel does not take (f32 q) is a clear error naming q, and nothing is written.
TEST(CudaDecodeCachePrefill, UnsupportedShapeIsAClearError) {
  SKIP_WITHOUT_GPU();
  Spec c = on_cuda(mk("prefill17_f32", DType::f32));
  c.sq = 17;
  c.lens = {40};
  Built bl(c, make_values(c, 2));
  try {
    bl.run();
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q") << e.what();
    EXPECT_NE(std::string(e.what()).find("f16 or bf16"), std::string::npos) << e.what();
  }
  bl.download();
  for (int64_t i = 0; i < bl.o.count(); ++i) ASSERT_TRUE(std::isnan(bl.o.get(i))) << "o written";
}

// Lengths the CUDA append cannot trust (read on the device only): a length past the capacity
// appends nothing for its sequence (the decode poisons it), and a length below seqlen_new appends
// only the tokens at positions >= 0; the other sequences are untouched.
TEST(CudaDecodeFusedAppend, OutOfRangeLengthsAppendNothingThere) {
  SKIP_WITHOUT_GPU();
  Spec c = on_cuda(mk("fused_bad_len", DType::bf16));
  c.lens = {40, 20, 3};
  c.page_size = 16;
  const Values vals = make_values(c, 8);
  Built fused(c, vals), expect(c, vals);
  const int64_t n = 4;
  FusedNew nw(fused, n);
  // Sequence 2 (3 tokens): new token i carries 0.25 (i + 1); token 0 would sit at position -1.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t x = 0; x < c.hkv * c.d; ++x) {
      nw.k.set((2 * n + i) * c.hkv * c.d + x, 0.25f * static_cast<float>(i + 1));
      nw.v.set((2 * n + i) * c.hkv * c.d + x, -0.25f * static_cast<float>(i + 1));
    }
  nw.k.upload();
  nw.v.upload();
  poison_last_tokens(fused, n);
  std::vector<int32_t> lens = c.lens;
  lens[1] = 1 << 30;  // past the capacity: nothing appended for sequence 1, its rows decode to NaN
  fused.lens.fill_i32(lens);
  fused.cache.k_new = nw.k.view({c.B(), n, c.hkv, c.d});
  fused.cache.v_new = nw.v.view({c.B(), n, c.hkv, c.DV()});
  fused.run();
  // Expected: sequence 0's last 4 tokens back in place, sequence 1's still poisoned, sequence 2's
  // positions 0..2 holding its new tokens 1..3.
  poison_last_tokens(expect, n);
  for (int64_t t = 36; t < 40; ++t)
    for (int64_t h = 0; h < c.hkv; ++h)
      for (int64_t x = 0; x < c.d; ++x) {
        expect.kc.set(expect.elem(0, t, h, c.d) + x, vals.k[0][static_cast<size_t>((t * c.hkv + h) * c.d + x)]);
        expect.vc.set(expect.elem(0, t, h, c.d) + x, vals.v[0][static_cast<size_t>((t * c.hkv + h) * c.d + x)]);
      }
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t h = 0; h < c.hkv; ++h)
      for (int64_t x = 0; x < c.d; ++x) {
        expect.kc.set(expect.elem(2, t, h, c.d) + x, 0.25f * static_cast<float>(t + 2));
        expect.vc.set(expect.elem(2, t, h, c.d) + x, -0.25f * static_cast<float>(t + 2));
      }
  fused.kc.download();
  fused.vc.download();
  EXPECT_TRUE(bytes_of(fused.kc) == bytes_of(expect.kc)) << "k cache";
  EXPECT_TRUE(bytes_of(fused.vc) == bytes_of(expect.vc)) << "v cache";
  for (int64_t i = 0; i < c.sq; ++i)
    for (int64_t h = 0; h < c.hq; ++h) {
      EXPECT_TRUE(std::isnan(fused.lse_at(1, h, i))) << "sequence 1 (length past the capacity) must be NaN";
      EXPECT_FALSE(std::isnan(fused.lse_at(0, h, i))) << "sequence 0";
      EXPECT_FALSE(std::isnan(fused.lse_at(2, h, i))) << "sequence 2";
    }
}

// CUDA-graph capture of decode with the fused append under a plan: replays give the eager result
// bitwise (the append is idempotent: the same tokens to the same slots).
TEST(CudaDecodeFusedAppend, GraphReplayEqualsEagerBitwise) {
  SKIP_WITHOUT_GPU();
  const Spec c = plan_spec();
  const Values vals = make_values(c, 12);
  Built bl(c, vals);
  const int64_t n = 2;
  FusedNew nw(bl, n);
  poison_last_tokens(bl, n);
  bl.cache.k_new = nw.k.view({c.B(), n, c.hkv, c.d});
  bl.cache.v_new = nw.v.view({c.B(), n, c.hkv, c.DV()});
  const DecodePlan plan = plan_decode(c.B(), c.hq, c.hkv, c.d, c.DV(), c.sq, bl.capacity, c.page_size, Device::cuda);
  DeviceBytes ws(plan.workspace_bytes);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Context ctx;
  ctx.stream = stream;
  bl.o.poison();
  bl.lse.poison();
  decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, plan, ws.ptr, ctx);
  CUDA_OK(cudaStreamSynchronize(stream));
  bl.download();
  const std::vector<float> eager = bl.outputs();
  expect_matches_reference(bl, "fused append eager");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  decode(bl.qv, bl.cache, bl.ov, bl.lv, bl.prm, plan, ws.ptr, ctx);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    poison_last_tokens(bl, n);  // every replay must append them again
    bl.o.poison();
    bl.lse.poison();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    bl.download();
    EXPECT_TRUE(bitwise_equal(bl.outputs(), eager))
        << "replay " << rep << ": max diff " << max_diff(bl.outputs(), eager);
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}

// Negative slots (padding) and slots past the cache are skipped; the rest land bit for bit.
TEST(CudaAppendKv, NegativeAndOutOfRangeSlotsAreSkipped) {
  SKIP_WITHOUT_GPU();
  Spec c = on_cuda(mk("skip", DType::bf16));
  c.lens = {40};
  c.page_size = 16;
  Built bl(c, make_values(c, 1));
  bl.clear_cache();
  bl.kc.download();
  bl.vc.download();
  const auto k_before = bytes_of(bl.kc), v_before = bytes_of(bl.vc);
  const int64_t T = 5;
  detail::Buffer kn(DType::bf16, T * c.hkv * c.d, Device::cuda), vn(DType::bf16, T * c.hkv * c.DV(), Device::cuda);
  std::mt19937_64 rng(3);
  kn.fill_random(rng);
  vn.fill_random(rng);
  detail::Buffer slots(DType::i32, T, Device::cuda);
  slots.fill_i32({-1, 5, -7, 2, static_cast<int32_t>(bl.pages * bl.ps)});
  append_kv(kn.view({T, c.hkv, c.d}), vn.view({T, c.hkv, c.DV()}), slots.view({T}), bl.cache);
  bl.kc.download();
  bl.vc.download();
  const auto k_after = bytes_of(bl.kc), v_after = bytes_of(bl.vc);
  const int64_t row_k = c.hkv * c.d * 2, row_v = c.hkv * c.DV() * 2;  // bytes per slot
  for (int64_t s = 0; s < bl.pages * bl.ps; ++s) {
    const bool written = s == 5 || s == 2;
    const bool k_same = std::equal(k_after.begin() + s * row_k, k_after.begin() + (s + 1) * row_k, k_before.begin() + s * row_k);
    const bool v_same = std::equal(v_after.begin() + s * row_v, v_after.begin() + (s + 1) * row_v, v_before.begin() + s * row_v);
    EXPECT_EQ(k_same, !written) << "slot " << s;
    EXPECT_EQ(v_same, !written) << "slot " << s;
  }
  EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(bl.kc.host()) + 5 * row_k,
                        static_cast<const uint8_t*>(kn.host()) + 1 * row_k, static_cast<size_t>(row_k)), 0);
  EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(bl.vc.host()) + 2 * row_v,
                        static_cast<const uint8_t*>(vn.host()) + 3 * row_v, static_cast<size_t>(row_v)), 0);
}

// Serving loop on the device: one plan for the capacity, a token appended and decoded per step.
TEST(CudaAppendKv, AppendDecodeLoopUnderOnePlan) {
  SKIP_WITHOUT_GPU();
  Spec c = on_cuda(mk("loop", DType::bf16));
  c.hq = 32;
  c.hkv = 8;
  c.d = 128;
  c.lens = {30, 0, 64};
  c.page_size = 16;
  c.causal = true;
  Spec full = c;
  const int steps = 12;
  for (int32_t& L : full.lens) L += steps;
  Values vals = make_values(full, 77);
  Built bl(full, vals);
  DecodeOptions opt;
  opt.num_splits = 3;
  const DecodePlan plan =
      plan_decode(c.B(), c.hq, c.hkv, c.d, c.DV(), c.sq, bl.capacity, c.page_size, Device::cuda, opt);
  DeviceBytes ws(plan.workspace_bytes);
  bl.clear_cache();
  std::vector<int32_t> cur = c.lens;
  auto append = [&](int64_t b, int64_t t0, int64_t t1) {
    const int64_t T = t1 - t0;
    if (T == 0) return;
    detail::Buffer kn(DType::bf16, T * c.hkv * c.d, Device::cuda), vn(DType::bf16, T * c.hkv * c.DV(), Device::cuda);
    std::vector<int32_t> slots;
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t x = 0; x < c.hkv * c.d; ++x)
        kn.set((t - t0) * c.hkv * c.d + x, vals.k[static_cast<size_t>(b)][static_cast<size_t>(t * c.hkv * c.d + x)]);
      for (int64_t x = 0; x < c.hkv * c.DV(); ++x)
        vn.set((t - t0) * c.hkv * c.DV() + x, vals.v[static_cast<size_t>(b)][static_cast<size_t>(t * c.hkv * c.DV() + x)]);
      slots.push_back(static_cast<int32_t>(bl.slot(b, t)));
    }
    kn.upload();
    vn.upload();
    detail::Buffer sl(DType::i32, T, Device::cuda);
    sl.fill_i32(slots);
    append_kv(kn.view({T, c.hkv, c.d}), vn.view({T, c.hkv, c.DV()}), sl.view({T}), bl.cache);
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
    bl.download();
    Spec now = full;
    now.lens = cur;
    now.device = Device::cpu;
    const Built ref_view(now, vals);
    expect_matches_reference(ref_view, "step " + std::to_string(step), false, nullptr, nullptr, &bl);
  }
}

// ---- merge_states ------------------------------------------------------------------------------

// CUDA merge_states vs the CPU one on the same inputs, with rows empty on one side (NaN O there,
// never read), on both sides (O = 0, LSE = -inf), a NaN LSE (NaN row), mixed dtypes and aliasing.
TEST(CudaMergeStates, MatchesCpuIncludingEmptyAndNaNRows) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    const int64_t B = 2, S = 5, H = 3, D = 80;
    std::mt19937_64 rng(17);
    auto mk_buf = [&](DType dt, int64_t n, float range) {
      detail::Buffer b(dt, n, Device::cuda);
      b.fill_random(rng, range);
      return b;
    };
    detail::Buffer oa = mk_buf(t, B * S * H * D, 1.0f), ob = mk_buf(DType::f32, B * S * H * D, 1.0f);
    detail::Buffer la = mk_buf(DType::f32, B * H * S, 4.0f), lb = mk_buf(DType::f32, B * H * S, 4.0f);
    auto empty = [&](detail::Buffer& o, detail::Buffer& l, int64_t b, int64_t s, int64_t h) {
      l.set((b * H + h) * S + s, -kInf);
      for (int64_t x = 0; x < D; ++x) o.set(((b * S + s) * H + h) * D + x, kNaN);
    };
    empty(ob, lb, 1, 2, 0);  // b side empty
    empty(oa, la, 0, 4, 1);  // a side empty
    empty(oa, la, 1, 3, 2);  // both
    empty(ob, lb, 1, 3, 2);
    la.set((0 * H + 2) * S + 1, kNaN);  // NaN LSE -> NaN row
    for (detail::Buffer* b : {&oa, &ob, &la, &lb}) b->upload();
    // CPU reference on host copies.
    auto host_copy = [](const detail::Buffer& src) {
      detail::Buffer h(src.dtype(), src.count());
      std::memcpy(h.host(), src.host(), src.bytes());
      return h;
    };
    detail::Buffer hoa = host_copy(oa), hob = host_copy(ob), hla = host_copy(la), hlb = host_copy(lb);
    detail::Buffer ho(t, B * S * H * D), hl(DType::f32, B * H * S);
    merge_states(hoa.view({B, S, H, D}), hla.view({B, H, S}), hob.view({B, S, H, D}), hlb.view({B, H, S}),
                 ho.view({B, S, H, D}), hl.view({B, H, S}));
    for (bool alias : {false, true}) {
      detail::Buffer o(t, B * S * H * D, Device::cuda), l(DType::f32, B * H * S, Device::cuda);
      o.poison();
      l.poison();
      detail::Buffer oa2 = host_copy(oa), la2 = host_copy(la);  // aliasing target (a copy of a)
      detail::Buffer doa(t, B * S * H * D, Device::cuda), dla(DType::f32, B * H * S, Device::cuda);
      std::memcpy(doa.host(), oa2.host(), oa2.bytes());
      std::memcpy(dla.host(), la2.host(), la2.bytes());
      doa.upload();
      dla.upload();
      detail::Buffer& out_o = alias ? doa : o;
      detail::Buffer& out_l = alias ? dla : l;
      const KernelChoice k = merge_states(doa.view({B, S, H, D}), dla.view({B, H, S}), ob.view({B, S, H, D}),
                                          lb.view({B, H, S}), out_o.view({B, S, H, D}), out_l.view({B, H, S}));
      EXPECT_NE(k.kernel.find("cuda/merge_states"), std::string::npos) << k.kernel;
      out_o.download();
      out_l.download();
      const double tol = t == DType::f32 ? 1e-6 : t == DType::bf16 ? 8e-3 : 1e-3;
      for (int64_t i = 0; i < ho.count(); ++i) {
        const float g = out_o.get(i), w = ho.get(i);
        if (std::isnan(w)) {
          ASSERT_TRUE(std::isnan(g)) << dtype_name(t) << " alias " << alias << " o[" << i << "]";
        } else {
          ASSERT_LE(std::fabs(g - w), tol) << dtype_name(t) << " alias " << alias << " o[" << i << "] " << g << " vs " << w;
        }
      }
      for (int64_t i = 0; i < hl.count(); ++i) {
        const float g = out_l.get(i), w = hl.get(i);
        if (std::isnan(w) || std::isinf(w)) {
          ASSERT_EQ(std::memcmp(&g, &w, 4) == 0 || (std::isnan(g) && std::isnan(w)), true) << "lse[" << i << "]";
        } else {
          ASSERT_NEAR(g, w, 2e-6 * std::max(1.0f, std::fabs(w))) << "lse[" << i << "]";
        }
      }
      // The one-sided rows are exactly the other side; the empty row exactly 0 / -inf.
      for (int64_t x = 0; x < D; ++x) {
        EXPECT_EQ(out_o.get(((1 * S + 3) * H + 2) * D + x), 0.0f);
        EXPECT_EQ(out_o.get(((0 * S + 4) * H + 1) * D + x), static_cast<float>(detail::round_to(t, ob.get(((0 * S + 4) * H + 1) * D + x))));
      }
    }
  }
}

// IOATTN_LOG-facing strings: kernel, splits and the reason (heuristic / requested / plan).
TEST(CudaDecode, KernelChoiceNamesSplitsAndLayout) {
  SKIP_WITHOUT_GPU();
  Spec c = on_cuda(mk("choice", DType::bf16));
  c.hq = 32;
  c.hkv = 8;
  c.d = 128;
  c.lens = {64};
  c.page_size = 16;
  Built bl(c, make_values(c, 1));
  KernelChoice k = bl.run(7);
  EXPECT_NE(k.kernel.find("cuda/splitkv sm"), std::string::npos) << k.kernel;
  // one short sequence (8 CTAs before splitting, 64 keys): the 2-stage ring (mma_decode_stages)
  EXPECT_NE(k.kernel.find(" mma stages2 bf16 hdim128 gqa4 page16"), std::string::npos) << k.kernel;
  EXPECT_NE(k.reason.find("2-stage cp.async ring"), std::string::npos) << k.reason;
  EXPECT_NE(k.kernel.find("splits 7"), std::string::npos) << k.kernel;
  EXPECT_NE(k.reason.find("requested"), std::string::npos) << k.reason;
  EXPECT_NE(k.reason.find("8 query rows per CTA (4 rows per kv head: 1 block)"), std::string::npos) << k.reason;
  EXPECT_NE(k.reason.find("(page, slot) of each key prefetched"), std::string::npos) << k.reason;
  {
    KernelEnv env("fma");
    k = bl.run(7);
    EXPECT_NE(k.kernel.find(" fma bf16 hdim128"), std::string::npos) << k.kernel;
    EXPECT_NE(k.reason.find("IOATTN_DECODE_KERNEL=fma"), std::string::npos) << k.reason;
    EXPECT_NE(k.reason.find("4 query rows per CTA"), std::string::npos) << k.reason;
  }
  {
    KernelEnv env("mma");
    k = bl.run(7);
    EXPECT_NE(k.kernel.find(" mma stages2 bf16 hdim128 gqa4 page16"), std::string::npos) << k.kernel;
    EXPECT_NE(k.reason.find("IOATTN_DECODE_KERNEL=mma"), std::string::npos) << k.reason;
  }
  {
    KernelEnv env("mma2");  // the retired kernel names are refused, not ignored
    EXPECT_THROW(bl.run(7), Error);
  }
  {
    KernelEnv env("bogus");
    EXPECT_THROW(bl.run(7), Error);
  }
  {
    Spec f = c;  // an f32 problem cannot be forced onto the mma kernel
    f.dtype = f.cache = DType::f32;
    Built b32(f, make_values(f, 1));
    KernelEnv env("mma");
    try {
      b32.run(1);
      ADD_FAILURE() << "IOATTN_DECODE_KERNEL=mma accepted an f32 problem";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("IOATTN_DECODE_KERNEL=mma"), std::string::npos) << e.what();
    }
  }
  k = bl.run(0);
  EXPECT_NE(k.reason.find("heuristic"), std::string::npos) << k.reason;
  EXPECT_NE(k.reason.find("SMs"), std::string::npos) << k.reason;
}

// A head_dim past the CUDA kernel's 256 is refused with the reason (never a silent CPU run).
TEST(CudaDecode, UnsupportedHeadDimFailsWithReason) {
  SKIP_WITHOUT_GPU();
  Spec c = on_cuda(mk("d320", DType::bf16));
  c.d = 320;
  c.lens = {10};
  Built bl(c, make_values(c, 1));
  try {
    bl.run(1);
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q") << e.what();
    EXPECT_NE(std::string(e.what()).find("up to 256"), std::string::npos) << e.what();
  }
  bl.download();
  EXPECT_TRUE(all_nan(bl.outputs()));
}

}  // namespace
}  // namespace ioattn::test

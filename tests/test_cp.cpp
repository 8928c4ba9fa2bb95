// Context parallelism on the loopback communicator: P virtual ranks (one thread each) against
// the single-device forward and backward. P = 1 must match bitwise; P = 2, 3, 4, 8 within
// tolerance for O, LSE, dQ, dK, dV, causal and not, zigzag and contiguous, GQA.
#include <gtest/gtest.h>

#include <cmath>
#include <exception>
#include <random>
#include <thread>

#include "check.hpp"
#include "ioattn/context_parallel.hpp"

namespace ioattn::test {
namespace {

template <class F>
void run_ranks(int P, F f) {
  auto comms = make_loopback_group(P);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      try {
        f(*comms[static_cast<size_t>(r)], r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

struct CpCase {
  int P;
  bool causal;
  CpLayout layout;
  DType dtype;
  int64_t heads_q, heads_kv;
  Device device = Device::cpu;
};

std::string cp_label(const CpCase& c) {
  return std::string(c.device == Device::cuda ? "cuda_" : "") + "P" + std::to_string(c.P) + (c.causal ? "_causal" : "_full") +
         (c.layout == CpLayout::zigzag ? "_zigzag_" : "_contiguous_") + dtype_name(c.dtype) + "_gqa" +
         std::to_string(c.heads_q / c.heads_kv);
}
std::string cp_name(const ::testing::TestParamInfo<CpCase>& i) { return cp_label(i.param); }
void PrintTo(const CpCase& c, std::ostream* os) { *os << cp_label(c); }

// Full-sequence tensors on the case's device (host copies kept by Buffer): inputs, single-device
// outputs and gradients. The CUDA kernels take head dims that are multiples of 8 (64 here) and
// need longer shards to cross their tile boundaries.
struct Full {
  Device dev;
  int64_t B = 2, S, Hq, Hk, D;
  DType dt;
  detail::Buffer q, k, v, dout, o, lse, dq, dk, dv;
  Full(DType t, int64_t hq, int64_t hk, Device d)
      : dev(d), S(d == Device::cuda ? 240 : 48), Hq(hq), Hk(hk), D(d == Device::cuda ? 64 : 32), dt(t),
        q(t, B * S * hq * D, d), k(t, B * S * hk * D, d), v(t, B * S * hk * D, d), dout(t, B * S * hq * D, d),
        o(t, B * S * hq * D, d), lse(DType::f32, B * hq * S, d), dq(t, B * S * hq * D, d), dk(t, B * S * hk * D, d),
        dv(t, B * S * hk * D, d) {
    std::mt19937_64 rng(11);
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    dout.fill_random(rng);
  }
  TensorView qv() { return q.view({B, S, Hq, D}); }
  TensorView kv() { return k.view({B, S, Hk, D}); }
  TensorView vv() { return v.view({B, S, Hk, D}); }
};

using detail::max_abs_diff;

class ContextParallel : public ::testing::TestWithParam<CpCase> {};

TEST_P(ContextParallel, MatchesSingleDevice) {
  const CpCase c = GetParam();
  if (c.device == Device::cuda && !cuda_available()) GTEST_SKIP() << "skipped: no CUDA device";
  Full f(c.dtype, c.heads_q, c.heads_kv, c.device);
  AttnParams prm;
  prm.causal = c.causal;
  Context one;
  one.num_threads = 1;
  one.deterministic = true;  // CUDA: dQ without float atomics, so P = 1 can be compared bitwise
  // Single device.
  forward(f.qv(), f.kv(), f.vv(), f.o.view({f.B, f.S, f.Hq, f.D}), f.lse.view({f.B, f.Hq, f.S}), prm, one);
  Gradients g{f.dq.view({f.B, f.S, f.Hq, f.D}), f.dk.view({f.B, f.S, f.Hk, f.D}), f.dv.view({f.B, f.S, f.Hk, f.D}), {}};
  backward(f.qv(), f.kv(), f.vv(), f.o.view({f.B, f.S, f.Hq, f.D}), f.dout.view({f.B, f.S, f.Hq, f.D}),
           f.lse.view({f.B, f.Hq, f.S}), g, prm, one);

  // P ranks: shard, run, gather.
  const int P = c.P;
  const int64_t L = f.S / P;
  for (detail::Buffer* b : {&f.o, &f.lse, &f.dq, &f.dk, &f.dv}) b->download();
  const Device dev = c.device;
  detail::Buffer o_cp(c.dtype, f.o.count(), dev), lse_cp(DType::f32, f.lse.count()), dq_cp(c.dtype, f.dq.count(), dev),
      dk_cp(c.dtype, f.dk.count(), dev), dv_cp(c.dtype, f.dv.count(), dev);
  o_cp.poison();
  dq_cp.poison();
  dk_cp.poison();
  dv_cp.poison();
  run_ranks(P, [&](Communicator& comm, int r) {
    auto local = [&](int64_t h) { return detail::Buffer(c.dtype, f.B * L * h * f.D, dev); };
    detail::Buffer q = local(f.Hq), k = local(f.Hk), v = local(f.Hk), dout = local(f.Hq), o = local(f.Hq);
    detail::Buffer dq = local(f.Hq), dk = local(f.Hk), dv = local(f.Hk), lse(DType::f32, f.B * f.Hq * L, dev);
    auto lv = [&](detail::Buffer& b, int64_t h) { return b.view({f.B, L, h, f.D}); };
    cp_shard(f.qv(), lv(q, f.Hq), r, P, c.layout);
    cp_shard(f.kv(), lv(k, f.Hk), r, P, c.layout);
    cp_shard(f.vv(), lv(v, f.Hk), r, P, c.layout);
    cp_shard(f.dout.view({f.B, f.S, f.Hq, f.D}), lv(dout, f.Hq), r, P, c.layout);
    o.poison();
    lse.poison();
    cp_forward(comm, lv(q, f.Hq), lv(k, f.Hk), lv(v, f.Hk), lv(o, f.Hq), lse.view({f.B, f.Hq, L}), prm, c.layout, one);
    Gradients gl{lv(dq, f.Hq), lv(dk, f.Hk), lv(dv, f.Hk), {}};
    cp_backward(comm, lv(q, f.Hq), lv(k, f.Hk), lv(v, f.Hk), lv(o, f.Hq), lv(dout, f.Hq), lse.view({f.B, f.Hq, L}), gl,
                prm, c.layout, one);
    cp_unshard(lv(o, f.Hq), o_cp.view({f.B, f.S, f.Hq, f.D}), r, P, c.layout);
    cp_unshard(lv(dq, f.Hq), dq_cp.view({f.B, f.S, f.Hq, f.D}), r, P, c.layout);
    cp_unshard(lv(dk, f.Hk), dk_cp.view({f.B, f.S, f.Hk, f.D}), r, P, c.layout);
    cp_unshard(lv(dv, f.Hk), dv_cp.view({f.B, f.S, f.Hk, f.D}), r, P, c.layout);
    // LSE [b, h, L] -> the full [b, h, S], on the host.
    lse.download();
    const auto pos = cp_positions(f.S, r, P, c.layout);
    for (int64_t b = 0; b < f.B; ++b)
      for (int64_t h = 0; h < f.Hq; ++h)
        for (int64_t i = 0; i < L; ++i)
          lse_cp.set((b * f.Hq + h) * f.S + pos[static_cast<size_t>(i)], lse.get((b * f.Hq + h) * L + i));
  });

  for (detail::Buffer* b : {&o_cp, &dq_cp, &dk_cp, &dv_cp}) b->download();
  if (P == 1) {  // the same block computations in the same order: bitwise
    EXPECT_EQ(max_abs_diff(o_cp, f.o), 0.0);
    EXPECT_EQ(max_abs_diff(lse_cp, f.lse), 0.0);
    EXPECT_EQ(max_abs_diff(dq_cp, f.dq), 0.0);
    EXPECT_EQ(max_abs_diff(dk_cp, f.dk), 0.0);
    EXPECT_EQ(max_abs_diff(dv_cp, f.dv), 0.0);
    return;
  }
  // Partial results are rounded to the input dtype before the fp32 merge: allow a few roundings.
  const double tol = c.dtype == DType::f32 ? 2e-5 : 4e-2;
  EXPECT_LE(max_abs_diff(o_cp, f.o), tol);
  EXPECT_LE(max_abs_diff(lse_cp, f.lse), c.dtype == DType::f32 ? 2e-5 : 1e-2);
  EXPECT_LE(max_abs_diff(dq_cp, f.dq), 2 * tol);
  EXPECT_LE(max_abs_diff(dk_cp, f.dk), 2 * tol);
  EXPECT_LE(max_abs_diff(dv_cp, f.dv), 2 * tol);
}

std::vector<CpCase> cp_cases() {
  std::vector<CpCase> v;
  for (int P : {1, 2, 3, 4, 8})
    for (bool causal : {false, true})
      for (CpLayout l : {CpLayout::contiguous, CpLayout::zigzag}) v.push_back({P, causal, l, DType::f32, 4, 2});
  v.push_back({4, true, CpLayout::zigzag, DType::bf16, 4, 4});
  v.push_back({2, false, CpLayout::contiguous, DType::bf16, 8, 1});
  // P virtual ranks on one GPU: the same ring through the CUDA forward, backward, merge_states
  // and the ring's device copies.
  for (int P : {1, 2, 4, 8})
    for (bool causal : {false, true})
      for (CpLayout l : {CpLayout::contiguous, CpLayout::zigzag})
        v.push_back({P, causal, l, DType::bf16, 4, 2, Device::cuda});
  v.push_back({3, true, CpLayout::zigzag, DType::f16, 8, 1, Device::cuda});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Loopback, ContextParallel, ::testing::ValuesIn(cp_cases()), cp_name);

TEST(ContextParallelApi, PositionsAndLayouts) {
  EXPECT_EQ(cp_positions(8, 0, 2, CpLayout::zigzag), (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(cp_positions(8, 1, 2, CpLayout::zigzag), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(cp_positions(8, 1, 2, CpLayout::contiguous), (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_THROW(cp_positions(10, 0, 3, CpLayout::contiguous), Error);
}

TEST(ContextParallelApi, RejectsWhatItCannotDo) {
  auto comms = make_loopback_group(1);
  detail::Buffer q(DType::f32, 6 * 2 * 8), lse(DType::f32, 2 * 6);
  std::mt19937_64 rng(1);
  q.fill_random(rng);
  const TensorView t = q.view({1, 6, 2, 8});
  AttnParams prm;
  prm.window_left = 4;
  try {
    cp_forward(*comms[0], t, t, t, t, lse.view({1, 2, 6}), prm, CpLayout::contiguous);
    FAIL() << "window accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("params.window_left"), std::string::npos) << e.what();
  }
  detail::Buffer q5(DType::f32, 5 * 2 * 8);
  q5.fill_random(rng);
  EXPECT_THROW(cp_forward(*comms[0], q5.view({1, 5, 2, 8}), q5.view({1, 5, 2, 8}), q5.view({1, 5, 2, 8}),
                          q5.view({1, 5, 2, 8}), lse.view({1, 2, 5}), AttnParams{}, CpLayout::zigzag),
               Error);
  EXPECT_THROW(make_nccl_communicator(nullptr), Error);
  // A group needs distinct visible devices; every refusal names the argument.
  for (const std::vector<int>& devs : {std::vector<int>{}, std::vector<int>{-1}, std::vector<int>{0, 0},
                                       std::vector<int>{1 << 20}}) {
    try {
      make_nccl_group(devs);
      FAIL() << "make_nccl_group accepted " << devs.size() << " devices";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("devices"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace ioattn::test

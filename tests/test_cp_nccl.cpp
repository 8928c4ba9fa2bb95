// Context parallelism over real GPUs through NCCL: P ranks, one thread and one GPU each, in one
// process (ncclCommInitAll). O, LSE, dQ, dK, dV must match the single-GPU result within the
// tolerance of the loopback test (tests/test_cp.cpp), causal and not, zigzag and contiguous, GQA.
//
// Runs whenever >= 2 CUDA devices are visible; otherwise every case prints "skipped: fewer than 2
// CUDA devices" (ctest reports it as skipped). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/backends.hpp"
#include "core/harness.hpp"
#include "ioattn/context_parallel.hpp"

namespace ioattn::test {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x
#define NCCL_OK(x) ASSERT_EQ((x), ncclSuccess) << #x

struct NcclCase {
  int P;
  bool causal;
  CpLayout layout;
  int64_t heads_q, heads_kv;
  bool group = false;  // the communicators from make_nccl_group instead of the caller's ncclComm_t
};

std::string label(const ::testing::TestParamInfo<NcclCase>& i) {
  const NcclCase& c = i.param;
  return "P" + std::to_string(c.P) + (c.causal ? "_causal" : "_full") +
         (c.layout == CpLayout::zigzag ? "_zigzag" : "_contiguous") + "_gqa" + std::to_string(c.heads_q / c.heads_kv) +
         (c.group ? "_group" : "");
}

TensorView host_view(detail::Buffer& b, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(b.host(), b.dtype(), shape, Device::cpu);
}

TensorView device_view(detail::Buffer& b, std::initializer_list<int64_t> shape, int index) {
  TensorView t = TensorView::contiguous(b.data(), b.dtype(), shape, Device::cuda);
  t.device_index = index;
  return t;
}

using detail::max_abs_diff;

class ContextParallelNccl : public ::testing::TestWithParam<NcclCase> {};

TEST_P(ContextParallelNccl, MatchesSingleGpu) {
  const NcclCase c = GetParam();
  const int devices = detail::cuda_device_count();
  if (devices < 2) GTEST_SKIP() << "skipped: fewer than 2 CUDA devices (" << devices << ")";
  if (devices < c.P) GTEST_SKIP() << "skipped: P = " << c.P << " needs " << c.P << " GPUs, " << devices << " visible";
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast on a shared host

  const DType dt = DType::bf16;
  const int64_t B = 2, S = 960, Hq = c.heads_q, Hk = c.heads_kv, D = 64, P = c.P, L = S / P;
  const int64_t nq = B * S * Hq * D, nk = B * S * Hk * D;
  std::mt19937_64 rng(5);
  // Host full tensors and the single-GPU result (GPU 0).
  detail::Buffer q(dt, nq), k(dt, nk), v(dt, nk), dout(dt, nq);
  for (detail::Buffer* b : {&q, &k, &v, &dout}) b->fill_random(rng);
  detail::Buffer o1(dt, nq), lse1(DType::f32, B * Hq * S), dq1(dt, nq), dk1(dt, nk), dv1(dt, nk);
  AttnParams prm;
  prm.causal = c.causal;
  Context ctx;
  ctx.deterministic = true;
  {
    CUDA_OK(cudaSetDevice(0));
    detail::Buffer gq(dt, nq, Device::cuda), gk(dt, nk, Device::cuda), gv(dt, nk, Device::cuda), gdo(dt, nq, Device::cuda);
    detail::Buffer go(dt, nq, Device::cuda), glse(DType::f32, B * Hq * S, Device::cuda), gdq(dt, nq, Device::cuda),
        gdk(dt, nk, Device::cuda), gdv(dt, nk, Device::cuda);
    for (auto [g, h] : {std::pair{&gq, &q}, {&gk, &k}, {&gv, &v}, {&gdo, &dout}})
      detail::cuda_copy_from_host(g->data(), h->host(), h->bytes());
    forward(device_view(gq, {B, S, Hq, D}, 0), device_view(gk, {B, S, Hk, D}, 0), device_view(gv, {B, S, Hk, D}, 0),
            device_view(go, {B, S, Hq, D}, 0), device_view(glse, {B, Hq, S}, 0), prm, ctx);
    Gradients g{device_view(gdq, {B, S, Hq, D}, 0), device_view(gdk, {B, S, Hk, D}, 0),
                device_view(gdv, {B, S, Hk, D}, 0), {}};
    backward(device_view(gq, {B, S, Hq, D}, 0), device_view(gk, {B, S, Hk, D}, 0), device_view(gv, {B, S, Hk, D}, 0),
             device_view(go, {B, S, Hq, D}, 0), device_view(gdo, {B, S, Hq, D}, 0), device_view(glse, {B, Hq, S}, 0),
             g, prm, ctx);
    for (auto [h, g] : {std::pair{&o1, &go}, {&lse1, &glse}, {&dq1, &gdq}, {&dk1, &gdk}, {&dv1, &gdv}})
      detail::cuda_copy_to_host(h->host(), g->data(), h->bytes());
  }

  // P ranks through NCCL. Progress goes to stderr: a hang in NCCL shows where it stopped.
  std::fprintf(stderr, "[cp_nccl] single GPU done; NCCL init over %d GPUs\n", static_cast<int>(P));
  std::vector<ncclComm_t> comms;
  std::vector<int> devs(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) devs[static_cast<size_t>(r)] = r;
  std::vector<std::unique_ptr<Communicator>> group;
  if (c.group) {
    group = make_nccl_group(devs);
  } else {
    comms.resize(static_cast<size_t>(P));
    NCCL_OK(ncclCommInitAll(comms.data(), static_cast<int>(P), devs.data()));
  }
  std::fprintf(stderr, "[cp_nccl] NCCL communicators ready\n");
  detail::Buffer o_cp(dt, nq), lse_cp(DType::f32, B * Hq * S), dq_cp(dt, nq), dk_cp(dt, nk), dv_cp(dt, nk);
  for (detail::Buffer* b : {&o_cp, &lse_cp, &dq_cp, &dk_cp, &dv_cp}) b->poison();
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      try {
        if (cudaSetDevice(r) != cudaSuccess) throw std::runtime_error("cudaSetDevice");
        std::unique_ptr<Communicator> own;
        if (!c.group) own = make_nccl_communicator(comms[static_cast<size_t>(r)]);
        Communicator& comm = c.group ? *group[static_cast<size_t>(r)] : *own;
        cudaStream_t stream = nullptr;
        if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
          throw std::runtime_error("cudaStreamCreate");
        Context rc = ctx;
        rc.stream = stream;
        auto host_local = [&](int64_t h) { return detail::Buffer(dt, B * L * h * D); };
        auto dev_local = [&](int64_t h) { return detail::Buffer(dt, B * L * h * D, Device::cuda); };
        // Shard on the host, upload to this rank's GPU.
        detail::Buffer hq = host_local(Hq), hk = host_local(Hk), hv = host_local(Hk), hdo = host_local(Hq);
        cp_shard(host_view(q, {B, S, Hq, D}), host_view(hq, {B, L, Hq, D}), r, static_cast<int>(P), c.layout);
        cp_shard(host_view(k, {B, S, Hk, D}), host_view(hk, {B, L, Hk, D}), r, static_cast<int>(P), c.layout);
        cp_shard(host_view(v, {B, S, Hk, D}), host_view(hv, {B, L, Hk, D}), r, static_cast<int>(P), c.layout);
        cp_shard(host_view(dout, {B, S, Hq, D}), host_view(hdo, {B, L, Hq, D}), r, static_cast<int>(P), c.layout);
        detail::Buffer gq = dev_local(Hq), gk = dev_local(Hk), gv = dev_local(Hk), gdo = dev_local(Hq), go = dev_local(Hq);
        detail::Buffer gdq = dev_local(Hq), gdk = dev_local(Hk), gdv = dev_local(Hk);
        detail::Buffer glse(DType::f32, B * Hq * L, Device::cuda);
        for (auto [g, h] : {std::pair{&gq, &hq}, {&gk, &hk}, {&gv, &hv}, {&gdo, &hdo}})
          detail::cuda_copy_from_host(g->data(), h->host(), h->bytes());
        const TensorView lq = device_view(gq, {B, L, Hq, D}, r), lk = device_view(gk, {B, L, Hk, D}, r),
                         lv = device_view(gv, {B, L, Hk, D}, r), lo = device_view(go, {B, L, Hq, D}, r),
                         ldo = device_view(gdo, {B, L, Hq, D}, r), llse = device_view(glse, {B, Hq, L}, r);
        std::fprintf(stderr, "[cp_nccl] rank %d: forward\n", r);
        cp_forward(comm, lq, lk, lv, lo, llse, prm, c.layout, rc);
        std::fprintf(stderr, "[cp_nccl] rank %d: backward\n", r);
        Gradients gl{device_view(gdq, {B, L, Hq, D}, r), device_view(gdk, {B, L, Hk, D}, r),
                     device_view(gdv, {B, L, Hk, D}, r), {}};
        cp_backward(comm, lq, lk, lv, lo, ldo, llse, gl, prm, c.layout, rc);
        cudaStreamSynchronize(stream);
        std::fprintf(stderr, "[cp_nccl] rank %d: done\n", r);
        // Download and gather on the host.
        detail::Buffer ho = host_local(Hq), hdq = host_local(Hq), hdk = host_local(Hk), hdv = host_local(Hk);
        detail::Buffer hlse(DType::f32, B * Hq * L);
        for (auto [h, g] : {std::pair{&ho, &go}, {&hdq, &gdq}, {&hdk, &gdk}, {&hdv, &gdv}, {&hlse, &glse}})
          detail::cuda_copy_to_host(h->host(), g->data(), h->bytes());
        cp_unshard(host_view(ho, {B, L, Hq, D}), host_view(o_cp, {B, S, Hq, D}), r, static_cast<int>(P), c.layout);
        cp_unshard(host_view(hdq, {B, L, Hq, D}), host_view(dq_cp, {B, S, Hq, D}), r, static_cast<int>(P), c.layout);
        cp_unshard(host_view(hdk, {B, L, Hk, D}), host_view(dk_cp, {B, S, Hk, D}), r, static_cast<int>(P), c.layout);
        cp_unshard(host_view(hdv, {B, L, Hk, D}), host_view(dv_cp, {B, S, Hk, D}), r, static_cast<int>(P), c.layout);
        const auto pos = cp_positions(S, r, static_cast<int>(P), c.layout);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < Hq; ++h)
            for (int64_t i = 0; i < L; ++i)
              lse_cp.set((b * Hq + h) * S + pos[static_cast<size_t>(i)], hlse.get((b * Hq + h) * L + i));
        cudaStreamDestroy(stream);
      } catch (const std::exception& e) {
        // The other ranks would wait in NCCL for ever for this one: say why and end the process.
        std::fprintf(stderr, "[cp_nccl] rank %d failed: %s\n", r, e.what());
        std::fflush(stderr);
        std::abort();
      }
    });
  for (auto& t : threads) t.join();
  for (ncclComm_t cm : comms) ncclCommDestroy(cm);

  EXPECT_LE(max_abs_diff(o_cp, o1), 4e-2);
  EXPECT_LE(max_abs_diff(lse_cp, lse1), 1e-2);
  EXPECT_LE(max_abs_diff(dq_cp, dq1), 8e-2);
  EXPECT_LE(max_abs_diff(dk_cp, dk1), 8e-2);
  EXPECT_LE(max_abs_diff(dv_cp, dv1), 8e-2);
}

std::vector<NcclCase> cases() {
  std::vector<NcclCase> v;
  for (int P : {2, 4, 8})
    for (bool causal : {false, true})
      for (CpLayout l : {CpLayout::contiguous, CpLayout::zigzag}) v.push_back({P, causal, l, 8, 2});
  v.push_back({2, true, CpLayout::zigzag, 4, 4});
  v.push_back({2, true, CpLayout::zigzag, 8, 1, true});
  v.push_back({2, false, CpLayout::contiguous, 8, 8, true});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Ring, ContextParallelNccl, ::testing::ValuesIn(cases()), label);

}  // namespace
}  // namespace ioattn::test

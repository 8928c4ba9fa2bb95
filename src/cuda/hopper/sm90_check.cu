// sm90_check.cu — correctness and speed harness of the Hopper forward kernel (ioattn_sm90_check).
//
// Correctness: odd shapes (seqlen 1, 17, 113x203, 203x113, 1023x1024, 4097, 300x10 (causal: a
// query tile with no visible key); causal or not; GQA 4;
// [b,s,h,d] and [b,h,s,d] memory; hdim 64/128/256; bf16 and f16). O and LSE are poisoned with NaN
// first; every element of both must be written. Each checked row is compared with a float64
// reference and with "naive attention in the input precision" (S, P and O rounded to the input
// dtype, as an unfused framework path does); the rule is
//     max|O - ref| <= 2 * max|O_naive_lowp - ref| + 1e-3,  same for LSE.
// Large shapes check a sample of rows (all of the first and last 130, every 17th between).
// IOATTN_SM90_MAX_CTAS=3 (read by the launcher) makes every case run many tiles per CTA; the
// launcher's other knobs (IOATTN_SM90_GRID, _RESCALE_SKIP, _WG3) pick the variants to check.
//
// Speed: bf16, batch * seqlen = 16k tokens, hidden 2048 (heads = 2048 / hdim), hdim 64/128/256,
// seqlen 2k..16k, causal and not. CUDA events around each launch (enqueued back to back), 3
// warm-ups, median of 25 (IOATTN_SM90_BENCH_REPS). FLOPs = 4 b h s^2 d, halved when causal.
//
// Build: nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I include -I src
//        src/cuda/hopper/sm90_check.cu src/cuda/hopper/flash_fwd_sm90*.cu -o ioattn_sm90_check
// FP8 (e4m3 q/k/v with descales, bf16/f16 O): checked on the same odd shapes at hdim 128 (and a
// subset at hdim 64 and 256) against the float64 reference of the dequantised inputs, with a naive fp8
// attention (P in e4m3) as the error baseline (run_fp8_checks); timed next to the bf16 kernel at
// hdim 128, 64 and 256, 4k-16k, with the ratio and the V^T pre-pass time (run_fp8_bench). --fp8-only
// runs only these.
//
// Run:   ioattn_sm90_check [--check-only | --bench-only] [--fp8-only] [--csv FILE]
// Exit 0 = all checks passed (or no CUDA device: prints "skipped: no CUDA device").
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/half.hpp"
#include "core/problem.hpp"
#include "cpu/serving_quant.h"  // host e4m3 encode / decode
#include "cuda/hopper/sm90.hpp"

using ioattn::DType;
using ioattn::detail::FwdProblem;

#define CHECK_CUDA(call)                                                                        \
  do {                                                                                          \
    cudaError_t e_ = (call);                                                                    \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", #call, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(2);                                                                             \
    }                                                                                           \
  } while (0)

namespace {

struct Case {
  int64_t b, hq, hkv, sq, sk, d;
  DType dt;
  bool causal;
  bool bhsd;  // memory [b, h, s, d] (strided view) instead of [b, s, h, d]
};

std::string case_name(const Case& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s d%lld b%lld hq%lld hkv%lld %lldx%lld %s%s", c.dt == DType::bf16 ? "bf16" : "f16",
                (long long)c.d, (long long)c.b, (long long)c.hq, (long long)c.hkv, (long long)c.sq,
                (long long)c.sk, c.causal ? "causal" : "full", c.bhsd ? " bhsd" : "");
  return buf;
}

// Element strides of a [b, s, h, d] logical tensor stored as bshd or bhsd.
ioattn::detail::Strides3 strides(const Case& c, int64_t s, int64_t h) {
  if (c.bhsd) return {h * s * c.d, c.d, s * c.d};
  return {s * h * c.d, h * c.d, c.d};
}

// The forward problem of a case on device buffers: q / o and k / v share strides, LSE [b, h, s]
// (batch, seq, head strides), scale 1 / sqrt(d), the plain causal mask or none.
FwdProblem case_problem(const Case& c, void* q, void* k, void* v, void* o, float* lse) {
  FwdProblem p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.lse = lse;
  p.q_stride = strides(c, c.sq, c.hq);
  p.k_stride = strides(c, c.sk, c.hkv);
  p.v_stride = p.k_stride;
  p.o_stride = p.q_stride;
  p.lse_stride = {c.hq * c.sq, 1, c.sq};
  p.dtype = c.dt;
  p.device = ioattn::Device::cuda;
  p.batch = c.b;
  p.heads_q = c.hq;
  p.heads_kv = c.hkv;
  p.seqlen_q = c.sq;
  p.seqlen_k = c.sk;
  p.head_dim = p.head_dim_v = c.d;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
  p.causal = c.causal;
  p.window_left = -1;
  p.window_right = c.causal ? 0 : -1;
  return p;
}

template <typename F>
void parallel_for(int64_t n, F f) {
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int64_t i = t; i < n; i += threads) f(i);
    });
  for (auto& th : pool) th.join();
}

struct Errors {
  double o = 0, lse = 0, naive_o = 0, naive_lse = 0;
  int64_t unwritten = 0;
};

// Runs one case; returns true if it passes.
bool run_case(const Case& c, std::mt19937_64& rng, bool verbose) {
  using namespace ioattn::detail;
  const int64_t nq = c.b * c.sq * c.hq * c.d, nk = c.b * c.sk * c.hkv * c.d;
  std::vector<uint16_t> q(nq), k(nk), v(nk);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto to16 = [&](float x) { return c.dt == DType::bf16 ? float_to_bf16(x) : float_to_f16(x); };
  auto from16 = [&](uint16_t x) { return c.dt == DType::bf16 ? bf16_to_float(x) : f16_to_float(x); };
  for (auto& x : q) x = to16(dist(rng));
  for (auto& x : k) x = to16(dist(rng));
  for (auto& x : v) x = to16(dist(rng));
  const uint16_t nan16 = c.dt == DType::bf16 ? 0x7fc0 : 0x7e00;
  std::vector<uint16_t> o(nq, nan16);
  std::vector<float> lse(c.b * c.hq * c.sq, std::numeric_limits<float>::quiet_NaN());

  void *dq, *dk, *dv, *dout;
  float* dlse;
  CHECK_CUDA(cudaMalloc(&dq, nq * 2 + 16));
  CHECK_CUDA(cudaMalloc(&dk, nk * 2 + 16));
  CHECK_CUDA(cudaMalloc(&dv, nk * 2 + 16));
  CHECK_CUDA(cudaMalloc(&dout, nq * 2 + 16));
  CHECK_CUDA(cudaMalloc(&dlse, lse.size() * 4 + 16));
  CHECK_CUDA(cudaMemcpy(dq, q.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, k.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, v.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dout, o.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dlse, lse.data(), lse.size() * 4, cudaMemcpyHostToDevice));

  const FwdProblem p = case_problem(c, dq, dk, dv, dout, dlse);

  std::string kernel, why;
  std::printf("%-52s ", case_name(c).c_str());
  std::fflush(stdout);  // a hang shows which case
  if (!sm90_flash_select(p, &kernel, &why)) {
    std::printf("FAIL not selected: %s\n", why.c_str());
    return false;
  }
  sm90_flash_forward(p);
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(o.data(), dout, nq * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(dq));
  CHECK_CUDA(cudaFree(dk));
  CHECK_CUDA(cudaFree(dv));
  CHECK_CUDA(cudaFree(dout));
  CHECK_CUDA(cudaFree(dlse));

  // Every output element written (NaN poison gone)?
  Errors err;
  for (auto x : o)
    if (std::isnan(from16(x))) ++err.unwritten;
  for (auto x : lse)
    if (std::isnan(x)) ++err.unwritten;

  // Rows to compare with the reference.
  std::vector<int64_t> rows;
  const bool sample = c.b * c.hq * c.sq * c.sk > (int64_t(1) << 23);
  for (int64_t i = 0; i < c.sq; ++i)
    if (!sample || i < 130 || i >= c.sq - 130 || i % 17 == 0) rows.push_back(i);
  const int64_t work = c.b * c.hq * static_cast<int64_t>(rows.size());
  std::vector<Errors> per(work);
  const int64_t group = c.hq / c.hkv;
  const double scale = p.scale;
  const double ninf = -std::numeric_limits<double>::infinity();
  auto rnd = [&](double x) { return static_cast<double>(round_to(c.dt, static_cast<float>(x))); };
  parallel_for(work, [&](int64_t w) {
    const int64_t i = rows[w % rows.size()];
    const int64_t h = (w / rows.size()) % c.hq, b = w / rows.size() / c.hq, hk = h / group;
    int64_t lo, hi;
    visible_keys(i, c.sq, c.sk, -1, c.causal ? 0 : -1, &lo, &hi);
    auto qe = [&](int64_t x) { return from16(q[b * p.q_stride.batch + i * p.q_stride.seq + h * p.q_stride.head + x]); };
    auto ke = [&](int64_t j, int64_t x) {
      return from16(k[b * p.k_stride.batch + j * p.k_stride.seq + hk * p.k_stride.head + x]);
    };
    auto ve = [&](int64_t j, int64_t x) {
      return from16(v[b * p.v_stride.batch + j * p.v_stride.seq + hk * p.v_stride.head + x]);
    };
    const int64_t n = std::max<int64_t>(hi - lo, 0);
    std::vector<double> s(n), se(n), ref(c.d, 0.0), emu(c.d, 0.0);
    std::vector<float> qs(c.d);
    for (int64_t x = 0; x < c.d; ++x) qs[x] = round_to(c.dt, static_cast<float>(qe(x) * scale));
    double m = ninf, me = ninf;
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      float facc = 0;
      for (int64_t x = 0; x < c.d; ++x) {
        const float kv = ke(lo + j, x);
        acc += static_cast<double>(qe(x)) * kv;
        facc += qs[x] * kv;
      }
      s[j] = acc * scale;
      se[j] = rnd(facc);
      m = std::max(m, s[j]);
      me = std::max(me, se[j]);
    }
    double l = 0, le = 0;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      se[j] = std::exp(se[j] - me);
      l += s[j];
      le += se[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      const double pr = s[j] / l, pe = rnd(se[j] / le);
      for (int64_t x = 0; x < c.d; ++x) {
        const double vv = ve(lo + j, x);
        ref[x] += pr * vv;
        emu[x] += pe * vv;
      }
    }
    const double ref_lse = n > 0 ? m + std::log(l) : ninf, emu_lse = n > 0 ? me + std::log(le) : ninf;
    Errors& e = per[w];
    for (int64_t x = 0; x < c.d; ++x) {
      const double got = from16(o[b * p.o_stride.batch + i * p.o_stride.seq + h * p.o_stride.head + x]);
      e.o = std::max(e.o, std::isnan(got) ? INFINITY : std::fabs(got - ref[x]));
      e.naive_o = std::max(e.naive_o, std::fabs(rnd(emu[x]) - ref[x]));
    }
    const double got_lse = lse[b * p.lse_stride.batch + h * p.lse_stride.head + i * p.lse_stride.seq];
    if (n == 0) {
      if (!(std::isinf(got_lse) && got_lse < 0)) e.lse = INFINITY;
    } else {
      e.lse = std::isnan(got_lse) ? INFINITY : std::fabs(got_lse - ref_lse);
      e.naive_lse = std::fabs(emu_lse - ref_lse);
    }
  });
  for (const Errors& e : per) {
    err.o = std::max(err.o, e.o);
    err.lse = std::max(err.lse, e.lse);
    err.naive_o = std::max(err.naive_o, e.naive_o);
    err.naive_lse = std::max(err.naive_lse, e.naive_lse);
  }
  const double atol = 1e-3;
  const bool ok = err.unwritten == 0 && err.o <= 2 * err.naive_o + atol && err.lse <= 2 * err.naive_lse + atol;
  if (!ok || verbose)
    std::printf("%s O err %.2e (naive %.2e)  LSE err %.2e (naive %.2e)  unwritten %lld\n", ok ? "ok  " : "FAIL",
                err.o, err.naive_o, err.lse, err.naive_lse, (long long)err.unwritten);
  return ok;
}

int run_checks() {
  std::mt19937_64 rng(20261129);
  int pass = 0, fail = 0;
  struct Shape {
    int64_t b, hq, hkv, sq, sk;
    bool bhsd;
  };
  const Shape shapes[] = {
      {1, 2, 2, 1, 1, false},     {2, 2, 2, 17, 17, false},    {2, 4, 1, 113, 203, false}, {2, 4, 1, 203, 113, true},
      {1, 8, 2, 17, 1, false},    {1, 4, 1, 1023, 1024, false}, {1, 2, 2, 4097, 4097, true},
      {1, 24, 6, 777, 1500, false},  // 168 tiles > 132 SMs: CTAs run several tiles
      {1, 2, 1, 300, 10, false},     // causal: the first query tile sees no key (n_blocks = 0)
  };
  for (DType dt : {DType::bf16, DType::f16})
    for (int64_t d : {64, 128, 256})
      for (bool causal : {false, true})
        for (const Shape& s : shapes) {
          const Case c{s.b, s.hq, s.hkv, s.sq, s.sk, d, dt, causal, s.bhsd};
          if (run_case(c, rng, true))
            ++pass;
          else
            ++fail;
        }
  std::printf("\nsm90 correctness: %d passed, %d failed\n", pass, fail);
  return fail == 0 ? 0 : 1;
}

// Uniform(-1, 1) bf16 from a hash of the index (no host round trip for big inputs).
__global__ void fill_uniform(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32) * 40503u;
    h ^= h >> 16;
    h *= 2246822519u;
    h ^= h >> 13;
    h *= 3266489917u;
    h ^= h >> 16;
    x[i] = __float2bfloat16(static_cast<float>(h) * (2.0f / 4294967296.0f) - 1.0f);
  }
}

// ---- FP8 (e4m3) ------------------------------------------------------------------------------
// Inputs: e4m3 codes of Uniform(-2, 2), descales per (batch, kv head) in [0.5, 1.5] (or none).
// Reference: float64 attention of the dequantised inputs (code * descale). Naive fp8 baseline,
// "standard attention in the same low precision": S = Q K^T on fp8 tensor cores, modelled as fp32
// sums over each 32-element k-step added into an accumulator truncated to 14 significant bits (Hopper's
// fp8 wgmma accumulates with about 14 bits: DeepSeek-V3 report, sec. 3.3.2; a model of that, not
// its exact rounding), the unnormalised P = exp(S - max) rounded to e4m3 (as an fp8 kernel feeds
// its P V GEMM), normalised by the fp32 row sum, O rounded to the output dtype.
// Rule: max|O - ref| <= 2 * max|O_naive_fp8 - ref| + 1e-3, LSE likewise.
struct Fp8Case {
  int64_t b, hq, hkv, sq, sk;
  bool causal, bhsd, descale;
  DType out;
  int64_t d = 128;  // head dim: 64, 128 or 256
};

std::string fp8_case_name(const Fp8Case& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "f8e4m3->%s d%lld b%lld hq%lld hkv%lld %lldx%lld %s%s%s",
                c.out == DType::bf16 ? "bf16" : "f16", (long long)c.d, (long long)c.b, (long long)c.hq,
                (long long)c.hkv, (long long)c.sq, (long long)c.sk, c.causal ? "causal" : "full", c.bhsd ? " bhsd" : "",
                c.descale ? "" : " no-descale");
  return buf;
}

bool run_fp8_case(const Fp8Case& c, std::mt19937_64& rng, bool verbose) {
  using namespace ioattn::detail;
  const int64_t d = c.d;
  const Case shape{c.b, c.hq, c.hkv, c.sq, c.sk, d, DType::bf16, c.causal, c.bhsd};
  const int64_t nq = c.b * c.sq * c.hq * d, nk = c.b * c.sk * c.hkv * d;
  std::vector<uint8_t> q(nq), k(nk), v(nk);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f), dsd(0.5f, 1.5f);
  for (auto& x : q) x = float_to_e4m3(dist(rng));
  for (auto& x : k) x = float_to_e4m3(dist(rng));
  for (auto& x : v) x = float_to_e4m3(dist(rng));
  std::vector<float> qd(c.b * c.hkv, 1.0f), kd(qd), vd(qd);
  if (c.descale)
    for (auto* ds : {&qd, &kd, &vd})
      for (auto& x : *ds) x = dsd(rng);
  auto from16 = [&](uint16_t x) { return c.out == DType::bf16 ? bf16_to_float(x) : f16_to_float(x); };
  const uint16_t nan16 = c.out == DType::bf16 ? 0x7fc0 : 0x7e00;
  std::vector<uint16_t> o(nq, nan16);
  std::vector<float> lse(c.b * c.hq * c.sq, std::numeric_limits<float>::quiet_NaN());

  void *dq, *dk, *dv, *dout;
  float *dlse, *dds;
  CHECK_CUDA(cudaMalloc(&dq, nq + 16));
  CHECK_CUDA(cudaMalloc(&dk, nk + 16));
  CHECK_CUDA(cudaMalloc(&dv, nk + 16));
  CHECK_CUDA(cudaMalloc(&dout, nq * 2 + 16));
  CHECK_CUDA(cudaMalloc(&dlse, lse.size() * 4 + 16));
  CHECK_CUDA(cudaMalloc(&dds, 3 * qd.size() * 4 + 16));
  CHECK_CUDA(cudaMemcpy(dq, q.data(), nq, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, k.data(), nk, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, v.data(), nk, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dout, o.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dlse, lse.data(), lse.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dds, qd.data(), qd.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dds + qd.size(), kd.data(), qd.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dds + 2 * qd.size(), vd.data(), qd.size() * 4, cudaMemcpyHostToDevice));

  FwdProblem p = case_problem(shape, dq, dk, dv, dout, dlse);
  p.dtype = DType::f8e4m3;
  p.fp8_out = c.out;
  if (c.descale) {
    p.q_descale = {dds, c.hkv, 1};
    p.k_descale = {dds + qd.size(), c.hkv, 1};
    p.v_descale = {dds + 2 * qd.size(), c.hkv, 1};
  }

  std::string kernel, why;
  std::printf("%-52s ", fp8_case_name(c).c_str());
  std::fflush(stdout);
  if (!sm90_flash_select(p, &kernel, &why)) {
    std::printf("FAIL not selected: %s\n", why.c_str());
    return false;
  }
  sm90_flash_forward(p);
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(o.data(), dout, nq * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
  for (void* ptr : {dq, dk, dv, dout, static_cast<void*>(dlse), static_cast<void*>(dds)}) CHECK_CUDA(cudaFree(ptr));

  Errors err;
  for (auto x : o)
    if (std::isnan(from16(x))) ++err.unwritten;
  for (auto x : lse)
    if (std::isnan(x)) ++err.unwritten;
  std::vector<int64_t> rows;
  const bool sample = c.b * c.hq * c.sq * c.sk > (int64_t(1) << 23);
  for (int64_t i = 0; i < c.sq; ++i)
    if (!sample || i < 130 || i >= c.sq - 130 || i % 17 == 0) rows.push_back(i);
  const int64_t work = c.b * c.hq * static_cast<int64_t>(rows.size());
  std::vector<Errors> per(work);
  const int64_t group = c.hq / c.hkv;
  const double scale = p.scale;
  const double ninf = -std::numeric_limits<double>::infinity();
  parallel_for(work, [&](int64_t w) {
    const int64_t i = rows[w % rows.size()];
    const int64_t h = (w / rows.size()) % c.hq, b = w / rows.size() / c.hq, hk = h / group;
    int64_t lo, hi;
    visible_keys(i, c.sq, c.sk, -1, c.causal ? 0 : -1, &lo, &hi);
    const float dsq = qd[b * c.hkv + hk], dsk = kd[b * c.hkv + hk], dsv = vd[b * c.hkv + hk];
    auto qc = [&](int64_t x) {  // codes as values (no descale)
      return e4m3_to_float(q[b * p.q_stride.batch + i * p.q_stride.seq + h * p.q_stride.head + x]);
    };
    auto kc = [&](int64_t j, int64_t x) {
      return e4m3_to_float(k[b * p.k_stride.batch + j * p.k_stride.seq + hk * p.k_stride.head + x]);
    };
    auto ve = [&](int64_t j, int64_t x) {
      return e4m3_to_float(v[b * p.v_stride.batch + j * p.v_stride.seq + hk * p.v_stride.head + x]) * dsv;
    };
    const int64_t n = std::max<int64_t>(hi - lo, 0);
    std::vector<double> s(n), se(n), ref(d, 0.0), emu(d, 0.0);
    double m = ninf, me = ninf;
    for (int64_t j = 0; j < n; ++j) {
      // The kernel multiplies codes and folds the descales into the scale; so does the model.
      double acc = 0;
      float facc = 0;
      for (int64_t x0 = 0; x0 < d; x0 += 32) {
        float part = 0;
        for (int64_t x = x0; x < x0 + 32; ++x) {
          const float qv = qc(x), kv = kc(lo + j, x);
          acc += (static_cast<double>(qv) * dsq) * (static_cast<double>(kv) * dsk);
          part += qv * kv;  // a product of two e4m3 values is exact in fp32
        }
        facc = round_fp8_accumulator(facc + part);
      }
      s[j] = acc * scale;
      se[j] = static_cast<double>(facc * (p.scale * (dsq * dsk)));
      m = std::max(m, s[j]);
      me = std::max(me, se[j]);
    }
    double l = 0, le = 0;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      se[j] = std::exp(se[j] - me);
      l += s[j];
      le += se[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      const double pr = s[j] / l, pe = e4m3_to_float(float_to_e4m3(static_cast<float>(se[j]))) / le;
      for (int64_t x = 0; x < d; ++x) {
        const double vv = ve(lo + j, x);
        ref[x] += pr * vv;
        emu[x] += pe * vv;
      }
    }
    const double ref_lse = n > 0 ? m + std::log(l) : ninf, emu_lse = n > 0 ? me + std::log(le) : ninf;
    Errors& e = per[w];
    for (int64_t x = 0; x < d; ++x) {
      const double got = from16(o[b * p.o_stride.batch + i * p.o_stride.seq + h * p.o_stride.head + x]);
      e.o = std::max(e.o, std::isnan(got) ? INFINITY : std::fabs(got - ref[x]));
      e.naive_o = std::max(e.naive_o, std::fabs(round_to(c.out, static_cast<float>(emu[x])) - ref[x]));
    }
    const double got_lse = lse[b * p.lse_stride.batch + h * p.lse_stride.head + i * p.lse_stride.seq];
    if (n == 0) {
      if (!(std::isinf(got_lse) && got_lse < 0)) e.lse = INFINITY;
    } else {
      e.lse = std::isnan(got_lse) ? INFINITY : std::fabs(got_lse - ref_lse);
      e.naive_lse = std::fabs(emu_lse - ref_lse);
    }
  });
  for (const Errors& e : per) {
    err.o = std::max(err.o, e.o);
    err.lse = std::max(err.lse, e.lse);
    err.naive_o = std::max(err.naive_o, e.naive_o);
    err.naive_lse = std::max(err.naive_lse, e.naive_lse);
  }
  const double atol = 1e-3;
  const bool ok = err.unwritten == 0 && err.o <= 2 * err.naive_o + atol && err.lse <= 2 * err.naive_lse + atol;
  if (!ok || verbose)
    std::printf("%s O err %.2e (naive fp8 %.2e)  LSE err %.2e (naive %.2e)  unwritten %lld\n", ok ? "ok  " : "FAIL",
                err.o, err.naive_o, err.lse, err.naive_lse, (long long)err.unwritten);
  return ok;
}

int run_fp8_checks() {
  std::mt19937_64 rng(20261130);
  int pass = 0, fail = 0;
  struct Shape {
    int64_t b, hq, hkv, sq, sk;
    bool bhsd;
  };
  const Shape shapes[] = {
      {1, 2, 2, 1, 1, false},     {2, 2, 2, 17, 17, false},     {2, 4, 1, 113, 203, false}, {2, 4, 1, 203, 113, true},
      {1, 8, 2, 17, 1, false},    {1, 4, 1, 1023, 1024, false}, {1, 2, 2, 4097, 4097, true},
      {1, 24, 6, 777, 1500, false},  // 168 tiles of 128 rows > 132 SMs
      {1, 32, 8, 1000, 1500, false},  // 192 tiles of 192 rows (3-warpgroup rows) > 132 SMs
      {1, 2, 1, 300, 10, false},     // causal: the first query tile sees no key
  };
  for (bool causal : {false, true})
    for (const Shape& s : shapes) {
      const Fp8Case c{s.b, s.hq, s.hkv, s.sq, s.sk, causal, s.bhsd, true, DType::bf16};
      (run_fp8_case(c, rng, true) ? pass : fail)++;
    }
  // f16 output and no descales (null pointers = 1).
  for (bool causal : {false, true}) {
    (run_fp8_case({2, 4, 1, 113, 203, causal, false, true, DType::f16}, rng, true) ? pass : fail)++;
    (run_fp8_case({1, 4, 2, 1023, 1024, causal, true, false, DType::bf16}, rng, true) ? pass : fail)++;
  }
  // hdim 64 (3 warpgroups, 192x128, 64-byte swizzled Q / K) and hdim 256 (128x128): a subset of the
  // shapes (bf16 output, descales), then f16 output without descales.  CTAs walk more than one tile in
  // the 777x1500 case at hdim 256 (168 tiles) and in the 1000x1500 one at hdim 64 (192 tiles).
  const Shape shapes_d[] = {
      {1, 2, 2, 1, 1, false}, {2, 4, 1, 113, 203, false}, {2, 4, 1, 203, 113, true},
      {1, 24, 6, 777, 1500, false}, {1, 32, 8, 1000, 1500, false},
      {1, 4, 2, 1023, 1024, false}, {1, 2, 2, 4097, 4097, true}, {1, 2, 1, 300, 10, false},
  };
  for (const int64_t d : {int64_t(64), int64_t(256)})
    for (bool causal : {false, true}) {
      for (const Shape& s : shapes_d)
        (run_fp8_case({s.b, s.hq, s.hkv, s.sq, s.sk, causal, s.bhsd, true, DType::bf16, d}, rng, true) ? pass : fail)++;
      (run_fp8_case({2, 4, 1, 113, 203, causal, false, false, DType::f16, d}, rng, true) ? pass : fail)++;
    }
  std::printf("\nsm90 fp8 correctness: %d passed, %d failed\n", pass, fail);
  return fail == 0 ? 0 : 1;
}

// e4m3 codes of Uniform(-1, 1) from a hash of the index.
__global__ void fill_uniform_e4m3(uint8_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32) * 40503u;
    h ^= h >> 16;
    h *= 2246822519u;
    h ^= h >> 13;
    h *= 3266489917u;
    h ^= h >> 16;
    x[i] = __nv_fp8_e4m3(static_cast<float>(h) * (2.0f / 4294967296.0f) - 1.0f).__x;
  }
}

// Median milliseconds of `reps` launches of f (CUDA events around each, back to back).
template <class F>
void time_median(F f, int reps, cudaEvent_t* ev, double* med, double* lo, double* hi) {
  for (int w = 0; w < 3; ++w) f();
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(ev[2 * r]));
    f();
    CHECK_CUDA(cudaEventRecord(ev[2 * r + 1]));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms(reps);
  for (int r = 0; r < reps; ++r) CHECK_CUDA(cudaEventElapsedTime(&ms[r], ev[2 * r], ev[2 * r + 1]));
  std::sort(ms.begin(), ms.end());
  *med = ms[reps / 2];
  *lo = ms[0];
  *hi = ms[reps - 1];
}

// The timed bf16 problem of the benches: BSHD, b x s tokens, h heads of dim d, no GQA, LSE out.
FwdProblem bench_problem(void* q, void* k, void* v, void* o, float* lse, int64_t b, int64_t h, int64_t s, int64_t d,
                         bool causal) {
  return case_problem(Case{b, h, h, s, s, d, DType::bf16, causal, false}, q, k, v, o, lse);
}

// FP8 vs bf16 at hdim 128, 64 and 256, 16k tokens, hidden 2048 (16 / 32 / 8 heads), seqlen 4k/8k/16k, causal and not,
// in one run: bf16 kernel, fp8 kernel (V^T pre-pass included, as a caller sees it), and the
// pre-pass alone. Ratio = fp8 TFLOP/s / bf16 TFLOP/s (the issue's target: >= 1.5 at >= 4k).
int run_fp8_bench(FILE* csv, int reps) {
  constexpr int64_t kTokens = 16384, kHidden = 2048;
  const int64_t n = kTokens * kHidden;
  void *q16, *k16, *v16, *q8, *k8, *v8, *o;
  float *lse, *ds;
  CHECK_CUDA(cudaMalloc(&q16, n * 2));
  CHECK_CUDA(cudaMalloc(&k16, n * 2));
  CHECK_CUDA(cudaMalloc(&v16, n * 2));
  CHECK_CUDA(cudaMalloc(&q8, n));
  CHECK_CUDA(cudaMalloc(&k8, n));
  CHECK_CUDA(cudaMalloc(&v8, n));
  CHECK_CUDA(cudaMalloc(&o, n * 2));
  CHECK_CUDA(cudaMalloc(&lse, kTokens * (kHidden / 64) * 4));  // the most heads (hdim 64)
  CHECK_CUDA(cudaMalloc(&ds, 3 * kTokens * 4));  // descales: >= batch * heads_kv each
  fill_uniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(q16), n, 1);
  fill_uniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(k16), n, 2);
  fill_uniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(v16), n, 3);
  fill_uniform_e4m3<<<1024, 256>>>(static_cast<uint8_t*>(q8), n, 1);
  fill_uniform_e4m3<<<1024, 256>>>(static_cast<uint8_t*>(k8), n, 2);
  fill_uniform_e4m3<<<1024, 256>>>(static_cast<uint8_t*>(v8), n, 3);
  {
    std::vector<float> ones(3 * kTokens, 1.0f);
    CHECK_CUDA(cudaMemcpy(ds, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  }
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  // hdim 128 first (its rows start with the seqlen: tools/gpu-check.sh's fp8ab stage parses them), then
  // hdim 64 (32 heads; rows prefixed "d64") and hdim 256 (8 heads; "d256").
  for (const int64_t d : {int64_t(128), int64_t(64), int64_t(256)}) {
    const int64_t h = kHidden / d;
    const char* prefix = d == 128 ? "" : d == 64 ? "d64 " : "d256 ";
    std::printf("\nfp8 vs bf16, hdim %lld (16k tokens, %lld heads; fp8 includes its V^T pre-pass)\n", (long long)d,
                (long long)h);
    std::printf("%s%-6s %-7s %10s %9s %10s %9s %7s %12s  %s\n", prefix, "seqlen", "causal", "bf16 ms", "TFLOP/s",
                "fp8 ms", "TFLOP/s", "ratio", "pre-pass ms", "fp8 kernel");
    for (int64_t s : {4096, 8192, 16384})
      for (bool causal : {false, true}) {
        const int64_t b = kTokens / s;
        FwdProblem p = bench_problem(q16, k16, v16, o, lse, b, h, s, d, causal);
        FwdProblem p8 = p;
        p8.q = q8;
        p8.k = k8;
        p8.v = v8;
        p8.dtype = DType::f8e4m3;
        p8.fp8_out = DType::bf16;
        p8.q_descale = {ds, h, 1};
        p8.k_descale = {ds + kTokens, h, 1};
        p8.v_descale = {ds + 2 * kTokens, h, 1};
        std::string k16name, k8name, why;
        if (!ioattn::detail::sm90_flash_select(p, &k16name, &why) || !ioattn::detail::sm90_flash_select(p8, &k8name, &why)) {
          std::printf("seqlen %lld not selected: %s\n", (long long)s, why.c_str());
          continue;
        }
        double t16, t16lo, t16hi, t8, t8lo, t8hi, tt, ttlo, tthi;
        time_median([&] { ioattn::detail::sm90_flash_forward(p); }, reps, ev.data(), &t16, &t16lo, &t16hi);
        time_median([&] { ioattn::detail::sm90_flash_forward(p8); }, reps, ev.data(), &t8, &t8lo, &t8hi);
        time_median([&] { ioattn::detail::sm90_fp8_transpose_only(p8); }, reps, ev.data(), &tt, &ttlo, &tthi);
        const double flops = 4.0 * b * h * double(s) * s * d / (causal ? 2.0 : 1.0);
        const double tf16 = flops / (t16 * 1e-3) / 1e12, tf8 = flops / (t8 * 1e-3) / 1e12;
        std::printf("%s%-6lld %-7s %10.3f %9.1f %10.3f %9.1f %7.2f %12.4f  %s\n", prefix, (long long)s, causal ? "yes" : "no",
                    t16, tf16, t8, tf8, tf8 / tf16, tt, k8name.c_str());
        if (csv) {
          std::fprintf(csv, "ioattn_sm90_bf16_vs_fp8,%lld,%lld,%d,%lld,%lld,%.4f,%.2f\n", (long long)d, (long long)s, causal ? 1 : 0,
                       (long long)b, (long long)h, t16, tf16);
          std::fprintf(csv, "ioattn_sm90_fp8,%lld,%lld,%d,%lld,%lld,%.4f,%.2f\n", (long long)d, (long long)s,
                       causal ? 1 : 0, (long long)b, (long long)h, t8, tf8);
          std::fprintf(csv, "ioattn_sm90_fp8_prepass,%lld,%lld,%d,%lld,%lld,%.4f,0\n", (long long)d, (long long)s,
                       causal ? 1 : 0, (long long)b, (long long)h, tt);
        }
      }
  }
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  for (void* ptr : {q16, k16, v16, q8, k8, v8, o, static_cast<void*>(lse), static_cast<void*>(ds)}) CHECK_CUDA(cudaFree(ptr));
  return 0;
}

int run_bench(const char* csv_path, bool fp8_only) {
  // Timed launches per shape (median reported): IOATTN_SM90_BENCH_REPS, default 25, at most 200.
  int reps = 25;
  if (const char* e = std::getenv("IOATTN_SM90_BENCH_REPS")) reps = std::max(1, std::min(200, std::atoi(e)));
  if (fp8_only) {
    FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
    if (csv) std::fprintf(csv, "impl,hdim,seqlen,causal,batch,heads,ms,tflops\n");
    run_fp8_bench(csv, reps);
    if (csv) std::fclose(csv);
    return 0;
  }
  constexpr int64_t kTokens = 16384, kHidden = 2048;
  const int64_t n = kTokens * kHidden;
  void *q, *k, *v, *o;
  float* lse;
  CHECK_CUDA(cudaMalloc(&q, n * 2));
  CHECK_CUDA(cudaMalloc(&k, n * 2));
  CHECK_CUDA(cudaMalloc(&v, n * 2));
  CHECK_CUDA(cudaMalloc(&o, n * 2));
  CHECK_CUDA(cudaMalloc(&lse, kTokens * 128 * 4));  // heads <= 32
  fill_uniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(q), n, 1);
  fill_uniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(k), n, 2);
  fill_uniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(v), n, 3);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
  if (csv) std::fprintf(csv, "impl,hdim,seqlen,causal,batch,heads,ms,tflops\n");
  std::printf("\n%-6s %-6s %-7s %-6s %-6s %10s %9s  %s\n", "hdim", "seqlen", "causal", "batch", "heads", "ms", "TFLOP/s",
              "kernel");
  cudaEvent_t ev[2 * 200];
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int64_t d : {64, 128, 256})
    for (int64_t s : {2048, 4096, 8192, 16384})
      for (bool causal : {false, true}) {
        const int64_t b = kTokens / s, h = kHidden / d;
        FwdProblem p = bench_problem(q, k, v, o, lse, b, h, s, d, causal);
        std::string kernel, why;
        if (!ioattn::detail::sm90_flash_select(p, &kernel, &why)) {
          std::printf("hdim %lld not selected: %s\n", (long long)d, why.c_str());
          continue;
        }
        for (int w = 0; w < 3; ++w) ioattn::detail::sm90_flash_forward(p);
        const int kReps = reps;
        for (int r = 0; r < kReps; ++r) {
          CHECK_CUDA(cudaEventRecord(ev[2 * r]));
          ioattn::detail::sm90_flash_forward(p);
          CHECK_CUDA(cudaEventRecord(ev[2 * r + 1]));
        }
        CHECK_CUDA(cudaDeviceSynchronize());
        std::vector<float> ms(kReps);
        for (int r = 0; r < kReps; ++r) CHECK_CUDA(cudaEventElapsedTime(&ms[r], ev[2 * r], ev[2 * r + 1]));
        std::sort(ms.begin(), ms.end());
        const double med = ms[kReps / 2];
        const double flops = 4.0 * b * h * double(s) * s * d / (causal ? 2.0 : 1.0);
        const double tflops = flops / (med * 1e-3) / 1e12;
        std::printf("%-6lld %-6lld %-7s %-6lld %-6lld %10.3f %9.1f  %s (min %.3f max %.3f)\n", (long long)d,
                    (long long)s, causal ? "yes" : "no", (long long)b, (long long)h, med, tflops, kernel.c_str(), ms[0],
                    ms[kReps - 1]);
        if (csv)
          std::fprintf(csv, "ioattn_sm90,%lld,%lld,%d,%lld,%lld,%.4f,%.2f\n", (long long)d, (long long)s, causal ? 1 : 0,
                       (long long)b, (long long)h, med, tflops);
      }
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  run_fp8_bench(csv, reps);
  if (csv) std::fclose(csv);
  CHECK_CUDA(cudaFree(q));
  CHECK_CUDA(cudaFree(k));
  CHECK_CUDA(cudaFree(v));
  CHECK_CUDA(cudaFree(o));
  CHECK_CUDA(cudaFree(lse));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  bool check = true, bench = true, fp8_only = false;
  const char* csv = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--probe")) return std::printf("probe ok\n"), 0;  // does the binary load?
    if (!std::strcmp(argv[i], "--fp8-only")) fp8_only = true;
    else if (!std::strcmp(argv[i], "--check-only")) bench = false;
    else if (!std::strcmp(argv[i], "--bench-only")) check = false;
    else if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) csv = argv[++i];
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("skipped: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("skipped: device is not sm_90 (the wgmma kernel needs Hopper)\n");
    return 0;
  }
  int rc = 0;
  try {
    if (check && !fp8_only) rc = run_checks();
    if (check) rc |= run_fp8_checks();
    if (bench) run_bench(csv, fp8_only);
  } catch (const std::exception& e) {
    std::printf("FAIL: exception: %s\n", e.what());
    return 1;
  }
  return rc;
}

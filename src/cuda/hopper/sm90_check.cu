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
// Run:   ioattn_sm90_check [--check-only | --bench-only] [--csv FILE]
// Exit 0 = all checks passed (or no CUDA device: prints "skipped: no CUDA device").
#include <cuda_bf16.h>
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

  FwdProblem p;
  p.q = dq;
  p.k = dk;
  p.v = dv;
  p.o = dout;
  p.lse = dlse;
  p.q_stride = strides(c, c.sq, c.hq);
  p.k_stride = strides(c, c.sk, c.hkv);
  p.v_stride = p.k_stride;
  p.o_stride = p.q_stride;
  p.lse_stride = {c.hq * c.sq, 1, c.sq};  // [b, h, s]: batch, seq, head
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

int run_bench(const char* csv_path) {
  // Timed launches per shape (median reported): IOATTN_SM90_BENCH_REPS, default 25, at most 200.
  int reps = 25;
  if (const char* e = std::getenv("IOATTN_SM90_BENCH_REPS")) reps = std::max(1, std::min(200, std::atoi(e)));
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
        FwdProblem p;
        p.q = q;
        p.k = k;
        p.v = v;
        p.o = o;
        p.lse = lse;
        p.q_stride = p.k_stride = p.v_stride = p.o_stride = {s * h * d, h * d, d};
        p.lse_stride = {h * s, 1, s};
        p.dtype = DType::bf16;
        p.device = ioattn::Device::cuda;
        p.batch = b;
        p.heads_q = p.heads_kv = h;
        p.seqlen_q = p.seqlen_k = s;
        p.head_dim = p.head_dim_v = d;
        p.scale = static_cast<float>(1.0 / std::sqrt(double(d)));
        p.causal = causal;
        p.window_right = causal ? 0 : -1;
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
  if (csv) std::fclose(csv);
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
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
  bool check = true, bench = true;
  const char* csv = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--probe")) return std::printf("probe ok\n"), 0;  // does the binary load?
    if (!std::strcmp(argv[i], "--check-only")) bench = false;
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
    if (check) rc = run_checks();
    if (bench) run_bench(csv);
  } catch (const std::exception& e) {
    std::printf("FAIL: exception: %s\n", e.what());
    return 1;
  }
  return rc;
}

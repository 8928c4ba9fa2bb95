// ioattn_cuda_bwd_tune — sweeps candidate backward tiles (flash_bwd_tune_d*.cu) on the benchmark
// grid (batch·seqlen = 16k tokens, hidden 2048, heads = hidden / hdim, bf16, causal and not,
// default atomic-dQ mode) and prints one JSON line per (candidate, shape), then a table of the
// best candidate per shape and its speedup over the shipped tile.
//
//   ioattn_cuda_bwd_tune [--hdims 128,256,64] [--seqlens 1024,4096,16384] [--tokens 16384]
//                        [--hidden 2048] [--repeats 10] [--budget-s 100]
//
// What is timed: the whole backward launch sequence of the library (run_flash_backward:
// workspace, dQ-accumulator memset, preprocess, dK/dV with atomic dQ, dQ convert) with only the
// tile swapped, CUDA events, median of --repeats batches after a warm-up (bench_util.cuh). The
// line "impl": "library" times backward() itself (validation included) as a cross-check.
// Backward FLOPs = 2.5 x forward (4·b·h·s²·d, halved when causal), FlashAttention's convention.
//
// Correctness: every candidate's dQ, dK, dV against backward()'s on the same inputs (Q, K, V,
// dO uniform in [-1, 1), O and LSE from forward()): max |diff| per gradient and the largest of
// them relative to max |reference|; > 2e-2 is flagged ("ok": false) and the candidate is left out
// of the "best" table. Outputs are NaN-poisoned before each candidate's first run.
//
// Kernel resources per candidate (cudaFuncGetAttributes + the occupancy calculator): registers,
// local memory (spills), smem, resident CTAs/SM. The build log has ptxas -v for the same kernels.
//
// --budget-s: no new (candidate, shape) run starts after that many seconds; what was skipped is
// listed at the end (head dims run in --hdims order, the slowest shapes of each last).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "core/validate.hpp"
#include "cuda/bench_util.cuh"
#include "cuda/flash_bwd_tune.cuh"
#include "ioattn/ioattn.hpp"

namespace {

using namespace ioattn;
namespace cb = ioattn::cuda::bench;
namespace bt = ioattn::cuda::bwd_tune;

constexpr double kRelTol = 2e-2;  // max |diff| / max |reference| above this: not the same function

std::string arg(int argc, char** argv, const char* name, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

// out[0] = max |a - b|, out[1] = max |b| (as float bits: for non-negative floats, and NaN above
// +inf, the unsigned order is the float order, so atomicMax works and a NaN wins).
__global__ void max_diff_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, unsigned* out) {
  float d = 0.f, r = 0.f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    const float e = fabsf(x - y);
    d = (e > d || e != e) ? e : d;
    r = fmaxf(r, fabsf(y));
  }
  for (int m = 16; m >= 1; m /= 2) {
    const float od = __shfl_xor_sync(0xffffffffu, d, m), orr = __shfl_xor_sync(0xffffffffu, r, m);
    d = (od > d || od != od) ? od : d;
    r = fmaxf(r, orr);
  }
  if (threadIdx.x % 32 == 0) {
    atomicMax(out, __float_as_uint(d));
    atomicMax(out + 1, __float_as_uint(r));
  }
}

struct Diff {
  float abs = 0.f, ref_max = 0.f;
};

Diff max_diff(const void* a, const void* b, int64_t n, unsigned* scratch) {
  IOATTN_CUDA_CHECK(cudaMemset(scratch, 0, 2 * sizeof(unsigned)));
  max_diff_kernel<<<1024, 256>>>(static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b), n,
                                 scratch);
  IOATTN_CUDA_CHECK_LAUNCH("max_diff_kernel");
  unsigned h[2];
  IOATTN_CUDA_CHECK(cudaMemcpy(h, scratch, sizeof(h), cudaMemcpyDeviceToHost));
  Diff r;
  std::memcpy(&r.abs, &h[0], 4);
  std::memcpy(&r.ref_max, &h[1], 4);
  return r;
}

struct DeviceBuf {
  void* p = nullptr;
  explicit DeviceBuf(size_t bytes) { IOATTN_CUDA_CHECK(cudaMalloc(&p, bytes)); }
  ~DeviceBuf() { cudaFree(p); }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
};

struct Shape {
  int64_t d, s;
  bool causal;
  std::string key() const {
    return "d" + std::to_string(d) + " s" + std::to_string(s) + (causal ? " causal" : " full");
  }
};

struct Result {
  std::string cand;
  double ms;
  bool ok;
};

// A JSON number, or null for NaN/inf (a poisoned output that was never written).
std::string num(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", x);
  return buf;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (detail::cuda_device_count() == 0) {
      std::printf("skipped: no CUDA device\n");
      return 0;
    }
    const auto hdims = cb::parse_list(arg(argc, argv, "--hdims", "128,256,64"));
    const auto seqlens = cb::parse_list(arg(argc, argv, "--seqlens", "1024,4096,16384"));
    const int64_t tokens = std::stoll(arg(argc, argv, "--tokens", "16384"));
    const int64_t hidden = std::stoll(arg(argc, argv, "--hidden", "2048"));
    const int repeats = std::stoi(arg(argc, argv, "--repeats", "10"));
    const double budget_s = std::stod(arg(argc, argv, "--budget-s", "100"));
    const auto t_start = std::chrono::steady_clock::now();

    int optin = 0, sms = 0;
    IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop{};
    IOATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("{\"impl\": \"device\", \"name\": \"%s\", \"sms\": %d, \"smem_optin\": %d}\n", prop.name, sms, optin);

    unsigned* scratch = nullptr;
    IOATTN_CUDA_CHECK(cudaMalloc(&scratch, 2 * sizeof(unsigned)));
    std::vector<std::pair<Shape, std::vector<Result>>> table;
    std::vector<std::string> skipped;

    for (int64_t d : hdims) {
      std::vector<bt::Candidate> cands = d == 64    ? bt::candidates_d64()
                                         : d == 128 ? bt::candidates_d128()
                                         : d == 256 ? bt::candidates_d256()
                                                    : std::vector<bt::Candidate>{};
      if (cands.empty()) {
        std::fprintf(stderr, "ioattn_cuda_bwd_tune: no candidates for hdim %lld\n", (long long)d);
        continue;
      }
      // The shipped tile runs first: every other line reports its speedup over it.
      std::stable_partition(cands.begin(), cands.end(), [](const bt::Candidate& c) { return c.shipped; });
      if (!cands.front().shipped)
        std::fprintf(stderr, "ioattn_cuda_bwd_tune: hdim %lld: no candidate is BwdTraits' tile; speedups are vs backward()\n",
                     (long long)d);

      // Resources per candidate (the occupancy query needs the smem attribute: set it here).
      struct Res {
        int regs = 0, ctas = 0;
        size_t local = 0;
        bool fits = false;
      };
      std::vector<Res> res(cands.size());
      for (size_t i = 0; i < cands.size(); ++i) {
        const auto& c = cands[i];
        cudaFuncAttributes a{};
        IOATTN_CUDA_CHECK(cudaFuncGetAttributes(&a, c.info.dkdv_bf16));
        res[i].regs = a.numRegs;
        res[i].local = a.localSizeBytes;
        res[i].fits = c.info.smem_bytes <= static_cast<size_t>(optin);
        if (res[i].fits) {
          IOATTN_CUDA_CHECK(cudaFuncSetAttribute(c.info.dkdv_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(c.info.smem_bytes)));
          IOATTN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&res[i].ctas, c.info.dkdv_bf16,
                                                                          c.info.warps * 32, c.info.smem_bytes));
        }
        std::printf(
            "{\"impl\": \"kernel\", \"hdim\": %lld, \"candidate\": \"%s\", \"shipped\": %s, \"block_m\": %d, "
            "\"block_n\": %d, \"warps\": %d, \"min_blocks\": %d, \"col_splits\": %d, \"smem_kb\": %.1f, "
            "\"regs\": %d, \"local_bytes\": %zu, \"ctas_per_sm\": %d, \"fits\": %s}\n",
            (long long)d, c.name.c_str(), c.shipped ? "true" : "false", c.info.block_m, c.info.block_n, c.info.warps,
            c.min_blocks, c.info.col_splits, c.info.smem_bytes / 1024.0, res[i].regs, res[i].local, res[i].ctas,
            res[i].fits ? "true" : "false");
      }
      std::fflush(stdout);

      for (int64_t s : seqlens) {
        const int64_t b = std::max<int64_t>(1, tokens / s), h = hidden / d, n = b * s * h * d;
        const size_t bytes = static_cast<size_t>(n) * 2;
        DeviceBuf q(bytes), k(bytes), v(bytes), o(bytes), dout(bytes), lse(static_cast<size_t>(b * h * s) * 4);
        DeviceBuf dq_ref(bytes), dk_ref(bytes), dv_ref(bytes), dq(bytes), dk(bytes), dv(bytes);
        cb::fill_uniform(q.p, true, n, 21);
        cb::fill_uniform(k.p, true, n, 22);
        cb::fill_uniform(v.p, true, n, 23);
        cb::fill_uniform(dout.p, true, n, 24);
        auto view = [&](void* p) { return TensorView::contiguous(p, DType::bf16, {b, s, h, d}, Device::cuda); };
        const TensorView lse_v = TensorView::contiguous(lse.p, DType::f32, {b, h, s}, Device::cuda);
        Gradients g_ref, g;
        g_ref.dq = view(dq_ref.p), g_ref.dk = view(dk_ref.p), g_ref.dv = view(dv_ref.p);
        g.dq = view(dq.p), g.dk = view(dk.p), g.dv = view(dv.p);

        for (bool causal : {false, true}) {
          const Shape shape{d, s, causal};
          if (seconds_since(t_start) > budget_s) {  // not even the reference
            skipped.push_back(shape.key() + " (all candidates)");
            continue;
          }
          AttnParams prm;
          prm.causal = causal;
          Context ctx;
          ctx.backend = Backend::flash;
          forward(view(q.p), view(k.p), view(v.p), view(o.p), lse_v, prm, ctx);
          // The reference: the library's own backward (BwdTraits<d>), also timed as a cross-check.
          auto lib = [&] { backward(view(q.p), view(k.p), view(v.p), view(o.p), view(dout.p), lse_v, g_ref, prm, ctx); };
          const KernelChoice kb = backward(view(q.p), view(k.p), view(v.p), view(o.p), view(dout.p), lse_v, g_ref, prm, ctx);
          IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
          const double lib_one = cb::time_ms(lib, 1, 1, 1);
          const double lib_ms = cb::time_ms(lib, 1, repeats, cb::inner_for(lib_one));
          const double flops = 2.5 * cb::attn_flops(b, h, s, s, d, causal);
          std::printf(
              "{\"impl\": \"library\", \"hdim\": %lld, \"seqlen\": %lld, \"batch\": %lld, \"heads\": %lld, "
              "\"causal\": %s, \"ms\": %.5f, \"tflops\": %.2f, \"kernel\": \"%s\"}\n",
              (long long)d, (long long)s, (long long)b, (long long)h, causal ? "true" : "false", lib_ms,
              flops / (lib_ms * 1e-3) / 1e12, kb.kernel.c_str());
          std::fflush(stdout);

          // The candidates' problem: validated exactly as backward() validates it, gradients into dq/dk/dv.
          detail::ValidatedBwd val = detail::validate_backward(view(q.p), view(k.p), view(v.p), view(o.p),
                                                               view(dout.p), lse_v, g, nullptr, prm, ctx);
          val.p.f = val.fwd.p;
          const detail::BwdProblem& bp = val.p;

          std::vector<Result> results;
          double shipped_ms = cands.front().shipped ? 0.0 : lib_ms;
          for (size_t i = 0; i < cands.size(); ++i) {
            const auto& c = cands[i];
            if (!res[i].fits) continue;  // listed by its "kernel" line
            if (seconds_since(t_start) > budget_s) {
              skipped.push_back(shape.key() + " " + c.name);
              continue;
            }
            try {
              for (void* p : {dq.p, dk.p, dv.p}) IOATTN_CUDA_CHECK(cudaMemset(p, 0xff, bytes));  // NaN poison
              auto fn = [&] { cuda::run_flash_backward(bp, c.info); };
              fn();
              IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
              const Diff ddq = max_diff(dq.p, dq_ref.p, n, scratch);
              const Diff ddk = max_diff(dk.p, dk_ref.p, n, scratch);
              const Diff ddv = max_diff(dv.p, dv_ref.p, n, scratch);
              double rel = 0.0;
              for (const Diff& x : {ddq, ddk, ddv})
                rel = std::isnan(x.abs) ? NAN : std::max(rel, static_cast<double>(x.abs) / std::max(x.ref_max, 1e-30f));
              const bool ok = !std::isnan(rel) && rel <= kRelTol;
              const double one = cb::time_ms(fn, 1, 1, 1);
              const double ms = cb::time_ms(fn, 1, repeats, cb::inner_for(one));
              if (c.shipped) shipped_ms = ms;
              results.push_back({c.name, ms, ok});
              std::printf(
                  "{\"impl\": \"bwd_tune\", \"hdim\": %lld, \"seqlen\": %lld, \"batch\": %lld, \"heads\": %lld, "
                  "\"causal\": %s, \"candidate\": \"%s\", \"shipped\": %s, \"ms\": %.5f, \"tflops\": %.2f, "
                  "\"speedup_vs_shipped\": %.3f, \"lib_ms\": %.5f, \"regs\": %d, \"local_bytes\": %zu, "
                  "\"smem_kb\": %.1f, \"ctas_per_sm\": %d, \"max_diff_dq\": %s, \"max_diff_dk\": %s, "
                  "\"max_diff_dv\": %s, \"rel_diff\": %s, \"ok\": %s, \"elapsed_s\": %.1f}\n",
                  (long long)d, (long long)s, (long long)b, (long long)h, causal ? "true" : "false", c.name.c_str(),
                  c.shipped ? "true" : "false", ms, flops / (ms * 1e-3) / 1e12, shipped_ms / ms, lib_ms, res[i].regs,
                  res[i].local, c.info.smem_bytes / 1024.0, res[i].ctas, num(ddq.abs).c_str(), num(ddk.abs).c_str(), num(ddv.abs).c_str(), num(rel).c_str(),
                  ok ? "true" : "false", seconds_since(t_start));
            } catch (const std::exception& e) {
              cudaGetLastError();  // a sticky error (illegal address) would fail every later run too
              std::string msg = e.what();
              std::replace(msg.begin(), msg.end(), '"', '\'');
              std::printf("{\"impl\": \"bwd_tune\", \"hdim\": %lld, \"seqlen\": %lld, \"causal\": %s, \"candidate\": \"%s\", "
                          "\"error\": \"%s\"}\n",
                          (long long)d, (long long)s, causal ? "true" : "false", c.name.c_str(), msg.c_str());
            }
            std::fflush(stdout);
          }
          // Baseline for the table: the shipped candidate, else backward() itself.
          if (!cands.front().shipped) results.insert(results.begin(), {"backward()", lib_ms, true});
          table.emplace_back(shape, std::move(results));
        }
      }
    }
    cudaFree(scratch);

    // ---- human summary: best per shape, then each candidate's geometric-mean speedup per head dim ----
    std::printf("\n## backward tile sweep (bf16, atomic dQ; ms of the whole backward; speedup = shipped / best)\n");
    std::printf("%-22s %10s  %-24s %10s %8s\n", "shape", "shipped", "best", "best ms", "speedup");
    std::map<std::string, std::pair<double, int>> geo;  // "d128 32x128 w8 minb1" -> (sum log speedup, count)
    std::map<std::string, int> shapes_per_d;
    for (const auto& [shape, results] : table) {
      if (results.empty()) continue;
      const Result& base = results.front();  // shipped (or backward()), run first
      const Result* best = &base;
      for (const Result& r : results) {
        if (r.ok && r.ms < best->ms) best = &r;
        const std::string gk = "d" + std::to_string(shape.d) + " " + r.cand;
        if (r.ok) geo[gk].first += std::log(base.ms / r.ms), geo[gk].second += 1;
      }
      shapes_per_d["d" + std::to_string(shape.d)] += 1;
      std::printf("%-22s %10.3f  %-24s %10.3f %7.3fx\n", shape.key().c_str(), base.ms, best->cand.c_str(), best->ms,
                  base.ms / best->ms);
    }
    std::printf("\n## per candidate: geometric-mean speedup over the shipped tile (shapes where it ran and matched)\n");
    for (const auto& [gk, acc] : geo) {
      const std::string dkey = gk.substr(0, gk.find(' '));
      std::printf("%-30s %7.3fx  (%d of %d shapes)\n", gk.c_str(), std::exp(acc.first / acc.second), acc.second,
                  shapes_per_d[dkey]);
    }
    for (const auto& [shape, results] : table)
      for (const Result& r : results)
        if (!r.ok) std::printf("MISMATCH (rel diff > %g): %s %s\n", kRelTol, shape.key().c_str(), r.cand.c_str());
    if (!skipped.empty()) {
      std::printf("\nbudget (%.0f s) spent: %zu runs skipped:\n", budget_s, skipped.size());
      for (const auto& x : skipped) std::printf("  %s\n", x.c_str());
    }
    std::printf("total %.1f s\n", seconds_since(t_start));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ioattn_cuda_bwd_tune: %s\n", e.what());
    return 1;
  }
  return 0;
}

// ioattn_cuda_tune — sweeps tile variants (flash_tune_d*.cu) x K/V ring depth on the benchmark
// grid shape (batch·seqlen = 16k tokens, hidden 2048, bf16) and prints JSON lines with TFLOP/s
// and max |O_variant - O_library| (every variant must compute the same function).
//
//   ioattn_cuda_tune [--seqlens 2048,8192] [--repeats 10]
//
// Used to choose FlashTraits; the winners are copied there by hand with the measured reason.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "cuda/bench_util.cuh"
#include "cuda/flash_tune.cuh"
#include "ioattn/ioattn.hpp"

namespace {
using namespace ioattn;
namespace cb = ioattn::cuda::bench;

float max_diff(const void* a, const void* b, int64_t n) {
  std::vector<uint16_t> ha(n), hb(n);
  IOATTN_CUDA_CHECK(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
  IOATTN_CUDA_CHECK(cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost));
  float m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = detail::bf16_to_float(ha[i]), y = detail::bf16_to_float(hb[i]);
    if (std::isnan(x) || std::isnan(y)) return NAN;
    m = std::max(m, std::fabs(x - y));
  }
  return m;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    if (detail::cuda_device_count() == 0) {
      std::printf("skipped: no CUDA device\n");
      return 0;
    }
    std::string seq_arg = "2048,8192";
    int repeats = 10;
    for (int i = 1; i + 1 < argc; ++i) {
      if (std::strcmp(argv[i], "--seqlens") == 0) seq_arg = argv[i + 1];
      if (std::strcmp(argv[i], "--repeats") == 0) repeats = std::atoi(argv[i + 1]);
    }
    int optin = 0;
    IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    const int64_t tokens = 16384, hidden = 2048;
    for (int64_t d : {64, 128, 256}) {
      std::vector<cuda::tune::Variant> vars =
          d == 64 ? cuda::tune::variants_d64() : d == 128 ? cuda::tune::variants_d128() : cuda::tune::variants_d256();
      for (int64_t s : cb::parse_list(seq_arg)) {
        const int64_t b = tokens / s, h = hidden / d, n = b * s * h * d;
        void *q, *k, *v, *o_ref, *o;
        float* lse;
        IOATTN_CUDA_CHECK(cudaMalloc(&q, n * 2));
        IOATTN_CUDA_CHECK(cudaMalloc(&k, n * 2));
        IOATTN_CUDA_CHECK(cudaMalloc(&v, n * 2));
        IOATTN_CUDA_CHECK(cudaMalloc(&o_ref, n * 2));
        IOATTN_CUDA_CHECK(cudaMalloc(&o, n * 2));
        IOATTN_CUDA_CHECK(cudaMalloc(&lse, b * h * s * 4));
        cb::fill_uniform(q, true, n, 21);
        cb::fill_uniform(k, true, n, 22);
        cb::fill_uniform(v, true, n, 23);
        for (bool causal : {false, true}) {
          // Reference output: the library's own choice, through the public API.
          auto tv = [&](void* p) { return TensorView::contiguous(p, DType::bf16, {b, s, h, d}, Device::cuda); };
          AttnParams prm;
          prm.causal = causal;
          Context ctx;
          ctx.backend = Backend::flash;
          forward(tv(q), tv(k), tv(v), tv(o_ref), TensorView{}, prm, ctx);
          IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
          for (const auto& var : vars) {
              if (var.smem_bytes > static_cast<size_t>(optin)) continue;
              cuda::FlashParams fp;
              fp.q = q, fp.k = k, fp.v = v, fp.o = o, fp.lse = lse;
              fp.q_batch = fp.k_batch = fp.v_batch = fp.o_batch = s * h * d;
              fp.q_seq = fp.k_seq = fp.v_seq = fp.o_seq = h * d;
              fp.q_head = fp.k_head = fp.v_head = fp.o_head = d;
              fp.lse_batch = h * s, fp.lse_head = s, fp.lse_seq = 1;
              fp.batch = static_cast<int>(b), fp.heads_q = static_cast<int>(h), fp.group = 1;
              fp.seqlen_q = fp.seqlen_k = static_cast<int>(s);
              fp.head_dim = static_cast<int>(d);
              fp.num_m_blocks = static_cast<int>((s + var.block_m - 1) / var.block_m);
              fp.scale = 1.f / std::sqrt(static_cast<float>(d));
              fp.scale_log2 = fp.scale * cuda::kLog2e;
              fp.window_left = -1;
              fp.window_right = causal ? 0 : -1;
              IOATTN_CUDA_CHECK(cudaMemset(o, 0xff, n * 2));  // NaN poison
              auto fn = [&] { var.launch(fp, nullptr); };
              const double one = cb::time_ms(fn, 2, 1, 1);
              const double ms = cb::time_ms(fn, 1, repeats, cb::inner_for(one));
              IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
              const float diff = max_diff(o, o_ref, n);
              std::printf(
                  "{\"impl\": \"tune\", \"hdim\": %lld, \"seqlen\": %lld, \"causal\": %s, \"variant\": \"%s\", "
                  "\"smem_kb\": %zu, \"ms\": %.5f, \"tflops\": %.2f, \"max_diff_vs_lib\": %.6f}\n",
                  (long long)d, (long long)s, causal ? "true" : "false", var.name.c_str(), var.smem_bytes / 1024, ms,
                  cb::attn_flops(b, h, s, s, d, causal) / (ms * 1e-3) / 1e12, diff);
              std::fflush(stdout);
            }
        }
        for (void* p : {q, k, v, o_ref, o, static_cast<void*>(lse)}) cudaFree(p);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ioattn_cuda_tune: %s\n", e.what());
    return 1;
  }
  return 0;
}

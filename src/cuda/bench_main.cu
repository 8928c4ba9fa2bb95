// ioattn_cuda_bench — times the CUDA forward (and forward+backward) paths through the public API
// and prints JSON lines.
//
//   ioattn_cuda_bench grid  [--hdims 64,128,256] [--seqlens 512,...,16384] [--tokens 16384]
//                           [--hidden 2048] [--dtypes bf16,f16] [--f16-hdims 128] [--repeats 15]
//                           [--causal 0|1|both]
//       FlashAttention's benchmark grid: batch·seqlen = tokens, heads = hidden / hdim, causal and
//       not (--causal: only one of them); f16 only for --f16-hdims. One line per (config): ms, TFLOP/s, the selected kernel.
//   ioattn_cuda_bench bwd   [--hdims 64,128,256] [--seqlens 512,...,16384] [--tokens 16384] [--hidden 2048]
//                           [--dtypes bf16] [--repeats 10] [--deterministic 0|1] [--varlen 0|1] [--mix L]
//                           [--causal 0|1|both]
//       forward + backward through the public API on the same grid, causal and not: fwd+bwd ms and
//       TFLOP/s (FLOPs = fwd + 2.5·fwd, FlashAttention's convention), the backward alone, and both
//       kernels' names. dO uniform in [-1, 1); the forward's O and LSE feed the backward. --varlen 1:
//       the same tokens as packed sequences (forward_varlen / backward_varlen; impl "..._varlen");
//       with --mix L one sequence of seqlen tokens and the rest in sequences of L (mixed lengths).
//   ioattn_cuda_bench local [--hdims 64,128,256] [--seqlens 4096,16384] [--tokens 16384] [--hidden 2048]
//                           [--window 1024] [--features window,sinks,softcap,alibi,varlen] [--repeats 15]
//                           [--dtype bf16|f8e4m3]
//       bf16 forward with one extra feature per line on top of causal: a causal sliding window of
//       --window keys, sinks, softcap 30, ALiBi, or varlen (the same sequences packed, cu_seqlens);
//       "causal" alone as the baseline ("none": no mask at all); TFLOP/s over the visible (row, key)
//       pairs. Run it as is (the sm90 kLocal rows, the default) and with IOATTN_SM90_LOCAL=0
//       (mma.sync) for the A/B (gpu-check stage sm90local). --dtype f8e4m3: e4m3 Q / K / V (random codes of magnitude < 2, unit
//       descales) with bf16 O, the fp8 kernel's rows.
//   ioattn_cuda_bench naive [--seqlens 4096,8192,16384] [--heads 16] [--hdim 128]
//       standard attention (S, P in HBM) vs flash on one sequence: ms, workspace bytes, and the
//       max |O_naive - O_flash| as a sanity check.
//
// bench/peer_bench.py runs this and PyTorch SDPA (flash, cudnn) on the same shapes in the same
// run and joins the two. Inputs: Q, K, V [b, s, h, d] uniform in [-1, 1) (never zeros); every
// shape moves >= 64 MB per tensor set at 16k tokens, beyond the 60 MB L2 of an H200.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "cuda/bench_util.cuh"
#include "cuda/naive.hpp"
#include "ioattn/ioattn.hpp"

namespace {

using namespace ioattn;
namespace cb = ioattn::cuda::bench;

std::string arg(int argc, char** argv, const char* name, const std::string& def) {
  for (int i = 2; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

struct Buffers {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float* lse = nullptr;
  Buffers() = default;
  // Q, K, V, O of n 16-bit elements (Q, K, V uniform in [-1, 1), seeds seed .. seed + 2) and
  // lse_n floats.
  Buffers(int64_t n, int64_t lse_n, bool bf16, uint64_t seed = 1) {
    IOATTN_CUDA_CHECK(cudaMalloc(&q, n * 2));
    IOATTN_CUDA_CHECK(cudaMalloc(&k, n * 2));
    IOATTN_CUDA_CHECK(cudaMalloc(&v, n * 2));
    IOATTN_CUDA_CHECK(cudaMalloc(&o, n * 2));
    IOATTN_CUDA_CHECK(cudaMalloc(&lse, lse_n * 4));
    cb::fill_uniform(q, bf16, n, seed);
    cb::fill_uniform(k, bf16, n, seed + 1);
    cb::fill_uniform(v, bf16, n, seed + 2);
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    for (void* p : {q, k, v, o, static_cast<void*>(lse)})
      if (p) cudaFree(p);
  }
};

// --causal 0|1|both: the masks to run, unmasked first (both by default).
std::vector<bool> causal_arg(int argc, char** argv) {
  const std::string masks = arg(argc, argv, "--causal", "both");
  if (masks == "both") return {false, true};
  if (masks == "0" || masks == "1") return {masks == "1"};
  throw std::invalid_argument("--causal must be 0, 1 or both, got '" + masks + "'");
}

void run_grid(int argc, char** argv) {
  const auto hdims = cb::parse_list(arg(argc, argv, "--hdims", "64,128,256"));
  const auto seqlens = cb::parse_list(arg(argc, argv, "--seqlens", "512,1024,2048,4096,8192,16384"));
  const auto f16_hdims = cb::parse_list(arg(argc, argv, "--f16-hdims", "128"));
  const int64_t tokens = std::stoll(arg(argc, argv, "--tokens", "16384"));
  const int64_t hidden = std::stoll(arg(argc, argv, "--hidden", "2048"));
  const int repeats = std::stoi(arg(argc, argv, "--repeats", "15"));
  const std::string dtypes = arg(argc, argv, "--dtypes", "bf16,f16");
  const std::vector<bool> masks = causal_arg(argc, argv);
  for (int64_t d : hdims)
    for (int64_t s : seqlens)
      for (const char* dts : {"bf16", "f16"}) {
        const bool bf16 = std::strcmp(dts, "bf16") == 0;
        if (!cb::list_has(dtypes, dts)) continue;
        if (!bf16 && std::find(f16_hdims.begin(), f16_hdims.end(), d) == f16_hdims.end()) continue;
        const int64_t b = std::max<int64_t>(1, tokens / s), h = hidden / d;
        const Buffers buf(b * s * h * d, b * h * s, bf16);
        const DType dt = bf16 ? DType::bf16 : DType::f16;
        const auto q = TensorView::contiguous(buf.q, dt, {b, s, h, d}, Device::cuda);
        const auto k = TensorView::contiguous(buf.k, dt, {b, s, h, d}, Device::cuda);
        const auto v = TensorView::contiguous(buf.v, dt, {b, s, h, d}, Device::cuda);
        const auto o = TensorView::contiguous(buf.o, dt, {b, s, h, d}, Device::cuda);
        const auto lse = TensorView::contiguous(buf.lse, DType::f32, {b, h, s}, Device::cuda);
        for (bool causal : masks) {
          AttnParams prm;
          prm.causal = causal;
          Context ctx;
          ctx.backend = Backend::flash;
          const KernelChoice kc = select_forward(q, k, v, o, lse, prm, ctx);
          auto fn = [&] { forward(q, k, v, o, lse, prm, ctx); };
          const double one = cb::time_ms(fn, 2, 1, 1);
          const double ms = cb::time_ms(fn, 1, repeats, cb::inner_for(one));
          const double tflops = cb::attn_flops(b, h, s, s, d, causal) / (ms * 1e-3) / 1e12;
          std::printf(
              "{\"impl\": \"ioattn_flash\", \"dtype\": \"%s\", \"hdim\": %lld, \"seqlen\": %lld, \"batch\": %lld, "
              "\"heads\": %lld, \"causal\": %s, \"ms\": %.5f, \"tflops\": %.2f, \"kernel\": \"%s\"}\n",
              dts, (long long)d, (long long)s, (long long)b, (long long)h, causal ? "true" : "false", ms, tflops,
              kc.kernel.c_str());
          std::fflush(stdout);
        }
      }
}

void run_local(int argc, char** argv) {
  const auto hdims = cb::parse_list(arg(argc, argv, "--hdims", "64,128,256"));
  const auto seqlens = cb::parse_list(arg(argc, argv, "--seqlens", "4096,16384"));
  const int64_t tokens = std::stoll(arg(argc, argv, "--tokens", "16384"));
  const int64_t hidden = std::stoll(arg(argc, argv, "--hidden", "2048"));
  const int64_t window = std::stoll(arg(argc, argv, "--window", "1024"));
  const int repeats = std::stoi(arg(argc, argv, "--repeats", "15"));
  const std::string features = arg(argc, argv, "--features", "window,sinks,softcap,alibi,varlen");
  const std::string dtype = arg(argc, argv, "--dtype", "bf16");
  if (dtype != "bf16" && dtype != "f8e4m3") throw Error("--dtype", "bf16 or f8e4m3, got '" + dtype + "'");
  const DType in_t = dtype == "bf16" ? DType::bf16 : DType::f8e4m3;
  for (int64_t d : hdims)
    for (int64_t s : seqlens) {
      const int64_t b = std::max<int64_t>(1, tokens / s), h = hidden / d;
      const Buffers buf(b * s * h * d, b * h * s, true);
      if (in_t == DType::f8e4m3) {  // valid e4m3 codes (|x| < 2, no NaN) over the first b*s*h*d bytes
        std::vector<uint8_t> codes(static_cast<size_t>(b * s * h * d + 2));
        std::mt19937 rng(7);
        for (auto& c : codes) c = static_cast<uint8_t>(rng() & 0xBF);  // exponent field <= 7
        const size_t n = static_cast<size_t>(b * s * h * d);
        IOATTN_CUDA_CHECK(cudaMemcpy(buf.q, codes.data(), n, cudaMemcpyHostToDevice));
        IOATTN_CUDA_CHECK(cudaMemcpy(buf.k, codes.data() + 1, n, cudaMemcpyHostToDevice));
        IOATTN_CUDA_CHECK(cudaMemcpy(buf.v, codes.data() + 2, n, cudaMemcpyHostToDevice));
      }
      // Per-head vectors (sinks, ALiBi slopes) and cu_seqlens for the varlen line.
      std::vector<float> head_vals(static_cast<size_t>(h));
      for (int64_t i = 0; i < h; ++i) head_vals[static_cast<size_t>(i)] = 0.5f / static_cast<float>(i + 1);
      std::vector<int32_t> cu(static_cast<size_t>(b + 1));
      for (int64_t i = 0; i <= b; ++i) cu[static_cast<size_t>(i)] = static_cast<int32_t>(i * s);
      void *heads_dev = nullptr, *cu_dev = nullptr;
      IOATTN_CUDA_CHECK(cudaMalloc(&heads_dev, h * 4));
      IOATTN_CUDA_CHECK(cudaMalloc(&cu_dev, (b + 1) * 4));
      IOATTN_CUDA_CHECK(cudaMemcpy(heads_dev, head_vals.data(), h * 4, cudaMemcpyHostToDevice));
      IOATTN_CUDA_CHECK(cudaMemcpy(cu_dev, cu.data(), (b + 1) * 4, cudaMemcpyHostToDevice));
      const auto q = TensorView::contiguous(buf.q, in_t, {b, s, h, d}, Device::cuda);
      const auto k = TensorView::contiguous(buf.k, in_t, {b, s, h, d}, Device::cuda);
      const auto v = TensorView::contiguous(buf.v, in_t, {b, s, h, d}, Device::cuda);
      const auto o = TensorView::contiguous(buf.o, DType::bf16, {b, s, h, d}, Device::cuda);
      const auto lse = TensorView::contiguous(buf.lse, DType::f32, {b, h, s}, Device::cuda);
      const auto per_head = TensorView::contiguous(heads_dev, DType::f32, {h}, Device::cuda);
      // varlen views: the same memory as [b*s, h, d] packed tokens, LSE as [h, b*s]
      const auto qp = TensorView::contiguous(buf.q, in_t, {b * s, h, d}, Device::cuda);
      const auto kp = TensorView::contiguous(buf.k, in_t, {b * s, h, d}, Device::cuda);
      const auto vp = TensorView::contiguous(buf.v, in_t, {b * s, h, d}, Device::cuda);
      const auto op = TensorView::contiguous(buf.o, DType::bf16, {b * s, h, d}, Device::cuda);
      const auto lsep = TensorView::contiguous(buf.lse, DType::f32, {h, b * s}, Device::cuda);
      Varlen vl;
      vl.cu_seqlens_q = vl.cu_seqlens_k = TensorView::contiguous(cu_dev, DType::i32, {b + 1}, Device::cuda);
      vl.max_seqlen_q = vl.max_seqlen_k = s;
      std::stringstream fs(features);
      std::string f;
      while (std::getline(fs, f, ',')) {
        AttnParams prm;
        prm.causal = true;
        double pairs = static_cast<double>(s) * static_cast<double>(s + 1) / 2.0;  // causal (row, key) pairs
        if (f == "none") {  // no mask (the fp8 rows' non-causal kernel; every (row, key) pair)
          prm.causal = false;
          pairs = static_cast<double>(s) * static_cast<double>(s);
        } else if (f == "window") {
          prm.window_left = window;
          pairs = 0;
          for (int64_t i = 0; i < s; ++i) pairs += static_cast<double>(std::min<int64_t>(i, window) + 1);
        } else if (f == "sinks") {
          prm.sinks = per_head;
        } else if (f == "softcap") {
          prm.softcap = 30.0f;
        } else if (f == "alibi") {
          prm.alibi_slopes = per_head;
        } else if (f != "varlen" && f != "causal") {
          throw Error("--features", "causal, none, window, sinks, softcap, alibi or varlen, got '" + f + "'");
        }
        Context ctx;
        ctx.backend = Backend::flash;
        const bool varlen = f == "varlen";
        KernelChoice ran;  // what the timed calls ran
        auto fn = [&] { ran = varlen ? forward_varlen(qp, kp, vp, op, lsep, vl, prm, ctx) : forward(q, k, v, o, lse, prm, ctx); };
        const double one = cb::time_ms(fn, 2, 1, 1);
        const double ms = cb::time_ms(fn, 1, repeats, cb::inner_for(one));
        const double tflops = 4.0 * b * h * pairs * d / (ms * 1e-3) / 1e12;
        std::printf(
            "{\"impl\": \"ioattn_flash\", \"feature\": \"%s\", \"dtype\": \"%s\", \"hdim\": %lld, \"seqlen\": %lld, "
            "\"batch\": %lld, \"heads\": %lld, \"window\": %lld, \"ms\": %.5f, \"tflops\": %.2f, \"kernel\": \"%s\"}\n",
            f.c_str(), dtype.c_str(), (long long)d, (long long)s, (long long)b, (long long)h,
            (long long)(f == "window" ? window : -1),
            ms, tflops, ran.kernel.c_str());
        std::fflush(stdout);
      }
      cudaFree(heads_dev);
      cudaFree(cu_dev);
    }
}

void run_bwd(int argc, char** argv) {
  const auto hdims = cb::parse_list(arg(argc, argv, "--hdims", "64,128,256"));
  const auto seqlens = cb::parse_list(arg(argc, argv, "--seqlens", "512,1024,2048,4096,8192,16384"));
  const int64_t tokens = std::stoll(arg(argc, argv, "--tokens", "16384"));
  const int64_t hidden = std::stoll(arg(argc, argv, "--hidden", "2048"));
  const int repeats = std::stoi(arg(argc, argv, "--repeats", "10"));
  const std::string dtypes = arg(argc, argv, "--dtypes", "bf16");
  const bool deterministic = arg(argc, argv, "--deterministic", "0") == "1";
  const std::vector<bool> masks = causal_arg(argc, argv);
  // --varlen 1: the same tokens as b packed sequences of s tokens each (forward_varlen /
  // backward_varlen over [b*s, h, d] views of the same memory, LSE [h, b*s]).
  const bool varlen = arg(argc, argv, "--varlen", "0") == "1";
  const int64_t mix = varlen ? std::stoll(arg(argc, argv, "--mix", "0")) : 0;
  for (int64_t d : hdims)
    for (int64_t s : seqlens)
      for (const char* dts : {"bf16", "f16"}) {
        if (!cb::list_has(dtypes, dts)) continue;
        const bool bf16 = std::strcmp(dts, "bf16") == 0;
        const int64_t b = std::max<int64_t>(1, tokens / s), h = hidden / d;
        const int64_t n = b * s * h * d;
        const Buffers buf(n, b * h * s, bf16, 21);
        void *dout = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
        IOATTN_CUDA_CHECK(cudaMalloc(&dout, n * 2));
        IOATTN_CUDA_CHECK(cudaMalloc(&dq, n * 2));
        IOATTN_CUDA_CHECK(cudaMalloc(&dk, n * 2));
        IOATTN_CUDA_CHECK(cudaMalloc(&dv, n * 2));
        cb::fill_uniform(dout, bf16, n, 24);
        const DType dt = bf16 ? DType::bf16 : DType::f16;
        auto view = [&](void* p) { return TensorView::contiguous(p, dt, {b, s, h, d}, Device::cuda); };
        const auto q = view(buf.q), k = view(buf.k), v = view(buf.v), o = view(buf.o), dov = view(dout);
        const auto lse = TensorView::contiguous(buf.lse, DType::f32, {b, h, s}, Device::cuda);
        Gradients g;
        g.dq = view(dq), g.dk = view(dk), g.dv = view(dv);
        auto packed = [&](void* p) { return TensorView::contiguous(p, dt, {b * s, h, d}, Device::cuda); };
        const auto qp = packed(buf.q), kp = packed(buf.k), vp = packed(buf.v), op = packed(buf.o), dop = packed(dout);
        Gradients gp;
        gp.dq = packed(dq), gp.dk = packed(dk), gp.dv = packed(dv);
        const auto lsep = TensorView::contiguous(buf.lse, DType::f32, {h, b * s}, Device::cuda);
        // sequence starts: b of s tokens, or (--mix L) one of s, then sequences of L (the last one
        // shorter if L does not divide the rest)
        std::vector<int32_t> cu{0};
        if (mix > 0 && b * s > s) {
          cu.push_back(static_cast<int32_t>(s));
          for (int64_t t = s; t < b * s; t += mix) cu.push_back(static_cast<int32_t>(std::min(t + mix, b * s)));
        } else {
          for (int64_t i = 1; i <= b; ++i) cu.push_back(static_cast<int32_t>(i * s));
        }
        const int64_t nseq = static_cast<int64_t>(cu.size()) - 1;
        void* cu_dev = nullptr;
        IOATTN_CUDA_CHECK(cudaMalloc(&cu_dev, (nseq + 1) * 4));
        IOATTN_CUDA_CHECK(cudaMemcpy(cu_dev, cu.data(), (nseq + 1) * 4, cudaMemcpyHostToDevice));
        Varlen vl;
        vl.cu_seqlens_q = vl.cu_seqlens_k = TensorView::contiguous(cu_dev, DType::i32, {nseq + 1}, Device::cuda);
        vl.max_seqlen_q = vl.max_seqlen_k = std::max(s, mix);
        for (bool causal : masks) {
          AttnParams prm;
          prm.causal = causal;
          Context ctx;
          ctx.backend = Backend::flash;
          ctx.deterministic = deterministic;
          auto fwd = [&] {
            return varlen ? forward_varlen(qp, kp, vp, op, lsep, vl, prm, ctx) : forward(q, k, v, o, lse, prm, ctx);
          };
          auto bwd = [&] {
            return varlen ? backward_varlen(qp, kp, vp, op, dop, lsep, gp, vl, prm, ctx)
                          : backward(q, k, v, o, dov, lse, g, prm, ctx);
          };
          const KernelChoice kf = fwd();
          const KernelChoice kb = bwd();
          auto fwd_bwd = [&] {
            fwd();
            bwd();
          };
          const double one = cb::time_ms(fwd_bwd, 1, 1, 1);
          const double ms = cb::time_ms(fwd_bwd, 1, repeats, cb::inner_for(one));
          const double ms_bwd = cb::time_ms(bwd, 1, repeats, cb::inner_for(one));
          double fwd_flops = 0;
          for (int64_t i = 0; i < (varlen ? nseq : 1); ++i) {
            const int64_t len = varlen ? cu[static_cast<size_t>(i + 1)] - cu[static_cast<size_t>(i)] : s;
            fwd_flops += cb::attn_flops(varlen ? 1 : b, h, len, len, d, causal);
          }
          std::printf(
              "{\"impl\": \"ioattn_flash_fwdbwd%s\", \"dtype\": \"%s\", \"hdim\": %lld, \"seqlen\": %lld, "
              "\"mix\": %lld, \"batch\": %lld, \"heads\": %lld, \"causal\": %s, \"deterministic\": %s, "
              "\"ms\": %.5f, \"tflops\": %.2f, \"bwd_ms\": %.5f, \"bwd_tflops\": %.2f, \"kernel\": \"%s\", "
              "\"bwd_kernel\": \"%s\"}\n",
              varlen ? "_varlen" : "", dts, (long long)d, (long long)s, (long long)mix,
              (long long)(varlen ? nseq : b), (long long)h,
              causal ? "true" : "false", deterministic ? "true" : "false", ms, 3.5 * fwd_flops / (ms * 1e-3) / 1e12,
              ms_bwd,
              2.5 * fwd_flops / (ms_bwd * 1e-3) / 1e12, kf.kernel.c_str(), kb.kernel.c_str());
          std::fflush(stdout);
        }
        for (void* p : {dout, dq, dk, dv, cu_dev}) cudaFree(p);
      }
}

float max_abs_diff_bf16(const void* a, const void* b, int64_t n) {
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

void run_naive(int argc, char** argv) {
  const auto seqlens = cb::parse_list(arg(argc, argv, "--seqlens", "4096,8192,16384"));
  const int64_t h = std::stoll(arg(argc, argv, "--heads", "16"));
  const int64_t d = std::stoll(arg(argc, argv, "--hdim", "128"));
  const int repeats = std::stoi(arg(argc, argv, "--repeats", "5"));
  for (int64_t s : seqlens)
    for (bool causal : {false, true}) {
      const int64_t b = 1, n = b * s * h * d;
      const Buffers buf(n, b * h * s, true, 11);
      void* o2 = nullptr;
      IOATTN_CUDA_CHECK(cudaMalloc(&o2, n * 2));
      const auto q = TensorView::contiguous(buf.q, DType::bf16, {b, s, h, d}, Device::cuda);
      const auto k = TensorView::contiguous(buf.k, DType::bf16, {b, s, h, d}, Device::cuda);
      const auto v = TensorView::contiguous(buf.v, DType::bf16, {b, s, h, d}, Device::cuda);
      const auto o = TensorView::contiguous(buf.o, DType::bf16, {b, s, h, d}, Device::cuda);
      const auto on = TensorView::contiguous(o2, DType::bf16, {b, s, h, d}, Device::cuda);
      const auto lse = TensorView::contiguous(buf.lse, DType::f32, {b, h, s}, Device::cuda);
      AttnParams prm;
      prm.causal = causal;
      Context cf, cn;
      cf.backend = Backend::flash;
      cn.backend = Backend::naive;
      const double flash_ms = cb::time_ms([&] { forward(q, k, v, o, lse, prm, cf); }, 2, repeats, 1);
      const size_t used0 = detail::cuda_used_bytes();
      const double naive_ms = cb::time_ms([&] { forward(q, k, v, on, lse, prm, cn); }, 1, repeats, 1);
      const size_t ws = ioattn::cuda::naive_last_workspace_bytes();
      IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
      const float diff = max_abs_diff_bf16(buf.o, o2, n);
      std::printf(
          "{\"impl\": \"ioattn_naive_vs_flash\", \"dtype\": \"bf16\", \"hdim\": %lld, \"seqlen\": %lld, "
          "\"batch\": 1, \"heads\": %lld, \"causal\": %s, \"naive_ms\": %.4f, \"flash_ms\": %.4f, "
          "\"naive_extra_bytes\": %zu, \"flash_extra_bytes\": 0, \"used_bytes_before\": %zu, "
          "\"max_abs_diff\": %.6f}\n",
          (long long)d, (long long)s, (long long)h, causal ? "true" : "false", naive_ms, flash_ms, ws, used0, diff);
      std::fflush(stdout);
      cudaFree(o2);
    }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (detail::cuda_device_count() == 0) {
      std::printf("skipped: no CUDA device\n");
      return 0;
    }
    const std::string mode = argc > 1 ? argv[1] : "grid";
    if (mode == "grid")
      run_grid(argc, argv);
    else if (mode == "naive")
      run_naive(argc, argv);
    else if (mode == "bwd")
      run_bwd(argc, argv);
    else if (mode == "local")
      run_local(argc, argv);
    else {
      std::fprintf(stderr, "usage: ioattn_cuda_bench grid|bwd|local|naive [options]\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ioattn_cuda_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}

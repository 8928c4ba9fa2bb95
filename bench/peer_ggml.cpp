// peer_ggml.cpp — ioattn_peer_ggml: the CPU forward against llama.cpp's CPU flash attention
// (ggml_flash_attn_ext, the kernel llama.cpp runs for prefill on the CPU) in one process, the
// implementations interleaved repeat by repeat, same threads, same shapes.
//
//   ioattn_peer_ggml [--threads 2] [--seqlen 1024,4096] [--hdims 64,128] [--heads 8] [--heads-kv 8]
//                    [--causal 0,1] [--repeats 5]
//
// Each implementation gets its natural layout and precision:
//   ggml      q f32 [d, seq, heads] (ggml's dim order: [heads][seq][d] in memory), k / v f16,
//             out f32; causal = an f16 mask of 0 / -inf (ggml skips -inf keys); its default
//             accumulation precision (what llama.cpp uses);
//   ioattn    q / k / v / o all f16 ("ioattn_f16") and all f32 ("ioattn_f32"), [batch, seq, heads, d].
// The same random values feed all three (f16-rounded for the f16 inputs). GFLOP/s = 4 heads seq^2
// d (halved when causal) / time; each line also gives the max |O - O_ggml| as a check that the two
// compute the same function. Built only with -DIOATTN_PEER_GGML=ON (tools/fetch-ggml.sh fetches and
// builds ggml from the llama-cpp-python sdist on PyPI, pinned there).
#include <ggml-cpu.h>
#include <ggml.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "ioattn/ioattn.hpp"

namespace {

std::string arg(int argc, char** argv, const char* name, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

std::vector<int64_t> list(const std::string& s) {
  std::vector<int64_t> v;
  size_t a = 0;
  while (a < s.size()) {
    size_t b = s.find(',', a);
    if (b == std::string::npos) b = s.size();
    v.push_back(std::stoll(s.substr(a, b - a)));
    a = b + 1;
  }
  return v;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Shape {
  int64_t heads, heads_kv, seq, d;
  bool causal;
};

// One shape: builds the inputs for both libraries, checks that the outputs agree, then times
// ggml, ioattn f16 and ioattn f32 in turn, `repeats` rounds, and prints the best and median rate.
void run(const Shape& s, int threads, int repeats) {
  const int64_t h = s.heads, hk = s.heads_kv, n = s.seq, d = s.d;
  std::mt19937_64 rng(1234);
  std::uniform_real_distribution<float> U(-1.0f, 1.0f);
  // Logical values [heads][seq][d] (q) and [heads_kv][seq][d] (k, v), rounded to f16 once so the
  // f16 and f32 inputs hold the same numbers.
  auto values = [&](int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = ioattn::detail::f16_to_float(ioattn::detail::float_to_f16(U(rng)));
    return x;
  };
  const std::vector<float> qv = values(h * n * d), kv = values(hk * n * d), vv = values(hk * n * d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  // ---- ggml ----
  const size_t bytes = static_cast<size_t>(h * n * d * 4 * 2 + hk * n * d * 2 * 2 + n * n * 2) + (size_t{64} << 20);
  ggml_init_params ip{bytes, nullptr, false};
  ggml_context* ctx = ggml_init(ip);
  ggml_tensor* gq = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, d, n, h, 1);
  ggml_tensor* gk = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, d, n, hk, 1);
  ggml_tensor* gv = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, d, n, hk, 1);
  std::memcpy(gq->data, qv.data(), qv.size() * 4);
  for (size_t i = 0; i < kv.size(); ++i) {
    static_cast<ggml_fp16_t*>(gk->data)[i] = ggml_fp32_to_fp16(kv[i]);
    static_cast<ggml_fp16_t*>(gv->data)[i] = ggml_fp32_to_fp16(vv[i]);
  }
  ggml_tensor* mask = nullptr;
  if (s.causal) {
    mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n, n, 1, 1);  // [kv, rows]
    auto* m = static_cast<ggml_fp16_t*>(mask->data);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) m[i * n + j] = j <= i ? zero : ninf;
  }
  ggml_tensor* gout = ggml_flash_attn_ext(ctx, gq, gk, gv, mask, scale, 0.0f, 0.0f);  // [d, heads, seq]
  ggml_cgraph* gf = ggml_new_graph(ctx);
  ggml_build_forward_expand(gf, gout);
  auto run_ggml = [&] { ggml_graph_compute_with_ctx(ctx, gf, threads); };

  // ---- ioattn: [1, seq, heads, d] ----
  using ioattn::DType;
  using ioattn::TensorView;
  auto bshd = [&](const std::vector<float>& x, int64_t heads) {  // [heads][seq][d] -> [seq][heads][d]
    std::vector<float> y(x.size());
    for (int64_t hh = 0; hh < heads; ++hh)
      for (int64_t t = 0; t < n; ++t)
        std::memcpy(&y[static_cast<size_t>((t * heads + hh) * d)], &x[static_cast<size_t>((hh * n + t) * d)], d * 4);
    return y;
  };
  const std::vector<float> q32 = bshd(qv, h), k32 = bshd(kv, hk), v32 = bshd(vv, hk);
  auto to16 = [](const std::vector<float>& x) {
    std::vector<uint16_t> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = ioattn::detail::float_to_f16(x[i]);
    return y;
  };
  std::vector<uint16_t> q16 = to16(q32), k16 = to16(k32), v16 = to16(v32), o16(q16.size());
  std::vector<float> o32(q32.size());
  ioattn::AttnParams prm;
  prm.causal = s.causal;
  prm.scale = scale;
  ioattn::Context cx;
  cx.num_threads = threads;
  auto view = [&](const void* p, DType t, int64_t heads) {
    return TensorView::contiguous(const_cast<void*>(p), t, {1, n, heads, d});
  };
  auto run_f16 = [&] {
    ioattn::forward(view(q16.data(), DType::f16, h), view(k16.data(), DType::f16, hk),
                    view(v16.data(), DType::f16, hk), view(o16.data(), DType::f16, h), TensorView{}, prm, cx);
  };
  auto run_f32 = [&] {
    ioattn::forward(view(q32.data(), DType::f32, h), view(k32.data(), DType::f32, hk),
                    view(v32.data(), DType::f32, hk), view(o32.data(), DType::f32, h), TensorView{}, prm, cx);
  };

  // Agreement: ggml's output is [seq][heads][d] in memory (permuted), as ioattn's [1, seq, heads, d].
  run_ggml();
  run_f16();
  run_f32();
  const float* go = static_cast<const float*>(gout->data);
  double diff16 = 0, diff32 = 0;
  for (size_t i = 0; i < o32.size(); ++i) {
    diff16 = std::max(diff16, std::fabs(static_cast<double>(ioattn::detail::f16_to_float(o16[i])) - go[i]));
    diff32 = std::max(diff32, std::fabs(static_cast<double>(o32[i]) - go[i]));
  }

  const double flops = 4.0 * h * static_cast<double>(n) * n * d * (s.causal ? 0.5 : 1.0);
  std::vector<double> t_ggml, t_f16, t_f32;
  auto timed = [](const auto& fn) {
    const double t0 = now_s();
    fn();
    return now_s() - t0;
  };
  for (int r = 0; r < repeats; ++r) {
    t_ggml.push_back(timed(run_ggml));
    t_f16.push_back(timed(run_f16));
    t_f32.push_back(timed(run_f32));
  }
  auto line = [&](const char* impl, std::vector<double> t, double diff) {
    std::sort(t.begin(), t.end());
    std::printf("{\"impl\": \"%s\", \"heads\": %lld, \"heads_kv\": %lld, \"seqlen\": %lld, \"head_dim\": %lld, "
                "\"causal\": %d, \"threads\": %d, \"best_gflops\": %.1f, \"median_gflops\": %.1f, "
                "\"max_diff_vs_ggml\": %.2e}\n",
                impl, static_cast<long long>(h), static_cast<long long>(hk), static_cast<long long>(n),
                static_cast<long long>(d), s.causal ? 1 : 0, threads, flops / t.front() / 1e9,
                flops / t[t.size() / 2] / 1e9, diff);
  };
  line("ggml_flash_attn_ext", t_ggml, 0.0);
  line("ioattn_f16", t_f16, diff16);
  line("ioattn_f32", t_f32, diff32);
  std::fflush(stdout);
  ggml_free(ctx);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = std::stoi(arg(argc, argv, "--threads", "2"));
  const int repeats = std::stoi(arg(argc, argv, "--repeats", "5"));
  const int64_t heads = std::stoll(arg(argc, argv, "--heads", "8"));
  const int64_t heads_kv = std::stoll(arg(argc, argv, "--heads-kv", std::to_string(heads)));
  for (int64_t n : list(arg(argc, argv, "--seqlen", "1024,4096")))
    for (int64_t d : list(arg(argc, argv, "--hdims", "64,128")))
      for (int64_t c : list(arg(argc, argv, "--causal", "0,1"))) run({heads, heads_kv, n, d, c != 0}, threads, repeats);
  return 0;
}

// peer_ggml.cpp — ioattn_peer_ggml: the CPU forward against llama.cpp's CPU flash attention
// (ggml_flash_attn_ext, the kernel llama.cpp runs for prefill on the CPU) in one process, the
// implementations interleaved repeat by repeat, same threads, same shapes.
//
//   ioattn_peer_ggml [--threads 2] [--seqlen 1024,4096] [--hdims 64,128] [--heads 8] [--heads-kv 8]
//                    [--causal 0,1] [--repeats 5]
//   ioattn_peer_ggml --decode 32768,131072 [--heads 32] [--heads-kv 8] [--hdims 128] [--threads 2]
//                    [--ggml-head-major 0]
//
// Prefill (the default):
// Each implementation gets its natural layout and precision:
//   ggml      q f32 [d, seq, heads] (ggml's dim order: [heads][seq][d] in memory), k / v f16,
//             out f32; causal = an f16 mask of 0 / -inf (ggml skips -inf keys); its default
//             accumulation precision (what llama.cpp uses);
//   ioattn    q / k / v / o all f16 ("ioattn_f16") and all f32 ("ioattn_f32"), [batch, seq, heads, d].
// The same random values feed all three (f16-rounded for the f16 inputs). GFLOP/s = 4 heads seq^2
// d (halved when causal) / time; each line also gives the max |O - O_ggml| as a check that the two
// compute the same function.
// Decode (--decode KV_LENS): one query token of one sequence against a KV cache of kv_len tokens
// laid out token-major, [kv][heads_kv][d], as llama.cpp keeps its cache (ggml gets the permuted
// view llama.cpp builds; ggml takes its split-KV path for one f16 row); f16 caches for both, and
// 8-bit: ggml q8_0 (blocks of 32 codes + an f16 scale, 8.5 bits) vs ioattn i8 (per-kv-head scale).
// GB/s = the cache's K+V bytes / time per call (medians over batches of calls). Built only with -DIOATTN_PEER_GGML=ON (tools/fetch-ggml.sh fetches and
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
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "ioattn/ioattn.hpp"
#include "ioattn/serving.hpp"

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

// A ggml graph planned once, as llama.cpp's CPU backend runs one: a persistent threadpool (OpenMP
// builds use their own team) and a work buffer allocated once, not per call.
struct GgmlRunner {
  ggml_cgraph* gf = nullptr;
  ggml_threadpool* pool = nullptr;
  ggml_cplan plan{};
  std::vector<uint8_t> work;
  GgmlRunner(ggml_cgraph* graph, int threads) : gf(graph) {
    ggml_threadpool_params tp = ggml_threadpool_params_default(threads);
    pool = ggml_threadpool_new(&tp);
    plan = ggml_graph_plan(gf, threads, pool);
    work.resize(plan.work_size + 1);
    plan.work_data = work.data();
  }
  ~GgmlRunner() { ggml_threadpool_free(pool); }
  GgmlRunner(const GgmlRunner&) = delete;
  GgmlRunner& operator=(const GgmlRunner&) = delete;
  void operator()() { ggml_graph_compute(gf, &plan); }
};

// count uniform values in [-1, 1), rounded to f16 once so f16 and f32 copies hold the same numbers.
std::vector<float> f16_values(std::mt19937_64& rng, int64_t count) {
  std::uniform_real_distribution<float> U(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(count));
  for (float& e : x) e = ioattn::detail::f16_to_float(ioattn::detail::float_to_f16(U(rng)));
  return x;
}

std::vector<uint16_t> to_f16(const std::vector<float>& x) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = ioattn::detail::float_to_f16(x[i]);
  return y;
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
  // Logical values [heads][seq][d] (q) and [heads_kv][seq][d] (k, v).
  const std::vector<float> qv = f16_values(rng, h * n * d), kv = f16_values(rng, hk * n * d),
                           vv = f16_values(rng, hk * n * d);
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
  GgmlRunner ggml_run(gf, threads);
  auto run_ggml = [&] { ggml_run(); };

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
  std::vector<uint16_t> q16 = to_f16(q32), k16 = to_f16(k32), v16 = to_f16(v32), o16(q16.size());
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

// ---- decode ----

// A token-major [kv][hk][d] cache: a [d, hk, kv] ggml tensor (permuted to [d, kv, hk] for the op).
ggml_tensor* token_major(ggml_context* ctx, ggml_type t, int64_t d, int64_t hk, int64_t kv) {
  return ggml_new_tensor_3d(ctx, t, d, hk, kv);
}

double median_call_s(const std::function<void()>& fn, int repeats) {
  fn();
  const double t0 = now_s();
  fn();
  const double one = std::max(now_s() - t0, 1e-6);
  const int inner = std::max(1, static_cast<int>(0.05 / one));  // >= 50 ms per sample
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const double a = now_s();
    for (int i = 0; i < inner; ++i) fn();
    t.push_back((now_s() - a) / inner);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void run_decode(int64_t hq, int64_t hk, int64_t d, int64_t kv, int threads, int repeats, bool ggml_head_major) {
  std::mt19937_64 rng(99);
  const std::vector<float> qv = f16_values(rng, hq * d), kvals = f16_values(rng, kv * hk * d),
                           vvals = f16_values(rng, kv * hk * d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  const size_t bytes = static_cast<size_t>(kv * hk * d) * 8 + (size_t{64} << 20);
  ggml_init_params ip{bytes, nullptr, false};
  ggml_context* ctx = ggml_init(ip);
  ggml_tensor* gq = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, d, 1, hq, 1);
  std::memcpy(gq->data, qv.data(), qv.size() * 4);
  struct GgmlCache {
    ggml_tensor* out;
    ggml_cgraph* gf;
    double kv_bytes;
  };
  // --ggml-head-major 1: ggml's cache [hk][kv][d] instead (each head's rows contiguous), a probe
  // of what llama.cpp's token-major layout costs it.
  auto order = [&](const std::vector<float>& x) {
    if (!ggml_head_major) return x;
    std::vector<float> y(x.size());
    for (int64_t t = 0; t < kv; ++t)
      for (int64_t h = 0; h < hk; ++h)
        std::memcpy(&y[static_cast<size_t>((h * kv + t) * d)], &x[static_cast<size_t>((t * hk + h) * d)], d * 4);
    return y;
  };
  const std::vector<float> kg = order(kvals), vg = order(vvals);
  auto ggml_cache = [&](ggml_type t) {
    ggml_tensor* k = ggml_head_major ? ggml_new_tensor_3d(ctx, t, d, kv, hk) : token_major(ctx, t, d, hk, kv);
    ggml_tensor* v = ggml_head_major ? ggml_new_tensor_3d(ctx, t, d, kv, hk) : token_major(ctx, t, d, hk, kv);
    const int64_t rows = hk * kv;  // rows of d values, in memory order
    if (t == GGML_TYPE_F16) {
      for (size_t i = 0; i < kg.size(); ++i) {
        static_cast<ggml_fp16_t*>(k->data)[i] = ggml_fp32_to_fp16(kg[i]);
        static_cast<ggml_fp16_t*>(v->data)[i] = ggml_fp32_to_fp16(vg[i]);
      }
    } else {
      ggml_quantize_chunk(t, kg.data(), k->data, 0, rows, d, nullptr);
      ggml_quantize_chunk(t, vg.data(), v->data, 0, rows, d, nullptr);
    }
    ggml_tensor* kp = ggml_head_major ? k : ggml_permute(ctx, k, 0, 2, 1, 3);  // [d, kv, hk]
    ggml_tensor* vp = ggml_head_major ? v : ggml_permute(ctx, v, 0, 2, 1, 3);
    ggml_tensor* out = ggml_flash_attn_ext(ctx, gq, kp, vp, nullptr, scale, 0.0f, 0.0f);
    ggml_cgraph* gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    return GgmlCache{out, gf, 2.0 * static_cast<double>(ggml_nbytes(k))};
  };

  // ioattn: q [1, 1, hq, d], cache [1, kv, hk, d] (the same token-major memory order).
  using ioattn::DType;
  using ioattn::TensorView;
  std::vector<uint16_t> q16 = to_f16(qv), k16 = to_f16(kvals), v16 = to_f16(vvals), o16(qv.size());
  // i8 with a per-kv-head scale (max |x| / 127), round to nearest.
  std::vector<int8_t> k8(kvals.size()), v8(vvals.size());
  std::vector<float> ks(static_cast<size_t>(hk), 0.0f), vs(static_cast<size_t>(hk), 0.0f);
  for (size_t i = 0; i < kvals.size(); ++i) {
    const size_t head = (i / static_cast<size_t>(d)) % static_cast<size_t>(hk);
    ks[head] = std::max(ks[head], std::fabs(kvals[i]) / 127.0f);
    vs[head] = std::max(vs[head], std::fabs(vvals[i]) / 127.0f);
  }
  for (size_t i = 0; i < kvals.size(); ++i) {
    const size_t head = (i / static_cast<size_t>(d)) % static_cast<size_t>(hk);
    k8[i] = static_cast<int8_t>(std::lrint(kvals[i] / ks[head]));
    v8[i] = static_cast<int8_t>(std::lrint(vvals[i] / vs[head]));
  }
  int32_t len = static_cast<int32_t>(kv);
  auto cache_of = [&](void* k, void* v, DType t) {
    ioattn::KVCache c;
    c.k_cache = TensorView::contiguous(k, t, {1, kv, hk, d});
    c.v_cache = TensorView::contiguous(v, t, {1, kv, hk, d});
    c.cache_seqlens = TensorView::contiguous(&len, DType::i32, {1});
    if (t == DType::i8) {
      c.k_scale = TensorView::contiguous(ks.data(), DType::f32, {hk});
      c.v_scale = TensorView::contiguous(vs.data(), DType::f32, {hk});
    }
    return c;
  };
  const TensorView qv16 = TensorView::contiguous(q16.data(), DType::f16, {1, 1, hq, d});
  const TensorView ov16 = TensorView::contiguous(o16.data(), DType::f16, {1, 1, hq, d});
  ioattn::AttnParams prm;
  prm.scale = scale;
  ioattn::Context cx;
  cx.num_threads = threads;

  struct Row {
    const char* cache;
    ggml_type gt;
    DType it;
    void* k;
    void* v;
    double bytes;
  };
  const Row rows[] = {{"f16", GGML_TYPE_F16, DType::f16, k16.data(), v16.data(), 2.0 * kv * hk * d * 2},
                      {"8-bit (ggml q8_0, ioattn i8)", GGML_TYPE_Q8_0, DType::i8, k8.data(), v8.data(),
                       2.0 * kv * hk * d}};
  for (const Row& r : rows) {
    const GgmlCache g = ggml_cache(r.gt);
    const ioattn::KVCache c = cache_of(r.k, r.v, r.it);
    GgmlRunner ggml_run(g.gf, threads);
    auto run_g = [&] { ggml_run(); };
    auto run_i = [&] { ioattn::decode(qv16, c, ov16, TensorView{}, prm, ioattn::DecodeOptions{}, cx); };
    run_g();
    run_i();
    const float* go = static_cast<const float*>(g.out->data);  // [d, hq, 1]
    double diff = 0;
    for (size_t i = 0; i < o16.size(); ++i)
      diff = std::max(diff, std::fabs(static_cast<double>(ioattn::detail::f16_to_float(o16[i])) - go[i]));
    double tg = 0, ti = 0;
    for (int round = 0; round < 2; ++round) {  // interleaved: ggml, ioattn, ggml, ioattn
      tg += median_call_s(run_g, repeats) / 2;
      ti += median_call_s(run_i, repeats) / 2;
    }
    auto line = [&](const char* impl, double t, double kv_bytes) {
      std::printf("{\"mode\": \"decode\", \"impl\": \"%s\", \"cache\": \"%s\", \"ggml_layout\": \"%s\", \"heads_q\": %lld, "
                  "\"heads_kv\": %lld, \"head_dim\": %lld, \"kv_len\": %lld, \"threads\": %d, \"us\": %.1f, "
                  "\"gbps\": %.2f, \"max_diff_ioattn_vs_ggml\": %.2e}\n",
                  impl, r.cache, ggml_head_major ? "head-major" : "token-major", static_cast<long long>(hq), static_cast<long long>(hk), static_cast<long long>(d),
                  static_cast<long long>(kv), threads, t * 1e6, kv_bytes / t / 1e9, diff);
    };
    line("ggml_flash_attn_ext", tg, g.kv_bytes);
    line("ioattn_decode", ti, r.bytes);
    std::fflush(stdout);
  }
  ggml_free(ctx);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = std::stoi(arg(argc, argv, "--threads", "2"));
  const int repeats = std::stoi(arg(argc, argv, "--repeats", "5"));
  const std::string decode_lens = arg(argc, argv, "--decode", "");
  if (!decode_lens.empty()) {
    const int64_t hq = std::stoll(arg(argc, argv, "--heads", "32"));
    const int64_t hk = std::stoll(arg(argc, argv, "--heads-kv", "8"));
    for (int64_t kv : list(decode_lens))
      for (int64_t d : list(arg(argc, argv, "--hdims", "128")))
        run_decode(hq, hk, d, kv, threads, repeats, arg(argc, argv, "--ggml-head-major", "0") == "1");
    return 0;
  }
  const int64_t heads = std::stoll(arg(argc, argv, "--heads", "8"));
  const int64_t heads_kv = std::stoll(arg(argc, argv, "--heads-kv", std::to_string(heads)));
  for (int64_t n : list(arg(argc, argv, "--seqlen", "1024,4096")))
    for (int64_t d : list(arg(argc, argv, "--hdims", "64,128")))
      for (int64_t c : list(arg(argc, argv, "--causal", "0,1"))) run({heads, heads_kv, n, d, c != 0}, threads, repeats);
  return 0;
}

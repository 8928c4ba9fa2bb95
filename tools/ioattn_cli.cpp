// ioattn — command-line tool.
//
//   ioattn explain [--seqlen N] [--head-dim D] [--heads H] [--layers L] [--dtype f16|bf16|f32]
//                  [--bandwidth TB/s] [--flops TFLOP/s] [--attention-share S --speedup K] [--json]
//   ioattn run     [--device cpu|cuda] [--backend auto|flash|naive] [--dtype f32|f16|bf16]
//                  [--batch B] [--seqlen N | --seqlen-q N --seqlen-k N] [--heads H] [--heads-kv H]
//                  [--head-dim D] [--head-dim-v D] [--causal] [--window L,R] [--softcap C]
//                  [--alibi] [--sinks] [--layout bshd|bhsd] [--threads T] [--repeats R]
//                  [--no-check] [--json]
//   ioattn info    [--json]
//
// With no arguments `ioattn run` runs the embedded default workload (batch 2, 8 heads,
// seqlen 1024, head_dim 128, f32, causal, CPU flash) and checks it against the float64 reference.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/harness.hpp"
#include "core/validate.hpp"
#include "cpu/reference.hpp"
#include "ioattn/explain.hpp"
#include "ioattn/ioattn.hpp"

namespace {

using namespace ioattn;

struct Args {
  std::string command;
  std::map<std::string, std::string> kv;
  bool has(const std::string& k) const { return kv.count(k) != 0; }
  std::string str(const std::string& k, const std::string& def) const {
    auto it = kv.find(k);
    return it == kv.end() ? def : it->second;
  }
  double num(const std::string& k, double def) const {
    auto it = kv.find(k);
    if (it == kv.end()) return def;
    char* end = nullptr;
    const double v = std::strtod(it->second.c_str(), &end);
    if (end == it->second.c_str() || *end != '\0')
      throw Error(k, "ioattn: option '--" + k + "': expected a number, got '" + it->second + "'");
    return v;
  }
  int64_t integer(const std::string& k, int64_t def) const {
    const double v = num(k, static_cast<double>(def));
    if (v != std::floor(v)) throw Error(k, "ioattn: option '--" + k + "': expected an integer, got " + str(k, ""));
    return static_cast<int64_t>(v);
  }
};

const char* const kFlags[] = {"causal", "alibi", "sinks", "no-check", "json", "help"};

Args parse(int argc, char** argv) {
  Args a;
  int i = 1;
  if (i < argc && argv[i][0] != '-') a.command = argv[i++];
  for (; i < argc; ++i) {
    std::string s = argv[i];
    if (s.rfind("--", 0) != 0) throw Error(s, "ioattn: unexpected argument '" + s + "' (options start with --)");
    s = s.substr(2);
    const auto eq = s.find('=');
    if (eq != std::string::npos) {
      a.kv[s.substr(0, eq)] = s.substr(eq + 1);
      continue;
    }
    const bool flag = std::find_if(std::begin(kFlags), std::end(kFlags),
                                   [&](const char* f) { return s == f; }) != std::end(kFlags);
    if (flag) {
      a.kv[s] = "1";
    } else {
      if (i + 1 >= argc) throw Error(s, "ioattn: option '--" + s + "' needs a value");
      a.kv[s] = argv[++i];
    }
  }
  return a;
}

void check_known(const Args& a, std::initializer_list<const char*> known) {
  for (const auto& kv : a.kv) {
    bool ok = false;
    for (const char* k : known) ok |= kv.first == k;
    if (!ok) throw Error(kv.first, "ioattn: unknown option '--" + kv.first + "' for '" + a.command + "'");
  }
}

DType parse_dtype(const std::string& s, const char* opt) {
  if (s == "f32" || s == "fp32" || s == "float32") return DType::f32;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::f16;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  throw Error(opt, std::string("ioattn: option '--") + opt + "': expected f32, f16 or bf16, got '" + s + "'");
}

void usage() {
  std::puts(
      "ioattn — IO-aware exact attention\n\n"
      "  ioattn run      time one attention forward on random inputs, check vs the float64 reference\n"
      "  ioattn explain  the memory-traffic arithmetic and the online-softmax worked example\n"
      "  ioattn info     backends, SIMD targets, compiled kernels, dispatcher choices\n\n"
      "ioattn run [--device cpu|cuda] [--backend auto|flash|naive] [--dtype f32|f16|bf16] [--batch B]\n"
      "           [--seqlen N | --seqlen-q N --seqlen-k N] [--heads H] [--heads-kv H] [--head-dim D]\n"
      "           [--head-dim-v D] [--causal] [--window L,R] [--softcap C] [--alibi] [--sinks]\n"
      "           [--layout bshd|bhsd] [--threads T] [--repeats R] [--no-check] [--json]\n"
      "ioattn explain [--seqlen N] [--head-dim D] [--heads H] [--layers L] [--dtype f16|bf16|f32]\n"
      "           [--bandwidth TB/s] [--flops TFLOP/s] [--attention-share S] [--speedup K] [--json]\n"
      "ioattn info [--json]\n\n"
      "IOATTN_LOG=info prints the kernel the dispatcher picks and why.");
}

// ---- explain ----------------------------------------------------------------------------
int cmd_explain(const Args& a) {
  check_known(a, {"seqlen", "head-dim", "heads", "layers", "dtype", "bandwidth", "flops", "passes",
                  "attention-share", "speedup", "json"});
  ExplainInput in;
  in.seqlen = a.integer("seqlen", in.seqlen);
  in.head_dim = a.integer("head-dim", in.head_dim);
  in.heads = a.integer("heads", in.heads);
  in.layers = a.integer("layers", in.layers);
  in.dtype_bytes = dtype_size(parse_dtype(a.str("dtype", "f16"), "dtype"));
  in.naive_passes = a.integer("passes", in.naive_passes);
  in.bandwidth_Bps = a.num("bandwidth", 3.0) * 1e12;
  in.flops_per_s = a.num("flops", 500.0) * 1e12;
  in.attention_share = a.num("attention-share", 0.0);
  in.kernel_speedup = a.num("speedup", 1.0);
  if (a.has("speedup") && !a.has("attention-share"))
    throw Error("attention-share", "ioattn: option '--attention-share': expected the share of a model step spent in "
                                   "attention, in (0, 1], with --speedup; got none");
  if (a.has("json")) {
    const ExplainReport r = explain(in);
    // The inputs first, so a script can read the model for its own shape (tools/report/traffic.py).
    std::printf(
        "{\"seqlen\": %lld, \"head_dim\": %lld, \"heads\": %lld, \"layers\": %lld, \"dtype_bytes\": %lld, "
        "\"naive_passes\": %lld, \"bandwidth_Bps\": %.6g, \"flops_per_s\": %.6g, \"attention_share\": %.6g, "
        "\"kernel_speedup\": %.6g, ",
        (long long)in.seqlen, (long long)in.head_dim, (long long)in.heads, (long long)in.layers,
        (long long)in.dtype_bytes, (long long)in.naive_passes, in.bandwidth_Bps, in.flops_per_s, in.attention_share,
        in.kernel_speedup);
    std::printf(
        "\"score_bytes_per_head\": %.0f, \"naive_bytes_per_head\": %.0f, \"naive_bytes_per_layer\": %.0f, "
        "\"naive_bytes_per_model\": %.0f, \"flash_bytes_per_head\": %.0f, \"traffic_ratio\": %.4f, "
        "\"flops_per_head\": %.0f, \"flops_per_model\": %.0f, \"naive_traffic_seconds\": %.6f, "
        "\"flash_traffic_seconds\": %.6f, \"math_seconds\": %.6f, \"end_to_end_speedup\": %.6f, ",
        r.score_bytes_per_head, r.naive_bytes_per_head, r.naive_bytes_per_layer, r.naive_bytes_per_model,
        r.flash_bytes_per_head, r.traffic_ratio, r.flops_per_head, r.flops_per_model, r.naive_traffic_seconds,
        r.flash_traffic_seconds, r.math_seconds, r.end_to_end_speedup);
    // JSON has no infinity: share 1 (all of the step is attention) has no ceiling.
    if (std::isinf(r.end_to_end_limit)) std::printf("\"end_to_end_limit\": null}\n");
    else std::printf("\"end_to_end_limit\": %.6f}\n", r.end_to_end_limit);
  } else {
    std::fputs(explain_text(in).c_str(), stdout);
  }
  return 0;
}

// ---- info -------------------------------------------------------------------------------
std::string json_list(const std::vector<std::string>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", \"" : "\"") + v[i] + "\"";
  return s + "]";
}

// What the dispatcher would pick for a few typical problems on each available device.
std::vector<std::pair<std::string, std::string>> sample_choices(const BuildInfo& bi) {
  std::vector<std::pair<std::string, std::string>> out;
  struct Case {
    const char* name;
    DType dt;
    int64_t d;
    bool causal;
  };
  const Case cases[] = {{"f32 hdim128 causal", DType::f32, 128, true},
                        {"bf16 hdim64", DType::bf16, 64, false},
                        {"bf16 hdim128 causal", DType::bf16, 128, true},
                        {"f16 hdim256", DType::f16, 256, false}};
  for (Device dev : {Device::cpu, Device::cuda}) {
    if (dev == Device::cuda && bi.cuda_devices == 0) continue;
    for (const Case& c : cases) {
      detail::Buffer buf(c.dt, 8, dev);  // views only; nothing runs
      TensorView q = TensorView::strided(buf.data(), c.dt, {1, 512, 8, c.d}, {0, 0, 0, 1}, dev);
      TensorView o = TensorView::strided(buf.data(), c.dt, {1, 512, 8, c.d}, {0, c.d, c.d * 512, 1}, dev);
      AttnParams prm;
      prm.causal = c.causal;
      std::string what;
      try {
        what = select_forward(q, q, q, o, TensorView{}, prm).kernel;
      } catch (const Error& e) {
        what = std::string("unsupported: ") + e.what();
      }
      out.emplace_back(std::string(device_name(dev)) + " " + c.name, what);
    }
  }
  return out;
}

int cmd_info(const Args& a) {
  check_known(a, {"json"});
  const BuildInfo bi = build_info();
  const auto choices = sample_choices(bi);
  if (a.has("json")) {
    std::printf("{\"version\": \"%s\", \"cpu_targets\": %s, \"cpu_best_target\": \"%s\", \"cpu_threads\": %d, "
                "\"cuda_compiled\": %s, \"cuda_devices\": %d, \"cuda_device_names\": %s, \"cuda_kernels\": %s, "
                "\"dispatch\": {",
                bi.version.c_str(), json_list(bi.cpu_targets).c_str(), bi.cpu_best_target.c_str(), bi.cpu_threads,
                bi.cuda_compiled ? "true" : "false", bi.cuda_devices, json_list(bi.cuda_device_names).c_str(),
                json_list(bi.cuda_kernels).c_str());
    for (size_t i = 0; i < choices.size(); ++i)
      std::printf("%s\"%s\": \"%s\"", i ? ", " : "", choices[i].first.c_str(), choices[i].second.c_str());
    std::printf("}}\n");
    return 0;
  }
  std::printf("ioattn %s\n", bi.version.c_str());
  std::printf("CPU backends: naive (float64 reference), flash (Highway SIMD, OpenMP)\n");
  std::printf("  SIMD targets compiled: ");
  for (size_t i = 0; i < bi.cpu_targets.size(); ++i) std::printf("%s%s", i ? ", " : "", bi.cpu_targets[i].c_str());
  std::printf("\n  chosen on this machine: %s, %d threads\n", bi.cpu_best_target.c_str(), bi.cpu_threads);
  std::printf("CUDA backend: %s", bi.cuda_compiled ? "compiled" : "not compiled");
  if (bi.cuda_compiled) std::printf(", %d device(s)", bi.cuda_devices);
  std::printf("\n");
  for (const auto& n : bi.cuda_device_names) std::printf("  device: %s\n", n.c_str());
  if (!bi.cuda_kernels.empty()) {
    std::printf("  kernels compiled (dispatch table):\n");
    for (const auto& k : bi.cuda_kernels) std::printf("    %s\n", k.c_str());
  }
  std::printf("Dispatcher choices for typical problems (seqlen 512, 8 heads):\n");
  for (const auto& c : choices) std::printf("  %-26s -> %s\n", c.first.c_str(), c.second.c_str());
  return 0;
}

// ---- run --------------------------------------------------------------------------------
long peak_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int cmd_run(const Args& a) {
  check_known(a, {"device", "backend", "dtype", "batch", "seqlen", "seqlen-q", "seqlen-k", "heads", "heads-kv",
                  "head-dim", "head-dim-v", "causal", "window", "softcap", "alibi", "sinks", "layout", "threads",
                  "repeats", "no-check", "json", "seed"});
  const bool defaults = a.kv.empty() || (a.kv.size() == 1 && a.has("json"));
  const std::string dev_s = a.str("device", "cpu");
  if (dev_s != "cpu" && dev_s != "cuda")
    throw Error("device", "ioattn: option '--device': expected cpu or cuda, got '" + dev_s + "'");
  const Device dev = dev_s == "cuda" ? Device::cuda : Device::cpu;
  const std::string be_s = a.str("backend", "auto");
  Context ctx;
  if (be_s == "flash") ctx.backend = Backend::flash;
  else if (be_s == "naive") ctx.backend = Backend::naive;
  else if (be_s != "auto") throw Error("backend", "ioattn: option '--backend': expected auto, flash or naive, got '" + be_s + "'");
  ctx.num_threads = static_cast<int>(a.integer("threads", 0));
  const DType dt = parse_dtype(a.str("dtype", "f32"), "dtype");
  const int64_t B = a.integer("batch", 2);
  const int64_t S = a.integer("seqlen", 1024);
  const int64_t Sq = a.integer("seqlen-q", S), Sk = a.integer("seqlen-k", S);
  const int64_t Hq = a.integer("heads", 8), Hk = a.integer("heads-kv", Hq);
  const int64_t D = a.integer("head-dim", 128), Dv = a.integer("head-dim-v", D);
  const int repeats = static_cast<int>(std::max<int64_t>(1, a.integer("repeats", 5)));
  const std::string layout = a.str("layout", "bshd");
  if (layout != "bshd" && layout != "bhsd")
    throw Error("layout", "ioattn: option '--layout': expected bshd or bhsd, got '" + layout + "'");
  for (auto [name, v] : {std::pair{"batch", B}, {"seqlen-q", Sq}, {"seqlen-k", Sk}, {"heads", Hq}, {"heads-kv", Hk},
                         {"head-dim", D}, {"head-dim-v", Dv}})
    if (v < 0) throw Error(name, std::string("ioattn: option '--") + name + "': expected >= 0, got " + std::to_string(v));

  AttnParams prm;
  prm.causal = a.has("causal") || defaults;
  prm.softcap = static_cast<float>(a.num("softcap", 0.0));
  if (a.has("window")) {
    const std::string w = a.str("window", "");
    const auto comma = w.find(',');
    if (comma == std::string::npos) throw Error("window", "ioattn: option '--window': expected L,R, got '" + w + "'");
    prm.window_left = std::atoll(w.substr(0, comma).c_str());
    prm.window_right = std::atoll(w.substr(comma + 1).c_str());
  }
  std::mt19937_64 rng(static_cast<uint64_t>(a.integer("seed", 1234)));
  detail::Buffer q(dt, B * Sq * Hq * D, dev), k(dt, B * Sk * Hk * D, dev), v(dt, B * Sk * Hk * Dv, dev);
  detail::Buffer o(dt, B * Sq * Hq * Dv, dev), lse(DType::f32, B * Hq * Sq, dev);
  detail::Buffer alibi(DType::f32, Hq, dev), sinks(DType::f32, Hq, dev);
  q.fill_random(rng);
  k.fill_random(rng);
  v.fill_random(rng);
  o.poison();
  lse.poison();
  auto view = [&](detail::Buffer& b, int64_t s, int64_t h, int64_t d) {
    if (layout == "bshd") return b.view({B, s, h, d});
    return b.view({B, h, s, d}).transpose12();  // [b, h, s, d] memory seen as [b, s, h, d]
  };
  if (a.has("alibi")) {
    for (int64_t h = 0; h < Hq; ++h) alibi.set(h, std::pow(2.0f, -8.0f * static_cast<float>(h + 1) / static_cast<float>(Hq)));
    alibi.upload();
    prm.alibi_slopes = alibi.view({Hq});
  }
  if (a.has("sinks")) {
    sinks.fill_random(rng, 2.0f);
    prm.sinks = sinks.view({Hq});
  }
  TensorView qv = view(q, Sq, Hq, D), kv = view(k, Sk, Hk, D), vv = view(v, Sk, Hk, Dv), ov = view(o, Sq, Hq, Dv);
  TensorView lv = lse.view({B, Hq, Sq});

  // First call: measures peak host memory growth (RSS) or device memory in use.
  const long rss0 = peak_rss_kb();
  const size_t dev0 = dev == Device::cuda ? detail::cuda_used_bytes() : 0;
  const KernelChoice choice = forward(qv, kv, vv, ov, lv, prm, ctx);
  if (dev == Device::cuda) detail::cuda_synchronize();
  const double extra_mb = dev == Device::cuda
                              ? static_cast<double>(detail::cuda_used_bytes() - std::min(dev0, detail::cuda_used_bytes())) / 1e6
                              : static_cast<double>(peak_rss_kb() - rss0) / 1e3;
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    forward(qv, kv, vv, ov, lv, prm, ctx);
    if (dev == Device::cuda) detail::cuda_synchronize();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double t = median(times);
  // FLOPs of the visible part of S (4 * d per score for QK^T and PV, d and dv averaged).
  double visible = 0;
  for (int64_t i = 0; i < Sq; ++i) {
    int64_t lo, hi;
    detail::visible_keys(i, Sq, Sk, prm.window_left, prm.causal ? 0 : prm.window_right, &lo, &hi);
    visible += static_cast<double>(std::max<int64_t>(0, hi - lo));
  }
  const double flops = 2.0 * static_cast<double>(B * Hq) * visible * static_cast<double>(D + Dv);

  double err_o = -1, err_lse = -1, err_naive = -1, bound = -1;
  bool pass = true;
  if (!a.has("no-check")) {
    o.download();
    lse.download();
    detail::Validated val = detail::validate(qv, kv, vv, ov, lv, nullptr, prm, ctx);
    // The reference reads inputs on the host.
    detail::FwdProblem hp = val.p;
    hp.q = q.host();
    hp.k = k.host();
    hp.v = v.host();
    hp.alibi_slopes = prm.alibi_slopes.defined() ? static_cast<const float*>(alibi.host()) : nullptr;
    hp.sinks = prm.sinks.defined() ? static_cast<const float*>(sinks.host()) : nullptr;
    const auto ref = detail::reference_forward(hp, detail::RefPrecision::f64);
    const auto emu = detail::reference_forward(hp, detail::RefPrecision::emulated);
    detail::ErrorStats eo, el, no, nl;
    detail::output_errors(hp, o.host(), static_cast<const float*>(lse.host()), ref, &eo, &el);
    detail::ref_errors(emu, ref, &no, &nl);
    err_o = eo.max_abs;
    err_lse = el.max_abs;
    err_naive = no.max_abs;
    bound = 2 * err_naive + (dt == DType::f32 ? 1e-5 : 1e-3);
    pass = err_o <= bound;
  }
  if (a.has("json")) {
    std::printf("{\"kernel\": \"%s\", \"device\": \"%s\", \"dtype\": \"%s\", \"batch\": %lld, \"seqlen_q\": %lld, "
                "\"seqlen_k\": %lld, \"heads_q\": %lld, \"heads_kv\": %lld, \"head_dim\": %lld, \"causal\": %s, "
                "\"time_ms\": %.4f, \"gflops\": %.2f, \"extra_memory_mb\": %.2f, \"max_err_o\": %.3g, "
                "\"max_err_lse\": %.3g, \"naive_lowp_err\": %.3g, \"pass\": %s}\n",
                choice.kernel.c_str(), dev_s.c_str(), dtype_name(dt), (long long)B, (long long)Sq, (long long)Sk,
                (long long)Hq, (long long)Hk, (long long)D, prm.causal ? "true" : "false", t * 1e3, flops / t / 1e9,
                extra_mb, err_o, err_lse, err_naive, pass ? "true" : "false");
  } else {
    std::printf("kernel:   %s\n          (%s)\n", choice.kernel.c_str(), choice.reason.c_str());
    std::printf("problem:  batch %lld, seqlen_q %lld, seqlen_k %lld, heads %lld/%lld, head_dim %lld/%lld, %s%s\n",
                (long long)B, (long long)Sq, (long long)Sk, (long long)Hq, (long long)Hk, (long long)D, (long long)Dv,
                dtype_name(dt), prm.causal ? ", causal" : "");
    std::printf("time:     %.3f ms (median of %d)\n", t * 1e3, repeats);
    std::printf("rate:     %.1f GFLOP/s\n", flops / t / 1e9);
    std::printf("memory:   %.1f MB peak extra %s (n x n scores would be %.1f MB per head in fp32)\n", extra_mb,
                dev == Device::cuda ? "device memory" : "host RSS", static_cast<double>(Sq * Sk * 4) / 1e6);
    if (err_o >= 0)
      std::printf("check:    max |O - ref| = %.3g (bound %.3g = 2 x naive-%s error %.3g + atol), max |LSE - ref| = %.3g: %s\n",
                  err_o, bound, dtype_name(dt), err_naive, err_lse, pass ? "PASS" : "FAIL");
  }
  return pass ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a = parse(argc, argv);
    if (a.has("help") || a.command == "help") {
      usage();
      return 0;
    }
    if (a.command.empty() || a.command == "run") {
      a.command = "run";
      return cmd_run(a);
    }
    if (a.command == "explain") return cmd_explain(a);
    if (a.command == "info") return cmd_info(a);
    std::fprintf(stderr, "ioattn: unknown command '%s'\n\n", a.command.c_str());
    usage();
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}

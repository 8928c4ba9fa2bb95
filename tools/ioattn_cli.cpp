// ioattn — command-line tool.
//
//   ioattn explain [--seqlen N] [--head-dim D] [--heads H] [--layers L] [--dtype f16|bf16|f32]
//                  [--bandwidth TB/s] [--flops TFLOP/s] [--attention-share S --speedup K] [--json]
//   ioattn run     [--device cpu|cuda] [--backend auto|flash|naive] [--dtype f32|f16|bf16|f8e4m3]
//                  [--batch B] [--seqlen N | --seqlen-q N --seqlen-k N] [--heads H] [--heads-kv H]
//                  [--head-dim D] [--head-dim-v D] [--causal] [--window L,R] [--softcap C]
//                  [--alibi] [--sinks] [--layout bshd|bhsd] [--threads T] [--repeats R]
//                  [--no-check] [--check-flops F] [--json]
//   ioattn bench   [--device cpu|cuda] [--seqlen N,N..] [--hdim D,D..] [--causal 0,1] [--dtype f16,bf16,f32,f8e4m3]
//                  [--backend naive,flash,auto] [--batch B | --tokens T] [--heads H | --hidden W]
//                  [--repeats R] [--warmup W] [--threads T] [--no-check] [--check-flops F] [--out FILE] [--quiet]
//   ioattn info    [--json]
//
// `bench` sweeps the grid and writes one JSON record per point (JSON lines, to --out or stdout):
// shape, kernel, median time, TFLOP/s (4 b h s^2 d, halved when causal), the traffic model of
// `explain` and the bandwidth it implies, extra memory (CUDA: measured; CPU: model) and the error
// vs the float64 reference (a sample of rows when the reference would cost more than
// --check-flops; the record says which). Progress goes to stderr. --tokens T --hidden W is
// FlashAttention's grid: batch = T / seqlen, heads = W / hdim. --repeats 0 --warmup 0 --no-check
// makes exactly one forward call per point (for Nsight Compute: tools/report/traffic.py).
//
// With no arguments `ioattn run` runs the embedded default workload (batch 2, 8 heads,
// seqlen 1024, head_dim 128, f32, causal, CPU flash) and checks it against the float64 reference.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <stdexcept>
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
  std::string missing;  // a last option given without its value (reported after the unknown-option check)
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
    // (beyond 2^53 a double no longer holds every integer, and the cast below would be undefined)
    if (std::fabs(v) > 9007199254740992.0)
      throw Error(k, "ioattn: option '--" + k + "': expected an integer of magnitude <= 2^53, got " + str(k, ""));
    return static_cast<int64_t>(v);
  }
};

// One integer of an option's value (e.g. each side of --window L,R): the whole text, in int64 range.
int64_t parse_int(const std::string& text, const std::string& opt, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || end == text.c_str() || *end != '\0' || errno == ERANGE)
    throw Error(opt, "ioattn: option '--" + opt + "': expected " + what + ", got '" + text + "'");
  return v;
}

const char* const kFlags[] = {"causal", "alibi", "sinks", "no-check", "json", "help", "quiet"};

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
      // A flag may carry a value (`bench --causal 0,1`); a following option is not one.
      const bool valued = i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0;
      a.kv[s] = valued ? argv[++i] : "1";
    } else {
      if (i + 1 >= argc) {
        a.missing = s;
        a.kv[s] = "";
        continue;
      }
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
  if (!a.missing.empty()) throw Error(a.missing, "ioattn: option '--" + a.missing + "' needs a value");
}

// with_fp8 (run, bench): also f8e4m3 inputs (O in bf16, descales 1).
DType parse_dtype(const std::string& s, const char* opt, bool with_fp8 = false) {
  if (s == "f32" || s == "fp32" || s == "float32") return DType::f32;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::f16;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (with_fp8 && (s == "f8e4m3" || s == "fp8" || s == "float8_e4m3fn")) return DType::f8e4m3;
  throw Error(opt, std::string("ioattn: option '--") + opt + "': expected f32, f16, bf16" +
                       (with_fp8 ? " or f8e4m3" : "") + ", got '" + s + "'");
}

void usage() {
  std::puts(
      "ioattn — IO-aware exact attention\n\n"
      "  ioattn run      time one attention forward on random inputs, check vs the float64 reference\n"
      "  ioattn explain  the memory-traffic arithmetic and the online-softmax worked example\n"
      "  ioattn bench    sweep a grid of shapes and backends, one JSON record per point\n"
      "  ioattn info     backends, SIMD targets, compiled kernels, dispatcher choices\n\n"
      "ioattn run [--device cpu|cuda] [--backend auto|flash|naive] [--dtype f32|f16|bf16|f8e4m3] [--batch B]\n"
      "           [--seqlen N | --seqlen-q N --seqlen-k N] [--heads H] [--heads-kv H] [--head-dim D]\n"
      "           [--head-dim-v D] [--causal] [--window L,R] [--softcap C] [--alibi] [--sinks]\n"
      "           [--layout bshd|bhsd] [--threads T] [--repeats R] [--no-check] [--check-flops F] [--json]\n"
      "ioattn bench [--device cpu|cuda] [--seqlen 1024,2048] [--hdim 64,128] [--causal 0,1] [--dtype bf16]\n"
      "           [--backend naive,flash] [--batch B | --tokens T] [--heads H | --hidden W] [--repeats R]\n"
      "           [--warmup W] [--threads T] [--no-check] [--check-flops F] [--out FILE] [--quiet]\n"
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
  // The rates in the options' own units (TB/s, TFLOP/s) before they become ExplainInput's.
  for (const char* opt : {"bandwidth", "flops", "speedup"}) {
    const double v = a.num(opt, 1.0);
    if (!(v > 0 && std::isfinite(v)))
      throw Error(opt, std::string("ioattn: option '--") + opt + "': expected a finite number > 0, got " + a.str(opt, ""));
  }
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

// ---- shared by run and bench: one workload, its timing, its check -------------------------
long peak_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Shape {
  Device device = Device::cpu;
  DType dtype = DType::f32;  // of q, k, v; O in it too, or bf16 for f8e4m3 (out())
  int64_t batch = 1, seqlen_q = 0, seqlen_k = 0, heads_q = 1, heads_kv = 1, head_dim = 64, head_dim_v = 64;
  bool bhsd = false;  // [b, h, s, d] memory seen as [b, s, h, d] (PyTorch SDPA's layout)
  DType out() const { return dtype == DType::f8e4m3 ? DType::bf16 : dtype; }
};

// One forward problem on random inputs (uniform in [-1, 1], rounded to the dtype): host buffers
// mirrored on the device, the views a call takes, and its parameters (mask set by the caller).
struct Workload {
  Shape s;
  AttnParams prm;
  detail::Buffer q, k, v, o, lse, alibi, sinks;
  TensorView qv, kv, vv, ov, lv;

  // The shape's buffers, in bytes (double: a product of option values can exceed int64), checked
  // before anything is allocated: beyond 2^62 bytes, or with no memory for them, a clear error
  // naming the options instead of an overflowed size or a bare std::bad_alloc.
  static double bytes_of(const Shape& sh) {
    const double b = static_cast<double>(sh.batch), e = static_cast<double>(dtype_size(sh.dtype));
    const double eo = static_cast<double>(dtype_size(sh.out()));
    const double q = b * static_cast<double>(sh.seqlen_q) * static_cast<double>(sh.heads_q);
    const double kv = b * static_cast<double>(sh.seqlen_k) * static_cast<double>(sh.heads_kv);
    return e * (q * static_cast<double>(sh.head_dim) + kv * static_cast<double>(sh.head_dim + sh.head_dim_v)) +
           eo * q * static_cast<double>(sh.head_dim_v) + 4.0 * q;
  }
  [[noreturn]] static void too_big(const Shape& sh) {
    char gb[64];
    std::snprintf(gb, sizeof gb, "%.3g", bytes_of(sh) / 1e9);
    throw Error("seqlen", std::string("ioattn: the workload's q, k, v, o and LSE need ") + gb + " GB of " +
                              (sh.device == Device::cuda ? "device" : "host") +
                              " memory, more than can be allocated here; lower --batch, --seqlen, --heads or --head-dim");
  }
  static const Shape& checked(const Shape& sh) {
    if (bytes_of(sh) > 4.6e18) too_big(sh);  // 2^62
    return sh;
  }

  Workload(const Shape& shape, bool with_alibi, bool with_sinks, std::mt19937_64& rng) try
      : s(checked(shape)),
        q(s.dtype, s.batch * s.seqlen_q * s.heads_q * s.head_dim, s.device),
        k(s.dtype, s.batch * s.seqlen_k * s.heads_kv * s.head_dim, s.device),
        v(s.dtype, s.batch * s.seqlen_k * s.heads_kv * s.head_dim_v, s.device),
        o(s.out(), s.batch * s.seqlen_q * s.heads_q * s.head_dim_v, s.device),
        lse(DType::f32, s.batch * s.heads_q * s.seqlen_q, s.device),
        alibi(DType::f32, s.heads_q, s.device),
        sinks(DType::f32, s.heads_q, s.device) {
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    poison();
    if (with_alibi) {
      for (int64_t h = 0; h < s.heads_q; ++h)
        alibi.set(h, std::pow(2.0f, -8.0f * static_cast<float>(h + 1) / static_cast<float>(s.heads_q)));
      alibi.upload();
      prm.alibi_slopes = alibi.view({s.heads_q});
    }
    if (with_sinks) {
      sinks.fill_random(rng, 2.0f);
      prm.sinks = sinks.view({s.heads_q});
    }
    qv = view(q, s.seqlen_q, s.heads_q, s.head_dim);
    kv = view(k, s.seqlen_k, s.heads_kv, s.head_dim);
    vv = view(v, s.seqlen_k, s.heads_kv, s.head_dim_v);
    ov = view(o, s.seqlen_q, s.heads_q, s.head_dim_v);
    lv = lse.view({s.batch, s.heads_q, s.seqlen_q});
  } catch (const std::bad_alloc&) {
    too_big(shape);
  }
  Workload(const Workload&) = delete;
  Workload& operator=(const Workload&) = delete;

  // Outputs back to NaN, so an element the next call leaves unwritten shows as an error.
  void poison() {
    o.poison();
    lse.poison();
  }
  KernelChoice forward(const Context& ctx) { return ioattn::forward(qv, kv, vv, ov, lv, prm, ctx); }
  // The problem exactly as a backend receives it (validation included).
  detail::Validated validated(const Context& ctx) const {
    return detail::validate(qv, kv, vv, ov, lv, nullptr, prm, ctx);
  }

 private:
  TensorView view(detail::Buffer& b, int64_t seq, int64_t heads, int64_t d) {
    if (!s.bhsd) return b.view({s.batch, seq, heads, d});
    return b.view({s.batch, heads, seq, d}).transpose12();
  }
};

struct Timing {
  KernelChoice choice;
  double median_s = 0, min_s = 0;
  int samples = 0;                  // timed samples (0 repeats: the first call alone, cold)
  int inner = 1;                    // back-to-back calls per sample
  double device_extra_bytes = 0;    // CUDA: device memory the first call held beyond what was in use
  double rss_growth_bytes = 0;      // CPU: growth of the peak RSS during the first call
};

// The first call measures memory; then `warmup` untimed calls; then `repeats` samples, each of
// `inner` back-to-back calls timed with steady_clock between device synchronisations. With
// batch_calls, inner grows until a sample lasts ~2 ms (at most 50 calls), so the launch and
// synchronise cost is small against short kernels. repeats = 0: one call in all (Nsight Compute
// profiles exactly one forward per point), timed cold.
Timing time_forward(Workload& w, const Context& ctx, int warmup, int repeats, bool batch_calls) {
  using clock = std::chrono::steady_clock;
  const bool cuda = w.s.device == Device::cuda;
  auto sync = [&] {
    if (cuda) detail::cuda_synchronize();
  };
  auto seconds = [](clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); };
  Timing t;
  sync();
  const size_t dev0 = cuda ? detail::cuda_used_bytes() : 0;
  const long rss0 = peak_rss_kb();
  auto t0 = clock::now();
  t.choice = w.forward(ctx);
  // Before the synchronise: a workspace the call took from the stream-ordered pool is still held
  // (the pool gives freed memory back to the device at a synchronise).
  const size_t dev_held = cuda ? detail::cuda_used_bytes() : 0;
  sync();
  double last_s = seconds(t0);
  if (cuda) {
    const size_t peak = std::max(dev_held, detail::cuda_used_bytes());
    t.device_extra_bytes = static_cast<double>(peak - std::min(peak, dev0));
  }
  t.rss_growth_bytes = static_cast<double>(peak_rss_kb() - rss0) * 1e3;
  if (repeats <= 0) {
    t.median_s = t.min_s = last_s;
    return t;
  }
  for (int i = 0; i < warmup; ++i) {
    t0 = clock::now();
    w.forward(ctx);
    sync();
    last_s = seconds(t0);
  }
  if (batch_calls) t.inner = static_cast<int>(std::clamp(std::ceil(2e-3 / std::max(last_s, 1e-7)), 1.0, 50.0));
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    t0 = clock::now();
    for (int i = 0; i < t.inner; ++i) w.forward(ctx);
    sync();
    times.push_back(seconds(t0) / t.inner);
  }
  t.samples = repeats;
  t.median_s = median(times);
  t.min_s = *std::min_element(times.begin(), times.end());
  return t;
}

// The workload's outputs (downloaded) against the float64 reference on the exact problem the
// backend received; a large problem is checked on a sample of rows (detail::check_forward).
struct Check {
  detail::ForwardCheck c;
  double bound = 0;
  bool pass = true;
};
Check check_workload(Workload& w, const Context& ctx, double max_ref_flops) {
  w.o.download();
  w.lse.download();
  detail::Validated val = w.validated(ctx);
  detail::FwdProblem hp = val.p;  // the reference reads host copies
  hp.q = w.q.host();
  hp.k = w.k.host();
  hp.v = w.v.host();
  hp.o = w.o.host();
  hp.lse = static_cast<float*>(w.lse.host());
  hp.alibi_slopes = w.prm.alibi_slopes.defined() ? static_cast<const float*>(w.alibi.host()) : nullptr;
  hp.sinks = w.prm.sinks.defined() ? static_cast<const float*>(w.sinks.host()) : nullptr;
  Check r;
  r.c = detail::check_forward(hp, max_ref_flops);
  r.bound = 2 * r.c.naive_o.max_abs + (w.s.dtype == DType::f32 ? 1e-5 : 1e-3);
  r.pass = r.c.o.max_abs <= r.bound;
  return r;
}

std::string check_scope(const detail::ForwardCheck& c, const Shape& s) {
  if (!c.sampled) return "full";
  return "sampled: last " + std::to_string(c.rows_checked) + " of " + std::to_string(s.seqlen_q) + " query rows of " +
         (c.heads_checked > 1 ? "the first and the last" : "one") + " of " + std::to_string(s.batch * s.heads_q) +
         " (batch, head) pairs";
}

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu;
  if (s == "cuda") return Device::cuda;
  throw Error("device", "ioattn: option '--device': expected cpu or cuda, got '" + s + "'");
}

Backend parse_backend(const std::string& s, const char* opt) {
  if (s == "flash") return Backend::flash;
  if (s == "naive") return Backend::naive;
  if (s == "auto") return Backend::automatic;
  throw Error(opt, std::string("ioattn: option '--") + opt + "': expected auto, flash or naive, got '" + s + "'");
}

constexpr double kDefaultCheckFlops = 2e9;  // float64 reference budget per point (~1-2 s on one core)

// --threads (0 = all) and --check-flops, shared by run and bench: errors name the option.
int threads_option(const Args& a) {
  const int64_t t = a.integer("threads", 0);
  if (t < 0 || t > INT_MAX)
    throw Error("threads", "ioattn: option '--threads': expected an integer >= 0 (0 = all), got " + a.str("threads", ""));
  return static_cast<int>(t);
}
double check_flops_option(const Args& a) {
  const double f = a.num("check-flops", kDefaultCheckFlops);
  if (!(f >= 0) || std::isinf(f))
    throw Error("check-flops", "ioattn: option '--check-flops': expected a finite number >= 0, got " + a.str("check-flops", ""));
  return f;
}

// ---- run --------------------------------------------------------------------------------
int cmd_run(const Args& a) {
  check_known(a, {"device", "backend", "dtype", "batch", "seqlen", "seqlen-q", "seqlen-k", "heads", "heads-kv",
                  "head-dim", "head-dim-v", "causal", "window", "softcap", "alibi", "sinks", "layout", "threads",
                  "repeats", "no-check", "json", "seed", "check-flops"});
  const bool defaults = a.kv.empty() || (a.kv.size() == 1 && a.has("json"));
  const std::string dev_s = a.str("device", "cpu");
  Shape sh;
  sh.device = parse_device(dev_s);
  Context ctx;
  ctx.backend = parse_backend(a.str("backend", "auto"), "backend");
  ctx.num_threads = threads_option(a);
  sh.dtype = parse_dtype(a.str("dtype", "f32"), "dtype", true);
  sh.batch = a.integer("batch", 2);
  const int64_t S = a.integer("seqlen", 1024);
  sh.seqlen_q = a.integer("seqlen-q", S);
  sh.seqlen_k = a.integer("seqlen-k", S);
  sh.heads_q = a.integer("heads", 8);
  sh.heads_kv = a.integer("heads-kv", sh.heads_q);
  sh.head_dim = a.integer("head-dim", 128);
  sh.head_dim_v = a.integer("head-dim-v", sh.head_dim);
  const int64_t repeats_arg = a.integer("repeats", 5);
  if (repeats_arg < 1 || repeats_arg > INT_MAX)
    throw Error("repeats", "ioattn: option '--repeats': expected an integer >= 1, got " + std::to_string(repeats_arg));
  const int repeats = static_cast<int>(repeats_arg);
  const std::string layout = a.str("layout", "bshd");
  if (layout != "bshd" && layout != "bhsd")
    throw Error("layout", "ioattn: option '--layout': expected bshd or bhsd, got '" + layout + "'");
  sh.bhsd = layout == "bhsd";
  for (auto [name, v] : {std::pair{"batch", sh.batch}, {"seqlen-q", sh.seqlen_q}, {"seqlen-k", sh.seqlen_k},
                         {"heads", sh.heads_q}, {"heads-kv", sh.heads_kv}, {"head-dim", sh.head_dim},
                         {"head-dim-v", sh.head_dim_v}})
    if (v < 0) throw Error(name, std::string("ioattn: option '--") + name + "': expected >= 0, got " + std::to_string(v));

  std::mt19937_64 rng(static_cast<uint64_t>(a.integer("seed", 1234)));
  Workload w(sh, a.has("alibi"), a.has("sinks"), rng);
  AttnParams& prm = w.prm;
  prm.causal = (a.has("causal") && a.str("causal", "1") != "0") || defaults;
  prm.softcap = static_cast<float>(a.num("softcap", 0.0));
  if (a.has("window")) {
    const std::string win = a.str("window", "");
    const auto comma = win.find(',');
    if (comma == std::string::npos) throw Error("window", "ioattn: option '--window': expected L,R, got '" + win + "'");
    const std::string what = "L,R with integers L and R (-1 = unbounded)";
    prm.window_left = parse_int(win.substr(0, comma), "window", what + " for L");
    prm.window_right = parse_int(win.substr(comma + 1), "window", what + " for R");
  }
  const Device dev = sh.device;
  const int64_t B = sh.batch, Sq = sh.seqlen_q, Sk = sh.seqlen_k, Hq = sh.heads_q, Hk = sh.heads_kv;
  const int64_t D = sh.head_dim, Dv = sh.head_dim_v;
  const DType dt = sh.dtype;

  const Timing tm = time_forward(w, ctx, 0, repeats, false);
  const double t = tm.median_s;
  const KernelChoice& choice = tm.choice;
  const double extra_mb = (dev == Device::cuda ? tm.device_extra_bytes : tm.rss_growth_bytes) / 1e6;
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
  std::string scope = "none";
  if (!a.has("no-check")) {
    const Check ck = check_workload(w, ctx, check_flops_option(a));
    err_o = ck.c.o.max_abs;
    err_lse = ck.c.lse.max_abs;
    err_naive = ck.c.naive_o.max_abs;
    bound = ck.bound;
    pass = ck.pass;
    scope = check_scope(ck.c, sh);
  }
  if (a.has("json")) {
    std::printf("{\"kernel\": \"%s\", \"device\": \"%s\", \"dtype\": \"%s\", \"batch\": %lld, \"seqlen_q\": %lld, "
                "\"seqlen_k\": %lld, \"heads_q\": %lld, \"heads_kv\": %lld, \"head_dim\": %lld, \"causal\": %s, "
                "\"time_ms\": %.4f, \"gflops\": %.2f, \"extra_memory_mb\": %.2f, \"max_err_o\": %.3g, "
                "\"max_err_lse\": %.3g, \"naive_lowp_err\": %.3g, \"check\": \"%s\", \"pass\": %s}\n",
                choice.kernel.c_str(), dev_s.c_str(), dtype_name(dt), (long long)B, (long long)Sq, (long long)Sk,
                (long long)Hq, (long long)Hk, (long long)D, prm.causal ? "true" : "false", t * 1e3, flops / t / 1e9,
                extra_mb, err_o, err_lse, err_naive, scope.c_str(), pass ? "true" : "false");
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
      std::printf("check:    max |O - ref| = %.3g (bound %.3g = 2 x naive-%s error %.3g + atol), max |LSE - ref| = %.3g: %s%s\n",
                  err_o, bound, dtype_name(dt), err_naive, err_lse, pass ? "PASS" : "FAIL",
                  scope == "full" ? "" : (" (" + scope + ")").c_str());
  }
  return pass ? 0 : 1;
}

// ---- bench ------------------------------------------------------------------------------
std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = std::min(s.find(',', at), s.size());
    if (comma > at) out.push_back(s.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

std::vector<int64_t> int_list(const Args& a, const std::string& key, const std::string& def, int64_t min_value) {
  std::vector<int64_t> out;
  const std::string what = "a comma-separated list of integers >= " + std::to_string(min_value);
  for (const std::string& x : split_list(a.str(key, def))) {
    const int64_t v = parse_int(x, key, what);
    if (v < min_value) throw Error(key, "ioattn: option '--" + key + "': expected " + what + ", got '" + x + "'");
    out.push_back(v);
  }
  if (out.empty()) throw Error(key, "ioattn: option '--" + key + "': expected at least one value, got none");
  return out;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out;
}

// A number for JSON: no inf or NaN there, so a non-finite value (NaN output) becomes null.
std::string jnum(double x, const char* fmt = "%.6g") {
  if (!std::isfinite(x)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, x);
  return buf;
}

// Progress on stderr: a bar redrawn in place on a terminal, one line per point in a log.
void progress(size_t done, size_t total, const std::string& what, bool tty) {
  if (tty) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * done / std::max<size_t>(total, 1));
    std::fprintf(stderr, "\r[%s%s] %zu/%zu %s\x1b[K", std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), done, total, what.c_str());
    if (done == total) std::fputc('\n', stderr);
  } else {
    std::fprintf(stderr, "[%zu/%zu] %s\n", done, total, what.c_str());
  }
  std::fflush(stderr);
}

// Extra memory a backend needs beyond its inputs and outputs, from how it is written:
//  CUDA naive: fp32 S plus P in the dtype, per head (src/cuda/naive.cu); CUDA flash: none.
//  CPU naive: the float64 reference materialises S (and copies of Q, K, V) per (batch, head), one
//  per thread in flight; CPU flash: one tile workspace per thread (src/cpu/flash_cpu.cpp).
double extra_bytes_model(const Shape& s, Backend be, const detail::FwdProblem& p, int threads) {
  const double sq = static_cast<double>(s.seqlen_q), sk = static_cast<double>(s.seqlen_k);
  const double d = static_cast<double>(s.head_dim), dv = static_cast<double>(s.head_dim_v);
  const double pairs = static_cast<double>(s.batch * s.heads_q), esz = static_cast<double>(dtype_size(s.dtype));
  const bool naive = be == Backend::naive;
  if (s.device == Device::cuda) return naive ? static_cast<double>(s.heads_q) * (4 + esz) * sq * sk : 0.0;
  if (naive) return std::min(pairs, static_cast<double>(threads)) * 8.0 * (sq * sk + sq * d + sk * (d + dv));
  const std::string tile = detail::cpu_flash_tile(p);  // "BRxBC"
  const double br = std::atof(tile.c_str()), bc = std::atof(tile.c_str() + tile.find('x') + 1);
  return static_cast<double>(threads) * 4.0 * (d * br + bc * br + bc * d + bc * dv + br * dv + 5 * br);
}

int cmd_bench(const Args& a) {
  check_known(a, {"device", "backend", "dtype", "seqlen", "hdim", "causal", "batch", "tokens", "heads", "hidden",
                  "threads", "repeats", "warmup", "no-check", "check-flops", "out", "seed", "quiet"});
  const std::string dev_s = a.str("device", "cpu");
  const Device dev = parse_device(dev_s);
  const bool cuda = dev == Device::cuda;
  if (cuda && build_info().cuda_devices == 0)
    throw Error("device", std::string("ioattn: option '--device': expected cpu here (") +
                              (build_info().cuda_compiled ? "no CUDA device visible" : "built without CUDA") +
                              "), got 'cuda'");
  std::vector<DType> dtypes;
  for (const std::string& x : split_list(a.str("dtype", "bf16"))) dtypes.push_back(parse_dtype(x, "dtype", true));
  std::vector<Backend> backends;
  for (const std::string& x : split_list(a.str("backend", "naive,flash"))) backends.push_back(parse_backend(x, "backend"));
  const auto seqlens = int_list(a, "seqlen", "1024,2048", 1);
  const auto hdims = int_list(a, "hdim", "64,128", 1);
  const auto causals = int_list(a, "causal", "0,1", 0);
  for (int64_t c : causals)
    if (c > 1) throw Error("causal", "ioattn: option '--causal': expected a list of 0 and 1, got " + std::to_string(c));
  if (dtypes.empty() || backends.empty())
    throw Error(dtypes.empty() ? "dtype" : "backend", "ioattn: option '--" + std::string(dtypes.empty() ? "dtype" : "backend") +
                                                          "': expected at least one value, got none");
  // Problem size: --batch/--heads as given, or FlashAttention's grid: --tokens = batch x seqlen
  // (batch = tokens / seqlen, at least 1) and --hidden = heads x head_dim.
  const int64_t tokens = a.integer("tokens", 0), hidden = a.integer("hidden", 0);
  if (a.has("tokens") && a.has("batch")) throw Error("batch", "ioattn: option '--batch': expected --batch or --tokens, got both");
  if (a.has("hidden") && a.has("heads")) throw Error("heads", "ioattn: option '--heads': expected --heads or --hidden, got both");
  const int64_t batch_opt = a.integer("batch", 1), heads_opt = a.integer("heads", 8);
  for (auto [name, v] : {std::pair{"batch", batch_opt}, {"heads", heads_opt}, {"tokens", tokens}, {"hidden", hidden}})
    if (v < (a.has(name) ? 1 : 0))
      throw Error(name, std::string("ioattn: option '--") + name + "': expected >= 1, got " + std::to_string(v));
  const int repeats = static_cast<int>(a.integer("repeats", cuda ? 10 : 3));
  const int warmup = static_cast<int>(a.integer("warmup", 1));
  if (repeats < 0 || warmup < 0)
    throw Error(repeats < 0 ? "repeats" : "warmup", "ioattn: option '--" + std::string(repeats < 0 ? "repeats" : "warmup") +
                                                        "': expected >= 0, got " + std::to_string(std::min(repeats, warmup)));
  const bool check = !a.has("no-check");
  const double check_flops = check_flops_option(a);
  Context ctx;
  ctx.num_threads = threads_option(a);
  const int threads = ctx.num_threads > 0 ? ctx.num_threads : build_info().cpu_threads;

  FILE* out = stdout;
  if (a.has("out")) {
    out = std::fopen(a.str("out", "").c_str(), "w");
    if (!out) throw Error("out", "ioattn: option '--out': expected a writable file, got '" + a.str("out", "") + "'");
  }
  const bool tty = !a.has("quiet") && isatty(fileno(stderr));
  const size_t total = dtypes.size() * hdims.size() * seqlens.size() * causals.size() * backends.size();
  size_t done = 0, failed = 0;
  std::mt19937_64 rng(static_cast<uint64_t>(a.integer("seed", 1234)));
  auto emit = [&](const std::string& record) {
    std::fprintf(out, "%s\n", record.c_str());
    std::fflush(out);  // a crash later keeps the points measured so far
  };

  for (DType dt : dtypes)
    for (int64_t d : hdims)
      for (int64_t s : seqlens) {
        Shape sh;
        sh.device = dev;
        sh.dtype = dt;
        sh.seqlen_q = sh.seqlen_k = s;
        sh.head_dim = sh.head_dim_v = d;
        sh.batch = tokens > 0 ? std::max<int64_t>(1, tokens / s) : batch_opt;
        sh.heads_q = sh.heads_kv = hidden > 0 ? std::max<int64_t>(1, hidden / d) : heads_opt;
        char shape_c[160];
        std::snprintf(shape_c, sizeof shape_c,
                      "\"device\": \"%s\", \"dtype\": \"%s\", \"batch\": %lld, \"heads\": %lld, \"heads_kv\": %lld, "
                      "\"seqlen\": %lld, \"hdim\": %lld",
                      dev_s.c_str(), dtype_name(dt), (long long)sh.batch, (long long)sh.heads_q, (long long)sh.heads_kv,
                      (long long)s, (long long)d);
        const std::string shape_json = shape_c;
        // The traffic model of `ioattn explain` for this shape (every (batch, head) a head).
        ExplainInput ein;
        ein.seqlen = s;
        ein.head_dim = d;
        ein.heads = sh.batch * sh.heads_q;
        ein.layers = 1;
        ein.dtype_bytes = dtype_size(dt);
        const ExplainReport model = explain(ein);
        const double naive_bytes = model.naive_bytes_per_layer;
        // (fp8: the model counts every tensor at the input's byte; O is written in bf16)
        const double flash_bytes = model.flash_bytes_per_head * static_cast<double>(ein.heads) +
                                   static_cast<double>((dtype_size(sh.out()) - dtype_size(dt)) * s * d * ein.heads);
        std::unique_ptr<Workload> w;
        std::string setup_error;
        try {
          w = std::make_unique<Workload>(sh, false, false, rng);
        } catch (const std::exception& e) {
          setup_error = e.what();
        }
        for (int64_t causal : causals)
          for (Backend be : backends) {
            std::string what = std::string(dtype_name(dt)) + " hdim " + std::to_string(d) + " seqlen " +
                               std::to_string(s) + (causal ? " causal " : " ") + backend_name(be);
            std::string rec = "{" + shape_json + ", \"causal\": " + (causal ? "true" : "false") +
                              ", \"backend\": \"" + backend_name(be) + "\"";
            try {
              if (!w) throw std::runtime_error(setup_error);
              w->prm.causal = causal != 0;
              ctx.backend = be;
              w->poison();
              const Timing tm = time_forward(*w, ctx, warmup, repeats, cuda);
              const double flops = 4.0 * static_cast<double>(sh.batch * sh.heads_q) * static_cast<double>(s) *
                                   static_cast<double>(s) * static_cast<double>(d) * (causal ? 0.5 : 1.0);
              const double bytes = be == Backend::naive ? naive_bytes : flash_bytes;
              const detail::Validated val = w->validated(ctx);
              const double extra_model = extra_bytes_model(sh, be, val.p, threads);
              rec += ", \"kernel\": \"" + json_escape(tm.choice.kernel) + "\"";
              rec += ", \"repeats\": " + std::to_string(tm.samples) + ", \"warmup\": " + std::to_string(warmup) +
                     ", \"inner\": " + std::to_string(tm.inner);
              rec += ", \"time_ms\": " + jnum(tm.median_s * 1e3) + ", \"time_ms_min\": " + jnum(tm.min_s * 1e3);
              rec += ", \"flops\": " + jnum(flops, "%.0f") + ", \"tflops\": " + jnum(flops / tm.median_s / 1e12);
              rec += ", \"model_bytes\": " + jnum(bytes, "%.0f") + ", \"bandwidth_tbps\": " + jnum(bytes / tm.median_s / 1e12);
              rec += ", \"model_naive_bytes\": " + jnum(naive_bytes, "%.0f") + ", \"model_flash_bytes\": " +
                     jnum(flash_bytes, "%.0f") + ", \"model_traffic_ratio\": " + jnum(model.traffic_ratio);
              rec += ", \"extra_bytes\": " + jnum(cuda ? tm.device_extra_bytes : extra_model, "%.0f") +
                     ", \"extra_bytes_source\": \"" + (cuda ? "measured" : "model") + "\"" +
                     ", \"extra_bytes_model\": " + jnum(extra_model, "%.0f");
              if (!cuda) rec += ", \"threads\": " + std::to_string(threads);
              bool pass = true;
              if (check) {
                const Check ck = check_workload(*w, ctx, check_flops);
                pass = ck.pass;
                rec += ", \"max_err_o\": " + jnum(ck.c.o.max_abs) + ", \"max_err_lse\": " + jnum(ck.c.lse.max_abs) +
                       ", \"naive_lowp_err\": " + jnum(ck.c.naive_o.max_abs) + ", \"err_bound\": " + jnum(ck.bound) +
                       ", \"pass\": " + (pass ? "true" : "false") + ", \"check\": \"" + check_scope(ck.c, sh) + "\"";
              } else {
                rec += ", \"check\": \"skipped\"";
              }
              if (!pass) ++failed;
              char tail[96];
              std::snprintf(tail, sizeof tail, ": %.3f ms, %.2f TFLOP/s%s", tm.median_s * 1e3, flops / tm.median_s / 1e12,
                            pass ? "" : ", CHECK FAILED");
              what += tail;
            } catch (const std::exception& e) {
              ++failed;
              rec += ", \"error\": \"" + json_escape(e.what()) + "\"";
              what += std::string(": error: ") + e.what();
            }
            emit(rec + "}");
            ++done;
            if (!a.has("quiet")) progress(done, total, what, tty);
          }
      }
  if (out != stdout) std::fclose(out);
  if (failed) std::fprintf(stderr, "ioattn bench: %zu of %zu points failed (error or check)\n", failed, total);
  return failed ? 1 : 0;
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
    if (a.command == "bench") return cmd_bench(a);
    std::fprintf(stderr, "ioattn: unknown command '%s'\n\n", a.command.c_str());
    usage();
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}

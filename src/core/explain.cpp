// The seed arithmetic: bytes moved by naive vs tiled attention, and the online softmax.
#include "ioattn/explain.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "ioattn/ioattn.hpp"

namespace ioattn {

ExplainReport explain(const ExplainInput& in) {
  if (in.seqlen < 1) throw Error("seqlen", "ioattn: argument 'seqlen': expected >= 1, got " + std::to_string(in.seqlen));
  if (in.head_dim < 1) throw Error("head_dim", "ioattn: argument 'head_dim': expected >= 1, got " + std::to_string(in.head_dim));
  if (in.dtype_bytes < 1) throw Error("dtype_bytes", "ioattn: argument 'dtype_bytes': expected >= 1, got " + std::to_string(in.dtype_bytes));
  for (auto [name, v] : {std::pair{"heads", in.heads}, {"layers", in.layers}, {"naive_passes", in.naive_passes}})
    if (v < 1) throw Error(name, std::string("ioattn: argument '") + name + "': expected >= 1, got " + std::to_string(v));
  // (named as ExplainInput's fields; `ioattn explain` checks its own --bandwidth / --flops / --speedup first)
  if (!(in.bandwidth_Bps > 0) || std::isinf(in.bandwidth_Bps))
    throw Error("bandwidth_Bps", "ioattn: argument 'bandwidth_Bps': expected finite bytes/s > 0, got " + std::to_string(in.bandwidth_Bps));
  if (!(in.flops_per_s > 0) || std::isinf(in.flops_per_s))
    throw Error("flops_per_s", "ioattn: argument 'flops_per_s': expected finite FLOP/s > 0, got " + std::to_string(in.flops_per_s));
  if (!(in.attention_share >= 0 && in.attention_share <= 1))
    throw Error("attention_share", "ioattn: argument 'attention_share': expected in [0, 1], got " + std::to_string(in.attention_share));
  if (!(in.kernel_speedup > 0) || std::isinf(in.kernel_speedup))
    throw Error("kernel_speedup", "ioattn: argument 'kernel_speedup': expected finite > 0, got " + std::to_string(in.kernel_speedup));
  const double n = static_cast<double>(in.seqlen), d = static_cast<double>(in.head_dim);
  const double bytes = static_cast<double>(in.dtype_bytes);
  ExplainReport r{};
  r.score_bytes_per_head = n * n * bytes;
  r.naive_bytes_per_head = static_cast<double>(in.naive_passes) * r.score_bytes_per_head;
  r.naive_bytes_per_layer = r.naive_bytes_per_head * static_cast<double>(in.heads);
  r.naive_bytes_per_model = r.naive_bytes_per_layer * static_cast<double>(in.layers);
  r.flash_bytes_per_head = 4.0 * n * d * bytes;
  r.traffic_ratio = r.naive_bytes_per_head / r.flash_bytes_per_head;
  r.flops_per_head = 4.0 * n * n * d;
  r.flops_per_model = r.flops_per_head * static_cast<double>(in.heads * in.layers);
  r.naive_traffic_seconds = r.naive_bytes_per_model / in.bandwidth_Bps;
  r.flash_traffic_seconds = r.flash_bytes_per_head * static_cast<double>(in.heads * in.layers) / in.bandwidth_Bps;
  r.math_seconds = r.flops_per_model / in.flops_per_s;
  r.end_to_end_speedup = in.attention_share > 0
                             ? 1.0 / ((1.0 - in.attention_share) + in.attention_share / in.kernel_speedup)
                             : 1.0;
  // Amdahl's bound: what removing attention altogether would buy (infinite at share 1).
  r.end_to_end_limit = in.attention_share < 1 ? 1.0 / (1.0 - in.attention_share)
                                              : std::numeric_limits<double>::infinity();
  return r;
}

OnlineSoftmaxExample online_softmax_example(const std::vector<double>& scores,
                                            const std::vector<double>& values, int block_size) {
  if (scores.empty()) throw Error("scores", "ioattn: argument 'scores': expected at least one score, got none");
  if (scores.size() != values.size())
    throw Error("values", "ioattn: argument 'values': expected " + std::to_string(scores.size()) +
                              " values (one per score), got " + std::to_string(values.size()));
  if (block_size < 1) throw Error("block_size", "ioattn: argument 'block_size': expected >= 1, got " + std::to_string(block_size));
  // -inf is a masked key (weight 0), as in the kernels; NaN and +inf would poison the row there,
  // which a worked example has nothing to show about.
  for (size_t j = 0; j < scores.size(); ++j)
    if (std::isnan(scores[j]) || scores[j] == std::numeric_limits<double>::infinity())
      throw Error("scores[" + std::to_string(j) + "]",
                  "ioattn: argument 'scores[" + std::to_string(j) +
                      "]': expected a finite score or -inf (a masked key), got " + std::to_string(scores[j]));
  const double ninf = -std::numeric_limits<double>::infinity();
  auto weight = [&](double s, double m_ref) { return s == ninf ? 0.0 : std::exp(s - m_ref); };
  OnlineSoftmaxExample ex;
  double m = ninf, l = 0.0, acc = 0.0;
  for (size_t start = 0; start < scores.size(); start += static_cast<size_t>(block_size)) {
    const size_t end = std::min(scores.size(), start + static_cast<size_t>(block_size));
    OnlineSoftmaxStep st;
    st.block_scores.assign(scores.begin() + static_cast<long>(start), scores.begin() + static_cast<long>(end));
    st.max_before = m;
    const double m_new = std::max(m, *std::max_element(st.block_scores.begin(), st.block_scores.end()));
    st.rescale = std::isinf(m) ? 0.0 : std::exp(m - m_new);
    l *= st.rescale;
    acc *= st.rescale;
    for (size_t j = start; j < end; ++j) {
      const double e = weight(scores[j], m_new);
      l += e;
      acc += e * values[j];
    }
    m = m_new;
    st.max_after = m;
    st.sum_after = l;
    st.acc_after = acc;
    ex.steps.push_back(st);
  }
  ex.output = l > 0 ? acc / l : 0.0;  // no visible key: 0, as the kernels write
  // Two-pass softmax for comparison.
  const double mx = *std::max_element(scores.begin(), scores.end());
  double z = 0.0;
  for (double s : scores) z += weight(s, mx);
  ex.output_direct = 0.0;
  for (size_t j = 0; j < scores.size(); ++j) {
    ex.probabilities.push_back(z > 0 ? weight(scores[j], mx) / z : 0.0);
    ex.output_direct += ex.probabilities.back() * values[j];
  }
  return ex;
}

namespace {
std::string grouped(double v) {  // 134217728 -> "134,217,728"
  std::string s = std::to_string(static_cast<long long>(std::llround(v)));
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return s;
}

std::string human_bytes(double b) {
  char buf[64];
  if (b >= 1e12) std::snprintf(buf, sizeof buf, "%.2f TB", b / 1e12);
  else if (b >= 1e9) std::snprintf(buf, sizeof buf, "%.1f GB", b / 1e9);
  else if (b >= 1e6) std::snprintf(buf, sizeof buf, "%.1f MB", b / 1e6);
  else std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}
}  // namespace

std::string explain_text(const ExplainInput& in) {
  const ExplainReport r = explain(in);
  std::ostringstream os;
  char line[512];
  auto put = [&](const char* fmt, auto... args) {
    std::snprintf(line, sizeof line, fmt, args...);
    os << line << "\n";
  };
  put("Attention memory traffic: n=%lld tokens, head_dim=%lld, %lld heads, %lld layers, %lld-byte elements",
      (long long)in.seqlen, (long long)in.head_dim, (long long)in.heads, (long long)in.layers, (long long)in.dtype_bytes);
  put("");
  put("Score matrix S = QK^T, per head:     n^2 x %lld B = %s B (%s)", (long long)in.dtype_bytes,
      grouped(r.score_bytes_per_head).c_str(), human_bytes(r.score_bytes_per_head).c_str());
  put("Naive attention, %lld passes over it (write S, read S, write P, read P):", (long long)in.naive_passes);
  put("  per head   %s", human_bytes(r.naive_bytes_per_head).c_str());
  put("  per layer  %s (%lld heads)", human_bytes(r.naive_bytes_per_layer).c_str(), (long long)in.heads);
  put("  per prompt %s (%lld layers)", human_bytes(r.naive_bytes_per_model).c_str(), (long long)in.layers);
  put("Flash attention reads Q, K, V and writes O once: 4 x n x d x %lld B = %s per head, %.0fx less",
      (long long)in.dtype_bytes, human_bytes(r.flash_bytes_per_head).c_str(), r.traffic_ratio);
  put("  (the ratio is passes x n / (4 d) = ~n/d: the longer the sequence, the bigger the win)");
  put("");
  put("Arithmetic: 4 n^2 d = %.1f GFLOP per head, %.0f TFLOP per prompt", r.flops_per_head / 1e9, r.flops_per_model / 1e12);
  put("At %.1f TB/s and %.0f TFLOP/s:", in.bandwidth_Bps / 1e12, in.flops_per_s / 1e12);
  put("  naive traffic %.2f s  vs  maths %.2f s  -> naive attention is memory-bound", r.naive_traffic_seconds, r.math_seconds);
  put("  flash traffic %.3f s  vs  maths %.2f s  -> flash attention is compute-bound", r.flash_traffic_seconds, r.math_seconds);
  if (in.attention_share > 0) {
    put("");
    put("End to end: attention is %.0f%% of a step; a %.2fx faster kernel gives 1 / ((1 - %.2f) + %.2f / %.2f) = %.2fx",
        in.attention_share * 100, in.kernel_speedup, in.attention_share, in.attention_share, in.kernel_speedup,
        r.end_to_end_speedup);
    if (in.attention_share < 1)
      put("  (Amdahl's ceiling: even an infinitely fast attention kernel gives 1 / (1 - %.2f) = %.2fx)",
          in.attention_share, r.end_to_end_limit);
  }
  put("");
  put("Online softmax, worked example: one query, scores [2, 1 | 3, 0] in two key blocks, values [1, 2, 3, 4]");
  const OnlineSoftmaxExample ex = online_softmax_example({2, 1, 3, 0}, {1, 2, 3, 4}, 2);
  int b = 1;
  for (const auto& st : ex.steps) {
    std::string sc;
    for (double s : st.block_scores) sc += (sc.empty() ? "" : ", ") + std::to_string(static_cast<int>(s));
    if (std::isinf(st.max_before))
      put("  block %d: scores [%s]  running max -inf -> %g (first block: nothing to rescale)  l = %.3f  acc = %.3f",
          b++, sc.c_str(), st.max_after, st.sum_after, st.acc_after);
    else
      put("  block %d: scores [%s]  running max %g -> %g  rescale l and acc by exp(%g - %g) = %.3f  l = %.3f  acc = %.3f",
          b++, sc.c_str(), st.max_before, st.max_after, st.max_before, st.max_after, st.rescale, st.sum_after,
          st.acc_after);
  }
  std::string pr;
  for (double p : ex.probabilities) {
    char v[32];
    std::snprintf(v, sizeof v, "%.3f", p);
    pr += (pr.empty() ? "" : ", ") + std::string(v);
  }
  put("  probabilities [%s]", pr.c_str());
  put("  output acc / l = %.3f (two-pass softmax gives %.3f: the same, without storing the row)", ex.output, ex.output_direct);
  return os.str();
}

}  // namespace ioattn

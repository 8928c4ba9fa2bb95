// Standard attention, materialised: see reference.hpp.
#include "cpu/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <new>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "cpu/serving_quant.h"

namespace ioattn::detail {
namespace {

struct SeqRange {
  int64_t q_start, q_len, k_start, k_len;
};

SeqRange seq_range(const FwdProblem& p, int64_t b) {
  if (!p.varlen()) return {0, p.seqlen_q, 0, p.seqlen_k};
  return {p.cu_seqlens_q_host[b], p.cu_seqlens_q_host[b + 1] - p.cu_seqlens_q_host[b],
          p.cu_seqlens_k_host[b], p.cu_seqlens_k_host[b + 1] - p.cu_seqlens_k_host[b]};
}

// q . k as an fp8 GEMM on Hopper tensor cores computes it, modelled: exact fp32 sums over each
// 32-element k-step (wgmma k32), added into an accumulator truncated to 14 significant bits (round_fp8_accumulator)
// (DeepSeek-V3 report, sec. 3.3.2, measured that for Hopper's fp8 wgmma; a model, not the exact
// rounding). Part of "naive attention in the same low precision" for f8e4m3 problems.
float fp8_tensor_core_dot(const double* q, const double* k, int64_t d) {
  float acc = 0.0f;
  for (int64_t x0 = 0; x0 < d; x0 += 32) {
    float part = 0.0f;
    for (int64_t x = x0; x < std::min<int64_t>(d, x0 + 32); ++x) part += static_cast<float>(q[x]) * static_cast<float>(k[x]);
    acc = round_fp8_accumulator(acc + part);
  }
  return acc;
}

}  // namespace

RefResult reference_forward(const FwdProblem& p, RefPrecision prec, int64_t total_q_rows) {
  const bool emu = prec == RefPrecision::emulated;
  const bool fp8 = p.fp8();
  const DType t = p.dtype;
  // Rounds an intermediate tensor to the input precision when emulating. FP8: S stays fp32 (as
  // in the kernels: fp32 accumulation of exact e4m3 products), P is rounded to e4m3 (below), O to
  // the output dtype.
  auto rnd = [&](double x) -> double {
    if (!emu) return x;
    return fp8 ? static_cast<float>(x) : round_to(t, static_cast<float>(x));
  };
  // Element x of a q/k/v buffer as a value: fp8 codes dequantised with their (b, kv head) descale.
  auto load = [&](const void* base, int64_t off, const Descale& ds, int64_t b, int64_t hk) -> float {
    if (!fp8) return load_float(base, t, off);
    return e4m3_to_float(static_cast<const uint8_t*>(base)[off]) * ds.at(b, hk);
  };

  RefResult r;
  r.rows = p.varlen() ? (total_q_rows >= 0 ? total_q_rows : p.cu_seqlens_q_host[p.batch])
                      : p.batch * p.seqlen_q;
  const int64_t hq = p.heads_q, d = p.head_dim, dv = p.head_dim_v;
  r.o.assign(static_cast<size_t>(r.rows * hq * dv), 0.0);
  r.lse.assign(static_cast<size_t>(r.rows * hq), -std::numeric_limits<double>::infinity());
  const double ninf = -std::numeric_limits<double>::infinity();

  LoopError errors;
#pragma omp parallel for schedule(dynamic) collapse(2)
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < hq; ++h) errors.run([&] {
      const SeqRange sr = seq_range(p, b);
      const int64_t sq = sr.q_len, sk = sr.k_len, hk = h / p.group();
      if (sq == 0) return;
      // Gather this head's Q, K (and later V) as contiguous double rows, so the inner loops are
      // plain dot products (emulated mode keeps q * scale rounded to the input dtype).
      std::vector<double> Q(static_cast<size_t>(sq * d)), K(static_cast<size_t>(sk * d));
      for (int64_t i = 0; i < sq; ++i) {
        const int64_t off = b * p.q_stride.batch + (sr.q_start + i) * p.q_stride.seq + h * p.q_stride.head;
        for (int64_t x = 0; x < d; ++x) {
          const float qv = load(p.q, off + x, p.q_descale, b, hk);
          Q[i * d + x] = emu ? (fp8 ? qv : round_to(t, qv * p.scale)) : qv;
        }
      }
      for (int64_t j = 0; j < sk; ++j) {
        const int64_t off = b * p.k_stride.batch + (sr.k_start + j) * p.k_stride.seq + hk * p.k_stride.head;
        for (int64_t x = 0; x < d; ++x) K[j * d + x] = load(p.k, off + x, p.k_descale, b, hk);
      }
      // S and P, materialised: [sq, sk].
      std::vector<double> S(static_cast<size_t>(sq * sk));
      const double slope = p.alibi_slopes ? p.alibi_slopes[h] : 0.0;
      for (int64_t i = 0; i < sq; ++i) {
        int64_t lo, hi;
        visible_keys(i, sq, sk, p.window_left, p.window_right, &lo, &hi);
        const double* qi = &Q[i * d];
        for (int64_t j = 0; j < sk; ++j) {
          if (j < lo || j >= hi) {
            S[i * sk + j] = ninf;
            continue;
          }
          const double* kj = &K[j * d];
          double acc;
          if (emu && fp8) {
            acc = static_cast<double>(fp8_tensor_core_dot(qi, kj, d) * p.scale);
          } else if (emu) {
            float facc = 0.0f;  // fp32 accumulate, result rounded to the input dtype
            for (int64_t x = 0; x < d; ++x) facc += static_cast<float>(qi[x]) * static_cast<float>(kj[x]);
            acc = rnd(facc);
          } else {
            double a4[4] = {0, 0, 0, 0};
            int64_t x = 0;
            for (; x + 4 <= d; x += 4)
              for (int u = 0; u < 4; ++u) a4[u] += qi[x + u] * kj[x + u];
            for (; x < d; ++x) a4[0] += qi[x] * kj[x];
            acc = ((a4[0] + a4[1]) + (a4[2] + a4[3])) * p.scale;
          }
          if (p.softcap > 0) acc = rnd(p.softcap * std::tanh(acc / p.softcap));
          if (p.alibi_slopes)
            acc = rnd(acc - slope * std::fabs(static_cast<double>(i + (sk - sq) - j)));
          S[i * sk + j] = acc;
        }
      }
      std::vector<double> V(static_cast<size_t>(sk * dv));
      for (int64_t j = 0; j < sk; ++j) {
        const int64_t off = b * p.v_stride.batch + (sr.k_start + j) * p.v_stride.seq + hk * p.v_stride.head;
        for (int64_t x = 0; x < dv; ++x) V[j * dv + x] = load(p.v, off + x, p.v_descale, b, hk);
      }
      // Row softmax (with the optional sink in the denominator), then O = P V.
      const double sink = p.sinks ? p.sinks[h] : ninf;
      const int64_t orow0 = p.varlen() ? sr.q_start : b * sq;
      for (int64_t i = 0; i < sq; ++i) {
        double m = sink;
        for (int64_t j = 0; j < sk; ++j) m = std::max(m, S[i * sk + j]);
        const int64_t lse_idx = p.varlen() ? h * r.rows + sr.q_start + i : (b * hq + h) * sq + i;
        if (m == ninf) continue;  // no visible key and no sink: O = 0, LSE = -inf
        double l = p.sinks ? std::exp(sink - m) : 0.0;
        for (int64_t j = 0; j < sk; ++j) {
          const double e = S[i * sk + j] == ninf ? 0.0 : std::exp(S[i * sk + j] - m);
          S[i * sk + j] = e;  // S now holds unnormalised P
          l += e;
        }
        r.lse[lse_idx] = m + std::log(l);
        double* orow = &r.o[((orow0 + i) * hq + h) * dv];
        for (int64_t j = 0; j < sk; ++j) {
          // FP8 emulation: the unnormalised P (max 1) in e4m3, as the P V GEMM of an fp8 kernel
          // takes it; the normalisation by l (a sum of the unrounded values) comes after.
          const double pij = emu && fp8 ? e4m3_to_float(float_to_e4m3(static_cast<float>(S[i * sk + j]))) / l
                                        : rnd(S[i * sk + j] / l);
          if (pij == 0.0) continue;
          const double* vj = &V[j * dv];
          for (int64_t x = 0; x < dv; ++x) orow[x] += pij * vj[x];
        }
        if (emu)
          for (int64_t x = 0; x < dv; ++x) orow[x] = round_to(p.out_dtype(), static_cast<float>(orow[x]));
      }
    });
  }
  errors.rethrow();
  return r;
}

void throw_naive_out_of_memory(const FwdProblem& p, const char* what, int matrices) {
  int64_t sq = p.seqlen_q, sk = p.seqlen_k;
  if (p.varlen())
    for (int64_t b = 0; b < p.batch; ++b) {
      sq = std::max<int64_t>(sq, p.cu_seqlens_q_host[b + 1] - p.cu_seqlens_q_host[b]);
      sk = std::max<int64_t>(sk, p.cu_seqlens_k_host[b + 1] - p.cu_seqlens_k_host[b]);
    }
  char gb[32];
  std::snprintf(gb, sizeof gb, "%.3g", static_cast<double>(matrices) * static_cast<double>(sq) *
                                           static_cast<double>(sk) * 8.0 / 1e9);
  throw Error("q", std::string("ioattn: out of memory in the naive ") + what + ": it materialises " +
                       std::to_string(matrices) + " [seqlen_q, seqlen_k] = [" + std::to_string(sq) + ", " +
                       std::to_string(sk) + "] float64 matri" + (matrices == 1 ? "x" : "ces") + " per (batch, head) and thread (" +
                       gb + " GB); use backend flash (O(seqlen) extra memory)");
}

void cpu_naive_forward(const FwdProblem& p) {
  const int64_t total = p.varlen() ? p.cu_seqlens_q_host[p.batch] : -1;
  RefResult r;
  try {
    r = reference_forward(p, RefPrecision::f64, total);
  } catch (const std::bad_alloc&) {
    throw_naive_out_of_memory(p, "forward", 1);
  }
  const int64_t dv = p.head_dim_v;
  for_each_output_row(p, r, [&](int64_t ooff, int64_t ro, int64_t loff, int64_t rl) {
    for (int64_t x = 0; x < dv; ++x) store_float(p.o, p.out_dtype(), ooff + x, static_cast<float>(r.o[ro + x]));
    if (p.lse) p.lse[loff] = static_cast<float>(r.lse[rl]);
  });
}

}  // namespace ioattn::detail

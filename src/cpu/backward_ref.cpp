// Standard attention backward, materialised: see backward_ref.hpp.
#include "cpu/backward_ref.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>

#include "core/backends.hpp"
#include "core/half.hpp"

namespace ioattn::detail {
namespace {

struct SeqRange {
  int64_t q_start, q_len, k_start, k_len;
};

SeqRange seq_range(const FwdProblem& p, int64_t b) {
  if (!p.varlen()) return {0, p.seqlen_q, 0, p.seqlen_k};
  return {p.cu_seqlens_q_host[b], p.cu_seqlens_q_host[b + 1] - p.cu_seqlens_q_host[b], p.cu_seqlens_k_host[b],
          p.cu_seqlens_k_host[b + 1] - p.cu_seqlens_k_host[b]};
}

// Loads `n` elements of one strided row as double.
void load_row(const void* base, DType t, int64_t off, int64_t n, double* dst) {
  for (int64_t x = 0; x < n; ++x) dst[x] = load_float(base, t, off + x);
}

}  // namespace

RefGrads reference_backward(const BwdProblem& bp, RefPrecision prec, int64_t total_q_rows, int64_t total_k_rows) {
  const FwdProblem& p = bp.f;
  const bool emu = prec == RefPrecision::emulated;
  const DType t = p.dtype;
  // Rounds an intermediate tensor to the input precision when emulating (identity in f64 mode).
  auto rnd = [&](double x) -> double { return emu ? round_to(t, static_cast<float>(x)) : x; };
  // Emulated arithmetic is fp32 (what a framework's kernels accumulate in); f64 stays double.
  auto fp = [&](double x) -> double { return emu ? static_cast<double>(static_cast<float>(x)) : x; };

  RefGrads r;
  r.rows_q = p.varlen() ? (total_q_rows >= 0 ? total_q_rows : p.cu_seqlens_q_host[p.batch]) : p.batch * p.seqlen_q;
  r.rows_k = p.varlen() ? (total_k_rows >= 0 ? total_k_rows : p.cu_seqlens_k_host[p.batch]) : p.batch * p.seqlen_k;
  const int64_t hq = p.heads_q, hkv = p.heads_kv, d = p.head_dim, dv = p.head_dim_v, g = p.group();
  r.dq.assign(static_cast<size_t>(r.rows_q * hq * d), 0.0);
  r.dk.assign(static_cast<size_t>(r.rows_k * hkv * d), 0.0);
  r.dv.assign(static_cast<size_t>(r.rows_k * hkv * dv), 0.0);
  const bool want_dsinks = p.sinks != nullptr;
  std::vector<double> dsink_part(static_cast<size_t>(want_dsinks ? p.batch * hq : 0), 0.0);
  const double ninf = -std::numeric_limits<double>::infinity();
  const double scale = p.scale, cap = p.softcap;

  // One task per (batch, kv head): the query heads of the group run in order inside it, so the
  // GQA sums of dK and dV need no synchronisation and have a fixed order.
  LoopError errors;
#pragma omp parallel for schedule(dynamic) collapse(2)
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t hk = 0; hk < hkv; ++hk) errors.run([&] {
      const SeqRange sr = seq_range(p, b);
      const int64_t sq = sr.q_len, sk = sr.k_len;
      const int64_t qrow0 = p.varlen() ? sr.q_start : b * p.seqlen_q;
      const int64_t krow0 = p.varlen() ? sr.k_start : b * p.seqlen_k;
      std::vector<double> K(static_cast<size_t>(sk * d)), V(static_cast<size_t>(sk * dv));
      for (int64_t j = 0; j < sk; ++j) {
        load_row(p.k, t, b * p.k_stride.batch + (sr.k_start + j) * p.k_stride.seq + hk * p.k_stride.head, d, &K[j * d]);
        load_row(p.v, t, b * p.v_stride.batch + (sr.k_start + j) * p.v_stride.seq + hk * p.v_stride.head, dv,
                 &V[j * dv]);
      }
      std::vector<double> dKsum(static_cast<size_t>(sk * d), 0.0), dVsum(static_cast<size_t>(sk * dv), 0.0);
      std::vector<double> Q(static_cast<size_t>(sq * d)), dO(static_cast<size_t>(sq * dv)), O(static_cast<size_t>(sq * dv));
      std::vector<double> lse(static_cast<size_t>(sq)), D(static_cast<size_t>(sq));
      // [sq, sk]: S then P; dP then dS; tanh(S / c) for softcap.
      std::vector<double> P(static_cast<size_t>(sq * sk)), dS(static_cast<size_t>(sq * sk));
      std::vector<double> T(cap > 0 ? static_cast<size_t>(sq * sk) : 0);
      std::vector<double> dKh(static_cast<size_t>(sk * d)), dVh(static_cast<size_t>(sk * dv));

      for (int64_t h = hk * g; h < (hk + 1) * g; ++h) {
        for (int64_t i = 0; i < sq; ++i) {
          const int64_t row = sr.q_start + i;
          load_row(p.q, t, b * p.q_stride.batch + row * p.q_stride.seq + h * p.q_stride.head, d, &Q[i * d]);
          // Emulated: the framework multiplies q by the scale in the input dtype (as the forward).
          if (emu)
            for (int64_t x = 0; x < d; ++x) Q[i * d + x] = rnd(static_cast<float>(Q[i * d + x]) * p.scale);
          load_row(bp.dout, t, b * bp.dout_stride.batch + row * bp.dout_stride.seq + h * bp.dout_stride.head, dv,
                   &dO[i * dv]);
          load_row(p.o, t, b * p.o_stride.batch + row * p.o_stride.seq + h * p.o_stride.head, dv, &O[i * dv]);
          lse[i] = p.lse[b * p.lse_stride.batch + h * p.lse_stride.head + row * p.lse_stride.seq];
          double acc = 0.0;
          for (int64_t x = 0; x < dv; ++x) acc = fp(acc + dO[i * dv + x] * O[i * dv + x]);
          D[i] = acc;
        }

        // S -> P, with dP and dS, row by row.
        const double slope = p.alibi_slopes ? p.alibi_slopes[h] : 0.0;
        for (int64_t i = 0; i < sq; ++i) {
          int64_t lo, hi;
          visible_keys(i, sq, sk, p.window_left, p.window_right, &lo, &hi);
          const double* qi = &Q[i * d];
          const double* doi = &dO[i * dv];
          for (int64_t j = 0; j < sk; ++j) {
            const int64_t ij = i * sk + j;
            if (j < lo || j >= hi || lse[i] == ninf) {  // masked key or a row with nothing to attend
              P[ij] = 0.0;
              dS[ij] = 0.0;
              continue;
            }
            const double* kj = &K[j * d];
            double s = 0.0;
            for (int64_t x = 0; x < d; ++x) s = fp(s + qi[x] * kj[x]);
            s = emu ? rnd(s) : s * scale;
            if (cap > 0) {
              const double th = std::tanh(s / cap);
              T[ij] = rnd(th);
              s = rnd(cap * th);
            }
            if (p.alibi_slopes) s = rnd(s - slope * std::fabs(static_cast<double>(i + (sk - sq) - j)));
            const double pij = rnd(std::exp(s - lse[i]));
            double dp = 0.0;
            for (int64_t x = 0; x < dv; ++x) dp = fp(dp + doi[x] * V[j * dv + x]);
            dp = rnd(dp);
            double ds = rnd(fp(pij * fp(dp - D[i])));
            if (cap > 0) ds = rnd(fp(ds * fp(1.0 - fp(T[ij] * T[ij]))));
            P[ij] = pij;
            dS[ij] = ds;
          }
        }

        // dQ = scale * dS K (emulated: (dS K) in the dtype, then times the scale), this head's
        // dK = scale * dS^T Q (emulated: Q already holds q * scale) and dV = P^T dO. Loops run
        // row by row (axpy form) for locality; every sum still adds its terms in index order.
        std::fill(dKh.begin(), dKh.end(), 0.0);
        std::fill(dVh.begin(), dVh.end(), 0.0);
        std::vector<double> dqi(static_cast<size_t>(d));
        for (int64_t i = 0; i < sq; ++i) {
          std::fill(dqi.begin(), dqi.end(), 0.0);
          for (int64_t j = 0; j < sk; ++j) {
            const double ds = dS[i * sk + j], pij = P[i * sk + j];
            if (ds != 0.0) {
              for (int64_t x = 0; x < d; ++x) dqi[x] = fp(dqi[x] + ds * K[j * d + x]);
              for (int64_t x = 0; x < d; ++x) dKh[j * d + x] = fp(dKh[j * d + x] + ds * Q[i * d + x]);
            }
            if (pij != 0.0)
              for (int64_t x = 0; x < dv; ++x) dVh[j * dv + x] = fp(dVh[j * dv + x] + pij * dO[i * dv + x]);
          }
          double* out = &r.dq[((qrow0 + i) * hq + h) * d];
          for (int64_t x = 0; x < d; ++x) out[x] = emu ? rnd(rnd(dqi[x]) * p.scale) : dqi[x] * scale;
        }
        for (int64_t e = 0; e < sk * d; ++e) dKh[e] = emu ? rnd(dKh[e]) : dKh[e] * scale;
        for (int64_t e = 0; e < sk * dv; ++e) dVh[e] = rnd(dVh[e]);
        for (size_t e = 0; e < dKsum.size(); ++e) dKsum[e] = fp(dKsum[e] + dKh[e]);
        for (size_t e = 0; e < dVsum.size(); ++e) dVsum[e] = fp(dVsum[e] + dVh[e]);

        // The sink is one more softmax column with a zero value: its dP is 0, so
        // dS_sink = P_sink * (0 - D) and the sink's gradient is the sum of those.
        if (want_dsinks) {
          double acc = 0.0;
          for (int64_t i = 0; i < sq; ++i) {
            if (lse[i] == ninf) continue;
            const double ps = rnd(std::exp(static_cast<double>(p.sinks[h]) - lse[i]));
            acc = fp(acc + rnd(fp(-ps * D[i])));
          }
          dsink_part[b * hq + h] = acc;
        }
      }
      for (int64_t j = 0; j < sk; ++j) {
        for (int64_t x = 0; x < d; ++x) r.dk[((krow0 + j) * hkv + hk) * d + x] = rnd(dKsum[j * d + x]);
        for (int64_t x = 0; x < dv; ++x) r.dv[((krow0 + j) * hkv + hk) * dv + x] = rnd(dVsum[j * dv + x]);
      }
    });
  }
  errors.rethrow();
  if (want_dsinks) {
    r.dsinks.assign(static_cast<size_t>(hq), 0.0);
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t b = 0; b < p.batch; ++b) r.dsinks[h] = fp(r.dsinks[h] + dsink_part[b * hq + h]);
    if (emu)  // dsinks is fp32 whatever the input dtype
      for (double& x : r.dsinks) x = static_cast<float>(x);
  }
  return r;
}

// The `naive` backward: the float64 reference, stored into the caller's strided outputs.
void cpu_naive_backward(const BwdProblem& bp) {
  const FwdProblem& p = bp.f;
  RefGrads r;
  try {
    r = reference_backward(bp, RefPrecision::f64);
  } catch (const std::bad_alloc&) {
    throw_naive_out_of_memory(p, "backward", 2);
  }
  const int64_t hq = p.heads_q, hkv = p.heads_kv, d = p.head_dim, dv = p.head_dim_v;
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqRange sr = seq_range(p, b);
    const int64_t qrow0 = p.varlen() ? sr.q_start : b * p.seqlen_q;
    const int64_t krow0 = p.varlen() ? sr.k_start : b * p.seqlen_k;
    for (int64_t i = 0; i < sr.q_len; ++i)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t off = b * bp.dq_stride.batch + (sr.q_start + i) * bp.dq_stride.seq + h * bp.dq_stride.head;
        for (int64_t x = 0; x < d; ++x)
          store_float(bp.dq, p.dtype, off + x, static_cast<float>(r.dq[((qrow0 + i) * hq + h) * d + x]));
      }
    for (int64_t j = 0; j < sr.k_len; ++j)
      for (int64_t h = 0; h < hkv; ++h) {
        const int64_t ko = b * bp.dk_stride.batch + (sr.k_start + j) * bp.dk_stride.seq + h * bp.dk_stride.head;
        const int64_t vo = b * bp.dv_stride.batch + (sr.k_start + j) * bp.dv_stride.seq + h * bp.dv_stride.head;
        for (int64_t x = 0; x < d; ++x)
          store_float(bp.dk, p.dtype, ko + x, static_cast<float>(r.dk[((krow0 + j) * hkv + h) * d + x]));
        for (int64_t x = 0; x < dv; ++x)
          store_float(bp.dv, p.dtype, vo + x, static_cast<float>(r.dv[((krow0 + j) * hkv + h) * dv + x]));
      }
  }
  if (bp.dsinks)
    for (int64_t h = 0; h < hq; ++h) bp.dsinks[h] = static_cast<float>(r.dsinks[h]);
}

}  // namespace ioattn::detail

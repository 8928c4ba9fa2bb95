// The materialising attention backward on the CPU: the float64 gradient oracle, the
// low-precision error baseline of the tolerance rule, and the core of the `naive` backward.
//
// For each (batch, kv head) and each query head of its group it recomputes, from the forward's
// inputs only (q, k, v, the given o and the given fp32 lse), the full seqlen_q x seqlen_k
// matrices
//   S  = scale * Q K^T  [softcap: c * tanh(S / c)]  [ALiBi: - slope * |i + off - j|]  [mask]
//   P  = exp(S - LSE)            (0 where masked or LSE = -inf)
//   dP = dO V^T,  D = rowsum(dO * O),  dS = P * (dP - D)  [softcap: * (1 - tanh^2)]
// and then dQ = scale * dS K, dK = scale * dS^T Q, dV = P^T dO (dK, dV summed over the query
// heads of a GQA group), dsinks_h = -sum_{b,i} exp(sink_h - LSE_i) * D_i.
// Extra memory: four seqlen_q x seqlen_k matrices per thread — this is the "standard" backward.
#pragma once

#include <cstdint>
#include <vector>

#include "core/problem.hpp"
#include "cpu/reference.hpp"

namespace ioattn::detail {

// Gradients in contiguous order: dq [rows_q, heads_q, head_dim], dk [rows_k, heads_kv, head_dim],
// dv [rows_k, heads_kv, head_dim_v], dsinks [heads_q] (empty without sinks). Rows are
// batch * seqlen for fixed length and the packed token index for varlen; varlen rows outside
// every sequence are left 0.
struct RefGrads {
  std::vector<double> dq, dk, dv, dsinks;
  int64_t rows_q = 0, rows_k = 0;
};

// RefPrecision::f64: everything in double (the oracle).
// RefPrecision::emulated: what a framework's unfused autograd does in the input precision —
// fp32 accumulation, with S, tanh(S/c), P, dP, dS, the per-head gradients and their GQA sums
// rounded to the input dtype (the error baseline of the tolerance rule).
// total_q_rows / total_k_rows: for varlen the packed token counts of q and k (default: the last
// cu_seqlens entry).
RefGrads reference_backward(const BwdProblem& p, RefPrecision prec, int64_t total_q_rows = -1,
                            int64_t total_k_rows = -1);

}  // namespace ioattn::detail

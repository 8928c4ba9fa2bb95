// Standard (materialising) attention on the CPU: the float64 oracle and the `naive` backend.
//
// For each (batch, head) it builds the full S = scale * Q K^T matrix, applies softcap, ALiBi and
// the mask, computes P = softmax(S) row by row, then O = P V — exactly the "standard attention"
// that writes S and P to memory. Extra memory: one seqlen_q x seqlen_k matrix per thread.
#pragma once

#include <vector>

#include "core/problem.hpp"

namespace ioattn::detail {

enum class RefPrecision {
  f64,       // everything in double: the oracle
  emulated,  // "naive attention in the input precision": S, P and O rounded to the input dtype
             // the way a framework's unfused path does (fp32 accumulate, low-precision tensors).
};

// Results in contiguous order: o as [batch, seqlen_q, heads_q, head_dim_v] (varlen: [total_q,
// heads_q, head_dim_v]); lse as [batch, heads_q, seqlen_q] (varlen: [heads_q, total_q]).
// Rows past cu_seqlens_q[batch] (varlen padding) are left 0 / -inf.
struct RefResult {
  std::vector<double> o;
  std::vector<double> lse;
  int64_t rows = 0;  // batch * seqlen_q, or total_q for varlen
};

// total_q_rows: for varlen the packed token count of q (>= cu_seqlens_q[batch]).
RefResult reference_forward(const FwdProblem& p, RefPrecision prec, int64_t total_q_rows = -1);

}  // namespace ioattn::detail

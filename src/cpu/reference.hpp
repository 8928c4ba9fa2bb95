// Standard (materialising) attention on the CPU: the float64 oracle and the `naive` backend.
//
// For each (batch, head) it builds the full S = scale * Q K^T matrix, applies softcap, ALiBi and
// the mask, computes P = softmax(S) row by row, then O = P V — exactly the "standard attention"
// that writes S and P to memory. Extra memory: one seqlen_q x seqlen_k matrix per thread.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "core/problem.hpp"

namespace ioattn::detail {

enum class RefPrecision {
  f64,       // everything in double: the oracle
  emulated,  // "naive attention in the input precision": S, P and O rounded to the input dtype
             // the way a framework's unfused path does (fp32 accumulate, low-precision tensors).
             // f8e4m3: S from fp8 tensor cores (fp32 per 32-element k-step into a ~14-bit
             // accumulator, as measured on Hopper), the unnormalised P = exp(S - max) in e4m3,
             // O in the output dtype.
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

// The first exception thrown by the iterations of an OpenMP loop, rethrown on the calling thread
// after the loop (an exception that leaves an OpenMP region calls std::terminate; the S matrix of a
// large problem throws std::bad_alloc there). Each iteration runs its body through run(); once one
// has failed, the remaining ones skip theirs.
class LoopError {
 public:
  template <class F>
  void run(F&& body) noexcept {
    if (stop_.load(std::memory_order_relaxed)) return;
    try {
      body();
    } catch (...) {
      std::lock_guard<std::mutex> lock(m_);
      if (!first_) first_ = std::current_exception();
      stop_.store(true, std::memory_order_relaxed);
    }
  }
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::atomic<bool> stop_{false};
  std::mutex m_;
  std::exception_ptr first_;
};

// Out of memory in the naive backend (`what`: "forward" / "backward"), as an ioattn::Error on q
// that says how much one (batch, head) materialises in float64 and what to use instead.
[[noreturn]] void throw_naive_out_of_memory(const FwdProblem& p, const char* what, int matrices);

// Visits every (query row, head) of p once, pairing where the backend's strided output lives with
// where the contiguous RefResult holds it: f(o_off, ref_o_off, lse_off, ref_lse_off), offsets in
// elements (o_off into p.o's layout, lse_off into p.lse's; ref_* index r.o / r.lse, which start a
// row of head_dim_v values / hold one value).
template <class F>
void for_each_output_row(const FwdProblem& p, const RefResult& r, F f) {
  const int64_t hq = p.heads_q, dv = p.head_dim_v;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t q0 = p.varlen() ? p.cu_seqlens_q_host[b] : 0;
    const int64_t sq = p.varlen() ? p.cu_seqlens_q_host[b + 1] - q0 : p.seqlen_q;
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t row = p.varlen() ? q0 + i : b * sq + i;
        f(b * p.o_stride.batch + (q0 + i) * p.o_stride.seq + h * p.o_stride.head, (row * hq + h) * dv,
          b * p.lse_stride.batch + h * p.lse_stride.head + (q0 + i) * p.lse_stride.seq,
          p.varlen() ? h * r.rows + row : (b * hq + h) * sq + i);
      }
  }
}

}  // namespace ioattn::detail

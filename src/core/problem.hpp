// Internal: the validated, normalised forward problem every backend receives.
//
// Validation (validate.cpp) turns the public TensorViews into this struct once; backends
// never re-check arguments. All offsets are int64 and in elements. Fixed-length and varlen
// problems share one description: a token of (batch b, row i) lives at
//   base + b * batch_stride + (seq_start(b) + i) * seq_stride + head * head_stride
// where seq_start(b) = cu_seqlens[b] for varlen (batch_stride = 0), else 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "ioattn/ioattn.hpp"

namespace ioattn::detail {

struct Strides3 {
  int64_t batch = 0, seq = 0, head = 0;
};

// An FP8 descale factor per (batch, kv head): value = code * at(b, hk); null = 1.
struct Descale {
  const float* ptr = nullptr;  // on the problem's device
  int64_t batch_stride = 0, head_stride = 0;  // elements
  bool defined() const { return ptr != nullptr; }
  // Host only (the pointer must be host memory).
  float at(int64_t b, int64_t hk) const { return ptr ? ptr[b * batch_stride + hk * head_stride] : 1.0f; }
};

struct FwdProblem {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // optional
  Strides3 q_stride, k_stride, v_stride, o_stride, lse_stride;

  DType dtype = DType::f32;
  Device device = Device::cpu;
  int device_index = 0;
  int64_t batch = 0;
  int64_t heads_q = 0, heads_kv = 0;
  int64_t seqlen_q = 0, seqlen_k = 0;  // fixed length; for varlen: the max over the batch
  int64_t head_dim = 0, head_dim_v = 0;

  // Varlen (null for fixed length). Host copies of cu_seqlens are kept for CPU dispatch.
  const int32_t* cu_seqlens_q = nullptr;  // on `device`
  const int32_t* cu_seqlens_k = nullptr;
  const int32_t* cu_seqlens_q_host = nullptr;  // always host (owned by the caller of the backend)
  const int32_t* cu_seqlens_k_host = nullptr;

  float scale = 1.0f;
  float softcap = 0.0f;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // -1 = unbounded; causal sets right = 0
  const float* alibi_slopes = nullptr;  // on `device`, [heads_q]
  const float* sinks = nullptr;         // on `device`, [heads_q]

  void* stream = nullptr;
  int num_threads = 0;

  // FP8 (dtype == f8e4m3): o's dtype (bf16 or f16) and the descales (see AttnParams).
  DType fp8_out = DType::bf16;
  Descale q_descale, k_descale, v_descale;

  // KV-cache layout (decode() with more than 16 query rows: serving_api.cpp's
  // cache_prefill_problem; the CPU flash forward and the CUDA forward's KV-cache mode): kv_lens[b]
  // keys for sequence b (on `device`; query row i at position kv_lens[b] - seqlen_q + i, the
  // forward's bottom-right rule), K / V in kv_dtype (an 8-bit cache: f8e4m3 or i8, times
  // k_descale / v_descale). With block_table (on `device`) token t of sequence b sits in page
  // block_table[b * bt_stride_batch + (t / page_size) * bt_stride_page] at offset t % page_size,
  // element page * k_stride.batch + offset * k_stride.seq + hk * k_stride.head (k_stride.batch is
  // then the page stride); without it at b * k_stride.batch + t * k_stride.seq + ... as usual.
  // CUDA reads kv_lens and the table on the device only: num_pages and kv_bound (the largest valid
  // length) are what its kernel checks them against (CPU tensors are checked on the host).
  const int32_t* kv_lens = nullptr;
  const int32_t* block_table = nullptr;
  int64_t page_size = 0, bt_stride_batch = 0, bt_stride_page = 0;
  int64_t num_pages = 0, kv_bound = 0;
  bool kv_dtype_set = false;
  DType kv_dtype = DType::f32;

  bool varlen() const { return cu_seqlens_q != nullptr; }
  bool fp8() const { return dtype == DType::f8e4m3; }
  DType kvt() const { return kv_dtype_set ? kv_dtype : dtype; }  // the dtype of K and V
  // The dtype O is written in: the input dtype, or fp8_out for f8e4m3 inputs.
  DType out_dtype() const { return fp8() ? fp8_out : dtype; }
  int64_t group() const { return heads_q / heads_kv; }
  bool has_mask() const { return window_left >= 0 || window_right >= 0; }
};

// The backward problem: the forward's description (o and lse are inputs here) plus gradients.
struct BwdProblem {
  FwdProblem f;             // f.o, f.lse: the forward's outputs, read-only here
  const void* dout = nullptr;
  Strides3 dout_stride;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides3 dq_stride, dk_stride, dv_stride;
  float* dsinks = nullptr;  // optional, [heads_q]
  bool deterministic = false;
};

// Key range [lo, hi) visible to query row i, bottom-right aligned. hi <= lo means empty.
inline void visible_keys(int64_t i, int64_t sq, int64_t sk, int64_t wl, int64_t wr,
                         int64_t* lo, int64_t* hi) {
  const int64_t diag = i + (sk - sq);
  int64_t l = wl >= 0 ? diag - wl : 0;
  int64_t h = wr >= 0 ? diag + wr + 1 : sk;
  *lo = l < 0 ? 0 : l;
  *hi = h > sk ? sk : h;
}

// "causal+window(64,0)+softcap+gqa4": the mask and feature part of a kernel's name in the logs.
inline std::string mask_name(const FwdProblem& p) {
  std::string m;
  if (p.causal) m = "causal";
  if (p.window_left >= 0 || (!p.causal && p.window_right >= 0))
    m += (m.empty() ? "" : "+") + std::string("window(") + std::to_string(p.window_left) + "," +
         std::to_string(p.window_right) + ")";
  if (m.empty()) m = "nomask";
  if (p.softcap > 0) m += "+softcap";
  if (p.alibi_slopes) m += "+alibi";
  if (p.sinks) m += "+sinks";
  if (p.varlen()) m += "+varlen";
  if (p.heads_q != p.heads_kv) m += "+gqa" + std::to_string(p.group());
  if (p.fp8())
    m += std::string("+fp8") + (p.q_descale.defined() || p.k_descale.defined() || p.v_descale.defined() ? "-descale" : "") +
         "->" + (p.fp8_out == DType::f16 ? "f16" : "bf16");
  return m;
}

inline float neg_inf() { return -std::numeric_limits<float>::infinity(); }

}  // namespace ioattn::detail

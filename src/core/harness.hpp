// Internal: buffers, random inputs and error measurement shared by the CLI, the tests and the
// benchmarks. Header-only; host and CUDA buffers behind one type so a check runs on either.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "cpu/reference.hpp"
#include "ioattn/ioattn.hpp"

namespace ioattn::detail {

// A buffer of `count` elements of `dtype` that lives on the host and, for Device::cuda, is
// mirrored on the device. upload()/download() move the host copy.
class Buffer {
 public:
  Buffer() = default;
  Buffer(DType dtype, int64_t count, Device device = Device::cpu)
      : dtype_(dtype), count_(count), device_(device),
        host_(static_cast<size_t>(std::max<int64_t>(count, 0) * dtype_size(dtype))) {
    if (device_ == Device::cuda && bytes() > 0) dev_ = cuda_malloc(bytes());
  }
  ~Buffer() {
    if (dev_) cuda_free(dev_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    swap(o);
    return *this;
  }

  size_t bytes() const { return host_.size(); }
  int64_t count() const { return count_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  void* host() { return host_.data(); }
  const void* host() const { return host_.data(); }
  // The pointer a kernel sees.
  void* data() { return device_ == Device::cuda ? dev_ : static_cast<void*>(host_.data()); }
  void upload() {
    if (dev_) cuda_copy_from_host(dev_, host_.data(), bytes());
  }
  void download() {
    if (dev_) cuda_copy_to_host(host_.data(), dev_, bytes());
  }
  float get(int64_t i) const { return load_float(host_.data(), dtype_, i); }
  void set(int64_t i, float x) { store_float(host_.data(), dtype_, i, x); }

  // Uniform(-range, range) values rounded to the dtype; never all zeros.
  void fill_random(std::mt19937_64& rng, float range = 1.0f) {
    std::uniform_real_distribution<float> dist(-range, range);
    for (int64_t i = 0; i < count_; ++i) set(i, dist(rng));
    upload();
  }
  // Every element NaN (so unwritten outputs are caught).
  void poison() {
    for (int64_t i = 0; i < count_; ++i) set(i, std::numeric_limits<float>::quiet_NaN());
    upload();
  }
  void fill_i32(const std::vector<int32_t>& v) {
    std::memcpy(host_.data(), v.data(), std::min(bytes(), v.size() * sizeof(int32_t)));
    upload();
  }

  TensorView view(std::initializer_list<int64_t> shape) {
    TensorView t = TensorView::contiguous(data(), dtype_, shape, device_);
    return t;
  }

 private:
  void swap(Buffer& o) {
    std::swap(dtype_, o.dtype_);
    std::swap(count_, o.count_);
    std::swap(device_, o.device_);
    std::swap(host_, o.host_);
    std::swap(dev_, o.dev_);
  }
  DType dtype_ = DType::f32;
  int64_t count_ = 0;
  Device device_ = Device::cpu;
  std::vector<uint8_t> host_;
  void* dev_ = nullptr;
};

// Max |a - b| over elements of an output (strided, as in p) against a contiguous reference.
// NaN anywhere (an unwritten, poisoned element or a NaN result) gives +inf.
struct ErrorStats {
  double max_abs = 0.0;
  int64_t bad_index = -1;  // first non-finite output, if any
};

inline void accumulate_error(ErrorStats& e, double got, double want, int64_t idx) {
  const bool both_neg_inf = std::isinf(got) && std::isinf(want) && got < 0 && want < 0;
  if (both_neg_inf) return;
  const double d = std::fabs(got - want);
  if (std::isnan(d) || std::isinf(d)) {
    if (e.bad_index < 0) e.bad_index = idx;
    e.max_abs = std::numeric_limits<double>::infinity();
    return;
  }
  e.max_abs = std::max(e.max_abs, d);
}

// Max |a - b| over the host copies of two buffers of one shape (equal infinities count as 0; a NaN
// anywhere gives +inf): the ring-attention tests compare P ranks with one device this way.
inline double max_abs_diff(const Buffer& a, const Buffer& b) {
  ErrorStats e;
  for (int64_t i = 0; i < a.count(); ++i) {
    const double x = a.get(i), y = b.get(i);
    if (std::isinf(x) && std::isinf(y) && (x < 0) == (y < 0)) continue;
    accumulate_error(e, x, y, i);
  }
  return e.max_abs;
}

// Errors of the O and LSE written by a backend (host copies, strides from p) vs a RefResult.
inline void output_errors(const FwdProblem& p, const void* o_host, const float* lse_host, const RefResult& ref,
                          ErrorStats* o_err, ErrorStats* lse_err) {
  const int64_t dv = p.head_dim_v;
  for_each_output_row(p, ref, [&](int64_t ooff, int64_t ro, int64_t loff, int64_t rl) {
    for (int64_t x = 0; x < dv; ++x)
      accumulate_error(*o_err, load_float(o_host, p.out_dtype(), ooff + x), ref.o[ro + x], ooff + x);
    if (lse_host && lse_err) accumulate_error(*lse_err, lse_host[loff], ref.lse[rl], loff);
  });
}

// Error of one reference against another (e.g. emulated low precision vs float64).
inline void ref_errors(const RefResult& a, const RefResult& b, ErrorStats* o_err, ErrorStats* lse_err) {
  for (size_t i = 0; i < a.o.size(); ++i) accumulate_error(*o_err, a.o[i], b.o[i], static_cast<int64_t>(i));
  for (size_t i = 0; i < a.lse.size(); ++i) accumulate_error(*lse_err, a.lse[i], b.lse[i], static_cast<int64_t>(i));
}

// The last `rows` query rows of (batch b, query head h) of a fixed-length problem, as a problem
// of its own (batch 1, one head, seqlen_q = rows; pointers moved, strides kept). The masks and
// ALiBi depend on i + (seqlen_k - seqlen_q) only, which the last rows keep, so its reference is
// the full problem's on those rows: a large problem is checked on a sample for a fraction of
// the float64 cost. o and lse point where the full problem's outputs hold those rows.
inline FwdProblem last_rows_problem(const FwdProblem& p, int64_t b, int64_t h, int64_t rows) {
  const int64_t hk = h / p.group(), i0 = p.seqlen_q - rows;
  auto at = [&](const void* base, const Strides3& s, int64_t head, int64_t row, DType t) {
    return static_cast<const char*>(base) + (b * s.batch + row * s.seq + head * s.head) * dtype_size(t);
  };
  FwdProblem s = p;
  s.q = at(p.q, p.q_stride, h, i0, p.dtype);
  s.k = at(p.k, p.k_stride, hk, 0, p.dtype);
  s.v = at(p.v, p.v_stride, hk, 0, p.dtype);
  s.o = const_cast<char*>(at(p.o, p.o_stride, h, i0, p.out_dtype()));  // (fp8: o in bf16 / f16)
  for (Descale* ds : {&s.q_descale, &s.k_descale, &s.v_descale})  // fp8: (b, hk)'s factor at (0, 0)
    if (ds->ptr) ds->ptr += b * ds->batch_stride + hk * ds->head_stride;
  s.lse = p.lse ? p.lse + b * p.lse_stride.batch + h * p.lse_stride.head + i0 * p.lse_stride.seq : nullptr;
  s.alibi_slopes = p.alibi_slopes ? p.alibi_slopes + h : nullptr;
  s.sinks = p.sinks ? p.sinks + h : nullptr;
  s.batch = 1;
  s.heads_q = s.heads_kv = 1;
  s.seqlen_q = rows;
  return s;
}

// A backend's outputs against the float64 reference, with the error of standard attention in
// the input precision beside it (the tolerance rule's baseline).
struct ForwardCheck {
  ErrorStats o, lse;              // backend vs float64 reference
  ErrorStats naive_o, naive_lse;  // emulated input-precision standard attention vs float64
  bool sampled = false;           // true: only (heads_checked x rows_checked) rows were compared
  int64_t heads_checked = 0;      // (batch, head) pairs
  int64_t rows_checked = 0;       // query rows per pair
};

// hp: the problem with host pointers for every input and for o / lse (downloaded outputs).
// When the float64 reference of the whole problem would cost more than max_ref_flops, the check
// runs on the last rows of the first and the last (batch, head) pair instead (fixed length only;
// varlen is always checked whole).
inline ForwardCheck check_forward(const FwdProblem& hp, double max_ref_flops) {
  ForwardCheck c;
  const double row_flops = 2.0 * static_cast<double>(hp.seqlen_k) * static_cast<double>(hp.head_dim + hp.head_dim_v);
  const double full_flops = row_flops * static_cast<double>(hp.batch * hp.heads_q * hp.seqlen_q);
  auto compare = [&](const FwdProblem& p) {
    const RefResult ref = reference_forward(p, RefPrecision::f64);
    const RefResult emu = reference_forward(p, RefPrecision::emulated);
    output_errors(p, p.o, p.lse, ref, &c.o, p.lse ? &c.lse : nullptr);
    ref_errors(emu, ref, &c.naive_o, &c.naive_lse);
  };
  if (hp.varlen() || full_flops <= max_ref_flops || hp.batch * hp.heads_q == 0) {
    compare(hp);
    c.heads_checked = hp.batch * hp.heads_q;
    c.rows_checked = hp.seqlen_q;
    return c;
  }
  std::vector<std::pair<int64_t, int64_t>> pairs = {{0, 0}};
  if (hp.batch * hp.heads_q > 1) pairs.emplace_back(hp.batch - 1, hp.heads_q - 1);
  const double per_pair = max_ref_flops / static_cast<double>(pairs.size());
  const int64_t rows = std::clamp<int64_t>(static_cast<int64_t>(per_pair / std::max(row_flops, 1.0)), 1, hp.seqlen_q);
  for (const auto& bh : pairs) compare(last_rows_problem(hp, bh.first, bh.second, rows));
  c.sampled = true;
  c.heads_checked = static_cast<int64_t>(pairs.size());
  c.rows_checked = rows;
  return c;
}

}  // namespace ioattn::detail

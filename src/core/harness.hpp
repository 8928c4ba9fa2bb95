// Internal: buffers, random inputs and error measurement shared by the CLI, the tests and the
// benchmarks. Header-only; host and CUDA buffers behind one type so a check runs on either.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
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

// Errors of the O and LSE written by a backend (host copies, strides from p) vs a RefResult.
inline void output_errors(const FwdProblem& p, const void* o_host, const float* lse_host, const RefResult& ref,
                          ErrorStats* o_err, ErrorStats* lse_err) {
  const int64_t dv = p.head_dim_v;
  for_each_output_row(p, ref, [&](int64_t ooff, int64_t ro, int64_t loff, int64_t rl) {
    for (int64_t x = 0; x < dv; ++x)
      accumulate_error(*o_err, load_float(o_host, p.dtype, ooff + x), ref.o[ro + x], ooff + x);
    if (lse_host && lse_err) accumulate_error(*lse_err, lse_host[loff], ref.lse[rl], loff);
  });
}

// Error of one reference against another (e.g. emulated low precision vs float64).
inline void ref_errors(const RefResult& a, const RefResult& b, ErrorStats* o_err, ErrorStats* lse_err) {
  for (size_t i = 0; i < a.o.size(); ++i) accumulate_error(*o_err, a.o[i], b.o[i], static_cast<int64_t>(i));
  for (size_t i = 0; i < a.lse.size(); ++i) accumulate_error(*lse_err, a.lse[i], b.lse[i], static_cast<int64_t>(i));
}

}  // namespace ioattn::detail

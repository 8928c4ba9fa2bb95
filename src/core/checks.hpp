// Internal: the argument checks every validator uses. Each failure throws ioattn::Error whose
// message reads "ioattn: argument 'NAME': expected WHAT, got WHAT".
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "ioattn/ioattn.hpp"

namespace ioattn::detail {

inline std::string shape_str(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim && i < 4; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

[[noreturn]] inline void fail(const std::string& arg, const std::string& expected, const std::string& got) {
  throw Error(arg, "ioattn: argument '" + arg + "': expected " + expected + ", got " + got);
}

inline bool is_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

// Checks that apply to every tensor argument.
inline void check_view(const TensorView& t, const char* name, int ndim, const TensorView& ref_dev) {
  if (t.ndim != ndim)
    fail(name, std::to_string(ndim) + " dims", std::to_string(t.ndim) + " dims " + shape_str(t));
  for (int i = 0; i < ndim; ++i) {
    if (t.shape[i] < 0) fail(std::string(name) + ".shape", "non-negative sizes", shape_str(t));
    if (t.stride[i] < 0)
      fail(std::string(name) + ".stride[" + std::to_string(i) + "]", "a non-negative stride",
           std::to_string(t.stride[i]));
  }
  // An empty tensor's strides are arbitrary (DLPack producers report 0 for them): checked only when
  // it holds elements.
  if (t.stride[ndim - 1] != 1 && t.shape[ndim - 1] > 1 && t.numel() > 0)
    fail(std::string(name) + ".stride[" + std::to_string(ndim - 1) + "]", "1 (unit stride on the last dim)",
         std::to_string(t.stride[ndim - 1]));
  if (t.data == nullptr && t.numel() > 0) fail(name, "a non-null data pointer", "null");
  if (t.device != ref_dev.device || t.device_index != ref_dev.device_index)
    fail(std::string(name) + ".device",
         std::string(device_name(ref_dev.device)) + ":" + std::to_string(ref_dev.device_index) + " (as q)",
         std::string(device_name(t.device)) + ":" + std::to_string(t.device_index));
  if (t.device == Device::cuda && t.numel() > 0 && cuda_compiled()) {
    const int where = cuda_pointer_device(t.data);
    if (where == -1) fail(std::string(name) + ".data", "a CUDA device pointer (device = cuda)", "a host pointer");
    if (where >= 0 && where != t.device_index)
      fail(std::string(name) + ".device_index", std::to_string(where) + " (the device " + name + ".data lives on)",
           std::to_string(t.device_index));
  }
}

inline void check_dtype(const TensorView& t, const char* name, DType want) {
  if (t.dtype != want)
    fail(std::string(name) + ".dtype", std::string(dtype_name(want)), dtype_name(t.dtype));
}

inline void check_dim(const char* name, int dim, int64_t got, int64_t want, const char* what) {
  if (got != want)
    fail(std::string(name) + ".shape[" + std::to_string(dim) + "]",
         std::to_string(want) + " (" + what + ")", std::to_string(got));
}

// Outputs must not have stride 0 in a dim of size > 1 (two rows would land on one address); an
// empty output is never written.
inline void check_writable(const TensorView& t, const char* name) {
  if (t.numel() == 0) return;
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] > 1 && t.stride[i] == 0)
      fail(std::string(name) + ".stride[" + std::to_string(i) + "]",
           "a non-zero stride for an output dim of size > 1", "0");
}

inline const float* check_head_vector(const TensorView& t, const char* name, int64_t heads_q,
                               const TensorView& q) {
  if (!t.defined()) return nullptr;
  check_view(t, name, 1, q);
  check_dtype(t, name, DType::f32);
  check_dim(name, 0, t.shape[0], heads_q, "heads_q");
  if (t.data == nullptr) fail(name, "a non-null data pointer", "null");
  return static_cast<const float*>(t.data);
}

inline std::vector<int32_t> read_cu_seqlens(const TensorView& cu, const char* name, int64_t batch,
                                     int64_t total, const TensorView& q, void* stream = nullptr) {
  check_view(cu, name, 1, q);
  check_dtype(cu, name, DType::i32);
  check_dim(name, 0, cu.shape[0], batch + 1, "batch + 1");
  if (cu.data == nullptr) fail(name, "a non-null data pointer", "null");
  std::vector<int32_t> h(static_cast<size_t>(batch + 1));
  if (cu.device == Device::cuda)
    cuda_copy_to_host(h.data(), cu.data, h.size() * sizeof(int32_t), stream);
  else
    std::memcpy(h.data(), cu.data, h.size() * sizeof(int32_t));
  if (h[0] != 0) fail(std::string(name) + "[0]", "0", std::to_string(h[0]));
  for (int64_t b = 0; b < batch; ++b)
    if (h[b + 1] < h[b])
      fail(std::string(name), "non-decreasing offsets",
           "[" + std::to_string(b) + "] = " + std::to_string(h[b]) + " > [" + std::to_string(b + 1) +
               "] = " + std::to_string(h[b + 1]));
  if (h[batch] > total)
    fail(std::string(name) + "[" + std::to_string(batch) + "]",
         "at most the packed token count " + std::to_string(total), std::to_string(h[batch]));
  return h;
}

}  // namespace ioattn::detail

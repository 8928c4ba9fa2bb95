// Memory operations for ring attention: CPU loops here, CUDA kernels in ops_cuda.cu.
#include "dist/ops.hpp"

#include <cstring>

#include "core/backends.hpp"
#include "core/half.hpp"

namespace ioattn::detail::dist {
namespace {

// Visits every row (all dims but the last) of a view up to 4-D: f(offset_a, offset_b).
template <class F>
void for_rows(const TensorView& a, const TensorView& b, F f) {
  int64_t shape[3] = {1, 1, 1}, sa[3] = {0, 0, 0}, sb[3] = {0, 0, 0};
  const int lead = a.ndim - 1;
  for (int i = 0; i < lead; ++i) {
    shape[3 - lead + i] = a.shape[i];
    sa[3 - lead + i] = a.stride[i];
    sb[3 - lead + i] = b.stride[i];
  }
  for (int64_t i = 0; i < shape[0]; ++i)
    for (int64_t j = 0; j < shape[1]; ++j)
      for (int64_t k = 0; k < shape[2]; ++k) f(i * sa[0] + j * sa[1] + k * sa[2], i * sb[0] + j * sb[1] + k * sb[2]);
}

int64_t row_len(const TensorView& t) { return t.ndim ? t.shape[t.ndim - 1] : 1; }

}  // namespace

Scratch::Scratch(Device dev, size_t bytes, void* stream) : dev_(dev), stream_(stream) {
  if (bytes == 0) return;
  ptr_ = dev == Device::cuda ? cuda_alloc_async(bytes, stream) : ::operator new(bytes);
}

Scratch::~Scratch() {
  if (!ptr_) return;
  if (dev_ == Device::cuda)
    cuda_free_async(ptr_, stream_);
  else
    ::operator delete(ptr_);
}

void fill_f32(const TensorView& dst, float value, void* stream) {
  if (dst.device == Device::cuda) return cuda_fill_f32(dst, value, stream);
  const int64_t n = row_len(dst);
  for_rows(dst, dst, [&](int64_t o, int64_t) {
    float* p = static_cast<float*>(dst.data) + o;
    for (int64_t x = 0; x < n; ++x) p[x] = value;
  });
}

void copy(const TensorView& dst, const TensorView& src, void* stream) {
  if (dst.device == Device::cuda) return cuda_copy(dst, src, stream);
  const int64_t es = dtype_size(dst.dtype), n = row_len(dst);
  for_rows(dst, src, [&](int64_t od, int64_t os) {
    std::memcpy(static_cast<char*>(dst.data) + od * es, static_cast<const char*>(src.data) + os * es,
                static_cast<size_t>(n * es));
  });
}

void accumulate(const TensorView& acc, const TensorView& src, void* stream) {
  if (acc.device == Device::cuda) return cuda_accumulate(acc, src, stream);
  const int64_t n = row_len(acc);
  for_rows(acc, src, [&](int64_t oa, int64_t os) {
    float* a = static_cast<float*>(acc.data) + oa;
    for (int64_t x = 0; x < n; ++x) a[x] += load_float(src.data, src.dtype, os + x);
  });
}

void convert(const TensorView& dst, const TensorView& src, void* stream) {
  if (dst.device == Device::cuda) return cuda_convert(dst, src, stream);
  const int64_t n = row_len(dst);
  for_rows(dst, src, [&](int64_t od, int64_t os) {
    const float* s = static_cast<const float*>(src.data) + os;
    for (int64_t x = 0; x < n; ++x) store_float(dst.data, dst.dtype, od + x, s[x]);
  });
}

void copy_bytes(Device dev, void* dst, const void* src, size_t bytes, void* stream) {
  if (dev == Device::cuda) return cuda_copy_bytes(dst, src, bytes, stream);
  std::memcpy(dst, src, bytes);
}

void synchronize(Device dev, void* stream) {
  if (dev == Device::cuda) cuda_stream_synchronize(stream);
}

#ifndef IOATTN_WITH_CUDA
namespace {
[[noreturn]] void no_cuda() { throw Error("q.device", "ioattn: argument 'q.device': expected cpu (this build has no CUDA backend), got cuda"); }
}  // namespace
void cuda_fill_f32(const TensorView&, float, void*) { no_cuda(); }
void cuda_copy(const TensorView&, const TensorView&, void*) { no_cuda(); }
void cuda_accumulate(const TensorView&, const TensorView&, void*) { no_cuda(); }
void cuda_convert(const TensorView&, const TensorView&, void*) { no_cuda(); }
void cuda_stream_synchronize(void*) { no_cuda(); }
void cuda_copy_bytes(void*, const void*, size_t, void*) { no_cuda(); }
void* cuda_alloc_async(size_t, void*) { no_cuda(); }
void cuda_free_async(void*, void*) {}
#endif

}  // namespace ioattn::detail::dist

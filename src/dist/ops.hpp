// Internal: the few memory operations ring attention needs, on the CPU or a CUDA device.
// Views are up to 4-D with a unit last-dim stride (the API's TensorView).
#pragma once

#include <condition_variable>
#include <mutex>

#include "ioattn/ioattn.hpp"

namespace ioattn::detail::dist {

// Memory owned by the ring algorithm (K/V ring buffers, fp32 accumulators). On CUDA it is
// stream-ordered (cudaMallocAsync / cudaFreeAsync on `stream`): no device-wide synchronisation per
// call, and the pool reuses the blocks of the previous call.
class Scratch {
 public:
  Scratch(Device dev, size_t bytes, void* stream = nullptr);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get() const { return ptr_; }

 private:
  Device dev_;
  void* stream_ = nullptr;
  void* ptr_ = nullptr;
};

// Reusable barrier for n threads (C++17 has no std::barrier): the loopback group's ranks, and the
// rank threads of ioattn_bench_cp --nccl 1.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lk(m_);
    const long gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lk, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  long gen_ = 0;
};

void fill_f32(const TensorView& dst, float value, void* stream);
void copy(const TensorView& dst, const TensorView& src, void* stream);        // same dtype, any strides
void accumulate(const TensorView& acc_f32, const TensorView& src, void* stream);  // acc += float(src)
void convert(const TensorView& dst, const TensorView& src_f32, void* stream);     // dst = dtype(src)
void synchronize(Device dev, void* stream);
void copy_bytes(Device dev, void* dst, const void* src, size_t bytes, void* stream);

// CUDA versions (src/dist/ops_cuda.cu; stubs that throw when built without CUDA).
void cuda_fill_f32(const TensorView& dst, float value, void* stream);
void cuda_copy(const TensorView& dst, const TensorView& src, void* stream);
void cuda_accumulate(const TensorView& acc_f32, const TensorView& src, void* stream);
void cuda_convert(const TensorView& dst, const TensorView& src_f32, void* stream);
void cuda_stream_synchronize(void* stream);
void cuda_copy_bytes(void* dst, const void* src, size_t bytes, void* stream);
void* cuda_alloc_async(size_t bytes, void* stream);
void cuda_free_async(void* ptr, void* stream);

}  // namespace ioattn::detail::dist

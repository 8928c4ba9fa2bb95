// CUDA versions of the ring-attention memory operations (see ops.hpp): one block per row of a
// strided view (all dims but the last), threads along the contiguous last dim.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "dist/ops.hpp"

namespace ioattn::detail::dist {
namespace {

struct Rows {  // a view's row geometry, padded to 3 leading dims
  int64_t shape[3] = {1, 1, 1};
  int64_t sa[3] = {0, 0, 0};
  int64_t sb[3] = {0, 0, 0};
  int64_t n = 1;  // row length
  __host__ __device__ int64_t count() const { return shape[0] * shape[1] * shape[2]; }
};

Rows rows_of(const TensorView& a, const TensorView& b) {
  Rows r;
  const int lead = a.ndim - 1;
  for (int i = 0; i < lead; ++i) {
    r.shape[3 - lead + i] = a.shape[i];
    r.sa[3 - lead + i] = a.stride[i];
    r.sb[3 - lead + i] = b.stride[i];
  }
  r.n = a.ndim ? a.shape[a.ndim - 1] : 1;
  return r;
}

__device__ inline float load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ inline void store(void* p, DType t, int64_t i, float x) {
  switch (t) {
    case DType::f16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    default: static_cast<float*>(p)[i] = x; break;
  }
}

__device__ inline void row_offsets(const Rows& r, int64_t row, int64_t* oa, int64_t* ob) {
  const int64_t k = row % r.shape[2], j = (row / r.shape[2]) % r.shape[1], i = row / (r.shape[1] * r.shape[2]);
  *oa = i * r.sa[0] + j * r.sa[1] + k * r.sa[2];
  *ob = i * r.sb[0] + j * r.sb[1] + k * r.sb[2];
}

enum class Op { fill, copy, accumulate, convert };

__global__ void rows_kernel(Op op, Rows r, void* dst, DType dt, const void* src, DType st, float value, int64_t es) {
  for (int64_t row = blockIdx.x; row < r.count(); row += gridDim.x) {
    int64_t oa, ob;
    row_offsets(r, row, &oa, &ob);
    for (int64_t x = threadIdx.x; x < r.n; x += blockDim.x) {
      switch (op) {
        case Op::fill: static_cast<float*>(dst)[oa + x] = value; break;
        case Op::copy:
          for (int64_t b = 0; b < es; ++b)
            static_cast<char*>(dst)[(oa + x) * es + b] = static_cast<const char*>(src)[(ob + x) * es + b];
          break;
        case Op::accumulate: static_cast<float*>(dst)[oa + x] += load(src, st, ob + x); break;
        case Op::convert: store(dst, dt, oa + x, static_cast<const float*>(src)[ob + x]); break;
      }
    }
  }
}

void launch(Op op, const TensorView& dst, const TensorView& src, float value, void* stream) {
  const Rows r = rows_of(dst, src);
  if (r.count() == 0 || r.n == 0) return;
  const int64_t blocks = r.count() < 65535 * 8 ? r.count() : 65535 * 8;
  rows_kernel<<<static_cast<unsigned>(blocks), 128, 0, static_cast<cudaStream_t>(stream)>>>(
      op, r, dst.data, dst.dtype, src.data, src.dtype, value, dtype_size(dst.dtype));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw Error("cuda", std::string("ioattn: ring-attention memory kernel failed: ") + cudaGetErrorString(e));
}

}  // namespace

void cuda_fill_f32(const TensorView& dst, float value, void* stream) { launch(Op::fill, dst, dst, value, stream); }
void cuda_copy(const TensorView& dst, const TensorView& src, void* stream) { launch(Op::copy, dst, src, 0, stream); }
void cuda_accumulate(const TensorView& acc, const TensorView& src, void* stream) {
  launch(Op::accumulate, acc, src, 0, stream);
}
void cuda_convert(const TensorView& dst, const TensorView& src, void* stream) { launch(Op::convert, dst, src, 0, stream); }
void cuda_copy_bytes(void* dst, const void* src, size_t bytes, void* stream) {
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) throw Error("cuda", std::string("ioattn: cudaMemcpyAsync failed: ") + cudaGetErrorString(e));
}

void* cuda_alloc_async(size_t bytes, void* stream) {
  void* p = nullptr;
  const cudaError_t e = cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error("cuda", "ioattn: cudaMallocAsync(" + std::to_string(bytes) + " bytes) failed: " + cudaGetErrorString(e));
  }
  return p;
}

// Destructor path: never throws (a failure here leaves the block to the pool).
void cuda_free_async(void* ptr, void* stream) {
  if (cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)) != cudaSuccess) cudaGetLastError();
}

void cuda_stream_synchronize(void* stream) {
  const cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) throw Error("cuda", std::string("ioattn: cudaStreamSynchronize failed: ") + cudaGetErrorString(e));
}

}  // namespace ioattn::detail::dist

// runtime.cu — device queries and the small memory helpers of the CUDA backend.
//
// These let validation (src/core/api.cpp), the tests, the CLI and the benchmarks talk to the GPU
// without including CUDA headers. Queries that can legitimately find no GPU (a CI machine has
// none) answer "absent" instead of throwing; everything else throws ioattn::Error.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/backends.hpp"
#include "cuda/check.cuh"

namespace ioattn::detail {

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: clear the sticky-free error and report none
    return 0;
  }
  return n;
}

std::string cuda_device_name(int index) {
  if (index < 0 || index >= cuda_device_count()) return "";
  cudaDeviceProp prop{};
  IOATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return prop.name;
}

int cuda_device_arch(int index) {
  if (index < 0 || index >= cuda_device_count()) return 0;
  int major = 0, minor = 0;
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index));
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index));
  return major * 10 + minor;
}

int cuda_pointer_device(const void* ptr) {
  if (ptr == nullptr || cuda_device_count() == 0) return -1;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // an unknown pointer is "not device memory", not an error
    return -1;
  }
  if (attr.type == cudaMemoryTypeManaged) return -2;
  return attr.type == cudaMemoryTypeDevice ? attr.device : -1;
}

bool cuda_is_device_pointer(const void* ptr) { return cuda_pointer_device(ptr) != -1; }

int cuda_set_device(int index) {
  int prev = 0;
  IOATTN_CUDA_CHECK(cudaGetDevice(&prev));
  if (prev != index) IOATTN_CUDA_CHECK(cudaSetDevice(index));
  return prev;
}

void cuda_copy_to_host(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return;
  if (stream == nullptr) {
    IOATTN_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return;
  }
  auto s = static_cast<cudaStream_t>(stream);
  IOATTN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  IOATTN_CUDA_CHECK(cudaStreamSynchronize(s));
}

void* cuda_malloc(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) bytes = 1;  // a valid, distinct pointer even for empty tensors
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error("cuda", "ioattn: cudaMalloc(" + std::to_string(bytes) + " bytes) failed: " +
                            cudaGetErrorString(e));
  }
  return p;
}

void cuda_free(void* ptr) {
  if (ptr) IOATTN_CUDA_CHECK(cudaFree(ptr));
}

void cuda_copy_from_host(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  IOATTN_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void cuda_synchronize() { IOATTN_CUDA_CHECK(cudaDeviceSynchronize()); }

size_t cuda_used_bytes() {
  if (cuda_device_count() == 0) return 0;
  size_t free_b = 0, total_b = 0;
  IOATTN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return total_b - free_b;
}

bool cuda_poison_pool(size_t bytes) {
  if (cuda_device_count() == 0 || bytes < 64) return false;
  int dev = 0;
  IOATTN_CUDA_CHECK(cudaGetDevice(&dev));
  cudaMemPool_t pool;
  IOATTN_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t keep = UINT64_MAX;  // freed blocks stay in the pool across synchronisations
  IOATTN_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  void* p = nullptr;
  IOATTN_CUDA_CHECK(cudaMallocAsync(&p, bytes, nullptr));
  IOATTN_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, bytes, nullptr));
  IOATTN_CUDA_CHECK(cudaFreeAsync(p, nullptr));
  IOATTN_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  uint8_t probe[64] = {};
  IOATTN_CUDA_CHECK(cudaMallocAsync(&p, bytes / 4, nullptr));
  IOATTN_CUDA_CHECK(cudaMemcpyAsync(probe, p, sizeof(probe), cudaMemcpyDeviceToHost, nullptr));
  IOATTN_CUDA_CHECK(cudaFreeAsync(p, nullptr));
  IOATTN_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  for (uint8_t b : probe)
    if (b != 0xFF) return false;
  return true;
}

}  // namespace ioattn::detail

// check.cuh — CUDA / cuBLAS error checking for the host side of src/cuda.
//
// Every runtime call goes through IOATTN_CUDA_CHECK and every launch is followed by
// IOATTN_CUDA_CHECK_LAUNCH(): a failure throws ioattn::Error (argument "cuda") naming the call,
// the CUDA error and the source line. Exit code 0 proves nothing; these make failures loud.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "core/backends.hpp"
#include "ioattn/ioattn.hpp"

namespace ioattn::cuda {

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* what, const char* file, int line) {
  throw Error("cuda", std::string("ioattn: CUDA error in ") + what + ": " + cudaGetErrorString(e) +
                          " (" + cudaGetErrorName(e) + ") at " + file + ":" + std::to_string(line));
}

[[noreturn]] inline void throw_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  throw Error("cuda", std::string("ioattn: cuBLAS error in ") + what + ": " + cublasGetStatusName(s) +
                          " (" + cublasGetStatusString(s) + ") at " + file + ":" + std::to_string(line));
}

// Short file name for messages ("src/cuda/naive.cu" rather than an absolute build path).
constexpr const char* short_file(const char* f) {
  const char* s = f;
  for (const char* p = f; *p; ++p)
    if (p[0] == 's' && p[1] == 'r' && p[2] == 'c' && p[3] == '/') s = p;
  return s;
}

}  // namespace ioattn::cuda

#define IOATTN_CUDA_CHECK(call)                                                              \
  do {                                                                                       \
    cudaError_t ioattn_err_ = (call);                                                        \
    if (ioattn_err_ != cudaSuccess)                                                          \
      ::ioattn::cuda::throw_cuda(ioattn_err_, #call, ::ioattn::cuda::short_file(__FILE__), __LINE__); \
  } while (0)

// After a <<<...>>> launch: catches bad configurations (grid, smem, missing image) at once.
#define IOATTN_CUDA_CHECK_LAUNCH(name)                                                       \
  do {                                                                                       \
    cudaError_t ioattn_err_ = cudaGetLastError();                                            \
    if (ioattn_err_ != cudaSuccess)                                                          \
      ::ioattn::cuda::throw_cuda(ioattn_err_, "launch of " name, ::ioattn::cuda::short_file(__FILE__), __LINE__); \
  } while (0)

#define IOATTN_CUBLAS_CHECK(call)                                                            \
  do {                                                                                       \
    cublasStatus_t ioattn_st_ = (call);                                                      \
    if (ioattn_st_ != CUBLAS_STATUS_SUCCESS)                                                 \
      ::ioattn::cuda::throw_cublas(ioattn_st_, #call, ::ioattn::cuda::short_file(__FILE__), __LINE__); \
  } while (0)

namespace ioattn::cuda {

// Makes `device` current for the scope of a call and restores the caller's device after (the one
// guard of the library: host code without CUDA headers uses it as detail::CudaDeviceGuard).
using DeviceGuard = ::ioattn::detail::CudaDeviceGuard;

}  // namespace ioattn::cuda

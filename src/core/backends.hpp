// Internal: the backend entry points the dispatcher can call. Each backend implements the
// semantics in include/ioattn/ioattn.hpp on an already validated FwdProblem.
#pragma once

#include <string>
#include <vector>

#include "core/problem.hpp"

namespace ioattn::detail {

// ---- CPU (src/cpu) ---------------------------------------------------------------------
// Float64 "standard attention": materialises S and P per (batch, head). The oracle and the
// `naive` backend.
void cpu_naive_forward(const FwdProblem& p);
// Tiled online-softmax backend (Highway SIMD, OpenMP threads).
void cpu_flash_forward(const FwdProblem& p);
// Backward by recomputation. The reference materialises P, dP, dS per (batch, head) in float64;
// the flash backend is tiled: one fused pass per (batch, kv head); when those pairs are too few
// for the threads, the fused pass over key ranges with per-range dQ partials, or (deterministic
// mode) two passes (dK/dV over key blocks, then dQ over query blocks); cpu_backward_mode says
// which and why (the kernel choice's reason).
void cpu_naive_backward(const BwdProblem& p);
void cpu_flash_backward(const BwdProblem& p);
std::string cpu_backward_mode(const BwdProblem& p);
// Tile shape the CPU flash kernel uses for this problem, e.g. "48x64".
std::string cpu_flash_tile(const FwdProblem& p);
// Highway targets compiled in, and the one chosen at run time on this machine.
std::vector<std::string> cpu_compiled_targets();
std::string cpu_best_target();
int cpu_max_threads();

// ---- CUDA (src/cuda; stubs in src/core/cuda_stubs.cpp when built without CUDA) -----------
bool cuda_compiled();
int cuda_device_count();
std::string cuda_device_name(int index);
int cuda_device_arch(int index);  // e.g. 90 for sm_90; 0 if absent
// Whether ptr is device memory (for validation of views that claim Device::cuda).
bool cuda_is_device_pointer(const void* ptr);
// The device ordinal ptr lives on: -1 for host/unknown memory, -2 for managed memory (any device).
int cuda_pointer_device(const void* ptr);
// Makes `index` the calling thread's current CUDA device; returns the previous one.
int cuda_set_device(int index);
// Runs a CUDA call on the device its tensors live on and restores the caller's device after.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int index) : prev_(cuda_set_device(index)), index_(index) {}
  ~CudaDeviceGuard() {
    if (prev_ != index_) cuda_set_device(prev_);
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int prev_, index_;
};
// Copies n bytes from device to host (used to validate cu_seqlens on the host), ordered after the
// work already queued on `stream` (the caller's stream: data written there is seen).
void cuda_copy_to_host(void* dst, const void* src, size_t bytes, void* stream = nullptr);
// Small memory helpers so tests, the CLI and benchmarks need no CUDA headers.
void* cuda_malloc(size_t bytes);
void cuda_free(void* ptr);
void cuda_copy_from_host(void* dst, const void* src, size_t bytes);
void cuda_synchronize();
// Peak device memory allocated through the runtime (bytes in use now, from cudaMemGetInfo).
size_t cuda_used_bytes();
// Tests: fills `bytes` of the current device's default memory pool with 0xFF bytes and frees them
// again, stream-ordered on the legacy default stream, after raising the pool's release threshold so
// that the memory stays in the pool. The next stream-ordered allocations there (the kernels'
// workspaces, cudaMallocAsync) then start as NaN in the 8- and 16-bit float formats and -1 as ints,
// so a workspace element that a kernel reads before writing shows up as NaN. Returns whether a
// probe allocation of bytes / 4 right after came back poisoned (false without a device).
bool cuda_poison_pool(size_t bytes);

// Dispatch-table row for the CUDA flash kernel, or an empty name and a reason why none fits.
struct CudaSelection {
  std::string kernel;  // "" = no kernel fits
  std::string reason;
};
CudaSelection cuda_flash_select(const FwdProblem& p, int arch);
void cuda_flash_forward(const FwdProblem& p);
// decode() with more than 16 query rows (a prefill chunk against the KV cache: p's cache fields,
// serving_api.cpp's cache_prefill_problem): on sm_90 the Hopper kernel's KV-cache rows where they
// take it (16-bit caches of q's dtype: contiguous, page pieces of >= 64 rows read directly, other
// page sizes and 8-bit caches through a gathered contiguous copy; IOATTN_SM90_CACHE=1 reads smaller
// pieces directly, =0 none; IOATTN_SM90_CACHE_GATHER=0 no copy, =1 every paged cache copied), else
// the mma.sync forward in its KV-cache mode. The row
// for this problem or why none fits; the run (the caller appended first, if asked to).
CudaSelection cuda_cache_prefill_select(const FwdProblem& p, int arch);
// The smallest page piece (rows per TMA load: min(page size, key block)) that the Hopper kernel's
// cache rows take by default (the selector's rule; the test's expectation).
constexpr int64_t kSm90CacheMinPieceRows = 64;
// Whether caches the direct rows do not take (paged with pieces under kSm90CacheMinPieceRows rows
// or odd page sizes, 8-bit caches) go through the gathered contiguous copy by default (session 31:
// 1.6-2.9x the mma.sync cache mode there on an H100; IOATTN_SM90_CACHE_GATHER=0 switches it off).
constexpr bool kSm90CacheGatherByDefault = true;
void cuda_cache_prefill(const FwdProblem& p);
void cuda_naive_forward(const FwdProblem& p);  // materialised S and P in HBM
std::vector<std::string> cuda_compiled_kernels();
// Backward on CUDA: a dispatch-table row or an empty name and the reason.
CudaSelection cuda_backward_select(const BwdProblem& p, int arch);
void cuda_flash_backward(const BwdProblem& p);

}  // namespace ioattn::detail

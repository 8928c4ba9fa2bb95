// naive.cu — "standard attention" on the GPU: the baseline the flash kernel is measured against.
//
// For a chunk of (batch, head) pairs it runs three passes through HBM, exactly what the
// FlashAttention paper's Algorithm 0 does:
//   1. S = scale · Q Kᵀ      cuBLAS batched GEMM, fp32 output [heads_in_chunk, sq, sk] in HBM
//   2. P = softmax(S)        one CTA per row: reads S (twice), applies softcap / ALiBi / mask /
//                            sink, writes P in the input dtype and the LSE
//   3. O = P V               cuBLAS batched GEMM, reads P, writes O in the input dtype
// Extra memory is (4 + sizeof(dtype)) · sq · sk bytes per (batch, head) in the chunk; chunks are
// sized to fit in the free device memory (16 heads x 16k x 16k bf16 = 25.8 GB fits on an H200).
// Pointer arrays (cublasGemmBatchedEx) make GQA, arbitrary strides and varlen the same code.
// Any head_dim, head_dim_v and dtype (f32 too: cuBLAS fp32 without TF32).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "cuda/check.cuh"
#include "cuda/naive.hpp"

namespace ioattn::cuda {
namespace {

constexpr float kNaiveLog2e = 1.4426950408889634f;
constexpr int kSoftmaxThreads = 256;

std::atomic<size_t> g_last_workspace_bytes{0};

cublasHandle_t cublas_handle(int device) {
  static std::mutex mu;
  static std::map<int, cublasHandle_t> handles;  // one per device, kept for the process lifetime
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasHandle_t h = nullptr;
  IOATTN_CUBLAS_CHECK(cublasCreate(&h));
  handles[device] = h;
  return h;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float block_reduce(float v, bool is_max, float* scratch) {
  for (int o = 16; o > 0; o /= 2) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from the previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = is_max ? -INFINITY : 0.f;
  for (int w = 0; w < kSoftmaxThreads / 32; ++w) v = is_max ? fmaxf(v, scratch[w]) : v + scratch[w];
  return v;
}

struct SoftmaxArgs {
  const float* s;  // [nh, slab] with [sq, sk] at the start of each slab, already times scale
  void* p;         // [nh, slab] in the input dtype
  int64_t slab;    // elements per head
  float* lse;      // optional; element (h, i) at lse_base + h * lse_head + i * lse_seq
  int64_t lse_head, lse_seq;
  int sq, sk, h0;  // h0: first query head of the chunk
  float softcap;
  int64_t window_left, window_right;
  const float* alibi;
  const float* sinks;
};

// One CTA per row (grid.x = nh * sq): the three reads of S and the write of P that make
// standard attention memory-bound.
template <typename T>
__global__ void __launch_bounds__(kSoftmaxThreads) softmax_rows_kernel(const SoftmaxArgs a) {
  __shared__ float scratch[kSoftmaxThreads / 32];
  const int64_t row = blockIdx.x;  // hl * sq + i
  const int i = static_cast<int>(row % a.sq);
  const int hl = static_cast<int>(row / a.sq), h = a.h0 + hl;
  const float* srow = a.s + hl * a.slab + static_cast<int64_t>(i) * a.sk;
  T* prow = static_cast<T*>(a.p) + hl * a.slab + static_cast<int64_t>(i) * a.sk;
  const int64_t diag = static_cast<int64_t>(i) + (a.sk - a.sq);
  const int64_t lo = a.window_left >= 0 ? diag - a.window_left : 0;
  const int64_t hi = a.window_right >= 0 && diag + a.window_right + 1 < a.sk ? diag + a.window_right + 1 : a.sk;
  const float slope = a.alibi ? a.alibi[h] : 0.f;
  auto score = [&](int j) -> float {  // natural-log units; -inf when masked
    if (j < lo || j >= hi) return -INFINITY;
    float x = srow[j];
    if (a.softcap > 0.f) x = a.softcap * tanhf(x / a.softcap);
    if (a.alibi) x -= slope * fabsf(static_cast<float>(diag - j));
    return x;
  };
  float m = -INFINITY;
  for (int j = threadIdx.x; j < a.sk; j += kSoftmaxThreads) m = fmaxf(m, score(j));
  m = block_reduce(m, true, scratch);
  const float sink = a.sinks ? a.sinks[h] : -INFINITY;
  m = fmaxf(m, sink);
  const float m_use = m == -INFINITY ? 0.f : m;
  float l = 0.f;
  for (int j = threadIdx.x; j < a.sk; j += kSoftmaxThreads) l += exp2f((score(j) - m_use) * kNaiveLog2e);
  l = block_reduce(l, false, scratch);
  if (a.sinks && sink > -INFINITY) l += exp2f((sink - m_use) * kNaiveLog2e);
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int j = threadIdx.x; j < a.sk; j += kSoftmaxThreads)
    prow[j] = from_float<T>(exp2f((score(j) - m_use) * kNaiveLog2e) * inv);
  if (a.lse && threadIdx.x == 0)
    a.lse[h * a.lse_head + static_cast<int64_t>(i) * a.lse_seq] = l > 0.f ? m_use + logf(l) : -INFINITY;
}

// O rows of a sequence with no keys at all (sk = 0): zero, LSE = -inf or the sink.
template <typename T>
__global__ void empty_rows_kernel(T* o, int64_t o_seq, int64_t o_head, int dv, float* lse, int64_t lse_seq,
                                  int64_t lse_head, int sq, int hq, const float* sinks) {
  const int64_t row = blockIdx.x;  // h * sq + i
  const int i = static_cast<int>(row % sq), h = static_cast<int>(row / sq);
  for (int x = threadIdx.x; x < dv; x += blockDim.x) o[i * o_seq + h * o_head + x] = from_float<T>(0.f);
  if (lse && threadIdx.x == 0) lse[h * lse_head + i * lse_seq] = sinks ? sinks[h] : -INFINITY;
}

// Leading dimension for cuBLAS: the row stride, or anything legal when there is a single row.
int64_t leading_dim(int64_t stride, int64_t rows, int64_t cols) {
  if (rows <= 1) return std::max<int64_t>(std::max<int64_t>(stride, cols), 1);
  if (stride < cols)
    throw Error("strides", "ioattn: the naive CUDA path needs a sequence stride >= the head dim (" +
                               std::to_string(cols) + "), got " + std::to_string(stride));
  return stride;
}

template <typename T>
void launch_softmax(const SoftmaxArgs& a, int nh, cudaStream_t st) {
  softmax_rows_kernel<T><<<static_cast<unsigned>(static_cast<int64_t>(nh) * a.sq), kSoftmaxThreads, 0, st>>>(a);
  IOATTN_CUDA_CHECK_LAUNCH("softmax_rows_kernel");
}

template <typename T>
void launch_empty_rows(const detail::FwdProblem& p, char* o_b, float* lse_b, int sq, cudaStream_t st) {
  empty_rows_kernel<T><<<static_cast<unsigned>(static_cast<int64_t>(sq) * p.heads_q), 128, 0, st>>>(
      reinterpret_cast<T*>(o_b), p.o_stride.seq, p.o_stride.head, static_cast<int>(p.head_dim_v), lse_b,
      p.lse_stride.seq, p.lse_stride.head, sq, static_cast<int>(p.heads_q), p.sinks);
  IOATTN_CUDA_CHECK_LAUNCH("empty_rows_kernel");
}

}  // namespace

size_t naive_last_workspace_bytes() { return g_last_workspace_bytes.load(); }

}  // namespace ioattn::cuda

namespace ioattn::detail {

void cuda_naive_forward(const FwdProblem& p) {
  using namespace ioattn::cuda;
  DeviceGuard guard(p.device_index);
  const cudaStream_t st = static_cast<cudaStream_t>(p.stream);
  cublasHandle_t handle = cublas_handle(p.device_index);
  IOATTN_CUBLAS_CHECK(cublasSetStream(handle, st));
  const int64_t esz = dtype_size(p.dtype);
  const cudaDataType_t dt = cuda_type(p.dtype);
  const int64_t hq = p.heads_q, d = p.head_dim, dv = p.head_dim_v, grp = p.group();

  // Chunk size: as many heads as fit in 80% of the free memory (at least one).
  size_t free_b = 0, total_b = 0;
  IOATTN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const int64_t max_sq = p.seqlen_q, max_sk = p.seqlen_k;
  const int64_t per_head = std::max<int64_t>(max_sq * max_sk * (4 + esz), 1);
  const int64_t budget = static_cast<int64_t>(free_b * 0.8);
  if (max_sq > 0 && max_sk > 0 && per_head > budget)
    throw Error("q", "ioattn: the naive CUDA path needs " + std::to_string(per_head >> 20) +
                         " MiB for one head's S and P; " + std::to_string(free_b >> 20) + " MiB free");
  const int64_t nh_max = std::max<int64_t>(1, std::min<int64_t>(hq, budget / per_head));
  // Every per-head slab and every region starts on a 256-byte boundary: cuBLAS and the pointer
  // arrays need aligned bases (odd sq·sk·2 bytes once put the pointer array off 8-byte alignment).
  auto round_up = [](int64_t x, int64_t a) { return (x + a - 1) / a * a; };
  const int64_t slab_elems = round_up(std::max<int64_t>(max_sq * max_sk, 1), 128);  // per head
  const size_t s_bytes = static_cast<size_t>(nh_max * slab_elems * 4);
  const size_t p_bytes = static_cast<size_t>(round_up(nh_max * slab_elems * esz, 256));
  const size_t ptr_bytes = static_cast<size_t>(round_up(6 * nh_max * static_cast<int64_t>(sizeof(void*)), 256));
  const size_t ws_bytes = s_bytes + p_bytes + ptr_bytes;

  char* ws = nullptr;
  IOATTN_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ws), std::max<size_t>(ws_bytes, 256), st));
  g_last_workspace_bytes = ws_bytes;
  float* S = reinterpret_cast<float*>(ws);
  char* P = ws + s_bytes;
  const void** dptr = reinterpret_cast<const void**>(ws + s_bytes + p_bytes);  // 6 arrays of nh_max
  std::vector<const void*> hptr(static_cast<size_t>(6 * nh_max));

  const float one = 1.f, zero = 0.f, scale = p.scale;
  const char* qb = static_cast<const char*>(p.q);
  const char* kb = static_cast<const char*>(p.k);
  const char* vb = static_cast<const char*>(p.v);
  char* ob = static_cast<char*>(p.o);
  try {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t q0 = p.varlen() ? p.cu_seqlens_q_host[b] : 0;
      const int64_t k0 = p.varlen() ? p.cu_seqlens_k_host[b] : 0;
      const int64_t sq = p.varlen() ? p.cu_seqlens_q_host[b + 1] - q0 : p.seqlen_q;
      const int64_t sk = p.varlen() ? p.cu_seqlens_k_host[b + 1] - k0 : p.seqlen_k;
      if (sq == 0) continue;
      const char* q_b = qb + (b * p.q_stride.batch + q0 * p.q_stride.seq) * esz;
      const char* k_b = kb + (b * p.k_stride.batch + k0 * p.k_stride.seq) * esz;
      const char* v_b = vb + (b * p.v_stride.batch + k0 * p.v_stride.seq) * esz;
      char* o_b = ob + (b * p.o_stride.batch + q0 * p.o_stride.seq) * esz;
      float* lse_b = p.lse ? p.lse + b * p.lse_stride.batch + q0 * p.lse_stride.seq : nullptr;
      if (sk == 0) {
        if (p.dtype == DType::bf16) launch_empty_rows<__nv_bfloat16>(p, o_b, lse_b, static_cast<int>(sq), st);
        else if (p.dtype == DType::f16) launch_empty_rows<__half>(p, o_b, lse_b, static_cast<int>(sq), st);
        else launch_empty_rows<float>(p, o_b, lse_b, static_cast<int>(sq), st);
        continue;
      }
      const int64_t ldq = leading_dim(p.q_stride.seq, sq, d), ldk = leading_dim(p.k_stride.seq, sk, d);
      const int64_t ldv = leading_dim(p.v_stride.seq, sk, dv), ldo = leading_dim(p.o_stride.seq, sq, dv);
      for (int64_t h0 = 0; h0 < hq; h0 += nh_max) {
        const int64_t nh = std::min<int64_t>(nh_max, hq - h0);
        for (int64_t x = 0; x < nh; ++x) {
          const int64_t h = h0 + x, hk = h / grp;
          hptr[0 * nh_max + x] = k_b + hk * p.k_stride.head * esz;             // A of S^T = K Q^T
          hptr[1 * nh_max + x] = q_b + h * p.q_stride.head * esz;              // B
          hptr[2 * nh_max + x] = S + x * slab_elems;                           // C (fp32)
          hptr[3 * nh_max + x] = v_b + hk * p.v_stride.head * esz;             // A of O^T = V^T P^T
          hptr[4 * nh_max + x] = P + x * slab_elems * esz;                     // B
          hptr[5 * nh_max + x] = o_b + h * p.o_stride.head * esz;              // C (dtype)
        }
        // Pageable -> device async copy: returns once staged, so hptr may be rewritten after it;
        // stream order keeps it behind the previous chunk's GEMMs.
        IOATTN_CUDA_CHECK(cudaMemcpyAsync(dptr, hptr.data(), hptr.size() * sizeof(void*),
                                          cudaMemcpyHostToDevice, st));
        // 1. S^T (col-major sk x sq, ld sk) = K (d x sk col-major, transposed) · Q (d x sq col-major)
        IOATTN_CUBLAS_CHECK(cublasGemmBatchedEx(
            handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(sk), static_cast<int>(sq), static_cast<int>(d),
            &scale, dptr + 0 * nh_max, dt, static_cast<int>(ldk), dptr + 1 * nh_max, dt, static_cast<int>(ldq),
            &zero, const_cast<void* const*>(dptr + 2 * nh_max), CUDA_R_32F, static_cast<int>(sk),
            static_cast<int>(nh), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        // 2. P = softmax(S) row by row, LSE
        SoftmaxArgs a;
        a.s = S;
        a.p = P;
        a.slab = slab_elems;
        a.lse = lse_b;
        a.lse_head = p.lse_stride.head;
        a.lse_seq = p.lse_stride.seq;
        a.sq = static_cast<int>(sq);
        a.sk = static_cast<int>(sk);
        a.h0 = static_cast<int>(h0);
        a.softcap = p.softcap;
        a.window_left = p.window_left;
        a.window_right = p.window_right;
        a.alibi = p.alibi_slopes;
        a.sinks = p.sinks;
        if (p.dtype == DType::bf16) launch_softmax<__nv_bfloat16>(a, static_cast<int>(nh), st);
        else if (p.dtype == DType::f16) launch_softmax<__half>(a, static_cast<int>(nh), st);
        else launch_softmax<float>(a, static_cast<int>(nh), st);
        // 3. O^T (col-major dv x sq, ld o_seq) = V^T (dv x sk col-major) · P^T (sk x sq col-major, ld sk)
        IOATTN_CUBLAS_CHECK(cublasGemmBatchedEx(
            handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(dv), static_cast<int>(sq), static_cast<int>(sk),
            &one, dptr + 3 * nh_max, dt, static_cast<int>(ldv), dptr + 4 * nh_max, dt, static_cast<int>(sk),
            &zero, const_cast<void* const*>(dptr + 5 * nh_max), dt, static_cast<int>(ldo), static_cast<int>(nh),
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
    }
  } catch (...) {
    cudaFreeAsync(ws, st);
    throw;
  }
  IOATTN_CUDA_CHECK(cudaFreeAsync(ws, st));
}

}  // namespace ioattn::detail

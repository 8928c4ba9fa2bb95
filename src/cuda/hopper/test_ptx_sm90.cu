// test_ptx_sm90.cu — GPU unit tests of every wrapper in ptx_sm90.cuh (ioattn_test_ptx_sm90).
//
// Each test is a tiny kernel checked against the CPU:
//   mbarrier      init / arrive / try_wait.parity across two phase flips
//   cp_async_mbarrier_arrive_noinc  cp.async arrivals (and a plain one) complete a phase whose
//                 waiter, which issued no copy, then sees every copied value; and mixed with
//                 expect_tx + a bulk copy on 2 stages over 3 phases each, refills gated by an
//                 empty barrier (the wgmma backward's pp protocol)
//   tma_2d        a box copied without swizzle equals memcpy of the same rows
//   tma_3d/4d     boxes with 128-byte swizzle, un-swizzled by the formula the wgmma tests assume,
//                 including rows past the end (must read as zeros) and a [b,s,h,d] stride order
//   wgmma_ss      S = A B^T, A by TMA, B written by threads (+ fence.proxy.async), K-major SW128,
//                 for (N, K) = (128, 128), (80, 256), (64, 64): the D fragment layout
//   wgmma_chain   S = Q K^T (ss), P = bf16(S) repacked in registers, O = P V (rs, V MN-major):
//                 exactly the flash kernel's data path
//   wgmma_rs      D = A V with A loaded into the register fragment, N = 256 over 4 column blocks
//   setmaxnreg + named barriers: 3 warpgroups, register rebalancing, ping-pong ordering; and
//                 4 warpgroups (3 consumers at 160 registers), round-robin ordering
//   claim_tile    the dynamic scheduler (sched_sm90.cuh) with the kernel's handshake: a producer
//                 thread per CTA claims tiles from an atomic counter and announces each through a
//                 shared slot + mbarriers (plain arrivals, as for key-less tiles and the end
//                 marker); every tile must reach every consumer warp of exactly one CTA
//   tma_reduce    cp.reduce.async.bulk.tensor add of fp32 SW128 boxes from 3 CTAs into one tensor
//                 (per-element atomic sums, rows past the bound skipped, a buffer reused after
//                 bulk_wait_group_read): the wgmma backward's dQ path
//   exp2_approx   against exp2
//   pack4_e4m3    cvt.rn.satfinite.e4m3x2.f32 x2: byte order, rounding, saturation vs the host encoder
//   fp8_p_key     a permutation of 0..31
//   wgmma fp8     S = Q K^T (WgmmaFp8 ss, Q and K by UINT8 TMA maps, SW128 at hdim 128, SW64 +
//                 make_desc_sw64 at hdim 64), P = e4m3 by fp8_p_fragment, O = P V (WgmmaFp8 rs,
//                 V^T K-major in the fp8_p_key order): the fp8 kernel's data path
// Prints "ok"/"FAIL" per test and "N passed, M failed"; exit 1 on any failure.
// Without a CUDA device it prints "skipped: no CUDA device" and exits 0.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/hopper/ptx_sm90.cuh"
#include "cuda/hopper/sched_sm90.cuh"
#include "cpu/serving_quant.h"  // host e4m3 encode / decode (round to nearest even, satfinite)

using namespace ioattn::cuda::sm90;

#define CHECK_CUDA(call)                                                                                        \
  do {                                                                                                          \
    cudaError_t e_ = (call);                                                                                    \
    if (e_ != cudaSuccess) {                                                                                    \
      std::printf("FAIL CUDA error %s at %s:%d: %s\n", #call, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                                             \
    }                                                                                                           \
  } while (0)

namespace {

int g_pass = 0, g_fail = 0;
void report(const char* name, bool ok, const std::string& detail = "") {
  std::printf("%s %-28s %s\n", ok ? "ok  " : "FAIL", name, detail.c_str());
  (ok ? g_pass : g_fail)++;
}

float bf(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t to_bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
std::vector<uint16_t> random_bf16(size_t n, float range, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-range, range);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = to_bf(d(rng));
  return v;
}
template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, h.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !f) {
      std::printf("FAIL no cuTensorMapEncodeTiled\n");
      std::exit(1);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// Tensor map of rank r (bf16 unless `type` says otherwise); dims innermost first, strides in bytes
// for dims 1..r-1.
CUtensorMap make_map(const void* ptr, int rank, const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                     bool swizzle, CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
  CUtensorMap m{};
  cuuint64_t d[5], s[4];
  cuuint32_t b[5], e[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    e[i] = 1;
    if (i + 1 < rank) s[i] = strides[i];
  }
  CUresult r = encoder()(&m, type, rank, const_cast<void*>(ptr), d, s, b, e,
                         CU_TENSOR_MAP_INTERLEAVE_NONE,
                         swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                         CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("FAIL cuTensorMapEncodeTiled: %d\n", (int)r);
    std::exit(1);
  }
  return m;
}

// Byte offset of element (row, col) of a 64-column block stored with the 128-byte swizzle.
__host__ __device__ inline uint32_t swz(int row, int col) {
  const int chunk = (col * 2) / 16, in_chunk = (col * 2) % 16;
  return row * 128 + ((chunk ^ (row % 8)) * 16) + in_chunk;
}

__device__ inline uint8_t* align1024(uint8_t* p) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + 1023) & ~uintptr_t(1023));
}

// ---------------------------------------------------------------- mbarrier
__global__ void k_mbarrier(int* out) {
#if IOATTN_SM90A_ENABLED
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, blockDim.x);
    fence_mbarrier_init();
  }
  __syncthreads();
  // Fresh barrier: parity 1 ("previous phase") passes, parity 0 does not.
  if (threadIdx.x == 0) {
    out[0] = mbarrier_try_wait(&bar, 1);
    out[1] = mbarrier_try_wait(&bar, 0);
  }
  __syncthreads();
  mbarrier_arrive(&bar);
  mbarrier_wait(&bar, 0);  // phase 0 completes when all threads arrived
  if (threadIdx.x == 0) {
    out[2] = mbarrier_try_wait(&bar, 0);
    out[3] = mbarrier_try_wait(&bar, 1);  // phase 1 still open
  }
  __syncthreads();
  mbarrier_arrive(&bar);
  mbarrier_wait(&bar, 1);
  if (threadIdx.x == 0) out[4] = mbarrier_try_wait(&bar, 1);
#endif
}

void test_mbarrier() {
  int* d;
  CHECK_CUDA(cudaMalloc(&d, 8 * sizeof(int)));
  CHECK_CUDA(cudaMemset(d, 0xff, 8 * sizeof(int)));
  k_mbarrier<<<1, 96>>>(d);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  auto h = to_host(d, 8);
  const bool ok = h[0] == 1 && h[1] == 0 && h[2] == 1 && h[3] == 0 && h[4] == 1;
  char buf[96];
  std::snprintf(buf, sizeof buf, "try_wait answers %d %d %d %d %d (want 1 0 1 0 1)", h[0], h[1], h[2], h[3], h[4]);
  report("mbarrier", ok, buf);
  CHECK_CUDA(cudaFree(d));
}

// ---------------------------------------------------------------- cp.async + mbarrier arrive
// 64 threads each copy one float with cp.async and arrive (noinc) on a barrier of count 64 + 1;
// one more thread writes its value with st.shared and arrives plainly. The last warp waits on
// the phase (it issued no copy itself) and reads all 65 values: the phase completes only when
// every copy has landed, and the bytes are visible to the waiter.
__global__ void k_cp_async_arrive(const float* src, float* out) {
#if IOATTN_SM90A_ENABLED
  __shared__ float s[65];
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 65);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 64) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(&s[threadIdx.x])), "l"(src + threadIdx.x)
                 : "memory");
    cp_async_mbarrier_arrive_noinc(&bar);
  } else if (threadIdx.x == 64) {
    s[64] = 7.5f;
    mbarrier_arrive(&bar);
  } else if (threadIdx.x >= 96) {
    mbarrier_wait_or_trap(&bar, 0);
    for (int i = threadIdx.x - 96; i < 65; i += 32) out[i] = s[i];
  }
#endif
}

void test_cp_async_arrive() {
  std::vector<float> h(64);
  for (int i = 0; i < 64; ++i) h[i] = 1.0f + 0.25f * static_cast<float>(i);
  float *src, *out;
  CHECK_CUDA(cudaMalloc(&src, 64 * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&out, 65 * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(src, h.data(), 64 * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(out, 0xff, 65 * sizeof(float)));
  k_cp_async_arrive<<<1, 128>>>(src, out);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> o(65);
  CHECK_CUDA(cudaMemcpy(o.data(), out, 65 * sizeof(float), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int i = 0; i < 64; ++i) bad += o[i] != h[i];
  bad += o[64] != 7.5f;
  char buf[96];
  std::snprintf(buf, sizeof buf, "%d of 65 values wrong after the phase", bad);
  report("cp_async_mbarrier_arrive_noinc", bad == 0, buf);
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(out));
}

// The wgmma backward's pp protocol in small: 2 stages refilled over 6 steps by warpgroup 1 (thread
// 128: arrive.expect_tx + a 1 KiB bulk copy; threads 128..191: one float each by cp.async + noinc
// arrival, the last 4 by st.shared + a plain arrival) onto full[stage] (count 1 + 64); warpgroup 0
// waits on the phase, checks everything, and each of its warps arrives on empty[stage] (count 4),
// which the loaders wait on before refilling. out[0] counts wrong values, out[1] steps seen.
__global__ void k_cp_async_arrive_stages(const float* bulk, const float* small, int* out) {
#if IOATTN_SM90A_ENABLED
  constexpr int kSteps = 6;
  __shared__ __align__(128) float s_bulk[2][256];
  __shared__ float s_small[2][64];
  __shared__ uint64_t full[2], empty[2];
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int i = 0; i < 2; ++i) mbarrier_init(&full[i], 65), mbarrier_init(&empty[i], 4);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (tid >= 128) {
    if (tid >= 192) return;
    const int r = tid - 128;
    for (int step = 0; step < kSteps; ++step) {
      const int st = step & 1;
      if (step >= 2) mbarrier_wait_or_trap(&empty[st], ((step - 2) >> 1) & 1);
      if (r == 0) {
        mbarrier_arrive_expect_tx(&full[st], 1024);
        bulk_load_1d(s_bulk[st], bulk + step * 256, 1024, &full[st]);
      }
      if (r < 60) {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(&s_small[st][r])),
                     "l"(small + step * 64 + r)
                     : "memory");
        cp_async_mbarrier_arrive_noinc(&full[st]);
      } else {
        s_small[st][r] = -1.0f - static_cast<float>(step * 64 + r);
        mbarrier_arrive(&full[st]);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  int bad = 0;
  for (int step = 0; step < kSteps; ++step) {
    const int st = step & 1;
    mbarrier_wait_or_trap(&full[st], (step >> 1) & 1);
    bad += s_bulk[st][tid] != bulk[step * 256 + tid];
    bad += s_bulk[st][tid + 128] != bulk[step * 256 + tid + 128];
    const int r = tid & 63;
    const float want = r < 60 ? small[step * 64 + r] : -1.0f - static_cast<float>(step * 64 + r);
    bad += s_small[st][r] != want;
    __syncwarp();
    if ((tid & 31) == 0) mbarrier_arrive(&empty[st]);
  }
  atomicAdd(&out[0], bad);
  if (tid == 0) atomicAdd(&out[1], kSteps);
#endif
}

void test_cp_async_arrive_stages() {
  std::vector<float> hb(6 * 256), hs(6 * 64);
  for (size_t i = 0; i < hb.size(); ++i) hb[i] = 0.5f * static_cast<float>(i) + 3.0f;
  for (size_t i = 0; i < hs.size(); ++i) hs[i] = 1000.0f + static_cast<float>(i);
  float *bulk, *small;
  int* out;
  CHECK_CUDA(cudaMalloc(&bulk, hb.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&small, hs.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&out, 2 * sizeof(int)));
  CHECK_CUDA(cudaMemcpy(bulk, hb.data(), hb.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(small, hs.data(), hs.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(out, 0, 2 * sizeof(int)));
  k_cp_async_arrive_stages<<<1, 256>>>(bulk, small, out);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  auto h = to_host(out, 2);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%d wrong values, %d steps (want 0, 6)", h[0], h[1]);
  report("cp_async_arrive + tma expect_tx, 2 stages x 3 phases", h[0] == 0 && h[1] == 6, buf);
  CHECK_CUDA(cudaFree(bulk));
  CHECK_CUDA(cudaFree(small));
  CHECK_CUDA(cudaFree(out));
}

// ---------------------------------------------------------------- bulk copy (1-D)
// Two bulk copies of different sizes (a 16 KiB stage, then 256 + 48 bytes at odd 16-byte
// offsets) complete one barrier phase each; the shared copy is written back and compared.
__global__ void k_bulk(const uint8_t* src, uint8_t* out) {
#if IOATTN_SM90A_ENABLED
  __shared__ __align__(128) uint8_t s[16384];
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&bar, 16384);
    bulk_load_1d(s, src, 16384, &bar);
  }
  mbarrier_wait_or_trap(&bar, 0);
  for (int i = threadIdx.x; i < 16384; i += blockDim.x) out[i] = s[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&bar, 256 + 48);
    bulk_load_1d(s + 16, src + 16384 + 32, 256, &bar);
    bulk_load_1d(s + 512, src + 16384 + 1008, 48, &bar);
  }
  mbarrier_wait_or_trap(&bar, 1);
  for (int i = threadIdx.x; i < 256; i += blockDim.x) out[16384 + i] = s[16 + i];
  for (int i = threadIdx.x; i < 48; i += blockDim.x) out[16384 + 256 + i] = s[512 + i];
#endif
}

void test_bulk() {
  const int n_src = 16384 + 2048, n_out = 16384 + 256 + 48;
  std::vector<uint8_t> h(n_src);
  for (int i = 0; i < n_src; ++i) h[i] = static_cast<uint8_t>(i * 37 + (i >> 8));
  uint8_t *src, *out;
  CHECK_CUDA(cudaMalloc(&src, n_src));
  CHECK_CUDA(cudaMalloc(&out, n_out));
  CHECK_CUDA(cudaMemcpy(src, h.data(), n_src, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(out, 0, n_out));
  k_bulk<<<1, 128>>>(src, out);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> o(n_out);
  CHECK_CUDA(cudaMemcpy(o.data(), out, n_out, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int i = 0; i < 16384; ++i) bad += o[i] != h[i];
  for (int i = 0; i < 256; ++i) bad += o[16384 + i] != h[16384 + 32 + i];
  for (int i = 0; i < 48; ++i) bad += o[16384 + 256 + i] != h[16384 + 1008 + i];
  char buf[96];
  std::snprintf(buf, sizeof buf, "%d of %d bytes differ", bad, n_out);
  report("bulk_load_1d", bad == 0, buf);
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(out));
}

// ---------------------------------------------------------------- TMA
// Copies a box into shared memory with TMA and writes it back un-swizzled, row-major
// (rows x 64 columns per column block, cblocks blocks).
template <int kRank>
__global__ void k_tma(const __grid_constant__ CUtensorMap map, int c0, int c1, int c2, int c3, int rows, int cblocks,
                      bool swizzled, uint16_t* out) {
#if IOATTN_SM90A_ENABLED
  extern __shared__ uint8_t raw[];
  uint8_t* s = align1024(raw);
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  const uint32_t block_bytes = rows * 128;
  if (threadIdx.x == 0) {
    tma_prefetch_map(&map);
    mbarrier_arrive_expect_tx(&bar, block_bytes * cblocks);
    for (int c = 0; c < cblocks; ++c) {
      if (kRank == 2) tma_load_2d(s + c * block_bytes, &map, &bar, c0 + 64 * c, c1);
      if (kRank == 3) tma_load_3d(s + c * block_bytes, &map, &bar, c0 + 64 * c, c1, c2);
      if (kRank == 4) tma_load_4d(s + c * block_bytes, &map, &bar, c0 + 64 * c, c1, c2, c3);
    }
  }
  mbarrier_wait(&bar, 0);
  for (int i = threadIdx.x; i < rows * 64 * cblocks; i += blockDim.x) {
    const int c = i / (rows * 64), r = (i / 64) % rows, col = i % 64;
    const uint32_t off = swizzled ? swz(r, col) : r * 128 + col * 2;
    out[(size_t)r * 64 * cblocks + c * 64 + col] = *reinterpret_cast<const uint16_t*>(s + c * block_bytes + off);
  }
#endif
}

// want(r, col) for a box of `rows` x (64*cblocks) starting at logical (row0, col0).
template <typename Want>
bool compare_box(const std::vector<uint16_t>& got, int rows, int cols, Want want, std::string* detail) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      if (got[(size_t)r * cols + c] != want(r, c)) {
        char buf[128];
        std::snprintf(buf, sizeof buf, "mismatch at (%d, %d): got %04x want %04x", r, c, got[(size_t)r * cols + c],
                      want(r, c));
        *detail = buf;
        return false;
      }
  return true;
}

void test_tma() {
  const int smem = 64 * 1024;
  // 2D, no swizzle: tensor [100 rows][128 cols], box (64 cols, 16 rows) at (64, 3).
  {
    auto h = random_bf16(100 * 128, 1.0f, 1);
    auto* d = to_device(h);
    const uint64_t dims[2] = {128, 100}, strides[1] = {128 * 2};
    const uint32_t box[2] = {64, 16};
    CUtensorMap m = make_map(d, 2, dims, strides, box, false);
    uint16_t* out;
    CHECK_CUDA(cudaMalloc(&out, 16 * 64 * 2));
    CHECK_CUDA(cudaFuncSetAttribute(k_tma<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    k_tma<2><<<1, 128, smem>>>(m, 64, 3, 0, 0, 16, 1, false, out);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    auto got = to_host(out, 16 * 64);
    std::string detail;
    const bool ok = compare_box(got, 16, 64, [&](int r, int c) { return h[(3 + r) * 128 + 64 + c]; }, &detail);
    report("tma_2d (no swizzle)", ok, detail);
    CHECK_CUDA(cudaFree(d));
    CHECK_CUDA(cudaFree(out));
  }
  // 3D, 128B swizzle: tensor [6][100][128], box (64, 32, 1) x 2 column blocks at (0, 90, 5):
  // rows 100.. are out of bounds and must be zero.
  {
    auto h = random_bf16(6 * 100 * 128, 1.0f, 2);
    auto* d = to_device(h);
    const uint64_t dims[3] = {128, 100, 6}, strides[2] = {128 * 2, 100 * 128 * 2};
    const uint32_t box[3] = {64, 32, 1};
    CUtensorMap m = make_map(d, 3, dims, strides, box, true);
    uint16_t* out;
    CHECK_CUDA(cudaMalloc(&out, 32 * 128 * 2));
    CHECK_CUDA(cudaFuncSetAttribute(k_tma<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    k_tma<3><<<1, 128, smem>>>(m, 0, 90, 5, 0, 32, 2, true, out);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    auto got = to_host(out, 32 * 128);
    std::string detail;
    const bool ok = compare_box(got, 32, 128, [&](int r, int c) -> uint16_t {
      return 90 + r < 100 ? h[(5 * 100 + 90 + r) * 128 + c] : 0;
    }, &detail);
    report("tma_3d (swizzle 128B, OOB)", ok, detail);
    CHECK_CUDA(cudaFree(d));
    CHECK_CUDA(cudaFree(out));
  }
  // 4D over a [b=2][s=100][h=3][d=128] tensor as (d, s, h, b): the flash kernel's map.
  // Box (64, 64, 1, 1) x 2 column blocks at (0, 64, 2, 1); rows 100.. are zero.
  {
    auto h = random_bf16(2 * 100 * 3 * 128, 1.0f, 3);
    auto* d = to_device(h);
    const uint64_t dims[4] = {128, 100, 3, 2}, strides[3] = {3 * 128 * 2, 128 * 2, 100 * 3 * 128 * 2};
    const uint32_t box[4] = {64, 64, 1, 1};
    CUtensorMap m = make_map(d, 4, dims, strides, box, true);
    uint16_t* out;
    CHECK_CUDA(cudaMalloc(&out, 64 * 128 * 2));
    CHECK_CUDA(cudaFuncSetAttribute(k_tma<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    k_tma<4><<<1, 128, smem>>>(m, 0, 64, 2, 1, 64, 2, true, out);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    auto got = to_host(out, 64 * 128);
    std::string detail;
    const bool ok = compare_box(got, 64, 128, [&](int r, int c) -> uint16_t {
      const int s = 64 + r;
      return s < 100 ? h[((1 * 100 + s) * 3 + 2) * 128 + c] : 0;
    }, &detail);
    report("tma_4d (bshd strides, OOB)", ok, detail);
    CHECK_CUDA(cudaFree(d));
    CHECK_CUDA(cudaFree(out));
  }
}

// ---------------------------------------------------------------- wgmma
// Writes a 64 x N fp32 D fragment to out[64][N] (row-major) by the documented layout.
template <int N>
__device__ void store_d(const float (&d)[N / 2], float* out) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  const int r = 16 * w + l / 4, c = 2 * (l % 4);
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    out[r * N + 8 * i + c] = d[4 * i];
    out[r * N + 8 * i + c + 1] = d[4 * i + 1];
    out[(r + 8) * N + 8 * i + c] = d[4 * i + 2];
    out[(r + 8) * N + 8 * i + c + 1] = d[4 * i + 3];
  }
}

// S (64 x N) = A (64 x K) B^T, B given as [N][K]. A by TMA (map over [64][K], box 64x64);
// B stored by the threads with the swizzle formula, then fence.proxy.async.
template <int N, int K>
__global__ void k_wgmma_ss(const __grid_constant__ CUtensorMap map_a, const uint16_t* b, float* out) {
#if IOATTN_SM90A_ENABLED
  extern __shared__ uint8_t raw[];
  uint8_t* sa = align1024(raw);           // K/64 blocks of [64 x 128B]
  uint8_t* sb = sa + 64 * K * 2;          // K/64 blocks of [N x 128B]
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&bar, 64 * K * 2);
    for (int c = 0; c < K / 64; ++c) tma_load_2d(sa + c * 64 * 128, &map_a, &bar, 64 * c, 0);
  }
  for (int i = threadIdx.x; i < N * K; i += blockDim.x) {
    const int n = i / K, k = i % K;
    *reinterpret_cast<uint16_t*>(sb + (k / 64) * N * 128 + swz(n, k % 64)) = b[i];
  }
  fence_proxy_async();
  __syncthreads();
  mbarrier_wait(&bar, 0);
  float d[N / 2];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const uint32_t col = kk / 4, byte = (kk % 4) * 32;
    const uint64_t da = make_desc_sw128(smem_u32(sa) + col * 64 * 128 + byte, 16, 1024);
    const uint64_t db = make_desc_sw128(smem_u32(sb) + col * N * 128 + byte, 16, 1024);
    Wgmma<N, __nv_bfloat16>::template ss<0>(d, da, db, kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) reg_fence(d[i]);
  store_d<N>(d, out);
#endif
}

// got (64 x N) against A (64 x K, row-major bf16) times B in float64; b_nk(n, k) is B's element
// (k, n) as bf16 bits, so one check serves B stored [N][K] and [K][N].
template <int N, int K, class BAt>
void check_ab(const char* name, const std::vector<uint16_t>& a, BAt b_nk, const std::vector<float>& got) {
  double max_err = 0;
  for (int r = 0; r < 64; ++r)
    for (int n = 0; n < N; ++n) {
      double ref = 0;
      for (int k = 0; k < K; ++k) ref += double(bf(a[r * K + k])) * bf(b_nk(n, k));
      max_err = std::max(max_err, std::fabs(ref - got[r * N + n]));
    }
  char buf[64];
  std::snprintf(buf, sizeof buf, "max |err| %.2e", max_err);
  report(name, max_err < 1e-3, buf);
}

template <int N, int K>
void test_wgmma_ss(const char* name) {
  auto a = random_bf16(64 * K, 1.0f, 10 + N), b = random_bf16(N * K, 1.0f, 20 + K);
  auto* da = to_device(a);
  auto* db = to_device(b);
  const uint64_t dims[2] = {K, 64}, strides[1] = {K * 2};
  const uint32_t box[2] = {64, 64};
  CUtensorMap m = make_map(da, 2, dims, strides, box, true);
  float* out;
  CHECK_CUDA(cudaMalloc(&out, 64 * N * 4));
  const int smem = (64 + N) * K * 2 + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(k_wgmma_ss<N, K>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k_wgmma_ss<N, K><<<1, 128, smem>>>(m, db, out);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  check_ab<N, K>(name, a, [&](int n, int k) { return b[n * K + k]; }, to_host(out, 64 * N));
  CHECK_CUDA(cudaFree(da));
  CHECK_CUDA(cudaFree(db));
  CHECK_CUDA(cudaFree(out));
}

// Transposed A (kTransA = 1): D (64 x N) = A (64 x K) B^T with A stored MN-major, i.e. A^T as K
// rows of 64 M-values (128 bytes, 128-byte swizzle), 8-row groups 1024 bytes apart, k-steps of
// 16 rows = 2048 bytes (the layout of dS^T for dQ = dS K in a backward); B as in k_wgmma_ss.
template <int N, int K>
__global__ void k_wgmma_ss_ta(const uint16_t* a, const uint16_t* b, float* out) {
#if IOATTN_SM90A_ENABLED
  extern __shared__ uint8_t raw[];
  uint8_t* sa = align1024(raw);  // [K rows x 128B]
  uint8_t* sb = sa + K * 128;    // K/64 blocks of [N x 128B]
  for (int i = threadIdx.x; i < 64 * K; i += blockDim.x) {
    const int m = i / K, k = i % K;
    *reinterpret_cast<uint16_t*>(sa + swz(k, m)) = a[i];
  }
  for (int i = threadIdx.x; i < N * K; i += blockDim.x) {
    const int n = i / K, k = i % K;
    *reinterpret_cast<uint16_t*>(sb + (k / 64) * N * 128 + swz(n, k % 64)) = b[i];
  }
  fence_proxy_async();
  __syncthreads();
  float d[N / 2];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const uint64_t da = make_desc_sw128(smem_u32(sa) + kk * 2048, 64 * 128, 1024);
    const uint64_t db = make_desc_sw128(smem_u32(sb) + (kk / 4) * N * 128 + (kk % 4) * 32, 16, 1024);
    Wgmma<N, __nv_bfloat16>::template ss<0, 1>(d, da, db, kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) reg_fence(d[i]);
  store_d<N>(d, out);
#endif
}

template <int N, int K>
void test_wgmma_ss_ta(const char* name) {
  auto a = random_bf16(64 * K, 1.0f, 30 + N), b = random_bf16(N * K, 1.0f, 40 + K);
  auto* da = to_device(a);
  auto* db = to_device(b);
  float* out;
  CHECK_CUDA(cudaMalloc(&out, 64 * N * 4));
  const int smem = (64 + N) * K * 2 + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(k_wgmma_ss_ta<N, K>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k_wgmma_ss_ta<N, K><<<1, 128, smem>>>(da, db, out);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  check_ab<N, K>(name, a, [&](int n, int k) { return b[n * K + k]; }, to_host(out, 64 * N));
  CHECK_CUDA(cudaFree(da));
  CHECK_CUDA(cudaFree(db));
  CHECK_CUDA(cudaFree(out));
}

// The flash data path: S = Q K^T (Q 64x128, K 128x128, ss), P = bf16(S) as register pairs,
// O = P V (V [128 keys][128 dims] by TMA, MN-major, rs).
__global__ void k_wgmma_chain(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                              const __grid_constant__ CUtensorMap map_v, float* out_s, float* out_o) {
#if IOATTN_SM90A_ENABLED
  constexpr int kD = 128, kN = 128;
  extern __shared__ uint8_t raw[];
  uint8_t* sq = align1024(raw);   // 2 blocks [64 x 128B]
  uint8_t* sk = sq + 64 * kD * 2;  // 2 blocks [128 x 128B]
  uint8_t* sv = sk + kN * kD * 2;  // 2 blocks [128 keys x 128B]
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&bar, (64 + 2 * kN) * kD * 2);
    for (int c = 0; c < 2; ++c) {
      tma_load_2d(sq + c * 64 * 128, &map_q, &bar, 64 * c, 0);
      tma_load_2d(sk + c * kN * 128, &map_k, &bar, 64 * c, 0);
      tma_load_2d(sv + c * kN * 128, &map_v, &bar, 64 * c, 0);
    }
  }
  mbarrier_wait(&bar, 0);
  float s[kN / 2];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t col = kk / 4, byte = (kk % 4) * 32;
    Wgmma<kN, __nv_bfloat16>::ss<0>(s, make_desc_sw128(smem_u32(sq) + col * 64 * 128 + byte, 16, 1024),
                                    make_desc_sw128(smem_u32(sk) + col * kN * 128 + byte, 16, 1024), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) reg_fence(s[i]);
  store_d<kN>(s, out_s);
  uint32_t pf[kN / 4];
#pragma unroll
  for (int j = 0; j < kN / 4; ++j) pf[j] = pack2<__nv_bfloat16>(s[2 * j], s[2 * j + 1]);
  float o[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    const uint32_t a[4] = {pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3]};
    Wgmma<kD, __nv_bfloat16>::rs<1>(o, a, make_desc_sw128(smem_u32(sv) + kk * 16 * 128, kN * 128, 1024), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) reg_fence(o[i]);
  store_d<kD>(o, out_o);
#endif
}

// The data path of a Hopper backward for one (64 keys x 64 query rows) block, one warpgroup,
// hdim 128, keys as the M dimension (FA3's order): S^T = K Q^T and dP^T = V dO^T (ss), P^T =
// exp2(S^T * scale * log2 e - LSE * log2 e) and dS^T = P^T (dP^T - D) in registers, dV = P^T dO and
// dK = dS^T Q (rs: A from the accumulators, B = dO / Q MN-major), dS^T stored to shared memory
// and dQ = dS K (ss with both operands MN-major: A = dS^T transposed, B = K). Every operand
// layout a wgmma backward needs, checked against a float64 reference that rounds P and dS to
// bf16 where the kernel does. Operands are stored by the threads with the 128-byte swizzle.
__global__ void k_wgmma_bwd_chain(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout,
                                  const float* lse, const float* dsum, float scale, float* out_dv, float* out_dk,
                                  float* out_dq) {
#if IOATTN_SM90A_ENABLED
  constexpr int kD = 128, kM = 64, kN = 64;  // head dim, keys (M), query rows (N)
  extern __shared__ uint8_t raw[];
  uint8_t* sq = align1024(raw);     // [64 rows] x 2 column blocks of 128 B
  uint8_t* sk = sq + kN * kD * 2;   // [64 keys] x 2 blocks
  uint8_t* sv = sk + kM * kD * 2;   // [64 keys] x 2 blocks
  uint8_t* sdo = sv + kM * kD * 2;  // [64 rows] x 2 blocks
  uint8_t* sds = sdo + kN * kD * 2; // dS^T: [64 keys (K-rows of dQ = dS K)] x 64 rows (M-values), 128 B
  __shared__ float s_lse[kN], s_d[kN];
  auto put = [](uint8_t* base, int rows, const uint16_t* src) {
    for (int i = threadIdx.x; i < rows * kD; i += blockDim.x) {
      const int r = i / kD, c = i % kD;
      *reinterpret_cast<uint16_t*>(base + (c / 64) * rows * 128 + swz(r, c % 64)) = src[i];
    }
  };
  put(sq, kN, q);
  put(sk, kM, k);
  put(sv, kM, v);
  put(sdo, kN, dout);
  if (threadIdx.x < kN) s_lse[threadIdx.x] = lse[threadIdx.x] * 1.4426950408889634f, s_d[threadIdx.x] = dsum[threadIdx.x];
  fence_proxy_async();
  __syncthreads();
  const int w = threadIdx.x / 32, l = threadIdx.x % 32, g = l / 4, t = l % 4;

  // S^T = K Q^T and dP^T = V dO^T: both operands K-major (head dim contiguous).
  float st[kN / 2], dpt[kN / 2];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t col = kk / 4, byte = (kk % 4) * 32;
    Wgmma<kN, __nv_bfloat16>::ss<0>(st, make_desc_sw128(smem_u32(sk) + col * kM * 128 + byte, 16, 1024),
                                    make_desc_sw128(smem_u32(sq) + col * kN * 128 + byte, 16, 1024), kk > 0);
    Wgmma<kN, __nv_bfloat16>::ss<0>(dpt, make_desc_sw128(smem_u32(sv) + col * kM * 128 + byte, 16, 1024),
                                    make_desc_sw128(smem_u32(sdo) + col * kN * 128 + byte, 16, 1024), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) reg_fence(st[i]), reg_fence(dpt[i]);

  // Fragment element e of st: key 16w + g (+8 for e % 4 >= 2), query row 8 (e / 4) + 2t + (e % 2).
  uint32_t pa[kN / 4], dsa[kN / 4];
  const float sl2 = scale * 1.4426950408889634f;
#pragma unroll
  for (int j = 0; j < kN / 4; ++j) {
    float pv[2], dsv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int e = 2 * j + h, row = 8 * (e / 4) + 2 * t + (e % 2);
      pv[h] = exp2f(st[e] * sl2 - s_lse[row]);
      dsv[h] = pv[h] * (dpt[e] - s_d[row]);
    }
    pa[j] = pack2<__nv_bfloat16>(pv[0], pv[1]);
    dsa[j] = pack2<__nv_bfloat16>(dsv[0], dsv[1]);
    // dS^T to shared memory as the MN-major A of dQ = dS K: (key, row) at swz(key, row).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int e = 2 * j + h, row = 8 * (e / 4) + 2 * t + (e % 2), key = 16 * w + g + ((e % 4) >= 2 ? 8 : 0);
      *reinterpret_cast<uint16_t*>(sds + swz(key, row)) = static_cast<uint16_t>(h ? dsa[j] >> 16 : dsa[j] & 0xffffu);
    }
  }
  fence_proxy_async();
  __syncthreads();

  // dV = P^T dO, dK = dS^T Q: A from registers (k-step kk = query rows 16kk..), B MN-major.
  float dv[kD / 2], dk[kD / 2], dq[kD / 2];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    const uint32_t ap[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
    const uint32_t ad[4] = {dsa[4 * kk], dsa[4 * kk + 1], dsa[4 * kk + 2], dsa[4 * kk + 3]};
    Wgmma<kD, __nv_bfloat16>::rs<1>(dv, ap, make_desc_sw128(smem_u32(sdo) + kk * 2048, kN * 128, 1024), kk > 0);
    Wgmma<kD, __nv_bfloat16>::rs<1>(dk, ad, make_desc_sw128(smem_u32(sq) + kk * 2048, kN * 128, 1024), kk > 0);
  }
  // dQ = dS K: A = dS^T read transposed (k-step = keys 16kk..), B = K MN-major.
#pragma unroll
  for (int kk = 0; kk < kM / 16; ++kk)
    Wgmma<kD, __nv_bfloat16>::ss<1, 1>(dq, make_desc_sw128(smem_u32(sds) + kk * 2048, kN * 128, 1024),
                                       make_desc_sw128(smem_u32(sk) + kk * 2048, kM * 128, 1024), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) reg_fence(dv[i]), reg_fence(dk[i]), reg_fence(dq[i]);
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) dk[i] *= scale, dq[i] *= scale;
  store_d<kD>(dv, out_dv);
  store_d<kD>(dk, out_dk);
  store_d<kD>(dq, out_dq);
  (void)w;
#endif
}

void test_wgmma_bwd_chain() {
  constexpr int kD = 128, kM = 64, kN = 64;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  auto q = random_bf16(kN * kD, 1.0f, 51), k = random_bf16(kM * kD, 1.0f, 52), v = random_bf16(kM * kD, 1.0f, 53),
       dout = random_bf16(kN * kD, 1.0f, 54);
  // Reference forward in float64: S, LSE, P, O; D = rowsum(dO o O).
  std::vector<double> S(kN * kM), P(kN * kM), O(kN * kD, 0.0);
  std::vector<float> lse(kN), dsum(kN);
  for (int i = 0; i < kN; ++i) {
    double mx = -1e300;
    for (int j = 0; j < kM; ++j) {
      double x = 0;
      for (int c = 0; c < kD; ++c) x += double(bf(q[i * kD + c])) * bf(k[j * kD + c]);
      S[i * kM + j] = x * scale;
      mx = std::max(mx, S[i * kM + j]);
    }
    double sum = 0;
    for (int j = 0; j < kM; ++j) sum += std::exp(S[i * kM + j] - mx);
    lse[i] = static_cast<float>(mx + std::log(sum));
    for (int j = 0; j < kM; ++j) P[i * kM + j] = std::exp(S[i * kM + j] - lse[i]);
    for (int j = 0; j < kM; ++j)
      for (int c = 0; c < kD; ++c) O[i * kD + c] += P[i * kM + j] * bf(v[j * kD + c]);
    double d = 0;
    for (int c = 0; c < kD; ++c) d += double(bf(dout[i * kD + c])) * O[i * kD + c];
    dsum[i] = static_cast<float>(d);
  }
  // Gradients with P and dS rounded to bf16 (what the kernel feeds the tensor cores).
  std::vector<double> dV(kM * kD, 0.0), dK(kM * kD, 0.0), dQ(kN * kD, 0.0);
  for (int i = 0; i < kN; ++i)
    for (int j = 0; j < kM; ++j) {
      double dp = 0;
      for (int c = 0; c < kD; ++c) dp += double(bf(dout[i * kD + c])) * bf(v[j * kD + c]);
      const double p = P[i * kM + j];
      const double pb = bf(to_bf(static_cast<float>(p))), dsb = bf(to_bf(static_cast<float>(p * (dp - dsum[i]))));
      for (int c = 0; c < kD; ++c) {
        dV[j * kD + c] += pb * bf(dout[i * kD + c]);
        dK[j * kD + c] += dsb * bf(q[i * kD + c]) * scale;
        dQ[i * kD + c] += dsb * bf(k[j * kD + c]) * scale;
      }
    }
  auto *gq = to_device(q), *gk = to_device(k), *gv = to_device(v), *gdo = to_device(dout);
  auto *glse = to_device(lse), *gd = to_device(dsum);
  float *odv, *odk, *odq;
  CHECK_CUDA(cudaMalloc(&odv, kM * kD * 4));
  CHECK_CUDA(cudaMalloc(&odk, kM * kD * 4));
  CHECK_CUDA(cudaMalloc(&odq, kN * kD * 4));
  const int smem = (2 * kN + 2 * kM) * kD * 2 + kM * kN * 2 + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(k_wgmma_bwd_chain, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k_wgmma_bwd_chain<<<1, 128, smem>>>(gq, gk, gv, gdo, glse, gd, scale, odv, odk, odq);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  auto hv = to_host(odv, kM * kD), hk = to_host(odk, kM * kD), hq = to_host(odq, kN * kD);
  // Relative to each gradient's largest magnitude: a layout error is O(1), bf16 rounding of P / dS
  // at a rounding boundary (fp32 in the kernel vs float64 here) ~1e-3.
  auto rel = [](const std::vector<float>& got, const std::vector<double>& want) {
    double err = 0, mag = 1e-30;
    for (size_t i = 0; i < want.size(); ++i) {
      err = std::max(err, std::fabs(got[i] - want[i]));
      mag = std::max(mag, std::fabs(want[i]));
    }
    return err / mag;
  };
  const double ev = rel(hv, dV), ek = rel(hk, dK), eq = rel(hq, dQ);
  char buf[128];
  std::snprintf(buf, sizeof buf, "relative max |err| dV %.1e dK %.1e dQ %.1e", ev, ek, eq);
  report("wgmma backward chain (S^T, dP^T, dV, dK, dQ)", ev < 1e-2 && ek < 1e-2 && eq < 1e-2, buf);
  for (void* p : {static_cast<void*>(gq), static_cast<void*>(gk), static_cast<void*>(gv), static_cast<void*>(gdo),
                  static_cast<void*>(glse), static_cast<void*>(gd), static_cast<void*>(odv), static_cast<void*>(odk),
                  static_cast<void*>(odq)})
    CHECK_CUDA(cudaFree(p));
}

void test_wgmma_chain() {
  constexpr int kD = 128, kN = 128;
  auto q = random_bf16(64 * kD, 0.5f, 31), k = random_bf16(kN * kD, 0.5f, 32), v = random_bf16(kN * kD, 1.0f, 33);
  auto *dq = to_device(q), *dk = to_device(k), *dv = to_device(v);
  const uint64_t dq_dims[2] = {kD, 64}, dk_dims[2] = {kD, kN}, strides[1] = {kD * 2};
  const uint32_t box_q[2] = {64, 64}, box_k[2] = {64, kN};
  CUtensorMap mq = make_map(dq, 2, dq_dims, strides, box_q, true);
  CUtensorMap mk = make_map(dk, 2, dk_dims, strides, box_k, true);
  CUtensorMap mv = make_map(dv, 2, dk_dims, strides, box_k, true);
  float *ds, *dout;
  CHECK_CUDA(cudaMalloc(&ds, 64 * kN * 4));
  CHECK_CUDA(cudaMalloc(&dout, 64 * kD * 4));
  const int smem = (64 + 2 * kN) * kD * 2 + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(k_wgmma_chain, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k_wgmma_chain<<<1, 128, smem>>>(mq, mk, mv, ds, dout);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  auto s = to_host(ds, 64 * kN);
  auto o = to_host(dout, 64 * kD);
  // P from the GPU's own S (rounded the same way), so only layouts are under test.
  double max_s = 0, max_o = 0, ref_scale = 0;
  for (int r = 0; r < 64; ++r) {
    for (int n = 0; n < kN; ++n) {
      double ref = 0;
      for (int x = 0; x < kD; ++x) ref += double(bf(q[r * kD + x])) * bf(k[n * kD + x]);
      max_s = std::max(max_s, std::fabs(ref - s[r * kN + n]));
    }
    for (int x = 0; x < kD; ++x) {
      double ref = 0;
      for (int n = 0; n < kN; ++n) ref += double(bf(to_bf(s[r * kN + n]))) * bf(v[n * kD + x]);
      max_o = std::max(max_o, std::fabs(ref - o[r * kD + x]));
      ref_scale = std::max(ref_scale, std::fabs(ref));
    }
  }
  char buf[96];
  std::snprintf(buf, sizeof buf, "S max |err| %.2e, O max |err| %.2e (|O| <= %.1f)", max_s, max_o, ref_scale);
  report("wgmma_chain ss->pack->rs", max_s < 1e-3 && max_o < 1e-3 * (1 + ref_scale), buf);
  CHECK_CUDA(cudaFree(dq));
  CHECK_CUDA(cudaFree(dk));
  CHECK_CUDA(cudaFree(dv));
  CHECK_CUDA(cudaFree(ds));
  CHECK_CUDA(cudaFree(dout));
}

// D (64 x 256) = A (64 x 80) V (80 x 256): A from global into the register fragment, V by TMA
// as 4 column blocks of [80 x 128B] (lbo = 80 * 128): the hdim-256 tile of the flash kernel.
__global__ void k_wgmma_rs(const uint16_t* a, const __grid_constant__ CUtensorMap map_v, float* out) {
#if IOATTN_SM90A_ENABLED
  constexpr int kK = 80, kN = 256;
  extern __shared__ uint8_t raw[];
  uint8_t* sv = align1024(raw);
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&bar, kK * kN * 2);
    for (int c = 0; c < kN / 64; ++c) tma_load_2d(sv + c * kK * 128, &map_v, &bar, 64 * c, 0);
  }
  mbarrier_wait(&bar, 0);
  const int w = threadIdx.x / 32, l = threadIdx.x % 32, r = 16 * w + l / 4, t = l % 4;
  auto pair = [&](int row, int col) {
    return static_cast<uint32_t>(a[row * kK + col]) | static_cast<uint32_t>(a[row * kK + col + 1]) << 16;
  };
  float d[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) d[i] = 0.0f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    const uint32_t frag[4] = {pair(r, 16 * kk + 2 * t), pair(r + 8, 16 * kk + 2 * t), pair(r, 16 * kk + 8 + 2 * t),
                              pair(r + 8, 16 * kk + 8 + 2 * t)};
    Wgmma<kN, __nv_bfloat16>::rs<1>(d, frag, make_desc_sw128(smem_u32(sv) + kk * 16 * 128, kK * 128, 1024), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) reg_fence(d[i]);
  store_d<kN>(d, out);
#endif
}

void test_wgmma_rs() {
  constexpr int kK = 80, kN = 256;
  auto a = random_bf16(64 * kK, 1.0f, 41), v = random_bf16(kK * kN, 1.0f, 42);
  auto *da = to_device(a), *dv = to_device(v);
  const uint64_t dims[2] = {kN, kK}, strides[1] = {kN * 2};
  const uint32_t box[2] = {64, kK};
  CUtensorMap mv = make_map(dv, 2, dims, strides, box, true);
  float* out;
  CHECK_CUDA(cudaMalloc(&out, 64 * kN * 4));
  const int smem = kK * kN * 2 + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(k_wgmma_rs, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k_wgmma_rs<<<1, 128, smem>>>(da, mv, out);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  check_ab<kN, kK>("wgmma_rs m64n256 MN-major", a, [&](int n, int k) { return v[k * kN + n]; },
                   to_host(out, 64 * kN));
  CHECK_CUDA(cudaFree(da));
  CHECK_CUDA(cudaFree(dv));
  CHECK_CUDA(cudaFree(out));
}

// ---------------------------------------------------------------- fp8 (e4m3)
// Byte offset of 8-bit element (row, col) of a 128-column block stored with the 128-byte swizzle.
__host__ __device__ inline uint32_t swz8(int row, int col) {
  return row * 128 + (((col / 16) ^ (row % 8)) * 16) + col % 16;
}

std::vector<uint8_t> random_e4m3(size_t n, float range, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-range, range);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = ioattn::detail::float_to_e4m3(d(rng));
  return v;
}
float e4(uint8_t b) { return ioattn::detail::e4m3_to_float(b); }

// pack4_e4m3: byte order (x0 lowest), round to nearest even, saturation, sign, subnormals.
__global__ void k_pack4(const float* x, uint32_t* out, int n4) {
#if IOATTN_SM90A_ENABLED
  const int i = threadIdx.x;
  if (i < n4) out[i] = pack4_e4m3(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
#endif
}

void test_pack4() {
  std::vector<float> x = {1.0f, -2.0f, 0.5f, 448.0f,          1.0625f, 1.1875f, 1.07f, 1000.0f,
                          -1000.0f, 0.0f, -0.0f, 0.001953125f, 0.0029296875f, 0.3f, 1e-6f, 440.0f};
  std::mt19937_64 rng(77);
  std::uniform_real_distribution<float> d(-3.0f, 3.0f);
  for (int i = 0; i < 240; ++i) x.push_back(d(rng) * (i % 3 == 0 ? 0.01f : 1.0f));
  const int n4 = static_cast<int>(x.size() / 4);
  auto* dx = to_device(x);
  uint32_t* dout;
  CHECK_CUDA(cudaMalloc(&dout, n4 * 4));
  k_pack4<<<1, 128>>>(dx, dout, n4);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  auto got = to_host(dout, n4);
  int bad = 0;
  std::string first;
  for (int i = 0; i < n4 * 4; ++i) {
    const uint8_t want = ioattn::detail::float_to_e4m3(x[i]);
    const uint8_t g = static_cast<uint8_t>(got[i / 4] >> (8 * (i % 4)));
    if (g != want) {
      if (bad++ == 0) first = "x=" + std::to_string(x[i]) + " got " + std::to_string(g) + " want " + std::to_string(want);
    }
  }
  report("pack4_e4m3 (cvt e4m3x2)", bad == 0, bad ? std::to_string(bad) + " wrong, first " + first : "256 values exact");
  CHECK_CUDA(cudaFree(dx));
  CHECK_CUDA(cudaFree(dout));
}

// fp8_p_key is a permutation of 0..31 (host side; the device uses the same constexpr function).
void test_fp8_p_key() {
  bool seen[32] = {};
  bool ok = true;
  for (int c = 0; c < 32; ++c) {
    const int k = fp8_p_key(c);
    ok = ok && k >= 0 && k < 32 && !seen[k];
    if (k >= 0 && k < 32) seen[k] = true;
  }
  // Thread t = 1's row values sit at A columns 4..7 (keys 2, 3, 10, 11) and 20..23 (18, 19, 26, 27).
  ok = ok && fp8_p_key(4) == 2 && fp8_p_key(5) == 3 && fp8_p_key(6) == 10 && fp8_p_key(7) == 11 &&
       fp8_p_key(20) == 18 && fp8_p_key(23) == 27;
  report("fp8_p_key permutation", ok);
}

// The fp8 flash data path on one warpgroup, at head dim kD = 128 (128-byte rows, SW128) or 64
// (64-byte rows: TMA SWIZZLE_64B and make_desc_sw64, two k32 steps per row):
//   S (64 x 128) = Q K^T: WgmmaFp8<128>::ss, Q and K by TMA (UINT8 maps, box kD x rows);
//   P = e4m3(S * p_scale) in registers by fp8_p_fragment (no shuffles, keys permuted per 32);
//   O (64 x kD) = P V: WgmmaFp8<kD>::rs with B = V^T [kD dims x 128 keys] K-major (128-byte rows,
//   SW128), written by the threads in the fp8_p_key order (as the kernel's pre-pass writes it).
// The host recomputes O from the GPU's own S, rounded to e4m3 by the host encoder in natural key
// order, so a wrong fragment layout, swizzle or permutation shows as a large S or O error.
template <int kD>
__global__ void k_fp8_chain(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                            const uint8_t* vt_perm, float p_scale, float* out_s, float* out_o) {
#if IOATTN_SM90A_ENABLED
  constexpr int kN = 128;
  extern __shared__ uint8_t raw[];
  uint8_t* sq = align1024(raw);  // [64 x kD B]
  uint8_t* sk = sq + 64 * kD;    // [128 keys x kD B]
  uint8_t* sv = sk + kN * kD;    // [kD dims x 128 B (keys)]
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&bar, (64 + kN) * kD);
    tma_load_2d(sq, &map_q, &bar, 0, 0);
    tma_load_2d(sk, &map_k, &bar, 0, 0);
  }
  for (int i = threadIdx.x; i < kD * kN; i += blockDim.x) sv[swz8(i / 128, i % 128)] = vt_perm[i];
  fence_proxy_async();
  __syncthreads();
  mbarrier_wait(&bar, 0);
  auto qk_desc = [](const uint8_t* base, int kk) {
    return kD == 64 ? make_desc_sw64(smem_u32(base) + kk * 32, 16, 512) : make_desc_sw128(smem_u32(base) + kk * 32, 16, 1024);
  };
  float s[kN / 2];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 32; ++kk) WgmmaFp8<kN>::ss(s, qk_desc(sq, kk), qk_desc(sk, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) reg_fence(s[i]);
  store_d<kN>(s, out_s);
  uint32_t pf[kN / 8];
#pragma unroll
  for (int kk = 0; kk < kN / 32; ++kk) {
    float sc[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) sc[j] = s[16 * kk + j] * p_scale;
    uint32_t a[4];
    fp8_p_fragment(sc, a);
#pragma unroll
    for (int j = 0; j < 4; ++j) pf[4 * kk + j] = a[j];
  }
  float o[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kN / 32; ++kk) {
    const uint32_t a[4] = {pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3]};
    WgmmaFp8<kD>::rs(o, a, make_desc_sw128(smem_u32(sv) + kk * 32, 16, 1024), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) reg_fence(o[i]);
  store_d<kD>(o, out_o);
#endif
}

// 2-D uint8 map of a dense [rows x kD] e4m3 matrix, box kD x rows, swizzled to kD-byte rows.
template <int kD>
CUtensorMap fp8_rows_map(const void* ptr, int rows) {
  CUtensorMap m{};
  const cuuint64_t dims[2] = {kD, static_cast<cuuint64_t>(rows)}, strides[1] = {kD};
  const cuuint32_t box[2] = {kD, static_cast<cuuint32_t>(rows)}, es[2] = {1, 1};
  const CUresult r = encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(ptr), dims, strides, box, es,
                               CU_TENSOR_MAP_INTERLEAVE_NONE,
                               kD == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("FAIL cuTensorMapEncodeTiled (uint8, %d-byte rows): %d\n", kD, (int)r);
    std::exit(1);
  }
  return m;
}

template <int kD>
void test_fp8_chain(const char* name) {
  constexpr int kN = 128;
  auto q = random_e4m3(64 * kD, 2.0f, 41), k = random_e4m3(kN * kD, 2.0f, 42), v = random_e4m3(kN * kD, 2.0f, 43);
  // V^T in the P fragment's key order: vt[x][32 j + c] = v[32 j + fp8_p_key(c)][x].
  std::vector<uint8_t> vt(kD * kN);
  for (int x = 0; x < kD; ++x)
    for (int c = 0; c < kN; ++c) vt[x * kN + c] = v[((c & ~31) + fp8_p_key(c & 31)) * kD + x];
  auto *dq = to_device(q), *dk = to_device(k), *dvt = to_device(vt);
  const CUtensorMap mq = fp8_rows_map<kD>(dq, 64), mk = fp8_rows_map<kD>(dk, kN);
  float *ds, *dout;
  CHECK_CUDA(cudaMalloc(&ds, 64 * kN * 4));
  CHECK_CUDA(cudaMalloc(&dout, 64 * kD * 4));
  const int smem = (64 + 2 * kN) * kD + 1024;
  const float p_scale = 1.0f / 16.0f;  // |S| <= 128 * 4: |P| <= 32, normals and subnormals of e4m3
  CHECK_CUDA(cudaFuncSetAttribute(k_fp8_chain<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k_fp8_chain<kD><<<1, 128, smem>>>(mq, mk, dvt, p_scale, ds, dout);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  auto s = to_host(ds, 64 * kN);
  auto o = to_host(dout, 64 * kD);
  // Tolerances are relative to the largest magnitude: fp8 wgmma accumulates with fewer than fp32's
  // mantissa bits (about 2^-14 relative is reported for Hopper), while a layout error is O(1).
  double max_s = 0, max_o = 0, ref_scale = 0, s_scale = 0;
  for (int r = 0; r < 64; ++r) {
    for (int n = 0; n < kN; ++n) {
      double ref = 0;
      for (int x = 0; x < kD; ++x) ref += double(e4(q[r * kD + x])) * e4(k[n * kD + x]);
      max_s = std::max(max_s, std::fabs(ref - s[r * kN + n]));
      s_scale = std::max(s_scale, std::fabs(ref));
    }
    for (int x = 0; x < kD; ++x) {
      double ref = 0;
      for (int n = 0; n < kN; ++n)
        ref += double(e4(ioattn::detail::float_to_e4m3(s[r * kN + n] * p_scale))) * e4(v[n * kD + x]);
      max_o = std::max(max_o, std::fabs(ref - o[r * kD + x]));
      ref_scale = std::max(ref_scale, std::fabs(ref));
    }
  }
  char buf[112];
  std::snprintf(buf, sizeof buf, "S max |err| %.2e, O max |err| %.2e (|O| <= %.1f)", max_s, max_o, ref_scale);
  report(name, max_s < 1e-3 * (1 + s_scale) && max_o < 1e-3 * (1 + ref_scale), buf);
  CHECK_CUDA(cudaFree(dq));
  CHECK_CUDA(cudaFree(dk));
  CHECK_CUDA(cudaFree(dvt));
  CHECK_CUDA(cudaFree(ds));
  CHECK_CUDA(cudaFree(dout));
}

// ---------------------------------------------------------------- setmaxnreg + named barriers
// Warpgroup 0 gives registers back and leaves; warpgroups 1 and 2 take more and alternate through
// two named barriers exactly like the flash kernel's scheduler: the log must read 0,1,0,1,...
__global__ void __launch_bounds__(384, 1) k_pingpong(int* log, float* sink) {
#if IOATTN_SM90A_ENABLED
  __shared__ int s_log[32];
  __shared__ int s_pos;
  if (threadIdx.x == 0) s_pos = 0;
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<24>();
  } else {
    setmaxnreg_inc<240>();
    const int cw = wg - 1;
    constexpr int kIters = 8;
    if (cw == 1) named_barrier_arrive(1, 256);
    float acc = threadIdx.x;
    for (int it = 0; it < kIters; ++it) {
      named_barrier_sync(1 + cw, 256);
      if (threadIdx.x % 128 == 0) s_log[s_pos++] = cw;
      for (int j = 0; j < 100; ++j) acc = acc * 1.0001f + 0.5f;  // some work inside the turn
      if (!(cw == 1 && it == kIters - 1)) named_barrier_arrive(1 + (1 - cw), 256);
    }
    sink[threadIdx.x] = acc;
    named_barrier_sync(3, 256);
    if (threadIdx.x == 128) {
      log[0] = s_pos;
      for (int i = 0; i < s_pos; ++i) log[1 + i] = s_log[i];
    }
  }
#endif
}

void test_pingpong() {
  int* d;
  float* sink;
  CHECK_CUDA(cudaMalloc(&d, 64 * sizeof(int)));
  CHECK_CUDA(cudaMalloc(&sink, 384 * sizeof(float)));
  CHECK_CUDA(cudaMemset(d, 0xff, 64 * sizeof(int)));
  k_pingpong<<<1, 384>>>(d, sink);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  auto h = to_host(d, 64);
  bool ok = h[0] == 16;
  std::string seq;
  for (int i = 0; i < 16 && i < h[0]; ++i) {
    ok = ok && h[1 + i] == i % 2;
    seq += std::to_string(h[1 + i]);
  }
  report("setmaxnreg + named barriers", ok, "turns " + seq);
  CHECK_CUDA(cudaFree(d));
  CHECK_CUDA(cudaFree(sink));
}

// 3 consumer warpgroups take turns round robin (the kernel's 192-row tiles): warpgroup c syncs on
// barrier 1 + c and then arrives on barrier 1 + (c + 1) % 3; the last one's first arrival lets
// warpgroup 0 go first and warpgroup 0's final sync consumes the one extra arrival.
__global__ void __launch_bounds__(512, 1) k_roundrobin(int* log, float* sink) {
#if IOATTN_SM90A_ENABLED
  __shared__ int s_log[32];
  __shared__ int s_pos;
  if (threadIdx.x == 0) s_pos = 0;
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<24>();
  } else {
    setmaxnreg_inc<160>();
    const int cw = wg - 1;
    constexpr int kIters = 6;
    if (cw == 2) named_barrier_arrive(1, 256);
    float acc = threadIdx.x;
    for (int it = 0; it < kIters; ++it) {
      named_barrier_sync(1 + cw, 256);
      if (threadIdx.x % 128 == 0) s_log[s_pos++] = cw;
      for (int j = 0; j < 100; ++j) acc = acc * 1.0001f + 0.5f;  // some work inside the turn
      named_barrier_arrive(1 + (cw + 1) % 3, 256);
    }
    sink[threadIdx.x] = acc;
    if (cw == 0) named_barrier_sync(1, 256);  // the extra arrival
    named_barrier_sync(5, 384);
    if (threadIdx.x == 128) {
      log[0] = s_pos;
      for (int i = 0; i < s_pos; ++i) log[1 + i] = s_log[i];
    }
  }
#endif
}

void test_roundrobin() {
  int* d;
  float* sink;
  CHECK_CUDA(cudaMalloc(&d, 64 * sizeof(int)));
  CHECK_CUDA(cudaMalloc(&sink, 512 * sizeof(float)));
  CHECK_CUDA(cudaMemset(d, 0xff, 64 * sizeof(int)));
  k_roundrobin<<<1, 512>>>(d, sink);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  auto h = to_host(d, 64);
  bool ok = h[0] == 18;
  std::string seq;
  for (int i = 0; i < 18 && i < h[0]; ++i) {
    ok = ok && h[1 + i] == i % 3;
    seq += std::to_string(h[1 + i]);
  }
  report("setmaxnreg 160 + round robin", ok, "turns " + seq);
  CHECK_CUDA(cudaFree(d));
  CHECK_CUDA(cudaFree(sink));
}

// ---------------------------------------------------------------- claim_tile + Q handshake
// The flash kernel's tile hand-over without the math: thread 0 claims tiles (first = blockIdx.x,
// then claim_tile), writes each index to a shared slot after the consumers freed it (empty,
// one arrival per consumer warp) and arrives on full (count 1, no tx: as for key-less tiles and
// the end marker); 8 consumer warps read the slot after full, count the tile in hits[t], spin
// a tile-dependent while (uneven tiles, like causal ones), and arrive on empty.
__global__ void __launch_bounds__(384, 1) k_claim(int* counter, int* hits, int* per_cta, int num_tiles) {
#if IOATTN_SM90A_ENABLED
  __shared__ uint64_t full, empty;
  __shared__ int slot;
  if (threadIdx.x == 0) {
    mbarrier_init(&full, 1);
    mbarrier_init(&empty, 8);
    fence_mbarrier_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    if (threadIdx.x == 0) {
      int t = blockIdx.x;
      for (int round = 0;; ++round) {
        mbarrier_wait(&empty, (round & 1) ^ 1);
        *reinterpret_cast<volatile int*>(&slot) = t;
        mbarrier_arrive(&full);
        if (t >= num_tiles) break;
        t = claim_tile(counter);
      }
    }
  } else {
    int mine = 0;
    float acc = threadIdx.x;
    for (int round = 0;; ++round) {
      mbarrier_wait(&full, round & 1);
      const int t = *reinterpret_cast<volatile int*>(&slot);
      if (t >= num_tiles) break;
      if (threadIdx.x % 32 == 0) atomicAdd(&hits[t], 1);
      for (int j = 0; j < 20 * (t % 7); ++j) acc = acc * 1.0001f + 0.5f;
      __syncwarp();
      if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty);
      ++mine;
    }
    if (threadIdx.x == 128) per_cta[blockIdx.x] = mine;
    if (acc == 12345.0f) hits[0] = -1000;  // keeps the spin alive; never true in practice
  }
#endif
}

void test_claim() {
  constexpr int kTiles = 5000, kCtas = 37;
  int *counter, *hits, *per_cta;
  CHECK_CUDA(cudaMalloc(&counter, sizeof(int)));
  CHECK_CUDA(cudaMalloc(&hits, kTiles * sizeof(int)));
  CHECK_CUDA(cudaMalloc(&per_cta, kCtas * sizeof(int)));
  bool ok = true;
  std::string detail;
  for (int launch = 0; launch < 3; ++launch) {  // a fresh zeroed counter each launch, as the launcher does
    CHECK_CUDA(cudaMemset(counter, 0, sizeof(int)));
    CHECK_CUDA(cudaMemset(hits, 0, kTiles * sizeof(int)));
    CHECK_CUDA(cudaMemset(per_cta, 0xff, kCtas * sizeof(int)));
    k_claim<<<kCtas, 384>>>(counter, hits, per_cta, kTiles);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    auto h = to_host(hits, kTiles);
    auto c = to_host(per_cta, kCtas);
    auto n = to_host(counter, 1);
    int bad = 0, total = 0, lo = 1 << 30, hi = 0;
    for (int t = 0; t < kTiles; ++t) bad += h[t] != 8;
    for (int b = 0; b < kCtas; ++b) {
      total += c[b];
      lo = std::min(lo, c[b]);
      hi = std::max(hi, c[b]);
    }
    // Every CTA claims until it draws an index past the end: kCtas claims land there.
    ok = ok && bad == 0 && total == kTiles && lo > 0 && n[0] == kTiles;
    detail = "tiles with hits != 8: " + std::to_string(bad) + ", tiles per CTA " + std::to_string(lo) + ".." +
             std::to_string(hi) + ", counter " + std::to_string(n[0]);
  }
  report("claim_tile + Q handshake", ok, detail);
  CHECK_CUDA(cudaFree(counter));
  CHECK_CUDA(cudaFree(hits));
  CHECK_CUDA(cudaFree(per_cta));
}

// ---------------------------------------------------------------- exp2_approx
__global__ void k_exp2(const float* x, float* y, int n) {
#if IOATTN_SM90A_ENABLED
  const int i = threadIdx.x;
  if (i < n) y[i] = exp2_approx(x[i]);
#endif
}

void test_exp2() {
  std::vector<float> x = {-INFINITY, -100.f, -10.5f, -1.f, -0.25f, 0.f, 0.5f, 1.f, 3.75f, 20.f};
  auto* dx = to_device(x);
  float* dy;
  CHECK_CUDA(cudaMalloc(&dy, x.size() * 4));
  k_exp2<<<1, 32>>>(dx, dy, static_cast<int>(x.size()));
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  auto y = to_host(dy, x.size());
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp2(double(x[i]));
    const double rel = want == 0 ? std::fabs(y[i]) : std::fabs(y[i] - want) / want;
    worst = std::max(worst, rel);
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "max rel err %.2e (ex2(-inf) = %g)", worst, y[0]);
  report("exp2_approx", worst < 1e-6 && y[0] == 0.0f, buf);
  CHECK_CUDA(cudaFree(dx));
  CHECK_CUDA(cudaFree(dy));
}

// red_add_v2_f32_if: every thread adds (tid, -tid) to pair tid % 8 only when its predicate
// (tid % 3 != 0) holds; 4 rounds, so each pair sums exactly (small integers).
__global__ void k_red_if(float* out) {
#if IOATTN_SM90A_ENABLED
  const int tid = threadIdx.x;
  float* p = pin_ptr(out + 2 * (tid % 8));
  for (int round = 0; round < 4; ++round) red_add_v2_f32_if(p, float(tid), float(-tid), tid % 3 != 0);
#endif
}

void test_red_if() {
  float* d;
  CHECK_CUDA(cudaMalloc(&d, 16 * 4));
  CHECK_CUDA(cudaMemset(d, 0, 16 * 4));
  k_red_if<<<1, 128>>>(d);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto got = to_host(d, 16);
  bool ok = true;
  std::string detail;
  for (int j = 0; j < 8; ++j) {
    double want = 0;
    for (int tid = j; tid < 128; tid += 8)
      if (tid % 3 != 0) want += 4.0 * tid;
    if (got[2 * j] != want || got[2 * j + 1] != -want) {
      ok = false;
      detail += "pair " + std::to_string(j) + ": " + std::to_string(got[2 * j]) + ", " + std::to_string(got[2 * j + 1]) +
                " want " + std::to_string(want) + "; ";
    }
  }
  report("red_add_v2_f32_if", ok, detail);
  CHECK_CUDA(cudaFree(d));
}

// ---------------------------------------------------------------- stmatrix
// One warp stores four 8x8 matrices of 16-bit values with stmatrix_x4 into a [32 rows x 8 cols]
// shared tile whose rows are scattered (row r of matrix j at shared row 8 j + (5 r + 3) % 8, 16
// bytes each): lane l's register j holds matrix j's (row l / 4, cols 2 (l % 4), + 1) as
// (1000 j + 10 row + col) in the low / high halves. The tile is copied out and every value checked.
__global__ void k_stmatrix(uint16_t* out) {
#if IOATTN_SM90A_ENABLED
  __shared__ __align__(16) uint16_t tile[32 * 8];
  const int lane = threadIdx.x;
  uint32_t r[4];
  for (int j = 0; j < 4; ++j) {
    const int row = lane / 4, col = 2 * (lane % 4);
    r[j] = static_cast<uint32_t>(1000 * j + 10 * row + col) | (static_cast<uint32_t>(1000 * j + 10 * row + col + 1) << 16);
  }
  const int mj = lane / 8, mr = lane % 8;
  stmatrix_x4(smem_u32(tile) + static_cast<uint32_t>((8 * mj + (5 * mr + 3) % 8) * 16), r[0], r[1], r[2], r[3]);
  __syncwarp();
  for (int i = lane; i < 32 * 8; i += 32) out[i] = tile[i];
#endif
}

void test_stmatrix() {
  uint16_t* d;
  CHECK_CUDA(cudaMalloc(&d, 32 * 8 * 2));
  CHECK_CUDA(cudaMemset(d, 0xFF, 32 * 8 * 2));
  k_stmatrix<<<1, 32>>>(d);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto h = to_host(d, 32 * 8);
  int bad = 0;
  std::string detail;
  for (int j = 0; j < 4; ++j)
    for (int row = 0; row < 8; ++row)
      for (int col = 0; col < 8; ++col) {
        const int want = 1000 * j + 10 * row + col, got = h[(8 * j + (5 * row + 3) % 8) * 8 + col];
        if (got != want && bad++ == 0)
          detail = "matrix " + std::to_string(j) + " (" + std::to_string(row) + ", " + std::to_string(col) +
                   "): " + std::to_string(got) + " want " + std::to_string(want);
      }
  report("stmatrix_x4", bad == 0, detail);
  CHECK_CUDA(cudaFree(d));
}

// ---------------------------------------------------------------- TMA reduce-add (fp32)
// Every CTA adds two [64 rows x 32 cols] fp32 boxes, written by its threads in the SW128 layout,
// into plane 1 of a [2 planes][70 rows][64 cols] tensor: box A at (cols 0.., rows 40..) — rows
// 70.. are past the bound and must be skipped — then, in the same shared buffer after
// bulk_wait_group_read<0>, box B at (cols 32.., rows 0..). Value of (r, c) in box A: (cta + 1) *
// (64 r + c) / 4, in box B: -(cta + 1) * (64 r + c) / 8 (exact in fp32).
__global__ void k_tma_reduce(const __grid_constant__ CUtensorMap map) {
#if IOATTN_SM90A_ENABLED
  extern __shared__ uint8_t raw[];
  uint8_t* s = align1024(raw);
  const float scale[2] = {0.25f * (blockIdx.x + 1), -0.125f * (blockIdx.x + 1)};
  const int col0[2] = {0, 32}, row0[2] = {40, 0};
  for (int box = 0; box < 2; ++box) {
    for (int i = threadIdx.x; i < 64 * 32; i += blockDim.x) {
      const int r = i / 32, c = i % 32;
      *reinterpret_cast<float*>(s + r * 128 + (((c >> 2) ^ (r & 7)) << 4) + (c & 3) * 4) = scale[box] * (64 * r + c);
    }
    fence_proxy_async();
    __syncthreads();
    if (threadIdx.x == 0) {
      tma_reduce_add_3d(&map, s, col0[box], row0[box], 1);
      bulk_commit_group();
      bulk_wait_group_read<0>();  // the box may be overwritten now
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) bulk_wait_group<0>();
#endif
}

void test_tma_reduce() {
  const int planes = 2, rows = 70, cols = 64, guard = 256, ctas = 3;
  const size_t n = static_cast<size_t>(planes) * rows * cols;
  std::vector<float> init(n + guard);
  for (size_t i = 0; i < init.size(); ++i) init[i] = 1.0f + static_cast<float>(i % 7);
  float* d = to_device(init);
  const uint64_t dims[3] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows), static_cast<uint64_t>(planes)};
  const uint64_t strides[2] = {cols * 4ull, static_cast<uint64_t>(rows) * cols * 4};
  const uint32_t box[3] = {32, 64, 1};
  const CUtensorMap map = make_map(d, 3, dims, strides, box, true, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
  const int smem = 8192 + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(k_tma_reduce, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k_tma_reduce<<<ctas, 128, smem>>>(map);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto got = to_host(d, init.size());
  const double sum_cta = ctas * (ctas + 1) / 2.0;  // sum of (cta + 1)
  int bad = 0;
  std::string detail;
  for (size_t i = 0; i < init.size(); ++i) {
    double want = init[i];
    if (i < n && i >= static_cast<size_t>(rows) * cols) {  // plane 1
      const int r = static_cast<int>((i / cols) % rows), c = static_cast<int>(i % cols);
      if (c < 32 && r >= 40) want += 0.25 * sum_cta * (64 * (r - 40) + c);
      if (c >= 32 && r < 64) want += -0.125 * sum_cta * (64 * r + (c - 32));
    }
    if (got[i] != static_cast<float>(want)) {
      if (bad++ == 0)
        detail = "first mismatch at " + std::to_string(i) + ": got " + std::to_string(got[i]) + " want " +
                 std::to_string(want);
    }
  }
  report("tma_reduce_add_3d", bad == 0, bad ? detail + " (" + std::to_string(bad) + " bad)" : "");
  CHECK_CUDA(cudaFree(d));
}


// ---------------------------------------------------------------- ragged (varlen) maps
// The library's make_ragged_map + tma_load_ragged / tma_reduce_add_ragged: a box of 64 rows at
// row r of the packed sequence [start, start + len) must read rows past the sequence's end as
// zeros (though they are inside the tensor: the next sequence's tokens), and a reduce-add must
// leave them untouched.
__global__ void k_tma_ragged(const __grid_constant__ CUtensorMap map, int head, int start, int len, int r,
                             uint16_t* out) {
#if IOATTN_SM90A_ENABLED
  extern __shared__ uint8_t raw[];
  uint8_t* s = align1024(raw);
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 1);
    fence_mbarrier_init();
  }
  // The box lands on garbage, so an unwritten (not zero-filled) element shows.
  for (int i = threadIdx.x; i < 2 * 64 * 64; i += blockDim.x) reinterpret_cast<uint16_t*>(s)[i] = 0x7fc0;
  fence_proxy_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&bar, 2 * 64 * 128);
    for (int c = 0; c < 2; ++c) tma_load_ragged(s + c * 64 * 128, &map, &bar, 64 * c, head, start, len, r);
  }
  mbarrier_wait(&bar, 0);
  for (int i = threadIdx.x; i < 64 * 128; i += blockDim.x) {
    const int c = i / (64 * 64), row = (i / 64) % 64, col = i % 64;
    out[row * 128 + c * 64 + col] = *reinterpret_cast<const uint16_t*>(s + c * 64 * 128 + swz(row, col));
  }
#endif
}

__global__ void k_tma_reduce_ragged(const __grid_constant__ CUtensorMap map, int col, int head, int start, int len,
                                    int r) {
#if IOATTN_SM90A_ENABLED
  extern __shared__ uint8_t raw[];
  uint8_t* s = align1024(raw);
  for (int i = threadIdx.x; i < 64 * 32; i += blockDim.x) {
    const int row = i / 32, c = i % 32;
    *reinterpret_cast<float*>(s + row * 128 + (((c >> 2) ^ (row & 7)) << 4) + (c & 3) * 4) = 64.f * row + c;
  }
  fence_proxy_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    tma_reduce_add_ragged(&map, s, col, head, start, len, r);
    bulk_commit_group();
    bulk_wait_group<0>();
  }
#endif
}

void test_tma_ragged() {
  using ioattn::DType;
  // bf16 [100 tokens][3 heads][128 + 8 NaN-free padding columns].
  const int total = 100, heads = 3, dp = 136, smem = 2 * 64 * 128 + 1024;
  auto h = random_bf16(total * heads * dp, 1.0f, 11);
  auto* d = to_device(h);
  const CUtensorMap m = make_ragged_map(d, DType::bf16, 2, 128, total, heads, heads * dp, dp, 64, 64, "t");
  uint16_t* out;
  CHECK_CUDA(cudaMalloc(&out, 64 * 128 * 2));
  CHECK_CUDA(cudaFuncSetAttribute(k_tma_ragged, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const struct {
    int head, start, len, r;
  } cases[] = {{2, 37, 20, 0}, {1, 37, 20, 16}, {0, 0, 100, 64}, {2, 90, 10, 0}, {1, 0, 1, 0}};
  for (const auto& c : cases) {
    k_tma_ragged<<<1, 128, smem>>>(m, c.head, c.start, c.len, c.r, out);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    const auto got = to_host(out, 64 * 128);
    std::string detail;
    const bool ok = compare_box(got, 64, 128, [&](int row, int col) -> uint16_t {
      return c.r + row < c.len ? h[((c.start + c.r + row) * heads + c.head) * dp + col] : 0;
    }, &detail);
    report(("tma_load_ragged (start " + std::to_string(c.start) + ", len " + std::to_string(c.len) + ", row " +
            std::to_string(c.r) + ")").c_str(),
           ok, detail);
  }
  CHECK_CUDA(cudaFree(d));
  // One token, one head (the map's size-1 strides replaced by packed ones): the token, and a
  // sequence of length 0 (all zeros).
  {
    auto h1 = random_bf16(dp, 1.0f, 12);
    auto* d1 = to_device(h1);
    const CUtensorMap m1 = make_ragged_map(d1, DType::bf16, 2, 128, 1, 1, dp, dp, 64, 64, "t1");
    for (int len : {1, 0}) {
      k_tma_ragged<<<1, 128, smem>>>(m1, 0, 0, len, 0, out);
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaDeviceSynchronize());
      const auto got = to_host(out, 64 * 128);
      std::string detail;
      const bool ok = compare_box(got, 64, 128, [&](int row, int col) -> uint16_t {
        return row < len ? h1[col] : 0;
      }, &detail);
      report(("tma_load_ragged (one token, one head, len " + std::to_string(len) + ")").c_str(), ok, detail);
    }
    CHECK_CUDA(cudaFree(d1));
  }
  CHECK_CUDA(cudaFree(out));

  // f32 [2 heads][70 rows][64 columns] (the dQ workspace's layout) + a guard: a [64 x 32] box at
  // row 0 of the sequence [10, 40) of head 1, columns 32..63.
  const int rows = 70, cols = 64, guard = 256;
  const size_t n = 2 * rows * cols;
  std::vector<float> init(n + guard);
  for (size_t i = 0; i < init.size(); ++i) init[i] = 1.0f + static_cast<float>(i % 7);
  float* w = to_device(init);
  const CUtensorMap mw = make_ragged_map(w, DType::f32, 4, cols, rows, 2, cols, rows * cols, 32, 64, "ws");
  CHECK_CUDA(cudaFuncSetAttribute(k_tma_reduce_ragged, cudaFuncAttributeMaxDynamicSharedMemorySize, 8192 + 1024));
  k_tma_reduce_ragged<<<1, 128, 8192 + 1024>>>(mw, 32, 1, 10, 30, 0);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto got = to_host(w, init.size());
  int bad = 0;
  std::string detail;
  for (size_t i = 0; i < init.size(); ++i) {
    double want = init[i];
    if (i < n && i >= static_cast<size_t>(rows) * cols) {  // head 1
      const int row = static_cast<int>((i / cols) % rows), c = static_cast<int>(i % cols);
      if (c >= 32 && row >= 10 && row < 40) want += 64.0 * (row - 10) + (c - 32);
    }
    if (got[i] != static_cast<float>(want) && bad++ == 0)
      detail = "first mismatch at " + std::to_string(i) + ": got " + std::to_string(got[i]) + " want " +
               std::to_string(want);
  }
  report("tma_reduce_add_ragged (rows past the sequence untouched)", bad == 0,
         bad ? detail + " (" + std::to_string(bad) + " bad)" : "");
  CHECK_CUDA(cudaFree(w));
}

// ---------------------------------------------------------------- cluster: rank, barrier, DSMEM
// Two clusters of n CTAs (n = 4, and 16 through the non-portable size where the device allows
// it): every CTA writes rank * 1000 + thread into a shared array and rank + 7 into a shared int,
// passes cluster_sync, reads its right neighbour's ((rank + 1) % n) entries through mapa_shared +
// ld.shared::cluster, then passes cluster_sync again before exiting (its own array is being read).
__global__ void k_cluster(int n, int* out, float* outf) {
#if IOATTN_SM90A_ENABLED
  __shared__ float vals[128];
  __shared__ int flag;
  const uint32_t rank = cluster_ctarank();
  vals[threadIdx.x] = static_cast<float>(rank) * 1000.f + static_cast<float>(threadIdx.x);
  if (threadIdx.x == 0) flag = static_cast<int>(rank) + 7;
  cluster_sync();
  const uint32_t nb = (rank + 1) % static_cast<uint32_t>(n);
  outf[blockIdx.x * 128 + threadIdx.x] = ld_shared_cluster_f32(mapa_shared(smem_u32(&vals[threadIdx.x]), nb));
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = static_cast<int>(rank);
    out[2 * blockIdx.x + 1] = ld_shared_cluster_s32(mapa_shared(smem_u32(&flag), nb));
  }
  cluster_sync();
#endif
}

void test_cluster(int n) {
  const std::string name = "cluster rank / barrier / ld.shared::cluster, n = " + std::to_string(n);
  if (n > 8 && cudaFuncSetAttribute(k_cluster, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    cudaGetLastError();
    std::printf("  (skipped %s: no non-portable cluster sizes)\n", name.c_str());
    return;
  }
  const int ctas = 2 * n;
  int* d;
  float* f;
  CHECK_CUDA(cudaMalloc(&d, 2 * ctas * sizeof(int)));
  CHECK_CUDA(cudaMalloc(&f, ctas * 128 * sizeof(float)));
  CHECK_CUDA(cudaMemset(d, 0xff, 2 * ctas * sizeof(int)));
  CHECK_CUDA(cudaMemset(f, 0xff, ctas * 128 * sizeof(float)));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(128);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = n;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CHECK_CUDA(cudaLaunchKernelEx(&cfg, k_cluster, n, d, f));
  CHECK_CUDA(cudaDeviceSynchronize());
  auto h = to_host(d, 2 * ctas);
  auto hf = to_host(f, ctas * 128);
  int bad = 0;
  std::string detail;
  for (int c = 0; c < ctas; ++c) {
    const int rank = c % n, nb = (rank + 1) % n;
    if (h[2 * c] != rank || h[2 * c + 1] != nb + 7) {
      if (!bad) detail = "CTA " + std::to_string(c) + ": rank " + std::to_string(h[2 * c]) + ", neighbour flag " +
                         std::to_string(h[2 * c + 1]);
      ++bad;
    }
    for (int t = 0; t < 128; ++t)
      if (hf[c * 128 + t] != static_cast<float>(nb) * 1000.f + static_cast<float>(t)) {
        if (!bad) detail = "CTA " + std::to_string(c) + " thread " + std::to_string(t) + ": " + std::to_string(hf[c * 128 + t]);
        ++bad;
      }
  }
  report(name.c_str(), bad == 0, detail);
  CHECK_CUDA(cudaFree(d));
  CHECK_CUDA(cudaFree(f));
}
}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("skipped: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("skipped: device %s is sm_%d%d, these tests need sm_90\n", prop.name, prop.major, prop.minor);
    return 0;
  }
  test_mbarrier();
  test_cp_async_arrive();
  test_cp_async_arrive_stages();
  test_bulk();
  test_tma();
  test_wgmma_ss<128, 128>("wgmma_ss m64n128 K=128");
  test_wgmma_ss<80, 256>("wgmma_ss m64n80 K=256");
  test_wgmma_ss<64, 64>("wgmma_ss m64n64 K=64");
  test_wgmma_ss_ta<128, 128>("wgmma_ss transposed A m64n128 K=128");
  test_wgmma_ss_ta<64, 64>("wgmma_ss transposed A m64n64 K=64");
  test_wgmma_chain();
  test_wgmma_bwd_chain();
  test_wgmma_rs();
  test_pack4();
  test_fp8_p_key();
  test_fp8_chain<128>("wgmma fp8 ss->p_fragment->rs, hdim 128 (SW128 Q/K)");
  test_fp8_chain<64>("wgmma fp8 ss->p_fragment->rs, hdim 64 (SW64 Q/K)");
  test_pingpong();
  test_roundrobin();
  test_claim();
  test_exp2();
  test_red_if();
  test_stmatrix();
  test_tma_reduce();
  test_tma_ragged();
  test_cluster(4);
  test_cluster(16);
  std::printf("\nptx_sm90: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail == 0 ? 0 : 1;
}

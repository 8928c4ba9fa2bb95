// flash_fwd.cuh — the tensor-core flash-attention forward kernel (mma.sync path, sm_80+).
//
// What it computes: O = softmax(scale·Q Kᵀ [softcap] [+ALiBi] [mask] [+sink]) V and the
// natural-log LSE per query row, in one pass over K/V, never writing the score matrix anywhere.
//
// Tiling (FlashAttention-2): one CTA per (query block of kBlockM rows, query head, batch); the
// product sits in grid.x, query blocks fastest (and longest-first, for causal load balance), so
// CTAs that share K/V run together and hit L2. Each warp owns kRowsPerWarp = kBlockM / kWarps
// query rows (16 or 32, i.e. 1 or 2 mma row tiles) and walks the K/V blocks of kBlockN keys:
//   S = Q Kᵀ         mma.m16n8k16, A = Q (ldmatrix from smem, or kept in registers), B = K (ldmatrix)
//   online softmax   in registers: row max over the 4 lanes of a quad, exp2 with scale·log2(e)
//                    folded into one FFMA, O rescaled by 2^(m_old - m_new)
//   O += P V         P converted to bf16/f16 in registers and used directly as the A operand
//                    (the C layout of S equals the A layout of P), B = V via ldmatrix.trans
// K/V arrive by cp.async into a ring of `stages` (K, V) buffers: after K(i) lands, V(i+S-1) is
// issued; after V(i) lands, K(i+S) is issued — with S = 1 this is FlashAttention-2's schedule
// (V loads under QKᵀ, the next K under P·V), S = 2 adds a whole block of prefetch.
// Shared memory rows are padded by 16 bytes (pitch = head_dim + 8 elements): a row pitch that is
// an odd number of 16-byte units makes every 8-row ldmatrix phase hit 8 different bank groups.
//
// Assumptions (checked by cuda_flash_select): f16/bf16; head_dim == head_dim_v, a multiple of 8,
// <= kHeadDim (padded columns are zero-filled); 16-byte aligned base pointers and strides that
// are multiples of 8 elements; sequence lengths < 2^31. Offsets are int64 throughout.
// Blocks fully outside the causal/window band are never visited; rows with no visible key get
// O = 0 and LSE = -inf (or the sink); keys past the end of the sequence are zero-filled in smem,
// so no NaN from unrelated memory can reach P·V.
//
// KV-cache mode (flash_fwd_kernel<Tr, T, CT>, CT != void; hdim 64 / 128 / 256 tiles only): the
// same kernel for decode() with more than 16 query rows (a prefill chunk against a paged or
// contiguous cache, serving.hpp). The sequence's key count comes from cache_seqlens on the device;
// K / V rows are addressed through a per-block table of byte offsets in shared memory (page from
// the block table, slot), so any page size works and each row costs one shared load per copy.
// 16-bit caches keep cp.async; 8-bit codes (e4m3, int8) are copied by cp.async into a staging
// buffer and converted to exact bf16 / f16 values after the wait (kStaged, the default), or loaded
// to registers, converted and stored (IOATTN_PREFILL_8BIT=regs; 1.2-1.6x slower on the H200), their
// k_scale folded into the score scale and v_scale into O.
//
// History (H200, bf16, 16k tokens, hidden 2048; PyTorch SDPA flash = FA2 in the same run)
//   1. FA2-style mma.sync kernel: padded smem, cp.async K/V ring, runtime mask/softcap/ALiBi/sink
//      flags (one instantiation per head dim and dtype), Q optionally held in registers.
//      hdim128 non-causal 16k: 297 TFLOP/s = 0.84x FA2; hdim64 0.75x; hdim256 0.74x.
//   2. Tile copies: one pointer bump per 16-byte cp.async and no bounds checks on full tiles
//      (the rolled, checked loop was ~450 of ~1000 instructions per warp per K/V block);
//      lazy O rescaling (only when a row max grows by > 2^8); ring depth compile-time.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/epilogue.cuh"
#include "cuda/ptx.cuh"
#include "cuda/serving.cuh"  // serving::E4m3, the 8-bit cache tag of the KV-cache mode

// IOATTN_SM80_EPI_VEC (compile time, default 1 since session 37; 0 = the previous element pairs):
// the epilogue's O rows (and flash_bwd.cuh's dK / dV rows) as 16-byte vectors after a quad transpose
// (store_acc_row, cuda/epilogue.cuh), as the sm90 kernels store theirs since session 36, where the
// head dim is unpadded and the rows 16-byte aligned; element pairs otherwise. H100, Nsight Compute
// SM cycles against 0 (docs/PERF.md "Session 37"): forward hdim 192 2k 0.988, hdim 96 0.998, hdim 32
// 4k causal 1.000; backward dK / dV kernel hdim 128 2k 0.976, hdim 64 4k causal 0.990.
#ifndef IOATTN_SM80_EPI_VEC
#define IOATTN_SM80_EPI_VEC 1
#endif

namespace ioattn::cuda {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = 2^(x·log2 e)
constexpr float kLn2 = 0.6931471805599453f;     // ln(2): natural LSE from a log2 one
constexpr float kNegInf = -__builtin_huge_valf();
constexpr float kRescaleLog2 = 8.f;  // lazy-rescale threshold: P <= 2^8 against a stale max

// Plain pointers + int64 strides (elements); everything the kernel reads.
struct FlashParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // optional
  int64_t q_batch = 0, q_seq = 0, q_head = 0;
  int64_t k_batch = 0, k_seq = 0, k_head = 0;
  int64_t v_batch = 0, v_seq = 0, v_head = 0;
  int64_t o_batch = 0, o_seq = 0, o_head = 0;
  int64_t lse_batch = 0, lse_seq = 0, lse_head = 0;
  int batch = 0, heads_q = 0, group = 1;  // kv head = h / group
  int seqlen_q = 0, seqlen_k = 0;         // fixed length, or the max for varlen
  int head_dim = 0;                       // actual (<= the kernel's kHeadDim)
  int num_m_blocks = 0;
  const int32_t* cu_seqlens_q = nullptr;  // varlen, on the device
  const int32_t* cu_seqlens_k = nullptr;
  float scale = 1.f;
  float scale_log2 = kLog2e;  // scale·log2(e)
  float softcap = 0.f;        // 0 = off
  float softcap_inv = 0.f;
  int window_left = -1, window_right = -1;  // -1 = unbounded (causal: right = 0); the host maps
                                            // windows wider than both sequences to -1
  const float* alibi_slopes = nullptr;
  const float* sinks = nullptr;
  // KV-cache mode only (flash_fwd_kernel<Tr, T, CT> with CT != void: decode() with more than 16
  // query rows, cuda_cache_prefill in flash_dispatch.cu). Query row i of sequence b sits at
  // position kv_lens[b] - seqlen_q + i. Token t of sequence b: with a block table, page
  // block_table[b * bt_batch + (t / page_size) * bt_page], slot t % page_size, element
  // page * k_batch + slot * k_seq + hk * k_head (k_batch is the page stride); without one,
  // b * k_batch + t * k_seq + hk * k_head. A length outside [0, kv_bound] or a block-table entry
  // outside [0, num_pages) among the sequence's pages makes that sequence's O and LSE NaN (the
  // decode kernels' rule); nothing out of range is read.
  const int32_t* kv_lens = nullptr;  // [batch], on the device
  const int32_t* block_table = nullptr;
  int64_t bt_batch = 0, bt_page = 0;
  int page_size = 1, page_shift = -1;  // page_shift: log2(page_size) for powers of two, else -1
  int64_t num_pages = 0;
  int kv_bound = 0;
  const float* k_scale = nullptr;  // 8-bit caches: per kv head, null = 1 (codes stay exact in smem)
  const float* v_scale = nullptr;
};

// Tile shape of one kernel instantiation. "Should not affect results, only speed."
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_, bool kQInRegs_>
struct FlashTile {
  static constexpr int kHeadDim = kHeadDim_;   // padded head dim the kernel is built for
  static constexpr int kBlockM = kBlockM_;     // query rows per CTA
  static constexpr int kBlockN = kBlockN_;     // keys per inner-loop step
  static constexpr int kWarps = kWarps_;
  static constexpr int kStages = kStages_;     // K/V ring depth, 1 or 2
  static constexpr bool kQInRegs = kQInRegs_;  // Q fragments loaded once into registers
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kWarps;
  static constexpr int kPitch = kHeadDim + 8;  // smem row pitch in elements (+16 B: no bank conflicts)
  static constexpr int kMinBlocksPerSm = kWarps <= 4 ? 2 : 1;  // register budget 255/thread either way
  static constexpr size_t kSmemBytes = (static_cast<size_t>(kBlockM) + 2 * kStages * kBlockN) * kPitch * 2;
  static_assert(kRowsPerWarp == 16 || kRowsPerWarp == 32, "a warp owns 1 or 2 mma row tiles");
  static_assert(kStages == 1 || kStages == 2, "a 3-deep ring measured slower (occupancy) on H200");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "k16 steps over keys and head dims");
  static_assert((kBlockM * kHeadDim / 8) % kThreads == 0 && (kBlockN * kHeadDim / 8) % kThreads == 0,
                "tile loads split evenly into 16-byte chunks per thread");
};

namespace flash_detail {

// cp.async of a (kRows, kHeadDim) tile, rows [0, rows) of g (row stride in elements) and columns
// [0, d); everything else is zero-filled. One commit group is closed by the caller.
// Thread t copies chunk (t % kChunks) of rows t / kChunks + i·kRowsPerPass: one 64-bit pointer
// bump per 16-byte copy, and no bounds checks at all for full tiles (every block but the last).
template <class Tr, int kRows, typename T>
__device__ __forceinline__ void load_tile(uint32_t s_tile, const T* g, int64_t g_row_stride, int rows,
                                          int d, int tid) {
  constexpr int kChunks = Tr::kHeadDim / 8;  // 16-byte chunks per row
  constexpr int kRowBytes = Tr::kPitch * 2;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kUnrolled = true;
#else
  // sm_8x: ptxas spills the hdim >= 128 kernels with the unrolled copy loop; the rolled loop
  // below costs more instructions but keeps every accumulator in registers.
  constexpr bool kUnrolled = Tr::kHeadDim < 128;
#endif
  if constexpr (kUnrolled && Tr::kThreads % kChunks == 0 && kRows % (Tr::kThreads / kChunks) == 0) {
    constexpr int kRowsPerPass = Tr::kThreads / kChunks;
    constexpr int kPasses = kRows / kRowsPerPass;
    const int r0 = tid / kChunks, c = tid % kChunks;
    // The row step is made opaque so the compiler cannot hoist kPasses 64-bit products out of
    // the main loop (that costs 2·kPasses registers per tensor, which the accumulators need).
    const int64_t step = ptx::opaque(g_row_stride * kRowsPerPass);
    const T* src = g + r0 * g_row_stride + c * 8;
    const uint32_t dst = s_tile + r0 * kRowBytes + c * 16;
    if (rows >= kRows && d == Tr::kHeadDim) {
#pragma unroll
      for (int i = 0; i < kPasses; ++i, src += step) ptx::cp_async_16(dst + i * kRowsPerPass * kRowBytes, src, 16);
    } else {
      const bool col_ok = c * 8 < d;
#pragma unroll
      for (int i = 0; i < kPasses; ++i, src += step) {
        const bool ok = col_ok && r0 + i * kRowsPerPass < rows;
        ptx::cp_async_16(dst + i * kRowsPerPass * kRowBytes, ok ? src : g, ok ? 16 : 0);
      }
    }
  } else {
    // Generic split (sm_8x, and head dims whose chunk count does not divide the thread count).
    // Not unrolled on purpose: unrolled, the compiler hoists one 64-bit address per chunk out of
    // the main loop and the kernel spills.
#pragma unroll 1
    for (int idx = tid; idx < kRows * kChunks; idx += Tr::kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool ok = r < rows && c * 8 < d;
      const T* src = ok ? g + r * g_row_stride + c * 8 : g;
      ptx::cp_async_16(s_tile + r * kRowBytes + c * 16, src, ok ? 16 : 0);
    }
  }
}

// 2·stages - 2 groups may stay in flight when block i's K (or V) must have landed (see the
// schedule above).
template <int kStages>
__device__ __forceinline__ void wait_kv() {
  ptx::cp_async_wait<2 * kStages - 2>();
}

// ---- KV-cache mode (CT != void) ----------------------------------------------------------------

template <typename CT>
constexpr int kCacheBytes = std::is_same_v<CT, __nv_bfloat16> || std::is_same_v<CT, __half> ? 2 : 1;

// Two 8-bit codes (the low 16 bits of w, lower address first) -> a packed pair of T, exactly:
// every e4m3 and int8 value is a bf16 and an f16 number (e4m3 NaN codes give NaN). The codes'
// scales are applied outside (k_scale in the score scale, v_scale on O).
template <typename CT, typename T>
__device__ __forceinline__ uint32_t code2_to(uint32_t w) {
  if constexpr (std::is_same_v<CT, serving::E4m3>) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    if constexpr (std::is_same_v<T, __half>) return static_cast<uint32_t>(r.x) | static_cast<uint32_t>(r.y) << 16;
    const float2 f = __half22float2(__half2(r));
    return ptx::pack2<T>(f.x, f.y);
  } else {
    static_assert(std::is_same_v<CT, int8_t>, "8-bit caches: serving::E4m3 or int8_t codes");
    return ptx::pack2<T>(static_cast<float>(static_cast<int8_t>(w & 0xffu)),
                         static_cast<float>(static_cast<int8_t>((w >> 8) & 0xffu)));
  }
}

// Eight 8-bit codes (lo: the lower four addresses) -> eight T values, one 16-byte tile chunk at dst.
template <typename CT, typename T>
__device__ __forceinline__ void store_codes8(uint32_t dst, uint32_t lo, uint32_t hi) {
  ptx::st_shared_v4(dst, code2_to<CT, T>(lo), code2_to<CT, T>(lo >> 16), code2_to<CT, T>(hi),
                    code2_to<CT, T>(hi >> 16));
}

// One (kRows, kHeadDim) K or V tile of the cache: row r from byte offset offs[r] of g (the
// shared-memory row table, below), columns [0, d); rows >= `rows` and columns >= d are zero.
// 16-bit caches: cp.async 16-byte chunks, as load_tile. 8-bit caches: 8 codes per chunk through
// registers (4 loads in flight per thread before their conversions), stored as 8 T values.
template <class Tr, int kRows, typename T, typename CT>
__device__ __forceinline__ void load_cache_tile(uint32_t s_tile, const unsigned char* g, const int64_t* offs,
                                                int rows, int d, int tid) {
  constexpr int kChunks = Tr::kHeadDim / 8;
  constexpr int kRowBytes = Tr::kPitch * 2;
  constexpr int kTotal = kRows * kChunks;
  constexpr int kIters = (kTotal + Tr::kThreads - 1) / Tr::kThreads;
  constexpr int kEB = kCacheBytes<CT>;
  static_assert(kTotal % Tr::kThreads == 0, "the tile's chunks split evenly over the threads");
  // Rolled on purpose, as load_tile's generic loop: unrolled, the compiler hoists every
  // iteration's addresses out of the main loop and the accumulators spill.
  if constexpr (kEB == 2) {
#pragma unroll 1
    for (int idx = tid; idx < kTotal; idx += Tr::kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool ok = r < rows && c * 8 < d;
      ptx::cp_async_16(s_tile + r * kRowBytes + c * 16, ok ? g + offs[r] + c * 16 : g, ok ? 16 : 0);
    }
  } else {
    // kBatch loads in flight per thread before the first conversion.
    constexpr int kBatch = kIters < 4 ? kIters : 4;
    static_assert(kIters % kBatch == 0, "whole batches");
#pragma unroll 1
    for (int i0 = 0; i0 < kIters; i0 += kBatch) {
      uint2 w[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int idx = tid + (i0 + i) * Tr::kThreads;
        const int r = idx / kChunks, c = idx % kChunks;
        w[i] = make_uint2(0u, 0u);
        if (r < rows && c * 8 < d) w[i] = __ldg(reinterpret_cast<const uint2*>(g + offs[r] + c * 8));
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int idx = tid + (i0 + i) * Tr::kThreads;
        const int r = idx / kChunks, c = idx % kChunks;
        store_codes8<CT, T>(s_tile + r * kRowBytes + c * 16, w[i].x, w[i].y);
      }
    }
  }
}

// Staged 8-bit tiles (kStaged): the raw codes of a (kRows, kHeadDim) tile go by cp.async into a
// staging buffer (rows of kHeadDim bytes), 16 codes per copy, so their global latency hides under
// the tile products as the 16-bit loads' does; after the wait, each thread converts the chunks it
// copied itself (its own completed copies are visible to it) into the tile, before the barrier
// that publishes the tile. Needs 16-byte aligned code rows and d % 16 == 0 (the selector checks).
template <class Tr, int kRows>
__device__ __forceinline__ void load_codes_tile(uint32_t s_stage, const unsigned char* g, const int64_t* offs,
                                                int rows, int d, int tid) {
  constexpr int kCC = Tr::kHeadDim / 16;  // 16-code chunks per row
  constexpr int kTotal = kRows * kCC;
#pragma unroll 1
  for (int idx = tid; idx < kTotal; idx += Tr::kThreads) {
    const int r = idx / kCC, c = idx % kCC;
    const bool ok = r < rows && c * 16 < d;
    ptx::cp_async_16(s_stage + r * Tr::kHeadDim + c * 16, ok ? g + offs[r] + c * 16 : g, ok ? 16 : 0);
  }
}

template <class Tr, int kRows, typename T, typename CT>
__device__ __forceinline__ void convert_codes_tile(uint32_t s_tile, uint32_t s_stage, int tid) {
  constexpr int kCC = Tr::kHeadDim / 16;
  constexpr int kTotal = kRows * kCC;
  constexpr int kRowBytes = Tr::kPitch * 2;
#pragma unroll 1
  for (int idx = tid; idx < kTotal; idx += Tr::kThreads) {
    const int r = idx / kCC, c = idx % kCC;
    const uint4 w = ptx::ld_shared_v4(s_stage + r * Tr::kHeadDim + c * 16);
    const uint32_t dst = s_tile + r * kRowBytes + c * 32;  // tile chunks 2c, 2c + 1
    store_codes8<CT, T>(dst, w.x, w.y);
    store_codes8<CT, T>(dst + 16, w.z, w.w);
  }
}

}  // namespace flash_detail

// Shared-memory bytes of the KV-cache mode beyond the tile: the row tables (stages + 1 slots of
// (K, V) byte offsets for the kBlockN keys of a block; see flash_fwd_kernel) and, staged 8-bit
// tiles, the codes of one K and one V tile per ring slot.
template <class Tr>
constexpr size_t cache_table_bytes() {
  return static_cast<size_t>(Tr::kStages + 1) * 2 * Tr::kBlockN * sizeof(int64_t);
}
template <class Tr>
constexpr size_t cache_stage_bytes() {
  return static_cast<size_t>(Tr::kStages) * 2 * Tr::kBlockN * Tr::kHeadDim;
}

// CT = void: the forward over contiguous / varlen K and V. CT = T (a 16-bit cache), serving::E4m3
// or int8_t (8-bit codes): K and V read through a KV cache (FlashParams' cache fields); 8-bit
// tiles through registers, or (kStaged) by cp.async into a staging buffer and converted after the
// wait (flash_detail::load_codes_tile).
template <class Tr, typename T, typename CT = void, bool kStaged = false>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocksPerSm) flash_fwd_kernel(const FlashParams p) {
  using namespace ptx;
  constexpr bool kCache = !std::is_void_v<CT>;
  constexpr bool k8 = kCache && !std::is_same_v<CT, T>;  // 8-bit codes, converted to T on load
  static_assert(!kStaged || k8, "staging is for 8-bit codes");
  static_assert(!kCache || std::is_same_v<CT, T> || flash_detail::kCacheBytes<CT> == 1, "cache dtype");
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim;
  constexpr int kRowBytes = Tr::kPitch * 2;
  constexpr int kMT = Tr::kRowsPerWarp / 16;  // 16-row mma tiles per warp
  constexpr int kNT = kN / 8;                 // 8-key score tiles per block
  constexpr int kDT = kD / 8;                 // 8-column output tiles
  constexpr int kKD = kD / 16;                // k16 steps of Q Kᵀ
  constexpr int kKN = kN / 16;                // k16 steps of P V

  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int stages = Tr::kStages;
  const uint32_t sQ = smem_u32(smem);                   // (kM, pitch)
  const uint32_t sK = sQ + kM * kRowBytes;              // (stages, kN, pitch)
  const uint32_t sV = sK + stages * kN * kRowBytes;     // (stages, kN, pitch)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // fragment row group / column pair
  const int m_block = p.num_m_blocks - 1 - static_cast<int>(blockIdx.x % p.num_m_blocks);
  const int bh = static_cast<int>(blockIdx.x / p.num_m_blocks);
  const int h = bh % p.heads_q, b = bh / p.heads_q, hk = h / p.group;

  int q_start = 0, k_start = 0, sq = p.seqlen_q, sk = p.seqlen_k;
  if (!kCache && p.cu_seqlens_q != nullptr) {
    q_start = p.cu_seqlens_q[b];
    sq = p.cu_seqlens_q[b + 1] - q_start;
    k_start = p.cu_seqlens_k[b];
    sk = p.cu_seqlens_k[b + 1] - k_start;
  }
  const int m0 = m_block * kM;
  if (m0 >= sq) return;
  const int m_end = min(m0 + kM, sq);
  if constexpr (kCache) {
    // The sequence's length and every block-table entry of its pages, checked before anything is
    // read through them (the same verdict in every CTA of the sequence).
    const int len = p.kv_lens[b];
    bool bad = len < 0 || len > p.kv_bound;
    if (!bad && p.block_table != nullptr) {
      const int pages = (len + p.page_size - 1) / p.page_size;
      const int32_t* bt = p.block_table + b * p.bt_batch;
      for (int j = tid; j < pages; j += Tr::kThreads) {
        const int32_t e = bt[j * p.bt_page];
        bad |= e < 0 || e >= p.num_pages;
      }
    }
    if (__syncthreads_or(bad)) {
      T* gO = static_cast<T*>(p.o) + b * p.o_batch + h * p.o_head;
      const T nan_t = static_cast<T>(__int_as_float(0x7fc00000));
      for (int idx = tid; idx < (m_end - m0) * p.head_dim; idx += Tr::kThreads)
        gO[static_cast<int64_t>(m0 + idx / p.head_dim) * p.o_seq + idx % p.head_dim] = nan_t;
      if (p.lse != nullptr)
        for (int r = m0 + tid; r < m_end; r += Tr::kThreads)
          p.lse[b * p.lse_batch + h * p.lse_head + static_cast<int64_t>(r) * p.lse_seq] = __int_as_float(0x7fc00000);
      return;
    }
    sk = len;
  }
  const int off = sk - sq;  // bottom-right alignment: row i sees up to key i + off

  // Key blocks that intersect the band of rows [m0, m_end): visited from the last down.
  // (Positions stay in int: the host guarantees seqlen_q + seqlen_k + window < 2^31.)
  int n_lo = 0, n_hi = sk;
  if (p.window_left >= 0) n_lo = max(0, m0 + off - p.window_left);
  if (p.window_right >= 0) n_hi = min(sk, m_end - 1 + off + p.window_right + 1);
  const int nb_lo = n_lo / kN;
  const int n_blocks = n_hi > n_lo ? (n_hi + kN - 1) / kN - nb_lo : 0;
  const int nb_top = nb_lo + n_blocks - 1;

  const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch + (q_start + m0) * p.q_seq + h * p.q_head;
  const T* gK = static_cast<const T*>(p.k) + b * p.k_batch + k_start * p.k_seq + hk * p.k_head;
  const T* gV = static_cast<const T*>(p.v) + b * p.v_batch + k_start * p.v_seq + hk * p.v_head;

  // KV-cache mode: K / V rows come from anywhere in the cache, so each block's rows get a table of
  // byte offsets in shared memory (K then V, kN each; stages + 1 slots), written by threads < kN
  // (one key each: its page from the block table, its slot) `stages` blocks ahead of the block's
  // first load: block j's table is written in iteration j - stages, between the two barriers, so
  // it is visible to K(j) (issued after that iteration's second barrier) and to V(j) (one
  // iteration later), and slot j % (stages + 1) was last read by V(j - stages - 1), issued before.
  constexpr int kTabSlots = Tr::kStages + 1;
  [[maybe_unused]] int64_t* tab = reinterpret_cast<int64_t*>(smem + (kM + 2 * stages * kN) * kRowBytes);
  // (kStaged: the codes of K slot s at sStage + s * kN * kHeadDim, V's after the K slots)
  [[maybe_unused]] const uint32_t sStage = sQ + (kM + 2 * stages * kN) * kRowBytes + kTabSlots * 2 * kN * 8;
  [[maybe_unused]] const uint32_t sStageV = sStage + stages * kN * kD;
  [[maybe_unused]] const unsigned char* cK = nullptr;
  [[maybe_unused]] const unsigned char* cV = nullptr;
  if constexpr (kCache) {
    constexpr int kEB = flash_detail::kCacheBytes<CT>;
    const bool paged = p.block_table != nullptr;  // contiguous: the sequence's rows from b * batch stride
    cK = static_cast<const unsigned char*>(p.k) + ((paged ? 0 : b * p.k_batch) + hk * p.k_head) * kEB;
    cV = static_cast<const unsigned char*>(p.v) + ((paged ? 0 : b * p.v_batch) + hk * p.v_head) * kEB;
  }
  static_assert(!kCache || kN <= Tr::kThreads, "one table writer per key of a block");
  auto write_table = [&](int j) {
    if constexpr (kCache) {
      constexpr int kEB = flash_detail::kCacheBytes<CT>;
      if (j < n_blocks && tid < kN) {
        const int key = (nb_top - j) * kN + tid;
        int64_t ko = 0, vo = 0;
        if (key < sk) {
          int64_t page = 0, slot = key;
          if (p.block_table != nullptr) {
            const int pi = p.page_shift >= 0 ? key >> p.page_shift : key / p.page_size;
            slot = key - pi * p.page_size;
            page = p.block_table[b * p.bt_batch + pi * p.bt_page];
          }
          ko = (page * p.k_batch + slot * p.k_seq) * kEB;
          vo = (page * p.v_batch + slot * p.v_seq) * kEB;
        }
        int64_t* t = tab + (j % kTabSlots) * 2 * kN;
        t[tid] = ko;
        t[kN + tid] = vo;
      }
    }
  };

  // Block `it` lives in ring slot it % stages; callers pass that slot.
  auto load_k = [&](int it, int slot) {
    if (it < n_blocks) {
      const int n0 = (nb_top - it) * kN;
      if constexpr (kStaged)
        flash_detail::load_codes_tile<Tr, kN>(sStage + slot * kN * kD, cK, tab + (it % kTabSlots) * 2 * kN, sk - n0,
                                              p.head_dim, tid);
      else if constexpr (kCache)
        flash_detail::load_cache_tile<Tr, kN, T, CT>(sK + slot * kN * kRowBytes, cK, tab + (it % kTabSlots) * 2 * kN,
                                                     sk - n0, p.head_dim, tid);
      else
        flash_detail::load_tile<Tr, kN>(sK + slot * kN * kRowBytes, gK + n0 * p.k_seq, p.k_seq,
                                        sk - n0, p.head_dim, tid);
    }
    cp_async_commit();
  };
  auto load_v = [&](int it, int slot) {
    if (it < n_blocks) {
      const int n0 = (nb_top - it) * kN;
      if constexpr (kStaged)
        flash_detail::load_codes_tile<Tr, kN>(sStageV + slot * kN * kD, cV, tab + (it % kTabSlots) * 2 * kN + kN,
                                              sk - n0, p.head_dim, tid);
      else if constexpr (kCache)
        flash_detail::load_cache_tile<Tr, kN, T, CT>(sV + slot * kN * kRowBytes, cV,
                                                     tab + (it % kTabSlots) * 2 * kN + kN, sk - n0, p.head_dim, tid);
      else
        flash_detail::load_tile<Tr, kN>(sV + slot * kN * kRowBytes, gV + n0 * p.v_seq, p.v_seq,
                                        sk - n0, p.head_dim, tid);
    }
    cp_async_commit();
  };

  if constexpr (kCache) {  // the tables of the prologue's blocks
    for (int j = 0; j < stages; ++j) write_table(j);
    __syncthreads();
  }
  // Prologue: groups Q+K0, V0, K1, V1, ..., K(S-1)  (2S-1 groups).
  flash_detail::load_tile<Tr, kM>(sQ, gQ, p.q_seq, m_end - m0, p.head_dim, tid);
  load_k(0, 0);
  for (int s = 1; s < stages; ++s) {
    load_v(s - 1, s - 1);
    load_k(s, s);
  }

  // Score transform: "plain" folds scale·log2(e) into the exp2 FFMA (raw scores are compared,
  // which needs scale > 0); otherwise scores are mapped to the log2 domain first.
  // (8-bit caches: the codes' k_scale joins the score scale)
  float scale = p.scale, scale_log2 = p.scale_log2;
  if constexpr (k8) {
    scale *= p.k_scale != nullptr ? p.k_scale[hk] : 1.f;
    scale_log2 = scale * kLog2e;
  }
  const bool plain = p.softcap == 0.f && p.alibi_slopes == nullptr && scale > 0.f;
  const float mul = plain ? scale_log2 : 1.f;
  const float slope_log2 = p.alibi_slopes != nullptr ? p.alibi_slopes[h] * kLog2e : 0.f;
  const int row0 = m0 + warp * Tr::kRowsPerWarp + g;  // sequence row of c0 in row tile 0

  // ldmatrix lane addresses (see ptx.cuh for the fragment each matrix becomes).
  const uint32_t q_lane = sQ + (warp * Tr::kRowsPerWarp + lane % 16) * kRowBytes + (lane / 16) * 16;
  const uint32_t k_lane = (lane % 8 + (lane / 16) * 8) * kRowBytes + ((lane / 8) % 2) * 16;
  const uint32_t v_lane = (lane % 8 + ((lane / 8) % 2) * 8) * kRowBytes + (lane / 16) * 16;

  float acc_o[kMT][kDT][4];  // (rows, head_dim) accumulator, fp32
  float row_max[kMT][2];     // running max of the raw (plain) or log2-domain scores
  float row_sum[kMT][2];     // this thread's part of the running denominator
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
    row_max[mt][0] = row_max[mt][1] = kNegInf;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  uint32_t q_frag[Tr::kQInRegs ? kMT : 1][Tr::kQInRegs ? kKD : 1][4];

  for (int it = 0; it < n_blocks; ++it) {
    const int stage = it & (stages - 1);  // ring slot of block it (stages is 1 or 2)
    const int n0 = (nb_top - it) * kN;
    flash_detail::wait_kv<stages>();  // K(it) (and Q) landed
    if constexpr (kStaged)  // this thread's K(it) codes -> the tile (published by the barrier below)
      flash_detail::convert_codes_tile<Tr, kN, T, CT>(sK + stage * kN * kRowBytes, sStage + stage * kN * kD, tid);
    __syncthreads();
    if constexpr (Tr::kQInRegs) {
      if (it == 0) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int kk = 0; kk < kKD; ++kk) ldmatrix_x4(q_frag[mt][kk], q_lane + mt * 16 * kRowBytes + kk * 32);
      }
    }
    load_v(it + stages - 1, stage ^ (stages - 1));  // the slot of block it-1, consumed
    write_table(it + stages);                       // (KV-cache mode; see above)

    // ---- S = Q Kᵀ: (kRowsPerWarp, kN) per warp ----
    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
    const uint32_t k_stage = sK + stage * kN * kRowBytes + k_lane;
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if constexpr (Tr::kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][kk][e];
        } else {
          ldmatrix_x4(a[mt], q_lane + mt * 16 * kRowBytes + kk * 32);
        }
      }
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bk[4];  // b0,b1 of key tiles 2np and 2np+1
        ldmatrix_x4(bk, k_stage + np * 16 * kRowBytes + kk * 32);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_m16n8k16<T>(s[mt][2 * np], a[mt], bk[0], bk[1]);
          mma_m16n8k16<T>(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    // ---- scores: log2 domain (softcap, ALiBi), then the mask for blocks that need one ----
    if (!plain) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = s[mt][nt][e] * scale;
            if (p.softcap > 0.f) x = p.softcap * tanh_approx(x * p.softcap_inv);
            x *= kLog2e;
            // |i + off - j| for row i = row0 + 16mt + 8(e/2), key j = n0 + 8nt + 2t + e%2
            const int dist = row0 + off - n0 - 2 * t + mt * 16 + (e / 2) * 8 - nt * 8 - (e % 2);
            x -= slope_log2 * fabsf(static_cast<float>(dist));  // slope 0 when ALiBi is off
            s[mt][nt][e] = x;
          }
    }
    const bool needs_mask = n0 + kN > sk ||
                            (p.window_right >= 0 && n0 + kN - 1 > m0 + off + p.window_right) ||
                            (p.window_left >= 0 && n0 < m_end - 1 + off - p.window_left);
    if (needs_mask) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const int diag = row0 + mt * 16 + rh * 8 + off;
          const int lo = p.window_left >= 0 ? diag - p.window_left : 0;
          const int hi = p.window_right >= 0 ? min(sk, diag + p.window_right + 1) : sk;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = n0 + nt * 8 + 2 * t + e;
              if (j < lo || j >= hi) s[mt][nt][2 * rh + e] = kNegInf;
            }
        }
    }

    // ---- online softmax (rows g and g+8 of each row tile; a quad shares a row) ----
    // Lazy rescaling: the running max only moves (and O, l are rescaled) when a row's max grows
    // by more than 2^kRescaleLog2; otherwise P is computed against the stale max and stays
    // <= 2^8, harmless in fp32 and bf16/f16, and exact after the final division by l (which
    // uses the same max). Past the first blocks a row's max rarely jumps that much, so the
    // O·corr multiplies (head_dim/4 per row per step) are mostly branched over. The condition
    // is uniform over a quad; a warp skips the branch when all 8 of its row pairs agree.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        float m = row_max[mt][rh];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) m = fmaxf(m, fmaxf(s[mt][nt][2 * rh], s[mt][nt][2 * rh + 1]));
        m = fmaxf(m, shfl_xor(m, 1));
        m = fmaxf(m, shfl_xor(m, 2));
        // -inf - -inf is NaN, so a row that has seen nothing keeps max -inf; m_old = -inf and a
        // finite m gives corr = 0 (O and l are still 0 then).
        if (m * mul - row_max[mt][rh] * mul > kRescaleLog2) {
          const float corr = exp2_approx(row_max[mt][rh] * mul - m * mul);
          row_max[mt][rh] = m;
          row_sum[mt][rh] *= corr;
#pragma unroll
          for (int dt = 0; dt < kDT; ++dt) {
            acc_o[mt][dt][2 * rh] *= corr;
            acc_o[mt][dt][2 * rh + 1] *= corr;
          }
        }
      }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        // A row with no visible key yet keeps max -inf: subtract 0 so exp2(-inf) = 0, never NaN.
        const float m_scaled = row_max[mt][rh] == kNegInf ? 0.f : row_max[mt][rh] * mul;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = exp2_approx(fmaf(s[mt][nt][2 * rh + e], mul, -m_scaled));
            s[mt][nt][2 * rh + e] = pe;
            sum += pe;
          }
        row_sum[mt][rh] += sum;
      }

    // ---- P to 16-bit A fragments: C layout of key tiles (2kk, 2kk+1) = A layout of k16 step kk ----
    uint32_t pf[kMT][kKN][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int kk = 0; kk < kKN; ++kk) {
        pf[mt][kk][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pf[mt][kk][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pf[mt][kk][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pf[mt][kk][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }

    flash_detail::wait_kv<stages>();  // V(it) landed; every warp is done with K(it)
    if constexpr (kStaged)  // this thread's V(it) codes -> the tile (published by the barrier below)
      flash_detail::convert_codes_tile<Tr, kN, T, CT>(sV + stage * kN * kRowBytes, sStageV + stage * kN * kD, tid);
    __syncthreads();
    load_k(it + stages, stage);  // slot of block it, just consumed

    // ---- O += P V: (kRowsPerWarp, kD) per warp ----
    const uint32_t v_stage = sV + stage * kN * kRowBytes + v_lane;
#pragma unroll
    for (int kk = 0; kk < kKN; ++kk)
#pragma unroll
      for (int dp = 0; dp < kDT / 2; ++dp) {
        uint32_t bv[4];  // b0,b1 of output tiles 2dp and 2dp+1
        ldmatrix_x4_trans(bv, v_stage + kk * 16 * kRowBytes + dp * 32);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_m16n8k16<T>(acc_o[mt][2 * dp], pf[mt][kk], bv[0], bv[1]);
          mma_m16n8k16<T>(acc_o[mt][2 * dp + 1], pf[mt][kk], bv[2], bv[3]);
        }
      }
  }
  cp_async_wait<0>();

  // ---- epilogue: O = acc / l (with the sink in l), LSE = m + log(l); written once ----
  const float sink_log2 = p.sinks != nullptr ? p.sinks[h] * kLog2e : kNegInf;
  T* gO = static_cast<T*>(p.o) + b * p.o_batch + q_start * p.o_seq + h * p.o_head;
  // 16-byte row stores need every column real (no padded head dim) and 16-byte rows.
  const bool o_vec = IOATTN_SM80_EPI_VEC && kD % 32 == 0 && p.head_dim == kD &&
                     vec16_ok<T>(p.o, p.o_batch, p.o_seq, p.o_head);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float l = row_sum[mt][rh];
      l += shfl_xor(l, 1);
      l += shfl_xor(l, 2);
      const float mx = row_max[mt][rh];
      float m_log2 = mx == kNegInf ? kNegInf : mx * mul;
      float o_scale = 1.f;
      if (sink_log2 > kNegInf) {  // the sink joins the denominator with a zero value vector
        const float mm = fmaxf(m_log2, sink_log2);
        o_scale = exp2_approx(m_log2 - mm);
        l = l * o_scale + exp2_approx(sink_log2 - mm);
        m_log2 = mm;
      }
      float inv = l > 0.f ? o_scale / l : 0.f;
      if constexpr (k8) inv *= p.v_scale != nullptr ? p.v_scale[hk] : 1.f;  // the codes' v_scale
      const int r = row0 + mt * 16 + rh * 8;
      if constexpr (IOATTN_SM80_EPI_VEC && kD % 32 == 0) {
        if (o_vec)  // every lane of the warp (shuffles); r < sq masks the stores
          store_acc_row<T, kD>(gO + static_cast<int64_t>(r) * p.o_seq, &acc_o[mt][0][0], rh, inv, lane, true, r < sq);
      }
      if (r < sq) {
        T* o_row = gO + static_cast<int64_t>(r) * p.o_seq;
        if (!o_vec) {  // (else stored above)
#pragma unroll
          for (int dt = 0; dt < kDT; ++dt)
            if (dt * 8 < p.head_dim)
              *reinterpret_cast<uint32_t*>(o_row + dt * 8 + 2 * t) =
                  pack2<T>(acc_o[mt][dt][2 * rh] * inv, acc_o[mt][dt][2 * rh + 1] * inv);
        }
        if (p.lse != nullptr && t == 0) {
          // (KV-cache mode: a NaN / +inf visible score leaves l NaN, and the row's LSE is NaN as in
          // the decode kernels; the plain forward keeps its -inf there)
          const bool poisoned = kCache && isnan(l);
          p.lse[b * p.lse_batch + h * p.lse_head + (q_start + static_cast<int64_t>(r)) * p.lse_seq] =
              l > 0.f || poisoned ? (m_log2 + __log2f(l)) * kLn2 : kNegInf;
        }
      }
    }
}

// Launch of one instantiation (the caller checked that kSmemBytes fits the device).
template <class Tr, typename T>
void launch_flash_fwd(const FlashParams& p, cudaStream_t stream, int64_t grid_x);

// What a head-dim translation unit exports to the dispatcher.
struct FlashKernelInfo {
  int head_dim, block_m, block_n, warps, stages;
  bool q_in_regs;
  const char* reason;  // why this tile, written next to the traits
  size_t smem_bytes;   // dynamic shared memory per CTA
  const void* kernel_bf16;
  const void* kernel_f16;
  // Launches the bf16 (is_bf16) or f16 kernel with p.
  void (*launch)(const FlashParams& p, bool is_bf16, cudaStream_t stream);
};

}  // namespace ioattn::cuda

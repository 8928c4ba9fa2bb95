// serving_decode_mma.cu — the tensor-core split-KV decode kernel (mma.sync m16n8k16, sm_80+) for
// bf16 / f16 queries and caches with head_dim == head_dim_v in {64, 128, 256}, when every query
// row of a CTA sees the same keys (seqlen_q 1, or no causal / window mask): the serving case.
//
// Same grid, key ranges, merge and outputs as the fp32 FMA kernel (serving_decode.cu, whose file
// comment is the full description); what differs is the arithmetic per tile and the loader.
//
// Keys are the mma M dimension ("swap AB", as FlashInfer and FA3 do for decode): a decode CTA has
// few query rows (GQA 32/8, one token: 4), so they are the N = 8 dimension (NT n-tiles: 8 rows, or
// 16 when a kv head has more than 8 rows and D <= 128). Each of the 4 warps takes 16 keys of a
// 64-key tile:
//   S^T (16 keys x 8 rows) = K Q^T   A = K rows by ldmatrix (dims contiguous = row-major A),
//                                    B = Q^T from registers (lane holds query row g, loaded once);
//                                    D/16 mma in two accumulation chains (even / odd k-steps)
//   scale, softcap, ALiBi, mask on the C tile (keys g, g+8; rows 2t, 2t+1); online softmax per
//   (warp, row) in log2 units: column max over the 8 lanes sharing t (shfl xor 4, 8, 16), one
//   ex2.approx per score, O^T rescaled only when some row's max grew (a warp vote); l is a
//   per-lane partial sum, reduced once at the end
//   P^T as B                         the C tile packed to 16 bits is (key g; rows 2t, 2t+1);
//                                    movmatrix.trans makes it (keys 2t, 2t+1; row g), the B layout.
//                                    P = P_hi + P_lo (each rounded to the input type; P_lo carries
//                                    the residual), so the weights keep ~16 significant bits
//                                    instead of 8 (bf16) and O matches the fp32 kernel
//   O^T (D x 8 rows) += V^T P^T      A = V^T by ldmatrix.trans (16 dims x 16 keys per x4),
//                                    2 x D/16 mma
// Loader: cp.async 16-byte chunks into a STAGES-deep ring; contiguous caches advance a row pointer
// by a constant; paged caches read (page, slot) of each key from a shared-memory ring that threads
// < 64 fill STAGES - 1 tiles ahead (the page by cp.async from the block table, the slot by a
// store), so no thread waits on a dependent global load and no division runs per row.
//
// History (H200, GQA 32/8, hdim 128, bf16, graph replay): the first tensor-core kernel held the
// query rows as M (16 rows, 3/4 padding at GQA 4) and computed each row's page and 64-bit address
// per chunk: ~1100 warp instructions per 16 keys, 2 warps per scheduler waiting 4.2 cycles between
// instructions (ncu), 0.50 / 1.89 / 2.90 TB/s at b1 x 4k / 32k / 128k and paged 1.17-1.29x slower
// than contiguous. This kernel (with the merge rewritten, serving_decode.cu): 1.25 / 3.17 / 3.86
// TB/s, 4.1-4.2 TB/s at batch >= 16, paged within 3% of contiguous. Session 9 (IOATTN_DECODE_TRACE,
// below): ~12,000 of a b1 x 4k CTA's ~18,500 cycles were fixed costs (64-bit index divisions, the
// q loads' first use stalling the warp before any K/V load was issued, an epilogue with divisions
// per output element); the K/V loads now go out first and the epilogue writes one row per warp:
// b1 x 4k 13.6 -> 12.9 us per call. The burst's cp.async issue still takes ~3,500 cycles per CTA.
//
// Why "every row sees the same keys": a masked key inside the loaded range would still be
// multiplied by P = 0 on the tensor core, and 0 * inf = NaN would reach rows that must not see its
// V. With one visible range per CTA, every key inside [klo, khi) is visible to every real row and
// keys outside are zero-filled, so the CPU semantics hold exactly. Other shapes use the FMA kernel.
//
// Shared memory: K and V tiles of 64 unpadded rows, 16-byte chunk c of row r stored at chunk
// c ^ swz(r) (MmaTraits), so every 8-row ldmatrix phase hits 8 bank groups; 4 / 3 / 2 stages for
// D = 64 / 128 / 256 (64 / 96 / 128 KiB at 16 bits). The warps' accumulators are merged through the
// same memory. Until session 14 the rows were padded to D * 2 + 16 bytes instead: a cp.async whose
// shared row starts 16 bytes off a 32-byte boundary (every odd row) made the L2 serve 1.5x the
// sectors of the bytes read (ncu: 34% L2 hits, 96% of L2 throughput at 88% DRAM), and the
// swizzled rows took b16 x 32k from 4.17 to 4.54 TB/s (docs/PERF.md, session 14).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <string>
#include <type_traits>

#include "cuda/check.cuh"
#include "cuda/hopper/ptx_sm90.cuh"
#include "cuda/ptx.cuh"
#include "cuda/serving.cuh"
#include "cuda/serving_decode.cuh"

namespace ioattn::cuda::serving {
namespace {

constexpr int kBK = 64;  // keys per tile: 16 per warp

// IOATTN_DECODE_TRACE=1 builds (gpu-check stage dectrace; off in every other build): thread 0 of
// the first kDtCtas CTAs stamps the SM clock at the kernel's phases and the global timer at its
// start and end; the host prints per-phase statistics over the CTAs after the 40th launch of an
// instance (launch() below).
#ifndef IOATTN_DECODE_TRACE
#define IOATTN_DECODE_TRACE 0
#endif
#if IOATTN_DECODE_TRACE
constexpr int kDtCtas = 1024, kDtPoints = 8;
__device__ long long g_dec_clk[kDtCtas][kDtPoints];
__device__ unsigned long long g_dec_gt[kDtCtas][2];
__device__ __forceinline__ unsigned long long dec_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
#define DEC_TRACE(k)                                                                        \
  do {                                                                                      \
    if (threadIdx.x == 0 && blockIdx.x < kDtCtas) g_dec_clk[blockIdx.x][k] = clock64();    \
  } while (0)
#define DEC_TRACE_GT(k)                                                                     \
  do {                                                                                      \
    if (threadIdx.x == 0 && blockIdx.x < kDtCtas) g_dec_gt[blockIdx.x][k] = dec_globaltimer(); \
  } while (0)
#else
#define DEC_TRACE(k) \
  do {               \
  } while (0)
#define DEC_TRACE_GT(k) \
  do {                  \
  } while (0)
#endif

// kBytes: cache element bytes (2: bf16/f16, 1: f8e4m3/i8). kStagesOpt > 0 overrides the ring depth
// (experiments, see mma_decode_stages; 16-bit caches at head_dim 128: IOATTN_DECODE_STAGES=2, a
// 2-stage ring, 68 KiB, so 3 CTAs fit an SM instead of 2; =5, 170 KiB, one CTA per SM with 4 tiles
// = 128 KiB of K/V in flight instead of 2 x 2).
// Shared rows (kSwz, every cp.async instance): unpadded (pitch = the row's bytes) with 16-byte chunk
// c of row r stored at chunk c ^ swz(r), swz(r) = (r / kSwzDiv) & kSwzMask, so the 8 rows of an
// ldmatrix phase hit 8 different bank groups and every row starts on a 32-byte boundary. The bulk
// loader (kSwz false) copies whole rows, so it keeps rows padded by 16 bytes instead (an odd
// number of 16-byte units); a copy whose shared row starts 16 bytes off a 32-byte boundary costs
// the L2 1.5x the sectors (see the file comment).
template <int D, int kBytes = 2, int kStagesOpt = 0, bool kSwz = true>
struct MmaTraits {
  static constexpr int kCPR = D * kBytes / 16;         // 16-byte chunks per cache row
  static constexpr int kPitch = kSwz ? kCPR * 16 : (kCPR + 1) * 16;  // smem row pitch, bytes
  static constexpr int kSwzMask = (kCPR < 8 ? kCPR : 8) - 1;  // 8 chunks (128 bytes) span the banks
  static constexpr int kSwzDiv = kCPR < 8 ? 8 / kCPR : 1;     // rows sharing one 128-byte line
  static_assert(kCPR >= 4, "rows of at least 64 bytes");
  static constexpr int kTileBytes = kBK * kPitch;      // one K (or V) tile
  static constexpr int kStages = kStagesOpt > 0 ? kStagesOpt
                                 : kBytes == 1  ? (D == 256 ? 3 : 4)
                                 : D == 64      ? 4
                                 : D == 128     ? 3
                                                : 2;
  static constexpr int kSmem = kStages * 2 * kTileBytes;
  static constexpr int kLoadIters = kBK * kCPR / kThreads;  // chunks per thread per tile
  static_assert(kThreads % kCPR == 0 && kLoadIters * (kThreads / kCPR) == kBK, "loader covers the tile");
};

// The two halves of a packed bf16x2 / f16x2 register as fp32 (low half first).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    __half2_raw r;
    r.x = static_cast<unsigned short>(w & 0xffffu);
    r.y = static_cast<unsigned short>(w >> 16);
    return __half22float2(__half2(r));
  }
}

// P = hi + lo, each a packed pair of the input type.
template <typename T>
__device__ __forceinline__ void split2(float a, float b, uint32_t& hi, uint32_t& lo) {
  hi = ptx::pack2<T>(a, b);
  const float2 h = unpack2<T>(hi);
  lo = ptx::pack2<T>(a - h.x, b - h.y);
}

// Two 8-bit cache codes (the low 16 bits of w, lower address first) -> packed f16x2, exactly
// (e4m3 and int8 values are all f16 numbers; e4m3 NaN codes give NaN). The codes' scales are
// applied outside (k_scale in the score scale, v_scale on O).
template <typename CT>
__device__ __forceinline__ uint32_t code2_to_f16x2(uint32_t w) {
  if constexpr (std::is_same_v<CT, E4m3>) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    return static_cast<uint32_t>(r.x) | static_cast<uint32_t>(r.y) << 16;
  } else {  // int8: 1024 + (b ^ 0x80) as an f16 (exact), minus 1152
    const uint32_t u = ((w & 0xffu) | (w & 0xff00u) << 8) ^ 0x00800080u;
    __half2 h;
    uint32_t bits = u | 0x64006400u;
    memcpy(&h, &bits, 4);
    h = __hsub2(h, __half2(__float2half_rn(1152.0f), __float2half_rn(1152.0f)));
    memcpy(&bits, &h, 4);
    return bits;
  }
}

// Bulk-copy loader (kBulk, IOATTN_DECODE_LOADER=bulk; sm_90, 16-bit caches, head_dim 128): an
// experiment against the cp.async loader. Each K / V row of a tile is one 1-D bulk copy (TMA,
// cp.async.bulk) issued by its own lane (warp w: keys 16w..16w+15, lanes 0-15 the K rows, 16-31
// the V rows), completing on the stage's mbarrier (4 arrivals: one per warp, with the warp's byte
// count); rows outside [klo, khi) or with a bad page entry are zeroed by plain stores instead.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define IOATTN_DECODE_BULK_ENABLED 1
#else
#define IOATTN_DECODE_BULK_ENABLED 0
#endif

// One CTA: (sequence, kv head, split, block of 8 * NT query rows); see the file comment.
template <typename T, typename CT, int D, int NT, bool kBulk = false, int kStagesOpt = 0>
__global__ void __launch_bounds__(kThreads) decode_mma_kernel(const DecodeParams p) {
  // 8-bit caches: codes become f16 in registers (T = __half); q (bf16 or f16) is loaded as f16.
  constexpr bool k8 = std::is_same_v<CT, E4m3> || std::is_same_v<CT, int8_t>;
  static_assert(!k8 || std::is_same_v<T, __half>, "8-bit caches run the f16 mma");
  constexpr bool kSwz = !kBulk;  // the swizzled unpadded rows (MmaTraits)
  using Tr = MmaTraits<D, k8 ? 1 : 2, kStagesOpt, kSwz>;
  static_assert(Tr::kStages >= 2, "the loop waits for a tile while the next one is in flight");
  constexpr int STAGES = Tr::kStages, kKD = D / 16, ROWS = 8 * NT;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float grp_m[4 * ROWS], grp_l[4 * ROWS];
  __shared__ int grp_bad[4];
  __shared__ float row_m[ROWS], row_l[ROWS];
  __shared__ int row_bad[ROWS];
  __shared__ int2 pg_ring[STAGES][kBK];  // paged: (page, slot) of each key of the tiles in flight
  static_assert(!kBulk || (!k8 && D == 128), "the bulk loader is built for 16-bit caches, head_dim 128");
#if !IOATTN_DECODE_BULK_ENABLED
  if constexpr (kBulk) {  // never launched below sm_90 (the host checks)
    __trap();
    return;
  }
#endif
  __shared__ __align__(8) uint64_t full_bar[kBulk ? STAGES : 1];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  DEC_TRACE_GT(0);
  DEC_TRACE(0);
  const WorkItem w = work_item(p);
  DEC_TRACE(1);
  const int sq = p.seqlen_q;

  int64_t klo = 0, khi = 0;
  if (w.len > 0) {
    vis_keys(0, sq, w.len, p.wl, p.wr, &klo, &khi);
    klo = max(klo, w.k0);
    khi = min(khi, w.k1);
    if (khi < klo) khi = klo;
  }

  // Loader: chunk c_ld of rows j_ld0 + it * j_step of each tile (K and V: d == dv == D, so every
  // chunk of a row is real). Contiguous: row pointers advance by a constant. Paged: (page, slot)
  // of every key of the tiles in flight sit in pg_ring, written STAGES - 1 tiles ahead by threads
  // < kBK (the page by cp.async from the block table, the slot by a plain store), so the loader
  // does no global load and no division.
  const int64_t nkeys = khi - klo;
  const int ntiles = static_cast<int>((nkeys + kBK - 1) / kBK);
  constexpr int j_step_c = kThreads / Tr::kCPR;
  const int c_ld = tid % Tr::kCPR, j_ld0 = tid / Tr::kCPR, j_step = j_step_c;
  // swz of this thread's rows j_ld0 + it * j_step: swz(j_ld0) ^ swz_it(it), where swz_it is 0 or the
  // mask's top bit (j_step / kSwzDiv is a multiple of 8, or 4 with 8 chunks per row: adding 4 to
  // r / kSwzDiv flips bit 2 of its last 3 bits), so the chunk's XOR is a constant per iteration.
  static_assert(j_step_c % Tr::kSwzDiv == 0 && ((j_step_c / Tr::kSwzDiv) % (Tr::kSwzMask + 1) == 0 ||
                                                 (j_step_c / Tr::kSwzDiv) % (Tr::kSwzMask + 1) == (Tr::kSwzMask + 1) / 2),
                "the loader's rows advance the swizzle by 0 or its top bit");
  auto swz_it = [](int it) { return (it * (j_step_c / Tr::kSwzDiv)) & Tr::kSwzMask; };
  const int c_sw = kSwz ? c_ld ^ ((j_ld0 / Tr::kSwzDiv) & Tr::kSwzMask) : c_ld;
  const bool paged = p.block_table != nullptr;
  int pg_bad = 0;
  const uint8_t* kbase = p.k + w.hk * p.k_sh + c_ld * 16 + (paged ? 0 : w.b * p.k_sp);
  const uint8_t* vbase = p.v + w.hk * p.v_sh + c_ld * 16 + (paged ? 0 : w.b * p.v_sp);
  const int64_t k_it = j_step * p.k_ss, v_it = j_step * p.v_ss;  // bytes between a thread's rows
  // Paged: K and V rows share one byte offset when their page / slot strides agree (the usual
  // layout; the head strides may differ); an int32 entry e is valid iff (uint32) e < pages_u32.
  const bool kv_same = p.k_sp == p.v_sp && p.k_ss == p.v_ss;
  const uint32_t pages_u32 = static_cast<uint32_t>(min(p.num_pages, int64_t{1} << 31));
  const uint32_t ring = ptx::smem_u32(smem) + j_ld0 * Tr::kPitch;  // + the chunk: chunk_at(it)
  auto chunk_at = [&](int it) { return static_cast<uint32_t>((kSwz ? c_sw ^ swz_it(it) : c_ld) * 16); };
  const int khi32 = static_cast<int>(khi);  // keys < 2^31 (checked on the host)
  auto issue_pages = [&](int tile) {
    if (paged && tid < kBK && tile < ntiles) {
      const int t = static_cast<int>(klo) + tile * kBK + tid;
      int2* dst = &pg_ring[tile % STAGES][tid];
      if (t < khi32) {
        const int pi = p.page_shift >= 0 ? t >> p.page_shift : t / p.page_size;
        dst->y = t - pi * p.page_size;
        ptx::cp_async_4(ptx::smem_u32(&dst->x), p.block_table + w.b * p.bt_sb + static_cast<int64_t>(pi) * p.bt_sp, 4);
      }
    }
  };
  auto issue_rows = [&](int tile) {  // the tile's K / V rows
    if (tile >= ntiles) return;
#if IOATTN_DECODE_BULK_ENABLED
    if constexpr (kBulk) {
      const int slot = tile % STAGES, j = warp * 16 + (lane & 15);
      const bool is_v = lane >= 16;
      const int t = static_cast<int>(klo) + tile * kBK + j;
      const bool in = t < khi32;
      bool ok = in;
      const uint8_t* src;
      if (!paged) {
        src = is_v ? p.v + w.hk * p.v_sh + w.b * p.v_sp + static_cast<int64_t>(t) * p.v_ss
                   : p.k + w.hk * p.k_sh + w.b * p.k_sp + static_cast<int64_t>(t) * p.k_ss;
      } else {
        const int2 ps = pg_ring[slot][j];
        ok = in && ps.x >= 0 && ps.x < p.num_pages;
        pg_bad |= (in && !ok) ? 1 : 0;
        const uint64_t page = static_cast<uint32_t>(ok ? ps.x : 0), sl = static_cast<uint32_t>(ps.y);
        src = is_v ? p.v + w.hk * p.v_sh + (page * p.v_sp + sl * p.v_ss) : p.k + w.hk * p.k_sh + (page * p.k_sp + sl * p.k_ss);
      }
      uint8_t* dst = smem + slot * 2 * Tr::kTileBytes + (is_v ? Tr::kTileBytes : 0) + j * Tr::kPitch;
      if (!ok) {
#pragma unroll
        for (int c = 0; c < Tr::kCPR; ++c) reinterpret_cast<uint4*>(dst)[c] = make_uint4(0, 0, 0, 0);
      }
      const uint32_t bytes = static_cast<uint32_t>(__popc(__ballot_sync(0xffffffffu, ok))) * (D * 2);
      __syncwarp();  // the zeroed rows before the arrival that publishes the stage
      if (lane == 0) sm90::mbarrier_arrive_expect_tx(&full_bar[slot], bytes);
      __syncwarp();
      if (ok) sm90::bulk_load_1d(dst, src, D * 2, &full_bar[slot]);
      return;
    }
#endif
    const uint32_t dst0 = ring + (tile % STAGES) * 2 * Tr::kTileBytes;
    const int t0 = static_cast<int>(klo) + tile * kBK + j_ld0;
    if (!paged) {
      const uint8_t* kr = kbase + static_cast<int64_t>(t0) * p.k_ss;
      const uint8_t* vr = vbase + static_cast<int64_t>(t0) * p.v_ss;
#pragma unroll
      for (int it = 0; it < Tr::kLoadIters; ++it) {
        const bool ok = t0 + it * j_step < khi32;
        const uint32_t dst = dst0 + it * j_step * Tr::kPitch + chunk_at(it);
        ptx::cp_async_16_zfill(dst, kr, ok);
        ptx::cp_async_16_zfill(dst + Tr::kTileBytes, vr, ok);
        kr += k_it;
        vr += v_it;
      }
    } else {
      // Every (page, slot) entry of this thread's rows first, then the copies: interleaved, each
      // entry's shared-memory read waited out before its copy and the next read (ptxas keeps the
      // reads behind the earlier cp.async), ~8 serial load latencies per tile that one warp per
      // scheduler (one CTA per SM, batch 16 unsplit) could not hide.
      const int2* pgs = pg_ring[tile % STAGES] + j_ld0;
      int2 pse[Tr::kLoadIters];
#pragma unroll
      for (int it = 0; it < Tr::kLoadIters; ++it) pse[it] = pgs[it * j_step];
      auto rows = [&](auto same_tag) {  // same_tag: K and V at one offset (a uniform branch, below)
        constexpr bool kSame = decltype(same_tag)::value;
#pragma unroll
        for (int it = 0; it < Tr::kLoadIters; ++it) {
          const int2 ps = pse[it];
          const bool in = t0 + it * j_step < khi32;
          const bool ok = in && static_cast<uint32_t>(ps.x) < pages_u32;
          pg_bad |= (in && !ok) ? 1 : 0;
          const uint64_t page = static_cast<uint32_t>(ok ? ps.x : 0), slot = static_cast<uint32_t>(ps.y);
          const uint32_t dst = dst0 + it * j_step * Tr::kPitch + chunk_at(it);
          const uint64_t koff = page * p.k_sp + slot * p.k_ss;
          ptx::cp_async_16_zfill(dst, kbase + koff, ok);
          ptx::cp_async_16_zfill(dst + Tr::kTileBytes, vbase + (kSame ? koff : page * p.v_sp + slot * p.v_ss), ok);
        }
      };
      if (kv_same)
        rows(std::true_type{});
      else
        rows(std::false_type{});
    }
  };
  auto issue = [&](int tile) {
    issue_pages(tile + STAGES - 1);  // entries for the tile issued STAGES - 1 iterations later
    issue_rows(tile);
    ptx::cp_async_commit();
  };

  // ldmatrix lane offsets within a stage: K as the A operand of S^T (keys 0-7 | 8-15, dims +0 |
  // +8), V through .trans as the A operand of O^T (dims +0 | +8, keys 0-7 | 8-15).
  // 8-bit: K and V both by plain ldmatrix (16 keys x two 16-byte chunks per x4, as K).
  // The lane's K row and 16-byte half (chunk 0 / 1 of a pair), and V's (8-bit: V as K).
  const int kr = warp * 16 + (lane & 15), kh = lane >> 4;
  const int vr = k8 ? kr : warp * 16 + (lane & 7) + ((lane >> 4) << 3), vh = k8 ? kh : (lane >> 3) & 1;
  const int k_lane = kr * Tr::kPitch + kh * 16, v_lane = vr * Tr::kPitch + vh * 16;
  // kSwz: the lane's chunk pair m (chunks 2m + half) of its row r sits at byte 128 (m / 4) + sw[m % 4],
  // sw[b] = r * pitch + 16 ((2b + half) ^ swz(r)) (swz(r) < 8 touches the low 3 bits of the chunk
  // only): the m / 4 part is an immediate offset.
  int k_sw[4], v_sw[4];
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    k_sw[b] = kr * Tr::kPitch + 16 * ((2 * b + kh) ^ ((kr / Tr::kSwzDiv) & Tr::kSwzMask));
    v_sw[b] = vr * Tr::kPitch + 16 * ((2 * b + vh) ^ ((vr / Tr::kSwzDiv) & Tr::kSwzMask));
  }
  auto k_at = [&](uint32_t kv, int m) { return kSwz ? kv + k_sw[m & 3] + (m >> 2) * 128 : kv + k_lane + m * 32; };
  auto v_at = [&](uint32_t kv, int m) {
    return kSwz ? kv + Tr::kTileBytes + v_sw[m & 3] + (m >> 2) * 128 : kv + Tr::kTileBytes + v_lane + m * 32;
  };

  // The query rows first, by loads that stay in front of the prologue's copies (volatile asm; the
  // compiler sinks plain loads to their first use) and whose values are used only after them: the
  // loads go out ahead of this CTA's (and, at small batch, the whole grid's) burst of K / V
  // requests instead of queueing behind it, so the first use (the 8-bit caches' per-row max of q,
  // the first mma otherwise) does not wait for the burst to drain (session 32).
  // Q^T as the B operand: the lane holds query row g of each n-tile, dims 2t, 2t+1 (and +8) of
  // each k-step; with an 8-bit cache the k-step's dims are permuted as the K codes arrive (below):
  // b0 = dims 4t, 4t+1 and b1 = dims 4t+2, 4t+3 of the step's 16.
  // Where q's base and strides keep every lane's piece aligned (a grid-uniform test), the lane's
  // dims of a k-step go as one 8-byte load (8-bit caches: dims 4t..4t+3 are contiguous) or two
  // 4-byte loads (dims 2t, 2t+1 and 2t+8, 2t+9), else as 16-bit pairs. Rows past p.rows load row
  // (b, 0, the group's first head), which exists, and keep zeros: no per-lane branch.
  uint32_t qb[NT][kKD][2];
  {
    const auto* q16 = static_cast<const uint16_t*>(p.q);
    const bool wide = ((reinterpret_cast<uintptr_t>(p.q) | uint64_t(p.q_sb | p.q_ss | p.q_sh) << 1) & (k8 ? 7 : 3)) == 0;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int rr = w.rb * ROWS + nt * 8 + g;
      const bool ok = rr < p.rows;
      const int hh = ok ? rr / sq : 0, i = ok ? rr % sq : 0, h = w.hk * p.group + hh;
      const uint16_t* qrow = q16 + (w.b * p.q_sb + i * p.q_ss + h * p.q_sh);
      const uint32_t keep = ok ? 0xffffffffu : 0u;
      if (wide) {
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk) {
          if constexpr (k8) {
            const uint2 v = ptx::ld_global_v2_u32(qrow + kk * 16 + 4 * t4);
            qb[nt][kk][0] = v.x & keep, qb[nt][kk][1] = v.y & keep;
          } else {
#pragma unroll
            for (int half = 0; half < 2; ++half)
              qb[nt][kk][half] = ptx::ld_global_u32(qrow + kk * 16 + half * 8 + 2 * t4) & keep;
          }
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int col = k8 ? kk * 16 + 4 * t4 + 2 * half : kk * 16 + half * 8 + 2 * t4;
            qb[nt][kk][half] = (ptx::ld_global_u16(qrow + col) | ptx::ld_global_u16(qrow + col + 1) << 16) & keep;
          }
      }
    }
  }
#if IOATTN_DECODE_BULK_ENABLED
  if constexpr (kBulk) {
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) sm90::mbarrier_init(&full_bar[s], 4);  // one arrival per warp
      sm90::fence_mbarrier_init();
    }
    __syncthreads();
  }
#endif
  if (paged) {  // the entries of the first STAGES - 1 tiles, before their rows are issued
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue_pages(s);
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    __syncthreads();
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    // issue(s) writes the entries of tile s + STAGES - 1 into the slot of tile s - 1, which
    // issue(s - 1) read in other threads: a barrier between (the loop has one per tile).
    if (paged && s > 0) __syncthreads();
    issue(s);
  }
  DEC_TRACE(2);

  // bf16 q on the f16 mma: each row times 2^-s, its max finite |q| then in [2^13, 2^14) (a power
  // of two: exact; elements below 2^-24 of the row's largest flush, far under bf16's own rounding;
  // inf and NaN stay what they are and poison their row as on the CPU), and 2^s back in that row's
  // score scale: rscale[nt][e] for the rows 2t + e this lane holds in the C layout.
  float rscale[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) rscale[nt][0] = rscale[nt][1] = 1.0f;  // 16-bit caches, f16 q
  if constexpr (k8) {
    if (p.dtype == DType::bf16) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float m = 0.0f;  // max finite |q| of row g: this lane's dims, then over the 4 lanes that hold it
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint32_t bits = qb[nt][kk][half];
            const float lo = fabsf(__uint_as_float(bits << 16)), hi = fabsf(__uint_as_float(bits & 0xffff0000u));
            m = fmaxf(m, fmaxf(lo < INFINITY ? lo : 0.0f, hi < INFINITY ? hi : 0.0f));  // inf, NaN: 0
          }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        // s = floor(log2 m) - 13 from the exponent bits, so 2^13 <= m * 2^-s < 2^14: large rows
        // scaled into f16's range, small ones up out of its subnormals; clamped so 2^+-s stay
        // normal (an all-zero or subnormal row: s = -100, harmless).
        const int sh = min(114, max(-100, ((__float_as_int(m) >> 23) & 0xff) - 127 - 13));
        const float qs = __int_as_float((127 - sh) << 23);
#pragma unroll
        for (int kk = 0; kk < kKD; ++kk)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint32_t b = qb[nt][kk][half];
            qb[nt][kk][half] = ptx::pack2<__half>(__uint_as_float(b << 16) * qs, __uint_as_float(b & 0xffff0000u) * qs);
          }
#pragma unroll
        for (int e = 0; e < 2; ++e) rscale[nt][e] = __int_as_float((127 + __shfl_sync(0xffffffffu, sh, 4 * (2 * t4 + e))) << 23);
      }
    }
  }
  // The rows this lane holds in the C layouts of S^T and O^T: 2t + e of each n-tile.
  bool valid[NT][2];
  float slope[NT][2], diag[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int rr = w.rb * ROWS + nt * 8 + 2 * t4 + e;
      valid[nt][e] = rr < p.rows;
      const int hh = valid[nt][e] ? rr / sq : 0, i = valid[nt][e] ? rr % sq : 0;
      slope[nt][e] = (valid[nt][e] && p.alibi) ? p.alibi[w.hk * p.group + hh] * kLog2e : 0.0f;
      diag[nt][e] = static_cast<float>(i + w.len - sq);
    }

  float o[NT][kKD][4];  // O^T: m-tile mt holds dims mt * 16 + g (c0, c1) and + 8 (c2, c3)
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int mt = 0; mt < kKD; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nt][mt][e] = 0.0f;
  float m[NT][2], l[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) m[nt][0] = m[nt][1] = ninf(), l[nt][0] = l[nt][1] = 0.0f;
  int bad = 0;  // bit r: row r of the block saw a NaN or +inf score
  // Score scale per (n-tile, row 2t + e): scale, log2(e), k_scale (8-bit caches), 2^s (bf16 q).
  float smul[NT][2];
  {
    const float base = p.scale * kLog2e * (k8 ? w.k_scale : 1.0f);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) smul[nt][0] = base * rscale[nt][0], smul[nt][1] = base * rscale[nt][1];
  }
  const float cap = p.softcap * kLog2e, inv_cap = p.softcap > 0.0f ? 1.0f / cap : 0.0f;

  for (int tile = 0; tile < ntiles; ++tile) {
    ptx::cp_async_wait<STAGES - 2>();
    __syncthreads();
    issue(tile + STAGES - 1);
#if IOATTN_DECODE_BULK_ENABLED
    // Experimental path: a wrong byte count traps (a launch error) instead of hanging the GPU.
    if constexpr (kBulk) sm90::mbarrier_wait_or_trap(&full_bar[tile % STAGES], static_cast<uint32_t>((tile / STAGES) & 1));
#endif
    if (tile == 0) DEC_TRACE(3);
    if (tile == 1) DEC_TRACE(5);
    const uint32_t kv = ptx::smem_u32(smem + (tile % STAGES) * 2 * Tr::kTileBytes);
    const int key0 = static_cast<int>(klo) + tile * kBK + warp * 16 + g;  // keys of c0/c1; +8: c2/c3

    // S^T = K Q^T for the warp's 16 keys, in two accumulation chains (even / odd k-steps) so
    // that one warp per scheduler does not wait out D/16 dependent mma latencies.
    float s[NT][4], s2[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = s2[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kKD; kk += 2) {
      uint32_t a[4], b[4];
      if constexpr (k8) {
        // One x4: chunks kk, kk + 1 (16 dims each) of keys 0-7 / 8-15: the lane holds 4 codes
        // (dims 4t..4t+3) per (key, chunk); lo / hi halves become a0 / a2 (a1 / a3 for key g+8).
        uint32_t c[4];
        ptx::ldmatrix_x4(c, k_at(kv, kk / 2));
        a[0] = code2_to_f16x2<CT>(c[0]), a[2] = code2_to_f16x2<CT>(c[0] >> 16);
        a[1] = code2_to_f16x2<CT>(c[1]), a[3] = code2_to_f16x2<CT>(c[1] >> 16);
        b[0] = code2_to_f16x2<CT>(c[2]), b[2] = code2_to_f16x2<CT>(c[2] >> 16);
        b[1] = code2_to_f16x2<CT>(c[3]), b[3] = code2_to_f16x2<CT>(c[3] >> 16);
      } else {
        ptx::ldmatrix_x4(a, k_at(kv, kk));
        ptx::ldmatrix_x4(b, k_at(kv, kk + 1));
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        ptx::mma_m16n8k16<T>(s[nt], a, qb[nt][kk][0], qb[nt][kk][1]);
        ptx::mma_m16n8k16<T>(s2[nt], b, qb[nt][kk + 1][0], qb[nt][kk + 1][1]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] += s2[nt][e];

    // Score modifiers, mask, column maxima (over the 8 lanes sharing t), online softmax.
    bool grow = false;
    float alpha[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = ninf();
#pragma unroll
        for (int kh = 0; kh < 2; ++kh) {
          float x = s[nt][2 * kh + e] * smul[nt][e];
          if (inv_cap > 0.0f) x = cap * tanhf(x * inv_cap);
          if (p.alibi) x = fmaf(-slope[nt][e], fabsf(diag[nt][e] - static_cast<float>(key0 + 8 * kh)), x);
          const bool vis = valid[nt][e] && key0 + 8 * kh < khi;
          x = vis ? x : ninf();
          if (vis && !(x < INFINITY)) bad |= 1 << (nt * 8 + 2 * t4 + e);
          s[nt][2 * kh + e] = x;
          mx = fmaxf(mx, x);
        }
        mx = fmaxf(mx, ptx::shfl_xor(mx, 4));
        mx = fmaxf(mx, ptx::shfl_xor(mx, 8));
        mx = fmaxf(mx, ptx::shfl_xor(mx, 16));
        const float mn = fmaxf(m[nt][e], mx);
        const bool up = mn > m[nt][e];
        alpha[nt][e] = up ? ptx::exp2_approx(m[nt][e] - mn) : 1.0f;  // m = -inf -> 0
        grow |= up;
        m[nt][e] = mn;
        float sum = 0.0f;
#pragma unroll
        for (int kh = 0; kh < 2; ++kh) {
          const float pv = mn == ninf() ? 0.0f : ptx::exp2_approx(s[nt][2 * kh + e] - mn);  // -inf -> 0
          s[nt][2 * kh + e] = pv;
          sum += pv;
        }
        l[nt][e] = l[nt][e] * alpha[nt][e] + sum;
      }
    if (ptx::any_sync(grow)) {  // rare after the first tiles: rescale O^T only then
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int mt = 0; mt < kKD; ++mt) {
          o[nt][mt][0] *= alpha[nt][0];
          o[nt][mt][1] *= alpha[nt][1];
          o[nt][mt][2] *= alpha[nt][0];
          o[nt][mt][3] *= alpha[nt][1];
        }
    }

    // P^T as the B operand: P = P_hi + P_lo packed (key g | g + 8; rows 2t, 2t+1), transposed.
    uint32_t ph[NT][2], pl[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        uint32_t hi, lo;
        split2<T>(s[nt][2 * kh], s[nt][2 * kh + 1], hi, lo);
        ph[nt][kh] = ptx::movmatrix_trans(hi);
        pl[nt][kh] = ptx::movmatrix_trans(lo);
      }

    // O^T += V^T P^T.
    if constexpr (k8) {
      // One x4: chunks mt, mt + 1 of keys 0-7 / 8-15, (key; 4 dims) per lane. Converted, each
      // half is an 8x8 (keys x dim pairs) tile; movmatrix.trans gives (dim; keys 2t, 2t+1), the A
      // layout, with the m-tile's rows in the order g -> 4 (g / 2) + g % 2 (+2 for rows g + 8).
#pragma unroll
      for (int mt = 0; mt < kKD; mt += 2) {
        uint32_t c[4];
        ptx::ldmatrix_x4(c, v_at(kv, mt / 2));
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          uint32_t a[4];
          a[0] = ptx::movmatrix_trans(code2_to_f16x2<CT>(c[2 * u]));
          a[1] = ptx::movmatrix_trans(code2_to_f16x2<CT>(c[2 * u] >> 16));
          a[2] = ptx::movmatrix_trans(code2_to_f16x2<CT>(c[2 * u + 1]));
          a[3] = ptx::movmatrix_trans(code2_to_f16x2<CT>(c[2 * u + 1] >> 16));
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            ptx::mma_m16n8k16<T>(o[nt][mt + u], a, ph[nt][0], ph[nt][1]);
            ptx::mma_m16n8k16<T>(o[nt][mt + u], a, pl[nt][0], pl[nt][1]);
          }
        }
      }
    } else {
#pragma unroll
      for (int mt = 0; mt < kKD; ++mt) {
        uint32_t a[4];
        ptx::ldmatrix_x4_trans(a, v_at(kv, mt));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          ptx::mma_m16n8k16<T>(o[nt][mt], a, ph[nt][0], ph[nt][1]);
          ptx::mma_m16n8k16<T>(o[nt][mt], a, pl[nt][0], pl[nt][1]);
        }
      }
    }
#if IOATTN_DECODE_TRACE
    if (tile == 0) {  // (the stamp waits for tile 0's O^T: a use of the accumulators)
      float x = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) x += o[nt][0][0];
      if (x == 12345.f) g_dec_gt[0][1] = 0;
      DEC_TRACE(4);
    }
#endif
  }
  DEC_TRACE(6);

  // ---- merge the 4 warps (shared memory, in warp order) --------------------------------------
  ptx::cp_async_wait<0>();
  const int any_pg_bad = __syncthreads_or(pg_bad);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      l[nt][e] += ptx::shfl_xor(l[nt][e], 4);
      l[nt][e] += ptx::shfl_xor(l[nt][e], 8);
      l[nt][e] += ptx::shfl_xor(l[nt][e], 16);
    }
  for (int off = 1; off < 32; off <<= 1) bad |= __shfl_xor_sync(0xffffffffu, bad, off);
  if (g == 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        grp_m[warp * ROWS + nt * 8 + 2 * t4 + e] = m[nt][e];
        grp_l[warp * ROWS + nt * 8 + 2 * t4 + e] = l[nt][e];
      }
  }
  if (lane == 0) grp_bad[warp] = bad;
  __syncthreads();
  rows_from_groups<ROWS>(4, grp_m, grp_l, grp_bad, any_pg_bad | (w.seq_bad ? 1 : 0), row_m, row_l, row_bad);
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);  // [4][ROWS][D] fp32
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = nt * 8 + 2 * t4 + e;
      const float f = m[nt][e] > ninf() ? ptx::exp2_approx(m[nt][e] - row_m[r]) : 0.0f;
      // O^T rows of m-tile mt: dims mt * 16 + g and + 8 (8-bit: + 4 (g / 2) + g % 2, and + 2).
      const int d0 = k8 ? 4 * (g >> 1) + (g & 1) : g, d1 = k8 ? d0 + 2 : g + 8;
      float* dst = red + (warp * ROWS + r) * D;
#pragma unroll
      for (int mt = 0; mt < kKD; ++mt) {
        dst[mt * 16 + d0] = o[nt][mt][e] * f;
        dst[mt * 16 + d1] = o[nt][mt][2 + e] * f;
      }
    }
  __syncthreads();
  write_outputs<ROWS>(p, w, 4, D, red, row_m, row_l, row_bad);
  DEC_TRACE(7);
  DEC_TRACE_GT(1);
}

#if IOATTN_DECODE_TRACE
// Per phase (stamp k - stamp k-1; tile-1 phases only for CTAs with two or more tiles) the median,
// mean and max SM cycles over the traced CTAs, and the global-timer spread of their starts / ends.
void print_decode_trace(int64_t grid, const char* name) {
  IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
  static long long clk[kDtCtas][kDtPoints];
  static unsigned long long gt[kDtCtas][2];
  IOATTN_CUDA_CHECK(cudaMemcpyFromSymbol(clk, g_dec_clk, sizeof(clk)));
  IOATTN_CUDA_CHECK(cudaMemcpyFromSymbol(gt, g_dec_gt, sizeof(gt)));
  const int n = static_cast<int>(std::min<int64_t>(grid, kDtCtas));
  const char* names[kDtPoints] = {"", "work_item", "prologue issue", "q + wait tile0", "compute tile0",
                                  "wait tile1", "rest of loop", "epilogue"};
  std::fprintf(stderr, "decode trace %s grid %lld (%d CTAs traced), SM cycles median / mean / max:", name,
               static_cast<long long>(grid), n);
  for (int k = 1; k < kDtPoints; ++k) {
    std::vector<double> v;
    for (int b = 0; b < n; ++b) {
      const long long a = clk[b][k - 1], c = clk[b][k];
      if (a != 0 && c != 0 && c >= a) v.push_back(static_cast<double>(c - a));
    }
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    double mean = 0;
    for (double x : v) mean += x;
    mean /= v.size();
    std::fprintf(stderr, " | %s %.0f / %.0f / %.0f", names[k], v[v.size() / 2], mean, v.back());
  }
  std::vector<double> life;
  unsigned long long s0 = ~0ull, s1 = 0, e0 = ~0ull, e1 = 0;
  for (int b = 0; b < n; ++b) {
    if (clk[b][7] > clk[b][0]) life.push_back(static_cast<double>(clk[b][7] - clk[b][0]));
    s0 = std::min(s0, gt[b][0]), s1 = std::max(s1, gt[b][0]), e0 = std::min(e0, gt[b][1]), e1 = std::max(e1, gt[b][1]);
  }
  std::sort(life.begin(), life.end());
  if (!life.empty())
    std::fprintf(stderr, " | CTA life median %.0f max %.0f cycles | globaltimer ns: starts %llu..%llu, ends %llu..%llu",
                 life[life.size() / 2], life.back(), 0ull, s1 - s0, e0 - s0, e1 - s0);
  std::fprintf(stderr, "\n");
}
#endif

template <typename T, typename CT, int D, int NT, bool kBulk = false, int kStagesOpt = 0>
void launch(const DecodeParams& p, int64_t grid, cudaStream_t stream, bool pdl) {
  constexpr int smem = MmaTraits<D, std::is_same_v<CT, T> ? 2 : 1, kStagesOpt, !kBulk>::kSmem;
  static_assert(smem >= 4 * 8 * NT * D * 4, "the warp merge reuses [4][ROWS][D] fp32 of the ring");
  static std::atomic<uint64_t> smem_set{0};
  launch_decode_grid(&decode_mma_kernel<T, CT, D, NT, kBulk, kStagesOpt>, smem_set, p, grid, smem, stream, pdl);
#if IOATTN_DECODE_TRACE
  // Eager launches only (a graph capture calls this once per captured call): zero the stamps
  // before the 40th, print after it.
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  IOATTN_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
  static int calls = 0;
  if (cap == cudaStreamCaptureStatusNone && ++calls >= 39 && calls <= 40) {
    if (calls == 39) {
      static long long zero[kDtCtas][kDtPoints];
      IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
      IOATTN_CUDA_CHECK(cudaMemcpyToSymbol(g_dec_clk, zero, sizeof(zero)));
    } else {
      print_decode_trace(grid, D == 128 && NT == 1 ? "hdim128 nt1" : "other");
    }
  }
#endif
}

}  // namespace

bool mma_decode_supported(DType dtype, DType cache, int64_t d, int64_t dv, int64_t seqlen_q, bool masked) {
  const bool cache_ok = cache == dtype || cache == DType::f8e4m3 || cache == DType::i8;
  return (dtype == DType::bf16 || dtype == DType::f16) && cache_ok && d == dv && (d == 64 || d == 128 || d == 256) &&
         (seqlen_q == 1 || !masked);
}

bool mma_bulk_supported(DType dtype, DType cache, int64_t d, int arch) {
  if (!(arch >= 90 && cache == dtype && (dtype == DType::bf16 || dtype == DType::f16) && d == 128)) return false;
  // The device must run an image built for sm_90+ (a build for sm_80 only runs its PTX through
  // the JIT on an H200, where the bulk kernel body is a trap): ask the loaded image.
  cudaFuncAttributes a{};
  if (cudaFuncGetAttributes(&a, decode_mma_kernel<__nv_bfloat16, __nv_bfloat16, 128, 1, true>) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.ptxVersion >= 90;
}

int mma_rows_per_cta(int64_t rows_per_group, int64_t head_dim) {
  return rows_per_group > 8 && head_dim <= 128 ? 16 : 8;
}

int mma_decode_stages(DType cache, int64_t head_dim, bool bulk, int64_t work, int64_t max_seqlen_k) {
  const bool eight = cache == DType::f8e4m3 || cache == DType::i8;
  if ((cache == DType::bf16 || cache == DType::f16) && head_dim == 128 && !bulk) {
    const char* e = std::getenv("IOATTN_DECODE_STAGES");
    if (e != nullptr && std::strcmp(e, "2") == 0) return MmaTraits<128, 2, 2>::kStages;
    if (e != nullptr && std::strcmp(e, "5") == 0) return MmaTraits<128, 2, 5>::kStages;
    const bool forced = e != nullptr && *e != '\0';  // "3": the default ring
    if (!forced && work <= 8 && max_seqlen_k <= 4096) return MmaTraits<128, 2, 2>::kStages;
  }
  switch (head_dim) {  // the rings the instances below are built with
    case 64: return eight ? MmaTraits<64, 1>::kStages : MmaTraits<64, 2>::kStages;
    case 128: return eight ? MmaTraits<128, 1>::kStages : MmaTraits<128, 2>::kStages;
    default: return eight ? MmaTraits<256, 1>::kStages : MmaTraits<256, 2>::kStages;
  }
}

namespace {
// One (q / mma type, cache type): the head dim and n-tile switch.
template <typename T, typename CT>
void launch_dims(const DecodeParams& p, int64_t grid, cudaStream_t stream, bool pdl, bool bulk, int ring) {
  const bool two = mma_rows_per_cta(p.rows, p.d) == 16;
  if constexpr (std::is_same_v<T, CT>) {
    if (bulk) {  // the caller checked mma_bulk_supported: head_dim 128, sm_90
      two ? launch<T, CT, 128, 2, true>(p, grid, stream, pdl) : launch<T, CT, 128, 1, true>(p, grid, stream, pdl);
      return;
    }
  }
  if constexpr (std::is_same_v<T, CT>) {
    if (p.d == 128 && ring == MmaTraits<128, 2, 2>::kStages) {
      two ? launch<T, CT, 128, 2, false, 2>(p, grid, stream, pdl) : launch<T, CT, 128, 1, false, 2>(p, grid, stream, pdl);
      return;
    }
    if (p.d == 128 && ring == MmaTraits<128, 2, 5>::kStages) {
      two ? launch<T, CT, 128, 2, false, 5>(p, grid, stream, pdl) : launch<T, CT, 128, 1, false, 5>(p, grid, stream, pdl);
      return;
    }
  }
  switch (p.d) {
    case 64: two ? launch<T, CT, 64, 2>(p, grid, stream, pdl) : launch<T, CT, 64, 1>(p, grid, stream, pdl); break;
    case 128: two ? launch<T, CT, 128, 2>(p, grid, stream, pdl) : launch<T, CT, 128, 1>(p, grid, stream, pdl); break;
    case 256: launch<T, CT, 256, 1>(p, grid, stream, pdl); break;
    default: throw Error("q", "ioattn: the mma decode kernel has no head_dim " + std::to_string(p.d));
  }
}
}  // namespace

void launch_decode_mma(const DecodeParams& p, DType cache, int64_t grid, cudaStream_t stream, bool pdl, bool bulk,
                       int ring) {
  switch (cache) {
    case DType::bf16: launch_dims<__nv_bfloat16, __nv_bfloat16>(p, grid, stream, pdl, bulk, ring); break;
    case DType::f16: launch_dims<__half, __half>(p, grid, stream, pdl, bulk, ring); break;
    case DType::f8e4m3: launch_dims<__half, E4m3>(p, grid, stream, pdl, false, ring); break;
    case DType::i8: launch_dims<__half, int8_t>(p, grid, stream, pdl, false, ring); break;
    default: throw Error("cache.k_cache.dtype", "ioattn: the mma decode kernel takes bf16/f16/f8e4m3/i8 caches");
  }
}

}  // namespace ioattn::cuda::serving

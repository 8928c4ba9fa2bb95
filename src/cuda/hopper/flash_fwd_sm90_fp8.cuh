// flash_fwd_sm90_fp8.cuh — FP8 (e4m3) forward for Hopper (sm_90a): e4m3 Q, K, V with per
// (batch, kv head) descale factors, fp32 accumulation, bf16/f16 O, fp32 LSE.
//
// The structure is the v4 kernel's (flash_fwd_sm90.cuh: producer warpgroup with one TMA thread,
// two consumer warpgroups in ping-pong (three in round robin for the softmax-bound rows: hdim 64,
// hdim 128 without a mask), S_{j+1} issued with P_j V_j, persistent grid with the
// static or dynamic schedule, tile hand-over through tile_slot + full_q, O-rescale skip); what
// differs for 8-bit inputs:
//   * wgmma m64nNk32 e4m3 (WgmmaFp8, ptx_sm90.cuh): 32 keys / dims per k-step, one 128-byte
//     swizzled row = 128 elements, so a hdim-128 Q or K tile is a single column block (hdim 256:
//     two). At hdim 64 Q and K rows are 64 bytes: TMA SWIZZLE_64B and make_desc_sw64 (two k-steps
//     per row); V^T keeps 128-byte rows (128 keys) at every head dim.
//   * 8-bit wgmma takes only K-major shared-memory operands. Q K^T: Q and K are K-major as stored.
//     P V: B must be V^T [d x keys]. A pre-pass kernel (fp8_transpose_v below) writes
//     V^T [batch, heads_kv, d, seqlen_k padded to 128] into a workspace (cudaMallocAsync on the
//     call's stream), zero past seqlen_k, and TMA loads [d x 128 keys] boxes of it (kBlockN / 128
//     of them per key block, rounded up; past the padding the map's zeros).
//   * P (fp32 D fragment of S) becomes the e4m3 A fragment of P V in registers with no shuffles:
//     fp8_p_fragment keeps each value in its thread and permutes the key order inside every
//     32-key group; the pre-pass writes V^T in that same order (fp8_p_key), so P V is exact.
//   * Descales: scale * q_descale * k_descale goes into the softmax scale (and the LSE), v_descale
//     into the final 1 / rowsum; read once per tile from [batch, heads_kv] f32 arrays.
//   * kLocal instances (session 27, the bf16 kernel's kLocal rows carried over; on the causal
//     tiling): sliding windows with whole-block skipping, softcap, ALiBi and sinks from LocalParams,
//     passed as Fp8LocalParams so the other instances' parameter block (and code) is unchanged.
//     Softcap / ALiBi act on t = s * scale * q_descale * k_descale as on the other paths.
// Assumes (the fp8 rows of sm90_flash_select check it): head_dim = head_dim_v = 64, 128 or 256; q/k 16-byte
// aligned with 16-byte-multiple strides; o 4-byte aligned with even strides; kLocal: sequences
// below 2^29, varlen (session 28: ragged Q / K maps, a packed V^T workspace, fp8_vt_col); scale > 0,
// descales > 0.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "cuda/check.cuh"
#include "cuda/hopper/flash_fwd_sm90.cuh"
#include "cuda/hopper/ptx_sm90.cuh"
#include "cuda/hopper/sched_sm90.cuh"

namespace ioattn::cuda::sm90 {

// IOATTN_FP8_TRACE (a diagnostic build only, -DIOATTN_FP8_TRACE=1): SM clock stamps at the phases
// of the steady-state steps of the first tile of the first kTrBlocks CTAs, both consumer
// warpgroups (thread 0 of each), printed by the host after the 10th launch at a given seqlen
// (fp8_trace_print: mean cycles per phase, the step period, the two warpgroups' offset and the SM
// clock from %globaltimer).
#ifndef IOATTN_FP8_TRACE
#define IOATTN_FP8_TRACE 0
#endif
#if IOATTN_FP8_TRACE
namespace fp8_trace {
constexpr int kBlocks = 16, kSteps = 48, kPoints = 11;
static __device__ unsigned g_stamp[kBlocks][2][kSteps][kPoints];
static __device__ unsigned long long g_clock[kBlocks][2][2][2];  // (clock64, globaltimer) at step 2 and the last step
}  // namespace fp8_trace
#define FP8_TRACE(step, k)                                                                         \
  do {                                                                                             \
    if ((threadIdx.x & 127) == 0 && cw < 2 && round == 0 && blockIdx.x < fp8_trace::kBlocks &&    \
        (step) < fp8_trace::kSteps)                                                                \
      fp8_trace::g_stamp[blockIdx.x][cw][(step)][(k)] = static_cast<unsigned>(clock64());           \
  } while (0)
#define FP8_TRACE_TIME(slot)                                                                       \
  do {                                                                                             \
    if ((threadIdx.x & 127) == 0 && cw < 2 && round == 0 && blockIdx.x < fp8_trace::kBlocks) {       \
      uint64_t gt;                                                                                 \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));                                       \
      fp8_trace::g_clock[blockIdx.x][cw][(slot)][0] = clock64();                                   \
      fp8_trace::g_clock[blockIdx.x][cw][(slot)][1] = gt;                                          \
    }                                                                                              \
  } while (0)
#else
#define FP8_TRACE(step, k) \
  do {                     \
  } while (0)
#define FP8_TRACE_TIME(slot) \
  do {                       \
  } while (0)
#endif

// The v4 parameters plus the descales (null = 1; element strides of [batch, heads_kv]).
struct Fp8Params {
  FwdParams f;
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  int64_t qd_batch = 0, qd_head = 0, kd_batch = 0, kd_head = 0, vd_batch = 0, vd_head = 0;
};
// The kLocal instances' argument: the above plus the window / softcap / ALiBi / sinks and varlen's
// cu_seqlens (LocalParams; inv_scale is unused, the kernel divides by its tile's descaled scale).
struct Fp8LocalParams : Fp8Params {
  LocalParams lp;
};
template <bool kLocal>
using Fp8KernelParams = std::conditional_t<kLocal, Fp8LocalParams, Fp8Params>;

// Varlen (the kLocal rows with cu_seqlens): Q and K through ragged maps (make_ragged_map: a tile's
// rows past its sequence read as zeros), V^T a packed workspace [heads_kv, d, width] in which
// sequence b (first packed key k0) starts at column fp8_vt_col(k0, b) = 32 ceil(k0 / 32) + 288 b.
// Two starts lie at least sk_b - 31 + 288 apart, more than a key block's loads reach past its last
// key (<= 2 x 128 - 1 columns), and the pre-pass zero-fills the gaps, so a tile never reads another
// sequence's V (whose NaN would reach it through 0 x NaN). Starts are multiples of 32: the P
// fragment's 32-key groups (fp8_p_key) begin at the sequence's first key.
constexpr int kFp8VtGap = 288;
// The pre-pass writes every column itself (session 31; before, the host zeroed the whole workspace
// first, a memset as large as V): a sequence's groups past its last key, up to the next start
// (<= 288 columns) or, after the last sequence, to the width (<= 288 + 127), are zeros: at most
// kFp8VtTailGroups groups past the longest sequence's. Its test poisons the workspace pool first
// (Fp8Cuda.VarlenOnDevice).
constexpr int kFp8VtTailGroups = (kFp8VtGap + 127 + 31) / 32;
__host__ __device__ __forceinline__ int64_t fp8_vt_col(int64_t k0, int64_t b) {
  return (k0 + 31) / 32 * 32 + kFp8VtGap * b;
}

// Tiling of the fp8 kernel. Out: the O dtype (__nv_bfloat16 or __half). kConsumerWGs_: 2
// (ping-pong, 240 registers each) or 3 (round robin, 160 each; 192-row tiles), 64 query rows each.
template <int kHeadDim_, int kBlockN_, int kStages_, typename Out_, int kConsumerWGs_ = 2>
struct Fp8Traits {
  using Out = Out_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumerWGs = kConsumerWGs_;
  static constexpr int kBlockM = 64 * kConsumerWGs;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kConsumerWarps = 4 * kConsumerWGs;
  static constexpr int kColBlock = 128;  // e4m3 elements in one 128-byte swizzle row (V^T: keys)
  // Bytes (= dims) in one swizzled row of Q and K: 128 (SW128), or 64 at hdim 64 (SW64).
  static constexpr int kQKRow = kHeadDim < kColBlock ? kHeadDim : kColBlock;
  static constexpr int kQColBlocks = kHeadDim / kQKRow;  // of Q and K (along d)
  // V^T column blocks (128 keys each) per key block; a partial last one (kBlockN = 96, 192) is loaded
  // whole (its other keys belong to the next block or lie past the end: TMA zeros) and only its
  // first kBlockN % 128 keys are read.
  static constexpr int kVColBlocks = (kBlockN + kColBlock - 1) / kColBlock;
  static constexpr int kQBytes = kBlockM * kHeadDim;
  static constexpr int kKVBytes = kBlockN * kHeadDim;               // one stage of K
  static constexpr int kVBytes = kVColBlocks * kColBlock * kHeadDim;  // one stage of V^T
  static constexpr int kSmemBytes = kQBytes + kStages * (kKVBytes + kVBytes) + 1024;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
  static_assert(kConsumerWGs == 2 || kConsumerWGs == 3, "consumer warpgroups");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWGs <= kThreads * ((65536 / kThreads) & ~7),
                "register file (the CTA's launch allocation)");
  static_assert((kHeadDim == 64 || kHeadDim % kColBlock == 0) && kBlockN % 32 == 0,
                "fp8 tile shape (64- or 128-byte Q / K rows, 32-key k-steps)");
  static_assert(kHeadDim <= 256 && kBlockN <= 256, "wgmma N and TMA box rows <= 256");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
};

// The 128x128 row (IOATTN_SM90_FP8_BLOCKN=128): hdim 128, S 64 + P 16 + O 64 registers per
// consumer thread; 16 KB Q + 4 stages x (16 KB K + 16 KB V^T) = 144 KB; each V^T tile is one
// 128-byte column block.
struct Fp8Tile128 {
  static constexpr int kBlockN = 128, kStages = 4;
  static constexpr const char* kWhy =
      "fp8 hdim128: 128x128 (S 64 + P 16 + O 64 registers), 4 stages of K + V^T (144 KB smem); "
      "wgmma k32 e4m3, V^T from a transpose pre-pass";
};
template <typename Out>
using Fp8Traits128 = Fp8Traits<128, Fp8Tile128::kBlockN, Fp8Tile128::kStages, Out>;
// The default row since session 15 (IOATTN_SM90_FP8_BLOCKN=128 selects the one above): 128x192
// tiles, FlashAttention-3's direction for fp8 (it uses 128x224): the per-block fixed work (row max
// shuffles, corr, barriers, waits, descriptors) spread over 1.5x the scores. S 96 + P 24 + O 64
// registers; 3 stages of 24 KB K + 32 KB V^T (the second V^T column block loaded whole) + 16 KB Q
// = 184 KB.
struct Fp8Tile192 {
  static constexpr int kBlockN = 192, kStages = 3;
  static constexpr const char* kWhy =
      "fp8 hdim128: 128x192 (S 96 + P 24 + O 64 registers), 3 stages of K + V^T (184 KB smem); "
      "wgmma k32 e4m3, V^T from a transpose pre-pass";
};
template <typename Out>
using Fp8Traits192 = Fp8Traits<128, Fp8Tile192::kBlockN, Fp8Tile192::kStages, Out>;
// hdim 128 without a mask (session 22): 3 consumer warpgroups, as at hdim 64 (below): 160 registers
// each, S 48 + P 12 + O 64 at 192x96 (192x128 spills 144 bytes); Q 24 KB + 4 stages x (12 KB K + 16 KB
// V^T, the 128-key column block loaded whole and its first 96 keys read) = 136 KB. Measured against
// 128x192 (three interleaved passes, means): 2-7% faster without a mask, 3-6% slower causal.
struct Fp8Tile128W3 {
  static constexpr int kBlockN = 96, kStages = 4, kConsumerWGs = 3;
  static constexpr const char* kWhy =
      "fp8 hdim128: 3 consumer warpgroups (192x96, 160 registers: S 48 + P 12 + O 64), 4 stages of K + V^T "
      "(136 KB smem): each one's softmax hides under the other two's GEMMs; wgmma k32 e4m3, V^T from a "
      "transpose pre-pass";
};
template <typename Out>
using Fp8Traits128W3 = Fp8Traits<128, Fp8Tile128W3::kBlockN, Fp8Tile128W3::kStages, Out, Fp8Tile128W3::kConsumerWGs>;
// hdim 256 (session 21): O alone is 128 registers, so 128x128 (S 64 + P 16 + O 128, no spills, every
// wgmma asynchronous in ptxas's report); Q 32 KB + 3 stages of 32 KB K + 32 KB V^T = 224 KB.
struct Fp8Tile256 {
  static constexpr int kBlockN = 128, kStages = 3;
  static constexpr const char* kWhy =
      "fp8 hdim256: 128x128 (S 64 + P 16 + O 128 registers), 3 stages of K + V^T (224 KB smem); wgmma k32 "
      "e4m3, V^T from a transpose pre-pass";
};
template <typename Out>
using Fp8Traits256 = Fp8Traits<256, Fp8Tile256::kBlockN, Fp8Tile256::kStages, Out>;

// hdim 64 (session 22): Q and K rows of 64 bytes (SW64). The softmax's exponentials outweigh the
// GEMMs here (fp8 Q K^T + P V = 256 FLOP per score at 8192 FLOP / clock, one ex2 at 16 / clock), so
// 3 consumer warpgroups (192x128, round robin, 160 registers: S 64 + P 16 + O 32): each one's
// softmax hides under the other two's GEMMs. Q 12 KB + 4 stages x (8 KB K + 8 KB V^T) = 76 KB.
// Measured against 2 warpgroups at 128x256 (no spills either; 128x128 / 128x192 within 5% of it):
// 1.10-1.23x faster over three interleaved passes; 192x192 spills at 160 registers.
struct Fp8Tile64 {
  static constexpr int kBlockN = 128, kStages = 4, kConsumerWGs = 3;
  static constexpr const char* kWhy =
      "fp8 hdim64: 3 consumer warpgroups (192x128, 160 registers: S 64 + P 16 + O 32), 4 stages of K + V^T "
      "(76 KB smem): the exp-bound softmax of each hides under the others' GEMMs; wgmma k32 e4m3, Q / K "
      "with the 64-byte swizzle, V^T from a transpose pre-pass";
};
template <typename Out>
using Fp8Traits64 = Fp8Traits<64, Fp8Tile64::kBlockN, Fp8Tile64::kStages, Out, Fp8Tile64::kConsumerWGs>;

// Descriptor of a K-major Q or K operand: rows of kQKRow bytes, 8-row groups 8 * kQKRow apart.
template <int kQKRow>
__device__ __forceinline__ uint64_t fp8_qk_desc(uint32_t smem_addr) {
  static_assert(kQKRow == 64 || kQKRow == 128, "fp8 Q / K rows are 64 or 128 bytes");
  return kQKRow == 64 ? make_desc_sw64(smem_addr, 16, 512) : make_desc_sw128(smem_addr, 16, 1024);
}

// kLocal: on the causal tiling (kCausal = true, longest-first order), with the key blocks of each
// tile's window (local_key_blocks) and the mask, softcap, ALiBi and sinks of pp.lp.
template <class Tr, bool kCausal, bool kLocal = false>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_fwd_sm90_fp8_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                              const __grid_constant__ CUtensorMap tm_vt, const Fp8KernelParams<kLocal> pp) {
#if IOATTN_SM90A_ENABLED
  static_assert(!kLocal || kCausal, "the kLocal rows use the causal tiling");
  static_assert(Tr::kVColBlocks * Tr::kColBlock <= kFp8VtGap - 32, "varlen V^T: a key block's loads stay in its gap");
  // setmaxnreg moves registers only within what the CTA got at launch: kThreads x the launch count
  // (ptxas: 168 at 384 threads, 128 at 512). The 3-warpgroup kLocal producer (span, varlen's ragged
  // coordinates) takes 32 (32 + 3 x 160 = 4 x 128; at 24 ptxas spilled 48 bytes); the 2-warpgroup
  // rows stay at 24 (24 + 2 x 240 = 3 x 168; 32 there would leave the last consumer warp waiting in
  // setmaxnreg.inc forever), their producer spilling 92-140 bytes on its one thread.
  constexpr int kProducerRegs = kLocal && Tr::kConsumerWGs == 3 ? 32 : Tr::kProducerRegs;
  static_assert(kProducerRegs * 128 + Tr::kConsumerRegs * 128 * Tr::kConsumerWGs <=
                    Tr::kThreads * ((65536 / Tr::kThreads) & ~7),
                "setmaxnreg: the warpgroups' registers exceed the CTA's launch allocation");
  using Out = typename Tr::Out;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  constexpr int kStages = Tr::kStages, kQKRow = Tr::kQKRow;
  const FwdParams& p = pp.f;

  __shared__ uint64_t full_q, empty_q;
  __shared__ uint64_t full_k[kStages], full_v[kStages];
  __shared__ uint64_t empty_k[kStages], empty_v[kStages];
  __shared__ int tile_slot;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* s_q = smem;                          // (kQColBlocks, kBlockM, kQKRow B)
  uint8_t* s_k = smem + Tr::kQBytes;            // (kStages, kQColBlocks, kBlockN, kQKRow B)
  uint8_t* s_v = s_k + kStages * Tr::kKVBytes;  // (kStages, kVColBlocks, kHeadDim, 128 B): V^T, kVBytes a stage

  if (threadIdx.x == 0) {
    mbarrier_init(&full_q, 1);
    mbarrier_init(&empty_q, Tr::kConsumerWarps);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full_k[s], 1);
      mbarrier_init(&full_v[s], 1);
      mbarrier_init(&empty_k[s], Tr::kConsumerWarps);
      mbarrier_init(&empty_v[s], Tr::kConsumerWarps);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  // Tile hand-over, schedules and ring positions exactly as in flash_fwd_sm90_kernel.
  const bool dynamic = p.tile_counter != nullptr;
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ================================ producer ================================
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      tma_prefetch_map(&tm_q);
      tma_prefetch_map(&tm_k);
      tma_prefetch_map(&tm_vt);
      int ring = 0;
      int t = tile_of_round(0, p.zigzag);
      for (int round = 0;; ++round) {
        mbarrier_wait(&empty_q, (round & 1) ^ 1);
        *reinterpret_cast<volatile int*>(&tile_slot) = t;
        if (t >= p.num_tiles) {
          mbarrier_arrive(&full_q);  // the end marker
          break;
        }
        const TileCoord tc = decode_tile<kCausal>(t, p);
        const int m0 = tc.m_block * kBlockM, hk = tc.h / p.group;
        int n_first = 0, n_blocks;
        // kLocal varlen: ragged Q / K maps, V^T columns from the sequence's start (fp8_vt_col).
        bool ragged = false;
        TileSpan span{};
        int vt_col = 0, vt_b = tc.b;
        if constexpr (kLocal) {
          span = tile_span(tc.b, p, pp.lp);
          const int2 kb = local_key_blocks<kBlockM, kBlockN>(m0, span);
          n_first = kb.x, n_blocks = kb.y;
          ragged = pp.lp.cu_seqlens_q != nullptr;
          if (ragged) vt_col = static_cast<int>(fp8_vt_col(span.k0, tc.b)), vt_b = 0;
        } else {
          n_blocks = num_key_blocks<kBlockM, kBlockN, kCausal>(m0, p.seqlen_q, p.seqlen_k);
        }
        if (n_blocks == 0) {
          mbarrier_arrive(&full_q);
          t = dynamic ? claim_tile(p.tile_counter) : tile_of_round(round + 1, p.zigzag);
          continue;
        }
        const int rot = key_rotation(tc.m_block, n_blocks, p);
        mbarrier_arrive_expect_tx(&full_q, Tr::kQBytes);
#pragma unroll
        for (int c = 0; c < Tr::kQColBlocks; ++c)
          tma_load_rows(ragged, s_q + c * kBlockM * kQKRow, &tm_q, &full_q, c * kQKRow, tc.h, tc.b, span.q0, span.sq,
                        m0);
        // K tile i: [kBlockN keys x d] at (d, key); V^T tile i: [d x kBlockN keys] at (key, d).
        auto load_k = [&](int i) {
          const uint32_t st = ring_stage(ring + i, kStages);
          mbarrier_wait(&empty_k[st], ring_phase(ring + i, kStages) ^ 1);
          mbarrier_arrive_expect_tx(&full_k[st], Tr::kKVBytes);
          const int n0 = (n_first + key_block(i, n_blocks, rot)) * kBlockN;
          uint8_t* dst = s_k + st * Tr::kKVBytes;
#pragma unroll
          for (int c = 0; c < Tr::kQColBlocks; ++c)
            tma_load_rows(ragged, dst + c * kBlockN * kQKRow, &tm_k, &full_k[st], c * kQKRow, hk, tc.b, span.k0, span.sk,
                          n0);
        };
        auto load_v = [&](int i) {
          const uint32_t st = ring_stage(ring + i, kStages);
          mbarrier_wait(&empty_v[st], ring_phase(ring + i, kStages) ^ 1);
          mbarrier_arrive_expect_tx(&full_v[st], Tr::kVBytes);
          const int n0 = (n_first + key_block(i, n_blocks, rot)) * kBlockN;
          uint8_t* dst = s_v + st * Tr::kVBytes;
#pragma unroll
          for (int c = 0; c < Tr::kVColBlocks; ++c)
            tma_load_4d(dst + c * kHeadDim * 128, &tm_vt, &full_v[st], vt_col + n0 + c * 128, 0, hk, vt_b);
        };
        load_k(0);
        for (int i = 1; i < n_blocks; ++i) {
          load_k(i);
          load_v(i - 1);
        }
        load_v(n_blocks - 1);
        t = dynamic ? claim_tile(p.tile_counter) : tile_of_round(round + 1, p.zigzag);
        ring += n_blocks;
      }
    }
  } else {
    // ================================ consumers ===============================
    setmaxnreg_inc<Tr::kConsumerRegs>();
    const int cw = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    // The epilogue's 16-byte stores (store_acc_row), except on the hdim-64 rows without a mask: there
    // the element pairs take fewer cycles (session 37, H100, Nsight Compute cycles with the pairs
    // against the vectors, 4k: hdim 64 0.969, hdim 64 causal 1.006, hdim 128 1.026).
    constexpr bool kOVec = IOATTN_SM90_O_VEC && !(Tr::kHeadDim == 64 && !kCausal);
    const bool o_vec = kOVec && vec16_ok<Out>(p.o, p.o_batch, p.o_seq, p.o_head);
    const int row_in_tile = cw * 64 + warp * 16 + lane / 4;
    const int off = p.seqlen_k - p.seqlen_q;
    const int sched_mine = static_cast<int>(NamedBarrier::kSchedWG0) + cw;
    const int sched_other = static_cast<int>(NamedBarrier::kSchedWG0) + (cw + 1) % Tr::kConsumerWGs;
    if (cw == Tr::kConsumerWGs - 1) named_barrier_arrive(static_cast<int>(NamedBarrier::kSchedWG0), 256);
    const uint32_t q_base = smem_u32(s_q) + cw * 64 * kQKRow;
    const uint32_t k_base = smem_u32(s_k);
    const uint32_t v_base = smem_u32(s_v);
    auto release = [&](uint64_t* empty) {
      __syncwarp();
      if (lane == 0) mbarrier_arrive(empty);
    };
    int ring = 0;

    for (int round = 0;; ++round) {
      mbarrier_wait(&full_q, round & 1);
      // Lane 0 alone reads the slot and broadcasts it: lane 0 is also the lane that arrives on
      // empty_q, so the read is ordered before that arrival by program order even when the tile
      // has no key block (no named barrier in between). With every lane reading, racecheck
      // reported lanes 1-31's reads as racing the producer's next write (16 hazards, 3-WG hdim64
      // causal), formally right: nothing ordered them before lane 0's release.
      int slot = 0;
      if (lane == 0) slot = *reinterpret_cast<volatile int*>(&tile_slot);
      const int t = __shfl_sync(0xffffffffu, slot, 0);
      if (t >= p.num_tiles) break;
      const TileCoord tc = decode_tile<kCausal>(t, p);
      const int m0 = tc.m_block * kBlockM;
      int n_first = 0, n_blocks;
      [[maybe_unused]] TileSpan span{};  // kLocal only
      if constexpr (kLocal) {
        span = tile_span(tc.b, p, pp.lp);
        const int2 kb = local_key_blocks<kBlockM, kBlockN>(m0, span);
        n_first = kb.x, n_blocks = kb.y;
      } else {
        n_blocks = num_key_blocks<kBlockM, kBlockN, kCausal>(m0, p.seqlen_q, p.seqlen_k);
      }
      const int rot = key_rotation(tc.m_block, n_blocks, p);
      // This tile's descales (per batch and kv head): folded into the score scale and 1 / rowsum.
      const int hk = tc.h / p.group;
      const float dq = pp.q_descale ? pp.q_descale[tc.b * pp.qd_batch + hk * pp.qd_head] : 1.0f;
      const float dk = pp.k_descale ? pp.k_descale[tc.b * pp.kd_batch + hk * pp.kd_head] : 1.0f;
      const float dv = pp.v_descale ? pp.v_descale[tc.b * pp.vd_batch + hk * pp.vd_head] : 1.0f;
      const float scale_log2 = p.scale_log2 * (dq * dk);
      const float scale_ln = p.scale * (dq * dk);

      float o[kHeadDim / 2];
#pragma unroll
      for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.0f;
      float row_max[2] = {-INFINITY, -INFINITY};
      float row_sum[2] = {0.0f, 0.0f};

      if (n_blocks > 0) {
        float s[kBlockN / 2];      // S fragment (64 x kBlockN), fp32
        uint32_t pf[kBlockN / 8];  // P as e4m3, 4 per register: the A fragments of P V
        float corr[2] = {1.0f, 1.0f};
        bool rescale = true;

        // S = Q K^T: kHeadDim / 32 k-steps of 32 bytes, both operands K-major.
        auto issue_qk = [&](uint32_t st) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kHeadDim / 32; ++kk) {
            constexpr int kStepsPerRow = kQKRow / 32;
            const uint32_t col = kk / kStepsPerRow, byte_in_row = (kk % kStepsPerRow) * 32;
            const uint64_t a = fp8_qk_desc<kQKRow>(q_base + col * kBlockM * kQKRow + byte_in_row);
            const uint64_t bd = fp8_qk_desc<kQKRow>(k_base + st * Tr::kKVBytes + col * kBlockN * kQKRow + byte_in_row);
            WgmmaFp8<kBlockN>::ss(s, a, bd, kk > 0 ? 1 : 0);
          }
          wgmma_commit();
        };
        // O += P V: kBlockN / 32 k-steps, A = P from registers, B = V^T K-major (keys contiguous).
        auto issue_pv = [&](uint32_t st) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBlockN / 32; ++kk) {
            const uint32_t col = kk / 4, byte_in_row = (kk % 4) * 32;
            const uint64_t bd =
                make_desc_sw128(v_base + st * Tr::kVBytes + col * kHeadDim * 128 + byte_in_row, 16, 1024);
            const uint32_t a[4] = {pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3]};
            WgmmaFp8<kHeadDim>::rs(o, a, bd, 1);
          }
          wgmma_commit();
        };
        auto fence_s = [&]() {
#pragma unroll
          for (int i = 0; i < kBlockN / 2; ++i) reg_fence(s[i]);
        };
        auto fence_o = [&]() {
#pragma unroll
          for (int i = 0; i < kHeadDim / 2; ++i) reg_fence(o[i]);
#pragma unroll
          for (int i = 0; i < kBlockN / 8; ++i) reg_fence(pf[i]);
        };
        auto apply_mask = [&](int n) {
          const int key0 = n * kBlockN + 2 * (lane % 4);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = m0 + row_in_tile + 8 * r;
            if constexpr (kLocal) {  // visible: key_begin <= key < key_end
              local_mask_row<kBlockN>(s, r, key0, row, span);
              continue;
            }
            const int key_end = kCausal ? min(p.seqlen_k, row + off + 1) : p.seqlen_k;
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
              for (int e = 0; e < 2; ++e)
                if (key0 + 8 * i + e >= key_end) s[4 * i + 2 * r + e] = -INFINITY;
            }
          }
        };
        auto needs_mask = [&](int n) {
          if constexpr (kLocal) return local_needs_mask<kBlockM, kBlockN>(n, m0, span);
          return (n + 1) * kBlockN > p.seqlen_k || (kCausal && (n + 1) * kBlockN - 1 > m0 + off);
        };
        auto softmax = [&]() {
          bool changed = false;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            changed |= mx != row_max[r];
            const float m_scaled = mx == -INFINITY ? 0.0f : mx * scale_log2;
            corr[r] = exp2_approx(row_max[r] * scale_log2 - m_scaled);
            row_max[r] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                float& x = s[4 * i + 2 * r + e];
                x = exp2_approx(fmaf(x, scale_log2, -m_scaled));
                sum += x;
              }
            }
            row_sum[r] = row_sum[r] * corr[r] + sum;
          }
          rescale = !p.rescale_skip || __any_sync(0xffffffffu, changed);
        };
        // Where ptxas puts the wait for P_{i-1} V_{i-1} depends on this branch's shape. With the
        // branch joining before the softmax, ptxas places that wait at the join, above the
        // softmax: softmax_i then starts after P_{i-1} V_{i-1}, and the e4m3 packing of P_i is
        // interleaved with its exponentials. With the softmax in both arms (as flash_fwd_sm90.cuh
        // does), the wait stays after it: softmax_i overlaps P_{i-1} V_{i-1}, the packing follows
        // the wait. Measured (session 15, H200, 16k tokens, two passes each): the overlap form is
        // 3-13% faster causal (4k 0.401 vs 0.424-0.461 ms) and 1-5% slower without a mask (16k
        // 2.89-2.96 vs 2.76-2.77 ms), so each mode keeps the form that wins.
        // kLocal: softcap / ALiBi on the scores of key block n (before the mask, as on mma.sync), on
        // t = s * scale_ln (the descaled score in logit units), kept as t / scale_ln.
        [[maybe_unused]] float slope = 0.0f, inv_scale_ln = 0.0f;  // kLocal: read once per tile
        if constexpr (kLocal) {
          if (pp.lp.alibi_slopes != nullptr) slope = pp.lp.alibi_slopes[tc.h];
          inv_scale_ln = scale_ln > 0.0f ? 1.0f / scale_ln : 0.0f;
        }
        auto modify_scores = [&](int n) {
          if constexpr (kLocal)
            local_modify_scores<kBlockN>(s, n * kBlockN + 2 * (lane % 4), m0 + row_in_tile + span.sk - span.sq,
                                         scale_ln, inv_scale_ln, pp.lp, slope);
        };
        auto mask_and_softmax = [&](int n) {
          if constexpr (kLocal) {
            if (pp.lp.softcap > 0.0f || pp.lp.alibi_slopes != nullptr) modify_scores(n);
          }
          if constexpr (kCausal) {
            if (needs_mask(n)) {
              apply_mask(n);
              softmax();
            } else {
              softmax();
            }
          } else {
            if (needs_mask(n)) apply_mask(n);
            softmax();
          }
        };
        auto rescale_o = [&]() {
          if (!rescale) return;
#pragma unroll
          for (int i = 0; i < kHeadDim / 8; ++i) {
            o[4 * i + 0] *= corr[0];
            o[4 * i + 1] *= corr[0];
            o[4 * i + 2] *= corr[1];
            o[4 * i + 3] *= corr[1];
          }
        };
        // P (values in [0, 1]) -> e4m3 A fragments, key order permuted per 32 (fp8_p_key).
        auto convert_p = [&]() {
#pragma unroll
          for (int kk = 0; kk < kBlockN / 32; ++kk) {
            uint32_t a[4];
            fp8_p_fragment(&s[16 * kk], a);
#pragma unroll
            for (int j = 0; j < 4; ++j) pf[4 * kk + j] = a[j];
          }
        };

        // ---- first key block ----
        {
          const uint32_t st = ring_stage(ring, kStages);
          mbarrier_wait(&full_k[st], ring_phase(ring, kStages));
          named_barrier_sync(sched_mine, 256);
          issue_qk(st);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<0>();
          fence_s();
          release(&empty_k[st]);
          if (IOATTN_SM90_EARLY_Q && n_blocks == 1) release(&empty_q);  // (flash_fwd_sm90.cuh)
          mask_and_softmax(n_first + key_block(0, n_blocks, rot));
          if (p.rescale_skip) rescale = false;  // O is still all zeros
          convert_p();
        }

        // ---- steady state: S_i = Q K_i^T issued with O += P_{i-1} V_{i-1} ----
        for (int i = 1; i < n_blocks; ++i) {
          if (i == 2) FP8_TRACE_TIME(0);
          if (i == n_blocks - 1) FP8_TRACE_TIME(1);
          FP8_TRACE(i, 0);
          const uint32_t st = ring_stage(ring + i, kStages), prev = ring_stage(ring + i - 1, kStages);
          mbarrier_wait(&full_k[st], ring_phase(ring + i, kStages));
          FP8_TRACE(i, 1);
          named_barrier_sync(sched_mine, 256);
          FP8_TRACE(i, 2);
          issue_qk(st);
          FP8_TRACE(i, 3);
          rescale_o();
          FP8_TRACE(i, 4);
          mbarrier_wait(&full_v[prev], ring_phase(ring + i - 1, kStages));
          FP8_TRACE(i, 5);
          issue_pv(prev);
          named_barrier_arrive(sched_other, 256);
          FP8_TRACE(i, 6);
          wgmma_wait<1>();
          fence_s();
          release(&empty_k[st]);
          if (IOATTN_SM90_EARLY_Q && i == n_blocks - 1) release(&empty_q);
          FP8_TRACE(i, 7);
          mask_and_softmax(n_first + key_block(i, n_blocks, rot));
          FP8_TRACE(i, 8);
          wgmma_wait<0>();
          fence_o();
          release(&empty_v[prev]);
          FP8_TRACE(i, 9);
          convert_p();
          FP8_TRACE(i, 10);
        }
        if (!IOATTN_SM90_EARLY_Q) release(&empty_q);

        // ---- last P V ----
        {
          const uint32_t prev = ring_stage(ring + n_blocks - 1, kStages);
          mbarrier_wait(&full_v[prev], ring_phase(ring + n_blocks - 1, kStages));
          named_barrier_sync(sched_mine, 256);
          rescale_o();
          issue_pv(prev);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<0>();
          fence_o();
          release(&empty_v[prev]);
        }
        ring += n_blocks;
      } else {
        release(&empty_q);
      }

      // ---- epilogue: O * v_descale / rowsum in Out; LSE = scale' * max + log(sum) ----
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if constexpr (kLocal) {
          float inv = sum > 0.0f ? dv / sum : 0.0f;
          float lse = sum > 0.0f ? row_max[r] * scale_ln + logf(sum) : -INFINITY;
          if (pp.lp.sinks != nullptr)
            fold_sink(sum, sum > 0.0f ? row_max[r] * scale_ln : -INFINITY, pp.lp.sinks[tc.h], dv, &inv, &lse);
          const int row = m0 + row_in_tile + 8 * r;
          const int64_t prow = static_cast<int64_t>(span.q0) + row;  // varlen: packed position q0 + row
          store_acc_row<Out, kHeadDim>(static_cast<Out*>(p.o) + tc.b * p.o_batch + prow * p.o_seq + tc.h * p.o_head, o, r,
                                     inv, lane, o_vec, row < span.sq);
          if (row < span.sq && p.lse != nullptr && lane % 4 == 0)
            p.lse[tc.b * p.lse_batch + tc.h * p.lse_head + prow * p.lse_seq] = lse;
          continue;
        }
        const float inv = sum > 0.0f ? dv / sum : 0.0f;
        const int row = m0 + row_in_tile + 8 * r;
        store_acc_row<Out, kHeadDim>(static_cast<Out*>(p.o) + tc.b * p.o_batch + row * p.o_seq + tc.h * p.o_head, o, r,
                                   inv, lane, o_vec, row < p.seqlen_q);
        if (row < p.seqlen_q && p.lse != nullptr && lane % 4 == 0)
          p.lse[tc.b * p.lse_batch + tc.h * p.lse_head + row * p.lse_seq] =
              sum > 0.0f ? row_max[r] * scale_ln + logf(sum) : -INFINITY;
      }
    }
    if (cw == 0) named_barrier_sync(static_cast<int>(NamedBarrier::kSchedWG0), 256);
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif  // IOATTN_SM90A_ENABLED
}

// ---- the V transpose pre-pass ------------------------------------------------------------------
// vt[b][hk][x][key'] = v[b, key, hk, x] for key' in [0, skp): key' = 32 j + c holds key
// 32 j + fp8_p_key(c) (the P fragment's order), zero where that key >= seqlen_k. One warp per
// 32 keys x 128 dims of one (b, kv head), a register transpose (flash_fwd_sm90_fp8.cu); needs
// head_dim % 4 == 0, v rows and strides 4-byte aligned (the selector's TMA checks give 16), skp a
// multiple of 32 and vt 32-byte aligned. Varlen (cu_seqlens_k non-null; v packed [total_k, hk, d]):
// vt[hk][x][fp8_vt_col(cu[b], b) + key'] for sequence b's keys, rows of skp (the workspace's width)
// bytes; seqlen_k is then the longest sequence and the caller zeroes vt first (the gaps).
struct Fp8TransposeArgs {
  const uint8_t* v = nullptr;
  int64_t v_batch = 0, v_seq = 0, v_head = 0;  // element (= byte) strides
  uint8_t* vt = nullptr;
  int seqlen_k = 0, skp = 0, head_dim = 0, heads_kv = 0;
  const int32_t* cu_seqlens_k = nullptr;  // varlen when non-null (on the device)
  int64_t batch_heads = 0;  // batch * heads_kv (set by fp8_transpose_v_launch)
  // 32-key groups per (batch, kv head) the grid covers: the padded width, or varlen's longest
  // sequence and the zero groups of its gap (kFp8VtTailGroups)
  __host__ __device__ int groups() const {
    return cu_seqlens_k != nullptr ? (seqlen_k + 31) / 32 + kFp8VtTailGroups : skp / 32;
  }
};

// ---- host side ---------------------------------------------------------------------------------

struct Fp8Launch {
  // 4D: q/k (d, seq, heads, batch) box (kQKRow, rows); vt (skp, d, heads_kv, batch) box (128, d)
  CUtensorMap q, k, vt;
  Fp8Params params;
  LocalParams local;  // read by the kLocal instances only
  unsigned grid = 0;
  cudaStream_t stream = nullptr;
};

#if IOATTN_FP8_TRACE
// Per phase (stamp k - stamp k-1; phase 0 from the previous step's last stamp) the mean cycles over
// the traced steps 2.. of the traced CTAs, per warpgroup; the step period; warpgroup 1's issue
// (stamp 2) after warpgroup 0's in the same step; the SM clock (cycles / ns between the two
// timer stamps).
// (3-warpgroup rows: warpgroups 0 and 1 only.)
inline void fp8_trace_print(int head_dim, int block_m, int block_n, bool causal, int seqlen, unsigned grid) {
  using namespace fp8_trace;
  IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
  static unsigned h[kBlocks][2][kSteps][kPoints];
  static unsigned long long c[kBlocks][2][2][2];
  IOATTN_CUDA_CHECK(cudaMemcpyFromSymbol(h, g_stamp, sizeof(h)));
  IOATTN_CUDA_CHECK(cudaMemcpyFromSymbol(c, g_clock, sizeof(c)));
  const char* names[kPoints] = {"top",      "wait K",  "sched bar", "issue QK",  "rescale O", "wait V",
                                "issue PV", "wait S",  "softmax",   "wait PV",   "pack P"};
  const int nb = static_cast<int>(grid < static_cast<unsigned>(kBlocks) ? grid : kBlocks);
  for (int wg = 0; wg < 2; ++wg) {
    double sum[kPoints] = {}, period = 0;
    int n = 0;
    for (int b = 0; b < nb; ++b)
      for (int st = 3; st < kSteps; ++st) {
        if (h[b][wg][st][10] == 0 || h[b][wg][st - 1][10] == 0) continue;
        for (int k = 0; k < kPoints; ++k)
          sum[k] += static_cast<double>(h[b][wg][st][k] - (k == 0 ? h[b][wg][st - 1][10] : h[b][wg][st][k - 1]));
        period += static_cast<double>(h[b][wg][st][10] - h[b][wg][st - 1][10]);
        ++n;
      }
    std::fprintf(stderr, "fp8 trace d%d %dx%d %s seqlen %d wg %d (%d steps):", head_dim, block_m, block_n,
                 causal ? "causal" : "no-mask", seqlen, wg, n);
    for (int k = 0; k < kPoints; ++k) std::fprintf(stderr, " %s %.0f |", names[k], n ? sum[k] / n : 0.0);
    std::fprintf(stderr, " period %.0f\n", n ? period / n : 0.0);
  }
  double off = 0, mhz = 0;
  int n = 0, nm = 0;
  for (int b = 0; b < nb; ++b) {
    for (int st = 3; st < kSteps; ++st)
      if (h[b][0][st][2] && h[b][1][st][2]) off += static_cast<double>(static_cast<int>(h[b][1][st][2] - h[b][0][st][2])), ++n;
    for (int wg = 0; wg < 2; ++wg) {
      const double dc = static_cast<double>(c[b][wg][1][0] - c[b][wg][0][0]), dt = static_cast<double>(c[b][wg][1][1] - c[b][wg][0][1]);
      if (dt > 0) mhz += dc / dt * 1e3, ++nm;
    }
  }
  std::fprintf(stderr, "fp8 trace d%d %dx%d %s seqlen %d: wg1 issue - wg0 issue %.0f cycles; SM clock %.0f MHz\n",
               head_dim, block_m,
               block_n, causal ? "causal" : "no-mask", seqlen, n ? off / n : 0.0, nm ? mhz / nm : 0.0);
}
#endif

template <class Tr, bool kCausal, bool kLocal = false>
bool flash_fwd_sm90_fp8_present() {
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, flash_fwd_sm90_fp8_kernel<Tr, kCausal, kLocal>);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.binaryVersion >= 90 && attr.ptxVersion >= 90;
}

template <class Tr, bool kCausal, bool kLocal = false>
void flash_fwd_sm90_fp8_launch(const Fp8Launch& l) {
  auto kernel = flash_fwd_sm90_fp8_kernel<Tr, kCausal, kLocal>;
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
#if IOATTN_FP8_TRACE
  static int calls = 0, last_seqlen = -1;
  if (l.params.f.seqlen_q != last_seqlen) last_seqlen = l.params.f.seqlen_q, calls = 0;
  if (++calls == 10) {
    void* sym = nullptr;
    IOATTN_CUDA_CHECK(cudaGetSymbolAddress(&sym, fp8_trace::g_stamp));
    IOATTN_CUDA_CHECK(cudaMemsetAsync(sym, 0, sizeof(fp8_trace::g_stamp), l.stream));
  }
#endif
  if constexpr (kLocal) {
    Fp8LocalParams pp;
    static_cast<Fp8Params&>(pp) = l.params;
    pp.lp = l.local;
    kernel<<<l.grid, Tr::kThreads, Tr::kSmemBytes, l.stream>>>(l.q, l.k, l.vt, pp);
  } else {
    kernel<<<l.grid, Tr::kThreads, Tr::kSmemBytes, l.stream>>>(l.q, l.k, l.vt, l.params);
  }
  IOATTN_CUDA_CHECK_LAUNCH("flash_fwd_sm90_fp8_kernel");
#if IOATTN_FP8_TRACE
  if (calls == 10) fp8_trace_print(Tr::kHeadDim, Tr::kBlockM, Tr::kBlockN, kCausal, l.params.f.seqlen_q, l.grid);
#endif
}

// The pre-pass (compiled once, in flash_fwd_sm90_fp8.cu).
void fp8_transpose_v_launch(const Fp8TransposeArgs& a, int64_t batch, cudaStream_t stream);

#define IOATTN_SM90_FP8_INSTANTIATE(TR, CAUSAL, LOCAL)          \
  template bool flash_fwd_sm90_fp8_present<TR, CAUSAL, LOCAL>(); \
  template void flash_fwd_sm90_fp8_launch<TR, CAUSAL, LOCAL>(const Fp8Launch& l);
#define IOATTN_SM90_FP8_EXTERN(TR, CAUSAL, LOCAL)                       \
  extern template bool flash_fwd_sm90_fp8_present<TR, CAUSAL, LOCAL>(); \
  extern template void flash_fwd_sm90_fp8_launch<TR, CAUSAL, LOCAL>(const Fp8Launch& l);

// Every (traits, causal, local) instance the fp8 dispatch table can launch (flash_fwd_sm90.cu's
// fp8_row_for_out), listed once: X = IOATTN_SM90_FP8_INSTANTIATE in flash_fwd_sm90_fp8.cu,
// IOATTN_SM90_FP8_EXTERN where the table is. The hdim-128 3-warpgroup row is non-causal only; the
// kLocal rows are the causal tilings of hdim 64 (3 warpgroups), 128 (128x192) and 256.
#define IOATTN_SM90_FP8_ROWS_OF(X, TR)                                                            \
  X(TR<__nv_bfloat16>, false, false) X(TR<__nv_bfloat16>, true, false) X(TR<__half>, false, false) \
  X(TR<__half>, true, false)
#define IOATTN_SM90_FP8_LOCAL_ROWS_OF(X, TR) X(TR<__nv_bfloat16>, true, true) X(TR<__half>, true, true)
#define IOATTN_SM90_FP8_ROWS(X)                                              \
  IOATTN_SM90_FP8_ROWS_OF(X, Fp8Traits128)                                   \
  IOATTN_SM90_FP8_ROWS_OF(X, Fp8Traits192)                                   \
  IOATTN_SM90_FP8_ROWS_OF(X, Fp8Traits64)                                    \
  IOATTN_SM90_FP8_ROWS_OF(X, Fp8Traits256)                                   \
  X(Fp8Traits128W3<__nv_bfloat16>, false, false) X(Fp8Traits128W3<__half>, false, false) \
  IOATTN_SM90_FP8_LOCAL_ROWS_OF(X, Fp8Traits192)                             \
  IOATTN_SM90_FP8_LOCAL_ROWS_OF(X, Fp8Traits64)                              \
  IOATTN_SM90_FP8_LOCAL_ROWS_OF(X, Fp8Traits256)

}  // namespace ioattn::cuda::sm90

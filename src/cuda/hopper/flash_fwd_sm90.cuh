// flash_fwd_sm90.cuh — FlashAttention-3-style forward kernel for Hopper (sm_90a).
//
// Computes O = softmax(scale * Q K^T [causal mask]) V and LSE (natural log, fp32) in 128- or
// 192-row query tiles, 16-bit inputs (bf16 or f16), fp32 accumulation.
//
// Tiling and roles (one CTA = 1 + kConsumerWGs warpgroups, 384 or 512 threads, 1 CTA per SM):
//   * warpgroup 0, the producer, drops to kProducerRegs registers (setmaxnreg.dec) and one
//     thread issues TMA copies: a tile's Q [kBlockM x d] once, then K and V tiles [kBlockN x d]
//     through a kStages-deep ring of shared-memory buffers, each completing on a "full"
//     mbarrier; it refills a buffer once both consumers arrive on its "empty" mbarrier.
//   * warpgroups 1, 2 (and 3), the consumers, rise to kConsumerRegs registers and each owns 64
//     query rows (tiles of 128 rows, or 192 with 3 consumer warpgroups). Per key block j:
//     S = Q K_j^T by wgmma (both operands from shared memory),
//     online softmax in registers (exp2 with scale*log2(e) folded in, row max/sum within the quad
//     of threads that share a row), P rounded to 16 bits in registers and fed as the A operand of
//     O += P V_j (wgmma with A in registers).
//   * Overlap: (a) ping-pong — named barriers hand the tensor cores from one consumer warpgroup
//     to the next (round robin with 3), so one's softmax runs while the others' GEMMs run;
//     (b) inside a warpgroup,
//     S_{j+1} = Q K_{j+1}^T is issued together with O += P_j V_j, so softmax(j+1) only waits
//     for the first of the two; (c) across tiles (persistent grid) the producer loads the next
//     tile's Q and K/V while the consumers finish the last P V and store O.
//   * Key blocks are visited last to first, so the blocks that need masking (the ragged end of
//     the keys, the causal diagonal) come first and the rest run without mask code; non-causal
//     tiles rotate that order (stagger) so CTAs on one head do not read the same block at once.
//   * Tiles are scheduled in L2-sized sections of (batch, head) pairs, longest first for causal
//     (decode_tile); the grid is one CTA per tile, or persistent with a static (tile_of_round) or
//     dynamic (atomic counter, sched_sm90.cuh) schedule, per the host table (flash_fwd_sm90.cu).
//     The producer announces each tile to the consumers with its Q (tile_slot + full_q).
//   * Shared memory holds 128-byte-swizzled column blocks of 64 elements (see ptx_sm90.cuh),
//     written by TMA with CU_TENSOR_MAP_SWIZZLE_128B and read by wgmma with SW128 descriptors.
//
// Assumes (sm90_flash_select checks it): head_dim = head_dim_v in {64, 128, 256}; unit stride on
// the last dim; q/k/v 16-byte aligned with 16-byte-multiple strides (TMA); o 4-byte aligned
// with even strides; scale > 0; windows, softcap, ALiBi, sinks and varlen only in the kLocal
// instances (LocalParams), which the selector uses unless IOATTN_SM90_LOCAL=0. The kCache
// instances (CacheParams, session 27) run decode()'s prefill chunks through a 16-bit KV cache:
// per-sequence lengths on the device, K / V through ragged maps over the cache's rows (paged: one
// TMA load per page piece); verified on the H200 in session 30, the default for contiguous caches
// and page pieces of >= 64 rows (IOATTN_SM90_CACHE=1 also smaller pieces, =0 none).
// Masks are bottom-right aligned: row i sees key j iff j <= i + (seqlen_k - seqlen_q).
// Rows with no visible key get O = 0, LSE = -inf.
//
// History (numbers: NOTES.md; bf16 TFLOP/s on an H200 vs cuDNN in the same run)
//   v1  TMA + mbarrier ring, producer/2-consumer warp specialisation, wgmma SS for Q K^T and RS
//       for P V, ping-pong + intra-warpgroup overlap, backward key order, 1D longest-first grid.
//       Correct first time; 0.80-1.02x cuDNN.
//   v2  persistent grid with cross-tile prefetch (empty_q barrier), L2 sections; optional FMA-pipe
//       exp2 share (measured slower: off). Non-causal +2..7%; causal worse (static imbalance).
//   v3  causal back to one CTA per tile; non-causal key-order stagger; tile per (hdim, causal):
//       128x192 / 128x176 for non-causal hdim64 / 128. 0.82-1.02x cuDNN, geomean 0.91x.
//   v4  dynamic tile scheduler (persistent + balanced), O-rescale skip by warp vote (+ placement
//       knob), 3 consumer warpgroups (192x128) for hdim64; the host table picks per (hdim, causal);
//       hdim128 non-causal keeps the v3 body (flash_fwd_sm90_v3.cuh). 0.79-1.06x cuDNN, geomean
//       0.95x (the v3 build in the same run: 0.92x).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "cuda/check.cuh"
#include "cuda/epilogue.cuh"
#include "cuda/hopper/ptx_sm90.cuh"
#include "cuda/hopper/sched_sm90.cuh"
#include "cuda/ptx.cuh"  // tanh_approx (softcap, as the mma.sync kernel)

namespace ioattn::cuda::sm90 {

// IOATTN_SM90_EARLY_Q (compile time, default 1 since session 36; 0 = the Q buffer given back after
// the steady loop, as before): each consumer warp of the v3, v4 and fp8 bodies gives the Q buffer
// back as soon as its tile's last Q K^T has completed (in the last visited block, before that
// block's softmax) instead of after the steady loop, so the next tile's Q load (which the producer
// can start only then) also gets the last softmax's time; with Q in registers (kQRegs, the hdim-128
// causal default) right after its ldmatrix loads, so the next Q has a whole tile to arrive. Same
// arrivals per tile (one per consumer warp), only earlier; neither Q nor the tile slot is read
// after that point (mbarrier.arrive releases the warp's earlier shared-memory reads). Measured with
// IOATTN_SM90_O_VEC on the H100 (Nsight Compute cycles, docs/PERF.md "Session 36"): 0.95-0.99 of the
// cycles of neither on the bf16 grid rows at 2k-16k.
#ifndef IOATTN_SM90_EARLY_Q
#define IOATTN_SM90_EARLY_Q 1
#endif

// IOATTN_SM90_O_VEC (compile time, default 1 since session 36; 0 = the element-pair stores
// always): the epilogue stores each O row as 16-byte vectors after a 4 x 4 transpose of 32-bit
// words inside each quad (store_acc_row) instead of one 4-byte element pair per column group: a
// quarter of the store instructions, each writing whole 32-byte sectors (the pair stores wrote 16
// bytes of each of 8 rows per warp instruction). The phase trace put the hdim-128 epilogue at ~3,600
// cycles of a 2k tile's 45,700 (hdim 256: ~7,300 of 80,300; with the vectors 2,600-3,100 and
// 4,600-4,800). Taken when o and its strides are 16-byte multiples (vec16_ok), else the pair stores.
#ifndef IOATTN_SM90_O_VEC
#define IOATTN_SM90_O_VEC 1
#endif

// IOATTN_FWD_TRACE (a diagnostic build only, -DIOATTN_FWD_TRACE=1; gpu-check stage fwdtrace): SM
// clock stamps at the phases of each tile of the first kBlocks CTAs (each consumer warpgroup's
// thread 0, and the producer) of the v3 and v4 bodies, printed by the host after an instance's
// 10th launch as mean cycles per phase over rounds 1 .. kRounds - 2: where a short tile's time goes
// outside its steady-state steps.
#ifndef IOATTN_FWD_TRACE
#define IOATTN_FWD_TRACE 0
#endif

#if IOATTN_FWD_TRACE
namespace fwd_trace {
constexpr int kBlocks = 8, kRounds = 16, kPoints = 10;
constexpr int kProducer = 3;  // `who` of the producer; consumer warpgroups are 0 .. 2
// [cta][who][round][point]; the points are named in fwd_trace_print().
static __device__ unsigned g_stamp[kBlocks][4][kRounds][kPoints];
static __device__ int g_blocks[kBlocks][kRounds];  // the tile's visited key blocks
}  // namespace fwd_trace
#define FWD_TRACE_IN(rnd) (blockIdx.x < fwd_trace::kBlocks && (rnd) < fwd_trace::kRounds)
#define FWD_TRACE(who, rnd, k)                                                              \
  do {                                                                                      \
    if (FWD_TRACE_IN(rnd))                                                                  \
      fwd_trace::g_stamp[blockIdx.x][(who)][(rnd)][(k)] = static_cast<unsigned>(clock64()); \
  } while (0)
// The tile's visited key blocks (one writer per CTA and round).
#define FWD_TRACE_BLOCKS(rnd, n)                                          \
  do {                                                                    \
    if (FWD_TRACE_IN(rnd)) fwd_trace::g_blocks[blockIdx.x][(rnd)] = (n); \
  } while (0)
#else
#define FWD_TRACE(who, rnd, k) \
  do {                         \
  } while (0)
#define FWD_TRACE_BLOCKS(rnd, n) \
  do {                           \
  } while (0)
#endif

// Everything the kernel needs besides the three tensor maps. Offsets in elements, int64.
struct FwdParams {
  void* o = nullptr;
  float* lse = nullptr;  // may be null
  int64_t o_batch = 0, o_seq = 0, o_head = 0;
  int64_t lse_batch = 0, lse_head = 0, lse_seq = 0;
  int seqlen_q = 0, seqlen_k = 0;
  int heads_q = 0, group = 1;  // group = heads_q / heads_kv
  int num_m_blocks = 0;
  int num_tiles = 0;      // num_m_blocks * batch_heads
  int batch_heads = 0;    // batch * heads_q
  int section_heads = 1;  // (batch, head) pairs per scheduling section (L2-sized)
  int stagger = 0;        // non-causal: rotate each tile's key order (see key_block)
  int zigzag = 0;         // persistent grid: odd rounds walk the CTAs backwards (see tile loops)
  float scale = 1.0f;       // natural-log units (for LSE)
  float scale_log2 = 1.0f;  // scale * log2(e) (for exp2)
  // v4 (after the v3 fields, so the v3 body in flash_fwd_sm90_v3.cuh compiles to the v3 SASS):
  int* tile_counter = nullptr;  // non-null: dynamic persistent schedule (claim_tile), zeroed per launch
  int rescale_skip = 0;   // skip O *= corr in a warp whose 16 rows all kept their running max
  int rescale_early = 0;  // O *= corr before waiting for the tensor-core turn (else after Q K^T issue)
};

// What only the kLocal instances read, as a kernel argument of its own (growing FwdParams changed
// the other instances' SASS: the compiler loads the parameter block differently): the window
// (-1 = unbounded side; the host clamps wider ones, and the selector keeps sequences below 2^29,
// so no position sum overflows int); varlen (cu_seqlens, on the device; FwdParams::seqlen_q / k
// are then the maxima, and the tensor maps span the packed tokens with one batch); sinks (per query
// head, logit units, may be null) join every row's softmax denominator and LSE; score modifiers as
// the mma.sync kernel applies them: t = scale * s, t = softcap * tanh(t / softcap) when softcap > 0,
// t -= slope_h * |i + off - j| with ALiBi slopes [heads_q]; the kernel keeps t / scale (inv_scale)
// so its softmax and LSE arithmetic is unchanged.
struct LocalParams {
  int window_left = -1, window_right = -1;
  const int32_t* cu_seqlens_q = nullptr;  // varlen when non-null (then cu_seqlens_k too)
  const int32_t* cu_seqlens_k = nullptr;
  const float* sinks = nullptr;
  float softcap = 0.0f, softcap_inv = 0.0f, inv_scale = 1.0f;
  // Read by the plain causal rows, not the kLocal ones (it sits in this struct's alignment hole
  // before alibi_slopes, so no kernel's parameter layout changed): query blocks aligned to the end
  // of the sequence, block 0 starting m_shift rows before row 0. Its padding rows see no key (TMA
  // zero-fills them, the mask empties them, nothing is stored), where the usual alignment puts up
  // to kBlockM - 1 padding rows in the last block, which sees every key (IOATTN_SM90_ALIGN_END).
  int m_shift = 0;
  const float* alibi_slopes = nullptr;
};
static_assert(sizeof(LocalParams) == 56, "m_shift fills the hole before alibi_slopes");

// The KV-cache instances (kCache, with kLocal; decode() with more than 16 query rows through a
// 16-bit cache of q's dtype, session 27): the kLocal features plus the cache. Lengths kv_lens[b] on
// the device; K / V through ragged maps over the cache's rows (make_ragged_map): contiguous,
// [batch * capacity] rows with sequence b from row b * capacity; paged, [num_pages * page_size]
// rows, each key block loaded in pieces of box_rows (min(page_size, kBlockN), a multiple of 8) from
// the pages block_table names. Rows past a sequence's length (or a piece of a page past it) read
// as zeros. A length outside [0, kv_bound] or a table entry outside [0, num_pages) poisons that
// sequence's rows: NaN O and LSE. A kernel argument of its own type (LocalArg), so the other
// instances' parameter block and code stay as they were.
struct CacheParams : LocalParams {
  const int32_t* kv_lens = nullptr;
  const int32_t* block_table = nullptr;  // null: contiguous
  int64_t bt_batch = 0, bt_page = 0;
  int page_size = 0, box_rows = 0;  // paged
  int capacity = 0;                 // contiguous: rows per sequence
  int kv_bound = 0, num_pages = 0;
  // 8-bit caches (through the gathered copy, which holds their codes exactly in q's dtype): per kv
  // head, k_scale joins the score scale and v_scale O's factor, as on mma.sync; null = 1.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};
template <bool kCache>
using LocalArg = std::conditional_t<kCache, CacheParams, LocalParams>;

// kLocal: one tile's sequence (varlen: packed-token offsets q0 / k0 and lengths from cu_seqlens;
// otherwise 0 and the fixed lengths) and its window relative to the row: key j is visible to row
// i iff i + win_lo <= j <= i + win_hi and j < sk (unbounded sides -2^30 / 2^30).
struct TileSpan {
  int q0, k0, sq, sk, win_lo, win_hi;
};
__device__ __forceinline__ TileSpan tile_span(int b, const FwdParams& p, const LocalParams& lp) {
  TileSpan s{0, 0, p.seqlen_q, p.seqlen_k, 0, 0};
  if (lp.cu_seqlens_q != nullptr) {
    s.q0 = lp.cu_seqlens_q[b];
    s.sq = lp.cu_seqlens_q[b + 1] - s.q0;
    s.k0 = lp.cu_seqlens_k[b];
    s.sk = lp.cu_seqlens_k[b + 1] - s.k0;
  }
  const int off = s.sk - s.sq;
  s.win_lo = lp.window_left >= 0 ? off - lp.window_left : -(1 << 30);
  s.win_hi = lp.window_right >= 0 ? off + lp.window_right : (1 << 30);
  return s;
}

// Tiling parameters of one kernel instance. "should not affect results, only speed".
template <int kHeadDim_, int kBlockN_, int kStages_, typename Element_, int kExp2PolyEvery_ = 0,
          int kConsumerWGs_ = 2>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumerWGs = kConsumerWGs_;  // 2 (ping-pong) or 3 (round robin)
  static constexpr int kBlockM = 64 * kConsumerWGs;   // 64 query rows per consumer warpgroup
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  // Every kExp2PolyEvery-th group of 8 scores per row takes its exp2 on the FMA pipe (0: none).
  static constexpr int kExp2PolyEvery = kExp2PolyEvery_;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kConsumerWarps = 4 * kConsumerWGs;
  static constexpr int kColBlock = 64;  // 16-bit elements in one 128-byte swizzle row
  static constexpr int kColBlocks = kHeadDim / kColBlock;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // one stage of K (or of V)
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKVBytes + 1024;  // + alignment slack
  // 24 x 128 + 240 x 256 = 64512 (2 consumer WGs) or 24 x 128 + 160 x 384 = 64512 (3) <= 65536
  // registers of the SM.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
  static_assert(kConsumerWGs == 2 || kConsumerWGs == 3, "consumer warpgroups");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWGs <= 65536, "register file");
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0 && kBlockN <= 256, "tile shape");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
};

// ---- the dispatch table: one tile per (head_dim, causal) ("should not affect results, only speed")
// Register budget per consumer thread (240): O takes d/2 fp32, S kBlockN/2, P kBlockN/4.
// Shared memory (227 KB max): Q 128 x d, plus kStages x (K + V) of kBlockN x d, 16-bit.
// Measured on the H200 against 128x128 (NOTES.md, run 3): wider key blocks pay off without a
// mask (fewer, longer iterations) and cost on causal tiles (more of the diagonal block is wasted).
template <int kHeadDim, bool kCausal>
struct Sm90Tile;
template <>
struct Sm90Tile<64, false> {
  static constexpr int kBlockN = 192, kStages = 2, kExp2PolyEvery = 0;
  static constexpr const char* kWhy =
      "hdim64: 128x192 (S 96 + P 48 + O 32 registers, 16 KB Q + 2 x 48 KB K/V smem): the kernel is "
      "exp-bound, long key blocks amortise each iteration's barriers (+2..6% over 128x128 measured)";
};
template <>
struct Sm90Tile<64, true> {
  static constexpr int kBlockN = 128, kStages = 3, kExp2PolyEvery = 0;
  static constexpr const char* kWhy =
      "hdim64 causal: 128x128, 3 stages (16 KB Q + 3 x 32 KB K/V): square tiles waste the least of "
      "the diagonal block; smem is cheap at hdim64, so a deeper ring";
};
template <>
struct Sm90Tile<128, false> {
  static constexpr int kBlockN = 176, kStages = 2, kExp2PolyEvery = 0;
  static constexpr const char* kWhy =
      "hdim128: 128x176 = S 88 + P 44 + O 64 registers (fits 240 with the overlapped next S), "
      "32 KB Q + 2 x 88 KB K/V = 208 KB smem; +0..8% over 128x128 measured";
};
template <>
struct Sm90Tile<128, true> {
  static constexpr int kBlockN = 128, kStages = 2, kExp2PolyEvery = 0;
  static constexpr const char* kWhy =
      "hdim128 causal: 128x128 (S 64 + P 32 + O 64 registers; 32 KB Q + 2 x 64 KB K/V): square "
      "tiles waste the least of the diagonal block (128x176 measured -8% at 2k)";
};
template <bool kCausal>
struct Sm90Tile<256, kCausal> {
  static constexpr int kBlockN = 80, kStages = 2, kExp2PolyEvery = 0;
  static constexpr const char* kWhy =
      "hdim256: O alone takes 128 registers, so kBlockN = 80 (S 40 + P 20) fits 240; smem 64 KB Q + "
      "2 stages x 80 KB K/V = 224 KB, the most that fits under 227 KB (128x64 measured -5..8%)";
};
template <int kHeadDim, typename T, bool kCausal>
using Sm90Traits = FwdTraits<kHeadDim, Sm90Tile<kHeadDim, kCausal>::kBlockN, Sm90Tile<kHeadDim, kCausal>::kStages,
                             T, Sm90Tile<kHeadDim, kCausal>::kExp2PolyEvery>;

// Q K^T with Q in registers (an optional trait member kQRegs, default false): each consumer
// warpgroup loads its 64 Q rows once per tile from the swizzled Q tile into the wgmma A fragment
// (ldmatrix, 32 registers at hdim 128) and issues Q K^T as rs wgmmas, so the tensor cores read
// only K from shared memory under Q K^T (session 9: a warpgroup storing the K/V volume beside the
// forward's wgmmas slowed them by ~28%; an ss m64nN wgmma reads 2 KB of Q besides N x 32 B of K).
// hdim 128 causal on the 128x128 v4 tile (S 64 + P 32 + O 64 + Q 32 registers): the default since
// session 10 (+4% on average, three interleaved H200 A/Bs; docs/PERF.md). Without a mask it lost
// to the v3 body's 128x176 (which cannot take it: ptxas spills, wgmma serialisation): 128x128
// 0.96-1.02x, 128x144 0.94-1.00x, 128x160 (spilling) 0.7x.
template <class Tr, class = void>
struct QInRegs : std::false_type {};
template <class Tr>
struct QInRegs<Tr, std::void_t<decltype(Tr::kQRegs)>> : std::bool_constant<Tr::kQRegs> {};
template <typename T>
struct Sm90TraitsQRegs128 : Sm90Traits<128, T, true> {
  static constexpr bool kQRegs = true;
  static constexpr const char* kWhy =
      "hdim128 causal: 128x128 (S 64 + P 32 + O 64 + Q 32 registers; 32 KB Q + 2 x 64 KB K/V), Q K^T with Q "
      "in registers: the tensor cores read only K from shared memory under Q K^T (+4% measured); square "
      "tiles waste the least of the diagonal block";
};

// Alternative rows with 3 consumer warpgroups (192-row tiles, as FlashAttention-3 for hdim 64):
// each warpgroup's softmax hides under the GEMMs of the other two instead of one. Registers drop
// to 160 per consumer thread (S 64 + P 32 + O 32 at 192x128). Chosen per (hdim, causal) by the
// host table (flash_fwd_sm90.cu); only hdim 64, where the softmax is as long as the GEMMs.
template <bool kCausal>
struct Sm90Tile3 {
  static constexpr int kBlockN = 128, kStages = 3;
  static constexpr const char* kWhy =
      "hdim64: 3 consumer warpgroups (192x128, 160 registers: S 64 + P 32 + O 32; 24 KB Q + 3 x 32 KB "
      "K/V): the exp-bound softmax of each warpgroup hides under the GEMMs of the other two";
};
template <typename T, bool kCausal>
using Sm90Traits3 = FwdTraits<64, Sm90Tile3<kCausal>::kBlockN, Sm90Tile3<kCausal>::kStages, T, 0, 3>;

// Named barrier ids (0 is __syncthreads). Consumer warpgroup c waits on kSchedWG0 + c for its
// turn at the tensor cores; warpgroup c - 1 (mod the count) arrives there when it has issued its
// GEMMs (ping-pong for 2 warpgroups, round robin for 3).
enum class NamedBarrier : int { kSchedWG0 = 1 };

__device__ __forceinline__ uint32_t ring_stage(int i, int stages) { return static_cast<uint32_t>(i % stages); }
__device__ __forceinline__ uint32_t ring_phase(int i, int stages) { return static_cast<uint32_t>((i / stages) & 1); }

// Key blocks the query tile [m0, m0 + kBlockM) must visit: [0, n_blocks).
template <int kBlockM, int kBlockN, bool kCausal>
__device__ __forceinline__ int num_key_blocks(int m0, int seqlen_q, int seqlen_k) {
  int last_key = seqlen_k - 1;  // last key any row of the tile can see
  if (kCausal) last_key = min(last_key, m0 + kBlockM - 1 + (seqlen_k - seqlen_q));
  return last_key < 0 ? 0 : last_key / kBlockN + 1;
}

// kLocal: key blocks [x, x + y) of the tile [m0, m0 + kBlockM) of span s, the blocks that hold a
// key of some row's window; none for a query block past the sequence's end (varlen: the grid
// covers the longest sequence).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int2 local_key_blocks(int m0, const TileSpan& s) {
  if (m0 >= s.sq) return make_int2(0, 0);
  const int last_key = min(s.sk - 1, min(m0 + kBlockM, s.sq) - 1 + s.win_hi);  // the last real row's bound
  const int first_key = max(0, m0 + s.win_lo);
  const int first = first_key / kBlockN, end = last_key < 0 ? 0 : last_key / kBlockN + 1;
  return make_int2(first, max(0, end - first));
}

// kLocal pieces shared by the bf16 / f16 and fp8 kernels (one thread's two rows r = 0, 1 of a
// 64 x kBlockN S fragment: columns key0 + 8 i + e, values s[4 i + 2 r + e]).
// Row `row`'s keys outside its window [row + win_lo, row + win_hi] or past sk to -inf.
template <int kBlockN>
__device__ __forceinline__ void local_mask_row(float* s, int r, int key0, int row, const TileSpan& span) {
  const int key_end = min(span.sk, row + span.win_hi + 1), key_begin = row + span.win_lo;
#pragma unroll
  for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = key0 + 8 * i + e;
      if (key < key_begin || key >= key_end) s[4 * i + 2 * r + e] = -INFINITY;
    }
  }
}
// Whether key block n needs the mask for some row of the tile [m0, m0 + kBlockM): the first row's
// right bound is the lowest, the last row's left bound the highest.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ bool local_needs_mask(int n, int m0, const TileSpan& span) {
  const int lo = n * kBlockN, hi = lo + kBlockN - 1;
  return hi >= span.sk || hi > m0 + span.win_hi || lo < m0 + kBlockM - 1 + span.win_lo;
}
// Softcap / ALiBi on the scores of key block n, as the mma.sync kernel applies them: t = x scale,
// t = softcap tanh(t / softcap) (lp's, read where used), t -= slope |centre_r - key|; stored back
// as t inv_scale.
// centre0: row 0's ALiBi centre (its row + sk - sq).
template <int kBlockN>
__device__ __forceinline__ void local_modify_scores(float* s, int key0, int centre0, float scale, float inv_scale,
                                                    const LocalParams& lp, float slope) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int centre = centre0 + 8 * r;
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * i + 2 * r + e];
        float t = x * scale;
        if (lp.softcap > 0.0f) t = lp.softcap * ptx::tanh_approx(t * lp.softcap_inv);
        t -= slope * fabsf(static_cast<float>(centre - (key0 + 8 * i + e)));
        x = t * inv_scale;
      }
    }
  }
}
// A sink in the row's softmax: sum_j exp(t_j) + exp(sink), relative to M = max(m, sink), where m is
// the row's max in logit units (-inf without keys) and sum its exp sum relative to m; inv becomes
// num / the total (O's factor), lse the log of the total.
__device__ __forceinline__ void fold_sink(float sum, float m, float sink, float num, float* inv, float* lse) {
  const float mx = fmaxf(m, sink);
  if (mx == -INFINITY) {
    *inv = 0.0f;
    *lse = -INFINITY;
  } else {
    const float a = expf(m - mx), total = sum * a + expf(sink - mx);
    *inv = num * a / total;
    *lse = mx + logf(total);
  }
}

// kCache: tile_span of a sequence in the KV cache: kv_lens[b] keys (0 when the length is outside
// [0, kv_bound]), contiguous ones from row b * capacity of the ragged map, q as [batch, seqlen_q].
// With `poisoned`, also whether the sequence is bad: its length, or (paged) an entry of its block
// table's first ceil(len / page_size) outside [0, num_pages), checked by this warp's lanes (warp-uniform).
__device__ __forceinline__ TileSpan cache_span(int b, const FwdParams& p, const CacheParams& lp, bool* poisoned) {
  const int len = __ldg(lp.kv_lens + b);
  const bool bad_len = len < 0 || len > lp.kv_bound;
  TileSpan s{0, lp.block_table != nullptr ? 0 : b * lp.capacity, p.seqlen_q, bad_len ? 0 : len, 0, 0};
  const int off = s.sk - s.sq;
  s.win_lo = lp.window_left >= 0 ? off - lp.window_left : -(1 << 30);
  s.win_hi = lp.window_right >= 0 ? off + lp.window_right : (1 << 30);
  if (poisoned != nullptr) {
    bool bad = bad_len;
    if (!bad && lp.block_table != nullptr) {
      const int pages = (len + lp.page_size - 1) / lp.page_size;
      for (int pi = static_cast<int>(threadIdx.x % 32); pi < pages; pi += 32) {
        const int page = __ldg(lp.block_table + b * lp.bt_batch + pi * lp.bt_page);
        bad |= page < 0 || page >= lp.num_pages;
      }
    }
    *poisoned = __any_sync(0xffffffffu, bad);
  }
  return s;
}

// Tile t of the persistent schedule -> (query block, head, batch). Tiles come in sections of
// `section_heads` (batch, head) pairs whose K and V fit in L2 together; inside a section the query
// block is the slow index, so the tiles running at one time share K/V through L2, and for causal
// it counts down, so the longest tiles (most keys) run first and the short ones fill the tail.
struct TileCoord {
  int m_block, h, b;
};
template <bool kCausal>
__device__ __forceinline__ TileCoord decode_tile(int t, const FwdParams& p) {
  const int per_section = p.section_heads * p.num_m_blocks;
  const int section = t / per_section;
  const int r = t - section * per_section;
  const int heads_here = min(p.section_heads, p.batch_heads - section * p.section_heads);
  const int m_idx = r / heads_here;
  const int bh = section * p.section_heads + (r - m_idx * heads_here);
  return {kCausal ? p.num_m_blocks - 1 - m_idx : m_idx, bh % p.heads_q, bh / p.heads_q};
}

// The first query row of tile tc, the same for the producer and the consumers: the query block
// times kBlockM, less the plain causal rows' m_shift (LocalParams).
template <int kBlockM, bool kCausal, bool kLocal>
__device__ __forceinline__ int tile_m0(const TileCoord& tc, const LocalParams& lp) {
  return tc.m_block * kBlockM - (kCausal && !kLocal ? lp.m_shift : 0);
}

// Persistent grid: the tile this CTA takes in `round` (tiles round * gridDim.x ... + gridDim.x - 1).
// zigzag: odd rounds hand them out in reverse CTA order, so a CTA that drew a long tile in one
// round draws a short one in the next when tile lengths fall along the order (causal).
__device__ __forceinline__ int tile_of_round(int round, int zigzag) {
  const int pos = (zigzag && (round & 1)) ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  return round * static_cast<int>(gridDim.x) + pos;
}

// Key blocks are visited last to first (the blocks that need a mask come first for causal). With
// `stagger` (non-causal) the order is also rotated by a per-query-block amount, so the CTAs that
// work on one head at the same time read different K/V blocks instead of all hammering the same
// L2 lines (seen as a 20% drop at hdim256, seqlen 16k, where one head fills the whole GPU).
__device__ __forceinline__ int key_rotation(int m_block, int n_blocks, const FwdParams& p) {
  return p.stagger && n_blocks > 0 ? static_cast<int>((static_cast<int64_t>(m_block) * n_blocks) / p.num_m_blocks) : 0;
}
__device__ __forceinline__ int key_block(int i, int n_blocks, int rot) {
  const int n = n_blocks - 1 - i + rot;
  return n >= n_blocks ? n - n_blocks : n;
}

// 2^x on the FMA pipe, for a share of the softmax exponentials so the MUFU unit (16 ex2 per clock
// per SM, the bottleneck at hdim 64) is not the only one working: 2^x = 2^k 2^f with k = round(x)
// (the 1.5 * 2^23 trick: x + 1.5*2^23 holds k in its low mantissa bits) and 2^f, f in [-0.5, 0.5],
// by a degree-3 minimax polynomial (max relative error 7.5e-5, far below bf16's 3.9e-3). Inputs
// below -126.5 give ~1e-38 instead of 0, so callers use it only where no score is masked.
__device__ __forceinline__ float exp2_poly3(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  constexpr float kC0 = 0.999928057f, kC1 = 0.693260968f, kC2 = 0.24261114f, kC3 = 0.0551716685f;
  x = fmaxf(x, -126.5f);
  const float t = x + kRound;
  const float f = x - (t - kRound);
  const float p = fmaf(fmaf(fmaf(kC3, f, kC2), f, kC1), f, kC0);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// Whether score group i (8 columns) takes exp2_poly3: every kEvery-th group, none for kEvery = 0.
template <int kEvery>
__device__ __forceinline__ constexpr bool use_poly_exp2(int i) {
  return kEvery > 0 && i % (kEvery > 0 ? kEvery : 1) == kEvery - 1;
}

// kLocal (with kCausal's tiling and longest-first order): sliding windows, sinks, softcap and ALiBi
// at run time (LocalParams lp); the other instances ignore lp and compile exactly as without it.
template <class Tr, bool kCausal, bool kLocal = false, bool kCache = false>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const FwdParams p, const LocalArg<kCache> lp) {
#if IOATTN_SM90A_ENABLED
  static_assert(!kCache || kLocal, "the KV-cache instances are kLocal ones");
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  constexpr int kStages = Tr::kStages;
  constexpr bool kQRegs = QInRegs<Tr>::value;
  static_assert(!kQRegs || (!kLocal && Tr::kConsumerWGs == 2), "Q in registers: the 2-warpgroup plain rows");

  __shared__ uint64_t full_q, empty_q;                    // Q tile landed / Q buffer free again
  __shared__ uint64_t full_k[kStages], full_v[kStages];    // K / V stage landed
  __shared__ uint64_t empty_k[kStages], empty_v[kStages];  // K / V stage free again
  __shared__ int tile_slot;  // the tile whose Q the last full_q phase announced (see below)
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment: the 128-byte swizzle pattern repeats every 8 rows x 128 bytes.
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* s_q = smem;                          // (kColBlocks, kBlockM, 64)
  uint8_t* s_k = smem + Tr::kQBytes;            // (kStages, kColBlocks, kBlockN, 64)
  uint8_t* s_v = s_k + kStages * Tr::kKVBytes;  // (kStages, kColBlocks, kBlockN, 64)

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

  // The producer decides the tiles and announces each one with its Q: it writes the tile index
  // to tile_slot before its arrival on full_q (release), and the consumers read it after their
  // wait on full_q (acquire); they arrive on empty_q when done with Q (and so with the slot) for
  // that tile. Tiles without keys (n_blocks = 0: the consumers write O = 0, LSE = -inf) and the
  // end marker (index >= num_tiles) take the same handshake with a plain arrival (no Q bytes).
  // So the Q count is the tile count, and both roles skip the same empty tiles for the K/V ring
  // position `ring`. The next tile: static schedule, tile_of_round; dynamic (p.tile_counter),
  // claim_tile after the current tile's last K/V load (sched_sm90.cuh).
  const bool dynamic = p.tile_counter != nullptr;
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ================================ producer ================================
    setmaxnreg_dec<Tr::kProducerRegs>();
    if (threadIdx.x == 0) {
      tma_prefetch_map(&tm_q);
      tma_prefetch_map(&tm_k);
      tma_prefetch_map(&tm_v);
      int ring = 0;
      int t = tile_of_round(0, p.zigzag);  // = blockIdx.x, for either schedule
      for (int round = 0;; ++round) {
        // The Q buffer and tile_slot are free once the consumers finished every Q K^T of the
        // previous tile.
        mbarrier_wait(&empty_q, (round & 1) ^ 1);
        *reinterpret_cast<volatile int*>(&tile_slot) = t;
        if (t >= p.num_tiles) {
          mbarrier_arrive(&full_q);  // the end marker
          break;
        }
        const TileCoord tc = decode_tile<kCausal>(t, p);
        const int m0 = tile_m0<kBlockM, kCausal, kLocal>(tc, lp), hk = tc.h / p.group;
        int n_first = 0, n_blocks;
        // kLocal varlen: the maps are ragged (make_ragged_map), rows clipped at the sequence's end.
        bool ragged = false;
        TileSpan span{};
        if constexpr (kLocal) {
          if constexpr (kCache)
            span = cache_span(tc.b, p, lp, nullptr);
          else
            span = tile_span(tc.b, p, lp);
          const int2 kb = local_key_blocks<kBlockM, kBlockN>(m0, span);
          n_first = kb.x, n_blocks = kb.y;
          ragged = lp.cu_seqlens_q != nullptr;
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
        for (int c = 0; c < Tr::kColBlocks; ++c)
          tma_load_rows(ragged, s_q + c * kBlockM * 128, &tm_q, &full_q, c * 64, tc.h, tc.b, span.q0, span.sq, m0);
        // K or V of the i-th visited key block of this tile into ring slot (ring + i) % kStages.
        auto load_kv = [&](const CUtensorMap* map, uint8_t* buf, uint64_t* full, uint64_t* empty, int i) {
          const uint32_t st = ring_stage(ring + i, kStages);
          mbarrier_wait(&empty[st], ring_phase(ring + i, kStages) ^ 1);
          mbarrier_arrive_expect_tx(&full[st], Tr::kKVBytes);
          const int n0 = (n_first + key_block(i, n_blocks, rot)) * kBlockN;
          uint8_t* dst = buf + st * Tr::kKVBytes;
          if constexpr (kCache) {
            if (lp.block_table == nullptr) {  // the sequence's rows [b * capacity, + len)
#pragma unroll
              for (int c = 0; c < Tr::kColBlocks; ++c)
                tma_load_ragged(dst + c * kBlockN * 128, map, &full[st], c * 64, hk, span.k0, span.sk, n0);
            } else {  // pieces of box_rows keys, each inside one page (valid ones: page in range, key < len)
              for (int j = 0; j < kBlockN; j += lp.box_rows) {
                const int key = n0 + j, pi = key / lp.page_size, within = key - pi * lp.page_size;
                int start = 0, len = 0;  // (len 0: every row out of bounds, zeros)
                if (key < span.sk) {
                  const int page = __ldg(lp.block_table + tc.b * lp.bt_batch + pi * lp.bt_page);
                  if (page >= 0 && page < lp.num_pages) {
                    start = page * lp.page_size;
                    len = min(lp.page_size, span.sk - pi * lp.page_size);
                  }
                }
#pragma unroll
                for (int c = 0; c < Tr::kColBlocks; ++c)
                  tma_load_ragged(dst + c * kBlockN * 128 + j * 128, map, &full[st], c * 64, hk, start, len, within);
              }
            }
          } else {
#pragma unroll
            for (int c = 0; c < Tr::kColBlocks; ++c)
              tma_load_rows(ragged, dst + c * kBlockN * 128, map, &full[st], c * 64, hk, tc.b, span.k0, span.sk, n0);
          }
        };
        // Order K0, K1, V0, K2, V1, ...: the consumers need K_{i+1} before V_i.
        load_kv(&tm_k, s_k, full_k, empty_k, 0);
        for (int i = 1; i < n_blocks; ++i) {
          load_kv(&tm_k, s_k, full_k, empty_k, i);
          load_kv(&tm_v, s_v, full_v, empty_v, i - 1);
        }
        load_kv(&tm_v, s_v, full_v, empty_v, n_blocks - 1);
        // Dynamic: claim the next tile only now, when this one is nearly done (the consumers are
        // kStages blocks behind), so the claim order follows the CTAs' finishing order.
        t = dynamic ? claim_tile(p.tile_counter) : tile_of_round(round + 1, p.zigzag);
        ring += n_blocks;
      }
    }
  } else {
    // ================================ consumers ===============================
    setmaxnreg_inc<Tr::kConsumerRegs>();
    const int cw = warpgroup - 1;  // consumer warpgroup 0, 1(, 2): rows [64 cw, 64 cw + 64) of the tile
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    const bool o_vec = IOATTN_SM90_O_VEC && vec16_ok<Element>(p.o, p.o_batch, p.o_seq, p.o_head);  // the epilogue's 16-byte stores
    const int row_in_tile = cw * 64 + warp * 16 + lane / 4;  // this thread's rows: +0 and +8
    const int off = p.seqlen_k - p.seqlen_q;                 // bottom-right causal offset
    const int sched_mine = static_cast<int>(NamedBarrier::kSchedWG0) + cw;
    const int sched_other = static_cast<int>(NamedBarrier::kSchedWG0) + (cw + 1) % Tr::kConsumerWGs;
    // Ping-pong / round-robin protocol: warpgroup 0 goes first. Every GEMM issue is bracketed by a
    // sync on my barrier (256 threads: mine + the previous warpgroup's arrival) and an arrival on
    // the next one's, across tiles; every warpgroup issues equally often, and this one extra
    // arrival is consumed by warpgroup 0's final sync below, so every barrier phase completes.
    // A warpgroup cannot arrive twice before its successor synced: its own next turn needs the
    // whole ring to pass first.
    if (cw == Tr::kConsumerWGs - 1) named_barrier_arrive(static_cast<int>(NamedBarrier::kSchedWG0), 256);
    const uint32_t q_base = smem_u32(s_q) + cw * 64 * 128;
    const uint32_t k_base = smem_u32(s_k);
    const uint32_t v_base = smem_u32(s_v);
    // One arrival of this warp on an "empty" barrier (the producer may refill / reuse).
    auto release = [&](uint64_t* empty) {
      __syncwarp();
      if (lane == 0) mbarrier_arrive(empty);
    };
    int ring = 0;

    const bool tr = IOATTN_FWD_TRACE && threadIdx.x % 128 == 0;  // (trace builds: who stamps)
    for (int round = 0;; ++round) {
      if (tr) FWD_TRACE(cw, round, 0);
      mbarrier_wait(&full_q, round & 1);  // this tile's index, and its Q when it has keys
      if (tr) FWD_TRACE(cw, round, 1);
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
      const int m0 = tile_m0<kBlockM, kCausal, kLocal>(tc, lp);
      int n_first = 0, n_blocks;
      [[maybe_unused]] TileSpan span{};  // kLocal only
      [[maybe_unused]] bool poisoned = false;  // kCache: a bad length or table entry (NaN rows)
      if constexpr (kLocal) {
        if constexpr (kCache)
          span = cache_span(tc.b, p, lp, &poisoned);
        else
          span = tile_span(tc.b, p, lp);
        const int2 kb = local_key_blocks<kBlockM, kBlockN>(m0, span);
        n_first = kb.x, n_blocks = kb.y;
      } else {
        n_blocks = num_key_blocks<kBlockM, kBlockN, kCausal>(m0, p.seqlen_q, p.seqlen_k);
      }
      const int rot = key_rotation(tc.m_block, n_blocks, p);
      // (the v4 producer stamps nothing: at 24 registers its stamps spilled)
      if (tr && cw == 0) FWD_TRACE_BLOCKS(round, n_blocks);
      // The score scale (and its log2(e) multiple, 1 / it) and O's factor of this tile: kCache with
      // an 8-bit cache's scales folds k_scale / v_scale of the tile's kv head in; the other
      // instances read p's (scale(), scale_log2(): their SASS stays as it was).
      [[maybe_unused]] float tile_scale = 0.0f, tile_scale_log2 = 0.0f, tile_inv_scale = 0.0f, o_factor = 1.0f;
      if constexpr (kCache) {
        const int hk = tc.h / p.group;
        const float ks = lp.k_scale != nullptr ? __ldg(lp.k_scale + hk) : 1.0f;
        tile_scale = p.scale * ks;
        tile_scale_log2 = p.scale_log2 * ks;
        tile_inv_scale = lp.inv_scale / ks;
        o_factor = lp.v_scale != nullptr ? __ldg(lp.v_scale + hk) : 1.0f;
      }
      auto scale = [&]() {
        if constexpr (kCache) return tile_scale;
        else return p.scale;
      };
      auto scale_log2 = [&]() {
        if constexpr (kCache) return tile_scale_log2;
        else return p.scale_log2;
      };

      float o[kHeadDim / 2];  // O accumulator fragment (64 x kHeadDim per warpgroup)
#pragma unroll
      for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.0f;
      float row_max[2] = {-INFINITY, -INFINITY};  // raw (unscaled) running max of S, per row
      float row_sum[2] = {0.0f, 0.0f};            // this thread's share of sum exp, per row

      if (n_blocks > 0) {
        float s[kBlockN / 2];      // S fragment (64 x kBlockN)
        uint32_t pf[kBlockN / 4];  // P fragment as 16-bit pairs: the A operand of P V
        float corr[2] = {1.0f, 1.0f};
        // Whether O needs O *= corr before the next P V: false when no row of this warp changed
        // its running max in the last softmax (corr = 1 exactly), or O is still 0 (first block).
        bool rescale = true;

        // kQRegs: this warp's 16 Q rows of the warpgroup's 64 as the wgmma A fragment of every
        // k-step (the mma.m16n8k16 A layout: a0 / a1 rows g / g + 8 at dims 2t, 2t + 1, a2 / a3 the
        // same at dims 8 + 2t), by one ldmatrix.x4 per k-step from the 128-byte-swizzled Q tile:
        // lane L addresses row 16 w + L % 8 + 8 ((L / 8) % 2), 16-byte chunk 2 (kk % 4) + L / 16
        // of column block kk / 4, stored at chunk ^ (row % 8). Q landed (full_q) before this tile's
        // consumers got here; the wgmma_fence in issue_qk orders these register writes first.
        [[maybe_unused]] uint32_t qa[kQRegs ? kHeadDim / 16 : 1][4];
        if constexpr (kQRegs) {
          const int qrow = warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2);  // row within the warpgroup's 64
#pragma unroll
          for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            const uint32_t chunk = 2 * (kk % 4) + lane / 16;
            ptx::ldmatrix_x4(qa[kk], q_base + (kk / 4) * kBlockM * 128 + qrow * 128 + ((chunk ^ (qrow % 8)) << 4));
          }
          // IOATTN_SM90_EARLY_Q: with Q in registers nothing reads the Q tile after this point.
          if (IOATTN_SM90_EARLY_Q) release(&empty_q);
        }
        // S = Q K^T for ring slot st: kHeadDim/16 k-steps, K-major A and B (kQRegs: A from qa).
        auto issue_qk = [&](uint32_t st) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            const uint32_t col = kk / 4, byte_in_row = (kk % 4) * 32;
            const uint64_t bd =
                make_desc_sw128(k_base + st * Tr::kKVBytes + col * kBlockN * 128 + byte_in_row, 16, 1024);
            if constexpr (kQRegs) {
              Wgmma<kBlockN, Element>::template rs<0>(s, qa[kk], bd, kk > 0 ? 1 : 0);
            } else {
              const uint64_t a = make_desc_sw128(q_base + col * kBlockM * 128 + byte_in_row, 16, 1024);
              Wgmma<kBlockN, Element>::template ss<0>(s, a, bd, kk > 0 ? 1 : 0);
            }
          }
          wgmma_commit();
        };
        // O += P V for ring slot st: kBlockN/16 k-steps, A = P from registers, V MN-major.
        auto issue_pv = [&](uint32_t st) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) {
            const uint64_t bd = make_desc_sw128(v_base + st * Tr::kKVBytes + kk * 16 * 128, kBlockN * 128, 1024);
            const uint32_t a[4] = {pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3]};
            Wgmma<kHeadDim, Element>::template rs<1>(o, a, bd, 1);
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
          for (int i = 0; i < kBlockN / 4; ++i) reg_fence(pf[i]);
        };
        // Sets S to -inf where key >= seqlen_k or (causal) key > row + off. Key block n.
        auto apply_mask = [&](int n) {
          const int key0 = n * kBlockN + 2 * (lane % 4);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = m0 + row_in_tile + 8 * r;
            if constexpr (kLocal) {  // visible: key_begin <= key < key_end
              local_mask_row<kBlockN>(s, r, key0, row, span);
              continue;
            }
            const int key_end = kCausal ? min(p.seqlen_k, row + off + 1) : p.seqlen_k;  // visible: key < key_end
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
        // Online softmax on S of one key block: new row max, corr = exp(old max - new max),
        // S <- exp(scale (S - max)), row_sum <- row_sum * corr + sum. Rows stay -inf-safe.
        // kPoly: every kExp2PolyEvery-th group of 8 columns uses exp2_poly3 (no masked scores).
        auto softmax = [&](auto poly_tag) {
          constexpr bool kPoly = decltype(poly_tag)::value;
          bool changed = false;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 threads of a quad share a row
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            changed |= mx != row_max[r];
            const float m_scaled = mx == -INFINITY ? 0.0f : mx * scale_log2();
            corr[r] = exp2_approx(row_max[r] * scale_log2() - m_scaled);  // old max -inf -> 0
            row_max[r] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                float& x = s[4 * i + 2 * r + e];
                const float arg = fmaf(x, scale_log2(), -m_scaled);
                if (kPoly && use_poly_exp2<Tr::kExp2PolyEvery>(i))
                  x = exp2_poly3(arg);
                else
                  x = exp2_approx(arg);
                sum += x;
              }
            }
            row_sum[r] = row_sum[r] * corr[r] + sum;
          }
          rescale = !p.rescale_skip || __any_sync(0xffffffffu, changed);  // warp-uniform
        };
        // kLocal: softcap / ALiBi on the scores of key block n (before the mask, as on mma.sync).
        float slope = 0.0f;  // kLocal: this tile's ALiBi slope (read once per tile)
        if constexpr (kLocal) {
          if (lp.alibi_slopes != nullptr) slope = lp.alibi_slopes[tc.h];
        }
        auto modify_scores = [&](int n) {
          if constexpr (kCache)
            local_modify_scores<kBlockN>(s, n * kBlockN + 2 * (lane % 4), m0 + row_in_tile + span.sk - span.sq,
                                         tile_scale, tile_inv_scale, lp, slope);
          else
            local_modify_scores<kBlockN>(s, n * kBlockN + 2 * (lane % 4), m0 + row_in_tile + span.sk - span.sq,
                                         p.scale, lp.inv_scale, lp, slope);
        };
        auto mask_and_softmax = [&](int n) {
          if constexpr (kLocal) {
            if (lp.softcap > 0.0f || lp.alibi_slopes != nullptr) modify_scores(n);
          }
          if (needs_mask(n)) {
            apply_mask(n);
            softmax(std::false_type{});
          } else {
            softmax(std::true_type{});
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
        auto convert_p = [&]() {
#pragma unroll
          for (int j = 0; j < kBlockN / 4; ++j) pf[j] = pack2<Element>(s[2 * j], s[2 * j + 1]);
        };

        // ---- first key block (the last one in key order) ----
        {
          const uint32_t st = ring_stage(ring, kStages);
          mbarrier_wait(&full_k[st], ring_phase(ring, kStages));
          if (tr) FWD_TRACE(cw, round, 2);
          named_barrier_sync(sched_mine, 256);
          if (tr) FWD_TRACE(cw, round, 3);
          issue_qk(st);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<0>();
          if (tr) FWD_TRACE(cw, round, 4);
          fence_s();
          release(&empty_k[st]);
          if (IOATTN_SM90_EARLY_Q && !kQRegs && n_blocks == 1) release(&empty_q);
          mask_and_softmax(n_first + key_block(0, n_blocks, rot));
          if (p.rescale_skip) rescale = false;  // O is still all zeros
          convert_p();
          if (tr) FWD_TRACE(cw, round, 5);
        }

        // ---- steady state: S_i = Q K_i^T issued with O += P_{i-1} V_{i-1} ----
        for (int i = 1; i < n_blocks; ++i) {
          const uint32_t st = ring_stage(ring + i, kStages), prev = ring_stage(ring + i - 1, kStages);
          // O to the max of block i-1: early, while the other warpgroup holds the tensor cores;
          // or late, while Q K_i^T runs (FlashAttention-3's place).
          if (p.rescale_early) rescale_o();
          mbarrier_wait(&full_k[st], ring_phase(ring + i, kStages));
          named_barrier_sync(sched_mine, 256);
          issue_qk(st);
          if (!p.rescale_early) rescale_o();
          mbarrier_wait(&full_v[prev], ring_phase(ring + i - 1, kStages));
          issue_pv(prev);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<1>();  // S_i ready (P V may still run)
          fence_s();
          release(&empty_k[st]);
          if (IOATTN_SM90_EARLY_Q && !kQRegs && i == n_blocks - 1) release(&empty_q);
          mask_and_softmax(n_first + key_block(i, n_blocks, rot));
          wgmma_wait<0>();  // P_{i-1} V_{i-1} done: pf and the V slot are free
          fence_o();
          release(&empty_v[prev]);
          convert_p();
        }
        // Every Q K^T of this tile has completed: the producer may load the next Q.
        if (!IOATTN_SM90_EARLY_Q) release(&empty_q);
        if (tr) FWD_TRACE(cw, round, 6);

        // ---- last P V ----
        {
          const uint32_t prev = ring_stage(ring + n_blocks - 1, kStages);
          if (p.rescale_early) rescale_o();
          mbarrier_wait(&full_v[prev], ring_phase(ring + n_blocks - 1, kStages));
          named_barrier_sync(sched_mine, 256);
          if (!p.rescale_early) rescale_o();
          issue_pv(prev);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<0>();
          fence_o();
          release(&empty_v[prev]);
        }
        if (tr) FWD_TRACE(cw, round, 7);
        ring += n_blocks;
      } else {
        release(&empty_q);  // nothing loaded for this tile: the slot is free again at once
      }

      // ---- epilogue: O /= row sum, LSE = scale * max + log(sum); stored straight from registers
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if constexpr (kLocal) {
          float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
          float lse = sum > 0.0f ? row_max[r] * scale() + logf(sum) : -INFINITY;
          if (lp.sinks != nullptr)
            fold_sink(sum, sum > 0.0f ? row_max[r] * scale() : -INFINITY, lp.sinks[tc.h], 1.0f, &inv, &lse);
          if constexpr (kCache) {  // NaN O and LSE: a poisoned sequence, or a NaN / +inf visible score
            inv *= o_factor;
            if (poisoned || sum != sum) inv = lse = __int_as_float(0x7fc00000);  // (fmaxf drops NaN: sum holds it)
          }
          const int row = m0 + row_in_tile + 8 * r;
          const int64_t prow = static_cast<int64_t>(span.q0) + row;  // varlen: packed position q0 + row
          store_acc_row<Element, kHeadDim>(static_cast<Element*>(p.o) + tc.b * p.o_batch + prow * p.o_seq + tc.h * p.o_head,
                                         o, r, inv, lane, o_vec, row < span.sq);
          if (row < span.sq && p.lse != nullptr && lane % 4 == 0)
            p.lse[tc.b * p.lse_batch + tc.h * p.lse_head + prow * p.lse_seq] = lse;
          continue;
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        const int row = m0 + row_in_tile + 8 * r;
        const bool in = row < p.seqlen_q && (!kCausal || row >= 0);  // (rows < 0: m_shift's padding)
        store_acc_row<Element, kHeadDim>(static_cast<Element*>(p.o) + tc.b * p.o_batch + row * p.o_seq + tc.h * p.o_head,
                                       o, r, inv, lane, o_vec, in);
        if (in && p.lse != nullptr && lane % 4 == 0)
          p.lse[tc.b * p.lse_batch + tc.h * p.lse_head + row * p.lse_seq] =
              sum > 0.0f ? row_max[r] * p.scale + logf(sum) : -INFINITY;
      }
      if (tr) FWD_TRACE(cw, round, 8);
    }
    if (cw == 0) named_barrier_sync(static_cast<int>(NamedBarrier::kSchedWG0), 256);  // the extra arrival
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // an image without sm_90a features must never run (the selector checks; this is loud)
#endif  // IOATTN_SM90A_ENABLED
}

// ---- host side of one kernel instance ---------------------------------------------------------

struct FwdLaunch {
  CUtensorMap q, k, v;  // 4D maps (head_dim, seqlen, heads, batch), box (64, rows, 1, 1), 128B swizzle
  FwdParams params;
  LocalParams local;     // read by the kLocal instances only
  CacheParams cache;     // the kCache instances' (its LocalParams part instead of `local`)
  unsigned grid = 0;     // CTAs: num_m_blocks * heads_q * batch
  cudaStream_t stream = nullptr;
};

// Whether this build holds an sm_90a image of the instance: false when built for sm_80 only, and
// also when the driver would JIT older PTX for sm_90 (ptxVersion < 90: that body is empty).
#if IOATTN_FWD_TRACE
// Before the traced (10th) launch: zero the stamps, so rounds that launch did not run (dynamic
// schedules hand out different tiles per launch) read as absent, not as an older launch's.
inline void fwd_trace_arm(cudaStream_t stream) {
  void* a = nullptr;
  IOATTN_CUDA_CHECK(cudaGetSymbolAddress(&a, fwd_trace::g_stamp));
  IOATTN_CUDA_CHECK(cudaMemsetAsync(a, 0, sizeof(fwd_trace::g_stamp), stream));
  IOATTN_CUDA_CHECK(cudaGetSymbolAddress(&a, fwd_trace::g_blocks));
  IOATTN_CUDA_CHECK(cudaMemsetAsync(a, 0, sizeof(fwd_trace::g_blocks), stream));
}
// After the 10th launch (per instance): mean cycles per phase over rounds 1 .. kRounds - 2 of the
// traced CTAs (rounds whose next round ran a tile too), per consumer warpgroup and the producer.
// The v4 body's producer stamps nothing (its consumer warpgroup 0 records the visited blocks).
// A round's span is its point 0 to the next round's point 0; "outside the steps" = the span less
// (visited blocks - 1) x the steady step (steady loop / (blocks - 1)).
inline void fwd_trace_print(unsigned grid, int consumer_wgs, const char* what) {
  using namespace fwd_trace;
  static unsigned h[kBlocks][4][kRounds][kPoints];
  static int nb[kBlocks][kRounds];
  IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
  IOATTN_CUDA_CHECK(cudaMemcpyFromSymbol(h, g_stamp, sizeof(h)));
  IOATTN_CUDA_CHECK(cudaMemcpyFromSymbol(nb, g_blocks, sizeof(nb)));
  const int blocks = static_cast<int>(grid < static_cast<unsigned>(kBlocks) ? grid : kBlocks);
  const char* names[8] = {"Q wait", "K0 wait", "turn", "first S", "first softmax", "steady loop", "last P V",
                          "epilogue"};
  for (int who = 0; who < consumer_wgs; ++who) {
    double ph[8] = {}, span = 0, step = 0, outside = 0;
    int n = 0;
    for (int b = 0; b < blocks; ++b)
      for (int r = 1; r < kRounds - 1; ++r) {
        const unsigned* x = h[b][who][r];
        const unsigned* next = h[b][who][r + 1];
        if (x[0] == 0 || next[0] == 0 || x[8] == 0 || nb[b][r] < 2) continue;
        for (int k = 0; k < 8; ++k) ph[k] += static_cast<double>(x[k + 1] - x[k]);
        const double sp = static_cast<double>(next[0] - x[0]), st = static_cast<double>(x[6] - x[5]) / (nb[b][r] - 1);
        span += sp, step += st, outside += sp - (nb[b][r] - 1) * st, ++n;
      }
    if (n == 0) continue;
    std::fprintf(stderr, "fwd trace %s wg %d (mean cycles over %d tiles):", what, who, n);
    for (int k = 0; k < 8; ++k) std::fprintf(stderr, " %s %.0f |", names[k], ph[k] / n);
    std::fprintf(stderr, " tile span %.0f | steady step %.0f | outside the steps %.0f\n", span / n, step / n,
                 outside / n);
  }
  double qwait = 0, k0 = 0;
  int n = 0;
  for (int b = 0; b < blocks; ++b)
    for (int r = 1; r < kRounds - 1; ++r) {
      const unsigned* x = h[b][kProducer][r];
      const unsigned* c = h[b][0][r];
      if (x[0] == 0 || x[2] == 0 || c[1] == 0) continue;
      qwait += static_cast<double>(x[1] - x[0]);
      k0 += static_cast<double>(c[1] - x[1]);  // producer's Q issue -> consumer 0 sees Q landed
      ++n;
    }
  if (n > 0)
    std::fprintf(stderr, "fwd trace %s producer: empty_q wait %.0f | Q issue -> Q landed (wg 0) %.0f\n", what,
                 qwait / n, k0 / n);
}
#endif

template <class Tr, bool kCausal, bool kLocal = false, bool kCache = false>
bool flash_fwd_sm90_present() {
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, flash_fwd_sm90_kernel<Tr, kCausal, kLocal, kCache>);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear: "no image" is an answer here, not a failure
    return false;
  }
  return attr.binaryVersion >= 90 && attr.ptxVersion >= 90;
}

template <class Tr, bool kCausal, bool kLocal = false, bool kCache = false>
void flash_fwd_sm90_launch(const FwdLaunch& l) {
  auto kernel = flash_fwd_sm90_kernel<Tr, kCausal, kLocal, kCache>;
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
#if IOATTN_FWD_TRACE
  static int calls = 0;
  if (++calls == 10) fwd_trace_arm(l.stream);
#endif
  if constexpr (kCache)
    kernel<<<l.grid, Tr::kThreads, Tr::kSmemBytes, l.stream>>>(l.q, l.k, l.v, l.params, l.cache);
  else
    kernel<<<l.grid, Tr::kThreads, Tr::kSmemBytes, l.stream>>>(l.q, l.k, l.v, l.params, l.local);
  IOATTN_CUDA_CHECK_LAUNCH("flash_fwd_sm90_kernel");
#if IOATTN_FWD_TRACE
  if (calls == 10) fwd_trace_print(l.grid, Tr::kConsumerWGs, kCausal ? "v4 causal" : "v4");
#endif
}

// Explicit instantiation (one line per dispatch-table row, in the flash_fwd_sm90_hdim*.cu files).
#define IOATTN_SM90_INSTANTIATE(TR, CAUSAL)                                \
  template bool flash_fwd_sm90_present<TR, CAUSAL>();                    \
  template void flash_fwd_sm90_launch<TR, CAUSAL>(const FwdLaunch& l);
#define IOATTN_SM90_EXTERN(TR, CAUSAL)                                     \
  extern template bool flash_fwd_sm90_present<TR, CAUSAL>();             \
  extern template void flash_fwd_sm90_launch<TR, CAUSAL>(const FwdLaunch& l);
// The kLocal rows (windows, sinks, softcap, ALiBi, varlen): one per (head_dim, dtype), on the causal
// tiling.
#define IOATTN_SM90_INSTANTIATE_LOCAL(TR)                                  \
  template bool flash_fwd_sm90_present<TR, true, true>();                \
  template void flash_fwd_sm90_launch<TR, true, true>(const FwdLaunch& l);
#define IOATTN_SM90_EXTERN_LOCAL(TR)                                       \
  extern template bool flash_fwd_sm90_present<TR, true, true>();         \
  extern template void flash_fwd_sm90_launch<TR, true, true>(const FwdLaunch& l);
// The KV-cache rows (decode() with more than 16 query rows; CacheParams): the kLocal tiling.
#define IOATTN_SM90_INSTANTIATE_CACHE(TR)                                  \
  template bool flash_fwd_sm90_present<TR, true, true, true>();          \
  template void flash_fwd_sm90_launch<TR, true, true, true>(const FwdLaunch& l);
#define IOATTN_SM90_EXTERN_CACHE(TR)                                       \
  extern template bool flash_fwd_sm90_present<TR, true, true, true>();   \
  extern template void flash_fwd_sm90_launch<TR, true, true, true>(const FwdLaunch& l);

}  // namespace ioattn::cuda::sm90

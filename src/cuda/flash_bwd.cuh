// flash_bwd.cuh — the tensor-core flash-attention backward (mma.sync path, sm_80+).
//
// What it computes: from the forward's Q, K, V, O, its LSE and dO, the gradients dQ, dK, dV (and
// the sink gradient) by recomputation, never storing a score matrix anywhere. For each visible
// (query i, key j), with s_ij the forward's score (scale, softcap, ALiBi as in the forward):
//   P_ij = exp(s_ij - LSE_i)      (0 for masked keys and for rows with LSE = -inf)
//   D_i  = dO_i . O_i,   dP_ij = dO_i . v_j,   dS_ij = P_ij (dP_ij - D_i) [softcap: * (1 - tanh^2)]
//   dV_j = sum_i P_ij dO_i,   dK_j = scale sum_i dS_ij q_i,   dQ_i = scale sum_j dS_ij k_j
// with dK, dV summed over the query heads of a GQA group, and dsinks_h = -sum_i exp(sink_h - LSE_i) D_i.
// The semantics are src/cpu/backward_cpu.cpp's (the float64 oracle is src/cpu/backward_ref.cpp).
//
// Kernels, in launch order (flash_bwd_dispatch.cu runs them on the caller's stream):
//   1. preprocess     one warp per query row: D = dO.O (fp32), LSE·log2(e) (+inf where LSE = -inf,
//                     so exp2(s - lse) = 0 on such rows, never NaN), and per-CTA partial sums of
//                     the sink gradient (summed in a fixed order by 2., so dsinks is always
//                     deterministic). Workspace rows: [heads_q, rows_q] with rows_q = batch·seqlen_q
//                     (fixed length) or total_q (varlen, the packed token index).
//   2. dsink reduce   one warp per head, fixed-order sum of the partials.
//   3. dK/dV          FlashAttention-2 order: one CTA per (key block of kBlockN keys, kv head,
//                     batch). K and V stay in shared memory; the CTA walks every query head of the
//                     GQA group and every block of kBlockM query rows that sees one of its keys
//                     (blocks outside the causal/window band are skipped whole), with Q, dO, LSE
//                     and D double-buffered by cp.async. Each warp owns 16 keys of the block:
//                       S^T  = K Q^T, dP^T = V dO^T   (16 keys x kBlockM queries, A = K/V rows via
//                                                       ldmatrix, B = Q/dO rows via ldmatrix)
//                       P^T, dS^T in registers         (the C layout of a score tile is the A layout
//                                                       of the next mma, as in the forward's P·V)
//                       dV += P^T dO, dK += dS^T Q     (16 keys x head_dim per warp, fp32 registers;
//                                                       B = dO/Q via ldmatrix.trans)
//                     so P never touches shared memory and dK, dV never leave registers until the
//                     end (no atomics on dK/dV; GQA sums stay on chip). Default mode then also
//                     accumulates dQ: dS^T goes to shared memory (16-bit), and the warps, now tiled
//                     32 query rows x kDqCols columns, compute dQ_partial = dS K and add it to the
//                     fp32 accumulator [heads_q, rows_q, kHeadDim] with red.global.add (.v2 on sm_90).
//   4a. dQ convert    (default) dQ = scale · accumulator -> the input dtype, 16-byte stores.
//   4b. dQ pass       (deterministic mode) no float atomics at all: one CTA per (query block,
//                     head, batch) walks the key blocks that its rows see in ascending order,
//                     recomputes S and dP (warps own 16 query rows, as the forward) and
//                     accumulates dQ in registers; every dQ row has one owner and a fixed order,
//                     so results are bitwise identical run to run (7 GEMMs instead of 5: the price
//                     the CPU backend pays too).
// Extra memory: D, LSE·log2e (2·heads_q·rows_q floats), the sink partials and, in the default
// mode, the fp32 dQ accumulator (heads_q·rows_q·kHeadDim floats): O(n), never n x n.
//
// Assumptions (checked by cuda_backward_select): f16/bf16; head_dim == head_dim_v, a multiple of
// 8, <= kHeadDim <= 256 (padded columns are zero-filled in shared memory: they contribute nothing);
// 16-byte aligned base pointers and strides that are multiples of 8 elements (q, k, v, o, dout,
// dq, dk, dv); seqlen_q + seqlen_k < 2^30 (32-bit positions); int64 offsets throughout.
// Keys and query rows past the end of a sequence are zero-filled and masked, so nothing from
// unrelated memory reaches a gradient; rows with no visible key get dQ = 0 exactly, keys that no
// query sees get dK = dV = 0 exactly.
//
// History (no GPU measurement yet: tile shapes below are first choices, see the traits)
//   1. FA2-order dK/dV kernel with key-owning warps (P^T, dS^T stay in registers for dV, dK),
//      atomic fp32 dQ from a second warp tiling of dS K, and a separate recomputing dQ kernel for
//      the deterministic mode. One traits row per head dim (64, 128), bf16 and f16.
//   2. hdim256: column splits (2 CTAs per key block, 128 accumulator columns each, S and dP
//      recomputed by both), 32-row steps; dQ partials with red.global.add.v2.f32 on sm_90.
// Verified before any GPU run by executing this source on the host (one std::thread per CUDA
// thread, ldmatrix/mma/shfl as warp collectives, cp.async applied at wait_group, smem poisoned
// with NaN) against the float64 reference: every mask/feature, both dQ modes, hdim 40..256.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/flash_fwd.cuh"  // ptx wrappers, kLog2e/kNegInf, flash_detail::load_tile
#include "cuda/ptx.cuh"

namespace ioattn::cuda {

constexpr float kPosInf = __builtin_huge_valf();

// Plain pointers + int64 strides (elements): everything the backward kernels read and write.
struct BwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;  // the forward's LSE (natural log)
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int64_t q_batch = 0, q_seq = 0, q_head = 0;
  int64_t k_batch = 0, k_seq = 0, k_head = 0;
  int64_t v_batch = 0, v_seq = 0, v_head = 0;
  int64_t o_batch = 0, o_seq = 0, o_head = 0;
  int64_t do_batch = 0, do_seq = 0, do_head = 0;
  int64_t dq_batch = 0, dq_seq = 0, dq_head = 0;
  int64_t dk_batch = 0, dk_seq = 0, dk_head = 0;
  int64_t dv_batch = 0, dv_seq = 0, dv_head = 0;
  int64_t lse_batch = 0, lse_seq = 0, lse_head = 0;
  int batch = 0, heads_q = 0, heads_kv = 0, group = 1;  // kv head = h / group
  int seqlen_q = 0, seqlen_k = 0;  // fixed length, or the max over the batch for varlen
  int head_dim = 0;                // actual (<= the kernel's kHeadDim)
  int num_n_blocks = 0;            // key blocks per (batch, kv head) of the dK/dV kernel
  int num_m_blocks = 0;            // query blocks per (batch, head) of the deterministic dQ kernel
  int64_t rows_q = 0;              // workspace rows per head: batch·seqlen_q, or total_q (varlen)
  int64_t rows_k = 0;              // key rows: batch·seqlen_k, or total_k (varlen; the hdim-256 TMA maps)
  int64_t variant_rows = 0;        // the wgmma backward's variant key: seqlen_q, or varlen's work-weighted length
  const int32_t* cu_seqlens_q = nullptr;  // varlen, on the device
  const int32_t* cu_seqlens_k = nullptr;
  float scale = 1.f;
  float scale_log2 = kLog2e;  // scale·log2(e)
  float softcap = 0.f;        // 0 = off
  float softcap_inv = 0.f;
  int window_left = -1, window_right = -1;  // -1 = unbounded (causal: right = 0); clamped by the host
  const float* alibi_slopes = nullptr;
  const float* sinks = nullptr;
  float* dsinks = nullptr;  // optional output [heads_q]

  // Workspace (flash_bwd_dispatch.cu allocates it on the stream).
  float* ws_lse = nullptr;    // [heads_q, rows_q]: LSE·log2(e), +inf where LSE = -inf
  float* ws_d = nullptr;      // [heads_q, rows_q]: D = dO.O
  float* ws_dq = nullptr;     // [heads_q, rows_q, ws_dq_pitch] fp32 dQ accumulator; null = deterministic
  int ws_dq_pitch = 0;        // the kernel's kHeadDim
  float* ws_dsink = nullptr;  // [heads_q, num_pre_blocks] partial sink gradients
  int num_pre_blocks = 0;
};

// Tile shape of one backward instantiation. "Should not affect results, only speed."
//   dK/dV kernel: kWarps warps, each owning 16 keys (kBlockN = 16·kWarps keys per CTA), walking
//   query blocks of kBlockM rows; dQ partials tiled 32 rows x kDqCols columns per warp.
//   kColSplits > 1 (hdim256): kColSplits CTAs share a key block, each accumulating dK, dV and
//   the dQ partial of kAccCols = kHeadDim / kColSplits columns (S^T and dP^T, which reduce over
//   all of head_dim, are recomputed by each), so the accumulators fit in registers.
//   dQ kernel (deterministic mode): kDqWarps warps x 16 query rows, key blocks of kDqBlockN.
template <int kHeadDim_, int kBlockM_, int kWarps_, int kMinBlocks_, int kDqBlockN_, int kDqWarps_, int kDqMinBlocks_,
          int kColSplits_ = 1>
struct BwdTile {
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim the kernels are built for
  static constexpr int kBlockM = kBlockM_;    // query rows per step of the dK/dV kernel
  static constexpr int kWarps = kWarps_;
  static constexpr int kBlockN = 16 * kWarps;  // keys per dK/dV CTA
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocksPerSm = kMinBlocks_;
  static constexpr int kPitch = kHeadDim + 8;  // smem row pitch in elements (+16 B: no bank conflicts)
  static constexpr int kPitchS = kBlockM + 8;  // dS^T row pitch in elements (same reason)
  static constexpr int kDqWarpsM = kBlockM / 32;        // dQ partial: warps along query rows
  static constexpr int kDqWarpsD = kWarps / kDqWarpsM;  // ... and along head_dim
  static constexpr int kColSplits = kColSplits_;
  static constexpr int kAccCols = kHeadDim / kColSplits;  // dK/dV/dQ columns of one CTA
  static constexpr int kDqCols = kAccCols / kDqWarpsD;    // dQ partial columns per warp
  // (K, V) + 2 stages of (Q, dO) + 2 stages of (LSE, D) floats + dS^T (default mode only).
  static constexpr size_t kSmemNoDs = (static_cast<size_t>(2 * kBlockN) + 4 * kBlockM) * kPitch * 2 + 4 * kBlockM * 4;
  static constexpr size_t kSmemBytes = kSmemNoDs + static_cast<size_t>(kBlockN) * kPitchS * 2;

  static constexpr int kDqWarps = kDqWarps_;
  static constexpr int kDqThreads = kDqWarps * 32;
  static constexpr int kDqBlockM = 16 * kDqWarps;  // query rows per dQ CTA
  static constexpr int kDqBlockN = kDqBlockN_;     // keys per step of the dQ kernel
  static constexpr int kDqMinBlocksPerSm = kDqMinBlocks_;
  // Q, dO + 2 stages of (K, V).
  static constexpr size_t kDqSmemBytes = (static_cast<size_t>(2 * kDqBlockM) + 4 * kDqBlockN) * kPitch * 2;

  static_assert(kHeadDim % 16 == 0 && kBlockM % 32 == 0, "k16 steps over head_dim; 32-row dQ slabs");
  static_assert(kHeadDim % (16 * kColSplits) == 0, "column splits of whole 16-column pairs");
  static_assert(kWarps % kDqWarpsM == 0 && kDqCols % 16 == 0, "dQ partial tiles: whole ldmatrix.x4 column pairs");
  static_assert(2 * kBlockM <= kThreads, "one thread per staged LSE / D value");
  static_assert(kDqBlockN % 16 == 0, "k16 steps over keys in the dQ kernel");
};

// What load_tile needs of a tile: head dim, pitch, threads (the dQ kernel has its own count).
template <class Tr>
struct DqLoadShape {
  static constexpr int kHeadDim = Tr::kHeadDim;
  static constexpr int kPitch = Tr::kPitch;
  static constexpr int kThreads = Tr::kDqThreads;
};

namespace bwd_detail {

// Where query row i / key j of batch b starts, and the sequence lengths (varlen or fixed).
struct SeqInfo {
  int q_start, k_start, sq, sk;
  int64_t ws_row0;  // workspace row of query 0 of this sequence
};

__device__ __forceinline__ SeqInfo seq_info(const BwdParams& p, int b) {
  SeqInfo s;
  if (p.cu_seqlens_q != nullptr) {
    s.q_start = p.cu_seqlens_q[b];
    s.sq = p.cu_seqlens_q[b + 1] - s.q_start;
    s.k_start = p.cu_seqlens_k[b];
    s.sk = p.cu_seqlens_k[b + 1] - s.k_start;
    s.ws_row0 = s.q_start;
  } else {
    s.q_start = 0, s.k_start = 0, s.sq = p.seqlen_q, s.sk = p.seqlen_k;
    s.ws_row0 = static_cast<int64_t>(b) * p.seqlen_q;
  }
  return s;
}

// seq_info for a kernel that knows at compile time whether it runs varlen: its dense instances get
// the fixed lengths without a branch on cu_seqlens_q.
template <bool kVarlen>
__device__ __forceinline__ SeqInfo seq_info_t(const BwdParams& p, int b) {
  if constexpr (kVarlen) return seq_info(p, b);
  return SeqInfo{0, 0, p.seqlen_q, p.seqlen_k, static_cast<int64_t>(b) * p.seqlen_q};
}

// Workspace row -> (batch, position in the q/o/dq tensors): varlen rows are packed token
// indices (batch stride 0); fixed-length rows are b·seqlen_q + i.
__device__ __forceinline__ void ws_row_to_pos(const BwdParams& p, int64_t row, int64_t* b, int64_t* pos) {
  if (p.cu_seqlens_q != nullptr) {
    *b = 0;
    *pos = row;
  } else {
    *b = row / p.seqlen_q;
    *pos = row - *b * p.seqlen_q;
  }
}

// tanh without branches: 1 - 2 / (1 + e^2x), with ex2.approx (2^-22 relative) and a fast
// division; absolute error ~1e-7 over the whole range (e^2x = inf gives 1, e^2x = 0 gives -1).
// Not tanh.approx: 1 - tanh^2 multiplies dS, and near |tanh| = 1 the approximate one's 2^-11
// relative error would be a large relative error of that factor.
__device__ __forceinline__ float tanh_abs_accurate(float x) {
  return 1.f - __fdividef(2.f, 1.f + ptx::exp2_approx(2.f * kLog2e * x));
}

// The score transform of the forward in the log2 domain, and the softcap chain-rule factor.
// `raw` is q.k (fp32 from the mma); i, j are positions in the sequence (row, key). kPlain (no
// softcap, no ALiBi) is a compile-time split so the per-element code has no branches.
struct ScoreFn {
  const BwdParams& p;  // scale, softcap: read from the kernel's parameter (constant) bank
  float slope_log2;
  int off;  // seqlen_k - seqlen_q (bottom-right alignment)

  template <bool kPlain>
  __device__ __forceinline__ float apply(float raw, int i, int j, float* chain) const {
    if constexpr (kPlain) {
      return raw * p.scale_log2;
    } else {
      float x = raw * p.scale;
      // softcap 0 (off): th = 0 would zero the score, so select the capped value only when on.
      const float th = tanh_abs_accurate(x * p.softcap_inv);
      if (p.softcap > 0.f) {
        x = p.softcap * th;
        *chain = 1.f - th * th;
      }
      return x * kLog2e - slope_log2 * fabsf(static_cast<float>(i + off - j));  // slope 0 without ALiBi
    }
  }
};

// Key j visible to row i (the mask of ioattn.hpp): j in [i + off - wl, i + off + wr] ∩ [0, sk).
__device__ __forceinline__ bool visible(int i, int j, int sq, int sk, int off, int wl, int wr) {
  const int delta = j - i - off;
  return i < sq && j < sk && (wl < 0 || delta >= -wl) && (wr < 0 || delta <= wr);
}

// 8 elements of dO and O (16 bytes each) -> their fp32 dot product, summed in a fixed order.
// Words are unpacked with memcpy (type-punning a register array through __nv_bfloat162 is
// undefined behaviour that an optimiser may exploit; memcpy compiles to nothing).
template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x, y;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      __nv_bfloat162 xa, yb;
      memcpy(&xa, &av[i], 4);
      memcpy(&yb, &bv[i], 4);
      x = __bfloat1622float2(xa);
      y = __bfloat1622float2(yb);
    } else {
      __half2 xa, yb;
      memcpy(&xa, &av[i], 4);
      memcpy(&yb, &bv[i], 4);
      x = __half22float2(xa);
      y = __half22float2(yb);
    }
    acc = fmaf(x.x, y.x, acc);
    acc = fmaf(x.y, y.y, acc);
  }
  return acc;
}

}  // namespace bwd_detail

// ---- 1. preprocess: D, LSE·log2e, sink-gradient partials -----------------------------------

constexpr int kPreWarps = 8;
constexpr int kPreRows = 64;  // workspace rows per CTA (8 per warp)

template <typename T>
__global__ void __launch_bounds__(kPreWarps * 32) flash_bwd_preprocess_kernel(const BwdParams p) {
  using namespace ptx;
  constexpr int kRows = kPreRows / kPreWarps;  // per warp
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kPreRows;
  // The fp32 dQ accumulator's rows of this block ([heads_q, rows_q, pitch]: one contiguous span)
  // zeroed here rather than by a memset pass of its own (the dK/dV kernel adds into it next). The
  // pitch is a kernel head dim (64, 128 or 256) and the workspace 256-byte aligned: 16-byte stores.
  if (p.ws_dq != nullptr) {
    const int64_t n4 = min(static_cast<int64_t>(kPreRows), p.rows_q - row0) * p.ws_dq_pitch / 4;
    float4* z = reinterpret_cast<float4*>(p.ws_dq + (static_cast<int64_t>(h) * p.rows_q + row0) * p.ws_dq_pitch);
    for (int64_t i = threadIdx.x; i < n4; i += kPreWarps * 32) z[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const float sink = p.dsinks != nullptr ? p.sinks[h] : 0.f;
  float sink_part = 0.f;  // lane 0's running sum over its rows, in row order
  // D of the warp's rows: every row's loads first (kRows rows in flight), then the reductions.
  float acc[kRows];
  int64_t bs[kRows], poss[kRows];
  uint4 ov[kRows], gv[kRows];
  float lses[kRows];  // lane 0's
  const bool has_chunk = lane * 8 < p.head_dim;  // head_dim <= 256: one 8-element chunk per lane
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + warp * kRows + r;
    bs[r] = poss[r] = 0;
    ov[r] = gv[r] = make_uint4(0u, 0u, 0u, 0u);  // (zero chunks: dot 0)
    lses[r] = 0.f;
    if (row >= p.rows_q) continue;  // warp-uniform
    bwd_detail::ws_row_to_pos(p, row, &bs[r], &poss[r]);
    if (lane == 0) lses[r] = p.lse[bs[r] * p.lse_batch + h * p.lse_head + poss[r] * p.lse_seq];
    if (has_chunk) {
      const T* o = static_cast<const T*>(p.o) + bs[r] * p.o_batch + poss[r] * p.o_seq + h * p.o_head + lane * 8;
      const T* g = static_cast<const T*>(p.dout) + bs[r] * p.do_batch + poss[r] * p.do_seq + h * p.do_head + lane * 8;
      ov[r] = __ldg(reinterpret_cast<const uint4*>(o));
      gv[r] = __ldg(reinterpret_cast<const uint4*>(g));
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = bwd_detail::dot8<T>(gv[r], ov[r]);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + warp * kRows + r;
    if (row >= p.rows_q) break;  // warp-uniform
#pragma unroll
    for (int m = 16; m >= 1; m /= 2) acc[r] += shfl_xor(acc[r], m);  // same tree every run
    if (lane == 0) {
      const float lse = lses[r];
      const int64_t w = static_cast<int64_t>(h) * p.rows_q + row;
      p.ws_lse[w] = lse == kNegInf ? kPosInf : lse * kLog2e;
      p.ws_d[w] = acc[r];
      if (p.dsinks != nullptr && lse != kNegInf) sink_part -= expf(sink - lse) * acc[r];  // sink's P·(0 - D)
    }
  }
  if (p.dsinks != nullptr) {
    __shared__ float part[kPreWarps];
    if (lane == 0) part[warp] = sink_part;
    __syncthreads();
    if (threadIdx.x == 0) {
      float s = 0.f;
      for (int w = 0; w < kPreWarps; ++w) s += part[w];
      p.ws_dsink[static_cast<int64_t>(h) * p.num_pre_blocks + blockIdx.x] = s;
    }
  }
}

// ---- 2. dsinks: one warp per head, fixed-order sum of the partials ------------------------

// (A template like the other kernels, so that the header defines it in every TU without clashes;
// T is unused.)
template <typename T>
__global__ void __launch_bounds__(32) flash_bwd_dsink_kernel(const BwdParams p) {
  const int h = blockIdx.x, lane = threadIdx.x;
  float s = 0.f;
  for (int i = lane; i < p.num_pre_blocks; i += 32) s += p.ws_dsink[static_cast<int64_t>(h) * p.num_pre_blocks + i];
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) s += ptx::shfl_xor(s, m);
  if (lane == 0) p.dsinks[h] = s;
}

// ---- 3. dK, dV (and the atomic dQ partials) ------------------------------------------------

template <class Tr, typename T>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocksPerSm) flash_bwd_dkdv_kernel(const BwdParams p) {
  using namespace ptx;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim;
  constexpr int kRowBytes = Tr::kPitch * 2;
  constexpr int kSRowBytes = Tr::kPitchS * 2;
  constexpr int kQT = kM / 8;             // 8-query tiles of a warp's S^T
  constexpr int kKD = kD / 16;            // k16 steps of K Q^T, V dO^T
  constexpr int kKM = kM / 16;            // k16 steps of P^T dO, dS^T Q
  constexpr int kDT = Tr::kAccCols / 8;   // 8-column tiles of this CTA's dK, dV columns
  constexpr int kKN = kN / 16;            // k16 steps of dS K
  constexpr int kCT = Tr::kDqCols / 8;    // 8-column tiles of a warp's dQ partial

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t sK = smem_u32(smem);              // (kN, pitch)
  const uint32_t sV = sK + kN * kRowBytes;         // (kN, pitch)
  const uint32_t sQ = sV + kN * kRowBytes;         // (2 stages, kM, pitch)
  const uint32_t sdO = sQ + 2 * kM * kRowBytes;    // (2 stages, kM, pitch)
  constexpr int kLseOff = (2 * kN + 4 * kM) * kRowBytes;
  float* sLse = reinterpret_cast<float*>(smem + kLseOff);  // (2 stages, kM) LSE·log2e
  float* sDd = sLse + 2 * kM;                               // (2 stages, kM) D
  constexpr int kDsOff = kLseOff + 4 * kM * 4;
  unsigned char* sdS_ptr = smem + kDsOff;                   // (kN, kM + 8) dS^T, 16-bit
  const uint32_t sdS = smem_u32(sdS_ptr);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // fragment row group / column pair
  const int tile = static_cast<int>(blockIdx.x / Tr::kColSplits);
  const int col0 = static_cast<int>(blockIdx.x % Tr::kColSplits) * Tr::kAccCols;  // this CTA's columns
  const int n_block = tile % p.num_n_blocks;
  const int bh = tile / p.num_n_blocks;
  const int hk = bh % p.heads_kv, b = bh / p.heads_kv;
  const bwd_detail::SeqInfo si = bwd_detail::seq_info(p, b);
  const int sq = si.sq, sk = si.sk, off = sk - sq;
  const int n0 = n_block * kN;
  if (n0 >= sk) return;  // varlen: this sequence has fewer keys
  const int n_end = min(n0 + kN, sk);

  // Query rows that see a key of [n0, n_end): [i_begin, i_end) (the band is monotone in i).
  int i_begin = 0, i_end = sq;
  if (p.window_right >= 0) i_begin = max(0, n0 - off - p.window_right);
  if (p.window_left >= 0) i_end = min(sq, n_end - off + p.window_left);
  const int m_first = i_begin / kM;
  const int n_m = i_end > i_begin ? (i_end + kM - 1) / kM - m_first : 0;
  const int n_iters = n_m * p.group;  // (query head of the group, query block) pairs
  const bool accum_dq = p.ws_dq != nullptr;

  const T* gK = static_cast<const T*>(p.k) + b * p.k_batch + static_cast<int64_t>(si.k_start + n0) * p.k_seq +
                static_cast<int64_t>(hk) * p.k_head;
  const T* gV = static_cast<const T*>(p.v) + b * p.v_batch + static_cast<int64_t>(si.k_start + n0) * p.v_seq +
                static_cast<int64_t>(hk) * p.v_head;

  // Step it = (query head h of the group, query block mb), blocks fastest; stage it % 2.
  auto load_q = [&](bool valid, int h, int mb, int stage) {
    if (valid) {
      // Offsets are rebuilt from opaque values each step: hoisted out of the loop they would hold
      // a dozen 64-bit registers that the dK/dV accumulators need (ptxas spilled them).
      const int m0 = mb * kM;
      const int64_t bo = ptx::opaque(static_cast<int64_t>(b)), row = ptx::opaque(si.q_start + m0);
      flash_detail::load_tile<Tr, kM>(sQ + stage * kM * kRowBytes,
                                      static_cast<const T*>(p.q) + bo * p.q_batch + row * p.q_seq + h * p.q_head,
                                      p.q_seq, sq - m0, p.head_dim, tid);
      flash_detail::load_tile<Tr, kM>(sdO + stage * kM * kRowBytes,
                                      static_cast<const T*>(p.dout) + bo * p.do_batch + row * p.do_seq + h * p.do_head,
                                      p.do_seq, sq - m0, p.head_dim, tid);
      const int tx = threadIdx.x;  // fresh: rematerialised instead of spilled
      if (tx < 2 * kM) {  // LSE (threads [0, kM)) and D ([kM, 2kM)); rows past the end read as 0
        const int r = tx % kM;
        const bool ok = m0 + r < sq;
        const int64_t w = ptx::opaque(static_cast<int64_t>(h) * p.rows_q + si.ws_row0 + m0 + r);
        const float* src = (tx < kM ? p.ws_lse : p.ws_d) + w;
        cp_async_4(smem_u32(smem) + kLseOff + ((tx < kM ? 0 : 2 * kM) + stage * kM + r) * 4, ok ? src : p.ws_lse,
                   ok ? 4 : 0);
      }
    }
    cp_async_commit();
  };

  // Prologue: one group with K, V and step 0's Q, dO, LSE, D.
  flash_detail::load_tile<Tr, kN>(sK, gK, p.k_seq, n_end - n0, p.head_dim, tid);
  flash_detail::load_tile<Tr, kN>(sV, gV, p.v_seq, n_end - n0, p.head_dim, tid);
  load_q(n_iters > 0, hk * p.group, m_first, 0);

  // ldmatrix lane addresses (fragment layouts in ptx.cuh).
  const uint32_t a_lane = (warp * 16 + lane % 16) * kRowBytes + (lane / 16) * 16;  // K/V rows as A
  const uint32_t b_lane = (lane % 8 + (lane / 16) * 8) * kRowBytes + ((lane / 8) % 2) * 16;  // Q/dO rows as B
  const uint32_t bt_lane = (lane % 8 + ((lane / 8) % 2) * 8) * kRowBytes + (lane / 16) * 16;  // ... as B^T

  bwd_detail::ScoreFn score{p, 0.f, off};
  const bool plain = p.softcap == 0.f && p.alibi_slopes == nullptr;
  const int key_row0 = n0 + warp * 16 + g;  // key of the warp's fragment row g

  float acc_dk[kDT][4], acc_dv[kDT][4];  // (16 keys, kAccCols columns from col0) per warp, fp32
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

  int h = hk * p.group, mb = m_first;  // step it's query head and block
  for (int it = 0; it < n_iters; ++it) {
    const int stage = it & 1;
    const int m0 = mb * kM;
    int h_next = h, mb_next = mb + 1;
    if (mb_next == m_first + n_m) mb_next = m_first, ++h_next;
    cp_async_wait<0>();  // this step's tiles (and K, V) landed
    __syncthreads();     // ... for every thread; every warp is done with step it-1's buffers
    load_q(it + 1 < n_iters, h_next, mb_next, stage ^ 1);

    const uint32_t q_st = sQ + stage * kM * kRowBytes, do_st = sdO + stage * kM * kRowBytes;

    // ---- S^T = K Q^T and dP^T = V dO^T: (16 keys, kM queries) per warp ----
    float s[kQT][4], dp[kQT][4];
#pragma unroll
    for (int nt = 0; nt < kQT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk) {
      uint32_t ak[4], av[4];
      ldmatrix_x4(ak, sK + a_lane + kk * 32);
      ldmatrix_x4(av, sV + a_lane + kk * 32);
#pragma unroll
      for (int np = 0; np < kQT / 2; ++np) {
        uint32_t bq[4], bo[4];  // b0,b1 of query tiles 2np and 2np+1
        ldmatrix_x4(bq, q_st + b_lane + np * 16 * kRowBytes + kk * 32);
        mma_m16n8k16<T>(s[2 * np], ak, bq[0], bq[1]);
        mma_m16n8k16<T>(s[2 * np + 1], ak, bq[2], bq[3]);
        ldmatrix_x4(bo, do_st + b_lane + np * 16 * kRowBytes + kk * 32);
        mma_m16n8k16<T>(dp[2 * np], av, bo[0], bo[1]);
        mma_m16n8k16<T>(dp[2 * np + 1], av, bo[2], bo[3]);
      }
    }

    // ---- P^T = exp2(S - LSE), dS^T = P^T (dP^T - D) [softcap chain rule] ----
    // Element (nt, e): key key_row0 + 8(e/2), query m0 + 8nt + 2t + e%2. Three branch-free
    // variants: plain scores without / with the mask, and the general transform with the mask.
    score.slope_log2 = p.alibi_slopes != nullptr ? p.alibi_slopes[h] * kLog2e : 0.f;
    const bool needs_mask = n0 + kN > sk || m0 + kM > sq ||
                            (p.window_right >= 0 && n0 + kN - 1 - m0 - off > p.window_right) ||
                            (p.window_left >= 0 && n0 - (m0 + kM - 1) - off < -p.window_left);
    const float* lse_st = sLse + stage * kM;
    const float* d_st = sDd + stage * kM;
    auto grads = [&](auto plain_tag, auto mask_tag) {
      constexpr bool kPlain = decltype(plain_tag)::value, kMask = decltype(mask_tag)::value;
#pragma unroll
      for (int nt = 0; nt < kQT; ++nt) {
        const float2 lse2 = *reinterpret_cast<const float2*>(lse_st + nt * 8 + 2 * t);
        const float2 dd2 = *reinterpret_cast<const float2*>(d_st + nt * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key_row0 + (e / 2) * 8;
          const int qi = m0 + nt * 8 + 2 * t + (e % 2);
          float chain = 1.f;
          float x = score.apply<kPlain>(s[nt][e], qi, key, &chain);
          if (kMask && !bwd_detail::visible(qi, key, sq, sk, off, p.window_left, p.window_right)) x = kNegInf;
          const float pe = exp2_approx(x - ((e % 2) ? lse2.y : lse2.x));  // +inf LSE (empty row) gives 0
          s[nt][e] = pe;
          dp[nt][e] = pe * (dp[nt][e] - ((e % 2) ? dd2.y : dd2.x));
          if constexpr (!kPlain) dp[nt][e] *= chain;
        }
      }
    };
    if (!plain)
      grads(std::false_type{}, std::true_type{});
    else if (needs_mask)
      grads(std::true_type{}, std::true_type{});
    else
      grads(std::true_type{}, std::false_type{});

    // ---- to 16-bit A fragments: C layout of query tiles (2kk, 2kk+1) = A layout of k16 step kk ----
    uint32_t pf[kKM][4], dsf[kKM][4];
#pragma unroll
    for (int kk = 0; kk < kKM; ++kk) {
      pf[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pf[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pf[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pf[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      dsf[kk][0] = pack2<T>(dp[2 * kk][0], dp[2 * kk][1]);
      dsf[kk][1] = pack2<T>(dp[2 * kk][2], dp[2 * kk][3]);
      dsf[kk][2] = pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      dsf[kk][3] = pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
    }

    // ---- dV += P^T dO, dK += dS^T Q: (16 keys, kAccCols) per warp ----
    const uint32_t col_bytes = col0 * 2;
#pragma unroll
    for (int kk = 0; kk < kKM; ++kk)
#pragma unroll
      for (int dp2 = 0; dp2 < kDT / 2; ++dp2) {
        uint32_t bo[4], bq[4];  // b0,b1 of column tiles 2dp2 and 2dp2+1
        ldmatrix_x4_trans(bo, do_st + bt_lane + col_bytes + kk * 16 * kRowBytes + dp2 * 32);
        mma_m16n8k16<T>(acc_dv[2 * dp2], pf[kk], bo[0], bo[1]);
        mma_m16n8k16<T>(acc_dv[2 * dp2 + 1], pf[kk], bo[2], bo[3]);
        ldmatrix_x4_trans(bq, q_st + bt_lane + col_bytes + kk * 16 * kRowBytes + dp2 * 32);
        mma_m16n8k16<T>(acc_dk[2 * dp2], dsf[kk], bq[0], bq[1]);
        mma_m16n8k16<T>(acc_dk[2 * dp2 + 1], dsf[kk], bq[2], bq[3]);
      }

    if (accum_dq) {
      // ---- dS^T -> smem (kN keys, kM queries); step it-1's readers passed this step's barrier ----
      unsigned char* ds_row = sdS_ptr + (warp * 16 + g) * kSRowBytes + 4 * t;
#pragma unroll
      for (int kk = 0; kk < kKM; ++kk) {
        *reinterpret_cast<uint32_t*>(ds_row + kk * 32) = dsf[kk][0];                        // key g, queries 16kk+2t
        *reinterpret_cast<uint32_t*>(ds_row + 8 * kSRowBytes + kk * 32) = dsf[kk][1];       // key g+8
        *reinterpret_cast<uint32_t*>(ds_row + kk * 32 + 16) = dsf[kk][2];                   // key g, queries +8
        *reinterpret_cast<uint32_t*>(ds_row + 8 * kSRowBytes + kk * 32 + 16) = dsf[kk][3];  // key g+8, queries +8
      }
      __syncthreads();

      // ---- dQ partial = dS K: (32 queries, kDqCols) per warp, A = dS via ldmatrix.trans of dS^T ----
      // Lane addresses from a fresh threadIdx (S2R is rematerialised; kept from the top of the
      // kernel they would be spilled next to the accumulators).
      const int ln = threadIdx.x % 32, wp = threadIdx.x / 32;
      const int dq_wm = wp % Tr::kDqWarpsM, dq_wd = wp / Tr::kDqWarpsM;  // warp's dQ slab
      const uint32_t ds_lane = ((ln / 16) * 8 + ln % 8) * kSRowBytes + ((ln / 8) % 2) * 16;  // dS^T as A^T
      const uint32_t kt_lane = (ln % 8 + ((ln / 8) % 2) * 8) * kRowBytes + (ln / 16) * 16;   // K as B^T
      float acc_dq[2][kCT][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int ct = 0; ct < kCT; ++ct)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dq[mt][ct][e] = 0.f;
      const uint32_t k_col = (col0 + dq_wd * Tr::kDqCols) * 2;
#pragma unroll
      for (int kk = 0; kk < kKN; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
          ldmatrix_x4_trans(a[mt], sdS + ds_lane + kk * 16 * kSRowBytes + (dq_wm * 32 + mt * 16) * 2);
#pragma unroll
        for (int cp = 0; cp < kCT / 2; ++cp) {
          uint32_t bk[4];
          ldmatrix_x4_trans(bk, sK + kt_lane + kk * 16 * kRowBytes + k_col + cp * 32);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma_m16n8k16<T>(acc_dq[mt][2 * cp], a[mt], bk[0], bk[1]);
            mma_m16n8k16<T>(acc_dq[mt][2 * cp + 1], a[mt], bk[2], bk[3]);
          }
        }
      }
      // fp32 atomics into [heads_q, rows_q, kD]; columns past head_dim add zeros (K is zero there).
      // One opaque 64-bit base per step and immediate offsets: hoisted per-row pointers cost the
      // registers that the accumulators need.
      const int r_lane = dq_wm * 32 + ln / 4;  // row of (mt, rh) = r_lane + 16mt + 8rh
      float* gdq = p.ws_dq + ptx::opaque((static_cast<int64_t>(h) * p.rows_q + si.ws_row0 + m0 + r_lane) * kD +
                                         col0 + dq_wd * Tr::kDqCols + 2 * (ln % 4));
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          if (m0 + r_lane + mt * 16 + rh * 8 < sq) {
#pragma unroll
            for (int ct = 0; ct < kCT; ++ct)
              red_add_v2_f32(gdq + (mt * 16 + rh * 8) * kD + ct * 8, acc_dq[mt][ct][2 * rh], acc_dq[mt][ct][2 * rh + 1]);
          }
        }
    }
    h = h_next, mb = mb_next;
  }
  cp_async_wait<0>();

  // ---- epilogue: dK = scale·acc, dV = acc, in the input dtype; every key of the block is written
  // (columns [col0, col0 + kAccCols) by this CTA) ----
  const int64_t bo = ptx::opaque(static_cast<int64_t>(b)), k0 = ptx::opaque(static_cast<int64_t>(si.k_start));
  T* gdk = static_cast<T*>(p.dk) + bo * p.dk_batch + k0 * p.dk_seq + static_cast<int64_t>(hk) * p.dk_head;
  T* gdv = static_cast<T*>(p.dv) + bo * p.dv_batch + k0 * p.dv_seq + static_cast<int64_t>(hk) * p.dv_head;
  // IOATTN_SM80_EPI_VEC (flash_fwd.cuh): 16-byte vectors when this CTA's columns are all real and
  // the rows 16-byte aligned.
  const bool vec = IOATTN_SM80_EPI_VEC && Tr::kAccCols % 32 == 0 && col0 + Tr::kAccCols <= p.head_dim &&
                   vec16_ok<T>(p.dk, p.dk_batch, p.dk_seq, p.dk_head) && vec16_ok<T>(p.dv, p.dv_batch, p.dv_seq, p.dv_head);
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int key = key_row0 + rh * 8;
    if constexpr (IOATTN_SM80_EPI_VEC && Tr::kAccCols % 32 == 0) {
      if (vec) {  // every lane of the warp (shuffles); key < sk masks the stores
        store_acc_row<T, Tr::kAccCols>(gdk + static_cast<int64_t>(key) * p.dk_seq + col0, &acc_dk[0][0], rh, p.scale,
                                       lane, true, key < sk);
        store_acc_row<T, Tr::kAccCols>(gdv + static_cast<int64_t>(key) * p.dv_seq + col0, &acc_dv[0][0], rh, 1.0f, lane,
                                       true, key < sk);
        continue;
      }
    }
    if (key < sk) {
      T* k_row = gdk + static_cast<int64_t>(key) * p.dk_seq + col0 + 2 * t;
      T* v_row = gdv + static_cast<int64_t>(key) * p.dv_seq + col0 + 2 * t;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt)
        if (col0 + dt * 8 < p.head_dim) {
          *reinterpret_cast<uint32_t*>(k_row + dt * 8) =
              pack2<T>(acc_dk[dt][2 * rh] * p.scale, acc_dk[dt][2 * rh + 1] * p.scale);
          *reinterpret_cast<uint32_t*>(v_row + dt * 8) = pack2<T>(acc_dv[dt][2 * rh], acc_dv[dt][2 * rh + 1]);
        }
    }
  }
}

// ---- 4a. dQ = scale · accumulator -> input dtype (default mode) ----------------------------

template <typename T>
__global__ void __launch_bounds__(256) flash_bwd_dq_convert_kernel(const BwdParams p) {
  const int chunks = p.head_dim / 8;  // 8 columns = one 16-byte store
  const int64_t total = static_cast<int64_t>(p.heads_q) * p.rows_q * chunks;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(idx % chunks);
    const int64_t hr = idx / chunks;  // h·rows_q + row
    const int64_t row = hr % p.rows_q;
    const int64_t h = hr / p.rows_q;
    const float4* src = reinterpret_cast<const float4*>(p.ws_dq + hr * p.ws_dq_pitch + c * 8);
    const float4 x = src[0], y = src[1];
    int64_t b, pos;
    bwd_detail::ws_row_to_pos(p, row, &b, &pos);
    T* dst = static_cast<T*>(p.dq) + b * p.dq_batch + pos * p.dq_seq + h * p.dq_head + c * 8;
    const float s = p.scale;
    uint4 out;
    out.x = ptx::pack2<T>(x.x * s, x.y * s);
    out.y = ptx::pack2<T>(x.z * s, x.w * s);
    out.z = ptx::pack2<T>(y.x * s, y.y * s);
    out.w = ptx::pack2<T>(y.z * s, y.w * s);
    *reinterpret_cast<uint4*>(dst) = out;
  }
}

// ---- 4b. dQ by recomputation over key blocks (deterministic mode) ---------------------------

template <class Tr, typename T>
__global__ void __launch_bounds__(Tr::kDqThreads, Tr::kDqMinBlocksPerSm) flash_bwd_dq_kernel(const BwdParams p) {
  using namespace ptx;
  using LoadShape = DqLoadShape<Tr>;
  constexpr int kM = Tr::kDqBlockM, kN = Tr::kDqBlockN, kD = Tr::kHeadDim;
  constexpr int kRowBytes = Tr::kPitch * 2;
  constexpr int kNT = kN / 8;   // 8-key tiles of a warp's S
  constexpr int kKD = kD / 16;  // k16 steps of Q K^T, dO V^T
  constexpr int kKN = kN / 16;  // k16 steps of dS K
  constexpr int kDT = kD / 8;   // 8-column tiles of dQ

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t sQ = smem_u32(smem);           // (kM, pitch)
  const uint32_t sdO = sQ + kM * kRowBytes;     // (kM, pitch)
  const uint32_t sK = sdO + kM * kRowBytes;     // (2 stages, kN, pitch)
  const uint32_t sV = sK + 2 * kN * kRowBytes;  // (2 stages, kN, pitch)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  // Longest query blocks first (causal: the last rows see the most keys).
  const int m_block = p.num_m_blocks - 1 - static_cast<int>(blockIdx.x % p.num_m_blocks);
  const int bh = static_cast<int>(blockIdx.x / p.num_m_blocks);
  const int h = bh % p.heads_q, b = bh / p.heads_q, hk = h / p.group;
  const bwd_detail::SeqInfo si = bwd_detail::seq_info(p, b);
  const int sq = si.sq, sk = si.sk, off = sk - sq;
  const int m0 = m_block * kM;
  if (m0 >= sq) return;
  const int m_end = min(m0 + kM, sq);

  // Key blocks that intersect the band of rows [m0, m_end), visited in ascending order.
  int n_lo = 0, n_hi = sk;
  if (p.window_left >= 0) n_lo = max(0, m0 + off - p.window_left);
  if (p.window_right >= 0) n_hi = min(sk, m_end - 1 + off + p.window_right + 1);
  const int nb_lo = n_lo / kN;
  const int n_blocks = n_hi > n_lo ? (n_hi + kN - 1) / kN - nb_lo : 0;

  const int64_t row = si.q_start + m0;
  const T* gK = static_cast<const T*>(p.k) + b * p.k_batch + static_cast<int64_t>(si.k_start) * p.k_seq +
                static_cast<int64_t>(hk) * p.k_head;
  const T* gV = static_cast<const T*>(p.v) + b * p.v_batch + static_cast<int64_t>(si.k_start) * p.v_seq +
                static_cast<int64_t>(hk) * p.v_head;
  auto load_kv = [&](int it, int stage) {
    if (it < n_blocks) {
      const int n0 = (nb_lo + it) * kN;
      flash_detail::load_tile<LoadShape, kN>(sK + stage * kN * kRowBytes, gK + static_cast<int64_t>(n0) * p.k_seq,
                                             p.k_seq, sk - n0, p.head_dim, tid);
      flash_detail::load_tile<LoadShape, kN>(sV + stage * kN * kRowBytes, gV + static_cast<int64_t>(n0) * p.v_seq,
                                             p.v_seq, sk - n0, p.head_dim, tid);
    }
    cp_async_commit();
  };
  flash_detail::load_tile<LoadShape, kM>(sQ, static_cast<const T*>(p.q) + b * p.q_batch + row * p.q_seq + h * p.q_head,
                                         p.q_seq, m_end - m0, p.head_dim, tid);
  flash_detail::load_tile<LoadShape, kM>(
      sdO, static_cast<const T*>(p.dout) + b * p.do_batch + row * p.do_seq + h * p.do_head, p.do_seq, m_end - m0,
      p.head_dim, tid);
  load_kv(0, 0);

  // LSE·log2e and D of this thread's two rows (g, g+8 of the warp's 16); rows past the end get
  // LSE +inf, so their P is 0.
  const int row_g = m0 + warp * 16 + g;
  float lse_r[2], d_r[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int r = row_g + rh * 8;
    const int64_t w = static_cast<int64_t>(h) * p.rows_q + si.ws_row0 + r;
    lse_r[rh] = r < sq ? p.ws_lse[w] : kPosInf;
    d_r[rh] = r < sq ? p.ws_d[w] : 0.f;
  }

  const bwd_detail::ScoreFn score{p, p.alibi_slopes != nullptr ? p.alibi_slopes[h] * kLog2e : 0.f, off};
  const bool plain = p.softcap == 0.f && p.alibi_slopes == nullptr;

  const uint32_t q_lane = (warp * 16 + lane % 16) * kRowBytes + (lane / 16) * 16;            // Q/dO rows as A
  const uint32_t k_lane = (lane % 8 + (lane / 16) * 8) * kRowBytes + ((lane / 8) % 2) * 16;  // K/V rows as B
  const uint32_t kt_lane = (lane % 8 + ((lane / 8) % 2) * 8) * kRowBytes + (lane / 16) * 16;  // K as B^T

  float acc[kDT][4];  // (16 rows, kD) per warp
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] = 0.f;

  for (int it = 0; it < n_blocks; ++it) {
    const int stage = it & 1;
    const int n0 = (nb_lo + it) * kN;
    cp_async_wait<0>();
    __syncthreads();
    load_kv(it + 1, stage ^ 1);
    const uint32_t k_st = sK + stage * kN * kRowBytes, v_st = sV + stage * kN * kRowBytes;

    // ---- S = Q K^T, dP = dO V^T: (16 rows, kN keys) per warp ----
    float s[kNT][4], dp[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk) {
      uint32_t aq[4], ao[4];
      ldmatrix_x4(aq, sQ + q_lane + kk * 32);
      ldmatrix_x4(ao, sdO + q_lane + kk * 32);
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bk[4], bv[4];
        ldmatrix_x4(bk, k_st + k_lane + np * 16 * kRowBytes + kk * 32);
        mma_m16n8k16<T>(s[2 * np], aq, bk[0], bk[1]);
        mma_m16n8k16<T>(s[2 * np + 1], aq, bk[2], bk[3]);
        ldmatrix_x4(bv, v_st + k_lane + np * 16 * kRowBytes + kk * 32);
        mma_m16n8k16<T>(dp[2 * np], ao, bv[0], bv[1]);
        mma_m16n8k16<T>(dp[2 * np + 1], ao, bv[2], bv[3]);
      }
    }

    // ---- P, dS; element (nt, e): row row_g + 8(e/2), key n0 + 8nt + 2t + e%2 ----
    const bool needs_mask = n0 + kN > sk ||
                            (p.window_right >= 0 && n0 + kN - 1 - m0 - off > p.window_right) ||
                            (p.window_left >= 0 && n0 - (m_end - 1) - off < -p.window_left);
    auto grads = [&](auto plain_tag, auto mask_tag) {
      constexpr bool kPlain = decltype(plain_tag)::value, kMask = decltype(mask_tag)::value;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = row_g + (e / 2) * 8;
          const int key = n0 + nt * 8 + 2 * t + (e % 2);
          float chain = 1.f;
          float x = score.apply<kPlain>(s[nt][e], qi, key, &chain);
          if (kMask && !bwd_detail::visible(qi, key, sq, sk, off, p.window_left, p.window_right)) x = kNegInf;
          const float pe = exp2_approx(x - lse_r[e / 2]);  // rows past the end: LSE +inf, P = 0
          dp[nt][e] = pe * (dp[nt][e] - d_r[e / 2]);
          if constexpr (!kPlain) dp[nt][e] *= chain;
        }
    };
    if (!plain)
      grads(std::false_type{}, std::true_type{});
    else if (needs_mask)
      grads(std::true_type{}, std::true_type{});
    else
      grads(std::true_type{}, std::false_type{});
    uint32_t dsf[kKN][4];
#pragma unroll
    for (int kk = 0; kk < kKN; ++kk) {
      dsf[kk][0] = pack2<T>(dp[2 * kk][0], dp[2 * kk][1]);
      dsf[kk][1] = pack2<T>(dp[2 * kk][2], dp[2 * kk][3]);
      dsf[kk][2] = pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      dsf[kk][3] = pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
    }

    // ---- dQ += dS K: (16 rows, kD) per warp, B = K via ldmatrix.trans ----
#pragma unroll
    for (int kk = 0; kk < kKN; ++kk)
#pragma unroll
      for (int dp2 = 0; dp2 < kDT / 2; ++dp2) {
        uint32_t bk[4];
        ldmatrix_x4_trans(bk, k_st + kt_lane + kk * 16 * kRowBytes + dp2 * 32);
        mma_m16n8k16<T>(acc[2 * dp2], dsf[kk], bk[0], bk[1]);
        mma_m16n8k16<T>(acc[2 * dp2 + 1], dsf[kk], bk[2], bk[3]);
      }
  }
  cp_async_wait<0>();

  // ---- epilogue: dQ = scale·acc in the input dtype; rows with no visible key get 0 ----
  T* gdq = static_cast<T*>(p.dq) + b * p.dq_batch + static_cast<int64_t>(si.q_start) * p.dq_seq +
           static_cast<int64_t>(h) * p.dq_head;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int r = row_g + rh * 8;
    if (r < sq) {
      T* q_row = gdq + static_cast<int64_t>(r) * p.dq_seq + 2 * t;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt)
        if (dt * 8 < p.head_dim)
          *reinterpret_cast<uint32_t*>(q_row + dt * 8) =
              pack2<T>(acc[dt][2 * rh] * p.scale, acc[dt][2 * rh + 1] * p.scale);
    }
  }
}

// What a head-dim translation unit exports to the backward dispatcher.
struct BwdKernelInfo {
  int head_dim, block_m, block_n, warps, dq_block_m, dq_block_n, dq_warps;
  int col_splits;            // CTAs per key block, each with head_dim / col_splits columns
  const char* reason;        // why this tile, written next to the traits
  size_t smem_bytes;         // dK/dV kernel, default mode (with the dS^T buffer)
  size_t smem_bytes_det;     // dK/dV kernel, deterministic mode (no dS^T buffer)
  size_t dq_smem_bytes;      // deterministic dQ kernel
  const void* dkdv_bf16;     // for cudaFuncGetAttributes (image present? registers?)
  const void* dkdv_f16;
  const void* dq_bf16;
  const void* dq_f16;
  // Launches the dK/dV kernel and then, in deterministic mode, the dQ kernel (p.ws_dq null).
  void (*launch)(const BwdParams& p, bool is_bf16, cudaStream_t stream);
  // The wgmma rows' variant for a problem (the name the kernel string carries), nullptr elsewhere.
  const char* (*variant)(int64_t rows);
  // The wgmma rows' query rows per step for a problem where the variant sets it (nullptr, and
  // deterministic mode's dK/dV-only instance: block_m).
  int (*step_rows)(int64_t rows);
  // Whether the default (non-deterministic) mode wants the fp32 dQ workspace (nullptr: yes); a row
  // whose launch runs an atomic-free dQ pass instead says no (the hdim-256 wgmma row's mode pass).
  bool (*wants_dq_workspace)();
  // Whose atomic-free dQ pass the wgmma rows run (deterministic mode, and where
  // wants_dq_workspace says no), for the selector's reason.
  const char* dq_pass_name;
};

}  // namespace ioattn::cuda

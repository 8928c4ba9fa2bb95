// CPU flash backward: dQ, dK, dV (and dsinks) by recomputation, tiled, multithreaded, no atomics.
//
// What it computes (the semantics of include/ioattn/ioattn.hpp): for each visible (i, j)
//   P_ij = exp(s_ij - LSE_i)   (recomputed from Q, K and the forward's LSE; 0 if LSE_i = -inf)
//   dP_ij = dO_i . v_j,  D_i = dO_i . O_i,  dS_ij = P_ij (dP_ij - D_i) [softcap: * (1 - tanh^2)]
//   dQ_i = scale * sum_j dS_ij k_j,  dK_j = scale * sum_i dS_ij q_i,  dV_j = sum_i P_ij dO_i,
// with dK, dV summed over the query heads of a GQA group, and
//   dsinks_h = -sum_{b,i} exp(sink_h - LSE_i) D_i.
//
// Tiling (64 query rows x 64 keys, fp32 tiles in a per-thread workspace):
//   pass 0  D_i for every row (and the dsinks partial sums), O(seqlen) floats per head.
//   pass 1  one task per (batch, kv head, 64-key block): K^T and V^T of the block stay in the
//           workspace; for every query head of the group and every 64-row query block that sees
//           the keys (found by binary search on the mask; other blocks are skipped whole) it
//           recomputes S = (scale Q) K^T, P, dP = dO V^T, dS and accumulates
//           dV += P^T dO, dK += dS^T (scale Q) in fp32, then writes its dK/dV rows once.
//   pass 2  one task per (batch, q head, 64-row query block): (scale Q)^T and dO^T stay in the
//           workspace; for each 64-key block of the rows' visible range it recomputes S^T = K Q^T,
//           P^T, dP^T = V dO^T, dS^T and accumulates dQ += dS K, then writes its dQ rows once.
//   Pass 1 and pass 2 read only inputs and D, so they share one task list.
// Fused (one pass, when there are enough (batch, kv head) pairs for the threads; bwd_mode below):
//   one task per (batch, kv head) walks the key blocks in order, and for each block does pass 1's
//   work and also dQ += dS K into an fp32 dQ of the whole group ([group, seqlen_q, d] per
//   thread), written once at the end: 5 tile GEMMs instead of 7, the same arithmetic order for
//   every output element (dQ sums over keys in ascending order either way, and a key a row cannot
//   see adds an exact 0), so the two modes agree bitwise (tested) unless a masked key holds
//   inf / NaN.
// Split (one pass when the pairs are fewer than the threads, e.g. MQA): each pair's key blocks
//   cut into contiguous ranges of about equal work (query rows that see them), one fused task per
//   range with its own fp32 dQ partial; the partials of a pair are then summed in range order and
//   stored (one owner per dQ row again). dK / dV are the two passes' bits; dQ is summed in a
//   different order, so its bits depend on the range count, which follows the thread count.
// Every output row is written by exactly one task, whose loops run in a fixed order, so the
// result is bitwise reproducible run to run; in the fused and two-pass modes also for any thread
// count and schedule on a given machine (SIMD target). Context::deterministic only rules out the
// split. No atomics, no seqlen_q x seqlen_k buffer: extra memory is the per-thread workspace
// (O(tile x head_dim)) plus D (O(seqlen)), and in the fused mode the per-thread fp32 dQ of one
// group (O(seqlen)), in the split mode an fp32 dQ per range (both capped at 256 MiB).
// Pass 2 recomputes S and dP once more than a single-pass kernel with atomic dQ would (7 tile
// GEMMs instead of 5); that is the price of thread-count-independent bits where the pairs are few.
//
// SIMD: Highway with foreach_target dynamic dispatch (one binary, best ISA at run time; the
// same targets as the forward, and IOATTN_CPU_TARGET caps the choice the same way). The
// only kernels are a register-blocked C (+)= A B (8 or 4 rows x 2 vectors, A read with
// arbitrary strides so transposed operands need no copy), the softmax-gradient step on a tile with
// vector exp/tanh from hwy/contrib/math, and row loads that widen f16/bf16 to fp32.
// Varlen rows past cu_seqlens[batch] belong to no sequence and are not written (as for the
// forward's O). Assumes sequence lengths fit in int32 (key indices are compared as int32 lanes).
// Not guaranteed: a NaN/Inf stored in a key that the mask hides from some rows of a tile can
// still reach those rows' dQ through 0 * NaN in dS K (the forward guards its P V; the backward
// only guarantees that masked scores never produce NaN in P or dS).
//
// History
//   1. Two-pass recomputation (dK/dV over key blocks, dQ over query blocks), fp32 tiles,
//      transposed Q/dO tiles in pass 2 so no per-block transposes are needed; 4x2 register
//      block (~90 GFLOP/s of executed FMAs per AVX-512 core at hdim 128, ~55% of its FMA peak).
//   2. 8x2 register block on AVX-512 (16 accumulators), 4-row groups for the one-vector column
//      tail (hdim 80): hdim 64 ~1.4x faster, hdim 128 about the same.
//   3. Fused single pass per (batch, kv head) when the pairs fill the threads (session 26: PyTorch's
//      CPU SDPA backward, one (batch, head) per thread, ran 1.2-1.4x ours at f32; docs/PERF.md).
//   4. Split single pass when the pairs are fewer than the threads (session 27: MQA on 2 threads
//      1.12-1.5x the two passes; docs/PERF.md).
#ifndef IOATTN_CPU_BACKWARD_SHARED
#define IOATTN_CPU_BACKWARD_SHARED

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "cpu/flash_amx.hpp"

// The same Highway targets as the forward (src/cpu/flash_cpu.cpp): SSSE3 is not compiled.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS HWY_SSSE3
#endif
#include "hwy/aligned_allocator.h"

namespace ioattn::detail::bwd {

// Tile shape: 64 query rows x 64 keys for every head_dim. 64 is a multiple of every Highway
// target's fp32 lane count (up to 2048-bit SVE), so tile rows are whole vectors; the fp32
// workspace is ~(6 * 64 * head_dim + 3 * 64 * 64) floats, 256 KiB at head_dim 128 (L2-sized).
// Tuning these should not affect results beyond rounding, only speed.
constexpr int64_t kTileQ = 64;
constexpr int64_t kTileK = 64;
constexpr int64_t kAlignFloats = 16;  // 64-byte alignment of each workspace region

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Per-thread scratch, carved out of one aligned allocation. Pass 1 / pass 2 layouts:
//   kbuf (d, kTileK) K^T      | (kTileK, d) K rows
//   vbuf (dv, kTileK) V^T     | (kTileK, dv) V rows
//   qbuf (kTileQ, d) scale Q  | (d, kTileQ) (scale Q)^T
//   obuf (kTileQ, dv) dO      | (dv, kTileQ) dO^T
//   s, dp, th (64, 64)        S -> P, dP -> dS, tanh (softcap); pass 2 holds their transposes
//   acc1 (kTileK, d) dK       | (kTileQ, d) dQ
//   acc2 (kTileK, dv) dV      | unused
//   krow (kTileK, d) K rows   | unused (the fused pass's dS K operand)
//   row  (max(d, dv))         conversion scratch
struct Workspace {
  float *kbuf, *vbuf, *qbuf, *obuf, *s, *dp, *th, *acc1, *acc2, *krow, *row;
};

inline int64_t workspace_floats(int64_t d, int64_t dv) {
  const int64_t t = std::max(kTileQ, kTileK);
  return 7 * round_up(t * std::max(d, dv), kAlignFloats) + 3 * t * t + round_up(std::max(d, dv), kAlignFloats) +
         kAlignFloats;
}

inline Workspace carve(float* base, int64_t d, int64_t dv) {
  const int64_t t = std::max(kTileQ, kTileK);
  const int64_t big = round_up(t * std::max(d, dv), kAlignFloats);
  Workspace w;
  float* p = base;
  auto take = [&](int64_t n) {
    float* r = p;
    p += n;
    return r;
  };
  w.kbuf = take(big);
  w.vbuf = take(big);
  w.qbuf = take(big);
  w.obuf = take(big);
  w.s = take(t * t);
  w.dp = take(t * t);
  w.th = take(t * t);
  w.acc1 = take(big);
  w.acc2 = take(big);
  w.krow = take(big);
  w.row = take(round_up(std::max(d, dv), kAlignFloats));
  return w;
}

struct SeqRange {
  int64_t q_start, q_len, k_start, k_len;
};

inline SeqRange seq_range(const FwdProblem& p, int64_t b) {
  if (!p.varlen()) return {0, p.seqlen_q, 0, p.seqlen_k};
  return {p.cu_seqlens_q_host[b], p.cu_seqlens_q_host[b + 1] - p.cu_seqlens_q_host[b], p.cu_seqlens_k_host[b],
          p.cu_seqlens_k_host[b + 1] - p.cu_seqlens_k_host[b]};
}

// First i in [0, n) with pred(i) true, for a predicate that is monotone (false ... true).
template <class Pred>
int64_t first_true(int64_t n, Pred pred) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (pred(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// Query rows [*i_begin, *i_end) of a sequence that see at least one of keys [c0, c0 + nc). The
// visible range's ends hi_i and lo_i are non-decreasing in i, and a row with hi_i > c0 and
// lo_i < c0 + nc sees a key of the block.
inline void rows_seeing(const FwdProblem& p, int64_t sq, int64_t sk, int64_t c0, int64_t nc, int64_t* i_begin,
                        int64_t* i_end) {
  auto range = [&](int64_t i, int64_t* lo, int64_t* hi) { visible_keys(i, sq, sk, p.window_left, p.window_right, lo, hi); };
  *i_begin = first_true(sq, [&](int64_t i) { int64_t lo, hi; range(i, &lo, &hi); return hi > c0; });
  *i_end = first_true(sq, [&](int64_t i) { int64_t lo, hi; range(i, &lo, &hi); return lo >= c0 + nc; });
}

// How the backward runs (bwd_mode below):
//   two_pass  pass 1 (dK, dV over key blocks) and pass 2 (dQ over query blocks), 7 tile products;
//   fused     one task per (batch, kv head), dQ of the group accumulated with dK / dV (5 products)
//             in a per-thread fp32 buffer; the same bits as two_pass;
//   split     fused, with each (batch, kv head)'s keys cut into `chunks` contiguous ranges of about
//             equal work, one task each, every task accumulating its own fp32 dQ partial; the
//             partials are summed afterwards in chunk order. Run to run reproducible, but the
//             chunk count follows the thread count, so the dQ bits do too (Context::deterministic
//             never takes it).
struct BwdMode {
  enum Kind { two_pass, fused, split } kind = two_pass;
  int64_t dq_floats = 0;  // fused: the per-thread fp32 dQ of one group, [group, longest seqlen_q, d]
  int64_t chunks = 1;     // split: key ranges per (batch, kv head) (fewer where a sequence has fewer blocks)
  bool amx = false;       // the single pass's products on AMX-BF16 (KVTask)
  std::string why;
};

struct Plan {
  const BwdProblem* bp = nullptr;
  const float* D = nullptr;  // [heads_q, d_rows]: dO_i . O_i
  int64_t d_rows = 0;        // batch * seqlen_q, or the packed query count for varlen
  bool amx = false;          // BwdMode::amx
};

// pass 1 (kv = true): key block starting at `start` of kv head `head`;
// pass 2 (kv = false): query block starting at `start` of query head `head`;
// fused (fused = true): key blocks [start, end) of kv head `head`, dQ of its group too, into dq
// (the split mode's own partial, [group, seqlen_q, d], left for the reduction) or, with dq null,
// into the thread's buffer and stored.
struct Task {
  int64_t b, head, start;
  bool kv;
  bool fused = false;
  int64_t end = 0;
  float* dq = nullptr;
};

}  // namespace ioattn::detail::bwd
#endif  // IOATTN_CPU_BACKWARD_SHARED

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/backward_cpu.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

HWY_BEFORE_NAMESPACE();
namespace ioattn::detail::bwd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

// Rows of C per register block: 8 x 2 vectors = 16 accumulators where there are 32 vector
// registers (AVX-512), 4 x 2 = 8 elsewhere (AVX2/SSE have 16). Either covers the FMA latency x
// throughput (4 cycles x 2 ports); the larger block halves the B loads per FMA.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr size_t kBlockRows = 8;
#else
constexpr size_t kBlockRows = 4;
#endif

// C rows [0, R) x columns [n, n + 2L) (+)= A B over all K: the register-blocked inner kernel.
template <bool kAccumulate, size_t R>
HWY_INLINE void MatMulBlock(size_t K, const float* HWY_RESTRICT a, size_t sam, size_t sak, const float* HWY_RESTRICT b,
                            size_t ldb, float* HWY_RESTRICT c, size_t ldc, size_t n) {
  static_assert(R == 4 || R == 8, "4 or 8 rows");
  const DF df;
  const size_t L = hn::Lanes(df);
  using V = hn::Vec<DF>;
  auto init = [&](size_t r, size_t v) {
    return kAccumulate && r < R ? hn::LoadU(df, c + r * ldc + n + v * L) : hn::Zero(df);
  };
  V x00 = init(0, 0), x01 = init(0, 1), x10 = init(1, 0), x11 = init(1, 1);
  V x20 = init(2, 0), x21 = init(2, 1), x30 = init(3, 0), x31 = init(3, 1);
  V x40 = init(4, 0), x41 = init(4, 1), x50 = init(5, 0), x51 = init(5, 1);
  V x60 = init(6, 0), x61 = init(6, 1), x70 = init(7, 0), x71 = init(7, 1);
  for (size_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb + n;
    const V b0 = hn::LoadU(df, bk), b1 = hn::LoadU(df, bk + L);
    const float* ak = a + k * sak;
    auto step = [&](size_t r, V& u0, V& u1) {
      const V av = hn::Set(df, ak[r * sam]);
      u0 = hn::MulAdd(av, b0, u0);
      u1 = hn::MulAdd(av, b1, u1);
    };
    step(0, x00, x01);
    step(1, x10, x11);
    step(2, x20, x21);
    step(3, x30, x31);
    if constexpr (R == 8) {
      step(4, x40, x41);
      step(5, x50, x51);
      step(6, x60, x61);
      step(7, x70, x71);
    }
  }
  auto store = [&](size_t r, V u0, V u1) {
    hn::StoreU(u0, df, c + r * ldc + n);
    hn::StoreU(u1, df, c + r * ldc + n + L);
  };
  store(0, x00, x01);
  store(1, x10, x11);
  store(2, x20, x21);
  store(3, x30, x31);
  if constexpr (R == 8) {
    store(4, x40, x41);
    store(5, x50, x51);
    store(6, x60, x61);
    store(7, x70, x71);
  }
}

// C (M, N) = [C +] A B with A(m, k) = a[m * sam + k * sak] (so A^T is A with the strides
// swapped) and B (K, N) row-major with row stride ldb. Blocks of kBlockRows rows x 2 vectors of
// C stay in registers across the whole K loop; leftover rows and columns take narrower paths.
template <bool kAccumulate>
HWY_INLINE void MatMul(size_t M, size_t N, size_t K, const float* HWY_RESTRICT a, size_t sam, size_t sak,
                       const float* HWY_RESTRICT b, size_t ldb, float* HWY_RESTRICT c, size_t ldc) {
  const DF df;
  const size_t L = hn::Lanes(df);
  auto init = [&](const float* p) { return kAccumulate ? hn::LoadU(df, p) : hn::Zero(df); };
  size_t m = 0;
  for (; m + kBlockRows <= M; m += kBlockRows)
    for (size_t n = 0; n + 2 * L <= N; n += 2 * L)
      MatMulBlock<kAccumulate, kBlockRows>(K, a + m * sam, sam, sak, b, ldb, c + m * ldc, ldc, n);
  if (kBlockRows == 8 && m + 4 <= M) {
    for (size_t n = 0; n + 2 * L <= N; n += 2 * L)
      MatMulBlock<kAccumulate, 4>(K, a + m * sam, sam, sak, b, ldb, c + m * ldc, ldc, n);
    m += 4;
  }
  const size_t n_blocked = N / (2 * L) * (2 * L);
  // Rows past the blocks, all 2-vector column blocks.
  for (; m < M; ++m) {
    const float* a0 = a + m * sam;
    float* c0 = c + m * ldc;
    for (size_t n = 0; n < n_blocked; n += 2 * L) {
      auto x0 = init(c0 + n), x1 = init(c0 + n + L);
      for (size_t k = 0; k < K; ++k) {
        const auto av = hn::Set(df, a0[k * sak]);
        x0 = hn::MulAdd(av, hn::LoadU(df, b + k * ldb + n), x0);
        x1 = hn::MulAdd(av, hn::LoadU(df, b + k * ldb + n + L), x1);
      }
      hn::StoreU(x0, df, c0 + n), hn::StoreU(x1, df, c0 + n + L);
    }
  }
  if (n_blocked == N) return;
  // Columns past the 2-vector blocks (e.g. head_dim 80 = 64 + 16 on AVX-512): one vector in
  // 4-row groups (4 independent FMA chains), then scalars.
  size_t n = n_blocked;
  for (; n + L <= N; n += L) {
    m = 0;
    for (; m + 4 <= M; m += 4) {
      const float* a0 = a + m * sam;
      float* c0 = c + m * ldc;
      auto x0 = init(c0 + n), x1 = init(c0 + ldc + n), x2 = init(c0 + 2 * ldc + n), x3 = init(c0 + 3 * ldc + n);
      for (size_t k = 0; k < K; ++k) {
        const auto bv = hn::LoadU(df, b + k * ldb + n);
        const float* ak = a0 + k * sak;
        x0 = hn::MulAdd(hn::Set(df, ak[0]), bv, x0);
        x1 = hn::MulAdd(hn::Set(df, ak[sam]), bv, x1);
        x2 = hn::MulAdd(hn::Set(df, ak[2 * sam]), bv, x2);
        x3 = hn::MulAdd(hn::Set(df, ak[3 * sam]), bv, x3);
      }
      hn::StoreU(x0, df, c0 + n), hn::StoreU(x1, df, c0 + ldc + n);
      hn::StoreU(x2, df, c0 + 2 * ldc + n), hn::StoreU(x3, df, c0 + 3 * ldc + n);
    }
    for (; m < M; ++m) {
      const float* a0 = a + m * sam;
      float* c0 = c + m * ldc;
      auto x0 = init(c0 + n);
      for (size_t k = 0; k < K; ++k) x0 = hn::MulAdd(hn::Set(df, a0[k * sak]), hn::LoadU(df, b + k * ldb + n), x0);
      hn::StoreU(x0, df, c0 + n);
    }
  }
  // Fewer than one vector of columns left (small head_dim). std::fma, not `x0 += a * b`: whether
  // the compiler contracts that into an FMA depends on the inlined context, and the fused and
  // two-pass backward must round dS K alike.
  for (; n < N; ++n)
    for (m = 0; m < M; ++m) {
      const float* a0 = a + m * sam;
      float* c0 = c + m * ldc;
      float x0 = kAccumulate ? c0[n] : 0.0f;
      for (size_t k = 0; k < K; ++k) x0 = std::fma(a0[k * sak], b[k * ldb + n], x0);
      c0[n] = x0;
    }
}

// dst[0, n) = mul * (row of the input dtype at base + off), widened to fp32.
HWY_INLINE void LoadRow(const void* base, DType t, int64_t off, size_t n, float mul, float* HWY_RESTRICT dst) {
  const DF df;
  const size_t L = hn::Lanes(df);
  const auto vm = hn::Set(df, mul);
  size_t x = 0;
  if (t == DType::f32) {
    const float* src = static_cast<const float*>(base) + off;
    for (; x + L <= n; x += L) hn::StoreU(hn::Mul(hn::LoadU(df, src + x), vm), df, dst + x);
  } else if (t == DType::bf16) {
    const hn::Rebind<hwy::bfloat16_t, DF> dh;
    const auto* src = static_cast<const hwy::bfloat16_t*>(base) + off;
    for (; x + L <= n; x += L) hn::StoreU(hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, src + x)), vm), df, dst + x);
  } else {
    const hn::Rebind<hwy::float16_t, DF> dh;
    const auto* src = static_cast<const hwy::float16_t*>(base) + off;
    for (; x + L <= n; x += L) hn::StoreU(hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, src + x)), vm), df, dst + x);
  }
  for (; x < n; ++x) dst[x] = load_float(base, t, off + static_cast<int64_t>(x)) * mul;
}

// Row of the output dtype at base + off = mul * src[0, n) (round to nearest even, as half.hpp).
HWY_INLINE void StoreRow(void* base, DType t, int64_t off, size_t n, const float* src, float mul) {
  if (t == DType::f32) {
    float* dst = static_cast<float*>(base) + off;
    for (size_t x = 0; x < n; ++x) dst[x] = src[x] * mul;
    return;
  }
  for (size_t x = 0; x < n; ++x) store_float(base, t, off + static_cast<int64_t>(x), src[x] * mul);
}

// Per query row of a tile: the visible key range [lo, hi) (absolute key indices; lo = hi = 0 for
// a row that attends to nothing, including LSE = -inf), LSE and D. Entries past the tile's rows
// are empty, so vector lanes past them are masked off.
struct RowInfo {
  HWY_ALIGN float lse[kTileQ];
  HWY_ALIGN float dd[kTileQ];
  HWY_ALIGN int32_t lo[kTileQ];
  HWY_ALIGN int32_t hi[kTileQ];
};

void FillRowInfo(const Plan& pl, const SeqRange& sr, int64_t b, int64_t h, int64_t r0, int64_t nr, RowInfo* ri) {
  const FwdProblem& p = pl.bp->f;
  const int64_t drow0 = h * pl.d_rows + (p.varlen() ? sr.q_start : b * p.seqlen_q);
  for (int64_t r = 0; r < kTileQ; ++r) {
    ri->lse[r] = 0.0f;
    ri->dd[r] = 0.0f;
    ri->lo[r] = ri->hi[r] = 0;
    if (r >= nr) continue;
    const int64_t i = r0 + r;
    int64_t lo, hi;
    visible_keys(i, sr.q_len, sr.k_len, p.window_left, p.window_right, &lo, &hi);
    const float lse = p.lse[b * p.lse_stride.batch + h * p.lse_stride.head + (sr.q_start + i) * p.lse_stride.seq];
    if (hi <= lo || lse == neg_inf()) continue;  // nothing visible: P = dS = 0 on the whole row
    ri->lse[r] = lse;
    ri->dd[r] = pl.D[drow0 + i];
    ri->lo[r] = static_cast<int32_t>(lo);
    ri->hi[r] = static_cast<int32_t>(hi);
  }
}

// Softcap, ALiBi, mask, P = exp(s - LSE) and dS = P (dP - D) [* (1 - tanh^2)] on one vector of
// scores. `vis` masks lanes to keys the row may see; `dist` = |i + off - j| for ALiBi.
struct ScoreParams {
  float cap, inv_cap, slope;
  bool softcap, alibi;
};

template <class M, class V, class VI>
HWY_INLINE void GradStep(const ScoreParams& sp, M vis, V s, V dp, V lse, V dd, VI dist, V* p_out, V* ds_out) {
  const DF df;
  V th = hn::Zero(df);
  if (sp.softcap) {
    th = hn::Tanh(df, hn::Mul(s, hn::Set(df, sp.inv_cap)));
    s = hn::Mul(th, hn::Set(df, sp.cap));
  }
  if (sp.alibi) s = hn::NegMulAdd(hn::Set(df, sp.slope), hn::ConvertTo(df, dist), s);
  // Lanes outside the mask may hold anything (stale tile data, NaN keys): select, never multiply.
  const V p = hn::IfThenElseZero(vis, hn::Exp(df, hn::Sub(s, lse)));
  V ds = hn::Mul(p, hn::Sub(dp, dd));
  if (sp.softcap) ds = hn::Mul(ds, hn::NegMulAdd(th, th, hn::Set(df, 1.0f)));
  *p_out = p;
  *ds_out = hn::IfThenElseZero(vis, ds);
}

ScoreParams score_params(const FwdProblem& p, int64_t h) {
  ScoreParams sp;
  sp.softcap = p.softcap > 0.0f;
  sp.cap = p.softcap;
  sp.inv_cap = sp.softcap ? 1.0f / p.softcap : 0.0f;
  sp.alibi = p.alibi_slopes != nullptr;
  sp.slope = sp.alibi ? p.alibi_slopes[h] : 0.0f;
  return sp;
}

// Pass 1 tile, row-major: s (nr, kTileK) holds S for query rows r0.. and keys c0..; on return
// s holds P and dp (dP on entry) holds dS. Columns up to ncv (a whole number of vectors).
void GradsRowMajor(const ScoreParams& sp, const RowInfo& ri, int64_t nr, int64_t ncv, int64_t r0, int64_t c0,
                   int64_t off, float* s, float* dp) {
  const DF df;
  const DI di;
  const size_t L = hn::Lanes(df);
  for (int64_t r = 0; r < nr; ++r) {
    float* srow = s + r * kTileK;
    float* dprow = dp + r * kTileK;
    const int32_t cl = ri.lo[r] - static_cast<int32_t>(c0), ch = ri.hi[r] - static_cast<int32_t>(c0);
    if (ri.lo[r] >= ri.hi[r] || ch <= 0 || cl >= ncv) {
      std::fill(srow, srow + ncv, 0.0f);
      std::fill(dprow, dprow + ncv, 0.0f);
      continue;
    }
    const auto lse = hn::Set(df, ri.lse[r]), dd = hn::Set(df, ri.dd[r]);
    const auto clm1 = hn::Set(di, cl - 1), chv = hn::Set(di, ch);
    const auto diag = hn::Set(di, static_cast<int32_t>(r0 + r + off - c0));
    for (int64_t c = 0; c < ncv; c += static_cast<int64_t>(L)) {
      const auto ci = hn::Iota(di, static_cast<int32_t>(c));
      const auto vis = hn::RebindMask(df, hn::And(hn::Lt(clm1, ci), hn::Lt(ci, chv)));
      hn::Vec<DF> pv, dsv;
      GradStep(sp, vis, hn::LoadU(df, srow + c), hn::LoadU(df, dprow + c), lse, dd, hn::Abs(hn::Sub(diag, ci)), &pv,
               &dsv);
      hn::StoreU(pv, df, srow + c);
      hn::StoreU(dsv, df, dprow + c);
    }
  }
}

// Pass 2 tile, transposed: s (nc, kTileQ) holds S^T for keys c0.. and query rows r0..; on return
// s holds P^T and dp holds dS^T. Rows (queries) up to nrv (a whole number of vectors).
void GradsTransposed(const ScoreParams& sp, const RowInfo& ri, int64_t nc, int64_t nrv, int64_t r0, int64_t c0,
                     int64_t off, float* s, float* dp) {
  const DF df;
  const DI di;
  const size_t L = hn::Lanes(df);
  for (int64_t c = 0; c < nc; ++c) {
    float* srow = s + c * kTileQ;
    float* dprow = dp + c * kTileQ;
    const int32_t j = static_cast<int32_t>(c0 + c);
    const auto jv = hn::Set(di, j), jp1 = hn::Set(di, j + 1);
    for (int64_t r = 0; r < nrv; r += static_cast<int64_t>(L)) {
      // lo_r <= j < hi_r
      const auto vis = hn::RebindMask(df, hn::And(hn::Lt(hn::LoadU(di, ri.lo + r), jp1), hn::Lt(jv, hn::LoadU(di, ri.hi + r))));
      const auto dist = hn::Abs(hn::Add(hn::Iota(di, static_cast<int32_t>(r)), hn::Set(di, static_cast<int32_t>(r0 + off - j))));
      hn::Vec<DF> pv, dsv;
      GradStep(sp, vis, hn::LoadU(df, srow + r), hn::LoadU(df, dprow + r), hn::LoadU(df, ri.lse + r),
               hn::LoadU(df, ri.dd + r), dist, &pv, &dsv);
      hn::StoreU(pv, df, srow + r);
      hn::StoreU(dsv, df, dprow + r);
    }
  }
}

// Pass 1: dK, dV of keys [c0, c0 + nc) of kv head hk. With dq (the fused pass) also
// dq[(h - hk * group) * sq + i] += dS K for the rows the block's keys reach (unscaled, fp32).
// The tile products by AMX-BF16 (flash_amx.hpp) on the AVX-512 targets, for bf16 inputs with head
// dims that are multiples of 16 (<= 512), where the CPU has AMX-BF16: Q, K, V and dO exact in bf16,
// P and dS rounded to bf16 as the GPU kernels do; scale applied to S and to dK / dQ after the
// products instead of to Q before. Every mode (the two passes too: each output element's products
// and sums do not depend on the thread count, so Context::deterministic keeps its guarantee; the
// fused and the two-pass modes then differ in rounding, as their key blocks cut the sums
// differently, where on the fp32 products they agree bitwise).
constexpr bool kAmxTarget = IOATTN_FLASH_AMX_HWY_TARGET;

bool UsesAmx(const FwdProblem& p) {
#if IOATTN_HAVE_FLASH_AMX
  return kAmxTarget && (p.dtype == DType::bf16 || p.dtype == DType::f16) && p.head_dim % 16 == 0 &&
         p.head_dim_v % 16 == 0 &&
         p.head_dim <= 512 && p.head_dim_v <= 512 && flash::flash_amx_usable();
#else
  (void)p;
  return false;
#endif
}

// The passes' tile products: C (M, N) = [C +] alpha A B, by the AMX products (B packed in slot >= 0
// (KVTask: K^T 0, V^T 1, K 2; QTask: Q^T 0, dO^T 1), or from bm; f16 split into two bf16 parts,
// flash_amx.hpp) or by MatMul (alpha 1 there).
struct Products {
  bool amx, split;
  Products(const Plan& pl, const FwdProblem& p) : amx(pl.amx), split(pl.amx && p.dtype == DType::f16) {}
  void operator()(bool acc, size_t M, size_t N, size_t K, const float* a, size_t sam, size_t sak, const float* bm,
                  size_t ldb, float* c, size_t ldc, float alpha, int slot) const {
#if IOATTN_HAVE_FLASH_AMX
    if (amx) return flash::flash_amx_matmul(M, N, K, a, sam, sak, bm, ldb, c, ldc, acc, alpha, slot, split);
#endif
    (void)alpha, (void)slot;
    acc ? MatMul<true>(M, N, K, a, sam, sak, bm, ldb, c, ldc) : MatMul<false>(M, N, K, a, sam, sak, bm, ldb, c, ldc);
  }
};

void KVTask(const Plan& pl, const Task& task, const Workspace& w, float* dq = nullptr) {
  const BwdProblem& bp = *pl.bp;
  const FwdProblem& p = bp.f;
  const Products mm(pl, p);
  [[maybe_unused]] const bool amx = mm.amx, split = mm.split;
#if IOATTN_HAVE_FLASH_AMX
  if (amx) flash::flash_amx_begin();
#endif
  const float qmul = amx ? 1.0f : p.scale, smul = amx ? p.scale : 1.0f;
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const int64_t b = task.b, hk = task.head, c0 = task.start, d = p.head_dim, dv = p.head_dim_v;
  const DType t = p.dtype;
  const SeqRange sr = seq_range(p, b);
  const int64_t sq = sr.q_len, sk = sr.k_len, off = sk - sq;
  const int64_t nc = std::min(kTileK, sk - c0), ncv = round_up(nc, L);

  // K^T (d, kTileK) and V^T (dv, kTileK); columns past nc are zero.
  std::fill(w.kbuf, w.kbuf + d * kTileK, 0.0f);
  std::fill(w.vbuf, w.vbuf + dv * kTileK, 0.0f);
  for (int64_t j = 0; j < nc; ++j) {
    const int64_t key = sr.k_start + c0 + j;
    float* krow = dq ? w.krow + j * d : w.row;  // (the fused pass keeps the K rows for dS K)
    LoadRow(p.k, t, b * p.k_stride.batch + key * p.k_stride.seq + hk * p.k_stride.head, d, 1.0f, krow);
    for (int64_t x = 0; x < d; ++x) w.kbuf[x * kTileK + j] = krow[x];
    LoadRow(p.v, t, b * p.v_stride.batch + key * p.v_stride.seq + hk * p.v_stride.head, dv, 1.0f, w.row);
    for (int64_t x = 0; x < dv; ++x) w.vbuf[x * kTileK + j] = w.row[x];
  }
#if IOATTN_HAVE_FLASH_AMX
  if (amx) {  // the block's K^T, V^T and K, packed once for all its products
    flash::flash_amx_pack_b(0, static_cast<size_t>(ncv), static_cast<size_t>(d), w.kbuf, kTileK, split);
    flash::flash_amx_pack_b(1, static_cast<size_t>(ncv), static_cast<size_t>(dv), w.vbuf, kTileK, split);
    if (dq)
      flash::flash_amx_pack_b(2, static_cast<size_t>(d), static_cast<size_t>(nc), w.krow, static_cast<size_t>(d), split);
  }
#endif
  std::fill(w.acc1, w.acc1 + nc * d, 0.0f);   // dK (nc, d)
  std::fill(w.acc2, w.acc2 + nc * dv, 0.0f);  // dV (nc, dv)

  int64_t i_begin, i_end;  // the query rows that see at least one key of the block
  rows_seeing(p, sq, sk, c0, nc, &i_begin, &i_end);

  RowInfo ri;
  for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
    const ScoreParams sp = score_params(p, h);
    for (int64_t r0 = i_begin; r0 < i_end; r0 += kTileQ) {
      const int64_t nr = std::min(kTileQ, i_end - r0);
      FillRowInfo(pl, sr, b, h, r0, nr, &ri);
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t row = sr.q_start + r0 + r;
        LoadRow(p.q, t, b * p.q_stride.batch + row * p.q_stride.seq + h * p.q_stride.head, d, qmul, w.qbuf + r * d);
        LoadRow(bp.dout, t, b * bp.dout_stride.batch + row * bp.dout_stride.seq + h * bp.dout_stride.head, dv, 1.0f,
                w.obuf + r * dv);
      }
      mm(false, nr, ncv, d, w.qbuf, d, 1, w.kbuf, kTileK, w.s, kTileK, smul, 0);   // S  (nr, ncv) = (scale Q) K^T
      mm(false, nr, ncv, dv, w.obuf, dv, 1, w.vbuf, kTileK, w.dp, kTileK, 1.0f, 1);  // dP (nr, ncv) = dO V^T
      GradsRowMajor(sp, ri, nr, ncv, r0, c0, off, w.s, w.dp);                      // s = P, dp = dS
      mm(true, nc, dv, nr, w.s, 1, kTileK, w.obuf, dv, w.acc2, dv, 1.0f, -1);      // dV (nc, dv) += P^T dO
      mm(true, nc, d, nr, w.dp, 1, kTileK, w.qbuf, d, w.acc1, d, 1.0f, -1);        // dK (nc, d) += dS^T (scale Q)
      if (dq)                                                                       // dQ (nr, d) += dS K
        mm(true, nr, d, nc, w.dp, kTileK, 1, w.krow, d, dq + ((h - hk * p.group()) * sq + r0) * d, d, 1.0f, 2);
    }
  }
#if IOATTN_HAVE_FLASH_AMX
  if (amx) flash::flash_amx_end();
#endif
  for (int64_t j = 0; j < nc; ++j) {
    const int64_t key = sr.k_start + c0 + j;
    StoreRow(bp.dk, t, b * bp.dk_stride.batch + key * bp.dk_stride.seq + hk * bp.dk_stride.head, d, w.acc1 + j * d, smul);
    StoreRow(bp.dv, t, b * bp.dv_stride.batch + key * bp.dv_stride.seq + hk * bp.dv_stride.head, dv, w.acc2 + j * dv,
             1.0f);
  }
}

// Pass 2: dQ of query rows [r0, r0 + nr) of query head h.
void QTask(const Plan& pl, const Task& task, const Workspace& w) {
  const BwdProblem& bp = *pl.bp;
  const FwdProblem& p = bp.f;
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const int64_t b = task.b, h = task.head, r0 = task.start, d = p.head_dim, dv = p.head_dim_v;
  const int64_t hk = h / p.group();
  const DType t = p.dtype;
  const SeqRange sr = seq_range(p, b);
  const int64_t sq = sr.q_len, sk = sr.k_len, off = sk - sq;
  const int64_t nr = std::min(kTileQ, sq - r0), nrv = round_up(nr, L);

  const Products mm(pl, p);  // (as KVTask: Q unscaled into the products, the scale applied to S)
  [[maybe_unused]] const bool amx = mm.amx, split = mm.split;
  const float qmul = amx ? 1.0f : p.scale, smul = amx ? p.scale : 1.0f;

  RowInfo ri;
  FillRowInfo(pl, sr, b, h, r0, nr, &ri);
  // (qmul Q)^T (d, kTileQ) and dO^T (dv, kTileQ); columns past nr are zero.
  std::fill(w.qbuf, w.qbuf + d * kTileQ, 0.0f);
  std::fill(w.obuf, w.obuf + dv * kTileQ, 0.0f);
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t row = sr.q_start + r0 + r;
    LoadRow(p.q, t, b * p.q_stride.batch + row * p.q_stride.seq + h * p.q_stride.head, d, qmul, w.row);
    for (int64_t x = 0; x < d; ++x) w.qbuf[x * kTileQ + r] = w.row[x];
    LoadRow(bp.dout, t, b * bp.dout_stride.batch + row * bp.dout_stride.seq + h * bp.dout_stride.head, dv, 1.0f, w.row);
    for (int64_t x = 0; x < dv; ++x) w.obuf[x * kTileQ + r] = w.row[x];
  }
  std::fill(w.acc1, w.acc1 + nr * d, 0.0f);  // dQ (nr, d), unscaled
#if IOATTN_HAVE_FLASH_AMX
  if (amx) {  // Q^T and dO^T, packed once for every key block's products
    flash::flash_amx_begin();
    flash::flash_amx_pack_b(0, static_cast<size_t>(nrv), static_cast<size_t>(d), w.qbuf, kTileQ, split);
    flash::flash_amx_pack_b(1, static_cast<size_t>(nrv), static_cast<size_t>(dv), w.obuf, kTileQ, split);
  }
#endif

  // Keys seen by any row of the block: [lo of the first row, hi of the last row).
  int64_t k_begin, unused, k_end;
  visible_keys(r0, sq, sk, p.window_left, p.window_right, &k_begin, &unused);
  visible_keys(r0 + nr - 1, sq, sk, p.window_left, p.window_right, &unused, &k_end);
  const ScoreParams sp = score_params(p, h);
  for (int64_t c0 = k_begin; c0 < k_end; c0 += kTileK) {
    const int64_t nc = std::min(kTileK, k_end - c0);
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t key = sr.k_start + c0 + j;
      LoadRow(p.k, t, b * p.k_stride.batch + key * p.k_stride.seq + hk * p.k_stride.head, d, 1.0f, w.kbuf + j * d);
      LoadRow(p.v, t, b * p.v_stride.batch + key * p.v_stride.seq + hk * p.v_stride.head, dv, 1.0f, w.vbuf + j * dv);
    }
    const size_t nc_ = static_cast<size_t>(nc), nrv_ = static_cast<size_t>(nrv);
    mm(false, nc_, nrv_, d, w.kbuf, d, 1, w.qbuf, kTileQ, w.s, kTileQ, smul, 0);    // S^T  (nc, nrv) = scale K Q^T
    mm(false, nc_, nrv_, dv, w.vbuf, dv, 1, w.obuf, kTileQ, w.dp, kTileQ, 1.0f, 1);  // dP^T (nc, nrv) = V dO^T
    GradsTransposed(sp, ri, nc, nrv, r0, c0, off, w.s, w.dp);                       // s = P^T, dp = dS^T
    mm(true, static_cast<size_t>(nr), d, nc_, w.dp, 1, kTileQ, w.kbuf, d, w.acc1, d, 1.0f, -1);  // dQ (nr, d) += dS K
  }
#if IOATTN_HAVE_FLASH_AMX
  if (amx) flash::flash_amx_end();
#endif
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t row = sr.q_start + r0 + r;
    StoreRow(bp.dq, t, b * bp.dq_stride.batch + row * bp.dq_stride.seq + h * bp.dq_stride.head, d, w.acc1 + r * d,
             p.scale);
  }
}

// Writes the dQ rows of kv head hk's group from fp32 sums [group, sq, d] (unscaled).
void StoreGroupDq(const Plan& pl, int64_t b, int64_t hk, const float* dq) {
  const BwdProblem& bp = *pl.bp;
  const FwdProblem& p = bp.f;
  const SeqRange sr = seq_range(p, b);
  const int64_t d = p.head_dim, g = p.group(), sq = sr.q_len;
  for (int64_t hh = 0; hh < g; ++hh) {
    const int64_t h = hk * g + hh;
    for (int64_t i = 0; i < sq; ++i) {
      const int64_t row = sr.q_start + i;
      StoreRow(bp.dq, p.dtype, b * bp.dq_stride.batch + row * bp.dq_stride.seq + h * bp.dq_stride.head, d,
               dq + (hh * sq + i) * d, p.scale);
    }
  }
}

// The fused pass: dK, dV of key blocks [task.start, task.end) of kv head task.head (pass 1's tasks
// in key order) and the dQ of its group, accumulated in fp32 ([group, sq, d]): the task's own
// partial in the split mode (summed by ReduceDq), else the thread's buffer dq, stored at the end.
void FusedTask(const Plan& pl, const Task& task, const Workspace& w, float* dq) {
  const FwdProblem& p = pl.bp->f;
  const SeqRange sr = seq_range(p, task.b);
  float* acc = task.dq ? task.dq : dq;
  std::fill(acc, acc + p.group() * sr.q_len * p.head_dim, 0.0f);
  for (int64_t c0 = task.start; c0 < task.end; c0 += kTileK) KVTask(pl, {task.b, task.head, c0, true}, w, acc);
  if (!task.dq) StoreGroupDq(pl, task.b, task.head, acc);
}

// The split mode's reduction for query head hk * group + hh of (batch b, kv head hk): parts holds
// the pair's n partials ([group, sq, d] each) back to back; their rows of that head are summed in
// order into the first partial and stored.
void ReduceDq(const Plan& pl, int64_t b, int64_t hk, int64_t hh, float* parts, int64_t n) {
  const BwdProblem& bp = *pl.bp;
  const FwdProblem& p = bp.f;
  const SeqRange sr = seq_range(p, b);
  const int64_t d = p.head_dim, sq = sr.q_len, len = p.group() * sq * d, h = hk * p.group() + hh;
  float* HWY_RESTRICT dst = parts + hh * sq * d;
  for (int64_t c = 1; c < n; ++c) {
    const float* HWY_RESTRICT src = parts + c * len + hh * sq * d;
    for (int64_t x = 0; x < sq * d; ++x) dst[x] += src[x];
  }
  for (int64_t i = 0; i < sq; ++i) {
    const int64_t row = sr.q_start + i;
    StoreRow(bp.dq, p.dtype, b * bp.dq_stride.batch + row * bp.dq_stride.seq + h * bp.dq_stride.head, d,
             dst + i * d, p.scale);
  }
}

void RunTask(const Plan& pl, const Task& task, float* ws, float* dq) {
  const Workspace w = carve(ws, pl.bp->f.head_dim, pl.bp->f.head_dim_v);
  if (task.fused)
    FusedTask(pl, task, w, dq);
  else if (task.kv)
    KVTask(pl, task, w);
  else
    QTask(pl, task, w);
}

}  // namespace HWY_NAMESPACE
}  // namespace ioattn::detail::bwd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ioattn::detail {
namespace bwd {
HWY_EXPORT(TargetName);
HWY_EXPORT(RunTask);
HWY_EXPORT(ReduceDq);
HWY_EXPORT(UsesAmx);

// Pass 0: D_i = dO_i . O_i (fp32) for every (head, row), and each (batch, head)'s share of
// dsinks (in double, summed over batches in order afterwards, so it is deterministic too).
void row_dots(const BwdProblem& bp, int nt, std::vector<float>& D, int64_t d_rows, std::vector<double>& dsink_part) {
  const FwdProblem& p = bp.f;
  const int64_t hq = p.heads_q, dv = p.head_dim_v;
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(nt)
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < hq; ++h) {
      const SeqRange sr = seq_range(p, b);
      const int64_t drow0 = h * d_rows + (p.varlen() ? sr.q_start : b * p.seqlen_q);
      double sink_acc = 0.0;
      for (int64_t i = 0; i < sr.q_len; ++i) {
        const int64_t row = sr.q_start + i;
        const int64_t oo = b * p.o_stride.batch + row * p.o_stride.seq + h * p.o_stride.head;
        const int64_t go = b * bp.dout_stride.batch + row * bp.dout_stride.seq + h * bp.dout_stride.head;
        float acc = 0.0f;
        for (int64_t x = 0; x < dv; ++x) acc += load_float(bp.dout, p.dtype, go + x) * load_float(p.o, p.dtype, oo + x);
        D[drow0 + i] = acc;
        if (bp.dsinks) {
          const float lse = p.lse[b * p.lse_stride.batch + h * p.lse_stride.head + row * p.lse_stride.seq];
          if (lse != neg_inf()) sink_acc -= std::exp(static_cast<double>(p.sinks[h]) - lse) * acc;
        }
      }
      if (bp.dsinks) dsink_part[b * hq + h] = sink_acc;
    }
  }
}

}  // namespace bwd

namespace bwd {

// The mode (BwdMode above). The fill of n tasks is the fraction of the threads' rounds they
// occupy, n / (ceil(n / threads) * threads). Fused when the (batch, kv head) tasks fill at least
// 90% of the rounds; else split when that fills better by 0.1 or more (not under
// Context::deterministic: the split's bits follow the thread count); else fused from 5/7 (the
// two passes do 7 tile products to its 5 but split finer); else the two passes. The fused
// per-thread dQ buffers and the split partials stay within kFusedDqBytes. IOATTN_CPU_BWD=fused /
// split / twopass forces one (an unknown value is an error naming the variable).
constexpr int64_t kFusedDqBytes = int64_t{256} << 20;

BwdMode bwd_mode(const BwdProblem& bp, int nt) {
  const FwdProblem& p = bp.f;
  BwdMode m;
  int64_t max_sq = 0, rows = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    max_sq = std::max(max_sq, seq_range(p, b).q_len);
    rows += seq_range(p, b).q_len;
  }
  const int64_t tasks = p.batch * p.heads_kv, threads = std::max<int64_t>(1, nt);
  auto fill = [&](int64_t n) {
    const int64_t rounds = (n + threads - 1) / threads;
    return rounds > 0 ? static_cast<double>(n) / static_cast<double>(rounds * threads) : 0.0;
  };
  auto pct = [](double f) { return std::to_string(static_cast<int>(f * 100 + 0.5)) + "%"; };
  const int64_t dq_floats = p.group() * max_sq * p.head_dim;
  const int64_t dq_bytes = dq_floats * 4 * std::min(threads, std::max<int64_t>(tasks, 1));
  const bool fused_fits = tasks > 0 && dq_bytes <= kFusedDqBytes;
  const double f1 = fill(tasks);
  // The split's chunk count: the first from 2 up whose tasks fill >= 90%, else the best fill
  // (bounded by the partials' memory, heads_q * rows * head_dim floats per chunk).
  const int64_t part_bytes = p.heads_q * rows * p.head_dim * 4;
  int64_t chunks = 0;
  double fc = 0.0;
  const int64_t max_chunks = 4 * ((threads + std::max<int64_t>(tasks, 1) - 1) / std::max<int64_t>(tasks, 1));
  for (int64_t c = 2; c <= std::max<int64_t>(2, max_chunks) && c * part_bytes <= kFusedDqBytes; ++c)
    if (fill(tasks * c) > fc + 1e-9) {
      chunks = c;
      fc = fill(tasks * c);
      if (fc >= 0.9) break;
    }
  const std::string tasks_s = std::to_string(tasks) + " (batch, kv head) tasks fill " + pct(f1) + " of " +
                              std::to_string(threads) + " threads' rounds";
  const std::string split_s = "split single pass: " + tasks_s + ", " + std::to_string(chunks) +
                              " key ranges each fill " + pct(fc) + " (5 tile products per block + a dQ sum)";
  if (fused_fits && f1 >= 0.9) {
    m.kind = BwdMode::fused;
    m.why = "fused single pass: " + tasks_s + " (5 tile products per block)";
  } else if (chunks > 0 && fc >= f1 + 0.1 && !bp.deterministic) {
    m.kind = BwdMode::split;
    m.why = split_s;
  } else if (fused_fits && f1 * 7.0 >= 5.0) {
    m.kind = BwdMode::fused;
    m.why = "fused single pass: " + tasks_s + " (5 tile products per block)";
  } else {
    m.why = "two passes (dK/dV over key blocks, dQ over query blocks; 7 tile products): " +
            (tasks == 0              ? std::string("no tasks")
             : !fused_fits           ? "a fused dQ buffer of " + std::to_string(dq_bytes >> 20) + " MiB"
             : chunks > 0 && bp.deterministic ? tasks_s + " (deterministic: no split)"
                                      : "only " + tasks_s);
  }
  if (const char* e = std::getenv("IOATTN_CPU_BWD")) {
    const std::string v = e;
    if (v == "fused" || v == "twopass" || v == "split") {
      m.kind = v == "fused" ? BwdMode::fused : v == "split" ? BwdMode::split : BwdMode::two_pass;
      if (m.kind == BwdMode::split && chunks == 0) chunks = 2;
      m.why = std::string(v == "fused" ? "fused single pass" : v == "split" ? split_s : "two passes") +
              " (IOATTN_CPU_BWD=" + v + ")";
    } else if (!v.empty()) {
      throw Error("IOATTN_CPU_BWD", "ioattn: IOATTN_CPU_BWD must be fused, split or twopass, got '" + v + "'");
    }
  }
  m.amx = HWY_DYNAMIC_DISPATCH(UsesAmx)(p);
  if (m.amx)
    m.why += p.dtype == DType::f16 ? "; amx-bf16 tile products (f16 as two bf16 parts, P and dS to ~16 bits)"
                                   : "; amx-bf16 tile products (P and dS rounded to bf16)";
  if (m.kind == BwdMode::fused) m.dq_floats = dq_floats;
  if (m.kind == BwdMode::split) m.chunks = chunks;
  return m;
}

// The split mode's key ranges of one sequence: min(chunks, key blocks) contiguous runs of 64-key
// blocks of about equal work (a block's work: the query rows that see it, + 1 for its loads).
// Returns the range starts in keys and sk at the end.
std::vector<int64_t> key_ranges(const FwdProblem& p, const SeqRange& sr, int64_t chunks) {
  const int64_t nb = (sr.k_len + kTileK - 1) / kTileK, n = std::min(chunks, nb);
  std::vector<int64_t> prefix(static_cast<size_t>(nb + 1), 0);
  for (int64_t j = 0; j < nb; ++j) {
    int64_t i_begin, i_end;
    rows_seeing(p, sr.q_len, sr.k_len, j * kTileK, std::min(kTileK, sr.k_len - j * kTileK), &i_begin, &i_end);
    prefix[static_cast<size_t>(j + 1)] = prefix[static_cast<size_t>(j)] + std::max<int64_t>(i_end - i_begin, 0) + 1;
  }
  std::vector<int64_t> starts{0};
  for (int64_t k = 1, j = 1; k < n; ++k) {  // cut k: the first block j with prefix(j) >= total * k / n
    j = std::max(j, static_cast<int64_t>(starts.back() / kTileK) + 1);
    while (j < nb - (n - k) && prefix[static_cast<size_t>(j)] * n < prefix[static_cast<size_t>(nb)] * k) ++j;
    starts.push_back(j * kTileK);
  }
  starts.push_back(sr.k_len);
  return starts;
}

}  // namespace bwd

std::string cpu_backward_mode(const BwdProblem& bp) {
  return bwd::bwd_mode(bp, bp.f.num_threads > 0 ? bp.f.num_threads : cpu_max_threads()).why;
}

void cpu_flash_backward(const BwdProblem& bp) {
  using namespace bwd;
  const FwdProblem& p = bp.f;
  const int nt = p.num_threads > 0 ? p.num_threads : cpu_max_threads();
  const int64_t hq = p.heads_q, hkv = p.heads_kv, g = p.group();

  Plan pl;
  pl.bp = &bp;
  pl.d_rows = p.varlen() ? p.cu_seqlens_q_host[p.batch] : p.batch * p.seqlen_q;
  std::vector<float> D(static_cast<size_t>(hq * pl.d_rows));
  std::vector<double> dsink_part(static_cast<size_t>(bp.dsinks ? p.batch * hq : 0), 0.0);
  row_dots(bp, nt, D, pl.d_rows, dsink_part);
  pl.D = D.data();
  if (bp.dsinks)
    for (int64_t h = 0; h < hq; ++h) {
      double acc = 0.0;
      for (int64_t b = 0; b < p.batch; ++b) acc += dsink_part[b * hq + h];
      bp.dsinks[h] = static_cast<float>(acc);
    }

  const BwdMode mode = bwd_mode(bp, nt);
  pl.amx = mode.amx;
  const bool one_pass = mode.kind != BwdMode::two_pass;
  std::vector<Task> tasks;
  // split: every (batch, kv head)'s partials back to back ([ranges, group, seqlen_q, d] fp32);
  // reduce lists (b, kv head, first partial, count) for the sum afterwards.
  struct Reduce {
    int64_t b, hk, off, n;
  };
  std::vector<Reduce> reduce;
  hwy::AlignedFreeUniquePtr<float[]> parts;
  if (mode.kind == BwdMode::split) {
    std::vector<std::vector<int64_t>> ranges(static_cast<size_t>(p.batch));
    int64_t total = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      const SeqRange sr = seq_range(p, b);
      if (sr.k_len == 0) continue;
      ranges[static_cast<size_t>(b)] = key_ranges(p, sr, mode.chunks);
      const int64_t n = static_cast<int64_t>(ranges[static_cast<size_t>(b)].size()) - 1;
      for (int64_t hk = 0; hk < hkv; ++hk) {
        reduce.push_back({b, hk, total, n});
        total += n * g * sr.q_len * p.head_dim;
      }
    }
    parts = hwy::AllocateAligned<float>(static_cast<size_t>(std::max<int64_t>(total, 1)));
    if (!parts) throw std::bad_alloc();
    for (const Reduce& r : reduce) {
      const std::vector<int64_t>& st = ranges[static_cast<size_t>(r.b)];
      const int64_t len = g * seq_range(p, r.b).q_len * p.head_dim;
      for (int64_t c = 0; c < r.n; ++c)
        tasks.push_back({r.b, r.hk, st[static_cast<size_t>(c)], true, true, st[static_cast<size_t>(c + 1)],
                         parts.get() + r.off + c * len});
    }
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqRange sr = seq_range(p, b);
    if (mode.kind == BwdMode::fused) {  // one task per (batch, kv head)
      for (int64_t hk = 0; hk < hkv; ++hk)
        if (sr.k_len > 0) tasks.push_back({b, hk, 0, true, true, sr.k_len});
    }
    if (one_pass) continue;
    // Passes 1 and 2 in one task list (they are independent); heavier tasks of a head come first.
    for (int64_t hk = 0; hk < hkv; ++hk)
      for (int64_t c0 = 0; c0 < sr.k_len; c0 += kTileK) tasks.push_back({b, hk, c0, true});
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t r0 = 0; r0 < sr.q_len; r0 += kTileQ) tasks.push_back({b, h, r0, false});
  }
  if (one_pass) {  // sequences with no keys: their dQ rows are 0 (no task covers them)
    for (int64_t b = 0; b < p.batch; ++b) {
      const SeqRange sr = seq_range(p, b);
      if (sr.k_len > 0) continue;
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t i = 0; i < sr.q_len; ++i)
          for (int64_t x = 0; x < p.head_dim; ++x)
            store_float(bp.dq, p.dtype,
                        b * bp.dq_stride.batch + (sr.q_start + i) * bp.dq_stride.seq + h * bp.dq_stride.head + x, 0.0f);
    }
  }
  if (tasks.empty()) return;

  const int nthreads = static_cast<int>(std::min<int64_t>(nt, static_cast<int64_t>(tasks.size())));
  const int64_t ws_floats = workspace_floats(p.head_dim, p.head_dim_v);
  const int64_t dq_floats = mode.dq_floats;
  std::vector<hwy::AlignedFreeUniquePtr<float[]>> ws(static_cast<size_t>(nthreads)), dqs(static_cast<size_t>(nthreads));
  for (int i = 0; i < nthreads; ++i) {
    auto& w = ws[static_cast<size_t>(i)];
    w = hwy::AllocateAligned<float>(static_cast<size_t>(ws_floats));
    if (!w) throw std::bad_alloc();
    std::memset(w.get(), 0, static_cast<size_t>(ws_floats) * sizeof(float));
    if (dq_floats > 0) {
      dqs[static_cast<size_t>(i)] = hwy::AllocateAligned<float>(static_cast<size_t>(dq_floats));
      if (!dqs[static_cast<size_t>(i)]) throw std::bad_alloc();
    }
  }
  HWY_DYNAMIC_DISPATCH(TargetName)();  // picks the SIMD target once, before the threads start
  const int64_t ntasks = static_cast<int64_t>(tasks.size()), nreduce = static_cast<int64_t>(reduce.size());
#pragma omp parallel num_threads(nthreads)
  {
    const size_t me = static_cast<size_t>(omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < ntasks; ++it)
      HWY_DYNAMIC_DISPATCH(RunTask)(pl, tasks[static_cast<size_t>(it)], ws[me].get(), dqs[me].get());
    // (the implicit barrier: every partial is complete) the split's sums, one per (batch, q head)
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t it = 0; it < nreduce; ++it)
      for (int64_t hh = 0; hh < g; ++hh) {
        const Reduce& r = reduce[static_cast<size_t>(it)];
        HWY_DYNAMIC_DISPATCH(ReduceDq)(pl, r.b, r.hk, hh, parts.get() + r.off, r.n);
      }
  }
}

}  // namespace ioattn::detail
#endif  // HWY_ONCE

// CPU serving backend: split-KV decode (Flash-Decoding) over a paged or contiguous KV cache,
// append_kv into the cache, and merge_states. Highway SIMD with runtime ISA dispatch, OpenMP.
//
// What decode computes: for every sequence b and query row i (position cache_seqlens[b] -
// seqlen_q + i), attention over the cache's first cache_seqlens[b] tokens with ioattn's masks and
// score modifiers (include/ioattn/ioattn.hpp), fp32 accumulation, O in q's dtype, LSE in fp32.
//
// Work partition. The g = heads_q / heads_kv query heads of a kv head times the seqlen_q rows
// form R = g * seqlen_q "query rows" r = hh * seqlen_q + i that are processed together (GQA
// packing), so every K/V row is read from the cache and dequantised once and reused by all R
// rows. The keys the sequence's rows can see at all (a contiguous range: the union of the rows'
// mask windows) are cut into num_splits equal chunks (decode_split_range). A task is (sequence b,
// a range of kv heads [hk0, hk1), split s): all kv heads of the sequence where their rows fit
// (kMaxTaskRows) and there are at least 2 tasks per thread, fewer heads per task otherwise. With
// the usual cache layout [pages, page_size, kv_heads, d] a token's rows of all kv heads are
// adjacent, so a task reads one contiguous stream (per page) instead of one 256-byte row per
// 2 KiB. Which heads share a task changes no result: each (head, split) is computed the same way.
// The tasks run in parallel (OpenMP, dynamic schedule).
//
// One task, per block of kBlockKeys keys (no fp32 copy of K or V is ever stored: cache rows are
// converted to fp32 in registers as they are loaded, LoadCvt; 8-bit: raw codes, the per-head
// k_scale folded into the pre-scaled Q rows, v_scale into the final O):
//   S (R, Bc)      = Q (R, dp) . K^T    4 keys at a time, token by token across the task's heads;
//                                       tiles of up to 4 rows x 4 keys share each converted K
//                                       vector and each Q load; one transpose-add tree per tile
//   softcap, ALiBi, mask (select -inf, so a masked NaN key never reaches P), online softmax per
//   row (running max m, sum l, rescale of the accumulator when the max grows)
//   Acc (R, dvp)  += P (R, Bc) . V      8 keys at a time across the heads, tiles of up to 4 rows
//                                       x 64 columns; keys with P == 0 are skipped per row (0 * NaN
//                                       safety; one shared pass where every row of the tile has P != 0)
// A steady software prefetch runs kPrefetchTokens tokens (all the task's heads) ahead of the
// token being consumed, K in the score pass and V in the P.V pass, across block edges.
// With one split the task finishes the rows itself (sinks, v_scale, 1/l) into O and LSE. With
// more, it writes a partial (O_s normalised, LSE_s) in fp32 to the workspace and a second
// parallel pass merges the splits of each row exactly: M = max(LSE_s, sink), O = sum_s
// exp(LSE_s - M) O_s / (sum_s exp(LSE_s - M) + exp(sink - M)); the sink joins once, here. A row
// with no visible key anywhere (an empty sequence) gets O = 0 and LSE = -inf (or the sink).
// A row that saw a NaN or +inf score is written as NaN (as the forward does).
//
// Memory. All scratch lives in the workspace (cpu_decode_layout): partials plus one scratch
// slot per thread; decode under a plan allocates nothing.
//
// Targets: as flash_cpu.cpp (SSSE3 disabled; IOATTN_CPU_TARGET caps the choice; the dispatcher
// applies the cap before calling here). Vectors are capped at 16 floats so the 16-float padding of
// every row works on any target.
//
// History:
//  1. GQA-packed split-KV tasks (one kv head each), fp32 partials in the caller's workspace,
//     f8e4m3 / i8 dequantised on load with the scale folded into Q / O; K and V blocks converted
//     to fp32 scratch, burst prefetch of the next block (23-70% of stream_read at long KV).
//  2. This version: tasks over all kv heads of a sequence (contiguous streams), K / V converted in
//     registers inside the score and P.V loops (no fp32 scratch), 4 x 4 score tiles, steady
//     prefetch; f8e4m3 through f16 (value * 2^-8, the 2^8 folded into the scales). 90-104% of
//     stream_read for f32 / bf16 caches at long KV, 35-68% for 8-bit (docs/PERF.md).
//  3. i8 caches on CPUs with AMX-INT8: Q.K^T and P.V as exact int8 tile products with Q / P in
//     4-limb fixed point (serving_amx.hpp; RunChunkT<i8, true>); f8e4m3 via AMX-BF16 exists but
//     is opt-in (IOATTN_CPU_AMX_E4M3=1: slower here). ~1.2x single thread; at 2 threads, with
//     the K / V prefetches behind the tile loads, 0.74-0.85 of stream_read (docs/PERF.md).
#ifndef IOATTN_CPU_SERVING_CPU_SHARED_
#define IOATTN_CPU_SERVING_CPU_SHARED_

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "core/serving_problem.hpp"
#include "cpu/prefetch.hpp"
#include "cpu/serving_amx.hpp"
#include "cpu/serving_quant.h"

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS HWY_SSSE3
#endif

namespace ioattn::detail::serving {

// ---- tile constants: should not affect results beyond fp32 rounding, only speed ----------
// 64 keys per block (the online-softmax step; a key bit mask per row fits a uint64). Q and
// accumulator rows are padded to 16 floats (one AVX-512 vector, four SSE vectors), so those
// loops have no tails; pads are written as zeros. Cache rows are not padded: a row tail (head
// dims not a multiple of the vector) is read element by element (LoadCvtN).
constexpr int64_t kBlockKeys = 64;
constexpr int64_t kPadFloats = 16;

// A task covers up to this many query rows (kv heads x R): all kv heads of a sequence where
// they fit, so a thread reads each token's K (V) rows of all heads as one contiguous stream.
constexpr int64_t kMaxTaskRows = 64;
inline int64_t max_heads_per_task(int64_t heads_kv, int64_t rows_per_group) {
  return std::max<int64_t>(1, std::min<int64_t>(heads_kv, kMaxTaskRows / std::max<int64_t>(1, rows_per_group)));
}

inline int64_t pad_floats(int64_t n) { return (n + kPadFloats - 1) / kPadFloats * kPadFloats; }
inline size_t align_bytes(size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// One thread's scratch inside the workspace (byte offsets from the slot start). R here: the
// task's query rows (its kv heads x rows per kv head).
struct ScratchLayout {
  size_t qf = 0;    // (R, dp)   Q rows in fp32, pre-multiplied by scale * k_scale
  size_t s = 0;     // (R, Bc)   scores, then P
  size_t acc = 0;   // (R, dvp)  O accumulators (unnormalised)
  size_t m = 0;     // (R)       running max
  size_t l = 0;     // (R)       running sum relative to m
  size_t bad = 0;   // (R)       non-zero: the row saw a NaN or +inf score
  size_t act = 0;   // (R)       non-zero: the row has P > 0 somewhere in the current block
  size_t lo = 0;    // (R) int64 first visible key of the row in this split
  size_t hi = 0;    // (R) int64 one past the last
  size_t pnz = 0;   // (R) uint64 bit j: P != 0 at key j of the block
  size_t tall = 0;  // (R) uint64 per row tile: bit j set when all its rows have P != 0 at key j
  size_t tany = 0;  // (R) int32 per row tile: some row of the tile is active in the block
  size_t tsee = 0;  // (R) int32 per row tile of a head: some row sees a key of the block
  // AMX path (i8 caches, serving_amx.hpp):
  size_t amxq = 0;   // Q limbs / parts in B-tile order, up to (R, dp) x 32 bytes (groups of 4 rows per head)
  size_t amxm = 0;   // (R) float 2^-E per Q row
  size_t amxp = 0;   // P limbs / parts of one head's rows: ceil(R / 4) x 2 A tiles of 1 KiB
  size_t amxs = 0;   // staging: 2 x 32 K rows or 64 V rows (bf16 for f8e4m3), max(128 dp, 128 dvp) bytes
  size_t bytes = 0;
};

inline ScratchLayout scratch_layout(int64_t rows, int64_t d, int64_t dv) {
  const size_t r = static_cast<size_t>(rows), dp = static_cast<size_t>(pad_floats(d));
  const size_t dvp = static_cast<size_t>(pad_floats(dv)), bc = static_cast<size_t>(kBlockKeys);
  ScratchLayout L;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t off = at;
    at += align_bytes(bytes);
    return off;
  };
  L.qf = take(r * dp * 4);
  L.s = take(r * bc * 4);
  L.acc = take(r * dvp * 4);
  L.m = take(r * 4);
  L.l = take(r * 4);
  L.bad = take(r * 4);
  L.act = take(r * 4);
  L.lo = take(r * 8);
  L.hi = take(r * 8);
  L.pnz = take(r * 8);
  L.tall = take(r * 8);
  L.tany = take(r * 4);
  L.tsee = take(r * 4);
  L.amxq = take(r * dp * 32);
  L.amxm = take(r * 4);
  L.amxp = take((r + 3) / 4 * 2048);
  L.amxs = take(std::max(128 * dp, 128 * dvp));
  L.bytes = at;
  return L;
}

// Row pointers of tokens [t0, t0 + n) of sequence b, kv head hk, for K and V: the page is
// looked up once per page, not per token (no division in the token loop).
inline void block_rows(const DecodeProblem& p, int64_t b, int64_t hk, int64_t t0, int64_t n,
                       const uint8_t** k_rows, const uint8_t** v_rows) {
  const int64_t esize = dtype_size(p.cache_dtype);
  const auto* kbase = static_cast<const uint8_t*>(p.k_cache);
  const auto* vbase = static_cast<const uint8_t*>(p.v_cache);
  int64_t page_idx = t0 / p.page_size, slot = t0 % p.page_size;
  for (int64_t j = 0; j < n;) {
    const int64_t page =
        p.block_table ? p.block_table[b * p.bt_stride_batch + page_idx * p.bt_stride_page] : b;
    const uint8_t* k = kbase + (page * p.k_stride.page + slot * p.k_stride.slot + hk * p.k_stride.head) * esize;
    const uint8_t* v = vbase + (page * p.v_stride.page + slot * p.v_stride.slot + hk * p.v_stride.head) * esize;
    const int64_t run = std::min(n - j, p.page_size - slot);  // tokens left on this page
    for (int64_t r = 0; r < run; ++r, ++j) {
      k_rows[j] = k + r * p.k_stride.slot * esize;
      v_rows[j] = v + r * p.v_stride.slot * esize;
    }
    ++page_idx;
    slot = 0;
  }
}

// Software prefetch of one cache row into L2. Without it the loops wait on DRAM latency per row
// (one kv head's rows are 1-4 KiB apart; a task's rows of all heads are contiguous per token, but
// the hardware streamers stop at 4 KiB page boundaries and run only ~20 lines ahead). prefetcht1:
// 16 tokens x all heads ahead may not fit L1.
inline void prefetch_row(const uint8_t* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) prefetch_l2(row + off);
}

inline float ninf() { return -std::numeric_limits<float>::infinity(); }

}  // namespace ioattn::detail::serving

#endif  // IOATTN_CPU_SERVING_CPU_SHARED_

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/serving_cpu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

HWY_BEFORE_NAMESPACE();
namespace ioattn::detail::serving {
namespace HWY_NAMESPACE {

// Whether this Highway target can run the AMX path (serving_amx.hpp); foreach_target compiles this
// section once per target, so it is decided again in each pass.
#undef IOATTN_AMX_TARGET
#if defined(IOATTN_HAVE_AMX) && HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
#define IOATTN_AMX_TARGET 1
#else
#define IOATTN_AMX_TARGET 0
#endif
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::CappedTag<float, kPadFloats>;  // at most 16 lanes: rows are padded to 16 floats
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;
using VF = hn::Vec<DF>;

// ---- dtype conversion: one cache / query row to fp32 -------------------------------------

// f8e4m3 codes -> fp32. Normal: the 7 magnitude bits shifted into fp32's exponent/mantissa
// fields, exponent rebased from bias 7 to 127 (+120). Subnormal (exponent 0): m * 2^-9.
// 0x7f / 0xff: NaN. No fp32 subnormals are involved, so FTZ/DAZ modes cannot change the result.
HWY_INLINE VF LoadE4m3(const uint8_t* HWY_RESTRICT src) {
  const DF df;
  const DU du;
  const DI di;
  const hn::Rebind<uint8_t, DF> d8;
  const auto b = hn::PromoteTo(du, hn::LoadU(d8, src));
  const auto mag = hn::And(b, hn::Set(du, 0x7fu));
  const auto normal = hn::Add(hn::ShiftLeft<20>(mag), hn::Set(du, 120u << 23));
  const VF sub = hn::Mul(hn::ConvertTo(df, hn::BitCast(di, mag)), hn::Set(df, 1.0f / 512.0f));
  VF v = hn::IfThenElse(hn::RebindMask(df, hn::Lt(mag, hn::Set(du, 8u))), sub, hn::BitCast(df, normal));
  v = hn::IfThenElse(hn::RebindMask(df, hn::Eq(mag, hn::Set(du, 0x7fu))),
                     hn::Set(df, std::numeric_limits<float>::quiet_NaN()), v);
  const auto sign = hn::ShiftLeft<24>(hn::And(b, hn::Set(du, 0x80u)));
  return hn::BitCast(df, hn::Or(hn::BitCast(du, v), sign));
}

// dst[0, n) = the row at src (dtype t) in fp32; dst[n, npad) = 0.
HWY_INLINE void ConvertRow(DType t, const void* src, size_t n, size_t npad, float* HWY_RESTRICT dst) {
  const DF df;
  const size_t L = hn::Lanes(df);
  size_t x = 0;
  switch (t) {
    case DType::f32: {
      const float* s = static_cast<const float*>(src);
      for (; x + L <= n; x += L) hn::StoreU(hn::LoadU(df, s + x), df, dst + x);
      for (; x < n; ++x) dst[x] = s[x];
      break;
    }
    case DType::bf16: {
      const hn::Rebind<hwy::bfloat16_t, DF> db;
      const auto* s = static_cast<const hwy::bfloat16_t*>(src);
      for (; x + L <= n; x += L) hn::StoreU(hn::PromoteTo(df, hn::LoadU(db, s + x)), df, dst + x);
      for (; x < n; ++x) dst[x] = bf16_to_float(static_cast<const uint16_t*>(src)[x]);
      break;
    }
    case DType::f16: {
#if HWY_TARGET <= HWY_AVX2  // F16C: exact, subnormals and inf included
      const hn::Rebind<hwy::float16_t, DF> dh;
      const auto* s = static_cast<const hwy::float16_t*>(src);
      for (; x + L <= n; x += L) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, s + x)), df, dst + x);
#endif
      for (; x < n; ++x) dst[x] = f16_to_float(static_cast<const uint16_t*>(src)[x]);
      break;
    }
    case DType::i8: {
      const hn::Rebind<int8_t, DF> d8;
      const DI di;
      const auto* s = static_cast<const int8_t*>(src);
      for (; x + L <= n; x += L) hn::StoreU(hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, s + x))), df, dst + x);
      for (; x < n; ++x) dst[x] = i8_to_float(s[x]);
      break;
    }
    case DType::f8e4m3: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (; x + L <= n; x += L) hn::StoreU(LoadE4m3(s + x), df, dst + x);
      for (; x < n; ++x) dst[x] = e4m3_to_float(s[x]);
      break;
    }
    default:
      break;  // validation admits no other dtype
  }
  for (; x < npad; ++x) dst[x] = 0.0f;
}

// ---- cache rows converted in registers -----------------------------------------------------
// LoadCvt<T>(row, x): elements [x, x + L) of a cache row (dtype T) in fp32, straight from the
// cache into a register (no fp32 copy of the row is ever stored). f8e4m3 comes out as
// value * 2^-8 (exact: a power of two, and the smallest e4m3 magnitude 2^-9 stays a normal fp32);
// the 2^8 is folded into the Q and V scales (kE4m3Unit). On F16C targets the code goes through
// f16: S.EEEE.MMM -> S.0EEEE.MMM0000000 is the f16 of value * 2^-8, e4m3 subnormals onto f16
// subnormals, which VCVTPH2PS converts exactly; the NaN codes (S.1111.111) by one compare.
// LoadCvtN: the first cnt < L elements, zeros after (row tails; never reads past the row).
// kNaN = false (f8e4m3 only) leaves out the NaN fix-up (3 of 8 vector uops per 16 codes): the
// score and P.V tiles watch the codes they convert for NaN (WatchE4m3) and redo the tile with
// kNaN = true when one shows up, so results are bitwise those of the exact conversion.
constexpr float kE4m3Unit = 256.0f;

template <DType T>
HWY_INLINE float ScalarCvt(const uint8_t* row, size_t x) {
  if constexpr (T == DType::f32) {
    float f;
    std::memcpy(&f, row + 4 * x, 4);
    return f;
  } else if constexpr (T == DType::bf16) {
    uint16_t u;
    std::memcpy(&u, row + 2 * x, 2);
    return bf16_to_float(u);
  } else if constexpr (T == DType::f16) {
    uint16_t u;
    std::memcpy(&u, row + 2 * x, 2);
    return f16_to_float(u);
  } else if constexpr (T == DType::i8) {
    return i8_to_float(static_cast<int8_t>(row[x]));
  } else {
    return e4m3_to_float(row[x]) * (1.0f / kE4m3Unit);
  }
}

template <DType T>
HWY_INLINE VF LoadCvtN(const uint8_t* HWY_RESTRICT row, size_t x, size_t cnt) {
  const DF df;
  HWY_ALIGN float buf[kPadFloats] = {};
  for (size_t i = 0; i < cnt; ++i) buf[i] = ScalarCvt<T>(row, x + i);
  return hn::Load(df, buf);
}

template <DType T, bool kNaN = true>
HWY_INLINE VF LoadCvt(const uint8_t* HWY_RESTRICT row, size_t x) {
  const DF df;
  if constexpr (T == DType::f32) {
    return hn::LoadU(df, reinterpret_cast<const float*>(row) + x);
  } else if constexpr (T == DType::bf16) {
    const hn::Rebind<hwy::bfloat16_t, DF> db;
    return hn::PromoteTo(df, hn::LoadU(db, reinterpret_cast<const hwy::bfloat16_t*>(row) + x));
  } else if constexpr (T == DType::i8) {
    const hn::Rebind<int8_t, DF> d8;
    const DI di;
    return hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const int8_t*>(row) + x)));
  } else {
#if HWY_TARGET <= HWY_AVX2  // F16C
    const hn::Rebind<hwy::float16_t, DF> dh;
    if constexpr (T == DType::f16) {
      return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(row) + x));
    } else {
      const hn::Rebind<int8_t, DF> d8;
      const hn::Rebind<int16_t, DF> d16;
      const auto s = hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const int8_t*>(row) + x));
      // sign-extended S..S.EEEE.MMM << 7, keep bit 15 (sign) and 13..7 (magnitude)
      auto t = hn::And(hn::ShiftLeft<7>(s), hn::Set(d16, static_cast<int16_t>(0xBF80)));
      if constexpr (!kNaN) return hn::PromoteTo(df, hn::BitCast(dh, t));
      const auto is_nan = hn::Eq(hn::Or(t, hn::Set(d16, static_cast<int16_t>(0x8000))),
                                 hn::Set(d16, static_cast<int16_t>(0xBF80)));
      t = hn::IfThenElse(is_nan, hn::Set(d16, static_cast<int16_t>(0x7E00)), t);
      return hn::PromoteTo(df, hn::BitCast(dh, t));
    }
#else
    if constexpr (T == DType::f16) {
      return LoadCvtN<T>(row, x, hn::Lanes(df));  // no F16C: the exact scalar conversion
    } else {
      return hn::Mul(LoadE4m3(row + x), hn::Set(df, 1.0f / kE4m3Unit));
    }
#endif
  }
}

// NaN watch for the f8e4m3 conversion without fix-up: c | 0x80 == 0xFF exactly for the NaN codes
// (S.1111.111), so a running byte max of c | 0x80 reaches 0xFF iff one was seen. Two vector ops
// per Lanes(DW) codes (64 on AVX-512, 32 on AVX2), on the cache lines the conversion is loading
// anyway. Only where LoadCvt has a conversion without the fix-up (F16C targets); elsewhere the
// tiles run exact (kE4m3Watch).
#if HWY_TARGET <= HWY_AVX2
constexpr bool kE4m3Watch = true;
#else
constexpr bool kE4m3Watch = false;
#endif
using DW = hn::CappedTag<uint8_t, 64>;
using VW = hn::Vec<DW>;
HWY_INLINE VW WatchE4m3(VW mx, const uint8_t* HWY_RESTRICT p) {
  const DW dw;
  return hn::Max(mx, hn::Or(hn::LoadU(dw, p), hn::Set(dw, uint8_t{0x80})));
}
HWY_INLINE bool SawE4m3NaN(VW mx) {
  const DW dw;
  return !hn::AllFalse(dw, hn::Eq(mx, hn::Set(dw, uint8_t{0xFF})));
}
// The same for one vector's worth (L codes) where fewer than Lanes(DW) remain in the row.
HWY_INLINE bool ChunkHasE4m3NaN(const uint8_t* HWY_RESTRICT p) {
  const hn::Rebind<uint8_t, DF> dq;
  return !hn::AllFalse(dq, hn::Eq(hn::Or(hn::LoadU(dq, p), hn::Set(dq, uint8_t{0x80})), hn::Set(dq, uint8_t{0xFF})));
}

// ---- the block kernels -------------------------------------------------------------------

#if HWY_TARGET != HWY_SCALAR
// Sum of the 128-bit blocks of v.
template <class D>
HWY_INLINE hn::Vec<hn::Full128<float>> SumBlocks(D d, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(D()) > 4) {
    const hn::Half<D> dh;
    return SumBlocks(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  } else {
    (void)d;
    return v;
  }
}
#endif

// out[k] = sum of the lanes of a_k, k < 4 (one transpose-and-add tree instead of four
// horizontal sums).
HWY_INLINE void Sum4(VF a0, VF a1, VF a2, VF a3, float* HWY_RESTRICT out) {
#if HWY_TARGET == HWY_SCALAR
  out[0] = hn::GetLane(a0);
  out[1] = hn::GetLane(a1);
  out[2] = hn::GetLane(a2);
  out[3] = hn::GetLane(a3);
#else
  const DF df;
  const hn::Repartition<uint64_t, DF> d64;
  const VF u01 = hn::Add(hn::InterleaveLower(df, a0, a1), hn::InterleaveUpper(df, a0, a1));
  const VF u23 = hn::Add(hn::InterleaveLower(df, a2, a3), hn::InterleaveUpper(df, a2, a3));
  const auto w01 = hn::BitCast(d64, u01), w23 = hn::BitCast(d64, u23);
  const VF w = hn::Add(hn::BitCast(df, hn::InterleaveLower(d64, w01, w23)),
                       hn::BitCast(df, hn::InterleaveUpper(d64, w01, w23)));
  hn::StoreU(SumBlocks(df, w), hn::Full128<float>(), out);
#endif
}

// Row tiles: RT query rows share every converted K / V vector. 4 on AVX-512 (16 score
// accumulators or 4 x 4 P.V accumulators of 32 registers), 2 on targets with 16 registers.
#if HWY_TARGET <= HWY_AVX3
constexpr int kMaxRowTile = 4;
#else
constexpr int kMaxRowTile = 2;
#endif

// s[r * bc + k] = q_r . K_k for the RT rows of the tile (q: stride dp, zero-padded) and the 4
// keys' rows (dtype T, d elements each).
// kExact = false (f8e4m3): conversion without the NaN fix-up, the codes watched; a tile that
// met a NaN code is computed again with kExact = true.
template <DType T, int RT, bool kExact = (T != DType::f8e4m3 || !kE4m3Watch)>
HWY_INLINE void ScoresTile(const float* HWY_RESTRICT q, size_t dp, const uint8_t* const* rows, size_t d,
                           float* HWY_RESTRICT s, size_t bc) {
  const DF df;
  const size_t L = hn::Lanes(df);
  VF a[RT][4];
  for (int r = 0; r < RT; ++r)
    for (int k = 0; k < 4; ++k) a[r][k] = hn::Zero(df);
  const uint8_t* const r0 = rows[0];
  const uint8_t* const r1 = rows[1];
  const uint8_t* const r2 = rows[2];
  const uint8_t* const r3 = rows[3];
  // The RT rows' q[x, x + L) times the 4 keys' elements (converted) at x.
  auto fma_block = [&](size_t x, VF k0, VF k1, VF k2, VF k3) HWY_ATTR {
    for (int r = 0; r < RT; ++r) {
      const VF qv = hn::LoadU(df, q + r * dp + x);
      a[r][0] = hn::MulAdd(qv, k0, a[r][0]);
      a[r][1] = hn::MulAdd(qv, k1, a[r][1]);
      a[r][2] = hn::MulAdd(qv, k2, a[r][2]);
      a[r][3] = hn::MulAdd(qv, k3, a[r][3]);
    }
  };
  // The 4 keys' elements [u, u + L), converted (LoadCvt<T, false>: without the NaN fix-up).
  auto fma_at = [&](size_t u) HWY_ATTR {
    fma_block(u, LoadCvt<T, kExact>(r0, u), LoadCvt<T, kExact>(r1, u), LoadCvt<T, kExact>(r2, u),
              LoadCvt<T, kExact>(r3, u));
  };
  size_t x = 0;
  if constexpr (!kExact) {
    const DW dw;
    const size_t LW = hn::Lanes(dw);  // a multiple of L
    VW mx = hn::Zero(dw);
    bool nan = false;
    for (; x + LW <= d; x += LW) {
      mx = WatchE4m3(WatchE4m3(WatchE4m3(WatchE4m3(mx, r0 + x), r1 + x), r2 + x), r3 + x);
      for (size_t u = x; u < x + LW; u += L) fma_at(u);
    }
    for (; x + L <= d; x += L) {
      nan |= ChunkHasE4m3NaN(r0 + x) | ChunkHasE4m3NaN(r1 + x) | ChunkHasE4m3NaN(r2 + x) | ChunkHasE4m3NaN(r3 + x);
      fma_at(x);
    }
    if (nan || SawE4m3NaN(mx)) return ScoresTile<T, RT, true>(q, dp, rows, d, s, bc);
  } else {
    for (; x + L <= d; x += L) fma_at(x);
  }
  if (x < d) {  // the row tail: exact scalar conversions
    const size_t c = d - x;
    fma_block(x, LoadCvtN<T>(r0, x, c), LoadCvtN<T>(r1, x, c), LoadCvtN<T>(r2, x, c), LoadCvtN<T>(r3, x, c));
  }
  for (int r = 0; r < RT; ++r) Sum4(a[r][0], a[r][1], a[r][2], a[r][3], s + r * bc);
}

// acc_r[x0, x0 + NV*L) += sum_jj p_r[jj] * V_jj[x0, ...) over keys jj in [0, n) for the RT rows of
// the tile (p: stride bc; acc: stride dvp; V row jj at rows[jj] + off). Keys with P == 0 are
// skipped per row (masked keys: their V may hold anything, and 0 * NaN would be NaN): bit jj of
// `all` says every row of the tile is active and has P != 0 at jj (one shared FMA pass);
// otherwise each row is checked. cnt < L: only the first cnt elements of the (single) vector.
// kExact as in ScoresTile: the redo starts again from acc, which the tile stores only at its end.
template <DType T, int RT, int NV, bool kExact = (T != DType::f8e4m3 || !kE4m3Watch)>
HWY_INLINE void PVTile(const float* HWY_RESTRICT p, size_t bc, const float* act, const uint8_t* const* rows,
                       int64_t off, size_t n, uint64_t all, size_t x0, size_t cnt, float* HWY_RESTRICT acc,
                       size_t dvp) {
  const DF df;
  const size_t L = hn::Lanes(df);
  [[maybe_unused]] VW mx = hn::Zero(DW());
  [[maybe_unused]] bool nan = false;
  VF a[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int u = 0; u < NV; ++u) a[r][u] = hn::LoadU(df, acc + r * dvp + x0 + u * L);
  for (size_t jj = 0; jj < n; ++jj) {
    const uint8_t* row = rows[jj] + off;
    VF v[NV];
    if (NV == 1 && cnt < L) {
      v[0] = LoadCvtN<T>(row, x0, cnt);
    } else {
      if constexpr (!kExact) {
        const size_t LW = hn::Lanes(DW()), bytes = NV * L;
        size_t i = 0;
        for (; i + LW <= bytes; i += LW) mx = WatchE4m3(mx, row + x0 + i);
        for (; i < bytes; i += L) nan |= ChunkHasE4m3NaN(row + x0 + i);
      }
      for (int u = 0; u < NV; ++u) v[u] = LoadCvt<T, kExact>(row, x0 + u * L);
    }
    if ((all >> jj) & 1) {
      for (int r = 0; r < RT; ++r) {
        const VF pv = hn::Set(df, p[r * bc + jj]);
        for (int u = 0; u < NV; ++u) a[r][u] = hn::MulAdd(pv, v[u], a[r][u]);
      }
    } else {
      for (int r = 0; r < RT; ++r) {
        const float pr = p[r * bc + jj];
        if (act[r] == 0.0f || pr == 0.0f) continue;
        const VF pv = hn::Set(df, pr);
        for (int u = 0; u < NV; ++u) a[r][u] = hn::MulAdd(pv, v[u], a[r][u]);
      }
    }
  }
  if constexpr (!kExact) {
    if (nan || SawE4m3NaN(mx)) return PVTile<T, RT, NV, true>(p, bc, act, rows, off, n, all, x0, cnt, acc, dvp);
  }
  for (int r = 0; r < RT; ++r)
    for (int u = 0; u < NV; ++u) hn::StoreU(a[r][u], df, acc + r * dvp + x0 + u * L);
}

template <DType T, int RT>
HWY_INLINE void PVRows(const float* p, size_t bc, const float* act, const uint8_t* const* rows, int64_t off,
                       size_t n, uint64_t all, size_t dv, float* acc, size_t dvp) {
  const size_t L = hn::Lanes(DF());
  constexpr int NV = 4;
  size_t x = 0;
  for (; x + NV * L <= dv; x += NV * L) PVTile<T, RT, NV>(p, bc, act, rows, off, n, all, x, L, acc, dvp);
  for (; x < dv; x += L) PVTile<T, RT, 1>(p, bc, act, rows, off, n, all, x, std::min(L, dv - x), acc, dvp);
}

template <DType T>
HWY_INLINE void ScoresDispatch(int64_t rt, const float* q, size_t dp, const uint8_t* const* rows4, size_t d,
                               float* s, size_t bc) {
  switch (rt) {
    case 1: ScoresTile<T, 1>(q, dp, rows4, d, s, bc); break;
    case 2: ScoresTile<T, 2>(q, dp, rows4, d, s, bc); break;
#if HWY_TARGET <= HWY_AVX3
    case 3: ScoresTile<T, 3>(q, dp, rows4, d, s, bc); break;
    case 4: ScoresTile<T, 4>(q, dp, rows4, d, s, bc); break;
#endif
    default: break;
  }
}

template <DType T>
HWY_INLINE void PVDispatch(int64_t rt, const float* p, size_t bc, const float* act, const uint8_t* const* rows,
                           int64_t off, size_t n, uint64_t all, size_t dv, float* acc, size_t dvp) {
  switch (rt) {
    case 1: PVRows<T, 1>(p, bc, act, rows, off, n, all, dv, acc, dvp); break;
    case 2: PVRows<T, 2>(p, bc, act, rows, off, n, all, dv, acc, dvp); break;
#if HWY_TARGET <= HWY_AVX3
    case 3: PVRows<T, 3>(p, bc, act, rows, off, n, all, dv, acc, dvp); break;
    case 4: PVRows<T, 4>(p, bc, act, rows, off, n, all, dv, acc, dvp); break;
#endif
    default: break;
  }
}

// ---- one task: (sequence b, kv heads [hk0, hk1), split) ------------------------------------

// Steady software prefetch distance, in tokens (all the task's kv heads of each), and the key
// group that the score and P.V passes walk token by token across the heads.
constexpr int64_t kPrefetchTokens = 16;
constexpr int64_t kGroupKeys = 8;
static_assert(kPrefetchTokens <= kBlockKeys, "the prefetch looks at most one block ahead");
static_assert(kBlockKeys % kGroupKeys == 0 && kGroupKeys % 4 == 0, "groups tile the block, 4 keys per score tile");

// kAmx: the AMX variant (i8 always where the CPU has AMX-INT8; f8e4m3 only on request, see
// RunChunk); the kAmx = false instantiations contain no AMX code at all.
template <DType T, bool kAmx = false>
void RunChunkT(const DecodeProblem& p, int64_t b, int64_t hk0, int64_t hk1, int split, uint8_t* scratch) {
  const DF df;
  const DI di;
  const size_t L = hn::Lanes(df);
  const int64_t len = p.cache_seqlens_host[b];
  int64_t k0, k1;
  decode_split_range(p, len, split, &k0, &k1);
  const bool direct = p.num_splits == 1;
  if (!direct && k1 <= k0) return;  // the merge skips empty splits

  const int64_t g = p.group(), sq = p.seqlen_q, R = p.rows_per_group(), H = hk1 - hk0, RH = H * R;
  const size_t d = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.head_dim_v);
  const size_t dp = static_cast<size_t>(pad_floats(p.head_dim)), dvp = static_cast<size_t>(pad_floats(p.head_dim_v));
  const size_t bc = static_cast<size_t>(kBlockKeys);
  const ScratchLayout sl = scratch_layout(RH, p.head_dim, p.head_dim_v);
  float* const qf = reinterpret_cast<float*>(scratch + sl.qf);
  float* const sc = reinterpret_cast<float*>(scratch + sl.s);
  float* const acc = reinterpret_cast<float*>(scratch + sl.acc);
  float* const m = reinterpret_cast<float*>(scratch + sl.m);
  float* const l = reinterpret_cast<float*>(scratch + sl.l);
  float* const bad = reinterpret_cast<float*>(scratch + sl.bad);
  float* const act = reinterpret_cast<float*>(scratch + sl.act);
  int64_t* const lo = reinterpret_cast<int64_t*>(scratch + sl.lo);
  int64_t* const hi = reinterpret_cast<int64_t*>(scratch + sl.hi);
  uint64_t* const pnz = reinterpret_cast<uint64_t*>(scratch + sl.pnz);
  uint64_t* const tall = reinterpret_cast<uint64_t*>(scratch + sl.tall);
  int32_t* const tany = reinterpret_cast<int32_t*>(scratch + sl.tany);
  int32_t* const tsee = reinterpret_cast<int32_t*>(scratch + sl.tsee);

  // f8e4m3 rows load as value * 2^-8 (LoadCvt): the 2^8 joins the scales (exact, a power of 2).
  const float unit = T == DType::f8e4m3 ? kE4m3Unit : 1.0f;
  const int64_t q_esize = dtype_size(p.dtype), c_esize = dtype_size(p.cache_dtype);

  // Rows rho = (hk - hk0) * R + r: visible keys within this split (the same for every head),
  // state, and the pre-scaled Q row.
  int64_t klo = k1, khi = k0;
  for (int64_t rho = 0; rho < RH; ++rho) {
    const int64_t hk = hk0 + rho / R, r = rho % R, hh = r / sq, i = r % sq, h = hk * g + hh;
    int64_t a = 0, z = 0;
    if (len > 0) {
      visible_keys(i, sq, len, p.window_left, p.window_right, &a, &z);
      a = std::max(a, k0);
      z = std::min(z, k1);
    }
    lo[rho] = a;
    hi[rho] = z;
    if (a < z) {
      klo = std::min(klo, a);
      khi = std::max(khi, z);
    }
    m[rho] = ninf();
    l[rho] = 0.0f;
    bad[rho] = 0.0f;
    std::memset(acc + rho * dvp, 0, dvp * sizeof(float));
    const int64_t qoff = b * p.q_stride.batch + i * p.q_stride.seq + h * p.q_stride.head;
    float* qr = qf + rho * dp;
    ConvertRow(p.dtype, static_cast<const uint8_t*>(p.q) + qoff * q_esize, d, dp, qr);
    const VF vm = hn::Set(df, p.scale * (p.k_scale ? p.k_scale[hk] : 1.0f) * unit);
    for (size_t x = 0; x < dp; x += L) hn::StoreU(hn::Mul(hn::LoadU(df, qr + x), vm), df, qr + x);
  }

  // i8 caches on CPUs with AMX-INT8: Q.K^T and P.V as int8 tile products (serving_amx.hpp).
  // Per task: off when a Q row is not finite (the fp32 path propagates NaN / inf).
  [[maybe_unused]] bool use_amx = false;
#if IOATTN_AMX_TARGET
  int8_t* const amxq = reinterpret_cast<int8_t*>(scratch + sl.amxq);
  float* const amxm = reinterpret_cast<float*>(scratch + sl.amxm);
  int8_t* const amxp = reinterpret_cast<int8_t*>(scratch + sl.amxp);
  uint8_t* const amxs = scratch + sl.amxs;
  // Q limb / part bytes per head: groups of 4 rows x (d / 64) KiB (i8) or (d / 32) KiB (f8e4m3)
  const size_t amx_head = static_cast<size_t>((R + 3) / 4) * (d / (T == DType::i8 ? 64 : 32)) * 1024;
  if constexpr (kAmx && T == DType::i8) {
    if (d % 64 == 0 && dv % 64 == 0 && d <= 512) {
      use_amx = true;
      for (int64_t hh = 0; hh < H && use_amx; ++hh)
        use_amx = amx_pack_q(qf + hh * R * dp, dp, d, R, amxq + hh * amx_head, amxm + hh * R);
      if (use_amx) amx_begin();
    }
  } else if constexpr (kAmx && T == DType::f8e4m3) {
    if (d % 32 == 0 && dv % 32 == 0) {
      use_amx = true;
      for (int64_t hh = 0; hh < H && use_amx; ++hh)
        use_amx = amx_pack_q_bf16(qf + hh * R * dp, dp, d, R, reinterpret_cast<uint16_t*>(amxq + hh * amx_head),
                                  amxm + hh * R);
      if (use_amx) amx_begin();
    }
  }
#endif

  const float cap = p.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
  const VF vninf = hn::Set(df, ninf()), vpinf = hn::Set(df, std::numeric_limits<float>::infinity());
  const auto iota0 = hn::Iota(di, 0);  // hoisted: Iota is a stack round trip on some targets
  // Row pointers (kv head hk0) of the current block [0, n) followed by the next block's [n, n +
  // nn); head hk's row is hk - hk0 head strides further. The passes walk the block token by
  // token across the heads (with the usual layout [pages, page_size, kv_heads, d], one
  // contiguous stream), and a steady prefetch runs kPrefetchTokens ahead, across the block edge.
  const uint8_t* k_rows[2 * kBlockKeys];
  const uint8_t* v_rows[2 * kBlockKeys];
  const int64_t k_bytes = static_cast<int64_t>(d) * c_esize, v_bytes = static_cast<int64_t>(dv) * c_esize;
  const int64_t k_head = p.k_stride.head * c_esize, v_head = p.v_stride.head * c_esize;
  auto prefetch_k = [&](const uint8_t* row) {
    for (int64_t hh = 0; hh < H; ++hh) prefetch_row(row + hh * k_head, k_bytes);
  };
  auto prefetch_v = [&](const uint8_t* row) {
    for (int64_t hh = 0; hh < H; ++hh) prefetch_row(row + hh * v_head, v_bytes);
  };
  if (klo < khi) {
    const int64_t n0 = std::min<int64_t>(kBlockKeys, khi - klo);
    block_rows(p, b, hk0, klo, n0, k_rows, v_rows);
    for (int64_t jj = 0; jj < std::min(n0, kPrefetchTokens); ++jj) {
      prefetch_k(k_rows[jj]);
      prefetch_v(v_rows[jj]);
    }
  }
  const int64_t ntiles = (R + kMaxRowTile - 1) / kMaxRowTile;  // row tiles per head
  for (int64_t j0 = klo; j0 < khi; j0 += kBlockKeys) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(kBlockKeys, khi - j0));
    const size_t nv = (n + L - 1) / L * L;
    const int64_t next = j0 + kBlockKeys;
    const size_t nn = next < khi ? static_cast<size_t>(std::min<int64_t>(kBlockKeys, khi - next)) : 0;
    if (nn) block_rows(p, b, hk0, next, static_cast<int64_t>(nn), k_rows + n, v_rows + n);
    const size_t pf_end = n + nn;  // prefetch targets jj + kPrefetchTokens < pf_end

    // Which row tiles see a key of the block (the same for every head).
    bool any_sees = false;
    for (int64_t t = 0; t < ntiles; ++t) {
      tsee[t] = 0;
      for (int64_t r = t * kMaxRowTile; r < std::min<int64_t>(R, (t + 1) * kMaxRowTile); ++r)
        if (lo[r] < j0 + static_cast<int64_t>(n) && hi[r] > j0) tsee[t] = 1;
      any_sees |= tsee[t] != 0;
    }

    // S = Q K^T: 4 keys at a time, every head, RT rows per tile; the padding keys of the last
    // group reuse row n - 1 (their scores are masked below: key >= khi).
    bool amx_done = false;
#if IOATTN_AMX_TARGET
    if (kAmx && any_sees && use_amx) {
      // 16 keys per tile product, every head. Rows that see no key get scores nobody reads.
      // Prefetch, i8: K rows 16 tokens ahead inside amx_scores16 behind its tile loads, V rows of
      // the next block inside amx_pv64's staging loop (in front of the tile loads, or all V rows
      // here in one burst per head: 0.82-0.89x, docs/PERF.md). f8e4m3 (opt-in): both here.
      for (size_t jj = 0; jj < n; jj += 16) {
        const size_t pf0 = jj + kPrefetchTokens, pf1 = std::min(pf0 + 16, pf_end);
        const uint8_t* rows16[16];
        for (size_t k = 0; k < 16; ++k) rows16[k] = k_rows[std::min(jj + k, n - 1)];
        if constexpr (T == DType::i8) {
          for (int64_t hh = 0; hh < H; hh += 2) {  // two heads per call: two independent tile chains
            const bool two = hh + 1 < H;
            const int64_t h1 = two ? hh + 1 : hh;
            amx_scores16(rows16, hh * k_head, h1 * k_head, d, amxq + hh * amx_head,
                         two ? amxq + h1 * amx_head : nullptr, R, amxm + hh * R, amxm + h1 * R, sc + hh * R * bc + jj,
                         sc + h1 * R * bc + jj, bc, amxs, k_rows + pf0, pf1 > pf0 ? pf1 - pf0 : 0);
          }
        } else {  // all heads per call (the conversion of the next pair runs ahead of the tiles)
          for (int64_t hh = 0; hh < H; ++hh)
            for (size_t k = pf0; k < pf1; ++k) {
              prefetch_row(k_rows[k] + hh * k_head, k_bytes);
              prefetch_row(v_rows[k] + hh * v_head, v_bytes);
            }
          amx_scores16_e4m3(rows16, H, k_head, d, reinterpret_cast<const uint16_t*>(amxq), amx_head / 2, R, amxm,
                            sc + jj, bc, amxs);
        }
      }
      amx_done = true;
    }
#endif
    if (any_sees && !amx_done) {
      for (size_t jj = 0; jj < n; jj += 4) {
        const size_t pf0 = jj + kPrefetchTokens, pf1 = std::min(pf0 + 4, pf_end);
        const uint8_t* rows4[4];
        for (size_t k = 0; k < 4; ++k) rows4[k] = k_rows[std::min(jj + k, n - 1)];
        for (int64_t hh = 0; hh < H; ++hh) {
          for (size_t k = pf0; k < pf1; ++k) prefetch_row(k_rows[k] + hh * k_head, k_bytes);  // spread over the heads
          const uint8_t* hrows[4] = {rows4[0] + hh * k_head, rows4[1] + hh * k_head, rows4[2] + hh * k_head,
                                     rows4[3] + hh * k_head};
          for (int64_t t = 0; t < ntiles; ++t) {
            if (!tsee[t]) continue;
            const int64_t rho0 = hh * R + t * kMaxRowTile, rt = std::min<int64_t>(kMaxRowTile, R - t * kMaxRowTile);
            ScoresDispatch<T>(rt, qf + rho0 * dp, dp, hrows, d, sc + rho0 * bc + jj, bc);
          }
        }
      }
    }

    bool any_p = false;
    for (int64_t rho = 0; rho < RH; ++rho) {
      float* s = sc + rho * bc;
      act[rho] = 0.0f;
      if (lo[rho] >= j0 + static_cast<int64_t>(n) || hi[rho] <= j0) continue;  // sees no key of the block
      const int64_t r = rho % R, i = r % sq, h = (hk0 + rho / R) * g + r / sq;
      const float diag = static_cast<float>(i + len - sq);
      const VF vslope = hn::Set(df, p.alibi_slopes ? p.alibi_slopes[h] : 0.0f);
      const auto vlo = hn::Set(di, static_cast<int32_t>(lo[rho])), vhi = hn::Set(di, static_cast<int32_t>(hi[rho]));
      VF mx = vninf;
      auto nonfinite = hn::Lt(vpinf, vpinf);  // all false
      for (size_t x = 0; x < nv; x += L) {
        VF v = hn::LoadU(df, s + x);
        const auto key = hn::Add(iota0, hn::Set(di, static_cast<int32_t>(j0 + static_cast<int64_t>(x))));
        if (cap > 0) v = hn::Mul(hn::Set(df, cap), hn::Tanh(df, hn::Mul(v, hn::Set(df, inv_cap))));
        if (p.alibi_slopes)
          v = hn::NegMulAdd(vslope, hn::Abs(hn::Sub(hn::Set(df, diag), hn::ConvertTo(df, key))), v);
        const auto visible = hn::AndNot(hn::Lt(key, vlo), hn::Lt(key, vhi));  // lo <= key < hi
        v = hn::IfThenElse(hn::RebindMask(df, visible), v, vninf);
        nonfinite = hn::Or(nonfinite, hn::Not(hn::Lt(v, vpinf)));
        mx = hn::Max(mx, v);
        hn::StoreU(v, df, s + x);
      }
      if (!hn::AllFalse(df, nonfinite)) bad[rho] = 1.0f;
      const float m_blk = hn::GetLane(hn::MaxOfLanes(df, mx));
      const float m_new = std::max(m[rho], m_blk);
      if (m_new == ninf()) continue;  // nothing visible yet: P = 0 for the whole block
      const float alpha = std::exp(m[rho] - m_new);  // m = -inf -> 0
      const VF vm = hn::Set(df, m_new);
      VF sum = hn::Zero(df);
      uint64_t nz = 0;
      for (size_t x = 0; x < nv; x += L) {
        const VF v = hn::LoadU(df, s + x);
        const VF e = hn::IfThenElseZero(hn::Gt(v, vninf), hn::Exp(df, hn::Sub(v, vm)));
        sum = hn::Add(sum, e);
        hn::StoreU(e, df, s + x);
        uint64_t bits = 0;
        hn::StoreMaskBits(df, hn::Ne(e, hn::Zero(df)), reinterpret_cast<uint8_t*>(&bits));
        nz |= (bits & ((uint64_t{1} << L) - 1)) << x;
      }
      pnz[rho] = nz;
      l[rho] = l[rho] * alpha + hn::GetLane(hn::SumOfLanes(df, sum));
      m[rho] = m_new;
      if (alpha != 1.0f) {
        float* ar = acc + rho * dvp;
        const VF va = hn::Set(df, alpha);
        for (size_t x = 0; x < dvp; x += L) hn::StoreU(hn::Mul(hn::LoadU(df, ar + x), va), df, ar + x);
      }
      act[rho] = 1.0f;
      any_p = true;
    }

    amx_done = false;
#if IOATTN_AMX_TARGET
    if (kAmx && any_p && use_amx) {
      for (int64_t hh = 0; hh < H; ++hh) {
        if constexpr (T == DType::i8) {
          amx_pv64(sc + hh * R * bc, bc, act + hh * R, R, v_rows, hh * v_head, n, dv, acc + hh * R * dvp, dvp, amxp,
                   amxs, nn);
        } else {
          amx_pv64_e4m3(sc + hh * R * bc, bc, act + hh * R, R, v_rows, hh * v_head, n, dv, acc + hh * R * dvp, dvp,
                        reinterpret_cast<uint16_t*>(amxp), amxs);
        }
      }
      amx_done = true;
    }
#endif
    if (any_p && !amx_done) {
      // Per (head, row tile): bit jj set when every row of the tile has P != 0 at key jj.
      const int64_t nt = H * ntiles;
      for (int64_t ti = 0; ti < nt; ++ti) {
        const int64_t hh = ti / ntiles, t = ti % ntiles, rho0 = hh * R + t * kMaxRowTile;
        const int64_t rt = std::min<int64_t>(kMaxRowTile, R - t * kMaxRowTile);
        uint64_t a = n == 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
        bool any = false;
        for (int64_t rho = rho0; rho < rho0 + rt; ++rho) {
          if (act[rho] == 0.0f) {
            a = 0;
            continue;
          }
          any = true;
          a &= pnz[rho];
        }
        tall[ti] = a;
        tany[ti] = any;
      }
      // Acc += P V: kGroupKeys keys at a time, every head, RT rows per tile.
      for (size_t j = 0; j < n; j += kGroupKeys) {
        const size_t gn = std::min<size_t>(kGroupKeys, n - j);
        const size_t pf0 = j + kPrefetchTokens, pf1 = std::min(pf0 + kGroupKeys, pf_end);
        for (int64_t ti = 0; ti < nt; ++ti) {
          const int64_t hh = ti / ntiles, t = ti % ntiles, rho0 = hh * R + t * kMaxRowTile;
          if (t == 0)
            for (size_t k = pf0; k < pf1; ++k) prefetch_row(v_rows[k] + hh * v_head, v_bytes);  // spread over the heads
          if (!tany[ti]) continue;
          const int64_t rt = std::min<int64_t>(kMaxRowTile, R - t * kMaxRowTile);
          PVDispatch<T>(rt, sc + rho0 * bc + j, bc, act + rho0, v_rows + j, hh * v_head, gn, tall[ti] >> j, dv,
                        acc + rho0 * dvp, dvp);
        }
      }
    }
    // The next block's rows move to the front.
    std::copy(k_rows + n, k_rows + n + nn, k_rows);
    std::copy(v_rows + n, v_rows + n + nn, v_rows);
  }

  // Finish: O and LSE directly (one split), or this split's partial.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t rho = 0; rho < RH; ++rho) {
    const int64_t hk = hk0 + rho / R, r = rho % R, i = r % sq, h = hk * g + r / sq;
    const float v_scale = (p.v_scale ? p.v_scale[hk] : 1.0f) * unit;
    float* ar = acc + rho * dvp;
#if IOATTN_AMX_TARGET
    if (kAmx && use_amx) amx_unpermute(ar, dv, T == DType::i8 ? 64 : 32);
#endif
    float lse_r;
    if (bad[rho] != 0.0f) {
      std::fill(ar, ar + dv, nan);
      lse_r = nan;
    } else if (direct) {
      const float sink = p.sinks ? p.sinks[h] : ninf();
      const float mx = std::max(m[rho], sink);
      if (mx == ninf()) {
        std::fill(ar, ar + dv, 0.0f);
        lse_r = ninf();
      } else {
        const float a = std::exp(m[rho] - mx);  // m = -inf (only the sink) -> 0, and acc = 0
        const float lsum = l[rho] * a + (p.sinks ? std::exp(sink - mx) : 0.0f);
        const float mul = a * v_scale / lsum;
        for (size_t x = 0; x < dv; ++x) ar[x] *= mul;
        lse_r = mx + std::log(lsum);
      }
    } else if (l[rho] == 0.0f) {  // no visible key in this split
      std::fill(ar, ar + dv, 0.0f);
      lse_r = ninf();
    } else {
      const float mul = v_scale / l[rho];
      for (size_t x = 0; x < dv; ++x) ar[x] *= mul;
      lse_r = m[rho] + std::log(l[rho]);
    }
    if (direct) {
      const int64_t ooff = b * p.o_stride.batch + i * p.o_stride.seq + h * p.o_stride.head;
      for (size_t x = 0; x < dv; ++x) store_float(p.o, p.dtype, ooff + static_cast<int64_t>(x), ar[x]);
      if (p.lse) p.lse[b * p.lse_stride.batch + h * p.lse_stride.head + i * p.lse_stride.seq] = lse_r;
    } else {
      const int64_t at = ((b * p.heads_q + h) * sq + i) * p.num_splits + split;  // [b, h, i, split]
      std::memcpy(p.partial_o + at * static_cast<int64_t>(dv), ar, dv * sizeof(float));
      p.partial_lse[at] = lse_r;
    }
  }
#if IOATTN_AMX_TARGET
  if (kAmx && use_amx) amx_end();
#endif
}

void RunChunk(const DecodeProblem& p, int64_t b, int64_t hk0, int64_t hk1, int split, uint8_t* scratch) {
  switch (p.cache_dtype) {
    case DType::f32: return RunChunkT<DType::f32>(p, b, hk0, hk1, split, scratch);
    case DType::bf16: return RunChunkT<DType::bf16>(p, b, hk0, hk1, split, scratch);
    case DType::f16: return RunChunkT<DType::f16>(p, b, hk0, hk1, split, scratch);
#if IOATTN_AMX_TARGET
    case DType::i8:
      return amx_usable() ? RunChunkT<DType::i8, true>(p, b, hk0, hk1, split, scratch)
                          : RunChunkT<DType::i8>(p, b, hk0, hk1, split, scratch);
    case DType::f8e4m3:
      return amx_e4m3_requested() ? RunChunkT<DType::f8e4m3, true>(p, b, hk0, hk1, split, scratch)
                                  : RunChunkT<DType::f8e4m3>(p, b, hk0, hk1, split, scratch);
#else
    case DType::i8: return RunChunkT<DType::i8>(p, b, hk0, hk1, split, scratch);
    case DType::f8e4m3: return RunChunkT<DType::f8e4m3>(p, b, hk0, hk1, split, scratch);
#endif
    default: return;  // validation admits no other dtype
  }
}

int64_t TargetBits() { return HWY_TARGET; }

}  // namespace HWY_NAMESPACE
}  // namespace ioattn::detail::serving
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ioattn::detail {
namespace serving {
HWY_EXPORT(RunChunk);
HWY_EXPORT(TargetBits);

// Merges the splits of one query row of the workspace into O and LSE (see the file comment).
void MergeRow(const DecodeProblem& p, int64_t b, int64_t h, int64_t i) {
  const int64_t S = p.num_splits, dv = p.head_dim_v, sq = p.seqlen_q;
  const int64_t len = p.cache_seqlens_host[b];
  const int64_t row = (b * p.heads_q + h) * sq + i;
  float* po = p.partial_o + row * S * dv;  // [S, dv] of this row
  const float* pl = p.partial_lse + row * S;
  const float sink = p.sinks ? p.sinks[h] : ninf();
  int used = 0;  // splits with a non-empty key range: a prefix 0..used-1
  for (int s = 0; s < S; ++s) {
    int64_t k0, k1;
    decode_split_range(p, len, s, &k0, &k1);
    if (k1 > k0) used = s + 1;
  }
  float mx = sink;
  bool nan = false;
  for (int s = 0; s < used; ++s) {
    nan |= std::isnan(pl[s]);
    mx = std::max(mx, pl[s]);
  }
  const int64_t ooff = b * p.o_stride.batch + i * p.o_stride.seq + h * p.o_stride.head;
  float* lse_out = p.lse ? p.lse + b * p.lse_stride.batch + h * p.lse_stride.head + i * p.lse_stride.seq : nullptr;
  if (nan || mx == ninf() || used == 0) {  // poisoned, or no key and no sink, or only the sink
    if (!nan && mx != ninf()) {
      for (int64_t x = 0; x < dv; ++x) store_float(p.o, p.dtype, ooff + x, 0.0f);
      if (lse_out) *lse_out = sink;
      return;
    }
    const float fill = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    for (int64_t x = 0; x < dv; ++x) store_float(p.o, p.dtype, ooff + x, fill);
    if (lse_out) *lse_out = nan ? fill : ninf();
    return;
  }
  float total = p.sinks ? std::exp(sink - mx) : 0.0f;
  // Accumulate into split 0's slot (ours): out = sum_s w_s O_s.
  const float w0 = std::exp(pl[0] - mx);  // -inf -> 0
  total += w0;
  for (int64_t x = 0; x < dv; ++x) po[x] *= w0;
  for (int s = 1; s < used; ++s) {
    const float w = std::exp(pl[s] - mx);
    total += w;
    if (w == 0.0f) continue;
    const float* os = po + s * dv;
    for (int64_t x = 0; x < dv; ++x) po[x] += w * os[x];
  }
  const float inv = 1.0f / total;
  for (int64_t x = 0; x < dv; ++x) store_float(p.o, p.dtype, ooff + x, po[x] * inv);
  if (lse_out) *lse_out = mx + std::log(total);
}

}  // namespace serving

// ---- split heuristic -----------------------------------------------------------------------
//
// Decode reads K and V once per (sequence, kv head); beyond batch * heads_kv independent tasks,
// parallelism comes only from splitting the KV range. Aim for kTasksPerThread tasks per thread
// (dynamic scheduling evens out ragged cache lengths), but keep every chunk at least
// kMinChunkTokens long: a split costs a partial (rows x dv fp32) write plus its merge read, which
// must stay small next to the chunk's K/V bytes (256 tokens x 128 dims x 2 (K, V) x 2 B = 128 KiB
// vs 4 rows x 128 x 4 B = 2 KiB for GQA 4, bf16).
//   work   = batch * heads_kv
//   splits = 1                                          if work >= kTasksPerThread * threads
//          = ceil(kTasksPerThread * threads / work)      otherwise,
//   capped by ceil(max_seqlen_k / kMinChunkTokens) and kMaxSplits; at least 1.
// E.g. 16 threads, batch 1, 8 kv heads, 32k tokens: 4 splits (32 tasks of 8k tokens); batch 16:
// 1 split (128 tasks).
int cpu_decode_num_splits(int64_t batch, int64_t heads_kv, int64_t max_seqlen_k, int threads, std::string* why) {
  constexpr int64_t kTasksPerThread = 2;
  constexpr int64_t kMinChunkTokens = 256;
  const int64_t work = std::max<int64_t>(1, batch * heads_kv);
  const int64_t want = kTasksPerThread * std::max(threads, 1);
  int64_t splits = work >= want ? 1 : (want + work - 1) / work;
  const int64_t by_len = std::max<int64_t>(1, (max_seqlen_k + kMinChunkTokens - 1) / kMinChunkTokens);
  splits = std::clamp<int64_t>(std::min(splits, by_len), 1, kMaxSplits);
  if (why)
    *why = "batch*heads_kv " + std::to_string(work) + " tasks for " + std::to_string(threads) + " threads (want " +
           std::to_string(want) + "), max_seqlen_k " + std::to_string(max_seqlen_k) + " allows " +
           std::to_string(by_len) + " chunks of >= " + std::to_string(kMinChunkTokens) + " tokens";
  return static_cast<int>(splits);
}

void decode_split_range(const DecodeProblem& p, int64_t len, int split, int64_t* k0, int64_t* k1) {
  *k0 = *k1 = 0;
  if (len <= 0) return;
  // The visible ranges are monotone in the row, so row 0 bounds the start and the last row the
  // end; consecutive rows' windows overlap or touch, so the union has no hole.
  int64_t lo_first, hi_first, lo_last, hi_last;
  visible_keys(0, p.seqlen_q, len, p.window_left, p.window_right, &lo_first, &hi_first);
  visible_keys(p.seqlen_q - 1, p.seqlen_q, len, p.window_left, p.window_right, &lo_last, &hi_last);
  const int64_t span = hi_last - lo_first;
  if (span <= 0) return;
  int64_t chunk = (span + p.num_splits - 1) / p.num_splits;
  chunk = (chunk + kSplitAlignTokens - 1) / kSplitAlignTokens * kSplitAlignTokens;
  *k0 = lo_first + split * chunk;
  *k1 = std::min(hi_last, *k0 + chunk);
}

DecodeLayout cpu_decode_layout(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int64_t head_dim,
                               int64_t head_dim_v, int num_splits, int threads) {
  using serving::align_bytes;
  DecodeLayout lay;
  const size_t rows = static_cast<size_t>(batch * heads_q * seqlen_q);
  const size_t S = num_splits > 1 ? static_cast<size_t>(num_splits) : 0;  // one split: no partials
  lay.o_offset = 0;
  lay.lse_offset = align_bytes(rows * S * static_cast<size_t>(head_dim_v) * 4);
  lay.scratch_offset = lay.lse_offset + align_bytes(rows * S * 4);
  const int64_t R = heads_q / heads_kv * seqlen_q;
  lay.scratch_bytes_per_thread =
      serving::scratch_layout(serving::max_heads_per_task(heads_kv, R) * R, head_dim, head_dim_v).bytes;
  lay.scratch_threads = threads;
  lay.total_bytes = lay.scratch_offset + static_cast<size_t>(std::max(threads, 0)) * lay.scratch_bytes_per_thread;
  return lay;
}

DecodeLayout cpu_decode_layout_for_bytes(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seqlen_q,
                                         int64_t head_dim, int64_t head_dim_v, int num_splits, size_t workspace_bytes) {
  DecodeLayout lay = cpu_decode_layout(batch, heads_q, heads_kv, seqlen_q, head_dim, head_dim_v, num_splits, 1);
  const size_t room = workspace_bytes > lay.scratch_offset ? workspace_bytes - lay.scratch_offset : 0;
  lay.scratch_threads = static_cast<int>(room / lay.scratch_bytes_per_thread);
  if (lay.scratch_threads >= 1) lay.total_bytes = lay.scratch_offset + lay.scratch_threads * lay.scratch_bytes_per_thread;
  return lay;
}

void cpu_decode(const DecodeProblem& problem) {
  const int64_t S = problem.num_splits;
  if (problem.batch * problem.heads_kv * S == 0) return;
  const DecodeLayout lay =
      cpu_decode_layout_for_bytes(problem.batch, problem.heads_q, problem.heads_kv, problem.seqlen_q,
                                  problem.head_dim, problem.head_dim_v, problem.num_splits, problem.workspace_bytes);
  uint8_t* const ws = static_cast<uint8_t*>(problem.workspace);
  DecodeProblem p = problem;
  if (S > 1) {
    p.partial_o = reinterpret_cast<float*>(ws + lay.o_offset);
    p.partial_lse = reinterpret_cast<float*>(ws + lay.lse_offset);
  }
  uint8_t* const scratch = ws + lay.scratch_offset;
  const size_t slot_bytes = lay.scratch_bytes_per_thread;
  const int threads = std::max(1, std::min(p.num_threads, lay.scratch_threads));
  auto* const run_chunk = &HWY_DYNAMIC_DISPATCH(serving::RunChunk);

  // Tasks: (sequence, group of kv heads, split). As many heads per task as the scratch holds,
  // but at least 2 tasks per thread where the heads allow (the split count is the caller's).
  // Which heads share a task changes no result: every (head, split) is computed the same way.
  const int64_t hmax = serving::max_heads_per_task(p.heads_kv, p.rows_per_group());
  const int64_t seq_splits = p.batch * S, want = 2 * static_cast<int64_t>(threads);
  int64_t groups = std::max((p.heads_kv + hmax - 1) / hmax, (want + seq_splits - 1) / seq_splits);
  groups = std::min(groups, p.heads_kv);
  const int64_t hpt = (p.heads_kv + groups - 1) / groups;
  groups = (p.heads_kv + hpt - 1) / hpt;
  const int64_t ntasks = seq_splits * groups;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t id = 0; id < ntasks; ++id) {
    const int64_t b = id / (groups * S), hk0 = (id / S) % groups * hpt;
    const int split = static_cast<int>(id % S);
    run_chunk(p, b, hk0, std::min(p.heads_kv, hk0 + hpt), split,
              scratch + static_cast<size_t>(omp_get_thread_num()) * slot_bytes);
  }
  if (S == 1) return;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = row % p.seqlen_q, h = (row / p.seqlen_q) % p.heads_q, b = row / (p.seqlen_q * p.heads_q);
    serving::MergeRow(p, b, h, i);
  }
}

// ---- append_kv -----------------------------------------------------------------------------

namespace {

// dst[x] = src[x] converted to the cache dtype (8-bit: quantised with 1/scale, round to
// nearest, saturate).
void store_cache_row(const AppendProblem& p, const void* src, void* dst, int64_t n, float scale) {
  switch (p.cache_dtype) {
    case DType::f8e4m3: {
      auto* o = static_cast<uint8_t*>(dst);
      for (int64_t x = 0; x < n; ++x) o[x] = float_to_e4m3(load_float(src, p.new_dtype, x) / scale);
      break;
    }
    case DType::i8: {
      auto* o = static_cast<int8_t*>(dst);
      for (int64_t x = 0; x < n; ++x) o[x] = float_to_i8(load_float(src, p.new_dtype, x) / scale);
      break;
    }
    default:
      for (int64_t x = 0; x < n; ++x) store_float(dst, p.cache_dtype, x, load_float(src, p.new_dtype, x));
      break;
  }
}

int threads_for(int requested, int64_t work) {
  const int t = requested > 0 ? requested : cpu_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, work)));
}

}  // namespace

void cpu_append_kv(const AppendProblem& p) {
  if (p.tokens == 0) return;
  const int64_t ne = dtype_size(p.new_dtype), ce = dtype_size(p.cache_dtype);
  const int threads = threads_for(p.num_threads, p.tokens / 16 + 1);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < p.tokens; ++t) {
    const int64_t s = p.seqlen_new > 0 ? p.lengths_slot(t) : p.slot(t);
    if (s < 0) continue;  // padding (lengths mode: a token not appended)
    const int64_t page = s / p.page_size, off = s % p.page_size;
    for (int64_t hk = 0; hk < p.heads_kv; ++hk) {
      const auto* ksrc = static_cast<const uint8_t*>(p.k_new) + p.k_src(t, hk) * ne;
      const auto* vsrc = static_cast<const uint8_t*>(p.v_new) + p.v_src(t, hk) * ne;
      auto* kdst = static_cast<uint8_t*>(p.k_cache) + (page * p.k_stride.page + off * p.k_stride.slot + hk * p.k_stride.head) * ce;
      auto* vdst = static_cast<uint8_t*>(p.v_cache) + (page * p.v_stride.page + off * p.v_stride.slot + hk * p.v_stride.head) * ce;
      store_cache_row(p, ksrc, kdst, p.head_dim, p.k_scale ? p.k_scale[hk] : 1.0f);
      store_cache_row(p, vsrc, vdst, p.head_dim_v, p.v_scale ? p.v_scale[hk] : 1.0f);
    }
  }
}

// ---- merge_states --------------------------------------------------------------------------

void cpu_merge_states(const MergeProblem& p) {
  const int64_t rows = p.batch * p.seqlen * p.heads;
  if (rows == 0) return;
  const int64_t d = p.head_dim;
  const int threads = threads_for(p.num_threads, rows / 64 + 1);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t h = row % p.heads, s = (row / p.heads) % p.seqlen, b = row / (p.heads * p.seqlen);
    const float la = p.lse_a[b * p.la_stride.batch + h * p.la_stride.head + s * p.la_stride.seq];
    const float lb = p.lse_b[b * p.lb_stride.batch + h * p.lb_stride.head + s * p.lb_stride.seq];
    const int64_t oa = b * p.oa_stride.batch + s * p.oa_stride.seq + h * p.oa_stride.head;
    const int64_t ob = b * p.ob_stride.batch + s * p.ob_stride.seq + h * p.ob_stride.head;
    const int64_t oo = b * p.oo_stride.batch + s * p.oo_stride.seq + h * p.oo_stride.head;
    // Every input of the row is read before anything is written: the outputs may alias inputs.
    float buf[512];  // kMaxHeadDim
    float lse;
    if (std::isnan(la) || std::isnan(lb)) {
      std::fill(buf, buf + d, std::numeric_limits<float>::quiet_NaN());
      lse = std::numeric_limits<float>::quiet_NaN();
    } else {
      const float mx = std::max(la, lb);
      if (mx == serving::ninf()) {  // empty on both sides (-inf + -inf)
        std::fill(buf, buf + d, 0.0f);
        lse = mx;
      } else {
        const float wa = std::exp(la - mx), wb = std::exp(lb - mx);  // -inf -> 0
        const float tot = wa + wb;
        const float ca = wa / tot, cb = wb / tot;
        for (int64_t x = 0; x < d; ++x) {
          // A side with weight 0 is not read into the sum (its O may be anything, e.g. unset).
          float v = 0.0f;
          if (ca != 0.0f) v += ca * load_float(p.o_a, p.dtype, oa + x);
          if (cb != 0.0f) v += cb * load_float(p.o_b, p.dtype_b, ob + x);
          buf[x] = v;
        }
        lse = mx + std::log(tot);
      }
    }
    for (int64_t x = 0; x < d; ++x) store_float(p.o_out, p.dtype_out, oo + x, buf[x]);
    if (p.lse_out) p.lse_out[b * p.lo_stride.batch + h * p.lo_stride.head + s * p.lo_stride.seq] = lse;
  }
}

}  // namespace ioattn::detail
#endif  // HWY_ONCE

// CPU serving backend: split-KV decode (Flash-Decoding) over a paged or contiguous KV cache,
// append_kv into the cache, and merge_states. Highway SIMD with runtime ISA dispatch, OpenMP.
//
// What decode computes: for every sequence b and query row i (position cache_seqlens[b] -
// seqlen_q + i), attention over the cache's first cache_seqlens[b] tokens with ioattn's masks and
// score modifiers (include/ioattn/ioattn.hpp), fp32 accumulation, O in q's dtype, LSE in fp32.
//
// Work partition. A task is (sequence b, kv head hk, split s). The g = heads_q / heads_kv query
// heads of kv head hk times the seqlen_q rows form R = g * seqlen_q "query rows" r = hh *
// seqlen_q + i that are processed together (GQA packing), so every K/V row is read from the cache
// and dequantised once per task and reused by all R rows. The keys the sequence's rows can see
// at all (a contiguous range: the union of the rows' mask windows) are cut into num_splits equal
// chunks (decode_split_range); the tasks run in parallel (OpenMP, dynamic schedule).
//
// One task, per block of kBlockKeys keys:
//   K_blk (Bc, dp)  = the block's K rows converted to fp32 (8-bit: raw codes; the per-head k_scale
//                     is folded into the pre-scaled Q rows instead)
//   S (R, Bc)       = Q (R, dp) . K_blk^T          four keys per pass share each Q vector load
//   softcap, ALiBi, mask (select -inf, so a masked NaN key never reaches P), online softmax per
//   row (running max m, sum l, rescale of the accumulator when the max grows)
//   V_blk (Bc, dvp) = the block's V rows in fp32
//   Acc (R, dvp)   += P (R, Bc) . V_blk             keys with P == 0 are skipped (0 * NaN safety)
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
//  1. This version: GQA-packed split-KV tasks, fp32 partials in the caller's workspace,
//     f8e4m3 / i8 dequantised on load with the scale folded into Q / O.
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
#include "cpu/serving_quant.h"

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS HWY_SSSE3
#endif

namespace ioattn::detail::serving {

// ---- tile constants: should not affect results beyond fp32 rounding, only speed ----------
// 64 keys per block: the fp32 K and V blocks (64 x 128 x 4 B = 32 KiB each) stay in L1/L2 while
// all R rows use them. Rows are padded to 16 floats (one AVX-512 vector, four SSE vectors), so
// the SIMD loops have no tails; pads are written as zeros.
constexpr int64_t kBlockKeys = 64;
constexpr int64_t kPadFloats = 16;

inline int64_t pad_floats(int64_t n) { return (n + kPadFloats - 1) / kPadFloats * kPadFloats; }
inline size_t align_bytes(size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// One thread's scratch inside the workspace (byte offsets from the slot start).
struct ScratchLayout {
  size_t qf = 0;    // (R, dp)   Q rows in fp32, pre-multiplied by scale * k_scale
  size_t s = 0;     // (R, Bc)   scores, then P
  size_t kb = 0;    // (Bc, dp)  K block in fp32
  size_t vb = 0;    // (Bc, dvp) V block in fp32
  size_t acc = 0;   // (R, dvp)  O accumulators (unnormalised)
  size_t m = 0;     // (R)       running max
  size_t l = 0;     // (R)       running sum relative to m
  size_t bad = 0;   // (R)       non-zero: the row saw a NaN or +inf score
  size_t act = 0;   // (R)       non-zero: the row has P > 0 somewhere in the current block
  size_t lo = 0;    // (R) int64 first visible key of the row in this split
  size_t hi = 0;    // (R) int64 one past the last
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
  L.kb = take(bc * dp * 4);
  L.vb = take(bc * dvp * 4);
  L.acc = take(r * dvp * 4);
  L.m = take(r * 4);
  L.l = take(r * 4);
  L.bad = take(r * 4);
  L.act = take(r * 4);
  L.lo = take(r * 8);
  L.hi = take(r * 8);
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

// Software prefetch of one cache row into L2. Cache rows of one kv head are head_stride apart
// (1-4 KiB), one row per 4 KiB page or so: the hardware streamers, which stop at page
// boundaries, do not follow them, and without this the loop waits on DRAM latency per row.
inline void prefetch_row(const uint8_t* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 2);  // prefetcht1: the next block (up to 64 KiB) outlives L1
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

// ---- the block kernels -------------------------------------------------------------------

// s[jj] = q . k_jj for keys [0, n4), n4 a multiple of 4; dp a multiple of the vector length.
HWY_INLINE void ScoresRow(const float* HWY_RESTRICT q, const float* HWY_RESTRICT kb, size_t dp, size_t n4,
                          float* HWY_RESTRICT s) {
  const DF df;
  const size_t L = hn::Lanes(df);
  for (size_t jj = 0; jj < n4; jj += 4) {
    const float* k0 = kb + jj * dp;
    VF a0 = hn::Zero(df), a1 = hn::Zero(df), a2 = hn::Zero(df), a3 = hn::Zero(df);
    for (size_t x = 0; x < dp; x += L) {
      const VF qv = hn::LoadU(df, q + x);
      a0 = hn::MulAdd(qv, hn::LoadU(df, k0 + x), a0);
      a1 = hn::MulAdd(qv, hn::LoadU(df, k0 + dp + x), a1);
      a2 = hn::MulAdd(qv, hn::LoadU(df, k0 + 2 * dp + x), a2);
      a3 = hn::MulAdd(qv, hn::LoadU(df, k0 + 3 * dp + x), a3);
    }
    s[jj] = hn::GetLane(hn::SumOfLanes(df, a0));
    s[jj + 1] = hn::GetLane(hn::SumOfLanes(df, a1));
    s[jj + 2] = hn::GetLane(hn::SumOfLanes(df, a2));
    s[jj + 3] = hn::GetLane(hn::SumOfLanes(df, a3));
  }
}

// acc[x0, x0 + NV*L) += sum_jj p[jj] * vb[jj][x0, ...), skipping p == 0 (masked keys: their V
// may hold anything, and 0 * NaN would be NaN).
template <int NV>
HWY_INLINE void AccumulatePV(const float* HWY_RESTRICT p, const float* HWY_RESTRICT vb, size_t dvp, size_t n,
                             size_t x0, float* HWY_RESTRICT acc) {
  const DF df;
  const size_t L = hn::Lanes(df);
  VF a[NV];
  for (int u = 0; u < NV; ++u) a[u] = hn::LoadU(df, acc + x0 + u * L);
  for (size_t jj = 0; jj < n; ++jj) {
    if (p[jj] == 0.0f) continue;
    const VF pv = hn::Set(df, p[jj]);
    const float* v = vb + jj * dvp + x0;
    for (int u = 0; u < NV; ++u) a[u] = hn::MulAdd(pv, hn::LoadU(df, v + u * L), a[u]);
  }
  for (int u = 0; u < NV; ++u) hn::StoreU(a[u], df, acc + x0 + u * L);
}

// ---- one task: (sequence b, kv head hk, split) ---------------------------------------------

void RunChunk(const DecodeProblem& p, int64_t b, int64_t hk, int split, uint8_t* scratch) {
  const DF df;
  const DI di;
  const size_t L = hn::Lanes(df);
  const int64_t len = p.cache_seqlens_host[b];
  int64_t k0, k1;
  decode_split_range(p, len, split, &k0, &k1);
  const bool direct = p.num_splits == 1;
  if (!direct && k1 <= k0) return;  // the merge skips empty splits

  const int64_t g = p.group(), sq = p.seqlen_q, R = p.rows_per_group();
  const size_t d = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.head_dim_v);
  const size_t dp = static_cast<size_t>(pad_floats(p.head_dim)), dvp = static_cast<size_t>(pad_floats(p.head_dim_v));
  const size_t bc = static_cast<size_t>(kBlockKeys);
  const ScratchLayout sl = scratch_layout(R, p.head_dim, p.head_dim_v);
  float* const qf = reinterpret_cast<float*>(scratch + sl.qf);
  float* const sc = reinterpret_cast<float*>(scratch + sl.s);
  float* const kb = reinterpret_cast<float*>(scratch + sl.kb);
  float* const vb = reinterpret_cast<float*>(scratch + sl.vb);
  float* const acc = reinterpret_cast<float*>(scratch + sl.acc);
  float* const m = reinterpret_cast<float*>(scratch + sl.m);
  float* const l = reinterpret_cast<float*>(scratch + sl.l);
  float* const bad = reinterpret_cast<float*>(scratch + sl.bad);
  float* const act = reinterpret_cast<float*>(scratch + sl.act);
  int64_t* const lo = reinterpret_cast<int64_t*>(scratch + sl.lo);
  int64_t* const hi = reinterpret_cast<int64_t*>(scratch + sl.hi);

  const float k_scale = p.k_scale ? p.k_scale[hk] : 1.0f;
  const float v_scale = p.v_scale ? p.v_scale[hk] : 1.0f;
  const float q_mul = p.scale * k_scale;
  const int64_t q_esize = dtype_size(p.dtype), c_esize = dtype_size(p.cache_dtype);

  // Rows: visible keys within this split, state, and the pre-scaled Q row.
  int64_t klo = k1, khi = k0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t hh = r / sq, i = r % sq, h = hk * g + hh;
    int64_t a = 0, z = 0;
    if (len > 0) {
      visible_keys(i, sq, len, p.window_left, p.window_right, &a, &z);
      a = std::max(a, k0);
      z = std::min(z, k1);
    }
    lo[r] = a;
    hi[r] = z;
    if (a < z) {
      klo = std::min(klo, a);
      khi = std::max(khi, z);
    }
    m[r] = ninf();
    l[r] = 0.0f;
    bad[r] = 0.0f;
    std::memset(acc + r * dvp, 0, dvp * sizeof(float));
    const int64_t qoff = b * p.q_stride.batch + i * p.q_stride.seq + h * p.q_stride.head;
    float* qr = qf + r * dp;
    ConvertRow(p.dtype, static_cast<const uint8_t*>(p.q) + qoff * q_esize, d, dp, qr);
    const VF vm = hn::Set(df, q_mul);
    for (size_t x = 0; x < dp; x += L) hn::StoreU(hn::Mul(hn::LoadU(df, qr + x), vm), df, qr + x);
  }

  const float cap = p.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
  const VF vninf = hn::Set(df, ninf()), vpinf = hn::Set(df, std::numeric_limits<float>::infinity());
  // Row pointers of the current block and the next (prefetched while this one is computed).
  const uint8_t* k_rows[2][kBlockKeys];
  const uint8_t* v_rows[2][kBlockKeys];
  const int64_t k_bytes = static_cast<int64_t>(d) * c_esize, v_bytes = static_cast<int64_t>(dv) * c_esize;
  int cur = 0;
  if (klo < khi) {
    const int64_t n0 = std::min<int64_t>(kBlockKeys, khi - klo);
    block_rows(p, b, hk, klo, n0, k_rows[0], v_rows[0]);
    for (int64_t jj = 0; jj < n0; ++jj) {
      prefetch_row(k_rows[0][jj], k_bytes);
      prefetch_row(v_rows[0][jj], v_bytes);
    }
  }
  for (int64_t j0 = klo; j0 < khi; j0 += kBlockKeys, cur ^= 1) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(kBlockKeys, khi - j0));
    const size_t n4 = (n + 3) / 4 * 4, nv = (n + L - 1) / L * L;
    const int64_t next = j0 + kBlockKeys;
    const size_t nn = next < khi ? static_cast<size_t>(std::min<int64_t>(kBlockKeys, khi - next)) : 0;
    if (nn) block_rows(p, b, hk, next, static_cast<int64_t>(nn), k_rows[cur ^ 1], v_rows[cur ^ 1]);
    for (size_t jj = 0; jj < n; ++jj) {
      if (jj < nn) prefetch_row(k_rows[cur ^ 1][jj], k_bytes);
      ConvertRow(p.cache_dtype, k_rows[cur][jj], d, dp, kb + jj * dp);
    }
    for (size_t jj = n; jj < n4; ++jj) std::memset(kb + jj * dp, 0, dp * sizeof(float));

    bool any_p = false;
    for (int64_t r = 0; r < R; ++r) {
      float* s = sc + r * bc;
      act[r] = 0.0f;
      if (lo[r] >= j0 + static_cast<int64_t>(n) || hi[r] <= j0) continue;  // sees no key of the block
      ScoresRow(qf + r * dp, kb, dp, n4, s);
      const int64_t i = r % sq, h = hk * g + r / sq;
      const float diag = static_cast<float>(i + len - sq);
      const VF vslope = hn::Set(df, p.alibi_slopes ? p.alibi_slopes[h] : 0.0f);
      const auto vlo = hn::Set(di, static_cast<int32_t>(lo[r])), vhi = hn::Set(di, static_cast<int32_t>(hi[r]));
      VF mx = vninf;
      auto nonfinite = hn::Lt(vpinf, vpinf);  // all false
      for (size_t x = 0; x < nv; x += L) {
        VF v = hn::LoadU(df, s + x);
        const auto key = hn::Iota(di, static_cast<int32_t>(j0 + static_cast<int64_t>(x)));
        if (cap > 0) v = hn::Mul(hn::Set(df, cap), hn::Tanh(df, hn::Mul(v, hn::Set(df, inv_cap))));
        if (p.alibi_slopes)
          v = hn::NegMulAdd(vslope, hn::Abs(hn::Sub(hn::Set(df, diag), hn::ConvertTo(df, key))), v);
        const auto visible = hn::AndNot(hn::Lt(key, vlo), hn::Lt(key, vhi));  // lo <= key < hi
        v = hn::IfThenElse(hn::RebindMask(df, visible), v, vninf);
        nonfinite = hn::Or(nonfinite, hn::Not(hn::Lt(v, vpinf)));
        mx = hn::Max(mx, v);
        hn::StoreU(v, df, s + x);
      }
      if (!hn::AllFalse(df, nonfinite)) bad[r] = 1.0f;
      const float m_blk = hn::GetLane(hn::MaxOfLanes(df, mx));
      const float m_new = std::max(m[r], m_blk);
      if (m_new == ninf()) continue;  // nothing visible yet: P = 0 for the whole block
      const float alpha = std::exp(m[r] - m_new);  // m = -inf -> 0
      const VF vm = hn::Set(df, m_new);
      VF sum = hn::Zero(df);
      for (size_t x = 0; x < nv; x += L) {
        const VF v = hn::LoadU(df, s + x);
        const VF e = hn::IfThenElseZero(hn::Gt(v, vninf), hn::Exp(df, hn::Sub(v, vm)));
        sum = hn::Add(sum, e);
        hn::StoreU(e, df, s + x);
      }
      l[r] = l[r] * alpha + hn::GetLane(hn::SumOfLanes(df, sum));
      m[r] = m_new;
      if (alpha != 1.0f) {
        float* ar = acc + r * dvp;
        const VF va = hn::Set(df, alpha);
        for (size_t x = 0; x < dvp; x += L) hn::StoreU(hn::Mul(hn::LoadU(df, ar + x), va), df, ar + x);
      }
      act[r] = 1.0f;
      any_p = true;
    }
    if (!any_p) continue;

    for (size_t jj = 0; jj < n; ++jj) {
      if (jj < nn) prefetch_row(v_rows[cur ^ 1][jj], v_bytes);
      ConvertRow(p.cache_dtype, v_rows[cur][jj], dv, dvp, vb + jj * dvp);
    }
    for (int64_t r = 0; r < R; ++r) {
      if (act[r] == 0.0f) continue;
      const float* s = sc + r * bc;
      float* ar = acc + r * dvp;
      size_t x = 0;
      for (; x + 4 * L <= dvp; x += 4 * L) AccumulatePV<4>(s, vb, dvp, n, x, ar);
      for (; x < dvp; x += L) AccumulatePV<1>(s, vb, dvp, n, x, ar);
    }
  }

  // Finish: O and LSE directly (one split), or this split's partial.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r % sq, h = hk * g + r / sq;
    float* ar = acc + r * dvp;
    float lse_r;
    if (bad[r] != 0.0f) {
      std::fill(ar, ar + dv, nan);
      lse_r = nan;
    } else if (direct) {
      const float sink = p.sinks ? p.sinks[h] : ninf();
      const float mx = std::max(m[r], sink);
      if (mx == ninf()) {
        std::fill(ar, ar + dv, 0.0f);
        lse_r = ninf();
      } else {
        const float a = std::exp(m[r] - mx);  // m = -inf (only the sink) -> 0, and acc = 0
        const float lsum = l[r] * a + (p.sinks ? std::exp(sink - mx) : 0.0f);
        const float mul = a * v_scale / lsum;
        for (size_t x = 0; x < dv; ++x) ar[x] *= mul;
        lse_r = mx + std::log(lsum);
      }
    } else if (l[r] == 0.0f) {  // no visible key in this split
      std::fill(ar, ar + dv, 0.0f);
      lse_r = ninf();
    } else {
      const float mul = v_scale / l[r];
      for (size_t x = 0; x < dv; ++x) ar[x] *= mul;
      lse_r = m[r] + std::log(l[r]);
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
  lay.scratch_bytes_per_thread = serving::scratch_layout(heads_q / heads_kv * seqlen_q, head_dim, head_dim_v).bytes;
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
  const int64_t ntasks = problem.batch * problem.heads_kv * S;
  if (ntasks == 0) return;
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

#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t id = 0; id < ntasks; ++id) {
    const int64_t b = id / (p.heads_kv * S), hk = (id / S) % p.heads_kv;
    const int split = static_cast<int>(id % S);
    run_chunk(p, b, hk, split, scratch + static_cast<size_t>(omp_get_thread_num()) * slot_bytes);
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
    const int64_t s = p.slot(t);
    if (s < 0) continue;  // padding
    const int64_t page = s / p.page_size, off = s % p.page_size;
    for (int64_t hk = 0; hk < p.heads_kv; ++hk) {
      const auto* ksrc = static_cast<const uint8_t*>(p.k_new) + (t * p.k_new_stride_token + hk * p.k_new_stride_head) * ne;
      const auto* vsrc = static_cast<const uint8_t*>(p.v_new) + (t * p.v_new_stride_token + hk * p.v_new_stride_head) * ne;
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

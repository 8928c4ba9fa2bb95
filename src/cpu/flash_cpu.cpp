// CPU flash attention: tiled online softmax, Highway SIMD with runtime ISA dispatch, OpenMP.
//
// What it computes: the forward of ioattn's attention (include/ioattn/ioattn.hpp) -- scale,
// softcap, ALiBi, bottom-right causal/window masks, sinks, GQA, varlen, any int64 strides --
// with fp32 accumulation for f32/f16/bf16 inputs. O is written in the input dtype, LSE in fp32.
// f8e4m3 inputs are dequantised on load (code * descale, scalar) and O is written in bf16/f16.
// The n x n score matrix never exists; extra memory is O(tile) per thread.
//
// Tiling. A task is (batch b, kv head hk, query tile). The g = heads_q / heads_kv query heads
// that share kv head hk are flattened into one list of "query rows" r = i * g + (h - hk * g), and
// a query tile is Br consecutive rows of that list, so every K/V block converted to fp32 feeds all
// heads of the group. Per key block of Bc keys:
//   S^T (Bc, Br)  = K_blk (Bc, d) . Q^T (d, Br)        register tiles of Mr1 keys x Nr1 vectors
//   online softmax *down the columns* of S^T (a column is one query row), so the running max and
//   sum are vertical vector ops: no horizontal reductions. Softcap, ALiBi and the mask live here.
//   O (Br, dv) = O * alpha + P (Br, Bc) . V_blk (Bc, dv)  register tiles of Mr2 rows x Nr2 vectors
// Both GEMMs are "broadcast one scalar x a contiguous vector row", the register-blocked shape of a
// CPU sgemm. Q^T is packed once per tile, pre-scaled; K and V are converted to fp32 per block into
// contiguous buffers (this also avoids 4 KiB aliasing between head-strided rows) while the next
// block is prefetched; V rows and O are padded to the vector width, tiles are padded with zero
// rows/columns instead of scalar tails. The shapes are in the tile table below (AVX-512: Br up to
// 384, Bc 64, QK^T register tile 8 keys x 3 vectors, P.V 6 rows x 4 vectors).
//
// Masks. For a tile, the visible keys of its first and last query row bound the key range
// (lo and hi are monotone in the row), so only those key blocks are visited; the per-element mask
// runs only on blocks that straddle a boundary. Keys outside [0, seqlen_k) are never loaded.
// Blocks sit on a fixed grid, so every output is bit-identical for any thread count.
//
// NaN safety. A masked score is *selected* to -inf (never computed from a NaN K), so P = 0. P.V
// would still turn 0 * NaN into NaN, so a straddling block whose partly-masked V rows hold a
// non-finite value takes a scalar-P path that skips P == 0. A row whose visible scores contain a
// NaN or +inf is poisoned and written as NaN (the float64 reference does the same).
//
// Targets. AVX3 (AVX-512), AVX2, SSE4 and Highway's portable fallback (EMU128, or SCALAR with
// GCC < 12.3) are compiled; SSSE3 is disabled (only pre-2008 CPUs would pick it). The environment
// variable IOATTN_CPU_TARGET=avx2 (sse4, scalar, emu128) caps the run-time choice, so one machine
// can test the lower code paths. Threads: ctx.num_threads, else IOATTN_NUM_THREADS, else OpenMP's.
//
// History:
//  1. A placeholder that called the float64 naive path.
//  2. Highway + OpenMP: S^T orientation (vertical softmax), register micro-kernels for both GEMMs,
//     GQA heads flattened into the query tile, whole-block skipping. Br 48: ~45% of FMA peak at
//     hdim 128 / seqlen 4096, with a quarter of the time stalled on K/V rows that miss cache
//     and TLB (in [b, s, h, d] each row of a head starts a new 4 KiB page).
//  3. Br 48 -> 384 (8x fewer passes over K/V; capped by L2), software prefetch of the next block
//     spread over the register-tile calls, a 2^x polynomial instead of Highway's general Exp,
//     register tiles above the causal diagonal skipped: ~65% of FMA peak (1 and 2 threads).
#ifndef IOATTN_CPU_FLASH_CPU_SHARED_
#define IOATTN_CPU_FLASH_CPU_SHARED_

#include <omp.h>
#if __has_include(<unistd.h>)
#include <unistd.h>  // sysconf: L2 size
#endif

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "core/problem.hpp"
#include "cpu/exp2_poly.hpp"
#include "cpu/flash_amx.hpp"
#include "cpu/prefetch.hpp"
#include "cpu/serving_quant.h"

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS HWY_SSSE3
#endif
#include <hwy/aligned_allocator.h>

namespace ioattn::detail::flash {

// The tile shape one Highway target uses (see the table in the per-target section).
struct TileShape {
  int br = 0;     // most query rows per tile (columns of S^T); a multiple of the vector length
  int bc = 0;     // keys per block (rows of S^T)
  int bc_amx = 0; // keys per block of the AMX-BF16 path (flash_amx.hpp; 0: none on this target)
  int lanes = 0;  // floats per vector
};

// One unit of parallel work: Br query rows of one (batch, kv head).
struct Task {
  int64_t b = 0, hk = 0;
  int64_t r0 = 0, r1 = 0;  // flattened query rows [r0, r1), r = i * group + (h - hk * group)
  int64_t q_start = 0, sq = 0, k_start = 0, sk = 0;  // token offsets and lengths of sequence b
};

inline size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

// Per-thread scratch, O(tile): allocated once per thread per call, zero-initialised (the zero
// padding of V's columns and of S^T's unused columns relies on it).
struct Workspace {
  float* qt = nullptr;      // (d, br)    Q^T of the tile, pre-scaled
  float* st = nullptr;      // (bc, br)   S^T, then P^T
  uint32_t* pv = nullptr;   // (bc/2, br) P^T as bf16 key pairs (the AMX path's B operand)
  uint32_t* pv_lo = nullptr;  // (bc/2, br) P^T - bf16(P^T) likewise (the AMX path for f16 inputs)
  float* kp = nullptr;      // (bc, d)    K block, fp32
  float* vp = nullptr;      // (bc, dvp)  V block, fp32, columns padded to the vector width
  float* o = nullptr;       // (br, dvp)  O accumulator
  float* m = nullptr;       // (br)       running max per query row
  float* l = nullptr;       // (br)       running sum per query row (relative to m)
  float* alpha = nullptr;   // (br)       rescale factor of the current block
  float* slope = nullptr;   // (br)       ALiBi slope per query row
  float* poison = nullptr;  // (br)       non-zero: a visible score was NaN or +inf
  int32_t* lo = nullptr;    // (br)       first visible key per query row
  int32_t* hi = nullptr;    // (br)       one past the last visible key
  int32_t* diag = nullptr;  // (br)       i + (sk - sq): the ALiBi / mask diagonal
  size_t dvp = 0;
  hwy::AlignedFreeUniquePtr<float[]> fbuf;
  hwy::AlignedFreeUniquePtr<int32_t[]> ibuf;

  Workspace(const TileShape& s, int64_t d, int64_t dv) {
    constexpr size_t kAlign = 16;  // floats: 64 bytes, the widest vector
    const size_t br = s.br, bc = std::max(s.bc, s.bc_amx);
    const size_t dk = s.bc_amx ? round_up(static_cast<size_t>(d), 32) : static_cast<size_t>(d);  // (AMX: zero-padded rows)
    dvp = round_up(static_cast<size_t>(dv), static_cast<size_t>(s.lanes));
    const size_t x2 = s.bc_amx ? 2 : 1;  // (the AMX path's f16 operands: 3 d-wide Q and K stages, two P parts)
    const size_t sizes[] = {x2 * dk * br, bc * br, x2 * bc * dk, x2 * bc * dvp, br * dvp, br, br, br, br, br, x2 * bc / 2 * br};
    size_t total = 0;
    for (size_t n : sizes) total += round_up(n, kAlign);
    fbuf = hwy::AllocateAligned<float>(total);
    std::fill(fbuf.get(), fbuf.get() + total, 0.0f);
    float* pvf = nullptr;
    float** dst[] = {&qt, &st, &kp, &vp, &o, &m, &l, &alpha, &slope, &poison, &pvf};
    size_t at = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
      *dst[i] = fbuf.get() + at;
      at += round_up(sizes[i], kAlign);
    }
    pv = reinterpret_cast<uint32_t*>(pvf);
    pv_lo = pv + bc / 2 * br;
    const size_t bri = round_up(br, kAlign);
    ibuf = hwy::AllocateAligned<int32_t>(3 * bri);
    std::fill(ibuf.get(), ibuf.get() + 3 * bri, 0);
    lo = ibuf.get();
    hi = lo + bri;
    diag = hi + bri;
  }
};

inline int32_t clamp_i32(int64_t x) {
  return static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(x, INT32_MIN), INT32_MAX));
}

}  // namespace ioattn::detail::flash

#endif  // IOATTN_CPU_FLASH_CPU_SHARED_

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/flash_cpu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

HWY_BEFORE_NAMESPACE();
namespace ioattn::detail::flash {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;
using VF = hn::Vec<DF>;
using VI = hn::Vec<DI>;

constexpr size_t kL = HWY_LANES(float);  // floats per vector

// ---- tile table: should not affect results, only speed ---------------------------------
// AVX-512 has 32 vector registers: QK^T keeps 8 keys x 3 vectors = 24 accumulators (+3 Q
// vectors; the K scalar is an embedded-broadcast memory operand), P.V keeps Mr2 x Nr2 <= 24.
// 16-register targets (AVX2, SSE4, EMU128): 6 x 2 = 12 accumulators + 2 loads + 1 broadcast.
// Br = 384 query rows: every K/V block is read from memory (and converted) once per Br rows; at
// Br = 48 those reads cost a quarter of the run time, at 192 about an eighth, 576 gains nothing.
// Q^T and O of a tile (2 x 192 KiB at hdim 128) stay in L2; tile_rows() uses fewer rows when L2
// is smaller or head_dim larger, and for small problems. Br is a multiple of every vector length
// and of every Mr2 below, so a partial tile rounds up to at most Br rows.
// Bc = 64 keys keeps the fp32 K block (64 x 128 x 4 = 32 KiB) in L1; 128 measured no faster.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr bool kRegs32 = true;
#else
constexpr bool kRegs32 = false;
#endif
constexpr size_t kBr = 384;
// The AMX-BF16 path (below) on the AVX-512 targets: 128 keys per block, so each O^T accumulator
// tile loaded from L2 takes 4 key chunks of products before it is stored back (64: P.V at half
// the speed of Q.K^T).
constexpr bool kAmxTarget = IOATTN_FLASH_AMX_HWY_TARGET;
constexpr size_t kBcAmx = 128;
constexpr size_t kBc = kRegs32 ? 64 : 48;
constexpr size_t kMr1 = kRegs32 ? 8 : 6;
constexpr size_t kNr1 = kRegs32 ? 3 : 2;
constexpr size_t kNr2 = kRegs32 ? 4 : 2;
// P.V rows per register tile for a tile kNr2-or-narrower vectors wide.
constexpr size_t Mr2(size_t nr) {
  return kRegs32 ? (nr >= 4 ? 6 : nr == 3 ? 8 : nr == 2 ? 12 : 16) : (nr >= 2 ? 6 : 12);
}
static_assert(kBr % kL == 0 && kBc % kMr1 == 0, "tile table");
static_assert(kBr % Mr2(1) == 0 && kBr % Mr2(2) == 0 && kBr % Mr2(3) == 0 && kBr % Mr2(4) == 0,
              "a partial tile must round up to at most kBr rows");

TileShape TargetShape() {
  TileShape s;
  s.br = static_cast<int>(kBr);
  s.bc = static_cast<int>(kBc);
  s.bc_amx = kAmxTarget ? static_cast<int>(kBcAmx) : 0;
  s.lanes = static_cast<int>(kL);
  return s;
}

int64_t TargetBits() { return HWY_TARGET; }

// ---- dtype conversion ------------------------------------------------------------------

// Exact f16 -> f32 of kL halves (subnormals, inf and NaN included).
HWY_INLINE VF LoadF16(const uint16_t* HWY_RESTRICT p) {
  const DF df;
#if HWY_TARGET <= HWY_AVX2  // F16C: vcvtph2ps
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
#else
  const DU du;
  const DI di;
  const hn::Rebind<uint16_t, DF> du16;
  const auto bits = hn::PromoteTo(du, hn::LoadU(du16, p));
  const auto sign = hn::ShiftLeft<31>(hn::ShiftRight<15>(bits));
  const auto exp = hn::And(hn::ShiftRight<10>(bits), hn::Set(du, 0x1F));
  const auto mant = hn::And(bits, hn::Set(du, 0x3FF));
  const auto normal = hn::Or(hn::ShiftLeft<23>(hn::Add(exp, hn::Set(du, 127 - 15))),
                             hn::ShiftLeft<13>(mant));
  const auto infnan = hn::Or(hn::Set(du, 0x7F800000u), hn::ShiftLeft<13>(mant));
  // Subnormal: mant * 2^-24, exact in fp32.
  const auto subnormal =
      hn::BitCast(du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, mant)), hn::Set(df, 1.0f / 16777216.0f)));
  auto mag = hn::IfThenElse(hn::Eq(exp, hn::Zero(du)), subnormal, normal);
  mag = hn::IfThenElse(hn::Eq(exp, hn::Set(du, 0x1F)), infnan, mag);
  return hn::BitCast(df, hn::Or(sign, mag));
#endif
}

HWY_INLINE VF LoadBF16(const uint16_t* HWY_RESTRICT p) {
  const DF df;
  const hn::Rebind<hwy::bfloat16_t, DF> db;
  return hn::PromoteTo(df, hn::LoadU(db, reinterpret_cast<const hwy::bfloat16_t*>(p)));
}

// dst[0, n) = row base[off, off + n) of dtype t, as fp32 (f8e4m3: codes times `descale`).
HWY_INLINE void LoadRow(DType t, const void* base, int64_t off, size_t n, float* HWY_RESTRICT dst,
                        float descale = 1.0f) {
  const DF df;
  size_t x = 0;
  if (t == DType::f8e4m3) {  // scalar: fp8 inputs are a correctness path on the CPU
    const uint8_t* src = static_cast<const uint8_t*>(base) + off;
    for (; x < n; ++x) dst[x] = e4m3_to_float(src[x]) * descale;
  } else if (t == DType::i8) {  // (an i8 KV cache read by the paged prefill; scalar as e4m3)
    const int8_t* src = static_cast<const int8_t*>(base) + off;
    for (; x < n; ++x) dst[x] = static_cast<float>(src[x]) * descale;
  } else if (t == DType::f32) {
    const float* src = static_cast<const float*>(base) + off;
    for (; x + kL <= n; x += kL) hn::StoreU(hn::LoadU(df, src + x), df, dst + x);
    for (; x < n; ++x) dst[x] = src[x];
  } else if (t == DType::bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + off;
    for (; x + kL <= n; x += kL) hn::StoreU(LoadBF16(src + x), df, dst + x);
    for (; x < n; ++x) dst[x] = bf16_to_float(src[x]);
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(base) + off;
    for (; x + kL <= n; x += kL) hn::StoreU(LoadF16(src + x), df, dst + x);
    for (; x < n; ++x) dst[x] = f16_to_float(src[x]);
  }
}

// base[off, off + n) of dtype t = src * inv (round to nearest even).
// The bf16 bits of v (round to nearest even) in the low half of each 32-bit lane; a NaN may come
// out as inf or another NaN (StoreRow fixes NaNs up; the softmax's P is >= 0, or NaN only in a
// poisoned row, whose output is NaN whatever P holds).
HWY_INLINE hn::Vec<DU> Bf16Bits(VF v) {
  const DU du;
  const auto u = hn::BitCast(du, v);
  return hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du, 0x7FFFu), hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1)))));
}

HWY_INLINE void StoreRow(DType t, void* base, int64_t off, size_t n, const float* HWY_RESTRICT src,
                         float inv) {
  const DF df;
  const VF vinv = hn::Set(df, inv);
  size_t x = 0;
  if (t == DType::f32) {
    float* dst = static_cast<float*>(base) + off;
    for (; x + kL <= n; x += kL) hn::StoreU(hn::Mul(hn::Load(df, src + x), vinv), df, dst + x);
    for (; x < n; ++x) dst[x] = src[x] * inv;
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(base) + off;
  if (t == DType::bf16) {
    const DU du;
    const DI di;
    const hn::Rebind<uint16_t, DF> du16;
    for (; x + kL <= n; x += kL) {
      const VF v = hn::Mul(hn::Load(df, src + x), vinv);
      const auto u = hn::BitCast(du, v);
      auto r = Bf16Bits(v);
      r = hn::IfThenElse(hn::RebindMask(du, hn::Ne(v, v)),
                         hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40)), r);
      hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, r)), du16, dst + x);
    }
    for (; x < n; ++x) dst[x] = float_to_bf16(src[x] * inv);
    return;
  }
#if HWY_TARGET <= HWY_AVX2  // F16C: vcvtps2ph rounds to nearest even, overflows to inf
  const hn::Rebind<hwy::float16_t, DF> dh;
  for (; x + kL <= n; x += kL)
    hn::StoreU(hn::DemoteTo(dh, hn::Mul(hn::Load(df, src + x), vinv)), dh,
               reinterpret_cast<hwy::float16_t*>(dst + x));
#endif
  for (; x < n; ++x) dst[x] = float_to_f16(src[x] * inv);
}

// ---- micro-kernels ---------------------------------------------------------------------

// S^T (MR keys, NR*kL rows) = K (MR, depth) . Q^T (depth, NR*kL). K rows are ldk apart, Q^T rows
// ldq apart; the scalar K[r][k] is broadcast against a vector row of Q^T.
template <size_t MR, size_t NR>
HWY_INLINE void MicroQK(const float* HWY_RESTRICT kp, size_t ldk, const float* HWY_RESTRICT qt,
                        size_t ldq, size_t depth, float* HWY_RESTRICT st, size_t lds) {
  const DF df;
  VF acc[MR][NR];
#pragma GCC unroll 16
  for (size_t r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (size_t c = 0; c < NR; ++c) acc[r][c] = hn::Zero(df);
  for (size_t k = 0; k < depth; ++k) {
    VF b[NR];
#pragma GCC unroll 4
    for (size_t c = 0; c < NR; ++c) b[c] = hn::Load(df, qt + k * ldq + c * kL);
#pragma GCC unroll 16
    for (size_t r = 0; r < MR; ++r) {
      const VF a = hn::Set(df, kp[r * ldk + k]);
#pragma GCC unroll 4
      for (size_t c = 0; c < NR; ++c) acc[r][c] = hn::MulAdd(a, b[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (size_t r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (size_t c = 0; c < NR; ++c) hn::Store(acc[r][c], df, st + r * lds + c * kL);
}

// O (MR rows, NR*kL) = O * alpha + P (MR, kc) . V (kc, NR*kL). P is read from P^T (kc, ldp), so
// the MR scalars of one key are adjacent; V rows are ldv apart, O rows ldo apart.
template <size_t MR, size_t NR>
HWY_INLINE void MicroPV(const float* HWY_RESTRICT pt, size_t ldp, const float* HWY_RESTRICT vp,
                        size_t ldv, size_t kc, const float* HWY_RESTRICT alpha,
                        float* HWY_RESTRICT o, size_t ldo) {
  const DF df;
  VF acc[MR][NR];
#pragma GCC unroll 16
  for (size_t r = 0; r < MR; ++r) {
    const VF a = hn::Set(df, alpha[r]);
#pragma GCC unroll 4
    for (size_t c = 0; c < NR; ++c) acc[r][c] = hn::Mul(hn::Load(df, o + r * ldo + c * kL), a);
  }
  for (size_t j = 0; j < kc; ++j) {
    VF b[NR];
#pragma GCC unroll 4
    for (size_t c = 0; c < NR; ++c) b[c] = hn::Load(df, vp + j * ldv + c * kL);
#pragma GCC unroll 16
    for (size_t r = 0; r < MR; ++r) {
      const VF a = hn::Set(df, pt[j * ldp + r]);
#pragma GCC unroll 4
      for (size_t c = 0; c < NR; ++c) acc[r][c] = hn::MulAdd(a, b[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (size_t r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (size_t c = 0; c < NR; ++c) hn::Store(acc[r][c], df, o + r * ldo + c * kL);
}

// Prefetches the next key block's K and V rows into L2 while this block computes. In the
// [b, s, h, d] layout the rows of one head are heads*d elements apart (4 KiB for 8 x 128 f32),
// so every row starts a new page: the hardware prefetchers do not follow, and without this the
// packing stalls on an L3 (and TLB) miss per row.
// prefetch_l2 (prefetch.hpp): prefetcht1, into L2 (and L3), not L1.

struct RowPrefetch {
  const char* k = nullptr;  // first row of the next block; null = nothing to prefetch
  const char* v = nullptr;
  int64_t k_stride = 0, v_stride = 0;  // bytes between rows
  size_t k_bytes = 0, v_bytes = 0;     // bytes per row
  size_t rows = 0;
  size_t slice = 0, nslices = 1;  // one slice per register-tile call of this block's GEMMs

  // Issues the next slice of rows, [slice*rows/nslices, (slice+1)*rows/nslices).
  void Next() {
    if (k == nullptr || slice >= nslices) return;
    constexpr size_t kLine = 64;
    const size_t j1 = (slice + 1) * rows / nslices;
    for (size_t j = slice * rows / nslices; j < j1; ++j) {
      const char* kr = k + static_cast<int64_t>(j) * k_stride;
      const char* vr = v + static_cast<int64_t>(j) * v_stride;
      for (size_t x = 0; x < k_bytes; x += kLine) prefetch_l2(kr + x);
      for (size_t x = 0; x < v_bytes; x += kLine) prefetch_l2(vr + x);
    }
    ++slice;
  }
  // Issues whatever the GEMMs did not (they skip register tiles that see no key).
  void Finish() {
    while (k != nullptr && slice < nslices) Next();
  }
};

// The key block a tile works on, and the query rows it has.
struct Block {
  int64_t kb = 0;    // first key
  size_t len = 0;    // keys in the block
  size_t ncols = 0;  // real (unpadded) query rows of the tile
};

// Keys [*j0, *j1) of the block (relative to kb) that query rows [c0, c1) can see. lo and hi are
// monotone in the row, so row c0 bounds the start and row c1 - 1 the end. Under a causal mask
// this skips the register tiles above the diagonal; P there is exactly 0, so results are the
// same bits as computing them.
HWY_INLINE void VisibleSpan(const Workspace& ws, const Block& blk, size_t c0, size_t c1, size_t* j0,
                            size_t* j1) {
  c1 = std::min(c1, blk.ncols);
  const int64_t len = static_cast<int64_t>(blk.len);
  const int64_t a = std::clamp<int64_t>(ws.lo[c0] - blk.kb, 0, len);
  const int64_t b = std::clamp<int64_t>(ws.hi[c1 - 1] - blk.kb, 0, len);
  *j0 = static_cast<size_t>(a);
  *j1 = static_cast<size_t>(std::max(a, b));
}

// S^T columns [col0, col0 + NR*kL), for the key register tiles these rows can see (the rest
// is left stale: the block is then a masked one and the softmax selects -inf there).
template <size_t NR>
HWY_NOINLINE void GemmQK(const Workspace& ws, const Block& blk, size_t d, size_t col0, RowPrefetch& pf) {
  size_t j0, j1;
  VisibleSpan(ws, blk, col0, col0 + NR * kL, &j0, &j1);
  for (size_t j = j0 / kMr1 * kMr1; j < j1; j += kMr1) {
    pf.Next();
    MicroQK<kMr1, NR>(ws.kp + j * d, d, ws.qt + col0, kBr, d, ws.st + j * kBr + col0, kBr);
  }
}

// O rows [0, ncols) x columns [col0, col0 + NR*kL): O * alpha + P . V over the keys each
// register tile of rows can see.
template <size_t NR>
HWY_NOINLINE void GemmPV(const Workspace& ws, const Block& blk, size_t col0, RowPrefetch& pf) {
  constexpr size_t kMr = Mr2(NR);
  const size_t ldv = ws.dvp;
  for (size_t i = 0; i < blk.ncols; i += kMr) {
    pf.Next();
    size_t j0, j1;
    VisibleSpan(ws, blk, i, i + kMr, &j0, &j1);
    MicroPV<kMr, NR>(ws.st + j0 * kBr + i, kBr, ws.vp + j0 * ldv + col0, ldv, j1 - j0, ws.alpha + i,
                     ws.o + i * ldv + col0, ldv);
  }
}

// Register-tile widths (in vectors) of the tile's GEMMs: S^T columns in tiles of at most kNr1
// vectors; O's dv vectors in balanced tiles of at most kNr2.
HWY_INLINE size_t QKWidth(size_t nvq, size_t c) { return std::min(kNr1, nvq - c); }
HWY_INLINE size_t PVChunks(size_t nv) { return (nv + kNr2 - 1) / kNr2; }
HWY_INLINE size_t PVWidth(size_t nv, size_t chunk) {
  const size_t n = PVChunks(nv);
  return nv / n + (chunk < nv % n ? 1 : 0);
}

// Register-tile calls the two GEMMs of one block make (the prefetch is spread over them).
HWY_INLINE size_t GemmCalls(size_t nkeys, size_t nvq, size_t rows, size_t nv) {
  size_t calls = (nvq + kNr1 - 1) / kNr1 * (nkeys / kMr1);
  for (size_t chunk = 0; chunk < PVChunks(nv); ++chunk) {
    const size_t mr = Mr2(PVWidth(nv, chunk));
    calls += (rows + mr - 1) / mr;
  }
  return calls;
}

// S^T for the nvq query vectors of the tile.
HWY_INLINE void TileQK(const Workspace& ws, const Block& blk, size_t d, size_t nvq, RowPrefetch& pf) {
  for (size_t c = 0; c < nvq; c += kNr1) {
    const size_t w = QKWidth(nvq, c);
    if constexpr (kNr1 >= 3) {
      if (w == 3) {
        GemmQK<3>(ws, blk, d, c * kL, pf);
        continue;
      }
    }
    if (w == 2)
      GemmQK<2>(ws, blk, d, c * kL, pf);
    else
      GemmQK<1>(ws, blk, d, c * kL, pf);
  }
}

// O = O * alpha + P . V for all dv vectors.
HWY_INLINE void TilePV(const Workspace& ws, const Block& blk, RowPrefetch& pf) {
  const size_t nv = ws.dvp / kL;
  for (size_t chunk = 0, c = 0; chunk < PVChunks(nv); ++chunk) {
    const size_t w = PVWidth(nv, chunk);
    if constexpr (kNr2 >= 4) {
      if (w == 4) GemmPV<4>(ws, blk, c * kL, pf);
      if (w == 3) GemmPV<3>(ws, blk, c * kL, pf);
    }
    if (w == 2) GemmPV<2>(ws, blk, c * kL, pf);
    if (w == 1) GemmPV<1>(ws, blk, c * kL, pf);
    c += w;
  }
}

// The exact path for a block whose V holds a non-finite value in a partly masked row: P == 0
// must contribute nothing, not 0 * inf.
HWY_NOINLINE void TilePVSkipZeros(const Workspace& ws, size_t kc, size_t rows) {
  const DF df;
  const size_t dvp = ws.dvp;
  for (size_t i = 0; i < rows; ++i) {
    float* o = ws.o + i * dvp;
    const VF a = hn::Set(df, ws.alpha[i]);
    for (size_t x = 0; x < dvp; x += kL) hn::Store(hn::Mul(hn::Load(df, o + x), a), df, o + x);
    for (size_t j = 0; j < kc; ++j) {
      const float pij = ws.st[j * kBr + i];
      if (pij == 0.0f) continue;
      const VF pv = hn::Set(df, pij);
      const float* v = ws.vp + j * dvp;
      for (size_t x = 0; x < dvp; x += kL)
        hn::Store(hn::MulAdd(pv, hn::Load(df, v + x), hn::Load(df, o + x)), df, o + x);
    }
  }
}

// ---- online softmax on S^T ---------------------------------------------------------------
// P = exp(s - m) = 2^((s - m) * log2(e)). Folding log2(e) into the Q scale instead would save the
// multiply but makes the error grow with |s| rather than |s - m| (2.5x worse on large logits).
// kLog2e and the polynomial's coefficients: exp2_poly.hpp.

// 2^x for x <= 0, the only range the softmax needs: x = -inf gives 0 and results below 2^-126
// flush to 0 (Highway's Exp costs about twice as many instructions for the full range).
// 2^x = 2^n * 2^f with n = round(x), f in [-0.5, 0.5]; 2^f by the degree-6 polynomial kExp2Poly.
HWY_INLINE VF Exp2NonPositive(VF x) {
  const DF df;
  const DI di;
  x = hn::Max(hn::Set(df, -127.0f), x);  // n = -127 below makes the 2^n factor +0
  const VF n = hn::Round(x);
  const VF f = hn::Sub(x, n);
  VF p = hn::Set(df, kExp2Poly[0]);
#pragma GCC unroll 6
  for (int i = 1; i < 7; ++i) p = hn::MulAdd(p, f, hn::Set(df, kExp2Poly[i]));
  const VI e = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));
  return hn::Mul(p, hn::BitCast(df, e));
}

struct BlockMods {
  bool mask = false;     // the block straddles a mask boundary of some row of the tile
  bool alibi = false;
  float softcap = 0.0f;  // 0 = off
};

// For each query row (column of S^T): apply softcap / ALiBi / mask to the block's scores, update
// the running max m and sum l, turn S^T into P^T = exp(S - m) and leave alpha = exp(m_old - m).
// The AMX path passes S^T unscaled (qk_scale: the softmax scale, applied here to each score as
// the fp32 path's pre-scaled Q does), takes P^T as bf16 key pairs in pv ((len + 1) / 2 rows of
// kBr, zero pairs after them up to the next 32 keys) instead of fp32 in st, and keeps a row's
// max until the block's exceeds it by more than `lazy` (P then up to e^lazy; alpha = 1 exactly
// while the max stands, so the O^T rescale is skipped: LSE = m + log l holds for any m >= the
// true max), with the next block's prefetch spread over the row groups (pf).
HWY_NOINLINE void SoftmaxBlock(const Workspace& ws, size_t nvq, int64_t kb, size_t len,
                               const BlockMods& mods, float qk_scale = 1.0f, uint32_t* pv = nullptr,
                               float lazy = 0.0f, RowPrefetch* pf = nullptr, uint32_t* pv_lo = nullptr) {
  const DF df;
  const DI di;
  const DU du;
  const bool scaled = qk_scale != 1.0f;
  const VF qs = hn::Set(df, qk_scale);
  const VF ninf = hn::Set(df, -std::numeric_limits<float>::infinity());
  const VF pinf = hn::Set(df, std::numeric_limits<float>::infinity());
  const VF cap = hn::Set(df, mods.softcap);
  const VF inv_cap = hn::Set(df, mods.softcap > 0 ? 1.0f / mods.softcap : 0.0f);
  const bool plain = !mods.mask && !mods.alibi && !(mods.softcap > 0);
  for (size_t c = 0; c < nvq; ++c) {
    if (pf) pf->Next();
    float* s = ws.st + c * kL;
    const VF m_old = hn::Load(df, ws.m + c * kL);
    VF mx = m_old;
    auto bad = hn::Lt(pinf, pinf);  // all false: NaN or +inf seen among visible scores
    // Under a mask, the keys [j0, j1) some row of the group can see (a superset: pad columns have
    // lo = hi = 0), widened to whole pairs; the others give P = 0 without being computed.
    size_t j0 = 0, j1 = len;
    if (mods.mask) {
      const int64_t lo_min = hn::GetLane(hn::MinOfLanes(di, hn::Load(di, ws.lo + c * kL)));
      const int64_t hi_max = hn::GetLane(hn::MaxOfLanes(di, hn::Load(di, ws.hi + c * kL)));
      const int64_t n = static_cast<int64_t>(len);
      j0 = static_cast<size_t>(std::clamp<int64_t>(lo_min - kb, 0, n)) & ~size_t{1};
      j1 = std::min(len, round_up(static_cast<size_t>(std::clamp<int64_t>(hi_max - kb, 0, n)), 2));
      j1 = std::max(j0, j1);
    }
    if (plain) {
      for (size_t j = 0; j < len; ++j) {
        VF v = hn::Load(df, s + j * kBr);
        if (scaled) v = hn::Mul(v, qs);
        bad = hn::Or(bad, hn::Not(hn::Lt(v, pinf)));
        mx = hn::Max(mx, v);
      }
    } else {
      const VI lo = hn::Load(di, ws.lo + c * kL);
      const VI hi = hn::Load(di, ws.hi + c * kL);
      const VI diag = hn::Load(di, ws.diag + c * kL);
      const VF slope = hn::Load(df, ws.slope + c * kL);
      for (size_t j = j0; j < j1; ++j) {
        VF v = hn::Load(df, s + j * kBr);
        if (scaled) v = hn::Mul(v, qs);
        const VI key = hn::Set(di, static_cast<int32_t>(kb + static_cast<int64_t>(j)));
        if (mods.softcap > 0) v = hn::Mul(cap, hn::Tanh(df, hn::Mul(v, inv_cap)));
        if (mods.alibi) v = hn::NegMulAdd(slope, hn::ConvertTo(df, hn::Abs(hn::Sub(diag, key))), v);
        if (mods.mask) {
          const auto visible = hn::AndNot(hn::Lt(key, lo), hn::Lt(key, hi));  // lo <= key < hi
          v = hn::IfThenElse(hn::RebindMask(df, visible), v, ninf);
        }
        hn::Store(v, df, s + j * kBr);
        bad = hn::Or(bad, hn::Not(hn::Lt(v, pinf)));
        mx = hn::Max(mx, v);
      }
    }
    // A row that has seen only -inf keeps m = -inf; subtract 0 instead so exp never sees
    // -inf - (-inf).
    if (lazy > 0.0f) mx = hn::IfThenElse(hn::Gt(mx, hn::Add(m_old, hn::Set(df, lazy))), mx, m_old);
    const VF m_use = hn::IfThenElseZero(hn::Ne(mx, ninf), mx);
    const VF log2e = hn::Set(df, kLog2e);
    VF alpha = Exp2NonPositive(hn::Mul(hn::Sub(m_old, m_use), log2e));
    if (lazy > 0.0f) alpha = hn::IfThenElse(hn::Eq(mx, m_old), hn::Set(df, 1.0f), alpha);  // (-inf rows too)
    VF sum0 = hn::Zero(df), sum1 = hn::Zero(df);
    const bool scale_here = plain && scaled;  // (the masked path stored its scores scaled)
    size_t j = j0;
    for (; j + 2 <= j1; j += 2) {
      VF s0 = hn::Load(df, s + j * kBr), s1 = hn::Load(df, s + (j + 1) * kBr);
      if (scale_here) s0 = hn::Mul(s0, qs), s1 = hn::Mul(s1, qs);
      const VF p0 = Exp2NonPositive(hn::Mul(hn::Sub(s0, m_use), log2e));
      const VF p1 = Exp2NonPositive(hn::Mul(hn::Sub(s1, m_use), log2e));
      if (pv) {
        const auto h0 = Bf16Bits(p0), h1 = Bf16Bits(p1);
        hn::Store(hn::Or(h0, hn::ShiftLeft<16>(h1)), du, pv + j / 2 * kBr + c * kL);
        if (pv_lo) {  // the second parts, P - bf16(P)
          const VF r0 = hn::Sub(p0, hn::BitCast(df, hn::ShiftLeft<16>(h0)));
          const VF r1 = hn::Sub(p1, hn::BitCast(df, hn::ShiftLeft<16>(h1)));
          hn::Store(hn::Or(Bf16Bits(r0), hn::ShiftLeft<16>(Bf16Bits(r1))), du, pv_lo + j / 2 * kBr + c * kL);
        }
      } else {
        hn::Store(p0, df, s + j * kBr);
        hn::Store(p1, df, s + (j + 1) * kBr);
      }
      sum0 = hn::Add(sum0, p0);
      sum1 = hn::Add(sum1, p1);
    }
    if (j < j1) {
      VF s0 = hn::Load(df, s + j * kBr);
      if (scale_here) s0 = hn::Mul(s0, qs);
      const VF p0 = Exp2NonPositive(hn::Mul(hn::Sub(s0, m_use), log2e));
      if (pv) {
        const auto h0 = Bf16Bits(p0);
        hn::Store(h0, du, pv + j / 2 * kBr + c * kL);
        if (pv_lo) hn::Store(Bf16Bits(hn::Sub(p0, hn::BitCast(df, hn::ShiftLeft<16>(h0)))), du, pv_lo + j / 2 * kBr + c * kL);
      } else
        hn::Store(p0, df, s + j * kBr);
      sum0 = hn::Add(sum0, p0);
    }
    if (pv) {
      for (uint32_t* q : {pv, pv_lo}) {
        if (!q) continue;
        for (size_t jj = 0; jj < j0 / 2; ++jj) hn::Store(hn::Zero(du), du, q + jj * kBr + c * kL);
        for (size_t jj = (j1 + 1) / 2; jj < round_up(len, 32) / 2; ++jj) hn::Store(hn::Zero(du), du, q + jj * kBr + c * kL);
      }
    } else {
      for (size_t jj = 0; jj < j0; ++jj) hn::Store(hn::Zero(df), df, s + jj * kBr);
      for (size_t jj = j1; jj < len; ++jj) hn::Store(hn::Zero(df), df, s + jj * kBr);
    }
    hn::Store(hn::MulAdd(hn::Load(df, ws.l + c * kL), alpha, hn::Add(sum0, sum1)), df, ws.l + c * kL);
    hn::Store(mx, df, ws.m + c * kL);
    hn::Store(alpha, df, ws.alpha + c * kL);
    const VF poison = hn::Load(df, ws.poison + c * kL);
    hn::Store(hn::IfThenElse(bad, hn::Set(df, 1.0f), poison), df, ws.poison + c * kL);
  }
}

// True if any of V rows [j0, j1) holds a non-finite value.
HWY_INLINE bool AnyNonFinite(const Workspace& ws, size_t j0, size_t j1) {
  const DF df;
  auto bad = hn::Ne(hn::Zero(df), hn::Zero(df));
  for (size_t j = j0; j < j1; ++j)
    for (size_t x = 0; x < ws.dvp; x += kL)
      bad = hn::Or(bad, hn::Not(hn::IsFinite(hn::Load(df, ws.vp + j * ws.dvp + x))));
  return !hn::AllFalse(df, bad);
}

// ---- AMX-BF16 products (flash_amx.hpp) --------------------------------------------------
// On the AVX-512 targets, for bf16 Q / K / V with head_dim % 32 == 0 and head_dim_v % 16 == 0,
// where the CPU has AMX-BF16: K staged as bf16 rows, V as bf16 V^T, S^T by tile products, the
// softmax as above (scaling the raw scores, writing P^T as bf16 key pairs), O^T accumulated by
// tile products (the accumulator is O^T here: columns are query rows, as in S^T).
// The AMX path's lazy running max (SoftmaxBlock): a row's max moves when a block's exceeds it by
// more than this (natural-log units), so P <= e^5.5 ~ 245, well inside bf16 and fp32.
constexpr float kLazyMax = 5.5f;

bool UsesAmx(const FwdProblem& p) {
#if IOATTN_HAVE_FLASH_AMX
  const DType kv = p.kvt();
  const bool bf16 = p.dtype == DType::bf16 && (kv == DType::bf16 || kv == DType::f8e4m3 || kv == DType::i8);
  // f16 as two bf16 parts (x = hi + lo exactly): head dims up to 256 (the stages' room)
  const bool f16 = p.dtype == DType::f16 && kv == DType::f16 && p.head_dim <= 256 && p.head_dim_v <= 256;
  // Head dims: the products' depth is a whole number of 32-element steps (Q and K rows, or each of
  // f16's three parts, zero-padded from d % 32 == 16).
  return kAmxTarget && (bf16 || f16) && !p.fp8() && p.head_dim % 16 == 0 && p.head_dim_v % 16 == 0 &&
         p.head_dim_v <= 512 && flash_amx_usable();
#else
  (void)p;
  return false;
#endif
}

// O^T columns (query rows) times this block's alpha, for the column groups where some alpha != 1.
HWY_INLINE void ScaleOT(const Workspace& ws, size_t nvq, size_t dv) {
  const DF df;
  for (size_t u = 0; u < nvq; ++u) {
    const VF a = hn::Load(df, ws.alpha + u * kL);
    if (hn::AllTrue(df, hn::Eq(a, hn::Set(df, 1.0f)))) continue;
    for (size_t x = 0; x < dv; ++x) {
      float* o = ws.o + x * kBr + u * kL;
      hn::Store(hn::Mul(hn::Load(df, o), a), df, o);
    }
  }
}

// True if a staged V^T column (key) in [j0, j1) holds a non-finite value.
HWY_INLINE bool AnyNonFiniteT(const uint16_t* vt, size_t dv, size_t j0, size_t j1) {
  for (size_t x = 0; x < dv; ++x)
    for (size_t j = j0; j < j1; ++j)
      if ((vt[x * kBcAmx + j] & 0x7F80u) == 0x7F80u) return true;
  return false;
}

// The exact path on O^T (fp32 P^T in st): keys with P == 0 contribute nothing, not 0 * inf.
// vt_lo (f16 inputs): V's second parts, added to vt's.
HWY_NOINLINE void PVSkipZerosT(const Workspace& ws, const uint16_t* vt, const uint16_t* vt_lo, size_t len, size_t ncols,
                               size_t dv) {
  for (size_t c = 0; c < ncols; ++c)
    for (size_t j = 0; j < len; ++j) {
      const float pij = ws.st[j * kBr + c];
      if (pij == 0.0f) continue;
      for (size_t x = 0; x < dv; ++x) {
        const size_t e = x * kBcAmx + j;
        ws.o[x * kBr + c] += pij * (bf16_to_float(vt[e]) + (vt_lo ? bf16_to_float(vt_lo[e]) : 0.0f));
      }
    }
}

// ---- one task ----------------------------------------------------------------------------

void RunTask(const FwdProblem& p, const Task& t, const Workspace& ws) {
  const int64_t g = p.group();
  const size_t d = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.head_dim_v);
  const size_t dvp = ws.dvp;
  const int64_t sq = t.sq, sk = t.sk;
  const size_t ncols = static_cast<size_t>(t.r1 - t.r0);
  const size_t nvq = (ncols + kL - 1) / kL;
  const size_t width = nvq * kL;
  const DType dt = p.dtype, kvt = p.kvt();
  const float ninf = -std::numeric_limits<float>::infinity();
  const bool amx = UsesAmx(p);
  // f16 on AMX: every operand as two bf16 parts; S from K = [Kh | Kh' | Kl] . Q = [Qh; Ql; Qh'] (the
  // Ql Kl term, < 2^-16 relative, dropped), O^T += Vh Ph + Vh' Pl + Vl Ph, where x' is x's hi part
  // with inf / NaN as 0 (flash_amx_split_f16): only hi . hi products meet a non-finite input.
  const bool split = amx && dt == DType::f16;
  // The depth of the S products: d rounded up to whole 32-element steps (dq: Q and K rows, or each
  // of f16's three parts, copied with zeros after d, which add nothing to a score), 3 dq for f16.
  const size_t dq = round_up(d, size_t{32});
  const size_t da = split ? 3 * dq : dq;
  const bool pad = amx && !split && dq != d;
  // AMX: Q in VNNI order, [column tile][da / 32][16 dim pairs][16 columns], in qt's memory.
  uint32_t* const qv = reinterpret_cast<uint32_t*>(ws.qt);
  const uint16_t* qrows[16] = {};  // the current column group's Q rows (AMX)

  // Per query row: visible key range, ALiBi slope, initial max (the sink logit, if any), and
  // the packed, pre-scaled column of Q^T. Pad columns see no key and hold Q = 0.
  for (size_t c = 0; c < width; ++c) {
    ws.l[c] = 0.0f;
    ws.poison[c] = 0.0f;
    if (c >= ncols) {
      ws.lo[c] = ws.hi[c] = ws.diag[c] = 0;
      ws.slope[c] = 0.0f;
      ws.m[c] = ninf;
      if (!amx)
        for (size_t k = 0; k < d; ++k) ws.qt[k * kBr + c] = 0.0f;
      continue;
    }
    const int64_t r = t.r0 + static_cast<int64_t>(c);
    const int64_t i = r / g, h = t.hk * g + r % g;
    int64_t lo, hi;
    visible_keys(i, sq, sk, p.window_left, p.window_right, &lo, &hi);
    ws.lo[c] = clamp_i32(lo);
    ws.hi[c] = clamp_i32(hi);
    ws.diag[c] = clamp_i32(i + (sk - sq));
    ws.slope[c] = p.alibi_slopes ? p.alibi_slopes[h] : 0.0f;
    ws.m[c] = p.sinks ? p.sinks[h] : ninf;
    const int64_t qoff = t.b * p.q_stride.batch + (t.q_start + i) * p.q_stride.seq + h * p.q_stride.head;
    if (amx) {
      qrows[c % kL] = static_cast<const uint16_t*>(p.q) + qoff;
#if IOATTN_HAVE_FLASH_AMX
      if (split) {  // [Qh | Ql | Qh'] in st (free until the first block's products)
        uint16_t* row = reinterpret_cast<uint16_t*>(ws.st) + c % kL * da;
        if (dq != d) std::memset(row, 0, da * sizeof(uint16_t));
        flash_amx_split_f16(qrows[c % kL], d, row, row + dq, row + 2 * dq);
        qrows[c % kL] = row;
      } else if (pad) {  // [Q | 0] in st (as above)
        uint16_t* row = reinterpret_cast<uint16_t*>(ws.st) + c % kL * da;
        std::memcpy(row, qrows[c % kL], d * sizeof(uint16_t));
        std::memset(row + d, 0, (da - d) * sizeof(uint16_t));
        qrows[c % kL] = row;
      }
      if (c % kL == kL - 1 || c + 1 == ncols) {  // the group's last row: pack it (pad rows zero)
        for (size_t i = c % kL + 1; i < kL; ++i) qrows[i] = nullptr;
        flash_amx_pack_q(qrows, da, qv + c / kL * (da / 32) * 256);
      }
#endif
    } else if (p.fp8()) {
      const float qs = p.q_descale.at(t.b, t.hk) * p.scale;
      for (size_t k = 0; k < d; ++k)
        ws.qt[k * kBr + c] = e4m3_to_float(static_cast<const uint8_t*>(p.q)[qoff + static_cast<int64_t>(k)]) * qs;
    } else {
      for (size_t k = 0; k < d; ++k)
        ws.qt[k * kBr + c] = load_float(p.q, dt, qoff + static_cast<int64_t>(k)) * p.scale;
    }
  }
  std::memset(ws.o, 0, kBr * dvp * sizeof(float));
#if IOATTN_HAVE_FLASH_AMX
  if (amx) flash_amx_begin();
#endif

  // The key range of the tile: lo and hi are monotone in the query row, so the first row bounds
  // the start and the last row the end; blocks inside [lo(last), hi(first)) need no mask.
  int64_t lo_first, hi_first, lo_last, hi_last;
  visible_keys(t.r0 / g, sq, sk, p.window_left, p.window_right, &lo_first, &hi_first);
  visible_keys((t.r1 - 1) / g, sq, sk, p.window_left, p.window_right, &lo_last, &hi_last);
  BlockMods mods;
  mods.alibi = p.alibi_slopes != nullptr;
  mods.softcap = p.softcap;
  const int64_t hk = t.hk;
  const float k_descale = p.k_descale.at(t.b, hk), v_descale = p.v_descale.at(t.b, hk);
  // AMX over 8-bit cache codes: the codes staged as bf16 (e4m3 as value * 2^-8), k_scale (and the
  // 2^8) folded into the softmax's score scale, v_scale (and the 2^8) into O's normaliser.
  const bool codes = amx && (kvt == DType::f8e4m3 || kvt == DType::i8);
  const float code_unit = kvt == DType::f8e4m3 ? 256.0f : 1.0f;
  const float qk_scale = codes ? p.scale * k_descale * code_unit : p.scale;
  const float o_mul = codes ? v_descale * code_unit : 1.0f;
  // Blocks sit on a global grid of bc keys, so a row's result does not depend on which tile
  // (hence on the thread count) computed it: bit-identical for any number of threads.
  const int64_t bc = static_cast<int64_t>(amx ? kBcAmx : kBc);
  const int64_t kb0 = lo_first / bc * bc;
  for (int64_t kb = kb0; kb < hi_last; kb += bc) {
    const size_t len = static_cast<size_t>(std::min<int64_t>(bc, hi_last - kb));
    const size_t nkeys = round_up(len, kMr1);
    mods.mask = !(kb >= lo_last && kb + static_cast<int64_t>(len) <= hi_first);
    const uint16_t* vrows[std::max(kBc, kBcAmx)];
    const uint16_t* vrows_lo[kBcAmx];
    const uint16_t* vrows_hf[kBcAmx];
    for (size_t j = 0; j < len; ++j) {
      const int64_t key = t.k_start + kb + static_cast<int64_t>(j);
      int64_t page = t.b, slot = key;  // (a KV-cache block table: the key's page and offset)
      if (p.block_table) {
        page = p.block_table[t.b * p.bt_stride_batch + key / p.page_size * p.bt_stride_page];
        slot = key % p.page_size;
      }
      const int64_t koff = page * p.k_stride.batch + slot * p.k_stride.seq + hk * p.k_stride.head;
      const int64_t voff = page * p.v_stride.batch + slot * p.v_stride.seq + hk * p.v_stride.head;
      if (amx) {  // K rows copied as they are (or converted from codes), V rows transposed below
        uint16_t* krow = reinterpret_cast<uint16_t*>(ws.kp) + j * da;
#if IOATTN_HAVE_FLASH_AMX
        if (split) {  // K as [Kh | Kh' | Kl]; V's parts wait in st (3 x 128 x dv <= 384 x 128 floats)
          if (dq != d) std::memset(krow, 0, da * sizeof(uint16_t));
          flash_amx_split_f16(static_cast<const uint16_t*>(p.k) + koff, d, krow, krow + 2 * dq, krow + dq);
          uint16_t* vh = reinterpret_cast<uint16_t*>(ws.st) + j * dv;
          uint16_t* vl = vh + kBcAmx * dv;
          uint16_t* vhf = vl + kBcAmx * dv;
          flash_amx_split_f16(static_cast<const uint16_t*>(p.v) + voff, dv, vh, vl, vhf);
          vrows[j] = vh;
          vrows_lo[j] = vl;
          vrows_hf[j] = vhf;
          continue;
        }
        if (pad) std::memset(krow + d, 0, (da - d) * sizeof(uint16_t));
        if (codes) {  // (V's converted rows wait in st, which the products overwrite only after)
          uint16_t* vrow = reinterpret_cast<uint16_t*>(ws.st) + j * dv;
          flash_amx_codes_to_bf16(static_cast<const uint8_t*>(p.k) + koff, d, kvt == DType::f8e4m3, krow);
          flash_amx_codes_to_bf16(static_cast<const uint8_t*>(p.v) + voff, dv, kvt == DType::f8e4m3, vrow);
          vrows[j] = vrow;
          continue;
        }
#endif
        std::memcpy(krow, static_cast<const uint16_t*>(p.k) + koff, d * sizeof(uint16_t));
        vrows[j] = static_cast<const uint16_t*>(p.v) + voff;
        continue;
      }
      LoadRow(kvt, p.k, koff, d, ws.kp + j * d, k_descale);
      LoadRow(kvt, p.v, voff, dv, ws.vp + j * dvp, v_descale);
    }
    if (amx) {
#if IOATTN_HAVE_FLASH_AMX
      const size_t kpad = round_up(len, 16);  // the key tiles' rows
      if (kpad > len) std::memset(reinterpret_cast<uint16_t*>(ws.kp) + len * da, 0, (kpad - len) * da * sizeof(uint16_t));
      flash_amx_stage_vt(vrows, len, dv, reinterpret_cast<uint16_t*>(ws.vp), kBcAmx);
      if (split) {
        flash_amx_stage_vt(vrows_lo, len, dv, reinterpret_cast<uint16_t*>(ws.vp) + dv * kBcAmx, kBcAmx);
        flash_amx_stage_vt(vrows_hf, len, dv, reinterpret_cast<uint16_t*>(ws.vp) + 2 * dv * kBcAmx, kBcAmx);
      }
#endif
    } else if (nkeys > len) {
      std::memset(ws.kp + len * d, 0, (nkeys - len) * d * sizeof(float));
    }

    RowPrefetch pf;  // (rows of one stride: none across the pages of a block table)
    const int64_t next = kb + bc;
    if (next < hi_last && !p.block_table) {
      const int64_t key = t.k_start + next;
      const int64_t esize = dtype_size(kvt);
      pf.k = static_cast<const char*>(p.k) +
             (t.b * p.k_stride.batch + key * p.k_stride.seq + hk * p.k_stride.head) * esize;
      pf.v = static_cast<const char*>(p.v) +
             (t.b * p.v_stride.batch + key * p.v_stride.seq + hk * p.v_stride.head) * esize;
      pf.k_stride = p.k_stride.seq * esize;
      pf.v_stride = p.v_stride.seq * esize;
      pf.k_bytes = d * esize;
      pf.v_bytes = dv * esize;
      pf.rows = static_cast<size_t>(std::min<int64_t>(bc, hi_last - next));
      // spread over the register-tile calls of the GEMMs (AMX: over the softmax's row groups)
      pf.nslices = amx ? nvq : GemmCalls(nkeys, nvq, ncols, dvp / kL);
    }
    Block blk;
    blk.kb = kb;
    blk.len = len;
    blk.ncols = ncols;
    // V rows that some row of the tile masks: [0, masked_a) and [masked_b, len) of the block (P
    // there must add nothing, not 0 * inf: a non-finite value in them takes the exact skip path).
    size_t masked_a = 0, masked_b = len;
    if (mods.mask) {
      masked_a = static_cast<size_t>(std::clamp<int64_t>(lo_last - kb, 0, len));
      masked_b = std::max(masked_a, static_cast<size_t>(std::clamp<int64_t>(hi_first - kb, 0, len)));
    }
#if IOATTN_HAVE_FLASH_AMX
    if (amx) {
      int32_t kt0[kBr / kL], kt1[kBr / kL], kc0[kBr / kL], kc1[kBr / kL];
      for (size_t u = 0; u < nvq; ++u) {
        size_t j0, j1;
        VisibleSpan(ws, blk, u * kL, (u + 1) * kL, &j0, &j1);
        if (j1 <= j0) j0 = j1 = 0;
        kt0[u] = static_cast<int32_t>(j0 / 16), kt1[u] = static_cast<int32_t>((j1 + 15) / 16);
        kc0[u] = static_cast<int32_t>(j0 / 32), kc1[u] = static_cast<int32_t>((j1 + 31) / 32);
      }
      const uint16_t* vt = reinterpret_cast<const uint16_t*>(ws.vp);
      const uint16_t* vt_lo = split ? vt + dv * kBcAmx : nullptr;      // (f16: Vl)
      const uint16_t* vt_hf = split ? vt + 2 * dv * kBcAmx : nullptr;  // (f16: Vh')
      flash_amx_qk(reinterpret_cast<const uint16_t*>(ws.kp), da, qv, nvq, kt0, kt1, ws.st, kBr);
      const bool skip_zeros = mods.mask && (AnyNonFiniteT(vt, dv, 0, masked_a) || AnyNonFiniteT(vt, dv, masked_b, len));
      if (!mods.mask && !mods.alibi && !(mods.softcap > 0))  // the common block: AVX512-BF16 softmax
        flash_amx_softmax_plain(ws.st, kBr, nvq, len, qk_scale, kLazyMax, ws.m, ws.l, ws.alpha, ws.poison, ws.pv,
                                kBr, [](void* a) { static_cast<RowPrefetch*>(a)->Next(); }, &pf,
                                split ? ws.pv_lo : nullptr);
      else
        SoftmaxBlock(ws, nvq, kb, len, mods, qk_scale, skip_zeros ? nullptr : ws.pv, kLazyMax, &pf,
                     split && !skip_zeros ? ws.pv_lo : nullptr);
      pf.Finish();
      ScaleOT(ws, nvq, dv);
      if (skip_zeros) {
        PVSkipZerosT(ws, vt, vt_lo, len, ncols, dv);
      } else {
        flash_amx_pv(vt, kBcAmx, dv, ws.pv, kBr, nvq, kc0, kc1, ws.o, kBr);
        if (split) {
          flash_amx_pv(vt_hf, kBcAmx, dv, ws.pv_lo, kBr, nvq, kc0, kc1, ws.o, kBr);  // Vh' Pl
          flash_amx_pv(vt_lo, kBcAmx, dv, ws.pv, kBr, nvq, kc0, kc1, ws.o, kBr);     // Vl Ph
        }
      }
      continue;
    }
#endif
    TileQK(ws, blk, d, nvq, pf);
    SoftmaxBlock(ws, nvq, kb, len, mods);
    if (mods.mask && (AnyNonFinite(ws, 0, masked_a) || AnyNonFinite(ws, masked_b, len)))
      TilePVSkipZeros(ws, len, ncols);
    else
      TilePV(ws, blk, pf);
    pf.Finish();
  }
#if IOATTN_HAVE_FLASH_AMX
  if (amx) flash_amx_end();
#endif

  // Normalise and write O (input dtype) and LSE (fp32).
  for (size_t c = 0; c < ncols; ++c) {
    const int64_t r = t.r0 + static_cast<int64_t>(c);
    const int64_t i = r / g, h = t.hk * g + r % g;
    const float m = ws.m[c];
    float l = ws.l[c];
    if (p.sinks && p.sinks[h] > ninf) l += std::exp(p.sinks[h] - m);
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float lse = l > 0.0f ? m + std::log(l) : ninf;
    if (ws.poison[c] != 0.0f) inv = lse = std::numeric_limits<float>::quiet_NaN();
    const int64_t ooff = t.b * p.o_stride.batch + (t.q_start + i) * p.o_stride.seq + h * p.o_stride.head;
    const float* orow = ws.o + c * dvp;
#if IOATTN_HAVE_FLASH_AMX
    if (amx) {  // rows of O from columns of O^T, 16 at a time, into the (finished) K stage
      if (c % kL == 0) flash_amx_unpack_o(ws.o + c, kBr, dv, ws.kp, dvp);
      orow = ws.kp + c % kL * dvp;
    }
#endif
    StoreRow(p.out_dtype(), p.o, ooff, dv, orow, inv * o_mul);
    if (p.lse) p.lse[t.b * p.lse_stride.batch + h * p.lse_stride.head + (t.q_start + i) * p.lse_stride.seq] = lse;
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace ioattn::detail::flash
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ioattn::detail {
namespace flash {

HWY_EXPORT(TargetShape);
HWY_EXPORT(TargetBits);
HWY_EXPORT(RunTask);
HWY_EXPORT(UsesAmx);

namespace {

// L2 bytes per core as the C library reports it (0 if unknown).
size_t l2_bytes() {
#ifdef _SC_LEVEL2_CACHE_SIZE
  static const long bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return bytes > 0 ? static_cast<size_t>(bytes) : 0;
#else
  return 0;
#endif
}

// Query rows per tile, in steps of 48 (a multiple of every vector length and register-tile
// height), at most the target's Br, and smaller when
//  * Q^T and the O accumulator of a tile ((d + dv) * 4 bytes a row) would fill more than half of
//    L2 (1 MiB assumed if unknown), or
//  * the problem would give fewer than 4 tasks per thread.
int64_t tile_rows(const FwdProblem& p, const TileShape& s, int threads) {
  constexpr int64_t kStep = 48;
  const size_t l2 = l2_bytes() ? l2_bytes() : size_t{1} << 20;
  const int64_t row_bytes = (p.head_dim + round_up(static_cast<size_t>(p.head_dim_v), s.lanes)) * 4;
  const int64_t fit = static_cast<int64_t>(l2 / 2) / std::max<int64_t>(row_bytes, 1) / kStep * kStep;
  int64_t rows = 0;  // query rows of all kv groups
  for (int64_t b = 0; b < p.batch; ++b)
    rows += (p.varlen() ? p.cu_seqlens_q_host[b + 1] - p.cu_seqlens_q_host[b] : p.seqlen_q) * p.heads_q;
  const int64_t spread = (rows / (4 * static_cast<int64_t>(threads)) + kStep - 1) / kStep * kStep;
  return std::max<int64_t>(kStep, std::min<int64_t>({s.br, fit, spread}));
}

int resolve_threads(const FwdProblem& p);

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// IOATTN_CPU_TARGET=avx2|sse4|scalar|avx3 (emu128 with compilers where Highway uses it): never pick a target better than that (for testing
// the lower code paths on a machine that has the higher ones). Applied once per process.
void apply_target_cap() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* e = std::getenv("IOATTN_CPU_TARGET");
    if (!e || !*e) return;
    const std::string want = lower(e);
    std::string compiled;
    for (int64_t bits = HWY_TARGETS; bits != 0; bits &= bits - 1) {
      const int64_t t = bits & -bits;
      if (lower(hwy::TargetName(t)) == want) {
        hwy::DisableTargets(t - 1);  // all better targets have lower bits
        return;
      }
      compiled += (compiled.empty() ? "" : ", ") + lower(hwy::TargetName(t));
    }
    // Never silently: say that the cap did nothing and what would have worked.
    std::fprintf(stderr, "ioattn: IOATTN_CPU_TARGET=%s matches no compiled SIMD target (%s); ignored\n", e,
                 compiled.c_str());
  });
}

int env_threads() {
  const char* e = std::getenv("IOATTN_NUM_THREADS");
  const int n = e ? std::atoi(e) : 0;
  return n > 0 ? n : 0;
}

int resolve_threads(const FwdProblem& p) {
  if (p.num_threads > 0) return p.num_threads;
  const int n = env_threads();
  return n > 0 ? n : omp_get_max_threads();
}

}  // namespace
}  // namespace flash

void cpu_flash_forward(const FwdProblem& p) {
  using flash::Task;
  flash::apply_target_cap();
  const flash::TileShape shape = HWY_DYNAMIC_DISPATCH(flash::TargetShape)();
  // The chosen target is initialised by the call above; keep its pointer for the task loop.
  auto* const run_task = &HWY_DYNAMIC_DISPATCH(flash::RunTask);

  // Tasks: batch-major, then kv head, then query tile (last tile first: under a causal mask
  // the last tiles see the most keys, and dynamic scheduling balances better heavy-first).
  const int64_t g = p.group();
  int threads = flash::resolve_threads(p);
  const int64_t br = flash::tile_rows(p, shape, threads);
  std::vector<int64_t> first_task(static_cast<size_t>(p.batch) + 1, 0);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t sq = p.varlen() ? p.cu_seqlens_q_host[b + 1] - p.cu_seqlens_q_host[b] : p.seqlen_q;
    const int64_t tiles = (sq * g + br - 1) / br;
    first_task[b + 1] = first_task[b] + p.heads_kv * tiles;
  }
  const int64_t ntasks = first_task[p.batch];
  if (ntasks == 0) return;
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, ntasks)));

#pragma omp parallel num_threads(threads)
  {
    const flash::Workspace ws(shape, p.head_dim, p.head_dim_v);
#pragma omp for schedule(dynamic, 1)
    for (int64_t id = 0; id < ntasks; ++id) {
      const int64_t b =
          std::upper_bound(first_task.begin(), first_task.end(), id) - first_task.begin() - 1;
      Task t;
      t.b = b;
      if (p.varlen()) {
        t.q_start = p.cu_seqlens_q_host[b];
        t.sq = p.cu_seqlens_q_host[b + 1] - t.q_start;
        t.k_start = p.cu_seqlens_k_host[b];
        t.sk = p.cu_seqlens_k_host[b + 1] - t.k_start;
      } else {
        t.sq = p.seqlen_q;
        t.sk = p.kv_lens ? p.kv_lens[b] : p.seqlen_k;
      }
      const int64_t rows = t.sq * g;
      const int64_t tiles = (rows + br - 1) / br;
      const int64_t local = id - first_task[b];
      t.hk = local / tiles;
      const int64_t tile = tiles - 1 - local % tiles;
      t.r0 = tile * br;
      t.r1 = std::min<int64_t>(rows, t.r0 + br);
      run_task(p, t, ws);
    }
  }
}

std::string cpu_flash_tile(const FwdProblem& p) {
  flash::apply_target_cap();
  const flash::TileShape s = HWY_DYNAMIC_DISPATCH(flash::TargetShape)();
  const bool amx = HWY_DYNAMIC_DISPATCH(flash::UsesAmx)(p);
  return std::to_string(flash::tile_rows(p, s, flash::resolve_threads(p))) + "x" + std::to_string(amx ? s.bc_amx : s.bc) +
         (amx ? (p.dtype == DType::f16 ? " amx-bf16 (f16 as two bf16 parts)" : " amx-bf16") : "");
}

std::vector<std::string> cpu_compiled_targets() {
  std::vector<std::string> names;
  for (int64_t bits = HWY_TARGETS; bits != 0; bits &= bits - 1)
    names.push_back(flash::lower(hwy::TargetName(bits & -bits)));
  return names;
}

std::string cpu_best_target() {
  flash::apply_target_cap();
  return flash::lower(hwy::TargetName(HWY_DYNAMIC_DISPATCH(flash::TargetBits)()));
}

int cpu_max_threads() { return flash::resolve_threads(FwdProblem{}); }

}  // namespace ioattn::detail
#endif  // HWY_ONCE

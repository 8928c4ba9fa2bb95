// AMX-BF16 tile products for the CPU flash forward: see flash_amx.hpp. Compiled without Highway:
// every function that executes AMX instructions carries its own target attribute and runs only
// after flash_amx_usable() said yes.
#include "cpu/flash_amx.hpp"

#include "cpu/exp2_poly.hpp"
#include "cpu/serving_amx.hpp"
#include "cpu/transpose_avx512.hpp"

#if IOATTN_HAVE_FLASH_AMX

// GCC 12: its AVX-512 headers trip -W(maybe-)uninitialized (_mm512_undefined_*).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

// One target set for every function here (they call each other inline): flash_amx_usable() checks
// AMX-BF16 and AVX512-BF16 (AVX-512 F / BW / VL come with them).
#define IOATTN_FLASH_AMX_ATTR __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace ioattn::detail::flash {

namespace {
// 64-byte aligned storage for the tile operands (tileloadd / aligned vector stores).
template <class T>
struct AlignedAlloc {
  using value_type = T;
  AlignedAlloc() = default;
  template <class U>
  AlignedAlloc(const AlignedAlloc<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const AlignedAlloc<U>&) const { return true; }
  template <class U>
  bool operator!=(const AlignedAlloc<U>&) const { return false; }
};

// The first min(n, 16) lanes.
IOATTN_FLASH_AMX_ATTR inline __mmask16 Mask16(size_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// 2^x for x in [-inf, 128): n = round(max(x, -127)), 2^(x - n) by kExp2Poly (exp2_poly.hpp, as the
// Highway softmax), times 2^n by vscalefps (below 2^-126 a denormal or 0).
IOATTN_FLASH_AMX_ATTR inline __m512 Exp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 6
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// vcvtne2ps2bf16(r1, r0) = [r0 0..15 | r1 0..15] as words -> the 16 words (r0[i], r1[i]).
IOATTN_FLASH_AMX_ATTR inline __m512i Interleave(__m512i h) {
  alignas(64) static const uint16_t kIdx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kIdx), h);
}

// Rows 2 k and 2 k + 1 of 16 values each -> the 16 words (r0[i], r1[i]) as bf16 pairs.
IOATTN_FLASH_AMX_ATTR inline __m512i PairBf16(__m512 r0, __m512 r1) {
  return Interleave((__m512i)_mm512_cvtne2ps_pbh(r1, r0));
}

// 16 bf16 values back to fp32 (exact).
IOATTN_FLASH_AMX_ATTR inline __m512 Bf16Widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The 2 x 2 block of 16 x 16 fp32 C tiles at c (rows ldc apart; the second row of tiles only when
// twom, the second column only when twon) (+)= A B over nk chunks of 32 products: the A tiles at a
// and a + a_next (bf16 rows astride bytes apart), the B tiles at b and b + b_next (VNNI rows
// bstride bytes apart); each chunk moves a by a_step and b by b_step elements. kLoadC: C's tiles
// are loaded first, else start at zero. Tiles: C 0-3, A 4/5, B 6/7 (the palette of flash_amx.hpp).
template <bool kLoadC>
IOATTN_FLASH_AMX_ATTR inline void Block2x2(const uint16_t* a, size_t a_next, size_t astride, size_t a_step,
                                           const uint32_t* b, size_t b_next, size_t bstride, size_t b_step,
                                           size_t nk, float* c, size_t ldc, bool twom, bool twon) {
  const size_t cstride = ldc * 4;
  if constexpr (kLoadC) {
    _tile_loadd(0, c, cstride);
    if (twon) _tile_loadd(1, c + 16, cstride);
    if (twom) _tile_loadd(2, c + 16 * ldc, cstride);
    if (twom && twon) _tile_loadd(3, c + 16 * ldc + 16, cstride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (size_t q = 0; q < nk; ++q, a += a_step, b += b_step) {
    _tile_loadd(6, b, bstride);
    _tile_loadd(4, a, astride);
    _tile_dpbf16ps(0, 4, 6);
    if (twon) {
      _tile_loadd(7, b + b_next, bstride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (twom) {
      _tile_loadd(5, a + a_next, astride);
      _tile_dpbf16ps(2, 5, 6);
      if (twon) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, cstride);
  if (twon) _tile_stored(1, c + 16, cstride);
  if (twom) _tile_stored(2, c + 16 * ldc, cstride);
  if (twom && twon) _tile_stored(3, c + 16 * ldc + 16, cstride);
}
}  // namespace

bool flash_amx_usable() { return serving::amx_bf16_usable(); }
void flash_amx_begin() { serving::amx_begin(); }
void flash_amx_end() { serving::amx_end(); }

IOATTN_FLASH_AMX_ATTR void flash_amx_qk(const uint16_t* ks, size_t d, const uint32_t* qv, size_t ncol_tiles,
                                        const int32_t* kt0, const int32_t* kt1, float* st, size_t ldst) {
  const size_t chunks = d / 32;
  for (size_t u = 0; u < ncol_tiles; u += 2) {
    const bool two = u + 1 < ncol_tiles;
    int32_t a = kt0[u], b = kt1[u];
    if (two) a = std::min(a, kt0[u + 1]), b = std::max(b, kt1[u + 1]);
    for (int32_t kt = a; kt < b; kt += 2)  // A: 16 K rows x 32 dims; B: Q's tiles, 1 KiB apart per chunk
      Block2x2<false>(ks + static_cast<size_t>(kt) * 16 * d, 16 * d, d * 2, 32, qv + u * chunks * 256, chunks * 256,
                      64, 256, chunks, st + static_cast<size_t>(kt) * 16 * ldst + u * 16, ldst, kt + 1 < b, two);
  }
}

IOATTN_FLASH_AMX_ATTR void flash_amx_pv(const uint16_t* vt, size_t ldv, size_t dv, const uint32_t* pv, size_t ldp,
                                        size_t ncol_tiles, const int32_t* kc0, const int32_t* kc1, float* ot,
                                        size_t ldo) {
  const size_t xtiles = dv / 16;
  for (size_t u = 0; u < ncol_tiles; u += 2) {
    const bool two = u + 1 < ncol_tiles;
    int32_t a = kc0[u], b = kc1[u];
    if (two) a = std::min(a, kc0[u + 1]), b = std::max(b, kc1[u + 1]);
    if (a >= b) continue;
    for (size_t xt = 0; xt < xtiles; xt += 2)  // A: 16 V^T rows x 32 keys; B: 16 key pairs of P^T
      Block2x2<true>(vt + xt * 16 * ldv + static_cast<size_t>(a) * 32, 16 * ldv, ldv * 2, 32,
                     pv + static_cast<size_t>(a) * 16 * ldp + u * 16, 16, ldp * 4, 16 * ldp, static_cast<size_t>(b - a),
                     ot + xt * 16 * ldo + u * 16, ldo, xt + 1 < xtiles, two);
  }
}

IOATTN_FLASH_AMX_ATTR void flash_amx_softmax_plain(const float* st, size_t ldst, size_t ngroups, size_t len,
                                                    float scale, float lazy, float* m, float* l, float* alpha,
                                                    float* poison, uint32_t* pv, size_t ldp, void (*hook)(void*),
                                                    void* hook_arg, uint32_t* pv_lo) {
  const __m512 pinf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 one = _mm512_set1_ps(1.0f), vscale = _mm512_set1_ps(scale), log2e = _mm512_set1_ps(kLog2e);
  const __m512 c1 = _mm512_set1_ps(scale * kLog2e);
  const size_t pairs = len / 2, pad_end = (len + 31) / 32 * 16;
  for (size_t g = 0; g < ngroups; ++g) {
    if (hook) hook(hook_arg);
    const float* s = st + g * 16;
    uint32_t* pg = pv + g * 16;
    uint32_t* pgl = pv_lo ? pv_lo + g * 16 : nullptr;
    // Key pair jj's P as bf16 pairs, and (f16 inputs) P - bf16(P), the second bf16 part.
    auto store_pair = [&](size_t jj, __m512 p0, __m512 p1) IOATTN_FLASH_AMX_ATTR {
      const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
      _mm512_store_si512(pg + jj * ldp, Interleave(h));
      if (pgl) {
        const __m512 r0 = _mm512_sub_ps(p0, Bf16Widen(_mm512_castsi512_si256(h)));
        const __m512 r1 = _mm512_sub_ps(p1, Bf16Widen(_mm512_extracti64x4_epi64(h, 1)));
        _mm512_store_si512(pgl + jj * ldp, PairBf16(r0, r1));
      }
    };
    __m512 mr0 = ninf, mr1 = ninf;  // max of the raw scores (two chains)
    __mmask16 bad = 0;              // NaN or +inf among them
    size_t j = 0;
    for (; j + 2 <= len; j += 2) {
      const __m512 v0 = _mm512_load_ps(s + j * ldst), v1 = _mm512_load_ps(s + (j + 1) * ldst);
      bad |= _mm512_cmp_ps_mask(v0, pinf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(v1, pinf, _CMP_NLT_UQ);
      mr0 = _mm512_max_ps(mr0, v0);
      mr1 = _mm512_max_ps(mr1, v1);
    }
    if (j < len) {
      const __m512 v0 = _mm512_load_ps(s + j * ldst);
      bad |= _mm512_cmp_ps_mask(v0, pinf, _CMP_NLT_UQ);
      mr0 = _mm512_max_ps(mr0, v0);
    }
    // The scaled max (rounding is monotone: the max of the scaled scores), a scaled +inf poisons.
    const __m512 m_old = _mm512_load_ps(m + g * 16);
    const __m512 mb = _mm512_mul_ps(_mm512_max_ps(mr0, mr1), vscale);
    bad |= _mm512_cmp_ps_mask(mb, pinf, _CMP_NLT_UQ);
    __m512 mx = _mm512_max_ps(m_old, mb);
    mx = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, _mm512_add_ps(m_old, _mm512_set1_ps(lazy)), _CMP_GT_OQ), m_old, mx);
    const __m512 m_use = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx, ninf, _CMP_NEQ_OQ), mx);
    const __m512 a = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, m_old, _CMP_EQ_OQ),
                                          Exp2(_mm512_mul_ps(_mm512_sub_ps(m_old, m_use), log2e)), one);
    const __m512 bias = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), m_use), log2e);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (size_t jj = 0; jj < pairs; ++jj) {
      const __m512 p0 = Exp2(_mm512_fmadd_ps(_mm512_load_ps(s + 2 * jj * ldst), c1, bias));
      const __m512 p1 = Exp2(_mm512_fmadd_ps(_mm512_load_ps(s + (2 * jj + 1) * ldst), c1, bias));
      store_pair(jj, p0, p1);
      sum0 = _mm512_add_ps(sum0, p0);
      sum1 = _mm512_add_ps(sum1, p1);
    }
    size_t jj = pairs;
    if (len % 2) {
      const __m512 p0 = Exp2(_mm512_fmadd_ps(_mm512_load_ps(s + (len - 1) * ldst), c1, bias));
      store_pair(jj++, p0, _mm512_setzero_ps());
      sum0 = _mm512_add_ps(sum0, p0);
    }
    for (; jj < pad_end; ++jj) {
      _mm512_store_si512(pg + jj * ldp, _mm512_setzero_si512());
      if (pgl) _mm512_store_si512(pgl + jj * ldp, _mm512_setzero_si512());
    }
    _mm512_store_ps(l + g * 16, _mm512_fmadd_ps(_mm512_load_ps(l + g * 16), a, _mm512_add_ps(sum0, sum1)));
    _mm512_store_ps(m + g * 16, mx);
    _mm512_store_ps(alpha + g * 16, a);
    _mm512_store_ps(poison + g * 16, _mm512_mask_blend_ps(bad, _mm512_load_ps(poison + g * 16), one));
  }
}

// Column group u of Q in VNNI order: the 16 rows' dims [32 c, 32 c + 32) as 16 dim-pair words
// each, transposed, are the B tile of chunk c.
IOATTN_FLASH_AMX_ATTR void flash_amx_pack_q(const uint16_t* const* rows, size_t d, uint32_t* qv) {
  for (size_t c = 0; c < d / 32; ++c) {
    __m512i w[16];
    for (int i = 0; i < 16; ++i)
      w[i] = rows[i] ? _mm512_loadu_si512(rows[i] + 32 * c) : _mm512_setzero_si512();
    transpose16x16_u32(w);
    for (int k = 0; k < 16; ++k) _mm512_store_si512(qv + c * 256 + k * 16, w[k]);
  }
}

// out[i * ldr + x] = ot[x * ldo + i] for 16 columns i (query rows) and x < dv (dv % 16 == 0).
IOATTN_FLASH_AMX_ATTR void flash_amx_unpack_o(const float* ot, size_t ldo, size_t dv, float* out, size_t ldr) {
  for (size_t x0 = 0; x0 < dv; x0 += 16) {
    __m512i w[16];
    for (int x = 0; x < 16; ++x) w[x] = _mm512_loadu_si512(ot + (x0 + x) * ldo);
    transpose16x16_u32(w);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + i * ldr + x0, w[i]);
  }
}

// 8-bit cache codes -> bf16, exactly: e4m3 through the f16 bit pattern (sign, then the 7 low bits
// shifted up by 7: the value times 2^-8, subnormals included), widened by vcvtph2ps and narrowed
// by vcvtne2ps2bf16 (3 mantissa bits: exact), NaN codes (S.1111.111) set to a bf16 NaN; int8 codes
// as integers (|c| <= 128: exact).
IOATTN_FLASH_AMX_ATTR void flash_amx_codes_to_bf16(const uint8_t* src, size_t n, bool e4m3, uint16_t* dst) {
  for (size_t x = 0; x < n; x += 32) {
    const __mmask32 m = n - x >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (n - x)) - 1);
    const __m256i c = _mm256_maskz_loadu_epi8(m, src + x);
    __m512 lo, hi;
    __mmask32 nan = 0;
    if (e4m3) {
      const __m512i w = _mm512_cvtepu8_epi16(c);
      const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7f));
      const __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8),
                                        _mm512_slli_epi16(mag, 7));
      lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
      hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
      nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f));
    } else {
      lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c)));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1)));
    }
    __m512i b = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    b = _mm512_mask_mov_epi16(b, nan, _mm512_set1_epi16(0x7fc0));
    _mm512_mask_storeu_epi16(dst + x, m, b);
  }
}

// f16 -> two bf16 parts, hi = bf16(x) and lo = bf16(x - hi), exactly (11 significant bits = 8 + 3;
// f16's range inside bf16's normal range); lo = 0 where x is not finite (hi holds the inf / NaN).
IOATTN_FLASH_AMX_ATTR void flash_amx_split_f16(const uint16_t* src, size_t n, uint16_t* hi, uint16_t* lo,
                                              uint16_t* hi_finite) {
  for (size_t x = 0; x < n; x += 16) {
    const __mmask16 m = Mask16(n - x);
    const __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + x));
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 hv = Bf16Widen(h);
    const __mmask16 fin = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(std::numeric_limits<float>::infinity()),
                                            _CMP_LT_OQ);
    const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_sub_ps(fin, v, hv));
    _mm256_mask_storeu_epi16(hi + x, m, h);
    _mm256_mask_storeu_epi16(lo + x, m, l);
    _mm256_mask_storeu_epi16(hi_finite + x, m, _mm256_maskz_mov_epi16(fin, h));
  }
}

// Keys in pairs: the 32-bit word (v_2i[x], v_2i+1[x]) is element (x, i) of V^T read as 32-bit
// words, so 16 key pairs x 16 columns of such words, transposed, are 16 rows of V^T x 32 keys.
IOATTN_FLASH_AMX_ATTR void flash_amx_stage_vt(const uint16_t* const* rows, size_t n, size_t dv, uint16_t* vt,
                                              size_t ldv) {
  alignas(64) static const uint16_t kZeros[512] = {};  // a missing key's row (dv <= 512 here)
  for (size_t j0 = 0; j0 < ldv; j0 += 32) {
    const uint16_t* r[32];
    for (size_t j = 0; j < 32; ++j) r[j] = j0 + j < n ? rows[j0 + j] : kZeros;
    for (size_t x0 = 0; x0 < dv; x0 += 16) {
      __m512i w[16];
      for (int i = 0; i < 16; ++i) {
        const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[2 * i] + x0)));
        const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[2 * i + 1] + x0)));
        w[i] = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
      }
      transpose16x16_u32(w);
      for (int x = 0; x < 16; ++x) _mm512_storeu_si512(vt + (x0 + x) * ldv + j0, w[x]);
    }
  }
}

namespace {

// The parts of a split operand (flash_amx_matmul's split): 0 the value (rounded to bf16 when
// packed: hi), 1 lo = x - bf16(x), 2 hi' = x; both 0 where x is not finite.
IOATTN_FLASH_AMX_ATTR inline __m512 Part(__m512 x, int part) {
  if (part == 0) return x;
  const __mmask16 fin =
      _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_LT_OQ);
  if (part == 2) return _mm512_maskz_mov_ps(fin, x);
  return _mm512_maskz_sub_ps(fin, x, Bf16Widen((__m256i)_mm512_cvtneps_pbh(x)));
}

// A (M x K) into bf16 rows, m16 x parts * k32 zero-padded (parts 1, or 3 for split: the segments
// [hi | lo | hi'], each k32 wide): rows contiguous (sak == 1) or else columns contiguous (sam ==
// 1, the only two layouts the backward passes).
template <int parts>
IOATTN_FLASH_AMX_ATTR void PackA(size_t M, size_t K, const float* a, size_t sam, size_t sak, uint16_t* ap,
                                 size_t m16, size_t k32) {
  const size_t kd = parts * k32;  // the packed row
  if (sak == 1) {
    for (size_t m = 0; m < m16; ++m)
      for (size_t k = 0; k < k32; k += 32) {
        __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
        if (m < M) {
          lo = _mm512_maskz_loadu_ps(Mask16(K > k ? K - k : 0), a + m * sam + k);
          hi = _mm512_maskz_loadu_ps(Mask16(K > k + 16 ? K - k - 16 : 0), a + m * sam + k + 16);
        }
        for (int q = 0; q < parts; ++q)
          _mm512_store_si512(ap + m * kd + q * k32 + k, (__m512i)_mm512_cvtne2ps_pbh(Part(hi, q), Part(lo, q)));
      }
    return;
  }
  for (size_t m = 0; m < m16; m += 16) {  // 16 rows x 32 columns as pair words, transposed
    const __mmask16 mm = Mask16(M > m ? M - m : 0);
    for (size_t k = 0; k < k32; k += 32)
      for (int q = 0; q < parts; ++q) {
        __m512i w[16];
        for (size_t kk = 0; kk < 16; ++kk) {
          const size_t k0 = k + 2 * kk, k1 = k0 + 1;
          const __m512 c0 = k0 < K ? _mm512_maskz_loadu_ps(mm, a + k0 * sak + m) : _mm512_setzero_ps();
          const __m512 c1 = k1 < K ? _mm512_maskz_loadu_ps(mm, a + k1 * sak + m) : _mm512_setzero_ps();
          w[kk] = PairBf16(Part(c0, q), Part(c1, q));
        }
        transpose16x16_u32(w);
        for (size_t i = 0; i < 16; ++i) _mm512_store_si512(ap + (m + i) * kd + q * k32 + k, w[i]);
      }
  }
}

// B (K x N, rows ldb apart) -> VNNI pairs bp[(k / 2) * n16 + n] = (B[k][n], B[k + 1][n]); split
// (parts 3): the segments [hi ; hi' ; lo], k32 deep each, matching PackA's [hi | lo | hi'].
template <int parts>
IOATTN_FLASH_AMX_ATTR void PackB(size_t N, size_t K, const float* b, size_t ldb, uint32_t* bp, size_t n16,
                                  size_t k32) {
  static constexpr int kPartOf[3] = {0, 2, 1};
  for (int q = 0; q < parts; ++q)
    for (size_t kk = 0; kk < k32 / 2; ++kk) {
      const size_t k0 = 2 * kk, k1 = k0 + 1;
      uint32_t* row = bp + (q * k32 / 2 + kk) * n16;
      for (size_t n = 0; n < n16; n += 16) {
        const __mmask16 mn = Mask16(N > n ? N - n : 0);
        const __m512 r0 = k0 < K ? _mm512_maskz_loadu_ps(mn, b + k0 * ldb + n) : _mm512_setzero_ps();
        const __m512 r1 = k1 < K ? _mm512_maskz_loadu_ps(mn, b + k1 * ldb + n) : _mm512_setzero_ps();
        _mm512_store_si512(row + n, PairBf16(Part(r0, kPartOf[q]), Part(r1, kPartOf[q])));
      }
    }
}

// The per-thread operand scratch: A, the products T, and B (slot -1) or a packed B kept for
// several products (slots 0..kSlots-1, flash_amx_pack_b).
constexpr int kSlots = 3;
struct Scratch {
  std::vector<uint16_t, AlignedAlloc<uint16_t>> ap;
  std::vector<float, AlignedAlloc<float>> t;
  std::vector<uint32_t, AlignedAlloc<uint32_t>> bp[kSlots + 1];
};
thread_local Scratch tl_scratch;

// C (+)= A B in 16 x 16 fp32 tiles, 2 x 2 at a time over the K chunks: ap (m16 x k32 bf16 rows),
// bp (k32 / 2 x n16 VNNI pairs), c (rows ldc apart; kLoadC: its tiles loaded first, else zeros).
template <bool kLoadC>
IOATTN_FLASH_AMX_ATTR void TileGemm(const uint16_t* ap, const uint32_t* bp, float* c, size_t ldc, size_t m16,
                                    size_t n16, size_t k32) {
  const size_t mt = m16 / 16, nt = n16 / 16;
  for (size_t m = 0; m < mt; m += 2)
    for (size_t n = 0; n < nt; n += 2)
      Block2x2<kLoadC>(ap + m * 16 * k32, 16 * k32, k32 * 2, 32, bp + n * 16, 16, n16 * 4, 16 * n16, k32 / 32,
                       c + m * 16 * ldc + n * 16, ldc, m + 1 < mt, n + 1 < nt);
}

size_t K32(size_t K) { return std::max<size_t>(32, (K + 31) / 32 * 32); }
}  // namespace

IOATTN_FLASH_AMX_ATTR void flash_amx_pack_b(int slot, size_t N, size_t K, const float* b, size_t ldb, bool split) {
  Scratch& s = tl_scratch;
  const int parts = split ? 3 : 1;
  const size_t n16 = (N + 15) / 16 * 16, k32 = K32(K);
  auto& bp = s.bp[slot + 1];
  if (bp.size() < parts * k32 / 2 * n16) bp.resize(parts * k32 / 2 * n16);
  split ? PackB<3>(N, K, b, ldb, bp.data(), n16, k32) : PackB<1>(N, K, b, ldb, bp.data(), n16, k32);
}

IOATTN_FLASH_AMX_ATTR void flash_amx_matmul(size_t M, size_t N, size_t K, const float* a, size_t sam, size_t sak,
                                             const float* b, size_t ldb, float* c, size_t ldc, bool accumulate,
                                             float alpha, int b_slot, bool split) {
  if (M == 0 || N == 0) return;
  Scratch& s = tl_scratch;
  const int parts = split ? 3 : 1;
  const size_t m16 = (M + 15) / 16 * 16, n16 = (N + 15) / 16 * 16, k32 = K32(K) * parts;  // (the products' depth)
  if (s.ap.size() < m16 * k32) s.ap.resize(m16 * k32);
  split ? PackA<3>(M, K, a, sam, sak, s.ap.data(), m16, k32 / parts)
        : PackA<1>(M, K, a, sam, sak, s.ap.data(), m16, k32);
  if (b_slot < 0) flash_amx_pack_b(-1, N, K, b, ldb, split);
  const uint32_t* bp = s.bp[b_slot + 1].data();
  if (accumulate && alpha == 1.0f && M % 16 == 0 && N % 16 == 0) {  // C's own tiles: no scratch, no epilogue
    TileGemm<true>(s.ap.data(), bp, c, ldc, m16, n16, k32);
    return;
  }
  if (s.t.size() < m16 * n16) s.t.resize(m16 * n16);
  TileGemm<false>(s.ap.data(), bp, s.t.data(), n16, m16, n16, k32);
  const __m512 va = _mm512_set1_ps(alpha);
  for (size_t m = 0; m < M; ++m)
    for (size_t n = 0; n < N; n += 16) {
      const __mmask16 mn = Mask16(N - n);
      __m512 x = _mm512_mul_ps(_mm512_load_ps(s.t.data() + m * n16 + n), va);
      if (accumulate) x = _mm512_add_ps(_mm512_maskz_loadu_ps(mn, c + m * ldc + n), x);
      _mm512_mask_storeu_ps(c + m * ldc + n, mn, x);
    }
}

}  // namespace ioattn::detail::flash

#endif  // IOATTN_HAVE_FLASH_AMX

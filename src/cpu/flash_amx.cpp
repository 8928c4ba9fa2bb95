// AMX-BF16 tile products for the CPU flash forward: see flash_amx.hpp. Compiled without Highway:
// every function that executes AMX instructions carries its own target attribute and runs only
// after flash_amx_usable() said yes.
#include "cpu/flash_amx.hpp"

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
}  // namespace

bool flash_amx_usable() { return serving::amx_bf16_usable(); }
void flash_amx_begin() { serving::amx_begin(); }
void flash_amx_end() { serving::amx_end(); }

IOATTN_FLASH_AMX_ATTR void flash_amx_qk(const uint16_t* ks, size_t d, const uint32_t* qv, size_t ncol_tiles,
                                        const int32_t* kt0, const int32_t* kt1, float* st, size_t ldst) {
  const size_t chunks = d / 32, kstride = d * 2, sstride = ldst * 4;
  for (size_t u = 0; u < ncol_tiles; u += 2) {
    const bool two = u + 1 < ncol_tiles;
    int32_t a = kt0[u], b = kt1[u];
    if (two) a = std::min(a, kt0[u + 1]), b = std::max(b, kt1[u + 1]);
    const uint32_t* q0 = qv + u * chunks * 256;
    const uint32_t* q1 = q0 + chunks * 256;
    for (int32_t kt = a; kt < b; kt += 2) {
      const bool twok = kt + 1 < b;
      const uint16_t* k0 = ks + static_cast<size_t>(kt) * 16 * d;
      const uint16_t* k1 = k0 + 16 * d;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (size_t c = 0; c < chunks; ++c) {
        _tile_loadd(6, q0 + c * 256, 64);
        _tile_loadd(4, k0 + c * 32, kstride);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(7, q1 + c * 256, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (twok) {
          _tile_loadd(5, k1 + c * 32, kstride);
          _tile_dpbf16ps(2, 5, 6);
          if (two) _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* s = st + static_cast<size_t>(kt) * 16 * ldst + u * 16;
      _tile_stored(0, s, sstride);
      if (two) _tile_stored(1, s + 16, sstride);
      if (twok) {
        _tile_stored(2, s + 16 * ldst, sstride);
        if (two) _tile_stored(3, s + 16 * ldst + 16, sstride);
      }
    }
  }
}

IOATTN_FLASH_AMX_ATTR void flash_amx_pv(const uint16_t* vt, size_t ldv, size_t dv, const uint32_t* pv, size_t ldp,
                                        size_t ncol_tiles, const int32_t* kc0, const int32_t* kc1, float* ot,
                                        size_t ldo) {
  const size_t xtiles = dv / 16, vstride = ldv * 2, pstride = ldp * 4, ostride = ldo * 4;
  for (size_t u = 0; u < ncol_tiles; u += 2) {
    const bool two = u + 1 < ncol_tiles;
    int32_t a = kc0[u], b = kc1[u];
    if (two) a = std::min(a, kc0[u + 1]), b = std::max(b, kc1[u + 1]);
    if (a >= b) continue;
    for (size_t xt = 0; xt < xtiles; xt += 2) {
      const bool twox = xt + 1 < xtiles;
      float* o = ot + xt * 16 * ldo + u * 16;
      _tile_loadd(0, o, ostride);
      if (two) _tile_loadd(1, o + 16, ostride);
      if (twox) {
        _tile_loadd(2, o + 16 * ldo, ostride);
        if (two) _tile_loadd(3, o + 16 * ldo + 16, ostride);
      }
      const uint16_t* v0 = vt + xt * 16 * ldv;
      const uint16_t* v1 = v0 + 16 * ldv;
      for (int32_t c = a; c < b; ++c) {
        const uint32_t* p = pv + static_cast<size_t>(c) * 16 * ldp + u * 16;
        _tile_loadd(6, p, pstride);
        _tile_loadd(4, v0 + c * 32, vstride);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(7, p + 16, pstride);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (twox) {
          _tile_loadd(5, v1 + c * 32, vstride);
          _tile_dpbf16ps(2, 5, 6);
          if (two) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, o, ostride);
      if (two) _tile_stored(1, o + 16, ostride);
      if (twox) {
        _tile_stored(2, o + 16 * ldo, ostride);
        if (two) _tile_stored(3, o + 16 * ldo + 16, ostride);
      }
    }
  }
}

#define IOATTN_FLASH_BF16_ATTR IOATTN_FLASH_AMX_ATTR

namespace {
// The first min(n, 16) lanes.
IOATTN_FLASH_AMX_ATTR inline __mmask16 Mask16(size_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}
}  // namespace

namespace {

// 2^x for x in [-inf, 128): n = round(max(x, -127)), 2^(x - n) by flash_cpu.cpp's degree-6
// polynomial (relative error ~1 ulp), times 2^n by vscalefps (below 2^-126 a denormal or 0).
IOATTN_FLASH_BF16_ATTR inline __m512 Exp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5345720694913637e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3399930471579434e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618489296472785e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503287792933516e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022646887500068e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472057358227e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000000005545888f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace

IOATTN_FLASH_BF16_ATTR void flash_amx_softmax_plain(const float* st, size_t ldst, size_t ngroups, size_t len,
                                                    float scale, float lazy, float* m, float* l, float* alpha,
                                                    float* poison, uint32_t* pv, size_t ldp, void (*hook)(void*),
                                                    void* hook_arg, uint32_t* pv_lo) {
  constexpr float kLog2e = 1.44269504088896340736f;
  const __m512 pinf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 one = _mm512_set1_ps(1.0f), vscale = _mm512_set1_ps(scale), log2e = _mm512_set1_ps(kLog2e);
  const __m512 c1 = _mm512_set1_ps(scale * kLog2e);
  // (p0[i], p1[i]) pairs from vcvtne2ps2bf16(p1, p0) = [p0 0..15 | p1 0..15]: word 2 i <- i, 2 i + 1 <- 16 + i.
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i perm = _mm512_load_si512(kInterleave);
  const size_t pairs = len / 2, pad_end = (len + 31) / 32 * 16;
  for (size_t g = 0; g < ngroups; ++g) {
    if (hook) hook(hook_arg);
    const float* s = st + g * 16;
    uint32_t* pg = pv + g * 16;
    uint32_t* pgl = pv_lo ? pv_lo + g * 16 : nullptr;
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
      const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
      _mm512_store_si512(pg + jj * ldp, _mm512_permutexvar_epi16(perm, h));
      if (pgl) {  // P - bf16(P), the second bf16 part (f16 inputs)
        const __m512 r0 = _mm512_sub_ps(p0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16)));
        const __m512 r1 = _mm512_sub_ps(p1, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16)));
        _mm512_store_si512(pgl + jj * ldp, _mm512_permutexvar_epi16(perm, (__m512i)_mm512_cvtne2ps_pbh(r1, r0)));
      }
      sum0 = _mm512_add_ps(sum0, p0);
      sum1 = _mm512_add_ps(sum1, p1);
    }
    size_t jj = pairs;
    if (len % 2) {
      const __m512 p0 = Exp2(_mm512_fmadd_ps(_mm512_load_ps(s + (len - 1) * ldst), c1, bias));
      const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), p0);
      _mm512_store_si512(pg + jj * ldp, _mm512_permutexvar_epi16(perm, h));
      if (pgl) {
        const __m512 r0 = _mm512_sub_ps(p0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16)));
        _mm512_store_si512(pgl + jj * ldp, _mm512_permutexvar_epi16(perm, (__m512i)_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), r0)));
      }
      sum0 = _mm512_add_ps(sum0, p0);
      ++jj;
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
    const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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

// Rows 2 k and 2 k + 1 of 16 values each -> the 16 words (r0[i], r1[i]) as bf16 pairs.
IOATTN_FLASH_BF16_ATTR inline __m512i PairBf16(__m512 r0, __m512 r1) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), (__m512i)_mm512_cvtne2ps_pbh(r1, r0));
}


IOATTN_FLASH_BF16_ATTR void PackA(size_t M, size_t K, const float* a, size_t sam, size_t sak, uint16_t* ap,
                                  size_t m16, size_t k32) {
  if (sak == 1) {  // rows contiguous
    for (size_t m = 0; m < m16; ++m)
      for (size_t k = 0; k < k32; k += 32) {
        __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
        if (m < M) {
          lo = _mm512_maskz_loadu_ps(Mask16(K > k ? K - k : 0), a + m * sam + k);
          hi = _mm512_maskz_loadu_ps(Mask16(K > k + 16 ? K - k - 16 : 0), a + m * sam + k + 16);
        }
        _mm512_store_si512(ap + m * k32 + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    return;
  }
  if (sam == 1) {  // columns contiguous: 16 rows x 32 columns as pair words, transposed
    for (size_t m = 0; m < m16; m += 16) {
      const __mmask16 mm = Mask16(M > m ? M - m : 0);
      for (size_t k = 0; k < k32; k += 32) {
        __m512i w[16];
        for (size_t kk = 0; kk < 16; ++kk) {
          const size_t k0 = k + 2 * kk, k1 = k0 + 1;
          const __m512 c0 = k0 < K ? _mm512_maskz_loadu_ps(mm, a + k0 * sak + m) : _mm512_setzero_ps();
          const __m512 c1 = k1 < K ? _mm512_maskz_loadu_ps(mm, a + k1 * sak + m) : _mm512_setzero_ps();
          w[kk] = PairBf16(c0, c1);
        }
        transpose16x16_u32(w);
        for (size_t i = 0; i < 16; ++i) _mm512_store_si512(ap + (m + i) * k32 + k, w[i]);
      }
    }
    return;
  }
  for (size_t m = 0; m < m16; ++m)
    for (size_t k = 0; k < k32; ++k) {
      const float x = m < M && k < K ? a[m * sam + k * sak] : 0.0f;
      uint32_t u;
      std::memcpy(&u, &x, 4);
      u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even (finite values; NaN stays NaN-ish)
      ap[m * k32 + k] = static_cast<uint16_t>(u >> 16);
    }
}

// B (K x N, rows ldb apart) -> VNNI pairs bp[(k / 2) * n16 + n] = (B[k][n], B[k + 1][n]).
IOATTN_FLASH_BF16_ATTR void PackB(size_t N, size_t K, const float* b, size_t ldb, uint32_t* bp, size_t n16,
                                  size_t k32) {
  for (size_t kk = 0; kk < k32 / 2; ++kk) {
    const size_t k0 = 2 * kk, k1 = k0 + 1;
    for (size_t n = 0; n < n16; n += 16) {
      const __mmask16 mn = Mask16(N > n ? N - n : 0);
      const __m512 r0 = k0 < K ? _mm512_maskz_loadu_ps(mn, b + k0 * ldb + n) : _mm512_setzero_ps();
      const __m512 r1 = k1 < K ? _mm512_maskz_loadu_ps(mn, b + k1 * ldb + n) : _mm512_setzero_ps();
      _mm512_store_si512(bp + kk * n16 + n, PairBf16(r0, r1));
    }
  }
}

}  // namespace

namespace {
// The per-thread operand scratch: A, the products T, and B (slot -1) or a packed B kept for
// several products (slots 0..kSlots-1, flash_amx_pack_b).
constexpr int kSlots = 3;
struct Scratch {
  std::vector<uint16_t, AlignedAlloc<uint16_t>> ap;
  std::vector<float, AlignedAlloc<float>> t;
  std::vector<uint32_t, AlignedAlloc<uint32_t>> bp[kSlots + 1];
  size_t bn[kSlots + 1] = {}, bk[kSlots + 1] = {};  // the N and K each slot was packed for
};
thread_local Scratch tl_scratch;

// C (+)= A B in 16 x 16 fp32 tiles, 2 x 2 at a time over the K chunks: ap (m16 x k32 bf16 rows),
// bp (k32 / 2 x n16 VNNI pairs), c (rows ldc apart; kLoadC: its tiles loaded first, else zeros).
template <bool kLoadC>
IOATTN_FLASH_AMX_ATTR void TileGemm(const uint16_t* ap, const uint32_t* bp, float* c, size_t ldc, size_t m16,
                                    size_t n16, size_t k32) {
  const size_t mt = m16 / 16, nt = n16 / 16, kc = k32 / 32, astride = k32 * 2, bstride = n16 * 4, cstride = ldc * 4;
  for (size_t m = 0; m < mt; m += 2) {
    const bool twom = m + 1 < mt;
    for (size_t n = 0; n < nt; n += 2) {
      const bool twon = n + 1 < nt;
      float* o = c + m * 16 * ldc + n * 16;
      if constexpr (kLoadC) {
        _tile_loadd(0, o, cstride);
        if (twon) _tile_loadd(1, o + 16, cstride);
        if (twom) _tile_loadd(2, o + 16 * ldc, cstride);
        if (twom && twon) _tile_loadd(3, o + 16 * ldc + 16, cstride);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (size_t q = 0; q < kc; ++q) {
        const uint32_t* b0 = bp + q * 16 * n16 + n * 16;
        const uint16_t* a0 = ap + m * 16 * k32 + q * 32;
        _tile_loadd(6, b0, bstride);
        _tile_loadd(4, a0, astride);
        _tile_dpbf16ps(0, 4, 6);
        if (twon) {
          _tile_loadd(7, b0 + 16, bstride);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (twom) {
          _tile_loadd(5, a0 + 16 * k32, astride);
          _tile_dpbf16ps(2, 5, 6);
          if (twon) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, o, cstride);
      if (twon) _tile_stored(1, o + 16, cstride);
      if (twom) _tile_stored(2, o + 16 * ldc, cstride);
      if (twom && twon) _tile_stored(3, o + 16 * ldc + 16, cstride);
    }
  }
}

size_t K32(size_t K) { return std::max<size_t>(32, (K + 31) / 32 * 32); }
}  // namespace

IOATTN_FLASH_BF16_ATTR void flash_amx_pack_b(int slot, size_t N, size_t K, const float* b, size_t ldb) {
  Scratch& s = tl_scratch;
  const size_t n16 = (N + 15) / 16 * 16, k32 = K32(K);
  auto& bp = s.bp[slot + 1];
  if (bp.size() < k32 / 2 * n16) bp.resize(k32 / 2 * n16);
  PackB(N, K, b, ldb, bp.data(), n16, k32);
  s.bn[slot + 1] = N;
  s.bk[slot + 1] = K;
}

IOATTN_FLASH_BF16_ATTR void flash_amx_matmul(size_t M, size_t N, size_t K, const float* a, size_t sam, size_t sak,
                                             const float* b, size_t ldb, float* c, size_t ldc, bool accumulate,
                                             float alpha, int b_slot) {
  if (M == 0 || N == 0) return;
  Scratch& s = tl_scratch;
  const size_t m16 = (M + 15) / 16 * 16, n16 = (N + 15) / 16 * 16, k32 = K32(K);
  if (s.ap.size() < m16 * k32) s.ap.resize(m16 * k32);
  PackA(M, K, a, sam, sak, s.ap.data(), m16, k32);
  if (b_slot < 0) flash_amx_pack_b(-1, N, K, b, ldb);
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

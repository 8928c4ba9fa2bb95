// AMX-BF16 tile products for the CPU flash forward: see flash_amx.hpp. Compiled without Highway:
// every function that executes AMX instructions carries its own target attribute and runs only
// after flash_amx_usable() said yes.
#include "cpu/flash_amx.hpp"

#include "cpu/serving_amx.hpp"

#if IOATTN_HAVE_FLASH_AMX

// GCC 12: its AVX-512 headers trip -W(maybe-)uninitialized (_mm512_undefined_*).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#define IOATTN_FLASH_AMX_ATTR __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

namespace ioattn::detail::flash {

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

namespace {

// 16 x 16 32-bit transpose: r[c] becomes column c of the input rows.
IOATTN_FLASH_AMX_ATTR inline void Transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Lane L of r[4 i + k] now holds rows 4 i .. 4 i + 3 at column 4 L + k.
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
    t[8 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);
  }
}

}  // namespace

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
      Transpose16(w);
      for (int x = 0; x < 16; ++x) _mm512_storeu_si512(vt + (x0 + x) * ldv + j0, w[x]);
    }
  }
}

}  // namespace ioattn::detail::flash

#endif  // IOATTN_HAVE_FLASH_AMX

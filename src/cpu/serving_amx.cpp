// AMX-INT8 kernels for the CPU decode with i8 caches: see serving_amx.hpp. Compiled without
// Highway: every function that executes AMX or AVX-512 instructions carries its own target
// attribute and is only called after amx_usable() said yes (which implies AVX-512 on every CPU
// that has AMX).
#include "cpu/serving_amx.hpp"
#include "cpu/prefetch.hpp"
#include "cpu/serving_quant.h"
#include "cpu/transpose_avx512.hpp"

#if IOATTN_HAVE_AMX

// GCC 12: its AVX-512 headers trip -W(maybe-)uninitialized (_mm512_undefined_*).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#define IOATTN_AMX_ATTR __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")))

namespace ioattn::detail::serving {
namespace {

constexpr float kAmxE4m3Unit = 256.0f;  // serving_cpu.cpp's kE4m3Unit: its f8e4m3 rows load as value / 256

struct TileConfig {
  uint8_t palette = 0, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};


// ((c3 * 256 + c2) * 256 + c1) * 256 + c0 in fp32 (the limb sums are exact integers < 2^24).
IOATTN_AMX_ATTR inline __m512 Horner4(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
  const __m512 k256 = _mm512_set1_ps(256.0f);
  __m512 t = _mm512_cvtepi32_ps(c3);
  t = _mm512_fmadd_ps(t, k256, _mm512_cvtepi32_ps(c2));
  t = _mm512_fmadd_ps(t, k256, _mm512_cvtepi32_ps(c1));
  return _mm512_fmadd_ps(t, k256, _mm512_cvtepi32_ps(c0));
}

}  // namespace

bool amx_usable() {
  static const bool ok = [] {
    const char* e = std::getenv("IOATTN_CPU_AMX");
    if (e && e[0] == '0') return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1, vbmi = (c >> 1) & 1;
    if (!tile || !int8 || !vbmi) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// A static object: GCC 12 treats _tile_loadconfig's operand as reading only its first bytes and
// drops the stores of a local config's colsb / rows fields.
alignas(64) const TileConfig kTileConfig = [] {
  TileConfig c;
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}();

__attribute__((target("amx-tile"))) void amx_begin() { _tile_loadconfig(&kTileConfig); }

__attribute__((target("amx-tile"))) void amx_end() { _tile_release(); }

bool amx_pack_q(const float* qf, size_t dp, size_t d, int64_t R, int8_t* qb, float* qmul) {
  const size_t chunks = d / 64;
  const int64_t G = (R + 3) / 4;
  std::memset(qb, 0, static_cast<size_t>(G) * chunks * 1024);
  for (int64_t r = 0; r < R; ++r) {
    const float* q = qf + r * dp;
    float amax = 0.0f;
    for (size_t x = 0; x < d; ++x) amax = std::max(amax, std::fabs(q[x]));
    if (!std::isfinite(amax)) return false;  // NaN / inf: the fp32 path propagates them
    if (amax == 0.0f) {
      qmul[r] = 0.0f;
      continue;
    }
    int e = 0;
    std::frexp(amax, &e);  // amax = f * 2^e, f in [0.5, 1)
    const int E = 29 - e;  // amax * 2^E in [2^28, 2^29)
    if (E > 126 || E < -126) return false;
    qmul[r] = std::ldexp(1.0f, -E);
    const int64_t g = r / 4, rl = r % 4;
    for (size_t x = 0; x < d; ++x) {
      int32_t v = static_cast<int32_t>(std::nearbyint(std::ldexp(static_cast<double>(q[x]), E)));
      const size_t c = x / 64, k = x % 64;
      int8_t* dst = qb + ((static_cast<size_t>(g) * chunks + c) * 16 + k / 4) * 64 + k % 4;
      for (int l = 0; l < 4; ++l) {
        const int32_t lb = ((v + 128) & 255) - 128;  // balanced limb in [-128, 127]
        v = (v - lb) / 256;                          // exact
        dst[(4 * rl + l) * 4] = static_cast<int8_t>(lb);
      }
    }
  }
  return true;
}

// The 16 C rows (keys) of one unit -> scores of its rows (transpose, limbs combined, x 2^-E).
IOATTN_AMX_ATTR inline void StoreScores(const int32_t* cb, int64_t rows, const float* qmul, float* s, size_t bc) {
  __m512i v[16];
  for (int k = 0; k < 16; ++k) v[k] = _mm512_load_si512(cb + 16 * k);
  transpose16x16_u32(v);  // v[4 rl + l]: limb l of row rl, over the 16 keys
  for (int64_t rl = 0; rl < rows; ++rl) {
    const __m512 t = Horner4(v[4 * rl], v[4 * rl + 1], v[4 * rl + 2], v[4 * rl + 3]);
    _mm512_storeu_ps(s + rl * static_cast<int64_t>(bc), _mm512_mul_ps(t, _mm512_set1_ps(qmul[rl])));
  }
}

IOATTN_AMX_ATTR void amx_scores16(const uint8_t* const* rows, int64_t off0, int64_t off1, size_t d, const int8_t* qb0,
                                  const int8_t* qb1, int64_t R, const float* qmul0, const float* qmul1, float* s0,
                                  float* s1, size_t bc, uint8_t* stage, const uint8_t* const* pf, size_t npf) {
  const size_t chunks = d / 64;
  const bool two = qb1 != nullptr;
  const uint8_t* base0 = rows[0] + off0;
  const uint8_t* base1 = rows[0] + off1;
  const int64_t stride = rows[1] - rows[0];
  bool uniform = stride >= static_cast<int64_t>(d);
  for (int k = 2; k < 16 && uniform; ++k) uniform = rows[k] == rows[0] + k * stride;
  int64_t ld = stride;
  if (!uniform) {  // page edges, padding keys: copy the 16 rows (of both heads) together
    for (int k = 0; k < 16; ++k)
      for (size_t x = 0; x < d; x += 64) {
        _mm512_storeu_si512(stage + k * d + x, _mm512_loadu_si512(rows[k] + off0 + x));
        if (two) _mm512_storeu_si512(stage + (16 + k) * d + x, _mm512_loadu_si512(rows[k] + off1 + x));
      }
    base0 = stage;
    base1 = stage + 16 * d;
    ld = static_cast<int64_t>(d);
  }
  alignas(64) int32_t cb[2][256];
  const int64_t G = (R + 3) / 4;
  for (int64_t g = 0; g < G; ++g) {  // rows 4 g .. 4 g + 3 of both heads: two independent tile chains
    const size_t qg = static_cast<size_t>(g) * chunks * 1024;
    _tile_zero(0);
    if (two) _tile_zero(1);
    for (size_t c = 0; c < chunks; ++c) {
      _tile_loadd(2, base0 + 64 * c, ld);
      _tile_loadd(4, qb0 + qg + c * 1024, 64);
      _tile_dpbssd(0, 2, 4);
      if (two) {
        _tile_loadd(3, base1 + 64 * c, ld);
        _tile_loadd(5, qb1 + qg + c * 1024, 64);
        _tile_dpbssd(1, 3, 5);
      }
    }
    _tile_stored(0, cb[0], 64);
    if (two) _tile_stored(1, cb[1], 64);
    if (pf && g == 0)  // later keys' rows, behind this group's tile loads instead of in front of them
      for (size_t k = 0; k < npf; ++k)
        for (size_t x = 0; x < d; x += 64) {
          prefetch_l2(pf[k] + off0 + x);
          if (two) prefetch_l2(pf[k] + off1 + x);
        }
    const int64_t rows_g = std::min<int64_t>(4, R - 4 * g);
    StoreScores(cb[0], rows_g, qmul0 + 4 * g, s0 + 4 * g * static_cast<int64_t>(bc), bc);
    if (two) StoreScores(cb[1], rows_g, qmul1 + 4 * g, s1 + 4 * g * static_cast<int64_t>(bc), bc);
  }
}

IOATTN_AMX_ATTR void amx_pv64(const float* p, size_t bc, const float* act, int64_t R, const uint8_t* const* rows,
                              int64_t off, size_t n, size_t dv, float* acc, size_t dvp, int8_t* pl, uint8_t* stage,
                              size_t npf) {
  const int64_t G = (R + 3) / 4;
  // P limbs: A[4 rl + l][j] = byte l of round(p_j * 2^30) (unsigned, little-endian bytes of the int32).
  // vpermb gathers byte l of the 16 keys of a vector into lane l.
  const __m512i bytes_by_limb = _mm512_set_epi8(
      63, 59, 55, 51, 47, 43, 39, 35, 31, 27, 23, 19, 15, 11, 7, 3,  //
      62, 58, 54, 50, 46, 42, 38, 34, 30, 26, 22, 18, 14, 10, 6, 2,  //
      61, 57, 53, 49, 45, 41, 37, 33, 29, 25, 21, 17, 13, 9, 5, 1,   //
      60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
  const __m512 k2p30 = _mm512_set1_ps(1073741824.0f);
  for (int64_t r = 0; r < 4 * G; ++r) {
    uint8_t* a = reinterpret_cast<uint8_t*>(pl) + (r / 4) * 1024 + (r % 4) * 4 * 64;  // rows 4 rl .. 4 rl + 3
    if (r >= R || act[r] == 0.0f) {
      std::memset(a, 0, 4 * 64);
      continue;
    }
    const float* pr = p + r * static_cast<int64_t>(bc);
    __m512i w[4];
    for (int c = 0; c < 4; ++c) {
      const __mmask16 live = static_cast<size_t>(16 * c) >= n ? 0 : n - 16 * c >= 16 ? 0xffff : (1u << (n - 16 * c)) - 1;
      const __m512i q = _mm512_maskz_cvtps_epi32(live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, pr + 16 * c), k2p30));
      w[c] = _mm512_permutexvar_epi8(bytes_by_limb, q);  // lane l: byte l of the 16 keys
    }
    // 4 x 4 transpose of 128-bit lanes: row l = lane l of w[0..3].
    const __m512i t0 = _mm512_shuffle_i32x4(w[0], w[1], 0x44), t1 = _mm512_shuffle_i32x4(w[0], w[1], 0xee);
    const __m512i t2 = _mm512_shuffle_i32x4(w[2], w[3], 0x44), t3 = _mm512_shuffle_i32x4(w[2], w[3], 0xee);
    _mm512_storeu_si512(a + 0 * 64, _mm512_shuffle_i32x4(t0, t2, 0x88));
    _mm512_storeu_si512(a + 1 * 64, _mm512_shuffle_i32x4(t0, t2, 0xdd));
    _mm512_storeu_si512(a + 2 * 64, _mm512_shuffle_i32x4(t1, t3, 0x88));
    _mm512_storeu_si512(a + 3 * 64, _mm512_shuffle_i32x4(t1, t3, 0xdd));
  }
  // V in VNNI order: stage[X][u][quad][64 B], X = 64-column chunk, u = interleave group.
  const size_t nx = dv / 64;
  for (size_t q = 0; q < 16; ++q) {
    for (size_t j = 4 * q; j < std::min(4 * q + 4, npf); ++j)  // the next block's rows, spread over the loop
      for (size_t x = 0; x < dv; x += 64) prefetch_l2(rows[n + j] + off + x);
    const uint8_t* r0 = rows[std::min(4 * q + 0, n - 1)] + off;
    const uint8_t* r1 = rows[std::min(4 * q + 1, n - 1)] + off;
    const uint8_t* r2 = rows[std::min(4 * q + 2, n - 1)] + off;
    const uint8_t* r3 = rows[std::min(4 * q + 3, n - 1)] + off;
    for (size_t X = 0; X < nx; ++X) {
      const __m512i a = _mm512_loadu_si512(r0 + 64 * X), b = _mm512_loadu_si512(r1 + 64 * X);
      const __m512i c = _mm512_loadu_si512(r2 + 64 * X), e = _mm512_loadu_si512(r3 + 64 * X);
      const __m512i ab0 = _mm512_unpacklo_epi8(a, b), ab1 = _mm512_unpackhi_epi8(a, b);
      const __m512i ce0 = _mm512_unpacklo_epi8(c, e), ce1 = _mm512_unpackhi_epi8(c, e);
      uint8_t* dst = stage + X * 4096 + q * 64;
      _mm512_storeu_si512(dst + 0 * 1024, _mm512_unpacklo_epi16(ab0, ce0));  // x = 16 L + 0..3
      _mm512_storeu_si512(dst + 1 * 1024, _mm512_unpackhi_epi16(ab0, ce0));  // x = 16 L + 4..7
      _mm512_storeu_si512(dst + 2 * 1024, _mm512_unpacklo_epi16(ab1, ce1));  // x = 16 L + 8..11
      _mm512_storeu_si512(dst + 3 * 1024, _mm512_unpackhi_epi16(ab1, ce1));  // x = 16 L + 12..15
    }
  }
  alignas(64) int32_t cb[2][256];
  const __m512 k2m30 = _mm512_set1_ps(1.0f / 1073741824.0f);
  auto combine = [&](const int32_t* c, int64_t g, size_t t) IOATTN_AMX_ATTR {
    for (int64_t rl = 0; rl < 4 && 4 * g + rl < R; ++rl) {
      const int64_t r = 4 * g + rl;
      if (act[r] == 0.0f) continue;
      const __m512 h = Horner4(_mm512_load_si512(c + 16 * (4 * rl)), _mm512_load_si512(c + 16 * (4 * rl + 1)),
                               _mm512_load_si512(c + 16 * (4 * rl + 2)), _mm512_load_si512(c + 16 * (4 * rl + 3)));
      float* ar = acc + r * static_cast<int64_t>(dvp) + 16 * t;
      _mm512_storeu_ps(ar, _mm512_fmadd_ps(h, k2m30, _mm512_loadu_ps(ar)));
    }
  };
  for (int64_t g = 0; g < G; ++g) {
    _tile_loadd(1, pl + g * 1024, 64);
    for (size_t t = 0; t < 4 * nx; t += 2) {  // 16 permuted columns at acc + 16 t, two tiles at a time
      _tile_zero(0);
      _tile_zero(3);
      _tile_loadd(2, stage + t * 1024, 64);
      _tile_loadd(4, stage + (t + 1) * 1024, 64);
      _tile_dpbusd(0, 1, 2);
      _tile_dpbusd(3, 1, 4);
      _tile_stored(0, cb[0], 64);
      _tile_stored(3, cb[1], 64);
      combine(cb[0], g, t);
      combine(cb[1], g, t + 1);
    }
  }
}

void amx_unpermute(float* row, size_t dv, size_t width) {
  const size_t q = width / 4;  // column n of interleave group u: x = q * (n / 4) + 4 u + n % 4
  for (size_t X = 0; X < dv; X += width) {
    float tmp[64];
    for (size_t u = 0; u < width / 16; ++u)
      for (size_t n = 0; n < 16; ++n) tmp[q * (n / 4) + 4 * u + n % 4] = row[X + 16 * u + n];
    std::memcpy(row + X, tmp, width * sizeof(float));
  }
}

// ---- f8e4m3 caches: AMX-BF16 ---------------------------------------------------------------

#define IOATTN_AMX_BF16_ATTR \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")))

namespace {

// 32 e4m3 codes -> 32 bf16 (exact: every e4m3 value, subnormals included, is a normal bf16);
// NaN codes (S.1111.111) -> bf16 NaN, their lanes OR-ed into *nan.
IOATTN_AMX_BF16_ATTR inline __m512i E4m3ToBf16(const uint8_t* src, __mmask32* nan) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7f));
  // normal: exponent + 120 (bias 7 -> 127), mantissa << 4; subnormal (exponent 0): M * 2^-9 from a table
  __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
  const __m512i sub_table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  //
                                             0, 0, 0, 0, 0, 0, 0, 0, 0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0,
                                             0x3B80, 0x3B00, 0);
  r = _mm512_mask_permutexvar_epi16(r, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag, sub_table);
  const __mmask32 isnan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f));
  r = _mm512_mask_mov_epi16(r, isnan, _mm512_set1_epi16(0x7FC0));
  *nan |= isnan;
  return _mm512_ternarylogic_epi32(r, w, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);  // r | (w & sign)
}

IOATTN_AMX_BF16_ATTR inline __m512 Sum4Parts(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
  return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_castsi512_ps(c3), _mm512_castsi512_ps(c2)),
                                     _mm512_castsi512_ps(c1)),
                       _mm512_castsi512_ps(c0));
}

// fp32 -> bf16 (round to nearest even), scalar (Q packing only).
inline uint16_t Bf16Rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

bool amx_e4m3_requested() {
  static const bool on = [] {
    const char* e = std::getenv("IOATTN_CPU_AMX_E4M3");
    return e && e[0] == '1' && amx_bf16_usable();
  }();
  return on;
}

bool amx_bf16_usable() {
  static const bool ok = [] {
    if (!amx_usable()) return false;  // AMX-TILE, VBMI, the OS permission, IOATTN_CPU_AMX
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1)) return false;  // AMX-BF16
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return false;  // AVX512_BF16
    return true;
  }();
  return ok;
}

bool amx_pack_q_bf16(const float* qf, size_t dp, size_t d, int64_t R, uint16_t* qb, float* qmul) {
  const size_t chunks = d / 32;
  const int64_t G = (R + 3) / 4;
  std::memset(qb, 0, static_cast<size_t>(G) * chunks * 1024);
  for (int64_t r = 0; r < R; ++r) {
    const float* q = qf + r * dp;
    float amax = 0.0f;
    for (size_t x = 0; x < d; ++x) amax = std::max(amax, std::fabs(q[x]));
    if (!std::isfinite(amax)) return false;
    if (amax == 0.0f) {
      qmul[r] = 0.0f;
      continue;
    }
    int e = 0;
    std::frexp(amax, &e);
    const int E = 1 - e;  // amax * 2^E in [1, 2): the parts stay clear of bf16 denormals (DAZ)
    if (E > 100 || E < -100) return false;
    qmul[r] = std::ldexp(1.0f, -E) / kAmxE4m3Unit;  // K tiles hold the true values (LoadCvt: value / 256)
    const int64_t g = r / 4, rl = r % 4;
    for (size_t x = 0; x < d; ++x) {
      float v = std::ldexp(q[x], E);
      const size_t c = x / 32, k = x % 32;
      uint16_t* dst = qb + ((static_cast<size_t>(g) * chunks + c) * 16 + k / 2) * 32 + k % 2;
      for (int l = 0; l < 4; ++l) {  // v = p0 + p1 + p2 + p3 (each the bf16 of the remainder)
        const uint16_t h = Bf16Rne(v);
        v -= Bf16ToFloat(h);
        dst[(4 * rl + l) * 2] = h;
      }
    }
  }
  return true;
}

IOATTN_AMX_BF16_ATTR void amx_scores16_e4m3(const uint8_t* const* rows, int64_t H, int64_t k_head, size_t d,
                                            const uint16_t* qb, size_t qb_head, int64_t R, const float* qmul,
                                            float* s, size_t bc, uint8_t* stage) {
  const size_t chunks = d / 32, rowb = 2 * d;
  // Software pipeline over pairs of heads: pair p + 1 is converted into the other half of the
  // stage before pair p's tiles load theirs (a tile load right behind the stores that wrote its
  // rows waits for them to commit).
  uint32_t nan_keys[2][2] = {};
  auto convert = [&](int64_t pair) IOATTN_AMX_BF16_ATTR {
    uint8_t* st = stage + (pair & 1) * 32 * rowb;
    for (int h = 0; h < 2 && 2 * pair + h < H; ++h) {
      const int64_t off = (2 * pair + h) * k_head;
      uint32_t nk = 0;
      for (int k = 0; k < 16; ++k) {
        __mmask32 nan = 0;
        uint8_t* dst = st + (h * 16 + k) * rowb;
        for (size_t x = 0; x < d; x += 32) _mm512_storeu_si512(dst + 2 * x, E4m3ToBf16(rows[k] + off + x, &nan));
        if (nan) nk |= 1u << k;
      }
      nan_keys[pair & 1][h] = nk;
    }
  };
  alignas(64) int32_t cb[2][256];
  const int64_t G = (R + 3) / 4, pairs = (H + 1) / 2;
  const __m512 vnan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  convert(0);
  for (int64_t pr = 0; pr < pairs; ++pr) {
    if (pr + 1 < pairs) convert(pr + 1);
    const uint8_t* st0 = stage + (pr & 1) * 32 * rowb;
    const uint8_t* st1 = st0 + 16 * rowb;
    const bool two = 2 * pr + 1 < H;
    const uint16_t* qb0 = qb + 2 * pr * qb_head;
    const uint16_t* qb1 = qb0 + qb_head;
    for (int64_t g = 0; g < G; ++g) {
      const size_t qg = static_cast<size_t>(g) * chunks * 512;  // uint16 elements
      _tile_zero(0);
      if (two) _tile_zero(1);
      for (size_t c = 0; c < chunks; ++c) {
        _tile_loadd(2, st0 + 64 * c, rowb);
        _tile_loadd(4, qb0 + qg + c * 512, 64);
        _tile_dpbf16ps(0, 2, 4);
        if (two) {
          _tile_loadd(3, st1 + 64 * c, rowb);
          _tile_loadd(5, qb1 + qg + c * 512, 64);
          _tile_dpbf16ps(1, 3, 5);
        }
      }
      _tile_stored(0, cb[0], 64);
      if (two) _tile_stored(1, cb[1], 64);
      const int64_t rows_g = std::min<int64_t>(4, R - 4 * g);
      for (int h = 0; h < (two ? 2 : 1); ++h) {
        const int64_t head = 2 * pr + h;
        __m512i v[16];
        for (int k = 0; k < 16; ++k) v[k] = _mm512_load_si512(cb[h] + 16 * k);
        transpose16x16_u32(v);
        const float* qm = qmul + head * R + 4 * g;
        float* sr = s + (head * R + 4 * g) * static_cast<int64_t>(bc);
        for (int64_t rl = 0; rl < rows_g; ++rl) {
          __m512 t = _mm512_mul_ps(Sum4Parts(v[4 * rl], v[4 * rl + 1], v[4 * rl + 2], v[4 * rl + 3]),
                                   _mm512_set1_ps(qm[rl]));
          t = _mm512_mask_mov_ps(t, static_cast<__mmask16>(nan_keys[pr & 1][h]), vnan);  // NaN code: NaN score
          _mm512_storeu_ps(sr + rl * static_cast<int64_t>(bc), t);
        }
      }
    }
  }
}

IOATTN_AMX_BF16_ATTR void amx_pv64_e4m3(const float* p, size_t bc, const float* act, int64_t R,
                                        const uint8_t* const* rows, int64_t off, size_t n, size_t dv, float* acc,
                                        size_t dvp, uint16_t* pl, uint8_t* stage) {
  const int64_t G = (R + 3) / 4;
  const size_t nx = dv / 32;  // 32-column chunks; 2 column tiles each
  // V in VNNI pairs: stage[t][X][u][k2][64 B] (t: keys 32 t .., k2: key pair, u: unpack lo / hi).
  bool nan = false;
  for (size_t kp = 0; kp < 32; ++kp) {
    const size_t j0 = std::min(2 * kp, n - 1), j1 = std::min(2 * kp + 1, n - 1);
    const size_t t = kp / 16, k2 = kp % 16;
    for (size_t X = 0; X < nx; ++X) {
      __mmask32 m = 0;
      const __m512i a = E4m3ToBf16(rows[j0] + off + 32 * X, &m);
      const __m512i b = E4m3ToBf16(rows[j1] + off + 32 * X, &m);
      nan |= m != 0;
      uint8_t* dst = stage + ((t * nx + X) * 2 * 16 + k2) * 64;
      _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(a, b));             // x = 32 X + 8 L + 0..3
      _mm512_storeu_si512(dst + 16 * 64, _mm512_unpackhi_epi16(a, b));   // x = 32 X + 8 L + 4..7
    }
  }
  const float inv_unit = 1.0f / kAmxE4m3Unit;  // acc holds sum p * value / 256 (the 256 is in v_scale)
  if (nan) {
    // Some V code of the block is NaN: per row, keys with P == 0 are skipped (0 * NaN), as the
    // fp32 path does; the columns go to their permuted places.
    for (int64_t r = 0; r < R; ++r) {
      if (act[r] == 0.0f) continue;
      for (size_t j = 0; j < n; ++j) {
        const float pj = p[r * static_cast<int64_t>(bc) + j];
        if (pj == 0.0f) continue;
        for (size_t x = 0; x < dv; ++x) {
          const size_t w = x % 32, pos = x - w + 16 * ((w % 8) / 4) + 4 * (w / 8) + w % 4;
          acc[r * static_cast<int64_t>(dvp) + pos] += pj * (e4m3_to_float(rows[j][off + x]) * inv_unit);
        }
      }
    }
    return;
  }
  // P parts: A[t][4 rl + l][key] = part l of p (p = p0 + p1 + p2 + p3, each bf16 of the remainder).
  for (int64_t r = 0; r < 4 * G; ++r) {
    uint16_t* a = pl + (r / 4) * 1024 + (r % 4) * 4 * 32;  // A tile t at + t * 512
    if (r >= R || act[r] == 0.0f) {
      for (int t = 0; t < 2; ++t) std::memset(a + t * 512, 0, 4 * 64);
      continue;
    }
    const float* pr = p + r * static_cast<int64_t>(bc);
    for (int c = 0; c < 4; ++c) {
      const __mmask16 live = static_cast<size_t>(16 * c) >= n ? 0 : n - 16 * c >= 16 ? 0xffff : (1u << (n - 16 * c)) - 1;
      __m512 v = _mm512_maskz_loadu_ps(live, pr + 16 * c);
      uint16_t* dst = a + (c / 2) * 512 + (c % 2) * 16;
      for (int l = 0; l < 4; ++l) {
        const __m256bh h = _mm512_cvtneps_pbh(v);
        v = _mm512_sub_ps(v, _mm512_cvtpbh_ps(h));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + l * 32), (__m256i)h);
      }
    }
  }
  alignas(64) int32_t cb[2][256];
  const __m512 vinv = _mm512_set1_ps(inv_unit);
  auto combine = [&](const int32_t* c, int64_t g, size_t col) IOATTN_AMX_BF16_ATTR {
    for (int64_t rl = 0; rl < 4 && 4 * g + rl < R; ++rl) {
      const int64_t r = 4 * g + rl;
      if (act[r] == 0.0f) continue;
      const __m512 h = Sum4Parts(_mm512_load_si512(c + 16 * (4 * rl)), _mm512_load_si512(c + 16 * (4 * rl + 1)),
                                 _mm512_load_si512(c + 16 * (4 * rl + 2)), _mm512_load_si512(c + 16 * (4 * rl + 3)));
      float* ar = acc + r * static_cast<int64_t>(dvp) + col;
      _mm512_storeu_ps(ar, _mm512_fmadd_ps(h, vinv, _mm512_loadu_ps(ar)));
    }
  };
  const size_t tstride = nx * 2 * 1024;  // bytes between the key halves of one column tile
  for (int64_t g = 0; g < G; ++g) {
    _tile_loadd(1, pl + g * 1024, 64);
    _tile_loadd(6, pl + g * 1024 + 512, 64);
    for (size_t ct = 0; ct < 2 * nx; ct += 2) {  // column tiles ct, ct + 1: 16 permuted columns at acc + 16 ct
      _tile_zero(0);
      _tile_zero(3);
      _tile_loadd(2, stage + ct * 1024, 64);
      _tile_loadd(4, stage + (ct + 1) * 1024, 64);
      _tile_loadd(5, stage + tstride + ct * 1024, 64);
      _tile_loadd(7, stage + tstride + (ct + 1) * 1024, 64);
      _tile_dpbf16ps(0, 1, 2);
      _tile_dpbf16ps(3, 1, 4);
      _tile_dpbf16ps(0, 6, 5);
      _tile_dpbf16ps(3, 6, 7);
      _tile_stored(0, cb[0], 64);
      _tile_stored(3, cb[1], 64);
      combine(cb[0], g, 16 * ct);
      combine(cb[1], g, 16 * (ct + 1));
    }
  }
}

}  // namespace ioattn::detail::serving

#endif  // IOATTN_HAVE_AMX

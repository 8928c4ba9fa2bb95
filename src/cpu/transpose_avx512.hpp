// A 16 x 16 transpose of 32-bit words in AVX-512 registers, shared by the CPU's AMX kernels
// (serving_amx.cpp, flash_amx.cpp). Always inlined into callers compiled for AVX-512F or more.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

namespace ioattn::detail {

// r[c] becomes column c of the input rows.
__attribute__((target("avx512f"), always_inline)) inline void transpose16x16_u32(__m512i r[16]) {
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
    t[k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);       // L0, L2 of rows 0-3, 4-7
    t[4 + k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);   // L1, L3
    t[8 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);           // column k
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);       // column 8 + k
    r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);  // column 4 + k
    r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd); // column 12 + k
  }
}

}  // namespace ioattn::detail
#endif

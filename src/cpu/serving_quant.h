// Scalar 8-bit KV-cache conversions (host): f8e4m3 <-> float and symmetric i8.
//
// f8e4m3 is the OCP "E4M3FN" format of NVIDIA's __nv_fp8_e4m3: 1 sign, 4 exponent (bias 7),
// 3 mantissa bits; no infinities; NaN = S.1111.111 (0x7f / 0xff); the largest finite value is
// S.1111.110 = 448; subnormals are m * 2^-9. Encoding rounds to nearest even and saturates to
// +-448 (inf included), as the cache writers of vLLM / FlashInfer do (__NV_SATFINITE).
// i8 is symmetric: value = stored * scale, stored in [-127, 127] when we write it (any int8 is
// read back correctly).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ioattn::detail {

constexpr float kE4m3Max = 448.0f;
constexpr uint8_t kE4m3MaxCode = 0x7e;  // S.1111.110
constexpr uint8_t kE4m3NaN = 0x7f;      // S.1111.111
constexpr int kE4m3Bias = 7;
constexpr int kI8Max = 127;

inline float e4m3_to_float(uint8_t b) {
  const uint32_t sign = b >> 7;
  const int e = (b >> 3) & 0xf;
  const int m = b & 0x7;
  float mag;
  if (e == 0xf && m == 0x7) {
    mag = std::nanf("");
  } else if (e == 0) {
    mag = std::ldexp(static_cast<float>(m), 1 - kE4m3Bias - 3);  // m / 8 * 2^-6
  } else {
    mag = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - kE4m3Bias);
  }
  return sign ? -mag : mag;
}

inline uint8_t float_to_e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | kE4m3NaN;
  float x;
  std::memcpy(&x, &abs, 4);
  if (x >= kE4m3Max) return sign | kE4m3MaxCode;  // saturate (inf included)
  constexpr float kMinNormal = 0.015625f;         // 2^(1 - bias)
  if (x < kMinNormal) {
    // Subnormal grid: multiples of 2^-9. nearbyint rounds half to even; a result of 8 is the
    // smallest normal (code 0x08), which the encoding below represents correctly.
    const auto q = static_cast<uint32_t>(std::nearbyint(x * 512.0f));
    return sign | static_cast<uint8_t>(q);
  }
  const int e = static_cast<int>(abs >> 23) - 127;  // in [-6, 8]
  const uint32_t mant = abs & 0x7fffffu;
  uint32_t code = static_cast<uint32_t>(e + kE4m3Bias) << 3 | (mant >> 20);
  const uint32_t rest = mant & 0xfffffu, half = 0x80000u;
  if (rest > half || (rest == half && (code & 1u))) ++code;  // a carry bumps the exponent: fine
  if (code > kE4m3MaxCode) code = kE4m3MaxCode;  // cannot happen below 448; kept for clarity
  return sign | static_cast<uint8_t>(code);
}

inline float i8_to_float(int8_t b) { return static_cast<float>(b); }

inline int8_t float_to_i8(float f) {
  if (std::isnan(f)) return 0;
  const float r = std::nearbyint(f);
  if (r >= static_cast<float>(kI8Max)) return kI8Max;
  if (r <= -static_cast<float>(kI8Max)) return -kI8Max;
  return static_cast<int8_t>(r);
}

}  // namespace ioattn::detail

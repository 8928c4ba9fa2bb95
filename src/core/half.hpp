// Scalar fp16 / bf16 <-> fp32 conversions for the host (round to nearest even).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ioattn::detail {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | mant << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;    // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;   // overflow (>= 65520) -> inf
  if (abs < 0x38800000u) {                          // subnormal or zero in f16
    // value = abs_float; f16 subnormal unit = 2^-24
    float af;
    std::memcpy(&af, &abs, 4);
    const float scaled = af * 16777216.0f;  // 2^24
    const auto m = static_cast<uint32_t>(std::nearbyint(scaled));
    return sign | static_cast<uint16_t>(m);
  }
  uint32_t e = ((abs >> 23) - 127 + 15);
  uint32_t mant = abs & 0x7fffffu;
  uint32_t h = e << 10 | mant >> 13;
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into exponent: fine
  return sign | static_cast<uint16_t>(h);
}

}  // namespace ioattn::detail

#include "cpu/serving_quant.h"  // e4m3 <-> float (header-only)
#include "ioattn/ioattn.hpp"

namespace ioattn::detail {

// Element idx of a buffer of floating dtype t, as float.
inline float load_float(const void* base, DType t, int64_t idx) {
  switch (t) {
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(base)[idx]);
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(base)[idx]);
    case DType::f8e4m3: return e4m3_to_float(static_cast<const uint8_t*>(base)[idx]);
    default: return static_cast<const float*>(base)[idx];
  }
}

inline void store_float(void* base, DType t, int64_t idx, float x) {
  switch (t) {
    case DType::f16: static_cast<uint16_t*>(base)[idx] = float_to_f16(x); break;
    case DType::bf16: static_cast<uint16_t*>(base)[idx] = float_to_bf16(x); break;
    case DType::f8e4m3: static_cast<uint8_t*>(base)[idx] = float_to_e4m3(x); break;
    default: static_cast<float*>(base)[idx] = x; break;
  }
}

// x rounded to the precision of dtype t (f32: float rounding).
inline float round_to(DType t, float x) {
  switch (t) {
    case DType::f16: return f16_to_float(float_to_f16(x));
    case DType::bf16: return bf16_to_float(float_to_bf16(x));
    default: return x;
  }
}

// The fp8 tensor-core accumulator model of the "naive attention in the same low precision"
// baselines (the CPU reference's emulation and src/cuda/hopper/sm90_check.cu): x kept to 14
// significant bits, truncated toward zero. The SageAttention2 paper reports the FP8 mma
// accumulator to be FP22 (13 explicit mantissa bits); truncation rather than round-to-nearest is
// our assumption: on the H200 the kernel's LSE error was 2-5x a round-to-nearest model's (run of
// 2026-11-29), as a biased (truncating) accumulator predicts, while its O error matched the model.
inline float round_fp8_accumulator(float x) {
  if (x == 0.0f || !std::isfinite(x)) return x;
  int e = 0;
  const float m = std::frexp(x, &e);  // x = m * 2^e, 0.5 <= |m| < 1
  return std::ldexp(std::trunc(std::ldexp(m, 14)), e - 14);
}

}  // namespace ioattn::detail

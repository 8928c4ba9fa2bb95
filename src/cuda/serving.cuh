// serving.cuh — device helpers shared by the CUDA serving kernels (serving_decode.cu,
// serving_ops.cu): runtime-dtype element access for the tensors touched once per row (q, o,
// merge_states, append_kv inputs), the 16-byte cache-chunk conversions of the decode kernel,
// and the 8-bit encoders, bit-identical to the host ones in src/cpu/serving_quant.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ioattn/ioattn.hpp"

namespace ioattn::cuda::serving {

// ---- one element of an f32 / f16 / bf16 tensor, dtype known at run time --------------------

__device__ __forceinline__ float load_elem(const void* base, DType t, int64_t idx) {
  switch (t) {
    case DType::f16: return __half2float(static_cast<const __half*>(base)[idx]);
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[idx]);
    default: return static_cast<const float*>(base)[idx];
  }
}

// Round to nearest even, as the host's store_float.
__device__ __forceinline__ void store_elem(void* base, DType t, int64_t idx, float x) {
  switch (t) {
    case DType::f16: static_cast<__half*>(base)[idx] = __float2half_rn(x); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(base)[idx] = __float2bfloat16_rn(x); break;
    default: static_cast<float*>(base)[idx] = x; break;
  }
}

// ---- 8-bit encoders: the host's float_to_e4m3 / float_to_i8, line for line ------------------

// f8e4m3 (E4M3FN): round to nearest even, saturate to +-448 (inf included), NaN -> S.1111.111.
__device__ __forceinline__ uint8_t encode_e4m3(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  const float x = __uint_as_float(abs);
  if (x >= 448.0f) return static_cast<uint8_t>(sign | 0x7eu);
  if (x < 0.015625f) {  // subnormal grid: multiples of 2^-9 (x * 512 is exact)
    const uint32_t q = static_cast<uint32_t>(rintf(x * 512.0f));
    return static_cast<uint8_t>(sign | q);
  }
  const int e = static_cast<int>(abs >> 23) - 127;  // [-6, 8]
  const uint32_t mant = abs & 0x7fffffu;
  uint32_t code = static_cast<uint32_t>(e + 7) << 3 | (mant >> 20);
  const uint32_t rest = mant & 0xfffffu, half = 0x80000u;
  if (rest > half || (rest == half && (code & 1u))) ++code;
  if (code > 0x7eu) code = 0x7eu;
  return static_cast<uint8_t>(sign | code);
}

// Symmetric int8: round to nearest even, saturate to +-127, NaN -> 0.
__device__ __forceinline__ int8_t encode_i8(float f) {
  if (isnan(f)) return 0;
  const float r = rintf(f);
  if (r >= 127.0f) return 127;
  if (r <= -127.0f) return -127;
  return static_cast<int8_t>(r);
}

// ---- cache element types of the decode kernel ----------------------------------------------

struct E4m3 {};  // tag: f8e4m3 codes (uint8 storage)

// Per cache dtype: element bytes, cp.async pipeline depth (the K+V stage is 16 KiB per element
// byte: bf16 3 x 32 KiB, f32 2 x 64 KiB, 8-bit 4 x 16 KiB), and the conversion of one 16-byte
// chunk to fp32 (exact for every dtype: 8-bit codes stay raw, their scales are applied to Q / O).
template <typename CT>
struct CacheTraits;

template <>
struct CacheTraits<float> {
  static constexpr int kBytes = 4, kStages = 2;
  __device__ __forceinline__ static void convert(const uint4& w, float* out) {
    out[0] = __uint_as_float(w.x);
    out[1] = __uint_as_float(w.y);
    out[2] = __uint_as_float(w.z);
    out[3] = __uint_as_float(w.w);
  }
};

template <>
struct CacheTraits<__nv_bfloat16> {
  static constexpr int kBytes = 2, kStages = 3;
  __device__ __forceinline__ static void convert(const uint4& w, float* out) {
    const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(x[i] << 16);  // low half = lower address
      out[2 * i + 1] = __uint_as_float(x[i] & 0xffff0000u);
    }
  }
};

template <>
struct CacheTraits<__half> {
  static constexpr int kBytes = 2, kStages = 3;
  __device__ __forceinline__ static void convert(const uint4& w, float* out) {
    const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2_raw r;
      r.x = static_cast<unsigned short>(x[i] & 0xffffu);
      r.y = static_cast<unsigned short>(x[i] >> 16);
      const float2 f = __half22float2(__half2(r));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

template <>
struct CacheTraits<int8_t> {
  static constexpr int kBytes = 1, kStages = 4;
  __device__ __forceinline__ static void convert(const uint4& w, float* out) {
    const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) out[4 * i + k] = static_cast<float>(static_cast<int8_t>((x[i] >> (8 * k)) & 0xffu));
  }
};

template <>
struct CacheTraits<E4m3> {
  static constexpr int kBytes = 1, kStages = 4;
  // cvt.rn.f16x2.e4m3x2 on sm_89+ (software before): exact, NaN codes give NaN.
  __device__ __forceinline__ static void convert(const uint4& w, float* out) {
    const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const auto pair = static_cast<__nv_fp8x2_storage_t>((x[i] >> (16 * k)) & 0xffffu);
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
        out[4 * i + 2 * k] = f.x;  // the lower byte
        out[4 * i + 2 * k + 1] = f.y;
      }
  }
};

}  // namespace ioattn::cuda::serving

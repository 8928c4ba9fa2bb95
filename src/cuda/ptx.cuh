// ptx.cuh — every PTX instruction the CUDA kernels use, one small function each.
//
// Kernels never write `asm` themselves: they call these. Each wrapper holds exactly one
// instruction and says in a comment what it does and which fragment layout it produces, so a
// kernel body reads like the algorithm (ThunderKittens style). All of these need sm_80+.
//
// Fragment layouts of mma.m16n8k16 (row.col), lane = threadIdx.x % 32, g = lane / 4, t = lane % 4:
//   A (16x16, row-major)  a0: (g,   2t..2t+1)   a1: (g+8, 2t..2t+1)
//                         a2: (g, 2t+8..2t+9)   a3: (g+8, 2t+8..2t+9)        two 16-bit values each
//   B (16x8, k x n)       b0: (k = 2t..2t+1, n = g)   b1: (k = 2t+8..2t+9, n = g)
//   C/D (16x8, fp32)      c0,c1: (g, 2t..2t+1)   c2,c3: (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace ioattn::cuda::ptx {

// 32-bit shared-memory address of a generic pointer into shared memory (what ldmatrix and
// cp.async take).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- asynchronous global -> shared copies (sm_80) -------------------------------------------

// cp.async.cg: copies 16 bytes from global to shared without staging in registers and without
// allocating in L1 (.cg). Bytes past src_bytes are zero-filled, so src_bytes = 0 writes 16 zero
// bytes and reads nothing: that is how tiles are padded past the end of a sequence or head_dim.
__device__ __forceinline__ void cp_async_16(uint32_t dst_smem, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_smem), "l"(src),
               "r"(src_bytes));
}

// cp.async.cg of a full 16 bytes, with neither a src-size nor an ignore-src operand.
__device__ __forceinline__ void cp_async_16_full(uint32_t dst_smem, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst_smem), "l"(src));
}

// cp.async.cg with the ignore-src predicate (PTX 7.5+): a full 16-byte copy when `valid`, else
// nothing is read and 16 zero bytes are written. One instruction, no src-size arithmetic.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst_smem, const void* src, bool valid) {
  asm volatile(
      "{\n .reg .pred ig;\n setp.eq.u32 ig, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, ig;\n}\n" ::"r"(
          dst_smem),
      "l"(src), "r"(static_cast<uint32_t>(valid)));
}

// cp.async.ca with 4 bytes: one 32-bit word from global to shared (through L1; .cg takes only 16
// bytes). src_bytes is 4 or 0 (0 writes a zero word and reads nothing). The backward stages
// per-row fp32 values (LSE, D) with it: their rows start at any 4-byte boundary.
__device__ __forceinline__ void cp_async_4(uint32_t dst_smem, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst_smem), "l"(src), "r"(src_bytes));
}

// Closes the current group of cp.async copies issued by this thread.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's most recent cp.async groups are still in flight.
// Other threads' copies are visible only after a following barrier.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ld.global.u16 as a volatile asm statement: it keeps its place in program order relative to the
// other volatile statements (cp.async above all), where a plain load is sunk by the compiler to
// its first use. The decode issues its query loads this way ahead of its K / V copies.
__device__ __forceinline__ uint32_t ld_global_u16(const void* src) {
  uint16_t r;
  asm volatile("ld.global.u16 %0, [%1];\n" : "=h"(r) : "l"(src));
  return r;
}

// The same as 4 bytes (src 4-byte aligned) and as 8 bytes into two registers, lo from the lower
// address (src 8-byte aligned): the decode's wide query loads.
__device__ __forceinline__ uint32_t ld_global_u32(const void* src) {
  uint32_t r;
  asm volatile("ld.global.u32 %0, [%1];\n" : "=r"(r) : "l"(src));
  return r;
}
__device__ __forceinline__ uint2 ld_global_v2_u32(const void* src) {
  uint2 r;
  asm volatile("ld.global.v2.u32 {%0, %1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "l"(src));
  return r;
}

// ld.shared.v4.b32: 16 bytes of shared memory (src 16-byte aligned) into registers, a..d from
// increasing addresses. The forward's staged 8-bit cache tiles read their raw codes with it.
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t src_smem) {
  uint4 r;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(src_smem)
               : "memory");
  return r;
}

// st.shared.v4.b32: 16 bytes from registers to shared memory (dst 16-byte aligned); a, b, c, d
// land at increasing addresses. The forward's 8-bit cache tiles are stored with it after their
// codes are converted in registers (cp.async cannot convert).
__device__ __forceinline__ void st_shared_v4(uint32_t dst_smem, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst_smem), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}

// ---- shared -> register matrix loads -------------------------------------------------------

// ldmatrix.x4: four 8x8 matrices of 16-bit values. Lane l supplies the shared address of row
// (l % 8) of matrix (l / 8); register j receives matrix j in the mma "A/B fragment" layout
// (lane holds row g, elements 2t, 2t+1). Rows must be 16-byte aligned.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ldmatrix.x4.trans: as ldmatrix_x4 but each 8x8 matrix is transposed on the way, so lane holds
// column g, rows 2t, 2t+1. Reading V [keys x dims] this way yields the B fragment of P·V.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// movmatrix.trans (sm_75+): transposes an 8x8 matrix of 16-bit values held in the fragment layout
// (lane holds row lane / 4, elements 2 (lane % 4), +1) across the warp, in registers: the lane then
// holds column lane / 4, rows 2 (lane % 4), +1. Turns an mma C tile packed to 16 bits (rows =
// the M dimension) into the B fragment of the next mma (rows = the K dimension).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// ---- tensor-core matrix multiply-accumulate ------------------------------------------------

// mma.sync m16n8k16, bf16 inputs, fp32 accumulate in place: D = A·B + D (layouts above).
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                  uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// mma.sync m16n8k16, fp16 inputs, fp32 accumulate in place: D = A·B + D (layouts above).
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The element type picks the instruction.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    mma_m16n8k16_bf16(d, a, b0, b1);
  else
    mma_m16n8k16_f16(d, a, b0, b1);
}

// ---- conversions -------------------------------------------------------------------------------

// cvt.rn.bf16x2.f32: two fp32 -> packed bf16x2 (round to nearest even); `lo` lands in the low
// half (the lower address / lower column), as the mma fragments and memory order expect.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// cvt.rn.f16x2.f32: two fp32 -> packed f16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return pack_bf16x2(lo, hi);
  else
    return pack_f16x2(lo, hi);
}

// ---- global reductions ------------------------------------------------------------------------

// red.global.add.v2.f32 (sm_90+): adds (a, b) to the two adjacent fp32 values at p (8-byte
// aligned) atomically, without a return value: one instruction per C-fragment pair (c0, c1).
// sm_8x has no vector float red: two scalar atomicAdds (red.global.add.f32) there.
__device__ __forceinline__ void red_add_v2_f32(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// ---- special functions (the MUFU unit) ----------------------------------------------------

// ex2.approx.ftz: 2^x with ~2 ulp error; 2^-inf = +0, which is how masked scores vanish.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh.approx (sm_75+): max relative error ~2^-10.987, plenty for a softcap feeding bf16/f16 P.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- compiler fences -------------------------------------------------------------------------

// mov.b64 inside asm volatile: returns x unchanged but opaque to the optimiser, so values derived
// from it are recomputed where used instead of being hoisted into long-lived registers.
__device__ __forceinline__ int64_t opaque(int64_t x) {
  int64_t y;
  asm volatile("mov.b64 %0, %1;\n" : "=l"(y) : "l"(x));
  return y;
}

// ---- warp shuffles ---------------------------------------------------------------------------

// shfl.sync.bfly: value of lane (lane ^ mask); reduces a row over the 4 lanes of a quad that
// share it in the C fragment (masks 1 and 2).
__device__ __forceinline__ float shfl_xor(float x, int mask) {
  float y;
  asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;\n" : "=f"(y) : "f"(x), "r"(mask));
  return y;
}

// vote.sync.any: true in every lane if pred is true in any lane of the (full) warp.
__device__ __forceinline__ bool any_sync(bool pred) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n vote.sync.any.pred q, p, 0xffffffff;\n"
      " selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(static_cast<uint32_t>(pred)));
  return r != 0;
}

}  // namespace ioattn::cuda::ptx

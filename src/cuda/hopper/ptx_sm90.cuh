// ptx_sm90.cuh — the Hopper-only PTX the sm90 kernels use, one small function per instruction.
//
// Kernels never write `asm` themselves: they call these (ThunderKittens style). Everything here
// needs sm_90a (wgmma, setmaxnreg) or sm_90 (TMA, mbarrier tx-count); the callers guard their
// bodies with IOATTN_SM90A_ENABLED so the same source also compiles for sm_80.
// Each wrapper is tested on the GPU by test_ptx_sm90.cu.
//
// Shared-memory tile convention (the one TMA SWIZZLE_128B writes and wgmma SW128 reads):
//   a tile of R rows x 64 16-bit columns (128 bytes a row) is stored row after row, 1024-byte
//   aligned, with the 16-byte chunk c of row r at chunk position c ^ (r % 8)  (Swizzle<3,4,3>).
//   A tile wider than 64 columns is several such "column blocks" one after another.
//
// wgmma register fragments (warpgroup of 4 warps; w = warp in group, lane l, g = l/4, t = l%4):
//   D (64 x N, fp32), N/2 floats:   d[4i+0,1]: row 16w+g,   cols 8i+2t, 8i+2t+1
//                                   d[4i+2,3]: row 16w+g+8, same cols           (i < N/8)
//   A (64 x 16, 16-bit) in regs, 4 x b32: a0: (16w+g, 2t..2t+1)   a1: (16w+g+8, 2t..2t+1)
//                                          a2: (16w+g, 8+2t..)     a3: (16w+g+8, 8+2t..)
//   so the D fragment of S (64 x kBlockN) converted pairwise to 16-bit IS the A fragment of P for
//   the k-steps of P V: A-register j of k-step kk = pack(d[8kk + 2j], d[8kk + 2j + 1]).
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct; no driver library is linked)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "core/problem.hpp"  // detail::Strides3, DType (the tensor-map helpers' arguments)
#include "cuda/hopper/sm90.hpp"  // kSm90RaggedMaxRowStrideBytes

// True only in the device pass for sm_90a ("a" = the arch-specific features wgmma/setmaxnreg).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define IOATTN_SM90A_ENABLED 1
#else
#define IOATTN_SM90A_ENABLED 0
#endif

namespace ioattn::cuda::sm90 {

// Host: cuTensorMapEncodeTiled from the driver, fetched once through the runtime's entry-point
// query (flash_fwd_sm90.cu; throws ioattn::Error when the driver has none).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder();

// Host (flash_fwd_sm90.cu): a [batch, seqlen, heads, head_dim] bf16/f16 operand (element strides s)
// as a 4-D map (head_dim, seqlen, heads, batch) with (64, box_rows, 1, 1) boxes, 128-byte swizzle,
// out-of-bounds rows zero; and whether the operand meets TMA's alignment / stride rules (false with
// *why naming it).
CUtensorMap make_tensor_map(const void* ptr, DType dtype, int64_t head_dim, int64_t seqlen, int64_t heads,
                            int64_t batch, const detail::Strides3& s, int box_rows, const char* name);
bool tma_compatible(const void* ptr, const detail::Strides3& s, int64_t batch, int64_t seqlen, int64_t heads,
                    const char* name, std::string* why, int64_t elem_bytes = 2);

// ---- Ragged maps: one packed varlen sequence's rows, clipped at its end --------------------------
// A packed tensor [total, heads, cols] (row stride rs, head stride hs, bytes) as a 5-D map over
// (col, y, head, z, w) with strides (elem, rs, hs, rs, 2^34 - rs) and y < kRaggedRows. Row r of the
// sequence [start, start + len) is y = kRaggedRows - len + r, z = start + len, w = kRaggedRows:
// the address offset (y + z) rs + w (2^34 - rs) = (start + r) rs + 2^64 - 2^30 rs wraps (64-bit
// address arithmetic) to (start + r) rs. Rows r >= len have y >= kRaggedRows: out of bounds, so a
// load reads zeros and a store / reduce-add skips them, instead of touching the next sequence
// (whose NaN / Inf would otherwise reach this one through 0 x NaN). The base stays the tensor's
// own pointer. (The construction is Triton's ragged TMA descriptor, tools/ragged_tma.py.)
// Limits: a sequence of at most 2^30 rows, rs < 2^34 bytes (the forward's selector and the
// backward's refusal check both).
constexpr int kRaggedRows = 1 << 30;
constexpr int64_t kRaggedMaxRowStrideBytes = ::ioattn::detail::kSm90RaggedMaxRowStrideBytes;  // (sm90.hpp)

// Host (flash_fwd_sm90.cu): the map, boxes of box_cols x box_rows (x 1 x 1 x 1) swizzled to their
// row width (box_cols x elem_bytes: 128 bytes, or 64 for the fp8 Q / K rows at hdim 64);
// elem_bytes 1 (e4m3 codes as uint8), 2 (bf16 / f16 by dtype) or 4 (f32); dtype only tells bf16
// from f16. Strides in elements.
CUtensorMap make_ragged_map(const void* ptr, DType dtype, int64_t elem_bytes, int64_t cols, int64_t total_rows,
                            int64_t heads, int64_t row_stride, int64_t head_stride, int box_cols, int box_rows,
                            const char* name);

// 32-bit shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier: an opaque 8-byte shared-memory barrier with a phase bit and a tx count --------

// mbarrier.init: `count` arrivals complete a phase. One thread initialises; then
// fence_mbarrier_init() and a CTA barrier make it visible to all threads and to the TMA unit.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// fence.mbarrier_init: orders the preceding mbarrier.init before later arrivals of any proxy.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// mbarrier.arrive.expect_tx: this thread's arrival, and `bytes` more to come from async copies
// (TMA) before the phase can complete.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(smem_u32(bar)),
      "r"(bytes)
      : "memory");
}

// mbarrier.arrive: one arrival (release semantics: this thread's prior accesses are ordered
// before whoever waits on the phase).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_u32(bar)) : "memory");
}

// mbarrier.try_wait.parity: true once the phase with parity `parity` has completed (a fresh
// barrier is in phase 0, so waiting for parity 1 passes at once: "the previous phase is done").
// May suspend the thread for a while inside the instruction before answering false.
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Spins on mbarrier_try_wait (acquire: data the phase guarded is visible afterwards).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}

// cp.async.mbarrier.arrive.noinc: one arrival of this thread on `bar`, made when every cp.async
// this thread issued before it has landed (noinc: it counts toward the count given to
// mbarrier_init rather than adding to it). Waiters that see the phase complete see those bytes.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// mbarrier_wait for experimental paths and tests: traps (a launch error the host sees) after
// max_spins failed polls instead of spinning for ever when a byte count is wrong. Each poll may
// suspend for a while inside try_wait, so 2^22 polls is well beyond any real wait.
__device__ __forceinline__ void mbarrier_wait_or_trap(uint64_t* bar, uint32_t parity, uint32_t max_spins = 1u << 22) {
  for (uint32_t i = 0; !mbarrier_try_wait(bar, parity); ++i)
    if (i == max_spins) __trap();
}

// ---- TMA: cp.async.bulk.tensor, global -> shared, completing on an mbarrier ----------------
// The tensor map (built on the host with cuTensorMapEncodeTiled) is a __grid_constant__ kernel
// parameter; its generic address is what the instruction takes. Coordinates are in elements,
// innermost first; out-of-bounds box elements are written as zeros. The destination must be
// 128-byte aligned (1024 for SWIZZLE_128B so the pattern lines up with wgmma's).

// prefetch.tensormap: pulls the descriptor into the cache ahead of the first copy.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void tma_load_5d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// Rows [r, r + box) of the packed sequence [start, start + len), columns [col, col + box), head
// `head`, through a ragged map (make_ragged_map): rows past the sequence's end read as zeros.
__device__ __forceinline__ void tma_load_ragged(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int head,
                                                int start, int len, int r) {
  tma_load_5d(dst, map, bar, col, kRaggedRows - len + r, head, start + len, kRaggedRows);
}

// Rows [r, r + box) of head `head`, the one call for both map kinds: ragged (varlen: the packed
// sequence [start, start + len), rows past its end read as zeros) or the 4-D [batch, seq, heads,
// cols] map (batch b; start and len unused). `ragged` is a constant at every call site, so the
// branch folds away.
__device__ __forceinline__ void tma_load_rows(bool ragged, void* dst, const CUtensorMap* map, uint64_t* bar, int col,
                                              int head, int b, int start, int len, int r) {
  if (ragged)
    tma_load_ragged(dst, map, bar, col, head, start, len, r);
  else
    tma_load_4d(dst, map, bar, col, r, head, b);
}

// cp.async.bulk (non-tensor TMA): `bytes` contiguous bytes global -> shared, completing on `bar`
// (the caller arms it with mbarrier_arrive_expect_tx first). No tensor map: any address, but
// src, dst and bytes must be multiples of 16. One instruction moves up to the whole stage, where
// cp.async needs one 16-byte instruction per thread per piece.
__device__ __forceinline__ void bulk_load_1d(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// ---- TMA reductions: shared -> global, tracked by bulk async-groups ---------------------------
// cp.reduce.async.bulk.tensor (.add): the box at the coordinates (elements, innermost first) is
// added element-wise into global memory through the tensor map; the map's element type (here
// FLOAT32) is the type of the add, each element's add is atomic, and box elements outside the
// map's bounds are skipped (a tail block writes nothing past the end). The source box is in the
// map's shared layout (SWIZZLE_128B: 16-byte chunk c of 128-byte row r at c ^ (r % 8)), written
// by ordinary stores + fence_proxy_async() + a barrier before the issuing thread runs this.
// Completion is tracked per issuing thread: bulk_commit_group() closes a group, and
// bulk_wait_group_read<N>() returns once at most N of its groups still read shared memory (the
// source may then be overwritten); bulk_wait_group<N>() also waits for the global writes.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_reduce_add_5d(const CUtensorMap* map, const void* src, int c0, int c1, int c2,
                                                  int c3, int c4) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.5d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4, %5, %6}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}
// The ragged form (see tma_load_ragged): rows past the sequence's end are skipped.
__device__ __forceinline__ void tma_reduce_add_ragged(const CUtensorMap* map, const void* src, int col, int head,
                                                      int start, int len, int r) {
  tma_reduce_add_5d(map, src, col, kRaggedRows - len + r, head, start + len, kRaggedRows);
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// fence.proxy.async.shared::cta: makes this thread's ordinary shared-memory writes visible to
// the async proxy (wgmma operand reads, TMA stores) that a later barrier hands them to.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- warpgroup register budget and named barriers ------------------------------------------

// setmaxnreg.inc / .dec: the whole warpgroup raises / lowers its per-thread register limit.
// Takes effect only when the kernel has a register cap at entry (__launch_bounds__(n, 1)).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// bar.sync id, n: waits until n threads (a multiple of 32) have arrived at barrier `id`,
// counting this warp. bar.arrive: counts this warp without waiting. Id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}


// ---- thread-block clusters: rank, barrier, distributed shared memory (sm_90) ---------------
// No kernel uses these at present: session 18 merged the decode's splits inside a cluster with
// them (each CTA's partial left in its shared memory, read by the others with ld.shared::cluster
// after a cluster barrier) and measured it slower than the merge kernel (docs/PERF.md, session 18);
// kept, tested, for cluster designs to come (e.g. a backward pair of CTAs sharing Q / dO). Plain
// sm_90 features (no "a"): callers guard with __CUDA_ARCH__ >= 900 and launch with
// cudaLaunchAttributeClusterDimension.

// %cluster_ctarank: this CTA's rank in its cluster, 0 .. cluster size - 1.
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// barrier.cluster.arrive.release + wait.acquire, by every thread of every CTA of the cluster: the
// shared-memory writes of any thread before it are visible to ld.shared::cluster of any thread of
// the cluster after it (it is also a barrier among the CTA's own threads). A CTA whose shared
// memory others read must pass one more of these after their reads before it exits.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// mapa.shared::cluster: the shared::cluster address of the same shared-memory location (32-bit
// shared-window address, smem_u32) in the cluster's CTA `rank`.
__device__ __forceinline__ uint32_t mapa_shared(uint32_t smem_addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_addr), "r"(rank));
  return r;
}

// ld.shared::cluster.f32 / .s32: one value from a shared::cluster address (mapa_shared's answer).
__device__ __forceinline__ float ld_shared_cluster_f32(uint32_t cluster_addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(cluster_addr) : "memory");
  return v;
}
__device__ __forceinline__ int ld_shared_cluster_s32(uint32_t cluster_addr) {
  int v;
  asm volatile("ld.shared::cluster.s32 %0, [%1];\n" : "=r"(v) : "r"(cluster_addr) : "memory");
  return v;
}
// ---- matrix stores ----------------------------------------------------------------------------

// stmatrix.sync.aligned.m8n8.x4.shared.b16 (sm_90): the warp stores four 8x8 matrices of 16-bit
// values, matrix j from register r[j] of every lane in the mma accumulator layout (lane l holds
// row l / 4, columns 2 (l % 4) and + 1, low half first); lane l gives the shared address of row
// l % 8 of matrix l / 8 (16 contiguous bytes). One instruction for 512 bytes where st.shared.b32
// needs four.
__device__ __forceinline__ void stmatrix_x4(uint32_t row_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// ---- global reductions -------------------------------------------------------------------------

// red.global.add.v2.f32 [p], {a, b} under a predicate, as one predicated instruction (no branch
// around it). Callers keep p in one register pair across a run of constant offsets from it
// (pin_ptr), so each reduction is [R+imm] (the backward's dQ: ptxas otherwise rebuilt every 64-bit
// address under register pressure, ~20 instructions per reduction).
__device__ __forceinline__ void red_add_v2_f32_if(float* p, float a, float b, bool pred) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n @q red.global.add.v2.f32 [%0], {%1, %2};\n}\n" ::"l"(p), "f"(a),
      "f"(b), "r"(static_cast<int>(pred))
      : "memory");
}

// red.global.add.v4.f32 [p], {a, b, c, d} (16-byte aligned p) under a predicate: four adjacent
// fp32 values in one reduction (sm_90; PTX ISA 8.1).
__device__ __forceinline__ void red_add_v4_f32_if(float* p, float a, float b, float c, float d, bool pred) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n @q red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(p),
      "f"(a), "f"(b), "f"(c), "f"(d), "r"(static_cast<int>(pred))
      : "memory");
}

// Makes p opaque to the optimiser (it cannot be rematerialised from its inputs afterwards).
template <typename P>
__device__ __forceinline__ P* pin_ptr(P* p) {
  asm volatile("" : "+l"(p));
  return p;
}

// ---- math ------------------------------------------------------------------------------------

// ex2.approx.ftz: 2^x in one MUFU op (ex2(-inf) = +0); softmax folds scale*log2(e) into its
// argument so this is the only transcendental per score.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- wgmma: warpgroup-wide asynchronous matrix multiply-accumulate --------------------------

// wgmma.fence: required before the first wgmma of a batch whenever its accumulator or A
// registers were touched by ordinary instructions since the previous wgmma.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// wgmma.commit_group: closes the wgmma ops issued so far into one group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// wgmma.wait_group N: waits until at most N groups are still in flight; only then may their
// accumulators be read and their shared-memory operands be overwritten.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Compiler-only fence on a register: keeps reads/writes of accumulators from being moved across
// the wgmma issue / wait asm statements (which do not name them).
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void reg_fence(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// Shared-memory matrix descriptor (PTX ISA "matrix descriptor format"):
//   bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
//   49-51 base offset (0: tiles aligned to the swizzle pattern), 62-63 swizzle mode (1 = 128B,
//   2 = 64B).
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                              uint64_t swizzle_mode) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32 | swizzle_mode << 62;
}

// The 128-byte swizzle (tiles 1024-byte aligned):
// K-major operand (K contiguous, e.g. Q or K for S = Q K^T): rows of 128 bytes, 8-row groups
//   `sbo` = 1024 bytes apart, LBO unused (1). Step k by 16 elements: start address + 32 bytes.
// MN-major operand (N contiguous, e.g. V [keys x dims] for O = P V): each 8 K-rows x 64 N-values
//   atom is 1024 bytes; `sbo` = 1024 = next 8 K-rows, `lbo` = distance to the next 64 N-values
//   (the next column block). Step k by 16 rows: start address + 2048 bytes.
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return make_desc(smem_addr, lbo_bytes, sbo_bytes, 1);
}

// The 64-byte swizzle (swizzle mode 2), for K-major operands
// whose rows are 64 bytes (fp8 Q / K at head dim 64): the 16-byte chunk c of row r sits at chunk
// position c ^ ((r / 2) % 4) (Swizzle<2,4,3> on byte addresses, what TMA SWIZZLE_64B writes),
// 8-row groups `sbo` = 512 bytes apart, tiles 512-byte aligned, LBO unused (1). Step k by 32 bytes
// (one e4m3 k32 step, two per row): start address + 32.
__device__ __forceinline__ uint64_t make_desc_sw64(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return make_desc(smem_addr, lbo_bytes, sbo_bytes, 2);
}

// A descriptor moved by `bytes` (a multiple of 16): the start-address field is bits 0-13 (address
// >> 4), so adding bytes >> 4 to the 64-bit value gives make_desc_sw128(addr + bytes, lbo, sbo) as
// long as addr + bytes stays below 256 KB, which every shared-memory address of a CTA does. A
// kernel builds each operand's descriptor once and steps it by constants (no mask / shift chain
// in front of every wgmma). The field cannot carry, so only the low word is added (one IADD).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// Register-list strings for the accumulators ("{%0, ..., %K-1}") and their "+f" operands.
#define IOATTN_SM90_R0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define IOATTN_SM90_R8 "%8, %9, %10, %11, %12, %13, %14, %15"
#define IOATTN_SM90_R16 "%16, %17, %18, %19, %20, %21, %22, %23"
#define IOATTN_SM90_R24 "%24, %25, %26, %27, %28, %29, %30, %31"
#define IOATTN_SM90_R32 "%32, %33, %34, %35, %36, %37, %38, %39"
#define IOATTN_SM90_R40 "%40, %41, %42, %43, %44, %45, %46, %47"
#define IOATTN_SM90_R48 "%48, %49, %50, %51, %52, %53, %54, %55"
#define IOATTN_SM90_R56 "%56, %57, %58, %59, %60, %61, %62, %63"
#define IOATTN_SM90_R64 "%64, %65, %66, %67, %68, %69, %70, %71"
#define IOATTN_SM90_R72 "%72, %73, %74, %75, %76, %77, %78, %79"
#define IOATTN_SM90_R80 "%80, %81, %82, %83, %84, %85, %86, %87"
#define IOATTN_SM90_R88 "%88, %89, %90, %91, %92, %93, %94, %95"
#define IOATTN_SM90_R96 "%96, %97, %98, %99, %100, %101, %102, %103"
#define IOATTN_SM90_R104 "%104, %105, %106, %107, %108, %109, %110, %111"
#define IOATTN_SM90_R112 "%112, %113, %114, %115, %116, %117, %118, %119"
#define IOATTN_SM90_R120 "%120, %121, %122, %123, %124, %125, %126, %127"
#define IOATTN_SM90_R_32 IOATTN_SM90_R0 ", " IOATTN_SM90_R8 ", " IOATTN_SM90_R16 ", " IOATTN_SM90_R24
#define IOATTN_SM90_R_64 IOATTN_SM90_R_32 ", " IOATTN_SM90_R32 ", " IOATTN_SM90_R40 ", " IOATTN_SM90_R48 ", " IOATTN_SM90_R56
#define IOATTN_SM90_R_96 IOATTN_SM90_R_64 ", " IOATTN_SM90_R64 ", " IOATTN_SM90_R72 ", " IOATTN_SM90_R80 ", " IOATTN_SM90_R88
#define IOATTN_SM90_DREGS_32 "{" IOATTN_SM90_R_32 "}"
#define IOATTN_SM90_DREGS_40 "{" IOATTN_SM90_R_32 ", " IOATTN_SM90_R32 "}"
#define IOATTN_SM90_DREGS_48 "{" IOATTN_SM90_R_32 ", " IOATTN_SM90_R32 ", " IOATTN_SM90_R40 "}"
#define IOATTN_SM90_DREGS_64 "{" IOATTN_SM90_R_64 "}"
#define IOATTN_SM90_DREGS_88 "{" IOATTN_SM90_R_64 ", " IOATTN_SM90_R64 ", " IOATTN_SM90_R72 ", " IOATTN_SM90_R80 "}"
#define IOATTN_SM90_DREGS_96 "{" IOATTN_SM90_R_96 "}"
#define IOATTN_SM90_DREGS_128 \
  "{" IOATTN_SM90_R_96 ", " IOATTN_SM90_R96 ", " IOATTN_SM90_R104 ", " IOATTN_SM90_R112 ", " IOATTN_SM90_R120 "}"

#define IOATTN_SM90_D8(i)                                                                            \
  "+f"(d[(i) + 0]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
      "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define IOATTN_SM90_D32(i) IOATTN_SM90_D8(i), IOATTN_SM90_D8((i) + 8), IOATTN_SM90_D8((i) + 16), IOATTN_SM90_D8((i) + 24)
#define IOATTN_SM90_DOPS_32 IOATTN_SM90_D32(0)
#define IOATTN_SM90_DOPS_40 IOATTN_SM90_D32(0), IOATTN_SM90_D8(32)
#define IOATTN_SM90_DOPS_48 IOATTN_SM90_D32(0), IOATTN_SM90_D8(32), IOATTN_SM90_D8(40)
#define IOATTN_SM90_DOPS_64 IOATTN_SM90_D32(0), IOATTN_SM90_D32(32)
#define IOATTN_SM90_DOPS_88 IOATTN_SM90_D32(0), IOATTN_SM90_D32(32), IOATTN_SM90_D8(64), IOATTN_SM90_D8(72), IOATTN_SM90_D8(80)
#define IOATTN_SM90_DOPS_96 IOATTN_SM90_D32(0), IOATTN_SM90_D32(32), IOATTN_SM90_D32(64)
#define IOATTN_SM90_DOPS_128 IOATTN_SM90_D32(0), IOATTN_SM90_D32(32), IOATTN_SM90_D32(64), IOATTN_SM90_D32(96)

// Wgmma<N, T>::ss: D(64 x N) (+)= A(64 x 16) B(16 x N), A and B in shared memory (descriptors).
// Wgmma<N, T>::rs: the same with A in registers (4 x b32 in the fragment above).
// accumulate = 0 overwrites D (scale-d = 0); kTransB = 1 reads B as MN-major (N contiguous);
// ss only: kTransA = 1 reads A as MN-major (M contiguous: A^T stored K-rows x 64 M-values, the
// layout the backward needs for dQ = dS K with dS^T in shared memory).
// T is __nv_bfloat16 or __half; accumulation is fp32 either way.
template <int N, typename T>
struct Wgmma;

#define IOATTN_SM90_WGMMA(N, T, PTYPE, K, I0, I1, I2, I3, I4, I5, I6)                                     \
  template <>                                                                                            \
  struct Wgmma<N, T> {                                                                                   \
    template <int kTransB, int kTransA = 0>                                                              \
    __device__ __forceinline__ static void ss(float (&d)[K], uint64_t a_desc, uint64_t b_desc, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I3 ", 0;\n"                                     \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTYPE "." PTYPE " " IOATTN_SM90_DREGS_##K \
                   ", %" #I0 ", %" #I1 ", p, 1, 1, %" #I4 ", %" #I2 ";\n}\n"                              \
                   : IOATTN_SM90_DOPS_##K                                                                \
                   : "l"(a_desc), "l"(b_desc), "n"(kTransB), "r"(accumulate), "n"(kTransA));            \
    }                                                                                                    \
    template <int kTransB>                                                                               \
    __device__ __forceinline__ static void rs(float (&d)[K], const uint32_t (&a)[4], uint64_t b_desc,    \
                                              int accumulate) {                                          \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I6 ", 0;\n"                                     \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTYPE "." PTYPE " " IOATTN_SM90_DREGS_##K \
                   ", {%" #I0 ", %" #I1 ", %" #I2 ", %" #I3 "}, %" #I4 ", p, 1, 1, %" #I5 ";\n}\n"       \
                   : IOATTN_SM90_DOPS_##K                                                                \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(kTransB), "r"(accumulate)); \
    }                                                                                                    \
  };

#define IOATTN_SM90_WGMMA_BOTH(N, K, I0, I1, I2, I3, I4, I5, I6)                   \
  IOATTN_SM90_WGMMA(N, __nv_bfloat16, "bf16", K, I0, I1, I2, I3, I4, I5, I6) \
  IOATTN_SM90_WGMMA(N, __half, "f16", K, I0, I1, I2, I3, I4, I5, I6)

IOATTN_SM90_WGMMA_BOTH(64, 32, 32, 33, 34, 35, 36, 37, 38)
IOATTN_SM90_WGMMA_BOTH(80, 40, 40, 41, 42, 43, 44, 45, 46)
IOATTN_SM90_WGMMA_BOTH(96, 48, 48, 49, 50, 51, 52, 53, 54)
IOATTN_SM90_WGMMA_BOTH(128, 64, 64, 65, 66, 67, 68, 69, 70)
IOATTN_SM90_WGMMA_BOTH(176, 88, 88, 89, 90, 91, 92, 93, 94)
IOATTN_SM90_WGMMA_BOTH(192, 96, 96, 97, 98, 99, 100, 101, 102)
IOATTN_SM90_WGMMA_BOTH(256, 128, 128, 129, 130, 131, 132, 133, 134)

#undef IOATTN_SM90_WGMMA_BOTH
#undef IOATTN_SM90_WGMMA

// Two fp32 -> one b32 of two 16-bit values (lo = first), round to nearest even.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---- FP8 (e4m3): wgmma k32, conversion, and the P fragment ------------------------------------
//
// 8-bit wgmma reads 32 elements of K per instruction (m64nNk32) and only K-major operands from
// shared memory (no transpose flag for 8-bit types): a row of the SW128 tile convention above is
// 128 e4m3 elements, one k-step is still 32 bytes (start address + 32), so the Q K^T descriptors
// are the 16-bit ones (at hdim 64, 64-byte rows: make_desc_sw64 above). P V needs V K-major along the keys, i.e. V^T tiles [d rows x keys].
// A fragment (64 x 32, 8-bit) in registers, 4 x b32 of 4 elements each, low byte first (PTX ISA,
// wgmma k32 / mma.m16n8k32 8-bit A layout; w, g, t as above):
//   a0: row 16w+g,   cols 4t..4t+3        a1: row 16w+g+8, cols 4t..4t+3
//   a2: row 16w+g,   cols 16+4t..16+4t+3  a3: row 16w+g+8, cols 16+4t..16+4t+3
// while the fp32 D fragment of S holds, per row, cols 8i+2t, 8i+2t+1 (i = 0..3 in a 32-col step).
// Rather than exchanging values between threads, fp8_p_fragment keeps every value in its thread
// and the key order inside each 32-key group is permuted instead: A column c of k-step kk holds
// the score of key 32kk + fp8_p_key(c), so V^T must hold key 32kk + fp8_p_key(c) at column c
// (the V transpose pre-pass writes it so; flash_fwd_sm90_fp8.cuh).

// WgmmaFp8<N>::ss: D(64 x N) (+)= A(64 x 32) B(32 x N), e4m3 x e4m3 -> fp32, both operands
// K-major in shared memory. ::rs: A from registers (the fragment above). accumulate = 0: D = A B.
template <int N>
struct WgmmaFp8;

#define IOATTN_SM90_WGMMA_FP8(N, K, I0, I1, I2, I3, I4, I5)                                                  \
  template <>                                                                                              \
  struct WgmmaFp8<N> {                                                                                     \
    __device__ __forceinline__ static void ss(float (&d)[K], uint64_t a_desc, uint64_t b_desc, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I2 ", 0;\n"                                       \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " IOATTN_SM90_DREGS_##K          \
                   ", %" #I0 ", %" #I1 ", p, 1, 1;\n}\n"                                                   \
                   : IOATTN_SM90_DOPS_##K                                                                  \
                   : "l"(a_desc), "l"(b_desc), "r"(accumulate));                                           \
    }                                                                                                      \
    __device__ __forceinline__ static void rs(float (&d)[K], const uint32_t (&a)[4], uint64_t b_desc,      \
                                              int accumulate) {                                            \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I5 ", 0;\n"                                       \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " IOATTN_SM90_DREGS_##K          \
                   ", {%" #I0 ", %" #I1 ", %" #I2 ", %" #I3 "}, %" #I4 ", p, 1, 1;\n}\n"                   \
                   : IOATTN_SM90_DOPS_##K                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));            \
    }                                                                                                      \
  };

IOATTN_SM90_WGMMA_FP8(64, 32, 32, 33, 34, 35, 36, 37)
IOATTN_SM90_WGMMA_FP8(96, 48, 48, 49, 50, 51, 52, 53)
IOATTN_SM90_WGMMA_FP8(128, 64, 64, 65, 66, 67, 68, 69)
IOATTN_SM90_WGMMA_FP8(192, 96, 96, 97, 98, 99, 100, 101)
IOATTN_SM90_WGMMA_FP8(256, 128, 128, 129, 130, 131, 132, 133)

#undef IOATTN_SM90_WGMMA_FP8

// cvt.rn.satfinite.e4m3x2.f32 (twice): four fp32 -> one b32 of four e4m3, x0 in the low byte.
// Round to nearest even; out-of-range values saturate to +-448 (NaN stays NaN). The instruction
// puts its first source in the upper byte, hence the swapped operands.
__device__ __forceinline__ uint32_t pack4_e4m3(float x0, float x1, float x2, float x3) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return r;
}

// The key (0..31, inside a 32-key group) whose score sits in A column c of the fp8 P fragment
// built by fp8_p_fragment: thread t's row values are the S columns {2t, 2t+1, 8+2t, 9+2t} and
// {16+2t, 17+2t, 24+2t, 25+2t}, placed at A columns 4t..4t+3 and 16+4t..16+4t+3.
__host__ __device__ constexpr int fp8_p_key(int c) {
  return 16 * (c / 16) + 8 * ((c % 4) / 2) + 2 * ((c % 16) / 4) + (c % 2);
}

// The A fragment of P for one 32-key k-step from the 16 floats of the S D-fragment that cover
// those keys (s = &S[16 kk]): no data leaves the thread (see fp8_p_key for the resulting order).
__device__ __forceinline__ void fp8_p_fragment(const float* s, uint32_t (&a)[4]) {
  a[0] = pack4_e4m3(s[0], s[1], s[4], s[5]);      // row g:   keys 2t, 2t+1, 8+2t, 9+2t
  a[1] = pack4_e4m3(s[2], s[3], s[6], s[7]);      // row g+8: the same keys
  a[2] = pack4_e4m3(s[8], s[9], s[12], s[13]);    // row g:   keys 16+2t, 17+2t, 24+2t, 25+2t
  a[3] = pack4_e4m3(s[10], s[11], s[14], s[15]);  // row g+8
}

}  // namespace ioattn::cuda::sm90

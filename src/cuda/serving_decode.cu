// serving_decode.cu — split-KV decode (Flash-Decoding) on CUDA over a paged or contiguous KV
// cache (bf16 / f16 / f32 or 8-bit f8e4m3 / i8 with per-kv-head scales), the exact merge of the
// splits, the CUDA split heuristic and the dispatcher's row for decode.
//
// Two kernels share the grid, the key ranges and the epilogue (serving_decode.cuh): the fp32 FMA
// kernel below takes every shape; the tensor-core kernel (serving_decode_mma.cu) takes the
// serving case (bf16/f16, head_dim == head_dim_v in {64, 128, 256}, every row of a CTA seeing the
// same keys: seqlen_q 1 or no causal/window mask) and is chosen there; IOATTN_DECODE_KERNEL=fma|mma
// forces one (the log line says which and why). With more than one split, a second kernel merges
// the partials (merge_splits_kernel, launched with programmatic dependent launch on sm90; the decode
// CTAs trigger its launch right after their own dependency wait, DecodeParams::early_trigger).
// Tried and measured slower (docs/PERF.md, session 18): the splits as one thread-block cluster
// merging through distributed shared memory instead of the merge kernel (clusters must be resident
// together in a GPC, so a grid sized to fill the machine no longer packs it: f8e4m3 b16 x 4k with 3
// splits lost 30%).

// Semantics: exactly those of the CPU backend (src/cpu/serving_cpu.cpp, whose file comment is the
// specification): the same key range per split (decode_split_range), masks, softcap before ALiBi,
// sinks added once (at the merge, or in the CTA when there is one split), NaN / +inf visible scores
// poison their row, rows with no visible key give O = 0 and LSE = -inf (or the sink).
//
// Work partition. CTA = (sequence b, kv head hk, split s, row block rb). The R = group * seqlen_q
// query rows of a kv head are cut into blocks of kRows = 4 (GQA 32/8 with one query token: one
// block, so every K/V byte is read once); a larger group runs ceil(R / 4) CTAs over the same
// chunk, adjacent in the grid so the repeats hit L2. Grid = batch * heads_kv * splits * blocks,
// fixed by the shape and the split count: nothing depends on cache_seqlens on the host, so the
// launch is CUDA-graph capturable; a CTA whose range is empty writes an empty partial.
//
// One CTA, 4 warps. A key's head_dim is spread over TX = pow2(ceil(max(d, dv) / 16)) lanes of
// 16 elements each ("a lane group"); the CTA's G = 128 / TX groups each take one key at a time.
// Per tile of BK = 4 * G keys (K and V tiles of 8 KiB per element byte, cp.async 16-byte copies
// through the page table into a 2-4 stage ring):
//   every group scores its 4 keys for the 4 rows: partial dots over its 16 elements, a butterfly
//   over the TX lanes; softcap, ALiBi, mask (select -inf); online softmax per (group, row) in
//   log2 units (Q pre-scaled by log2 e; one ex2.approx per score; running max m, sum l, acc
//   rescaled only when the max grows); acc += p * V (p == 0 skipped: a masked key's V may hold
//   inf / NaN).
// At the end the G groups are merged exactly in shared memory (in group order: deterministic, so a
// graph replay is bitwise the eager run), then the CTA writes O and LSE (one split) or its fp32
// partial (O normalised, LSE) to the workspace, [b, h, i, split, dv] / [b, h, i, split].
//
// Shared-memory layout: a cache row of the tile occupies CPR = TX * kBytes 16-byte chunks (a lane
// owns kBytes chunks of 16 / kBytes elements: chunk c = tx + v * TX, v < kBytes). When
// TX < 8 and CPR >= 8, chunk c of row j is stored at c ^ ((j % (8 / TX)) * TX), so the 8 lanes of a
// 16-byte shared-load phase (8 / TX consecutive keys) hit 8 distinct bank groups.
//
// Device-side bounds (validation cannot read device tensors): a cache_seqlens entry outside
// [0, bound] (bound = the capacity, or the plan's max_seqlen_k if smaller) or a block_table entry
// outside [0, pages) makes the whole sequence's output NaN (LSE NaN); nothing out of range is read.
// A length below seqlen_q (rejected on the CPU) is computed as the position formula says.
//
// Measured (H200, GQA 32/8, hdim 128, bf16, q len 1, graph replay; bench/peer_decode.py): see
// serving_decode_mma.cu's history and docs/PERF.md. The merge was one warp per row walking the
// splits one L2 round trip at a time (ncu, b1 x 4k: 12 / 35 / 70 us at 8 / 32 / 64 splits, more
// than the decode kernel); one CTA per row with batched loads takes it to ~5 us at 32 splits.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/serving_problem.hpp"
#include "cuda/check.cuh"
#include "cuda/ptx.cuh"
#include "cuda/serving.cuh"
#include "cuda/serving_decode.cuh"

namespace ioattn::cuda::serving {
namespace {

constexpr int kRows = 4;          // query rows per CTA
constexpr int kElems = 16;        // head-dim elements per lane
constexpr int kKeysPerGroup = 4;  // keys a lane group scores per tile
constexpr int kMaxGroups = kThreads;  // TX = 1

// The lane's 16 elements of cache row `row` (shared memory) in fp32: chunk v of the lane is
// logical chunk tx + v * TX, stored at that ^ sw.
template <typename CT>
__device__ __forceinline__ void load_row(const uint8_t* row, int tx, int txl, int sw, float (&out)[kElems]) {
  constexpr int NV = CacheTraits<CT>::kBytes, VEC = 16 / NV;
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const int c = (tx + (v << txl)) ^ sw;
    const uint4 raw = *reinterpret_cast<const uint4*>(row + c * 16);
    CacheTraits<CT>::convert(raw, out + v * VEC);
  }
}

template <typename CT>
__global__ void __launch_bounds__(kThreads) decode_kernel(const DecodeParams p) {
  using Tr = CacheTraits<CT>;
  constexpr int NV = Tr::kBytes;        // 16-byte chunks per lane per row
  constexpr int VEC = 16 / NV;          // elements per chunk
  constexpr int STAGES = Tr::kStages;
  constexpr int kTileBytes = 8192 * NV;  // one K (or V) tile: BK rows of CPR chunks
  constexpr int kLoadIters = 4 * NV;     // chunks per thread per tile (of K, and of V)
  static_assert(kTileBytes == (kThreads * kKeysPerGroup) * kElems * NV, "tile bytes");

  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float grp_m[kMaxGroups * kRows], grp_l[kMaxGroups * kRows];
  __shared__ int grp_bad[kMaxGroups];
  __shared__ float row_m[kRows], row_l[kRows];
  __shared__ int row_bad[kRows];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int txl = p.tx_log2, TX = 1 << txl;
  const int tx = lane & (TX - 1), ty = lane >> txl;
  const int G = kThreads >> txl;             // lane groups
  const int gi = (warp << (5 - txl)) + ty;   // this lane's group
  const int CPR = NV << txl;                 // 16-byte chunks per tile row
  const int row_stride = CPR * 16;           // bytes
  const int BK = G * kKeysPerGroup;          // keys per tile
  const int swz_mask = (TX < 8 && CPR >= 8) ? (8 >> txl) - 1 : 0;

  const WorkItem w = work_item(p);
  const int rb = w.rb, hk = w.hk;
  const int64_t b = w.b, len = w.len, k0 = w.k0, k1 = w.k1;
  const int sq = p.seqlen_q;

  // ---- rows: visible range within the split, pre-scaled Q --------------------------------
  const float q_mul = p.scale * w.k_scale * kLog2e;
  float qr[kRows][kElems];
  int lo[kRows], hi[kRows];
  float slope[kRows], diag[kRows];
  // Union of the rows' visible ranges within the split; empty (nkeys 0) when no row sees a key.
  // (Not seeded with [k1, k0): for an empty split k0 > k1, and that seed would be read as a
  // non-empty range past the sequence's pages.)
  int64_t klo = INT64_MAX, khi = INT64_MIN;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int rr = rb * kRows + r;
    const bool valid = rr < p.rows;
    const int hh = valid ? rr / sq : 0, i = valid ? rr % sq : 0;
    const int h = hk * p.group + hh;
    int64_t a = 0, z = 0;
    if (valid && len > 0) {
      vis_keys(i, sq, len, p.wl, p.wr, &a, &z);
      a = max(a, k0);
      z = min(z, k1);
    }
    if (a < z) {
      klo = min(klo, a);
      khi = max(khi, z);
    } else {
      a = z = 0;
    }
    lo[r] = static_cast<int>(a);
    hi[r] = static_cast<int>(z);
    slope[r] = (valid && p.alibi) ? p.alibi[h] * kLog2e : 0.0f;
    diag[r] = static_cast<float>(i + len - sq);
    const int64_t qoff = b * p.q_sb + i * p.q_ss + h * p.q_sh;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      const int dim = ((tx + ((e / VEC) << txl)) * VEC) + e % VEC;
      qr[r][e] = (valid && dim < p.d) ? load_elem(p.q, p.dtype, qoff + dim) * q_mul : 0.0f;
    }
  }

  // ---- the cp.async loader: this thread copies chunk c_ld of rows j_ld0 + it * j_step --------
  const int64_t nkeys = khi > klo ? khi - klo : 0;  // klo is only used when nkeys > 0
  const int ntiles = static_cast<int>((nkeys + BK - 1) / BK);
  const int c_ld = tid & (CPR - 1);
  const int j_ld0 = tid / CPR, j_step = kThreads / CPR;  // kLoadIters * j_step == BK
  const int k_valid = min(max(p.k_row_bytes - c_ld * 16, 0), 16);
  const int v_valid = min(max(p.v_row_bytes - c_ld * 16, 0), 16);
  int pg_bad = 0;

  auto issue = [&](int tile) {
    if (tile < ntiles) {
      uint8_t* ks = smem + (tile % STAGES) * 2 * kTileBytes;
      issue_tile<kLoadIters>(p, w, ks, ks + kTileBytes, klo + static_cast<int64_t>(tile) * BK, khi, c_ld, j_ld0,
                             j_step, row_stride, swz_mask, txl, k_valid, v_valid, pg_bad);
    }
    ptx::cp_async_commit();  // always: the wait counts groups
  };

  float m[kRows], l[kRows], acc[kRows][kElems];
  int bad = 0;  // bit r: row r saw a NaN or +inf score
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = ninf();
    l[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[r][e] = 0.0f;
  }
  // Softcap in log2 units: (cap log2e) tanh(s' / (cap log2e)) = log2e * cap tanh(s / cap).
  const float cap = p.softcap * kLog2e, inv_cap = p.softcap > 0.0f ? 1.0f / cap : 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);

  for (int tile = 0; tile < ntiles; ++tile) {
    ptx::cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile landed for every thread; tile - 1's stage is free again
    issue(tile + STAGES - 1);
    const uint8_t* ks = smem + (tile % STAGES) * 2 * kTileBytes;
    const uint8_t* vs = ks + kTileBytes;
    const int t0 = static_cast<int>(klo) + tile * BK;

    // Scores of this group's keys u * G + gi for the 4 rows.
    float s[kRows][kKeysPerGroup];
#pragma unroll
    for (int u = 0; u < kKeysPerGroup; ++u) {
      const int j = u * G + gi;
      const int sw = (j & swz_mask) << txl;
#pragma unroll
      for (int r = 0; r < kRows; ++r) s[r][u] = 0.0f;
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int c = (tx + (v << txl)) ^ sw;
        const uint4 raw = *reinterpret_cast<const uint4*>(ks + j * row_stride + c * 16);
        float kf[VEC];
        Tr::convert(raw, kf);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int x = 0; x < VEC; ++x) s[r][u] = fmaf(qr[r][v * VEC + x], kf[x], s[r][u]);
      }
    }
    for (int off = TX >> 1; off > 0; off >>= 1)
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int u = 0; u < kKeysPerGroup; ++u) s[r][u] += ptx::shfl_xor(s[r][u], off);

    // Score modifiers, mask, online softmax (s becomes P).
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float mb = ninf();
#pragma unroll
      for (int u = 0; u < kKeysPerGroup; ++u) {
        const int t = t0 + u * G + gi;
        float x = s[r][u];
        if (inv_cap > 0.0f) x = cap * tanhf(x * inv_cap);
        if (p.alibi) x = fmaf(-slope[r], fabsf(diag[r] - static_cast<float>(t)), x);
        const bool vis = t >= lo[r] && t < hi[r];
        x = vis ? x : ninf();
        if (vis && !(x < INFINITY)) bad |= 1 << r;
        mb = fmaxf(mb, x);
        s[r][u] = x;
      }
      const float mn = fmaxf(m[r], mb);
      if (mn == ninf()) {  // nothing visible yet: P = 0
#pragma unroll
        for (int u = 0; u < kKeysPerGroup; ++u) s[r][u] = 0.0f;
        continue;
      }
      float sum = 0.0f;
#pragma unroll
      for (int u = 0; u < kKeysPerGroup; ++u) {
        const float e = ptx::exp2_approx(s[r][u] - mn);  // s = -inf -> 0
        s[r][u] = e;
        sum += e;
      }
      if (mn != m[r]) {  // the max grew: rescale (rare once the first keys are in)
        const float alpha = ptx::exp2_approx(m[r] - mn);  // m = -inf -> 0
        l[r] *= alpha;
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[r][e] *= alpha;
        m[r] = mn;
      }
      l[r] += sum;
    }

    // acc += P V.
#pragma unroll
    for (int u = 0; u < kKeysPerGroup; ++u) {
      const int j = u * G + gi;
      float vf[kElems];
      load_row<CT>(vs + j * row_stride, tx, txl, (j & swz_mask) << txl, vf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float pu = s[r][u];
        if (pu != 0.0f) {
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[r][e] = fmaf(pu, vf[e], acc[r][e]);
        }
      }
    }
  }

  // ---- merge the G groups (shared memory, in group order) ---------------------------------
  ptx::cp_async_wait<0>();
  const int any_pg_bad = __syncthreads_or(pg_bad);  // also: every thread is done with the ring
  if (tx == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      grp_m[gi * kRows + r] = m[r];
      grp_l[gi * kRows + r] = l[r];
    }
    grp_bad[gi] = bad;
  }
  __syncthreads();
  rows_from_groups<kRows>(G, grp_m, grp_l, grp_bad, any_pg_bad | (w.seq_bad ? 1 : 0), row_m, row_l, row_bad);
  __syncthreads();
  const int Dp = kElems << txl;
  float* red = reinterpret_cast<float*>(smem);  // [G][kRows][Dp] fp32 = 32 KiB
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float f = m[r] > ninf() ? ptx::exp2_approx(m[r] - row_m[r]) : 0.0f;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      const int dim = ((tx + ((e / VEC) << txl)) * VEC) + e % VEC;
      red[(gi * kRows + r) * Dp + dim] = acc[r][e] * f;
    }
  }
  __syncthreads();

  write_outputs<kRows>(p, w, G, Dp, red, row_m, row_l, row_bad);
}

// ---- merge of the splits: one CTA per query row ---------------------------------------------
//
// Every warp reduces the S partial LSEs (max, NaN, sum; they are few), then warp w accumulates
// the partial O rows of splits w, w + 4, w + 8, ..., loading kMergeBatch of them before it
// multiplies any (the loads of a batch are independent, so a warp waits one L2 round trip per
// batch instead of one per split: one warp walking 32 splits in order cost ~35 us at b1 x 4k),
// and the 4 warp sums are added in warp order: a fixed order, so a replay is bitwise the eager run.

struct MergeParams {
  const float* part_o;
  const float* part_lse;
  void* o;
  float* lse;
  int64_t o_sb, o_ss, o_sh, l_sb, l_ss, l_sh;
  DType dtype;
  int64_t rows;  // batch * heads_q * seqlen_q
  int heads_q, seqlen_q, splits, dv;
  const float* sinks;
};

constexpr int kMergeWarps = 4;
constexpr int kMergeElems = kMaxDim / 32;
constexpr int kMergeSplitRegs = detail::kMaxSplits / 32;
constexpr int kMergeBatch = 8;
static_assert(detail::kMaxSplits % 32 == 0, "merge: splits in whole warps");

__global__ void __launch_bounds__(kMergeWarps * 32) merge_splits_kernel(const MergeParams p) {
  __shared__ float wts[detail::kMaxSplits];
  __shared__ float red[kMergeWarps][kMaxDim];
  // Indices before the wait (kernel parameters only; 32-bit: the host keeps the grid below 2^31).
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x;
  const uint32_t bh32 = blockIdx.x / static_cast<uint32_t>(p.seqlen_q);
  const int i = static_cast<int>(blockIdx.x - bh32 * static_cast<uint32_t>(p.seqlen_q));
  const int h = static_cast<int>(bh32 % static_cast<uint32_t>(p.heads_q));
  const int64_t b = bh32 / static_cast<uint32_t>(p.heads_q);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // the decode grid's partials are complete and visible (no-op without PDL)
  // The next decode call (launched with PDL) may start its CTAs now; they wait in their own
  // cudaGridDependencySynchronize until this grid has completed.
  cudaTriggerProgrammaticLaunchCompletion();
#endif
  const int S = p.splits;  // <= kMaxSplits = 32 * kMergeSplitRegs
  const float* pl = p.part_lse + row * S;
  const float* po = p.part_o + row * S * p.dv;
  const float sink = p.sinks ? p.sinks[h] : ninf();
  // Split s's LSE lives in lane s % 32, register s / 32: all of them are loaded at once (no
  // dependent chain of S loads), then max / NaN / sum are warp reductions in a fixed order.
  float lv[kMergeSplitRegs];
  float M = sink;
  bool nan = false;
#pragma unroll
  for (int j = 0; j < kMergeSplitRegs; ++j) {
    const int s = lane + 32 * j;
    lv[j] = s < S ? pl[s] : ninf();
    nan |= isnan(lv[j]);
    M = fmaxf(M, lv[j]);
  }
  nan = __any_sync(0xffffffffu, nan);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
  const int64_t ooff = b * p.o_sb + i * p.o_ss + h * p.o_sh;
  if (nan || M == ninf()) {  // the same in every warp of the CTA
    if (warp == 0) {
      const float fill = nan ? NAN : 0.0f;
      for (int x = lane; x < p.dv; x += 32) store_elem(p.o, p.dtype, ooff + x, fill);
      if (lane == 0 && p.lse) p.lse[b * p.l_sb + h * p.l_sh + i * p.l_ss] = nan ? NAN : ninf();
    }
    return;
  }
  float part = 0.0f;
#pragma unroll
  for (int j = 0; j < kMergeSplitRegs; ++j) {
    lv[j] = expf(lv[j] - M);  // an empty split (-inf) -> 0
    part += lv[j];
    if (warp == 0 && lane + 32 * j < S) wts[lane + 32 * j] = lv[j];
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
  const float total = part + (p.sinks ? expf(sink - M) : 0.0f);
  __syncthreads();

  float acc[kMergeElems];
#pragma unroll
  for (int k = 0; k < kMergeElems; ++k) acc[k] = 0.0f;
  for (int s0 = warp; s0 < S; s0 += kMergeWarps * kMergeBatch) {
    float v[kMergeBatch][kMergeElems], wt[kMergeBatch];
#pragma unroll
    for (int u = 0; u < kMergeBatch; ++u) {
      const int s = s0 + u * kMergeWarps;
      wt[u] = s < S ? wts[s] : 0.0f;
      const float* src = po + static_cast<int64_t>(s) * p.dv;
#pragma unroll
      for (int k = 0; k < kMergeElems; ++k) {
        const int x = lane + 32 * k;
        v[u][k] = (s < S && x < p.dv) ? __ldcg(src + x) : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kMergeBatch; ++u)
      if (wt[u] != 0.0f)  // a zero weight never multiplies an inf / NaN
#pragma unroll
        for (int k = 0; k < kMergeElems; ++k) acc[k] = fmaf(wt[u], v[u][k], acc[k]);
  }
#pragma unroll
  for (int k = 0; k < kMergeElems; ++k) red[warp][lane + 32 * k] = acc[k];
  __syncthreads();
  if (warp == 0) {
    const float inv = 1.0f / total;
#pragma unroll
    for (int k = 0; k < kMergeElems; ++k) {
      const int x = lane + 32 * k;
      if (x < p.dv) {
        float sum = red[0][x];
#pragma unroll
        for (int ww = 1; ww < kMergeWarps; ++ww) sum += red[ww][x];
        store_elem(p.o, p.dtype, ooff + x, sum * inv);
      }
    }
    if (lane == 0 && p.lse) p.lse[b * p.l_sb + h * p.l_sh + i * p.l_ss] = M + logf(total);
  }
}

// ---- host side ---------------------------------------------------------------------------------

int tx_log2_for(int64_t dim) {
  int txl = 0;
  while ((int64_t{kElems} << txl) < dim) ++txl;
  return txl;
}

size_t align_up(size_t n) {
  return (n + detail::kWorkspaceAlign - 1) / detail::kWorkspaceAlign * detail::kWorkspaceAlign;
}

template <typename CT>
void launch_decode(const DecodeParams& dp, int64_t grid, cudaStream_t stream, bool pdl) {
  constexpr size_t smem = static_cast<size_t>(CacheTraits<CT>::kStages) * 2 * 8192 * CacheTraits<CT>::kBytes;
  static_assert(smem >= 32768, "the group merge reuses 32 KiB ([G][kRows][Dp] fp32) of the ring");
  static std::atomic<uint64_t> smem_set{0};
  launch_decode_grid(&decode_kernel<CT>, smem_set, dp, grid, static_cast<int>(smem), stream, pdl);
}

int sm_count(int device) {
  int n = 0;
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

// Programmatic dependent launch for the merge kernel: sm90+, unless IOATTN_DECODE_PDL=0.
bool use_pdl(int device) {
  static const bool env_off = [] {
    const char* e = std::getenv("IOATTN_DECODE_PDL");
    return e && std::strcmp(e, "0") == 0;
  }();
  if (env_off) return false;
  int major = 0;
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 9;
}

// The merge grid's launch triggered at the decode CTAs' start (DecodeParams::early_trigger), unless
// IOATTN_DECODE_EARLY_TRIGGER=0 (read once, as use_pdl's switch).
bool early_trigger_on() {
  static const bool on = [] {
    const char* e = std::getenv("IOATTN_DECODE_EARLY_TRIGGER");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

int64_t row_blocks_of(int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int rows_per_cta = kRows) {
  return (heads_q / heads_kv * seqlen_q + rows_per_cta - 1) / rows_per_cta;
}

// IOATTN_DECODE_KERNEL=fma | mma forces a kernel (tests, comparisons); unset: mma where it applies.
std::string forced_kernel() {
  const char* e = std::getenv("IOATTN_DECODE_KERNEL");
  return e ? std::string(e) : std::string();
}

// IOATTN_DECODE_LOADER=bulk | cp.async: the mma kernel's loader (bulk: an experiment; unset: cp.async).
std::string forced_loader() {
  const char* e = std::getenv("IOATTN_DECODE_LOADER");
  return e ? std::string(e) : std::string();
}

// The device's arch is asked for only when the bulk loader was requested (arch_of: device -> arch).
template <class ArchOf>
bool use_bulk_loader(const detail::DecodeProblem& p, ArchOf arch_of) {
  return forced_loader() == "bulk" && mma_bulk_supported(p.dtype, p.cache_dtype, p.head_dim, arch_of());
}

bool masked(const detail::DecodeProblem& p) { return p.causal || p.window_left >= 0 || p.window_right >= 0; }

// The mma kernel's ring depth for this call (mma_decode_stages over the call's CTAs before
// splitting): one answer for the kernel choice's name and for the launch.
int mma_ring_of(const detail::DecodeProblem& p, bool bulk) {
  const int64_t rb = row_blocks_of(p.heads_q, p.heads_kv, p.seqlen_q, mma_rows_per_cta(p.rows_per_group(), p.head_dim));
  return mma_decode_stages(p.cache_dtype, p.head_dim, bulk, p.batch * p.heads_kv * rb, p.max_seqlen_k);
}

bool mma_applies(const detail::DecodeProblem& p) {
  return mma_decode_supported(p.dtype, p.cache_dtype, p.head_dim, p.head_dim_v, p.seqlen_q, masked(p));
}

}  // namespace
}  // namespace ioattn::cuda::serving

namespace ioattn::detail {

using namespace ioattn::cuda::serving;

CudaSelection cuda_decode_select(const DecodeProblem& p, int arch) {
  auto no = [](std::string why) { return CudaSelection{"", std::move(why)}; };
  if (arch < 80) return no("the CUDA decode kernel needs sm80+ (cp.async); device is sm" + std::to_string(arch));
  if (p.head_dim > kMaxDim || p.head_dim_v > kMaxDim)
    return no("the CUDA decode kernel takes head_dim and head_dim_v up to " + std::to_string(kMaxDim) + ", got " +
              std::to_string(p.head_dim) + "/" + std::to_string(p.head_dim_v));
  const int64_t es = dtype_size(p.cache_dtype);
  auto al = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  auto st = [es](int64_t stride, int64_t extent) { return extent <= 1 || (stride * es) % 16 == 0; };
  if (!al(p.k_cache) || !al(p.v_cache) || !st(p.k_stride.page, p.num_pages) || !st(p.v_stride.page, p.num_pages) ||
      !st(p.k_stride.slot, p.page_size) || !st(p.v_stride.slot, p.page_size) || !st(p.k_stride.head, p.heads_kv) ||
      !st(p.v_stride.head, p.heads_kv))
    return no("the CUDA decode kernel reads cache rows with 16-byte copies: k_cache / v_cache must be 16-byte "
              "aligned and their page, slot and head strides multiples of 16 bytes (" +
              std::to_string(16 / es) + " " + dtype_name(p.cache_dtype) + " elements)");
  if (p.paged() && p.page_size > INT_MAX) return no("page_size must be below 2^31 on CUDA");
  const std::string force = forced_kernel();
  if (!force.empty() && force != "fma" && force != "mma")
    return no("IOATTN_DECODE_KERNEL must be fma or mma (or unset), got '" + force + "'");
  const bool mma = force == "mma" || (force.empty() && mma_applies(p));
  if (mma && !mma_applies(p))
    return no("IOATTN_DECODE_KERNEL=" + force +
              ": the mma.sync decode kernel takes bf16/f16 q and cache of the same dtype, "
              "head_dim == head_dim_v in {64, 128, 256}, and seqlen_q 1 or no causal/window mask");
  const std::string loader = forced_loader();
  if (!loader.empty() && loader != "bulk" && loader != "cp.async")
    return no("IOATTN_DECODE_LOADER must be bulk or cp.async (or unset), got '" + loader + "'");
  const char* stages_env = std::getenv("IOATTN_DECODE_STAGES");
  if (stages_env != nullptr && *stages_env != '\0' && std::strcmp(stages_env, "2") != 0 &&
      std::strcmp(stages_env, "3") != 0 && std::strcmp(stages_env, "5") != 0)
    return no(std::string("IOATTN_DECODE_STAGES must be 2, 3 or 5 (or unset), got '") + stages_env + "'");
  if (mma) {
    const int rows = mma_rows_per_cta(p.rows_per_group(), p.head_dim);
    const bool bulk = use_bulk_loader(p, [&] { return arch; });
    const std::string loader_why =
        bulk ? "IOATTN_DECODE_LOADER=bulk: one 1-D bulk copy (TMA) per K / V row, stages completing on mbarriers"
             : std::string(loader == "bulk" ? "IOATTN_DECODE_LOADER=bulk does not apply (needs sm90 and a build with "
                                              "sm_90 code, bf16/f16 q and cache of the same dtype, head_dim 128): "
                                            : "") +
                   "cp.async ring";
    const int64_t rbm = row_blocks_of(p.heads_q, p.heads_kv, p.seqlen_q, rows);
    const int stages = mma_ring_of(p, bulk);
    return {"cuda/splitkv sm" + std::to_string(arch) + " mma" + (bulk ? " bulk" : "") +
                (!bulk && stages != 3 && p.head_dim == 128 && dtype_size(p.cache_dtype) == 2
                     ? " stages" + std::to_string(stages)
                     : ""),
            std::string(force.empty() ? "" : "IOATTN_DECODE_KERNEL=mma; ") +
                "mma.sync m16n8k16 with keys as M (S^T = K Q^T, O^T += V^T P^T, P^T by movmatrix, P = P_hi + "
                "P_lo), 4 warps x 16 keys of 64-key tiles, " +
                std::to_string(rows) + " query rows per CTA (" + std::to_string(p.rows_per_group()) +
                " rows per kv head: " + std::to_string(rbm) + (rbm == 1 ? " block" : " blocks") + "), " +
                std::to_string(stages) + "-stage " + loader_why + (bulk ? "" : " into XOR-swizzled unpadded shared rows") +
                (p.paged() ? ", (page, slot) of each key prefetched into shared memory" : "")};
  }
  const int txl = tx_log2_for(std::max(p.head_dim, p.head_dim_v));
  const int TX = 1 << txl;
  const int64_t rb = row_blocks_of(p.heads_q, p.heads_kv, p.seqlen_q);
  const int stages = p.cache_dtype == DType::f32 ? 2 : dtype_size(p.cache_dtype) == 2 ? 3 : 4;
  std::string why = std::string(force.empty() ? "" : "IOATTN_DECODE_KERNEL=fma; ") +
                    (mma_applies(p) ? "" : "not the mma kernel's shape (bf16/f16, head_dim == head_dim_v in {64, 128, "
                                           "256}, one visible range per CTA); ") +
                    "fp32 FMA, 4 warps, " + std::to_string(kRows) + " query rows per CTA (" +
                    std::to_string(p.rows_per_group()) + " rows per kv head: " + std::to_string(rb) +
                    (rb == 1 ? " block" : " blocks") + "), " + std::to_string(TX) + " lanes x " +
                    std::to_string(kElems) + " dims per key, " + std::to_string(4 * (kThreads / TX)) +
                    "-key tiles, " + std::to_string(stages) + "-stage cp.async ring";
  return {"cuda/splitkv sm" + std::to_string(arch) + " fma", why};
}

// Split heuristic (CUDA). A CTA is (sequence, kv head, split, row block); beyond batch * heads_kv
// * row_blocks CTAs, parallelism comes only from splitting the KV range. A launch runs in waves of
// slots = ctas_per_sm * SMs CTAs (2 resident per SM: the cp.async ring of the 16-bit kernels; 3
// for 8-bit caches at head_dim <= 128, whose ring is smaller), and every CTA of a wave streams a
// chunk of the same length. The cost of s splits, in key tokens per CTA slot:
//   cost(s) = waves(s) * (chunk(s) + kCtaOverheadTokens) + (s > 1 ? kMergeOverheadTokens : 0)
//   waves(s) = ceil(work * s / slots), chunk(s) = ceil(max_seqlen_k / s) rounded up to 16,
//   work = batch * heads_kv * row_blocks (the row blocks of the kernel that will run: 8 or 16 query
//   rows per CTA for the mma kernel's one-token case, kRows otherwise),
// (the pipeline ramp and epilogue of a CTA, and the merge launch, as the tokens a CTA streams in
// that time), minimised over 1 <= s <= min(kMaxSplits, ceil(max_seqlen_k / kMinChunkTokens)),
// the fewest splits within 3% of the minimum. One exception: the mma kernel's serving case (one
// query token, head_dim == head_dim_v == 128, the measured one) on a contiguous 16-bit cache whose
// work already puts a CTA on ~every SM (work >= 0.9 SMs) runs unsplit — one such CTA reads at its
// SM's share of HBM bandwidth, so a second one per SM only adds a merge (H200, session 9, GQA 32/8,
// hdim 128, TB/s unsplit / 2 splits: b16 x 4k 3.95 / 3.65, x 32k 4.30 / 4.09, x 128k 4.28 /
// 4.15; paged caches, 8-bit ones and the FMA kernel keep the wave model: f8e4m3 b64 x 32k paged 16
// ran 2.89 TB/s unsplit, 3.57 / 3.61 at 4 / 8 splits; the FMA kernel unsplit at b16 reads < 1 TB/s). H200 (132 SMs), GQA 32/8, one token, bf16: batch 1 x
// 4k / 32k / 128k -> 32 splits (256 CTAs; at 4k chunks of 128 tokens, every tile in flight at
// once), 16 and 64 x 4k..128k contiguous -> 1 (paged: 2 at batch 16).
int cuda_decode_num_splits(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int64_t max_seqlen_k,
                           DType cache_dtype, int64_t head_dim, int64_t head_dim_v, bool paged, int device_index,
                           std::string* why) {
  constexpr int64_t kMinChunkTokens = 128, kCtaOverheadTokens = 64, kMergeOverheadTokens = 64;
  const bool eight_bit = cache_dtype == DType::f8e4m3 || cache_dtype == DType::i8;
  const bool sixteen_bit = cache_dtype == DType::bf16 || cache_dtype == DType::f16;
  // The mma kernel runs one query token on these caches (its other conditions — q of the cache's
  // dtype or 8-bit cache, no mask when seqlen_q > 1 — are not known to a plan; a wrong guess costs
  // speed, never correctness): its CTAs hold 8 or 16 query rows, the FMA kernel's kRows.
  const bool mma_likely = (sixteen_bit || eight_bit) && seqlen_q == 1 && head_dim == head_dim_v &&
                          (head_dim == 64 || head_dim == 128 || head_dim == 256) && forced_kernel() != "fma";
  const int64_t group_rows = heads_kv > 0 ? heads_q / heads_kv * seqlen_q : 1;
  const int rows_per_cta = mma_likely ? mma_rows_per_cta(group_rows, head_dim) : kRows;
  const int64_t rb = heads_kv > 0 ? row_blocks_of(heads_q, heads_kv, seqlen_q, rows_per_cta) : 1;
  const int64_t work = std::max<int64_t>(1, batch * heads_kv * rb);
  // The mma kernel's ring at head_dim 128 with 16-bit caches (mma_decode_stages: 2 stages for a few
  // short sequences, or as IOATTN_DECODE_STAGES forces; not with the bulk loader): 2 stages fit 3
  // CTAs per SM, 5 one; both the wave model only. 8-bit caches at head_dim <= 128 with 8-row CTAs:
  // 3 per SM (their ring is smaller; 16-row CTAs need ~170 registers: 2).
  const int ring = mma_likely && sixteen_bit && head_dim == 128
                       ? mma_decode_stages(cache_dtype, head_dim, forced_loader() == "bulk", work, max_seqlen_k)
                       : 0;
  const bool two_stage = ring == 2, ring_opt = ring == 2 || ring == 5;
  const int64_t ctas_per_sm = ring == 5 ? 1 : (eight_bit && head_dim <= 128 && rows_per_cta == 8) || two_stage ? 3 : 2;
  const int sms = sm_count(device_index);
  const int64_t slots = ctas_per_sm * sms;
  const int64_t L = std::max<int64_t>(max_seqlen_k, 1);
  const int64_t by_len = std::max<int64_t>(1, (L + kMinChunkTokens - 1) / kMinChunkTokens);
  const int64_t max_s = std::clamp<int64_t>(by_len, 1, kMaxSplits);
  const bool mma_serving = mma_likely && sixteen_bit && head_dim == 128 && !ring_opt;
  if (mma_serving && !paged && work * 10 >= static_cast<int64_t>(sms) * 9) {
    if (why)
      *why = "batch*heads_kv*row_blocks " + std::to_string(work) + " CTAs on " + std::to_string(sms) +
             " SMs, one query token on a contiguous 16-bit cache (the mma kernel): unsplit (one CTA per SM reads "
             "at its share of the bandwidth)";
    return 1;
  }
  auto cost = [&](int64_t s) {
    int64_t chunk = (L + s - 1) / s;
    chunk = (chunk + detail::kSplitAlignTokens - 1) / detail::kSplitAlignTokens * detail::kSplitAlignTokens;
    const int64_t waves = (work * s + slots - 1) / slots;
    return static_cast<double>(waves * (chunk + kCtaOverheadTokens) + (s > 1 ? kMergeOverheadTokens : 0));
  };
  double best_cost = cost(1);
  for (int64_t s = 2; s <= max_s; ++s) best_cost = std::min(best_cost, cost(s));
  int64_t best = 1;  // the fewest splits within 3% of the best cost (a near tie is not worth the merge)
  while (best < max_s && cost(best) > 1.03 * best_cost) ++best;
  if (why)
    *why = "batch*heads_kv*row_blocks " + std::to_string(work) + " CTAs per split on " + std::to_string(sms) +
           " SMs (" + std::to_string(slots) + " slots of " + std::to_string(ctas_per_sm) +
           " per SM), max_seqlen_k " + std::to_string(max_seqlen_k) + ": fewest waves x (chunk + ramp) over 1.." +
           std::to_string(max_s) + " splits (chunks >= " + std::to_string(kMinChunkTokens) + " tokens)";
  return static_cast<int>(best);
}

size_t cuda_decode_workspace_bytes(int64_t batch, int64_t heads_q, int64_t seqlen_q, int64_t head_dim_v,
                                   int num_splits) {
  if (num_splits <= 1) return 0;
  const size_t rows = static_cast<size_t>(batch * heads_q * seqlen_q) * static_cast<size_t>(num_splits);
  return align_up(rows * static_cast<size_t>(head_dim_v) * 4) + align_up(rows * 4);
}

void cuda_decode(const DecodeProblem& p) {
  cuda::DeviceGuard guard(p.device_index);
  auto stream = static_cast<cudaStream_t>(p.stream);
  const int S = std::max(p.num_splits, 1);
  const std::string force = forced_kernel();
  const bool mma = force == "mma" || (force.empty() && mma_applies(p));  // as cuda_decode_select
  const int rows_per_cta = mma ? mma_rows_per_cta(p.rows_per_group(), p.head_dim) : kRows;
  const int64_t rb = row_blocks_of(p.heads_q, p.heads_kv, p.seqlen_q, rows_per_cta);
  const int64_t grid = p.batch * p.heads_kv * S * rb;
  if (grid == 0) return;
  if (grid > INT_MAX)
    throw Error("q", "ioattn: CUDA decode grid of " + std::to_string(grid) +
                         " CTAs (batch * heads_kv * splits * row blocks) exceeds 2^31 - 1; use fewer splits");
  const int64_t es = dtype_size(p.cache_dtype);

  DecodeParams dp{};
  dp.q = p.q;
  dp.o = p.o;
  dp.lse = p.lse;
  dp.q_sb = p.q_stride.batch, dp.q_ss = p.q_stride.seq, dp.q_sh = p.q_stride.head;
  dp.o_sb = p.o_stride.batch, dp.o_ss = p.o_stride.seq, dp.o_sh = p.o_stride.head;
  dp.l_sb = p.lse_stride.batch, dp.l_ss = p.lse_stride.seq, dp.l_sh = p.lse_stride.head;
  dp.dtype = p.dtype;
  dp.k = static_cast<const uint8_t*>(p.k_cache);
  dp.v = static_cast<const uint8_t*>(p.v_cache);
  dp.k_sp = p.k_stride.page * es, dp.k_ss = p.k_stride.slot * es, dp.k_sh = p.k_stride.head * es;
  dp.v_sp = p.v_stride.page * es, dp.v_ss = p.v_stride.slot * es, dp.v_sh = p.v_stride.head * es;
  dp.k_row_bytes = static_cast<int>(p.head_dim * es);
  dp.v_row_bytes = static_cast<int>(p.head_dim_v * es);
  dp.block_table = p.block_table;
  dp.bt_sb = p.bt_stride_batch, dp.bt_sp = p.bt_stride_page;
  dp.page_size = p.paged() ? static_cast<int>(p.page_size) : 0;
  dp.page_shift = -1;
  for (int sh = 0; sh < 31 && p.paged(); ++sh)
    if ((int64_t{1} << sh) == p.page_size) dp.page_shift = sh;
  dp.num_pages = p.num_pages;
  dp.seqlens = p.cache_seqlens;
  dp.bound = p.max_seqlen_k;
  dp.k_scale = p.k_scale;
  dp.v_scale = p.v_scale;
  dp.heads_q = static_cast<int>(p.heads_q);
  dp.heads_kv = static_cast<int>(p.heads_kv);
  dp.seqlen_q = static_cast<int>(p.seqlen_q);
  dp.group = static_cast<int>(p.group());
  dp.rows = static_cast<int>(p.rows_per_group());
  dp.row_blocks = static_cast<int>(rb);
  dp.splits = S;
  dp.d = static_cast<int>(p.head_dim);
  dp.dv = static_cast<int>(p.head_dim_v);
  dp.tx_log2 = tx_log2_for(std::max(p.head_dim, p.head_dim_v));
  dp.scale = p.scale;
  dp.softcap = p.softcap;
  dp.wl = p.window_left;
  dp.wr = p.window_right;
  dp.alibi = p.alibi_slopes;
  dp.sinks = p.sinks;

  // Partials: the caller's workspace (plan) or a stream-ordered allocation (capturable too).
  void* internal = nullptr;
  if (S > 1) {
    void* ws = p.workspace;
    const size_t need = cuda_decode_workspace_bytes(p.batch, p.heads_q, p.seqlen_q, p.head_dim_v, S);
    if (ws == nullptr) {
      IOATTN_CUDA_CHECK(cudaMallocAsync(&internal, need, stream));
      ws = internal;
    }
    const size_t rows = static_cast<size_t>(p.batch * p.heads_q * p.seqlen_q) * static_cast<size_t>(S);
    dp.part_o = static_cast<float*>(ws);
    dp.part_lse = reinterpret_cast<float*>(static_cast<uint8_t*>(ws) + align_up(rows * p.head_dim_v * 4));
  }

  if (S > 1 && p.batch * p.heads_q * p.seqlen_q > INT_MAX)
    throw Error("q", "ioattn: CUDA decode merge grid exceeds 2^31 - 1 blocks");
  // Decode's fused append (KVCache::k_new): only now, after every check and allocation above, so an
  // error never leaves the cache written; the decode grid (PDL) waits for it before reading.
  if (p.seqlen_new > 0) cuda_append_kv(fused_append_problem(p));

  const bool pdl = use_pdl(p.device_index);
  dp.early_trigger = S > 1 && early_trigger_on() ? 1 : 0;
  if (mma) {
    const bool bulk = use_bulk_loader(p, [&] { return detail::cuda_device_arch(p.device_index); });
    const int ring = mma_ring_of(p, bulk);
    launch_decode_mma(dp, p.cache_dtype, grid, stream, pdl, bulk, ring);
  } else {
    switch (p.cache_dtype) {
      case DType::bf16: launch_decode<__nv_bfloat16>(dp, grid, stream, pdl); break;
      case DType::f16: launch_decode<__half>(dp, grid, stream, pdl); break;
      case DType::f32: launch_decode<float>(dp, grid, stream, pdl); break;
      case DType::f8e4m3: launch_decode<E4m3>(dp, grid, stream, pdl); break;
      case DType::i8: launch_decode<int8_t>(dp, grid, stream, pdl); break;
      default: throw Error("cache.k_cache.dtype", "ioattn: no CUDA decode kernel for this cache dtype");
    }
  }

  if (S > 1) {
    MergeParams mp{};
    mp.part_o = dp.part_o;
    mp.part_lse = dp.part_lse;
    mp.o = p.o;
    mp.lse = p.lse;
    mp.o_sb = dp.o_sb, mp.o_ss = dp.o_ss, mp.o_sh = dp.o_sh;
    mp.l_sb = dp.l_sb, mp.l_ss = dp.l_ss, mp.l_sh = dp.l_sh;
    mp.dtype = p.dtype;
    mp.rows = p.batch * p.heads_q * p.seqlen_q;
    mp.heads_q = dp.heads_q;
    mp.seqlen_q = dp.seqlen_q;
    mp.splits = S;
    mp.dv = dp.dv;
    mp.sinks = p.sinks;
    const int64_t blocks = mp.rows;  // one CTA per query row (below 2^31: checked before any launch)
    // sm90+: programmatic dependent launch overlaps the merge grid's launch with the decode
    // grid's tail (IOATTN_DECODE_PDL=0 turns it off).
    launch_pdl(merge_splits_kernel, mp, blocks, kMergeWarps * 32, 0, stream, pdl);
  }
  if (internal) IOATTN_CUDA_CHECK(cudaFreeAsync(internal, stream));
}

}  // namespace ioattn::detail

// serving_decode.cuh — what the two CUDA decode kernels share (serving_decode.cu: fp32 FMA, any
// dtype; serving_decode_mma.cu: mma.sync, bf16/f16 q over 16-bit or 8-bit caches): the launch
// parameters, the work item of a CTA and its key range (decode_split_range on the device), and the
// end of a CTA: merging its key groups exactly and writing O / LSE or the split's partial; plus the
// FMA kernel's cp.async tile loader through the page table (the mma kernel has a leaner one of its
// own: (page, slot) per key prefetched into shared memory). The file comment of serving_decode.cu
// describes the algorithm.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "core/serving_problem.hpp"
#include "cuda/check.cuh"
#include "cuda/ptx.cuh"
#include "cuda/serving.cuh"

namespace ioattn::cuda::serving {

constexpr int kThreads = 128;  // 4 warps, both kernels
constexpr int kMaxDim = 256;   // head_dim, head_dim_v

struct DecodeParams {
  const void* q;
  void* o;
  float* lse;
  int64_t q_sb, q_ss, q_sh, o_sb, o_ss, o_sh, l_sb, l_ss, l_sh;  // elements
  DType dtype;

  const uint8_t* k;
  const uint8_t* v;
  int64_t k_sp, k_ss, k_sh, v_sp, v_ss, v_sh;  // bytes (page, slot, head)
  int k_row_bytes, v_row_bytes;                 // d * esize, dv * esize
  const int32_t* block_table;                   // null: contiguous (page = b, slot = t)
  int64_t bt_sb, bt_sp;
  int page_size;
  int page_shift;  // log2(page_size) when it is a power of two, else -1 (a division per row)
  int64_t num_pages;
  const int32_t* seqlens;
  int64_t bound;  // largest accepted cache_seqlens entry
  const float* k_scale;
  const float* v_scale;

  int heads_q, heads_kv, seqlen_q, group, rows, row_blocks, splits, d, dv, tx_log2;
  float scale, softcap;
  int64_t wl, wr;
  const float* alibi;
  const float* sinks;
  float* part_o;  // splits > 1
  float* part_lse;
  // 1 (splits > 1, unless IOATTN_DECODE_EARLY_TRIGGER=0): each CTA triggers the merge grid's
  // programmatic launch right after its own dependency wait instead of after its outputs, so the
  // merge CTAs are resident (waiting in cudaGridDependencySynchronize, which still waits for this
  // whole grid and its writes) when the last decode CTA ends. H200, session 18, graph replay, A-B
  // x3 in two calls: b1 x 4k bf16 +1.0 / +2.7%, f8e4m3 +6.8 / +7.7%; other cells -0.7..+0.7%.
  int early_trigger;
};

__device__ __forceinline__ float ninf() { return -INFINITY; }

// Scores live in log2 units inside the kernels (scaled by log2(e)), so every softmax exponential
// is one ex2.approx (2^-inf = 0: masked keys vanish); LSE leaves in natural log.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// problem.hpp's visible_keys, on the device.
__device__ __forceinline__ void vis_keys(int64_t i, int64_t sq, int64_t sk, int64_t wl, int64_t wr, int64_t* lo,
                                         int64_t* hi) {
  const int64_t diag = i + (sk - sq);
  const int64_t l = wl >= 0 ? diag - wl : 0;
  const int64_t h = wr >= 0 ? diag + wr + 1 : sk;
  *lo = l < 0 ? 0 : l;
  *hi = h > sk ? sk : h;
}

// detail::decode_split_range, on the device.
__device__ __forceinline__ void split_range(int64_t len, int64_t sq, int64_t wl, int64_t wr, int splits, int split,
                                            int64_t* k0, int64_t* k1) {
  *k0 = *k1 = 0;
  if (len <= 0) return;
  int64_t lo_first, hi_first, lo_last, hi_last;
  vis_keys(0, sq, len, wl, wr, &lo_first, &hi_first);
  vis_keys(sq - 1, sq, len, wl, wr, &lo_last, &hi_last);
  const int64_t span = hi_last - lo_first;
  if (span <= 0) return;
  // (32-bit division when it fits: a 64-bit one is a ~100-instruction subroutine call)
  int64_t chunk = span <= INT32_MAX - splits ? static_cast<int64_t>((static_cast<uint32_t>(span) + splits - 1) /
                                                                   static_cast<uint32_t>(splits))
                                             : (span + splits - 1) / splits;
  chunk = (chunk + detail::kSplitAlignTokens - 1) / detail::kSplitAlignTokens * detail::kSplitAlignTokens;
  *k0 = lo_first + split * chunk;
  *k1 = min(hi_last, *k0 + chunk);
}

// A CTA's work: blockIdx.x = ((b * heads_kv + hk) * splits + split) * row_blocks + rb (row blocks
// fastest: the CTAs that read one chunk run together and share it in L2), the sequence's length
// (an entry outside [0, bound] is "bad": length 0 and NaN outputs) and the split's key range.
struct WorkItem {
  int rb, split, hk;
  int64_t b, len, k0, k1;
  bool seq_bad;
  float k_scale, v_scale;  // the kv head's 8-bit cache scales (1 without them)
};

__device__ __forceinline__ WorkItem work_item(const DecodeParams& p) {
  // The CTA's indices first (kernel parameters only; 32-bit: the host keeps the grid below 2^31
  // CTAs, and 64-bit divisions are subroutine calls), so they overlap the wait below.
  WorkItem w;
  uint32_t id = blockIdx.x;
  w.rb = static_cast<int>(id % static_cast<uint32_t>(p.row_blocks));
  id /= static_cast<uint32_t>(p.row_blocks);
  w.split = static_cast<int>(id % static_cast<uint32_t>(p.splits));
  id /= static_cast<uint32_t>(p.splits);
  w.hk = static_cast<int>(id % static_cast<uint32_t>(p.heads_kv));
  w.b = id / static_cast<uint32_t>(p.heads_kv);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched with programmatic dependent launch (sm90+), the CTA may start while the previous
  // kernel of the stream (the last call's merge, an append_kv, the caller's own kernel) is still
  // running: wait here, before the first read of any input, until it has completed and its
  // writes are visible (a no-op when launched without PDL).
  cudaGridDependencySynchronize();
  if (p.early_trigger) cudaTriggerProgrammaticLaunchCompletion();
#endif
  // The 8-bit caches' scales load beside the length, not where they are used (after the mma
  // kernel's q setup, in the epilogue), so their latency overlaps the length's: f8e4m3 b1 x 4k
  // 13.66 -> 13.54 us per call (session 14; its ~3,800 extra cycles before the first tile, traced
  // against bf16, are mostly the q setup).
  w.k_scale = p.k_scale ? p.k_scale[w.hk] : 1.0f;
  w.v_scale = p.v_scale ? p.v_scale[w.hk] : 1.0f;
  const int64_t len = p.seqlens[w.b];
  w.seq_bad = len < 0 || len > p.bound;
  w.len = w.seq_bad ? 0 : len;
  split_range(w.len, p.seqlen_q, p.wl, p.wr, p.splits, w.split, &w.k0, &w.k1);
  return w;
}

// Issues the cp.async copies of one K tile and one V tile: keys [t0, t0 + kLoadIters * j_step),
// this thread's 16-byte chunk c of rows j = j0 + it * j_step, stored at
//   j * row_stride + ((c ^ ((j & swz_mask) << swz_shift)) << 4).
// Keys at or past khi, and bytes past the row (k_valid / v_valid), are zero-filled; nothing is
// read for them. A block-table entry outside [0, num_pages) sets pg_bad and zero-fills the key.
template <int kLoadIters>
__device__ __forceinline__ void issue_tile(const DecodeParams& p, const WorkItem& w, uint8_t* ks, uint8_t* vs,
                                           int64_t t0, int64_t khi, int c, int j0, int j_step, int row_stride,
                                           int swz_mask, int swz_shift, int k_valid, int v_valid, int& pg_bad) {
#pragma unroll
  for (int it = 0; it < kLoadIters; ++it) {
    const int j = j0 + it * j_step;
    const int64_t t = t0 + j;
    const int off = j * row_stride + ((c ^ ((j & swz_mask) << swz_shift)) << 4);
    const uint8_t* ksrc = p.k;
    const uint8_t* vsrc = p.v;
    int kb = 0, vb = 0;
    if (t < khi) {
      int64_t page, slot;
      if (p.block_table) {
        const int pi = p.page_shift >= 0 ? static_cast<int>(t) >> p.page_shift : static_cast<int>(t) / p.page_size;
        slot = t - static_cast<int64_t>(pi) * p.page_size;
        page = __ldg(p.block_table + w.b * p.bt_sb + pi * p.bt_sp);
        if (page < 0 || page >= p.num_pages) {
          pg_bad = 1;
          page = -1;
        }
      } else {
        page = w.b;
        slot = t;
      }
      if (page >= 0) {
        if (k_valid > 0) {
          ksrc = p.k + page * p.k_sp + slot * p.k_ss + w.hk * p.k_sh + c * 16;
          kb = k_valid;
        }
        if (v_valid > 0) {
          vsrc = p.v + page * p.v_sp + slot * p.v_ss + w.hk * p.v_sh + c * 16;
          vb = v_valid;
        }
      }
    }
    ptx::cp_async_16(ptx::smem_u32(ks + off), ksrc, kb);
    ptx::cp_async_16(ptx::smem_u32(vs + off), vsrc, vb);
  }
}

// Threads r < ROWS: the CTA's row r from its G key groups (each with max m_g and sum l_g in log2
// units, and a bad-row bit mask): M = max m_g, L = sum l_g 2^(m_g - M), bad = any | extra_bad.
template <int ROWS>
__device__ __forceinline__ void rows_from_groups(int G, const float* grp_m, const float* grp_l, const int* grp_bad,
                                                 int extra_bad, float* row_m, float* row_l, int* row_bad) {
  const int r = threadIdx.x;
  if (r >= ROWS) return;
  float M = ninf();
  for (int g = 0; g < G; ++g) M = fmaxf(M, grp_m[g * ROWS + r]);
  float L = 0.0f;
  int B = 0;
  for (int g = 0; g < G; ++g) {
    const float mg = grp_m[g * ROWS + r];
    if (mg > ninf()) L += grp_l[g * ROWS + r] * ptx::exp2_approx(mg - M);
    B |= (grp_bad[g] >> r) & 1;
  }
  row_m[r] = M;
  row_l[r] = L;
  row_bad[r] = B | extra_bad;
}

// The CTA's outputs. red = [G][ROWS][Dp] fp32: each group's O accumulator, already multiplied by
// 2^(m_g - M). Rows rb * ROWS + r < p.rows, columns x < dv: with one split, O and LSE (sinks
// joined here); with more, the split's partial (O normalised, LSE) in the workspace.
template <int ROWS>
__device__ __forceinline__ void write_outputs(const DecodeParams& p, const WorkItem& w, int G, int Dp,
                                              const float* red, const float* row_m, const float* row_l,
                                              const int* row_bad) {
  // One warp per row, lanes over the columns: the row's indices, LSE and scale once per row (a
  // loop over elements with divisions in it took ~4,500 cycles per CTA: trace, H200). Both
  // kernels run kThreads (whole warps).
  static_assert(kThreads % 32 == 0 && kThreads >= 32, "write_outputs: whole warps");
  const float v_scale = w.v_scale;
  const bool direct = p.splits == 1;
  const int sq = p.seqlen_q, lane = threadIdx.x & 31, nw = static_cast<int>(blockDim.x >> 5);
  for (int r = static_cast<int>(threadIdx.x >> 5); r < ROWS; r += nw) {
    const int rr = w.rb * ROWS + r;
    if (rr >= p.rows) break;  // (rows increase with r)
    const int hh = rr / sq, i = rr % sq, h = w.hk * p.group + hh;
    const float M = row_m[r], L = row_l[r];  // log2 units
    float mul = 0.0f, lse;  // out = sum * mul
    const bool bad = row_bad[r] != 0, empty = M == ninf();
    if (bad) {
      lse = NAN;
    } else if (empty) {  // no visible key (in this split): O = 0, LSE = -inf or the sink
      lse = (direct && p.sinks) ? p.sinks[h] : ninf();
    } else if (direct) {
      const float sink = p.sinks ? p.sinks[h] * kLog2e : ninf();
      const float mx = fmaxf(M, sink);
      const float a = ptx::exp2_approx(M - mx);
      const float lsum = L * a + (p.sinks ? ptx::exp2_approx(sink - mx) : 0.0f);
      mul = a * v_scale / lsum;
      lse = (mx + log2f(lsum)) * kLn2;
    } else {
      mul = v_scale / L;
      lse = (M + log2f(L)) * kLn2;
    }
    const int64_t at = ((w.b * p.heads_q + h) * sq + i) * p.splits + w.split;  // the split's partial row
    const int64_t o_row = w.b * p.o_sb + i * p.o_ss + h * p.o_sh;
    for (int x = lane; x < p.dv; x += 32) {
      float sum = 0.0f;
      for (int g = 0; g < G; ++g) sum += red[(g * ROWS + r) * Dp + x];
      const float out = bad ? NAN : empty ? 0.0f : sum * mul;
      if (direct)
        store_elem(p.o, p.dtype, o_row + x, out);
      else
        p.part_o[at * p.dv + x] = out;
    }
    if (lane == 0) {
      if (direct) {
        if (p.lse) p.lse[w.b * p.l_sb + h * p.l_sh + i * p.l_ss] = lse;
      } else {
        p.part_lse[at] = lse;
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch: the merge grid may start launching once every CTA got here (or
  // got past its dependency wait, with early_trigger); it reads the partials only after
  // cudaGridDependencySynchronize (this grid complete + flushed).
  if (!p.early_trigger) cudaTriggerProgrammaticLaunchCompletion();
#endif
}

// Launches `kernel(p)` on `grid` CTAs of `threads`, with programmatic stream serialization when
// `pdl` (sm90+: the CTAs may be scheduled before the previous kernel of the stream ends; the
// serving kernels wait for it in cudaGridDependencySynchronize before reading anything).
template <typename P>
void launch_pdl(void (*kernel)(P), const P& p, int64_t grid, int threads, int smem, cudaStream_t stream, bool pdl) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  IOATTN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

// Launches a decode kernel (grid x kThreads, `smem` dynamic bytes, PDL as launch_pdl). The
// kernel's dynamic shared-memory limit is raised once per device: `smem_set` (one per kernel) holds
// a bit per device index, so a call under CUDA-graph capture that follows an eager one makes no
// attribute call at all.
inline void launch_decode_grid(void (*kernel)(DecodeParams), std::atomic<uint64_t>& smem_set, const DecodeParams& p,
                               int64_t grid, int smem, cudaStream_t stream, bool pdl) {
  int dev = 0;
  IOATTN_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
  if (!bit || !(smem_set.load() & bit)) {
    IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    smem_set.fetch_or(bit);
  }
  launch_pdl(kernel, p, grid, kThreads, smem, stream, pdl);
}

// The mma.sync kernel (serving_decode_mma.cu): bf16/f16 q, a cache of the same dtype or 8-bit
// (f8e4m3 / i8 codes, converted to f16 in registers), head_dim == head_dim_v in
// {64, 128, 256}, every row of a CTA seeing the same keys (seqlen_q 1 or no causal/window mask).
bool mma_decode_supported(DType dtype, DType cache, int64_t d, int64_t dv, int64_t seqlen_q, bool masked);
// Query rows per CTA of the mma kernel: 8, or 16 when a kv head has more than 8 rows and
// head_dim <= 128 (the grid's row blocks follow it).
int mma_rows_per_cta(int64_t rows_per_group, int64_t head_dim);
// ring: mma_decode_stages' answer for the call (16-bit caches at head_dim 128 have rings of 2, 3 and
// 5 stages; the other instances one each).
void launch_decode_mma(const DecodeParams& p, DType cache, int64_t grid, cudaStream_t stream, bool pdl, bool bulk,
                       int ring);
// The mma kernel's ring depth (from its MmaTraits): 4 / 3 / 2 stages at head_dim 64 / 128 / 256 for
// 16-bit caches, 4 / 4 / 3 for 8-bit ones (bulk: its own 3 stages). 16-bit caches at head_dim 128
// with the cp.async loader take a 2-stage ring (68 KiB: 3 CTAs per SM) when the call is a few
// short sequences: work (batch * heads_kv * row blocks) <= 8 and max_seqlen_k <= 4096, where a CTA
// reads a few tiles and its fixed costs (prologue, first-tile latency, epilogue) dominate, so a
// third CTA per SM overlaps them (H200, b1 x 4k: 1.40 vs 1.30 TB/s; at 32k 3.19 vs 3.26: not
// there). IOATTN_DECODE_STAGES=2 / 3 / 5 forces a depth for those caches (5: one CTA per SM
// with 4 tiles in flight; measured no faster).
int mma_decode_stages(DType cache, int64_t head_dim, bool bulk, int64_t work, int64_t max_seqlen_k);
// The mma kernel's bulk-copy loader (IOATTN_DECODE_LOADER=bulk): sm_90, bf16/f16 q and cache, head_dim 128.
bool mma_bulk_supported(DType dtype, DType cache, int64_t d, int arch);

}  // namespace ioattn::cuda::serving

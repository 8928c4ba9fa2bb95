// serving_ops.cu — append_kv (scatter new tokens into the cache by slot, quantising for 8-bit
// caches) and merge_states (exact LSE merge of two partial attention states) on CUDA.
//
// Both are element-wise and touch each byte once: one warp per (token, kv head) row or per
// (batch, seq, head) row, lanes over head_dim. Semantics as the CPU (src/cpu/serving_cpu.cpp):
//   append_kv: negative slot = padding (skipped); 8-bit: stored = encode(value / scale) with the
//     host's encoders (serving.cuh), so the cache bytes equal the CPU's. Validation cannot read a
//     device slot_mapping (CUDA-graph capture): a slot >= pages * page_size is skipped too, and two
//     tokens on one slot leave either (the CPU rejects both). Lengths mode (decode's fused append,
//     AppendProblem::seqlen_new > 0): each token's slot from cache_seqlens and the block table on
//     the device, skipped where the length, the position or the page is out of range.
//   merge_states: empty rows (-inf + -inf) give O = 0 and LSE = -inf; a NaN LSE poisons the row; a
//     side with weight 0 is never read; every input of a row is read before it is written (the
//     outputs may alias the inputs).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "core/serving_problem.hpp"
#include "cuda/check.cuh"
#include "cuda/serving.cuh"

namespace ioattn::cuda::serving {
namespace {

constexpr int kWarps = 4;

struct AppendParams {
  const void* k_new;
  const void* v_new;
  int64_t kn_st, kn_sh, vn_st, vn_sh;  // elements
  DType new_dtype;
  const void* slots;
  bool slot_i64;
  int64_t slot_stride;
  void* k_cache;
  void* v_cache;
  int64_t k_sp, k_ss, k_sh, v_sp, v_ss, v_sh;  // elements
  DType cache_dtype;
  int64_t page_size, num_slots;
  const float* k_scale;
  const float* v_scale;
  int64_t tokens;
  int heads_kv, d, dv;
  // lengths mode (seqlens non-null): see AppendProblem
  const int32_t* seqlens;
  const int32_t* block_table;
  int64_t bt_sb, bt_sp, seqlen_new, capacity, num_pages, kn_sb, vn_sb;
};

__device__ __forceinline__ void store_cache(void* base, DType t, int64_t idx, float x, float scale) {
  switch (t) {
    case DType::f8e4m3: static_cast<uint8_t*>(base)[idx] = encode_e4m3(x / scale); break;
    case DType::i8: static_cast<int8_t*>(base)[idx] = encode_i8(x / scale); break;
    default: store_elem(base, t, idx, x); break;
  }
}

__global__ void __launch_bounds__(kWarps * 32) append_kernel(const AppendParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A decode grid launched next with programmatic dependent launch (sm90: every decode launch) may
  // be scheduled now; it reads nothing before cudaGridDependencySynchronize, which waits for this
  // grid to complete and its stores to be visible. So the decode's launch overlaps the append.
  cudaTriggerProgrammaticLaunchCompletion();
#endif
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);  // token * heads_kv + hk
  if (row >= p.tokens * p.heads_kv) return;
  const int64_t t = row / p.heads_kv;
  const int hk = static_cast<int>(row % p.heads_kv);
  int64_t page, off, ksrc, vsrc;
  if (p.seqlens != nullptr) {  // lengths mode: token i of sequence b at position len - seqlen_new + i
    const int64_t b = t / p.seqlen_new, i = t % p.seqlen_new;
    const int64_t s = detail::fused_append_slot(b, i, p.seqlens[b], p.seqlen_new, p.capacity, p.block_table, p.bt_sb,
                                                p.bt_sp, p.page_size, p.num_pages);
    if (s < 0) return;
    page = s / p.page_size, off = s % p.page_size;
    ksrc = b * p.kn_sb + i * p.kn_st + hk * p.kn_sh, vsrc = b * p.vn_sb + i * p.vn_st + hk * p.vn_sh;
  } else {
    const int64_t s = p.slot_i64 ? static_cast<const int64_t*>(p.slots)[t * p.slot_stride]
                                 : static_cast<const int32_t*>(p.slots)[t * p.slot_stride];
    if (s < 0 || s >= p.num_slots) return;  // padding (or out of range: skipped, see the file comment)
    page = s / p.page_size, off = s % p.page_size;
    ksrc = t * p.kn_st + hk * p.kn_sh, vsrc = t * p.vn_st + hk * p.vn_sh;
  }
  const int64_t kdst = page * p.k_sp + off * p.k_ss + hk * p.k_sh;
  const int64_t vdst = page * p.v_sp + off * p.v_ss + hk * p.v_sh;
  const float ks = p.k_scale ? p.k_scale[hk] : 1.0f, vs = p.v_scale ? p.v_scale[hk] : 1.0f;
  for (int x = lane; x < p.d; x += 32)
    store_cache(p.k_cache, p.cache_dtype, kdst + x, load_elem(p.k_new, p.new_dtype, ksrc + x), ks);
  for (int x = lane; x < p.dv; x += 32)
    store_cache(p.v_cache, p.cache_dtype, vdst + x, load_elem(p.v_new, p.new_dtype, vsrc + x), vs);
}

struct MergeStatesParams {
  const void* o_a;
  const void* o_b;
  void* o_out;
  const float* lse_a;
  const float* lse_b;
  float* lse_out;
  detail::Strides3 oa, ob, oo, la, lb, lo;
  DType ta, tb, tout;
  int64_t batch, seqlen, heads;
  int d;
};

__global__ void __launch_bounds__(kWarps * 32) merge_states_kernel(const MergeStatesParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);  // (b, s, h), h fastest
  if (row >= p.batch * p.seqlen * p.heads) return;
  const int64_t bs = row / p.heads, h = row - bs * p.heads, b = bs / p.seqlen, s = bs - b * p.seqlen;
  const float la = p.lse_a[b * p.la.batch + h * p.la.head + s * p.la.seq];
  const float lb = p.lse_b[b * p.lb.batch + h * p.lb.head + s * p.lb.seq];
  const int64_t oa = b * p.oa.batch + s * p.oa.seq + h * p.oa.head;
  const int64_t ob = b * p.ob.batch + s * p.ob.seq + h * p.ob.head;
  const int64_t oo = b * p.oo.batch + s * p.oo.seq + h * p.oo.head;
  float ca = 0.0f, cb = 0.0f, lse;
  int mode;  // 0: NaN row, 1: empty row, 2: merge
  if (isnan(la) || isnan(lb)) {
    mode = 0;
    lse = NAN;
  } else {
    const float mx = fmaxf(la, lb);
    if (mx == -INFINITY) {
      mode = 1;
      lse = mx;
    } else {
      const float wa = expf(la - mx), wb = expf(lb - mx);  // -inf -> 0
      const float tot = wa + wb;
      ca = wa / tot;
      cb = wb / tot;
      mode = 2;
      lse = mx + logf(tot);
    }
  }
  // Element x is read and written by the same lane, so an aliased O is safe element by element.
  for (int x = lane; x < p.d; x += 32) {
    float v;
    if (mode == 0) {
      v = NAN;
    } else if (mode == 1) {
      v = 0.0f;
    } else {
      v = 0.0f;
      if (ca != 0.0f) v += ca * load_elem(p.o_a, p.ta, oa + x);
      if (cb != 0.0f) v += cb * load_elem(p.o_b, p.tb, ob + x);
    }
    store_elem(p.o_out, p.tout, oo + x, v);
  }
  // Every lane has read lse_a / lse_b before lane 0 overwrites them (lse_out may alias one).
  __syncwarp();
  if (lane == 0 && p.lse_out) p.lse_out[b * p.lo.batch + h * p.lo.head + s * p.lo.seq] = lse;
}

int64_t blocks_for(int64_t rows) { return (rows + kWarps - 1) / kWarps; }

void check_grid(int64_t blocks, const char* what) {
  if (blocks > INT_MAX)
    throw Error("cuda", std::string("ioattn: ") + what + ": " + std::to_string(blocks) +
                            " blocks exceed the grid limit 2^31 - 1");
}

}  // namespace
}  // namespace ioattn::cuda::serving

namespace ioattn::detail {

using namespace ioattn::cuda::serving;

void cuda_append_kv(const AppendProblem& p) {
  if (p.tokens == 0 || p.heads_kv == 0) return;
  cuda::DeviceGuard guard(p.device_index);
  AppendParams a{};
  a.k_new = p.k_new;
  a.v_new = p.v_new;
  a.kn_st = p.k_new_stride_token, a.kn_sh = p.k_new_stride_head;
  a.vn_st = p.v_new_stride_token, a.vn_sh = p.v_new_stride_head;
  a.new_dtype = p.new_dtype;
  a.slots = p.slot_mapping;
  a.slot_i64 = p.slot_i64;
  a.slot_stride = p.slot_stride;
  a.k_cache = p.k_cache;
  a.v_cache = p.v_cache;
  a.k_sp = p.k_stride.page, a.k_ss = p.k_stride.slot, a.k_sh = p.k_stride.head;
  a.v_sp = p.v_stride.page, a.v_ss = p.v_stride.slot, a.v_sh = p.v_stride.head;
  a.cache_dtype = p.cache_dtype;
  a.page_size = std::max<int64_t>(p.page_size, 1);
  a.num_slots = p.num_slots;
  a.k_scale = p.k_scale;
  a.v_scale = p.v_scale;
  a.tokens = p.tokens;
  a.heads_kv = static_cast<int>(p.heads_kv);
  a.d = static_cast<int>(p.head_dim);
  a.dv = static_cast<int>(p.head_dim_v);
  if (p.seqlen_new > 0) {
    a.seqlens = p.seqlens;
    a.block_table = p.block_table;
    a.bt_sb = p.bt_stride_batch, a.bt_sp = p.bt_stride_page;
    a.seqlen_new = p.seqlen_new, a.capacity = p.capacity, a.num_pages = p.num_pages;
    a.kn_sb = p.k_new_stride_batch, a.vn_sb = p.v_new_stride_batch;
  }
  const int64_t blocks = blocks_for(p.tokens * p.heads_kv);
  check_grid(blocks, "append_kv");
  append_kernel<<<static_cast<unsigned>(blocks), kWarps * 32, 0, static_cast<cudaStream_t>(p.stream)>>>(a);
  IOATTN_CUDA_CHECK_LAUNCH("append_kernel");
}

void cuda_merge_states(const MergeProblem& p) {
  const int64_t rows = p.batch * p.seqlen * p.heads;
  if (rows == 0) return;
  cuda::DeviceGuard guard(p.device_index);
  MergeStatesParams m{};
  m.o_a = p.o_a;
  m.o_b = p.o_b;
  m.o_out = p.o_out;
  m.lse_a = p.lse_a;
  m.lse_b = p.lse_b;
  m.lse_out = p.lse_out;
  m.oa = p.oa_stride, m.ob = p.ob_stride, m.oo = p.oo_stride;
  m.la = p.la_stride, m.lb = p.lb_stride, m.lo = p.lo_stride;
  m.ta = p.dtype, m.tb = p.dtype_b, m.tout = p.dtype_out;
  m.batch = p.batch, m.seqlen = p.seqlen, m.heads = p.heads;
  m.d = static_cast<int>(p.head_dim);
  const int64_t blocks = blocks_for(rows);
  check_grid(blocks, "merge_states");
  merge_states_kernel<<<static_cast<unsigned>(blocks), kWarps * 32, 0, static_cast<cudaStream_t>(p.stream)>>>(m);
  IOATTN_CUDA_CHECK_LAUNCH("merge_states_kernel");
}

}  // namespace ioattn::detail

// Internal: the validated, normalised serving problems (decode, append_kv, merge_states) that
// every backend receives, plus the backend entry points and the split / workspace arithmetic
// that plan_decode() and the backends must agree on.
//
// Validation (serving_api.cpp) turns the public views into these structs once; backends never
// re-check arguments. All offsets are int64 and in elements.
//
// KV cache addressing, one rule for paged and contiguous caches: token t of sequence b lives at
//   page = block_table ? block_table[b * bt_stride_batch + (t / page_size) * bt_stride_page] : b
//   elem = page * cache_stride.page + (t % page_size) * cache_stride.slot + hk * cache_stride.head
// A contiguous cache [batch, max_seqlen, hkv, d] is the special case page_size = max_seqlen,
// one page per sequence.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/backends.hpp"
#include "core/problem.hpp"
#include "ioattn/ioattn.hpp"
#include "ioattn/serving.hpp"

namespace ioattn::detail {

struct CacheStrides {
  int64_t page = 0, slot = 0, head = 0;  // elements
};

inline bool is_8bit(DType t) { return t == DType::f8e4m3 || t == DType::i8; }

#if defined(__CUDACC__)
#define IOATTN_HOST_DEVICE __host__ __device__
#else
#define IOATTN_HOST_DEVICE
#endif

// The fused append's slot rule (append_kv's lengths mode), one definition for the host
// (AppendProblem::lengths_slot) and the CUDA append kernel: new token i of sequence b (of seqlen_new)
// goes to position len - seqlen_new + i; it is skipped (-1) when len is outside 1..capacity, the
// position is negative, or its page is outside 0..num_pages-1 (contiguous caches: page b).
IOATTN_HOST_DEVICE inline int64_t fused_append_slot(int64_t b, int64_t i, int64_t len, int64_t seqlen_new,
                                                    int64_t capacity, const int32_t* block_table,
                                                    int64_t bt_stride_batch, int64_t bt_stride_page,
                                                    int64_t page_size, int64_t num_pages) {
  const int64_t pos = len - seqlen_new + i;
  if (len <= 0 || len > capacity || pos < 0) return -1;
  const int64_t page = block_table ? block_table[b * bt_stride_batch + (pos / page_size) * bt_stride_page] : b;
  if (page < 0 || page >= num_pages) return -1;
  return page * page_size + pos % page_size;
}

// ---- decode ------------------------------------------------------------------------------

struct DecodeProblem {
  // Queries and outputs: q [batch, seqlen_q, heads_q, d], o [batch, seqlen_q, heads_q, dv],
  // lse f32 [batch, heads_q, seqlen_q] (optional). Strides3 = (batch, seq, head).
  const void* q = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  Strides3 q_stride, o_stride, lse_stride;
  DType dtype = DType::f32;  // of q and o

  // Cache. k_scale / v_scale are per kv head, non-null exactly for 8-bit caches.
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  CacheStrides k_stride, v_stride;
  DType cache_dtype = DType::f32;
  int64_t page_size = 0;               // tokens per page; contiguous: max_seqlen
  int64_t num_pages = 0;               // pages in the cache; contiguous: batch
  const int32_t* block_table = nullptr;  // on `device`; null = contiguous cache
  int64_t bt_stride_batch = 0, bt_stride_page = 0;
  int64_t max_pages_per_seq = 0;       // contiguous: 1
  const int32_t* cache_seqlens = nullptr;       // on `device`, [batch]
  const int32_t* cache_seqlens_host = nullptr;  // host copy (CPU tensors: the same pointer)
  const float* k_scale = nullptr;      // on `device`, [heads_kv]
  const float* v_scale = nullptr;

  int64_t batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, head_dim = 0, head_dim_v = 0;
  int64_t max_seqlen_k = 0;  // upper bound of cache_seqlens the split partition is sized for

  // Masks and score modifiers, as in FwdProblem (causal sets window_right = 0).
  float scale = 1.0f;
  float softcap = 0.0f;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  const float* alibi_slopes = nullptr;  // on `device`, [heads_q]
  const float* sinks = nullptr;         // on `device`, [heads_q]; added once, at the merge

  // Fused append (KVCache::k_new / v_new; seqlen_new 0 = none): [batch, seqlen_new, heads_kv,
  // d / dv] in `dtype`, written first by fused_append() (serving_api.cpp) through the backend's
  // append_kv in its lengths mode.
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  Strides3 k_new_stride, v_new_stride;
  int64_t seqlen_new = 0;
  int64_t capacity = 0;  // tokens a sequence can hold (block_table.shape[1] * page_size or max_seqlen)

  // Split-KV and the caller's (or the internal) workspace, laid out by decode_layout().
  int num_splits = 1;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Set by the backend from the workspace (num_splits > 1): [batch, heads_q, seqlen_q, splits, dv]
  // and [batch, heads_q, seqlen_q, splits], fp32.
  float* partial_o = nullptr;
  float* partial_lse = nullptr;

  Device device = Device::cpu;
  int device_index = 0;
  void* stream = nullptr;
  int num_threads = 0;  // CPU threads to use; the backend caps it by the workspace's scratch slots

  bool paged() const { return block_table != nullptr; }
  int64_t group() const { return heads_q / heads_kv; }
  int64_t rows_per_group() const { return group() * seqlen_q; }  // query rows sharing one kv head
};

// ---- workspace layout --------------------------------------------------------------------
//
//   [o_offset,  +o_bytes)        partial O   fp32 [batch, heads_q, seqlen_q, splits, dv]
//   [lse_offset, +lse_bytes)     partial LSE fp32 [batch, heads_q, seqlen_q, splits]
//   [scratch_offset, +threads * scratch_bytes_per_thread)   CPU per-thread tiles (see
//                                serving_cpu.cpp); none on CUDA
// With one split there are no partials: the chunk task writes O and LSE directly.
// Offsets are multiples of kWorkspaceAlign; the workspace pointer must be kWorkspaceAlign-aligned.
constexpr size_t kWorkspaceAlign = 64;
constexpr int kMaxSplits = 128;

struct DecodeLayout {
  size_t o_offset = 0, lse_offset = 0, scratch_offset = 0;
  size_t scratch_bytes_per_thread = 0;
  int scratch_threads = 0;
  size_t total_bytes = 0;
};

// The CPU layout for `threads` scratch slots.
DecodeLayout cpu_decode_layout(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seqlen_q,
                               int64_t head_dim, int64_t head_dim_v, int num_splits, int threads);
// Recovers the scratch slot count from a plan's workspace_bytes (the inverse of the above).
DecodeLayout cpu_decode_layout_for_bytes(int64_t batch, int64_t heads_q, int64_t heads_kv,
                                         int64_t seqlen_q, int64_t head_dim, int64_t head_dim_v,
                                         int num_splits, size_t workspace_bytes);

// The CPU split heuristic (documented at its definition); `why` receives the reasoning for the log.
int cpu_decode_num_splits(int64_t batch, int64_t heads_kv, int64_t max_seqlen_k, int threads,
                          std::string* why);

// Key range [k0, k1) of split s of sequence b (len tokens), shared by the chunk tasks and the
// merge: the union of the visible keys of the sequence's query rows, cut into num_splits chunks
// of equal length (a multiple of kSplitAlignTokens). k1 <= k0 means the split is empty.
constexpr int64_t kSplitAlignTokens = 16;
void decode_split_range(const DecodeProblem& p, int64_t len, int split, int64_t* k0, int64_t* k1);

// ---- append_kv ---------------------------------------------------------------------------

struct AppendProblem {
  const void* k_new = nullptr;  // [tokens, heads_kv, d]
  const void* v_new = nullptr;  // [tokens, heads_kv, dv]
  int64_t k_new_stride_token = 0, k_new_stride_head = 0;
  int64_t v_new_stride_token = 0, v_new_stride_head = 0;
  DType new_dtype = DType::f32;
  // i32 or i64 [tokens]
  const void* slot_mapping = nullptr;       // on `device`
  const void* slot_mapping_host = nullptr;  // host copy (CPU: the same pointer)
  bool slot_i64 = false;
  int64_t slot_stride = 1;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  CacheStrides k_stride, v_stride;
  DType cache_dtype = DType::f32;
  int64_t page_size = 0, num_slots = 0;  // slot = page * page_size + offset, < num_slots
  // Lengths mode (decode's fused append; seqlen_new > 0, slot_mapping null): token t = b *
  // seqlen_new + i (k_new [batch, seqlen_new, heads_kv, d], batch stride k_new_stride_batch) goes to
  // position pos = seqlens[b] - seqlen_new + i of sequence b, page block_table[b][pos / page_size]
  // (contiguous: page b), offset pos % page_size. Skipped: a length of 0 or above capacity, pos < 0,
  // a page outside 0..num_pages-1 (the CPU has checked all of them on the host already).
  int64_t seqlen_new = 0, capacity = 0, num_pages = 0;
  const int32_t* seqlens = nullptr;      // on `device`
  const int32_t* block_table = nullptr;  // on `device`; null = contiguous
  int64_t bt_stride_batch = 0, bt_stride_page = 0;
  int64_t k_new_stride_batch = 0, v_new_stride_batch = 0;
  const float* k_scale = nullptr;         // 8-bit caches: stored = quantise(value / scale)
  const float* v_scale = nullptr;
  int64_t tokens = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  Device device = Device::cpu;
  int device_index = 0;
  void* stream = nullptr;
  int num_threads = 0;

  // (slot mode only; lengths mode: lengths_slot())
  int64_t slot(int64_t t) const {
    return slot_i64 ? static_cast<const int64_t*>(slot_mapping_host)[t * slot_stride]
                    : static_cast<const int32_t*>(slot_mapping_host)[t * slot_stride];
  }
  // Lengths mode on host memory (CPU): token t's slot, or -1 when skipped (fused_append_slot).
  int64_t lengths_slot(int64_t t) const {
    const int64_t b = t / seqlen_new;
    return fused_append_slot(b, t % seqlen_new, seqlens[b], seqlen_new, capacity, block_table, bt_stride_batch,
                             bt_stride_page, page_size, num_pages);
  }
  // Element offsets of token t's row of kv head hk in k_new / v_new (either mode).
  int64_t k_src(int64_t t, int64_t hk) const {
    return seqlen_new > 0 ? (t / seqlen_new) * k_new_stride_batch + (t % seqlen_new) * k_new_stride_token +
                                hk * k_new_stride_head
                          : t * k_new_stride_token + hk * k_new_stride_head;
  }
  int64_t v_src(int64_t t, int64_t hk) const {
    return seqlen_new > 0 ? (t / seqlen_new) * v_new_stride_batch + (t % seqlen_new) * v_new_stride_token +
                                hk * v_new_stride_head
                          : t * v_new_stride_token + hk * v_new_stride_head;
  }
};

// Decode's fused append (p.seqlen_new > 0) as an append_kv problem in lengths mode (serving_api.cpp);
// the backends run it before the decode (CUDA: inside cuda_decode, after its checks and
// allocations, so an error never leaves the cache written).
AppendProblem fused_append_problem(const DecodeProblem& p);

// Validation of append_kv's arguments (serving_api.cpp), exposed for tests of the backend.
AppendProblem validate_append(const TensorView& k_new, const TensorView& v_new, const TensorView& slot_mapping,
                              const KVCache& cache, const Context& ctx);

// ---- merge_states ------------------------------------------------------------------------

struct MergeProblem {
  const void* o_a = nullptr;  // [batch, seqlen, heads, d]
  const void* o_b = nullptr;
  void* o_out = nullptr;
  const float* lse_a = nullptr;  // [batch, heads, seqlen]
  const float* lse_b = nullptr;
  float* lse_out = nullptr;      // optional
  Strides3 oa_stride, ob_stride, oo_stride, la_stride, lb_stride, lo_stride;  // (batch, seq, head)
  DType dtype = DType::f32;      // of o_a
  DType dtype_b = DType::f32;    // of o_b (may differ: e.g. an fp32 accumulator + a bf16 partial)
  DType dtype_out = DType::f32;  // of o_out
  int64_t batch = 0, seqlen = 0, heads = 0, head_dim = 0;
  Device device = Device::cpu;
  int device_index = 0;
  void* stream = nullptr;
  int num_threads = 0;
};

// ---- backend entry points ----------------------------------------------------------------

// CPU (src/cpu/serving_cpu.cpp).
void cpu_decode(const DecodeProblem& p);  // p.workspace laid out by cpu_decode_layout*
void cpu_append_kv(const AppendProblem& p);
void cpu_merge_states(const MergeProblem& p);

// CUDA (src/cuda/serving_decode.cu, serving_ops.cu; stubs in core/cuda_stubs.cpp without CUDA).
// On CUDA, cache_seqlens / block_table / slot_mapping / scales stay on the device (validation
// does not read them: CUDA-graph capture); the kernels bound-check instead (see serving_decode.cu).
// The decode kernel's row for this problem, or an empty name and why none fits.
CudaSelection cuda_decode_select(const DecodeProblem& p, int arch);
// The CUDA split heuristic (documented at its definition) for the SM count of device_index; the
// cache's dtype, head_dim and layout (paged or contiguous) pick how many CTAs an SM holds and
// whether one CTA per SM already reads at the SM's share of the bandwidth.
int cuda_decode_num_splits(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seqlen_q,
                           int64_t max_seqlen_k, DType cache_dtype, int64_t head_dim, int64_t head_dim_v,
                           bool paged, int device_index, std::string* why);
// CUDA workspace: partial O fp32 [batch, heads_q, seqlen_q, splits, dv] at offset 0, partial LSE
// fp32 [batch, heads_q, seqlen_q, splits] at the next kWorkspaceAlign boundary; 0 bytes for one split.
size_t cuda_decode_workspace_bytes(int64_t batch, int64_t heads_q, int64_t seqlen_q, int64_t head_dim_v,
                                   int num_splits);
// p.max_seqlen_k is the device-side bound of cache_seqlens; p.workspace null = allocate on the
// stream (cudaMallocAsync) for this call.
void cuda_decode(const DecodeProblem& p);
void cuda_append_kv(const AppendProblem& p);
void cuda_merge_states(const MergeProblem& p);

}  // namespace ioattn::detail

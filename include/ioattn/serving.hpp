// ioattn serving API: decode against a (paged) KV cache with split-KV, appending to the cache,
// merging partial attention states, and a plan/run split for CUDA-graph capture.
//
// KV cache layout: k_cache / v_cache are [num_pages, page_size, heads_kv, head_dim] (strided,
// unit last-dim stride); sequence b's token t lives at page block_table[b][t / page_size], slot
// t % page_size. Without a block table the cache is contiguous: [batch, max_seqlen, heads_kv,
// head_dim] and sequence b's token t is k_cache[b][t]. cache_seqlens[b] tokens are valid.
// 8-bit caches (f8e4m3 or i8) carry per-kv-head f32 scales: value = stored * scale.
//
// Queries: q [batch, seqlen_q, heads_q, head_dim] with seqlen_q in 1..16 (speculative / multi-
// token decode: the split-KV decode) — or any seqlen_q: more than 16 rows (a prefill or a long
// chunk against the cache) run the tiled flash forward reading K / V through the cache's layout
// ("cpu/flash cache-prefill"; on CUDA "cuda/flash cache-prefill", the mma.sync forward for f16 /
// bf16 q with head_dim == head_dim_v <= 256, else an error naming q; as the forward's tensor-core
// kernel, it multiplies masked keys of a loaded block by P = 0, so an inf / NaN in the V row of a
// token a row must not see can still reach that row, where the CPU and the decode kernels skip
// it). Plans (plan_decode) are for 1..16 rows. Query row i of sequence b sits at
// position cache_seqlens[b] - seqlen_q + i, so causal masking is bottom-right aligned as in the
// forward. o like q (head_dim_v), lse f32 [batch, heads_q, seqlen_q].
//
// Checks of the cache's values. CPU tensors: decode() reads cache_seqlens and the block-table
// entries a sequence uses on the host and throws ioattn::Error naming the entry (a length outside
// 0..capacity, a nonzero length below seqlen_q, a page outside 0..pages-1). CUDA tensors are not
// read on the host (no device -> host copy: the call stays CUDA-graph capturable), so the kernels
// check them instead and poison rather than throw: a sequence whose cache_seqlens entry is outside
// 0..bound (bound = the capacity, block_table.shape[1] * page_size or max_seqlen, and under a plan
// at most plan.max_seqlen_k), or whose block table names a page outside 0..pages-1 among the
// pages its length covers, gets O = NaN and LSE = NaN for all its rows; other sequences are
// unaffected and nothing outside the cache is read. A CUDA length below seqlen_q is not rejected;
// its rows are computed by the position formula above (rows before position 0 see no key under a
// causal mask: O = 0, LSE = -inf). append_kv on CUDA skips a slot outside 0..num_slots-1, as it
// skips a negative one.
#pragma once

#include "ioattn/ioattn.hpp"

namespace ioattn {

struct KVCache {
  TensorView k_cache, v_cache;  // [pages, page_size, hkv, d] or contiguous [batch, max_seqlen, hkv, d]
  TensorView block_table;       // optional i32 [batch, max_pages_per_seq]; undefined = contiguous
  TensorView cache_seqlens;     // i32 [batch]
  TensorView k_scale, v_scale;  // f32 [heads_kv], required for 8-bit caches, else undefined
  // decode() only, optional: append fused into the call. New tokens k_new / v_new [batch,
  // seqlen_new, heads_kv, head_dim(_v)] in q's dtype are written into the cache before the
  // attention reads it, token i of sequence b at position cache_seqlens[b] - seqlen_new + i
  // (cache_seqlens counts them, as it counts the queries' tokens; typically seqlen_new = seqlen_q)
  // — what append_kv with those slots followed by decode computes, in one call, quantised the
  // same way for 8-bit caches. A sequence of length 0 (an empty batch slot) appends nothing. CPU:
  // a nonzero length below seqlen_new, or two new tokens on one cache slot (a block table naming a
  // page twice), is an error (nothing written); CUDA: a token whose position would be negative or
  // whose page is out of range is skipped, a sequence whose length is out of range appends nothing
  // (its decode rows are NaN as usual), and two tokens on one slot leave either. On CUDA the
  // append kernel and then the decode kernel run on ctx.stream (CUDA-graph capturable, under a
  // plan too).
  TensorView k_new, v_new;
};

struct DecodeOptions {
  int num_splits = 0;  // KV chunks per (sequence, kv head) processed in parallel; 0 = heuristic
  // plan_decode only: the dtype of the cache the plan will run on, a hint for the CUDA split
  // heuristic (8-bit caches want more CTAs than 16-bit ones). Any cache runs under the plan;
  // decode() without a plan uses the cache's own dtype.
  DType cache_dtype = DType::bf16;
};

// A plan fixes the split counts and the work partition for one batch shape; run with it as
// often as the shape repeats (CUDA-graph capturable: no allocation, fixed grid). A decode call
// with a plan whose shape differs fails loudly.
struct DecodePlan {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0, seqlen_q = 0;
  int64_t max_seqlen_k = 0, page_size = 0;
  int num_splits = 0;
  size_t workspace_bytes = 0;  // caller-owned workspace, on the device of q
  Device device = Device::cpu;
  uint64_t fingerprint = 0;    // of everything above, checked on every run
};

DecodePlan plan_decode(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t head_dim,
                       int64_t head_dim_v, int64_t seqlen_q, int64_t max_seqlen_k, int64_t page_size,
                       Device device, const DecodeOptions& opt = {}, int device_index = 0);

// Decode with an internal workspace (allocated per call).
KernelChoice decode(const TensorView& q, const KVCache& cache, const TensorView& o,
                    const TensorView& lse, const AttnParams& params, const DecodeOptions& opt = {},
                    const Context& ctx = {});
// Decode under a plan with a caller-owned workspace of plan.workspace_bytes.
KernelChoice decode(const TensorView& q, const KVCache& cache, const TensorView& o,
                    const TensorView& lse, const AttnParams& params, const DecodePlan& plan,
                    void* workspace, const Context& ctx = {});

// Writes new tokens into the cache: k_new/v_new [tokens, heads_kv, head_dim] in the compute
// dtype; slot_mapping i32 or i64 [tokens], slot = page * page_size + offset (contiguous cache:
// batch * max_seqlen + position); a negative slot is padding and is skipped. 8-bit caches
// quantise with the cache's scales.
KernelChoice append_kv(const TensorView& k_new, const TensorView& v_new, const TensorView& slot_mapping,
                       const KVCache& cache, const Context& ctx = {});

// Merges two partial attention states over disjoint key sets:
//   lse = log(exp(lse_a) + exp(lse_b)), o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)
// o_* [batch, seqlen, heads, head_dim] (dtype f32/f16/bf16), lse_* f32 [batch, heads, seqlen].
// Empty rows (-inf + -inf) give o = 0 and lse = -inf. Outputs may alias either input.
KernelChoice merge_states(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
                          const TensorView& lse_b, const TensorView& o_out, const TensorView& lse_out,
                          const Context& ctx = {});

}  // namespace ioattn

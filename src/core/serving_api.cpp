// Validation + dispatch for the serving API (include/ioattn/serving.hpp): decode, plan_decode,
// append_kv, merge_states.
//
// As in api.cpp, every argument is checked once, here, before any backend runs, so an error
// never leaves a partly written output or cache. Each error names the argument, what was
// expected and what came. Values that decide memory safety (block_table entries, cache_seqlens,
// slot_mapping, the 8-bit scales) are read on the host for CPU tensors. For CUDA tensors those
// reads would need a device -> host copy and would break CUDA-graph capture, so they stay on the
// device and the CUDA kernels bound-check instead (src/cuda/serving_decode.cu: a sequence whose
// length or pages are out of range decodes to NaN; serving_ops.cu: an out-of-range slot is
// skipped). The CUDA decode kernel is picked by cuda_decode_select() (a row or a reason: no
// silent fallback to the CPU); IOATTN_LOG=info prints the kernel, the split count and why.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "core/backends.hpp"
#include "core/checks.hpp"
#include "core/serving_problem.hpp"
#include "ioattn/serving.hpp"

namespace ioattn {
namespace detail {
namespace {

constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kMaxSeqlenQ = 16;  // speculative / multi-token decode

std::string i2s(int64_t x) { return std::to_string(x); }

bool log_enabled() {
  const char* e = std::getenv("IOATTN_LOG");
  return e && (std::strcmp(e, "info") == 0 || std::strcmp(e, "debug") == 0);
}

void log_choice(const char* what, const KernelChoice& c) {
  if (log_enabled()) std::fprintf(stderr, "ioattn: %s: %s (%s)\n", what, c.kernel.c_str(), c.reason.c_str());
}

// check_view() names q as the device reference; the serving calls that have no q (append_kv,
// merge_states) check the device against their own first tensor here, then the rest.
void check_view_as(const TensorView& t, const char* name, int ndim, const TensorView& ref, const char* ref_name) {
  if (t.device != ref.device || t.device_index != ref.device_index)
    fail(std::string(name) + ".device",
         std::string(device_name(ref.device)) + ":" + i2s(ref.device_index) + " (as " + ref_name + ")",
         std::string(device_name(t.device)) + ":" + i2s(t.device_index));
  check_view(t, name, ndim, t);
}

void check_no_cuda_build(const TensorView& t, const char* name) {
  if (t.device == Device::cuda && !cuda_compiled())
    fail(std::string(name) + ".device", "cpu (this build has no CUDA backend)", "cuda");
}

void check_head_dim(const char* name, int dim, int64_t x, const char* what) {
  if (x < 1 || x > kMaxHeadDim)
    fail(std::string(name) + ".shape[" + std::to_string(dim) + "]",
         std::string(what) + " in 1.." + i2s(kMaxHeadDim), i2s(x));
}

// k_cache / v_cache: 4 dims, a float or 8-bit dtype, the same leading dims; returns heads_kv.
void check_cache_pair(const TensorView& k, const TensorView& v, const TensorView& ref, const char* ref_name,
                      bool output) {
  if (!k.defined()) fail("cache.k_cache", "a [pages, page_size, heads_kv, head_dim] tensor", "undefined");
  if (!v.defined()) fail("cache.v_cache", "a [pages, page_size, heads_kv, head_dim_v] tensor", "undefined");
  check_view_as(k, "cache.k_cache", 4, ref, ref_name);
  check_view_as(v, "cache.v_cache", 4, ref, ref_name);
  if (!is_float(k.dtype) && !is_8bit(k.dtype))
    fail("cache.k_cache.dtype", "f32, f16, bf16, f8e4m3 or i8", dtype_name(k.dtype));
  if (v.dtype != k.dtype)
    fail("cache.v_cache.dtype", std::string(dtype_name(k.dtype)) + " (as cache.k_cache)", dtype_name(v.dtype));
  check_dim("cache.v_cache", 0, v.shape[0], k.shape[0], "pages of cache.k_cache");
  check_dim("cache.v_cache", 1, v.shape[1], k.shape[1], "page_size of cache.k_cache");
  check_dim("cache.v_cache", 2, v.shape[2], k.shape[2], "heads_kv of cache.k_cache");
  if (k.shape[2] < 1) fail("cache.k_cache.shape[2]", "heads_kv >= 1", i2s(k.shape[2]));
  check_head_dim("cache.k_cache", 3, k.shape[3], "head_dim");
  check_head_dim("cache.v_cache", 3, v.shape[3], "head_dim_v");
  if (output) {
    check_writable(k, "cache.k_cache");
    check_writable(v, "cache.v_cache");
  }
}

// Per-kv-head scales: required for 8-bit caches, refused otherwise; positive and finite.
const float* check_scale(const TensorView& s, const char* name, DType cache_dtype, int64_t heads_kv,
                         const TensorView& ref, const char* ref_name) {
  if (!is_8bit(cache_dtype)) {
    if (s.defined())
      fail(name, std::string("undefined (scales apply only to 8-bit caches; the cache is ") +
                     dtype_name(cache_dtype) + ")",
           "a tensor");
    return nullptr;
  }
  if (!s.defined())
    fail(name, std::string("an f32 [heads_kv] tensor (required for the ") + dtype_name(cache_dtype) + " cache)",
         "undefined");
  check_view_as(s, name, 1, ref, ref_name);
  check_dtype(s, name, DType::f32);
  check_dim(name, 0, s.shape[0], heads_kv, "heads_kv");
  if (s.data == nullptr) fail(name, "a non-null data pointer", "null");
  const auto* f = static_cast<const float*>(s.data);
  if (s.device == Device::cpu)
    for (int64_t h = 0; h < heads_kv; ++h) {
      const float x = f[h * s.stride[0]];
      if (!(x > 0.0f) || !std::isfinite(x))
        fail(std::string(name) + "[" + i2s(h) + "]", "a positive finite scale", std::to_string(x));
    }
  return f;
}

void check_params(const AttnParams& params, int64_t heads_q, int64_t head_dim, const TensorView& q,
                  DecodeProblem& p) {
  if (!std::isfinite(params.scale))
    fail("params.scale", "a finite number (0 = 1/sqrt(head_dim))", std::to_string(params.scale));
  p.scale = params.scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(head_dim)) : params.scale;
  if (!(params.softcap >= 0.0f) || !std::isfinite(params.softcap))
    fail("params.softcap", "a finite value >= 0 (0 = off)", std::to_string(params.softcap));
  p.softcap = params.softcap;
  if (params.window_left < -1) fail("params.window_left", ">= -1 (-1 = unbounded)", i2s(params.window_left));
  if (params.window_right < -1) fail("params.window_right", ">= -1 (-1 = unbounded)", i2s(params.window_right));
  p.causal = params.causal;
  p.window_left = params.window_left;
  p.window_right = params.causal ? 0 : params.window_right;  // causal = right window of 0
  p.alibi_slopes = check_head_vector(params.alibi_slopes, "params.alibi_slopes", heads_q, q);
  p.sinks = check_head_vector(params.sinks, "params.sinks", heads_q, q);
}

struct ValidatedDecode {
  DecodeProblem p;
  int64_t max_len = 0;  // longest cache_seqlens entry (CUDA tensors: the capacity)
};

ValidatedDecode validate_decode(const TensorView& q, const KVCache& cache, const TensorView& o,
                                const TensorView& lse, const AttnParams& params, const Context& ctx) {
  ValidatedDecode out;
  DecodeProblem& p = out.p;
  check_view(q, "q", 4, q);
  if (!is_float(q.dtype)) fail("q.dtype", "f32, f16 or bf16", dtype_name(q.dtype));
  check_no_cuda_build(q, "q");
  check_view(o, "o", 4, q);
  check_dtype(o, "o", q.dtype);
  check_writable(o, "o");
  p.batch = q.shape[0];
  p.seqlen_q = q.shape[1];
  p.heads_q = q.shape[2];
  p.head_dim = q.shape[3];
  // (more than 16 query rows run the flash forward over the cache: run_cache_prefill)
  if (p.seqlen_q < 1) fail("q.shape[1]", "seqlen_q >= 1", i2s(p.seqlen_q));
  check_head_dim("q", 3, p.head_dim, "head_dim");

  const TensorView &k = cache.k_cache, &v = cache.v_cache;
  check_cache_pair(k, v, q, "q", false);
  if (is_float(k.dtype) && k.dtype != q.dtype)
    fail("cache.k_cache.dtype", std::string(dtype_name(q.dtype)) + " (as q) or an 8-bit f8e4m3 / i8",
         dtype_name(k.dtype));
  p.heads_kv = k.shape[2];
  if (p.heads_q % p.heads_kv != 0)
    fail("q.shape[2]", "heads_q divisible by heads_kv = " + i2s(p.heads_kv), "heads_q = " + i2s(p.heads_q));
  check_dim("cache.k_cache", 3, k.shape[3], p.head_dim, "head_dim of q");
  p.head_dim_v = v.shape[3];
  check_dim("o", 0, o.shape[0], p.batch, "batch of q");
  check_dim("o", 1, o.shape[1], p.seqlen_q, "seqlen_q of q");
  check_dim("o", 2, o.shape[2], p.heads_q, "heads_q of q");
  check_dim("o", 3, o.shape[3], p.head_dim_v, "head_dim_v of cache.v_cache");

  if (lse.defined()) {
    check_view(lse, "lse", 3, q);
    check_dtype(lse, "lse", DType::f32);
    check_writable(lse, "lse");
    check_dim("lse", 0, lse.shape[0], p.batch, "batch");
    check_dim("lse", 1, lse.shape[1], p.heads_q, "heads_q");
    check_dim("lse", 2, lse.shape[2], p.seqlen_q, "seqlen_q");
    p.lse = static_cast<float*>(lse.data);
    p.lse_stride = {lse.stride[0], lse.stride[2], lse.stride[1]};
  }

  // Cache geometry: paged with a block table, or contiguous [batch, max_seqlen, hkv, d].
  const TensorView& cs = cache.cache_seqlens;
  if (!cs.defined()) fail("cache.cache_seqlens", "an i32 [batch] tensor", "undefined");
  check_view(cs, "cache.cache_seqlens", 1, q);
  check_dtype(cs, "cache.cache_seqlens", DType::i32);
  check_dim("cache.cache_seqlens", 0, cs.shape[0], p.batch, "batch of q");
  int64_t capacity = 0;
  const TensorView& bt = cache.block_table;
  if (bt.defined()) {
    check_view(bt, "cache.block_table", 2, q);
    check_dtype(bt, "cache.block_table", DType::i32);
    check_dim("cache.block_table", 0, bt.shape[0], p.batch, "batch of q");
    p.page_size = k.shape[1];
    if (p.page_size < 1) fail("cache.k_cache.shape[1]", "page_size >= 1", i2s(p.page_size));
    p.num_pages = k.shape[0];
    p.block_table = static_cast<const int32_t*>(bt.data);
    p.bt_stride_batch = bt.stride[0];
    p.bt_stride_page = bt.stride[1];
    p.max_pages_per_seq = bt.shape[1];
    capacity = p.max_pages_per_seq * p.page_size;
  } else {
    check_dim("cache.k_cache", 0, k.shape[0], p.batch,
              "batch of q (a contiguous [batch, max_seqlen, heads_kv, head_dim] cache; pass a "
              "block_table for a paged one)");
    p.page_size = std::max<int64_t>(k.shape[1], 1);  // one page per sequence
    p.num_pages = k.shape[0];
    p.max_pages_per_seq = 1;
    capacity = k.shape[1];
  }
  p.capacity = capacity;
  p.cache_dtype = k.dtype;
  p.k_scale = check_scale(cache.k_scale, "cache.k_scale", k.dtype, p.heads_kv, q, "q");
  p.v_scale = check_scale(cache.v_scale, "cache.v_scale", k.dtype, p.heads_kv, q, "q");
  check_params(params, p.heads_q, p.head_dim, q, p);
  // Fused append: k_new / v_new [batch, seqlen_new, heads_kv, d / dv] in q's dtype; the cache is
  // then written.
  const TensorView &kn = cache.k_new, &vn = cache.v_new;
  if (kn.defined() || vn.defined()) {
    if (!kn.defined())
      fail("cache.k_new", "a [batch, seqlen_new, heads_kv, head_dim] tensor (cache.v_new is given)", "undefined");
    if (!vn.defined())
      fail("cache.v_new", "a [batch, seqlen_new, heads_kv, head_dim_v] tensor (cache.k_new is given)", "undefined");
    check_view(kn, "cache.k_new", 4, q);
    check_view(vn, "cache.v_new", 4, q);
    check_dtype(kn, "cache.k_new", q.dtype);
    check_dtype(vn, "cache.v_new", q.dtype);
    p.seqlen_new = kn.shape[1];
    check_dim("cache.k_new", 0, kn.shape[0], p.batch, "batch of q");
    if (p.seqlen_new < 1 || p.seqlen_new > std::max<int64_t>(capacity, 1))
      fail("cache.k_new.shape[1]",
           "seqlen_new in 1.." + i2s(std::max<int64_t>(capacity, 1)) + " (the cache's capacity)", i2s(p.seqlen_new));
    check_dim("cache.k_new", 2, kn.shape[2], p.heads_kv, "heads_kv of cache.k_cache");
    check_dim("cache.k_new", 3, kn.shape[3], p.head_dim, "head_dim of q");
    check_dim("cache.v_new", 0, vn.shape[0], p.batch, "batch of q");
    check_dim("cache.v_new", 1, vn.shape[1], p.seqlen_new, "seqlen_new of cache.k_new");
    check_dim("cache.v_new", 2, vn.shape[2], p.heads_kv, "heads_kv of cache.k_cache");
    check_dim("cache.v_new", 3, vn.shape[3], p.head_dim_v, "head_dim_v of cache.v_cache");
    check_writable(k, "cache.k_cache");
    check_writable(v, "cache.v_cache");
    p.k_new = kn.data;
    p.v_new = vn.data;
    p.k_new_stride = {kn.stride[0], kn.stride[1], kn.stride[2]};
    p.v_new_stride = {vn.stride[0], vn.stride[1], vn.stride[2]};
  }
  if (ctx.num_threads < 0) fail("ctx.num_threads", ">= 0 (0 = all)", i2s(ctx.num_threads));

  // Values, read on the host (CPU tensors): lengths within capacity and >= seqlen_q (or 0, an
  // empty slot of the batch), and every block-table entry a live sequence reads in range.
  const auto* lens = static_cast<const int32_t*>(cs.data);
  if (q.device == Device::cpu) {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t len = lens[b * cs.stride[0]];
      const std::string name = "cache.cache_seqlens[" + i2s(b) + "]";
      if (len < 0 || len > capacity)
        fail(name,
             "a length in 0.." + i2s(capacity) +
                 (bt.defined() ? " (block_table.shape[1] * page_size = " + i2s(p.max_pages_per_seq) + " * " +
                                     i2s(p.page_size) + ")"
                               : " (max_seqlen = cache.k_cache.shape[1])"),
             i2s(len));
      if (len != 0 && len < p.seqlen_q)
        fail(name,
             ">= seqlen_q = " + i2s(p.seqlen_q) +
                 " (query row i sits at position cache_seqlens - seqlen_q + i) or 0 (an empty slot)",
             i2s(len));
      if (len != 0 && len < p.seqlen_new)
        fail(name,
             ">= seqlen_new = " + i2s(p.seqlen_new) +
                 " (new token i goes to position cache_seqlens - seqlen_new + i) or 0 (an empty slot)",
             i2s(len));
      out.max_len = std::max(out.max_len, len);
      if (!bt.defined()) continue;
      const int64_t pages = (len + p.page_size - 1) / p.page_size;
      for (int64_t j = 0; j < pages; ++j) {
        const int64_t e = p.block_table[b * p.bt_stride_batch + j * p.bt_stride_page];
        if (e < 0 || e >= p.num_pages)
          fail("cache.block_table[" + i2s(b) + "][" + i2s(j) + "]",
               "a page index in 0.." + i2s(p.num_pages - 1) + " (cache.k_cache.shape[0] = " + i2s(p.num_pages) +
                   " pages; sequence " + i2s(b) + " has " + i2s(len) + " tokens)",
               i2s(e));
      }
    }
    p.cache_seqlens_host = lens;
  } else {
    out.max_len = capacity;
  }
  p.cache_seqlens = lens;

  p.q = q.data;
  p.o = o.data;
  p.q_stride = {q.stride[0], q.stride[1], q.stride[2]};
  p.o_stride = {o.stride[0], o.stride[1], o.stride[2]};
  p.dtype = q.dtype;
  p.k_cache = k.data;
  p.v_cache = v.data;
  p.k_stride = {k.stride[0], k.stride[1], k.stride[2]};
  p.v_stride = {v.stride[0], v.stride[1], v.stride[2]};
  p.device = q.device;
  p.device_index = q.device_index;
  p.stream = ctx.stream;
  p.num_threads = ctx.num_threads;
  // Fused append on the CPU: no two new tokens on one cache slot (a block table naming a page twice
  // at the written positions; the threads would race, as two equal slots of append_kv would). The
  // slots are the append's own (lengths_slot), every one in range after the checks above.
  if (q.device == Device::cpu && p.seqlen_new > 0 && bt.defined()) {
    const AppendProblem a = fused_append_problem(p);
    std::vector<std::pair<int64_t, int64_t>> used;  // (slot, sequence)
    for (int64_t t = 0; t < a.tokens; ++t)
      if (const int64_t s = a.lengths_slot(t); s >= 0) used.emplace_back(s, t / p.seqlen_new);
    std::sort(used.begin(), used.end());
    for (size_t i = 1; i < used.size(); ++i)
      if (used[i].first == used[i - 1].first)
        fail("cache.block_table", "distinct cache slots for the new tokens (cache.k_new) of every sequence",
             "page " + i2s(used[i].first / p.page_size) + " slot " + i2s(used[i].first % p.page_size) +
                 " for sequences " + i2s(used[i - 1].second) + " and " + i2s(used[i].second));
  }
  return out;
}

void check_num_splits(int n, const char* name) {
  if (n < 0 || n > kMaxSplits)
    fail(name, "0 (heuristic) or 1.." + i2s(kMaxSplits), i2s(n));
}

std::string mask_name(const DecodeProblem& p) {
  std::string m;
  if (p.causal) m = "causal";
  if (p.window_left >= 0 || (!p.causal && p.window_right >= 0))
    m += (m.empty() ? "" : "+") + std::string("window(") + i2s(p.window_left) + "," + i2s(p.window_right) + ")";
  if (m.empty()) m = "nomask";
  if (p.softcap > 0) m += "+softcap";
  if (p.alibi_slopes) m += "+alibi";
  if (p.sinks) m += "+sinks";
  return m;
}

// FNV-1a over the plan's fields: a plan edited by hand (or built for another shape) fails.
uint64_t plan_fingerprint(const DecodePlan& pl) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      h ^= (x >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  mix(0x696f617474'6e3031ull);  // "ioattn01": bump when the CPU workspace layout changes
  for (int64_t x : {pl.batch, pl.heads_q, pl.heads_kv, pl.head_dim, pl.head_dim_v, pl.seqlen_q,
                    pl.max_seqlen_k, pl.page_size})
    mix(static_cast<uint64_t>(x));
  mix(static_cast<uint64_t>(pl.num_splits));
  mix(static_cast<uint64_t>(pl.workspace_bytes));
  mix(static_cast<uint64_t>(pl.device));
  return h;
}

// CUDA: the dispatcher's row for this decode, or an error naming q with the reason.
CudaSelection select_cuda_decode(const DecodeProblem& p, const std::string& shape) {
  const int arch = cuda_device_arch(p.device_index);
  CudaSelection sel = cuda_decode_select(p, arch);
  if (sel.kernel.empty())
    throw Error("q", "ioattn: no CUDA decode kernel for " + shape + ": " + sel.reason);
  return sel;
}

std::string decode_shape(const DecodeProblem& p) {
  std::string s = std::string(dtype_name(p.dtype));
  if (p.cache_dtype != p.dtype) s += " kv " + std::string(dtype_name(p.cache_dtype));
  s += " hdim" + i2s(p.head_dim) + (p.head_dim_v != p.head_dim ? "/" + i2s(p.head_dim_v) : "");
  if (p.heads_q != p.heads_kv) s += " gqa" + i2s(p.group());
  if (p.seqlen_q > 1) s += " sq" + i2s(p.seqlen_q);
  s += p.paged() ? " page" + i2s(p.page_size) : std::string(" contiguous");
  s += " " + mask_name(p);
  return s;
}

int split_threads(const DecodeProblem& p, int threads, int splits) {
  const int64_t tasks = std::max<int64_t>(1, p.batch * p.heads_kv * splits);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
}

}  // namespace

// (declared in serving_problem.hpp)
AppendProblem fused_append_problem(const DecodeProblem& p) {
  AppendProblem a;
  a.k_new = p.k_new;
  a.v_new = p.v_new;
  a.k_new_stride_batch = p.k_new_stride.batch, a.k_new_stride_token = p.k_new_stride.seq;
  a.k_new_stride_head = p.k_new_stride.head;
  a.v_new_stride_batch = p.v_new_stride.batch, a.v_new_stride_token = p.v_new_stride.seq;
  a.v_new_stride_head = p.v_new_stride.head;
  a.new_dtype = p.dtype;
  a.k_cache = const_cast<void*>(p.k_cache);  // checked writable by validate_decode
  a.v_cache = const_cast<void*>(p.v_cache);
  a.k_stride = p.k_stride, a.v_stride = p.v_stride;
  a.cache_dtype = p.cache_dtype;
  a.page_size = p.page_size;
  a.num_slots = p.num_pages * p.page_size;
  a.k_scale = p.k_scale, a.v_scale = p.v_scale;
  a.tokens = p.batch * p.seqlen_new;
  a.heads_kv = p.heads_kv, a.head_dim = p.head_dim, a.head_dim_v = p.head_dim_v;
  // (the lengths the decode accepts: under a CUDA plan at most plan.max_seqlen_k)
  a.seqlen_new = p.seqlen_new, a.num_pages = p.num_pages;
  a.capacity = p.max_seqlen_k > 0 ? std::min(p.capacity, p.max_seqlen_k) : p.capacity;
  a.seqlens = p.cache_seqlens;
  a.block_table = p.block_table;
  a.bt_stride_batch = p.bt_stride_batch, a.bt_stride_page = p.bt_stride_page;
  a.device = p.device, a.device_index = p.device_index, a.stream = p.stream;
  a.num_threads = p.num_threads;
  return a;
}

namespace {

// The fused append's part of a KernelChoice: the kernel name's suffix and the reason's clause
// (empty without one).
std::string append_suffix(const DecodeProblem& p) { return p.seqlen_new > 0 ? " +append" + i2s(p.seqlen_new) : ""; }
std::string append_reason(const DecodeProblem& p) {
  if (p.seqlen_new == 0) return "";
  return "; fused append: " + i2s(p.seqlen_new) +
         " new tokens per sequence written at cache_seqlens - seqlen_new + i first" +
         (p.device == Device::cuda ? " (append kernel, then the attention, on the stream)" : "");
}

// More than 16 query rows (a prefill or a long chunk against the cache): the flash forward (tiled,
// the decode's semantics: query row i at position cache_seqlens[b] - seqlen_q + i) reading K / V
// through the cache's layout — block table, per-sequence lengths, 8-bit codes times the per-kv-head
// scales — instead of the split-KV decode, whose tiles are sized for a few rows. CPU: the
// multithreaded flash forward; CUDA: the mma.sync forward's KV-cache mode (flash_fwd.cuh), or an
// error naming q with the reason when its table lacks the shape (f32 q, head_dim != head_dim_v).
// The cache prefill as a forward problem over the cache's layout (both backends).
FwdProblem cache_prefill_problem(const DecodeProblem& p) {
  FwdProblem f;
  f.q = p.q, f.k = p.k_cache, f.v = p.v_cache, f.o = p.o, f.lse = p.lse;
  f.q_stride = p.q_stride, f.o_stride = p.o_stride, f.lse_stride = p.lse_stride;
  f.k_stride = {p.k_stride.page, p.k_stride.slot, p.k_stride.head};  // (batch = page stride)
  f.v_stride = {p.v_stride.page, p.v_stride.slot, p.v_stride.head};
  f.dtype = p.dtype;
  f.device = p.device, f.device_index = p.device_index, f.stream = p.stream;
  f.kv_dtype_set = true, f.kv_dtype = p.cache_dtype;
  f.batch = p.batch, f.heads_q = p.heads_q, f.heads_kv = p.heads_kv;
  f.seqlen_q = p.seqlen_q, f.seqlen_k = p.max_seqlen_k;
  f.head_dim = p.head_dim, f.head_dim_v = p.head_dim_v;
  f.kv_lens = p.device == Device::cpu ? p.cache_seqlens_host : p.cache_seqlens;
  f.block_table = p.block_table;
  f.page_size = p.page_size, f.bt_stride_batch = p.bt_stride_batch, f.bt_stride_page = p.bt_stride_page;
  f.num_pages = p.num_pages;
  f.kv_bound = std::min(p.capacity, p.max_seqlen_k > 0 ? p.max_seqlen_k : p.capacity);
  f.scale = p.scale, f.softcap = p.softcap, f.causal = p.causal;
  f.window_left = p.window_left, f.window_right = p.window_right;
  f.alibi_slopes = p.alibi_slopes, f.sinks = p.sinks;
  f.k_descale = {p.k_scale, 0, 1}, f.v_descale = {p.v_scale, 0, 1};  // (null: 1)
  f.num_threads = p.num_threads;
  return f;
}

KernelChoice run_cache_prefill(DecodeProblem& p, int requested_splits) {
  const std::string splits_note = requested_splits > 0 ? "; num_splits=" + i2s(requested_splits) +
                                                             " does not apply (no split-KV: the tiles split the rows)"
                                                       : std::string();
  const std::string why = "seqlen_q " + i2s(p.seqlen_q) + " > " + i2s(kMaxSeqlenQ) + ": ";
  const FwdProblem f = cache_prefill_problem(p);
  KernelChoice c;
  if (p.device == Device::cuda) {
    const CudaSelection sel = cuda_cache_prefill_select(f, cuda_device_arch(p.device_index));
    if (sel.kernel.empty())
      throw Error("q", "ioattn: no CUDA kernel for " + decode_shape(p) + " with " + i2s(p.seqlen_q) +
                           " query rows against the cache (more than " + i2s(kMaxSeqlenQ) +
                           " take the flash forward; the CPU runs every shape): " + sel.reason);
    c = {sel.kernel + " " + decode_shape(p) + append_suffix(p),
         why + sel.reason + ", not the split-KV decode" + append_reason(p) + splits_note};
  } else {
    c = {"cpu/flash cache-prefill " + cpu_best_target() + " " + decode_shape(p) + append_suffix(p),
         why + "the tiled flash forward (tile " + cpu_flash_tile(f) +
             ") reads K / V through the cache's layout, not the split-KV decode" + append_reason(p) + splits_note};
  }
  log_choice("decode", c);
  // The fused append only after the kernel was chosen: an error never leaves the cache written.
  if (p.seqlen_new > 0) {
    if (p.device == Device::cuda)
      cuda_append_kv(fused_append_problem(p));
    else
      cpu_append_kv(fused_append_problem(p));
  }
  if (p.device == Device::cuda)
    cuda_cache_prefill(f);
  else
    cpu_flash_forward(f);
  return c;
}

KernelChoice run_decode(DecodeProblem& p, const std::string& reason) {
  const std::string shape = decode_shape(p), app = append_suffix(p), app_why = append_reason(p);
  if (p.device == Device::cuda) {
    const CudaSelection sel = select_cuda_decode(p, shape);
    KernelChoice c{sel.kernel + " " + shape + " splits " + i2s(p.num_splits) + app,
                   reason + "; " + sel.reason + app_why};
    log_choice("decode", c);
    cuda_decode(p);  // (runs the fused append itself, after its checks and allocations)
    return c;
  }
  KernelChoice c{"cpu/splitkv " + cpu_best_target() + " " + shape + " splits " + i2s(p.num_splits) + app,
                 reason + app_why};
  log_choice("decode", c);
  if (p.seqlen_new > 0) cpu_append_kv(fused_append_problem(p));
  cpu_decode(p);
  return c;
}

struct AlignedFree {
  void operator()(void* ptr) const { ::operator delete(ptr, std::align_val_t(kWorkspaceAlign)); }
};

}  // namespace
}  // namespace detail

DecodePlan plan_decode(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t head_dim_v,
                       int64_t seqlen_q, int64_t max_seqlen_k, int64_t page_size, Device device,
                       const DecodeOptions& opt, int device_index) {
  using namespace detail;
  if (batch < 0) fail("batch", ">= 0", i2s(batch));
  if (heads_kv < 1) fail("heads_kv", ">= 1", i2s(heads_kv));
  if (heads_q < 1 || heads_q % heads_kv != 0)
    fail("heads_q", "a positive multiple of heads_kv = " + i2s(heads_kv), i2s(heads_q));
  if (head_dim < 1 || head_dim > kMaxHeadDim) fail("head_dim", "1.." + i2s(kMaxHeadDim), i2s(head_dim));
  if (head_dim_v < 1 || head_dim_v > kMaxHeadDim) fail("head_dim_v", "1.." + i2s(kMaxHeadDim), i2s(head_dim_v));
  if (seqlen_q < 1 || seqlen_q > kMaxSeqlenQ) fail("seqlen_q", "1.." + i2s(kMaxSeqlenQ), i2s(seqlen_q));
  if (max_seqlen_k < 0) fail("max_seqlen_k", ">= 0 (an upper bound of cache_seqlens)", i2s(max_seqlen_k));
  if (page_size < 0) fail("page_size", ">= 1 for a paged cache, 0 for a contiguous cache", i2s(page_size));
  check_num_splits(opt.num_splits, "opt.num_splits");
  if (device_index < 0) fail("device_index", ">= 0", i2s(device_index));
  if (device == Device::cuda) {
    if (!cuda_compiled()) fail("device", "cpu (this build has no CUDA backend)", "cuda");
    const int n = cuda_device_count();
    if (device_index >= n)
      fail("device_index", n ? "a CUDA device index in 0.." + i2s(n - 1) : std::string("a CUDA device (none found)"),
           i2s(device_index));
  }
  DecodePlan pl;
  pl.batch = batch;
  pl.heads_q = heads_q;
  pl.heads_kv = heads_kv;
  pl.head_dim = head_dim;
  pl.head_dim_v = head_dim_v;
  pl.seqlen_q = seqlen_q;
  pl.max_seqlen_k = max_seqlen_k;
  pl.page_size = page_size;
  pl.device = device;
  if (device == Device::cuda) {
    // CUDA: splits for this device's SM count; the workspace holds only the partials.
    pl.num_splits = opt.num_splits > 0 ? opt.num_splits
                                       : cuda_decode_num_splits(batch, heads_q, heads_kv, seqlen_q, max_seqlen_k,
                                                                opt.cache_dtype, head_dim, head_dim_v, page_size > 0,
                                                                device_index, nullptr);
    pl.workspace_bytes = cuda_decode_workspace_bytes(batch, heads_q, seqlen_q, head_dim_v, pl.num_splits);
    pl.fingerprint = plan_fingerprint(pl);
    return pl;
  }
  const int threads = cpu_max_threads();
  pl.num_splits = opt.num_splits > 0 ? opt.num_splits
                                     : cpu_decode_num_splits(batch, heads_kv, max_seqlen_k, threads, nullptr);
  const int64_t tasks = std::max<int64_t>(1, batch * heads_kv * pl.num_splits);
  const int slots = static_cast<int>(std::min<int64_t>(threads, tasks));
  pl.workspace_bytes = cpu_decode_layout(batch, heads_q, heads_kv, seqlen_q, head_dim, head_dim_v, pl.num_splits,
                                         slots)
                           .total_bytes;
  pl.fingerprint = plan_fingerprint(pl);
  return pl;
}

KernelChoice decode(const TensorView& q, const KVCache& cache, const TensorView& o, const TensorView& lse,
                    const AttnParams& params, const DecodeOptions& opt, const Context& ctx) {
  using namespace detail;
  ValidatedDecode val = validate_decode(q, cache, o, lse, params, ctx);
  check_num_splits(opt.num_splits, "opt.num_splits");
  DecodeProblem& p = val.p;
  p.max_seqlen_k = val.max_len;
  if (p.seqlen_q > kMaxSeqlenQ) return run_cache_prefill(p, opt.num_splits);
  if (p.device == Device::cuda) {
    // Splits from the capacity (the device's lengths are not read); partials in a stream-ordered
    // allocation made by the backend for this call.
    std::string reason;
    if (opt.num_splits > 0) {
      p.num_splits = opt.num_splits;
      reason = "num_splits=" + i2s(opt.num_splits) + " requested";
    } else {
      p.num_splits = cuda_decode_num_splits(p.batch, p.heads_q, p.heads_kv, p.seqlen_q, val.max_len, p.cache_dtype,
                                            p.head_dim, p.head_dim_v, p.paged(), p.device_index, &reason);
      reason = "heuristic: " + reason;
    }
    return run_decode(p, reason + "; internal workspace (stream-ordered) " +
                             i2s(static_cast<int64_t>(cuda_decode_workspace_bytes(
                                 p.batch, p.heads_q, p.seqlen_q, p.head_dim_v, p.num_splits))) +
                             " B");
  }
  const int threads = ctx.num_threads > 0 ? ctx.num_threads : cpu_max_threads();
  std::string reason;
  if (opt.num_splits > 0) {
    p.num_splits = opt.num_splits;
    reason = "num_splits=" + i2s(opt.num_splits) + " requested";
  } else {
    p.num_splits = cpu_decode_num_splits(p.batch, p.heads_kv, val.max_len, threads, &reason);
    reason = "heuristic: " + reason;
  }
  p.num_threads = split_threads(p, threads, p.num_splits);
  const DecodeLayout lay = cpu_decode_layout(p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.head_dim, p.head_dim_v,
                                             p.num_splits, p.num_threads);
  std::unique_ptr<void, AlignedFree> ws(lay.total_bytes
                                            ? ::operator new(lay.total_bytes, std::align_val_t(kWorkspaceAlign))
                                            : nullptr);
  p.workspace = ws.get();
  p.workspace_bytes = lay.total_bytes;
  return run_decode(p, reason + "; internal workspace " + i2s(static_cast<int64_t>(lay.total_bytes)) + " B");
}

KernelChoice decode(const TensorView& q, const KVCache& cache, const TensorView& o, const TensorView& lse,
                    const AttnParams& params, const DecodePlan& plan, void* workspace, const Context& ctx) {
  using namespace detail;
  ValidatedDecode val = validate_decode(q, cache, o, lse, params, ctx);
  DecodeProblem& p = val.p;
  // The plan must describe this problem (and be the one plan_decode produced).
  if (plan.fingerprint != plan_fingerprint(plan))
    fail("plan", "a DecodePlan from plan_decode() (fields unchanged since)",
         "a plan whose fingerprint does not match its fields");
  auto same = [](const char* field, int64_t planned, int64_t actual, const char* from) {
    if (planned != actual)
      fail("plan", std::string("a plan for ") + field + " = " + i2s(actual) + " (from " + from + ")",
           std::string("a plan for ") + field + " = " + i2s(planned) + "; call plan_decode() for this shape");
  };
  if (p.seqlen_q > kMaxSeqlenQ)
    fail("q.shape[1]",
         "seqlen_q in 1.." + i2s(kMaxSeqlenQ) + " under a plan (a longer chunk runs through decode() without one)",
         i2s(p.seqlen_q));
  same("batch", plan.batch, p.batch, "q.shape[0]");
  same("heads_q", plan.heads_q, p.heads_q, "q.shape[2]");
  same("heads_kv", plan.heads_kv, p.heads_kv, "cache.k_cache.shape[2]");
  same("head_dim", plan.head_dim, p.head_dim, "q.shape[3]");
  same("head_dim_v", plan.head_dim_v, p.head_dim_v, "cache.v_cache.shape[3]");
  same("seqlen_q", plan.seqlen_q, p.seqlen_q, "q.shape[1]");
  same("page_size", plan.page_size, p.paged() ? p.page_size : 0,
       p.paged() ? "cache.k_cache.shape[1]" : "a contiguous cache, page_size 0");
  if (plan.device != p.device)
    fail("plan", std::string("a plan for device ") + device_name(p.device) + " (from q)",
         std::string("a plan for device ") + device_name(plan.device));
  // CPU: the longest entry, read above. CUDA: the lengths stay on the device; the kernel treats an
  // entry past min(capacity, plan.max_seqlen_k) as invalid (NaN output).
  if (p.device == Device::cpu && val.max_len > plan.max_seqlen_k)
    fail("plan", "max_seqlen_k >= the longest cache_seqlens entry " + i2s(val.max_len),
         "a plan for max_seqlen_k = " + i2s(plan.max_seqlen_k) + "; plan with the cache capacity");
  check_num_splits(plan.num_splits, "plan.num_splits");
  if (plan.num_splits < 1) fail("plan.num_splits", ">= 1 (as plan_decode sets it)", i2s(plan.num_splits));
  if (plan.workspace_bytes > 0 && workspace == nullptr)
    fail("workspace", "a buffer of plan.workspace_bytes = " + i2s(static_cast<int64_t>(plan.workspace_bytes)) +
                          " bytes",
         "null");
  if (reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlign != 0)
    fail("workspace", "a " + i2s(static_cast<int64_t>(kWorkspaceAlign)) + "-byte aligned pointer",
         "an address " + i2s(static_cast<int64_t>(reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlign)) +
             " bytes past alignment");
  p.max_seqlen_k = plan.max_seqlen_k;
  p.num_splits = plan.num_splits;
  if (p.device == Device::cuda) {
    const size_t need = cuda_decode_workspace_bytes(p.batch, p.heads_q, p.seqlen_q, p.head_dim_v, p.num_splits);
    if (plan.workspace_bytes < need)
      fail("plan.workspace_bytes", ">= " + i2s(static_cast<int64_t>(need)) + " (as plan_decode sets it)",
           i2s(static_cast<int64_t>(plan.workspace_bytes)));
    if (need > 0 && !cuda_is_device_pointer(workspace))
      fail("workspace", "device memory on the device of q (plan.workspace_bytes = " + i2s(static_cast<int64_t>(need)) +
                            " B)",
           "a host pointer");
    p.max_seqlen_k = std::min(plan.max_seqlen_k, val.max_len);  // val.max_len: the capacity
    p.workspace = need > 0 ? workspace : nullptr;
    p.workspace_bytes = plan.workspace_bytes;
    return run_decode(p, "plan: splits fixed by plan_decode, caller workspace " +
                             i2s(static_cast<int64_t>(plan.workspace_bytes)) + " B, device bound on cache_seqlens " +
                             i2s(p.max_seqlen_k));
  }
  const DecodeLayout lay = cpu_decode_layout_for_bytes(p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.head_dim,
                                                       p.head_dim_v, p.num_splits, plan.workspace_bytes);
  if (lay.scratch_threads < 1)
    fail("plan.workspace_bytes", ">= " + i2s(static_cast<int64_t>(lay.total_bytes)) + " (as plan_decode sets it)",
         i2s(static_cast<int64_t>(plan.workspace_bytes)));
  const int threads = ctx.num_threads > 0 ? ctx.num_threads : cpu_max_threads();
  p.num_threads = std::min(split_threads(p, threads, p.num_splits), lay.scratch_threads);
  p.workspace = workspace;
  p.workspace_bytes = plan.workspace_bytes;
  return run_decode(p, "plan: splits fixed by plan_decode, caller workspace " +
                           i2s(static_cast<int64_t>(plan.workspace_bytes)) + " B");
}


namespace detail {

AppendProblem validate_append(const TensorView& k_new, const TensorView& v_new, const TensorView& slot_mapping,
                              const KVCache& cache, const Context& ctx) {
  AppendProblem p;
  if (cache.k_new.defined() || cache.v_new.defined())
    fail(cache.k_new.defined() ? "cache.k_new" : "cache.v_new",
         "undefined (append_kv takes its tokens as the k_new / v_new arguments; cache.k_new / v_new are "
         "decode's fused append)",
         "a tensor");
  check_view(k_new, "k_new", 3, k_new);
  if (!is_float(k_new.dtype)) fail("k_new.dtype", "f32, f16 or bf16", dtype_name(k_new.dtype));
  check_no_cuda_build(k_new, "k_new");
  check_view_as(v_new, "v_new", 3, k_new, "k_new");
  check_dtype(v_new, "v_new", k_new.dtype);
  p.tokens = k_new.shape[0];
  check_dim("v_new", 0, v_new.shape[0], p.tokens, "tokens of k_new");
  if (!slot_mapping.defined()) fail("slot_mapping", "an i32 or i64 [tokens] tensor", "undefined");
  check_view_as(slot_mapping, "slot_mapping", 1, k_new, "k_new");
  if (slot_mapping.dtype != DType::i32 && slot_mapping.dtype != DType::i64)
    fail("slot_mapping.dtype", "i32 or i64", dtype_name(slot_mapping.dtype));
  check_dim("slot_mapping", 0, slot_mapping.shape[0], p.tokens, "tokens of k_new");

  const TensorView &k = cache.k_cache, &v = cache.v_cache;
  check_cache_pair(k, v, k_new, "k_new", true);
  p.heads_kv = k.shape[2];
  p.head_dim = k.shape[3];
  p.head_dim_v = v.shape[3];
  check_dim("k_new", 1, k_new.shape[1], p.heads_kv, "heads_kv of cache.k_cache");
  check_dim("v_new", 1, v_new.shape[1], p.heads_kv, "heads_kv of cache.k_cache");
  check_dim("k_new", 2, k_new.shape[2], p.head_dim, "head_dim of cache.k_cache");
  check_dim("v_new", 2, v_new.shape[2], p.head_dim_v, "head_dim_v of cache.v_cache");
  p.cache_dtype = k.dtype;
  p.k_scale = check_scale(cache.k_scale, "cache.k_scale", k.dtype, p.heads_kv, k_new, "k_new");
  p.v_scale = check_scale(cache.v_scale, "cache.v_scale", k.dtype, p.heads_kv, k_new, "k_new");
  if (ctx.num_threads < 0) fail("ctx.num_threads", ">= 0 (0 = all)", i2s(ctx.num_threads));
  p.page_size = k.shape[1];
  p.num_slots = k.shape[0] * k.shape[1];

  p.slot_mapping = slot_mapping.data;
  p.slot_i64 = slot_mapping.dtype == DType::i64;
  p.slot_stride = slot_mapping.stride[0];
  if (k_new.device == Device::cpu) {
    // Every slot in range (negative = padding, skipped) and no slot written twice (two tokens
    // racing for one slot would leave whichever thread wrote last).
    p.slot_mapping_host = slot_mapping.data;
    std::vector<std::pair<int64_t, int64_t>> used;  // (slot, token)
    used.reserve(static_cast<size_t>(p.tokens));
    for (int64_t t = 0; t < p.tokens; ++t) {
      const int64_t s = p.slot(t);
      if (s >= p.num_slots)
        fail("slot_mapping[" + i2s(t) + "]",
             "a slot < pages * page_size = " + i2s(k.shape[0]) + " * " + i2s(k.shape[1]) + " = " + i2s(p.num_slots) +
                 " (negative = skip)",
             i2s(s));
      if (s >= 0) used.emplace_back(s, t);
    }
    std::sort(used.begin(), used.end());
    for (size_t i = 1; i < used.size(); ++i)
      if (used[i].first == used[i - 1].first)
        fail("slot_mapping", "distinct slots (negative = skip)",
             "slot " + i2s(used[i].first) + " for tokens " + i2s(used[i - 1].second) + " and " +
                 i2s(used[i].second));
  }
  p.k_new = k_new.data;
  p.v_new = v_new.data;
  p.k_new_stride_token = k_new.stride[0];
  p.k_new_stride_head = k_new.stride[1];
  p.v_new_stride_token = v_new.stride[0];
  p.v_new_stride_head = v_new.stride[1];
  p.new_dtype = k_new.dtype;
  p.k_cache = k.data;
  p.v_cache = v.data;
  p.k_stride = {k.stride[0], k.stride[1], k.stride[2]};
  p.v_stride = {v.stride[0], v.stride[1], v.stride[2]};
  p.device = k_new.device;
  p.device_index = k_new.device_index;
  p.stream = ctx.stream;
  p.num_threads = ctx.num_threads;
  return p;
}

namespace {

MergeProblem validate_merge(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
                            const TensorView& lse_b, const TensorView& o_out, const TensorView& lse_out,
                            const Context& ctx) {
  MergeProblem p;
  check_view(o_a, "o_a", 4, o_a);
  if (!is_float(o_a.dtype)) fail("o_a.dtype", "f32, f16 or bf16", dtype_name(o_a.dtype));
  check_no_cuda_build(o_a, "o_a");
  check_view_as(o_b, "o_b", 4, o_a, "o_a");
  check_view_as(o_out, "o_out", 4, o_a, "o_a");
  // Each O may have its own float dtype (an fp32 running state merged with a bf16 partial).
  if (!is_float(o_b.dtype)) fail("o_b.dtype", "f32, f16 or bf16", dtype_name(o_b.dtype));
  if (!is_float(o_out.dtype)) fail("o_out.dtype", "f32, f16 or bf16", dtype_name(o_out.dtype));
  check_writable(o_out, "o_out");
  static const char* const kDimNames[] = {"batch", "seqlen", "heads", "head_dim"};
  for (int i = 0; i < 4; ++i) {
    const std::string what = std::string(kDimNames[i]) + " of o_a";
    check_dim("o_b", i, o_b.shape[i], o_a.shape[i], what.c_str());
    check_dim("o_out", i, o_out.shape[i], o_a.shape[i], what.c_str());
  }
  p.batch = o_a.shape[0];
  p.seqlen = o_a.shape[1];
  p.heads = o_a.shape[2];
  p.head_dim = o_a.shape[3];
  check_head_dim("o_a", 3, p.head_dim, "head_dim");
  auto check_lse = [&](const TensorView& l, const char* name, bool output) {
    if (!l.defined()) fail(name, "an f32 [batch, heads, seqlen] tensor", "undefined");
    check_view_as(l, name, 3, o_a, "o_a");
    check_dtype(l, name, DType::f32);
    check_dim(name, 0, l.shape[0], p.batch, "batch of o_a");
    check_dim(name, 1, l.shape[1], p.heads, "heads of o_a");
    check_dim(name, 2, l.shape[2], p.seqlen, "seqlen of o_a");
    if (output) check_writable(l, name);
    return Strides3{l.stride[0], l.stride[2], l.stride[1]};
  };
  p.la_stride = check_lse(lse_a, "lse_a", false);
  p.lb_stride = check_lse(lse_b, "lse_b", false);
  if (lse_out.defined()) {
    p.lo_stride = check_lse(lse_out, "lse_out", true);
    p.lse_out = static_cast<float*>(lse_out.data);
  }
  if (ctx.num_threads < 0) fail("ctx.num_threads", ">= 0 (0 = all)", i2s(ctx.num_threads));
  p.o_a = o_a.data;
  p.o_b = o_b.data;
  p.o_out = o_out.data;
  p.lse_a = static_cast<const float*>(lse_a.data);
  p.lse_b = static_cast<const float*>(lse_b.data);
  p.oa_stride = {o_a.stride[0], o_a.stride[1], o_a.stride[2]};
  p.ob_stride = {o_b.stride[0], o_b.stride[1], o_b.stride[2]};
  p.oo_stride = {o_out.stride[0], o_out.stride[1], o_out.stride[2]};
  p.dtype = o_a.dtype;
  p.dtype_b = o_b.dtype;
  p.dtype_out = o_out.dtype;
  p.device = o_a.device;
  p.device_index = o_a.device_index;
  p.stream = ctx.stream;
  p.num_threads = ctx.num_threads;
  return p;
}

}  // namespace
}  // namespace detail

KernelChoice append_kv(const TensorView& k_new, const TensorView& v_new, const TensorView& slot_mapping,
                       const KVCache& cache, const Context& ctx) {
  using namespace detail;
  const AppendProblem p = validate_append(k_new, v_new, slot_mapping, cache, ctx);
  const std::string shape = std::string(dtype_name(p.new_dtype)) + "->" + dtype_name(p.cache_dtype) + " hdim" +
                            i2s(p.head_dim) + (p.head_dim_v != p.head_dim ? "/" + i2s(p.head_dim_v) : "") +
                            " page" + i2s(p.page_size);
  if (p.device == Device::cuda) {
    KernelChoice c{"cuda/append_kv " + shape,
                   std::string(is_8bit(p.cache_dtype) ? "quantise with the per-kv-head scales, round to nearest, saturate"
                                                      : "convert to the cache dtype (round to nearest even)") +
                       "; one warp per (token, kv head); slots outside 0..pages*page_size-1 skipped on the device"};
    log_choice("append_kv", c);
    cuda_append_kv(p);
    return c;
  }
  KernelChoice c{"cpu/append_kv " + shape,
                 is_8bit(p.cache_dtype) ? "quantise with the per-kv-head scales, round to nearest, saturate"
                                        : "convert to the cache dtype (round to nearest even)"};
  log_choice("append_kv", c);
  cpu_append_kv(p);
  return c;
}

KernelChoice merge_states(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
                          const TensorView& lse_b, const TensorView& o_out, const TensorView& lse_out,
                          const Context& ctx) {
  using namespace detail;
  const MergeProblem p = validate_merge(o_a, lse_a, o_b, lse_b, o_out, lse_out, ctx);
  const std::string shape = std::string(dtype_name(p.dtype)) + " hdim" + i2s(p.head_dim);
  if (p.device == Device::cuda) {
    KernelChoice c{"cuda/merge_states " + shape, "row-wise log-sum-exp rescale, fp32; one warp per row"};
    log_choice("merge_states", c);
    cuda_merge_states(p);
    return c;
  }
  KernelChoice c{"cpu/merge_states " + shape, "row-wise log-sum-exp rescale, fp32"};
  log_choice("merge_states", c);
  cpu_merge_states(p);
  return c;
}

}  // namespace ioattn

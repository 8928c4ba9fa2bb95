// bench_decode_cuda.cu — ioattn_cuda_decode_bench: split-KV decode on CUDA, one JSON line per cell.
//
//   ioattn_cuda_decode_bench [--batch 1,16,64] [--kv 4096,32768,131072] [--heads-q 32]
//       [--heads-kv 8] [--head-dim 128] [--pages 0,16,64] [--caches bf16,f8e4m3] [--q-dtype bf16]
//       [--seqlen-q 1] [--splits 0] [--repeats 15] [--eager 1] [--copy 1] [--mem-gb 100]
//       [--kernels auto,fma] [--append 0,1]
//
// Every cache holds kv_len tokens per sequence; paged caches (page size > 0) get a shuffled block
// table (pages of a sequence scattered over the pool, as a serving engine leaves them). Per cell:
//   impl "ioattn":       decode under a plan (caller workspace), `inner` calls captured in one CUDA
//                        graph and replayed: GPU time only, as a serving engine runs it;
//   impl "ioattn_eager": the same calls issued from the host (validation + launch each time).
// --kernels: "auto" (the dispatcher's choice: impl "ioattn") and/or "fma" / "mma" (forced through
// IOATTN_DECODE_KERNEL: impl "ioattn_fma" / "ioattn_mma"; 16-bit caches only; fma contiguous only,
// mma also the paged cells); "kernel" names what ran.
// ms is the median per call; tbps = K+V bytes read / s / 1e12 (batch * kv_len * heads_kv *
// (head_dim + head_dim_v) * element bytes; the query, output and partials are not counted).
// Caches smaller than 256 MiB are replicated (up to 8 copies) and the captured calls rotate over
// them, so a cell's bytes come from HBM rather than the 50 MiB L2.
// --append n (n > 0): decode with the fused append of n new tokens per sequence (KVCache::k_new /
// v_new, written at positions kv_len - n .. kv_len - 1 before the attention): impl "..._append<n>";
// tbps still counts the cache's K+V bytes only (the n new rows are not added).
// --seqlen-q > 16 (a prefill chunk against the cache): decode() takes the flash forward's KV-cache
// mode (no plan: plans are for 1..16 rows); per cell impl "ioattn_prefill" (eager calls, --causal 0/1)
// and, in the same run, impl "forward_contiguous": forward() over the same K / V as contiguous
// [batch, kv_len, heads_kv, d] tensors in q's dtype (on sm90 the Hopper kernel), with "tflops" =
// 4 * batch * heads_q * d * (visible query-key pairs) / s (causal: bottom-right aligned).
// --copy 1 adds one line, impl "memcpy": cudaMemcpyAsync device-to-device of 4 GiB, tbps = bytes
// read + written / s (the practical HBM ceiling on this GPU).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "core/serving_problem.hpp"
#include "cuda/bench_util.cuh"
#include "cuda/check.cuh"
#include "ioattn/serving.hpp"

namespace cb = ioattn::cuda::bench;
using namespace ioattn;

namespace {

std::string arg(int argc, char** argv, const char* name, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

std::vector<std::string> parse_names(const std::string& s) {
  std::vector<std::string> v;
  size_t a = 0;
  while (a <= s.size()) {
    const size_t b = s.find(',', a);
    v.push_back(s.substr(a, b == std::string::npos ? std::string::npos : b - a));
    if (b == std::string::npos) break;
    a = b + 1;
  }
  return v;
}

DType dtype_of(const std::string& s) {
  if (s == "bf16") return DType::bf16;
  if (s == "f16") return DType::f16;
  if (s == "f32") return DType::f32;
  if (s == "f8e4m3" || s == "fp8") return DType::f8e4m3;
  if (s == "i8" || s == "int8") return DType::i8;
  throw Error("--caches", "ioattn: unknown dtype " + s);
}

// Random f8e4m3 / i8 codes (never the e4m3 NaN code 0x7f / 0xff) from a counter hash.
__global__ void fill_codes_kernel(uint8_t* x, int64_t n, uint64_t seed, bool e4m3) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t z = cb::splitmix64(seed, i);
    x[i] = e4m3 ? static_cast<uint8_t>(((z >> 8) % 0x7e) | ((z >> 16) & 0x80)) : static_cast<uint8_t>(z >> 8);
  }
}

void fill(void* p, DType t, int64_t n, uint64_t seed) {
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  if (t == DType::f8e4m3 || t == DType::i8) {
    fill_codes_kernel<<<blocks, 256>>>(static_cast<uint8_t*>(p), n, seed, t == DType::f8e4m3);
    IOATTN_CUDA_CHECK_LAUNCH("fill_codes_kernel");
  } else if (t == DType::f32) {
    throw Error("--caches", "ioattn: the decode benchmark fills bf16 / f16 / 8-bit caches");
  } else {
    cb::fill_uniform(p, t == DType::bf16, n, seed);
  }
}

struct DevMem {
  void* p = nullptr;
  explicit DevMem(size_t n) { IOATTN_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 16))); }
  ~DevMem() { cudaFree(p); }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
};

struct Cell {
  int64_t batch, kv, hq, hkv, d, sq, page;
  DType cache, qt;
  int splits;
  int64_t append = 0;  // fused append of this many tokens per sequence (0 = none)
};

// The cache's metadata on the device: the block table, a shuffled permutation of the pool
// (IOATTN_BENCH_PAGES_IN_ORDER=1: the identity, a probe of what the shuffle costs); every length
// kv_len; the 8-bit caches' per-kv-head scales.
struct CacheMeta {
  DevMem bt, lens, scales;
  CacheMeta(const Cell& c, int64_t pages)
      : bt(static_cast<size_t>(std::max<int64_t>(pages, 1)) * 4), lens(static_cast<size_t>(c.batch) * 4),
        scales(static_cast<size_t>(c.hkv) * 4) {
    std::vector<int32_t> table(static_cast<size_t>(std::max<int64_t>(pages, 1)));
    std::iota(table.begin(), table.end(), 0);
    std::mt19937_64 rng(3);
    const char* in_order = std::getenv("IOATTN_BENCH_PAGES_IN_ORDER");
    if (in_order == nullptr || std::strcmp(in_order, "1") != 0) std::shuffle(table.begin(), table.end(), rng);
    IOATTN_CUDA_CHECK(cudaMemcpy(bt.p, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    const std::vector<int32_t> lv(static_cast<size_t>(c.batch), static_cast<int32_t>(c.kv));
    IOATTN_CUDA_CHECK(cudaMemcpy(lens.p, lv.data(), lv.size() * 4, cudaMemcpyHostToDevice));
    const std::vector<float> sc(static_cast<size_t>(c.hkv), c.cache == DType::f8e4m3 ? 1.0f / 448 : 1.0f / 127);
    IOATTN_CUDA_CHECK(cudaMemcpy(scales.p, sc.data(), sc.size() * 4, cudaMemcpyHostToDevice));
  }
};

void print_line(const Cell& c, const char* impl, int splits, double ms, double bytes, const std::string& kernel) {
  std::printf(
      "{\"batch\": %lld, \"heads_q\": %lld, \"heads_kv\": %lld, \"head_dim\": %lld, \"seqlen_q\": %lld, "
      "\"kv_len\": %lld, \"page_size\": %lld, \"cache\": \"%s\", \"q_dtype\": \"%s\", \"impl\": \"%s\", "
      "\"splits\": %d, \"ms\": %.5f, \"tbps\": %.4f, \"kernel\": \"%s\"}\n",
      static_cast<long long>(c.batch), static_cast<long long>(c.hq), static_cast<long long>(c.hkv),
      static_cast<long long>(c.d), static_cast<long long>(c.sq), static_cast<long long>(c.kv),
      static_cast<long long>(c.page), dtype_name(c.cache), dtype_name(c.qt), impl, splits, ms,
      bytes / (ms * 1e-3) / 1e12, kernel.c_str());
  std::fflush(stdout);
}

void run_cell(const Cell& c, int repeats, bool eager, double mem_limit, const std::string& kernel_mode) {
  if (kernel_mode == "auto")
    unsetenv("IOATTN_DECODE_KERNEL");
  else
    setenv("IOATTN_DECODE_KERNEL", kernel_mode.c_str(), 1);
  const std::string impl = (kernel_mode == "auto" ? std::string("ioattn") : "ioattn_" + kernel_mode) +
                           (c.append > 0 ? "_append" + std::to_string(c.append) : std::string());
  const int64_t es = dtype_size(c.cache), qs = dtype_size(c.qt);
  const bool paged = c.page > 0;
  const int64_t ps = paged ? c.page : c.kv;
  const int64_t pages_per_seq = (c.kv + ps - 1) / ps;
  const int64_t pages = c.batch * pages_per_seq;
  const int64_t cache_elems = pages * ps * c.hkv * c.d;
  const double kv_bytes = static_cast<double>(c.batch) * c.kv * c.hkv * 2 * c.d * es;
  const double one_copy = 2.0 * cache_elems * es;
  const int copies = static_cast<int>(std::clamp<double>(std::ceil(256.0 * (1 << 20) / one_copy), 1, 8));
  size_t free_b = 0, total_b = 0;
  IOATTN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (one_copy * copies > std::min<double>(mem_limit, 0.9 * free_b)) {
    std::fprintf(stderr, "skip batch %lld kv %lld page %lld %s: %.1f GB does not fit\n",
                 static_cast<long long>(c.batch), static_cast<long long>(c.kv), static_cast<long long>(c.page),
                 dtype_name(c.cache), one_copy * copies / 1e9);
    return;
  }
  std::vector<std::unique_ptr<DevMem>> kc, vc;
  for (int i = 0; i < copies; ++i) {
    kc.push_back(std::make_unique<DevMem>(static_cast<size_t>(cache_elems * es)));
    vc.push_back(std::make_unique<DevMem>(static_cast<size_t>(cache_elems * es)));
    fill(kc.back()->p, c.cache, cache_elems, 1000 + 2 * i);
    fill(vc.back()->p, c.cache, cache_elems, 1001 + 2 * i);
  }
  const int64_t qn = c.batch * c.sq * c.hq * c.d;
  DevMem q(static_cast<size_t>(qn * qs)), o(static_cast<size_t>(qn * qs)),
      lse(static_cast<size_t>(c.batch * c.hq * c.sq * 4));
  fill(q.p, c.qt, qn, 7);
  const int64_t nn = c.batch * std::max<int64_t>(c.append, 1) * c.hkv * c.d;  // the fused append's tokens
  DevMem kn(static_cast<size_t>(nn * qs)), vn(static_cast<size_t>(nn * qs));
  fill(kn.p, c.qt, nn, 8);
  fill(vn.p, c.qt, nn, 9);
  const CacheMeta meta(c, pages);
  const DevMem &bt = meta.bt, &lens = meta.lens, &scales = meta.scales;

  const bool q8 = c.cache == DType::f8e4m3 || c.cache == DType::i8;
  // IOATTN_BENCH_HEAD_MAJOR=1 (contiguous caches): the same [batch, capacity, kv heads, d] view over
  // memory laid out [batch, kv heads, capacity, d], so each kv head's rows are one stream (a probe
  // of the DRAM access pattern, not a layout the API prefers).
  static const bool head_major = [] {
    const char* e = std::getenv("IOATTN_BENCH_HEAD_MAJOR");
    return e && std::strcmp(e, "1") == 0;
  }();
  auto view = [&](void* ptr) {
    if (head_major && !paged)
      return TensorView::strided(ptr, c.cache, {c.batch, ps, c.hkv, c.d}, {ps * c.hkv * c.d, c.d, ps * c.d, 1},
                                 Device::cuda);
    return TensorView::contiguous(ptr, c.cache, {paged ? pages : c.batch, ps, c.hkv, c.d}, Device::cuda);
  };
  auto cache_of = [&](int i) {
    KVCache kv;
    kv.k_cache = view(kc[static_cast<size_t>(i)]->p);
    kv.v_cache = view(vc[static_cast<size_t>(i)]->p);
    if (paged) kv.block_table = TensorView::contiguous(bt.p, DType::i32, {c.batch, pages_per_seq}, Device::cuda);
    kv.cache_seqlens = TensorView::contiguous(lens.p, DType::i32, {c.batch}, Device::cuda);
    if (q8) {
      kv.k_scale = TensorView::contiguous(scales.p, DType::f32, {c.hkv}, Device::cuda);
      kv.v_scale = TensorView::contiguous(scales.p, DType::f32, {c.hkv}, Device::cuda);
    }
    if (c.append > 0) {
      kv.k_new = TensorView::contiguous(kn.p, c.qt, {c.batch, c.append, c.hkv, c.d}, Device::cuda);
      kv.v_new = TensorView::contiguous(vn.p, c.qt, {c.batch, c.append, c.hkv, c.d}, Device::cuda);
    }
    return kv;
  };
  const TensorView qv = TensorView::contiguous(q.p, c.qt, {c.batch, c.sq, c.hq, c.d}, Device::cuda);
  const TensorView ov = TensorView::contiguous(o.p, c.qt, {c.batch, c.sq, c.hq, c.d}, Device::cuda);
  const TensorView lv_ = TensorView::contiguous(lse.p, DType::f32, {c.batch, c.hq, c.sq}, Device::cuda);
  DecodeOptions opt;
  opt.num_splits = c.splits;
  opt.cache_dtype = c.cache;  // the split heuristic's hint
  const DecodePlan plan =
      plan_decode(c.batch, c.hq, c.hkv, c.d, c.d, c.sq, c.kv, paged ? c.page : 0, Device::cuda, opt);
  DevMem ws(plan.workspace_bytes);
  AttnParams prm;
  cudaStream_t stream;
  IOATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Context ctx;
  ctx.stream = stream;
  const KernelChoice choice = decode(qv, cache_of(0), ov, lv_, prm, plan, ws.p, ctx);
  IOATTN_CUDA_CHECK(cudaStreamSynchronize(stream));

  // One graph of `inner` calls rotating over the copies.
  cudaEvent_t e0, e1;
  IOATTN_CUDA_CHECK(cudaEventCreate(&e0));
  IOATTN_CUDA_CHECK(cudaEventCreate(&e1));
  auto time_once = [&](const std::function<void()>& fn) {
    IOATTN_CUDA_CHECK(cudaEventRecord(e0, stream));
    fn();
    IOATTN_CUDA_CHECK(cudaEventRecord(e1, stream));
    IOATTN_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    IOATTN_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    return static_cast<double>(t);
  };
  const double first = time_once([&] { decode(qv, cache_of(0), ov, lv_, prm, plan, ws.p, ctx); });
  const int inner = std::max(copies, std::min(64, std::max(4, static_cast<int>(4.0 / std::max(first, 1e-3)))));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  IOATTN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < inner; ++i) decode(qv, cache_of(i % copies), ov, lv_, prm, plan, ws.p, ctx);
  IOATTN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  IOATTN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int w = 0; w < 3; ++w) IOATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r)
    ms.push_back(time_once([&] { IOATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }) / inner);
  std::sort(ms.begin(), ms.end());
  print_line(c, impl.c_str(), plan.num_splits, ms[ms.size() / 2], kv_bytes, choice.kernel);
  IOATTN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  IOATTN_CUDA_CHECK(cudaGraphDestroy(graph));

  if (eager) {
    std::vector<double> me;
    for (int r = 0; r < repeats; ++r)
      me.push_back(time_once([&] {
                     for (int i = 0; i < inner; ++i) decode(qv, cache_of(i % copies), ov, lv_, prm, plan, ws.p, ctx);
                   }) /
                   inner);
    std::sort(me.begin(), me.end());
    print_line(c, (impl + "_eager").c_str(), plan.num_splits, me[me.size() / 2], kv_bytes, choice.kernel);
  }
  IOATTN_CUDA_CHECK(cudaEventDestroy(e0));
  IOATTN_CUDA_CHECK(cudaEventDestroy(e1));
  IOATTN_CUDA_CHECK(cudaStreamDestroy(stream));
}

// A prefill chunk of c.sq rows against c.kv cached tokens per sequence (see the file comment).
void run_prefill_cell(const Cell& c, int repeats, bool causal) {
  const int64_t es = dtype_size(c.cache), qs = dtype_size(c.qt);
  const bool paged = c.page > 0;
  const int64_t ps = paged ? c.page : c.kv;
  const int64_t pages_per_seq = (c.kv + ps - 1) / ps;
  const int64_t pages = c.batch * pages_per_seq;
  const int64_t cache_elems = pages * ps * c.hkv * c.d, kv_elems = c.batch * c.kv * c.hkv * c.d;
  DevMem kc(static_cast<size_t>(cache_elems * es)), vc(static_cast<size_t>(cache_elems * es));
  fill(kc.p, c.cache, cache_elems, 1000);
  fill(vc.p, c.cache, cache_elems, 1001);
  DevMem kf(static_cast<size_t>(kv_elems * qs)), vf(static_cast<size_t>(kv_elems * qs));  // the peer's K / V
  fill(kf.p, c.qt, kv_elems, 1002);
  fill(vf.p, c.qt, kv_elems, 1003);
  const int64_t qn = c.batch * c.sq * c.hq * c.d;
  DevMem q(static_cast<size_t>(qn * qs)), o(static_cast<size_t>(qn * qs)),
      lse(static_cast<size_t>(c.batch * c.hq * c.sq * 4));
  fill(q.p, c.qt, qn, 7);
  const CacheMeta meta(c, pages);
  const DevMem &bt = meta.bt, &lens = meta.lens, &scales = meta.scales;
  KVCache kv;
  kv.k_cache = TensorView::contiguous(kc.p, c.cache, {paged ? pages : c.batch, ps, c.hkv, c.d}, Device::cuda);
  kv.v_cache = TensorView::contiguous(vc.p, c.cache, {paged ? pages : c.batch, ps, c.hkv, c.d}, Device::cuda);
  if (paged) kv.block_table = TensorView::contiguous(bt.p, DType::i32, {c.batch, pages_per_seq}, Device::cuda);
  kv.cache_seqlens = TensorView::contiguous(lens.p, DType::i32, {c.batch}, Device::cuda);
  if (c.cache == DType::f8e4m3 || c.cache == DType::i8) {
    kv.k_scale = TensorView::contiguous(scales.p, DType::f32, {c.hkv}, Device::cuda);
    kv.v_scale = TensorView::contiguous(scales.p, DType::f32, {c.hkv}, Device::cuda);
  }
  const TensorView qv = TensorView::contiguous(q.p, c.qt, {c.batch, c.sq, c.hq, c.d}, Device::cuda);
  const TensorView ov = TensorView::contiguous(o.p, c.qt, {c.batch, c.sq, c.hq, c.d}, Device::cuda);
  const TensorView lse_v = TensorView::contiguous(lse.p, DType::f32, {c.batch, c.hq, c.sq}, Device::cuda);
  const TensorView kfv = TensorView::contiguous(kf.p, c.qt, {c.batch, c.kv, c.hkv, c.d}, Device::cuda);
  const TensorView vfv = TensorView::contiguous(vf.p, c.qt, {c.batch, c.kv, c.hkv, c.d}, Device::cuda);
  AttnParams prm;
  prm.causal = causal;
  const Context ctx;  // the default stream, which time_ms records on
  // Visible (query, key) pairs: row i sees keys [0, kv - sq + i] when causal (bottom-right).
  double pairs = static_cast<double>(c.sq) * c.kv;
  if (causal)
    for (int64_t i = 0; i < c.sq; ++i) pairs -= static_cast<double>(std::min<int64_t>(c.kv, c.sq - 1 - i));
  const double flops = 4.0 * c.batch * c.hq * c.d * pairs;
  struct Impl {
    const char* name;
    std::function<KernelChoice()> call;
  };
  const Impl impls[] = {{"ioattn_prefill", [&] { return decode(qv, kv, ov, lse_v, prm, DecodeOptions{}, ctx); }},
                        {"forward_contiguous", [&] { return forward(qv, kfv, vfv, ov, lse_v, prm, ctx); }}};
  for (const Impl& im : impls) {
    const KernelChoice choice = im.call();
    IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
    const double ms = cb::time_ms([&] { im.call(); }, 3, repeats, 4);
    std::printf("{\"batch\": %lld, \"heads_q\": %lld, \"heads_kv\": %lld, \"head_dim\": %lld, \"seqlen_q\": %lld, "
                "\"kv_len\": %lld, \"page_size\": %lld, \"cache\": \"%s\", \"q_dtype\": \"%s\", \"causal\": %d, "
                "\"impl\": \"%s\", \"ms\": %.5f, \"tflops\": %.2f, \"kernel\": \"%s\"}\n",
                static_cast<long long>(c.batch), static_cast<long long>(c.hq), static_cast<long long>(c.hkv),
                static_cast<long long>(c.d), static_cast<long long>(c.sq), static_cast<long long>(c.kv),
                static_cast<long long>(c.page), dtype_name(c.cache), dtype_name(c.qt), causal ? 1 : 0, im.name, ms,
                flops / (ms * 1e-3) / 1e12, choice.kernel.c_str());
    std::fflush(stdout);
  }
}

void run_copy(int repeats) {
  const size_t bytes = size_t{4} << 30;
  DevMem a(bytes), b(bytes);
  IOATTN_CUDA_CHECK(cudaMemset(a.p, 1, bytes));
  IOATTN_CUDA_CHECK(cudaMemcpy(b.p, a.p, bytes, cudaMemcpyDeviceToDevice));
  const double ms = cb::time_ms([&] { IOATTN_CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice)); },
                                2, repeats, 1);
  std::printf("{\"impl\": \"memcpy\", \"bytes\": %zu, \"ms\": %.4f, \"tbps\": %.4f}\n", bytes, ms,
              2.0 * bytes / (ms * 1e-3) / 1e12);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (detail::cuda_device_count() == 0) {
      std::fprintf(stderr, "skipped: no CUDA device\n");
      return 0;
    }
    const auto batches = cb::parse_list(arg(argc, argv, "--batch", "1,16,64"));
    const auto kvs = cb::parse_list(arg(argc, argv, "--kv", "4096,32768,131072"));
    const auto pages = cb::parse_list(arg(argc, argv, "--pages", "0,16,64"));
    const auto caches = parse_names(arg(argc, argv, "--caches", "bf16,f8e4m3"));
    Cell base{};
    base.hq = std::stoll(arg(argc, argv, "--heads-q", "32"));
    base.hkv = std::stoll(arg(argc, argv, "--heads-kv", "8"));
    base.d = std::stoll(arg(argc, argv, "--head-dim", "128"));
    base.sq = std::stoll(arg(argc, argv, "--seqlen-q", "1"));
    base.qt = dtype_of(arg(argc, argv, "--q-dtype", "bf16"));
    base.splits = std::stoi(arg(argc, argv, "--splits", "0"));
    const int repeats = std::stoi(arg(argc, argv, "--repeats", "15"));
    const bool eager = arg(argc, argv, "--eager", "1") == "1";
    const double mem_limit = std::stod(arg(argc, argv, "--mem-gb", "100")) * 1e9;
    const auto kernels = parse_names(arg(argc, argv, "--kernels", "auto"));
    const auto appends = cb::parse_list(arg(argc, argv, "--append", "0"));
    if (arg(argc, argv, "--copy", "1") == "1") run_copy(repeats);
    for (const std::string& cs : caches)
      for (int64_t kv : kvs)
        for (int64_t b : batches)
          for (int64_t pg : pages) {
            Cell c = base;
            c.cache = dtype_of(cs);
            if (c.cache == DType::bf16 || c.cache == DType::f16) c.qt = c.cache;
            c.batch = b;
            c.kv = kv;
            c.page = pg;
            for (const std::string& km : kernels)
              for (int64_t ap : appends) {
                // A forced kernel is a comparison row: contiguous 16-bit caches only (8-bit caches
                // always run the FMA kernel); mma runs the paged cells too.
                if (km != "auto" && ((pg != 0 && km != "mma") || dtype_size(c.cache) != 2)) continue;
                c.append = ap;
                try {
                  if (c.sq > 16) {  // a prefill chunk: no plan, no kernel forcing, no append
                    if (km == "auto" && ap == 0)
                      for (int causal : {0, 1}) run_prefill_cell(c, repeats, causal == 1);
                    continue;
                  }
                  run_cell(c, repeats, eager, mem_limit, km);
                } catch (const Error& e) {  // e.g. --kernels mma on an fp8 cache: a line, not the end
                  std::printf("{\"batch\": %lld, \"kv_len\": %lld, \"page_size\": %lld, \"cache\": \"%s\", "
                              "\"impl\": \"ioattn_%s\", \"error\": \"%s\"}\n",
                              static_cast<long long>(b), static_cast<long long>(kv), static_cast<long long>(pg),
                              cs.c_str(), km.c_str(), e.argument().c_str());
                  std::fflush(stdout);
                }
              }
          }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ioattn_cuda_decode_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}

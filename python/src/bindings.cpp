// ioattn._C — the nanobind extension under the `ioattn` Python package.
//
// A thin layer over the public C++ API (include/ioattn/*.hpp) and nothing else: every array
// arrives as an nb::ndarray (numpy, torch, JAX, CuPy, any DLPack producer or buffer), and its
// data pointer, dtype, device, shape and strides (nanobind gives strides in elements, as
// TensorView wants them) go straight into an ioattn::TensorView. No copies, no conversions:
// an array the C++ API cannot take is an ioattn.Error naming the argument.
//
// Functions: forward, forward_varlen, backward, backward_varlen, select_forward, plan_decode
// (class DecodePlan), decode, decode_planned, append_kv, merge_states, build_info, explain, explain_text, online_softmax_example. The Python package (python/ioattn/) allocates
// outputs in the caller's framework and passes them in; this module only describes and runs,
// with the GIL released while the library computes.
//
// Errors: ioattn::Error (a std::invalid_argument) becomes ioattn._C.Error, a subclass of
// ValueError with the C++ message unchanged and the argument name in `.argument`. Wrong Python
// types are nanobind's TypeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ioattn/explain.hpp"
#include "ioattn/ioattn.hpp"
#include "ioattn/serving.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// Inputs are read-only views (nb::ro also admits read-only numpy arrays and broadcast views);
// outputs must be writable.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

[[noreturn]] void fail(const std::string& arg, const std::string& expected, const std::string& got) {
  throw ioattn::Error(arg, "ioattn: argument '" + arg + "': expected " + expected + ", got " + got);
}

std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  std::string base;
  switch (static_cast<Code>(t.code)) {
    case Code::Int: base = "int"; break;
    case Code::UInt: base = "uint"; break;
    case Code::Float: base = "float"; break;
    case Code::Bfloat: base = "bfloat"; break;
    case Code::Complex: base = "complex"; break;
    case Code::Bool: return "bool";
    default: base = "dlpack_code" + std::to_string(t.code) + "_"; break;
  }
  std::string name = base + std::to_string(t.bits);
  if (t.lanes != 1) name += "x" + std::to_string(t.lanes);
  return name;
}

// Which dtypes an argument may have (for the error message only; the C++ API checks the rest).
// cache: a KV cache (the floating types, int8, or uint8 holding float8_e4m3fn codes);
// slots: append_kv's slot mapping (int32 or int64).
enum class Kind { floating, f32_only, i32_only, cache, slots };

const char* kind_expected(Kind k) {
  switch (k) {
    case Kind::floating: return "float32, float16 or bfloat16";
    case Kind::f32_only: return "float32";
    case Kind::i32_only: return "int32";
    case Kind::cache: return "float32, float16, bfloat16, float8_e4m3fn or int8";
    case Kind::slots: return "int32 or int64";
  }
  return "?";
}

ioattn::DType to_dtype(nb::dlpack::dtype t, const std::string& name, Kind kind, bool u16_is_bf16,
                       bool u8_is_e4m3 = false) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  // torch / ml_dtypes float8_e4m3fn travel as their uint8 bit patterns (the Python layer): KV
  // caches, and the fp8 forward's q, k, v (u8_is_e4m3).
  if (t.lanes == 1 && (kind == Kind::cache || kind == Kind::floating) && code == Code::UInt && t.bits == 8 &&
      u8_is_e4m3)
    return ioattn::DType::f8e4m3;
  if (t.lanes == 1 && kind == Kind::cache && code == Code::Int && t.bits == 8) return ioattn::DType::i8;
  if (t.lanes == 1 && kind == Kind::slots && code == Code::Int && t.bits == 64) return ioattn::DType::i64;
  if (t.lanes == 1) {
    if (code == Code::Float && t.bits == 32) return ioattn::DType::f32;
    if (code == Code::Float && t.bits == 16) return ioattn::DType::f16;
    if (code == Code::Bfloat && t.bits == 16) return ioattn::DType::bf16;
    // numpy has no bfloat16 of its own and cannot export ml_dtypes.bfloat16 through DLPack or
    // the buffer protocol; the Python layer passes such arrays as uint16 bit patterns.
    if (code == Code::UInt && t.bits == 16 && u16_is_bf16) return ioattn::DType::bf16;
    if (code == Code::Int && t.bits == 32) return ioattn::DType::i32;
  }
  // (the fp8 forward's q, k, v: e4m3 codes as uint8 too)
  fail(name + ".dtype",
       std::string(kind_expected(kind)) + (kind == Kind::floating && u8_is_e4m3 ? " (or uint8 e4m3 codes)" : ""),
       dlpack_dtype_name(t));
}

// DLPack device types (dlpack.h DLDeviceType).
constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;

const char* dlpack_device_name(int type) {
  switch (type) {
    case 1: return "cpu";
    case 2: return "cuda";
    case 3: return "cuda_host";
    case 4: return "opencl";
    case 7: return "vulkan";
    case 8: return "metal";
    case 9: return "vpi";
    case 10: return "rocm";
    case 11: return "rocm_host";
    case 13: return "cuda_managed";
    case 14: return "oneapi";
    default: return "unknown";
  }
}

template <typename Array>
ioattn::TensorView to_view(const Array& a, const std::string& name, Kind kind, bool u16_is_bf16,
                           bool u8_is_e4m3 = false) {
  ioattn::TensorView t;
  if (a.ndim() > 4)
    fail(name, "at most 4 dims", std::to_string(a.ndim()) + " dims");
  t.dtype = to_dtype(a.dtype(), name, kind, u16_is_bf16, u8_is_e4m3);
  switch (a.device_type()) {
    case kDLCPU:
    case kDLCUDAHost:  // pinned host memory: the CPU reads it directly
      t.device = ioattn::Device::cpu;
      t.device_index = 0;
      break;
    case kDLCUDA:
    case kDLCUDAManaged:
      t.device = ioattn::Device::cuda;
      t.device_index = a.device_id();
      break;
    default:
      fail(name + ".device", "cpu or cuda", dlpack_device_name(a.device_type()));
  }
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = static_cast<int64_t>(a.shape(static_cast<size_t>(i)));
    t.stride[i] = a.stride(static_cast<size_t>(i));  // elements
  }
  return t;
}

ioattn::TensorView to_view_opt(const std::optional<InArray>& a, const std::string& name, Kind kind,
                               bool u16_is_bf16) {
  if (!a) return {};
  return to_view(*a, name, kind, u16_is_bf16);
}

// The fp8 forward's descale factors (float32 [batch, heads_kv]; None = 1) into params.
void set_descales(ioattn::AttnParams& p, const std::optional<InArray>& q_descale,
                  const std::optional<InArray>& k_descale, const std::optional<InArray>& v_descale) {
  p.q_descale = to_view_opt(q_descale, "params.q_descale", Kind::f32_only, false);
  p.k_descale = to_view_opt(k_descale, "params.k_descale", Kind::f32_only, false);
  p.v_descale = to_view_opt(v_descale, "params.v_descale", Kind::f32_only, false);
}

ioattn::Backend to_backend(const std::string& s) {
  if (s == "auto") return ioattn::Backend::automatic;
  if (s == "flash") return ioattn::Backend::flash;
  if (s == "naive") return ioattn::Backend::naive;
  fail("backend", "'auto', 'flash' or 'naive'", "'" + s + "'");
}

// Everything a forward call takes besides the tensors.
struct Options {
  ioattn::AttnParams params;
  ioattn::Context ctx;
};

Options make_options(float scale, bool causal, int64_t window_left, int64_t window_right,
                     float softcap, const std::optional<InArray>& alibi_slopes,
                     const std::optional<InArray>& sinks, const std::string& backend,
                     uintptr_t stream, int num_threads, bool deterministic = false) {
  Options o;
  o.params.scale = scale;
  o.params.causal = causal;
  o.params.window_left = window_left;
  o.params.window_right = window_right;
  o.params.softcap = softcap;
  o.params.alibi_slopes = to_view_opt(alibi_slopes, "params.alibi_slopes", Kind::f32_only, false);
  o.params.sinks = to_view_opt(sinks, "params.sinks", Kind::f32_only, false);
  o.ctx.backend = to_backend(backend);
  o.ctx.stream = reinterpret_cast<void*>(stream);
  o.ctx.num_threads = num_threads;
  o.ctx.deterministic = deterministic;
  return o;
}

using Choice = std::tuple<std::string, std::string>;  // (kernel, reason)

// Runs call (an ioattn entry point returning a KernelChoice) with the GIL released.
template <class F>
Choice without_gil(F&& call) {
  ioattn::KernelChoice c;
  {
    nb::gil_scoped_release nogil;
    c = call();
  }
  return {c.kernel, c.reason};
}

Choice forward(const InArray& q, const InArray& k, const InArray& v, const OutArray& o,
               const std::optional<OutArray>& lse, float scale, bool causal, int64_t window_left,
               int64_t window_right, float softcap, const std::optional<InArray>& alibi_slopes,
               const std::optional<InArray>& sinks, const std::string& backend, uintptr_t stream,
               int num_threads, bool u16_is_bf16, const std::optional<InArray>& q_descale,
               const std::optional<InArray>& k_descale, const std::optional<InArray>& v_descale,
               bool u8_is_e4m3) {
  Options opt = make_options(scale, causal, window_left, window_right, softcap, alibi_slopes, sinks, backend,
                             stream, num_threads);
  set_descales(opt.params, q_descale, k_descale, v_descale);
  const ioattn::TensorView qv = to_view(q, "q", Kind::floating, u16_is_bf16, u8_is_e4m3);
  const ioattn::TensorView kv = to_view(k, "k", Kind::floating, u16_is_bf16, u8_is_e4m3);
  const ioattn::TensorView vv = to_view(v, "v", Kind::floating, u16_is_bf16, u8_is_e4m3);
  const ioattn::TensorView ov = to_view(o, "o", Kind::floating, u16_is_bf16);
  const ioattn::TensorView lv = lse ? to_view(*lse, "lse", Kind::f32_only, false) : ioattn::TensorView{};
  return without_gil([&] { return ioattn::forward(qv, kv, vv, ov, lv, opt.params, opt.ctx); });
}

Choice forward_varlen(const InArray& q, const InArray& k, const InArray& v, const OutArray& o,
                      const std::optional<OutArray>& lse, const InArray& cu_seqlens_q,
                      const InArray& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                      float scale, bool causal, int64_t window_left, int64_t window_right,
                      float softcap, const std::optional<InArray>& alibi_slopes,
                      const std::optional<InArray>& sinks, const std::string& backend,
                      uintptr_t stream, int num_threads, bool u16_is_bf16,
                      const std::optional<InArray>& q_descale, const std::optional<InArray>& k_descale,
                      const std::optional<InArray>& v_descale, bool u8_is_e4m3) {
  Options opt = make_options(scale, causal, window_left, window_right, softcap, alibi_slopes, sinks, backend,
                             stream, num_threads);
  set_descales(opt.params, q_descale, k_descale, v_descale);
  ioattn::Varlen vl;
  vl.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q", Kind::i32_only, false);
  vl.cu_seqlens_k = to_view(cu_seqlens_k, "cu_seqlens_k", Kind::i32_only, false);
  vl.max_seqlen_q = max_seqlen_q;
  vl.max_seqlen_k = max_seqlen_k;
  const ioattn::TensorView qv = to_view(q, "q", Kind::floating, u16_is_bf16, u8_is_e4m3);
  const ioattn::TensorView kv = to_view(k, "k", Kind::floating, u16_is_bf16, u8_is_e4m3);
  const ioattn::TensorView vv = to_view(v, "v", Kind::floating, u16_is_bf16, u8_is_e4m3);
  const ioattn::TensorView ov = to_view(o, "o", Kind::floating, u16_is_bf16);
  const ioattn::TensorView lv = lse ? to_view(*lse, "lse", Kind::f32_only, false) : ioattn::TensorView{};
  return without_gil([&] { return ioattn::forward_varlen(qv, kv, vv, ov, lv, vl, opt.params, opt.ctx); });
}

// Gradients by recomputation: reads q, k, v, o, dout and the forward's lse; writes dq, dk, dv
// (shapes and dtype of q, k, v) and, when given, dsinks (float32 [heads_q]; needs sinks).
struct GradViews {
  ioattn::Gradients g;
  ioattn::TensorView o, dout, lse;
};

GradViews grad_views(const InArray& o, const InArray& dout, const InArray& lse, const OutArray& dq,
                     const OutArray& dk, const OutArray& dv, const std::optional<OutArray>& dsinks,
                     bool u16_is_bf16) {
  GradViews r;
  r.o = to_view(o, "o", Kind::floating, u16_is_bf16);
  r.dout = to_view(dout, "dout", Kind::floating, u16_is_bf16);
  r.lse = to_view(lse, "lse", Kind::f32_only, false);
  r.g.dq = to_view(dq, "dq", Kind::floating, u16_is_bf16);
  r.g.dk = to_view(dk, "dk", Kind::floating, u16_is_bf16);
  r.g.dv = to_view(dv, "dv", Kind::floating, u16_is_bf16);
  if (dsinks) r.g.dsinks = to_view(*dsinks, "grads.dsinks", Kind::f32_only, false);
  return r;
}

Choice backward(const InArray& q, const InArray& k, const InArray& v, const InArray& o,
                const InArray& dout, const InArray& lse, const OutArray& dq, const OutArray& dk,
                const OutArray& dv, const std::optional<OutArray>& dsinks, float scale, bool causal,
                int64_t window_left, int64_t window_right, float softcap,
                const std::optional<InArray>& alibi_slopes, const std::optional<InArray>& sinks,
                const std::string& backend, uintptr_t stream, int num_threads, bool deterministic,
                bool u16_is_bf16) {
  const Options opt = make_options(scale, causal, window_left, window_right, softcap, alibi_slopes,
                                   sinks, backend, stream, num_threads, deterministic);
  const ioattn::TensorView qv = to_view(q, "q", Kind::floating, u16_is_bf16);
  const ioattn::TensorView kv = to_view(k, "k", Kind::floating, u16_is_bf16);
  const ioattn::TensorView vv = to_view(v, "v", Kind::floating, u16_is_bf16);
  const GradViews gv = grad_views(o, dout, lse, dq, dk, dv, dsinks, u16_is_bf16);
  return without_gil([&] { return ioattn::backward(qv, kv, vv, gv.o, gv.dout, gv.lse, gv.g, opt.params, opt.ctx); });
}

Choice backward_varlen(const InArray& q, const InArray& k, const InArray& v, const InArray& o,
                       const InArray& dout, const InArray& lse, const OutArray& dq,
                       const OutArray& dk, const OutArray& dv, const std::optional<OutArray>& dsinks,
                       const InArray& cu_seqlens_q, const InArray& cu_seqlens_k, int64_t max_seqlen_q,
                       int64_t max_seqlen_k, float scale, bool causal, int64_t window_left,
                       int64_t window_right, float softcap, const std::optional<InArray>& alibi_slopes,
                       const std::optional<InArray>& sinks, const std::string& backend,
                       uintptr_t stream, int num_threads, bool deterministic, bool u16_is_bf16) {
  const Options opt = make_options(scale, causal, window_left, window_right, softcap, alibi_slopes,
                                   sinks, backend, stream, num_threads, deterministic);
  ioattn::Varlen vl;
  vl.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q", Kind::i32_only, false);
  vl.cu_seqlens_k = to_view(cu_seqlens_k, "cu_seqlens_k", Kind::i32_only, false);
  vl.max_seqlen_q = max_seqlen_q;
  vl.max_seqlen_k = max_seqlen_k;
  const ioattn::TensorView qv = to_view(q, "q", Kind::floating, u16_is_bf16);
  const ioattn::TensorView kv = to_view(k, "k", Kind::floating, u16_is_bf16);
  const ioattn::TensorView vv = to_view(v, "v", Kind::floating, u16_is_bf16);
  const GradViews gv = grad_views(o, dout, lse, dq, dk, dv, dsinks, u16_is_bf16);
  return without_gil(
      [&] { return ioattn::backward_varlen(qv, kv, vv, gv.o, gv.dout, gv.lse, gv.g, vl, opt.params, opt.ctx); });
}

// Which kernel forward() would run, without running it and without an output buffer: the
// output view borrows q's pointer (never dereferenced) with contiguous [b, sq, hq, dv] strides.
Choice select_forward(const InArray& q, const InArray& k, const InArray& v, float scale, bool causal,
                      int64_t window_left, int64_t window_right, float softcap,
                      const std::optional<InArray>& alibi_slopes, const std::optional<InArray>& sinks,
                      const std::string& backend, uintptr_t stream, int num_threads, bool u16_is_bf16) {
  const Options opt = make_options(scale, causal, window_left, window_right, softcap, alibi_slopes,
                                   sinks, backend, stream, num_threads);
  const ioattn::TensorView qv = to_view(q, "q", Kind::floating, u16_is_bf16);
  const ioattn::TensorView kv = to_view(k, "k", Kind::floating, u16_is_bf16);
  const ioattn::TensorView vv = to_view(v, "v", Kind::floating, u16_is_bf16);
  ioattn::TensorView ov = qv;
  if (qv.ndim == 4 && vv.ndim == 4) {
    ov.shape[3] = vv.shape[3];
    int64_t st = 1;
    for (int d = 3; d >= 0; --d) {
      ov.stride[d] = st;
      st *= ov.shape[d];
    }
  }
  const ioattn::KernelChoice c = ioattn::select_forward(qv, kv, vv, ov, {}, opt.params, opt.ctx);
  return {c.kernel, c.reason};
}

nb::dict build_info() {
  const ioattn::BuildInfo b = ioattn::build_info();
  nb::dict d;
  d["version"] = b.version;
  d["cpu_targets"] = b.cpu_targets;
  d["cpu_best_target"] = b.cpu_best_target;
  d["cpu_threads"] = b.cpu_threads;
  d["cuda_compiled"] = b.cuda_compiled;
  d["cuda_devices"] = b.cuda_devices;
  d["cuda_kernels"] = b.cuda_kernels;
  d["cuda_device_names"] = b.cuda_device_names;
  return d;
}

nb::dict explain(int64_t seqlen, int64_t head_dim, int64_t heads, int64_t layers, int64_t dtype_bytes,
                 int64_t naive_passes, double bandwidth_Bps, double flops_per_s,
                 double attention_share, double kernel_speedup) {
  ioattn::ExplainInput in;
  in.seqlen = seqlen;
  in.head_dim = head_dim;
  in.heads = heads;
  in.layers = layers;
  in.dtype_bytes = dtype_bytes;
  in.naive_passes = naive_passes;
  in.bandwidth_Bps = bandwidth_Bps;
  in.flops_per_s = flops_per_s;
  in.attention_share = attention_share;
  in.kernel_speedup = kernel_speedup;
  const ioattn::ExplainReport r = ioattn::explain(in);
  nb::dict d;
  d["score_bytes_per_head"] = r.score_bytes_per_head;
  d["naive_bytes_per_head"] = r.naive_bytes_per_head;
  d["naive_bytes_per_layer"] = r.naive_bytes_per_layer;
  d["naive_bytes_per_model"] = r.naive_bytes_per_model;
  d["flash_bytes_per_head"] = r.flash_bytes_per_head;
  d["traffic_ratio"] = r.traffic_ratio;
  d["flops_per_head"] = r.flops_per_head;
  d["flops_per_model"] = r.flops_per_model;
  d["naive_traffic_seconds"] = r.naive_traffic_seconds;
  d["flash_traffic_seconds"] = r.flash_traffic_seconds;
  d["math_seconds"] = r.math_seconds;
  d["end_to_end_speedup"] = r.end_to_end_speedup;
  return d;
}

std::string explain_text(int64_t seqlen, int64_t head_dim, int64_t heads, int64_t layers,
                         int64_t dtype_bytes, int64_t naive_passes, double bandwidth_Bps,
                         double flops_per_s, double attention_share, double kernel_speedup) {
  ioattn::ExplainInput in;
  in.seqlen = seqlen;
  in.head_dim = head_dim;
  in.heads = heads;
  in.layers = layers;
  in.dtype_bytes = dtype_bytes;
  in.naive_passes = naive_passes;
  in.bandwidth_Bps = bandwidth_Bps;
  in.flops_per_s = flops_per_s;
  in.attention_share = attention_share;
  in.kernel_speedup = kernel_speedup;
  return ioattn::explain_text(in);
}

nb::dict online_softmax_example(const std::vector<double>& scores, const std::vector<double>& values,
                                int block_size) {
  const ioattn::OnlineSoftmaxExample ex = ioattn::online_softmax_example(scores, values, block_size);
  nb::list steps;
  for (const ioattn::OnlineSoftmaxStep& s : ex.steps) {
    nb::dict st;
    st["block_scores"] = s.block_scores;
    st["max_before"] = s.max_before;
    st["max_after"] = s.max_after;
    st["rescale"] = s.rescale;
    st["sum_after"] = s.sum_after;
    st["acc_after"] = s.acc_after;
    steps.append(st);
  }
  nb::dict d;
  d["steps"] = steps;
  d["probabilities"] = ex.probabilities;
  d["output"] = ex.output;
  d["output_direct"] = ex.output_direct;
  return d;
}

// ---- serving: decode against a (paged) KV cache, append_kv, merge_states -----------------

// The cache views (append_kv writes the caches, decode reads them: either array kind).
template <typename Array>
ioattn::KVCache make_cache(const Array& k_cache, const Array& v_cache, const std::optional<InArray>& cache_seqlens,
                           const std::optional<InArray>& block_table, const std::optional<InArray>& k_scale,
                           const std::optional<InArray>& v_scale, bool u16_is_bf16, bool u8_is_e4m3) {
  ioattn::KVCache c;
  c.k_cache = to_view(k_cache, "cache.k_cache", Kind::cache, u16_is_bf16, u8_is_e4m3);
  c.v_cache = to_view(v_cache, "cache.v_cache", Kind::cache, u16_is_bf16, u8_is_e4m3);
  c.cache_seqlens = to_view_opt(cache_seqlens, "cache.cache_seqlens", Kind::i32_only, false);
  c.block_table = to_view_opt(block_table, "cache.block_table", Kind::i32_only, false);
  c.k_scale = to_view_opt(k_scale, "cache.k_scale", Kind::f32_only, false);
  c.v_scale = to_view_opt(v_scale, "cache.v_scale", Kind::f32_only, false);
  return c;
}

// Everything a decode call takes but the plan / split count: decode and decode_planned alike.
struct DecodeCall {
  Options opt;
  ioattn::KVCache cache;
  ioattn::TensorView q, o, lse;
};

DecodeCall make_decode_call(const InArray& q, const InArray& k_cache, const InArray& v_cache,
                            const InArray& cache_seqlens, const OutArray& o, const std::optional<OutArray>& lse,
                            const std::optional<InArray>& block_table, const std::optional<InArray>& k_scale,
                            const std::optional<InArray>& v_scale, float scale, bool causal, int64_t window_left,
                            int64_t window_right, float softcap, const std::optional<InArray>& alibi_slopes,
                            const std::optional<InArray>& sinks, uintptr_t stream, int num_threads,
                            bool u16_is_bf16, bool u8_is_e4m3, const std::optional<InArray>& k_new,
                            const std::optional<InArray>& v_new) {
  DecodeCall d{make_options(scale, causal, window_left, window_right, softcap, alibi_slopes, sinks, "auto", stream,
                            num_threads),
               make_cache(k_cache, v_cache, std::optional<InArray>(cache_seqlens), block_table, k_scale, v_scale,
                          u16_is_bf16, u8_is_e4m3),
               to_view(q, "q", Kind::floating, u16_is_bf16),
               to_view(o, "o", Kind::floating, u16_is_bf16),
               lse ? to_view(*lse, "lse", Kind::f32_only, false) : ioattn::TensorView{}};
  // the fused append's new tokens (the Python layer checks that the caches are writable)
  d.cache.k_new = to_view_opt(k_new, "cache.k_new", Kind::floating, u16_is_bf16);
  d.cache.v_new = to_view_opt(v_new, "cache.v_new", Kind::floating, u16_is_bf16);
  return d;
}

Choice decode(const InArray& q, const InArray& k_cache, const InArray& v_cache, const InArray& cache_seqlens,
              const OutArray& o, const std::optional<OutArray>& lse, const std::optional<InArray>& block_table,
              const std::optional<InArray>& k_scale, const std::optional<InArray>& v_scale, float scale,
              bool causal, int64_t window_left, int64_t window_right, float softcap,
              const std::optional<InArray>& alibi_slopes, const std::optional<InArray>& sinks, int num_splits,
              uintptr_t stream, int num_threads, bool u16_is_bf16, bool u8_is_e4m3,
              const std::optional<InArray>& k_new, const std::optional<InArray>& v_new) {
  const DecodeCall d = make_decode_call(q, k_cache, v_cache, cache_seqlens, o, lse, block_table, k_scale, v_scale,
                                        scale, causal, window_left, window_right, softcap, alibi_slopes, sinks,
                                        stream, num_threads, u16_is_bf16, u8_is_e4m3, k_new, v_new);
  ioattn::DecodeOptions dopt;
  dopt.num_splits = num_splits;
  return without_gil([&] { return ioattn::decode(d.q, d.cache, d.o, d.lse, d.opt.params, dopt, d.opt.ctx); });
}

ioattn::DType parse_dtype(const std::string& s, const std::string& arg) {
  for (ioattn::DType t : {ioattn::DType::f32, ioattn::DType::f16, ioattn::DType::bf16, ioattn::DType::f8e4m3,
                          ioattn::DType::i8})
    if (s == ioattn::dtype_name(t)) return t;
  fail(arg, "'f32', 'f16', 'bf16', 'f8e4m3' or 'i8'", "'" + s + "'");
}

ioattn::DecodePlan plan_decode(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t head_dim_v,
                               int64_t seqlen_q, int64_t max_seqlen_k, int64_t page_size, const std::string& device,
                               int device_index, int num_splits, const std::string& cache_dtype) {
  ioattn::Device dev;
  if (device == "cpu")
    dev = ioattn::Device::cpu;
  else if (device == "cuda")
    dev = ioattn::Device::cuda;
  else
    fail("device", "'cpu' or 'cuda'", "'" + device + "'");
  ioattn::DecodeOptions opt;
  opt.num_splits = num_splits;
  opt.cache_dtype = parse_dtype(cache_dtype, "opt.cache_dtype");
  return ioattn::plan_decode(batch, heads_q, heads_kv, head_dim, head_dim_v, seqlen_q, max_seqlen_k, page_size, dev,
                             opt, device_index);
}

// decode under a plan, with a caller-owned workspace of at least plan.workspace_bytes (any dtype,
// contiguous, on q's device): no allocation, so a CUDA graph can capture it.
Choice decode_planned(const InArray& q, const InArray& k_cache, const InArray& v_cache, const InArray& cache_seqlens,
                      const OutArray& o, const std::optional<OutArray>& lse, const ioattn::DecodePlan& plan,
                      const OutArray& workspace, const std::optional<InArray>& block_table,
                      const std::optional<InArray>& k_scale, const std::optional<InArray>& v_scale, float scale,
                      bool causal, int64_t window_left, int64_t window_right, float softcap,
                      const std::optional<InArray>& alibi_slopes, const std::optional<InArray>& sinks,
                      uintptr_t stream, int num_threads, bool u16_is_bf16, bool u8_is_e4m3,
                      const std::optional<InArray>& k_new, const std::optional<InArray>& v_new) {
  const DecodeCall d = make_decode_call(q, k_cache, v_cache, cache_seqlens, o, lse, block_table, k_scale, v_scale,
                                        scale, causal, window_left, window_right, softcap, alibi_slopes, sinks,
                                        stream, num_threads, u16_is_bf16, u8_is_e4m3, k_new, v_new);
  const ioattn::TensorView& qv = d.q;
  if (workspace.nbytes() < plan.workspace_bytes)
    fail("workspace", "at least plan.workspace_bytes = " + std::to_string(plan.workspace_bytes) + " bytes",
         std::to_string(workspace.nbytes()) + " bytes");
  bool contiguous = true;
  for (size_t i = 0, expect = 1; i < workspace.ndim(); ++i) {
    const size_t dim = workspace.ndim() - 1 - i;
    if (workspace.shape(dim) > 1 && static_cast<size_t>(workspace.stride(dim)) != expect) contiguous = false;
    expect *= workspace.shape(dim);
  }
  if (!contiguous) fail("workspace", "a contiguous array", "strides that are not contiguous");
  const int ws_dev = workspace.device_type() == kDLCUDA || workspace.device_type() == kDLCUDAManaged ? 1 : 0;
  if (ws_dev != (qv.device == ioattn::Device::cuda ? 1 : 0))
    fail("workspace.device", ioattn::device_name(qv.device), dlpack_device_name(workspace.device_type()));
  if (ws_dev && static_cast<int>(workspace.device_id()) != qv.device_index)
    fail("workspace.device", "cuda:" + std::to_string(qv.device_index) + " (q's device)",
         "cuda:" + std::to_string(workspace.device_id()));
  return without_gil(
      [&] { return ioattn::decode(d.q, d.cache, d.o, d.lse, d.opt.params, plan, workspace.data(), d.opt.ctx); });
}

Choice append_kv(const InArray& k_new, const InArray& v_new, const InArray& slot_mapping, const OutArray& k_cache,
                 const OutArray& v_cache, const std::optional<InArray>& k_scale, const std::optional<InArray>& v_scale,
                 uintptr_t stream, bool u16_is_bf16, bool u8_is_e4m3) {
  const ioattn::KVCache cache =
      make_cache(k_cache, v_cache, std::nullopt, std::nullopt, k_scale, v_scale, u16_is_bf16, u8_is_e4m3);
  const ioattn::TensorView kv = to_view(k_new, "k_new", Kind::floating, u16_is_bf16);
  const ioattn::TensorView vv = to_view(v_new, "v_new", Kind::floating, u16_is_bf16);
  const ioattn::TensorView sv = to_view(slot_mapping, "slot_mapping", Kind::slots, false);
  ioattn::Context ctx;
  ctx.stream = reinterpret_cast<void*>(stream);
  return without_gil([&] { return ioattn::append_kv(kv, vv, sv, cache, ctx); });
}

Choice merge_states(const InArray& o_a, const InArray& lse_a, const InArray& o_b, const InArray& lse_b,
                    const OutArray& o_out, const OutArray& lse_out, uintptr_t stream, bool u16_is_bf16) {
  const ioattn::TensorView oa = to_view(o_a, "o_a", Kind::floating, u16_is_bf16);
  const ioattn::TensorView la = to_view(lse_a, "lse_a", Kind::f32_only, false);
  const ioattn::TensorView ob = to_view(o_b, "o_b", Kind::floating, u16_is_bf16);
  const ioattn::TensorView lb = to_view(lse_b, "lse_b", Kind::f32_only, false);
  const ioattn::TensorView oo = to_view(o_out, "o_out", Kind::floating, u16_is_bf16);
  const ioattn::TensorView lo = to_view(lse_out, "lse_out", Kind::f32_only, false);
  ioattn::Context ctx;
  ctx.stream = reinterpret_cast<void*>(stream);
  return without_gil([&] { return ioattn::merge_states(oa, la, ob, lb, oo, lo, ctx); });
}

// ioattn._C.Error: ValueError + `.argument`. A strong reference kept for the process lifetime
// (extension modules are never unloaded).
PyObject* g_error_type = nullptr;

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "ioattn._C: nanobind bindings of the ioattn C++ API (use the `ioattn` package).";

  g_error_type = PyErr_NewExceptionWithDoc(
      "ioattn._C.Error",
      "An argument the ioattn C++ API rejected. A ValueError; `.argument` names the argument.",
      PyExc_ValueError, nullptr);
  if (!g_error_type) throw nb::python_error();
  m.attr("Error") = nb::borrow(g_error_type);
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void*) {
        try {
          std::rethrow_exception(p);
        } catch (const ioattn::Error& e) {
          nb::object err = nb::borrow(g_error_type)(nb::str(e.what()));
          err.attr("argument") = nb::str(e.argument().c_str());
          PyErr_SetObject(g_error_type, err.ptr());
        }
      },
      nullptr);

  m.attr("__version__") = ioattn::build_info().version;

  m.def("forward", &forward, "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a.none(), nb::kw_only(),
        "scale"_a = 0.0f, "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1,
        "softcap"_a = 0.0f, "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none(),
        "backend"_a = "auto", "stream"_a = 0, "num_threads"_a = 0, "u16_is_bf16"_a = false,
        "q_descale"_a.none() = nb::none(), "k_descale"_a.none() = nb::none(), "v_descale"_a.none() = nb::none(),
        "u8_is_e4m3"_a = false,
        "Runs ioattn::forward on q, k, v [b, s, h, d], writing o [b, sq, hq, dv] and (unless None) "
        "lse [b, hq, sq] float32. stream is a cudaStream_t as an integer (0 = default). With "
        "u16_is_bf16, uint16 arrays are read as bfloat16 bit patterns; with u8_is_e4m3, uint8 q / k / v "
        "as float8_e4m3fn codes (the fp8 forward: o bfloat16 or float16, descales float32 "
        "[batch, heads_kv] or None). Returns (kernel, reason).");
  m.def("forward_varlen", &forward_varlen, "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a.none(),
        "cu_seqlens_q"_a, "cu_seqlens_k"_a, "max_seqlen_q"_a = 0, "max_seqlen_k"_a = 0, nb::kw_only(),
        "scale"_a = 0.0f, "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1,
        "softcap"_a = 0.0f, "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none(),
        "backend"_a = "auto", "stream"_a = 0, "num_threads"_a = 0, "u16_is_bf16"_a = false,
        "q_descale"_a.none() = nb::none(), "k_descale"_a.none() = nb::none(), "v_descale"_a.none() = nb::none(),
        "u8_is_e4m3"_a = false,
        "Runs ioattn::forward_varlen on packed q [total_q, hq, d], k, v [total_k, hkv, d] with int32 "
        "cu_seqlens [batch + 1], writing o [total_q, hq, dv] and (unless None) lse [hq, total_q]. "
        "u8_is_e4m3 and the descales as for forward. Returns (kernel, reason).");
  m.def("backward", &backward, "q"_a, "k"_a, "v"_a, "o"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a,
        "dv"_a, "dsinks"_a.none(), nb::kw_only(), "scale"_a = 0.0f, "causal"_a = false,
        "window_left"_a = -1, "window_right"_a = -1, "softcap"_a = 0.0f,
        "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none(), "backend"_a = "auto",
        "stream"_a = 0, "num_threads"_a = 0, "deterministic"_a = false, "u16_is_bf16"_a = false,
        "Runs ioattn::backward: from the forward's q, k, v, o, lse and dout (shape of o), writes "
        "dq, dk, dv (shapes of q, k, v) and, unless None, dsinks float32 [heads_q] (needs sinks). "
        "Returns (kernel, reason).");
  m.def("backward_varlen", &backward_varlen, "q"_a, "k"_a, "v"_a, "o"_a, "dout"_a, "lse"_a, "dq"_a,
        "dk"_a, "dv"_a, "dsinks"_a.none(), "cu_seqlens_q"_a, "cu_seqlens_k"_a, "max_seqlen_q"_a = 0,
        "max_seqlen_k"_a = 0, nb::kw_only(), "scale"_a = 0.0f, "causal"_a = false,
        "window_left"_a = -1, "window_right"_a = -1, "softcap"_a = 0.0f,
        "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none(), "backend"_a = "auto",
        "stream"_a = 0, "num_threads"_a = 0, "deterministic"_a = false, "u16_is_bf16"_a = false,
        "Runs ioattn::backward_varlen on packed tensors (lse [heads_q, total_q]). "
        "Returns (kernel, reason).");
  m.def("select_forward", &select_forward, "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a = 0.0f,
        "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1, "softcap"_a = 0.0f,
        "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none(), "backend"_a = "auto",
        "stream"_a = 0, "num_threads"_a = 0, "u16_is_bf16"_a = false,
        "Validates like forward() and returns (kernel, reason) for the kernel it would run.");
  m.def("decode", &decode, "q"_a, "k_cache"_a, "v_cache"_a, "cache_seqlens"_a, "o"_a, "lse"_a.none(),
        nb::kw_only(), "block_table"_a.none() = nb::none(), "k_scale"_a.none() = nb::none(),
        "v_scale"_a.none() = nb::none(), "scale"_a = 0.0f, "causal"_a = false, "window_left"_a = -1,
        "window_right"_a = -1, "softcap"_a = 0.0f, "alibi_slopes"_a.none() = nb::none(),
        "sinks"_a.none() = nb::none(), "num_splits"_a = 0, "stream"_a = 0, "num_threads"_a = 0,
        "u16_is_bf16"_a = false, "u8_is_e4m3"_a = false, "k_new"_a.none() = nb::none(),
        "v_new"_a.none() = nb::none(),
        "Runs ioattn::decode: q [b, sq, hq, d] (sq 1..16: split-KV; more: the flash forward) against the "
        "cache k_cache / v_cache ([pages, page_size, hkv, d] with block_table int32 [b, pages_per_seq], or contiguous "
        "[b, max_seqlen, hkv, d]) holding cache_seqlens int32 [b] tokens; writes o [b, sq, hq, dv] "
        "and (unless None) lse [b, hq, sq]. 8-bit caches (int8, or uint8 float8_e4m3fn codes with "
        "u8_is_e4m3) need k_scale / v_scale float32 [hkv]. num_splits 0 = heuristic. k_new / v_new "
        "[b, seqlen_new, hkv, d]: appended first, token i at position cache_seqlens - seqlen_new + i "
        "(the caches must be writable). Returns (kernel, reason).");
  nb::class_<ioattn::DecodePlan>(m, "DecodePlan",
                                 "Split counts and work partition fixed for one batch shape (ioattn::DecodePlan).")
      .def_ro("batch", &ioattn::DecodePlan::batch)
      .def_ro("heads_q", &ioattn::DecodePlan::heads_q)
      .def_ro("heads_kv", &ioattn::DecodePlan::heads_kv)
      .def_ro("head_dim", &ioattn::DecodePlan::head_dim)
      .def_ro("head_dim_v", &ioattn::DecodePlan::head_dim_v)
      .def_ro("seqlen_q", &ioattn::DecodePlan::seqlen_q)
      .def_ro("max_seqlen_k", &ioattn::DecodePlan::max_seqlen_k)
      .def_ro("page_size", &ioattn::DecodePlan::page_size)
      .def_ro("num_splits", &ioattn::DecodePlan::num_splits)
      .def_ro("workspace_bytes", &ioattn::DecodePlan::workspace_bytes)
      .def_prop_ro("device", [](const ioattn::DecodePlan& p) { return std::string(ioattn::device_name(p.device)); })
      .def("__repr__", [](const ioattn::DecodePlan& p) {
        return "DecodePlan(batch=" + std::to_string(p.batch) + ", heads_q=" + std::to_string(p.heads_q) +
               ", heads_kv=" + std::to_string(p.heads_kv) + ", head_dim=" + std::to_string(p.head_dim) +
               ", seqlen_q=" + std::to_string(p.seqlen_q) + ", max_seqlen_k=" + std::to_string(p.max_seqlen_k) +
               ", page_size=" + std::to_string(p.page_size) + ", num_splits=" + std::to_string(p.num_splits) +
               ", workspace_bytes=" + std::to_string(p.workspace_bytes) + ", device='" +
               ioattn::device_name(p.device) + "')";
      });
  m.def("plan_decode", &plan_decode, "batch"_a, "heads_q"_a, "heads_kv"_a, "head_dim"_a, "head_dim_v"_a,
        "seqlen_q"_a, "max_seqlen_k"_a, "page_size"_a, "device"_a, "device_index"_a = 0, "num_splits"_a = 0,
        "cache_dtype"_a = "bf16",
        "Runs ioattn::plan_decode (page_size 0: a contiguous cache) and returns the DecodePlan.");
  m.def("decode_planned", &decode_planned, "q"_a, "k_cache"_a, "v_cache"_a, "cache_seqlens"_a, "o"_a,
        "lse"_a.none(), "plan"_a, "workspace"_a, nb::kw_only(), "block_table"_a.none() = nb::none(),
        "k_scale"_a.none() = nb::none(), "v_scale"_a.none() = nb::none(), "scale"_a = 0.0f, "causal"_a = false,
        "window_left"_a = -1, "window_right"_a = -1, "softcap"_a = 0.0f, "alibi_slopes"_a.none() = nb::none(),
        "sinks"_a.none() = nb::none(), "stream"_a = 0, "num_threads"_a = 0, "u16_is_bf16"_a = false,
        "u8_is_e4m3"_a = false, "k_new"_a.none() = nb::none(), "v_new"_a.none() = nb::none(),
        "Runs ioattn::decode under a plan with a caller-owned contiguous workspace of at least "
        "plan.workspace_bytes bytes on q's device (nothing allocated: CUDA-graph capturable). "
        "Returns (kernel, reason).");
  m.def("append_kv", &append_kv, "k_new"_a, "v_new"_a, "slot_mapping"_a, "k_cache"_a, "v_cache"_a,
        nb::kw_only(), "k_scale"_a.none() = nb::none(), "v_scale"_a.none() = nb::none(), "stream"_a = 0,
        "u16_is_bf16"_a = false, "u8_is_e4m3"_a = false,
        "Runs ioattn::append_kv: writes k_new / v_new [tokens, hkv, d] into the cache at slot_mapping "
        "(int32 or int64 [tokens], page * page_size + offset; negative = skipped). "
        "Returns (kernel, reason).");
  m.def("merge_states", &merge_states, "o_a"_a, "lse_a"_a, "o_b"_a, "lse_b"_a, "o_out"_a, "lse_out"_a,
        nb::kw_only(), "stream"_a = 0, "u16_is_bf16"_a = false,
        "Runs ioattn::merge_states on two partial states (o [b, s, h, d], lse float32 [b, h, s]) "
        "over disjoint key sets; the outputs may alias an input. Returns (kernel, reason).");
  m.def("build_info", &build_info, "What this build contains (ioattn::BuildInfo) as a dict.");

  const ioattn::ExplainInput dflt;
  m.def("explain", &explain, nb::kw_only(), "seqlen"_a = dflt.seqlen, "head_dim"_a = dflt.head_dim,
        "heads"_a = dflt.heads, "layers"_a = dflt.layers, "dtype_bytes"_a = dflt.dtype_bytes,
        "naive_passes"_a = dflt.naive_passes, "bandwidth_Bps"_a = dflt.bandwidth_Bps,
        "flops_per_s"_a = dflt.flops_per_s, "attention_share"_a = dflt.attention_share,
        "kernel_speedup"_a = dflt.kernel_speedup,
        "The memory-traffic arithmetic (ioattn::explain) as a dict of ExplainReport fields.");
  m.def("explain_text", &explain_text, nb::kw_only(), "seqlen"_a = dflt.seqlen,
        "head_dim"_a = dflt.head_dim, "heads"_a = dflt.heads, "layers"_a = dflt.layers,
        "dtype_bytes"_a = dflt.dtype_bytes, "naive_passes"_a = dflt.naive_passes,
        "bandwidth_Bps"_a = dflt.bandwidth_Bps, "flops_per_s"_a = dflt.flops_per_s,
        "attention_share"_a = dflt.attention_share, "kernel_speedup"_a = dflt.kernel_speedup,
        "The same arithmetic as the text `ioattn explain` prints.");
  m.def("online_softmax_example", &online_softmax_example, "scores"_a, "values"_a, "block_size"_a,
        "The online softmax over key blocks, step by step (ioattn::online_softmax_example).");
}

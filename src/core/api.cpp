// Validation + dispatch: the only path from the public API to a backend.
//
// Every argument is checked once, here, before any backend runs, so an error never leaves a
// partly written output. Each error names the argument, what was expected and what came.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "core/problem.hpp"
#include "core/validate.hpp"
#include "core/checks.hpp"
#include "ioattn/ioattn.hpp"

namespace ioattn {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::f8e4m3: return "f8e4m3";
    case DType::i8: return "i8";
    case DType::i64: return "i64";
  }
  return "?";
}

const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

int64_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::f8e4m3: return 1;
    case DType::i8: return 1;
    case DType::i64: return 8;
  }
  return 0;
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::automatic: return "auto";
    case Backend::flash: return "flash";
    case Backend::naive: return "naive";
  }
  return "?";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

TensorView TensorView::contiguous(const void* data, DType dtype,
                                  std::initializer_list<int64_t> shape, Device device) {
  TensorView t;
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  if (t.ndim > 4) throw Error("shape", "expected at most 4 dims, got " + std::to_string(t.ndim));
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t st = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = st;
    st *= t.shape[d];
  }
  return t;
}

TensorView TensorView::strided(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, Device device) {
  if (shape.size() != strides.size())
    throw Error("strides", "expected " + std::to_string(shape.size()) + " strides (one per dim), got " +
                               std::to_string(strides.size()));
  TensorView t = contiguous(data, dtype, shape, device);
  int i = 0;
  for (int64_t s : strides) t.stride[i++] = s;
  return t;
}

TensorView TensorView::transpose12() const {
  TensorView t = *this;
  if (ndim == 4) {
    std::swap(t.shape[1], t.shape[2]);
    std::swap(t.stride[1], t.stride[2]);
  }
  return t;
}

namespace detail {
namespace {

constexpr int64_t kMaxHeadDim = 512;

// An FP8 descale view: only with f8e4m3 inputs; f32 [batch, heads_kv], any strides, on q's device.
Descale check_descale(const TensorView& t, const char* name, bool fp8, int64_t batch, int64_t heads_kv,
                      const TensorView& q) {
  Descale d;
  if (!t.defined()) return d;
  if (!fp8)
    fail(name, "undefined (descale factors apply to f8e4m3 inputs only)",
         std::string("a descale view with ") + dtype_name(q.dtype) + " inputs");
  check_view(t, name, 2, q);
  check_dtype(t, name, DType::f32);
  check_dim(name, 0, t.shape[0], batch, "batch");
  check_dim(name, 1, t.shape[1], heads_kv, "heads_kv");
  if (t.data == nullptr) fail(name, "a non-null data pointer", "null");
  d.ptr = static_cast<const float*>(t.data);
  d.batch_stride = t.stride[0];
  d.head_stride = t.stride[1];
  return d;
}

}  // namespace

Validated validate(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& o, const TensorView& lse, const Varlen* varlen,
                   const AttnParams& params, const Context& ctx) {
  Validated out;
  FwdProblem& p = out.p;
  const int nd = varlen ? 3 : 4;
  check_view(q, "q", nd, q);
  const bool fp8 = q.dtype == DType::f8e4m3;
  if (!is_float(q.dtype) && !fp8) fail("q.dtype", "f32, f16, bf16 or f8e4m3", dtype_name(q.dtype));
  check_view(k, "k", nd, q);
  check_view(v, "v", nd, q);
  check_view(o, "o", nd, q);
  check_dtype(k, "k", q.dtype);
  check_dtype(v, "v", q.dtype);
  if (fp8) {
    if (o.dtype != DType::bf16 && o.dtype != DType::f16)
      fail("o.dtype", "bf16 or f16 (the output of f8e4m3 inputs)", dtype_name(o.dtype));
  } else {
    check_dtype(o, "o", q.dtype);
  }
  check_writable(o, "o");
  if (q.device == Device::cuda && !cuda_compiled())
    fail("q.device", "cpu (this build has no CUDA backend)", "cuda");

  const int s = varlen ? 0 : 1;  // index of the seq dim
  const int h = nd - 2, d = nd - 1;
  if (!varlen) {
    check_dim("k", 0, k.shape[0], q.shape[0], "batch of q");
    check_dim("v", 0, v.shape[0], q.shape[0], "batch of q");
    check_dim("o", 0, o.shape[0], q.shape[0], "batch of q");
  }
  check_dim("v", s, v.shape[s], k.shape[s], varlen ? "total_k of k" : "seqlen_k of k");
  check_dim("o", s, o.shape[s], q.shape[s], varlen ? "total_q of q" : "seqlen_q of q");
  check_dim("v", h, v.shape[h], k.shape[h], "heads_kv of k");
  check_dim("o", h, o.shape[h], q.shape[h], "heads_q of q");
  check_dim("k", d, k.shape[d], q.shape[d], "head_dim of q");
  check_dim("o", d, o.shape[d], v.shape[d], "head_dim_v of v");
  p.heads_q = q.shape[h];
  p.heads_kv = k.shape[h];
  p.head_dim = q.shape[d];
  p.head_dim_v = v.shape[d];
  if (p.heads_kv < 1) fail("k.shape[" + std::to_string(h) + "]", "heads_kv >= 1", std::to_string(p.heads_kv));
  if (p.heads_q % p.heads_kv != 0)
    fail("q.shape[" + std::to_string(h) + "]",
         "heads_q divisible by heads_kv = " + std::to_string(p.heads_kv),
         "heads_q = " + std::to_string(p.heads_q));
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim)
    fail("q.shape[" + std::to_string(d) + "]", "head_dim in 1.." + std::to_string(kMaxHeadDim),
         std::to_string(p.head_dim));
  if (p.head_dim_v < 1 || p.head_dim_v > kMaxHeadDim)
    fail("v.shape[" + std::to_string(d) + "]", "head_dim_v in 1.." + std::to_string(kMaxHeadDim),
         std::to_string(p.head_dim_v));

  auto strides = [&](const TensorView& t) {
    Strides3 r;
    r.batch = varlen ? 0 : t.stride[0];
    r.seq = t.stride[s];
    r.head = t.stride[h];
    return r;
  };
  p.q_stride = strides(q);
  p.k_stride = strides(k);
  p.v_stride = strides(v);
  p.o_stride = strides(o);

  if (varlen) {
    const TensorView& cq = varlen->cu_seqlens_q;
    if (!cq.defined()) fail("cu_seqlens_q", "an int32 tensor [batch + 1]", "undefined");
    if (cq.ndim != 1) fail("cu_seqlens_q", "1 dim", std::to_string(cq.ndim) + " dims");
    p.batch = cq.shape[0] - 1;
    if (p.batch < 0) fail("cu_seqlens_q.shape[0]", "batch + 1 >= 1", std::to_string(cq.shape[0]));
    out.cu_q_host = read_cu_seqlens(cq, "cu_seqlens_q", p.batch, q.shape[0], q, ctx.stream);
    out.cu_k_host = read_cu_seqlens(varlen->cu_seqlens_k, "cu_seqlens_k", p.batch, k.shape[0], q, ctx.stream);
    int64_t mq = 0, mk = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      mq = std::max<int64_t>(mq, out.cu_q_host[b + 1] - out.cu_q_host[b]);
      mk = std::max<int64_t>(mk, out.cu_k_host[b + 1] - out.cu_k_host[b]);
    }
    if (varlen->max_seqlen_q != 0 && varlen->max_seqlen_q < mq)
      fail("max_seqlen_q", ">= the longest query sequence " + std::to_string(mq),
           std::to_string(varlen->max_seqlen_q));
    if (varlen->max_seqlen_k != 0 && varlen->max_seqlen_k < mk)
      fail("max_seqlen_k", ">= the longest key sequence " + std::to_string(mk),
           std::to_string(varlen->max_seqlen_k));
    p.seqlen_q = mq;
    p.seqlen_k = mk;
    p.cu_seqlens_q = static_cast<const int32_t*>(cq.data);
    p.cu_seqlens_k = static_cast<const int32_t*>(varlen->cu_seqlens_k.data);
    p.cu_seqlens_q_host = out.cu_q_host.data();
    p.cu_seqlens_k_host = out.cu_k_host.data();
  } else {
    p.batch = q.shape[0];
    p.seqlen_q = q.shape[1];
    p.seqlen_k = k.shape[1];
  }

  if (lse.defined()) {
    const int lnd = varlen ? 2 : 3;
    check_view(lse, "lse", lnd, q);
    check_dtype(lse, "lse", DType::f32);
    check_writable(lse, "lse");
    if (varlen) {
      check_dim("lse", 0, lse.shape[0], p.heads_q, "heads_q");
      check_dim("lse", 1, lse.shape[1], q.shape[0], "total_q");
      p.lse_stride = {0, lse.stride[1], lse.stride[0]};
    } else {
      check_dim("lse", 0, lse.shape[0], p.batch, "batch");
      check_dim("lse", 1, lse.shape[1], p.heads_q, "heads_q");
      check_dim("lse", 2, lse.shape[2], p.seqlen_q, "seqlen_q");
      p.lse_stride = {lse.stride[0], lse.stride[2], lse.stride[1]};
    }
    p.lse = static_cast<float*>(lse.data);
  }

  if (!std::isfinite(params.scale))
    fail("params.scale", "a finite number (0 = 1/sqrt(head_dim))", std::to_string(params.scale));
  p.scale = params.scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(p.head_dim)) : params.scale;
  if (!(params.softcap >= 0.0f) || !std::isfinite(params.softcap))
    fail("params.softcap", "a finite value >= 0 (0 = off)", std::to_string(params.softcap));
  p.softcap = params.softcap;
  if (params.window_left < -1)
    fail("params.window_left", ">= -1 (-1 = unbounded)", std::to_string(params.window_left));
  if (params.window_right < -1)
    fail("params.window_right", ">= -1 (-1 = unbounded)", std::to_string(params.window_right));
  p.causal = params.causal;
  p.window_left = params.window_left;
  p.window_right = params.causal ? 0 : params.window_right;  // causal = right window of 0
  p.alibi_slopes = check_head_vector(params.alibi_slopes, "params.alibi_slopes", p.heads_q, q);
  p.sinks = check_head_vector(params.sinks, "params.sinks", p.heads_q, q);
  if (ctx.num_threads < 0)
    fail("ctx.num_threads", ">= 0 (0 = all)", std::to_string(ctx.num_threads));
  p.q_descale = check_descale(params.q_descale, "params.q_descale", fp8, p.batch, p.heads_kv, q);
  p.k_descale = check_descale(params.k_descale, "params.k_descale", fp8, p.batch, p.heads_kv, q);
  p.v_descale = check_descale(params.v_descale, "params.v_descale", fp8, p.batch, p.heads_kv, q);
  if (fp8) p.fp8_out = o.dtype;

  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  p.o = o.data;
  p.dtype = q.dtype;
  p.device = q.device;
  p.device_index = q.device_index;
  p.stream = ctx.stream;
  p.num_threads = ctx.num_threads;
  return out;
}

namespace {

// A gradient or dout view: the shape and dtype of its partner, checked like any other view.
void check_like(const TensorView& t, const char* name, const TensorView& like, const char* like_name,
                const TensorView& q, bool output) {
  check_view(t, name, like.ndim, q);
  check_dtype(t, name, like.dtype);
  for (int i = 0; i < like.ndim; ++i)
    check_dim(name, i, t.shape[i], like.shape[i], (std::string("as ") + like_name).c_str());
  if (output) check_writable(t, name);
}

Strides3 strides3(const TensorView& t, bool varlen) {
  const int nd = t.ndim;
  return {varlen ? 0 : t.stride[0], t.stride[nd - 3], t.stride[nd - 2]};
}

}  // namespace

ValidatedBwd validate_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& o, const TensorView& dout, const TensorView& lse,
                               const Gradients& g, const Varlen* varlen, const AttnParams& params,
                               const Context& ctx) {
  ValidatedBwd out;
  if (!lse.defined()) fail("lse", "the forward's fp32 log-sum-exp (required by the backward)", "undefined");
  if (q.dtype == DType::f8e4m3)
    fail("q.dtype", "f32, f16 or bf16 (the backward has no f8e4m3 path)", dtype_name(q.dtype));
  out.fwd = validate(q, k, v, o, lse, varlen, params, ctx);
  const bool vl = varlen != nullptr;
  check_like(dout, "dout", o, "o", q, false);
  check_like(g.dq, "dq", q, "q", q, true);
  check_like(g.dk, "dk", k, "k", q, true);
  check_like(g.dv, "dv", v, "v", q, true);
  BwdProblem& p = out.p;
  if (g.dsinks.defined()) {
    if (!params.sinks.defined()) fail("grads.dsinks", "no dsinks when params.sinks is not given", "a dsinks view");
    p.dsinks = const_cast<float*>(check_head_vector(g.dsinks, "grads.dsinks", out.fwd.p.heads_q, q));
  }
  p.dout = dout.data;
  p.dout_stride = strides3(dout, vl);
  p.dq = g.dq.data;
  p.dk = g.dk.data;
  p.dv = g.dv.data;
  p.dq_stride = strides3(g.dq, vl);
  p.dk_stride = strides3(g.dk, vl);
  p.dv_stride = strides3(g.dv, vl);
  p.deterministic = ctx.deterministic;
  return out;
}

namespace {


using Runner = void (*)(const FwdProblem&);

struct Selection {
  KernelChoice choice;
  Runner run = nullptr;
};

Selection select(const FwdProblem& p, Backend backend) {
  Selection s;
  const std::string shape = std::string(dtype_name(p.dtype)) + " hdim" + std::to_string(p.head_dim) +
                            (p.head_dim_v != p.head_dim ? "/" + std::to_string(p.head_dim_v) : "") +
                            " " + mask_name(p);
  if (p.device == Device::cpu) {
    if (backend == Backend::naive) {
      s.choice = {"cpu/naive f64 " + shape, "backend=naive requested: float64 standard attention"};
      s.run = cpu_naive_forward;
    } else {
      s.choice = {"cpu/flash " + cpu_best_target() + " " + shape + " tile " + cpu_flash_tile(p),
                  backend == Backend::flash ? "backend=flash requested"
                                            : "auto: tiled online softmax is the CPU default"};
      s.run = cpu_flash_forward;
    }
    return s;
  }
  const int arch = cuda_device_arch(p.device_index);
  if (arch == 0)
    fail("q.device", "a visible CUDA device " + std::to_string(p.device_index),
         std::to_string(cuda_device_count()) + " CUDA devices");
  const std::string sm = "sm" + std::to_string(arch);
  if (backend == Backend::naive) {
    if (p.fp8())
      throw Error("q", "ioattn: no CUDA naive kernel for " + sm + " " + shape +
                           ": the cuBLAS path has no f8e4m3 inputs (the CPU naive backend has)");
    s.choice = {"cuda/naive " + sm + " " + shape, "backend=naive requested: S and P materialised in HBM"};
    s.run = cuda_naive_forward;
    return s;
  }
  CudaSelection c = cuda_flash_select(p, arch);
  if (c.kernel.empty())
    throw Error("q", "ioattn: no CUDA flash kernel for " + sm + " " + shape + ": " + c.reason +
                         " (backend=naive runs the materialising path)");
  s.choice = {c.kernel, c.reason};
  s.run = cuda_flash_forward;
  return s;
}

bool log_enabled() {
  const char* e = std::getenv("IOATTN_LOG");
  return e && (std::strcmp(e, "info") == 0 || std::strcmp(e, "debug") == 0);
}

KernelChoice run(const Validated& val, const Context& ctx) {
  Selection s = select(val.p, ctx.backend);
  if (log_enabled())
    std::fprintf(stderr, "ioattn: forward: %s (%s)\n", s.choice.kernel.c_str(), s.choice.reason.c_str());
  s.run(val.p);  // CUDA runners make the tensors' device current themselves (DeviceGuard)
  return s.choice;
}

KernelChoice run_backward(ValidatedBwd& val, const Context& ctx) {
  BwdProblem& p = val.p;
  p.f = val.fwd.p;
  const std::string shape = std::string(dtype_name(p.f.dtype)) + " hdim" + std::to_string(p.f.head_dim) + " " +
                            mask_name(p.f) + (p.deterministic ? " deterministic" : "");
  KernelChoice choice;
  void (*runner)(const BwdProblem&) = nullptr;
  if (p.f.device == Device::cpu) {
    if (ctx.backend == Backend::naive) {
      choice = {"cpu/naive-backward f64 " + shape, "backend=naive requested: P, dP, dS materialised in float64"};
      runner = cpu_naive_backward;
    } else {
      choice = {"cpu/flash-backward " + cpu_best_target() + " " + shape,
                "tiled recomputation from Q, K, V and LSE; " + cpu_backward_mode(p)};
      runner = cpu_flash_backward;
    }
  } else {
    const int arch = cuda_device_arch(p.f.device_index);
    CudaSelection c = cuda_backward_select(p, arch);
    if (c.kernel.empty())
      throw Error("q", "ioattn: no CUDA backward kernel for sm" + std::to_string(arch) + " " + shape + ": " + c.reason);
    choice = {c.kernel, c.reason};
    runner = cuda_flash_backward;
  }
  if (log_enabled())
    std::fprintf(stderr, "ioattn: backward: %s (%s)\n", choice.kernel.c_str(), choice.reason.c_str());
  runner(p);
  return choice;
}

}  // namespace
}  // namespace detail

KernelChoice backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                      const TensorView& dout, const TensorView& lse, const Gradients& grads,
                      const AttnParams& params, const Context& ctx) {
  auto val = detail::validate_backward(q, k, v, o, dout, lse, grads, nullptr, params, ctx);
  return detail::run_backward(val, ctx);
}

KernelChoice backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& o, const TensorView& dout, const TensorView& lse,
                             const Gradients& grads, const Varlen& varlen, const AttnParams& params,
                             const Context& ctx) {
  auto val = detail::validate_backward(q, k, v, o, dout, lse, grads, &varlen, params, ctx);
  return detail::run_backward(val, ctx);
}

KernelChoice forward(const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& o, const TensorView& lse, const AttnParams& params,
                     const Context& ctx) {
  return detail::run(detail::validate(q, k, v, o, lse, nullptr, params, ctx), ctx);
}

KernelChoice forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& o, const TensorView& lse, const Varlen& varlen,
                            const AttnParams& params, const Context& ctx) {
  return detail::run(detail::validate(q, k, v, o, lse, &varlen, params, ctx), ctx);
}

KernelChoice select_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& o, const TensorView& lse, const AttnParams& params,
                            const Context& ctx) {
  auto val = detail::validate(q, k, v, o, lse, nullptr, params, ctx);
  return detail::select(val.p, ctx.backend).choice;
}

BuildInfo build_info() {
  BuildInfo b;
  b.version = IOATTN_VERSION;
  b.cpu_targets = detail::cpu_compiled_targets();
  b.cpu_best_target = detail::cpu_best_target();
  b.cpu_threads = detail::cpu_max_threads();
  b.cuda_compiled = detail::cuda_compiled();
  b.cuda_devices = detail::cuda_device_count();
  b.cuda_kernels = detail::cuda_compiled_kernels();
  for (int i = 0; i < b.cuda_devices; ++i)
    b.cuda_device_names.push_back(detail::cuda_device_name(i) + " (sm" +
                                  std::to_string(detail::cuda_device_arch(i)) + ")");
  return b;
}

}  // namespace ioattn

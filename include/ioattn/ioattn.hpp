// ioattn — IO-aware exact attention.
//
// Public C++ API. Plain structs and free functions; nothing here names a kernel.
//
//   O = softmax(scale * Q K^T [softcap] [+ alibi] [masked]) V, LSE = log(sum exp(...))
//
// Semantics (one definition for every backend, see docs/ARCHITECTURE.md):
//  * Layout: q [batch, seqlen_q, heads_q, head_dim], k [batch, seqlen_k, heads_kv, head_dim],
//    v [batch, seqlen_k, heads_kv, head_dim_v], o [batch, seqlen_q, heads_q, head_dim_v].
//    Any int64 strides are accepted as long as the last dimension has unit stride, so a
//    [batch, heads, seqlen, dim] buffer is passed by permuting the strides. Empty tensors (a size-0
//    dim; their strides are not checked) are fine: batch = 0 or seqlen_q = 0 writes nothing,
//    seqlen_k = 0 makes every row one with no visible key (below); head_dim must be >= 1.
//    Varlen: q [total_q, heads_q, head_dim] with int32 cu_seqlens_q of length batch+1.
//  * LSE: fp32, natural log, [batch, heads_q, seqlen_q] (varlen: [heads_q, total_q]).
//  * Masks are aligned bottom-right: with off = seqlen_k - seqlen_q, causal keeps
//    j <= i + off; window (left, right) keeps i + off - left <= j <= i + off + right (-1 = unbounded).
//  * Score: s = scale * q.k; softcap c > 0: s = c * tanh(s / c); ALiBi: s -= slope_h * |i + off - j|.
//  * Sinks: per-query-head logit that joins the softmax denominator with a zero value vector
//    (gpt-oss style). LSE then includes the sink term.
//  * GQA: query head h reads kv head h / (heads_q / heads_kv).
//  * A row with no visible key: O = 0 and LSE = -inf (with a sink: O = 0, LSE = sink).
//  * Accumulation is fp32 for every input dtype; O is written in the input dtype (f8e4m3 inputs:
//    in o's dtype, bf16 or f16, see AttnParams' descales).
//
// Errors: every function throws ioattn::Error naming the argument, the expected and the actual
// value; validation runs before anything is written, so outputs are untouched on error.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

namespace ioattn {

// f8e4m3: the forward's q/k/v (with descale factors in AttnParams; o is then bf16 or f16) and
// 8-bit KV caches (serving.hpp); i8 only in KV caches; i64 only in append_kv's slot_mapping.
enum class DType : uint8_t { f32, f16, bf16, i32, f8e4m3, i8, i64 };
enum class Device : uint8_t { cpu, cuda };

const char* dtype_name(DType t);
const char* device_name(Device d);
int64_t dtype_size(DType t);

// A strided view of memory the caller owns. Up to 4 dims; strides are in elements.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int device_index = 0;
  int ndim = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t stride[4] = {0, 0, 0, 0};

  bool defined() const { return data != nullptr || ndim != 0; }
  int64_t numel() const;
  // Row-major contiguous view.
  static TensorView contiguous(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu);
  static TensorView strided(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, Device device = Device::cpu);
  // [b, h, s, d] buffer viewed as [b, s, h, d] without a copy.
  TensorView transpose12() const;
};

struct AttnParams {
  float scale = 0.0f;          // 0 -> 1/sqrt(head_dim)
  bool causal = false;
  int64_t window_left = -1;    // -1 = unbounded
  int64_t window_right = -1;   // -1 = unbounded
  float softcap = 0.0f;        // 0 = off
  TensorView alibi_slopes;     // optional, f32 [heads_q], same device as q
  TensorView sinks;            // optional, f32 [heads_q], same device as q
  // FP8 forward (q, k, v all f8e4m3; o bf16 or f16; lse fp32), FlashAttention-3's convention:
  // the real inputs are q * q_descale, k * k_descale, v * v_descale, each descale an optional
  // f32 view [batch, heads_kv] (unit stride on the last dim; undefined = 1) on the device of q. q_descale is
  // per kv head: all query heads of a GQA group share it. Scores are then
  // scale * q_descale * k_descale * (q_code . k_code), and O = descale_v * (P V_code).
  // Only with f8e4m3 inputs (an error otherwise); forward only (the backward refuses f8e4m3).
  TensorView q_descale;
  TensorView k_descale;
  TensorView v_descale;
};

enum class Backend : uint8_t { automatic, flash, naive };
const char* backend_name(Backend b);

struct Context {
  Backend backend = Backend::automatic;
  void* stream = nullptr;  // cudaStream_t for CUDA tensors; null = default stream
  int num_threads = 0;     // CPU threads; 0 = all (OpenMP default / IOATTN_NUM_THREADS)
  bool deterministic = false;  // backward: bitwise-reproducible gradient accumulation
};

// What the dispatcher picked and why ("cpu/flash avx3 f32 hdim128 causal tile 48x64").
struct KernelChoice {
  std::string kernel;
  std::string reason;
};

// Optional varlen description; cu_seqlens are int32 [batch+1] on the device of q.
struct Varlen {
  TensorView cu_seqlens_q;
  TensorView cu_seqlens_k;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
};

class Error : public std::invalid_argument {
 public:
  Error(std::string argument, const std::string& message)
      : std::invalid_argument(message), argument_(std::move(argument)) {}
  const std::string& argument() const { return argument_; }

 private:
  std::string argument_;
};

// Forward attention. lse may be an undefined view (not written).
KernelChoice forward(const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& o, const TensorView& lse, const AttnParams& params,
                     const Context& ctx = {});

// Packed variable-length forward: q [total_q, hq, d], k/v [total_k, hkv, d], o [total_q, hq, dv],
// lse [hq, total_q].
KernelChoice forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& o, const TensorView& lse, const Varlen& varlen,
                            const AttnParams& params, const Context& ctx = {});

// Validates and answers which kernel forward() would run, without running it.
// Throws the same Error forward() would.
KernelChoice select_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& o, const TensorView& lse, const AttnParams& params,
                            const Context& ctx = {});

// Backward by recomputation: given the forward's inputs, its output o and fp32 lse, and the
// output gradient dout (shape of o), writes dq, dk, dv (shapes of q, k, v; dtype of q). GQA: dk/dv
// are summed over the query heads of a group. dsinks (optional, f32 [heads_q]) receives the sink
// gradient summed over batch and rows; it requires params.sinks. Rows with LSE = -inf
// contribute 0. Extra memory is O(seqlen), never seqlen_q x seqlen_k.
struct Gradients {
  TensorView dq, dk, dv;
  TensorView dsinks;  // optional
};
KernelChoice backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                      const TensorView& dout, const TensorView& lse, const Gradients& grads,
                      const AttnParams& params, const Context& ctx = {});
KernelChoice backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& o, const TensorView& dout, const TensorView& lse,
                             const Gradients& grads, const Varlen& varlen, const AttnParams& params,
                             const Context& ctx = {});

// What this build contains: backends, ISA targets, compiled kernels, CUDA devices.
struct BuildInfo {
  std::string version;
  std::vector<std::string> cpu_targets;   // SIMD targets compiled (Highway)
  std::string cpu_best_target;            // chosen at run time on this machine
  int cpu_threads = 1;
  bool cuda_compiled = false;
  int cuda_devices = 0;
  std::vector<std::string> cuda_kernels;  // dispatch table rows compiled in
  std::vector<std::string> cuda_device_names;
};
BuildInfo build_info();

}  // namespace ioattn

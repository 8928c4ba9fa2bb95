// flash_bwd_dispatch.cu — the one selector for the CUDA flash backward (it answers both "is this
// problem supported?" and "which kernels run?", so the two can never disagree) and the launch
// sequence on the caller's stream (run_flash_backward, which ioattn_cuda_bwd_tune also runs with
// candidate tiles).
//
// The table is BwdTraits<64, 128, 256> x {bf16, f16} (flash_bwd_launch.cuh); a head_dim that is a
// multiple of 8 runs on the next size up with zero-filled columns. The selector string reads
// "cuda/flash-backward sm90 mma.sync bf16 hdim128 causal tile 64x128 warps 8 dq atomic" and the
// reason says why that tile and how dQ is accumulated.
//
// Workspace: one cudaMallocAsync on the call's stream (freed with cudaFreeAsync on the same
// stream after the last kernel, so it is stream-ordered and costs no device synchronisation):
//   ws_lse, ws_d   2 · heads_q · rows_q floats (rows_q = batch·seqlen_q, or total_q for varlen)
//   ws_dsink       heads_q · ceil(rows_q / 64) floats (only with dsinks)
//   ws_dq          heads_q · rows_q · kHeadDim floats (default mode only; zeroed by the
//                  preprocess kernel) — O(n) in total, never seqlen_q x seqlen_k.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <string>

#include "core/backends.hpp"
#include "cuda/check.cuh"
#include "cuda/flash_bwd_launch.cuh"
#include "cuda/hopper/sm90.hpp"  // kSm90RaggedMaxRowStrideBytes

namespace ioattn::cuda {
namespace {

// Ascending head dim; within a head dim, preferred row first (the selector takes the first row
// whose shared memory fits the device).
const std::array<BwdKernelInfo, 4>& bwd_table() {
  static const std::array<BwdKernelInfo, 4> table = {bwd_info_hdim64(), bwd_info_hdim128(), bwd_info_hdim256_wide(),
                                                     bwd_info_hdim256()};
  return table;
}

// The wgmma rows (sm_90's default where they apply): hdim 64, 128 and 256.
const BwdKernelInfo& sm90_bwd_info(int64_t head_dim) {
  static const BwdKernelInfo d128 = bwd_info_sm90_hdim128();
  static const BwdKernelInfo d64 = bwd_info_sm90_hdim64();
  static const BwdKernelInfo d256 = bwd_info_sm90_hdim256();
  return head_dim == 64 ? d64 : head_dim == 256 ? d256 : d128;
}

constexpr int kVecElems = 8;  // cp.async / vector stores move 16 bytes = 8 f16/bf16 elements

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Strides that matter (dims of size > 1) must be multiples of 8 elements.
bool strides_ok(const detail::Strides3& s, const detail::FwdProblem& p, int64_t seqlen, int64_t heads) {
  if (!p.varlen() && p.batch > 1 && s.batch % kVecElems != 0) return false;
  if ((seqlen > 1 || p.varlen()) && s.seq % kVecElems != 0) return false;
  if (heads > 1 && s.head % kVecElems != 0) return false;
  return true;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The row's launch runs an atomic-free dQ pass (no fp32 dQ workspace): deterministic mode, or a row
// whose default mode is such a pass.
bool dq_by_pass(const BwdKernelInfo& info, bool deterministic) {
  return deterministic || (info.wants_dq_workspace != nullptr && !info.wants_dq_workspace());
}

int64_t rows_q_of(const detail::FwdProblem& p) {
  return p.varlen() ? p.cu_seqlens_q_host[p.batch] : p.batch * p.seqlen_q;
}
int64_t rows_k_of(const detail::FwdProblem& p) {
  return p.varlen() ? p.cu_seqlens_k_host[p.batch] : p.batch * p.seqlen_k;
}

// The query length the wgmma backward picks its variant by (variant_bits): seqlen_q, or for varlen
// the query lengths weighted by each sequence's work (sq·sk), so that a batch of many short
// sequences beside one long one is sized by the short ones when they carry most of the work (the
// 128-row steps of ppwide are mostly padding on them).
int64_t variant_rows_of(const detail::FwdProblem& p) {
  if (!p.varlen()) return p.seqlen_q;
  double work = 0, weighted = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const double sq = p.cu_seqlens_q_host[b + 1] - p.cu_seqlens_q_host[b];
    const double sk = p.cu_seqlens_k_host[b + 1] - p.cu_seqlens_k_host[b];
    work += sq * sk;
    weighted += sq * sq * sk;
  }
  return work > 0 ? static_cast<int64_t>(weighted / work + 0.5) : p.seqlen_q;
}

struct Pick {
  const BwdKernelInfo* info = nullptr;
  detail::CudaSelection sel;
};

// IOATTN_BWD_KERNEL unset: on sm_90 the wgmma kernels (hopper/flash_bwd_sm90.cu) where they apply,
// else the mma.sync table; sm90: the same, with the refusal named as the env's; mma: the mma.sync
// table everywhere (for A/B runs and for testing that table on an H200).
std::string forced_bwd_kernel() {
  const char* e = std::getenv("IOATTN_BWD_KERNEL");
  return e ? std::string(e) : std::string();
}

// Why the wgmma backward cannot run this problem ("" = it can; then *attr holds its kernel's
// attributes).
std::string sm90_bwd_refusal(const detail::BwdProblem& bp, int arch, int optin, cudaFuncAttributes* attr) {
  const detail::FwdProblem& p = bp.f;
  if (arch != 90) return "needs sm_90, device is sm" + std::to_string(arch);
  if (p.head_dim != 128 && p.head_dim != 64 && p.head_dim != 256)
    return "head_dim 64, 128 or 256 only, got " + std::to_string(p.head_dim);
  const BwdKernelInfo& info = sm90_bwd_info(p.head_dim);
  // hdim 256 (session 19; varlen since session 24, verified on the H200: 1.9-2.1x the mma.sync
  // table's varlen backward, its dQ by the pass only); IOATTN_BWD_SM90_D256=0 sends hdim 256 to the
  // mma.sync table.
  if (p.head_dim == 256) {
    const char* e = std::getenv("IOATTN_BWD_SM90_D256");
    if (e != nullptr && std::string(e) == "0") return "hdim 256 switched off (IOATTN_BWD_SM90_D256=0)";
    if (p.varlen() && !bp.deterministic && info.wants_dq_workspace != nullptr && info.wants_dq_workspace())
      return "hdim-256 varlen takes dQ by the wgmma pass only, IOATTN_BWD_SM90_D256_DQ asks for reductions";
  }
  if (p.varlen()) {
    // Verified on the H200 in session 8 (test CudaBackwardSm90Varlen); IOATTN_BWD_SM90_VARLEN=0
    // sends varlen to the mma.sync table.
    const char* e = std::getenv("IOATTN_BWD_SM90_VARLEN");
    if (e != nullptr && std::string(e) == "0") return "varlen switched off (IOATTN_BWD_SM90_VARLEN=0)";
    if (rows_q_of(p) == 0) return "varlen with no query tokens (no dQ workspace)";
    // the ragged TMA maps (make_ragged_map) take token strides below 2^34 bytes
    if (std::max({p.q_stride.seq, p.k_stride.seq, p.v_stride.seq, bp.dout_stride.seq}) * 2 >=
        detail::kSm90RaggedMaxRowStrideBytes)
      return "varlen: a token stride of 2^34 bytes or more (the ragged TMA maps' limit)";
    const char* v = std::getenv("IOATTN_BWD_SM90_VARIANT");
    if (v != nullptr && *v != '\0' && std::string(v) != "lag" && std::string(v) != "pp" && std::string(v) != "ppwide")
      return "varlen: variants lag, pp and ppwide only, IOATTN_BWD_SM90_VARIANT is " + std::string(v);
  }
  if (p.softcap > 0.f || p.alibi_slopes != nullptr) return "no softcap or ALiBi";
  if (!p.varlen() && (p.batch == 0 || p.seqlen_q == 0 || p.seqlen_k == 0))  // a tensor map needs every dim >= 1
    return "an empty dim (batch, seqlen_q or seqlen_k = 0; a tensor map needs every dim >= 1)";
  if (cudaFuncGetAttributes(attr, p.dtype == DType::bf16 ? info.dkdv_bf16 : info.dkdv_f16) !=
          cudaSuccess ||
      attr->ptxVersion < 90) {
    cudaGetLastError();
    return "this build has no sm_90a image of it";
  }
  // Dynamic (the larger, default instance's) + static shared memory (LSE/D staging).
  const size_t smem = info.smem_bytes + attr->sharedSizeBytes;
  if (static_cast<size_t>(optin) < smem)
    return "needs " + std::to_string(smem / 1024) + " KB of shared memory, the device allows " +
           std::to_string(optin / 1024) + " KB";
  return "";
}

Pick pick(const detail::BwdProblem& bp, int arch) {
  const detail::FwdProblem& p = bp.f;
  Pick r;
  auto no = [&](std::string why) {
    r.sel = {"", std::move(why)};
    return r;
  };
  if (arch < 80)
    return no("the mma.sync backward needs sm80+ (bf16 mma, cp.async, ldmatrix); device is sm" +
              std::to_string(arch));
  if (p.dtype != DType::f16 && p.dtype != DType::bf16)
    return no(std::string("the tensor-core backward takes f16 or bf16 inputs, got ") + dtype_name(p.dtype) +
              " (the CPU backward runs f32 on host tensors)");
  if (p.head_dim != p.head_dim_v)
    return no("head_dim_v (" + std::to_string(p.head_dim_v) + ") must equal head_dim (" +
              std::to_string(p.head_dim) + ")");
  const int max_d = bwd_table().back().head_dim;
  if (p.head_dim % kVecElems != 0 || p.head_dim > max_d)
    return no("the backward table covers head_dim multiples of 8 up to " + std::to_string(max_d) + ", got " +
              std::to_string(p.head_dim));
  const void* ptrs[] = {p.q, p.k, p.v, p.o, bp.dout, bp.dq, bp.dk, bp.dv};
  for (const void* ptr : ptrs)
    if (!aligned16(ptr)) return no("q, k, v, o, dout, dq, dk and dv must be 16-byte aligned (16-byte vector loads/stores)");
  if (!strides_ok(p.q_stride, p, p.seqlen_q, p.heads_q) || !strides_ok(p.k_stride, p, p.seqlen_k, p.heads_kv) ||
      !strides_ok(p.v_stride, p, p.seqlen_k, p.heads_kv) || !strides_ok(p.o_stride, p, p.seqlen_q, p.heads_q) ||
      !strides_ok(bp.dout_stride, p, p.seqlen_q, p.heads_q) || !strides_ok(bp.dq_stride, p, p.seqlen_q, p.heads_q) ||
      !strides_ok(bp.dk_stride, p, p.seqlen_k, p.heads_kv) || !strides_ok(bp.dv_stride, p, p.seqlen_k, p.heads_kv))
    return no("q/k/v/o/dout/dq/dk/dv strides must be multiples of 8 elements (16-byte vector loads/stores)");
  if (p.seqlen_q + p.seqlen_k >= (int64_t{1} << 30))
    return no("seqlen_q + seqlen_k must be below 2^30 (32-bit positions in the kernel)");
  DeviceGuard guard(p.device_index);
  int optin = 0;
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, p.device_index));
  const std::string force = forced_bwd_kernel();
  if (!force.empty() && force != "sm90" && force != "mma")
    return no("IOATTN_BWD_KERNEL must be sm90 or mma (or unset), got '" + force + "'");
  std::string sm90_note;  // why the wgmma kernel did not run, for the mma.sync row's reason
  if (rows_q_of(p) >= INT_MAX / 2)
    return no("batch x seqlen_q (total_q for varlen) must stay below 2^30 (workspace rows, 32-bit grid)");
  if (force == "mma") {
    sm90_note = "IOATTN_BWD_KERNEL=mma: the mma.sync table; ";
  } else if (arch == 90 || force == "sm90") {
    // On sm_90 the wgmma kernel is the default wherever it applies; elsewhere the reason says why not.
    cudaFuncAttributes a{};
    const std::string why = sm90_bwd_refusal(bp, arch, optin, &a);
    if (why.empty()) {
      const BwdKernelInfo& info = sm90_bwd_info(p.head_dim);
      if (ceil_div(p.seqlen_k, info.block_n) * p.heads_kv * p.batch > INT_MAX ||
          (bp.deterministic && ceil_div(p.seqlen_q, info.dq_block_m) * p.heads_q * p.batch > INT_MAX))
        return no("key blocks x kv heads x batch (or, deterministic, query blocks x heads x batch) exceeds the "
                  "2^31-1 grid limit");
      r.info = &info;
      const int64_t vrows = variant_rows_of(p);
      r.sel = {"cuda/flash-backward sm90 wgmma " + std::string(dtype_name(p.dtype)) + " hdim" +
                   std::to_string(info.head_dim) + " " + detail::mask_name(p) + " tile " +
                   std::to_string(info.step_rows && !bp.deterministic ? info.step_rows(vrows)
                                                                     : info.block_m) +
                   "x" + std::to_string(info.block_n) + " warpgroups " + std::to_string(info.warps / 4) +
                   (bp.deterministic            ? std::string(" dq deterministic")
                    : dq_by_pass(info, false) ? std::string(" dq pass variant ") + info.variant(vrows)
                                              : std::string(" dq atomic variant ") + info.variant(vrows)),
               std::string(info.reason) + "; " +
                   (bp.deterministic
                        ? "deterministic: its dK/dV-only instance (no dQ wgmma, " +
                              std::to_string(info.smem_bytes_det / 1024) +
                              " KB smem), then " + info.dq_pass_name + " atomic-free dQ pass (" +
                              std::to_string(info.dq_block_m) + "x" + std::to_string(info.dq_block_n) + " tiles, " +
                              std::to_string(info.dq_smem_bytes / 1024) + " KB smem)"
                        : std::to_string(info.smem_bytes / 1024) + " KB smem, " + std::to_string(a.numRegs) +
                              " regs/thread")};
      return r;
    }
    sm90_note = (force == "sm90" ? "IOATTN_BWD_KERNEL=sm90 does not apply (" : "the wgmma backward does not apply (") +
                why + "); ";
  }
  auto smem_of = [&](const BwdKernelInfo& k) {
    return bp.deterministic ? std::max(k.smem_bytes_det, k.dq_smem_bytes) : k.smem_bytes;
  };
  const BwdKernelInfo* info = nullptr;
  std::string skipped;  // a preferred row of the head dim that did not fit
  for (const auto& k : bwd_table()) {
    if (k.head_dim < p.head_dim) continue;
    if (info == nullptr || k.head_dim == info->head_dim) {
      if (smem_of(k) <= static_cast<size_t>(optin)) {
        info = &k;
        break;
      }
      if (info == nullptr) info = &k;  // the smallest fitting head dim's first row, if none fits
      skipped += std::string(skipped.empty() ? "" : "; ") + "the " + std::to_string(k.warps) + "-warp tile needs " +
                 std::to_string(smem_of(k) / 1024) + " KB of shared memory, the device allows " +
                 std::to_string(optin / 1024) + " KB";
    }
  }
  if (ceil_div(p.seqlen_k, info->block_n) * p.heads_kv * p.batch * info->col_splits > INT_MAX ||
      ceil_div(p.seqlen_q, info->dq_block_m) * p.heads_q * p.batch > INT_MAX)
    return no("key blocks x kv heads x batch (or query blocks x heads x batch) exceeds the 2^31-1 grid limit");

  const bool bf16 = p.dtype == DType::bf16;
  cudaFuncAttributes attr{}, attr_dq{};
  cudaError_t e = cudaFuncGetAttributes(&attr, bf16 ? info->dkdv_bf16 : info->dkdv_f16);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr_dq, bf16 ? info->dq_bf16 : info->dq_f16);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return no(std::string("no backward kernel image for this device in this build (") + cudaGetErrorString(e) + ")");
  }
  if (smem_of(*info) > static_cast<size_t>(optin)) return no(skipped);

  r.info = info;
  std::string name = "cuda/flash-backward sm" + std::to_string(arch) + " mma.sync " + dtype_name(p.dtype) + " hdim" +
                     std::to_string(info->head_dim);
  if (info->head_dim != p.head_dim) name += "(d" + std::to_string(p.head_dim) + " zero-padded)";
  name += " " + detail::mask_name(p) + " tile " + std::to_string(info->block_m) + "x" + std::to_string(info->block_n) +
          " warps " + std::to_string(info->warps) + (info->col_splits > 1 ? " x" + std::to_string(info->col_splits) + " column splits" : "") +
          (bp.deterministic ? " dq deterministic" : " dq atomic");
  std::string reason = sm90_note + std::string(info->reason) + "; dK/dV kernel " + std::to_string(info->smem_bytes / 1024) +
                       " KB smem, " + std::to_string(attr.numRegs) + " regs/thread";
  if (bp.deterministic)
    reason += "; deterministic: dQ by a separate pass over key blocks in a fixed order (" +
              std::to_string(info->dq_block_m) + "x" + std::to_string(info->dq_block_n) + " tiles, " +
              std::to_string(attr_dq.numRegs) + " regs/thread), no float atomics";
  else
    reason += "; dQ accumulated in fp32 with atomics (Context::deterministic selects the atomic-free pass)";
  if (info->head_dim != p.head_dim)
    reason += "; head_dim " + std::to_string(p.head_dim) + " runs on the hdim" + std::to_string(info->head_dim) +
              " kernels with zero-filled columns";
  if (!skipped.empty()) reason += "; not the preferred tile: " + skipped;
  r.sel = {name, reason};
  return r;
}

// Windows that reach past both sequences are the same as unbounded; mapping them to -1 keeps
// every position the kernels compute inside int32.
int clamp_window(int64_t w, int64_t total_len) { return (w < 0 || w >= total_len) ? -1 : static_cast<int>(w); }

// The workspace of one call: allocated and freed on the call's stream.
class StreamBuffer {
 public:
  StreamBuffer(size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) IOATTN_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream));
  }
  ~StreamBuffer() {
    if (ptr_) cudaFreeAsync(ptr_, stream_);
  }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  unsigned char* get() const { return static_cast<unsigned char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

}  // namespace

void run_flash_backward(const detail::BwdProblem& bp, const BwdKernelInfo& info) {
  const detail::FwdProblem& p = bp.f;
  DeviceGuard guard(p.device_index);
  const auto stream = static_cast<cudaStream_t>(p.stream);

  BwdParams bw;
  bw.q = p.q, bw.k = p.k, bw.v = p.v, bw.o = p.o, bw.dout = bp.dout, bw.lse = p.lse;
  bw.dq = bp.dq, bw.dk = bp.dk, bw.dv = bp.dv;
  bw.q_batch = p.q_stride.batch, bw.q_seq = p.q_stride.seq, bw.q_head = p.q_stride.head;
  bw.k_batch = p.k_stride.batch, bw.k_seq = p.k_stride.seq, bw.k_head = p.k_stride.head;
  bw.v_batch = p.v_stride.batch, bw.v_seq = p.v_stride.seq, bw.v_head = p.v_stride.head;
  bw.o_batch = p.o_stride.batch, bw.o_seq = p.o_stride.seq, bw.o_head = p.o_stride.head;
  bw.do_batch = bp.dout_stride.batch, bw.do_seq = bp.dout_stride.seq, bw.do_head = bp.dout_stride.head;
  bw.dq_batch = bp.dq_stride.batch, bw.dq_seq = bp.dq_stride.seq, bw.dq_head = bp.dq_stride.head;
  bw.dk_batch = bp.dk_stride.batch, bw.dk_seq = bp.dk_stride.seq, bw.dk_head = bp.dk_stride.head;
  bw.dv_batch = bp.dv_stride.batch, bw.dv_seq = bp.dv_stride.seq, bw.dv_head = bp.dv_stride.head;
  bw.lse_batch = p.lse_stride.batch, bw.lse_seq = p.lse_stride.seq, bw.lse_head = p.lse_stride.head;
  bw.batch = static_cast<int>(p.batch);
  bw.heads_q = static_cast<int>(p.heads_q);
  bw.heads_kv = static_cast<int>(p.heads_kv);
  bw.group = static_cast<int>(p.group());
  bw.seqlen_q = static_cast<int>(p.seqlen_q);
  bw.seqlen_k = static_cast<int>(p.seqlen_k);
  bw.head_dim = static_cast<int>(p.head_dim);
  bw.num_n_blocks = static_cast<int>(ceil_div(p.seqlen_k, info.block_n));
  bw.num_m_blocks = static_cast<int>(ceil_div(p.seqlen_q, info.dq_block_m));
  bw.rows_q = rows_q_of(p);
  bw.rows_k = rows_k_of(p);
  bw.variant_rows = variant_rows_of(p);
  bw.cu_seqlens_q = p.cu_seqlens_q;
  bw.cu_seqlens_k = p.cu_seqlens_k;
  bw.scale = p.scale;
  bw.scale_log2 = p.scale * kLog2e;
  bw.softcap = p.softcap;
  bw.softcap_inv = p.softcap > 0 ? 1.f / p.softcap : 0.f;
  const int64_t total_len = p.seqlen_q + p.seqlen_k;
  bw.window_left = clamp_window(p.window_left, total_len);
  bw.window_right = clamp_window(p.window_right, total_len);
  bw.alibi_slopes = p.alibi_slopes;
  bw.sinks = p.sinks;
  bw.dsinks = bp.dsinks;
  bw.ws_dq_pitch = info.head_dim;  // 64 / 128 / 256: the preprocess zeroes the rows with 16-byte stores
  bw.num_pre_blocks = static_cast<int>(ceil_div(bw.rows_q, kPreRows));
  if (p.heads_q == 0) return;

  // Workspace regions, 256-byte aligned.
  const int64_t hr = p.heads_q * bw.rows_q;
  const size_t lse_bytes = round_up(static_cast<size_t>(hr) * 4, 256);
  const size_t sink_bytes = bp.dsinks ? round_up(static_cast<size_t>(p.heads_q) * bw.num_pre_blocks * 4, 256) : 0;
  const size_t dq_bytes = dq_by_pass(info, bp.deterministic) ? 0 : static_cast<size_t>(hr) * info.head_dim * 4;
  StreamBuffer ws(2 * lse_bytes + sink_bytes + dq_bytes, stream);
  unsigned char* base = ws.get();
  bw.ws_lse = reinterpret_cast<float*>(base);
  bw.ws_d = reinterpret_cast<float*>(base + lse_bytes);
  bw.ws_dsink = bp.dsinks ? reinterpret_cast<float*>(base + 2 * lse_bytes) : nullptr;
  bw.ws_dq = dq_bytes > 0 ? reinterpret_cast<float*>(base + 2 * lse_bytes + sink_bytes) : nullptr;

  const bool bf16 = p.dtype == DType::bf16;
  // (the dQ accumulator is zeroed by the preprocess kernel, which covers all hr rows)
  if (hr > 0) {
    const dim3 grid(static_cast<unsigned>(bw.num_pre_blocks), static_cast<unsigned>(p.heads_q));
    if (bf16)
      flash_bwd_preprocess_kernel<__nv_bfloat16><<<grid, kPreWarps * 32, 0, stream>>>(bw);
    else
      flash_bwd_preprocess_kernel<__half><<<grid, kPreWarps * 32, 0, stream>>>(bw);
    IOATTN_CUDA_CHECK_LAUNCH("flash_bwd_preprocess_kernel");
  }
  if (bp.dsinks) {  // also with no query rows at all: dsinks = 0
    flash_bwd_dsink_kernel<float><<<static_cast<unsigned>(p.heads_q), 32, 0, stream>>>(bw);
    IOATTN_CUDA_CHECK_LAUNCH("flash_bwd_dsink_kernel");
  }
  info.launch(bw, bf16, stream);  // dK/dV (+ atomic dQ), or dK/dV then the deterministic dQ pass
  if (dq_bytes > 0) {
    const int64_t chunks = hr * (p.head_dim / 8);
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(chunks, 256), 132 * 16));
    if (blocks > 0) {
      if (bf16)
        flash_bwd_dq_convert_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(bw);
      else
        flash_bwd_dq_convert_kernel<__half><<<blocks, 256, 0, stream>>>(bw);
      IOATTN_CUDA_CHECK_LAUNCH("flash_bwd_dq_convert_kernel");
    }
  }
}

}  // namespace ioattn::cuda

namespace ioattn::detail {

CudaSelection cuda_backward_select(const BwdProblem& p, int arch) { return cuda::pick(p, arch).sel; }

void cuda_flash_backward(const BwdProblem& bp) {
  const int arch = cuda_device_arch(bp.f.device_index);
  const cuda::Pick pk = cuda::pick(bp, arch);
  if (pk.info == nullptr) throw Error("q", "ioattn: no CUDA backward kernel: " + pk.sel.reason);
  cuda::run_flash_backward(bp, *pk.info);
}

}  // namespace ioattn::detail

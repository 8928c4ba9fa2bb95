// flash_dispatch.cu — the one selector for the CUDA flash forward: it answers both "is this
// problem supported?" and "which kernel runs?", so the two can never disagree, and it launches.
//
// The table is FlashTraits<32..256> x {bf16, f16} (flash_traits.cuh). The selector string reads
// "cuda/flash sm90 mma.sync bf16 hdim128 causal tile 128x64 warps 4" and the reason says why that
// tile was chosen and how deep the K/V ring is on this device.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "cuda/check.cuh"
#include "cuda/flash_launch.cuh"
#include "cuda/hopper/sm90.hpp"

namespace ioattn::cuda {
namespace {

const std::array<FlashKernelInfo, 6>& flash_table() {
  static const std::array<FlashKernelInfo, 6> table = {flash_info_hdim32(),  flash_info_hdim64(),
                                                       flash_info_hdim96(),  flash_info_hdim128(),
                                                       flash_info_hdim192(), flash_info_hdim256()};
  return table;
}

constexpr int kMaxHeadDim = 256;
constexpr int kVecElems = 8;  // cp.async moves 16 bytes = 8 f16/bf16 elements


bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Strides that matter (dims of extent > 1) must be multiples of `elems`.
bool strides_ok(const detail::Strides3& s, int64_t n_batch, int64_t n_seq, int64_t n_head, int64_t elems) {
  return (n_batch <= 1 || s.batch % elems == 0) && (n_seq <= 1 || s.seq % elems == 0) &&
         (n_head <= 1 || s.head % elems == 0);
}
// The forward's tensors: varlen rows are packed along seq (the batch stride is unused).
bool strides_ok(const detail::Strides3& s, const detail::FwdProblem& p, int64_t seqlen, int64_t heads,
                int64_t elems) {
  return p.varlen() ? strides_ok(s, 1, 2, heads, elems) : strides_ok(s, p.batch, seqlen, heads, elems);
}

int device_smem_optin(int device) {
  int bytes = 0;
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return bytes;
}

// What every mma.sync forward instance needs of the problem: sm80+, f16 / bf16 inputs, head_dim ==
// head_dim_v, a multiple of 8 up to 256. "" when it has it, else why not.
std::string mma_shape_refusal(const detail::FwdProblem& p, int arch) {
  if (arch < 80)
    return "the mma.sync kernel needs sm80+ (bf16 mma, cp.async, ldmatrix); device is sm" + std::to_string(arch);
  if (p.dtype != DType::f16 && p.dtype != DType::bf16)
    return std::string("the tensor-core kernel takes f16 or bf16 inputs, got ") + dtype_name(p.dtype);
  if (p.head_dim != p.head_dim_v)
    return "head_dim_v (" + std::to_string(p.head_dim_v) + ") must equal head_dim (" + std::to_string(p.head_dim) +
           ")";
  if (p.head_dim % kVecElems != 0 || p.head_dim > kMaxHeadDim)
    return "head_dim must be a multiple of 8 and at most 256, got " + std::to_string(p.head_dim);
  return "";
}

// The chosen instance on this device: its image (attr: its registers) and its shared memory
// against the opt-in limit. "" when it can run, else why not.
std::string instance_refusal(const void* kernel, size_t smem, int optin, cudaFuncAttributes* attr) {
  const cudaError_t e = cudaFuncGetAttributes(attr, kernel);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no kernel image for this device in this build (") + cudaGetErrorString(e) + ")";
  }
  if (smem > static_cast<size_t>(optin))
    return "tile needs " + std::to_string(smem / 1024) + " KB of shared memory, the device allows " +
           std::to_string(optin / 1024) + " KB";
  return "";
}

struct Pick {
  const FlashKernelInfo* info = nullptr;
  detail::CudaSelection sel;
};

Pick pick(const detail::FwdProblem& p, int arch) {
  Pick r;
  auto no = [&](std::string why) {
    r.sel = {"", std::move(why)};
    return r;
  };
  if (std::string why = mma_shape_refusal(p, arch); !why.empty()) return no(why);
  if (!aligned(p.q, 16) || !aligned(p.k, 16) || !aligned(p.v, 16) || !aligned(p.o, 16))
    return no("q, k, v and o must be 16-byte aligned (16-byte vector loads/stores)");
  if (!strides_ok(p.q_stride, p, p.seqlen_q, p.heads_q, kVecElems) ||
      !strides_ok(p.k_stride, p, p.seqlen_k, p.heads_kv, kVecElems) ||
      !strides_ok(p.v_stride, p, p.seqlen_k, p.heads_kv, kVecElems) ||
      !strides_ok(p.o_stride, p, p.seqlen_q, p.heads_q, kVecElems))
    return no("q/k/v/o strides must be multiples of 8 elements (16-byte vector loads/stores)");
  const int64_t total_len = p.seqlen_q + p.seqlen_k;
  if (total_len >= (int64_t{1} << 30))
    return no("seqlen_q + seqlen_k must be below 2^30 (32-bit positions in the kernel)");
  const FlashKernelInfo* info = nullptr;
  for (const auto& k : flash_table())
    if (k.head_dim >= p.head_dim) {
      info = &k;
      break;
    }
  const int64_t m_blocks = (p.seqlen_q + info->block_m - 1) / info->block_m;
  if (m_blocks * p.heads_q * p.batch > INT_MAX)
    return no("query blocks x heads x batch exceeds the 2^31-1 grid limit");

  DeviceGuard guard(p.device_index);
  cudaFuncAttributes attr{};
  const size_t smem = info->smem_bytes;
  if (std::string why = instance_refusal(p.dtype == DType::bf16 ? info->kernel_bf16 : info->kernel_f16, smem,
                                         device_smem_optin(p.device_index), &attr);
      !why.empty())
    return no(why);
  r.info = info;
  std::string name = "cuda/flash sm" + std::to_string(arch) + " mma.sync " + dtype_name(p.dtype) + " hdim" +
                     std::to_string(info->head_dim);
  if (info->head_dim != p.head_dim) name += "(d" + std::to_string(p.head_dim) + " zero-padded)";
  name += " " + detail::mask_name(p) + " tile " + std::to_string(info->block_m) + "x" +
          std::to_string(info->block_n) + " warps " + std::to_string(info->warps);
  std::string reason = std::string(info->reason) + "; K/V ring " + std::to_string(info->stages) + " stage" +
                       (info->stages > 1 ? "s" : "") + ", " + std::to_string(smem / 1024) + " KB smem, " +
                       std::to_string(attr.numRegs) + " regs/thread";
  if (info->head_dim != p.head_dim)
    reason += "; head_dim " + std::to_string(p.head_dim) + " runs on the hdim" + std::to_string(info->head_dim) +
              " kernel with zero-filled columns";
  r.sel = {name, reason};
  return r;
}

// Windows that reach past both sequences are the same as unbounded; mapping them to -1 keeps
// every position the kernel computes inside int32.
int clamp_window(int64_t w, int64_t total_len) { return (w < 0 || w >= total_len) ? -1 : static_cast<int>(w); }

// The kernel parameters of a forward problem (both modes; the caller checked the ranges).
FlashParams flash_params(const detail::FwdProblem& p, int block_m) {
  FlashParams fp;
  fp.q = p.q;
  fp.k = p.k;
  fp.v = p.v;
  fp.o = p.o;
  fp.lse = p.lse;
  fp.q_batch = p.q_stride.batch, fp.q_seq = p.q_stride.seq, fp.q_head = p.q_stride.head;
  fp.k_batch = p.k_stride.batch, fp.k_seq = p.k_stride.seq, fp.k_head = p.k_stride.head;
  fp.v_batch = p.v_stride.batch, fp.v_seq = p.v_stride.seq, fp.v_head = p.v_stride.head;
  fp.o_batch = p.o_stride.batch, fp.o_seq = p.o_stride.seq, fp.o_head = p.o_stride.head;
  fp.lse_batch = p.lse_stride.batch, fp.lse_seq = p.lse_stride.seq, fp.lse_head = p.lse_stride.head;
  fp.batch = static_cast<int>(p.batch);
  fp.heads_q = static_cast<int>(p.heads_q);
  fp.group = static_cast<int>(p.group());
  fp.seqlen_q = static_cast<int>(p.seqlen_q);
  fp.seqlen_k = static_cast<int>(p.seqlen_k);
  fp.head_dim = static_cast<int>(p.head_dim);
  fp.num_m_blocks = static_cast<int>((p.seqlen_q + block_m - 1) / block_m);
  fp.cu_seqlens_q = p.cu_seqlens_q;
  fp.cu_seqlens_k = p.cu_seqlens_k;
  fp.scale = p.scale;
  fp.scale_log2 = p.scale * kLog2e;
  fp.softcap = p.softcap;
  fp.softcap_inv = p.softcap > 0 ? 1.f / p.softcap : 0.f;
  const int64_t total_len = p.seqlen_q + p.seqlen_k;
  fp.window_left = clamp_window(p.window_left, total_len);
  fp.window_right = clamp_window(p.window_right, total_len);
  fp.alibi_slopes = p.alibi_slopes;
  fp.sinks = p.sinks;
  return fp;
}

// ---- KV-cache mode: decode() with more than 16 query rows ------------------------------------

const std::array<FlashCacheKernelInfo, 3>& flash_cache_table() {
  static const std::array<FlashCacheKernelInfo, 3> table = {flash_cache_info_hdim64(), flash_cache_info_hdim128(),
                                                            flash_cache_info_hdim256()};
  return table;
}

int cache_kind(DType cache) { return cache == DType::f8e4m3 ? 1 : cache == DType::i8 ? 2 : 0; }

struct CachePick {
  const FlashCacheKernelInfo* info = nullptr;
  bool staged = false;  // 8-bit tiles staged by cp.async (the default where they apply)
  detail::CudaSelection sel;
};

// IOATTN_PREFILL_8BIT: "staged" (the default since session 27: cp.async into a staging buffer,
// converted after the wait; H200, 512 rows, GQA 32/8 hdim 128, f8e4m3 cache: 1.2-1.6x the register
// path, docs/PERF.md) or "regs" (8-bit codes loaded to registers, converted, stored, which exposes
// the global latency twice per block); anything else is an error.
bool prefill_8bit_staged() {
  const char* e = std::getenv("IOATTN_PREFILL_8BIT");
  if (e == nullptr || *e == '\0' || std::strcmp(e, "staged") == 0) return true;
  if (std::strcmp(e, "regs") == 0) return false;
  throw Error("IOATTN_PREFILL_8BIT", std::string("ioattn: IOATTN_PREFILL_8BIT must be regs or staged, got '") + e + "'");
}

CachePick pick_cache(const detail::FwdProblem& p, int arch) {
  CachePick r;
  auto no = [&](std::string why) {
    r.sel = {"", std::move(why)};
    return r;
  };
  if (std::string why = mma_shape_refusal(p, arch); !why.empty()) return no(why);
  const bool eight = p.kvt() == DType::f8e4m3 || p.kvt() == DType::i8;
  if (!eight && p.kvt() != p.dtype)
    return no(std::string("the cache must hold q's dtype or 8-bit codes, got ") + dtype_name(p.kvt()));
  const size_t cache_align = eight ? 8 : 16;  // 8 codes or 8 elements per copy
  if (!aligned(p.q, 16) || !aligned(p.o, 16) || !aligned(p.k, cache_align) || !aligned(p.v, cache_align))
    return no("q and o must be 16-byte aligned and the caches " + std::to_string(cache_align) +
              "-byte aligned (vector loads / stores)");
  // (cache strides: batch = the page stride over num_pages pages, seq = the slot stride)
  const int64_t pages = p.block_table != nullptr ? p.num_pages : p.batch;
  if (!strides_ok(p.q_stride, p, p.seqlen_q, p.heads_q, kVecElems) ||
      !strides_ok(p.o_stride, p, p.seqlen_q, p.heads_q, kVecElems) ||
      !strides_ok(p.k_stride, pages, p.page_size, p.heads_kv, kVecElems) ||
      !strides_ok(p.v_stride, pages, p.page_size, p.heads_kv, kVecElems))
    return no("q / o / cache strides must be multiples of 8 elements (vector loads / stores)");
  if (p.seqlen_q + p.kv_bound >= (int64_t{1} << 30))
    return no("seqlen_q + the cache capacity must be below 2^30 (32-bit positions in the kernel)");
  const FlashCacheKernelInfo* info = nullptr;
  for (const auto& k : flash_cache_table())
    if (k.head_dim >= p.head_dim) {
      info = &k;
      break;
    }
  const int64_t m_blocks = (p.seqlen_q + info->block_m - 1) / info->block_m;
  if (m_blocks * p.heads_q * p.batch > INT_MAX) return no("query blocks x heads x batch exceeds the 2^31-1 grid limit");
  // Staged 8-bit tiles (unless IOATTN_PREFILL_8BIT=regs), where the code rows allow 16-byte copies.
  std::string staged_note;
  if (eight && prefill_8bit_staged()) {
    const bool ok16 = aligned(p.k, 16) && aligned(p.v, 16) && p.head_dim % 16 == 0 &&
                      p.k_stride.batch % 16 == 0 && p.k_stride.seq % 16 == 0 && p.k_stride.head % 16 == 0 &&
                      p.v_stride.batch % 16 == 0 && p.v_stride.seq % 16 == 0 && p.v_stride.head % 16 == 0;
    r.staged = ok16;
    staged_note = ok16 ? "; 8-bit tiles staged by cp.async, converted after the wait (IOATTN_PREFILL_8BIT=regs: "
                         "through registers)"
                       : "; 8-bit tiles staged not applicable (needs 16-byte aligned code rows and "
                         "head_dim % 16 == 0): codes through registers";
  }
  DeviceGuard guard(p.device_index);
  const int optin = device_smem_optin(p.device_index);
  if (r.staged && info->smem_bytes_staged > static_cast<size_t>(optin)) {  // (sm_80 at hdim 256)
    r.staged = false;
    staged_note = "; 8-bit tiles staged not applicable (their staging buffers need " +
                  std::to_string(info->smem_bytes_staged / 1024) + " KB of shared memory, the device allows " +
                  std::to_string(optin / 1024) + " KB): codes through registers";
  }
  cudaFuncAttributes attr{};
  const int qi = p.dtype == DType::bf16 ? 0 : 1;
  const void* kernel = r.staged ? info->staged[qi][cache_kind(p.kvt()) - 1] : info->kernels[qi][cache_kind(p.kvt())];
  const size_t smem = r.staged ? info->smem_bytes_staged : info->smem_bytes;
  if (std::string why = instance_refusal(kernel, smem, optin, &attr); !why.empty()) return no(why);
  r.info = info;
  std::string name = "cuda/flash cache-prefill sm" + std::to_string(arch) + " mma.sync hdim" +
                     std::to_string(info->head_dim) + " tile " + std::to_string(info->block_m) + "x" +
                     std::to_string(info->block_n) + " warps " + std::to_string(info->warps) +
                     (r.staged ? " 8bit-staged" : "");
  std::string reason = "the flash forward's hdim" + std::to_string(info->head_dim) +
                       " tile reading K / V through the cache (a shared-memory table of row offsets per key "
                       "block: any page size; lengths from cache_seqlens on the device)" +
                       std::string(eight ? "; 8-bit codes converted to exact 16-bit values on load, scales "
                                           "folded into the score scale and O"
                                         : "") +
                       staged_note + ", " + std::to_string(smem / 1024) + " KB smem, " +
                       std::to_string(attr.numRegs) + " regs/thread";
  if (info->head_dim != p.head_dim)
    reason += "; head_dim " + std::to_string(p.head_dim) + " runs zero-padded";
  r.sel = {name, reason};
  return r;
}

}  // namespace
}  // namespace ioattn::cuda

namespace ioattn::detail {

// sm90: the wgmma/TMA kernel first when its table has the problem; otherwise the mma.sync
// kernel, and the reason says why the Hopper kernel was not used.
CudaSelection cuda_flash_select(const FwdProblem& p, int arch) {
  std::string k90, why90;
  if (arch == 90 && sm90_flash_select(p, &k90, &why90)) return {k90, why90};
  if (p.dtype == DType::f8e4m3)  // the mma.sync kernel has no fp8 path: say why the sm90 one refused
    return {"", arch == 90 ? "the sm90 fp8 kernel cannot run it: " + why90
                           : "f8e4m3 inputs run only on the sm90 wgmma kernel (device is sm" + std::to_string(arch) + ")"};
  CudaSelection s = cuda::pick(p, arch).sel;
  if (arch == 90 && !s.kernel.empty()) s.reason += "; sm90 wgmma kernel not used: " + why90;
  return s;
}

void cuda_flash_forward(const FwdProblem& p) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0) return;  // no output element (varlen: seqlen_q = the longest)
  const int arch = cuda_device_arch(p.device_index);
  if (arch == 90 && sm90_flash_select(p, nullptr, nullptr)) {
    sm90_flash_forward(p);
    return;
  }
  const cuda::Pick pk = cuda::pick(p, arch);
  if (pk.info == nullptr) throw Error("q", "ioattn: no CUDA flash kernel: " + pk.sel.reason);
  cuda::DeviceGuard guard(p.device_index);

  const cuda::FlashParams fp = cuda::flash_params(p, pk.info->block_m);
  pk.info->launch(fp, p.dtype == DType::bf16, static_cast<cudaStream_t>(p.stream));
}

// sm90: the Hopper kernel's KV-cache rows where they take the problem (16-bit caches; session 27),
// else the mma.sync forward's KV-cache mode, and the reason says why.
CudaSelection cuda_cache_prefill_select(const FwdProblem& p, int arch) {
  std::string k90, why90;
  if (arch == 90 && sm90_cache_prefill_select(p, &k90, &why90)) return {k90, why90};
  CudaSelection s = cuda::pick_cache(p, arch).sel;
  if (arch == 90 && !s.kernel.empty()) s.reason += "; sm90 wgmma kernel not used: " + why90;
  return s;
}

void cuda_cache_prefill(const FwdProblem& p) {
  const int arch = cuda_device_arch(p.device_index);
  if (arch == 90 && sm90_cache_prefill_select(p, nullptr, nullptr)) {
    sm90_cache_prefill(p);
    return;
  }
  const cuda::CachePick pk = cuda::pick_cache(p, arch);
  if (pk.info == nullptr) throw Error("q", "ioattn: no CUDA cache-prefill kernel: " + pk.sel.reason);
  if (p.batch == 0) return;
  cuda::DeviceGuard guard(p.device_index);
  cuda::FlashParams fp = cuda::flash_params(p, pk.info->block_m);  // (k_batch: the page stride when paged)
  fp.kv_lens = p.kv_lens;
  fp.block_table = p.block_table;
  fp.bt_batch = p.bt_stride_batch, fp.bt_page = p.bt_stride_page;
  fp.page_size = p.block_table != nullptr ? static_cast<int>(p.page_size) : 1;
  fp.page_shift = -1;
  for (int sh = 0; sh < 31 && p.block_table != nullptr; ++sh)
    if ((int64_t{1} << sh) == p.page_size) fp.page_shift = sh;
  fp.num_pages = p.num_pages;
  fp.kv_bound = static_cast<int>(p.kv_bound);
  fp.k_scale = p.k_descale.ptr;
  fp.v_scale = p.v_descale.ptr;
  pk.info->launch(fp, p.dtype == DType::bf16, cuda::cache_kind(p.kvt()), pk.staged, static_cast<cudaStream_t>(p.stream));
}

std::vector<std::string> cuda_compiled_kernels() {
  std::vector<std::string> rows;
  for (const auto& k : cuda::flash_table())
    for (const char* dt : {"bf16", "f16"})
      rows.push_back("cuda/flash mma.sync " + std::string(dt) + " hdim" + std::to_string(k.head_dim) + " tile " +
                     std::to_string(k.block_m) + "x" + std::to_string(k.block_n) + " warps " +
                     std::to_string(k.warps) + (k.q_in_regs ? " q-in-regs" : ""));
  rows.push_back("cuda/flash sm90 wgmma+tma bf16/f16 hdim 64/128/256, f8e4m3 hdim 64/128/256 (in sm_90a images)");
  rows.push_back("cuda/flash-backward mma.sync bf16/f16 hdim 64/128/256 (others padded up to 256), dQ atomic or deterministic");
  rows.push_back("cuda/flash-backward sm90 wgmma bf16/f16 hdim 64/128 (dQ by TMA reduce-add) and 256 (dQ by a second "
                 "wgmma pass, no atomics), deterministic too (in sm_90a images)");
  rows.push_back("cuda/flash cache-prefill sm90 wgmma+tma bf16/f16 hdim 64/128/256: caches of q's dtype read "
                 "directly (contiguous, or page size a multiple of 8 that divides the key block or is a multiple "
                 "of it, pieces of >= 64 rows), other page sizes and f8e4m3/i8 caches through a gathered "
                 "contiguous copy (in sm_90a images)");
  rows.push_back("cuda/flash cache-prefill mma.sync bf16/f16 hdim 64/128/256 over bf16/f16/f8e4m3/i8 caches, paged or "
                 "contiguous (decode() with more than 16 query rows; 8-bit tiles staged by default: "
                 "IOATTN_PREFILL_8BIT)");
  rows.push_back("cuda/decode split-KV mma.sync (bf16/f16 hdim 64/128/256) and fma (any dtype incl. f8e4m3/i8 KV), paged or contiguous");
  rows.push_back("cuda/naive cublas f32/f16/bf16 any head_dim (S fp32 and P materialised in HBM)");
  return rows;
}

}  // namespace ioattn::detail

// flash_launch.cuh — turns one traits struct into the dispatcher's FlashKernelInfo row (bf16 and
// f16 kernels, their launch, their shared-memory needs). Included by exactly one .cu per head dim
// so the 12 instantiations compile in parallel.
#pragma once

#include "cuda/check.cuh"
#include "cuda/flash_fwd.cuh"

namespace ioattn::cuda {

template <class Tr, typename T>
void launch_flash_fwd(const FlashParams& p, cudaStream_t stream, int64_t grid_x) {
  const size_t smem = Tr::kSmemBytes;
  auto* kernel = &flash_fwd_kernel<Tr, T>;
  if (smem > 48 * 1024)
    IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
  kernel<<<static_cast<unsigned>(grid_x), Tr::kThreads, smem, stream>>>(p);
  IOATTN_CUDA_CHECK_LAUNCH("flash_fwd_kernel");
}

template <class Tr>
void launch_flash_any(const FlashParams& p, bool is_bf16, cudaStream_t stream) {
  const int64_t grid_x = static_cast<int64_t>(p.num_m_blocks) * p.heads_q * p.batch;
  if (grid_x <= 0) return;
  if (is_bf16)
    launch_flash_fwd<Tr, __nv_bfloat16>(p, stream, grid_x);
  else
    launch_flash_fwd<Tr, __half>(p, stream, grid_x);
}

template <class Tr>
FlashKernelInfo make_flash_info(const char* reason) {
  FlashKernelInfo info{};
  info.head_dim = Tr::kHeadDim;
  info.block_m = Tr::kBlockM;
  info.block_n = Tr::kBlockN;
  info.warps = Tr::kWarps;
  info.stages = Tr::kStages;
  info.q_in_regs = Tr::kQInRegs;
  info.reason = reason;
  info.smem_bytes = Tr::kSmemBytes;
  info.kernel_bf16 = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, __nv_bfloat16>);
  info.kernel_f16 = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, __half>);
  info.launch = &launch_flash_any<Tr>;
  return info;
}

// KV-cache mode (decode() with more than 16 query rows): per head dim of {64, 128, 256}, the
// kernels for bf16 / f16 queries over a cache of the same dtype, f8e4m3 or int8 codes (those two
// also through registers instead of staged tiles: IOATTN_PREFILL_8BIT=regs, flash_dispatch.cu).
struct FlashCacheKernelInfo {
  int head_dim, block_m, block_n, warps, stages;
  size_t smem_bytes;         // the tile + the row tables
  size_t smem_bytes_staged;  // + the 8-bit codes' staging buffers
  const void* kernels[2][3];  // [q: bf16, f16][cache: same as q, f8e4m3, i8]
  const void* staged[2][2];   // [q: bf16, f16][cache: f8e4m3, i8], 8-bit tiles staged by cp.async
  void (*launch)(const FlashParams& p, bool is_bf16, int cache_kind, bool staged, cudaStream_t stream);
};

template <class Tr, typename T, typename CT, bool kStaged = false>
void launch_flash_cache(const FlashParams& p, cudaStream_t stream, int64_t grid_x) {
  const size_t smem = Tr::kSmemBytes + cache_table_bytes<Tr>() + (kStaged ? cache_stage_bytes<Tr>() : 0);
  auto* kernel = &flash_fwd_kernel<Tr, T, CT, kStaged>;
  if (smem > 48 * 1024)
    IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
  kernel<<<static_cast<unsigned>(grid_x), Tr::kThreads, smem, stream>>>(p);
  IOATTN_CUDA_CHECK_LAUNCH("flash_fwd_kernel (kv cache)");
}

template <class Tr, typename T>
void launch_flash_cache_q(const FlashParams& p, int cache_kind, bool staged, cudaStream_t stream, int64_t grid_x) {
  if (cache_kind == 0)
    launch_flash_cache<Tr, T, T>(p, stream, grid_x);
  else if (cache_kind == 1 && staged)
    launch_flash_cache<Tr, T, serving::E4m3, true>(p, stream, grid_x);
  else if (cache_kind == 1)
    launch_flash_cache<Tr, T, serving::E4m3>(p, stream, grid_x);
  else if (staged)
    launch_flash_cache<Tr, T, int8_t, true>(p, stream, grid_x);
  else
    launch_flash_cache<Tr, T, int8_t>(p, stream, grid_x);
}

template <class Tr>
void launch_flash_cache_any(const FlashParams& p, bool is_bf16, int cache_kind, bool staged, cudaStream_t stream) {
  const int64_t grid_x = static_cast<int64_t>(p.num_m_blocks) * p.heads_q * p.batch;
  if (grid_x <= 0) return;
  if (is_bf16)
    launch_flash_cache_q<Tr, __nv_bfloat16>(p, cache_kind, staged, stream, grid_x);
  else
    launch_flash_cache_q<Tr, __half>(p, cache_kind, staged, stream, grid_x);
}

template <class Tr>
FlashCacheKernelInfo make_flash_cache_info() {
  FlashCacheKernelInfo info{};
  info.head_dim = Tr::kHeadDim;
  info.block_m = Tr::kBlockM;
  info.block_n = Tr::kBlockN;
  info.warps = Tr::kWarps;
  info.stages = Tr::kStages;
  info.smem_bytes = Tr::kSmemBytes + cache_table_bytes<Tr>();
  info.smem_bytes_staged = info.smem_bytes + cache_stage_bytes<Tr>();
  using B = __nv_bfloat16;
  using H = __half;
  info.kernels[0][0] = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, B, B>);
  info.kernels[0][1] = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, B, serving::E4m3>);
  info.kernels[0][2] = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, B, int8_t>);
  info.kernels[1][0] = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, H, H>);
  info.kernels[1][1] = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, H, serving::E4m3>);
  info.kernels[1][2] = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, H, int8_t>);
  info.staged[0][0] = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, B, serving::E4m3, true>);
  info.staged[0][1] = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, B, int8_t, true>);
  info.staged[1][0] = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, H, serving::E4m3, true>);
  info.staged[1][1] = reinterpret_cast<const void*>(&flash_fwd_kernel<Tr, H, int8_t, true>);
  info.launch = &launch_flash_cache_any<Tr>;
  return info;
}

// One per head dim, defined in flash_fwd_hdim<D>.cu.
FlashKernelInfo flash_info_hdim32();
FlashKernelInfo flash_info_hdim64();
FlashKernelInfo flash_info_hdim96();
FlashKernelInfo flash_info_hdim128();
FlashKernelInfo flash_info_hdim192();
FlashKernelInfo flash_info_hdim256();
FlashCacheKernelInfo flash_cache_info_hdim64();
FlashCacheKernelInfo flash_cache_info_hdim128();
FlashCacheKernelInfo flash_cache_info_hdim256();

}  // namespace ioattn::cuda

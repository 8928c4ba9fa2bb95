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

// One per head dim, defined in flash_fwd_hdim<D>.cu.
FlashKernelInfo flash_info_hdim32();
FlashKernelInfo flash_info_hdim64();
FlashKernelInfo flash_info_hdim96();
FlashKernelInfo flash_info_hdim128();
FlashKernelInfo flash_info_hdim192();
FlashKernelInfo flash_info_hdim256();

}  // namespace ioattn::cuda

// flash_bwd_launch.cuh — the dispatch table of the mma.sync flash backward: one traits struct per
// head dim, each with the reason for its tile written next to it, and the launch of one row's
// kernels. Only these are instantiated (x2 dtypes); a head_dim that is a multiple of 8 runs on
// the next size up with zero-filled columns, and anything above the largest row is refused by
// cuda_backward_select with the reason.
//
// Register budget: the dK/dV kernel keeps dK and dV of 16 keys x kAccCols in fp32 registers per
// warp (kAccCols regs/thread) next to S^T and dP^T (kBlockM regs/thread); at 255 regs/thread that
// caps kAccCols + kBlockM near 192, which is why hdim256 splits its columns over 2 CTAs.
#pragma once

#include "cuda/check.cuh"
#include "cuda/flash_bwd.cuh"

namespace ioattn::detail {
struct BwdProblem;
}

namespace ioattn::cuda {

template <int kHeadDim>
struct BwdTraits;

// BwdTile<head_dim, query rows per step, warps (x16 keys), CTAs/SM, dQ-kernel keys per step,
//         dQ-kernel warps (x16 rows), dQ-kernel CTAs/SM>
template <>
struct BwdTraits<64> : BwdTile<64, 128, 8, 1, 64, 4, 2> {
  static constexpr const char* kReason =
      "hdim64: FlashAttention-2's 128x128 block: 8 warps x 16 keys, 128 query rows per step (dK+dV 64 regs, "
      "S^T+dP^T 128 regs per thread; ptxas spills ~52 B), 144 KB smem; H200 tile sweep (ioattn_cuda_bwd_tune, "
      "2026-11-29): 1.03-1.06x the 64x128 tile on the FA grid";
};

// ptxas (nvcc 13): the hdim128 dK/dV kernel takes all 255 registers and spills 24 B (sm_90a) / 48 B
// (sm_80) of loop-invariant addresses, reloaded a few times per query block outside the mma loops.
// Computing each step as two 32-query halves removes the spill but reloads the K/V fragments
// (+16 ldmatrix.x4 per warp per step, ~+9% shared-memory traffic), which costs more than ~6 L1
// hits per thread per step. TODO(GPU): measure both.
template <>
struct BwdTraits<128> : BwdTile<128, 64, 8, 1, 64, 4, 2> {
  static constexpr const char* kReason =
      "hdim128: 8 warps x 16 keys = 128 keys per CTA (dK+dV 128 regs, S^T+dP^T 64 regs per thread at 64 "
      "query rows per step; FlashAttention-2's 64x128 block), 155 KB smem fits sm_80's 163 KB; first "
      "choice, not yet tuned on a GPU";
};

template <>
struct BwdTraits<256> : BwdTile<256, 32, 4, 1, 32, 4, 1, 2> {
  static constexpr const char* kReason =
      "hdim256: dK+dV of 16 keys x 256 columns would need 256 regs/thread, so 2 CTAs share each block of "
      "64 keys (4 warps x 16), each accumulating dK, dV, dQ for 128 columns and recomputing S and dP "
      "(7 GEMMs instead of 5); 32 query rows (dQ pass: 32 keys) per step keep S and dP at 32 regs and "
      "the smem at 141 KB (fits sm_80); the fallback where the 8-warp tile's 208 KB do not fit";
};

// hdim256 where the device lets a CTA have 208 KB of shared memory (sm_90): the same column split
// with 8 warps x 16 = 128 keys per CTA, so an SM runs 8 warps instead of 4 and each Q/dO row
// loaded serves twice the keys. H200 tile sweep (ioattn_cuda_bwd_tune, 2026-11-29): 1.12-1.28x the
// 4-warp tile on the FA grid. Listed before BwdTraits<256>: the selector takes the first row of
// the head dim whose shared memory fits.
struct BwdTraits256Wide : BwdTile<256, 32, 8, 1, 32, 4, 1, 2> {
  static constexpr const char* kReason =
      "hdim256 wide: 2 CTAs (column halves) per block of 128 keys, 8 warps x 16 keys, 32 query rows per "
      "step, 208 KB smem (sm_90); H200 sweep: 1.12-1.28x the 4-warp tile";
};

// The dK/dV kernel of one traits row (default mode: it also accumulates the fp32 dQ partials).
// Split from launch_flash_bwd_typed so that ioattn_cuda_bwd_tune can launch a candidate tile
// without instantiating its deterministic dQ kernel.
template <class Tr, typename T>
void launch_flash_bwd_dkdv(const BwdParams& p, cudaStream_t stream) {
  const bool deterministic = p.ws_dq == nullptr;
  const int64_t grid_kv = static_cast<int64_t>(p.num_n_blocks) * p.heads_kv * p.batch * Tr::kColSplits;
  if (grid_kv > 0) {
    auto* kernel = &flash_bwd_dkdv_kernel<Tr, T>;
    // The attribute is the larger size, so one setting serves both modes.
    IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(Tr::kSmemBytes)));
    const size_t smem = deterministic ? Tr::kSmemNoDs : Tr::kSmemBytes;
    kernel<<<static_cast<unsigned>(grid_kv), Tr::kThreads, smem, stream>>>(p);
    IOATTN_CUDA_CHECK_LAUNCH("flash_bwd_dkdv_kernel");
  }
}

// Deterministic mode's atomic-free dQ pass: one row's flash_bwd_dq_kernel (bf16 or f16 instance),
// launched through its pointer so that the wgmma backward (hopper/flash_bwd_sm90.cu), whose dK/dV
// kernel is its own, runs the same pass from the row's BwdKernelInfo.
inline void launch_flash_bwd_dq_pass(const BwdParams& p, const void* kernel, int threads, size_t smem,
                                     cudaStream_t stream) {
  const int64_t grid_q = static_cast<int64_t>(p.num_m_blocks) * p.heads_q * p.batch;
  if (grid_q == 0) return;
  if (smem > 48 * 1024)
    IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  BwdParams arg = p;
  void* args[] = {&arg};
  IOATTN_CUDA_CHECK(cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(grid_q)), dim3(static_cast<unsigned>(threads)),
                                     args, smem, stream));
  IOATTN_CUDA_CHECK_LAUNCH("flash_bwd_dq_kernel");
}

template <class Tr, typename T>
void launch_flash_bwd_typed(const BwdParams& p, cudaStream_t stream) {
  launch_flash_bwd_dkdv<Tr, T>(p, stream);
  if (p.ws_dq == nullptr)  // deterministic mode: the atomic-free dQ pass
    launch_flash_bwd_dq_pass(p, reinterpret_cast<const void*>(&flash_bwd_dq_kernel<Tr, T>), Tr::kDqThreads,
                             Tr::kDqSmemBytes, stream);
}

template <class Tr>
void launch_flash_bwd_any(const BwdParams& p, bool is_bf16, cudaStream_t stream) {
  if (is_bf16)
    launch_flash_bwd_typed<Tr, __nv_bfloat16>(p, stream);
  else
    launch_flash_bwd_typed<Tr, __half>(p, stream);
}

// The tile fields of a table row (no kernel pointers): shared by make_bwd_info and the
// candidates of ioattn_cuda_bwd_tune.
template <class Tr>
BwdKernelInfo bwd_info_shape() {
  BwdKernelInfo info{};
  info.head_dim = Tr::kHeadDim;
  info.block_m = Tr::kBlockM;
  info.block_n = Tr::kBlockN;
  info.warps = Tr::kWarps;
  info.dq_block_m = Tr::kDqBlockM;
  info.dq_block_n = Tr::kDqBlockN;
  info.dq_warps = Tr::kDqWarps;
  info.col_splits = Tr::kColSplits;
  info.smem_bytes = Tr::kSmemBytes;
  info.smem_bytes_det = Tr::kSmemNoDs;
  info.dq_smem_bytes = Tr::kDqSmemBytes;
  return info;
}

template <class Tr>
BwdKernelInfo make_bwd_info() {
  BwdKernelInfo info = bwd_info_shape<Tr>();
  info.reason = Tr::kReason;
  info.dkdv_bf16 = reinterpret_cast<const void*>(&flash_bwd_dkdv_kernel<Tr, __nv_bfloat16>);
  info.dkdv_f16 = reinterpret_cast<const void*>(&flash_bwd_dkdv_kernel<Tr, __half>);
  info.dq_bf16 = reinterpret_cast<const void*>(&flash_bwd_dq_kernel<Tr, __nv_bfloat16>);
  info.dq_f16 = reinterpret_cast<const void*>(&flash_bwd_dq_kernel<Tr, __half>);
  info.launch = &launch_flash_bwd_any<Tr>;
  return info;
}

// One per head dim, defined in flash_bwd_hdim<D>.cu.
BwdKernelInfo bwd_info_hdim64();
BwdKernelInfo bwd_info_hdim128();
BwdKernelInfo bwd_info_hdim256();
BwdKernelInfo bwd_info_hdim256_wide();
// The wgmma kernels (hopper/flash_bwd_sm90.cu): sm_90's default at hdim 64, 128 and 256.
BwdKernelInfo bwd_info_sm90_hdim128();
BwdKernelInfo bwd_info_sm90_hdim64();
BwdKernelInfo bwd_info_sm90_hdim256();

// The backward's launch sequence on bp's stream with the kernels of `info` (flash_bwd_dispatch.cu):
// BwdParams from the validated problem, the stream-ordered workspace, preprocess, dsinks,
// info.launch (dK/dV, + the dQ pass in deterministic mode), dQ convert. cuda_flash_backward calls
// it with the row that cuda_backward_select picked; ioattn_cuda_bwd_tune with candidate tiles
// (which must fit the device's shared memory: no check here).
void run_flash_backward(const detail::BwdProblem& bp, const BwdKernelInfo& info);

}  // namespace ioattn::cuda

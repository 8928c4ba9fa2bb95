// Dispatch-table rows of the sm90 FP8 forward (hdim 128, bf16 or f16 O; causal or not) and the
// V transpose pre-pass. See flash_fwd_sm90_fp8.cuh.
#include "cuda/hopper/flash_fwd_sm90_fp8.cuh"

namespace ioattn::cuda::sm90 {
namespace {

__global__ void __launch_bounds__(256) fp8_transpose_v(const Fp8TransposeArgs a) {
  __shared__ uint8_t tile[64][64 + 4];  // [key][dim]; +4: column reads hit different banks
  const int dblocks = a.head_dim / 64;
  const int k0 = blockIdx.y * 64, d0 = (blockIdx.x % dblocks) * 64;
  const int bh = blockIdx.x / dblocks, b = bh / a.heads_kv, h = bh % a.heads_kv;
  for (int i = threadIdx.x; i < 64 * 16; i += 256) {
    const int key = i / 16, c4 = i % 16;
    uint32_t w = 0;
    if (k0 + key < a.seqlen_k)
      w = *reinterpret_cast<const uint32_t*>(a.v + b * a.v_batch + static_cast<int64_t>(k0 + key) * a.v_seq +
                                             h * a.v_head + d0 + 4 * c4);
    *reinterpret_cast<uint32_t*>(&tile[key][4 * c4]) = w;
  }
  __syncthreads();
  uint8_t* out = a.vt + (static_cast<int64_t>(bh) * a.head_dim + d0) * a.skp + k0;
  for (int i = threadIdx.x; i < 64 * 16; i += 256) {
    const int x = i / 16, c4 = i % 16;
    uint32_t w = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 4 * c4 + e;
      w |= static_cast<uint32_t>(tile[(c & ~31) + fp8_p_key(c & 31)][x]) << (8 * e);
    }
    *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(x) * a.skp + 4 * c4) = w;
  }
}

}  // namespace

void fp8_transpose_v_launch(const Fp8TransposeArgs& a, int64_t batch, cudaStream_t stream) {
  // x: (batch, kv head, 64-dim block) (up to 2^31 - 1), y: 64-key block (skp / 64 <= 65535).
  const dim3 grid(static_cast<unsigned>(batch * a.heads_kv * (a.head_dim / 64)), static_cast<unsigned>(a.skp / 64));
  fp8_transpose_v<<<grid, 256, 0, stream>>>(a);
  IOATTN_CUDA_CHECK_LAUNCH("fp8_transpose_v");
}

using Fp8Hdim128Bf16 = Fp8Traits128<__nv_bfloat16>;
using Fp8Hdim128F16 = Fp8Traits128<__half>;
IOATTN_SM90_FP8_INSTANTIATE(Fp8Hdim128Bf16, false)
IOATTN_SM90_FP8_INSTANTIATE(Fp8Hdim128Bf16, true)
IOATTN_SM90_FP8_INSTANTIATE(Fp8Hdim128F16, false)
IOATTN_SM90_FP8_INSTANTIATE(Fp8Hdim128F16, true)

}  // namespace ioattn::cuda::sm90

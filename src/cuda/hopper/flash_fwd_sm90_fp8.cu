// Dispatch-table rows of the sm90 FP8 forward (hdim 64, 128 and 256, bf16 or f16 O; causal or not) and the
// V transpose pre-pass. See flash_fwd_sm90_fp8.cuh.
#include "cuda/hopper/flash_fwd_sm90_fp8.cuh"

namespace ioattn::cuda::sm90 {
namespace {

// One warp per 32 keys (one fp8_p_key group) x 128 dims of one (batch, kv head), no shared
// memory: lane t loads dims 4t..4t+3 of each of the 32 keys (32 coalesced 128-byte rows per warp),
// transposes the 4 x 4 byte blocks in registers and stores its 4 output rows (dims 4t..4t+3) as
// 32 contiguous bytes each (one full sector). Output position c of a group holds key fp8_p_key(c);
// the positions 4q..4q+3 hold keys k0, k0 + 1, k0 + 8, k0 + 9 with k0 = 16 (q / 4) + 2 (q % 4).
__global__ void __launch_bounds__(128) fp8_transpose_v(const Fp8TransposeArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  // Warp order: key groups fastest, then 128-dim chunks, then (batch, kv head). (Kv heads fastest,
  // so that neighbouring warps read neighbouring 128-byte pieces of a token row, measured slower:
  // 40.1-41.6 vs 37.3-38.0 us for 32 MB, session 15.)
  const bool varlen = a.cu_seqlens_k != nullptr;
  const int dchunks = (a.head_dim + 127) / 128, groups = a.groups();
  const int64_t bh = warp / (static_cast<int64_t>(groups) * dchunks);
  if (bh >= a.batch_heads) return;
  const int rest = static_cast<int>(warp % (static_cast<int64_t>(groups) * dchunks));
  const int g = rest / dchunks, x0 = (rest % dchunks) * 128 + 4 * lane;
  if (x0 >= a.head_dim) return;
  const int64_t b = bh / a.heads_kv, h = bh % a.heads_kv;
  // Varlen: sequence b's keys from packed token cu[b]; its groups at fp8_vt_col in rows of skp bytes.
  int64_t k0 = 0, dst_off = (bh * a.head_dim + x0) * a.skp + 32 * g;
  int sk = a.seqlen_k;
  if (varlen) {
    k0 = a.cu_seqlens_k[b];
    sk = a.cu_seqlens_k[b + 1] - static_cast<int>(k0);
    const int64_t col = fp8_vt_col(k0, b) + 32 * g;
    dst_off = (h * a.head_dim + x0) * a.skp + col;
    if (32 * g >= sk) {  // past the sequence's last group: zeros up to the next start or the width
      const int64_t end = bh + a.heads_kv < a.batch_heads ? fp8_vt_col(a.cu_seqlens_k[b + 1], b + 1) : a.skp;
      if (col >= end) return;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint4* row = reinterpret_cast<uint4*>(a.vt + dst_off + static_cast<int64_t>(j) * a.skp);
        row[0] = zero;
        row[1] = zero;
      }
      return;
    }
  }
  const uint8_t* src = a.v + b * a.v_batch + k0 * a.v_seq + h * a.v_head + x0;
  uint32_t w[32];
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const int key = 32 * g + k;
    w[k] = key < sk ? *reinterpret_cast<const uint32_t*>(src + key * a.v_seq) : 0u;
  }
  uint32_t out[4][8];
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const int k0 = 16 * (q / 4) + 2 * (q % 4);
    const uint32_t lo_ab = __byte_perm(w[k0], w[k0 + 1], 0x5140), hi_ab = __byte_perm(w[k0], w[k0 + 1], 0x7362);
    const uint32_t lo_cd = __byte_perm(w[k0 + 8], w[k0 + 9], 0x5140), hi_cd = __byte_perm(w[k0 + 8], w[k0 + 9], 0x7362);
    out[0][q] = __byte_perm(lo_ab, lo_cd, 0x5410);  // byte 0 of keys k0, k0+1, k0+8, k0+9
    out[1][q] = __byte_perm(lo_ab, lo_cd, 0x7632);
    out[2][q] = __byte_perm(hi_ab, hi_cd, 0x5410);
    out[3][q] = __byte_perm(hi_ab, hi_cd, 0x7632);
  }
  uint8_t* dst = a.vt + dst_off;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint4* row = reinterpret_cast<uint4*>(dst + static_cast<int64_t>(j) * a.skp);
    row[0] = make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
    row[1] = make_uint4(out[j][4], out[j][5], out[j][6], out[j][7]);
  }
}

}  // namespace

void fp8_transpose_v_launch(const Fp8TransposeArgs& a, int64_t batch, cudaStream_t stream) {
  Fp8TransposeArgs args = a;
  args.batch_heads = batch * a.heads_kv;
  const int64_t warps = args.batch_heads * a.groups() * ((a.head_dim + 127) / 128);
  const int64_t blocks = (warps + 3) / 4;  // 4 warps per block; <= 2^31 - 1 for any realistic cache
  if (blocks == 0) return;                  // varlen with no keys at all
  fp8_transpose_v<<<static_cast<unsigned>(blocks), 128, 0, stream>>>(args);
  IOATTN_CUDA_CHECK_LAUNCH("fp8_transpose_v");
}

IOATTN_SM90_FP8_ROWS(IOATTN_SM90_FP8_INSTANTIATE)

}  // namespace ioattn::cuda::sm90

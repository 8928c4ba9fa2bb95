// flash_fwd_sm90.cu — selector and host launch of the Hopper forward kernel.
//
// The kernel itself (warp-specialised TMA + wgmma, ping-pong) is in flash_fwd_sm90.cuh (the v3
// body, kept for hdim128, in flash_fwd_sm90_v3.cuh) and its dispatch-table rows are instantiated
// in flash_fwd_sm90_hdim{64,128,256}.cu. The per-(hdim, causal) policy (grid, rescale skip and
// placement, 3 consumer warpgroups, body) is default_policy below. This file answers
// "does the sm90 kernel take this problem, and which row?" (sm90_flash_select), builds the TMA
// tensor maps from the problem's int64 strides, and launches (sm90_flash_forward).
//
// Tensor maps are encoded with cuTensorMapEncodeTiled fetched through
// cudaGetDriverEntryPointByVersion, so the library needs no -lcuda.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <initializer_list>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "core/backends.hpp"
#include "cuda/check.cuh"
#include "cuda/hopper/flash_fwd_sm90.cuh"
#include "cuda/hopper/flash_fwd_sm90_fp8.cuh"
#include "cuda/hopper/flash_fwd_sm90_v3.cuh"
#include "cuda/hopper/sm90.hpp"
#include "cuda/serving.cuh"

namespace ioattn::cuda::sm90 {
using Hdim64Bf16 = Sm90Traits<64, __nv_bfloat16, false>;
using Hdim64Bf16Causal = Sm90Traits<64, __nv_bfloat16, true>;
using Hdim64F16 = Sm90Traits<64, __half, false>;
using Hdim64F16Causal = Sm90Traits<64, __half, true>;
using Hdim128Bf16 = Sm90Traits<128, __nv_bfloat16, false>;
using Hdim128Bf16Causal = Sm90Traits<128, __nv_bfloat16, true>;
using Hdim128F16 = Sm90Traits<128, __half, false>;
using Hdim128F16Causal = Sm90Traits<128, __half, true>;
using Hdim256Bf16 = Sm90Traits<256, __nv_bfloat16, false>;
using Hdim256Bf16Causal = Sm90Traits<256, __nv_bfloat16, true>;
using Hdim256F16 = Sm90Traits<256, __half, false>;
using Hdim256F16Causal = Sm90Traits<256, __half, true>;
IOATTN_SM90_EXTERN(Hdim64Bf16, false)
IOATTN_SM90_EXTERN(Hdim64Bf16Causal, true)
IOATTN_SM90_EXTERN(Hdim64F16, false)
IOATTN_SM90_EXTERN(Hdim64F16Causal, true)
IOATTN_SM90_EXTERN(Hdim128Bf16, false)
IOATTN_SM90_EXTERN(Hdim128Bf16Causal, true)
IOATTN_SM90_EXTERN(Hdim128F16, false)
IOATTN_SM90_EXTERN(Hdim128F16Causal, true)
using Hdim128Bf16CausalQRegs = Sm90TraitsQRegs128<__nv_bfloat16>;
using Hdim128F16CausalQRegs = Sm90TraitsQRegs128<__half>;
IOATTN_SM90_EXTERN(Hdim128Bf16CausalQRegs, true)
IOATTN_SM90_EXTERN(Hdim128F16CausalQRegs, true)
IOATTN_SM90_EXTERN(Hdim256Bf16, false)
IOATTN_SM90_EXTERN(Hdim256Bf16Causal, true)
IOATTN_SM90_EXTERN(Hdim256F16, false)
IOATTN_SM90_EXTERN(Hdim256F16Causal, true)
using Hdim64Bf16Wg3 = Sm90Traits3<__nv_bfloat16, false>;
using Hdim64Bf16Wg3Causal = Sm90Traits3<__nv_bfloat16, true>;
using Hdim64F16Wg3 = Sm90Traits3<__half, false>;
using Hdim64F16Wg3Causal = Sm90Traits3<__half, true>;
IOATTN_SM90_EXTERN(Hdim64Bf16Wg3, false)
IOATTN_SM90_EXTERN(Hdim64Bf16Wg3Causal, true)
IOATTN_SM90_EXTERN(Hdim64F16Wg3, false)
IOATTN_SM90_EXTERN(Hdim64F16Wg3Causal, true)
IOATTN_SM90_EXTERN_LOCAL(Hdim64Bf16Wg3Causal)
IOATTN_SM90_EXTERN_LOCAL(Hdim64F16Wg3Causal)
IOATTN_SM90_EXTERN_LOCAL(Hdim128Bf16Causal)
IOATTN_SM90_EXTERN_LOCAL(Hdim128F16Causal)
IOATTN_SM90_EXTERN_LOCAL(Hdim256Bf16Causal)
IOATTN_SM90_EXTERN_LOCAL(Hdim256F16Causal)
IOATTN_SM90_EXTERN_CACHE(Hdim64Bf16Wg3Causal)
IOATTN_SM90_EXTERN_CACHE(Hdim64F16Wg3Causal)
IOATTN_SM90_EXTERN_CACHE(Hdim128Bf16Causal)
IOATTN_SM90_EXTERN_CACHE(Hdim128F16Causal)
IOATTN_SM90_EXTERN_CACHE(Hdim256Bf16Causal)
IOATTN_SM90_EXTERN_CACHE(Hdim256F16Causal)
IOATTN_SM90_V3_EXTERN(Hdim128Bf16, false)
IOATTN_SM90_V3_EXTERN(Hdim128F16, false)
IOATTN_SM90_V3_EXTERN(Hdim128Bf16Causal, true)
IOATTN_SM90_V3_EXTERN(Hdim128F16Causal, true)
IOATTN_SM90_FP8_ROWS(IOATTN_SM90_FP8_EXTERN)

// cuTensorMapEncodeTiled from the driver, looked up once (declared in ptx_sm90.cuh; the backward's
// dQ map uses it too).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    IOATTN_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || f == nullptr)
      throw Error("cuda", "ioattn: the CUDA driver has no cuTensorMapEncodeTiled (driver too old for TMA)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

constexpr int64_t kTmaMaxStrideBytes = int64_t(1) << 40;

// (declared in ptx_sm90.cuh) TMA's rules for a [batch, seq, heads, head_dim] operand: 16-byte
// aligned base, strides (bytes) multiples of 16 below 2^40. Strides of size-1 dims are never used,
// so they are not checked.
bool tma_compatible(const void* ptr, const detail::Strides3& s, int64_t batch, int64_t seqlen, int64_t heads,
                    const char* name, std::string* why, int64_t elem_bytes) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
    *why = std::string(name) + " is not 16-byte aligned (TMA needs it)";
    return false;
  }
  const struct {
    int64_t extent, stride;
    const char* dim;
  } dims[3] = {{seqlen, s.seq, "seq"}, {heads, s.head, "head"}, {batch, s.batch, "batch"}};
  for (const auto& d : dims) {
    if (d.extent <= 1) continue;
    const int64_t bytes = d.stride * elem_bytes;
    if (d.stride < 0 || bytes % 16 != 0 || bytes >= kTmaMaxStrideBytes) {
      *why = std::string(name) + " " + d.dim + " stride " + std::to_string(d.stride) +
             " elements is not a non-negative multiple of 16 bytes below 2^40 (TMA needs it)";
      return false;
    }
  }
  return true;
}

// (declared in ptx_sm90.cuh, which explains the construction)
CUtensorMap make_ragged_map(const void* ptr, DType dtype, int64_t elem_bytes, int64_t cols, int64_t total_rows,
                            int64_t heads, int64_t row_stride, int64_t head_stride, int box_cols, int box_rows,
                            const char* name) {
  const int64_t rs = row_stride * elem_bytes;
  // Strides of size-1 dims are never followed, but TMA checks them: a packed (valid) one.
  const int64_t rs_valid = total_rows > 1 ? rs : cols * elem_bytes * heads;
  const int64_t hs = heads > 1 ? head_stride * elem_bytes : cols * elem_bytes;
  if (rs_valid <= 0 || rs_valid % 16 != 0 || rs_valid >= kRaggedMaxRowStrideBytes || hs % 16 != 0 ||
      hs >= kTmaMaxStrideBytes)
    throw Error(name, std::string("ioattn: ") + name + " strides (row " + std::to_string(rs) + ", head " +
                          std::to_string(hs) + " bytes) do not suit a TMA varlen map");
  const cuuint64_t dims[5] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(kRaggedRows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(total_rows + 1),
                              static_cast<cuuint64_t>(kRaggedRows) + 1};
  const cuuint64_t strides[4] = {static_cast<cuuint64_t>(rs_valid), static_cast<cuuint64_t>(hs),
                                 static_cast<cuuint64_t>(rs_valid),
                                 static_cast<cuuint64_t>(kRaggedMaxRowStrideBytes - rs_valid)};
  const cuuint32_t box[5] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1, 1, 1};
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUtensorMapDataType type = elem_bytes == 4     ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : elem_bytes == 1     ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                          : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  // Box rows of 128 bytes (every 16- / 32-bit map) or 64 (the fp8 Q / K rows at hdim 64).
  const int64_t row_bytes = box_cols * elem_bytes;
  if (row_bytes != 64 && row_bytes != 128)
    throw Error(name, std::string("ioattn: make_ragged_map: box rows of 64 or 128 bytes, got ") +
                          std::to_string(row_bytes));
  const CUtensorMapSwizzle swizzle = row_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B;
  CUtensorMap map{};
  const CUresult r = tensor_map_encoder()(&map, type, 5, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("cuda", std::string("ioattn: cuTensorMapEncodeTiled failed for the varlen map of ") + name +
                            " (CUresult " + std::to_string(static_cast<int>(r)) + ")");
  return map;
}

// (declared in ptx_sm90.cuh; the backward's tmald variant uses it too) 4D map over (head_dim,
// seqlen, heads, batch) with box (64, box_rows, 1, 1) and 128-byte
// swizzle: one box is one swizzled column block of a tile. Out-of-bounds rows read as zeros.
CUtensorMap make_tensor_map(const void* ptr, DType dtype, int64_t head_dim, int64_t seqlen, int64_t heads,
                            int64_t batch, const detail::Strides3& s, int box_rows, const char* name) {
  // seqlen 0 (no keys) still needs a valid map; the kernel then loads nothing.
  const int64_t rows = seqlen > 0 ? seqlen : 1;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  // Size-1 dims: their stride is never followed; give TMA a packed (valid) one (rows >= 1: no
  // zero stride when there are no keys).
  const int64_t packed[3] = {head_dim * 2, head_dim * rows * 2, head_dim * rows * heads * 2};
  const int64_t given[3] = {s.seq * 2, s.head * 2, s.batch * 2};
  cuuint64_t strides[3];
  for (int i = 0; i < 3; ++i)
    strides[i] = static_cast<cuuint64_t>(static_cast<int64_t>(dims[i + 1]) <= 1 ? packed[i] : given[i]);
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUtensorMap map{};
  const CUresult r = tensor_map_encoder()(
      &map, dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
      const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("cuda", std::string("ioattn: cuTensorMapEncodeTiled failed for ") + name + " (CUresult " +
                            std::to_string(static_cast<int>(r)) + ")");
  return map;
}

namespace {

using detail::FwdProblem;
using detail::Strides3;

bool env_flag(const char* name);  // "1" (below)
int env_bool(const char* name);   // -1 unset, else 0 / 1 (below)

// One dispatch-table row: what the tile is, why, and how to check / launch it.
struct Row {
  int block_m = 0, block_n = 0, stages = 0, consumer_wgs = 0;
  bool v3 = false;  // the v3 kernel body (flash_fwd_sm90_v3.cuh)
  bool q_regs = false;  // Q K^T with Q in registers (Sm90TraitsQRegs128; IOATTN_SM90_QREGS)
  const char* why = "";
  bool (*present)() = nullptr;
  void (*launch)(const FwdLaunch&) = nullptr;
};

template <class Tr, bool kCausal>
Row make_row(const char* why) {
  return Row{Tr::kBlockM, Tr::kBlockN, Tr::kStages, Tr::kConsumerWGs, false, QInRegs<Tr>::value, why,
             &flash_fwd_sm90_present<Tr, kCausal>, &flash_fwd_sm90_launch<Tr, kCausal>};
}
template <class Tr, bool kCausal>
Row make_row_v3(const char* why) {
  return Row{Tr::kBlockM, Tr::kBlockN, Tr::kStages, Tr::kConsumerWGs, true, false, why,
             &flash_fwd_sm90_v3_present<Tr, kCausal>, &flash_fwd_sm90_v3_launch<Tr, kCausal>};
}
template <int kHeadDim, typename T, bool kCausal>
Row make_row() {
  return make_row<Sm90Traits<kHeadDim, T, kCausal>, kCausal>(Sm90Tile<kHeadDim, kCausal>::kWhy);
}

// The kLocal rows (windows, sinks, softcap, ALiBi, varlen): the causal tiling of each head dim (3
// consumer warpgroups at hdim 64), those features at run time. kCache: the same tilings' KV-cache
// instances (decode() with more than 16 query rows; CacheParams).
template <class Tr, bool kCache>
Row make_row_local(const char* why) {
  return Row{Tr::kBlockM, Tr::kBlockN, Tr::kStages, Tr::kConsumerWGs, false, false, why,
             &flash_fwd_sm90_present<Tr, true, true, kCache>, &flash_fwd_sm90_launch<Tr, true, true, kCache>};
}
template <typename T, bool kCache = false>
Row local_row_for_dtype(int64_t hdim) {
  switch (hdim) {
    case 64: return make_row_local<Sm90Traits3<T, true>, kCache>(Sm90Tile3<true>::kWhy);
    case 128: return make_row_local<Sm90Traits<128, T, true>, kCache>(Sm90Tile<128, true>::kWhy);
    case 256: return make_row_local<Sm90Traits<256, T, true>, kCache>(Sm90Tile<256, true>::kWhy);
    default: return Row{};
  }
}


template <typename T>
Row row_for_dtype(int64_t hdim, bool causal, bool wg3, bool v3) {
  switch (hdim) {
    case 64:
      if (wg3)
        return causal ? make_row<Sm90Traits3<T, true>, true>(Sm90Tile3<true>::kWhy)
                      : make_row<Sm90Traits3<T, false>, false>(Sm90Tile3<false>::kWhy);
      return causal ? make_row<64, T, true>() : make_row<64, T, false>();
    case 128:
      if (v3) {
        // (The v3 body on 128x128 without a mask, no partial last key block at 2k / 4k: 0.96-1.02x
        // of 128x176, session 15, docs/PERF.md; not kept.)
        return causal ? make_row_v3<Sm90Traits<128, T, true>, true>(Sm90Tile<128, true>::kWhy)
                      : make_row_v3<Sm90Traits<128, T, false>, false>(Sm90Tile<128, false>::kWhy);
      }
      // Q K^T's Q in registers: the causal rows' default (session 10: +4% on average over the same
      // tile without, three interleaved A/Bs, docs/PERF.md); IOATTN_SM90_QREGS=0 turns it off. (Without
      // a mask, 128x128 / 128x144 with it measured 0.94-1.02x the v3 body's 128x176: not kept.)
      if (causal && env_bool("IOATTN_SM90_QREGS") != 0)
        return make_row<Sm90TraitsQRegs128<T>, true>(Sm90TraitsQRegs128<T>::kWhy);
      return causal ? make_row<128, T, true>() : make_row<128, T, false>();
    case 256:
      return causal ? make_row<Sm90Traits<256, T, true>, true>(Sm90Tile<256, true>::kWhy)
                    : make_row<Sm90Traits<256, T, false>, false>(Sm90Tile<256, false>::kWhy);
    default: return Row{};
  }
}

// A problem for the kLocal rows: a sliding window (beyond plain causal), sinks, softcap, ALiBi or
// varlen.
bool needs_local(const FwdProblem& p) {
  const bool plain_causal = p.causal && p.window_left < 0 && p.window_right == 0;
  const bool no_window = !p.causal && p.window_left < 0 && p.window_right < 0;
  return !(plain_causal || no_window) || p.sinks != nullptr || p.softcap > 0.0f || p.alibi_slopes != nullptr ||
         p.varlen();
}

// The extents the tensor maps see: fixed length (batch, seqlen), or varlen's packed tokens as one
// batch (the kLocal rows offset each sequence by its cu_seqlens entry).
struct MapExtent {
  int64_t batch, seqlen_q, seqlen_k;
};
MapExtent map_extent(const FwdProblem& p) {
  if (!p.varlen()) return {p.batch, p.seqlen_q, p.seqlen_k};
  return {1, p.cu_seqlens_q_host[p.batch], p.cu_seqlens_k_host[p.batch]};
}

// fp8 varlen: columns of the packed V^T workspace [heads_kv, d, width] (fp8_vt_col: the packed keys
// plus each sequence's gap), whole 128-key column blocks.
int64_t fp8_vt_width(const FwdProblem& p) {
  return (fp8_vt_col(p.cu_seqlens_k_host[p.batch], p.batch) + 127) / 128 * 128;
}

// "window=l,r sinks softcap alibi varlen": what puts a problem on the kLocal rows (for the kernel
// name and the selector's reason).
std::string local_features(const FwdProblem& p) {
  std::string f;
  auto add = [&](const std::string& x) { f += (f.empty() ? "" : " ") + x; };
  if (p.window_left >= 0 || (!p.causal && p.window_right >= 0))
    add("window=" + std::to_string(p.window_left) + "," + std::to_string(p.window_right));
  if (p.sinks != nullptr) add("sinks");
  if (p.softcap > 0.0f) add("softcap");
  if (p.alibi_slopes != nullptr) add("alibi");
  if (p.varlen()) add("varlen");
  return f;
}

Row table_row(const FwdProblem& p, bool wg3, bool v3) {
  if (needs_local(p)) {
    if (p.dtype == DType::bf16) return local_row_for_dtype<__nv_bfloat16>(p.head_dim);
    if (p.dtype == DType::f16) return local_row_for_dtype<__half>(p.head_dim);
    return Row{};
  }
  const bool causal = p.causal;
  if (p.dtype == DType::bf16) return row_for_dtype<__nv_bfloat16>(p.head_dim, causal, wg3, v3);
  if (p.dtype == DType::f16) return row_for_dtype<__half>(p.head_dim, causal, wg3, v3);
  return Row{};
}

const char* dtype_str(DType t) { return dtype_name(t); }

// The fp8 dispatch table: one row per (head dim 64 / 128 / 256, O dtype, causal) (flash_fwd_sm90_fp8.cuh).
struct Fp8Row {
  int block_m = 0, block_n = 0, stages = 0, consumer_wgs = 0;
  int qk_row = 0;  // bytes per swizzled Q / K row = the Q and K maps' box width (Fp8Traits::kQKRow)
  const char* why = "";
  bool (*present)() = nullptr;
  void (*launch)(const Fp8Launch&) = nullptr;
};
template <class Tr, bool kCausal, bool kLocal = false>
Fp8Row make_fp8_row(const char* why) {
  return Fp8Row{Tr::kBlockM, Tr::kBlockN, Tr::kStages, Tr::kConsumerWGs, Tr::kQKRow, why,
                &flash_fwd_sm90_fp8_present<Tr, kCausal, kLocal>, &flash_fwd_sm90_fp8_launch<Tr, kCausal, kLocal>};
}
template <class Tr>
Fp8Row make_fp8_row(bool causal, const char* why) {
  return causal ? make_fp8_row<Tr, true>(why) : make_fp8_row<Tr, false>(why);
}
// 128x192 is the default since session 15 (three interleaved A/Bs on the H200: 16k tokens +2.5%
// without a mask and +4.5% causal at 16k, 4k and 8k within the run-to-run spread, docs/PERF.md);
// IOATTN_SM90_FP8_BLOCKN=128 selects the 128x128 row (ctest sm90_check_fp8n128).
bool fp8_blockn_192() {
  const char* e = std::getenv("IOATTN_SM90_FP8_BLOCKN");
  return e == nullptr || std::string(e) != "128";
}
// hdim 128 without a mask: 3 consumer warpgroups (192x96) since session 22 (+2-7% over 128x192,
// three interleaved A/Bs; causal lost 3-6% and keeps 128x192); IOATTN_SM90_FP8_WG3=0 selects 128x192
// (ctest sm90_check_fp8_2wg).
bool fp8_wg3() { return env_bool("IOATTN_SM90_FP8_WG3") != 0; }
// The kLocal rows (windows, softcap, ALiBi, sinks; session 27): each head dim's causal tiling.
template <typename Out>
Fp8Row fp8_local_row_for_out(int64_t hdim) {
  if (hdim == 256) return make_fp8_row<Fp8Traits256<Out>, true, true>(Fp8Tile256::kWhy);
  if (hdim == 64) return make_fp8_row<Fp8Traits64<Out>, true, true>(Fp8Tile64::kWhy);
  return make_fp8_row<Fp8Traits192<Out>, true, true>(Fp8Tile192::kWhy);
}
template <typename Out>
Fp8Row fp8_row_for_out(int64_t hdim, bool causal) {
  if (hdim == 256) return make_fp8_row<Fp8Traits256<Out>>(causal, Fp8Tile256::kWhy);
  if (hdim == 64) return make_fp8_row<Fp8Traits64<Out>>(causal, Fp8Tile64::kWhy);
  if (!fp8_blockn_192()) return make_fp8_row<Fp8Traits128<Out>>(causal, Fp8Tile128::kWhy);
  if (!causal && fp8_wg3()) return make_fp8_row<Fp8Traits128W3<Out>, false>(Fp8Tile128W3::kWhy);
  return make_fp8_row<Fp8Traits192<Out>>(causal, Fp8Tile192::kWhy);
}
Fp8Row fp8_table_row(const FwdProblem& p) {
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return Fp8Row{};
  if (needs_local(p)) {
    if (p.fp8_out == DType::bf16) return fp8_local_row_for_out<__nv_bfloat16>(p.head_dim);
    if (p.fp8_out == DType::f16) return fp8_local_row_for_out<__half>(p.head_dim);
    return Fp8Row{};
  }
  if (p.fp8_out == DType::bf16) return fp8_row_for_out<__nv_bfloat16>(p.head_dim, p.causal);
  if (p.fp8_out == DType::f16) return fp8_row_for_out<__half>(p.head_dim, p.causal);
  return Fp8Row{};
}

bool fail(std::string* why, std::string message) {
  *why = std::move(message);
  return false;
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v == '1';
}
// -1 when unset, else 0 / 1.
int env_bool(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? -1 : (*v == '1' ? 1 : 0);
}

// Grid policy ("should not affect results, only speed"):
//   kTilePerCta  one CTA per tile; the hardware block scheduler hands tiles out longest first.
//   kStatic      persistent (one CTA per SM), tiles round robin (tile_of_round); the next tile's
//                Q/K/V load under the current tile's last blocks and epilogue.
//   kDynamic     persistent, each next tile claimed from an atomic counter (sched_sm90.cuh):
//                balanced like kTilePerCta, overlapped like kStatic.
// Non-causal tiles are all the same length, so kStatic balances them. Causal tiles differ in
// length: kStatic measured up to 35% slower than kTilePerCta (hdim256, seqlen 16k).
enum class Grid { kTilePerCta, kStatic, kDynamic };

// Defaults per (head_dim, causal) from the H200 measurements in NOTES.md (runs 4 and 5).
struct Policy {
  Grid grid = Grid::kStatic;
  bool rescale_skip = false;  // O *= corr only in warps where a row max changed
  bool wg3 = false;           // hdim 64: 3 consumer warpgroups (192-row tiles)
  bool rescale_early = false; // O *= corr before the tensor-core turn instead of after Q K^T issue
  bool v3_body = false;       // hdim 128: the v3 kernel body (static tiles, no skip)
  bool align_end = false;     // causal, v4 body: query blocks aligned to the sequence's end (LocalParams::m_shift)
};
// Runs 4 and 5 (NOTES.md): 3 consumer warpgroups + dynamic + skip won every hdim64 row (+3..13%
// over v3); dynamic + skip won the causal rows at hdim256 (up to +20% at 16k) and mostly at
// hdim128 (two runs disagree at 8k); the early rescale placement was +0..5% at hdim256 only; at
// hdim128 non-causal the v3 body (static grid) stayed 2-7% ahead of every v4 variant, so that
// row keeps it. IOATTN_SM90_OLD_POLICY=1: the v3 policy on the v4 body (causal one CTA per tile,
// non-causal static, no skip, 2 warpgroups), as measured in runs 4-5 ("v3pol").
Policy default_policy(int64_t hdim, bool causal) {
  Policy pol;
  if (env_flag("IOATTN_SM90_OLD_POLICY")) {
    pol.grid = causal ? Grid::kTilePerCta : Grid::kStatic;
    return pol;
  }
  if (hdim == 128 && !causal) {
    pol.grid = Grid::kStatic;
    pol.v3_body = true;
    return pol;
  }
  pol.grid = Grid::kDynamic;
  pol.rescale_skip = true;
  pol.wg3 = hdim == 64;
  pol.rescale_early = hdim == 256;
  // Causal query blocks aligned to the sequence's end (session 13, H200: hdim 64 causal +2.5% at
  // 2k and +6.5% at 4k, where 192-row tiles leave 64 / 128 padding rows that would see every key;
  // a no-op where seqlen_q is a multiple of the tile). policy_for keeps it to the v4 body.
  pol.align_end = causal;
  return pol;
}

bool mempools_supported(int device) {
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return v != 0;
}

// The default policy, then the measurement / test knobs (environment):
//   IOATTN_SM90_GRID=tile|static|dynamic   grid policy (old knobs: IOATTN_SM90_ONE_TILE_PER_CTA=1
//       = tile; IOATTN_SM90_PERSISTENT_CAUSAL=1 = static for causal too, zigzag order);
//   IOATTN_SM90_RESCALE_SKIP=0|1, IOATTN_SM90_RESCALE_EARLY=0|1, IOATTN_SM90_WG3=0|1 (hdim 64);
//   IOATTN_SM90_BODY=v3|v4 (hdim 128: the v3 kernel body or the current one);
//   IOATTN_SM90_MAX_CTAS=N caps a persistent grid (with a handful of CTAs every small problem runs
//       many tiles per CTA);
//   IOATTN_SM90_STAGGER=1 rotates each non-causal tile's key order (16-bit rows; off by default since
//       session 35); IOATTN_SM90_NO_STAGGER=1 keeps the fp8 rows' key order unrotated;
//   IOATTN_SM90_ALIGN_END=0|1: causal query blocks aligned to the sequence's end (LocalParams::m_shift;
//       the causal default since session 13).
// kDynamic needs a stream-ordered allocation (memory pools); without them it falls back.
Policy policy_for(const FwdProblem& p) {
  const bool local = needs_local(p);  // the kLocal rows: the causal policy, 3 WGs at hdim 64, v4 body
  Policy pol = default_policy(p.head_dim, p.causal || local);
  if ((p.causal || local) && env_flag("IOATTN_SM90_PERSISTENT_CAUSAL")) pol.grid = Grid::kStatic;
  if (const char* g = std::getenv("IOATTN_SM90_GRID")) {
    const std::string v(g);
    if (v == "tile") pol.grid = Grid::kTilePerCta;
    if (v == "static") pol.grid = Grid::kStatic;
    if (v == "dynamic") pol.grid = Grid::kDynamic;
  }
  if (env_flag("IOATTN_SM90_ONE_TILE_PER_CTA")) pol.grid = Grid::kTilePerCta;
  if (const int v = env_bool("IOATTN_SM90_RESCALE_SKIP"); v >= 0) pol.rescale_skip = v == 1;
  if (const int v = env_bool("IOATTN_SM90_WG3"); v >= 0) pol.wg3 = v == 1;
  if (const int v = env_bool("IOATTN_SM90_RESCALE_EARLY"); v >= 0) pol.rescale_early = v == 1;
  if (const char* b = std::getenv("IOATTN_SM90_BODY")) {
    if (std::string(b) == "v3") pol.v3_body = true;
    if (std::string(b) == "v4") pol.v3_body = false;
  }
  if (local) pol.wg3 = true, pol.v3_body = false;
  if (p.head_dim != 64) pol.wg3 = false;
  // The v3 body exists for hdim 128 only; it walks tiles statically (causal: one CTA per tile
  // unless a static grid is asked for), with 2 warpgroups and no skip / placement knobs.
  if (p.head_dim != 128 || pol.wg3) pol.v3_body = false;
  if (pol.v3_body) {
    if (pol.grid == Grid::kDynamic) pol.grid = p.causal ? Grid::kTilePerCta : Grid::kStatic;
    pol.rescale_skip = pol.rescale_early = false;
  }
  if (const int v = env_bool("IOATTN_SM90_ALIGN_END"); v >= 0) pol.align_end = v == 1;
  if (!p.causal || local || pol.v3_body) pol.align_end = false;
  if (pol.grid == Grid::kDynamic && !mempools_supported(p.device_index))
    pol.grid = p.causal || local ? Grid::kTilePerCta : Grid::kStatic;
  return pol;
}

// The fp8 rows' policy: persistent dynamic grid + rescale skip for causal and not (there is no
// v3 body for fp8; the softmax is the bottleneck once the GEMMs run at the fp8 rate, so the skip
// is on by default; not yet measured against the alternatives). Knobs as in policy_for:
// IOATTN_SM90_GRID, IOATTN_SM90_ONE_TILE_PER_CTA, IOATTN_SM90_RESCALE_SKIP.
Policy fp8_policy() {
  Policy pol;
  pol.grid = Grid::kDynamic;
  pol.rescale_skip = true;
  if (const char* g = std::getenv("IOATTN_SM90_GRID")) {
    const std::string v(g);
    if (v == "tile") pol.grid = Grid::kTilePerCta;
    if (v == "static") pol.grid = Grid::kStatic;
    if (v == "dynamic") pol.grid = Grid::kDynamic;
  }
  if (env_flag("IOATTN_SM90_ONE_TILE_PER_CTA")) pol.grid = Grid::kTilePerCta;
  if (const int v = env_bool("IOATTN_SM90_RESCALE_SKIP"); v >= 0) pol.rescale_skip = v == 1;
  return pol;
}

const char* grid_str(Grid g) {
  return g == Grid::kTilePerCta ? " 1 CTA/tile longest-first" : g == Grid::kStatic ? " persistent" : " persistent dynamic";
}

int64_t grid_ctas(int device, int64_t tiles, bool persistent) {
  if (!persistent) return tiles;
  int sms = 0;
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int64_t n = std::min<int64_t>(tiles, sms);
  if (const char* env = std::getenv("IOATTN_SM90_MAX_CTAS")) {
    const long long cap = std::atoll(env);
    if (cap > 0) n = std::min<int64_t>(n, cap);
  }
  return n;
}

// Varlen on the ragged TMA maps (the bf16 / f16 and fp8 selectors): host copies of cu_seqlens (the
// maps need the token totals), totals below 2^31 - 256, sequences of at most 2^30 rows and token
// strides (of the tensors read through ragged maps; elem_bytes each) below 2^34 bytes.
bool varlen_maps_ok(const FwdProblem& p, std::initializer_list<int64_t> token_strides, int64_t elem_bytes,
                    std::string* why) {
  constexpr int64_t kMaxInt = 2147483647;
  if (p.cu_seqlens_q_host == nullptr || p.cu_seqlens_k_host == nullptr)
    return fail(why, "varlen without host copies of cu_seqlens (the tensor maps need the token totals)");
  const MapExtent ext = map_extent(p);
  if (ext.seqlen_q > kMaxInt - 256 || ext.seqlen_k > kMaxInt - 256)
    return fail(why, "varlen: more than 2^31 - 256 packed tokens");
  if (p.seqlen_q > kRaggedRows || p.seqlen_k > kRaggedRows)
    return fail(why, "varlen: a sequence longer than 2^30 tokens (the ragged TMA maps' limit)");
  if (std::max(token_strides) * elem_bytes >= kRaggedMaxRowStrideBytes)
    return fail(why, "varlen: a token stride of 2^34 bytes or more (the ragged TMA maps' limit)");
  return true;
}

// The fp8 rows: hdim 64, 128 or 256, the plain causal mask or none, GQA; windows, softcap, ALiBi,
// sinks and varlen on the kLocal rows; a V^T workspace in stream order.
bool select_fp8(const FwdProblem& p, std::string* kernel, std::string* why) {
  if (p.head_dim != p.head_dim_v)
    return fail(why, "fp8: head_dim_v " + std::to_string(p.head_dim_v) + " != head_dim " + std::to_string(p.head_dim));
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return fail(why, "fp8: head_dim " + std::to_string(p.head_dim) + " (fp8 wgmma kernel: 64, 128 or 256)");
  if (p.fp8_out != DType::bf16 && p.fp8_out != DType::f16)
    return fail(why, std::string("fp8: output dtype ") + dtype_str(p.fp8_out) + " (bf16, f16)");
  const bool local = needs_local(p);
  if (local && env_bool("IOATTN_SM90_LOCAL") == 0)
    return fail(why, "fp8: " + local_features(p) + " on the wgmma kernel (kLocal rows): switched off by IOATTN_SM90_LOCAL=0");
  if (local && (p.seqlen_q >= (int64_t(1) << 29) || p.seqlen_k >= (int64_t(1) << 29)))
    return fail(why, "fp8: windows / sinks / softcap / ALiBi / varlen on the wgmma kernel: seqlen >= 2^29 (its int "
                     "window bounds)");
  if (!(p.scale > 0.0f)) return fail(why, "fp8: scale <= 0 (the kernel's running max assumes scale > 0)");
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return fail(why, "heads_q is not a multiple of heads_kv");
  constexpr int64_t kMaxInt = 2147483647;
  if (p.seqlen_q > kMaxInt - 256 || p.seqlen_k > (int64_t(65535) * 64 - 256)) return fail(why, "fp8: seqlen_q >= 2^31 or seqlen_k > 4M");
  if (!p.varlen() && p.seqlen_k == 0) return fail(why, "fp8: seqlen_k = 0 (a tensor map needs every dim >= 1)");
  const int64_t m_blocks = (p.seqlen_q + 127) / 128;
  if (m_blocks * p.heads_q * p.batch > kMaxInt) return fail(why, "more than 2^31-1 query tiles");
  if (p.batch * p.heads_kv * 2 > kMaxInt) return fail(why, "fp8: batch * heads_kv too large for the transpose grid");
  // varlen (verified on the H200 in session 30): the ragged Q / K maps' limits, the V^T workspace's
  // width (fp8_vt_width) and the transpose grid ((sequence, kv head) x the longest sequence's 32-key
  // groups x 128-dim chunks, 4 warps a block)
  if (p.varlen()) {
    if (!varlen_maps_ok(p, {p.q_stride.seq, p.k_stride.seq}, 1, why)) return false;
    if (fp8_vt_width(p) > kMaxInt - 256)
      return fail(why, "fp8 varlen: more than 2^31 - 256 packed keys with the V^T workspace's gaps");
    if (p.batch * p.heads_kv * ((p.seqlen_k + 31) / 32 + kFp8VtTailGroups) * ((p.head_dim + 127) / 128) / 4 > kMaxInt)
      return fail(why, "fp8 varlen: batch x heads_kv x the longest sequence too large for the V transpose grid");
  }
  const MapExtent ext = map_extent(p);
  if (!tma_compatible(p.q, p.q_stride, ext.batch, ext.seqlen_q, p.heads_q, "q", why, 1)) return false;
  if (!tma_compatible(p.k, p.k_stride, ext.batch, ext.seqlen_k, p.heads_kv, "k", why, 1)) return false;
  // v is read by the transpose pre-pass with 4-byte loads: the same 16-byte rules keep it simple.
  if (!tma_compatible(p.v, p.v_stride, ext.batch, ext.seqlen_k, p.heads_kv, "v", why, 1)) return false;
  if (reinterpret_cast<uintptr_t>(p.o) % 4 != 0 || p.o_stride.seq % 2 != 0 || p.o_stride.head % 2 != 0 ||
      p.o_stride.batch % 2 != 0)
    return fail(why, "o is not 4-byte aligned with even strides (the kernel stores element pairs)");
  if (!mempools_supported(p.device_index))
    return fail(why, "fp8: the device has no stream-ordered allocator (memory pools) for the V^T workspace");
  const Policy pol = fp8_policy();
  const Fp8Row row = fp8_table_row(p);
  if (row.present == nullptr) return fail(why, "fp8: no table row");
  if (!row.present()) return fail(why, "this build has no sm_90a image of the fp8 wgmma kernel (CUDA archs lack 90a)");
  *kernel = std::string("cuda/flash sm90 wgmma+tma f8e4m3->") + dtype_str(p.fp8_out) + " hdim" +
            std::to_string(p.head_dim) +
            (p.causal ? " causal" : "") + " tile " + std::to_string(row.block_m) + "x" + std::to_string(row.block_n) +
            " stages " + std::to_string(row.stages) + " ws " + std::to_string(row.consumer_wgs) + " consumer WGs " +
            (row.consumer_wgs == 2 ? "pingpong" : "round-robin") + grid_str(pol.grid) +
            (pol.rescale_skip ? " rescale-skip" : "") + " +V^T pre-pass" +
            (p.q_descale.defined() || p.k_descale.defined() || p.v_descale.defined() ? " descale" : "") +
            (local ? " local(" + local_features(p) + ")" : "");
  *why = row.why;
  return true;
}

bool select_impl(const FwdProblem& p, std::string* kernel, std::string* why) {
  if (p.device != Device::cuda) return fail(why, "inputs are not on a CUDA device");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || p.device_index < 0 || p.device_index >= count) {
    cudaGetLastError();
    return fail(why, "no CUDA device " + std::to_string(p.device_index));
  }
  int major = 0, minor = 0;
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, p.device_index));
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, p.device_index));
  if (major != 9 || minor != 0)
    return fail(why, "device is sm_" + std::to_string(major * 10 + minor) + ", the wgmma kernel needs sm_90");
  if (p.fp8()) return select_fp8(p, kernel, why);
  if (p.dtype != DType::bf16 && p.dtype != DType::f16)
    return fail(why, std::string("dtype ") + dtype_str(p.dtype) + " (wgmma kernel: bf16, f16, f8e4m3)");
  if (p.head_dim != p.head_dim_v)
    return fail(why, "head_dim_v " + std::to_string(p.head_dim_v) + " != head_dim " + std::to_string(p.head_dim));
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return fail(why, "head_dim " + std::to_string(p.head_dim) + " (wgmma kernel: 64, 128, 256)");
  // Windows, sinks, softcap, ALiBi, varlen: the kLocal rows (verified and timed on the H200 in
  // session 8: 1.2-2.4x the mma.sync kernel); IOATTN_SM90_LOCAL=0 sends them to mma.sync (A/B runs,
  // ctest cuda_kernels_mma_local).
  const bool local = needs_local(p);
  if (local && env_bool("IOATTN_SM90_LOCAL") == 0)
    return fail(why, local_features(p) + " on the wgmma kernel (kLocal rows): switched off by IOATTN_SM90_LOCAL=0");
  if (local && (p.seqlen_q >= (int64_t(1) << 29) || p.seqlen_k >= (int64_t(1) << 29)))
    return fail(why, "windows / sinks / softcap / ALiBi / varlen on the wgmma kernel: seqlen >= 2^29 (its int "
                     "window bounds)");
  if (!(p.scale > 0.0f)) return fail(why, "scale <= 0 (the kernel's running max assumes scale > 0)");
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return fail(why, "heads_q is not a multiple of heads_kv");
  constexpr int64_t kMaxInt = 2147483647;
  if (p.seqlen_q > kMaxInt - 256 || p.seqlen_k > kMaxInt - 256) return fail(why, "seqlen >= 2^31");
  if (!p.varlen() && (p.seqlen_k == 0 || p.seqlen_q == 0 || p.batch == 0))  // a tensor map needs every dim >= 1
    return fail(why, "an empty dim (batch, seqlen_q or seqlen_k = 0; a tensor map needs every dim >= 1): the mma.sync "
                     "path writes nothing, or O = 0 and LSE = -inf when seqlen_k = 0");
  const int64_t m_blocks = (p.seqlen_q + 127) / 128;
  if (m_blocks * p.heads_q * p.batch > kMaxInt) return fail(why, "more than 2^31-1 query tiles");
  if (p.varlen() && !varlen_maps_ok(p, {p.q_stride.seq, p.k_stride.seq, p.v_stride.seq}, 2, why)) return false;
  const MapExtent ext = map_extent(p);
  if (!tma_compatible(p.q, p.q_stride, ext.batch, ext.seqlen_q, p.heads_q, "q", why)) return false;
  if (!tma_compatible(p.k, p.k_stride, ext.batch, ext.seqlen_k, p.heads_kv, "k", why)) return false;
  if (!tma_compatible(p.v, p.v_stride, ext.batch, ext.seqlen_k, p.heads_kv, "v", why)) return false;
  if (reinterpret_cast<uintptr_t>(p.o) % 4 != 0 || p.o_stride.seq % 2 != 0 || p.o_stride.head % 2 != 0 ||
      p.o_stride.batch % 2 != 0)
    return fail(why, "o is not 4-byte aligned with even strides (the kernel stores element pairs)");

  const Policy pol = policy_for(p);
  const Row row = table_row(p, pol.wg3, pol.v3_body);
  if (row.present == nullptr) return fail(why, "no table row");
  if (!row.present()) return fail(why, "this build has no sm_90a image of the wgmma kernel (CUDA archs lack 90a)");
  *kernel = std::string("cuda/flash sm90 wgmma+tma ") + dtype_str(p.dtype) + " hdim" + std::to_string(p.head_dim) +
            (p.causal ? " causal" : "") + " tile " + std::to_string(row.block_m) + "x" + std::to_string(row.block_n) +
            " stages " + std::to_string(row.stages) + " ws " + std::to_string(row.consumer_wgs) + " consumer WGs " +
            (row.consumer_wgs == 2 ? "pingpong" : "round-robin") + grid_str(pol.grid) +
            (pol.rescale_skip ? " rescale-skip" : "") + (pol.rescale_early ? " rescale-early" : "") +
            (row.v3 ? " (v3 body)" : "") + (row.q_regs ? " qregs" : "") + (pol.align_end ? " align-end" : "") +
            (local ? " local(" + local_features(p) + ")" : "");
  *why = row.why;
  return true;
}


// The FwdParams every forward launch fills alike (output pointers and strides, extents, tile
// count, scale); seqlen_k is the key extent the kernel sees (the cache mode: its bound).
void fill_common(FwdParams& f, const FwdProblem& p, int64_t seqlen_k, int64_t m_blocks, int64_t tiles) {
  f.o = p.o;
  f.lse = p.lse;
  f.o_batch = p.o_stride.batch;
  f.o_seq = p.o_stride.seq;
  f.o_head = p.o_stride.head;
  f.lse_batch = p.lse_stride.batch;
  f.lse_head = p.lse_stride.head;
  f.lse_seq = p.lse_stride.seq;
  f.seqlen_q = static_cast<int>(p.seqlen_q);
  f.seqlen_k = static_cast<int>(seqlen_k);
  f.heads_q = static_cast<int>(p.heads_q);
  f.group = static_cast<int>(p.heads_q / p.heads_kv);
  f.num_m_blocks = static_cast<int>(m_blocks);
  f.batch_heads = static_cast<int>(p.batch * p.heads_q);
  f.num_tiles = static_cast<int>(tiles);
  constexpr float kLog2e = 1.4426950408889634f;
  f.scale = p.scale;
  f.scale_log2 = p.scale * kLog2e;
}

// The kLocal rows' run-time features (LocalParams, varlen's cu_seqlens too): windows wider
// than `wide` (both sequences' lengths) are unbounded, the rest as the mma.sync kernel takes them.
void fill_local(LocalParams& lp, const FwdProblem& p, int64_t wide) {
  lp.window_left = p.window_left < 0 || p.window_left > wide ? -1 : static_cast<int>(p.window_left);
  lp.window_right = p.window_right < 0 || p.window_right > wide ? -1 : static_cast<int>(p.window_right);
  lp.sinks = p.sinks;
  lp.softcap = p.softcap > 0.0f ? p.softcap : 0.0f;
  lp.softcap_inv = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;
  lp.inv_scale = 1.0f / p.scale;  // scale > 0 (checked by the selectors)
  lp.alibi_slopes = p.alibi_slopes;
  lp.cu_seqlens_q = p.cu_seqlens_q;  // varlen (null otherwise: the KV-cache rows never are)
  lp.cu_seqlens_k = p.cu_seqlens_k;
}

// K + V bytes a scheduling section may keep in L2 (50-60 MB of L2 in two halves; Q, O and the
// other half's copies need room too). IOATTN_SM90_L2_SECTION_MB overrides it (tile order only,
// results unchanged). 8 MB since session 35: Nsight Compute on an H100 (bf16, 16k tokens, hidden
// 2048, no mask; docs/PERF.md "Session 35"), 24 -> 8 MB: DRAM read 432 -> 221 MB at hdim 128 x 2k
// (cuDNN reads 201: Q + K + V once), 454 -> 228 at 4k, 474 -> 233 at 16k; kernel time -1.6%, -1.4%,
// -0.6%; hdim 64 and 256 the same way (-0.5..-2.4%, 16k x hdim 256 unchanged: one head's K + V is
// 16 MB). 24 MB sections (~3 waves of 132 CTAs at 2k) did not stay in L2; 4 MB was no better than 8.
constexpr int64_t kL2SectionBytes = 8ll << 20;
int64_t l2_section_bytes() {
  static const int64_t bytes = [] {
    const char* e = std::getenv("IOATTN_SM90_L2_SECTION_MB");
    const long mb = e != nullptr ? std::strtol(e, nullptr, 10) : 0;
    return mb > 0 ? static_cast<int64_t>(mb) << 20 : kL2SectionBytes;
  }();
  return bytes;
}
// FwdParams::section_heads: the (batch, head) pairs whose K + V (kv_bytes_per_head each, heads of
// one GQA group sharing theirs) fit in a section, at least 1, at most all of them.
int section_heads(int64_t kv_bytes_per_head, int batch_heads) {
  return static_cast<int>(std::clamp<int64_t>(l2_section_bytes() / std::max<int64_t>(kv_bytes_per_head, 1), 1, batch_heads));
}

// 4D uint8 map (e4m3 codes): dims innermost first, strides of dims 1..3 in bytes, box (box0,
// box1, 1, 1), swizzled to box0-byte rows: box0 = 128 (SWIZZLE_128B) or 64 (SWIZZLE_64B, fp8 Q / K
// at hdim 64), one swizzled row per box row.
CUtensorMap make_map_u8(const void* ptr, const int64_t (&dims)[4], const int64_t (&strides)[3], int box0, int box1,
                        const char* name) {
  cuuint64_t d[4];
  cuuint64_t st[3];
  for (int i = 0; i < 4; ++i) d[i] = static_cast<cuuint64_t>(std::max<int64_t>(dims[i], 1));
  int64_t packed = d[0];
  for (int i = 0; i < 3; ++i) {  // size-1 dims: their stride is never followed; give TMA a packed one
    st[i] = static_cast<cuuint64_t>(dims[i + 1] <= 1 ? packed : strides[i]);
    packed *= static_cast<int64_t>(d[i + 1]);
  }
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box0), static_cast<cuuint32_t>(box1), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  if (box0 != 64 && box0 != 128)
    throw Error(name, "ioattn: make_map_u8: box rows of 64 or 128 bytes, got " + std::to_string(box0));
  const CUtensorMapSwizzle swizzle = box0 == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B;
  CUtensorMap map{};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(ptr), d, st, box,
                                          elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("cuda", std::string("ioattn: cuTensorMapEncodeTiled failed for ") + name + " (CUresult " +
                            std::to_string(static_cast<int>(r)) + ")");
  return map;
}

// Keys of the V^T workspace per (batch, kv head, dim) row: seqlen_k rounded up to whole column
// blocks of the V^T TMA box (kColBlock keys; at least one, so the map is valid when there are no
// keys). Every row's key blocks load whole column blocks; what lies past the padding is the map's
// out-of-bounds zeros (128x192: the second column block of the last key block).
int64_t fp8_padded_keys(const FwdProblem& p) {
  const int64_t n = Fp8Traits128<__nv_bfloat16>::kColBlock;
  return std::max<int64_t>((p.seqlen_k + n - 1) / n * n, n);
}

// Stream-ordered device allocation freed on scope exit (also when a launch throws).
struct AsyncBuffer {
  void* ptr = nullptr;
  cudaStream_t stream = nullptr;
  AsyncBuffer(size_t bytes, cudaStream_t s) : stream(s) {
    IOATTN_CUDA_CHECK(cudaMallocAsync(&ptr, bytes, s));
  }
  ~AsyncBuffer() {
    if (ptr != nullptr) cudaFreeAsync(ptr, stream);
  }
  AsyncBuffer(const AsyncBuffer&) = delete;
  AsyncBuffer& operator=(const AsyncBuffer&) = delete;
};

// The V transpose pre-pass into `vt` ([batch, heads_kv, d, skp] e4m3, P-fragment key order; varlen:
// [heads_kv, d, skp = fp8_vt_width] with each sequence at fp8_vt_col).
void fp8_transpose(const FwdProblem& p, void* vt, int64_t skp, cudaStream_t stream) {
  Fp8TransposeArgs a;
  a.v = static_cast<const uint8_t*>(p.v);
  a.v_batch = p.v_stride.batch;
  a.v_seq = p.v_stride.seq;
  a.v_head = p.v_stride.head;
  a.vt = static_cast<uint8_t*>(vt);
  a.seqlen_k = static_cast<int>(p.seqlen_k);
  a.skp = static_cast<int>(skp);
  a.head_dim = static_cast<int>(p.head_dim);
  a.heads_kv = static_cast<int>(p.heads_kv);
  if (p.varlen()) {  // packed tokens; skp is the workspace's width (fp8_vt_width)
    a.v_batch = 0;
    a.cu_seqlens_k = p.cu_seqlens_k;
  }
  fp8_transpose_v_launch(a, p.batch, stream);
}

// The dynamic schedule's tile counter: one int, zeroed in stream order and freed on scope exit,
// when the persistent grid has fewer CTAs than tiles (f.tile_counter points at it); else none.
std::unique_ptr<AsyncBuffer> dynamic_tile_counter(const Policy& pol, unsigned ctas, int64_t tiles,
                                                  cudaStream_t stream, FwdParams& f) {
  if (pol.grid != Grid::kDynamic || static_cast<int64_t>(ctas) >= tiles) return nullptr;
  auto counter = std::make_unique<AsyncBuffer>(sizeof(int), stream);
  IOATTN_CUDA_CHECK(cudaMemsetAsync(counter->ptr, 0, sizeof(int), stream));
  f.tile_counter = static_cast<int*>(counter->ptr);
  return counter;
}

void fp8_forward(const FwdProblem& p, const Policy& pol) {
  const Fp8Row row = fp8_table_row(p);
  const int64_t m_blocks = (p.seqlen_q + row.block_m - 1) / row.block_m;
  const int64_t tiles = m_blocks * p.heads_q * p.batch;
  if (tiles == 0) return;
  cuda::DeviceGuard guard(p.device_index);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int64_t d = p.head_dim, skp = fp8_padded_keys(p);
  // V^T: [batch, heads_kv, d, skp], or varlen's packed [heads_kv, d, width] with zeroed gaps.
  const int64_t vt_cols = p.varlen() ? fp8_vt_width(p) : skp, vt_batch = p.varlen() ? 1 : p.batch;
  const size_t vt_bytes = static_cast<size_t>(vt_batch * p.heads_kv * d * vt_cols);
  AsyncBuffer vt(vt_bytes, stream);
  fp8_transpose(p, vt.ptr, vt_cols, stream);

  Fp8Launch l;
  if (p.varlen()) {  // ragged: a tile's rows past its sequence read as zeros, not the next sequence's
    const MapExtent ext = map_extent(p);
    l.q = make_ragged_map(p.q, p.dtype, 1, d, std::max<int64_t>(ext.seqlen_q, 1), p.heads_q, p.q_stride.seq,
                          p.q_stride.head, row.qk_row, row.block_m, "q");
    l.k = make_ragged_map(p.k, p.dtype, 1, d, std::max<int64_t>(ext.seqlen_k, 1), p.heads_kv, p.k_stride.seq,
                          p.k_stride.head, row.qk_row, row.block_n, "k");
  } else {
    l.q = make_map_u8(p.q, {d, p.seqlen_q, p.heads_q, p.batch}, {p.q_stride.seq, p.q_stride.head, p.q_stride.batch},
                      row.qk_row, row.block_m, "q");
    l.k = make_map_u8(p.k, {d, p.seqlen_k, p.heads_kv, p.batch}, {p.k_stride.seq, p.k_stride.head, p.k_stride.batch},
                      row.qk_row, row.block_n, "k");
  }
  l.vt = make_map_u8(vt.ptr, {vt_cols, d, p.heads_kv, vt_batch}, {vt_cols, d * vt_cols, p.heads_kv * d * vt_cols}, 128,
                     static_cast<int>(d), "v^T");
  Fp8Params& pp = l.params;
  FwdParams& f = pp.f;
  fill_common(f, p, p.seqlen_k, m_blocks, tiles);
  // L2 sections as for 16-bit inputs, with 1-byte K and V^T.
  f.section_heads = section_heads(skp * d * 2 / f.group, f.batch_heads);
  const bool persistent = pol.grid != Grid::kTilePerCta;
  const bool local = needs_local(p);  // the kLocal rows: the causal tiling, no key rotation
  f.zigzag = pol.grid == Grid::kStatic && (p.causal || local) ? 1 : 0;
  f.stagger = !p.causal && !local && !env_flag("IOATTN_SM90_NO_STAGGER") ? 1 : 0;
  f.rescale_skip = pol.rescale_skip ? 1 : 0;
  if (local) fill_local(l.local, p, p.seqlen_q + p.seqlen_k);  // (the longest sequences' lengths bound the windows)
  pp.q_descale = p.q_descale.ptr;
  pp.k_descale = p.k_descale.ptr;
  pp.v_descale = p.v_descale.ptr;
  pp.qd_batch = p.q_descale.batch_stride;
  pp.qd_head = p.q_descale.head_stride;
  pp.kd_batch = p.k_descale.batch_stride;
  pp.kd_head = p.k_descale.head_stride;
  pp.vd_batch = p.v_descale.batch_stride;
  pp.vd_head = p.v_descale.head_stride;
  l.grid = static_cast<unsigned>(grid_ctas(p.device_index, tiles, persistent));
  l.stream = stream;
  const std::unique_ptr<AsyncBuffer> counter = dynamic_tile_counter(pol, l.grid, tiles, stream, f);
  row.launch(l);
}


// ---- prefill through the KV cache (decode() with more than 16 query rows; the kCache rows) ----------

// Rows per sequence of a contiguous cache ([batch, capacity, heads, d]: the batch stride over the
// slot stride), or 0 when the layout is not that.
int64_t cache_capacity_rows(const FwdProblem& p) {
  if (p.batch <= 1) return std::max<int64_t>(p.kv_bound, 1);
  const Strides3 &k = p.k_stride, &v = p.v_stride;
  if (k.seq <= 0 || k.batch % k.seq != 0 || v.seq <= 0 || v.batch % v.seq != 0) return 0;
  const int64_t cap = k.batch / k.seq;
  return cap == v.batch / v.seq && cap >= p.kv_bound ? cap : 0;
}

// The KV-cache row of a bf16 / f16 problem (the kLocal tiling of its head dim).
Row cache_row(const FwdProblem& p) {
  return p.dtype == DType::bf16 ? local_row_for_dtype<__nv_bfloat16, true>(p.head_dim)
                                : local_row_for_dtype<__half, true>(p.head_dim);
}

// The smallest page piece (rows per TMA load) the wgmma cache rows take by default.
constexpr int64_t kCacheMinPieceRows = ioattn::detail::kSm90CacheMinPieceRows;

// Paged caches go one of two ways. Direct: the producer's TMA loads read each page piece
// (min(page size, key block) rows) where it lies. Gathered: a copy kernel first moves the rows
// the lengths cover into a contiguous [batch, kv_bound, heads_kv, d] buffer (stream-ordered,
// freed after the call), which the contiguous rows then read; the copy moves the cache once more
// (read + write), but every TMA load is a whole key block again. Direct for pieces of >=
// kCacheMinPieceRows rows (page 64: 0.66-0.74x forward(), session 30), gathered for smaller pieces
// (page 16 direct: 0.26-0.34x, one small load behind each block-table lookup) and for page sizes
// the TMA pieces cannot take (not a multiple of 8, not tiling the key block) where the copy is on
// (detail::kSm90CacheGatherByDefault, or IOATTN_SM90_CACHE_GATHER=1); else those stay on mma.sync.
enum class CacheMode { kContiguous, kDirect, kGathered };

// The gathered copy's limits: its buffer (K and V), and the rows per CTA of the copy kernel.
constexpr int64_t kGatherMaxBytes = int64_t{4} << 30;
constexpr int kGatherRows = 64;

int64_t gather_bytes(const FwdProblem& p) {  // K and V of the gathered buffer
  return 2 * p.batch * std::max<int64_t>(p.kv_bound, 1) * p.heads_kv * p.head_dim * 2;
}

// 16-bit caches of q's dtype, head_dim == head_dim_v in {64, 128, 256}; contiguous, or paged
// (CacheMode): direct for a page size that is a multiple of 8 and divides the key block or is a
// multiple of it, with pieces of >= kCacheMinPieceRows rows (IOATTN_SM90_CACHE=1: any), pages
// packed (page stride = page_size x slot stride); else gathered (IOATTN_SM90_CACHE_GATHER=0: never;
// =1: every paged cache), within kGatherMaxBytes. The rows the ragged maps span below 2^30.
bool select_cache_impl(const FwdProblem& p, std::string* kernel, std::string* why, CacheMode* mode_out = nullptr) {
  if (p.device != Device::cuda) return fail(why, "inputs are not on a CUDA device");
  if (detail::cuda_device_arch(p.device_index) != 90) return fail(why, "the device is not sm_90");
  // Default since session 30 (its H200 run: 0.87-1.02x forward() on contiguous K / V for contiguous
  // caches, 0.66-0.74x at page size 64, where the mma.sync cache mode ran 0.23-0.45x).
  // IOATTN_SM90_CACHE=0: always mma.sync.
  const int env = env_bool("IOATTN_SM90_CACHE"), env_gather = env_bool("IOATTN_SM90_CACHE_GATHER");
  if (env == 0) return fail(why, "the wgmma cache rows are switched off by IOATTN_SM90_CACHE=0");
  if (p.dtype != DType::bf16 && p.dtype != DType::f16)
    return fail(why, std::string("q dtype ") + dtype_str(p.dtype) + " (bf16, f16)");
  const bool eight_bit = p.kvt() == DType::f8e4m3 || p.kvt() == DType::i8;
  if (p.kvt() != p.dtype && !eight_bit)
    return fail(why, std::string("a ") + dtype_str(p.kvt()) +
                         " cache (the wgmma kernel reads 16-bit caches of q's dtype, 8-bit ones through the gathered copy)");
  if (p.head_dim != p.head_dim_v || (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256))
    return fail(why, "head_dim " + std::to_string(p.head_dim) + " / head_dim_v " + std::to_string(p.head_dim_v) +
                               " (64, 128 or 256, equal)");
  if (!(p.scale > 0.0f)) return fail(why, "scale <= 0");
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return fail(why, "heads_q is not a multiple of heads_kv");
  if (p.seqlen_q + p.kv_bound >= (int64_t(1) << 29)) return fail(why, "seqlen_q + the cache capacity >= 2^29");
  if (p.batch == 0 || p.seqlen_q == 0) return fail(why, "an empty dim");
  const Row row = cache_row(p);
  CacheMode mode = CacheMode::kContiguous;
  std::string direct_why;  // why a cache is not read directly (gathered instead)
  if (eight_bit) {  // codes converted exactly into q's dtype by the copy; scales applied in the kernel
    direct_why = std::string("a ") + dtype_str(p.kvt()) + " cache";
    mode = CacheMode::kGathered;
  } else if (p.block_table != nullptr) {
    const int64_t ps = p.page_size;
    if (ps % 8 != 0 || !(row.block_n % ps == 0 || ps % row.block_n == 0))
      direct_why = "page size " + std::to_string(ps) + " (TMA pieces: a multiple of 8 that divides the " +
                   std::to_string(row.block_n) + "-key block or is a multiple of it)";
    else if (p.k_stride.batch != ps * p.k_stride.seq || p.v_stride.batch != ps * p.v_stride.seq)
      direct_why = "pages are not packed (page stride != page_size x slot stride)";
    else if (p.num_pages * ps >= kRaggedRows)
      direct_why = "num_pages x page_size >= 2^30";
    else if (env != 1 && std::min<int64_t>(ps, row.block_n) < kCacheMinPieceRows)
      direct_why = "page size " + std::to_string(ps) + ": TMA pieces of fewer than " +
                   std::to_string(kCacheMinPieceRows) + " rows (one small load behind each block-table lookup)";
    else if (env_gather == 1)
      direct_why = "IOATTN_SM90_CACHE_GATHER=1";
    mode = direct_why.empty() ? CacheMode::kDirect : CacheMode::kGathered;
  }
  if (mode == CacheMode::kGathered) {
    if (env_gather == 0 || (env_gather == -1 && !ioattn::detail::kSm90CacheGatherByDefault))
      return fail(why, direct_why + (env_gather == 0 ? "; the gathered copy is switched off by IOATTN_SM90_CACHE_GATHER=0"
                                                     : "; the gathered copy is opt-in (IOATTN_SM90_CACHE_GATHER=1)"));
    if (gather_bytes(p) > kGatherMaxBytes)
      return fail(why, direct_why + "; the gathered copy would need " + std::to_string(gather_bytes(p) >> 20) +
                           " MiB (batch x kv_bound rows of K and V; at most " +
                           std::to_string(kGatherMaxBytes >> 20) + ")");
    if (p.batch * std::max<int64_t>(p.kv_bound, 1) >= kRaggedRows || p.batch > 65535)
      return fail(why, direct_why + "; the gathered copy: batch x kv_bound >= 2^30 or batch > 65535");
    // the copy's 16-byte loads (strides in elements of the cache's dtype)
    const int64_t e16 = eight_bit ? 16 : 8;
    if (reinterpret_cast<uintptr_t>(p.k) % 16 != 0 || reinterpret_cast<uintptr_t>(p.v) % 16 != 0 ||
        p.k_stride.batch % e16 != 0 || p.k_stride.seq % e16 != 0 || p.k_stride.head % e16 != 0 ||
        p.v_stride.batch % e16 != 0 || p.v_stride.seq % e16 != 0 || p.v_stride.head % e16 != 0)
      return fail(why, direct_why + "; the gathered copy needs 16-byte aligned caches and strides");
  } else if (p.block_table == nullptr) {
    const int64_t cap = cache_capacity_rows(p);
    if (cap == 0) return fail(why, "the contiguous cache's batch stride is not capacity x slot stride");
    if (p.batch * cap >= kRaggedRows) return fail(why, "batch x capacity >= 2^30");
  }
  if (mode != CacheMode::kGathered) {
    if (p.k_stride.seq <= 0 || p.v_stride.seq <= 0)
      return fail(why, "a slot stride <= 0 (the ragged maps need rows apart)");
    if (std::max(p.k_stride.seq, p.v_stride.seq) * 2 >= kRaggedMaxRowStrideBytes)
      return fail(why, "a slot stride of 2^34 bytes or more");
    if (!tma_compatible(p.k, {0, p.k_stride.seq, p.k_stride.head}, 1, 2, p.heads_kv, "k_cache", why)) return false;
    if (!tma_compatible(p.v, {0, p.v_stride.seq, p.v_stride.head}, 1, 2, p.heads_kv, "v_cache", why)) return false;
  }
  if (!tma_compatible(p.q, p.q_stride, p.batch, p.seqlen_q, p.heads_q, "q", why)) return false;
  if (reinterpret_cast<uintptr_t>(p.o) % 4 != 0 || p.o_stride.seq % 2 != 0 || p.o_stride.head % 2 != 0 ||
      p.o_stride.batch % 2 != 0)
    return fail(why, "o is not 4-byte aligned with even strides");
  const int64_t m_blocks = (p.seqlen_q + row.block_m - 1) / row.block_m;
  if (m_blocks * p.heads_q * p.batch > INT_MAX) return fail(why, "more than 2^31-1 query tiles");
  if (row.present == nullptr || !row.present()) return fail(why, "this build has no sm_90a image of the wgmma kernel");
  if (kernel != nullptr)
    *kernel = std::string("cuda/flash cache-prefill sm90 wgmma+tma ") + dtype_str(p.dtype) + " hdim" +
              std::to_string(p.head_dim) + " tile " + std::to_string(row.block_m) + "x" + std::to_string(row.block_n) +
              " ws " + std::to_string(row.consumer_wgs) + " consumer WGs" +
              (p.block_table == nullptr ? std::string(" contiguous") : " paged(" + std::to_string(p.page_size) + ")") +
              (p.kvt() != p.dtype ? std::string(" ") + dtype_str(p.kvt()) + " cache" : std::string()) +
              (mode == CacheMode::kGathered ? " gathered" : "");
  if (mode == CacheMode::kGathered)
    *why = "the Hopper forward's kLocal tiling over a contiguous copy of the cache (" + direct_why +
           "; a copy kernel moves the rows the lengths cover into a [batch, kv_bound] buffer of " +
           std::to_string((gather_bytes(p) + (1 << 20) - 1) >> 20) +
           " MiB, freed after the call; one TMA load per key block; lengths and table entries checked on the "
           "device); " + row.why;
  else
    *why = std::string("the Hopper forward's kLocal tiling reading K / V through ragged TMA maps over the cache (") +
           (mode == CacheMode::kDirect ? "one load per page piece of " +
                                             std::to_string(std::min<int64_t>(p.page_size, row.block_n)) + " rows"
                                       : "one load per key block") +
           ", rows past a sequence's length read as zeros; lengths from cache_seqlens on the device); " + row.why;
  if (mode_out != nullptr) *mode_out = mode;
  return true;
}

void cache_prefill_impl(const FwdProblem& p) {
  const Row row = cache_row(p);
  const int64_t m_blocks = (p.seqlen_q + row.block_m - 1) / row.block_m;
  const int64_t grid = m_blocks * p.heads_q * p.batch;
  if (grid == 0) return;
  cuda::DeviceGuard guard(p.device_index);
  FwdLaunch l;
  const bool paged = p.block_table != nullptr;
  const int64_t cap = paged ? 0 : cache_capacity_rows(p);
  const int64_t rows = paged ? p.num_pages * p.page_size : p.batch * cap;
  const int box = paged ? static_cast<int>(std::min<int64_t>(p.page_size, row.block_n)) : row.block_n;
  l.q = make_tensor_map(p.q, p.dtype, p.head_dim, p.seqlen_q, p.heads_q, p.batch, p.q_stride, row.block_m, "q");
  l.k = make_ragged_map(p.k, p.dtype, 2, p.head_dim, std::max<int64_t>(rows, 1), p.heads_kv, p.k_stride.seq,
                        p.k_stride.head, 64, box, "k_cache");
  l.v = make_ragged_map(p.v, p.dtype, 2, p.head_dim, std::max<int64_t>(rows, 1), p.heads_kv, p.v_stride.seq,
                        p.v_stride.head, 64, box, "v_cache");
  FwdParams& f = l.params;
  fill_common(f, p, p.kv_bound, m_blocks, grid);
  f.section_heads = section_heads(std::max<int64_t>(p.kv_bound, 1) * p.head_dim * 2 * 2 / f.group, f.batch_heads);
  Policy pol = default_policy(p.head_dim, true);  // the kLocal rows' policy (policy_for), no end alignment
  if (pol.grid == Grid::kDynamic && !mempools_supported(p.device_index)) pol.grid = Grid::kTilePerCta;
  const bool persistent = pol.grid != Grid::kTilePerCta;
  f.zigzag = pol.grid == Grid::kStatic ? 1 : 0;
  f.stagger = 0;
  f.rescale_skip = pol.rescale_skip ? 1 : 0;
  f.rescale_early = pol.rescale_early ? 1 : 0;
  CacheParams& cp = l.cache;
  fill_local(cp, p, p.seqlen_q + p.kv_bound);
  cp.kv_lens = p.kv_lens;
  cp.block_table = p.block_table;
  cp.bt_batch = p.bt_stride_batch;
  cp.bt_page = p.bt_stride_page;
  cp.page_size = paged ? static_cast<int>(p.page_size) : 0;
  cp.box_rows = box;
  cp.capacity = static_cast<int>(cap);
  cp.kv_bound = static_cast<int>(p.kv_bound);
  cp.num_pages = static_cast<int>(p.num_pages);
  cp.k_scale = p.k_descale.ptr;  // (null but for an 8-bit cache's gathered copy)
  cp.v_scale = p.v_descale.ptr;
  l.grid = static_cast<unsigned>(grid_ctas(p.device_index, grid, persistent));
  l.stream = static_cast<cudaStream_t>(p.stream);
  const std::unique_ptr<AsyncBuffer> counter = dynamic_tile_counter(pol, l.grid, grid, l.stream, f);
  row.launch(l);
}

// The gathered copy (CacheMode::kGathered): K and V rows of the cache (paged, or an 8-bit
// contiguous one) into [batch, kv_bound, heads_kv, d] buffers of q's dtype, one 16-byte chunk of
// the cache a thread, consecutive threads on consecutive bytes of a token's row; 8-bit codes
// become the same values in q's dtype (exact: every e4m3 and int8 value is a bf16 and an f16;
// the scales stay out, CacheParams::k_scale / v_scale). Rows past a sequence's length are not
// written (the ragged maps clip them to zeros).
struct GatherArgs {
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  uint8_t* k_out = nullptr;
  uint8_t* v_out = nullptr;
  int64_t k_page = 0, k_slot = 0, k_head = 0, v_page = 0, v_slot = 0, v_head = 0;  // bytes
  const int32_t* lens = nullptr;
  int32_t* lens_out = nullptr;  // the lengths the forward reads: -1 for a poisoned sequence
  const int32_t* table = nullptr;  // null: contiguous (sequence b at b x k_page / v_page)
  int64_t bt_batch = 0, bt_page = 0;
  int page_size = 0, num_pages = 0, kv_bound = 0, heads_kv = 0, head_dim = 0;
};

// CTA (x, b): rows [64 x, 64 x + 64) of sequence b. CTA 0 of a sequence also checks its length and
// the table entries its length covers, as the direct rows do (cache_span), and writes the length the
// forward reads: -1 (outside [0, kv_bound]: the forward poisons the sequence, NaN O and LSE) where
// one is bad. A bad entry's rows are written as zeros, never read from outside the cache.
// CT: the cache's element (Out itself: a plain copy; E4m3 or int8_t: codes converted).
template <typename CT, typename Out>
__global__ void __launch_bounds__(256) gather_cache_rows(const GatherArgs a) {
  constexpr bool kCopy = std::is_same_v<CT, Out>;
  constexpr int kElems = kCopy ? 8 : 16;  // elements per 16-byte chunk of the cache
  const int b = blockIdx.y, t0 = blockIdx.x * kGatherRows;
  const int len = __ldg(a.lens + b);
  const bool bad_len = len < 0 || len > a.kv_bound;
  const bool paged = a.table != nullptr;
  const int32_t* table = paged ? a.table + b * a.bt_batch : nullptr;
  if (blockIdx.x == 0) {
    int bad = bad_len;
    if (!bad && paged) {
      const int pages = (len + a.page_size - 1) / a.page_size;
      for (int pi = threadIdx.x; pi < pages; pi += blockDim.x) {
        const int page = __ldg(table + pi * a.bt_page);
        bad |= page < 0 || page >= a.num_pages;
      }
    }
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) a.lens_out[b] = bad ? -1 : len;
  }
  if (bad_len) return;
  const int rows = min(kGatherRows, len - t0);
  if (rows <= 0) return;
  const int chunks = a.head_dim / kElems, per_row = a.heads_kv * chunks, per_kv = rows * per_row;
  const int64_t out_slot = static_cast<int64_t>(a.heads_kv) * a.head_dim;  // elements
  for (int i = threadIdx.x; i < 2 * per_kv; i += blockDim.x) {
    const bool is_v = i >= per_kv;
    const int j = is_v ? i - per_kv : i, r = j / per_row, rem = j - r * per_row, h = rem / chunks,
              c = rem - h * chunks;
    const int t = t0 + r;
    int page = b, w = t;
    if (paged) {
      const int pi = t / a.page_size;
      w = t - pi * a.page_size;
      page = __ldg(table + pi * a.bt_page);
    }
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (!paged || (page >= 0 && page < a.num_pages)) {
      const uint8_t* src = is_v ? a.v + page * a.v_page + w * a.v_slot + h * a.v_head
                                : a.k + page * a.k_page + w * a.k_slot + h * a.k_head;
      x = __ldg(reinterpret_cast<const uint4*>(src) + c);
    }
    Out* dst = reinterpret_cast<Out*>(is_v ? a.v_out : a.k_out) + (static_cast<int64_t>(b) * a.kv_bound + t) * out_slot +
               h * a.head_dim + c * kElems;
    if constexpr (kCopy) {
      *reinterpret_cast<uint4*>(dst) = x;
    } else {
      float f[16];
      serving::CacheTraits<CT>::convert(x, f);
      uint32_t pk[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) pk[e] = pack2<Out>(f[2 * e], f[2 * e + 1]);
      reinterpret_cast<uint4*>(dst)[0] = make_uint4(pk[0], pk[1], pk[2], pk[3]);
      reinterpret_cast<uint4*>(dst)[1] = make_uint4(pk[4], pk[5], pk[6], pk[7]);
    }
  }
}

// CacheMode::kGathered: the copy, then the contiguous rows over it (both on p's stream; the
// buffers are freed in stream order after them).
template <typename Out>
void launch_gather(const GatherArgs& a, DType cache, dim3 grid, cudaStream_t stream) {
  if (cache == DType::f8e4m3)
    gather_cache_rows<serving::E4m3, Out><<<grid, 256, 0, stream>>>(a);
  else if (cache == DType::i8)
    gather_cache_rows<int8_t, Out><<<grid, 256, 0, stream>>>(a);
  else
    gather_cache_rows<Out, Out><<<grid, 256, 0, stream>>>(a);
  IOATTN_CUDA_CHECK_LAUNCH("gather_cache_rows");
}

void cache_prefill_gathered(const FwdProblem& p) {
  cuda::DeviceGuard guard(p.device_index);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int64_t bound = std::max<int64_t>(p.kv_bound, 1), slot = p.heads_kv * p.head_dim;
  const size_t half = static_cast<size_t>(gather_bytes(p) / 2);
  AsyncBuffer kb(half, stream), vb(half, stream), lens(static_cast<size_t>(p.batch) * sizeof(int32_t), stream);
  const int64_t eb = dtype_size(p.kvt());  // the cache's element bytes
  GatherArgs a;
  a.k = static_cast<const uint8_t*>(p.k);
  a.v = static_cast<const uint8_t*>(p.v);
  a.k_out = static_cast<uint8_t*>(kb.ptr);
  a.v_out = static_cast<uint8_t*>(vb.ptr);
  a.k_page = p.k_stride.batch * eb, a.k_slot = p.k_stride.seq * eb, a.k_head = p.k_stride.head * eb;
  a.v_page = p.v_stride.batch * eb, a.v_slot = p.v_stride.seq * eb, a.v_head = p.v_stride.head * eb;
  a.lens = p.kv_lens;
  a.lens_out = static_cast<int32_t*>(lens.ptr);
  a.table = p.block_table;
  a.bt_batch = p.bt_stride_batch, a.bt_page = p.bt_stride_page;
  a.page_size = static_cast<int>(p.page_size);  // (paged only)
  a.num_pages = static_cast<int>(p.num_pages);
  a.kv_bound = static_cast<int>(p.kv_bound);
  a.heads_kv = static_cast<int>(p.heads_kv);
  a.head_dim = static_cast<int>(p.head_dim);
  const dim3 grid(static_cast<unsigned>((bound + kGatherRows - 1) / kGatherRows), static_cast<unsigned>(p.batch));
  if (p.dtype == DType::bf16)
    launch_gather<__nv_bfloat16>(a, p.kvt(), grid, stream);
  else
    launch_gather<__half>(a, p.kvt(), grid, stream);
  FwdProblem g = p;
  g.k = kb.ptr, g.v = vb.ptr;
  g.k_stride = g.v_stride = {bound * slot, slot, p.head_dim};
  g.kv_dtype = p.dtype;  // (k_descale / v_descale stay: an 8-bit cache's scales, CacheParams)
  g.block_table = nullptr;
  g.page_size = 0, g.bt_stride_batch = 0, g.bt_stride_page = 0, g.num_pages = 0;
  g.kv_lens = static_cast<const int32_t*>(lens.ptr);
  cache_prefill_impl(g);
}

}  // namespace
}  // namespace ioattn::cuda::sm90

namespace ioattn::detail {

bool sm90_flash_select(const FwdProblem& p, std::string* kernel, std::string* reason) {
  std::string k, r;
  const bool ok = cuda::sm90::select_impl(p, &k, &r);
  if (kernel) *kernel = ok ? k : std::string();
  if (reason) *reason = r;
  return ok;
}

void sm90_flash_forward(const FwdProblem& p) {
  using namespace cuda::sm90;
  std::string kernel, why;
  if (!select_impl(p, &kernel, &why)) throw Error("q", "ioattn: sm90 flash kernel cannot run this problem: " + why);
  if (p.fp8()) {
    fp8_forward(p, fp8_policy());
    return;
  }
  const Policy pol = policy_for(p);
  const Row row = table_row(p, pol.wg3, pol.v3_body);
  const int64_t m_blocks = (p.seqlen_q + row.block_m - 1) / row.block_m;
  const int64_t grid = m_blocks * p.heads_q * p.batch;
  if (grid == 0) return;  // nothing to compute (seqlen_q, heads or batch is 0)
  cuda::DeviceGuard guard(p.device_index);

  FwdLaunch l;
  const MapExtent ext = map_extent(p);
  if (p.varlen()) {  // ragged: a tile's rows past its sequence read as zeros, not the next sequence's
    const auto ragged = [&](const void* ptr, int64_t rows, int64_t heads, const Strides3& s, int box, const char* n) {
      return make_ragged_map(ptr, p.dtype, 2, p.head_dim, rows, heads, s.seq, s.head, 64, box, n);
    };
    l.q = ragged(p.q, ext.seqlen_q, p.heads_q, p.q_stride, row.block_m, "q");
    l.k = ragged(p.k, ext.seqlen_k, p.heads_kv, p.k_stride, row.block_n, "k");
    l.v = ragged(p.v, ext.seqlen_k, p.heads_kv, p.v_stride, row.block_n, "v");
  } else {
    l.q = make_tensor_map(p.q, p.dtype, p.head_dim, ext.seqlen_q, p.heads_q, ext.batch, p.q_stride, row.block_m, "q");
    l.k = make_tensor_map(p.k, p.dtype, p.head_dim, ext.seqlen_k, p.heads_kv, ext.batch, p.k_stride, row.block_n, "k");
    l.v = make_tensor_map(p.v, p.dtype, p.head_dim, ext.seqlen_k, p.heads_kv, ext.batch, p.v_stride, row.block_n, "v");
  }
  FwdParams& f = l.params;
  fill_common(f, p, p.seqlen_k, m_blocks, grid);
  // Sections of (batch, head) pairs whose K + V fit in l2_section_bytes(), so the tiles in flight
  // reuse K/V from L2 (see decode_tile).
  f.section_heads = section_heads(std::max<int64_t>(p.seqlen_k, 1) * p.head_dim * 2 * 2 / f.group, f.batch_heads);
  const bool persistent = pol.grid != Grid::kTilePerCta;
  const bool local = needs_local(p);
  f.zigzag = pol.grid == Grid::kStatic && (p.causal || local) ? 1 : 0;
  // The non-causal key-order stagger is off by default since session 35 (IOATTN_SM90_STAGGER=1 turns
  // it on): with 8 MB L2 sections, Nsight Compute on an H100 (bf16, no mask, two rounds) put the
  // unrotated order at 0.970 / 0.991 / 0.999 of the rotated one's cycles for hdim 256 at 2k / 4k /
  // 16k, 0.991 / 0.995 / 1.000 for hdim 64 and 0.991 / 1.001 / 0.998 for hdim 128 (docs/PERF.md).
  // The fp8 rows (fp8_forward) keep it: not measured.
  f.stagger = !p.causal && !local && env_flag("IOATTN_SM90_STAGGER") ? 1 : 0;
  if (local) fill_local(l.local, p, p.seqlen_q + p.seqlen_k);  // (the longest sequences' lengths bound the windows)
  f.rescale_skip = pol.rescale_skip ? 1 : 0;
  f.rescale_early = pol.rescale_early ? 1 : 0;
  if (pol.align_end)  // (policy_for: plain causal, v4 body) padding rows before row 0 instead of after the last
    l.local.m_shift = static_cast<int>(m_blocks * row.block_m - p.seqlen_q);
  l.grid = static_cast<unsigned>(grid_ctas(p.device_index, grid, persistent));
  l.stream = static_cast<cudaStream_t>(p.stream);
  // Dynamic schedule: one int tile counter per launch, allocated and zeroed in stream order, so
  // launches on other streams (or replays of a captured graph) never share it; freed after the
  // kernel in stream order. With every tile a CTA's first one there is nothing to claim.
  struct CounterGuard {
    int* ptr = nullptr;
    cudaStream_t stream = nullptr;
    ~CounterGuard() {
      if (ptr != nullptr) cudaFreeAsync(ptr, stream);
    }
  } counter;
  if (pol.grid == Grid::kDynamic && static_cast<int64_t>(l.grid) < grid) {
    counter.stream = l.stream;
    IOATTN_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&counter.ptr), sizeof(int), l.stream));
    IOATTN_CUDA_CHECK(cudaMemsetAsync(counter.ptr, 0, sizeof(int), l.stream));
    f.tile_counter = counter.ptr;
  }
  row.launch(l);
  if (counter.ptr != nullptr) {
    int* ptr = counter.ptr;
    counter.ptr = nullptr;
    IOATTN_CUDA_CHECK(cudaFreeAsync(ptr, l.stream));
  }
}

bool sm90_cache_prefill_select(const FwdProblem& p, std::string* kernel, std::string* reason) {
  std::string r;
  const bool ok = cuda::sm90::select_cache_impl(p, kernel, &r);
  if (reason) *reason = r;
  return ok;
}

void sm90_cache_prefill(const FwdProblem& p) {
  std::string why;
  cuda::sm90::CacheMode mode;
  if (!cuda::sm90::select_cache_impl(p, nullptr, &why, &mode))
    throw Error("q", "ioattn: sm90 cache-prefill kernel cannot run this problem: " + why);
  if (mode == cuda::sm90::CacheMode::kGathered)
    cuda::sm90::cache_prefill_gathered(p);
  else
    cuda::sm90::cache_prefill_impl(p);
}

void sm90_fp8_transpose_only(const FwdProblem& p) {
  using namespace cuda::sm90;
  if (!p.fp8() || p.head_dim % 64 != 0) throw Error("q", "ioattn: sm90_fp8_transpose_only: f8e4m3, head_dim % 64 == 0");
  cuda::DeviceGuard guard(p.device_index);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int64_t skp = fp8_padded_keys(p);
  AsyncBuffer vt(static_cast<size_t>(p.batch * p.heads_kv * p.head_dim * skp), stream);
  fp8_transpose(p, vt.ptr, skp, stream);
}

}  // namespace ioattn::detail

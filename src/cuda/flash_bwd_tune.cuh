// flash_bwd_tune.cuh — candidate tiles for tuning BwdTraits (ioattn_cuda_bwd_tune only, never in
// the library). Each candidate is a BwdTile whose bf16 dK/dV kernel (with the atomic dQ partials)
// is instantiated on its own: no f16 kernel and no deterministic dQ kernel, so a dozen candidates
// compile in the time of a few table rows. The candidate runs through the library's own launch
// sequence (run_flash_backward: preprocess, dK/dV, dQ convert), so only the tile differs from
// what backward() runs.
#pragma once

#include <cuda_bf16.h>

#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/flash_bwd_launch.cuh"

namespace ioattn::cuda::bwd_tune {

struct Candidate {
  std::string name;    // "64x128 w8 minb1" (+ " cols/2"): kBlockM x kBlockN, warps, __launch_bounds__ min CTAs/SM
  int min_blocks = 1;  // kMinBlocksPerSm (the register cap it implies: 65536 / (threads x min_blocks))
  bool shipped = false;  // this is BwdTraits<kHeadDim>'s tile (the baseline of the sweep)
  BwdKernelInfo info;  // tile fields + dkdv_bf16 + launch; f16 and dq pointers stay null
};

// bf16, default (atomic dQ) mode only: anything else is a misuse of the sweep.
template <class Tr>
void launch_candidate(const BwdParams& p, bool is_bf16, cudaStream_t stream) {
  if (!is_bf16 || p.ws_dq == nullptr)
    throw std::runtime_error("ioattn_cuda_bwd_tune: candidates are instantiated for bf16 with atomic dQ only");
  launch_flash_bwd_dkdv<Tr, __nv_bfloat16>(p, stream);
}

template <class Tr>
Candidate make_candidate() {
  Candidate c;
  c.name = std::to_string(Tr::kBlockM) + "x" + std::to_string(Tr::kBlockN) + " w" + std::to_string(Tr::kWarps) +
           " minb" + std::to_string(Tr::kMinBlocksPerSm) +
           (Tr::kColSplits > 1 ? " cols/" + std::to_string(Tr::kColSplits) : std::string());
  c.min_blocks = Tr::kMinBlocksPerSm;
  c.shipped = std::is_base_of_v<Tr, BwdTraits<Tr::kHeadDim>>;
  c.info = bwd_info_shape<Tr>();
  c.info.reason = "ioattn_cuda_bwd_tune candidate";
  c.info.dkdv_bf16 = reinterpret_cast<const void*>(&flash_bwd_dkdv_kernel<Tr, __nv_bfloat16>);
  c.info.launch = &launch_candidate<Tr>;
  return c;
}

// One list per head dim, defined in flash_bwd_tune_d<D>.cu (one TU each: they compile in parallel).
std::vector<Candidate> candidates_d64();
std::vector<Candidate> candidates_d128();
std::vector<Candidate> candidates_d256();

}  // namespace ioattn::cuda::bwd_tune

// sm90.hpp — entry points of the Hopper (sm_90a) forward kernel (src/cuda/hopper/).
//
// One selector answers both "is this problem supported?" and "which kernel runs?", so the two
// can never disagree: sm90_flash_forward runs exactly the row sm90_flash_select names.
#pragma once

#include <string>

#include "core/problem.hpp"

namespace ioattn::detail {

// Packed (varlen) tokens must sit less than this many bytes apart for the sm90 kernels' ragged TMA
// maps (make_ragged_map in hopper/ptx_sm90.cuh); the forward's selector and the backward's refusal
// check it.
constexpr int64_t kSm90RaggedMaxRowStrideBytes = int64_t{1} << 34;

// True, with the dispatch-table row in *kernel (e.g. "cuda/flash sm90 wgmma+tma bf16 hdim128
// causal tile 128x128 stages 2 ws 2 consumer WGs pingpong") and the reason for the tile in
// *reason, when the wgmma/TMA kernel handles p on p.device_index. False, with *reason naming the
// feature or constraint that rules it out (then the caller uses the sm80 kernel and logs why).
// Either pointer may be null. Never throws for an unsupported problem.
bool sm90_flash_select(const FwdProblem& p, std::string* kernel, std::string* reason);

// Runs the kernel on p.stream. Precondition: sm90_flash_select(p) is true (otherwise throws
// ioattn::Error with the selector's reason). Every CUDA call and the launch are checked; a failure
// throws ioattn::Error naming the call.
void sm90_flash_forward(const FwdProblem& p);

// FP8 problems (dtype f8e4m3, head_dim a multiple of 64): runs only the V transpose pre-pass of
// the fp8 kernel (into a workspace allocated and freed on p.stream), so benchmarks can time it
// apart from the attention kernel. No output is written.
void sm90_fp8_transpose_only(const FwdProblem& p);

// Prefill through the KV cache (decode() with more than 16 query rows; FwdProblem from
// cache_prefill_problem: kv_lens / block_table on the device): the Hopper kernel's kCache rows for
// 16-bit caches of q's dtype, head_dim 64 / 128 / 256. Select: as sm90_flash_select (reason says
// what rules it out; never throws for an unsupported problem). Run: precondition select is true.
bool sm90_cache_prefill_select(const FwdProblem& p, std::string* kernel, std::string* reason);
void sm90_cache_prefill(const FwdProblem& p);

}  // namespace ioattn::detail

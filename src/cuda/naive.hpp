// naive.hpp — internal hooks of the naive CUDA path for the benchmarks in src/cuda.
#pragma once

#include <cstddef>

namespace ioattn::cuda {
// Bytes of workspace (S fp32 + P + pointer arrays) the last cuda_naive_forward call allocated:
// the "extra memory" of standard attention that the flash kernel does not need.
size_t naive_last_workspace_bytes();
}  // namespace ioattn::cuda

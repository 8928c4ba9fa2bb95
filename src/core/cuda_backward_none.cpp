// CUDA builds without a CUDA backward kernel yet: the dispatcher reports why, nothing runs.
#include "core/backends.hpp"

namespace ioattn::detail {
CudaSelection cuda_backward_select(const BwdProblem&, int) {
  return {"", "no CUDA backward kernel is built yet (the CPU backward runs on host tensors)"};
}
void cuda_flash_backward(const BwdProblem&) {
  throw Error("q.device", "ioattn: argument 'q.device': expected cpu for the backward (no CUDA backward kernel yet), got cuda");
}
}  // namespace ioattn::detail

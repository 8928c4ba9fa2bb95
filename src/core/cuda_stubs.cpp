// CUDA entry points for a build without CUDA: report "absent" and fail loudly if reached.
#include <stdexcept>

#include "core/backends.hpp"
#include "core/serving_problem.hpp"

namespace ioattn::detail {
namespace {
[[noreturn]] void no_cuda() {
  throw Error("q.device", "ioattn: argument 'q.device': expected cpu (this build has no CUDA backend), got cuda");
}
}  // namespace

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_device_name(int) { return ""; }
int cuda_device_arch(int) { return 0; }
bool cuda_is_device_pointer(const void*) { return false; }
int cuda_pointer_device(const void*) { return -1; }
int cuda_set_device(int index) { return index; }
void cuda_copy_to_host(void*, const void*, size_t, void*) { no_cuda(); }
void* cuda_malloc(size_t) { no_cuda(); }
void cuda_free(void*) {}
void cuda_copy_from_host(void*, const void*, size_t) { no_cuda(); }
void cuda_synchronize() {}
size_t cuda_used_bytes() { return 0; }
bool cuda_poison_pool(size_t) { return false; }
CudaSelection cuda_flash_select(const FwdProblem&, int) { return {"", "this build has no CUDA backend"}; }
void cuda_flash_forward(const FwdProblem&) { no_cuda(); }
void cuda_naive_forward(const FwdProblem&) { no_cuda(); }
std::vector<std::string> cuda_compiled_kernels() { return {}; }
CudaSelection cuda_backward_select(const BwdProblem&, int) { return {"", "this build has no CUDA backend"}; }
void cuda_flash_backward(const BwdProblem&) { no_cuda(); }
// Serving (never reached: validation refuses CUDA tensors in a build without CUDA).
CudaSelection cuda_decode_select(const DecodeProblem&, int) { return {"", "this build has no CUDA backend"}; }
int cuda_decode_num_splits(int64_t, int64_t, int64_t, int64_t, int64_t, DType, int64_t, int64_t, bool, int,
                           std::string*) {
  no_cuda();
}
size_t cuda_decode_workspace_bytes(int64_t, int64_t, int64_t, int64_t, int) { return 0; }
void cuda_decode(const DecodeProblem&) { no_cuda(); }
CudaSelection cuda_cache_prefill_select(const FwdProblem&, int) { return {"", "this build has no CUDA backend"}; }
void cuda_cache_prefill(const FwdProblem&) { no_cuda(); }
void cuda_append_kv(const AppendProblem&) { no_cuda(); }
void cuda_merge_states(const MergeProblem&) { no_cuda(); }

}  // namespace ioattn::detail

// CUDA entry points for a build without CUDA: report "absent" and fail loudly if reached.
#include <stdexcept>

#include "core/backends.hpp"

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
CudaSelection cuda_flash_select(const FwdProblem&, int) { return {"", "this build has no CUDA backend"}; }
void cuda_flash_forward(const FwdProblem&) { no_cuda(); }
void cuda_naive_forward(const FwdProblem&) { no_cuda(); }
std::vector<std::string> cuda_compiled_kernels() { return {}; }
CudaSelection cuda_backward_select(const BwdProblem&, int) { return {"", "this build has no CUDA backend"}; }
void cuda_flash_backward(const BwdProblem&) { no_cuda(); }

}  // namespace ioattn::detail

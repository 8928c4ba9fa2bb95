// PLACEHOLDER — being replaced by the Highway tiled online-softmax kernel.
#include <omp.h>

#include "core/backends.hpp"

namespace ioattn::detail {
void cpu_flash_forward(const FwdProblem& p) { cpu_naive_forward(p); }
std::string cpu_flash_tile(const FwdProblem&) { return "0x0"; }
std::vector<std::string> cpu_compiled_targets() { return {"none"}; }
std::string cpu_best_target() { return "none"; }
int cpu_max_threads() { return omp_get_max_threads(); }
}  // namespace ioattn::detail

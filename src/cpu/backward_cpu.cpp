// PLACEHOLDER — being replaced by the backward implementation.
#include "core/backends.hpp"

namespace ioattn::detail {
void cpu_naive_backward(const BwdProblem&) { throw Error("backward", "ioattn: backward is not implemented yet"); }
void cpu_flash_backward(const BwdProblem&) { throw Error("backward", "ioattn: backward is not implemented yet"); }
}  // namespace ioattn::detail

// Internal: public views -> validated FwdProblem (see api.cpp). Used by the API entry points,
// and by the CLI and tests to run the reference on exactly the problem a backend receives.
#pragma once

#include <vector>

#include "core/problem.hpp"

namespace ioattn::detail {

struct Validated {
  FwdProblem p;
  std::vector<int32_t> cu_q_host, cu_k_host;  // host copies that p.cu_seqlens_*_host point into

  Validated() = default;
  Validated(const Validated&) = delete;  // p points into the vectors above
  Validated& operator=(const Validated&) = delete;
  Validated(Validated&& o) noexcept { *this = std::move(o); }
  Validated& operator=(Validated&& o) noexcept {
    p = o.p;
    cu_q_host = std::move(o.cu_q_host);
    cu_k_host = std::move(o.cu_k_host);
    if (p.cu_seqlens_q_host) p.cu_seqlens_q_host = cu_q_host.data();
    if (p.cu_seqlens_k_host) p.cu_seqlens_k_host = cu_k_host.data();
    return *this;
  }
};

// Throws ioattn::Error on the first bad argument. varlen may be null (fixed length).
Validated validate(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                   const TensorView& lse, const Varlen* varlen, const AttnParams& params,
                   const Context& ctx);

struct ValidatedBwd {
  Validated fwd;
  BwdProblem p;  // p.f is filled from fwd.p right before a backend runs (fwd owns the host copies)
};

// Backward: the forward's checks plus dout/dq/dk/dv/dsinks; lse is required.
ValidatedBwd validate_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& o, const TensorView& dout, const TensorView& lse,
                               const Gradients& g, const Varlen* varlen, const AttnParams& params,
                               const Context& ctx);

}  // namespace ioattn::detail

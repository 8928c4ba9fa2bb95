// ioattn context parallelism: ring attention over P ranks.
//
// The sequence is sharded over P ranks along the sequence dim; each rank keeps its query
// shard and passes its K/V shard around a ring (P - 1 hops) while it attends to the shard it
// holds, merging the partial (O, LSE) pairs with merge_states. The backward rotates K/V again
// with a travelling fp32 dK/dV accumulator (one extra hop brings it home).
//
// Layouts: contiguous (rank r holds chunk r of P) or zigzag (rank r holds chunks r and 2P-1-r of
// 2P, so causal work is balanced). Only self-attention shards (seqlen_q == seqlen_k per rank)
// are supported; causal or not; GQA; softcap. Window, ALiBi and sinks need global positions
// inside the block kernel and are rejected with a clear error.
//
// Communicators: an in-process loopback group (P virtual ranks, one thread each, for tests on
// the CPU or one GPU) and NCCL (the caller passes its ncclComm_t; transfers run on a separate
// stream so they overlap the block computation).
#pragma once

#include <memory>
#include <vector>

#include "ioattn/ioattn.hpp"

namespace ioattn {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Starts one ring hop: `bytes` from send go to rank + 1, as many from rank - 1 arrive in recv.
  // recv may be read only after ring_wait(). send and recv must not overlap.
  virtual void ring_start(const void* send, void* recv, size_t bytes, Device device, void* stream) = 0;
  virtual void ring_wait(void* stream) = 0;
  virtual const char* name() const = 0;
};

// P virtual ranks in one process: run rank r's calls on its own thread (see tests/test_cp.cpp).
std::vector<std::unique_ptr<Communicator>> make_loopback_group(int size);

// NCCL communicator over the caller's ncclComm_t (passed as void*). Throws ioattn::Error when this
// build has no NCCL.
std::unique_ptr<Communicator> make_nccl_communicator(void* nccl_comm);
// One process driving several GPUs: ncclCommInitAll over `devices` (distinct, visible), one
// communicator per rank (rank r on devices[r]) that owns and destroys its ncclComm_t. Run rank
// r's calls on its own thread with devices[r] current. Throws ioattn::Error without NCCL.
std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& devices);
bool nccl_compiled();

enum class CpLayout : uint8_t { contiguous, zigzag };

// Local shards: q [batch, S/P, heads_q, d], k/v [batch, S/P, heads_kv, d] (k/v contiguous),
// o like q, lse f32 [batch, heads_q, S/P]. Zigzag needs S/P even.
KernelChoice cp_forward(Communicator& comm, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& o, const TensorView& lse, const AttnParams& params, CpLayout layout,
                        const Context& ctx = {});

// dq/dk/dv like q/k/v on this rank; o and lse are cp_forward's outputs.
KernelChoice cp_backward(Communicator& comm, const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const TensorView& dout, const TensorView& lse,
                         const Gradients& grads, const AttnParams& params, CpLayout layout,
                         const Context& ctx = {});

// Copies rank's shard out of a full [batch, S, heads, d] tensor (and back). Both views must be
// on the same device, same dtype; the local view is [batch, S/P, heads, d].
void cp_shard(const TensorView& full, const TensorView& local, int rank, int size, CpLayout layout);
void cp_unshard(const TensorView& local, const TensorView& full, int rank, int size, CpLayout layout);
// Global position of each local row (for RoPE and masks in the caller's model).
std::vector<int64_t> cp_positions(int64_t seqlen, int rank, int size, CpLayout layout);

}  // namespace ioattn

// Communicators for ring attention: the in-process loopback group (P virtual ranks, one thread
// each) and, when built with NCCL, the NCCL ring over a caller's ncclComm_t.
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "dist/ops.hpp"
#include "ioattn/context_parallel.hpp"

#ifdef IOATTN_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace ioattn {
namespace {

// Shared state of a loopback group: a mailbox per rank and a reusable barrier.
struct LoopbackState {
  explicit LoopbackState(int n)
      : size(n), send(static_cast<size_t>(n)), bytes(static_cast<size_t>(n)), barrier_(n) {}
  int size;
  std::vector<const void*> send;
  std::vector<size_t> bytes;
  detail::dist::Barrier barrier_;

  void barrier() { barrier_.wait(); }
};

class Loopback final : public Communicator {
 public:
  Loopback(std::shared_ptr<LoopbackState> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->size; }
  const char* name() const override { return "loopback"; }

  // Synchronous: post the send buffer, copy the left neighbour's, and wait until everybody has
  // copied before any rank may reuse its send buffer.
  void ring_start(const void* send, void* recv, size_t bytes, Device device, void* stream) override {
    detail::dist::synchronize(device, stream);  // the send buffer's producers are done
    s_->send[static_cast<size_t>(rank_)] = send;
    s_->bytes[static_cast<size_t>(rank_)] = bytes;
    s_->barrier();
    const auto left = static_cast<size_t>((rank_ - 1 + s_->size) % s_->size);
    if (s_->bytes[left] != bytes)
      throw Error("bytes", "ioattn: ring exchange: expected " + std::to_string(bytes) + " bytes from rank " +
                               std::to_string(left) + ", got " + std::to_string(s_->bytes[left]));
    detail::dist::copy_bytes(device, recv, s_->send[left], bytes, stream);
    detail::dist::synchronize(device, stream);
    s_->barrier();
  }
  void ring_wait(void*) override {}

 private:
  std::shared_ptr<LoopbackState> s_;
  int rank_;
};

#ifdef IOATTN_WITH_NCCL
void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error("nccl", std::string("ioattn: ") + what + " failed: " + ncclGetErrorString(r));
}
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error("cuda", std::string("ioattn: ") + what + " failed: " + cudaGetErrorString(e));
}

// Transfers run on the communicator's own stream: ring_start orders them after the compute
// stream's work so far, ring_wait orders the compute stream after them; in between the block
// computation and the transfer overlap.
class Nccl final : public Communicator {
 public:
  // On a throw the constructor releases what it made (the destructor does not run then); an
  // owned comm stays the caller's to destroy.
  Nccl(ncclComm_t comm, bool owns) : comm_(comm), owns_(false) {
    try {
      nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
      nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount");
      cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
      cuda_check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
      cuda_check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate");
    } catch (...) {
      release();
      throw;
    }
    owns_ = owns;
  }
  ~Nccl() override {
    release();
    if (owns_) ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "nccl"; }
  void ring_start(const void* send, void* recv, size_t bytes, Device device, void* stream) override {
    if (device != Device::cuda) throw Error("q.device", "ioattn: argument 'q.device': expected cuda for NCCL, got cpu");
    auto s = static_cast<cudaStream_t>(stream);
    cuda_check(cudaEventRecord(ready_, s), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    nccl_check(ncclSend(send, bytes, ncclUint8, (rank_ + 1) % size_, comm_, stream_), "ncclSend");
    nccl_check(ncclRecv(recv, bytes, ncclUint8, (rank_ - 1 + size_) % size_, comm_, stream_), "ncclRecv");
    nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    cuda_check(cudaEventRecord(done_, stream_), "cudaEventRecord");
  }
  void ring_wait(void* stream) override {
    cuda_check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), done_, 0), "cudaStreamWaitEvent");
  }

 private:
  void release() {
    if (stream_) cudaStreamSynchronize(stream_);
    if (ready_) cudaEventDestroy(ready_);
    if (done_) cudaEventDestroy(done_);
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr, ready_ = nullptr, done_ = nullptr;
  }

  ncclComm_t comm_;
  bool owns_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
};
#endif

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_loopback_group(int size) {
  if (size < 1) throw Error("size", "ioattn: argument 'size': expected >= 1 ranks, got " + std::to_string(size));
  auto state = std::make_shared<LoopbackState>(size);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<Loopback>(state, r));
  return out;
}

bool nccl_compiled() {
#ifdef IOATTN_WITH_NCCL
  return true;
#else
  return false;
#endif
}

std::unique_ptr<Communicator> make_nccl_communicator(void* nccl_comm) {
#ifdef IOATTN_WITH_NCCL
  if (!nccl_comm) throw Error("nccl_comm", "ioattn: argument 'nccl_comm': expected an ncclComm_t, got null");
  return std::make_unique<Nccl>(static_cast<ncclComm_t>(nccl_comm), false);
#else
  (void)nccl_comm;
  throw Error("nccl_comm", "ioattn: argument 'nccl_comm': expected a build with NCCL, got a build without it");
#endif
}

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& devices) {
#ifdef IOATTN_WITH_NCCL
  if (devices.empty()) throw Error("devices", "ioattn: argument 'devices': expected >= 1 CUDA device, got none");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;  // no driver or no GPU: nothing is visible
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] < 0 || devices[i] >= count)
      throw Error("devices", "ioattn: argument 'devices[" + std::to_string(i) + "]': expected a CUDA device in [0, " +
                                 std::to_string(count) + "), got " + std::to_string(devices[i]));
    for (size_t j = 0; j < i; ++j)
      if (devices[j] == devices[i])
        throw Error("devices", "ioattn: argument 'devices': expected distinct devices, got " +
                                   std::to_string(devices[i]) + " twice");
  }
  std::vector<ncclComm_t> comms(devices.size());
  nccl_check(ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()), "ncclCommInitAll");
  std::vector<std::unique_ptr<Communicator>> out;
  size_t made = 0;  // comms[0, made) are owned by a communicator in `out`
  try {
    for (; made < devices.size(); ++made) {
      detail::CudaDeviceGuard on(devices[made]);  // the communicator's stream and events live there
      out.push_back(std::make_unique<Nccl>(comms[made], true));
    }
  } catch (...) {
    out.clear();
    for (size_t r = made; r < comms.size(); ++r) ncclCommDestroy(comms[r]);
    throw;
  }
  return out;
#else
  (void)devices;
  throw Error("devices", "ioattn: argument 'devices': expected a build with NCCL, got a build without it");
#endif
}

}  // namespace ioattn

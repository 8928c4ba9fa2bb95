// Ring attention (context parallelism) on top of the public forward/backward/merge_states.
//
// Each rank holds its query shard and one K/V shard at a time. At step s rank r holds the K/V
// of rank src = r - s (mod P). A shard is 1 chunk (contiguous layout) or 2 chunks (zigzag:
// chunks r and 2P-1-r of 2P). For every (query chunk, key chunk) pair the causal decision is
// made at chunk granularity — all chunks have one length, so a pair is either fully visible
// (key chunk earlier), diagonal (same chunk: the ordinary causal mask) or skipped (key chunk
// later) — and the block attention runs through ioattn::forward / ioattn::backward. Partial
// (O, LSE) pairs merge into fp32 accumulators with merge_states; gradients accumulate in fp32,
// dK/dV in an accumulator that travels with the K/V shard and takes one extra hop home.
#include <string>
#include <vector>

#include <optional>

#include "core/backends.hpp"
#include "core/checks.hpp"
#include "dist/ops.hpp"
#include "ioattn/context_parallel.hpp"
#include "ioattn/serving.hpp"

namespace ioattn {
namespace {

using detail::fail;
using detail::dist::Scratch;

struct Chunk {
  int64_t offset;  // rows into the local shard
  int64_t len;
  int64_t id;      // global chunk index (granularity: S / P or S / 2P)
};

std::vector<Chunk> chunks_of(int rank, int P, int64_t local, CpLayout layout) {
  // With one rank, zigzag's chunks 0 and 1 are adjacent: the whole sequence, as contiguous.
  if (layout == CpLayout::contiguous || P == 1) return {{0, local, rank}};
  const int64_t h = local / 2;
  return {{0, h, rank}, {h, h, 2 * P - 1 - rank}};
}

enum class Pair { skip, full, diagonal };

Pair classify(const Chunk& q, const Chunk& k, bool causal) {
  if (!causal) return Pair::full;
  if (k.id < q.id) return Pair::full;
  if (k.id == q.id) return Pair::diagonal;
  return Pair::skip;
}

// Rows [off, off + len) of a [b, s, h, d] view (dim 1), or columns of a [b, h, s] LSE view (dim 2).
TensorView rows(const TensorView& t, int dim, int64_t off, int64_t len) {
  TensorView r = t;
  r.data = static_cast<char*>(t.data) + off * t.stride[dim] * dtype_size(t.dtype);
  r.shape[dim] = len;
  return r;
}

// Scratch views carry the device ordinal of the call's tensors: the block forward/backward checks
// that every tensor lives on the device its view names (rank r of an NCCL ring runs on GPU r).
TensorView contiguous(void* data, DType dt, std::initializer_list<int64_t> shape, Device dev, int device_index) {
  TensorView t = TensorView::contiguous(data, dt, shape, dev);
  t.device_index = device_index;
  return t;
}

struct Shapes {
  int64_t B, L, Hq, Hk, D, Dv;
};

Shapes check_cp(const Communicator& comm, const TensorView& q, const TensorView& k, const TensorView& v,
                const AttnParams& params, CpLayout layout) {
  if (q.ndim != 4) fail("q", "4 dims [batch, seqlen/P, heads_q, head_dim]", std::to_string(q.ndim) + " dims");
  if (k.ndim != 4 || v.ndim != 4) fail("k", "4 dims [batch, seqlen/P, heads_kv, head_dim]", std::to_string(k.ndim) + " dims");
  Shapes s{q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]};
  if (k.shape[1] != s.L)
    fail("k.shape[1]", std::to_string(s.L) + " (self-attention shards: seqlen_k = seqlen_q per rank)",
         std::to_string(k.shape[1]));
  if (layout == CpLayout::zigzag && s.L % 2 != 0)
    fail("q.shape[1]", "an even local length for the zigzag layout (two equal chunks)", std::to_string(s.L));
  for (const auto& [t, name] : {std::pair{&k, "k"}, {&v, "v"}}) {
    const int64_t want[4] = {t->shape[1] * t->shape[2] * t->shape[3], t->shape[2] * t->shape[3], t->shape[3], 1};
    for (int i = 0; i < 4; ++i)
      if (t->shape[i] > 1 && t->stride[i] != want[i])
        fail(std::string(name) + ".stride[" + std::to_string(i) + "]",
             std::to_string(want[i]) + " (contiguous K/V shards travel the ring as one buffer)",
             std::to_string(t->stride[i]));
  }
  if (params.window_left >= 0 || params.window_right >= 0)
    fail("params.window_left", "-1 (windows are not supported by cp_forward yet)",
         std::to_string(params.window_left) + "," + std::to_string(params.window_right));
  if (params.alibi_slopes.defined())
    fail("params.alibi_slopes", "undefined (ALiBi needs global positions in the block kernel)", "a view");
  if (params.sinks.defined()) fail("params.sinks", "undefined (sinks are not supported by cp_forward yet)", "a view");
  if (comm.size() < 1) fail("comm", "a communicator of >= 1 ranks", std::to_string(comm.size()));
  return s;
}

AttnParams block_params(const AttnParams& params, Pair pair) {
  AttnParams p = params;
  p.causal = pair == Pair::diagonal;
  return p;
}

// The travelling K/V shard: [K | V] contiguous, each [B, L, Hk, D|Dv].
struct KvRing {
  KvRing(const Shapes& s, DType dt, Device dev, int index, void* stream)
      : k_bytes(static_cast<size_t>(s.B * s.L * s.Hk * s.D * dtype_size(dt))),
        v_bytes(static_cast<size_t>(s.B * s.L * s.Hk * s.Dv * dtype_size(dt))),
        a(dev, k_bytes + v_bytes, stream), b(dev, k_bytes + v_bytes, stream), shapes(s), dtype(dt), device(dev), device_index(index) {}
  size_t k_bytes, v_bytes;
  Scratch a, b;
  Shapes shapes;
  DType dtype;
  Device device;
  int device_index;
  TensorView k(void* base) const {
    return contiguous(base, dtype, {shapes.B, shapes.L, shapes.Hk, shapes.D}, device, device_index);
  }
  TensorView v(void* base) const {
    return contiguous(static_cast<char*>(base) + k_bytes, dtype, {shapes.B, shapes.L, shapes.Hk, shapes.Dv}, device, device_index);
  }
};

// A hop started and not yet waited for: if a block throws in between, the destructor orders the
// compute stream after the transfer, so the ring buffers (freed on that stream by the scratch
// destructors that run after this one) are not returned to the pool while NCCL still writes them.
struct HopInFlight {
  Communicator& comm;
  void* stream;
  bool pending = false;
  ~HopInFlight() {
    if (!pending) return;
    try {
      comm.ring_wait(stream);
    } catch (...) {  // already unwinding: nothing better to do
    }
  }
};

}  // namespace

KernelChoice cp_forward(Communicator& comm, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& o, const TensorView& lse, const AttnParams& params, CpLayout layout,
                        const Context& ctx) {
  const Shapes s = check_cp(comm, q, k, v, params, layout);
  const int P = comm.size(), r = comm.rank();
  const Device dev = q.device;
  std::optional<detail::CudaDeviceGuard> on;  // scratch and kernels on q's device
  if (dev == Device::cuda) on.emplace(q.device_index);
  if (!lse.defined()) fail("lse", "an f32 [batch, heads_q, seqlen/P] view (the ring merges on it)", "undefined");
  // Validate the local problem once through the ordinary forward path (no work: select only).
  select_forward(q, k, v, o, lse, params, ctx);

  KvRing ring(s, q.dtype, dev, q.device_index, ctx.stream);
  detail::dist::copy(ring.k(ring.a.get()), k, ctx.stream);
  detail::dist::copy(ring.v(ring.a.get()), v, ctx.stream);
  // fp32 running state and one block's partial result (input dtype, as the forward writes it).
  void* st = ctx.stream;
  Scratch o_acc_m(dev, static_cast<size_t>(s.B * s.L * s.Hq * s.Dv * 4), st), lse_acc_m(dev, static_cast<size_t>(s.B * s.Hq * s.L * 4), st);
  Scratch o_part_m(dev, static_cast<size_t>(s.B * s.L * s.Hq * s.Dv * dtype_size(q.dtype)), st);
  Scratch lse_part_m(dev, static_cast<size_t>(s.B * s.Hq * s.L * 4), st);
  const TensorView o_acc = contiguous(o_acc_m.get(), DType::f32, {s.B, s.L, s.Hq, s.Dv}, dev, q.device_index);
  const TensorView lse_acc = contiguous(lse_acc_m.get(), DType::f32, {s.B, s.Hq, s.L}, dev, q.device_index);
  detail::dist::fill_f32(o_acc, 0.0f, ctx.stream);
  detail::dist::fill_f32(lse_acc, -std::numeric_limits<float>::infinity(), ctx.stream);

  const auto q_chunks = chunks_of(r, P, s.L, layout);
  void* cur = ring.a.get();
  void* nxt = ring.b.get();
  KernelChoice last{"cp/ring " + std::string(comm.name()) + " P=" + std::to_string(P) + " (no block ran)", ""};
  HopInFlight hop{comm, ctx.stream};
  for (int step = 0; step < P; ++step) {
    const int src = (r - step + P) % P;
    if (step + 1 < P) {
      comm.ring_start(cur, nxt, ring.k_bytes + ring.v_bytes, dev, ctx.stream);
      hop.pending = true;
    }
    const TensorView kc = ring.k(cur), vc = ring.v(cur);
    for (const Chunk& qc : q_chunks)
      for (const Chunk& kch : chunks_of(src, P, s.L, layout)) {
        const Pair pair = classify(qc, kch, params.causal);
        if (pair == Pair::skip) continue;
        const TensorView o_part = contiguous(o_part_m.get(), q.dtype, {s.B, qc.len, s.Hq, s.Dv}, dev, q.device_index);
        const TensorView lse_part = contiguous(lse_part_m.get(), DType::f32, {s.B, s.Hq, qc.len}, dev, q.device_index);
        last = forward(rows(q, 1, qc.offset, qc.len), rows(kc, 1, kch.offset, kch.len), rows(vc, 1, kch.offset, kch.len),
                       o_part, lse_part, block_params(params, pair), ctx);
        const TensorView oa = rows(o_acc, 1, qc.offset, qc.len), la = rows(lse_acc, 2, qc.offset, qc.len);
        merge_states(oa, la, o_part, lse_part, oa, la, ctx);
      }
    if (step + 1 < P) {
      hop.pending = false;
      comm.ring_wait(ctx.stream);
      std::swap(cur, nxt);
    }
  }
  detail::dist::convert(o, o_acc, ctx.stream);
  detail::dist::copy(lse, lse_acc, ctx.stream);
  detail::dist::synchronize(dev, ctx.stream);
  return {"cp/ring " + std::string(comm.name()) + " P=" + std::to_string(P) +
              (layout == CpLayout::zigzag ? " zigzag" : " contiguous") + " block: " + last.kernel,
          "ring attention: K/V rotate P-1 times, partial (O, LSE) merged in fp32"};
}

KernelChoice cp_backward(Communicator& comm, const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const TensorView& dout, const TensorView& lse,
                         const Gradients& grads, const AttnParams& params, CpLayout layout,
                         const Context& ctx) {
  const Shapes s = check_cp(comm, q, k, v, params, layout);
  const int P = comm.size(), r = comm.rank();
  const Device dev = q.device;
  std::optional<detail::CudaDeviceGuard> on;  // scratch and kernels on q's device
  if (dev == Device::cuda) on.emplace(q.device_index);
  if (grads.dsinks.defined()) fail("grads.dsinks", "undefined (no sinks in cp_backward)", "a view");
  for (const auto& [t, like, name] : {std::tuple{&grads.dq, &q, "dq"}, {&grads.dk, &k, "dk"}, {&grads.dv, &v, "dv"}}) {
    if (t->ndim != 4) fail(name, "4 dims", std::to_string(t->ndim) + " dims");
    for (int i = 0; i < 4; ++i)
      if (t->shape[i] != like->shape[i])
        fail(std::string(name) + ".shape[" + std::to_string(i) + "]", std::to_string(like->shape[i]),
             std::to_string(t->shape[i]));
  }

  KvRing ring(s, q.dtype, dev, q.device_index, ctx.stream);
  detail::dist::copy(ring.k(ring.a.get()), k, ctx.stream);
  detail::dist::copy(ring.v(ring.a.get()), v, ctx.stream);
  // Travelling fp32 [dK | dV] accumulators, the local fp32 dQ, and one block's gradients.
  const size_t dk_bytes = static_cast<size_t>(s.B * s.L * s.Hk * s.D * 4), dv_bytes = static_cast<size_t>(s.B * s.L * s.Hk * s.Dv * 4);
  void* st = ctx.stream;
  Scratch dkv_a(dev, dk_bytes + dv_bytes, st), dkv_b(dev, dk_bytes + dv_bytes, st);
  Scratch dq_acc_m(dev, static_cast<size_t>(s.B * s.L * s.Hq * s.D * 4), st);
  const int64_t es = dtype_size(q.dtype);
  Scratch dq_part_m(dev, static_cast<size_t>(s.B * s.L * s.Hq * s.D * es), st);
  Scratch dk_part_m(dev, static_cast<size_t>(s.B * s.L * s.Hk * s.D * es), st), dv_part_m(dev, static_cast<size_t>(s.B * s.L * s.Hk * s.Dv * es), st);
  auto dk_view = [&](void* base) { return contiguous(base, DType::f32, {s.B, s.L, s.Hk, s.D}, dev, q.device_index); };
  auto dv_view = [&](void* base) {
    return contiguous(static_cast<char*>(base) + dk_bytes, DType::f32, {s.B, s.L, s.Hk, s.Dv}, dev, q.device_index);
  };
  const TensorView dq_acc = contiguous(dq_acc_m.get(), DType::f32, {s.B, s.L, s.Hq, s.D}, dev, q.device_index);
  detail::dist::fill_f32(dq_acc, 0.0f, ctx.stream);
  detail::dist::fill_f32(dk_view(dkv_a.get()), 0.0f, ctx.stream);
  detail::dist::fill_f32(dv_view(dkv_a.get()), 0.0f, ctx.stream);

  const auto q_chunks = chunks_of(r, P, s.L, layout);
  void* cur = ring.a.get();
  void* nxt = ring.b.get();
  void* dcur = dkv_a.get();
  void* dnxt = dkv_b.get();
  KernelChoice last{"(no block ran)", ""};
  HopInFlight hop{comm, ctx.stream};
  for (int step = 0; step < P; ++step) {
    const int src = (r - step + P) % P;
    if (step + 1 < P) {
      comm.ring_start(cur, nxt, ring.k_bytes + ring.v_bytes, dev, ctx.stream);
      hop.pending = true;
    }
    const TensorView kc = ring.k(cur), vc = ring.v(cur), dkc = dk_view(dcur), dvc = dv_view(dcur);
    for (const Chunk& qc : q_chunks)
      for (const Chunk& kch : chunks_of(src, P, s.L, layout)) {
        const Pair pair = classify(qc, kch, params.causal);
        if (pair == Pair::skip) continue;
        Gradients g;
        g.dq = contiguous(dq_part_m.get(), q.dtype, {s.B, qc.len, s.Hq, s.D}, dev, q.device_index);
        g.dk = contiguous(dk_part_m.get(), q.dtype, {s.B, kch.len, s.Hk, s.D}, dev, q.device_index);
        g.dv = contiguous(dv_part_m.get(), q.dtype, {s.B, kch.len, s.Hk, s.Dv}, dev, q.device_index);
        last = backward(rows(q, 1, qc.offset, qc.len), rows(kc, 1, kch.offset, kch.len),
                        rows(vc, 1, kch.offset, kch.len), rows(o, 1, qc.offset, qc.len),
                        rows(dout, 1, qc.offset, qc.len), rows(lse, 2, qc.offset, qc.len), g,
                        block_params(params, pair), ctx);
        detail::dist::accumulate(rows(dq_acc, 1, qc.offset, qc.len), g.dq, ctx.stream);
        detail::dist::accumulate(rows(dkc, 1, kch.offset, kch.len), g.dk, ctx.stream);
        detail::dist::accumulate(rows(dvc, 1, kch.offset, kch.len), g.dv, ctx.stream);
      }
    if (step + 1 < P) {
      hop.pending = false;
      comm.ring_wait(ctx.stream);
    }
    // The accumulator follows its K/V shard; after the last step this hop brings it home.
    comm.ring_start(dcur, dnxt, dk_bytes + dv_bytes, dev, ctx.stream);
    comm.ring_wait(ctx.stream);
    std::swap(dcur, dnxt);
    if (step + 1 < P) std::swap(cur, nxt);
  }
  detail::dist::convert(grads.dq, dq_acc, ctx.stream);
  detail::dist::convert(grads.dk, dk_view(dcur), ctx.stream);
  detail::dist::convert(grads.dv, dv_view(dcur), ctx.stream);
  detail::dist::synchronize(dev, ctx.stream);
  return {"cp/ring-backward " + std::string(comm.name()) + " P=" + std::to_string(P) + " block: " + last.kernel,
          "K/V rotate again with a travelling fp32 dK/dV accumulator"};
}

std::vector<int64_t> cp_positions(int64_t seqlen, int rank, int size, CpLayout layout) {
  if (size < 1 || rank < 0 || rank >= size)
    fail("rank", "0 <= rank < size = " + std::to_string(size), std::to_string(rank));
  const int64_t parts = layout == CpLayout::zigzag ? 2 * size : size;
  if (seqlen % parts != 0)
    fail("seqlen", "a multiple of " + std::to_string(parts) + " (chunks of one length)", std::to_string(seqlen));
  const int64_t c = seqlen / parts;
  std::vector<int64_t> pos;
  for (const Chunk& ch : chunks_of(rank, size, layout == CpLayout::zigzag ? 2 * c : c, layout))
    for (int64_t i = 0; i < ch.len; ++i) pos.push_back(ch.id * c + i);
  return pos;
}

namespace {
void shard_copy(const TensorView& full, const TensorView& local, int rank, int size, CpLayout layout, bool to_local) {
  if (full.ndim != 4 || local.ndim != 4) fail("full", "4-D [batch, seqlen, heads, dim] views", std::to_string(full.ndim) + " dims");
  if (full.dtype != local.dtype) fail("local.dtype", dtype_name(full.dtype), dtype_name(local.dtype));
  if (full.device != local.device || full.device_index != local.device_index)
    fail("local.device", std::string(device_name(full.device)) + ":" + std::to_string(full.device_index) + " (as full)",
         std::string(device_name(local.device)) + ":" + std::to_string(local.device_index));
  const int64_t parts = layout == CpLayout::zigzag ? 2 * size : size;
  if (full.shape[1] % parts != 0)
    fail("full.shape[1]", "a multiple of " + std::to_string(parts), std::to_string(full.shape[1]));
  if (local.shape[1] != full.shape[1] / size)
    fail("local.shape[1]", std::to_string(full.shape[1] / size), std::to_string(local.shape[1]));
  const int64_t c = full.shape[1] / parts;
  std::optional<detail::CudaDeviceGuard> on;
  if (full.device == Device::cuda) on.emplace(full.device_index);
  for (const Chunk& ch : chunks_of(rank, size, local.shape[1], layout)) {
    const TensorView f = rows(full, 1, ch.id * c, ch.len), l = rows(local, 1, ch.offset, ch.len);
    if (to_local)
      detail::dist::copy(l, f, nullptr);
    else
      detail::dist::copy(f, l, nullptr);
  }
  detail::dist::synchronize(full.device, nullptr);
}
}  // namespace

void cp_shard(const TensorView& full, const TensorView& local, int rank, int size, CpLayout layout) {
  shard_copy(full, local, rank, size, layout, true);
}
void cp_unshard(const TensorView& local, const TensorView& full, int rank, int size, CpLayout layout) {
  shard_copy(full, local, rank, size, layout, false);
}

}  // namespace ioattn

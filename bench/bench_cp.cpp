// Context-parallel (ring attention) benchmark: time per rank against the ideal (single-device
// time / P), per layout, forward and forward+backward, plus a model of the ring's communication
// for P GPUs over NVLink.
//
//   ioattn_bench_cp [--device cpu|cuda] [--seqlen 32768] [--ranks 2,4,8] [--heads 16] [--heads-kv 16]
//                   [--head-dim 128] [--dtype bf16] [--causal 1] [--repeats 3] [--link-gbps 360]
//
// One device stands in for P: rank r of P is timed alone with a self-ring communicator (each hop
// copies the rank's own K/V buffer into the receive buffer on the same device, so the data is
// wrong but the work is exact: which blocks run and which are skipped depends only on the chunk
// ids). The slowest rank sets the pace of a real ring, so efficiency = (T1 / P) / max_r T_r, where
// T1 is the single-device call on the whole sequence. Zigzag balances causal work; contiguous
// does not. The communication model: each of the P - 1 hops (forward) moves the K/V shard,
// B * (S/P) * Hkv * (D + Dv) * elem bytes, to the next rank; the backward moves K/V again plus
// the fp32 dK/dV accumulator (P hops). A hop is hidden when the compute of one step (T_r / P)
// takes longer than the hop at the link's bandwidth (--link-gbps: the per-direction NCCL
// send/recv rate over NVLink; ~360 GB/s measured by others on H100/H200 8-GPU hosts).
// Output: one JSON line per (P, layout, pass), then a table.
//
// --nccl 1: real ranks instead of the stand-in. Rank r runs on GPU r (P <= visible GPUs), one
// thread each, through make_nccl_group (NVLink multicast off: NCCL_NVLS_ENABLE=0). Every
// (P, layout) runs twice: with overlap (the hop on the communicator's stream under the step's
// block computation, the library's behaviour) and without (each hop waited for before the step's
// compute starts). Times are per call, the slowest rank's, median over --repeats; the ideal is
// the single-GPU call on the whole sequence (GPU 0) / P. The hop is measured alone too (K/V
// shard around the ring, median), giving the link's achieved GB/s.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/backends.hpp"
#include "core/harness.hpp"
#include "dist/ops.hpp"
#include "ioattn/context_parallel.hpp"

namespace {

using namespace ioattn;
using detail::Buffer;

// Rank `rank` of `size` alone: every hop copies send -> recv on the same device.
class SelfRing final : public Communicator {
 public:
  SelfRing(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "self-ring"; }
  void ring_start(const void* send, void* recv, size_t bytes, Device device, void* stream) override {
    detail::dist::copy_bytes(device, recv, send, bytes, stream);
  }
  void ring_wait(void*) override {}

 private:
  int rank_, size_;
};

// The same ring with every hop waited for at once: the step's compute cannot overlap it.
class Serialized final : public Communicator {
 public:
  explicit Serialized(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const char* name() const override { return "serialized"; }
  void ring_start(const void* send, void* recv, size_t bytes, Device device, void* stream) override {
    inner_.ring_start(send, recv, bytes, device, stream);
    inner_.ring_wait(stream);
  }
  void ring_wait(void*) override {}

 private:
  Communicator& inner_;
};

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    v.push_back(std::stoll(s.substr(i, j - i)));
    i = j + 1;
  }
  return v;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
double median_s(int repeats, Device dev, F f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    if (dev == Device::cuda) detail::cuda_synchronize();
    const double t0 = now_s();
    f();
    if (dev == Device::cuda) detail::cuda_synchronize();
    t.push_back(now_s() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}


struct NcclResult {
  double fwd_s = 0, fwd_bwd_s = 0, hop_s = 0;
};

// P real ranks, GPU r for rank r: the slowest rank's median fwd and fwd+bwd time, and one K/V
// hop alone. Shards are cut on the host from the full tensors' host copies.
NcclResult run_nccl(int P, CpLayout layout, bool overlap, bool have_bwd, int repeats, Buffer& q, Buffer& k, Buffer& v,
                    Buffer& dout, int64_t B, int64_t S, int64_t Hq, int64_t Hk, int64_t D, DType dt,
                    const AttnParams& prm) {
  std::vector<int> devices(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) devices[static_cast<size_t>(r)] = r;
  auto group = make_nccl_group(devices);
  const int64_t L = S / P;
  detail::dist::Barrier barrier(P);
  std::vector<std::vector<double>> tf(static_cast<size_t>(P)), tfb(static_cast<size_t>(P)), th(static_cast<size_t>(P));
  auto host_view = [](Buffer& b, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(b.host(), b.dtype(), shape, Device::cpu);
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      const auto ru = static_cast<size_t>(r);
      try {
        detail::cuda_set_device(r);
        Communicator& nccl = *group[ru];
        Serialized serial(nccl);
        Communicator& comm = overlap ? nccl : static_cast<Communicator&>(serial);
        auto local = [&](int64_t h) { return Buffer(dt, B * L * h * D, Device::cuda); };
        Buffer lq = local(Hq), lk = local(Hk), lv = local(Hk), ldo = local(Hq), lo = local(Hq), ldq = local(Hq),
               ldk = local(Hk), ldv = local(Hk), llse(DType::f32, B * Hq * L, Device::cuda);
        for (auto [l, f, h] : {std::tuple{&lq, &q, Hq}, {&lk, &k, Hk}, {&lv, &v, Hk}, {&ldo, &dout, Hq}}) {
          cp_shard(host_view(*f, {B, S, h, D}), host_view(*l, {B, L, h, D}), r, P, layout);
          l->upload();
        }
        auto view = [&](Buffer& b, std::initializer_list<int64_t> shape) {
          TensorView t = b.view(shape);
          t.device_index = r;
          return t;
        };
        const TensorView vq = view(lq, {B, L, Hq, D}), vk = view(lk, {B, L, Hk, D}), vv = view(lv, {B, L, Hk, D}),
                         vo = view(lo, {B, L, Hq, D}), vdo = view(ldo, {B, L, Hq, D}), vlse = view(llse, {B, Hq, L});
        const Gradients g{view(ldq, {B, L, Hq, D}), view(ldk, {B, L, Hk, D}), view(ldv, {B, L, Hk, D}), {}};
        Context ctx;  // the device's default stream
        auto fwd = [&] { cp_forward(comm, vq, vk, vv, vo, vlse, prm, layout, ctx); };
        auto bwd = [&] { cp_backward(comm, vq, vk, vv, vo, vdo, vlse, g, prm, layout, ctx); };
        const size_t hop_bytes = static_cast<size_t>(B * L * Hk * 2 * D * dtype_size(dt));
        Buffer hop_a(DType::i8, static_cast<int64_t>(hop_bytes), Device::cuda),
            hop_b(DType::i8, static_cast<int64_t>(hop_bytes), Device::cuda);
        auto hop = [&] {
          nccl.ring_start(hop_a.data(), hop_b.data(), hop_bytes, Device::cuda, nullptr);
          nccl.ring_wait(nullptr);
          detail::cuda_synchronize();
        };
        fwd();  // warm-up (NCCL connections, scratch pools)
        if (have_bwd) bwd();
        hop();
        for (int i = 0; i < repeats; ++i) {
          barrier.wait();
          double t0 = now_s();
          hop();
          th[ru].push_back(now_s() - t0);
          barrier.wait();
          t0 = now_s();
          fwd();
          const double t1 = now_s();
          if (have_bwd) bwd();
          const double t2 = now_s();
          tf[ru].push_back(t1 - t0);
          tfb[ru].push_back(t2 - t0);
        }
        barrier.wait();
      } catch (const std::exception& e) {
        // The other ranks would wait forever at the next barrier or hop: end the process.
        std::fprintf(stderr, "ioattn_bench_cp: rank %d: %s\n", r, e.what());
        std::fflush(stderr);
        std::abort();
      }
    });
  for (auto& t : threads) t.join();
  // Per repeat the slowest rank, then the median over repeats.
  auto worst_median = [&](const std::vector<std::vector<double>>& t) {
    std::vector<double> w(static_cast<size_t>(repeats), 0.0);
    for (const auto& rank : t)
      for (size_t i = 0; i < rank.size(); ++i) w[i] = std::max(w[i], rank[i]);
    std::sort(w.begin(), w.end());
    return w[w.size() / 2];
  };
  return {worst_median(tf), worst_median(tfb), worst_median(th)};
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "cuda", dtype_s = "bf16", ranks_s = "2,4,8";
  int64_t S = 32768, Hq = 16, Hk = 16, D = 128, B = 1;
  bool causal = true;
  int repeats = 3;
  double link_gbps = 360;
  bool nccl = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--device") device = v;
    else if (a == "--seqlen") S = std::stoll(v);
    else if (a == "--ranks") ranks_s = v;
    else if (a == "--heads") Hq = std::stoll(v);
    else if (a == "--heads-kv") Hk = std::stoll(v);
    else if (a == "--head-dim") D = std::stoll(v);
    else if (a == "--batch") B = std::stoll(v);
    else if (a == "--dtype") dtype_s = v;
    else if (a == "--causal") causal = v != "0";
    else if (a == "--repeats") repeats = std::atoi(v.c_str());
    else if (a == "--link-gbps") link_gbps = std::atof(v.c_str());
    else if (a == "--nccl") nccl = v != "0";
    else {
      std::fprintf(stderr, "ioattn_bench_cp: unknown option %s (see the comment at the top of bench_cp.cpp)\n", a.c_str());
      return 2;
    }
  }
  const Device dev = device == "cpu" ? Device::cpu : Device::cuda;
  if (nccl && dev != Device::cuda) {
    std::fprintf(stderr, "ioattn_bench_cp: --nccl 1 needs --device cuda\n");
    return 2;
  }
  if (nccl && !nccl_compiled()) {
    std::fprintf(stderr, "ioattn_bench_cp: --nccl 1 needs a build with NCCL (this one has none)\n");
    return 2;
  }
  if (repeats < 1) {
    std::fprintf(stderr, "ioattn_bench_cp: --repeats must be >= 1, got %d\n", repeats);
    return 2;
  }
  if (nccl) setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast on a shared host
  const DType dt = dtype_s == "f32" ? DType::f32 : dtype_s == "f16" ? DType::f16 : DType::bf16;
  if (dev == Device::cuda && detail::cuda_device_count() == 0) {
    std::fprintf(stderr, "ioattn_bench_cp: no CUDA device (use --device cpu)\n");
    return 2;
  }
  try {
    std::mt19937_64 rng(3);
    AttnParams prm;
    prm.causal = causal;
    Context ctx;
    const int64_t es = dtype_size(dt);
    // Single device on the whole sequence.
    Buffer q(dt, B * S * Hq * D, dev), k(dt, B * S * Hk * D, dev), v(dt, B * S * Hk * D, dev),
        dout(dt, B * S * Hq * D, dev), o(dt, B * S * Hq * D, dev), lse(DType::f32, B * Hq * S, dev),
        dq(dt, B * S * Hq * D, dev), dk(dt, B * S * Hk * D, dev), dv(dt, B * S * Hk * D, dev);
    for (Buffer* b : {&q, &k, &v, &dout}) b->fill_random(rng);
    auto fwd1 = [&] { forward(q.view({B, S, Hq, D}), k.view({B, S, Hk, D}), v.view({B, S, Hk, D}), o.view({B, S, Hq, D}),
                              lse.view({B, Hq, S}), prm, ctx); };
    const Gradients g1{dq.view({B, S, Hq, D}), dk.view({B, S, Hk, D}), dv.view({B, S, Hk, D}), {}};
    auto bwd1 = [&] { backward(q.view({B, S, Hq, D}), k.view({B, S, Hk, D}), v.view({B, S, Hk, D}), o.view({B, S, Hq, D}),
                               dout.view({B, S, Hq, D}), lse.view({B, Hq, S}), g1, prm, ctx); };
    const double t1_fwd = median_s(repeats, dev, fwd1);
    bool have_bwd = true;
    double t1_bwd = 0;
    try {
      t1_bwd = median_s(repeats, dev, bwd1);
    } catch (const Error& e) {
      have_bwd = false;
      std::fprintf(stderr, "# backward not timed: %s\n", e.what());
    }
    std::printf("{\"bench\": \"cp\", \"device\": \"%s\", \"P\": 1, \"seqlen\": %lld, \"heads\": %lld, \"heads_kv\": %lld, "
                "\"head_dim\": %lld, \"dtype\": \"%s\", \"causal\": %d, \"fwd_ms\": %.4f, \"fwd_bwd_ms\": %.4f}\n",
                device.c_str(), (long long)S, (long long)Hq, (long long)Hk, (long long)D, dtype_s.c_str(), causal,
                t1_fwd * 1e3, have_bwd ? (t1_fwd + t1_bwd) * 1e3 : -1.0);
    std::fflush(stdout);

    if (nccl) {
      const int visible = detail::cuda_device_count();
      std::printf("\n## ring attention over NCCL, %d GPUs visible, %s S=%lld heads %lld/%lld hdim %lld %s: GPU 0 alone fwd %.3f ms",
                  visible, dtype_s.c_str(), (long long)S, (long long)Hq, (long long)Hk, (long long)D,
                  causal ? "causal" : "non-causal", t1_fwd * 1e3);
      if (have_bwd) std::printf(", fwd+bwd %.3f ms", (t1_fwd + t1_bwd) * 1e3);
      std::printf("\n| P | layout | overlap | tokens/rank | fwd ms (slowest rank) | ideal ms | fwd eff | fwd+bwd ms | ideal ms | fwd+bwd eff | K/V hop ms | hop GB/s |\n");
      std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
      for (int64_t P64 : parse_list(ranks_s)) {
        const int P = static_cast<int>(P64);
        if (P < 2 || P > visible) {
          std::printf("| %d | skipped: needs %d GPUs, %d visible |\n", P, P, visible);
          continue;
        }
        for (CpLayout layout : {CpLayout::contiguous, CpLayout::zigzag}) {
          const char* lname = layout == CpLayout::zigzag ? "zigzag" : "contiguous";
          if (S % (layout == CpLayout::zigzag ? 2 * P : P) != 0) continue;
          for (bool overlap : {true, false}) {
            const NcclResult r = run_nccl(P, layout, overlap, have_bwd, repeats, q, k, v, dout, B, S, Hq, Hk, D, dt, prm);
            const double hop_bytes = static_cast<double>(B * (S / P) * Hk * 2 * D * es);
            const double ideal_f = t1_fwd / P, ideal_fb = (t1_fwd + t1_bwd) / P;
            std::printf("{\"bench\": \"cp_nccl\", \"P\": %d, \"layout\": \"%s\", \"overlap\": %d, \"seqlen\": %lld, "
                        "\"tokens_per_rank\": %lld, \"causal\": %d, \"fwd_ms\": %.4f, \"fwd_ideal_ms\": %.4f, "
                        "\"fwd_efficiency\": %.3f, \"fwd_bwd_ms\": %.4f, \"fwd_bwd_ideal_ms\": %.4f, "
                        "\"fwd_bwd_efficiency\": %.3f, \"hop_bytes\": %.0f, \"hop_ms\": %.4f, \"hop_gbps\": %.1f}\n",
                        P, lname, overlap, (long long)S, (long long)(S / P), causal, r.fwd_s * 1e3, ideal_f * 1e3,
                        ideal_f / r.fwd_s, r.fwd_bwd_s * 1e3, ideal_fb * 1e3, have_bwd ? ideal_fb / r.fwd_bwd_s : 0.0,
                        hop_bytes, r.hop_s * 1e3, hop_bytes / r.hop_s / 1e9);
            std::printf("| %d | %s | %s | %lld | %.3f | %.3f | %.2f | %.3f | %.3f | %.2f | %.3f | %.0f |\n", P, lname,
                        overlap ? "yes" : "no", (long long)(S / P), r.fwd_s * 1e3, ideal_f * 1e3, ideal_f / r.fwd_s,
                        r.fwd_bwd_s * 1e3, ideal_fb * 1e3, have_bwd ? ideal_fb / r.fwd_bwd_s : 0.0, r.hop_s * 1e3,
                        hop_bytes / r.hop_s / 1e9);
            std::fflush(stdout);
          }
        }
      }
      return 0;
    }

    struct Row {
      int P;
      std::string layout;
      double worst_fwd, best_fwd, worst_fb, eff_fwd, eff_fb, hop_fwd_ms, hop_bwd_ms;
    };
    std::vector<Row> table;
    for (int64_t P64 : parse_list(ranks_s)) {
      const int P = static_cast<int>(P64);
      for (CpLayout layout : {CpLayout::contiguous, CpLayout::zigzag}) {
        const char* lname = layout == CpLayout::zigzag ? "zigzag" : "contiguous";
        const int64_t parts = layout == CpLayout::zigzag ? 2 * P : P;
        if (S % parts != 0) continue;
        const int64_t L = S / P;
        Buffer lq(dt, B * L * Hq * D, dev), lk(dt, B * L * Hk * D, dev), lv(dt, B * L * Hk * D, dev),
            ldo(dt, B * L * Hq * D, dev), lo(dt, B * L * Hq * D, dev), llse(DType::f32, B * Hq * L, dev),
            ldq(dt, B * L * Hq * D, dev), ldk(dt, B * L * Hk * D, dev), ldv(dt, B * L * Hk * D, dev);
        std::vector<double> tf, tb;
        for (int r = 0; r < P; ++r) {
          cp_shard(q.view({B, S, Hq, D}), lq.view({B, L, Hq, D}), r, P, layout);
          cp_shard(k.view({B, S, Hk, D}), lk.view({B, L, Hk, D}), r, P, layout);
          cp_shard(v.view({B, S, Hk, D}), lv.view({B, L, Hk, D}), r, P, layout);
          cp_shard(dout.view({B, S, Hq, D}), ldo.view({B, L, Hq, D}), r, P, layout);
          SelfRing comm(r, P);
          auto f = [&] { cp_forward(comm, lq.view({B, L, Hq, D}), lk.view({B, L, Hk, D}), lv.view({B, L, Hk, D}),
                                    lo.view({B, L, Hq, D}), llse.view({B, Hq, L}), prm, layout, ctx); };
          const Gradients g{ldq.view({B, L, Hq, D}), ldk.view({B, L, Hk, D}), ldv.view({B, L, Hk, D}), {}};
          auto b = [&] { cp_backward(comm, lq.view({B, L, Hq, D}), lk.view({B, L, Hk, D}), lv.view({B, L, Hk, D}),
                                     lo.view({B, L, Hq, D}), ldo.view({B, L, Hq, D}), llse.view({B, Hq, L}), g, prm,
                                     layout, ctx); };
          tf.push_back(median_s(repeats, dev, f));
          tb.push_back(have_bwd ? median_s(repeats, dev, b) : 0.0);
        }
        const double worst_f = *std::max_element(tf.begin(), tf.end());
        const double best_f = *std::min_element(tf.begin(), tf.end());
        double worst_fb = 0;
        for (int r = 0; r < P; ++r) worst_fb = std::max(worst_fb, tf[static_cast<size_t>(r)] + tb[static_cast<size_t>(r)]);
        const double kv_bytes = static_cast<double>(B * L * Hk * 2 * D * es);
        const double acc_bytes = static_cast<double>(B * L * Hk * 2 * D * 4);
        const double hop_f = kv_bytes / (link_gbps * 1e9), hop_b = (kv_bytes + acc_bytes) / (link_gbps * 1e9);
        Row row{P, lname, worst_f, best_f, worst_fb, (t1_fwd / P) / worst_f,
                have_bwd ? ((t1_fwd + t1_bwd) / P) / worst_fb : 0.0, hop_f * 1e3, hop_b * 1e3};
        table.push_back(row);
        std::printf("{\"bench\": \"cp\", \"device\": \"%s\", \"P\": %d, \"layout\": \"%s\", \"seqlen\": %lld, "
                    "\"tokens_per_rank\": %lld, \"causal\": %d, \"fwd_ms_worst_rank\": %.4f, \"fwd_ms_best_rank\": %.4f, "
                    "\"fwd_ideal_ms\": %.4f, \"fwd_efficiency\": %.3f, \"fwd_bwd_ms_worst_rank\": %.4f, "
                    "\"fwd_bwd_ideal_ms\": %.4f, \"fwd_bwd_efficiency\": %.3f, \"hop_bytes_fwd\": %.0f, "
                    "\"hop_bytes_bwd\": %.0f, \"model_hop_ms_fwd\": %.4f, \"model_hop_ms_bwd\": %.4f, "
                    "\"step_compute_ms_fwd\": %.4f, \"link_gbps\": %.0f}\n",
                    device.c_str(), P, lname, (long long)S, (long long)L, causal, worst_f * 1e3, best_f * 1e3,
                    t1_fwd / P * 1e3, row.eff_fwd, worst_fb * 1e3, have_bwd ? (t1_fwd + t1_bwd) / P * 1e3 : -1.0,
                    row.eff_fb, kv_bytes, kv_bytes + acc_bytes, hop_f * 1e3, hop_b * 1e3, worst_f / P * 1e3, link_gbps);
        std::fflush(stdout);
      }
    }
    std::printf("\n## ring attention, %s %s S=%lld heads %lld/%lld hdim %lld %s: single device fwd %.3f ms",
                device.c_str(), dtype_s.c_str(), (long long)S, (long long)Hq, (long long)Hk, (long long)D,
                causal ? "causal" : "non-causal", t1_fwd * 1e3);
    if (have_bwd) std::printf(", fwd+bwd %.3f ms", (t1_fwd + t1_bwd) * 1e3);
    std::printf("\n| P | layout | tokens/rank | fwd worst rank ms | ideal ms | fwd eff | fwd+bwd eff | step ms | hop ms (fwd/bwd @ %.0f GB/s) | hidden? |\n",
                link_gbps);
    std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Row& r : table)
      std::printf("| %d | %s | %lld | %.3f | %.3f | %.2f | %.2f | %.3f | %.3f / %.3f | %s |\n", r.P, r.layout.c_str(),
                  (long long)(S / r.P), r.worst_fwd * 1e3, t1_fwd / r.P * 1e3, r.eff_fwd, r.eff_fb,
                  r.worst_fwd / r.P * 1e3, r.hop_fwd_ms, r.hop_bwd_ms,
                  r.worst_fwd / r.P * 1e3 > r.hop_fwd_ms ? "yes" : "no");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ioattn_bench_cp: %s\n", e.what());
    return 1;
  }
  return 0;
}

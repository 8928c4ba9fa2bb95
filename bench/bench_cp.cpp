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
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
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

}  // namespace

int main(int argc, char** argv) {
  std::string device = "cuda", dtype_s = "bf16", ranks_s = "2,4,8";
  int64_t S = 32768, Hq = 16, Hk = 16, D = 128, B = 1;
  bool causal = true;
  int repeats = 3;
  double link_gbps = 360;
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
    else {
      std::fprintf(stderr, "ioattn_bench_cp: unknown option %s (see the comment at the top of bench_cp.cpp)\n", a.c_str());
      return 2;
    }
  }
  const Device dev = device == "cpu" ? Device::cpu : Device::cuda;
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

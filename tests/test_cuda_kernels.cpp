// CUDA forward kernels (flash mma.sync and naive) against the float64 CPU reference.
//
// Every case draws fresh random inputs, poisons O and LSE with NaN, runs ioattn::forward on
// Device::cuda views, and checks, for every row that belongs to a sequence:
//   max|O - ref64| <= 2 · max|O_emulated - ref64| + 1e-3      (O_emulated: naive attention in the
//   same for LSE (rows with no visible key must be exactly -inf)  input precision, RefPrecision::emulated)
// plus: no NaN anywhere we wrote, and padding columns / rows we must not write still hold NaN.
// Inputs carry NaN in padding (between rows, past the last varlen token), so a kernel that reads
// outside the tensor shows up as NaN in O. Without a GPU every case prints
// "skipped: no CUDA device" (GTEST_SKIP) — never a silent pass.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "core/problem.hpp"
#include "check.hpp"
#include "cpu/reference.hpp"
#include "ioattn/ioattn.hpp"

namespace {

using namespace ioattn;
using detail::FwdProblem;

struct Case {
  std::string name;
  DType dtype = DType::bf16;
  int64_t batch = 1, sq = 1, sk = 1, hq = 1, hkv = 1, d = 64, dv = -1;
  bool causal = false;
  int64_t wl = -1, wr = -1;
  float softcap = 0.f;
  bool alibi = false, sinks = false;
  bool bhsd = false;                     // [b, h, s, d] buffer viewed as [b, s, h, d]
  std::vector<int32_t> lens_q, lens_k;   // varlen when non-empty
  int nan_seq = -1;  // varlen: this sequence's Q / K / V tokens are all NaN; the others must not see it
  Backend backend = Backend::flash;
  int64_t o_pad = 8;  // O's NaN columns per row (2: 4-byte aligned rows, the sm90 epilogue's pair stores)
};

constexpr int64_t kPad = 8;  // NaN-filled elements after each row's head_dim (keeps 16-B alignment)

uint16_t nan_bits(DType t) { return t == DType::bf16 ? 0x7fc0 : 0x7e00; }

// Host buffer of `n` elements in dtype t, every element NaN.
std::vector<uint8_t> nan_buffer(DType t, int64_t n) {
  std::vector<uint8_t> b(static_cast<size_t>(n * dtype_size(t)));
  if (t == DType::f32) {
    const float x = std::numeric_limits<float>::quiet_NaN();
    for (int64_t i = 0; i < n; ++i) std::memcpy(&b[i * 4], &x, 4);
  } else {
    const uint16_t x = nan_bits(t);
    for (int64_t i = 0; i < n; ++i) std::memcpy(&b[i * 2], &x, 2);
  }
  return b;
}

// A tensor living both on the host (for the reference) and the device (for the kernel).
struct Tensor {
  std::vector<uint8_t> host;
  void* dev = nullptr;
  TensorView view;  // device view
  int64_t numel = 0;
  DType dtype = DType::f32;
  ~Tensor() { detail::cuda_free(dev); }
  void upload() { detail::cuda_copy_from_host(dev, host.data(), host.size()); }
  void download() { detail::cuda_copy_to_host(host.data(), dev, host.size()); }
  float at(int64_t i) const { return detail::load_float(host.data(), dtype, i); }
};

// Allocates [rows(seq), heads, dim] with kPad NaN columns per row; fills the real entries.
void make_qkv(Tensor& t, DType dt, int64_t batch, int64_t seq, int64_t heads, int64_t dim, bool varlen, bool bhsd,
              std::mt19937& rng, float amp, bool fill, int64_t pad = kPad) {
  const int64_t dp = dim + pad;
  t.dtype = dt;
  t.numel = (varlen ? 1 : batch) * seq * heads * dp;
  t.host = nan_buffer(dt, t.numel);
  t.dev = detail::cuda_malloc(t.host.size());
  std::uniform_real_distribution<float> u(-amp, amp);
  if (varlen) {
    t.view = TensorView::strided(t.dev, dt, {seq, heads, dim}, {heads * dp, dp, 1}, Device::cuda);
  } else if (bhsd) {
    t.view = TensorView::strided(t.dev, dt, {batch, seq, heads, dim}, {heads * seq * dp, dp, seq * dp, 1},
                                 Device::cuda);
  } else {
    t.view = TensorView::strided(t.dev, dt, {batch, seq, heads, dim}, {seq * heads * dp, heads * dp, dp, 1},
                                 Device::cuda);
  }
  if (!fill) return;
  const int nd = t.view.ndim;
  for (int64_t b = 0; b < (varlen ? 1 : batch); ++b)
    for (int64_t s = 0; s < seq; ++s)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t x = 0; x < dim; ++x) {
          const int64_t idx = varlen ? s * t.view.stride[0] + h * t.view.stride[1] + x
                                     : b * t.view.stride[0] + s * t.view.stride[1] + h * t.view.stride[2] + x;
          (void)nd;
          detail::store_float(t.host.data(), dt, idx, u(rng));
        }
}

void run_case(const Case& c, uint32_t seed) {
  if (detail::cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA device";
  // O rows 4-byte aligned only: the sm90 kernels' element-pair stores (their 16-byte stores need
  // 16-byte rows); the mma.sync kernel refuses such an O, so other GPUs have no kernel for it.
  if (c.o_pad % 8 != 0 && detail::cuda_device_arch(0) != 90) GTEST_SKIP() << "sm90 only: O rows 4-byte aligned";
  if (const char* l = std::getenv("IOATTN_SM90_LOCAL"); c.o_pad % 8 != 0 && l != nullptr && *l == '0' &&
                                                         (!c.lens_q.empty() || c.wl >= 0 || c.wr >= 0))
    GTEST_SKIP() << "kLocal rows off (IOATTN_SM90_LOCAL=0) and mma.sync refuses 4-byte O rows";
  SCOPED_TRACE(c.name);
  std::mt19937 rng(seed);
  const bool varlen = !c.lens_q.empty();
  const int64_t dv = c.dv < 0 ? c.d : c.dv;
  const DType dt = c.dtype;

  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (int32_t x : c.lens_q) cu_q.push_back(cu_q.back() + x);
  for (int32_t x : c.lens_k) cu_k.push_back(cu_k.back() + x);
  const int64_t batch = varlen ? static_cast<int64_t>(c.lens_q.size()) : c.batch;
  // Varlen tensors get 3 NaN tokens past the last sequence: nothing may read or write them.
  const int64_t rows_q = varlen ? cu_q.back() + 3 : c.sq, rows_k = varlen ? cu_k.back() + 3 : c.sk;

  Tensor q, k, v, o, lse, slopes, sinks, cuq, cuk;
  make_qkv(q, dt, batch, rows_q, c.hq, c.d, varlen, c.bhsd, rng, 2.0f, true);
  make_qkv(k, dt, batch, rows_k, c.hkv, c.d, varlen, c.bhsd, rng, 1.0f, true);
  make_qkv(v, dt, batch, rows_k, c.hkv, dv, varlen, c.bhsd, rng, 1.0f, true);
  make_qkv(o, dt, batch, rows_q, c.hq, dv, varlen, c.bhsd, rng, 1.0f, false, c.o_pad);
  if (varlen) {  // the 3 tail tokens stay NaN in q/k/v
    for (Tensor* t : {&q, &k, &v}) {
      const int64_t total = t == &q ? cu_q.back() : cu_k.back();
      const auto nb = nan_buffer(dt, (t->view.shape[0] - total) * t->view.stride[0]);
      std::memcpy(t->host.data() + total * t->view.stride[0] * dtype_size(dt), nb.data(), nb.size());
    }
    if (c.nan_seq >= 0)  // a sequence of NaN tokens between finite ones (only its own rows may be NaN)
      for (Tensor* t : {&q, &k, &v}) {
        const auto& cu = t == &q ? cu_q : cu_k;
        const int64_t row_bytes = t->view.stride[0] * dtype_size(dt);
        const auto nb = nan_buffer(dt, (cu[c.nan_seq + 1] - cu[c.nan_seq]) * t->view.stride[0]);
        std::memcpy(t->host.data() + cu[c.nan_seq] * row_bytes, nb.data(), nb.size());
      }
  }
  q.upload(), k.upload(), v.upload(), o.upload();

  // LSE [b, h, sq] (varlen [h, total_q]) poisoned with NaN.
  lse.dtype = DType::f32;
  lse.numel = varlen ? c.hq * rows_q : batch * c.hq * c.sq;
  lse.host = nan_buffer(DType::f32, lse.numel);
  lse.dev = detail::cuda_malloc(lse.host.size());
  lse.upload();
  lse.view = varlen ? TensorView::contiguous(lse.dev, DType::f32, {c.hq, rows_q}, Device::cuda)
                    : TensorView::contiguous(lse.dev, DType::f32, {batch, c.hq, c.sq}, Device::cuda);

  AttnParams prm;
  prm.causal = c.causal;
  prm.window_left = c.wl;
  prm.window_right = c.wr;
  prm.softcap = c.softcap;
  std::vector<float> h_slopes(c.hq), h_sinks(c.hq);
  std::uniform_real_distribution<float> us(0.0f, 0.5f), uk(-1.f, 3.f);
  for (auto& x : h_slopes) x = us(rng);
  for (auto& x : h_sinks) x = uk(rng);
  auto head_vec = [&](Tensor& t, const std::vector<float>& h) {
    t.dtype = DType::f32;
    t.host.resize(h.size() * 4);
    std::memcpy(t.host.data(), h.data(), t.host.size());
    t.dev = detail::cuda_malloc(t.host.size());
    t.upload();
    t.view = TensorView::contiguous(t.dev, DType::f32, {c.hq}, Device::cuda);
  };
  if (c.alibi) head_vec(slopes, h_slopes), prm.alibi_slopes = slopes.view;
  if (c.sinks) head_vec(sinks, h_sinks), prm.sinks = sinks.view;

  Context ctx;
  ctx.backend = c.backend;
  KernelChoice kc;
  if (varlen) {
    auto cu = [&](Tensor& t, const std::vector<int32_t>& h) {
      t.dtype = DType::i32;
      t.host.resize(h.size() * 4);
      std::memcpy(t.host.data(), h.data(), t.host.size());
      t.dev = detail::cuda_malloc(t.host.size());
      t.upload();
      t.view = TensorView::contiguous(t.dev, DType::i32, {static_cast<int64_t>(h.size())}, Device::cuda);
    };
    cu(cuq, cu_q), cu(cuk, cu_k);
    Varlen vl;
    vl.cu_seqlens_q = cuq.view;
    vl.cu_seqlens_k = cuk.view;
    kc = forward_varlen(q.view, k.view, v.view, o.view, lse.view, vl, prm, ctx);
  } else {
    kc = forward(q.view, k.view, v.view, o.view, lse.view, prm, ctx);
  }
  detail::cuda_synchronize();
  if (c.backend == Backend::flash) {
    EXPECT_NE(kc.kernel.find("cuda/flash"), std::string::npos) << kc.kernel;
    if (c.o_pad % 8 != 0) EXPECT_NE(kc.kernel.find("wgmma"), std::string::npos) << kc.kernel;
    // sm90 takes the wgmma/TMA kernel where its table fits, the mma.sync kernel elsewhere.
    EXPECT_TRUE(kc.kernel.find("mma.sync") != std::string::npos || kc.kernel.find("wgmma") != std::string::npos)
        << kc.kernel;
    // The sm90 kLocal rows (sliding windows, sinks, ...): the local_* cases run there unless
    // IOATTN_SM90_LOCAL=0 (ctest cuda_kernels_mma_local), which sends them to mma.sync.
    const char* local = std::getenv("IOATTN_SM90_LOCAL");
    const bool local_off = local != nullptr && *local == '0';
    if (c.name.rfind("local_", 0) == 0 && detail::cuda_device_arch(0) == 90) {
      if (local_off)
        EXPECT_NE(kc.kernel.find("mma.sync"), std::string::npos) << kc.kernel;
      else
        EXPECT_NE(kc.kernel.find(" local"), std::string::npos) << kc.kernel;
    }
    // Q K^T with Q in registers: the plain hdim-128 causal problems on the sm90 kernel run it by
    // default, none with IOATTN_SM90_QREGS=0 (ctest cuda_kernels_sm90_noqregs).
    const char* qregs = std::getenv("IOATTN_SM90_QREGS");
    const bool qregs_off = qregs != nullptr && *qregs != '\0' && *qregs != '1';  // as the library reads it
    const auto has = [&](const char* x) { return kc.kernel.find(x) != std::string::npos; };
    const bool plain = has("wgmma") && !has(" local") && !has("f8e4m3");
    if (plain) {
      const bool v3 = has("(v3 body)");
      if (has("hdim128 causal") && !v3) EXPECT_EQ(has(" qregs"), !qregs_off) << kc.kernel;
      // A tile's arithmetic does not depend on which CTA runs it: bit for bit the same O and LSE on
      // 3 persistent CTAs (every CTA walks many tiles, the ring and the tile slot carried across
      // them; some rounds skip). IOATTN_SM90_MAX_CTAS caps only a persistent grid.
      if (!varlen && has(" persistent") && std::getenv("IOATTN_SM90_MAX_CTAS") == nullptr) {
        std::mt19937 rng2(seed + 1);
        Tensor o2, lse2;
        make_qkv(o2, dt, batch, rows_q, c.hq, dv, varlen, c.bhsd, rng2, 1.0f, false, c.o_pad);
        o2.upload();
        lse2.dtype = DType::f32;
        lse2.numel = lse.numel;
        lse2.host = nan_buffer(DType::f32, lse2.numel);
        lse2.dev = detail::cuda_malloc(lse2.host.size());
        lse2.upload();
        lse2.view = TensorView::contiguous(lse2.dev, DType::f32, {batch, c.hq, c.sq}, Device::cuda);
        KernelChoice kx;
        {
          test::ScopedEnv e("IOATTN_SM90_MAX_CTAS", "3");
          kx = forward(q.view, k.view, v.view, o2.view, lse2.view, prm, ctx);
        }
        detail::cuda_synchronize();
        EXPECT_EQ(kx.kernel, kc.kernel);  // the cap changes the grid, nothing else
        Tensor* pairs[2][2] = {{&o, &o2}, {&lse, &lse2}};
        for (auto& pr : pairs) {
          pr[0]->download(), pr[1]->download();
          EXPECT_EQ(std::memcmp(pr[0]->host.data(), pr[1]->host.data(), pr[0]->host.size()), 0)
              << (pr[0] == &o ? "O" : "LSE") << " of " << kx.kernel << " on 3 CTAs differs from the full grid's";
        }
      }
    }
  }
  o.download();
  lse.download();

  // The same problem on host memory for the reference.
  FwdProblem p;
  auto s3 = [&](const TensorView& t) {
    detail::Strides3 s;
    if (varlen) {
      s.seq = t.stride[0], s.head = t.stride[1];
    } else {
      s.batch = t.stride[0], s.seq = t.stride[1], s.head = t.stride[2];
    }
    return s;
  };
  p.q = q.host.data(), p.k = k.host.data(), p.v = v.host.data();
  p.q_stride = s3(q.view), p.k_stride = s3(k.view), p.v_stride = s3(v.view), p.o_stride = s3(o.view);
  p.dtype = dt;
  p.batch = batch;
  p.heads_q = c.hq, p.heads_kv = c.hkv;
  p.head_dim = c.d, p.head_dim_v = dv;
  if (varlen) {
    int64_t mq = 0, mk = 0;
    for (size_t i = 0; i < c.lens_q.size(); ++i) mq = std::max<int64_t>(mq, c.lens_q[i]), mk = std::max<int64_t>(mk, c.lens_k[i]);
    p.seqlen_q = mq, p.seqlen_k = mk;
    p.cu_seqlens_q = cu_q.data(), p.cu_seqlens_k = cu_k.data();  // non-null marks varlen
    p.cu_seqlens_q_host = cu_q.data(), p.cu_seqlens_k_host = cu_k.data();
  } else {
    p.seqlen_q = c.sq, p.seqlen_k = c.sk;
  }
  p.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  p.softcap = c.softcap;
  p.causal = c.causal;
  p.window_left = c.wl;
  p.window_right = c.causal ? 0 : c.wr;
  p.alibi_slopes = c.alibi ? h_slopes.data() : nullptr;
  p.sinks = c.sinks ? h_sinks.data() : nullptr;
  const auto ref = detail::reference_forward(p, detail::RefPrecision::f64, varlen ? rows_q : -1);
  const auto emu = detail::reference_forward(p, detail::RefPrecision::emulated, varlen ? rows_q : -1);

  double err_o = 0, err_o_emu = 0, err_l = 0, err_l_emu = 0;
  int64_t nan_o = 0, nan_l = 0, pad_written = 0, ninf_mismatch = 0, rows_checked = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (b == c.nan_seq) continue;  // NaN in, NaN out; what matters is that no other sequence is
    const int64_t q0 = varlen ? cu_q[b] : 0, sq = varlen ? cu_q[b + 1] - cu_q[b] : c.sq;
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t h = 0; h < c.hq; ++h) {
        const int64_t row = varlen ? q0 + i : b * sq + i;
        const int64_t obase = b * p.o_stride.batch + (q0 + i) * p.o_stride.seq + h * p.o_stride.head;
        for (int64_t x = 0; x < dv + c.o_pad; ++x) {
          const float got = o.at(obase + x);
          if (x >= dv) {
            pad_written += !std::isnan(got);
            continue;
          }
          const double r = ref.o[(row * c.hq + h) * dv + x], e = emu.o[(row * c.hq + h) * dv + x];
          if (std::isnan(got)) {
            ++nan_o;
            continue;
          }
          err_o = std::max(err_o, std::fabs(got - r));
          err_o_emu = std::max(err_o_emu, std::fabs(e - r));
        }
        const int64_t li = varlen ? h * rows_q + row : (b * c.hq + h) * sq + i;
        const float got = lse.host.empty() ? 0.f : reinterpret_cast<const float*>(lse.host.data())[li];
        const double r = ref.lse[li], e = emu.lse[li];
        if (std::isnan(got)) {
          ++nan_l;
        } else if (std::isinf(r) || std::isinf(got)) {
          ninf_mismatch += !(std::isinf(r) && std::isinf(got) && r < 0 && got < 0);
        } else {
          err_l = std::max(err_l, std::fabs(got - r));
          err_l_emu = std::max(err_l_emu, std::isinf(e) ? 0.0 : std::fabs(e - r));
        }
        ++rows_checked;
      }
  }
  // Varlen: tail rows past cu_seqlens_q[batch] must be untouched.
  int64_t tail_written = 0;
  if (varlen)
    for (int64_t row = cu_q.back(); row < rows_q; ++row)
      for (int64_t h = 0; h < c.hq; ++h) {
        for (int64_t x = 0; x < dv; ++x) tail_written += !std::isnan(o.at(row * o.view.stride[0] + h * o.view.stride[1] + x));
        tail_written += !std::isnan(reinterpret_cast<const float*>(lse.host.data())[h * rows_q + row]);
      }
  EXPECT_EQ(nan_o, 0) << "O elements left unwritten or NaN";
  EXPECT_EQ(nan_l, 0) << "LSE entries left unwritten or NaN";
  EXPECT_EQ(pad_written, 0) << "O padding columns were written";
  EXPECT_EQ(tail_written, 0) << "varlen tail rows were written";
  EXPECT_EQ(ninf_mismatch, 0) << "rows with no visible key must have LSE = -inf exactly";
  EXPECT_LE(err_o, 2 * err_o_emu + 1e-3) << "O error " << err_o << " vs emulated " << err_o_emu;
  EXPECT_LE(err_l, 2 * err_l_emu + 1e-3) << "LSE error " << err_l << " vs emulated " << err_l_emu;
  std::printf("  %-40s %-70s rows %6lld  O err %.2e (emu %.2e)  LSE err %.2e (emu %.2e)\n", c.name.c_str(),
              kc.kernel.substr(0, 70).c_str(), static_cast<long long>(rows_checked), err_o, err_o_emu, err_l,
              err_l_emu);
}

Case mk(std::string name, DType dt, int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hkv, int64_t d) {
  Case c;
  c.name = std::move(name);
  c.dtype = dt, c.batch = b, c.sq = sq, c.sk = sk, c.hq = hq, c.hkv = hkv, c.d = d;
  return c;
}

std::vector<Case> flash_cases() {
  std::vector<Case> v;
  const DType bf = DType::bf16, hf = DType::f16;
  v.push_back(mk("one_token", bf, 1, 1, 1, 1, 1, 64));
  v.push_back(mk("seq17_f16", hf, 2, 17, 17, 3, 3, 128));
  {
    Case c = mk("113x203_causal_gqa2", bf, 1, 113, 203, 4, 2, 64);
    c.causal = true;
    v.push_back(c);
  }
  {
    Case c = mk("203x113_causal_empty_rows", hf, 2, 203, 113, 2, 1, 128);
    c.causal = true;
    v.push_back(c);
  }
  v.push_back(mk("1023x1024", bf, 1, 1023, 1024, 2, 2, 128));
  {
    Case c = mk("1023x1024_causal_f16", hf, 1, 1023, 1024, 2, 2, 128);
    c.causal = true;
    v.push_back(c);
  }
  {
    Case c = mk("gqa4_causal", bf, 2, 300, 300, 8, 2, 128);
    c.causal = true;
    v.push_back(c);
  }
  v.push_back(mk("gqa8_77x500_f16", hf, 1, 77, 500, 8, 1, 64));
  // hdim 128 without a mask, many 128-row tiles (the persistent grid carries state from tile to
  // tile): a partial last key block of one key, and one key block.
  v.push_back(mk("tiles_700x353_gqa2", bf, 3, 700, 353, 4, 2, 128));
  v.push_back(mk("tiles_300x100_f16", hf, 2, 300, 100, 6, 3, 128));
  // ... hdim 256 without a mask; hdim 64 causal (3 warpgroups, 192-row tiles); and causal tiles
  // with no visible key (bottom-right: rows < 350 of 450 see none) between ones with keys.
  v.push_back(mk("tiles_hdim256_300x257", bf, 2, 300, 257, 4, 2, 256));
  {
    Case c = mk("tiles_hdim64_700x700_causal_f16", hf, 1, 700, 700, 4, 4, 64);
    c.causal = true;
    v.push_back(c);
  }
  for (int64_t d : {64, 128, 256}) {
    Case c = mk("tiles_causal_empty_450x100_hdim" + std::to_string(d), bf, 2, 450, 100, 4, 2, d);
    c.causal = true;
    v.push_back(c);
  }
  for (int64_t d : {32, 64, 96, 128, 192, 256})
    for (DType dt : {bf, hf}) {
      Case c = mk("hdim" + std::to_string(d) + (dt == bf ? "_bf16" : "_f16"), dt, 1, 150, 170, 2, 1, d);
      c.causal = d % 64 == 0;
      v.push_back(c);
    }
  for (int64_t d : {8, 40, 72, 200}) {
    Case c = mk("padded_hdim" + std::to_string(d), bf, 1, 97, 131, 2, 2, d);
    c.causal = d == 72;
    v.push_back(c);
  }
  {
    Case c = mk("window50_10", bf, 1, 400, 400, 2, 2, 64);
    c.wl = 50, c.wr = 10;
    v.push_back(c);
  }
  {
    Case c = mk("window_sq_ne_sk", hf, 1, 190, 333, 2, 1, 128);
    c.wl = 100, c.wr = 0;
    v.push_back(c);
  }
  {
    Case c = mk("softcap_alibi_causal", bf, 1, 200, 260, 4, 4, 128);
    c.causal = true, c.softcap = 5.f, c.alibi = true;
    v.push_back(c);
  }
  {
    Case c = mk("sinks_window", bf, 1, 100, 100, 2, 2, 64);
    c.wl = 20, c.wr = 0, c.sinks = true;
    v.push_back(c);
  }
  {
    Case c = mk("sinks_empty_rows", hf, 1, 150, 60, 2, 2, 64);
    c.causal = true, c.sinks = true;
    v.push_back(c);
  }
  {
    Case c = mk("bhsd_strided_f16", hf, 2, 129, 257, 4, 2, 128);
    c.bhsd = true;
    v.push_back(c);
  }
  // O with rows of head_dim + 2 elements (4-byte aligned, not 16): the sm90 epilogue's element-pair
  // stores instead of its 16-byte vectors (store_acc_row), on each body: v3 (hdim 128 without a
  // mask), Q in registers (hdim 128 causal), 3 warpgroups (hdim 64 causal), hdim 256, kLocal (varlen).
  for (int64_t d : {64, 128, 256}) {
    Case c = mk("o_pairs_hdim" + std::to_string(d), d == 128 ? hf : bf, 2, 300, 257, 4, 2, d);
    c.o_pad = 2;
    v.push_back(c);
    c.name += "_causal";
    c.causal = true;
    v.push_back(c);
  }
  {
    Case c = mk("o_pairs_ragged_left60_d128", bf, 0, 0, 0, 4, 2, 128);  // (kLocal: varlen + window)
    c.lens_q = {130, 0, 77};
    c.lens_k = {200, 5, 77};
    c.wl = 60, c.wr = 0, c.causal = true, c.o_pad = 2;
    v.push_back(c);
  }
  // Dense empty dims (session 17: validation admits empty tensors whatever their strides): no keys
  // at all (every row O = 0, LSE = -inf) on the Hopper rows (hdim 64 / 128) and the mma.sync one
  // (hdim 96), and no queries (nothing written).
  v.push_back(mk("dense_no_keys", bf, 2, 65, 0, 4, 2, 128));
  {
    Case c = mk("dense_no_keys_causal_d64_f16", hf, 1, 33, 0, 2, 1, 64);
    c.causal = true;
    v.push_back(c);
  }
  v.push_back(mk("dense_no_keys_d96", bf, 1, 17, 0, 2, 2, 96));
  v.push_back(mk("dense_no_queries", bf, 2, 0, 40, 4, 2, 128));
  {
    Case c = mk("varlen_empty_seq", bf, 0, 0, 0, 4, 2, 128);
    c.lens_q = {5, 0, 130, 64, 200};
    c.lens_k = {7, 3, 200, 0, 150};
    v.push_back(c);
    c.name = "varlen_empty_seq_causal";
    c.causal = true;
    v.push_back(c);
  }
  // Cases for the sm90 kLocal rows (hdim 64 / 128 / 256; several key blocks, so windows skip
  // whole blocks at both ends): causal + left window, both sides, one side only, sinks with and
  // without a window, rows with no visible key, a diagonal-only window, softcap, ALiBi.
  {
    Case c = mk("local_causal_left100_d128", bf, 1, 700, 700, 2, 1, 128);
    c.causal = true, c.wl = 100;
    v.push_back(c);
  }
  {
    Case c = mk("local_window_l200_r40_d64_f16", hf, 1, 900, 900, 2, 2, 64);
    c.wl = 200, c.wr = 40;
    v.push_back(c);
  }
  {
    Case c = mk("local_window_r50_only_d256", bf, 1, 300, 500, 2, 2, 256);
    c.wr = 50;
    v.push_back(c);
  }
  {
    Case c = mk("local_left64_only_gqa4_d128_f16", hf, 2, 640, 640, 8, 2, 128);
    c.wl = 64;
    v.push_back(c);
  }
  {
    Case c = mk("local_sinks_noncausal_d128", bf, 1, 257, 333, 4, 2, 128);
    c.sinks = true;
    v.push_back(c);
  }
  {
    Case c = mk("local_sinks_causal_window_d64", bf, 1, 500, 500, 2, 1, 64);
    c.causal = true, c.wl = 30, c.sinks = true;
    v.push_back(c);
  }
  {
    Case c = mk("local_empty_rows_d128_f16", hf, 1, 300, 100, 2, 2, 128);
    c.wl = 10, c.wr = 0;
    v.push_back(c);
  }
  {
    Case c = mk("local_diagonal_only_d256_f16", hf, 1, 129, 129, 2, 2, 256);
    c.wl = 0, c.wr = 0;
    v.push_back(c);
  }
  {
    Case c = mk("local_softcap_d64", bf, 1, 333, 400, 2, 2, 64);
    c.softcap = 3.f;
    v.push_back(c);
  }
  {
    Case c = mk("local_alibi_window_d256_f16", hf, 1, 260, 300, 2, 1, 256);
    c.alibi = true, c.wl = 90, c.wr = 20;
    v.push_back(c);
  }
  {
    Case c = mk("local_softcap_alibi_sinks_causal_gqa_d128", bf, 1, 520, 520, 4, 2, 128);
    c.causal = true, c.softcap = 8.f, c.alibi = true, c.sinks = true;
    v.push_back(c);
  }
  {  // varlen on the kLocal rows: packed sequences (TMA maps over all tokens), empty ones included
    Case c = mk("local_varlen_window_d64_f16", hf, 0, 0, 0, 2, 2, 64);
    c.lens_q = {1, 300, 65, 0};
    c.lens_k = {1, 310, 64, 5};
    c.wl = 64, c.wr = 16;
    v.push_back(c);
  }
  {
    Case c = mk("local_varlen_sinks_causal_gqa_d256", bf, 0, 0, 0, 4, 2, 256);
    c.lens_q = {17, 260};
    c.lens_k = {33, 250};
    c.causal = true, c.sinks = true;
    v.push_back(c);
  }
  {
    Case c = mk("local_varlen_softcap_alibi_causal_d64", bf, 0, 0, 0, 2, 1, 64);
    c.lens_q = {250, 3, 199};
    c.lens_k = {260, 40, 199};
    c.causal = true, c.softcap = 6.f, c.alibi = true;
    v.push_back(c);
  }
  {
    Case c = mk("local_varlen_long_d128_f16", hf, 0, 0, 0, 2, 1, 128);
    c.lens_q = {700, 129};
    c.lens_k = {900, 1};
    v.push_back(c);
  }
  // A sequence of NaN tokens between finite ones: tail blocks of its neighbours (rows and keys past
  // their ends) must not read it (the sm90 kernels' ragged TMA maps zero-fill there), at each head dim.
  for (int64_t d : {64, 128, 256}) {
    Case c = mk("local_varlen_nan_neighbour_d" + std::to_string(d), d == 128 ? hf : bf, 0, 0, 0, 4, 2, d);
    c.lens_q = {77, 130, 33, 20};
    c.lens_k = {100, 150, 61, 0};
    c.nan_seq = 1;
    c.causal = d == 64;
    v.push_back(c);
  }
  {
    Case c = mk("varlen_window_f16_d96", hf, 0, 0, 0, 2, 2, 96);
    c.lens_q = {1, 300, 65};
    c.lens_k = {1, 310, 64};
    c.wl = 64, c.wr = 16;
    v.push_back(c);
  }
  return v;
}

std::vector<Case> naive_cases() {
  std::vector<Case> v;
  for (Case c : {mk("naive_f32", DType::f32, 1, 77, 130, 4, 2, 40), mk("naive_bf16_causal", DType::bf16, 2, 130, 77, 2, 1, 64),
                 mk("naive_f16_1023x1024", DType::f16, 1, 1023, 1024, 2, 2, 128)}) {
    c.backend = Backend::naive;
    c.causal = c.name.find("causal") != std::string::npos;
    v.push_back(c);
  }
  {
    Case c = mk("naive_dv32_softcap_alibi_sinks", DType::bf16, 1, 90, 120, 4, 2, 64);
    c.dv = 32, c.softcap = 5.f, c.alibi = true, c.sinks = true, c.wl = 30, c.wr = 5;
    c.backend = Backend::naive;
    v.push_back(c);
  }
  {
    Case c = mk("naive_varlen", DType::f16, 0, 0, 0, 4, 2, 64);
    c.lens_q = {5, 0, 130, 64};
    c.lens_k = {7, 3, 200, 0};
    c.causal = true;
    c.backend = Backend::naive;
    v.push_back(c);
  }
  {
    // Odd sq·sk·heads: the workspace regions must still be aligned (a misaligned pointer array
    // once made cuBLAS fault here).
    Case c = mk("naive_odd_17x17x3", DType::bf16, 1, 17, 17, 3, 3, 64);
    c.backend = Backend::naive;
    v.push_back(c);
    Case one = mk("naive_one_token_f16", DType::f16, 1, 1, 1, 1, 1, 32);
    one.backend = Backend::naive;
    v.push_back(one);
  }
  {
    Case c = mk("naive_bhsd", DType::bf16, 2, 65, 66, 2, 2, 128);
    c.bhsd = true;
    c.backend = Backend::naive;
    v.push_back(c);
  }
  return v;
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class CudaFlash : public ::testing::TestWithParam<Case> {};
TEST_P(CudaFlash, MatchesFloat64Reference) { run_case(GetParam(), 1234u + static_cast<uint32_t>(GetParam().name.size())); }
INSTANTIATE_TEST_SUITE_P(Cases, CudaFlash, ::testing::ValuesIn(flash_cases()),
                         [](const auto& info) { return info.param.name; });

class CudaNaive : public ::testing::TestWithParam<Case> {};
TEST_P(CudaNaive, MatchesFloat64Reference) { run_case(GetParam(), 99u + static_cast<uint32_t>(GetParam().name.size())); }
INSTANTIATE_TEST_SUITE_P(Cases, CudaNaive, ::testing::ValuesIn(naive_cases()),
                         [](const auto& info) { return info.param.name; });

// The selector refuses what the flash kernel does not do, with a reason, instead of a slow path.
TEST(CudaFlashSelect, RefusesWithAReason) {
  if (detail::cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA device";
  const int arch = detail::cuda_device_arch(0);
  FwdProblem p;
  p.dtype = DType::f32, p.device = Device::cuda, p.batch = 1, p.heads_q = p.heads_kv = 1;
  p.seqlen_q = p.seqlen_k = 16, p.head_dim = p.head_dim_v = 64;
  EXPECT_TRUE(detail::cuda_flash_select(p, arch).kernel.empty());
  p.dtype = DType::bf16, p.head_dim_v = 32;
  EXPECT_TRUE(detail::cuda_flash_select(p, arch).kernel.empty());
  p.head_dim_v = p.head_dim = 264;
  EXPECT_TRUE(detail::cuda_flash_select(p, arch).kernel.empty());
  p.head_dim_v = p.head_dim = 60;
  EXPECT_TRUE(detail::cuda_flash_select(p, arch).kernel.empty());
  EXPECT_FALSE(detail::cuda_flash_select(p, 75).reason.empty());
  EXPECT_FALSE(detail::cuda_compiled_kernels().empty());
}

}  // namespace

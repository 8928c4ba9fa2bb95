// Consumer of an installed ioattn: find_package(ioattn), one forward call, a sanity check.
#include <ioattn/ioattn.hpp>
#include <cstdio>
#include <vector>
int main() {
  const int64_t b = 1, s = 64, h = 2, d = 32;
  std::vector<float> q(b * s * h * d, 0.1f), o(q.size()), lse(b * h * s);
  auto t = ioattn::TensorView::contiguous(q.data(), ioattn::DType::f32, {b, s, h, d});
  auto ov = ioattn::TensorView::contiguous(o.data(), ioattn::DType::f32, {b, s, h, d});
  auto lv = ioattn::TensorView::contiguous(lse.data(), ioattn::DType::f32, {b, h, s});
  ioattn::AttnParams p;
  p.causal = true;
  auto ran = ioattn::forward(t, t, t, ov, lv, p);
  std::printf("%s o[0]=%g\n", ran.kernel.c_str(), o[0]);
  return o[0] > 0.09f && o[0] < 0.11f ? 0 : 1;
}

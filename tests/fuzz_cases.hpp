// Seeded random cases for the forward and backward tests: the fixed case lists test each feature
// on its own and a few chosen mixes; these draw the mixes nobody listed (windows with sinks and
// varlen, GQA ratio 3 with softcap and ALiBi, head_dim_v != head_dim with [b, h, s, d] strides,
// empty sequences beside one-token ones...). A seed always gives the same case, and the case's
// name spells out every parameter, so a failure reads as a reproducible shape.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "check.hpp"

namespace ioattn::test {

// The draws of one seeded case: the engine's raw output only (the standard distributions differ
// between libraries), salted per generator so the forward and decode cases do not correlate.
class SeededPicks {
 public:
  SeededPicks(uint64_t salt, uint64_t seed) : rng_(salt ^ (seed * 0x100000001b3ull)) {}
  int64_t pick(uint64_t n) { return static_cast<int64_t>(rng_() % n); }  // [0, n)
  bool chance(int percent) { return pick(100) < percent; }

 private:
  std::mt19937_64 rng_;
};

// A custom softmax scale in a case name: "_scale34pc" for 0.34.
inline std::string scale_tag(float scale) {
  return "_scale" + std::to_string(static_cast<int>(scale * 100 + 0.5f)) + "pc";
}

struct FuzzSpace {
  int64_t max_len = 160;       // longest query / key sequence
  bool low_precision = false;  // f16 / bf16 only (the CUDA flash kernels take no f32)
  bool tensor_core_dims = false;  // head_dim a multiple of 8 up to 256, head_dim_v == head_dim
};

inline Case random_case(uint64_t seed, const FuzzSpace& sp = {}) {
  SeededPicks r(0x9e3779b97f4a7c15ull, seed);
  auto length = [&]() -> int64_t {
    switch (r.pick(6)) {
      case 0: return 1;
      case 1: return 2 + r.pick(15);
      case 2: return 17;
      default: return 1 + r.pick(sp.max_len);
    }
  };
  Case c;
  static const DType kTypes[] = {DType::f32, DType::f16, DType::bf16};
  c.dtype = sp.low_precision ? kTypes[1 + r.pick(2)] : kTypes[r.pick(3)];
  static const int64_t kDims[] = {8, 16, 32, 40, 64, 72, 80, 96, 128, 160, 192, 256};
  static const int64_t kOddDims[] = {1, 3, 5, 33, 100, 130};
  c.head_dim = !sp.tensor_core_dims && r.chance(15) ? kOddDims[r.pick(6)] : kDims[r.pick(12)];
  if (!sp.tensor_core_dims && r.chance(25)) c.head_dim_v = kDims[r.pick(12)];
  c.heads_kv = 1 + r.pick(3);
  static const int64_t kRatios[] = {1, 2, 3, 4};
  c.heads_q = c.heads_kv == 1 && r.chance(20) ? 8 : c.heads_kv * kRatios[r.pick(4)];
  if (r.chance(30)) {  // packed sequences, some empty on either side
    c.batch = 1 + r.pick(4);
    for (int64_t b = 0; b < c.batch; ++b) {
      c.varlen_q.push_back(static_cast<int32_t>(r.chance(15) ? 0 : length()));
      c.varlen_k.push_back(static_cast<int32_t>(r.chance(15) ? 0 : length()));
    }
    c.seqlen_q = c.seqlen_k = 0;
  } else {
    c.batch = 1 + r.pick(3);
    c.seqlen_q = length();
    c.seqlen_k = length();
    c.bhsd = r.chance(20);
  }
  c.causal = r.chance(40);
  if (r.chance(30)) {
    c.window_left = r.chance(30) ? -1 : r.pick(64);
    c.window_right = r.chance(40) ? -1 : r.pick(20);
  }
  if (r.chance(20)) c.softcap = static_cast<float>(2 + r.pick(30));
  c.alibi = r.chance(20);
  c.sinks = r.chance(20);
  c.pad_head = r.chance(15) ? 8 : 0;
  c.input_range = c.softcap > 0 || r.chance(15) ? 3.0f : 1.0f;
  if (r.chance(10)) c.scale = 0.05f + static_cast<float>(r.pick(100)) / 100.0f;

  std::string n = "seed" + std::to_string(seed) + "_" + dtype_name(c.dtype) + "_b" + std::to_string(c.batch);
  auto lens = [](const std::vector<int32_t>& v) {
    std::string s;
    for (int32_t x : v) s += (s.empty() ? "" : "-") + std::to_string(x);
    return s;
  };
  n += c.varlen_q.empty() ? "_q" + std::to_string(c.seqlen_q) + "_k" + std::to_string(c.seqlen_k)
                          : "_varlen_q" + lens(c.varlen_q) + "_k" + lens(c.varlen_k);
  n += "_h" + std::to_string(c.heads_q) + "x" + std::to_string(c.heads_kv) + "_d" + std::to_string(c.head_dim);
  if (c.head_dim_v >= 0) n += "_dv" + std::to_string(c.head_dim_v);
  if (c.causal) n += "_causal";
  if (c.window_left >= 0 || c.window_right >= 0)
    n += "_window" + std::to_string(c.window_left) + "_" + std::to_string(c.window_right);
  if (c.softcap > 0) n += "_softcap" + std::to_string(static_cast<int>(c.softcap));
  if (c.alibi) n += "_alibi";
  if (c.sinks) n += "_sinks";
  if (c.bhsd) n += "_bhsd";
  if (c.pad_head) n += "_padheads";
  if (c.input_range != 1.0f) n += "_range3";
  if (c.scale > 0) n += scale_tag(c.scale);
  c.name = n;
  return c;
}

}  // namespace ioattn::test

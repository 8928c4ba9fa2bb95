// 2^f on f in [-0.5, 0.5] by a degree-6 polynomial fitted for relative error (1.9e-9 in exact
// arithmetic, ~1 ulp evaluated in fp32), highest degree first, and log2(e): one source for the CPU
// forward's two softmax implementations (the Highway one in flash_cpu.cpp, the AVX512-BF16 one in
// flash_amx.cpp).
#pragma once

namespace ioattn::detail {

inline constexpr float kLog2e = 1.44269504088896340736f;
inline constexpr float kExp2Poly[7] = {1.5345720694913637e-4f, 1.3399930471579434e-3f, 9.618489296472785e-3f,
                                       5.5503287792933516e-2f, 2.4022646887500068e-1f, 6.931472057358227e-1f,
                                       1.0000000005545888f};

}  // namespace ioattn::detail

// One cache line into L2 (prefetcht1), for the CPU kernels' software prefetch loops.
//
// An asm statement on x86, because GCC 12 deletes a loop whose only effect is __builtin_prefetch
// (or _mm_prefetch, the same builtin) once it may assume the loop finite (-ffinite-loops, the C++
// default). It did so silently in an earlier forward (flash_cpu.cpp) and, in session 29, in every
// f8e4m3 decode kernel of serving_cpu.cpp (up to 30% of decode speed; docs/PERF.md).
#pragma once

namespace ioattn::detail {

inline void prefetch_l2(const void* p) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __asm__ volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
  __asm__ volatile("prfm pldl2keep, %a0" : : "p"(p));  // into L2, as prefetcht1
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

}  // namespace ioattn::detail

// ioattn_cuda_readbw — the device's read-bandwidth ceiling by load mechanism, for the decode
// kernel (which only reads: K/V streamed once, O tiny). The decode table compares us with cuDNN
// at 4.6 TB/s of K+V, while our cp.async loader tops out near 4.3; this probe says which way of
// reading gets the most out of HBM, before a loader is rewritten around it.
//
//   ioattn_cuda_readbw [--gib 2] [--repeats 10] [--ctas-per-sm 1,2,3,4] [--kvloop-spins 0,500,...]
//
// Mechanisms (each CTA streams its share of a buffer far beyond L2 and sums it, so nothing is
// optimised away; one float per CTA is written):
//   ldg        LDG.128 through registers, 8 loads in flight per thread per step
//   cpasync    cp.async.cg 16 B into a STAGES-deep shared ring (the decode loader's instruction)
//   cpasync128 the same with the .L2::128B prefetch hint
//   cpasync256 the same with the .L2::256B prefetch hint
//   bulk       cp.async.bulk (TMA 1-D bulk copy) of whole 16 KiB stages, one thread issues, an
//              mbarrier with the transaction count completes each stage (sm_90)
// Patterns: contig (each CTA one contiguous span) and rows (the decode cache's access pattern:
// [tokens, 8 kv heads, 128 dims] bf16, each CTA one head's 256-byte rows 2 KiB apart; a stage is
// 64 rows of one head).
// kvloop (--kvloop-spins 0,1000,...; 1 and 2 CTAs per SM): the decode kernel's loop and pattern
//   without its arithmetic: CTA c streams head c % 8 of token group c / 8 from two caches (K in
//   the buffer's first half, V in its second, each [tokens, 8 heads, 256 B]) in tiles of 64 K rows +
//   64 V rows (32 KiB) through a 3-stage cp.async ring (96 KiB: 2 CTAs per SM, as the decode's),
//   per tile: wait, barrier, issue the tile 2 ahead, read the tile, then spin for the given SM
//   cycles (standing in for the decode's per-tile compute, ~1,500-3,300 cycles in its traces).
//   Pattern kv_warp: the same with each warp copying, waiting for and reading its own 16 rows (a
//   __syncwarp instead of the CTA barrier); kv_zfill: the CTA form with the decode kernel's
//   zero-fill form of cp.async; kv_pad: the CTA form into the decode kernel's padded shared rows
//   (272-byte pitch). Every form's ring is sized as the padded one's (102 KiB, 2 CTAs per SM).
//   Which of "two streams" and "compute per tile" holds the decode at ~4.2 TB/s where the single
//   stream above reads ~4.6?
// CTAs: SMs x CTAs-per-SM rounded down to whole groups of 8 (one token group of the rows
// pattern), so up to 7 slots stay idle; a (mechanism, CTAs per SM) the occupancy calculator says
// cannot be resident (the 64 KiB rings allow 3 per SM) is skipped, never reported as a false row.
// Output: one JSON line per (mechanism, pattern, CTAs per SM), then a table of TB/s.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/bench_util.cuh"
#include "cuda/check.cuh"
#include "cuda/hopper/ptx_sm90.cuh"
#include "cuda/ptx.cuh"

namespace {

constexpr int kThreads = 128;
constexpr int kStageBytes = 16384;   // 64 rows x 256 B
constexpr int kRowBytes = 256;       // one (token, kv head) row: 128 bf16
constexpr int kHeads = 8;            // rows of one token (head-interleaved cache)
constexpr int kRowsPerStage = kStageBytes / kRowBytes;

enum class Mech { ldg, cpasync, cpasync128, cpasync256, bulk };
const char* mech_name(Mech m) {
  switch (m) {
    case Mech::ldg: return "ldg";
    case Mech::cpasync: return "cpasync";
    case Mech::cpasync128: return "cpasync128";
    case Mech::cpasync256: return "cpasync256";
    default: return "bulk";
  }
}

// Byte offset of 16-byte piece `piece` (0..1023) of stage `s` of CTA `cta` (of `ctas`).
//   contig: CTA c owns stages [c * per, (c + 1) * per), each 16 KiB contiguous.
//   rows:   CTA c reads head c % 8 of token group c / 8: stage s covers 64 tokens, row r of the
//           stage is token (group_base + s * 64 + r), head h, at (token * 8 + h) * 256 bytes.
__device__ __forceinline__ size_t piece_offset(bool rows, int cta, int ctas, int64_t stages_per_cta, int64_t s,
                                               int piece) {
  if (!rows) return (static_cast<size_t>(cta) * stages_per_cta + s) * kStageBytes + static_cast<size_t>(piece) * 16;
  const int h = cta % kHeads, group = cta / kHeads;
  const int64_t token = (static_cast<int64_t>(group) * stages_per_cta + s) * kRowsPerStage + piece / 16;
  return (static_cast<size_t>(token) * kHeads + h) * kRowBytes + static_cast<size_t>(piece % 16) * 16;
}

__device__ __forceinline__ float sum4(uint4 v) {
  return __uint_as_float(v.x & 0x3fffffff) + __uint_as_float(v.y & 0x3fffffff) +
         __uint_as_float(v.z & 0x3fffffff) + __uint_as_float(v.w & 0x3fffffff);
}

__global__ void __launch_bounds__(kThreads) read_ldg(const char* buf, int64_t stages_per_cta, bool rows, float* out) {
  float acc = 0.f;
  for (int64_t s = 0; s < stages_per_cta; ++s) {
    uint4 v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      v[i] = __ldg(reinterpret_cast<const uint4*>(
          buf + piece_offset(rows, blockIdx.x, gridDim.x, stages_per_cta, s, i * kThreads + threadIdx.x)));
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += sum4(v[i]);
  }
  if (acc == 1.2345f) out[blockIdx.x] = acc;  // practically never: keeps the loads alive
}

template <int kHint>  // 0 none, 128, 256
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  if constexpr (kHint == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else if constexpr (kHint == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else
    ioattn::cuda::ptx::cp_async_16_full(dst, src);
}

template <int kHint, int kStages>
__global__ void __launch_bounds__(kThreads) read_cpasync(const char* buf, int64_t stages_per_cta, bool rows, float* out) {
  extern __shared__ __align__(128) char smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  auto issue = [&](int64_t s) {
    if (s < stages_per_cta) {
      const uint32_t dst = base + static_cast<uint32_t>((s % kStages) * kStageBytes);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int piece = i * kThreads + threadIdx.x;
        cp16<kHint>(dst + piece * 16, buf + piece_offset(rows, blockIdx.x, gridDim.x, stages_per_cta, s, piece));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  float acc = 0.f;
  for (int64_t s = 0; s < stages_per_cta; ++s) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
    __syncthreads();
    issue(s + kStages - 1);
    // Consume: each thread reads 8 of its stage's 16-byte pieces (light work, like the decode's).
    const char* st = smem + (s % kStages) * kStageBytes;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += sum4(*reinterpret_cast<const uint4*>(st + (i * kThreads + threadIdx.x) * 16));
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  if (acc == 1.2345f) out[blockIdx.x] = acc;
}

// The decode loop's pattern (see kvloop above): tile s of CTA c = 64 tokens of head c % 8.
constexpr int kKvTileRows = 64, kKvStages = 3;
constexpr int kKvTileBytes = 2 * kKvTileRows * kRowBytes;  // K rows then V rows
// kMode 3's shared-memory row pitch: the decode kernel's padded rows (256 + 16 bytes).
constexpr int kKvPadPitch = kRowBytes + 16;
constexpr size_t kKvSmem = static_cast<size_t>(kKvStages) * 2 * kKvTileRows * kKvPadPitch;  // fits every mode
// kMode 1 (kWarp): each warp copies and reads only its own 16 rows of the K and V tiles (the decode
// kernel's warps consume keys 16w..16w+15 alone), so a warp waits on its own copies and a
// __syncwarp instead of the CTA barrier: a slow warp no longer holds back the refill of the others'
// rows. kMode 2: the CTA form with the decode kernel's copy instruction, cp.async with the
// ignore-src (zero-fill) operand (always false here: every row is read), to see whether that form
// alone brings the decode kernel's extra L2 traffic (session 13: 34% L2 hits there, < 1% here).
// kMode 3: the CTA form with the decode kernel's shared-memory layout, rows padded to 272 bytes
// (so half of the rows start 16 bytes off a 32-byte boundary): does a destination row that is not
// sector-aligned split the copy's global requests (the other suspect for the extra L2 traffic)?
template <int kMode>
__global__ void __launch_bounds__(kThreads) read_kvloop(const char* buf, int64_t tiles_per_cta, int64_t half_bytes,
                                                        long long spin, float* out) {
  extern __shared__ __align__(128) char smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int h = blockIdx.x % kHeads, group = blockIdx.x / kHeads;
  // thread t copies 16-byte chunk t % 16 of rows t / 16 + 8 i (i < 8) of the K and V tiles
  // kWarp: lane l of warp w copies chunk l % 16 of rows 16 w + l / 16 + 2 i (i < 8)
  constexpr bool kWarp = kMode == 1;
  constexpr int kPitch = kMode == 3 ? kKvPadPitch : kRowBytes, kStageBytes = 2 * kKvTileRows * kPitch;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int chunk = kWarp ? lane % 16 : threadIdx.x % 16, row0 = kWarp ? 16 * warp + lane / 16 : threadIdx.x / 16;
  const int rstep = kWarp ? 2 : 8;
  auto issue = [&](int64_t s) {
    if (s < tiles_per_cta) {
      const uint32_t dst = base + static_cast<uint32_t>((s % kKvStages) * kStageBytes);
      const int64_t token0 = (static_cast<int64_t>(group) * tiles_per_cta + s) * kKvTileRows;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = row0 + rstep * i;
        const size_t off = (static_cast<size_t>(token0 + r) * kHeads + h) * kRowBytes + chunk * 16;
        if constexpr (kMode == 2) {
          // the decode kernel's copy (valid false would write zeros and read nothing)
          ioattn::cuda::ptx::cp_async_16_zfill(dst + r * kRowBytes + chunk * 16, buf + off, r < kKvTileRows);
          ioattn::cuda::ptx::cp_async_16_zfill(dst + (kKvTileRows + r) * kRowBytes + chunk * 16, buf + half_bytes + off,
                                               r < kKvTileRows);
        } else {
          cp16<0>(dst + r * kPitch + chunk * 16, buf + off);
          cp16<0>(dst + (kKvTileRows + r) * kPitch + chunk * 16, buf + half_bytes + off);
        }
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int s = 0; s < kKvStages - 1; ++s) issue(s);
  float acc = 0.f;
  for (int64_t s = 0; s < tiles_per_cta; ++s) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kKvStages - 2));
    if constexpr (kWarp)
      __syncwarp();
    else
      __syncthreads();
    issue(s + kKvStages - 1);
    const char* st = smem + (s % kKvStages) * kStageBytes;
    if constexpr (kWarp) {  // the warp's own 16 K rows and 16 V rows
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int r = 16 * warp + (i % 8) * 2 + lane / 16 + (i / 8) * kKvTileRows;
        acc += sum4(*reinterpret_cast<const uint4*>(st + r * kRowBytes + (lane % 16) * 16));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) acc += sum4(*reinterpret_cast<const uint4*>(st + (i * kThreads + threadIdx.x) * 16));
    }
    if (spin > 0) {
      const long long t0 = clock64();
      while (clock64() - t0 < spin) {
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  if (acc == 1.2345f) out[blockIdx.x] = acc;
}

template <int kStages>
__global__ void __launch_bounds__(kThreads) read_bulk(const char* buf, int64_t stages_per_cta, bool rows, float* out) {
#if IOATTN_SM90A_ENABLED
  using namespace ioattn::cuda::sm90;
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t full[kStages];
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) mbarrier_init(&full[i], 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  // Warp 0 issues a stage: one 16 KiB bulk copy (contig) or 64 row copies of 256 B (rows); lane
  // 0 arms the stage's barrier with the byte count first.
  auto issue = [&](int64_t s) {
    if (s >= stages_per_cta || threadIdx.x >= 32) return;
    const int slot = static_cast<int>(s % kStages);
    char* dst = smem + slot * kStageBytes;
    if (threadIdx.x == 0) mbarrier_arrive_expect_tx(&full[slot], kStageBytes);
    __syncwarp();
    if (!rows) {
      if (threadIdx.x == 0)
        bulk_load_1d(dst, buf + piece_offset(false, blockIdx.x, gridDim.x, stages_per_cta, s, 0), kStageBytes,
                     &full[slot]);
    } else {
      for (int r = threadIdx.x; r < kRowsPerStage; r += 32)
        bulk_load_1d(dst + r * kRowBytes, buf + piece_offset(true, blockIdx.x, gridDim.x, stages_per_cta, s, r * 16),
                     kRowBytes, &full[slot]);
    }
  };
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  float acc = 0.f;
  for (int64_t s = 0; s < stages_per_cta; ++s) {
    const int slot = static_cast<int>(s % kStages);
    mbarrier_wait_or_trap(&full[slot], static_cast<uint32_t>((s / kStages) & 1));
    const char* st = smem + slot * kStageBytes;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += sum4(*reinterpret_cast<const uint4*>(st + (i * kThreads + threadIdx.x) * 16));
    __syncthreads();  // all threads are done with stage s - 1's slot, which stage s + kStages - 1 reuses
    issue(s + kStages - 1);
  }
  if (acc == 1.2345f) out[blockIdx.x] = acc;
#else
  (void)buf, (void)stages_per_cta, (void)rows, (void)out;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ioattn::cuda::bench;
  double gib = 2;
  int repeats = 10;
  std::string ctas_s = "1,2,3,4", spins_s = "0,500,1000,1500,2000,3000";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--gib") gib = std::atof(v.c_str());
    else if (a == "--repeats") repeats = std::atoi(v.c_str());
    else if (a == "--ctas-per-sm") ctas_s = v;
    else if (a == "--kvloop-spins") spins_s = v;
    else {
      std::fprintf(stderr, "ioattn_cuda_readbw: unknown option %s (see the comment at the top of bench_readbw.cu)\n", a.c_str());
      return 2;
    }
  }
  int dev = 0, sms = 0, major = 0;
  IOATTN_CUDA_CHECK(cudaGetDevice(&dev));
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  IOATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  constexpr int kStages = 4;
  const size_t smem = static_cast<size_t>(kStages) * kStageBytes;
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(read_cpasync<0, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(read_cpasync<128, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(read_cpasync<256, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(read_bulk<kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));

  const size_t bytes = static_cast<size_t>(gib * (1ull << 30));
  char* buf = nullptr;
  float* out = nullptr;
  IOATTN_CUDA_CHECK(cudaMalloc(&buf, bytes));
  IOATTN_CUDA_CHECK(cudaMalloc(&out, 1 << 20));
  fill_uniform(buf, true, static_cast<int64_t>(bytes / 2), 7);
  IOATTN_CUDA_CHECK(cudaDeviceSynchronize());

  struct Row {
    std::string mech, pattern;
    int ctas_per_sm;
    double tbs;
  };
  std::vector<Row> rows_out;
  for (int64_t cps : parse_list(ctas_s)) {
    // Whole groups of 8 CTAs (one token group, all heads) so both patterns read the same bytes.
    const int ctas = static_cast<int>((sms * cps) / kHeads * kHeads);
    const int64_t stages_per_cta = static_cast<int64_t>(bytes / kStageBytes) / ctas;
    const double read = static_cast<double>(stages_per_cta) * ctas * kStageBytes;
    for (Mech m : {Mech::ldg, Mech::cpasync, Mech::cpasync128, Mech::cpasync256, Mech::bulk}) {
      if (m == Mech::bulk && major < 9) continue;
      int resident = 0;
      const void* fn = m == Mech::ldg          ? reinterpret_cast<const void*>(read_ldg)
                       : m == Mech::cpasync    ? reinterpret_cast<const void*>(read_cpasync<0, kStages>)
                       : m == Mech::cpasync128 ? reinterpret_cast<const void*>(read_cpasync<128, kStages>)
                       : m == Mech::cpasync256 ? reinterpret_cast<const void*>(read_cpasync<256, kStages>)
                                               : reinterpret_cast<const void*>(read_bulk<kStages>);
      IOATTN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, fn, kThreads,
                                                                      m == Mech::ldg ? 0 : smem));
      if (resident < cps) {
        std::printf("# %s: %lld CTAs per SM requested, %d resident at most: skipped\n", mech_name(m),
                    static_cast<long long>(cps), resident);
        continue;
      }
      for (bool rows : {false, true}) {
        auto launch = [&] {
          switch (m) {
            case Mech::ldg: read_ldg<<<ctas, kThreads>>>(buf, stages_per_cta, rows, out); break;
            case Mech::cpasync: read_cpasync<0, kStages><<<ctas, kThreads, smem>>>(buf, stages_per_cta, rows, out); break;
            case Mech::cpasync128: read_cpasync<128, kStages><<<ctas, kThreads, smem>>>(buf, stages_per_cta, rows, out); break;
            case Mech::cpasync256: read_cpasync<256, kStages><<<ctas, kThreads, smem>>>(buf, stages_per_cta, rows, out); break;
            case Mech::bulk: read_bulk<kStages><<<ctas, kThreads, smem>>>(buf, stages_per_cta, rows, out); break;
          }
          IOATTN_CUDA_CHECK_LAUNCH("read kernel");
        };
        const double ms = time_ms(launch, 2, repeats, 1);
        const double tbs = read / (ms * 1e-3) / 1e12;
        rows_out.push_back({mech_name(m), rows ? "rows" : "contig", static_cast<int>(cps), tbs});
        std::printf("{\"bench\": \"readbw\", \"mech\": \"%s\", \"pattern\": \"%s\", \"ctas_per_sm\": %d, \"ctas\": %d, "
                    "\"stages\": %d, \"bytes\": %.0f, \"ms\": %.4f, \"tbs\": %.3f}\n",
                    mech_name(m), rows ? "rows" : "contig", static_cast<int>(cps), ctas, kStages, read, ms, tbs);
        std::fflush(stdout);
      }
    }
  }
  // The decode loop's pattern and structure, with a spin per tile for its compute ("" skips).
  const size_t kv_smem = kKvSmem;  // every mode gets the padded ring's size: one occupancy for all
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(read_kvloop<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kv_smem));
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(read_kvloop<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kv_smem));
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(read_kvloop<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kv_smem));
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(read_kvloop<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kv_smem));
  for (int64_t cps : {int64_t{1}, int64_t{2}})
  for (int mode : {0, 1, 2, 3}) {
    int resident = 0;
    IOATTN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, read_kvloop<0>, kThreads, kv_smem));
    if (spins_s.empty() || resident < cps) continue;
    const int ctas = static_cast<int>((sms * cps) / kHeads * kHeads);
    const int64_t half = static_cast<int64_t>(bytes / 2) / kKvTileBytes * kKvTileBytes;  // V's base: aligned
    // each cache half holds ctas / 8 token groups of tiles_per_cta tiles x 64 tokens x 8 heads x 256 B
    const int64_t tiles_per_cta = half / (static_cast<int64_t>(ctas / kHeads) * kKvTileRows * kHeads * kRowBytes);
    const double read = static_cast<double>(tiles_per_cta) * ctas * kKvTileBytes;
    for (int64_t spin : parse_list(spins_s)) {
      auto launch = [&] {
        if (mode == 1)
          read_kvloop<1><<<ctas, kThreads, kv_smem>>>(buf, tiles_per_cta, half, spin, out);
        else if (mode == 2)
          read_kvloop<2><<<ctas, kThreads, kv_smem>>>(buf, tiles_per_cta, half, spin, out);
        else if (mode == 3)
          read_kvloop<3><<<ctas, kThreads, kv_smem>>>(buf, tiles_per_cta, half, spin, out);
        else
          read_kvloop<0><<<ctas, kThreads, kv_smem>>>(buf, tiles_per_cta, half, spin, out);
        IOATTN_CUDA_CHECK_LAUNCH("read_kvloop");
      };
      const double ms = time_ms(launch, 2, repeats, 1);
      const double tbs = read / (ms * 1e-3) / 1e12;
      const char* mname = mode == 1 ? "kv_warp" : mode == 2 ? "kv_zfill" : mode == 3 ? "kv_pad" : "kv";
      const std::string pat = std::string(mode == 1   ? "kv per-warp spin "
                                          : mode == 2 ? "kv zfill-form spin "
                                          : mode == 3 ? "kv padded-rows spin "
                                                      : "kv spin ") +
                              std::to_string(spin);
      rows_out.push_back({"kvloop", pat, static_cast<int>(cps), tbs});
      std::printf("{\"bench\": \"readbw\", \"mech\": \"kvloop\", \"pattern\": \"%s\", \"spin\": %lld, "
                  "\"ctas_per_sm\": %d, \"ctas\": %d, \"stages\": %d, \"bytes\": %.0f, \"ms\": %.4f, \"tbs\": %.3f}\n",
                  mname, static_cast<long long>(spin), static_cast<int>(cps), ctas, kKvStages, read, ms, tbs);
      std::fflush(stdout);
    }
  }
  std::printf("\n## read bandwidth (TB/s), %.1f GiB buffer, %d SMs, %d threads/CTA, %d x 16 KiB stages\n", gib, sms,
              kThreads, kStages);
  std::printf("| mechanism | pattern | CTAs/SM | TB/s |\n|---|---|---|---|\n");
  for (const Row& r : rows_out)
    std::printf("| %s | %s | %d | %.2f |\n", r.mech.c_str(), r.pattern.c_str(), r.ctas_per_sm, r.tbs);
  IOATTN_CUDA_CHECK(cudaFree(buf));
  IOATTN_CUDA_CHECK(cudaFree(out));
  return 0;
}

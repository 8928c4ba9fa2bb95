// flash_bwd_sm90.cu — the Hopper (wgmma) dK/dV/dQ kernels of the backward, bf16/f16: the
// dispatcher's default on sm_90 at hdim 64, 128 and 256 wherever they apply; hdim 256 has its own
// two kernels ("---- hdim 256" below). IOATTN_BWD_KERNEL=mma selects the mma.sync kernel of
// flash_bwd.cuh instead; flash_bwd_dispatch.cu says why when they do not apply.
// The preprocess (D, LSE·log2e), the fp32 dQ workspace and its conversion are run_flash_backward's,
// unchanged; this kernel replaces flash_bwd_dkdv_kernel.
//
// CTA = (batch, kv head, block of 128 keys), 2 consumer warpgroups (no producer: each step's Q,
// dO, LSE, D issued one step ahead, by cp.async from all 256 threads or, variants tmald /
// pp, by TMA from one thread), warpgroup c owning keys 64c..64c+63. Keys
// are the wgmma M dimension (FlashAttention-3's order; the operand layouts are the ones
// test_ptx_sm90.cu's k_wgmma_bwd_chain checks); d = head dim:
//   S^T  = K_c Q^T,   dP^T = V_c dO^T         ss, m64n64, both operands K-major
//   P^T  = exp2(S^T·scale·log2e − LSE·log2e), dS^T = P^T ∘ (dP^T − D), masked to 0
//   dV_c += P^T dO,   dK_c += dS^T Q          rs, m64n(d), A from the accumulators, B MN-major
//   dS^T -> shared memory; hdim 128: dQ[:, 64c..] = dS K[:, 64c..] over both warpgroups' keys;
//   hdim 64: dQ_c = dS[:, keys of c] K[keys of c, :]   ss, m64n64, A = dS^T read transposed,
//                                             B = K MN-major; each warpgroup's dQ piece through
//                                             shared memory into the fp32 dQ workspace by TMA reduce-add
// GQA: the CTA walks every query head of its kv head, so dK/dV are summed on chip.
// Tiles live in shared memory with the 128-byte swizzle (ptx_sm90.cuh): K, V [128 x d], Q, dO
// 2 stages x [64 x d] (column blocks of 64 dims = 128-byte rows), dS^T 2 x [128 x 128 B]
// (alternating per block so one barrier per block suffices), LSE and D 2 stages x 64 floats,
// dQ pieces 2 x 2 warpgroups x [64 x 64] fp32: 224 KB (hdim 128) or 160 KB (hdim 64), + 1 KB
// alignment. hdim 64's default, variant ppwide, steps over 128 query rows instead of 64 (see
// kWide below): Q, dO 2 stages x [128 x 64], dS^T 2 x [128 keys x 256 B]: hdim 128's 224 KB.
// Sinks need nothing here: the forward's LSE includes them, and their gradient comes from the
// preprocess (run_flash_backward). Deterministic mode: dK/dV here (kDq false: no dQ wgmma, no dS^T
// in shared memory), then the mma.sync table's atomic-free dQ pass (launch_deterministic). Not
// covered (the selector says so): softcap, ALiBi, head dims other than 64, 128 and 256, varlen at
// hdim 256 with dQ by reductions (IOATTN_BWD_SM90_D256_DQ=red|v4).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "cuda/check.cuh"
#include "cuda/epilogue.cuh"
#include "cuda/flash_bwd_launch.cuh"
#include "cuda/hopper/ptx_sm90.cuh"

namespace ioattn::cuda {
namespace sm90_bwd {

// IOATTN_BWD_TRACE (a diagnostic build only, -DIOATTN_BWD_TRACE=1): SM clock stamps at the
// phases of every step of the first kTrBlocks CTAs, both warpgroups, printed by the host after
// the 20th launch (per-phase mean cycles over the steps).
#ifndef IOATTN_BWD_TRACE
#define IOATTN_BWD_TRACE 0
#endif

// IOATTN_BWD_DKV_VEC (compile time, default 1 since session 36; 0 = element pairs): dK and dV
// leave the dK/dV kernels (hdim 64 / 128 and 256) as 16-byte vectors after a quad transpose
// (store_acc_row, cuda/epilogue.cuh) when dk / dv and their strides allow.
#ifndef IOATTN_BWD_DKV_VEC
#define IOATTN_BWD_DKV_VEC 1
#endif
#if IOATTN_BWD_TRACE
// Points 0-9: the phases every variant prints; 10-14: finer points (10: after the dQ piece
// buffer's read wait at the top; pp at hdim 128 only: 11 after dS^T is stored, 12 after the wait
// for the other half (ds_full), 13 after the dQ wait, 14 after put_dq).
constexpr int kTrBlocks = 8, kTrSteps = 64, kTrPoints = 15;
__device__ unsigned g_bwd_trace[kTrBlocks][2][kTrSteps][kTrPoints];
#define BWD_TRACE(step, k)                                                                       \
  do {                                                                                           \
    if (wtid == 0 && blockIdx.x < kTrBlocks && (step) < kTrSteps)                                \
      g_bwd_trace[blockIdx.x][wg][(step)][(k)] = static_cast<unsigned>(clock64());               \
  } while (0)
// Timing probes (IOATTN_BWD_DQ_PROBE, bits, copied to the device once by set_dq_probe): bits 0-1
// the dQ output: 0 as shipped, 1 dropped (both kernels: hdim 64/128 store the piece but add
// nothing, hdim 256's red form computes dQ and adds nothing), 2 a plain TMA store in place of the
// reduce-add (every key block overwrites), 3 red.global from the registers (no shared-memory
// piece); 4 dS^T by stmatrix (pp at hdim 128); 8 no dS^T stores; 16 no dQ piece stores (bits 2-4:
// hdim 64/128). Wrong results by design (except 3 and 4): trace builds only.
__device__ int g_bwd_dq_probe;
__device__ __forceinline__ int dq_probe_bits() { return g_bwd_dq_probe; }
#else
#define BWD_TRACE(step, k) \
  do {                     \
  } while (0)
__device__ __forceinline__ constexpr int dq_probe_bits() { return 0; }
#endif

constexpr int kBN = 128;       // keys per CTA (64 per consumer warpgroup)
constexpr int kBM = 64;        // query rows per step (variant ppwide: 2 kBM) and of a dQ piece
constexpr int kThreads = 256;  // 2 warpgroups

// Head dim kD (128 or 64).
// Tiles are column blocks of 64 dims (128-byte swizzled rows): two at hdim 128, one at 64.
//   hdim 128: dQ[:, 64wg..] = dS K[:, 64wg..] over all 128 keys (needs both warpgroups' dS^T:
//             a CTA barrier, or variant pp's ds_full / ds_empty mbarriers), one reduction per element;
//   hdim 64:  dQ_wg = dS[:, keys of wg] K[keys of wg, :] (own dS^T only: a warpgroup barrier),
//             both warpgroups reduce into every element.
constexpr int kDqPiece = kBM * 64 * 4;  // 16 KB: one warpgroup's dQ piece, two SW128 boxes of 32 dims
// kM: query rows per step (kBM; variant ppwide at hdim 64: 2 kBM).
template <int kD, int kM = kBM>
struct Cfg {
  static constexpr int kTileQ = kM * kD * 2;  // Q or dO block
  static constexpr int kTileK = kBN * kD * 2;  // K or V
  static constexpr int kTileDsM = kBN * kM * 2;  // dS^T [128 keys x kM rows]
  // Slack for aligning the tiles to 1024 bytes. ppwide (hdim 64, 128-row steps) needs the same
  // 229,440 bytes of tiles, pieces and barriers as hdim 128 plus 2 KB of static LSE / D (1 KB
  // more), so it keeps 960 bytes of slack to stay within the 232,448 an sm_90 CTA may have; the
  // kernel traps if its dynamic memory ever starts further than that from a 1024-byte boundary.
  static constexpr int kSlack = kM == kBM ? 1024 : 960;
  static constexpr int kSmemRed = 2 * kTileK + 4 * kTileQ + 2 * kTileDsM + kSlack;
  // kTmaDq: + 2 buffers x 2 warpgroups x [64 rows x 64 dims] fp32 dQ pieces (hdim 128, with the
  // TMA-load variants' 64 bytes of mbarriers and the static LSE/D arrays: 231,488 bytes of the
  // 232,448 an sm_90 CTA may have; 960 left).
  static constexpr int kSmemTma = kSmemRed + 2 * 2 * kDqPiece;
  static constexpr int kSmemTmaLoad = kSmemTma + 64;  // + mbarriers: Q/dO stages (full, empty), dS^T (pp)
  static constexpr int smem(bool tma_dq) { return tma_dq ? kSmemTma : kSmemRed; }
};

// Two 16-bit values of a packed b32 (lo = first, as pack2) back to fp32: exact. (The decode
// kernel's unpack2 builds the f16 pair through __half2_raw instead; one shared form changed the
// SASS of one of the two measured kernels, so each keeps its own.)
template <typename T>
__device__ __forceinline__ void unpack2(uint32_t w, float& lo, float& hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xFFFF0000u);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    lo = f.x, hi = f.y;
  }
}

// Byte offset of fp32 element (row r, column c < 64) of a dQ piece: two [64 rows x 32 floats]
// boxes of the dQ tensor map, 128-byte rows, 16-byte chunk (c % 32) / 4 at position ^ (r % 8).
__device__ __forceinline__ uint32_t dq_piece_off(int r, int c) {
  return static_cast<uint32_t>((c >> 5) * (kBM * 128) + r * 128 + ((((c & 31) >> 2) ^ (r & 7)) << 4) + (c & 3) * 4);
}

// Order of a step (FlashAttention-3's): the next step's Q/dO/LSE/D cp.async are issued after this
// step's S^T/dP^T wgmmas (their issue overlaps the tensor cores); S^T and dP^T are two wgmma
// commit groups, so P^T is computed and the dV wgmmas issued while dP^T is still on the tensor
// cores, and dS^T while dV is. (Session 5 measured these against the plain order: +3%, +2%.)
// Template flags (IOATTN_BWD_SM90_VARIANT picks them for A/B runs; see variant_bits()):
//   kLag:   the dQ wgmmas of step j are issued at the start of step j + 1, before its S^T and dP^T
//           (dS^T_j stays in its buffer for a step; the step's first barrier publishes it), and
//           the dQ output runs while S^T/dP^T are on the tensor cores. Without it the dQ output
//           sat between the last wgmma wait of a step and the next step's first wgmma, with the
//           tensor cores idle: session 6 measured +19-25% at hdim 128, +17-21% at hdim 64.
//   kTmaDq: each warpgroup's dQ piece (64 rows x 64 dims) goes to shared memory (two buffers,
//           alternating per step) and one thread adds it to the fp32 workspace with two TMA
//           reduce-adds (cp.reduce.async.bulk.tensor through a [heads·batch, seqlen_q, d] fp32
//           map; rows past seqlen_q are clipped by the map); otherwise 32 red.global.add.v2 per
//           thread per step (session 5's kernel). Alone it measured no faster than red; with kLag
//           it is (lag 414/474 TFLOP/s at 4k/16k vs redlag 362/410).
// (Removed after their A/B, docs/PERF.md: "base" and "late" — the plain order — and "defer", dQ
// reductions one step late through shared memory.)

// Byte offset of 16-byte chunk c (0..kD/8-1) of row r in a [rows x kD dims] tile: column block
// c / 8, swizzled chunk position (c % 8) ^ (r % 8).
__device__ __forceinline__ uint32_t chunk_off(int rows, int r, int c) {
  return static_cast<uint32_t>((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// rows x kD dims of a [.., seq, .., dims] tensor into a swizzled tile; rows at or past `valid`
// are zero-filled. Each of the 256 threads copies rows * kD / 8 / 256 chunks.
template <int kRows, int kD>
__device__ __forceinline__ void load_rows(uint32_t dst, const uint8_t* src, int64_t row_stride_bytes, int valid) {
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
#pragma unroll
  for (int it = 0; it < kRows * kChunks / kThreads; ++it) {
    const unsigned idx = it * kThreads + threadIdx.x;  // unsigned: / and % by kChunks are shifts
    const int r = static_cast<int>(idx / kChunks), c = static_cast<int>(idx % kChunks);
    const bool ok = r < valid;
    ptx::cp_async_16_zfill(dst + chunk_off(kRows, r, c), src + (ok ? r * row_stride_bytes + c * 16 : 0), ok);
  }
}

// kTmaLoad (variant "tmald", with kLag and kTmaDq): Q and dO of each step by TMA (thread 0 issues
// two 4-D box loads per tile into the stage, completing on the stage's mbarrier, which every
// thread waits on) instead of 256 threads' cp.async; LSE / D stay cp.async (64 threads). Fewer
// instructions and LSU queue entries per step (ncu, session 7: "mio throttle" 0.62 stalls per
// issued instruction); rows past seqlen_q are the maps' out-of-bounds zeros, as cp.async's zfill.
// kVarlen (with kLag and kTmaDq; varlen's default at hdim 128 below 2048 query rows;
// IOATTN_BWD_SM90_VARLEN=0 sends varlen to the mma.sync table): packed
// sequences from cu_seqlens (bwd_detail::seq_info): this CTA's sequence's key / query starts and
// lengths, workspace rows q_start + i, and the dQ workspace [heads_q, total_q, d] through a ragged
// map (make_ragged_map: head, sequence, row m0), so a tail block's dQ rows past the sequence are
// skipped by the reduce-add rather than added to the next sequence's rows.
// kVarlen with kPingPong (variants pp and ppwide on varlen, session 23; the defaults by the dense
// rule since session 24, verified on the H200): Q / dO by TMA through ragged maps over the packed
// [total_q, heads, d] tokens (session 25): a tail step's rows past its sequence read as zeros, as
// lag's zero-filled rows, never as the next sequence's tokens (whose NaN / Inf would reach dK / dV
// through 0 x NaN).
// kPingPong (variant "pp", with kTmaLoad; session 8, the default since session 9): no
// CTA barrier in the loop, so the two warpgroups stop walking the step in lockstep. At hdim 64 a
// step's wgmmas are ~1,280 cycles of a ~3,700-cycle step (342 TFLOP/s): the rest is the chain
// S^T -> P^T -> dV, dP^T -> dS^T -> dK that both warpgroups wait through at the same time. Here
// warpgroup 0 issues its dQ / S^T / dP^T wgmmas, then warpgroup 1 (named barriers 5 and 6 order the
// two issue blocks every step), so one's softmax and dS^T run under the other's wgmmas. What the
// CTA barrier did: the Q / dO / LSE / D stage is complete on full_qdo (TMA bytes + one arrival per
// LSE / D thread through cp.async.mbarrier.arrive), a stage is refilled only after empty_qdo (one
// arrival per warp after its step's last wgmma wait), and the hdim-64 dQ reads only its own
// warpgroup's dS^T rows, so a warpgroup barrier (3 + wg) publishes them and hands the dQ piece
// buffer over. Warpgroup 1, the one behind, issues the loads (it never waits for the other to
// free a stage).
// At hdim 128 the dQ of a step reads both warpgroups' dS^T halves, so pp there also orders the dS^T
// double buffer with mbarriers: ds_full[b] (every thread of both warpgroups arrives after storing
// and fencing its dS^T rows) before the dQ wgmmas read buffer b, ds_empty[b] (one arrival per warp
// once its dQ wgmmas that read b retired) before b is stored again; and the lagged dQ wgmmas go out
// with dV and dK, after dS^T (dQ first: its output then runs under them), so the wait for the other
// warpgroup's half comes half a step after that half was written.
// kWide (variant "ppwide", pp at hdim 64): 128 query rows per step instead of 64, so a step has the
// hdim-128 step's tensor work (5 GEMMs of 128 x 128 x 64) and every per-step fixed cost (barriers,
// waits, wgmma latency chains) is paid once per 128 rows: S^T and dP^T are m64n128 per warpgroup,
// dV / dK k-steps run over 128 rows, dS^T is [128 keys x 128 rows] in two column blocks of 64
// rows, and the dQ is split by rows as hdim 128 splits it by dims: warpgroup c computes rows
// 64c..64c+63 of the step over all 128 keys (dS^T column block c, both warpgroups' halves: the
// hdim-128 pp's ds_full / ds_empty order), so its accumulators are the hdim-128 kernel's count
// (S^T 64 + dP^T 64 + dV 32 + dK 32 + dQ 32 per thread) and its shared memory the same.
template <typename T, int kD, bool kTmaDq, bool kLag, bool kDq = true, bool kTmaLoad = false, bool kVarlen = false,
          bool kPingPong = false, bool kWarpDq = false, bool kWide = false>
__global__ void __launch_bounds__(kThreads, 1) flash_bwd_sm90_kernel(const BwdParams p,
                                                                     const __grid_constant__ CUtensorMap dq_map,
                                                                     const __grid_constant__ CUtensorMap q_map,
                                                                     const __grid_constant__ CUtensorMap do_map) {
#if IOATTN_SM90A_ENABLED
  using namespace sm90;
  static_assert(kD == 64 || kD == 128, "hdim 64 or 128");
  static_assert(kDq || (!kTmaDq && !kLag), "the dK/dV-only kernel (deterministic mode) has no dQ path");
  static_assert(!kTmaLoad || (kTmaDq && kLag), "TMA loads: the lag + TMA dQ variant only");
  static_assert(!kVarlen || (kTmaDq && kLag && kDq && (!kTmaLoad || kPingPong) && !kWarpDq) ||
                    (!kDq && !kTmaLoad),
                "varlen: the lag + TMA dQ instance, pp / ppwide, or the dK/dV-only one (deterministic mode)");
  static_assert(!kPingPong || kTmaLoad, "ping-pong: a tmald variant");
  static_assert(!kWarpDq || kPingPong, "per-warp dQ reduce-adds: a pp variant");
  static_assert(!kWide || (kPingPong && !kWarpDq && kD == 64), "128-row steps: variant pp at hdim 64");
  constexpr int kM = kWide ? 2 * kBM : kBM;  // query rows per step
  constexpr bool kDqWithDkv = kPingPong && (kD == 128 || kWide);  // the dQ wgmmas issued with dV / dK
  using C = Cfg<kD, kM>;
  constexpr int kTileQ = C::kTileQ, kTileK = C::kTileK, kTileDsM = C::kTileDsM;
  extern __shared__ uint8_t raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  if constexpr (C::kSlack < 1024) {  // see Cfg: never run on memory past the allocation
    if (base - raw > C::kSlack) __trap();
  }
  uint8_t* sk = base;
  uint8_t* sv = sk + kTileK;
  uint8_t* sq = sv + kTileK;       // [2 stages]
  uint8_t* sdo = sq + 2 * kTileQ;  // [2 stages]
  uint8_t* sds = sdo + 2 * kTileQ; // [2 parities]
  uint8_t* sdq = sds + 2 * kTileDsM; // kTmaDq: [2 parities][2 warpgroups] dQ pieces
  // kTmaLoad: the two Q/dO stages' mbarriers (full; kPingPong: and empty, and at hdim 128 the dS^T
  // buffers' ds_full / ds_empty), after the dQ pieces (Cfg::kSmemTmaLoad adds 64 bytes).
  [[maybe_unused]] uint64_t* full_qdo = reinterpret_cast<uint64_t*>(sdq + 4 * kDqPiece);
  [[maybe_unused]] uint64_t* empty_qdo = full_qdo + 2;  // kPingPong
  [[maybe_unused]] uint64_t* ds_full = full_qdo + 4;    // kPingPong at hdim 128
  [[maybe_unused]] uint64_t* ds_empty = full_qdo + 6;
  __shared__ __align__(16) float s_lse[2][kM];
  __shared__ __align__(16) float s_d[2][kM];

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, w = wtid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int dq_probe = dq_probe_bits();
  const int nb = blockIdx.x % p.num_n_blocks;
  const int hk = (blockIdx.x / p.num_n_blocks) % p.heads_kv;
  const int b = blockIdx.x / (p.num_n_blocks * p.heads_kv);
  const int n0 = nb * kBN;
  const bwd_detail::SeqInfo si = bwd_detail::seq_info_t<kVarlen>(p, b);
  const int sq_len = si.sq, sk_len = si.sk, q_start = si.q_start, k_start = si.k_start, off = sk_len - sq_len;
  if (kVarlen && n0 >= sk_len) return;  // this sequence has fewer keys (nothing issued yet)
  constexpr int es = static_cast<int>(sizeof(T));

  // K, V of the block, once.
  {
    const auto* kp = static_cast<const uint8_t*>(p.k) +
                     (b * p.k_batch + static_cast<int64_t>(k_start + n0) * p.k_seq + hk * p.k_head) * es;
    const auto* vp = static_cast<const uint8_t*>(p.v) +
                     (b * p.v_batch + static_cast<int64_t>(k_start + n0) * p.v_seq + hk * p.v_head) * es;
    load_rows<kBN, kD>(smem_u32(sk), kp, p.k_seq * es, sk_len - n0);
    load_rows<kBN, kD>(smem_u32(sv), vp, p.v_seq * es, sk_len - n0);
    ptx::cp_async_commit();
  }

  // Query rows that see a key of [n0, n_end): [i_begin, i_end) (the band is monotone in the row):
  // a right window (causal: 0) starts at the row whose band reaches key n0, a left window ends
  // at the last row whose band still reaches key n_end - 1.
  const int n_end = min(n0 + kBN, sk_len);
  const int i_begin = p.window_right >= 0 ? max(0, n0 - off - p.window_right) : 0;
  const int i_end = p.window_left >= 0 ? min(sq_len, n_end - off + p.window_left) : sq_len;
  const int m_first = i_begin / kM;
  const int per_head = i_end > i_begin ? (i_end + kM - 1) / kM - m_first : 0;
  const int steps = per_head * p.group;

  // Steps walk (query head of the group, query block) in order; the issuing and the computing
  // step keep their own counters (no integer division per step).
  int iss_h = 0, iss_m = 0;
  auto issue = [&](int step) {  // Q, dO, LSE, D of step into stage step & 1; called for 0, 1, 2, ...
    if (step >= steps) return;
    const int h = hk * p.group + iss_h, m0 = (m_first + iss_m) * kM, st = step & 1;
    if (++iss_m == per_head) iss_m = 0, ++iss_h;
    const auto* qp = static_cast<const uint8_t*>(p.q) +
                     (b * p.q_batch + static_cast<int64_t>(q_start + m0) * p.q_seq + h * p.q_head) * es;
    const auto* dp = static_cast<const uint8_t*>(p.dout) +
                     (b * p.do_batch + static_cast<int64_t>(q_start + m0) * p.do_seq + h * p.do_head) * es;
    // kPingPong: warpgroup 1 loads (thread 128: Q / dO, threads 128..191: LSE / D), once both
    // warpgroups are done with the step that used the stage last.
    constexpr int kLoader = kPingPong ? 128 : 0;
    if constexpr (kPingPong) {
      if (tid >= kLoader && tid < kLoader + kM && step >= 2)
        mbarrier_wait_or_trap(&empty_qdo[st], ((step - 2) >> 1) & 1);
    }
    if constexpr (kTmaLoad) {
      (void)qp, (void)dp;
      if (tid == kLoader) {
        mbarrier_arrive_expect_tx(&full_qdo[st], 2 * kTileQ);
#pragma unroll
        for (int cb = 0; cb < kD / 64; ++cb) {
          // (varlen: ragged maps, rows past the sequence read as zeros)
          tma_load_rows(kVarlen, sq + st * kTileQ + cb * kM * 128, &q_map, &full_qdo[st], cb * 64, h, b, q_start,
                        sq_len, m0);
          tma_load_rows(kVarlen, sdo + st * kTileQ + cb * kM * 128, &do_map, &full_qdo[st], cb * 64, h, b, q_start,
                        sq_len, m0);
        }
      }
    } else {
      load_rows<kM, kD>(smem_u32(sq + st * kTileQ), qp, p.q_seq * es, sq_len - m0);
      load_rows<kM, kD>(smem_u32(sdo + st * kTileQ), dp, p.do_seq * es, sq_len - m0);
    }
    // (written so that the other variants compile to exactly the instructions measured before)
    if (kPingPong ? (tid >= kLoader && tid < kLoader + kM) : tid < kM) {  // same cp.async group as the tiles
      const int r = tid - kLoader, i = m0 + r;
      const int64_t wrow = static_cast<int64_t>(h) * p.rows_q +
                           (kVarlen ? static_cast<int64_t>(q_start) : static_cast<int64_t>(b) * sq_len) + i;
      if (i < sq_len) {
        ptx::cp_async_4(ptx::smem_u32(&s_lse[st][r]), p.ws_lse + wrow, 4);
        ptx::cp_async_4(ptx::smem_u32(&s_d[st][r]), p.ws_d + wrow, 4);
        if constexpr (kPingPong) cp_async_mbarrier_arrive_noinc(&full_qdo[st]);  // once both have landed
      } else {
        s_lse[st][r] = kPosInf;  // rows past the end: P = 0
        s_d[st][r] = 0.f;
        if constexpr (kPingPong) mbarrier_arrive(&full_qdo[st]);
      }
    }
  };

  float dv[kD / 2], dk[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) dv[i] = 0.f, dk[i] = 0.f;

  if constexpr (kTmaLoad) {
    if (tid == 0) {
      // kPingPong: + one arrival per LSE / D thread; empty: one per warp
      mbarrier_init(&full_qdo[0], kPingPong ? 1 + kM : 1);
      mbarrier_init(&full_qdo[1], kPingPong ? 1 + kM : 1);
      if (kPingPong) mbarrier_init(&empty_qdo[0], kThreads / 32), mbarrier_init(&empty_qdo[1], kThreads / 32);
      if (kDqWithDkv) mbarrier_init(&ds_full[0], kThreads), mbarrier_init(&ds_full[1], kThreads);
      if (kDqWithDkv) mbarrier_init(&ds_empty[0], kThreads / 32), mbarrier_init(&ds_empty[1], kThreads / 32);
      fence_mbarrier_init();
    }
    __syncthreads();  // the barriers initialised before anyone waits on them
  }
  issue(0);
  ptx::cp_async_commit();
  if constexpr (kPingPong) {
    // K, V (cp.async by every thread) for everyone, once; then the loop has no CTA barrier.
    ptx::cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (wg == 1 && steps > 0) named_barrier_arrive(5, 256);  // warpgroup 0 issues first
  }
  // Every wgmma operand's descriptor is built here once and stepped by constants (desc_advance).
  // S^T / dP^T A: K / V rows 64c.. of column block 0 (1024-aligned), K-major; their B: Q / dO stage 0,
  // K-major; dV / dK B: the same stages read MN-major.
  const uint64_t k_desc = make_desc_sw128(smem_u32(sk) + wg * 64 * 128, 16, 1024);
  const uint64_t v_desc = make_desc_sw128(smem_u32(sv) + wg * 64 * 128, 16, 1024);
  const uint64_t q_kdesc = make_desc_sw128(smem_u32(sq), 16, 1024), do_kdesc = make_desc_sw128(smem_u32(sdo), 16, 1024);
  const uint64_t q_mdesc = make_desc_sw128(smem_u32(sq), kM * 128, 1024);
  const uint64_t do_mdesc = make_desc_sw128(smem_u32(sdo), kM * 128, 1024);
  // dQ wgmmas (see Cfg) of the step whose dS^T is in buffer `buf` (issue only): hdim 128,
  // dQ[:, 64wg..] = dS K[:, 64wg..] over both warpgroups' keys; hdim 64, dQ_wg = dS[:, own keys]
  // K[own keys, :]. A = dS^T (MN-major, transposed), B = K (MN-major).
  // kWide: dQ[rows 64wg.., :] = dS[rows 64wg.., all keys] K: A = dS^T column block wg, B = all of K.
  const uint64_t ds_desc =
      make_desc_sw128(smem_u32(sds) + (kWide ? wg * kBN * 128 : kD == 128 ? 0 : wg * 8192), kBN * 128, 1024);
  const uint64_t kdq_desc =
      make_desc_sw128(smem_u32(sk) + (kWide ? 0 : wg * (kD == 128 ? kBN * 128 : 8192)), kBN * 128, 1024);
  auto gemm_dq = [&](float(&dq)[kBM / 2], int buf) {
    const uint64_t ds_d = desc_advance(ds_desc, buf * kTileDsM);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < (kD == 128 || kWide ? kBN : kBN / 2) / 16; ++kk)
      Wgmma<kBM, T>::template ss<1, 1>(dq, desc_advance(ds_d, kk * 2048), desc_advance(kdq_desc, kk * 2048), kk > 0);
  };
  // dQ partial by red.global (the variants without kTmaDq; probe 3).
  auto red_dq = [&](const float(&dq)[kBM / 2], int ph, int pm0) {
    constexpr int kDqCols = kD == 128 ? 64 : 0;  // column offset per warpgroup
    // red.global: this thread's first element, pinned so that every reduction is one [R+imm]
    // instruction; rows past the end are skipped.
    float* ws = pin_ptr(p.ws_dq +
                        (static_cast<int64_t>(ph) * p.rows_q + static_cast<int64_t>(b) * sq_len + pm0 + 16 * w + g) * kD +
                        kDqCols * wg + 2 * t);
    const int valid = sq_len - pm0 - 16 * w - g;  // rows r0 and r0 + 8 exist when > 0 and > 8
    if (pm0 + kBM <= sq_len) {  // whole block inside: no predicates (ptxas branches around each)
#pragma unroll
      for (int i = 0; i < kBM / 8; ++i) {
        ptx::red_add_v2_f32(ws + 8 * i, dq[4 * i], dq[4 * i + 1]);
        ptx::red_add_v2_f32(ws + 8 * kD + 8 * i, dq[4 * i + 2], dq[4 * i + 3]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kBM / 8; ++i) {
        red_add_v2_f32_if(ws + 8 * i, dq[4 * i], dq[4 * i + 1], valid > 0);
        red_add_v2_f32_if(ws + 8 * kD + 8 * i, dq[4 * i + 2], dq[4 * i + 3], valid > 8);
      }
    }
  };
  // dQ partial of the step at (query head ph, rows pm0..) into the fp32 workspace; pbuf = its dS^T
  // buffer parity (kTmaDq: also its piece buffer).
  auto put_dq = [&](const float(&dq)[kBM / 2], int ph, int pm0, int pbuf) {
    // dQ partial (rows 16w + g (+8), dims c0 + 8i + 2t (+1); c0 = 64wg at hdim 128, 0 at 64) into
    // the fp32 workspace.
    constexpr int kDqCols = kD == 128 ? 64 : 0;  // column offset per warpgroup
    if constexpr (kTmaDq) {
      // Into this step's piece (conflict-free: the 8 rows g of a store hit 8 different chunks),
      // then one thread of the warpgroup adds it with two reduce-adds (32 dims each).
      if (!kWide && (dq_probe & 3) == 3) return red_dq(dq, ph, pm0);
      uint8_t* piece = sdq + (pbuf * 2 + wg) * kDqPiece;
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          if (dq_probe & 16) continue;
          const uint32_t addr = smem_u32(piece) + dq_piece_off(16 * w + g + 8 * rh, 8 * i + 2 * t);
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(dq[4 * i + 2 * rh]),
                       "f"(dq[4 * i + 2 * rh + 1])
                       : "memory");
        }
      fence_proxy_async();
      if constexpr (kWarpDq) {
        // Variant ppw: a warp stores and reads back only its own 16 rows of the piece, so its lane 0
        // adds them itself (the host's dq_map has [16 rows x 32 floats] boxes; a box at a multiple of
        // 16 rows starts 1024-byte aligned, in the piece's swizzle phase): no warpgroup barrier.
        __syncwarp();
        if (lane == 0) {
          const int plane = ph * p.batch + b, prow = pm0 + 16 * w;
          tma_reduce_add_3d(&dq_map, piece + 16 * w * 128, kDqCols * wg, prow, plane);
          tma_reduce_add_3d(&dq_map, piece + kBM * 128 + 16 * w * 128, kDqCols * wg + 32, prow, plane);
          bulk_commit_group();
        }
      } else {
        named_barrier_sync(1 + wg, 128);
        if (wtid == 0) {
          // the workspace's [heads_q, batch, seqlen_q] rows (varlen: [heads_q, total_q], a ragged map
          // that skips the rows past the sequence)
          const int plane = ph * p.batch + b, prow = pm0 + (kWide ? 64 * wg : 0);
          if constexpr (kVarlen) {  // (trace builds' dQ probes 1 / 2 apply to the dense instances only)
            tma_reduce_add_ragged(&dq_map, piece, kDqCols * wg, ph, q_start, sq_len, prow);
            tma_reduce_add_ragged(&dq_map, piece + kBM * 128, kDqCols * wg + 32, ph, q_start, sq_len, prow);
          } else
#if IOATTN_BWD_TRACE
          if ((dq_probe & 3) == 1) {
          } else if ((dq_probe & 3) == 2) {
#pragma unroll
            for (int hb = 0; hb < 2; ++hb)
              asm volatile(
                  "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                      reinterpret_cast<uint64_t>(&dq_map)),
                  "r"(smem_u32(piece + hb * kBM * 128)), "r"(kDqCols * wg + 32 * hb), "r"(prow), "r"(plane)
                  : "memory");
          } else
#endif
          {
            tma_reduce_add_3d(&dq_map, piece, kDqCols * wg, prow, plane);
            tma_reduce_add_3d(&dq_map, piece + kBM * 128, kDqCols * wg + 32, prow, plane);
          }
          bulk_commit_group();
        }
      }
    } else {
      red_dq(dq, ph, pm0);
    }
  };
  int cur_h = 0, cur_m = 0, prev_h = 0, prev_m0 = 0;
  // The thread that issues (and so waits for) this thread's dQ reduce-adds: one per warpgroup, or
  // (ppw) one per warp.
  const bool dq_issuer = kWarpDq ? lane == 0 : wtid == 0;
  for (int step = 0; step < steps; ++step) {
    if constexpr (kPingPong) {
      if (dq_issuer) bulk_wait_group_read<1>();  // this step's dQ piece buffer (see below)
      BWD_TRACE(step, 10);
      mbarrier_wait_or_trap(&full_qdo[step & 1], (step >> 1) & 1);  // Q, dO, LSE, D of this step
      BWD_TRACE(step, 9);
      // The piece buffer handed over; hdim 64: this warpgroup's dS^T rows of step - 1 (stored and
      // fenced there) published for its dQ wgmmas (hdim 128: ds_full). Then the issue order:
      // warpgroup 0 first.
      named_barrier_sync(3 + wg, 128);
      // Warpgroup 1 loads step + 1 here, before waiting for its turn (warpgroup 0, ahead, is done
      // with step - 1 by now, so the empty wait inside rarely waits), a whole step ahead of
      // warpgroup 0's need; every thread calls issue once per step (its counters).
      issue(step + 1);
      ptx::cp_async_commit();
      named_barrier_sync(wg == 0 ? 5 : 6, 256);
    } else {
      ptx::cp_async_wait<0>();
      fence_proxy_async();  // this thread's cp.async writes, visible to the wgmma (async proxy) reads
      // kLag + kTmaDq: the barrier also hands over the dQ piece buffer written in this step, free
      // once the reduce-adds issued from it two steps ago have read it.
      if (kLag && kTmaDq && wtid == 0) bulk_wait_group_read<1>();
      BWD_TRACE(step, 10);
      // Q, dO of this step (trap rather than hang while the variant is unverified on a GPU)
      if constexpr (kTmaLoad) mbarrier_wait_or_trap(&full_qdo[step & 1], (step >> 1) & 1);
      BWD_TRACE(step, 9);
      __syncthreads();  // stage step & 1 landed for everyone; everyone is done with step - 1
    }
    BWD_TRACE(step, 0);
    const int st = step & 1, h = hk * p.group + cur_h, m0 = (m_first + cur_m) * kM;
    if (++cur_m == per_head) cur_m = 0, ++cur_h;
    const uint64_t q_sk = desc_advance(q_kdesc, st * kTileQ), do_sk = desc_advance(do_kdesc, st * kTileQ);
    const uint64_t q_sm = desc_advance(q_mdesc, st * kTileQ), do_sm = desc_advance(do_mdesc, st * kTileQ);

    // S^T and dP^T (64 keys x 64 rows each) in two commit groups, so P^T (and the dV wgmmas that
    // need only P^T) start while dP^T is still on the tensor cores.
    float s[kM / 2], dp[kM / 2];
    auto gemm_sdp = [&](float(&acc)[kM / 2], uint64_t a_desc, uint64_t b_desc) {
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const uint32_t col = kk / 4, byte = (kk % 4) * 32;
        Wgmma<kM, T>::template ss<0>(acc, desc_advance(a_desc, col * kBN * 128 + byte),
                                      desc_advance(b_desc, col * kM * 128 + byte), kk > 0);
      }
    };
    // kLag: first the previous step's dQ wgmmas (its dS^T is in the other buffer, published by the
    // barrier above; step 0 computes a throw-away product of the still unwritten buffer 1 —
    // intentionally: the commit groups and waits are then the same every step, the result is
    // never read, and the read completes before step 1 writes that buffer), then S^T and dP^T;
    // the dQ output below runs while those are on the tensor cores.
    float dq[kBM / 2];
    if constexpr (kLag && !kDqWithDkv) {
      gemm_dq(dq, st ^ 1);
      wgmma_commit();
    }
    wgmma_fence();
    gemm_sdp(s, k_desc, q_sk);
    wgmma_commit();
    gemm_sdp(dp, v_desc, do_sk);
    wgmma_commit();
    if constexpr (kPingPong) {  // the other warpgroup's turn (warpgroup 1's last step has no next)
      if (wg == 0)
        named_barrier_arrive(6, 256);
      else if (step + 1 < steps)
        named_barrier_arrive(5, 256);
    } else {
      issue(step + 1);  // stage (step + 1) & 1 was last read by step - 1's wgmmas, all complete
      ptx::cp_async_commit();
    }
    BWD_TRACE(step, 1);
    if constexpr (kDqWithDkv) {  // (the trace's "wait dQ" / "put_dq" are 0 here: both fall
      BWD_TRACE(step, 2);                  // in "wait all")
      BWD_TRACE(step, 3);
    }
    if constexpr (kLag && !kDqWithDkv) {
      wgmma_wait<2>();  // the dQ wgmmas (S^T and dP^T may still run)
#pragma unroll
      for (int i = 0; i < kBM / 2; ++i) reg_fence(dq[i]);
      BWD_TRACE(step, 2);
      if (step > 0) put_dq(dq, prev_h, prev_m0, st ^ 1);
      prev_h = h, prev_m0 = m0;
      BWD_TRACE(step, 3);
    }

    // P^T (in place of S^T, fp32), dS^T; fragment element e: key 64wg + 16w + g (+8 when
    // e % 4 >= 2), row 8(e/4) + 2t + e%2. Blocks inside both sequences and wholly inside the
    // window band skip the mask (as the mma.sync kernel's needs_mask); masked elements get P = 0
    // and so dS = 0.
    uint32_t pa[kM / 4], da[kM / 4];
    uint8_t* ds_buf = sds + st * kTileDsM;
    const uint32_t ds_s = smem_u32(ds_buf);
    const int key_l = 64 * wg + 16 * w + g;
    const bool needs_mask = n0 + kBN > sk_len || m0 + kM > sq_len ||
                            (p.window_right >= 0 && n0 + kBN - 1 - m0 - off > p.window_right) ||
                            (p.window_left >= 0 && n0 - (m0 + kM - 1) - off < -p.window_left);
    // LSE and D of this thread's 16 rows: rows 8k + 2t and 8k + 2t + 1 as one 8-byte load each,
    // issued before the wait for the scores that use them. kWide (32 rows): read where used
    // instead (64 more live registers beside S^T / dP^T spilled).
    constexpr int kPre = kWide ? 1 : kM / 8;
    float2 lse2[kPre], d2[kPre];
    auto load_rows2 = [&](float2(&dst)[kPre], const float* src) {
      if constexpr (!kWide) {
#pragma unroll
        for (int k = 0; k < kM / 8; ++k) dst[k] = *reinterpret_cast<const float2*>(src + 8 * k + 2 * t);
      }
    };
    auto pick_at = [&](const float2(&v)[kPre], const float* src, int e) {
      if constexpr (kWide) return src[8 * (e / 4) + 2 * t + (e % 2)];
      else return (e % 2) ? v[e / 4].y : v[e / 4].x;
    };
    auto p_part = [&](auto mask_tag) {
      constexpr bool kMask = decltype(mask_tag)::value;
#pragma unroll
      for (int e = 0; e < kM / 2; ++e) {
        const int r = 8 * (e / 4) + 2 * t + (e % 2), kl = key_l + ((e % 4) >= 2 ? 8 : 0);
        s[e] = ptx::exp2_approx(s[e] * p.scale_log2 - pick_at(lse2, s_lse[st], e));
        if (kMask && !bwd_detail::visible(m0 + r, n0 + kl, sq_len, sk_len, off, p.window_left, p.window_right))
          s[e] = 0.f;
        if (kDqWithDkv && (e % 2) == 1) pa[e / 2] = ptx::pack2<T>(s[e - 1], s[e]);  // s dies
      }
      if constexpr (!kDqWithDkv) {
#pragma unroll
        for (int j = 0; j < kM / 4; ++j) pa[j] = ptx::pack2<T>(s[2 * j], s[2 * j + 1]);
      }
    };
    // dS^T as the MN-major A of dQ = dS K: (key, row) at row `key`, 16-bit column `row`; the pair
    // (rows r, r + 1; r even) of da[j] (`word`) is one aligned 32-bit word of the swizzled row.
    auto store_ds = [&](int j, uint32_t word) {
      const int e = 2 * j, kl = key_l + ((e % 4) >= 2 ? 8 : 0);
      // kWide: rows 64.. in the second column block ([128 keys x 64 rows] each)
      const int rb = kWide ? (e / 4) / 8 : 0, r = 8 * (e / 4 - 8 * rb) + 2 * t;
      const uint32_t addr = ds_s + static_cast<uint32_t>(rb * kBN * 128 + kl * 128 +
                                                         ((((r * 2) >> 4) ^ (kl & 7)) << 4) + ((r * 2) & 15));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(word) : "memory");
    };
    auto ds_part = [&]() {
#pragma unroll
      for (int j = 0; j < kM / 4; ++j) {
        const int e = 2 * j;
        float p0 = s[e], p1 = s[e + 1];
        if constexpr (kDqWithDkv) unpack2<T>(pa[j], p0, p1);  // P^T as dV sees it (s is dead)
        da[j] = ptx::pack2<T>(p0 * (dp[e] - pick_at(d2, s_d[st], e)), p1 * (dp[e + 1] - pick_at(d2, s_d[st], e + 1)));
        if constexpr (kDq && !kDqWithDkv) store_ds(j, da[j]);
      }
      // kDqWithDkv: buffer st is stored only now, after the arithmetic: its last readers were both
      // warpgroups' dQ wgmmas of the previous step (step 0: nothing; step 1: step 0's throw-away
      // product), and the other warpgroup's may still be running.
      if constexpr (kDqWithDkv) {
        if (step >= 1) mbarrier_wait_or_trap(&ds_empty[st], ((step - 1) >> 1) & 1);
        if (dq_probe & 8) {
        } else if (!kWide && (dq_probe & 4)) {
          // stmatrix: registers da[4m..4m+3] are the 8x8 (keys x rows) matrices (keys +0 / +8) x
          // (rows 16m.. / 16m + 8..); lane l addresses key row l % 8 of matrix l / 8.
          const int q = lane >> 3, kl = 64 * wg + 16 * w + 8 * (q & 1) + (lane & 7);
#pragma unroll
          for (int m = 0; m < kM / 16; ++m) {
            const int i = 2 * m + (q >> 1);
            stmatrix_x4(ds_s + static_cast<uint32_t>(kl * 128 + ((i ^ (lane & 7)) << 4)), da[4 * m], da[4 * m + 1],
                        da[4 * m + 2], da[4 * m + 3]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < kM / 4; ++j) store_ds(j, da[j]);
        }
      }
    };
    // dV += P^T dO, dK += dS^T Q (k-steps of 16 query rows; B MN-major).
    auto gemm_dkv = [&](float(&acc)[kD / 2], const uint32_t(&a)[kM / 4], uint64_t b_desc) {
#pragma unroll
      for (int kk = 0; kk < kM / 16; ++kk) {
        const uint32_t af[4] = {a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3]};
        Wgmma<kD, T>::template rs<1>(acc, af, desc_advance(b_desc, kk * 2048), 1);
      }
    };
    load_rows2(lse2, s_lse[st]);
    wgmma_wait<1>();  // S^T (dP^T may still run)
#pragma unroll
    for (int i = 0; i < kM / 2; ++i) reg_fence(s[i]);
    BWD_TRACE(step, 4);
    if (needs_mask)
      p_part(std::true_type{});
    else
      p_part(std::false_type{});
    if constexpr (!kDqWithDkv) {  // dV under dP^T
      wgmma_fence();
      gemm_dkv(dv, pa, do_sm);
      wgmma_commit();
    }
    BWD_TRACE(step, 5);
    load_rows2(d2, s_d[st]);
    wgmma_wait<kDqWithDkv ? 0 : 1>();  // dP^T (dV may still run; kDqWithDkv: nothing)
#pragma unroll
    for (int i = 0; i < kM / 2; ++i) reg_fence(dp[i]);
    BWD_TRACE(step, 6);
    ds_part();
    wgmma_fence();
    if constexpr (kDqWithDkv) {
      // This thread's dS^T rows to the async proxy, then counted on ds_full[st]; the previous
      // step's two halves (buffer st ^ 1) complete before its dQ wgmmas (step 0: the throw-away
      // product of buffer 1, no wait).
      BWD_TRACE(step, 11);
      fence_proxy_async();
      mbarrier_arrive(&ds_full[st]);
      if (step >= 1) mbarrier_wait_or_trap(&ds_full[st ^ 1], ((step - 1) >> 1) & 1);
      BWD_TRACE(step, 12);
      gemm_dq(dq, st ^ 1);  // (its own wgmma_fence)
      wgmma_commit();
      // dV only now, after dS^T has read the packed P^T
      gemm_dkv(dv, pa, do_sm);
      wgmma_commit();
    }
    gemm_dkv(dk, da, q_sm);
    wgmma_commit();
    BWD_TRACE(step, 7);
    if constexpr (kDqWithDkv) {
      wgmma_wait<2>();  // the dQ wgmmas (dV and dK may still run): its output under them
#pragma unroll
      for (int i = 0; i < kBM / 2; ++i) reg_fence(dq[i]);
      BWD_TRACE(step, 13);
      __syncwarp();  // this warp's reads of dS^T buffer st ^ 1 are done
      if (lane == 0) mbarrier_arrive(&ds_empty[st ^ 1]);
      if (step > 0) put_dq(dq, prev_h, prev_m0, st ^ 1);
      prev_h = h, prev_m0 = m0;
      BWD_TRACE(step, 14);
    }
    if constexpr (!kDq || kLag) {
      // dS^T for the next step's dQ wgmmas (after its first barrier; kDqWithDkv fenced before ds_full)
      if (kDq && !kDqWithDkv) fence_proxy_async();
      wgmma_wait<0>();  // dV, dK: nothing stays in flight across iterations
#pragma unroll
      for (int i = 0; i < kD / 2; ++i) reg_fence(dv[i]), reg_fence(dk[i]);
      if constexpr (kPingPong) {  // this warp is done with stage st (its wgmmas and LSE / D reads)
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&empty_qdo[st]);
      }
      BWD_TRACE(step, 8);
    } else {
      // dS^T visible to the async proxy, then the dQ wgmmas. kTmaDq: the barrier below also hands
      // this step's dQ piece buffer over, free once the reduce-adds issued from it two steps ago
      // have read it (this warpgroup's issuing thread waits here).
      if (kTmaDq && wtid == 0) bulk_wait_group_read<1>();
      fence_proxy_async();
      if constexpr (kD == 128)
        __syncthreads();
      else
        named_barrier_sync(1 + wg, 128);  // this warpgroup's dS^T rows only
      gemm_dq(dq, st);
      wgmma_commit();
      wgmma_wait<0>();  // dV, dK and dQ
#pragma unroll
      for (int i = 0; i < kD / 2; ++i) reg_fence(dv[i]), reg_fence(dk[i]);
#pragma unroll
      for (int i = 0; i < kBM / 2; ++i) reg_fence(dq[i]);
      put_dq(dq, h, m0, st);
    }
  }
  if constexpr (kDq && kLag) {  // the last step's dQ
    if (steps > 0) {
      if (kTmaDq && dq_issuer) bulk_wait_group_read<1>();
      if constexpr (kPingPong) {
        named_barrier_sync(3 + wg, 128);  // the piece buffer; hdim 64: this warpgroup's own dS^T rows
        if constexpr (kDqWithDkv) mbarrier_wait_or_trap(&ds_full[(steps - 1) & 1], ((steps - 1) >> 1) & 1);
      } else {
        __syncthreads();
      }
      float dq[kBM / 2];
      gemm_dq(dq, (steps - 1) & 1);
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kBM / 2; ++i) reg_fence(dq[i]);
      put_dq(dq, prev_h, prev_m0, (steps - 1) & 1);
    }
  }
  ptx::cp_async_wait<0>();
  if (kTmaDq && dq_issuer) bulk_wait_group<0>();  // the last pieces read (and added) before exit

  // dK (scaled), dV: keys 64wg + 16w + g (+8), dims 8i + 2t (+1); as 16-byte vectors when the
  // tensors allow (store_acc_row, IOATTN_BWD_DKV_VEC).
  T* dkp = static_cast<T*>(p.dk) + b * p.dk_batch + static_cast<int64_t>(k_start) * p.dk_seq + hk * p.dk_head;
  T* dvp = static_cast<T*>(p.dv) + b * p.dv_batch + static_cast<int64_t>(k_start) * p.dv_seq + hk * p.dv_head;
  const bool vec = IOATTN_BWD_DKV_VEC && vec16_ok<T>(p.dk, p.dk_batch, p.dk_seq, p.dk_head) &&
                   vec16_ok<T>(p.dv, p.dv_batch, p.dv_seq, p.dv_head);
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int j = n0 + 64 * wg + 16 * w + g + 8 * rh;
    store_acc_row<T, kD>(dkp + static_cast<int64_t>(j) * p.dk_seq, dk, rh, p.scale, lane, vec, j < sk_len);
    store_acc_row<T, kD>(dvp + static_cast<int64_t>(j) * p.dv_seq, dv, rh, 1.0f, lane, vec, j < sk_len);
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __trap();  // an sm_90 image without the "a" features (wgmma): never silently write nothing
#endif
}

// ---- hdim 256 -----------------------------------------------------------------------------------
// At hdim 256 the order above does not fit: dK and dV of 64 keys x 256 dims are 256 fp32 registers
// per thread of one warpgroup. Here a CTA owns 64 keys and its two warpgroups split the head dim of
// every output: warpgroup c accumulates dV[:, 128c..], dK[:, 128c..] (64 + 64 registers). The two
// score-sized GEMMs of a step are one per warpgroup (rows = the step's 64 query rows, keys = the
// CTA's 64 keys, k = the 256 dims):
//   warpgroup 0: S  = Q K^T  -> P  = exp2(S·scale·log2e − LSE·log2e), masked to 0     ss m64n64, K-major
//   warpgroup 1: dP = dO V^T -> dS = P ∘ (dP − D), P read back from shared memory    ss m64n64, K-major
// P and dS go to shared memory row-major ([64 rows x 64 keys], one SW128 atom column, 8 KB each,
// two buffers alternating per step), from where both warpgroups' output GEMMs read them:
//   dV_c += P^T dO[:, 128c..]    ss m64n128, A = P read transposed (MN-major), B = dO MN-major
//   dK_c += dS^T Q[:, 128c..]    ss m64n128, A = dS read transposed,        B = Q MN-major
// dV / dK stay on the tensor cores into the next step: its S / dP is queued behind them, and the
// step's stage and buffers are released once they retire (wgmma_wait<1> after the next issue).
// dQ: by default (and in deterministic mode) from the second kernel below, flash_bwd_sm90_d256_dq_kernel
// (no atomics); with kDq (IOATTN_BWD_SM90_D256_DQ=red|v4) this kernel also computes
//   dQ_c  = dS K[:, 128c..]      ss m64n128, A = dS K-major,               B = K MN-major
// and adds it to the fp32 workspace by red.global while dV and dK run — which session 19 measured
// spending ~45% of the step in the reductions (docs/PERF.md). Shared memory per step: 128 KB read by
// S / dP (the 128 B/clock limit of an ss m64n64: 1,024 cycles, as their tensor time), 96-144 KB by
// the output GEMMs, 64 KB of Q / dO landing, 16 KB of P / dS.
// Q and dO by TMA ([64 rows x 64 dims] boxes, rows past seqlen_q zero-filled), two stages, issued a
// step ahead by thread 128 once both warpgroups released the stage (empty: one arrival per warp);
// K, V once per CTA by cp.async. LSE / D: each thread's two rows (16w + g, +8) straight from the
// workspace into registers. Shared memory: K, V 64 KB, Q / dO 2 x 64 KB, P / dS 2 x 16 KB = 224 KB.
namespace d256 {
constexpr int kD = 256, kBN = 64, kBM = 64;
constexpr int kTile = 64 * kD * 2;   // 32 KB: K, V, or one stage of Q / dO ([64 rows x 256 dims])
constexpr int kTileP = 64 * 64 * 2;  // 8 KB: P or dS ([64 rows x 64 keys])
constexpr int kSmem = 6 * kTile + 4 * kTileP + 64 + 1024;  // + mbarriers, + alignment slack

// S = Q K^T (warpgroup 0) or dP = dO V^T (warpgroup 1): 64 rows x 64 keys over 256 dims, both
// operands K-major in [64 x 256] SW128 tiles (column block kk / 4, 32 bytes per k-step); one commit
// group, not waited (the caller retires the previous step's group first, then this one).
template <typename T>
__device__ __forceinline__ void issue_scores(float (&acc)[32], uint64_t a_desc, uint64_t b_desc) {
  using namespace sm90;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t at = (kk / 4) * 64 * 128 + (kk % 4) * 32;
    Wgmma<kBN, T>::template ss<0>(acc, desc_advance(a_desc, at), desc_advance(b_desc, at), kk > 0);
  }
  wgmma_commit();
}

// Byte address of the 32-bit word holding fragment elements (2j, 2j + 1) in a row-major [64 rows x
// 64 keys] SW128 tile: element e is row r0 + 8 ((e >> 1) & 1), key 8 (e >> 2) + 2t + (e & 1), so
// the pair is row r0 + 8 (j & 1), 16-byte chunk (j >> 1) ^ (row % 8) (row % 8 = g), bytes 4t.
__device__ __forceinline__ uint32_t pds_word(uint32_t buf, int r0, int g, int t, int j) {
  const int r = r0 + 8 * (j & 1), c = j >> 1;
  return buf + static_cast<uint32_t>(r * 128 + ((c ^ g) << 4) + 4 * t);
}

// Warpgroup 0: P = exp2(S·scale·log2e − x) (x = its rows' LSE·log2e), masked to 0 outside the band
// and the sequences, into buffer pbuf, then handed to warpgroup 1 (named barrier 1). Warpgroup 1:
// dS = P ∘ (dP − x) (x = its rows' D), P read back from pbuf, into dsbuf. Both buffers fenced for
// the async proxy; the caller's barrier then publishes them to both warpgroups' wgmmas.
template <typename T>
__device__ __forceinline__ void p_ds(float (&acc)[32], const float (&x)[2], int wg, int r0, int g, int t,
                                     uint32_t pbuf, uint32_t dsbuf, bool needs_mask, int m0, int n0,
                                     const BwdParams& p, int sq_len, int sk_len, [[maybe_unused]] int step) {
  using namespace sm90;
  [[maybe_unused]] const int wtid = threadIdx.x & 127;  // (BWD_TRACE)
  if (wg == 0) {
    auto exps = [&](auto mask_tag) {  // the mask test only where a block needs it (no branch per score)
#pragma unroll
      for (int e = 0; e < kBN / 2; ++e) {
        const int rh = (e >> 1) & 1;
        acc[e] = ptx::exp2_approx(acc[e] * p.scale_log2 - x[rh]);
        if (decltype(mask_tag)::value &&
            !bwd_detail::visible(m0 + r0 + 8 * rh, n0 + 8 * (e >> 2) + 2 * t + (e & 1), sq_len, sk_len,
                                 sk_len - sq_len, p.window_left, p.window_right))
          acc[e] = 0.f;
      }
    };
    if (needs_mask)
      exps(std::true_type{});
    else
      exps(std::false_type{});
    BWD_TRACE(step, 11);
#pragma unroll
    for (int j = 0; j < kBN / 4; ++j)
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(pds_word(pbuf, r0, g, t, j)),
                   "r"(ptx::pack2<T>(acc[2 * j], acc[2 * j + 1]))
                   : "memory");
    BWD_TRACE(step, 12);
    fence_proxy_async();                 // P for the wgmmas (async proxy) ...
    BWD_TRACE(step, 13);
    named_barrier_arrive(1, kThreads);  // ... and for warpgroup 1's dS
  } else {
    named_barrier_sync(1, kThreads);
    BWD_TRACE(step, 11);
    uint32_t pw[kBN / 4];  // all 16 loads first, so their latencies overlap
#pragma unroll
    for (int j = 0; j < kBN / 4; ++j)
      asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(pw[j]) : "r"(pds_word(pbuf, r0, g, t, j)) : "memory");
#pragma unroll
    for (int j = 0; j < kBN / 4; ++j) {
      float p0, p1;
      unpack2<T>(pw[j], p0, p1);
      const uint32_t dw = ptx::pack2<T>(p0 * (acc[2 * j] - x[j & 1]), p1 * (acc[2 * j + 1] - x[j & 1]));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(pds_word(dsbuf, r0, g, t, j)), "r"(dw) : "memory");
    }
    BWD_TRACE(step, 12);
    fence_proxy_async();
    BWD_TRACE(step, 13);
  }
}

// A block of 64 rows x 64 keys needs the mask unless it lies inside both sequences and wholly
// inside the window band.
__device__ __forceinline__ bool block_needs_mask(const BwdParams& p, int m0, int n0, int sq_len, int sk_len) {
  const int off = sk_len - sq_len;
  return n0 + kBN > sk_len || m0 + kBM > sq_len || (p.window_right >= 0 && n0 + kBN - 1 - m0 - off > p.window_right) ||
         (p.window_left >= 0 && n0 - (m0 + kBM - 1) - off < -p.window_left);
}

// This thread's two rows (r0, r0 + 8 past m0) of LSE·log2e (warpgroup 0) or D (warpgroup 1) from
// the workspace; rows past the end: LSE +inf (P = 0), D 0.
// row0: the workspace row of the sequence's first query (b·seqlen_q; varlen: its cu_seqlens_q entry).
__device__ __forceinline__ void load_x(float (&x)[2], const BwdParams& p, int wg, int h, int64_t row0, int m0,
                                       int r0, int sq_len) {
  const float* src = wg == 0 ? p.ws_lse : p.ws_d;
  const float fill = wg == 0 ? kPosInf : 0.f;
  const int64_t wrow = static_cast<int64_t>(h) * p.rows_q + row0 + m0 + r0;
  x[0] = m0 + r0 < sq_len ? src[wrow] : fill;
  x[1] = m0 + r0 + 8 < sq_len ? src[wrow + 8] : fill;
}
}  // namespace d256

// kRedV4 (IOATTN_BWD_SM90_D256_DQ=v4): dQ by red.global.add.v4 (half the reductions): lanes t and
// t ^ 1 swap one pair each, so an even lane adds 4 columns of row r0 and an odd lane 4 of r0 + 8.
// kVarlen (session 23; the default for varlen at hdim 256 since session 24, 1.9-2.1x mma.sync): packed
// sequences (bwd_detail::seq_info), Q / dO by TMA through ragged maps over the packed tokens (a tail
// step's rows past the sequence read as zeros), K / V and dK / dV at k_start; dQ by the pass only.
template <typename T, bool kDq, bool kRedV4 = false, bool kVarlen = false>
__global__ void __launch_bounds__(kThreads, 1) flash_bwd_sm90_d256_kernel(const BwdParams p,
                                                                          const __grid_constant__ CUtensorMap q_map,
                                                                          const __grid_constant__ CUtensorMap do_map) {
#if IOATTN_SM90A_ENABLED
  using namespace sm90;
  using d256::kBM;
  using d256::kBN;
  using d256::kD;
  using d256::kTile;
  using d256::kTileP;
  extern __shared__ uint8_t raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  uint8_t* sk = base;
  uint8_t* sv = sk + kTile;
  uint8_t* sq = sv + kTile;         // [2 stages]
  uint8_t* sdo = sq + 2 * kTile;    // [2 stages]
  uint8_t* sp = sdo + 2 * kTile;    // [2 parities]
  uint8_t* sds = sp + 2 * kTileP;   // [2 parities]
  uint64_t* full = reinterpret_cast<uint64_t*>(sds + 2 * kTileP);  // Q, dO of a stage landed
  uint64_t* empty = full + 2;                                       // both warpgroups done with a stage

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, w = wtid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int nb = blockIdx.x % p.num_n_blocks;
  const int hk = (blockIdx.x / p.num_n_blocks) % p.heads_kv;
  const int b = blockIdx.x / (p.num_n_blocks * p.heads_kv);
  const int n0 = nb * kBN;
  static_assert(!kVarlen || !kDq, "varlen: dQ by the pass");
  const bwd_detail::SeqInfo si = bwd_detail::seq_info_t<kVarlen>(p, b);
  const int sq_len = si.sq, sk_len = si.sk, q_start = si.q_start, k_start = si.k_start, off = sk_len - sq_len;
  if (kVarlen && n0 >= sk_len) return;  // this sequence has fewer keys (nothing issued yet)
  const int64_t row0 = kVarlen ? static_cast<int64_t>(q_start) : static_cast<int64_t>(b) * sq_len;
  constexpr int es = static_cast<int>(sizeof(T));

  {  // K, V of the block, once
    const auto* kp = static_cast<const uint8_t*>(p.k) +
                     (b * p.k_batch + static_cast<int64_t>(k_start + n0) * p.k_seq + hk * p.k_head) * es;
    const auto* vp = static_cast<const uint8_t*>(p.v) +
                     (b * p.v_batch + static_cast<int64_t>(k_start + n0) * p.v_seq + hk * p.v_head) * es;
    load_rows<kBN, kD>(smem_u32(sk), kp, p.k_seq * es, sk_len - n0);
    load_rows<kBN, kD>(smem_u32(sv), vp, p.v_seq * es, sk_len - n0);
    ptx::cp_async_commit();
  }
  // Query rows that see a key of [n0, n_end), as in the kernel above.
  const int n_end = min(n0 + kBN, sk_len);
  const int i_begin = p.window_right >= 0 ? max(0, n0 - off - p.window_right) : 0;
  const int i_end = p.window_left >= 0 ? min(sq_len, n_end - off + p.window_left) : sq_len;
  const int m_first = i_begin / kBM;
  const int per_head = i_end > i_begin ? (i_end + kBM - 1) / kBM - m_first : 0;
  const int steps = per_head * p.group;

  if (tid == 0) {
    mbarrier_init(&full[0], 1), mbarrier_init(&full[1], 1);
    mbarrier_init(&empty[0], kThreads / 32), mbarrier_init(&empty[1], kThreads / 32);
    fence_mbarrier_init();
  }
  // Q, dO of `step` into stage step & 1 (thread 128 only; called for 0, 1, 2, ... in order): once
  // both warpgroups are done with step - 2, the stage's previous user.
  int iss_h = 0, iss_m = 0;
  auto issue = [&](int step) {
    if (step >= steps) return;
    const int h = hk * p.group + iss_h, m0 = (m_first + iss_m) * kBM, st = step & 1;
    if (++iss_m == per_head) iss_m = 0, ++iss_h;
    if (step >= 2) mbarrier_wait_or_trap(&empty[st], ((step - 2) >> 1) & 1);
    mbarrier_arrive_expect_tx(&full[st], 2 * kTile);
#pragma unroll
    for (int cb = 0; cb < kD / 64; ++cb) {
      // (varlen: ragged maps, rows past the sequence read as zeros)
      tma_load_rows(kVarlen, sq + st * kTile + cb * kBM * 128, &q_map, &full[st], cb * 64, h, b, q_start, sq_len, m0);
      tma_load_rows(kVarlen, sdo + st * kTile + cb * kBM * 128, &do_map, &full[st], cb * 64, h, b, q_start, sq_len,
                    m0);
    }
  };
  ptx::cp_async_wait<0>();
  fence_proxy_async();  // K, V (this thread's cp.async writes) for the wgmma reads
  __syncthreads();      // ... everyone's, and the barriers initialised
  if (tid == 128) issue(0), issue(1);

  // This warpgroup's 128 columns; the first step's wgmmas overwrite them (no zeroing instructions:
  // with dV / dK in flight across iterations, ptxas serialises every wgmma (C7515) if ordinary
  // instructions define their registers anywhere in the loop's reach). steps == 0: zeros stored.
  float dv[kD / 4], dk[kD / 4];

  // Descriptors, built once and stepped by constants. S / dP: A = Q or dO stage 0, B = K or V, all
  // K-major. Output GEMMs: B = this warpgroup's 128 columns of dO / Q / K (MN-major; column blocks
  // 2c and 2c + 1, 8 KB apart); A = P / dS buffer 0, transposed (MN-major) for dV / dK, K-major for dQ.
  const uint64_t a_sdp = make_desc_sw128(smem_u32(wg == 0 ? sq : sdo), 16, 1024);
  const uint64_t b_sdp = make_desc_sw128(smem_u32(wg == 0 ? sk : sv), 16, 1024);
  const uint64_t do_mn = make_desc_sw128(smem_u32(sdo) + wg * 2 * kBM * 128, kBM * 128, 1024);
  const uint64_t q_mn = make_desc_sw128(smem_u32(sq) + wg * 2 * kBM * 128, kBM * 128, 1024);
  const uint64_t k_mn = make_desc_sw128(smem_u32(sk) + wg * 2 * kBN * 128, kBN * 128, 1024);
  const uint64_t p_mn = make_desc_sw128(smem_u32(sp), kBM * 128, 1024);
  const uint64_t ds_mn = make_desc_sw128(smem_u32(sds), kBM * 128, 1024);
  const uint64_t ds_k = make_desc_sw128(smem_u32(sds), 16, 1024);
  // This thread's rows of every fragment: r0 = 16w + g and r0 + 8 (both warpgroups hold the same rows).
  const int r0 = 16 * w + g;

  int cur_h = 0, cur_m = 0;
  for (int step = 0; step < steps; ++step) {
    const int st = step & 1, h = hk * p.group + cur_h, m0 = (m_first + cur_m) * kBM;
    if (++cur_m == per_head) cur_m = 0, ++cur_h;
    // LSE·log2e (warpgroup 0) or D (warpgroup 1) of rows r0, r0 + 8, loaded before the wait that
    // precedes their use; rows past the end: LSE +inf (P = 0), D 0.
    float x[2];
    d256::load_x(x, p, wg, h, row0, m0, r0, sq_len);
    BWD_TRACE(step, 10);
    mbarrier_wait_or_trap(&full[st], (step >> 1) & 1);
    BWD_TRACE(step, 9);

    // S (warpgroup 0) or dP (warpgroup 1) behind the previous step's dV / dK on the tensor cores; once
    // those are retired, the previous step's stage is released (and thread 128 refills it with step
    // + 1: its empty wait is for step - 1) and its P / dS buffers are free. Then P / dS.
    float acc[kBN / 2];
    d256::issue_scores<T>(acc, desc_advance(a_sdp, st * kTile), b_sdp);
    if (step > 0) {
      wgmma_wait<1>();  // (dv, dk are read by nothing but wgmmas until after the loop: no register fence)
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&empty[st ^ 1]);  // this warp is done with stage st ^ 1
      if (tid == 128) issue(step + 1);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) reg_fence(acc[i]);
    BWD_TRACE(step, 0);
    d256::p_ds<T>(acc, x, wg, r0, g, t, smem_u32(sp + st * kTileP), smem_u32(sds + st * kTileP),
                  d256::block_needs_mask(p, m0, n0, sq_len, sk_len), m0, n0, p, sq_len, sk_len, step);
    BWD_TRACE(step, 1);
    __syncthreads();  // P and dS of this step for both warpgroups' wgmmas
    BWD_TRACE(step, 2);

    // dQ first (its output runs while dV and dK are on the tensor cores), then dV, dK.
    [[maybe_unused]] float dq[kD / 4];
    wgmma_fence();
    if constexpr (kDq) {
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk)
        Wgmma<kD / 2, T>::template ss<1>(dq, desc_advance(ds_k, st * kTileP + kk * 32), desc_advance(k_mn, kk * 2048), kk > 0);
      wgmma_commit();
    }
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk)
      Wgmma<kD / 2, T>::template ss<1, 1>(dv, desc_advance(p_mn, st * kTileP + kk * 2048),
                                          desc_advance(do_mn, st * kTile + kk * 2048), step > 0 || kk > 0);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk)
      Wgmma<kD / 2, T>::template ss<1, 1>(dk, desc_advance(ds_mn, st * kTileP + kk * 2048),
                                          desc_advance(q_mn, st * kTile + kk * 2048), step > 0 || kk > 0);
    wgmma_commit();
    BWD_TRACE(step, 3);
    if constexpr (kDq) {
      wgmma_wait<2>();  // dQ (dV, dK may still run)
#pragma unroll
      for (int i = 0; i < kD / 4; ++i) reg_fence(dq[i]);
      BWD_TRACE(step, 4);
      // rows m0 + r0 (+8), columns 128c + 8i + 2t (+1) of the fp32 workspace; rows past the end skipped
      float* ws = pin_ptr(p.ws_dq + (static_cast<int64_t>(h) * p.rows_q + static_cast<int64_t>(b) * sq_len + m0 + r0) * kD +
                          (kD / 2) * wg + 2 * t);
      if ((dq_probe_bits() & 3) == 1) {  // a timing probe (IOATTN_BWD_TRACE builds): dQ dropped
      } else if (kRedV4) {
        // even t: row r0, columns 8i + 2t .. + 3 (its pair, then its partner's row-r0 pair); odd t:
        // row r0 + 8, columns 8i + 2(t - 1) .. + 3 (its partner's row-(r0 + 8) pair, then its own)
        const bool odd = t & 1;
        float* w4 = ws + (odd ? 8 * kD - 2 : 0);
        const bool ok = sq_len - m0 - r0 > (odd ? 8 : 0);
#pragma unroll
        for (int i = 0; i < kD / 16; ++i) {
          const float s0 = odd ? dq[4 * i] : dq[4 * i + 2], s1 = odd ? dq[4 * i + 1] : dq[4 * i + 3];
          const float r0v = __shfl_xor_sync(0xffffffffu, s0, 1), r1v = __shfl_xor_sync(0xffffffffu, s1, 1);
          if (odd)
            red_add_v4_f32_if(w4 + 8 * i, r0v, r1v, dq[4 * i + 2], dq[4 * i + 3], ok);
          else
            red_add_v4_f32_if(w4 + 8 * i, dq[4 * i], dq[4 * i + 1], r0v, r1v, ok);
        }
      } else if (m0 + kBM <= sq_len) {
#pragma unroll
        for (int i = 0; i < kD / 16; ++i) {
          ptx::red_add_v2_f32(ws + 8 * i, dq[4 * i], dq[4 * i + 1]);
          ptx::red_add_v2_f32(ws + 8 * kD + 8 * i, dq[4 * i + 2], dq[4 * i + 3]);
        }
      } else {
        const int valid = sq_len - m0 - r0;
#pragma unroll
        for (int i = 0; i < kD / 16; ++i) {
          red_add_v2_f32_if(ws + 8 * i, dq[4 * i], dq[4 * i + 1], valid > 0);
          red_add_v2_f32_if(ws + 8 * kD + 8 * i, dq[4 * i + 2], dq[4 * i + 3], valid > 8);
        }
      }
    }
    BWD_TRACE(step, 5);
    BWD_TRACE(step, 6);  // (dV, dK stay in flight into the next step)
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kD / 4; ++i) reg_fence(dv[i]), reg_fence(dk[i]);

  // dK (scaled), dV: keys n0 + r0 (+8), dims 128c + 8i + 2t (+1); 16-byte vectors as above.
  if (steps == 0) {  // no step: dK = dV = 0 (the registers were never written)
#pragma unroll
    for (int i = 0; i < kD / 4; ++i) dv[i] = 0.f, dk[i] = 0.f;
  }
  T* dkp = static_cast<T*>(p.dk) + b * p.dk_batch + static_cast<int64_t>(k_start) * p.dk_seq + hk * p.dk_head +
           (kD / 2) * wg;
  T* dvp = static_cast<T*>(p.dv) + b * p.dv_batch + static_cast<int64_t>(k_start) * p.dv_seq + hk * p.dv_head +
           (kD / 2) * wg;
  const bool vec = IOATTN_BWD_DKV_VEC && vec16_ok<T>(p.dk, p.dk_batch, p.dk_seq, p.dk_head) &&
                   vec16_ok<T>(p.dv, p.dv_batch, p.dv_seq, p.dv_head);
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int j = n0 + r0 + 8 * rh;
    store_acc_row<T, kD / 2>(dkp + static_cast<int64_t>(j) * p.dk_seq, dk, rh, p.scale, lane, vec, j < sk_len);
    store_acc_row<T, kD / 2>(dvp + static_cast<int64_t>(j) * p.dv_seq, dv, rh, 1.0f, lane, vec, j < sk_len);
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __trap();  // an sm_90 image without the "a" features (wgmma): never silently write nothing
#endif
}

// The hdim-256 dQ pass (the default, IOATTN_BWD_SM90_D256_DQ=pass, and deterministic mode): no
// atomics. CTA = (batch, query head, block of 64 rows), longest blocks first; it walks the key blocks
// its rows see in ascending order, recomputing S (warpgroup 0) and dP (warpgroup 1) exactly as the
// dK/dV kernel does (d256::issue_scores, d256::p_ds: the same P and dS bits), and accumulates
// dQ[:, 128c..] += dS K[:, 128c..] on warpgroup c (ss m64n128, A = dS K-major, B = K MN-major) in
// registers; dQ = scale · acc is written once, in the input dtype. Q, dO once by TMA; K, V by TMA in
// two stages, a block ahead (thread 128; empty: one arrival per warp). Costs S and dP a second time
// (3 of the backward's 5 GEMMs here, 7 in all) to avoid the fp32 reductions: at hdim 256 a 64-key
// CTA adds 64 KB of dQ per 64-row step, twice the hdim-128 kernel's bytes per FLOP.
// kVarlen: as the dK/dV kernel's (K / V by TMA through ragged maps over the packed keys too: a
// block's keys past the sequence read as zeros); query blocks past a shorter sequence exit.
template <typename T, bool kVarlen = false>
__global__ void __launch_bounds__(kThreads, 1) flash_bwd_sm90_d256_dq_kernel(const BwdParams p,
                                                                             const __grid_constant__ CUtensorMap q_map,
                                                                             const __grid_constant__ CUtensorMap do_map,
                                                                             const __grid_constant__ CUtensorMap k_map,
                                                                             const __grid_constant__ CUtensorMap v_map) {
#if IOATTN_SM90A_ENABLED
  using namespace sm90;
  using d256::kBM;
  using d256::kBN;
  using d256::kD;
  using d256::kTile;
  using d256::kTileP;
  extern __shared__ uint8_t raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  uint8_t* sq = base;
  uint8_t* sdo = sq + kTile;
  uint8_t* sk = sdo + kTile;       // [2 stages]
  uint8_t* sv = sk + 2 * kTile;    // [2 stages]
  uint8_t* sp = sv + 2 * kTile;    // [2 parities]
  uint8_t* sds = sp + 2 * kTileP;  // [2 parities]
  uint64_t* full = reinterpret_cast<uint64_t*>(sds + 2 * kTileP);  // K, V of a stage landed
  uint64_t* empty = full + 2;                                       // both warpgroups done with a stage
  uint64_t* qbar = full + 4;                                        // Q, dO landed

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, w = wtid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3, r0 = 16 * w + g;
  const int m_block = p.num_m_blocks - 1 - static_cast<int>(blockIdx.x % p.num_m_blocks);
  const int bh = static_cast<int>(blockIdx.x / p.num_m_blocks);
  const int h = bh % p.heads_q, b = bh / p.heads_q, hk = h / p.group;
  const bwd_detail::SeqInfo si = bwd_detail::seq_info_t<kVarlen>(p, b);
  const int sq_len = si.sq, sk_len = si.sk, q_start = si.q_start, k_start = si.k_start, off = sk_len - sq_len;
  const int m0 = m_block * kBM, m_end = min(m0 + kBM, sq_len);
  if (kVarlen && m0 >= sq_len) return;  // this sequence has fewer rows (nothing issued yet)
  const int64_t row0 = kVarlen ? static_cast<int64_t>(q_start) : static_cast<int64_t>(b) * sq_len;
  // Key blocks that intersect the band of rows [m0, m_end), ascending (as flash_bwd_dq_kernel).
  int n_lo = 0, n_hi = sk_len;
  if (p.window_left >= 0) n_lo = max(0, m0 + off - p.window_left);
  if (p.window_right >= 0) n_hi = min(sk_len, m_end - 1 + off + p.window_right + 1);
  const int nb_lo = n_lo / kBN;
  const int n_blocks = n_hi > n_lo ? (n_hi + kBN - 1) / kBN - nb_lo : 0;

  if (tid == 0) {
    mbarrier_init(&full[0], 1), mbarrier_init(&full[1], 1), mbarrier_init(qbar, 1);
    mbarrier_init(&empty[0], kThreads / 32), mbarrier_init(&empty[1], kThreads / 32);
    fence_mbarrier_init();
  }
  __syncthreads();
  auto issue = [&](int j) {  // K, V of key block j into stage j & 1 (thread 128 only, j = 0, 1, 2, ...)
    if (j >= n_blocks) return;
    const int st = j & 1, n0 = (nb_lo + j) * kBN;
    if (j >= 2) mbarrier_wait_or_trap(&empty[st], ((j - 2) >> 1) & 1);
    mbarrier_arrive_expect_tx(&full[st], 2 * kTile);
#pragma unroll
    for (int cb = 0; cb < kD / 64; ++cb) {
      // (varlen: ragged maps, keys past the sequence read as zeros)
      tma_load_rows(kVarlen, sk + st * kTile + cb * kBN * 128, &k_map, &full[st], cb * 64, hk, b, k_start, sk_len, n0);
      tma_load_rows(kVarlen, sv + st * kTile + cb * kBN * 128, &v_map, &full[st], cb * 64, hk, b, k_start, sk_len, n0);
    }
  };
  if (tid == 128 && n_blocks > 0) {
    mbarrier_arrive_expect_tx(qbar, 2 * kTile);
#pragma unroll
    for (int cb = 0; cb < kD / 64; ++cb) {
      tma_load_rows(kVarlen, sq + cb * kBM * 128, &q_map, qbar, cb * 64, h, b, q_start, sq_len, m0);
      tma_load_rows(kVarlen, sdo + cb * kBM * 128, &do_map, qbar, cb * 64, h, b, q_start, sq_len, m0);
    }
    issue(0), issue(1);
  }
  float x[2];
  d256::load_x(x, p, wg, h, row0, m0, r0, sq_len);
  float dq[kD / 4];  // overwritten by the first block's wgmmas (no zeroing: see the dK/dV kernel)
  const uint64_t a_sdp = make_desc_sw128(smem_u32(wg == 0 ? sq : sdo), 16, 1024);
  const uint64_t b_sdp = make_desc_sw128(smem_u32(wg == 0 ? sk : sv), 16, 1024);
  const uint64_t k_mn = make_desc_sw128(smem_u32(sk) + wg * 2 * kBN * 128, kBN * 128, 1024);
  const uint64_t ds_k = make_desc_sw128(smem_u32(sds), 16, 1024);
  if (n_blocks > 0) mbarrier_wait_or_trap(qbar, 0);
  for (int j = 0; j < n_blocks; ++j) {
    const int st = j & 1, n0 = (nb_lo + j) * kBN;
    mbarrier_wait_or_trap(&full[st], (j >> 1) & 1);
    // S / dP behind the previous block's dQ wgmmas; those retired, the previous stage is released
    // (thread 128 then refills it with block j + 1).
    float acc[kBN / 2];
    d256::issue_scores<T>(acc, a_sdp, desc_advance(b_sdp, st * kTile));
    if (j > 0) {
      wgmma_wait<1>();
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&empty[st ^ 1]);  // this warp is done with stage st ^ 1
      if (tid == 128) issue(j + 1);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) reg_fence(acc[i]);
    // (trace step INT_MAX: no stamps; IOATTN_BWD_TRACE builds trace the dK/dV kernel's steps only)
    d256::p_ds<T>(acc, x, wg, r0, g, t, smem_u32(sp + st * kTileP), smem_u32(sds + st * kTileP),
                  d256::block_needs_mask(p, m0, n0, sq_len, sk_len), m0, n0, p, sq_len, sk_len, INT_MAX);
    __syncthreads();  // dS of this block for both warpgroups' wgmmas
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      Wgmma<kD / 2, T>::template ss<1>(dq, desc_advance(ds_k, st * kTileP + kk * 32),
                                       desc_advance(k_mn, st * kTile + kk * 2048), j > 0 || kk > 0);
    wgmma_commit();  // (in flight into the next block)
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kD / 4; ++i) reg_fence(dq[i]);
  // dQ = scale · acc: rows m0 + r0 (+8), columns 128c + 8i + 2t (+1); rows with no visible key get 0.
  T* gdq = static_cast<T*>(p.dq) + b * p.dq_batch + static_cast<int64_t>(q_start) * p.dq_seq +
           static_cast<int64_t>(h) * p.dq_head;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int r = m0 + r0 + 8 * rh;
    if (r >= sq_len) continue;
    T* q_row = gdq + static_cast<int64_t>(r) * p.dq_seq + (kD / 2) * wg + 2 * t;
#pragma unroll
    for (int i = 0; i < kD / 16; ++i)
      *reinterpret_cast<uint32_t*>(q_row + 8 * i) =
          n_blocks > 0 ? ptx::pack2<T>(dq[4 * i + 2 * rh] * p.scale, dq[4 * i + 2 * rh + 1] * p.scale) : 0u;
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __trap();  // an sm_90 image without the "a" features (wgmma): never silently write nothing
#endif
}

// IOATTN_BWD_SM90_VARIANT: lag (dQ one step late, by TMA reduce-add) | tmald (lag with Q / dO
// loaded by TMA: kTmaLoad) | redlag (one step late, by red.global) | split (in its own step, by TMA
// reduce-add) | red (in its own step, by red.global: session 5's kernel) | pp (tmald without CTA
// barriers in the loop, the warpgroups' wgmma issue alternating: kPingPong). Bits: 1 red, 2 lag;
// tmald is 4, pp 5. Unset:
// pp at hdim 64 and from 2048 query rows at hdim 128, lag below that (session 8,
// H200: tmald +8-15% at hdim 64, +3-10% at hdim 128 from 4k over lag, -15% at 1k causal hdim 128;
// session 9: pp over tmald +1-7% at hdim 64, +0-4% at hdim 128 from 4k). Session 8's "dqlate" (the
// lagged dQ wgmmas after S^T / dP^T) lost 8-23% to tmald in session 9 and was removed.
constexpr int kVariantTmaLoad = 4, kVariantPingPong = 5, kVariantPingPongWarpDq = 6, kVariantPingPongWide = 7;
// rows: BwdParams::variant_rows (seqlen_q; varlen: its work-weighted query length, the same rule
// since session 24).
int variant_bits(int head_dim, int64_t rows) {
  const char* e = std::getenv("IOATTN_BWD_SM90_VARIANT");
  if (e == nullptr || *e == '\0')
    // hdim 64: ppwide from 256 query rows (session 23: +6-26% at 1k-16k, even at 256, 5-25% slower
    // at 32-128 rows, where a 128-row step is mostly padding). Varlen follows the same rule on its
    // work-weighted query length (session 24, H200, packed batches of equal lengths: hdim 64
    // ppwide over lag +5-17% at 512, +20-25% at 1k, +29-38% at 4k; hdim 128 pp over lag 0-4% at 4k,
    // 0-25% slower at 512). Q / dO by TMA needs nothing the dispatcher does not already require
    // (16-byte aligned bases, strides multiples of 8 elements), so there is no case left for lag.
    return head_dim == 64 ? (rows >= 256 ? kVariantPingPongWide : kVariantPingPong)
           : rows >= 2048 ? kVariantPingPong
                          : 2;
  if (std::strcmp(e, "lag") == 0) return 2;
  if (std::strcmp(e, "split") == 0) return 0;
  if (std::strcmp(e, "red") == 0) return 1;
  if (std::strcmp(e, "redlag") == 0) return 3;
  if (std::strcmp(e, "tmald") == 0) return kVariantTmaLoad;
  if (std::strcmp(e, "pp") == 0) return kVariantPingPong;
  if (std::strcmp(e, "ppw") == 0) return kVariantPingPongWarpDq;
  if (std::strcmp(e, "ppwide") == 0) {
    if (head_dim != 64)
      throw Error("IOATTN_BWD_SM90_VARIANT", "IOATTN_BWD_SM90_VARIANT=ppwide (128-row steps) is a hdim-64 variant, got "
                                             "head_dim " + std::to_string(head_dim));
    return kVariantPingPongWide;
  }
  throw Error("IOATTN_BWD_SM90_VARIANT",
              std::string("IOATTN_BWD_SM90_VARIANT must be split, red, lag, redlag, tmald, pp, ppw or ppwide, got '") +
                  e + "'");
}

// The fp32 dQ workspace [heads_q, batch·seqlen_q, kD] as a 3-D map (kD, seqlen_q, heads_q·batch) —
// rows of one (head, batch) pair are one plane, so a tail block's rows past seqlen_q are clipped
// instead of landing in the next sequence — with [box_rows x 32 floats] SW128 boxes (64: a
// warpgroup's dQ piece; 16: a warp's, variant ppw).
// Varlen: [heads_q, total_q] rows (rows_q = total_q) as a ragged map (make_ragged_map; the kernel
// gives the sequence), so rows past a sequence are skipped, not added to the next sequence's.
template <int kD>
CUtensorMap make_dq_map(const BwdParams& p, int box_rows = kBM) {
  if (p.cu_seqlens_q != nullptr)
    return sm90::make_ragged_map(p.ws_dq, DType::f32, 4, kD, p.rows_q, p.heads_q, kD, p.rows_q * kD, 32, box_rows,
                                 "the backward's dQ workspace");
  const int64_t rows = p.seqlen_q;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kD), static_cast<cuuint64_t>(rows > 0 ? rows : 1),
                              static_cast<cuuint64_t>(static_cast<int64_t>(p.heads_q) * p.batch)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kD) * 4, dims[1] * kD * 4};
  const cuuint32_t box[3] = {32, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  CUtensorMap map{};
  const CUresult r = sm90::tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, p.ws_dq, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("cuda", "ioattn: cuTensorMapEncodeTiled failed for the backward's dQ workspace (CUresult " +
                            std::to_string(static_cast<int>(r)) + ")");
  return map;
}

// Variant "tmald": Q or dO [batch, seqlen_q, heads_q, kD] as the forward's 4-D map with [64 rows x
// 64 dims] SW128 boxes, the layout of a stage's column blocks. TMA's alignment / stride rules
// unmet: an error naming the tensor (the variant is an explicit choice, so no silent fallback).
// Varlen: a ragged map over the packed tokens (rows_q = total_q; rows past the kernel's sequence
// are out of bounds: zeros).
template <typename T, int kD>
CUtensorMap make_row_map(const void* ptr, const detail::Strides3& s, const BwdParams& p, const char* name,
                         int box_rows = kBM) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int64_t rows = varlen ? p.rows_q : p.seqlen_q, batch = varlen ? 1 : p.batch;
  const DType dt = std::is_same_v<T, __nv_bfloat16> ? DType::bf16 : DType::f16;
  std::string why;
  if (!sm90::tma_compatible(ptr, s, batch, rows, p.heads_q, name, &why))
    throw Error(name, "the wgmma backward's TMA-load variants (tmald, pp, ppwide): " + why);
  if (varlen) return sm90::make_ragged_map(ptr, dt, 2, kD, rows, p.heads_q, s.seq, s.head, 64, box_rows, name);
  return sm90::make_tensor_map(ptr, dt, kD, rows, p.heads_q, batch, s, box_rows, name);
}

// Deterministic mode (no dQ workspace): this kernel for dK/dV only, then the mma.sync table's
// atomic-free dQ pass of the same head dim (flash_bwd_dq_kernel: one CTA per query block walks
// every key block in order), whose tile run_flash_backward sized num_m_blocks for (info_for()
// copies the row's dQ fields).
const BwdKernelInfo& mma_row(int head_dim) {
  static const BwdKernelInfo d64 = bwd_info_hdim64(), d128 = bwd_info_hdim128();
  return head_dim == 64 ? d64 : d128;
}

template <typename T, int kD>
void launch_deterministic(const BwdParams& p, cudaStream_t stream) {
  const int64_t grid = static_cast<int64_t>(p.num_n_blocks) * p.heads_kv * p.batch;
  if (grid > 0) {
    // (varlen since session 24: the same kernel over packed sequences; the dQ pass takes varlen too)
    auto* kernel = p.cu_seqlens_q != nullptr ? &flash_bwd_sm90_kernel<T, kD, false, false, false, false, true>
                                             : &flash_bwd_sm90_kernel<T, kD, false, false, false>;
    const int smem = Cfg<kD>::smem(false);
    IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(p, CUtensorMap{}, CUtensorMap{}, CUtensorMap{});
    IOATTN_CUDA_CHECK_LAUNCH("flash_bwd_sm90_kernel (dK/dV only)");
  }
  const BwdKernelInfo& row = mma_row(kD);
  launch_flash_bwd_dq_pass(p, std::is_same_v<T, __nv_bfloat16> ? row.dq_bf16 : row.dq_f16, row.dq_warps * 32,
                           row.dq_smem_bytes, stream);
}

#if IOATTN_BWD_TRACE
// After the 20th launch: per phase (stamp k - stamp k-1, k in the order 9 0 1 2 3 4 5 6 7 8) the
// mean cycles over steps 2..kTrSteps-2 of the traced CTAs, per warpgroup.
void print_trace(int64_t grid) {
  static int calls = 0;
  if (++calls != 20) return;
  IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
  static unsigned h[kTrBlocks][2][kTrSteps][kTrPoints];
  IOATTN_CUDA_CHECK(cudaMemcpyFromSymbol(h, g_bwd_trace, sizeof(h)));
  const int order[10] = {9, 0, 1, 2, 3, 4, 5, 6, 7, 8};
  const char* names[10] = {"top wait->bar", "barrier", "issue", "wait dQ", "put_dq", "wait S",
                           "P + dV issue", "wait dP", "dS + dK issue", "wait all"};
  const int nb = static_cast<int>(grid < kTrBlocks ? grid : kTrBlocks);
  for (int wg = 0; wg < 2; ++wg) {
    std::fprintf(stderr, "bwd trace wg %d (mean cycles, steps 2..%d, %d CTAs):", wg, kTrSteps - 2, nb);
    double total = 0;
    for (int k = 0; k < 10; ++k) {
      double sum = 0;
      int n = 0;
      for (int b = 0; b < nb; ++b)
        for (int st = 2; st < kTrSteps - 1; ++st) {
          const unsigned cur = h[b][wg][st][order[k]];
          const unsigned prev = k == 0 ? h[b][wg][st - 1][8] : h[b][wg][st][order[k - 1]];
          sum += static_cast<double>(cur - prev), ++n;
        }
      std::fprintf(stderr, " %s %.0f |", names[k], sum / n);
      total += sum / n;
    }
    std::fprintf(stderr, " step %.0f\n", total);
    // The finer points, where this variant stamps them (a point never stamped stays 0).
    auto mean = [&](int a, int b, bool prev_step) {  // stamp b - stamp a (a of step - 1 if prev_step)
      double sum = 0;
      int n = 0;
      for (int blk = 0; blk < nb; ++blk)
        for (int st = 2; st < kTrSteps - 1; ++st) {
          const unsigned x = h[blk][wg][prev_step ? st - 1 : st][a], y = h[blk][wg][st][b];
          if (x == 0 || y == 0) return -1.0;
          sum += static_cast<double>(y - x), ++n;
        }
      return n ? sum / n : -1.0;
    };
    struct Sub {
      const char* name;
      int a, b;
      bool prev;
    };
    const Sub subs[] = {{"dQ buffer read wait", 8, 10, true}, {"Q/dO/LSE/D wait", 10, 9, false},
                        {"dS^T math + store", 6, 11, false},  {"other dS^T half wait", 11, 12, false},
                        {"dQ/dV/dK issue", 12, 7, false},      {"dQ wait", 7, 13, false},
                        {"put_dq", 13, 14, false},             {"dV/dK wait", 14, 8, false}};
    std::fprintf(stderr, "bwd trace wg %d finer:", wg);
    for (const Sub& x : subs) {
      const double m = mean(x.a, x.b, x.prev);
      if (m >= 0) std::fprintf(stderr, " %s %.0f |", x.name, m);
    }
    std::fprintf(stderr, "\n");
  }
}
#endif

#if IOATTN_BWD_TRACE
// The hdim-256 kernel's phases (after the 20th launch): mean cycles over steps 2..kTrSteps-2.
void print_trace_d256(int64_t grid) {
  static int calls = 0;
  if (++calls != 20) return;
  IOATTN_CUDA_CHECK(cudaDeviceSynchronize());
  static unsigned h[kTrBlocks][2][kTrSteps][kTrPoints];
  IOATTN_CUDA_CHECK(cudaMemcpyFromSymbol(h, g_bwd_trace, sizeof(h)));
  const int order[9] = {10, 9, 0, 1, 2, 3, 4, 5, 6};
  const char* names[9] = {"top (LSE/D, issue)", "Q/dO wait", "S|dP wgmma", "P|dS", "barrier", "issue dQ/dV/dK",
                          "wait dQ", "red dQ", "wait dV/dK"};
  const int nb = static_cast<int>(grid < kTrBlocks ? grid : kTrBlocks);
  for (int wg = 0; wg < 2; ++wg) {
    std::fprintf(stderr, "d256 trace wg %d (mean cycles, steps 2..%d, %d CTAs):", wg, kTrSteps - 2, nb);
    double total = 0;
    for (int k = 0; k < 9; ++k) {
      double sum = 0;
      int n = 0;
      for (int b = 0; b < nb; ++b)
        for (int st = 2; st < kTrSteps - 1; ++st) {
          const unsigned cur = h[b][wg][st][order[k]];
          const unsigned prev = k == 0 ? h[b][wg][st - 1][6] : h[b][wg][st][order[k - 1]];
          sum += static_cast<double>(cur - prev), ++n;
        }
      std::fprintf(stderr, " %s %.0f |", names[k], sum / n);
      total += sum / n;
    }
    std::fprintf(stderr, " step %.0f\n", total);
    // inside P|dS: 0 -> 11 (warpgroup 0: exponentials; 1: wait for P), 11 -> 12 (stores), 12 -> 13 (fence)
    double f[3] = {0, 0, 0};
    const int pts[4] = {0, 11, 12, 13};
    int n = 0;
    for (int b = 0; b < nb; ++b)
      for (int st = 2; st < kTrSteps - 1; ++st, ++n)
        for (int k = 0; k < 3; ++k) f[k] += static_cast<double>(h[b][wg][st][pts[k + 1]] - h[b][wg][st][pts[k]]);
    std::fprintf(stderr, "d256 trace wg %d finer: %s %.0f | stores %.0f | fence %.0f\n", wg, wg == 0 ? "exps" : "P wait",
                 f[0] / n, f[1] / n, f[2] / n);
  }
}
#endif

// IOATTN_BWD_TRACE builds: IOATTN_BWD_DQ_PROBE into g_bwd_dq_probe, once per process (on the first
// launch, before any graph capture); nothing otherwise.
void set_dq_probe() {
#if IOATTN_BWD_TRACE
  static const bool done = [] {
    const char* e = std::getenv("IOATTN_BWD_DQ_PROBE");
    const int probe = e != nullptr ? std::atoi(e) : 0;
    IOATTN_CUDA_CHECK(cudaMemcpyToSymbol(g_bwd_dq_probe, &probe, sizeof(int)));
    return true;
  }();
  (void)done;
#endif
}

// Variant ppwide's instance (hdim 64 only; kVarlen: over packed sequences).
template <typename T, int kD, bool kVarlen>
auto wide_kernel() {
  if constexpr (kD == 64)
    return &flash_bwd_sm90_kernel<T, kD, true, true, true, true, kVarlen, true, false, true>;
  else
    return decltype(&flash_bwd_sm90_kernel<T, kD, true, false>){nullptr};
}

template <typename T, int kD>
void launch_typed(const BwdParams& p, cudaStream_t stream) {
  // (also rejects a bad value, in deterministic mode too)
  const int v = variant_bits(kD, p.variant_rows);
  if (p.ws_dq == nullptr) return launch_deterministic<T, kD>(p, stream);
  const int64_t grid = static_cast<int64_t>(p.num_n_blocks) * p.heads_kv * p.batch;
  const bool tma_load = v >= kVariantTmaLoad, tma_dq = tma_load || (v & 1) == 0;
  if (grid == 0) return;
  using Kernel = void (*)(const BwdParams, const CUtensorMap, const CUtensorMap, const CUtensorMap);
  const Kernel kernels[8] = {&flash_bwd_sm90_kernel<T, kD, true, false>,
                             &flash_bwd_sm90_kernel<T, kD, false, false>,
                             &flash_bwd_sm90_kernel<T, kD, true, true>,
                             &flash_bwd_sm90_kernel<T, kD, false, true>,
                             &flash_bwd_sm90_kernel<T, kD, true, true, true, true>,
                             &flash_bwd_sm90_kernel<T, kD, true, true, true, true, false, true>,
                             &flash_bwd_sm90_kernel<T, kD, true, true, true, true, false, true, true>,
                             wide_kernel<T, kD, false>()};
  Kernel kernel = kernels[v];
  if (p.cu_seqlens_q != nullptr) {  // varlen: the kVarlen instances (lag, pp, ppwide)
    if (v == 2)
      kernel = &flash_bwd_sm90_kernel<T, kD, true, true, true, false, true>;
    else if (v == kVariantPingPong)
      kernel = &flash_bwd_sm90_kernel<T, kD, true, true, true, true, true, true>;
    else if (v == kVariantPingPongWide)
      kernel = wide_kernel<T, kD, true>();
    else
      throw Error("IOATTN_BWD_SM90_VARIANT",
                  "the wgmma backward's varlen instances are variants lag, pp and ppwide only");
  }
  const bool wide = v == kVariantPingPongWide;
  const int smem = wide ? Cfg<kD, 2 * kBM>::kSmemTmaLoad : tma_load ? Cfg<kD>::kSmemTmaLoad : Cfg<kD>::smem(tma_dq);
  const int rows = wide ? 2 * kBM : kBM;  // query rows per step
  const CUtensorMap map = tma_dq ? make_dq_map<kD>(p, v == kVariantPingPongWarpDq ? 16 : kBM) : CUtensorMap{};
  const CUtensorMap q_map =
      tma_load ? make_row_map<T, kD>(p.q, {p.q_batch, p.q_seq, p.q_head}, p, "q", rows) : CUtensorMap{};
  const CUtensorMap do_map =
      tma_load ? make_row_map<T, kD>(p.dout, {p.do_batch, p.do_seq, p.do_head}, p, "dout", rows) : CUtensorMap{};
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  set_dq_probe();
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(p, map, q_map, do_map);
  IOATTN_CUDA_CHECK_LAUNCH("flash_bwd_sm90_kernel");
#if IOATTN_BWD_TRACE
  print_trace(grid);
#endif
}

template <int kD>
void launch(const BwdParams& p, bool is_bf16, cudaStream_t stream) {
  if (is_bf16)
    launch_typed<__nv_bfloat16, kD>(p, stream);
  else
    launch_typed<__half, kD>(p, stream);
}

const char* variant_name(int head_dim, int64_t rows) {
  switch (variant_bits(head_dim, rows)) {
    case 0: return "split";
    case 1: return "red";
    case 3: return "redlag";
    case kVariantTmaLoad: return "tmald";
    case kVariantPingPong: return "pp";
    case kVariantPingPongWarpDq: return "ppw";
    case kVariantPingPongWide: return "ppwide";
    default: return "lag";
  }
}
template <int kD>
const char* variant_of(int64_t rows) {
  return variant_name(kD, rows);
}
template <int kD>
int step_rows_of(int64_t rows) {
  return variant_bits(kD, rows) == kVariantPingPongWide ? 2 * kBM : kBM;
}

template <int kD>
BwdKernelInfo info_for() {
  BwdKernelInfo info{};
  info.head_dim = kD;
  info.block_m = kBM;
  info.block_n = kBN;
  info.warps = kThreads / 32;
  const BwdKernelInfo& row = mma_row(kD);  // deterministic mode's dQ pass
  info.dq_block_m = row.dq_block_m;
  info.dq_block_n = row.dq_block_n;
  info.dq_warps = row.dq_warps;
  info.col_splits = 1;
  info.reason =
      kD == 128
          ? "wgmma, keys as M (S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, dQ = dS K from dS^T in shared "
            "memory), 2 warpgroups x 64 keys, 64-row steps; from 2048 query rows variant pp (Q/dO by TMA, the "
            "warpgroups' wgmma issue alternating, dS^T halves ordered by mbarriers), else variant lag "
            "(cp.async one block ahead under the S^T/dP^T wgmmas; varlen: by its work-weighted query length); "
            "P^T and dV overlapping dP^T, dQ one step late, "
            "fp32 dQ by TMA reduce-add"
          : "wgmma, keys as M, 2 warpgroups x 64 keys; from 256 query rows variant ppwide: 128-row steps, Q/dO by "
            "TMA, the warpgroups' wgmma issue alternating, each warpgroup's dQ rows over both warpgroups' dS^T; "
            "below that variant pp, 64-row steps, each warpgroup's dQ from its own keys (varlen: by its work-weighted "
            "query length); dQ one step late, fp32 dQ by TMA reduce-add";
  // the largest instance (hdim 64: ppwide's 128-row stages; else the tmald / pp stages' barriers)
  info.smem_bytes = kD == 64 ? Cfg<kD, 2 * kBM>::kSmemTmaLoad : Cfg<kD>::kSmemTmaLoad;
  info.smem_bytes_det = Cfg<kD>::kSmemRed;
  info.dq_smem_bytes = row.dq_smem_bytes;
  // (registers and static shared memory as reported: hdim 64's ppwide instance, the largest; else lag's)
  if constexpr (kD == 64) {
    info.dkdv_bf16 = reinterpret_cast<const void*>(wide_kernel<__nv_bfloat16, kD, false>());
    info.dkdv_f16 = reinterpret_cast<const void*>(wide_kernel<__half, kD, false>());
  } else {
    info.dkdv_bf16 = reinterpret_cast<const void*>(&flash_bwd_sm90_kernel<__nv_bfloat16, kD, true, true>);
    info.dkdv_f16 = reinterpret_cast<const void*>(&flash_bwd_sm90_kernel<__half, kD, true, true>);
  }
  info.dq_bf16 = row.dq_bf16;
  info.dq_f16 = row.dq_f16;
  info.launch = &launch<kD>;
  info.variant = &variant_of<kD>;
  info.step_rows = &step_rows_of<kD>;
  info.dq_pass_name = "the mma.sync table's";
  return info;
}

// IOATTN_BWD_SM90_D256_DQ: how the hdim-256 backward gets dQ: pass (the default: the dK/dV kernel
// without dQ, then the wgmma dQ pass; no atomics, S and dP computed twice) | red (red.global.add.v2
// from the dK/dV kernel) | v4 (red.global.add.v4). Deterministic mode always runs the pass. Session
// 19 (H200): the fp32 reductions of all SMs together top out at ~1.44 TB/s (1.06 with the fragment's
// 8-row x 32-byte pattern; TMA bulk reduce-adds no faster), and a 64-key CTA adds 64 KB per 64-row
// step, so red spent ~45% of its step in the reductions; pass ran 1.05-1.12x red.
enum DqModeD256 { kDqRed = 0, kDqV4 = 1, kDqPass = 2 };
int dq_mode_d256() {
  const char* e = std::getenv("IOATTN_BWD_SM90_D256_DQ");
  if (e == nullptr || *e == '\0' || std::strcmp(e, "pass") == 0) return kDqPass;
  if (std::strcmp(e, "red") == 0) return kDqRed;
  if (std::strcmp(e, "v4") == 0) return kDqV4;
  throw Error("IOATTN_BWD_SM90_D256_DQ",
              std::string("IOATTN_BWD_SM90_D256_DQ must be pass, red or v4, got '") + e + "'");
}

// K or V [batch, seqlen_k, heads_kv, 256] as a 4-D map with [64 rows x 64 dims] SW128 boxes (the dQ
// pass's stages); rows past seqlen_k read as zeros.
// Varlen: a ragged map over the packed keys (rows_k = total_k; keys past the kernel's sequence
// read as zeros).
template <typename T>
CUtensorMap make_kv_map(const void* ptr, const detail::Strides3& s, const BwdParams& p, const char* name) {
  const bool varlen = p.cu_seqlens_k != nullptr;
  const int64_t rows = varlen ? p.rows_k : p.seqlen_k, batch = varlen ? 1 : p.batch;
  const DType dt = std::is_same_v<T, __nv_bfloat16> ? DType::bf16 : DType::f16;
  std::string why;
  if (!sm90::tma_compatible(ptr, s, batch, rows, p.heads_kv, name, &why))
    throw Error(name, "the hdim-256 wgmma dQ pass: " + why);
  if (varlen) return sm90::make_ragged_map(ptr, dt, 2, 256, rows, p.heads_kv, s.seq, s.head, 64, d256::kBN, name);
  return sm90::make_tensor_map(ptr, dt, 256, rows, p.heads_kv, batch, s, d256::kBN, name);
}

// hdim 256: the dK/dV kernel (with dQ by reductions, or without), then in deterministic mode or
// mode pass the wgmma dQ pass (p.ws_dq is null then: run_flash_backward allocates no workspace
// when wants_dq_workspace says so). IOATTN_BWD_SM90_VARIANT names the hdim-64/128 kernel's
// variants and is only checked here.
template <typename T>
void launch_d256_typed(const BwdParams& p, cudaStream_t stream) {
  (void)variant_bits(256, p.variant_rows);  // a bad value is an error here too
  const int mode = dq_mode_d256();
  const bool pass = p.ws_dq == nullptr;  // deterministic mode or mode pass
  const int64_t grid = static_cast<int64_t>(p.num_n_blocks) * p.heads_kv * p.batch;
  const CUtensorMap q_map = make_row_map<T, 256>(p.q, {p.q_batch, p.q_seq, p.q_head}, p, "q");
  const CUtensorMap do_map = make_row_map<T, 256>(p.dout, {p.do_batch, p.do_seq, p.do_head}, p, "dout");
  const bool varlen = p.cu_seqlens_q != nullptr;
  if (varlen && !pass)
    throw Error("IOATTN_BWD_SM90_D256_DQ", "the hdim-256 wgmma backward's varlen instances take dQ by the pass only");
  if (grid > 0) {
    auto* kernel = varlen ? &flash_bwd_sm90_d256_kernel<T, false, false, true>
                   : pass ? &flash_bwd_sm90_d256_kernel<T, false>
                   : mode == kDqV4 ? &flash_bwd_sm90_d256_kernel<T, true, true>
                                   : &flash_bwd_sm90_d256_kernel<T, true>;
    IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, d256::kSmem));
    set_dq_probe();
    kernel<<<static_cast<unsigned>(grid), kThreads, d256::kSmem, stream>>>(p, q_map, do_map);
    IOATTN_CUDA_CHECK_LAUNCH("flash_bwd_sm90_d256_kernel");
#if IOATTN_BWD_TRACE
    print_trace_d256(grid);
#endif
  }
  const int64_t grid_q = static_cast<int64_t>(p.num_m_blocks) * p.heads_q * p.batch;
  if (pass && grid_q > 0) {
    auto* kernel = varlen ? &flash_bwd_sm90_d256_dq_kernel<T, true> : &flash_bwd_sm90_d256_dq_kernel<T>;
    const CUtensorMap k_map = make_kv_map<T>(p.k, {p.k_batch, p.k_seq, p.k_head}, p, "k");
    const CUtensorMap v_map = make_kv_map<T>(p.v, {p.v_batch, p.v_seq, p.v_head}, p, "v");
    IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, d256::kSmem));
    kernel<<<static_cast<unsigned>(grid_q), kThreads, d256::kSmem, stream>>>(p, q_map, do_map, k_map, v_map);
    IOATTN_CUDA_CHECK_LAUNCH("flash_bwd_sm90_d256_dq_kernel");
  }
}

void launch_d256(const BwdParams& p, bool is_bf16, cudaStream_t stream) {
  if (is_bf16)
    launch_d256_typed<__nv_bfloat16>(p, stream);
  else
    launch_d256_typed<__half>(p, stream);
}

const char* variant_d256(int64_t) {
  const int m = dq_mode_d256();
  return m == kDqPass ? "dsplit-pass" : m == kDqV4 ? "dsplit-v4" : "dsplit";
}
bool wants_dq_workspace_d256() { return dq_mode_d256() != kDqPass; }

BwdKernelInfo info_d256() {
  BwdKernelInfo info{};
  info.head_dim = 256;
  info.block_m = d256::kBM;
  info.block_n = d256::kBN;
  info.warps = kThreads / 32;
  info.dq_block_m = d256::kBM;  // the wgmma dQ pass (deterministic mode, mode pass)
  info.dq_block_n = d256::kBN;
  info.dq_warps = kThreads / 32;
  info.col_splits = 1;
  info.reason =
      "wgmma, 64 keys per CTA, the head dim split over 2 warpgroups (each holds dK, dV and computes dQ for 128 of "
      "the 256 columns), 64-row steps: S = Q K^T on warpgroup 0 and dP = dO V^T on warpgroup 1 (ss m64n64), P and dS "
      "row-major in shared memory, dV += P^T dO, dK += dS^T Q (ss m64n128), Q/dO by TMA a step ahead, the next "
      "step's S/dP queued behind dV/dK; dQ by a second wgmma pass over key blocks per 64-row block (S and dP "
      "again, dQ = dS K in registers: no atomics; IOATTN_BWD_SM90_D256_DQ=red adds it from this kernel by "
      "red.global instead)";
  info.smem_bytes = d256::kSmem;
  info.smem_bytes_det = d256::kSmem;
  info.dq_smem_bytes = d256::kSmem;
  info.dkdv_bf16 = reinterpret_cast<const void*>(&flash_bwd_sm90_d256_kernel<__nv_bfloat16, true>);
  info.dkdv_f16 = reinterpret_cast<const void*>(&flash_bwd_sm90_d256_kernel<__half, true>);
  info.dq_bf16 = reinterpret_cast<const void*>(&flash_bwd_sm90_d256_dq_kernel<__nv_bfloat16>);
  info.dq_f16 = reinterpret_cast<const void*>(&flash_bwd_sm90_d256_dq_kernel<__half>);
  info.launch = &launch_d256;
  info.variant = &variant_d256;
  info.wants_dq_workspace = &wants_dq_workspace_d256;
  info.dq_pass_name = "its wgmma";
  return info;
}

}  // namespace sm90_bwd

BwdKernelInfo bwd_info_sm90_hdim256() { return sm90_bwd::info_d256(); }
BwdKernelInfo bwd_info_sm90_hdim128() { return sm90_bwd::info_for<128>(); }
BwdKernelInfo bwd_info_sm90_hdim64() { return sm90_bwd::info_for<64>(); }

}  // namespace ioattn::cuda

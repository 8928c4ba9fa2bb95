// flash_fwd_sm90_v3.cuh — the v3 body of the Hopper forward kernel, kept verbatim for the
// dispatch-table rows where it measured faster than the current body (flash_fwd_sm90.cuh).
//
// Why a copy: v4 changed the kernel (tile index handed over with Q, O-rescale skip vote, rescale
// placement knob, 3-warpgroup generalisation). With the same policy (static persistent grid, no
// skip), the v4 body ran 2-7% slower than v3 on hdim128 non-causal in both H200 runs (NOTES.md,
// runs 4 and 5) although its main loop has the same HGMMA/MUFU sequence; the v4 policy did not win
// that back on that row. This body is the v3 source unchanged apart from its name (its SASS
// matches the v3 build's instruction for instruction, checked with cuobjdump), so the v3
// measurements and its correctness runs (96/96, default grid and 3 CTAs) apply to it.
// It reads only the v3 fields of FwdParams and walks tiles statically (tile_of_round): the host
// launches it with a static or one-CTA-per-tile grid, never with a tile counter.
#pragma once


#include "cuda/hopper/flash_fwd_sm90.cuh"

namespace ioattn::cuda::sm90 {


template <class Tr, bool kCausal>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_fwd_sm90_v3_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const FwdParams p) {
#if IOATTN_SM90A_ENABLED
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  constexpr int kStages = Tr::kStages;

  __shared__ uint64_t full_q, empty_q;                    // Q tile landed / Q buffer free again
  __shared__ uint64_t full_k[kStages], full_v[kStages];    // K / V stage landed
  __shared__ uint64_t empty_k[kStages], empty_v[kStages];  // K / V stage free again
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment: the 128-byte swizzle pattern repeats every 8 rows x 128 bytes.
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* s_q = smem;                          // (kColBlocks, kBlockM, 64)
  uint8_t* s_k = smem + Tr::kQBytes;            // (kStages, kColBlocks, kBlockN, 64)
  uint8_t* s_v = s_k + kStages * Tr::kKVBytes;  // (kStages, kColBlocks, kBlockN, 64)

  if (threadIdx.x == 0) {
    mbarrier_init(&full_q, 1);
    mbarrier_init(&empty_q, Tr::kConsumerWarps);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full_k[s], 1);
      mbarrier_init(&full_v[s], 1);
      mbarrier_init(&empty_k[s], Tr::kConsumerWarps);
      mbarrier_init(&empty_v[s], Tr::kConsumerWarps);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  // Both roles walk the same tiles (tile_of_round) and skip the same empty ones, so
  // their ring position `ring` (K/V blocks so far) and Q count `q_iter` always agree.
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ================================ producer ================================
    setmaxnreg_dec<Tr::kProducerRegs>();
    if (threadIdx.x == 0) {
      tma_prefetch_map(&tm_q);
      tma_prefetch_map(&tm_k);
      tma_prefetch_map(&tm_v);
      int ring = 0, q_iter = 0;
      for (int round = 0; round * static_cast<int>(gridDim.x) < p.num_tiles; ++round) {
        const int t = tile_of_round(round, p.zigzag);
        if (t >= p.num_tiles) continue;
        const TileCoord tc = decode_tile<kCausal>(t, p);
        const int m0 = tc.m_block * kBlockM, hk = tc.h / p.group;
        const int n_blocks = num_key_blocks<kBlockM, kBlockN, kCausal>(m0, p.seqlen_q, p.seqlen_k);
        if (n_blocks == 0) continue;
        const int rot = key_rotation(tc.m_block, n_blocks, p);
        // Q of this tile once the consumers finished every Q K^T of the previous one.
        FWD_TRACE(fwd_trace::kProducer, round, 0);
        mbarrier_wait(&empty_q, (q_iter & 1) ^ 1);
        FWD_TRACE(fwd_trace::kProducer, round, 1);
        mbarrier_arrive_expect_tx(&full_q, Tr::kQBytes);
#pragma unroll
        for (int c = 0; c < Tr::kColBlocks; ++c)
          tma_load_4d(s_q + c * kBlockM * 128, &tm_q, &full_q, c * 64, m0, tc.h, tc.b);
        // K or V of the i-th visited key block of this tile into ring slot (ring + i) % kStages.
        auto load_kv = [&](const CUtensorMap* map, uint8_t* buf, uint64_t* full, uint64_t* empty, int i) {
          const uint32_t st = ring_stage(ring + i, kStages);
          mbarrier_wait(&empty[st], ring_phase(ring + i, kStages) ^ 1);
          mbarrier_arrive_expect_tx(&full[st], Tr::kKVBytes);
          const int n0 = key_block(i, n_blocks, rot) * kBlockN;
          uint8_t* dst = buf + st * Tr::kKVBytes;
#pragma unroll
          for (int c = 0; c < Tr::kColBlocks; ++c)
            tma_load_4d(dst + c * kBlockN * 128, map, &full[st], c * 64, n0, hk, tc.b);
        };
        // Order K0, K1, V0, K2, V1, ...: the consumers need K_{i+1} before V_i.
        load_kv(&tm_k, s_k, full_k, empty_k, 0);
        FWD_TRACE(fwd_trace::kProducer, round, 2);
        FWD_TRACE_BLOCKS(round, n_blocks);
        for (int i = 1; i < n_blocks; ++i) {
          load_kv(&tm_k, s_k, full_k, empty_k, i);
          load_kv(&tm_v, s_v, full_v, empty_v, i - 1);
        }
        load_kv(&tm_v, s_v, full_v, empty_v, n_blocks - 1);
        ring += n_blocks;
        ++q_iter;
      }
    }
  } else {
    // ================================ consumers ===============================
    setmaxnreg_inc<Tr::kConsumerRegs>();
    const int cw = warpgroup - 1;  // consumer warpgroup 0 / 1: rows [64 cw, 64 cw + 64) of the tile
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    const bool o_vec = IOATTN_SM90_O_VEC && vec16_ok<Element>(p.o, p.o_batch, p.o_seq, p.o_head);  // the epilogue's 16-byte stores
    const int row_in_tile = cw * 64 + warp * 16 + lane / 4;  // this thread's rows: +0 and +8
    const int off = p.seqlen_k - p.seqlen_q;                 // bottom-right causal offset
    const int sched_mine = static_cast<int>(NamedBarrier::kSchedWG0) + cw;
    const int sched_other = static_cast<int>(NamedBarrier::kSchedWG0) + (1 - cw);
    // Ping-pong protocol: warpgroup 0 goes first. Every GEMM issue is bracketed by a sync on my
    // barrier and an arrival on the other's, across tiles; this one extra arrival is consumed by
    // warpgroup 0's final sync below, so every barrier phase completes.
    if (cw == 1) named_barrier_arrive(static_cast<int>(NamedBarrier::kSchedWG0), 256);
    const uint32_t q_base = smem_u32(s_q) + cw * 64 * 128;
    const uint32_t k_base = smem_u32(s_k);
    const uint32_t v_base = smem_u32(s_v);
    int ring = 0, q_iter = 0;
    const bool tr = IOATTN_FWD_TRACE && threadIdx.x % 128 == 0;  // (trace builds: who stamps)

    for (int round = 0; round * static_cast<int>(gridDim.x) < p.num_tiles; ++round) {
      const int t = tile_of_round(round, p.zigzag);
      if (t >= p.num_tiles) continue;
      const TileCoord tc = decode_tile<kCausal>(t, p);
      const int m0 = tc.m_block * kBlockM;
      const int n_blocks = num_key_blocks<kBlockM, kBlockN, kCausal>(m0, p.seqlen_q, p.seqlen_k);
      const int rot = key_rotation(tc.m_block, n_blocks, p);

      float o[kHeadDim / 2];  // O accumulator fragment (64 x kHeadDim per warpgroup)
#pragma unroll
      for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.0f;
      float row_max[2] = {-INFINITY, -INFINITY};  // raw (unscaled) running max of S, per row
      float row_sum[2] = {0.0f, 0.0f};            // this thread's share of sum exp, per row

      if (n_blocks > 0) {
        float s[kBlockN / 2];      // S fragment (64 x kBlockN)
        uint32_t pf[kBlockN / 4];  // P fragment as 16-bit pairs: the A operand of P V
        float corr[2] = {1.0f, 1.0f};

        // S = Q K^T for ring slot st: kHeadDim/16 k-steps, K-major A and B.
        auto issue_qk = [&](uint32_t st) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            const uint32_t col = kk / 4, byte_in_row = (kk % 4) * 32;
            const uint64_t a = make_desc_sw128(q_base + col * kBlockM * 128 + byte_in_row, 16, 1024);
            const uint64_t bd =
                make_desc_sw128(k_base + st * Tr::kKVBytes + col * kBlockN * 128 + byte_in_row, 16, 1024);
            Wgmma<kBlockN, Element>::template ss<0>(s, a, bd, kk > 0 ? 1 : 0);
          }
          wgmma_commit();
        };
        // O += P V for ring slot st: kBlockN/16 k-steps, A = P from registers, V MN-major.
        auto issue_pv = [&](uint32_t st) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) {
            const uint64_t bd = make_desc_sw128(v_base + st * Tr::kKVBytes + kk * 16 * 128, kBlockN * 128, 1024);
            const uint32_t a[4] = {pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3]};
            Wgmma<kHeadDim, Element>::template rs<1>(o, a, bd, 1);
          }
          wgmma_commit();
        };
        // Lets the producer refill a buffer: one arrival per consumer warp.
        auto release = [&](uint64_t* empty) {
          __syncwarp();
          if (lane == 0) mbarrier_arrive(empty);
        };
        auto fence_s = [&]() {
#pragma unroll
          for (int i = 0; i < kBlockN / 2; ++i) reg_fence(s[i]);
        };
        auto fence_o = [&]() {
#pragma unroll
          for (int i = 0; i < kHeadDim / 2; ++i) reg_fence(o[i]);
#pragma unroll
          for (int i = 0; i < kBlockN / 4; ++i) reg_fence(pf[i]);
        };
        // Sets S to -inf where key >= seqlen_k or (causal) key > row + off. Key block n.
        auto apply_mask = [&](int n) {
          const int key0 = n * kBlockN + 2 * (lane % 4);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = m0 + row_in_tile + 8 * r;
            const int key_end = kCausal ? min(p.seqlen_k, row + off + 1) : p.seqlen_k;  // visible: key < key_end
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
              for (int e = 0; e < 2; ++e)
                if (key0 + 8 * i + e >= key_end) s[4 * i + 2 * r + e] = -INFINITY;
            }
          }
        };
        auto needs_mask = [&](int n) {
          return (n + 1) * kBlockN > p.seqlen_k || (kCausal && (n + 1) * kBlockN - 1 > m0 + off);
        };
        // Online softmax on S of one key block: new row max, corr = exp(old max - new max),
        // S <- exp(scale (S - max)), row_sum <- row_sum * corr + sum. Rows stay -inf-safe.
        // kPoly: every kExp2PolyEvery-th group of 8 columns uses exp2_poly3 (no masked scores).
        auto softmax = [&](auto poly_tag) {
          constexpr bool kPoly = decltype(poly_tag)::value;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 threads of a quad share a row
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_scaled = mx == -INFINITY ? 0.0f : mx * p.scale_log2;
            corr[r] = exp2_approx(row_max[r] * p.scale_log2 - m_scaled);  // old max -inf -> 0
            row_max[r] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                float& x = s[4 * i + 2 * r + e];
                const float arg = fmaf(x, p.scale_log2, -m_scaled);
                if (kPoly && use_poly_exp2<Tr::kExp2PolyEvery>(i))
                  x = exp2_poly3(arg);
                else
                  x = exp2_approx(arg);
                sum += x;
              }
            }
            row_sum[r] = row_sum[r] * corr[r] + sum;
          }
        };
        auto mask_and_softmax = [&](int n) {
          if (needs_mask(n)) {
            apply_mask(n);
            softmax(std::false_type{});
          } else {
            softmax(std::true_type{});
          }
        };
        auto rescale_o = [&]() {
#pragma unroll
          for (int i = 0; i < kHeadDim / 8; ++i) {
            o[4 * i + 0] *= corr[0];
            o[4 * i + 1] *= corr[0];
            o[4 * i + 2] *= corr[1];
            o[4 * i + 3] *= corr[1];
          }
        };
        auto convert_p = [&]() {
#pragma unroll
          for (int j = 0; j < kBlockN / 4; ++j) pf[j] = pack2<Element>(s[2 * j], s[2 * j + 1]);
        };

        // ---- first key block (the last one in key order) ----
        if (tr) FWD_TRACE(cw, round, 0);
        mbarrier_wait(&full_q, q_iter & 1);
        if (tr) FWD_TRACE(cw, round, 1);
        {
          const uint32_t st = ring_stage(ring, kStages);
          mbarrier_wait(&full_k[st], ring_phase(ring, kStages));
          if (tr) FWD_TRACE(cw, round, 2);
          named_barrier_sync(sched_mine, 256);
          if (tr) FWD_TRACE(cw, round, 3);
          issue_qk(st);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<0>();
          if (tr) FWD_TRACE(cw, round, 4);
          fence_s();
          release(&empty_k[st]);
          if (IOATTN_SM90_EARLY_Q && n_blocks == 1) release(&empty_q);
          mask_and_softmax(key_block(0, n_blocks, rot));
          convert_p();
          if (tr) FWD_TRACE(cw, round, 5);
        }

        // ---- steady state: S_i = Q K_i^T issued with O += P_{i-1} V_{i-1} ----
        for (int i = 1; i < n_blocks; ++i) {
          const uint32_t st = ring_stage(ring + i, kStages), prev = ring_stage(ring + i - 1, kStages);
          mbarrier_wait(&full_k[st], ring_phase(ring + i, kStages));
          named_barrier_sync(sched_mine, 256);
          issue_qk(st);
          rescale_o();  // O to the max of block i-1, while Q K_i^T runs
          mbarrier_wait(&full_v[prev], ring_phase(ring + i - 1, kStages));
          issue_pv(prev);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<1>();  // S_i ready (P V may still run)
          fence_s();
          release(&empty_k[st]);
          if (IOATTN_SM90_EARLY_Q && i == n_blocks - 1) release(&empty_q);
          mask_and_softmax(key_block(i, n_blocks, rot));
          wgmma_wait<0>();  // P_{i-1} V_{i-1} done: pf and the V slot are free
          fence_o();
          release(&empty_v[prev]);
          convert_p();
        }
        // Every Q K^T of this tile has completed: the producer may load the next Q.
        if (!IOATTN_SM90_EARLY_Q) release(&empty_q);
        if (tr) FWD_TRACE(cw, round, 6);

        // ---- last P V ----
        {
          const uint32_t prev = ring_stage(ring + n_blocks - 1, kStages);
          mbarrier_wait(&full_v[prev], ring_phase(ring + n_blocks - 1, kStages));
          named_barrier_sync(sched_mine, 256);
          rescale_o();
          issue_pv(prev);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<0>();
          fence_o();
          release(&empty_v[prev]);
        }
        if (tr) FWD_TRACE(cw, round, 7);
        ring += n_blocks;
        ++q_iter;
      }

      // ---- epilogue: O /= row sum, LSE = scale * max + log(sum); stored straight from registers
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        const int row = m0 + row_in_tile + 8 * r;
        store_acc_row<Element, kHeadDim>(static_cast<Element*>(p.o) + tc.b * p.o_batch + row * p.o_seq + tc.h * p.o_head,
                                       o, r, inv, lane, o_vec, row < p.seqlen_q);
        if (row < p.seqlen_q && p.lse != nullptr && lane % 4 == 0)
          p.lse[tc.b * p.lse_batch + tc.h * p.lse_head + row * p.lse_seq] =
              sum > 0.0f ? row_max[r] * p.scale + logf(sum) : -INFINITY;
      }
      if (tr) FWD_TRACE(cw, round, 8);
    }
    if (cw == 0) named_barrier_sync(static_cast<int>(NamedBarrier::kSchedWG0), 256);  // the extra arrival
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // an image without sm_90a features must never run (the selector checks; this is loud)
#endif  // IOATTN_SM90A_ENABLED
}

template <class Tr, bool kCausal>
bool flash_fwd_sm90_v3_present() {
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, flash_fwd_sm90_v3_kernel<Tr, kCausal>);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.binaryVersion >= 90 && attr.ptxVersion >= 90;
}


template <class Tr, bool kCausal>
void flash_fwd_sm90_v3_launch(const FwdLaunch& l) {
  static_assert(Tr::kConsumerWGs == 2, "the v3 body has 2 consumer warpgroups (128-row tiles)");
  auto kernel = flash_fwd_sm90_v3_kernel<Tr, kCausal>;
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
#if IOATTN_FWD_TRACE
  static int calls = 0;
  if (++calls == 10) fwd_trace_arm(l.stream);
#endif
  kernel<<<l.grid, Tr::kThreads, Tr::kSmemBytes, l.stream>>>(l.q, l.k, l.v, l.params);
  IOATTN_CUDA_CHECK_LAUNCH("flash_fwd_sm90_v3_kernel");
#if IOATTN_FWD_TRACE
  if (calls == 10) fwd_trace_print(l.grid, 2, kCausal ? "v3 causal" : "v3");
#endif
}

#define IOATTN_SM90_V3_INSTANTIATE(TR, CAUSAL)                               \
  template bool flash_fwd_sm90_v3_present<TR, CAUSAL>();                   \
  template void flash_fwd_sm90_v3_launch<TR, CAUSAL>(const FwdLaunch& l);
#define IOATTN_SM90_V3_EXTERN(TR, CAUSAL)                                    \
  extern template bool flash_fwd_sm90_v3_present<TR, CAUSAL>();            \
  extern template void flash_fwd_sm90_v3_launch<TR, CAUSAL>(const FwdLaunch& l);

}  // namespace ioattn::cuda::sm90

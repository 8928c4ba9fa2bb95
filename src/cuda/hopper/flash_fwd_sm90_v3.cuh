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

// IOATTN_SM90_V3_QRING (compile time, default 0: prepared in session 36, compiled, never run; the
// non-causal v3 rows only): two Q buffers, the next tile's Q loaded a whole tile ahead (right after
// the current tile's K0), so that a tile's last tensor-core turn can also issue the next tile's first
// Q K^T: [P V_last(t) + Q K_0(t+1)], like a steady step, and the epilogue of t runs while Q K_0(t+1)
// is on the tensor cores (src/cuda/hopper/NOTES.md, session 36: the tile boundary left ~3,600 cycles
// of idle tensor cores per 2k tile). The second Q buffer (32 KB) fits only with 160-key blocks
// (Sm90Tile<128, false> takes them under this macro): 32 KB x 2 + 2 stages x 80 KB = 225 KB.
template <bool kCausal>
constexpr bool kV3QRing = IOATTN_SM90_V3_QRING && !kCausal;

template <class Tr, bool kCausal>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_fwd_sm90_v3_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const FwdParams p) {
#if IOATTN_SM90A_ENABLED
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  constexpr int kStages = Tr::kStages;
  constexpr bool kQRing = kV3QRing<kCausal>;
  constexpr int kQBufs = kQRing ? 2 : 1;

  __shared__ uint64_t full_q[kQBufs], empty_q[kQBufs];    // Q tile landed / Q buffer free again
  __shared__ uint64_t full_k[kStages], full_v[kStages];    // K / V stage landed
  __shared__ uint64_t empty_k[kStages], empty_v[kStages];  // K / V stage free again
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment: the 128-byte swizzle pattern repeats every 8 rows x 128 bytes.
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* s_q = smem;                          // (kColBlocks, kBlockM, 64)
  uint8_t* s_k = smem + kQBufs * Tr::kQBytes;  // (kStages, kColBlocks, kBlockN, 64)
  uint8_t* s_v = s_k + kStages * Tr::kKVBytes;  // (kStages, kColBlocks, kBlockN, 64)

  if (threadIdx.x == 0) {
#pragma unroll
    for (int b = 0; b < kQBufs; ++b) {
      mbarrier_init(&full_q[b], 1);
      mbarrier_init(&empty_q[b], Tr::kConsumerWarps);
    }
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
      int ring = 0, q_iter = 0, q_loaded = 0;  // (q_loaded: Q tiles issued; kQRing runs one ahead)
      // kQRing: the Q of tile qc into buffer q_loaded % 2 once the consumers gave that buffer back.
      auto load_q = [&](const TileCoord& qc, int round_q) {
        const int b = q_loaded & 1, use = q_loaded >> 1;
        FWD_TRACE(fwd_trace::kProducer, round_q, 0);
        mbarrier_wait(&empty_q[b], (use & 1) ^ 1);
        FWD_TRACE(fwd_trace::kProducer, round_q, 1);
        mbarrier_arrive_expect_tx(&full_q[b], Tr::kQBytes);
#pragma unroll
        for (int c = 0; c < Tr::kColBlocks; ++c)
          tma_load_4d(s_q + b * Tr::kQBytes + c * kBlockM * 128, &tm_q, &full_q[b], c * 64, qc.m_block * kBlockM,
                      qc.h, qc.b);
        ++q_loaded;
      };
      for (int round = 0; round * static_cast<int>(gridDim.x) < p.num_tiles; ++round) {
        const int t = tile_of_round(round, p.zigzag);
        if (t >= p.num_tiles) continue;
        const TileCoord tc = decode_tile<kCausal>(t, p);
        const int m0 = tc.m_block * kBlockM, hk = tc.h / p.group;
        const int n_blocks = num_key_blocks<kBlockM, kBlockN, kCausal>(m0, p.seqlen_q, p.seqlen_k);
        if (n_blocks == 0) continue;
        const int rot = key_rotation(tc.m_block, n_blocks, p);
        // Q of this tile once the consumers finished every Q K^T of the previous one (kQRing: of the
        // tile before that; loaded here only for a CTA's first tile, the others one tile ahead).
        if constexpr (!kQRing) {
          FWD_TRACE(fwd_trace::kProducer, round, 0);
          mbarrier_wait(&empty_q[0], (q_iter & 1) ^ 1);
          FWD_TRACE(fwd_trace::kProducer, round, 1);
          mbarrier_arrive_expect_tx(&full_q[0], Tr::kQBytes);
#pragma unroll
          for (int c = 0; c < Tr::kColBlocks; ++c)
            tma_load_4d(s_q + c * kBlockM * 128, &tm_q, &full_q[0], c * 64, m0, tc.h, tc.b);
        } else if (q_loaded == q_iter) {
          load_q(tc, round);
        }
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
        if constexpr (kQRing) {  // the next tile's Q (non-causal: every tile has this n_blocks > 0)
          const int tn = tile_of_round(round + 1, p.zigzag);
          if (tn < p.num_tiles) load_q(decode_tile<kCausal>(tn, p), round + 1);
        }
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
    float s[kBlockN / 2];      // S fragment (64 x kBlockN)
    uint32_t pf[kBlockN / 4];  // P fragment as 16-bit pairs: the A operand of P V
    float row_max[2], row_sum[2], corr[2];  // running max of S (raw), this thread's sum exp, rescale
    // kQRing: the previous tile's last turn issued this tile's first Q K^T and its iteration ran the
    // first block's softmax (P in pf, the row statistics set): this tile starts at its steady loop.
    // (Nothing stays in flight across an iteration: ptxas serialises wgmmas whose accumulators are
    // loop-carried, C7515.)
    bool s0_done = false;

    for (int round = 0; round * static_cast<int>(gridDim.x) < p.num_tiles; ++round) {
      const int t = tile_of_round(round, p.zigzag);
      if (t >= p.num_tiles) continue;
      const TileCoord tc = decode_tile<kCausal>(t, p);
      const int m0 = tc.m_block * kBlockM;
      const int n_blocks = num_key_blocks<kBlockM, kBlockN, kCausal>(m0, p.seqlen_q, p.seqlen_k);
      const int rot = key_rotation(tc.m_block, n_blocks, p);

      float o[kHeadDim / 2];  // O accumulator fragment (64 x kHeadDim per warpgroup)
      // (kQRing: the tile's first P V overwrites O, accumulate = 0: no zeroing while the next tile's
      // first Q K^T is in flight, which would make ptxas serialise the wgmmas)
      if (!kQRing || n_blocks == 0) {
#pragma unroll
        for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.0f;
      }
      if (!s0_done) {
        row_max[0] = row_max[1] = -INFINITY;
        row_sum[0] = row_sum[1] = 0.0f;
        corr[0] = corr[1] = 1.0f;
      }

      // ---- epilogue: O /= row sum, LSE = scale * max + log(sum); stored straight from registers
      // (after the tile's last P V; kQRing: while the next tile's first Q K^T runs)
      auto epilogue = [&]() {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float sum = row_sum[r];
          sum += __shfl_xor_sync(0xffffffffu, sum, 1);
          sum += __shfl_xor_sync(0xffffffffu, sum, 2);
          const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
          const int row = m0 + row_in_tile + 8 * r;
          store_acc_row<Element, kHeadDim>(static_cast<Element*>(p.o) + tc.b * p.o_batch + row * p.o_seq +
                                               tc.h * p.o_head,
                                           o, r, inv, lane, o_vec, row < p.seqlen_q);
          if (row < p.seqlen_q && p.lse != nullptr && lane % 4 == 0)
            p.lse[tc.b * p.lse_batch + tc.h * p.lse_head + row * p.lse_seq] =
                sum > 0.0f ? row_max[r] * p.scale + logf(sum) : -INFINITY;
        }
      };
      bool epilogue_done = false;

      if (n_blocks > 0) {
        const int qb = kQRing ? (q_iter & 1) : 0;  // this tile's Q buffer
        const uint32_t q_tile = q_base + qb * Tr::kQBytes;

        // S = Q K^T for ring slot st (Q from the buffer at q_addr): kHeadDim/16 k-steps, K-major A and B.
        auto issue_qk = [&](uint32_t st, uint32_t q_addr) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            const uint32_t col = kk / 4, byte_in_row = (kk % 4) * 32;
            const uint64_t a = make_desc_sw128(q_addr + col * kBlockM * 128 + byte_in_row, 16, 1024);
            const uint64_t bd =
                make_desc_sw128(k_base + st * Tr::kKVBytes + col * kBlockN * 128 + byte_in_row, 16, 1024);
            Wgmma<kBlockN, Element>::template ss<0>(s, a, bd, kk > 0 ? 1 : 0);
          }
          wgmma_commit();
        };
        // O += P V for ring slot st: kBlockN/16 k-steps, A = P from registers, V MN-major.
        auto issue_pv = [&](uint32_t st, bool first = false) {  // (first: kQRing's O-initialising P V)
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) {
            const uint64_t bd = make_desc_sw128(v_base + st * Tr::kKVBytes + kk * 16 * 128, kBlockN * 128, 1024);
            const uint32_t a[4] = {pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3]};
            Wgmma<kHeadDim, Element>::template rs<1>(o, a, bd, kQRing && first && kk == 0 ? 0 : 1);
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
        if (!s0_done) {
          mbarrier_wait(&full_q[qb], kQRing ? (q_iter >> 1) & 1 : q_iter & 1);
          if (tr) FWD_TRACE(cw, round, 1);
          const uint32_t st = ring_stage(ring, kStages);
          mbarrier_wait(&full_k[st], ring_phase(ring, kStages));
          if (tr) FWD_TRACE(cw, round, 2);
          named_barrier_sync(sched_mine, 256);
          if (tr) FWD_TRACE(cw, round, 3);
          issue_qk(st, q_tile);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<0>();
          if (tr) FWD_TRACE(cw, round, 4);
          fence_s();
          release(&empty_k[st]);
          if (IOATTN_SM90_EARLY_Q && n_blocks == 1) release(&empty_q[qb]);
          mask_and_softmax(key_block(0, n_blocks, rot));
          convert_p();
          if (tr) FWD_TRACE(cw, round, 5);
        }

        // ---- steady state: S_i = Q K_i^T issued with O += P_{i-1} V_{i-1} ----
        for (int i = 1; i < n_blocks; ++i) {
          const uint32_t st = ring_stage(ring + i, kStages), prev = ring_stage(ring + i - 1, kStages);
          mbarrier_wait(&full_k[st], ring_phase(ring + i, kStages));
          named_barrier_sync(sched_mine, 256);
          issue_qk(st, q_tile);
          rescale_o();  // O to the max of block i-1, while Q K_i^T runs
          mbarrier_wait(&full_v[prev], ring_phase(ring + i - 1, kStages));
          issue_pv(prev, i == 1);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<1>();  // S_i ready (P V may still run)
          fence_s();
          release(&empty_k[st]);
          if (IOATTN_SM90_EARLY_Q && i == n_blocks - 1) release(&empty_q[qb]);
          mask_and_softmax(key_block(i, n_blocks, rot));
          wgmma_wait<0>();  // P_{i-1} V_{i-1} done: pf and the V slot are free
          fence_o();
          release(&empty_v[prev]);
          convert_p();
        }
        // Every Q K^T of this tile has completed: the producer may load the next Q.
        if (!IOATTN_SM90_EARLY_Q) release(&empty_q[qb]);
        if (tr) FWD_TRACE(cw, round, 6);

        // ---- last P V (kQRing: with the next tile's first Q K^T in the same turn) ----
        const uint32_t prev = ring_stage(ring + n_blocks - 1, kStages);
        mbarrier_wait(&full_v[prev], ring_phase(ring + n_blocks - 1, kStages));
        const int tn = kQRing ? tile_of_round(round + 1, p.zigzag) : p.num_tiles;
        if (kQRing && tn < p.num_tiles) {
          // The producer loaded the next tile's Q a tile ahead and its K0 after this tile's loads.
          const uint32_t next_st = ring_stage(ring + n_blocks, kStages);
          mbarrier_wait(&full_q[qb ^ 1], ((q_iter + 1) >> 1) & 1);
          mbarrier_wait(&full_k[next_st], ring_phase(ring + n_blocks, kStages));
          named_barrier_sync(sched_mine, 256);
          rescale_o();
          issue_pv(prev, n_blocks == 1);
          issue_qk(next_st, q_base + (qb ^ 1) * Tr::kQBytes);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<1>();  // P V done; the next tile's S still runs, beside this tile's epilogue
          fence_o();
          release(&empty_v[prev]);
          if (tr) FWD_TRACE(cw, round, 7);
          epilogue();
          epilogue_done = true;
          if (tr) FWD_TRACE(cw, round, 8);
          // The next tile's first block (non-causal: its mask does not depend on the rows).
          const TileCoord nc = decode_tile<kCausal>(tn, p);
          wgmma_wait<0>();
          fence_s();
          release(&empty_k[next_st]);
          if (IOATTN_SM90_EARLY_Q && n_blocks == 1) release(&empty_q[qb ^ 1]);
          row_max[0] = row_max[1] = -INFINITY;
          row_sum[0] = row_sum[1] = 0.0f;
          mask_and_softmax(key_block(0, n_blocks, key_rotation(nc.m_block, n_blocks, p)));
          convert_p();
          s0_done = true;
        } else {
          named_barrier_sync(sched_mine, 256);
          rescale_o();
          issue_pv(prev, n_blocks == 1);
          named_barrier_arrive(sched_other, 256);
          wgmma_wait<0>();
          fence_o();
          release(&empty_v[prev]);
          if (tr) FWD_TRACE(cw, round, 7);
          s0_done = false;
        }
        ring += n_blocks;
        ++q_iter;
      }

      if (!epilogue_done) {
        epilogue();
        if (tr) FWD_TRACE(cw, round, 8);
      }
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
  constexpr int kSmem = Tr::kSmemBytes + (kV3QRing<kCausal> ? Tr::kQBytes : 0);  // (kQRing: a second Q buffer)
  static_assert(kSmem <= 227 * 1024, "shared memory per block");
  auto kernel = flash_fwd_sm90_v3_kernel<Tr, kCausal>;
  IOATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
#if IOATTN_FWD_TRACE
  static int calls = 0;
  if (++calls == 10) fwd_trace_arm(l.stream);
#endif
  kernel<<<l.grid, Tr::kThreads, kSmem, l.stream>>>(l.q, l.k, l.v, l.params);
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

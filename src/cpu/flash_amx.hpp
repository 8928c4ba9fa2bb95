// AMX-BF16 tile products for the CPU flash forward with bf16 inputs (flash_cpu.cpp).
//
// The forward keeps its tiling (a task = Br query rows of one (batch, kv head); key blocks of Bc
// keys; the online softmax down the columns of S^T, in fp32) and replaces its two fp32 register
// GEMMs with TDPBF16PS (bf16 pairs, products exact, fp32 sums; input denormals read as zero):
//   S^T (Bc keys, Br rows) = K_blk . Q^T      A = 16 staged K rows x 32 dims (the input's bf16
//                                            bits, copied), B = Q in VNNI order, C = S^T tiles
//                                            stored straight into the softmax's fp32 buffer
//                                            (unscaled: the softmax multiplies by the scale).
//   O^T (dv, Br)  += V_blk^T . P^T           A = the staged V^T (16 columns x 32 keys), B = P^T
//                                            in VNNI order (key pairs interleaved per row: the
//                                            softmax writes it so, rounding P to bf16 as the
//                                            GPU kernels do), C = the O^T accumulator (fp32).
// Tiles (palette 1, all 16 x 64 bytes, serving_amx's configuration): C in tmm0-3 (2 x 2 tiles of
// 16 x 16 fp32), A in tmm4/5, B in tmm6/7.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ioattn::detail::flash {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define IOATTN_HAVE_FLASH_AMX 1
// In a Highway per-target section (expanded there, so it follows HWY_TARGET): whether this target
// may call these functions (x86 AVX-512 and better; the AMX checks are flash_amx_usable()'s).
#define IOATTN_FLASH_AMX_HWY_TARGET (HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3)
// AMX-BF16 and AVX512-BF16 present, the OS permission granted, IOATTN_CPU_AMX not 0.
bool flash_amx_usable();
// The thread's tile configuration (before the first product of a task) and its release (after).
void flash_amx_begin();
void flash_amx_end();
// st[j * ldst + c] = sum_x K[j][x] Q[c][x] for the key tiles kt in [kt0[u], kt1[u]) of each
// 16-column tile u < ncol_tiles (a pair of column tiles computes the union of their ranges).
// ks: staged K rows (d bf16 each, d % 32 == 0; flash_cpu.cpp zero-pads bf16 rows of 32 k + 16 to
// 32 (k + 1)), enough rows for every key tile asked for.
// qv: Q in VNNI order, [u][d / 32][16 dim pairs][16 columns] 32-bit pairs.
void flash_amx_qk(const uint16_t* ks, size_t d, const uint32_t* qv, size_t ncol_tiles, const int32_t* kt0,
                  const int32_t* kt1, float* st, size_t ldst);
// ot[x * ldo + c] += sum_j V[j][x] P[c][j] for x < dv (dv % 16 == 0), key chunks of 32 in
// [kc0[u], kc1[u]) of each 16-column tile u. vt: staged V^T, vt[x * ldv + j] (bf16, ldv % 32 == 0);
// pv: P^T in VNNI order, pv[(j / 2) * ldp + c] = (P[c][j], P[c][j + 1]) as two bf16.
void flash_amx_pv(const uint16_t* vt, size_t ldv, size_t dv, const uint32_t* pv, size_t ldp, size_t ncol_tiles,
                  const int32_t* kc0, const int32_t* kc1, float* ot, size_t ldo);
// The B tiles of one 16-column group of Q: qv[c * 256 + k * 16 + i] = (q_i[32 c + 2 k], q_i[32 c + 2 k + 1])
// for rows[i] (bf16, d % 32 == 0; nullptr: a pad column, zeros); qv 64-byte aligned.
void flash_amx_pack_q(const uint16_t* const* rows, size_t d, uint32_t* qv);
// out[i * ldr + x] = ot[x * ldo + i], i < 16, x < dv (dv % 16 == 0): 16 rows of O from O^T.
void flash_amx_unpack_o(const float* ot, size_t ldo, size_t dv, float* out, size_t ldr);
// The online softmax of a block that no row masks and without softcap / ALiBi (flash_cpu.cpp's
// SoftmaxBlock for that case, with its lazy running max), in AVX512-BF16: for each group g of 16
// query rows (columns of st, ldst apart per key), scores st * scale, running max m, sum l, rescale
// alpha, poison flag (NaN / +inf seen); P^T written as bf16 key pairs into pv (rows ldp apart),
// zero pairs up to the next 32 keys. hook(hook_arg), if set, runs before each group (prefetch).
// pv_lo (f16 inputs): also P - bf16(P) as bf16 pairs there (P = the two parts to ~2^-17).
void flash_amx_softmax_plain(const float* st, size_t ldst, size_t ngroups, size_t len, float scale, float lazy,
                             float* m, float* l, float* alpha, float* poison, uint32_t* pv, size_t ldp,
                             void (*hook)(void*), void* hook_arg, uint32_t* pv_lo = nullptr);
// f16 values -> hi = bf16(x), lo = bf16(x - hi) (exact: x = hi + lo), and hi_finite = hi with inf /
// NaN as 0 (lo is 0 there too): the products pair an inf / NaN only with the other operand's hi
// part, so a non-finite input gives the fp32 path's inf / NaN, never an inf - inf of two parts.
void flash_amx_split_f16(const uint16_t* src, size_t n, uint16_t* hi, uint16_t* lo, uint16_t* hi_finite);
// dst[0, n) = the bf16 of n 8-bit cache codes (e4m3: value * 2^-8; else int8), exactly; NaN codes NaN.
void flash_amx_codes_to_bf16(const uint8_t* src, size_t n, bool e4m3, uint16_t* dst);
// vt[x * ldv + j] = v_j[x] for j < n, x < dv (dv % 16 == 0, <= 512); columns j in [n, ldv) zero
// (ldv % 32 == 0). rows[j]: key j's V row (bf16).
void flash_amx_stage_vt(const uint16_t* const* rows, size_t n, size_t dv, uint16_t* vt, size_t ldv);
// C (M x N) = [C +] alpha * A B for the backward's tile products: A(m, k) = a[m * sam + k * sak]
// (rows or columns contiguous take vector packing), B (K x N) row-major (ldb), C row-major (ldc),
// all fp32; A and B rounded to bf16 (exact for values read from bf16 inputs), the products by
// TDPBF16PS into a 64-byte aligned per-thread scratch, then added to C. The caller holds the
// tile configuration (flash_amx_begin).
// b_slot >= 0: B is the one flash_amx_pack_b(b_slot, N, K, ...) packed last on this thread (b
// and ldb unused), for an operand that several products share.
// split (f16 inputs; B packed with the same flag): each operand as two bf16 parts, x = hi + lo
// with lo = bf16(x - hi) (exact for f16 values, ~16 bits for others), one product of depth 3 K:
// [A_hi | A_lo | A_hi'] . [B_hi ; B_hi' ; B_lo] (the lo . lo term, < 2^-16 relative, dropped), x'
// being hi with inf / NaN as 0 and lo 0 there, so a non-finite value meets only hi parts (as the
// forward's f16 rows, flash_amx_split_f16).
void flash_amx_matmul(size_t M, size_t N, size_t K, const float* a, size_t sam, size_t sak, const float* b,
                      size_t ldb, float* c, size_t ldc, bool accumulate, float alpha, int b_slot = -1,
                      bool split = false);
void flash_amx_pack_b(int slot, size_t N, size_t K, const float* b, size_t ldb, bool split = false);
#else
#define IOATTN_FLASH_AMX_HWY_TARGET false
#endif

}  // namespace ioattn::detail::flash

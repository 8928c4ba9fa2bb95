// AMX-INT8 kernels for the CPU decode with i8 caches (serving_cpu.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ioattn::detail::serving {

// AMX-INT8 for i8 caches (x86-64 with AMX-TILE + AMX-INT8, Linux).
// Q.K^T and P.V with int8 tile products (TDPBSSD: s8 x s8 -> s32, exact) instead of converting
// every cache code to fp32. The fp32 operand (pre-scaled Q row, or a block's P row) is written as
// a fixed-point integer with 4 balanced base-256 limbs (each in [-128, 127]):
//   Q row:  q_x * 2^E = sum_l limb_l(x) * 2^(8 l), |q * 2^E| < 2^29 (E per row: the largest |q_x|
//           to [2^28, 2^29)); error <= 2^-30 of the row's largest |q|, far below fp32 FMA rounding
//           over the row (and ~2^-23 of the 8-bit codes' own step).
//   P row:  p_j * 2^30 (p in [0, 1]); error <= 2^-31 absolute per weight (l >= 1 after the max).
// Every limb product sum is exact in int32 (|limb|, |code| <= 128, <= 512 terms: < 2^23), and
// the 4 limb sums are combined in fp32 by Horner (x 256 steps), then x 2^-E (exact).
// Tiles (palette 1, all 8 as 16 x 64 bytes): scores use tmm0/1 (C), tmm2/3 (A), tmm4/5 (B) for two
// heads at once; P.V uses tmm1 (A) and tmm0/3 (C), tmm2/4 (B) for two column tiles at once.
//   scores: A = 16 keys' codes (64 dims), B = the limbs of 4 Q rows in VNNI order
//           (B[k4][n * 4 + i] = limb l of row rl at dim 4 k4 + i, n = 4 rl + l), C = keys x (row, limb),
//           transposed in registers to (row, limb) x keys.
//   P.V:    A = the limbs of 4 P rows (A[4 rl + l][j] = limb l of p_{rl, j}, 64 keys), B = 64 keys'
//           V codes, 16 columns, in VNNI order (4 keys interleaved per column), C = (row, limb) x
//           columns. The columns of B come out permuted (column n of interleave group u is x =
//           16 (n / 4) + 4 u + n % 4 within 64 columns): the accumulator rows stay in that order
//           until the task finishes (amx_unpermute).
// Linux hands out the AMX register state only after arch_prctl(ARCH_REQ_XCOMP_PERM); asked once.
// IOATTN_CPU_AMX=0 turns the path off (the Highway fp32 path runs instead).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define IOATTN_HAVE_AMX 1
bool amx_usable();
void amx_begin();
void amx_end();
// Limbs of R rows (stride dp) of d dims into B tiles at qb ([group of 4 rows][d / 64][1024 B]),
// qmul[r] = 2^-E_r. False when a row is not finite or too small/large to scale.
bool amx_pack_q(const float* qf, size_t dp, size_t d, int64_t R, int8_t* qb, float* qmul);
// Two heads at once (two independent tile chains; qb1 == nullptr: one head):
// s_i[r * bc + k], k < 16, r < R: scores of the 16 keys at rows[k] + off_i (d codes each) with
// head i's Q limbs qb_i and factors qmul_i. stage: room for 32 rows of d bytes. pf[k] + off_i,
// k < npf: rows prefetched (into L2) after the tile loads.
void amx_scores16(const uint8_t* const* rows, int64_t off0, int64_t off1, size_t d, const int8_t* qb0,
                  const int8_t* qb1, int64_t R, const float* qmul0, const float* qmul1, float* s0, float* s1,
                  size_t bc, uint8_t* stage, const uint8_t* const* pf = nullptr, size_t npf = 0);
// acc[r * dvp + x'] += sum_j p[r * bc + j] * V_j[x] for keys j < n (<= 64), rows r < R with
// act[r] != 0 (x' the permuted column of x); V_j at rows[j] + off, dv codes (dv % 64 == 0);
// rows[n + j] + off, j < npf (the next block) prefetched during the staging loop.
void amx_pv64(const float* p, size_t bc, const float* act, int64_t R, const uint8_t* const* rows, int64_t off,
              size_t n, size_t dv, float* acc, size_t dvp, int8_t* pl, uint8_t* stage, size_t npf = 0);
// Row in permuted column order -> natural order (width 64: the i8 P.V, 32: the f8e4m3 P.V;
// dv % width == 0).
void amx_unpermute(float* row, size_t dv, size_t width);

// f8e4m3 caches, AMX-BF16 (TDPBF16PS: bf16 pairs, products exact, fp32 sums): the codes are
// converted to bf16 (exact, subnormals included) into a staging buffer; Q rows (scaled by 2^E
// to [1, 2): no bf16 denormals under the instruction's DAZ) and P rows are split into 4 bf16
// parts each (p = p0 + p1 + p2 + p3, each the bf16 of the remainder: 32 bits of mantissa), one C
// column (scores) / A row (P.V) per part, summed in fp32 smallest first. NaN codes: a NaN score
// for the key (K), the fp32 rule per row for the block (V: keys with P == 0 skipped). The 2^8 of
// serving_cpu's value / 256 convention is folded into qmul and the P.V combine.
// Not used by default: measured slower than the Highway fp32 path on the machine it was written on
// (docs/PERF.md); IOATTN_CPU_AMX_E4M3=1 (and amx_bf16_usable()) turns it on.
bool amx_bf16_usable();
bool amx_e4m3_requested();
// Q parts in B-tile order at qb ([group of 4 rows][d / 32][512 uint16]); qmul[r] = 2^-E / 256.
bool amx_pack_q_bf16(const float* qf, size_t dp, size_t d, int64_t R, uint16_t* qb, float* qmul);
// Scores of 16 keys for all H heads (head h: rows[k] + h * k_head, Q parts at qb + h * qb_head,
// qmul + h * R, s + h * R * bc), as amx_scores16 (d % 32 == 0); stage: 64 rows of 2 d bytes.
void amx_scores16_e4m3(const uint8_t* const* rows, int64_t H, int64_t k_head, size_t d, const uint16_t* qb,
                       size_t qb_head, int64_t R, const float* qmul, float* s, size_t bc, uint8_t* stage);
// As amx_pv64 (dv % 32 == 0; acc columns permuted with width 32); pl: ceil(R / 4) x 2 KiB;
// stage: 128 dv bytes.
void amx_pv64_e4m3(const float* p, size_t bc, const float* act, int64_t R, const uint8_t* const* rows, int64_t off,
                   size_t n, size_t dv, float* acc, size_t dvp, uint16_t* pl, uint8_t* stage);
#endif

}  // namespace ioattn::detail::serving

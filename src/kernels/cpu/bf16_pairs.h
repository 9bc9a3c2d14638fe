// Small bf16 products for the attention tiles: C (f32) = alpha * A B + beta * C
// with bf16 operands and f32 accumulation. B comes in "pair rows" (the layout
// of AVX512-BF16's dot-product instruction and of oneDNN's VNNI format): pair
// row p holds, for each of the n columns, the values of B's rows 2p and 2p+1
// side by side. The attention kernels pack their operands in this layout once
// per call, so a tile product is a plain loop over pair rows.
#pragma once

#include <cstdint>

namespace hspmd::kernels {

// A: m rows of kp bf16 values (kp even; pad with zeros), row stride lda.
// B: kp / 2 pair rows of n (row 2p, row 2p+1) pairs, pair row p at b + p * ldb.
// C: m x n f32, row stride ldc; beta 0 overwrites it (C may hold anything).
// Runs AVX512-BF16 code where the CPU has it and bf16 GEMMs are not emulated
// (kernels::bf16_gemm_emulated()), else portable code with the same rounding
// of the operands.
void gemm_bf16_pairs(int64_t m, int64_t n, int64_t kp, float alpha, const uint16_t* a,
                     int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
                     int64_t ldc);

// The portable code alone (the fallback), for tests.
void gemm_bf16_pairs_portable(int64_t m, int64_t n, int64_t kp, float alpha, const uint16_t* a,
                              int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
                              int64_t ldc);

// Two f32 rows of n values as n pairs (r0[c], r1[c]) of bf16 (rounded to
// nearest even), out[2c] and out[2c + 1]; r1 null stands for zeros.
void bf16_row_pairs(const float* r0, const float* r1, int64_t n, uint16_t* out);

// An f32 tile [m, n] (row stride ld) as bf16 [m, even(n)] (row stride ldo),
// rounded to nearest even; an odd n gets a zero column. The left operand of
// a tile product. Unlike the bulk f32_to_bf16_n (hspmd/core/dtype.h) it
// converts a whole strided tile in one call (a call per 64-value row cost
// more than the conversion) and flushes denormals on AVX512-BF16.
void bf16_tile_rows(const float* s, int64_t m, int64_t n, int64_t ld, uint16_t* out, int64_t ldo);

// Whether gemm_bf16_pairs runs AVX512-BF16 code now.
bool bf16_pairs_native();

}  // namespace hspmd::kernels

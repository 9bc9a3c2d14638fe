// Pieces shared by the CPU attention kernels (attention.cc: whole sequences;
// attention_block.cc: one block of context-parallel attention): the sgemm
// call, row masking, the online-softmax step and the k / v transposition.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "hspmd/core/ndarray.h"
#include "vec_math.h"

namespace hspmd::kernels::attention_tile {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Below this many score multiply-adds a call runs on one thread: waking the
// team would cost more than it saves.
constexpr int64_t kParallelWork = int64_t{1} << 22;

inline void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

// Masks the scores of one query row outside its allowed keys [lo, hi) (key
// indices relative to the tile's first key).
inline void mask_row(float* row, int64_t nk, int64_t lo, int64_t hi) {
  std::fill(row, row + std::clamp<int64_t>(lo, 0, nk), kNegInf);
  std::fill(row + std::clamp<int64_t>(hi, 0, nk), row + nk, kNegInf);
}

// Max of a row, in 16 independent lanes so that it vectorizes.
inline float row_max(const float* row, int64_t n) {
  float lane[16];
  std::fill_n(lane, 16, kNegInf);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16)
    for (int u = 0; u < 16; ++u) lane[u] = row[c + u] > lane[u] ? row[c + u] : lane[u];
  for (; c < n; ++c) lane[0] = row[c] > lane[0] ? row[c] : lane[0];
  return *std::max_element(lane, lane + 16);
}

// Online softmax step of one row: turns scores into exp(s - m_new), updates
// the running max m and sum l, and returns the factor for the row's output.
inline float softmax_update(float* row, int64_t nk, float& m, float& l) {
  const float m_new = std::max(m, row_max(row, nk));
  if (m_new == kNegInf) {  // nothing visible yet in this row
    std::fill(row, row + nk, 0.0f);
    return 1.0f;
  }
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < nk; ++c) {
    row[c] = vec::exp_scalar(row[c] - m_new);
    sum += row[c];
  }
  const float corr = vec::exp_scalar(m - m_new);
  l = l * corr + sum;
  m = m_new;
  return corr;
}

// P = exp(s - lse) over one row of scores (0 where masked).
inline void probs_row(float* row, int64_t nk, float lse) {
#pragma omp simd
  for (int64_t c = 0; c < nk; ++c) row[c] = vec::exp_scalar(row[c] - lse);
}

// [B, S, H, D] -> [B, H, D, S], so that Q K^T is a plain product.
inline std::vector<float> heads_transposed(const NDArray& a, bool parallel) {
  const int64_t B = a.dim(0), S = a.dim(1), H = a.dim(2), D = a.dim(3);
  std::vector<float> t(a.numel());
  const float* src = a.data<float>();
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t j = 0; j < S; ++j)
      for (int64_t d = 0; d < D; ++d)
        t[(bh * D + d) * S + j] = src[((bh / H * S + j) * H + bh % H) * D + d];
  return t;
}

}  // namespace hspmd::kernels::attention_tile

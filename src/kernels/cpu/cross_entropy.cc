// Softmax cross-entropy on CPU. One pass for the row max, one for the sum of
// exponentials (a vectorizable exp), OpenMP over rows; per-row losses are
// summed in double in row order, so the loss does not depend on the threads.
// Logits f32 or bf16 (widened row by row: the same f32 arithmetic).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "hspmd/core/dtype.h"
#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

#include "vec_math.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

struct RowStats {
  float max;
  float sum;  // Σ exp(x - max)
};

RowStats row_stats(const float* x, int64_t v) {
  const float m = vec::row_max(x, v);
  return {m, vec::sum_exp(x, v, m)};
}

// Throws on the first target outside [0, v) that is not ignore_index.
void check_targets(const NDArray& targets, int64_t v, int ignore_index) {
  const int32_t* t = targets.data<int32_t>();
  for (int64_t r = 0; r < targets.numel(); ++r)
    if (t[r] != ignore_index && (t[r] < 0 || t[r] >= v))
      fail("[cross_entropy] target ", t[r], " at position ", r, " is outside the vocabulary [0, ",
           v, ") and is not ignore_index ", ignore_index);
}

// The logits' rows as f32 (f32 or bf16 logits; cross-entropy computes in
// f32 either way): an f32 row is read in place, a bf16 one widened (exact)
// into a buffer of the calling thread's own.
class Rows {
 public:
  Rows(const NDArray& logits, const char* what) : v_(logits.dim(-1)) {
    if (logits.dtype() == DType::BF16) {
      bf16_ = static_cast<const uint16_t*>(logits.raw_data());
    } else {
      HSPMD_CHECK(logits.dtype() == DType::F32, what, ": logits must be f32 or bf16, got ",
                  dtype_name(logits.dtype()));
      f32_ = logits.data<float>();
    }
  }
  // Row r as f32; `buffer` holds it when the logits are bf16.
  const float* row(int64_t r, std::vector<float>& buffer) const {
    if (f32_ != nullptr) return f32_ + r * v_;
    buffer.resize(static_cast<size_t>(v_));
    bf16_to_f32_n(bf16_ + r * v_, buffer.data(), v_);
    return buffer.data();
  }

 private:
  int64_t v_;
  const float* f32_ = nullptr;
  const uint16_t* bf16_ = nullptr;
};

// How many of a shard's `v` entries, from global entry `begin`, are classes.
int64_t class_columns(int64_t v, int64_t begin, int64_t classes) {
  return classes > 0 ? std::clamp<int64_t>(classes - begin, 0, v) : v;
}

}  // namespace

void cross_entropy(const NDArray& logits, const NDArray& targets, const NDArray& normalizer,
                   int ignore_index, NDArray& loss, NDArray& lse, int64_t classes) {
  require_contiguous("cross_entropy", logits);
  require_contiguous("cross_entropy", targets);
  const int64_t v = logits.dim(-1), rows = targets.numel();
  HSPMD_CHECK(logits.numel() == rows * v && loss.numel() == 1, "cross_entropy: sizes");
  const int64_t n = class_columns(v, 0, classes);
  check_targets(targets, n, ignore_index);
  const Rows x(logits, "cross_entropy");
  const int32_t* t = targets.data<int32_t>();
  float* row_lse = lse.data<float>();
  std::vector<double> row_loss(rows, 0.0);
#pragma omp parallel if (rows * v > 32768)
  {
    std::vector<float> buffer;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      row_lse[r] = 0.0f;
      if (t[r] == ignore_index) continue;
      const float* xr = x.row(r, buffer);
      const RowStats st = row_stats(xr, n);
      const double l = std::log(static_cast<double>(st.sum)) + st.max;
      row_lse[r] = static_cast<float>(l);
      row_loss[r] = l - xr[t[r]];
    }
  }
  double total = 0;
  for (double l : row_loss) total += l;
  loss.data<float>()[0] = static_cast<float>(total / normalizer.data<float>()[0]);
}

void cross_entropy_shard_stats(const NDArray& logits, const NDArray& targets,
                               int64_t vocab_begin, int64_t vocab_size, int ignore_index,
                               NDArray& local_lse, NDArray& target_logit, int64_t classes) {
  require_contiguous("cross_entropy", logits);
  require_contiguous("cross_entropy", targets);
  const int64_t v = logits.dim(-1), rows = targets.numel();
  HSPMD_CHECK(logits.numel() == rows * v && local_lse.numel() == rows &&
                  target_logit.numel() == rows,
              "cross_entropy_shard_stats: sizes");
  HSPMD_CHECK(vocab_begin >= 0 && vocab_begin + v <= vocab_size,
              "cross_entropy_shard_stats: vocab range");
  check_targets(targets, classes > 0 ? classes : vocab_size, ignore_index);
  const int64_t n = class_columns(v, vocab_begin, classes);
  const Rows x(logits, "cross_entropy_shard_stats");
  const int32_t* t = targets.data<int32_t>();
  float* lse = local_lse.data<float>();
  float* picked = target_logit.data<float>();
#pragma omp parallel if (rows * v > 32768)
  {
    std::vector<float> buffer;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      lse[r] = 0.0f;
      picked[r] = 0.0f;
      if (t[r] == ignore_index) continue;
      if (n == 0) {  // a shard of padding only: no class, nothing to add
        lse[r] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float* xr = x.row(r, buffer);
      const RowStats st = row_stats(xr, n);
      lse[r] = static_cast<float>(std::log(static_cast<double>(st.sum)) + st.max);
      const int64_t local = t[r] - vocab_begin;
      if (local >= 0 && local < n) picked[r] = xr[local];
    }
  }
}

void cross_entropy_combine(const NDArray& shard_lse, const NDArray& target_logit,
                           const NDArray& targets, const NDArray& normalizer, int ignore_index,
                           NDArray& loss, NDArray& lse) {
  require_contiguous("cross_entropy", shard_lse);
  const int64_t rows = targets.numel(), shards = shard_lse.dim(0);
  HSPMD_CHECK(shard_lse.numel() == shards * rows && target_logit.numel() == rows &&
                  lse.numel() == rows && loss.numel() == 1,
              "cross_entropy_combine: sizes");
  const float* part = shard_lse.data<float>();
  const float* picked = target_logit.data<float>();
  const int32_t* t = targets.data<int32_t>();
  float* out_lse = lse.data<float>();
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    out_lse[r] = 0.0f;
    if (t[r] == ignore_index) continue;
    double m = part[r];
    for (int64_t s = 1; s < shards; ++s) m = std::max(m, static_cast<double>(part[s * rows + r]));
    double sum = 0;
    for (int64_t s = 0; s < shards; ++s) sum += std::exp(part[s * rows + r] - m);
    const double l = m + std::log(sum);
    out_lse[r] = static_cast<float>(l);
    total += l - picked[r];
  }
  loss.data<float>()[0] = static_cast<float>(total / normalizer.data<float>()[0]);
}

void cross_entropy_backward(const NDArray& dloss, const NDArray& logits, const NDArray& targets,
                            const NDArray& normalizer, const NDArray& lse, int ignore_index,
                            int64_t vocab_begin, NDArray& dlogits, int64_t classes) {
  require_contiguous("cross_entropy_backward", logits);
  const int64_t v = logits.dim(-1), rows = targets.numel();
  HSPMD_CHECK(logits.numel() == rows * v && dlogits.numel() == rows * v,
              "cross_entropy_backward: sizes");
  const bool bf16 = dlogits.dtype() == DType::BF16;
  HSPMD_CHECK(bf16 || dlogits.dtype() == DType::F32, "cross_entropy_backward: dlogits must be f32 or bf16");
  const Rows x(logits, "cross_entropy_backward");
  const int32_t* t = targets.data<int32_t>();
  const float* row_lse = lse.data<float>();
  const float g = dloss.data<float>()[0] / normalizer.data<float>()[0];
  const int64_t n = class_columns(v, vocab_begin, classes);
#pragma omp parallel if (rows * v > 32768)
  {
    // A bf16 gradient's rows are computed in f32 here, then rounded.
    std::vector<float> row(bf16 ? v : 0), buffer;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* dr = bf16 ? row.data() : dlogits.data<float>() + r * v;
      if (t[r] == ignore_index) {
        std::memset(dr, 0, v * sizeof(float));
      } else {
        vec::exp_scale(x.row(r, buffer), n, row_lse[r], g, dr);
        std::memset(dr + n, 0, (v - n) * sizeof(float));
        const int64_t local = t[r] - vocab_begin;
        if (local >= 0 && local < n) dr[local] -= g;
      }
      if (bf16) f32_to_bf16_n(dr, dlogits.data<uint16_t>() + r * v, v);
    }
  }
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT

// Embedding lookup and its scatter-add gradient on CPU.
#include <algorithm>
#include <cstring>

#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

// Throws on the first id outside [0, vocab) (checked before any parallel work).
void check_ids(const NDArray& ids, int64_t vocab) {
  const int32_t* p = ids.data<int32_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    if (p[t] < 0 || p[t] >= vocab)
      fail("[embedding] token id ", p[t], " at position ", t, " is outside the vocabulary [0, ",
           vocab, ")");
}

}  // namespace

void embedding(const NDArray& weight, const NDArray& ids, int64_t vocab_begin, int64_t vocab_size,
               NDArray& out) {
  require_contiguous("embedding", weight);
  require_contiguous("embedding", ids);
  const int64_t rows = weight.dim(0), hidden = weight.dim(1), tokens = ids.numel();
  HSPMD_CHECK(out.numel() == tokens * hidden, "embedding: output size");
  HSPMD_CHECK(vocab_begin >= 0 && vocab_begin + rows <= vocab_size, "embedding: vocab range");
  check_ids(ids, vocab_size);
  const int32_t* id = ids.data<int32_t>();
  const float* w = weight.data<float>();
  float* y = out.data<float>();
#pragma omp parallel for schedule(static) if (tokens * hidden > 65536)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t row = id[t] - vocab_begin;
    if (row >= 0 && row < rows)
      std::memcpy(y + t * hidden, w + row * hidden, hidden * sizeof(float));
    else
      std::memset(y + t * hidden, 0, hidden * sizeof(float));
  }
}

void embedding_backward(const NDArray& grad, const NDArray& ids, int64_t vocab_begin,
                        int64_t vocab_size, NDArray& dweight) {
  require_contiguous("embedding_backward", grad);
  const int64_t rows = dweight.dim(0), hidden = dweight.dim(1), tokens = ids.numel();
  HSPMD_CHECK(grad.numel() == tokens * hidden, "embedding_backward: grad size");
  HSPMD_CHECK(vocab_begin >= 0 && vocab_begin + rows <= vocab_size,
              "embedding_backward: vocab range");
  check_ids(ids, vocab_size);
  const int32_t* id = ids.data<int32_t>();
  const float* g = grad.data<float>();
  float* dw = dweight.data<float>();
  std::memset(dw, 0, dweight.nbytes());
  // Each column block belongs to one task that visits tokens in order: no races,
  // and the summation order is fixed.
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (hidden + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (tokens * hidden > 65536)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t h0 = b * kBlock, h1 = std::min(hidden, h0 + kBlock);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t row = id[t] - vocab_begin;
      if (row < 0 || row >= rows) continue;
      float* dst = dw + row * hidden;
      const float* src = g + t * hidden;
      for (int64_t h = h0; h < h1; ++h) dst[h] += src[h];
    }
  }
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT

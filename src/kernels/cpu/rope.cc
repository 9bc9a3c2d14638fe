// Rotary position embedding on CPU (Hugging Face rotate_half convention).
// Angles and their cos/sin are computed in double, once per distinct position,
// and kept for the next call with the same range.
#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <vector>

#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/cpu/variant.h"

namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT {

namespace {

// cos, sin and -sin of every (position, frequency) for positions [lo, hi].
struct RopeTable {
  float theta = 0;
  int64_t d = 0;
  int32_t lo = 0, hi = -1;
  std::vector<float> cos, sin, minus_sin;
};

// The table of the last call (forward and backward of every layer ask for
// the same one), made anew when theta, d or the positions' range change.
std::shared_ptr<const RopeTable> rope_table(float theta, int64_t d, int32_t lo, int32_t hi) {
  static std::mutex mu;
  static std::shared_ptr<const RopeTable> last;
  std::lock_guard<std::mutex> lock(mu);
  if (last && last->theta == theta && last->d == d && last->lo == lo && last->hi == hi) return last;
  auto t = std::make_shared<RopeTable>();
  t->theta = theta, t->d = d, t->lo = lo, t->hi = hi;
  const int64_t half = d / 2, span = static_cast<int64_t>(hi) - lo + 1;
  std::vector<double> inv_freq(half);
  for (int64_t i = 0; i < half; ++i)
    inv_freq[i] = std::pow(static_cast<double>(theta), -2.0 * i / static_cast<double>(d));
  t->cos.resize(span * half), t->sin.resize(span * half), t->minus_sin.resize(span * half);
#pragma omp parallel for schedule(static) if (span * half > 4096)
  for (int64_t p = 0; p < span; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p + lo) * inv_freq[i];
      t->cos[p * half + i] = static_cast<float>(std::cos(angle));
      t->sin[p * half + i] = static_cast<float>(std::sin(angle));
      t->minus_sin[p * half + i] = static_cast<float>(-std::sin(angle));
    }
  last = t;
  return last;
}

}  // namespace

void rope(const NDArray& x, const NDArray& positions, float theta, bool inverse, NDArray& out) {
  require_contiguous("rope", x);
  require_contiguous("rope", positions);
  HSPMD_CHECK(x.ndim() == 4 && out.numel() == x.numel(), "rope: x must be [B, S, heads, D]");
  const int64_t tokens = x.dim(0) * x.dim(1), heads = x.dim(2), d = x.dim(3), half = d / 2;
  HSPMD_CHECK(positions.numel() == tokens && d % 2 == 0, "rope: positions or head dim");
  const bool bf16 = out.dtype() == DType::BF16, bf16_x = x.dtype() == DType::BF16;
  HSPMD_CHECK(bf16 || out.dtype() == DType::F32, "rope: out must be f32 or bf16");
  HSPMD_CHECK(bf16_x || x.dtype() == DType::F32, "rope: x must be f32 or bf16");
  const int32_t* pos = positions.data<int32_t>();
  const float* px = bf16_x ? nullptr : x.data<float>();
  const uint16_t* px16 = bf16_x ? x.data<uint16_t>() : nullptr;
  // cos/sin per distinct position: batches repeat positions 0..S-1 (or per
  // document), so a table over [min, max] is far smaller than one per token.
  int32_t lo = 0, hi = -1;
  if (tokens > 0) lo = *std::min_element(pos, pos + tokens), hi = *std::max_element(pos, pos + tokens);
  const std::shared_ptr<const RopeTable> table = rope_table(theta, d, lo, hi);
  const float* cs = table->cos.data();
  const float* sn = (inverse ? table->minus_sin : table->sin).data();
#pragma omp parallel if (x.numel() > 32768)
  {
    std::vector<float> row(bf16 ? d : 0);    // a bf16 output's head, in f32 first
    std::vector<float> in_row(bf16_x ? d : 0);  // a bf16 input's head, widened
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const float* c = cs + (pos[t] - lo) * half;
      const float* sv = sn + (pos[t] - lo) * half;
      for (int64_t hd = 0; hd < heads; ++hd) {
        const int64_t at = (t * heads + hd) * d;
        if (bf16_x) bf16_to_f32_n(px16 + at, in_row.data(), d);
        const float* xi = bf16_x ? in_row.data() : px + at;
        float* yi = bf16 ? row.data() : out.data<float>() + at;
        for (int64_t i = 0; i < half; ++i) {
          const float a = xi[i], b = xi[i + half];
          yi[i] = a * c[i] - b * sv[i];
          yi[i + half] = b * c[i] + a * sv[i];
        }
        if (bf16) f32_to_bf16_n(yi, out.data<uint16_t>() + at, d);
      }
    }
  }
}

// q, then k: rope's bits, by construction.
void rope_qk(const NDArray& q, const NDArray& k, const NDArray& positions, float theta, bool inverse,
             NDArray& q_out, NDArray& k_out) {
  rope(q, positions, theta, inverse, q_out);
  rope(k, positions, theta, inverse, k_out);
}

}  // namespace hspmd::kernels::cpu::HSPMD_CPU_VARIANT

// Conformance of the CUDA backend's attention on cuDNN's fused SDPA
// (docs/cuda.md, "Attention on cuDNN") against the CPU kernels with bf16
// products, in the arrays the training graphs use (bf16 or f32 I/O): head
// dims 64 and 128, GQA 8:2, S 150 and 4096, causal, no documents, documents
// as cu_seqlens and as positions (packed: THD), a sliding window; forward
// (out, lse) and backward (dq, dk, dv). cuDNN is required here (as
// HSPMD_CUDNN_ATTENTION=1): a case it refuses fails instead of falling back.
// Then the fallback itself (a head dim cuDNN does not take), f32 products
// staying on our kernels, and the time of forward and backward at the
// TinyLlama shape (B 4, Hq 32, Hkv 4, S 4096, D 64, causal). Exits 0, 1 (a
// case failed) or 77 (no CUDA device, or a build without cuDNN attention).
//   RESULT probe=conformance_attention case=<c> ... status=PASS|FAIL
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "conformance.h"
#include "hspmd/core/device.h"
#include "hspmd/core/error.h"
#include "kernels/attention.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/memory.h"

namespace hspmd {
namespace {

using namespace conformance;
namespace kc = kernels::cuda;

struct Outputs {
  NDArray out, lse, dq, dk, dv;
};

// Forward and backward on one backend (device arrays come back to the host).
// io BF16: q, k, v, out and the gradients dq, dk, dv in bf16, as the bf16
// training graph has them on a GPU (the inputs rounded first on both
// backends; grad_out stays f32).
Outputs run(bool on_gpu, const NDArray& q32, const NDArray& k32, const NDArray& v32, const NDArray& go,
            const NDArray& docs, float scale, DType products, int64_t window, DType io = DType::F32) {
  const NDArray q = q32.to(io), k = k32.to(io), v = v32.to(io);
  Stream& st = on_gpu ? gpu() : cpu();
  auto put = [&](const NDArray& a) { return on_gpu && a.valid() ? up(a) : a; };
  auto get = [&](const NDArray& a) { return on_gpu ? down(a) : a; };
  const Device dev = on_gpu ? Device::cuda(0) : Device::cpu();
  const int64_t B = q.dim(0), S = q.dim(1), Hq = q.dim(2);
  NDArray out = NDArray::empty(q.shape(), io, dev), lse = NDArray::empty({B, Hq, S}, DType::F32, dev);
  NDArray dq = NDArray::empty(q.shape(), io, dev), dk = NDArray::empty(k.shape(), io, dev);
  NDArray dv = NDArray::empty(v.shape(), io, dev);
  const NDArray gq = put(q), gk = put(k), gv = put(v), gdocs = put(docs);
  // Small tiles on the small cases (several tiles per row), the defaults at S 4096.
  const kernels::AttentionTiles tiles = S > 1024 ? kernels::AttentionTiles{} : kernels::AttentionTiles{32, 32};
  kernels::attention_forward(st, gq, gk, gv, gdocs, scale, out, lse, tiles, products, window);
  kernels::attention_backward(st, gq, gk, gv, out, lse, put(go), gdocs, scale, dq, dk, dv, tiles, products, window);
  return {get(out), get(lse), get(dq), get(dk), get(dv)};
}

struct Case {
  std::string name;
  int64_t D;
  NDArray docs;
  int64_t window;
  DType io = DType::F32;
  int64_t B = 2, S = 150, Hq = 8, Hkv = 2;
};

// Documents of lengths 40, 110 | 70, 80 over two rows of 150 tokens.
NDArray cu_seqlens() { return NDArray::from_vector_i32({5}, {0, 40, 150, 220, 300}); }
NDArray positions() {
  std::vector<int32_t> pos(300);
  for (int64_t t = 0; t < 300; ++t) {
    const int64_t r = t % 150, start = t < 150 ? (r < 40 ? 0 : 40) : (r < 70 ? 0 : 70);
    pos[t] = static_cast<int32_t>(r - start);
  }
  return NDArray::from_vector_i32({2, 150}, pos);
}
// One row of 4096 tokens as packed documents of 1000, 2500 and 596 tokens
// (positions restart at each document, as token-budget batches have them).
NDArray positions_4096() {
  std::vector<int32_t> pos(4096);
  for (int64_t t = 0; t < 4096; ++t) pos[t] = static_cast<int32_t>(t < 1000 ? t : t < 3500 ? t - 1000 : t - 3500);
  return NDArray::from_vector_i32({1, 4096}, pos);
}

// cuDNN (required) against the CPU's bf16 products, through the entry points
// and in the arrays the training graphs use: io BF16 is the bf16 graph on a
// GPU (q, k, v, O and the gradients bf16), io F32 is HSPMD_ATTENTION_IO=f32
// (f32 arrays; cuDNN's bf16 O widened). Small cases (S 150) and the
// TinyLlama sequence (S 4096, causal, GQA 8:2, head dims 64 and 128, packed
// documents, a window). cuDNN's outputs are bf16 (one rounding, 2^-9
// relative) and it rounds its probabilities differently from our kernels,
// so the bound comes from the same case: three times the distance between
// the CPU's bf16 and f32 products (what rounding the products alone moves),
// at least 2e-2 of the largest value; lse within 1e-3 (fp32 on both). A
// kernel that computes the wrong attention is off by O(1).
void against_cpu() {
  const std::vector<Case> cases = {
      {"d64", 64, NDArray(), 0},
      {"d64_bf16_io", 64, NDArray(), 0, DType::BF16},
      {"d128_cu_seqlens_bf16_io", 128, cu_seqlens(), 0, DType::BF16},
      {"d128", 128, NDArray(), 0},
      {"d64_window", 64, NDArray(), 37},
      {"d128_cu_seqlens", 128, cu_seqlens(), 0},
      {"d64_positions", 64, positions(), 0},
      {"d128_cu_seqlens_window", 128, cu_seqlens(), 37},
      {"s4096_d64_bf16_io", 64, NDArray(), 0, DType::BF16, 1, 4096, 8, 2},
      {"s4096_d128_docs_window_bf16_io", 128, positions_4096(), 1024, DType::BF16, 1, 4096, 8, 2},
      {"s4096_d64_docs_f32_io", 64, positions_4096(), 0, DType::F32, 1, 4096, 8, 2},
      {"s4096_d128_window_f32_io", 128, NDArray(), 1024, DType::F32, 1, 4096, 8, 2},
  };
  kc::set_cudnn_attention_mode(kc::CudnnAttention::kRequired);
  for (const Case& c : cases)
    run_case("cudnn_" + c.name, [&] {
      const int64_t B = c.B, S = c.S, Hq = c.Hq, Hkv = c.Hkv, D = c.D;
      const float scale = 0.9f / std::sqrt(static_cast<float>(D));
      const NDArray q = random_f32({B, S, Hq, D}, 80), k = random_f32({B, S, Hkv, D}, 81);
      const NDArray v = random_f32({B, S, Hkv, D}, 82), go = random_f32({B, S, Hq, D}, 83);
      const int64_t calls = kc::cudnn_attention_calls();
      const Outputs want = run(false, q, k, v, go, c.docs, scale, DType::BF16, c.window, c.io);
      const Outputs exact = run(false, q, k, v, go, c.docs, scale, DType::F32, c.window, c.io);
      const Outputs got = run(true, q, k, v, go, c.docs, scale, DType::BF16, c.window, c.io);
      const auto grads = [](const Outputs& a, const Outputs& b) {
        return std::max({rel_diff(a.dq, b.dq), rel_diff(a.dk, b.dk), rel_diff(a.dv, b.dv)});
      };
      const double e_out = rel_diff(got.out, want.out), e_lse = rel_diff(got.lse, want.lse);
      const double e_grad = grads(got, want);
      const double tol_out = std::max(2e-2, 3 * rel_diff(want.out, exact.out));
      const double tol_grad = std::max(2e-2, 3 * grads(want, exact));
      const int64_t served = kc::cudnn_attention_calls() - calls;
      const bool dtypes = got.out.dtype() == c.io && got.dq.dtype() == c.io && got.dk.dtype() == c.io;
      char d[240];
      std::snprintf(d, sizeof d, "S=%lld D=%lld window=%lld out=%.1e/%.1e lse=%.1e grads=%.1e/%.1e cudnn_calls=%lld",
                    (long long)S, (long long)D, (long long)c.window, e_out, tol_out, e_lse, e_grad, tol_grad,
                    (long long)served);
      result("cudnn_" + c.name, e_out < tol_out && e_lse < 1e-3 && e_grad < tol_grad && served == 2 && dtypes, d);
    });
}

// Auto mode falls back (reason recorded) for a head dim cuDNN does not take,
// and the result is still right; required mode names the reason; f32
// products never go to cuDNN.
void fallbacks() {
  run_case("fallback", [] {
    const int64_t B = 1, S = 33, Hq = 4, Hkv = 2, D = 20;
    const NDArray q = random_f32({B, S, Hq, D}, 90), k = random_f32({B, S, Hkv, D}, 91);
    const NDArray v = random_f32({B, S, Hkv, D}, 92), go = random_f32({B, S, Hq, D}, 93);
    kc::set_cudnn_attention_mode(kc::CudnnAttention::kAuto);
    const Outputs want = run(false, q, k, v, go, NDArray(), 0.2f, DType::BF16, 0);
    const kernels::FusedAttentionReport before = kernels::fused_attention_report();
    const Outputs got = run(true, q, k, v, go, NDArray(), 0.2f, DType::BF16, 0);
    const std::string reason = kc::cudnn_attention_fallback_reason();
    const kernels::FusedAttentionReport after = kernels::fused_attention_report();
    const double e = std::max({rel_diff(got.out, want.out), rel_diff(got.dq, want.dq), rel_diff(got.dk, want.dk)});
    result("fallback_auto", e < 1e-2 && reason.find("head dim 20") != std::string::npos,
           "rel=" + std::to_string(e) + " reason=\"" + reason + "\"");
    // What training reports (a warning, the step records' attention_fallbacks):
    // the forward and the backward counted, the reason kept.
    result("fallback_reported",
           after.fallbacks - before.fallbacks == 2 && after.cudnn_calls == before.cudnn_calls &&
               after.last_fallback.find("head dim 20") != std::string::npos,
           "fallbacks=" + std::to_string(after.fallbacks - before.fallbacks) + " last=\"" + after.last_fallback + "\"");
    // The same with bf16 arrays: our kernels on f32 copies, the output rounded.
    const Outputs want16 = run(false, q, k, v, go, NDArray(), 0.2f, DType::BF16, 0, DType::BF16);
    const Outputs got16 = run(true, q, k, v, go, NDArray(), 0.2f, DType::BF16, 0, DType::BF16);
    const double e16 = std::max({rel_diff(got16.out, want16.out), rel_diff(got16.dq, want16.dq),
                                 rel_diff(got16.dk, want16.dk), rel_diff(got16.dv, want16.dv)});
    const bool bf16_grads = got16.dq.dtype() == DType::BF16 && got16.dk.dtype() == DType::BF16 &&
                            got16.dv.dtype() == DType::BF16;
    result("fallback_auto_bf16_io", e16 < 1e-2 && got16.out.dtype() == DType::BF16 && bf16_grads,
           "rel=" + std::to_string(e16));
    kc::set_cudnn_attention_mode(kc::CudnnAttention::kRequired);
    std::string error;
    try {
      run(true, q, k, v, go, NDArray(), 0.2f, DType::BF16, 0);
    } catch (const Error& x) {
      error = x.what();
    }
    result("fallback_required_throws", error.find("HSPMD_CUDNN_ATTENTION=1") != std::string::npos,
           "error=\"" + error + "\"");
    const int64_t calls = kc::cudnn_attention_calls();
    run(true, random_f32({1, 33, 4, 64}, 94), random_f32({1, 33, 2, 64}, 95), random_f32({1, 33, 2, 64}, 96),
        random_f32({1, 33, 4, 64}, 97), NDArray(), 0.125f, DType::F32, 0);
    result("f32_products_not_cudnn", kc::cudnn_attention_calls() == calls);
  });
}

// Median time of `f` over 10 runs after 3 warm-ups (events on the stream).
template <typename F>
double median_ms(F&& f) {
  std::vector<double> ms;
  for (int i = 0; i < 13; ++i) {
    Event a, b;
    a.record(gpu());
    f();
    b.record(gpu());
    gpu().synchronize();
    if (i >= 3) ms.push_back(b.elapsed_ms(a));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// The model's shape through the op, in the bf16 graph's arrays (q, k, v, O,
// dO and the gradients bf16, as training on a GPU has them). Causal: the
// forward counts 4 B Hq S^2 D / 2 flops, the backward 2.5 times that.
void timing() {
  run_case("timing_tinyllama", [] {
    kc::set_cudnn_attention_mode(kc::CudnnAttention::kRequired);
    const int64_t B = 4, S = 4096, Hq = 32, Hkv = 4, D = 64;
    const float scale = 0.125f;
    const auto bf16_up = [](const NDArray& a) { return up(a.to(DType::BF16)); };
    NDArray q = bf16_up(random_f32({B, S, Hq, D}, 100)), k = bf16_up(random_f32({B, S, Hkv, D}, 101));
    NDArray v = bf16_up(random_f32({B, S, Hkv, D}, 102)), go = bf16_up(random_f32({B, S, Hq, D}, 103));
    NDArray out = dev_empty(q.shape(), DType::BF16), lse = dev_empty({B, Hq, S});
    NDArray dq = dev_empty(q.shape(), DType::BF16), dk = dev_empty(k.shape(), DType::BF16);
    NDArray dv = dev_empty(v.shape(), DType::BF16);
    const kernels::AttentionTiles tiles;
    const double fwd = median_ms(
        [&] { kernels::attention_forward(gpu(), q, k, v, NDArray(), scale, out, lse, tiles, DType::BF16, 0); });
    const double bwd = median_ms([&] {
      kernels::attention_backward(gpu(), q, k, v, out, lse, go, NDArray(), scale, dq, dk, dv, tiles, DType::BF16, 0);
    });
    const double flops = 4.0 * B * Hq * S * S * D / 2;
    char d[200];
    std::snprintf(d, sizeof d, "B=%lld Hq=%lld Hkv=%lld S=%lld D=%lld fwd_ms=%.3f fwd_tflops=%.1f bwd_ms=%.3f "
                  "bwd_tflops=%.1f", (long long)B, (long long)Hq, (long long)Hkv, (long long)S, (long long)D, fwd,
                  flops / fwd / 1e9, bwd, 2.5 * flops / bwd / 1e9);
    result("timing_tinyllama", fwd > 0 && bwd > 0, d);
  });
}

}  // namespace
}  // namespace hspmd

int main() {
  using namespace hspmd;
  conformance::program = "conformance_attention";
  // Loading libcudnn needs no device: this line shows it works everywhere.
  std::string why;
  const int version = kernels::cuda::sdpa::cudnn_version(&why);
  std::printf("RESULT probe=conformance_attention case=cudnn_version runtime=%d %s status=INFO\n", version,
              why.empty() ? "" : ("why=\"" + why + "\"").c_str());
  if (cuda_device_count() == 0) {
    std::printf("RESULT probe=conformance_attention case=device status=SKIP (no CUDA device)\n");
    return 77;
  }
  if (why.find("this build has no cuDNN") != std::string::npos) {
    std::printf("RESULT probe=conformance_attention case=build status=SKIP (no cuDNN attention in this build)\n");
    return 77;
  }
  against_cpu();
  fallbacks();
  timing();
  std::printf("conformance_attention: %d failure(s)\n", conformance::failures);
  return conformance::failures == 0 ? 0 : 1;
}

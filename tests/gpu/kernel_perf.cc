// The conformance harness's performance mode (docs/cuda.md): each kernel of
// a training step timed at the TinyLlama-1.1B shape (hidden 2048, FFN 5632,
// 32 / 4 heads of 64, vocabulary 32000, `--tokens` tokens, default 8192),
// with its achieved bandwidth or FLOP rate against ceilings measured in the
// same run: a device-to-device copy (GB/s, memory-bound kernels) and a bf16
// GEMM of 8192^3 (TFLOP/s, GEMMs and attention).
//
//   kernel_perf [--device cuda:0 | cpu] [--tokens N] [--reps R]
//
// Bytes count each kernel's compulsory traffic (every input read once, every
// output written once); FLOPs the products (2 per multiply-add; causal
// attention half the square, its backward 2.5 times the forward). One line
// per kernel: `RESULT probe=kernel_perf case=<kernel> ms=... gbps=...|tflops=...
// pct=... status=PASS` (PASS: it ran; the numbers are the measurement), then
// a table. The step's GEMMs run twice: with the library's algorithm
// (`gemm_*`) and with the fastest of its top few that give the library
// algorithm's bits, measured per shape (`gemm_*_measured`,
// kernels::GemmAlgorithm::kMeasured). Exits 77 with
// `--device cuda*` and no GPU. On the CPU (`--device
// cpu`, small `--tokens`) it checks the harness itself.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/ndarray.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd {
namespace {

struct Row {
  std::string kernel;
  double ms = 0;
  double rate = 0;     // GB/s or TFLOP/s
  bool flops = false;  // rate is TFLOP/s
  double pct = 0;      // of the ceiling of its kind
};

class Perf {
 public:
  Perf(Device device, int reps) : device_(device), s_(default_stream(device)), reps_(reps) {}

  // The median milliseconds of `reps` runs of `work` (after one warm-up).
  double time_ms(const std::function<void()>& work) {
    work();
    std::vector<double> ms;
    for (int r = 0; r < reps_; ++r) {
      Event start, end;
      start.record(s_);
      work();
      end.record(s_);
      end.synchronize();
      ms.push_back(end.elapsed_ms(start));
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

  NDArray filled(const Shape& shape, float value, DType dtype = DType::F32) {
    NDArray a = NDArray::empty(shape, DType::F32, device_);
    kernels::fill(s_, a, value);
    return dtype == DType::F32 ? a : kernels::cast(s_, a, dtype);
  }
  NDArray ids(int64_t n, int64_t limit) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % limit);
    return kernels::to_device(s_, NDArray::from_vector_i32({n}, v));
  }

  void bandwidth(const std::string& name, double bytes, const std::function<void()>& work) {
    const double ms = time_ms(work);
    add({name, ms, bytes / (ms * 1e-3) / 1e9, false, 0});
  }
  void flop_rate(const std::string& name, double flops, const std::function<void()>& work) {
    const double ms = time_ms(work);
    add({name, ms, flops / (ms * 1e-3) / 1e12, true, 0});
  }

  void set_ceilings(double gbps, double tflops) {
    copy_gbps_ = gbps;
    gemm_tflops_ = tflops;
  }
  void report() {
    std::printf("\n%-30s %10s %12s %8s\n", "kernel", "ms", "rate", "of ceil");
    for (Row& r : rows_) {
      r.pct = 100.0 * r.rate / (r.flops ? gemm_tflops_ : copy_gbps_);
      std::printf("%-30s %10.3f %9.1f %s %7.1f%%\n", r.kernel.c_str(), r.ms, r.rate, r.flops ? "TF/s" : "GB/s",
                  r.pct);
      std::printf("RESULT probe=kernel_perf case=%s ms=%.4f %s=%.2f pct=%.1f status=PASS\n", r.kernel.c_str(), r.ms,
                  r.flops ? "tflops" : "gbps", r.rate, r.pct);
    }
    std::printf("ceilings: copy %.1f GB/s, bf16 GEMM %.1f TFLOP/s (%s)\n", copy_gbps_, gemm_tflops_,
                device_.str().c_str());
  }

  Stream& stream() { return s_; }
  Device device() const { return device_; }

 private:
  void add(Row r) {
    std::printf("%-30s %.3f ms\n", r.kernel.c_str(), r.ms);
    std::fflush(stdout);
    rows_.push_back(std::move(r));
  }

  Device device_;
  Stream& s_;
  int reps_;
  double copy_gbps_ = 1, gemm_tflops_ = 1;
  std::vector<Row> rows_;
};

// The block's and the head's GEMMs at the TinyLlama shape, each row's name
// followed by `suffix`.
void gemms(Perf& p, const NDArray& x16, int64_t T, const std::string& suffix) {
  Stream& s = p.stream();
  const Device device = p.device();
  const int64_t H = 2048, F = 5632, V = 32000, HQ = 32, HKV = 4, D = 64;
  struct Gemm {
    const char* name;
    int64_t k, n;
  };
  for (const Gemm& gm : {Gemm{"gemm_qkv", H, (HQ + 2 * HKV) * D}, Gemm{"gemm_o", HQ * D, H}, Gemm{"gemm_gate_up", H, 2 * F},
                         Gemm{"gemm_down", F, H}, Gemm{"gemm_lm_head", H, V}}) {
    NDArray a = gm.k == H ? x16 : p.filled({T, gm.k}, 0.01f, DType::BF16);
    NDArray w = p.filled({gm.n, gm.k}, 0.01f, DType::BF16), out = NDArray::empty({T, gm.n}, DType::F32, device);
    p.flop_rate(gm.name + suffix, 2.0 * T * gm.k * gm.n,
                [&] { kernels::matmul(s, a, w, false, true, out, kernels::GemmCompute::kBF16); });
  }
  // The backward's q/k/v dgrad with the gradient so far as the addend
  // (cuBLASLt, C != D): against the plain dgrad, what the addend costs.
  NDArray g = p.filled({T, HQ * D}, 0.01f, DType::BF16), w = p.filled({HQ * D, H}, 0.01f, DType::BF16);
  NDArray out = NDArray::empty({T, H}, DType::F32, device), add = p.filled({T, H}, 0.5f);
  p.flop_rate("gemm_dgrad_q" + suffix, 2.0 * T * HQ * D * H,
              [&] { kernels::matmul(s, g, w, false, false, out, kernels::GemmCompute::kBF16); });
  p.flop_rate("gemm_dgrad_q_addend" + suffix, 2.0 * T * HQ * D * H,
              [&] { kernels::matmul(s, g, w, false, false, out, kernels::GemmCompute::kBF16, &add); });
}

int run(Device device, int64_t T, int reps) {
  Perf p(device, reps);
  Stream& s = p.stream();
  const int64_t H = 2048, F = 5632, V = 32000, HQ = 32, HKV = 4, D = 64;
  const double f4 = 4, b2 = 2;

  // Ceilings.
  const int64_t big = device.type == DeviceType::CUDA ? (int64_t{1} << 28) : (int64_t{1} << 24);
  NDArray src = p.filled({big}, 1.0f), dst = NDArray::empty({big}, DType::F32, device);
  const double copy_ms = p.time_ms([&] { kernels::copy(s, src, dst); });
  const double copy_gbps = 2.0 * f4 * static_cast<double>(big) / (copy_ms * 1e-3) / 1e9;
  src = NDArray();
  dst = NDArray();
  const int64_t g = device.type == DeviceType::CUDA ? 8192 : 512;
  NDArray ga = p.filled({g, g}, 0.01f, DType::BF16), gb = p.filled({g, g}, 0.01f, DType::BF16);
  NDArray gc = NDArray::empty({g, g}, DType::F32, device);
  const double gemm_ms = p.time_ms([&] { kernels::matmul(s, ga, gb, false, true, gc, kernels::GemmCompute::kBF16); });
  const double gemm_tflops = 2.0 * g * g * g / (gemm_ms * 1e-3) / 1e12;
  p.set_ceilings(copy_gbps, gemm_tflops);
  std::printf("ceiling copy: %.1f GB/s; bf16 GEMM %lld^3: %.1f TFLOP/s\n", copy_gbps, static_cast<long long>(g),
              gemm_tflops);

  // GEMMs of a block and the head (bf16 operands, f32 out; x · W^T), with
  // the library's first algorithm (kHeuristic, the default), then with the
  // fastest of its top few whose output has that algorithm's bits, measured
  // at the first call of each shape (kMeasured, HSPMD_GEMM_ALGO=measured;
  // the rows named *_measured). How many were eligible is not reported: the
  // choice is internal to the CUDA backend.
  NDArray x16 = p.filled({T, H}, 0.01f, DType::BF16);
  const kernels::GemmAlgorithm before = kernels::gemm_algorithm();
  for (const auto& [algorithm, suffix] : {std::pair{kernels::GemmAlgorithm::kHeuristic, ""},
                                          std::pair{kernels::GemmAlgorithm::kMeasured, "_measured"}}) {
    kernels::set_gemm_algorithm(algorithm);
    gemms(p, x16, T, suffix);
  }
  kernels::set_gemm_algorithm(before);
  x16 = NDArray();

  // Memory-bound kernels.
  NDArray x = p.filled({T, H}, 0.5f), y = NDArray::empty({T, H}, DType::F32, device);
  NDArray dy = p.filled({T, H}, 0.25f), dx = NDArray::empty({T, H}, DType::F32, device);
  NDArray wn = p.filled({H}, 1.0f), dwn = NDArray::empty({H}, DType::F32, device);
  const double th = static_cast<double>(T * H);
  p.bandwidth("add", 3 * f4 * th, [&] { kernels::add(s, x, dy, y); });
  p.bandwidth("cast_f32_bf16", (f4 + b2) * th, [&] { (void)kernels::cast(s, x, DType::BF16); });
  p.bandwidth("rms_norm", 2 * f4 * th, [&] { kernels::rms_norm(s, x, wn, 1e-5f, y); });
  {
    NDArray y16 = NDArray::empty({T, H}, DType::BF16, device);  // the bf16 step's: norm and cast in one
    p.bandwidth("rms_norm_bf16_out", (f4 + b2) * th, [&] { kernels::rms_norm(s, x, wn, 1e-5f, y16); });
  }
  {
    // The decoder's post-attention pair as the bf16 step runs it: the bf16
    // block input and attention branch in, the f32 sum and the bf16 norm out
    // (the separate add and norm moved 4 more bytes an element: the sum read
    // again); the bf16 block input's norm as the block's first reads it.
    const NDArray a16 = kernels::cast(s, x, DType::BF16), b16 = kernels::cast(s, dy, DType::BF16);
    NDArray y16 = NDArray::empty({T, H}, DType::BF16, device);
    p.bandwidth("add_rms_norm_bf16", (2 * b2 + f4 + b2) * th,
                [&] { kernels::add_rms_norm(s, a16, b16, wn, 1e-5f, y, y16); });
    p.bandwidth("rms_norm_bf16_in_out", 2 * b2 * th, [&] { kernels::rms_norm(s, a16, wn, 1e-5f, y16); });
  }
  {
    // RoPE's backward as the bf16 step runs it: bf16 in and out, inverse.
    const NDArray q16 = kernels::cast(s, p.filled({1, T, HQ, D}, 0.5f), DType::BF16);
    NDArray qo = NDArray::empty({1, T, HQ, D}, DType::BF16, device);
    NDArray pos = p.ids(T, T).reshape({1, T});
    p.bandwidth("rope_bf16_backward", 2 * b2 * static_cast<double>(T * HQ * D),
                [&] { kernels::rope(s, q16, pos, 10000.0f, true, qo); });
  }
  p.bandwidth("rms_norm_backward", 3 * f4 * th, [&] { kernels::rms_norm_backward(s, dy, x, wn, 1e-5f, dx, dwn); });
  {
    // With the residual stream's gradient added in the same pass.
    const NDArray add = p.filled({T, H}, 0.125f);
    p.bandwidth("rms_norm_backward_addend", 4 * f4 * th,
                [&] { kernels::rms_norm_backward(s, dy, x, wn, 1e-5f, dx, dwn, &add); });
  }
  {
    // The bf16 step's: f32 in, bf16 out (attention's input).
    NDArray q = p.filled({1, T, HQ, D}, 0.5f), qo = NDArray::empty({1, T, HQ, D}, DType::BF16, device);
    NDArray pos = p.ids(T, T).reshape({1, T});
    p.bandwidth("rope_bf16_out", (f4 + b2) * static_cast<double>(T * HQ * D),
                [&] { kernels::rope(s, q, pos, 10000.0f, false, qo); });
    // The decoder's call: q and k in one (one table, one launch).
    NDArray k = p.filled({1, T, HKV, D}, 0.5f), ko = NDArray::empty({1, T, HKV, D}, DType::BF16, device);
    p.bandwidth("rope_qk_bf16_out", (f4 + b2) * static_cast<double>(T * (HQ + HKV) * D),
                [&] { kernels::rope_qk(s, q, k, pos, 10000.0f, false, qo, ko); });
  }
  {
    // As the bf16 step runs them: gate, up and the output in bf16, dy in f32
    // (down_proj's input gradient), dgate and dup in bf16.
    const NDArray gate = kernels::cast(s, p.filled({T, F}, 0.5f), DType::BF16);
    const NDArray up = kernels::cast(s, p.filled({T, F}, 0.5f), DType::BF16);
    NDArray out = NDArray::empty({T, F}, DType::BF16, device), dyf = p.filled({T, F}, 0.25f);
    NDArray dgate = NDArray::empty({T, F}, DType::BF16, device), dup = NDArray::empty({T, F}, DType::BF16, device);
    const double tf = static_cast<double>(T * F);
    p.bandwidth("swiglu_bf16", 3 * b2 * tf, [&] { kernels::swiglu(s, gate, up, out); });
    p.bandwidth("swiglu_backward_bf16", (f4 + 4 * b2) * tf,
                [&] { kernels::swiglu_backward(s, dyf, gate, up, dgate, dup); });
    // The bf16 step's: the output recomputed for down_proj's weight gradient
    // in the same pass.
    p.bandwidth("swiglu_backward_recompute_bf16", (f4 + 5 * b2) * tf,
                [&] { kernels::swiglu_backward(s, dyf, gate, up, dgate, dup, &out); });
  }
  {
    NDArray w = p.filled({V, H}, 0.01f), tok = p.ids(T, V), dw = NDArray::empty({V, H}, DType::F32, device);
    p.bandwidth("embedding", 2 * f4 * th, [&] { kernels::embedding(s, w, tok, 0, V, y); });
    p.bandwidth("embedding_backward", f4 * th + f4 * static_cast<double>(V * H),
                [&] { kernels::embedding_backward(s, dy, tok, 0, V, dw); });
  }
  {
    NDArray logits = p.filled({T, V}, 0.01f), tgt = p.ids(T, V), norm = p.filled({1}, static_cast<float>(T));
    NDArray loss = NDArray::empty({1}, DType::F32, device), lse = NDArray::empty({T}, DType::F32, device);
    NDArray dl = p.filled({1}, 1.0f), dlog = NDArray::empty({T, V}, DType::F32, device);
    const double tv = static_cast<double>(T * V);
    p.bandwidth("cross_entropy", f4 * tv, [&] { kernels::cross_entropy(s, logits, tgt, norm, -100, loss, lse); });
    p.bandwidth("cross_entropy_backward", 2 * f4 * tv,
                [&] { kernels::cross_entropy_backward(s, dl, logits, tgt, norm, lse, -100, 0, dlog); });
    dlog = NDArray::empty({T, V}, DType::BF16, device);  // the bf16 step's: the head GEMM's operand
    p.bandwidth("cross_entropy_backward_bf16", (f4 + b2) * tv,
                [&] { kernels::cross_entropy_backward(s, dl, logits, tgt, norm, lse, -100, 0, dlog); });
  }
  {
    // AdamW over eight FFN-sized tensors: p, g, m, v read; p, m, v written.
    std::vector<NDArray> ps, gs, ms, vs;
    for (int i = 0; i < 8; ++i) {
      ps.push_back(p.filled({H, F}, 0.1f));
      gs.push_back(p.filled({H, F}, 0.01f));
      ms.push_back(p.filled({H, F}, 0.0f));
      vs.push_back(p.filled({H, F}, 0.0f));
    }
    std::vector<kernels::AdamTensor> list;
    for (int i = 0; i < 8; ++i) list.push_back({&ps[i], &gs[i], &ms[i], &vs[i]});
    kernels::AdamFactors f;
    f.beta1 = 0.9f, f.beta2 = 0.95f, f.eps = 1e-8f, f.one_minus_beta1 = 0.1f, f.one_minus_beta2 = 0.05f;
    f.step_size = 1e-4f;
    p.bandwidth("adam_step", 7 * f4 * 8.0 * static_cast<double>(H * F), [&] { kernels::adam_step(s, list, f); });
    p.bandwidth("sum_of_squares", f4 * 8.0 * static_cast<double>(H * F), [&] { (void)kernels::sum_of_squares(s, gs); });
  }
  {
    // Attention, bf16 products, causal, sequences of up to 4096 tokens.
    const int64_t S = std::min<int64_t>(T, 4096), B = std::max<int64_t>(1, T / S);
    NDArray q = p.filled({B, S, HQ, D}, 0.1f), k = p.filled({B, S, HKV, D}, 0.1f), v = p.filled({B, S, HKV, D}, 0.1f);
    NDArray o = NDArray::empty({B, S, HQ, D}, DType::F32, device), lse = NDArray::empty({B, HQ, S}, DType::F32, device);
    NDArray dq = NDArray::empty(q.shape(), DType::F32, device), dk = NDArray::empty(k.shape(), DType::F32, device),
            dv = NDArray::empty(v.shape(), DType::F32, device), dout = p.filled(o.shape(), 0.01f);
    const double fwd = 4.0 * B * HQ * static_cast<double>(S) * S * D / 2;
    const float scale = 0.125f;
    p.flop_rate("attention_forward", fwd, [&] {
      kernels::attention_forward(s, q, k, v, NDArray(), scale, o, lse, kernels::attention_tiles(), DType::BF16);
    });
    p.flop_rate("attention_backward", 2.5 * fwd, [&] {
      kernels::attention_backward(s, q, k, v, o, lse, dout, NDArray(), scale, dq, dk, dv, kernels::attention_tiles(),
                                  DType::BF16);
    });
  }
  p.report();
  return 0;
}

}  // namespace
}  // namespace hspmd

int main(int argc, char** argv) {
  using namespace hspmd;
  std::string device = "cuda:0";
  int64_t tokens = 8192;
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) device = argv[++i];
    else if (a == "--tokens" && i + 1 < argc) tokens = std::atoll(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "kernel_perf: unknown argument '%s' (--device D, --tokens N, --reps R)\n", a.c_str());
      return 2;
    }
  }
  if (tokens < 1 || reps < 1) {
    std::fprintf(stderr, "kernel_perf: --tokens and --reps must be >= 1\n");
    return 2;
  }
  try {
    const Device d = parse_device_name(device, "--device");
    if (d.type == DeviceType::CUDA && cuda_device_count() == 0) {
      std::printf("RESULT probe=kernel_perf case=device status=SKIP (no CUDA device)\n");
      return 77;
    }
    require_device(d);
    return run(d, tokens, reps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kernel_perf: %s\n", e.what());
    return 1;
  }
}

// Conformance of the CUDA backend's device runtime and memory kernels
// against the CPU backend (docs/cuda.md): every kernel of kernels/memory.h
// and the f32 elementwise kernels on random inputs of odd sizes, each result
// compared with the CPU kernel's on the same inputs; the device errors and
// the allocator's accounting. Exits 0 (pass), 1 (a case failed) or 77 (no
// CUDA device: CTest reports it skipped). One line per case:
//   RESULT probe=conformance_memory case=<c> ... status=PASS|FAIL
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/error.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"
#include "conformance.h"

namespace hspmd {
namespace {

using namespace conformance;

void transfers() {
  run_case("round_trip", [] {
    for (DType t : {DType::F32, DType::BF16, DType::I32, DType::I64}) {
      NDArray host = random_f32({3, 37, 5}, 1);
      if (t == DType::BF16) host = host.to(DType::BF16);
      if (t == DType::I32 || t == DType::I64) {
        std::vector<int32_t> v(host.numel());
        for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>(i * 7919 % 1000) - 500;
        host = NDArray::from_vector_i32(host.shape(), v);
        if (t == DType::I64) host = host.to(DType::I64);
      }
      const NDArray dev = up(host);
      const NDArray back = down(dev);
      const bool ok = dev.device() == device_under_test && back.device() == Device::cpu() && max_diff(back, host) == 0;
      result(std::string("round_trip_") + dtype_name(t), ok);
    }
  });
}

void fills_and_copies() {
  run_case("fill", [] {
    for (DType t : {DType::F32, DType::BF16, DType::I32, DType::I64}) {
      NDArray c = NDArray::empty({1001}, t), g = NDArray::empty({1001}, t, device_under_test);
      kernels::fill(cpu(), c, -2.7f);
      kernels::fill(gpu(), g, -2.7f);
      result(std::string("fill_") + dtype_name(t), max_diff(down(g), c) == 0);
    }
    result("zeros", max_diff(down(kernels::zeros(gpu(), {7, 9}, DType::F32)), kernels::zeros(cpu(), {7, 9}, DType::F32)) == 0);
  });
  run_case("copy", [] {
    const NDArray host = random_f32({333}, 2);
    const NDArray a = up(host);
    NDArray b = NDArray::empty({333}, DType::F32, device_under_test);
    kernels::copy(gpu(), a, b);
    result("copy", max_diff(down(b), host) == 0);
  });
  run_case("cast_clone", [] {
    // f32 -> bf16 -> f32 and clone: bit for bit the CPU's (round to nearest
    // even both ways), on odd sizes, values around bf16 ties included.
    NDArray host = random_f32({1001}, 21);
    const std::vector<float> ties = {1.00390625f, 1.01171875f, -3.0078125f, 0.0f, -0.0f, 65504.0f, 1e-30f};
    NDArray with_ties = NDArray::from_vector({static_cast<int64_t>(ties.size())}, ties);
    bool ok = true;
    for (const NDArray& h : {host, with_ties}) {
      const NDArray a = up(h);
      const NDArray b = kernels::cast(gpu(), a, DType::BF16);
      const NDArray f = kernels::cast(gpu(), b, DType::F32);
      const NDArray want_b = h.to(DType::BF16);
      const NDArray got_b = down(b);
      ok = ok && b.dtype() == DType::BF16 &&
           std::memcmp(got_b.host_raw_data(), want_b.host_raw_data(), want_b.nbytes()) == 0 &&
           max_diff(down(f), want_b.to(DType::F32)) == 0 && max_diff(down(kernels::clone(gpu(), a)), h) == 0;
    }
    result("cast_clone", ok);
  });
  run_case("copy_block", [] {
    // Blocks of a 4-d array into another, copied and accumulated, f32 and bf16.
    const Shape fs = {3, 17, 5, 33}, ts = {2, 9, 7, 40}, fstart = {1, 3, 0, 2}, tstart = {0, 1, 2, 5}, ext = {2, 8, 5, 31};
    for (bool acc : {false, true})
      for (DType t : {DType::F32, DType::BF16}) {
        if (acc && t != DType::F32) continue;
        const NDArray from = random_f32(fs, 3).to(t), base = random_f32(ts, 4).to(t);
        NDArray c = base.clone(), g = up(base);
        kernels::copy_block(cpu(), from, fstart, c, tstart, ext, acc);
        kernels::copy_block(gpu(), up(from), fstart, g, tstart, ext, acc);
        result(std::string("copy_block_") + dtype_name(t) + (acc ? "_accumulate" : ""), max_diff(down(g), c) == 0);
      }
  });
}

void elementwise() {
  run_case("elementwise", [] {
    const NDArray a = random_f32({1, 4099}, 5), b = random_f32({1, 4099}, 6);
    NDArray c = NDArray::empty(a.shape(), DType::F32), g = NDArray::empty(a.shape(), DType::F32, device_under_test);
    const NDArray ga = up(a), gb = up(b);
    kernels::add(cpu(), a, b, c);
    kernels::add(gpu(), ga, gb, g);
    result("add", max_diff(down(g), c) == 0);
    // f32 + bf16 (the residual stream and a bf16 branch): exact on both.
    const NDArray b16 = b.to(DType::BF16);
    kernels::add(cpu(), a, b16, c);
    kernels::add(gpu(), ga, up(b16), g);
    result("add_bf16_operand", max_diff(down(g), c) == 0);
    kernels::mul(cpu(), a, b, c);
    kernels::mul(gpu(), ga, gb, g);
    result("mul", max_diff(down(g), c) == 0);
    kernels::scale(cpu(), a, 0.37f, c);
    kernels::scale(gpu(), ga, 0.37f, g);
    result("scale", max_diff(down(g), c) == 0);
    NDArray acc_c = b.clone(), acc_g = up(b);
    kernels::accumulate(cpu(), a, acc_c);
    kernels::accumulate(gpu(), ga, acc_g);
    result("accumulate", max_diff(down(acc_g), acc_c) == 0);
    // Views one element in: not 16-byte aligned, so the kernels take one
    // element per access instead of eight (launch::elementwise).
    const auto view = [](const NDArray& x) { return x.reshape({4099}).slice(0, 1, 4099); };
    NDArray c1 = NDArray::empty({4098}, DType::F32), g1 = dev_empty({4098});
    kernels::add(cpu(), view(a), view(b), c1);
    kernels::add(gpu(), view(ga), view(gb), g1);
    const NDArray want16 = view(a).contiguous().to(DType::BF16), got16 = down(kernels::cast(gpu(), view(ga), DType::BF16));
    result("unaligned_views", max_diff(down(g1), c1) == 0 &&
                                  std::memcmp(got16.host_raw_data(), want16.host_raw_data(), want16.nbytes()) == 0);
  });
}

void optimizer() {
  run_case("sum_of_squares", [] {
    const NDArray a = random_f32({100003}, 7), b = random_f32({17}, 8);
    const double c = kernels::sum_of_squares(cpu(), {a, b});
    const double g1 = kernels::sum_of_squares(gpu(), {up(a), up(b)});
    const double g2 = kernels::sum_of_squares(gpu(), {up(a), up(b)});
    // Both sum the f32 squares exactly in double; only the order differs.
    const double rel = std::fabs(g1 - c) / c;
    char d[96];
    std::snprintf(d, sizeof d, "rel_err=%.2e deterministic=%d", rel, g1 == g2);
    result("sum_of_squares", rel < 1e-12 && g1 == g2, d);
  });
  // Many arrays in one launch: sizes around the 65536-element chunk, empty
  // ones, and an unaligned view (its chunks take one element per access).
  run_case("sum_of_squares_many", [] {
    std::vector<NDArray> host, dev;
    const int64_t sizes[] = {1, 0, 65535, 65536, 65537, 3 * 65536 + 5, 2048, 0, 7, 200003};
    for (int i = 0; i < 10; ++i) {
      host.push_back(random_f32({sizes[i]}, 20 + i));
      dev.push_back(up(host.back()));
    }
    const NDArray whole = random_f32({131075}, 40);
    host.push_back(whole.slice(0, 1, 131075).contiguous());
    const NDArray gwhole = up(whole);
    dev.push_back(gwhole.slice(0, 1, 131075));
    const double c = kernels::sum_of_squares(cpu(), host);
    const double g1 = kernels::sum_of_squares(gpu(), dev), g2 = kernels::sum_of_squares(gpu(), dev);
    const double rel = std::fabs(g1 - c) / c;
    const bool none = kernels::sum_of_squares(gpu(), {dev[1], dev[7]}) == 0.0;
    // The same values aligned (a fresh array) and not (the view): the same
    // bits, the order depending on the sizes only.
    const bool layout_free =
        kernels::sum_of_squares(gpu(), {up(host.back())}) == kernels::sum_of_squares(gpu(), {dev.back()});
    char d[128];
    std::snprintf(d, sizeof d, "rel_err=%.2e deterministic=%d empty_is_zero=%d alignment_free=%d", rel, g1 == g2,
                  none, layout_free);
    result("sum_of_squares_many", rel < 1e-12 && g1 == g2 && none && layout_free, d);
  });
  run_case("adam_step", [] {
    const kernels::AdamFactors f{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, 0.0f, 0.999f, 0.6f, 1e-3f};
    NDArray p = random_f32({5003}, 9), g = random_f32({5003}, 10);
    NDArray m = random_f32({5003}, 11), v = random_f32({5003}, 12);
    kernels::scale(cpu(), m, 0.01f, m);
    std::vector<float> vv = v.to_vector();
    for (float& x : vv) x = x * x * 0.01f;  // second moments are >= 0
    v = NDArray::from_vector(v.shape(), vv);
    NDArray gp = up(p), gg = up(g), gm = up(m), gv = up(v);
    kernels::adam_step(cpu(), {{&p, &g, &m, &v}}, f);
    kernels::adam_step(gpu(), {{&gp, &gg, &gm, &gv}}, f);
    // Same f32 operations; sqrt and division are correctly rounded on both,
    // so the results agree to an ulp or two (FMA contraction may differ).
    const double dp = max_diff(down(gp), p), dm = max_diff(down(gm), m), dv = max_diff(down(gv), v);
    char d[96];
    std::snprintf(d, sizeof d, "param=%.1e exp_avg=%.1e exp_avg_sq=%.1e", dp, dm, dv);
    result("adam_step", dp < 1e-6 && dm < 1e-6 && dv < 1e-6, d);
  });
  // AdamFactors::step (a CUDA graph's per-step factors in device memory):
  // the kernel reads decay_scale, sqrt_bc2 and step_size there, not from its
  // arguments (set to other values here), bit for bit the arguments' update
  // on this GPU.
  run_case("adam_step_factors", [] {
    const kernels::AdamFactors f{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, 0.0f, 0.999f, 0.6f, 1e-3f};
    const NDArray p = random_f32({70001}, 13), g = random_f32({70001}, 14);
    const NDArray m = NDArray::zeros({70001}, DType::F32), v = NDArray::zeros({70001}, DType::F32);
    NDArray ap = up(p), ag = up(g), am = up(m), av = up(v);
    NDArray bp = up(p), bg = up(g), bm = up(m), bv = up(v);
    kernels::adam_step(gpu(), {{&ap, &ag, &am, &av}}, f);
    const NDArray step = up(NDArray::from_vector({3}, {f.decay_scale, f.sqrt_bc2, f.step_size}));
    kernels::AdamFactors stale = f;
    stale.decay_scale = 0.5f, stale.sqrt_bc2 = 3.0f, stale.step_size = 7.0f;
    stale.step = &step;
    kernels::adam_step(gpu(), {{&bp, &bg, &bm, &bv}}, stale);
    const bool same = down(ap).to_vector() == down(bp).to_vector() && down(am).to_vector() == down(bm).to_vector() &&
                      down(av).to_vector() == down(bv).to_vector();
    result("adam_step_factors", same, same ? "bit for bit" : "the update differs from the arguments' one");
  });
}

void ops() {
  run_case("rms_norm", [] {
    // Rows of an odd width; sums in double on both backends. 155 rows: the
    // CUDA dweight's partial sums over 64-row chunks, three of them.
    const NDArray x = random_f32({5, 31, 203}, 21), w = random_f32({203}, 22), dy = random_f32({5, 31, 203}, 23);
    NDArray y = NDArray::empty(x.shape(), DType::F32), gy = NDArray::empty(x.shape(), DType::F32, device_under_test);
    kernels::rms_norm(cpu(), x, w, 1e-5f, y);
    kernels::rms_norm(gpu(), up(x), up(w), 1e-5f, gy);
    NDArray dx = NDArray::empty(x.shape(), DType::F32), dw = NDArray::empty(w.shape(), DType::F32);
    NDArray gdx = NDArray::empty(x.shape(), DType::F32, device_under_test);
    NDArray gdw = NDArray::empty(w.shape(), DType::F32, device_under_test);
    kernels::rms_norm_backward(cpu(), dy, x, w, 1e-5f, dx, dw);
    kernels::rms_norm_backward(gpu(), up(dy), up(x), up(w), 1e-5f, gdx, gdw);
    const double e1 = rel_diff(down(gy), y), e2 = rel_diff(down(gdx), dx), e3 = rel_diff(down(gdw), dw);
    char d[128];
    // The bf16 output (norm and cast in one kernel): at most one bf16 ulp
    // from the CPU's where the two f32 values straddle a rounding boundary.
    NDArray y16 = NDArray::empty(x.shape(), DType::BF16), gy16 = dev_empty(x.shape(), DType::BF16);
    kernels::rms_norm(cpu(), x, w, 1e-5f, y16);
    kernels::rms_norm(gpu(), up(x), up(w), 1e-5f, gy16);
    const double e4 = rel_diff(down(gy16), y16);
    // dx with an addend (the residual stream's gradient, added in the same pass).
    const NDArray addend = random_f32(x.shape(), 24), gaddend = up(addend);
    kernels::rms_norm_backward(cpu(), dy, x, w, 1e-5f, dx, dw, &addend);
    kernels::rms_norm_backward(gpu(), up(dy), up(x), up(w), 1e-5f, gdx, gdw, &gaddend);
    double e5 = rel_diff(down(gdx), dx);
    // Rows wider than the fused backward takes (kThreads x 16 = 4096
    // columns): the two-kernel path, with the addend too.
    const NDArray xw = random_f32({3, 4099}, 25), ww = random_f32({4099}, 26), dyw = random_f32({3, 4099}, 27);
    const NDArray aw = random_f32({3, 4099}, 28);
    NDArray dxw = NDArray::empty(xw.shape(), DType::F32), dww = NDArray::empty(ww.shape(), DType::F32);
    NDArray gdxw = dev_empty(xw.shape()), gdww = dev_empty(ww.shape());
    const NDArray gaw = up(aw);
    kernels::rms_norm_backward(cpu(), dyw, xw, ww, 1e-5f, dxw, dww, &aw);
    kernels::rms_norm_backward(gpu(), up(dyw), up(xw), up(ww), 1e-5f, gdxw, gdww, &gaw);
    e5 = std::max({e5, rel_diff(down(gdxw), dxw), rel_diff(down(gdww), dww)});
    std::snprintf(d, sizeof d, "y=%.1e dx=%.1e dweight=%.1e y_bf16=%.1e dx_addend=%.1e", e1, e2, e3, e4, e5);
    result("rms_norm", e1 < 1e-6 && e2 < 1e-6 && e3 < 1e-6 && e4 < 4e-3 && e5 < 1e-6, d);
  });
  // The bf16 block input (the decoder's norm and residual add read it as it
  // is): a bf16 x is the f32 kernels on its exact values, bit for bit on the
  // GPU itself; a bf16 dx is the f32 one (the addend added) rounded once.
  // Both backward paths (fused up to 4096 columns, two kernels past it).
  run_case("rms_norm_bf16_io", [] {
    double worst_exact = 0, worst_cpu = 0;
    for (const Shape& shape : {Shape{5, 31, 203}, Shape{3, 4099}}) {
      const int64_t h = shape.back();
      const NDArray x16 = random_f32(shape, 31).to(DType::BF16), x32 = x16.to(DType::F32);
      const NDArray w = random_f32({h}, 32), dy = random_f32(shape, 33);
      const NDArray a16 = random_f32(shape, 34).to(DType::BF16), a32 = a16.to(DType::F32);
      NDArray gy16x = dev_empty(shape), gy32x = dev_empty(shape);
      kernels::rms_norm(gpu(), up(x16), up(w), 1e-5f, gy16x);
      kernels::rms_norm(gpu(), up(x32), up(w), 1e-5f, gy32x);
      worst_exact = std::max(worst_exact, max_diff(down(gy16x), down(gy32x)));
      // dx f32 from bf16 x and addend, against the f32 arrays: exact.
      NDArray gdx_a = dev_empty(shape), gdw_a = dev_empty({h}), gdx_b = dev_empty(shape), gdw_b = dev_empty({h});
      const NDArray ga16 = up(a16), ga32 = up(a32);
      kernels::rms_norm_backward(gpu(), up(dy), up(x16), up(w), 1e-5f, gdx_a, gdw_a, &ga16);
      kernels::rms_norm_backward(gpu(), up(dy), up(x32), up(w), 1e-5f, gdx_b, gdw_b, &ga32);
      worst_exact = std::max({worst_exact, max_diff(down(gdx_a), down(gdx_b)), max_diff(down(gdw_a), down(gdw_b))});
      // dx bf16: the f32 dx rounded once (exact), and the CPU's within a bf16 ulp.
      NDArray gdx16 = dev_empty(shape, DType::BF16), gdw16 = dev_empty({h});
      kernels::rms_norm_backward(gpu(), up(dy), up(x16), up(w), 1e-5f, gdx16, gdw16, &ga16);
      const NDArray want16 = down(gdx_b).to(DType::BF16);
      worst_exact = std::max(worst_exact, max_diff(down(gdx16).to(DType::F32), want16.to(DType::F32)));
      NDArray dx16 = NDArray::empty(shape, DType::BF16), dw = NDArray::empty({h}, DType::F32);
      kernels::rms_norm_backward(cpu(), dy, x16, w, 1e-5f, dx16, dw, &a16);
      worst_cpu = std::max({worst_cpu, rel_diff(down(gdx16).to(DType::F32), dx16.to(DType::F32)),
                            rel_diff(down(gdw16), dw)});
    }
    char d[96];
    std::snprintf(d, sizeof d, "bf16_vs_f32_on_gpu=%.1e vs_cpu=%.1e", worst_exact, worst_cpu);
    result("rms_norm_bf16_io", worst_exact == 0 && worst_cpu < 4e-3, d);
  });
  // The residual adds with a bf16 block input (a) and a bf16 output (the
  // next block's input): the f32 sum, rounded once; the CPU's bits.
  run_case("add_bf16_io", [] {
    const NDArray a16 = random_f32({3, 1001}, 35).to(DType::BF16), b16 = random_f32({3, 1001}, 36).to(DType::BF16);
    const NDArray a32 = random_f32({3, 1001}, 37);
    double worst = 0;
    for (DType out : {DType::F32, DType::BF16})
      for (const NDArray* a : {&a16, &a32}) {
        NDArray c = NDArray::empty(a16.shape(), out), g = dev_empty(a16.shape(), out);
        kernels::add(cpu(), *a, b16, c);
        kernels::add(gpu(), up(*a), up(b16), g);
        worst = std::max(worst, max_diff(down(g).to(DType::F32), c.to(DType::F32)));
      }
    result("add_bf16_io", worst == 0, "max_diff=" + std::to_string(worst));
  });
  run_case("swiglu", [] {
    const NDArray g = random_f32({7, 333}, 24), u = random_f32({7, 333}, 25), dy = random_f32({7, 333}, 26);
    NDArray y = NDArray::empty(g.shape(), DType::F32), gy = NDArray::empty(g.shape(), DType::F32, device_under_test);
    kernels::swiglu(cpu(), g, u, y);
    kernels::swiglu(gpu(), up(g), up(u), gy);
    NDArray dg = NDArray::empty(g.shape(), DType::F32), du = NDArray::empty(g.shape(), DType::F32);
    NDArray gdg = NDArray::empty(g.shape(), DType::F32, device_under_test);
    NDArray gdu = NDArray::empty(g.shape(), DType::F32, device_under_test);
    kernels::swiglu_backward(cpu(), dy, g, u, dg, du);
    kernels::swiglu_backward(gpu(), up(dy), up(g), up(u), gdg, gdu);
    // expf on the GPU, a polynomial exp on the CPU: a few ulps apart.
    const double e1 = rel_diff(down(gy), y), e2 = rel_diff(down(gdg), dg), e3 = rel_diff(down(gdu), du);
    char d[96];
    std::snprintf(d, sizeof d, "y=%.1e dgate=%.1e dup=%.1e", e1, e2, e3);
    result("swiglu", e1 < 1e-5 && e2 < 1e-5 && e3 < 1e-5, d);
  });
  // bf16 gate and up (as the bf16 training graph has them), a bf16 output,
  // dy in f32 and in bf16: f32 math on both sides, each result rounded once,
  // so the two differ by at most one bf16 ulp where their f32 values sit on
  // either side of a rounding boundary (2^-8 of the value: under 4e-3 of
  // the largest).
  run_case("swiglu_bf16", [] {
    const NDArray g = random_f32({7, 333}, 27).to(DType::BF16), u = random_f32({7, 333}, 28).to(DType::BF16);
    NDArray y = NDArray::empty(g.shape(), DType::BF16), gy = dev_empty(g.shape(), DType::BF16);
    kernels::swiglu(cpu(), g, u, y);
    kernels::swiglu(gpu(), up(g), up(u), gy);
    double worst = rel_diff(down(gy), y);
    for (DType dt : {DType::F32, DType::BF16}) {
      const NDArray dy = dt == DType::F32 ? random_f32({7, 333}, 29) : random_f32({7, 333}, 29).to(DType::BF16);
      NDArray dg = NDArray::empty(g.shape(), DType::BF16), du = NDArray::empty(g.shape(), DType::BF16);
      NDArray gdg = dev_empty(g.shape(), DType::BF16), gdu = dev_empty(g.shape(), DType::BF16);
      kernels::swiglu_backward(cpu(), dy, g, u, dg, du);
      kernels::swiglu_backward(gpu(), up(dy), up(g), up(u), gdg, gdu);
      worst = std::max({worst, rel_diff(down(gdg), dg), rel_diff(down(gdu), du)});
    }
    char d[64];
    std::snprintf(d, sizeof d, "worst=%.1e", worst);
    result("swiglu_bf16", worst < 4e-3, d);
  });
}

// cuBLAS against the CPU GEMM: every transpose combination on odd sizes
// (a 3-D left operand), f32 and bf16 products, f32 and bf16 results. The
// bf16 products are exact in f32 on both sides; only the order of the sums
// differs, so the bounds are a few f32 roundings of the largest result (and
// one bf16 rounding for a bf16 result).
void gemm() {
  run_case("matmul", [] {
    char d[160];
    double worst_f32 = 0, worst_bf16 = 0, worst_out = 0;
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const int64_t m = 37, k = 129, n = 67;
        const NDArray a = ta ? random_f32({k, m}, 30 + ta) : random_f32({1, m, k}, 32);
        const NDArray b = tb ? random_f32({n, k}, 33) : random_f32({k, n}, 34);
        for (kernels::GemmCompute c : {kernels::GemmCompute::kF32, kernels::GemmCompute::kBF16}) {
          NDArray want = NDArray::empty({m, n}, DType::F32);
          kernels::matmul(cpu(), a, b, ta, tb, want, c);
          NDArray got = NDArray::empty({m, n}, DType::F32, device_under_test);
          kernels::matmul(gpu(), up(a), up(b), ta, tb, got, c);
          double& w = c == kernels::GemmCompute::kF32 ? worst_f32 : worst_bf16;
          w = std::max(w, rel_diff(down(got), want));
        }
        NDArray want16 = NDArray::empty({m, n}, DType::BF16);
        kernels::matmul(cpu(), a, b, ta, tb, want16, kernels::GemmCompute::kBF16);
        NDArray got16 = NDArray::empty({m, n}, DType::BF16, device_under_test);
        kernels::matmul(gpu(), up(a), up(b), ta, tb, got16, kernels::GemmCompute::kBF16);
        worst_out = std::max(worst_out, rel_diff(down(got16), want16));
      }
    std::snprintf(d, sizeof d, "f32=%.1e bf16=%.1e bf16_out=%.1e", worst_f32, worst_bf16, worst_out);
    result("matmul", worst_f32 < 2e-5 && worst_bf16 < 2e-5 && worst_out < 8e-3, d);
  });  // With an addend (the backward's folded gradient accumulation): cuBLASLt
  // reads it and writes the sum apart (C != D); the CPU adds after its GEMM.
  run_case("matmul_addend", [] {
    double worst = 0;
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (kernels::GemmCompute c : {kernels::GemmCompute::kF32, kernels::GemmCompute::kBF16}) {
          const int64_t m = 45, k = 131, n = 71;
          const NDArray a = ta ? random_f32({k, m}, 60 + ta) : random_f32({1, m, k}, 62);
          const NDArray b = tb ? random_f32({n, k}, 63) : random_f32({k, n}, 64), add = random_f32({m, n}, 65);
          NDArray want = NDArray::empty({m, n}, DType::F32), got = dev_empty({m, n});
          kernels::matmul(cpu(), a, b, ta, tb, want, c, &add);
          const NDArray gadd = up(add);
          kernels::matmul(gpu(), up(a), up(b), ta, tb, got, c, &gadd);
          worst = std::max(worst, rel_diff(down(got), want));
          // The addend is read, not written.
          worst = std::max(worst, max_diff(down(gadd), add));
        }
    char d[64];
    std::snprintf(d, sizeof d, "rel=%.1e", worst);
    result("matmul_addend", worst < 2e-5, d);
  });
  // With a bias (linear_bias: Qwen2's q/k/v): the fused call against the
  // chain it replaces on the same GPU, matmul to f32, add_bias and cast, bit
  // for bit: at a key's first call (the epilogue compared, the two passes
  // written) and at a later one (the epilogue, where it matched), in the
  // heuristic and measured modes, a bias not 16-byte aligned (the two
  // passes). Against the CPU within the matmul bounds (the bias's
  // orientation whatever the GPU's paths agree on).
  run_case("matmul_bias", [] {
    struct Shape3 {
      int64_t m, k, n;
    };
    // Qwen2-1.5B's q (1536) and k/v (256) at 4096 tokens; odd N.
    const std::vector<Shape3> shapes = {{4096, 1536, 1536}, {4096, 1536, 256}, {37, 129, 67},
                                        {45, 131, 13},      {8, 64, 250},       {5, 1, 19}};
    int64_t differing = 0;
    double worst_cpu = 0;
    std::string first_bad;
    const kernels::GemmAlgorithm saved = kernels::gemm_algorithm();
    for (kernels::GemmAlgorithm mode : {kernels::GemmAlgorithm::kHeuristic, kernels::GemmAlgorithm::kMeasured})
      for (const Shape3& sh : shapes)
        for (DType operands : {DType::BF16, DType::F32})
          for (DType out : {DType::BF16, DType::F32})
            for (int aligned = 1; aligned >= 0; --aligned) {
              const auto [m, k, n] = sh;
              const NDArray flat = random_f32({m, k}, 70).to(operands);  // 3-D where m is even, as [B, S, K]
              const NDArray x = m % 2 == 0 ? flat.reshape({2, m / 2, k}) : flat;
              const NDArray w = random_f32({n, k}, 71).to(operands), b = random_f32({n}, 72);
              const NDArray gx = up(x), gw = up(w);
              const NDArray gb_store = up(random_f32({n + 1}, 72));
              const NDArray gb = aligned ? up(b) : gb_store.slice(0, 1, n + 1);
              const NDArray hb = down(gb).contiguous();
              const kernels::GemmCompute c = kernels::GemmCompute::kF32;
              kernels::set_gemm_algorithm(kernels::GemmAlgorithm::kHeuristic);
              NDArray y = dev_empty({m, n}), z = dev_empty({m, n});
              kernels::matmul(gpu(), gx, gw, false, true, y, c);
              kernels::add_bias(gpu(), y, gb, z);
              const NDArray want = down(kernels::cast(gpu(), z, out));
              kernels::set_gemm_algorithm(mode);
              for (int call = 0; call < 2; ++call) {
                NDArray got = dev_empty({m, n}, out);
                kernels::matmul(gpu(), gx, gw, false, true, got, c, kernels::GemmEpilogue::with_bias(&gb));
                const NDArray h = down(got);
                int64_t bad = 0;
                const size_t width = out == DType::F32 ? 4 : 2;
                for (int64_t i = 0; i < h.numel(); ++i)
                  bad += std::memcmp(static_cast<const char*>(h.host_raw_data()) + i * width,
                                     static_cast<const char*>(want.host_raw_data()) + i * width, width) != 0;
                if (bad > 0 && first_bad.empty())
                  first_bad = std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n) + " " +
                              dtype_name(operands) + "->" + dtype_name(out) + " call " + std::to_string(call) +
                              (aligned ? "" : " unaligned") +
                              (mode == kernels::GemmAlgorithm::kMeasured ? " measured" : "");
                differing += bad;
              }
              if (m * n * k <= 1 << 22 && mode == kernels::GemmAlgorithm::kHeuristic) {
                NDArray cy = NDArray::empty({m, n}, DType::F32), cz = NDArray::empty({m, n}, DType::F32);
                kernels::matmul(cpu(), x, w, false, true, cy, c);
                kernels::add_bias(cpu(), cy, hb, cz);
                worst_cpu = std::max(worst_cpu, rel_diff(want.to(DType::F32), cz.to(out).to(DType::F32)));
              }
            }
    kernels::set_gemm_algorithm(saved);
    char d[200];
    std::snprintf(d, sizeof d, "differing=%lld cpu_rel=%.1e%s%s", static_cast<long long>(differing), worst_cpu,
                  first_bad.empty() ? "" : " first=", first_bad.c_str());
    result("matmul_bias", differing == 0 && worst_cpu < 8e-3, d);
  });
}

std::vector<int32_t> random_id_vector(int64_t n, int32_t lo, int32_t hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> u(lo, hi - 1);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = u(rng);
  return v;
}

NDArray random_ids(int64_t n, int32_t lo, int32_t hi, uint32_t seed) {
  return NDArray::from_vector_i32({n}, random_id_vector(n, lo, hi, seed));
}

// The message of the hspmd::Error f throws ("" when none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// The layout kernels move bytes and the reductions add in double in the CPU
// kernels' order: equal bit for bit. RoPE and cross-entropy compute
// transcendental functions on both sides: within 1e-6.
void layout_and_model_ops() {
  run_case("layout", [] {
    const NDArray a = random_f32({3, 5, 7, 4}, 40);
    NDArray t = NDArray::empty({3, 4, 7, 5}, DType::F32), gt = dev_empty({3, 4, 7, 5});
    kernels::transpose(cpu(), a, 1, 3, t);
    kernels::transpose(gpu(), up(a), 1, 3, gt);
    const NDArray a16 = a.to(DType::BF16);
    NDArray t16 = NDArray::empty({3, 4, 7, 5}, DType::BF16), gt16 = dev_empty({3, 4, 7, 5}, DType::BF16);
    kernels::transpose(cpu(), a16, 1, 3, t16);
    kernels::transpose(gpu(), up(a16), 1, 3, gt16);
    NDArray sl = NDArray::empty({3, 2, 7, 4}, DType::F32), gsl = dev_empty({3, 2, 7, 4});
    kernels::slice(cpu(), a, 1, 2, sl);
    kernels::slice(gpu(), up(a), 1, 2, gsl);
    NDArray sb = NDArray::empty({3, 5, 7, 4}, DType::F32), gsb = dev_empty({3, 5, 7, 4});
    kernels::slice_backward(cpu(), sl, 1, 2, sb);
    kernels::slice_backward(gpu(), up(sl), 1, 2, gsb);
    const NDArray b = random_f32({3, 2, 7, 4}, 41);
    NDArray c = NDArray::empty({3, 7, 7, 4}, DType::F32), gc = dev_empty({3, 7, 7, 4});
    kernels::concat(cpu(), {a, b}, 1, c);
    kernels::concat(gpu(), {up(a), up(b)}, 1, gc);
    const double e = std::max({max_diff(down(gt), t), max_diff(down(gt16), t16), max_diff(down(gsl), sl),
                               max_diff(down(gsb), sb), max_diff(down(gc), c)});
    result("layout", e == 0, "max_diff=" + std::to_string(e));
  });
  run_case("reductions", [] {
    const NDArray a = random_f32({4, 6, 5}, 42);
    const std::vector<bool> mask = {true, false, true};
    NDArray r = NDArray::empty({6}, DType::F32), gr = dev_empty({6});
    kernels::reduce_sum(cpu(), a, mask, r);
    kernels::reduce_sum(gpu(), up(a), mask, gr);
    NDArray br = NDArray::empty({4, 6, 5}, DType::F32), gbr = dev_empty({4, 6, 5});
    kernels::broadcast_reduced(cpu(), r, mask, br);
    kernels::broadcast_reduced(gpu(), up(r), mask, gbr);
    const NDArray x = random_f32({1100, 37}, 43), bias = random_f32({37}, 44);
    NDArray y = NDArray::empty(x.shape(), DType::F32), gy = dev_empty(x.shape());
    kernels::add_bias(cpu(), x, bias, y);
    kernels::add_bias(gpu(), up(x), up(bias), gy);
    NDArray db = NDArray::empty({37}, DType::F32), gdb = dev_empty({37});
    kernels::bias_grad(cpu(), x, db);  // 1100 rows: three chunks of the CPU's partial sums
    kernels::bias_grad(gpu(), up(x), gdb);
    const double e = std::max({max_diff(down(gr), r), max_diff(down(gbr), br), max_diff(down(gy), y),
                               max_diff(down(gdb), db)});
    result("reductions", e == 0, "max_diff=" + std::to_string(e));
  });
  run_case("embedding", [] {
    // A vocabulary shard [40, 90) of 100: ids outside it give zeros.
    const NDArray w = random_f32({50, 33}, 45), ids = random_ids(77, 0, 100, 46), g = random_f32({77, 33}, 47);
    NDArray y = NDArray::empty({77, 33}, DType::F32), gy = dev_empty({77, 33});
    kernels::embedding(cpu(), w, ids, 40, 100, y);
    kernels::embedding(gpu(), up(w), up(ids), 40, 100, gy);
    NDArray dw = NDArray::empty({50, 33}, DType::F32), gdw = dev_empty({50, 33});
    kernels::embedding_backward(cpu(), g, ids, 40, 100, dw);
    kernels::embedding_backward(gpu(), up(g), up(ids), 40, 100, gdw);
    // Three ids, one outside the vocabulary, into an output of three rows
    // (the kernels check the output's size first, as an internal error).
    const NDArray bad = NDArray::from_vector_i32({3}, {5, 100, 7});
    NDArray ybad = NDArray::empty({3, 33}, DType::F32), gybad = dev_empty({3, 33});
    const std::string want = error_of([&] { kernels::embedding(cpu(), w, bad, 40, 100, ybad); });
    // Many tokens per id (500 over 12 ids, a shard of 10) and rows wider
    // than a block: the sorted segments and the column tiles.
    const NDArray ids2 = random_ids(500, 0, 12, 50), g2 = random_f32({500, 300}, 51);
    NDArray dw2 = NDArray::empty({10, 300}, DType::F32), gdw2 = dev_empty({10, 300});
    kernels::embedding_backward(cpu(), g2, ids2, 2, 12, dw2);
    kernels::embedding_backward(gpu(), up(g2), up(ids2), 2, 12, gdw2);
    const double e = std::max({max_diff(down(gy), y), max_diff(down(gdw), dw), max_diff(down(gdw2), dw2)});
    // The device does not wait for its check: the error comes at the
    // stream's next host read, with the CPU's message. (The device double
    // runs the CPU's kernel, which checks on the call.)
    std::string early;
    std::string got = error_of([&] {
      early = error_of([&] { kernels::embedding(gpu(), up(w), up(bad), 40, 100, gybad); });
      (void)down(gybad);
    });
    const bool on_double = device_under_test == Device::host_double();
    const bool deferred = early.empty() || on_double;
    if (!early.empty() && on_double) got = early;
    result("embedding", e == 0 && !want.empty() && got == want && deferred,
           "max_diff=" + std::to_string(e) + " error=\"" + got + "\"");
  });
  run_case("rope", [] {
    const NDArray x = random_f32({2, 9, 3, 16}, 48), pos = random_ids(18, 0, 4096, 49);
    double e = 0;
    for (bool inverse : {false, true}) {
      NDArray y = NDArray::empty(x.shape(), DType::F32), gy = dev_empty(x.shape());
      kernels::rope(cpu(), x, pos, 10000.0f, inverse, y);
      kernels::rope(gpu(), up(x), up(pos), 10000.0f, inverse, gy);
      e = std::max(e, rel_diff(down(gy), y));
    }
    char d[64];
    std::snprintf(d, sizeof d, "rel=%.1e", e);
    result("rope", e < 1e-6, d);
  });
  // bf16 in and out (attention's bf16 gradients rotated back on a GPU): x
  // read exactly, the f32 result rounded once; the CPU's bits but where the
  // two backends' f32 rotations differ by an ulp across a rounding boundary.
  run_case("rope_bf16_io", [] {
    const NDArray x = random_f32({2, 9, 3, 16}, 52).to(DType::BF16), pos = random_ids(18, 0, 4096, 53);
    double e = 0;
    bool dtypes = true;
    for (bool inverse : {false, true}) {
      NDArray y = NDArray::empty(x.shape(), DType::BF16), gy = dev_empty(x.shape(), DType::BF16);
      kernels::rope(cpu(), x, pos, 10000.0f, inverse, y);
      kernels::rope(gpu(), up(x), up(pos), 10000.0f, inverse, gy);
      const NDArray back = down(gy);
      dtypes = dtypes && back.dtype() == DType::BF16;
      e = std::max(e, rel_diff(back, y));
    }
    char d[64];
    std::snprintf(d, sizeof d, "rel=%.1e", e);
    result("rope_bf16_io", dtypes && e < 8e-3, d);
  });
  run_case("cross_entropy", [] {
    const int64_t rows = 9, v = 301;
    const NDArray logits = random_f32({rows, v}, 50);
    std::vector<int32_t> tv = random_id_vector(rows, 0, 290, 51);
    tv[4] = -100;  // ignored
    const NDArray targets = NDArray::from_vector_i32({rows}, tv), norm = NDArray::from_vector({1}, {8.0f});
    const NDArray dloss = NDArray::from_vector({1}, {1.5f});
    double e = 0, e16 = 0;
    for (int64_t classes : {int64_t{0}, int64_t{290}}) {
      NDArray loss = NDArray::empty({1}, DType::F32), lse = NDArray::empty({rows}, DType::F32);
      NDArray gloss = dev_empty({1}), glse = dev_empty({rows});
      kernels::cross_entropy(cpu(), logits, targets, norm, -100, loss, lse, classes);
      kernels::cross_entropy(gpu(), up(logits), up(targets), up(norm), -100, gloss, glse, classes);
      NDArray dx = NDArray::empty({rows, v}, DType::F32), gdx = dev_empty({rows, v});
      kernels::cross_entropy_backward(cpu(), dloss, logits, targets, norm, lse, -100, 0, dx, classes);
      kernels::cross_entropy_backward(gpu(), up(dloss), up(logits), up(targets), up(norm), up(lse), -100, 0, gdx,
                                      classes);
      e = std::max({e, rel_diff(down(gloss), loss), rel_diff(down(glse), lse), rel_diff(down(gdx), dx)});
      // The bf16 gradient (the bf16 graph's): the f32 values rounded once on
      // each side, so at most a bf16 ulp of a value apart (2^-8 relative).
      NDArray dx16 = NDArray::empty({rows, v}, DType::BF16), gdx16 = dev_empty({rows, v}, DType::BF16);
      kernels::cross_entropy_backward(cpu(), dloss, logits, targets, norm, lse, -100, 0, dx16, classes);
      kernels::cross_entropy_backward(gpu(), up(dloss), up(logits), up(targets), up(norm), up(lse), -100, 0,
                                      gdx16, classes);
      e16 = std::max(e16, rel_diff(down(gdx16), dx16));
      // Two vocabulary shards [0, 150) and [150, 301): stats per shard, then
      // the combine, against the CPU's.
      NDArray parts = NDArray::empty({2, rows}, DType::F32), picked = NDArray::zeros({rows}, DType::F32);
      NDArray gparts = dev_empty({2, rows}), gpicked = kernels::zeros(gpu(), {rows}, DType::F32);
      for (int shard = 0; shard < 2; ++shard) {
        const int64_t begin = shard == 0 ? 0 : 150, width = shard == 0 ? 150 : v - 150;
        NDArray part = NDArray::empty({rows, width}, DType::F32);
        kernels::slice(cpu(), logits, 1, begin, part);
        NDArray l = NDArray::empty({rows}, DType::F32), p = NDArray::empty({rows}, DType::F32);
        NDArray gl = dev_empty({rows}), gp = dev_empty({rows});
        kernels::cross_entropy_shard_stats(cpu(), part, targets, begin, v, -100, l, p, classes);
        kernels::cross_entropy_shard_stats(gpu(), up(part), up(targets), begin, v, -100, gl, gp, classes);
        // The shard's row of `parts`: copy_block takes arrays of one rank.
        kernels::copy_block(cpu(), l.reshape({1, rows}), {0, 0}, parts, {shard, 0}, {1, rows}, false);
        kernels::copy_block(gpu(), gl.reshape({1, rows}), {0, 0}, gparts, {shard, 0}, {1, rows}, false);
        kernels::accumulate(cpu(), p, picked);
        kernels::accumulate(gpu(), gp, gpicked);
      }
      NDArray closs = NDArray::empty({1}, DType::F32), clse = NDArray::empty({rows}, DType::F32);
      NDArray gcloss = dev_empty({1}), gclse = dev_empty({rows});
      kernels::cross_entropy_combine(cpu(), parts, picked, targets, norm, -100, closs, clse);
      kernels::cross_entropy_combine(gpu(), gparts, gpicked, up(targets), up(norm), -100, gcloss, gclse);
      e = std::max({e, rel_diff(down(gcloss), closs), rel_diff(down(gclse), clse), rel_diff(down(gclse), lse)});
    }
    const NDArray bad = NDArray::from_vector_i32({2}, {3, 400});
    NDArray loss = NDArray::empty({1}, DType::F32), lse = NDArray::empty({2}, DType::F32);
    NDArray gloss = dev_empty({1}), glse = dev_empty({2});
    const NDArray two = random_f32({2, v}, 52);
    const std::string want = error_of([&] { kernels::cross_entropy(cpu(), two, bad, norm, -100, loss, lse); });
    const std::string got = error_of([&] {
      kernels::cross_entropy(gpu(), up(two), up(bad), up(norm), -100, gloss, glse);
      (void)down(gloss);  // the check raises at the stream's next host read
    });
    char d[64];
    std::snprintf(d, sizeof d, "rel=%.1e bf16_grad=%.1e", e, e16);
    result("cross_entropy", e < 1e-6 && e16 < 4e-3 && !want.empty() && got == want,
           std::string(d) + " error=\"" + got + "\"");
  });
}

// The largest shape of the benchmarks: cross-entropy over Qwen2-1.5B's
// 16384 x 151936 logits (2.49e9 elements, past 2^31: every element index in
// the CUDA kernels must be 64-bit), its 151646 classes (the padded columns'
// gradient zero; a class count that leaves a tail of single entries past
// the 16-byte groups). The logits are zeros (lse log(classes)) but for
// three rows of random values filled on the device: the row holding element
// 2^31, and the last two (the last with -inf entries, the second last
// ignored). Checked: every row's lse, the loss, and the gradients (f32 and
// bf16, over arrays filled with NaN first) of those rows and of a zero row
// past 2^31, against the CPU's kernels on the rows alone, relative to each
// row's largest value (an unwritten or misplaced row fails). 25 GB of
// device memory; on the device double (a CPU machine) 6 rows instead.
double worst_rel(const NDArray& got, const NDArray& want) {
  if (got.shape() != want.shape()) return INFINITY;
  const std::vector<float> a = got.to_vector(), b = want.to_vector();
  double m = 0, d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, static_cast<double>(std::fabs(b[i])));
    const double e = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (!(e <= d)) d = std::isnan(e) ? INFINITY : e;  // NaN (an unwritten element): fails
  }
  return m > 0 ? d / m : d;
}

void large_shapes() {
  run_case("cross_entropy_past_2g", [] {
    const bool full = device_under_test != Device::host_double();
    const int64_t v = 151936, classes = 151646, rows = full ? 16384 : 6;
    const int64_t straddle = full ? (int64_t{1} << 31) / v : 2;  // the row holding element 2^31
    const int64_t zero_row = rows - 3;                              // past 2^31 too
    std::vector<int32_t> t = random_id_vector(rows, 0, static_cast<int32_t>(classes), 70);
    for (int64_t r = 5; r < rows; r += 7) t[r] = -100;
    t[straddle] = static_cast<int32_t>(full ? (int64_t{1} << 31) - straddle * v + 5 : 7);  // picked past 2^31
    t[zero_row] = 11;
    t[rows - 2] = -100;
    t[rows - 1] = static_cast<int32_t>(classes - 1);
    const NDArray targets = NDArray::from_vector_i32({rows}, t), gtargets = up(targets);
    const NDArray norm = NDArray::from_vector({1}, {8.0f}), dloss = NDArray::from_vector({1}, {1.5f});
    NDArray glogits = dev_empty({rows, v});
    kernels::fill(gpu(), glogits, 0.0f);
    const std::vector<int64_t> random_rows = {straddle, rows - 2, rows - 1};
    std::vector<NDArray> host_rows;
    for (size_t i = 0; i < random_rows.size(); ++i) {
      NDArray row = random_f32({1, v}, 71 + static_cast<uint32_t>(i));
      if (random_rows[i] == rows - 1)
        for (int64_t j = 0; j < 300; ++j) row.data<float>()[j] = -INFINITY;
      NDArray dst = glogits.slice(0, random_rows[i], random_rows[i] + 1);
      kernels::copy(gpu(), up(row), dst);
      host_rows.push_back(row);
    }
    NDArray gloss = dev_empty({1}), glse = dev_empty({rows});
    kernels::cross_entropy(gpu(), glogits, gtargets, up(norm), -100, gloss, glse, classes);
    // The CPU's kernels on one row: its lse and its loss term (normalizer 1).
    const NDArray one = NDArray::from_vector({1}, {1.0f}), zeros = NDArray::zeros({1, v}, DType::F32);
    const auto cpu_row = [&](const NDArray& x, int32_t target, NDArray& lse1) {
      NDArray loss1 = NDArray::empty({1}, DType::F32);
      const NDArray t1 = NDArray::from_vector_i32({1}, {target});
      kernels::cross_entropy(cpu(), x, t1, one, -100, loss1, lse1, classes);
      return static_cast<double>(loss1.data<float>()[0]);
    };
    std::vector<float> want_lse(rows);
    double total = 0;
    NDArray zero_lse = NDArray::empty({1}, DType::F32);
    const double zero_term = cpu_row(zeros, 11, zero_lse);  // log(classes) - 0
    for (int64_t r = 0; r < rows; ++r) {
      if (t[r] == -100) continue;
      want_lse[r] = zero_lse.data<float>()[0];
      total += zero_term;
    }
    std::vector<NDArray> row_lse;
    for (size_t i = 0; i < random_rows.size(); ++i) {
      const int64_t r = random_rows[i];
      NDArray lse1 = NDArray::empty({1}, DType::F32);
      const double term = cpu_row(host_rows[i], t[r], lse1);
      if (t[r] != -100) {
        total += term - zero_term;
        want_lse[r] = lse1.data<float>()[0];
      }
      row_lse.push_back(lse1);
    }
    const double e_lse = worst_rel(down(glse), NDArray::from_vector({rows}, want_lse));
    const double e_loss =
        worst_rel(down(gloss), NDArray::from_vector({1}, {static_cast<float>(total / norm.data<float>()[0])}));
    // The gradients, written over NaN.
    double e_dx = 0, e_dx16 = 0;
    NDArray gdx = dev_empty({rows, v}), gdx16 = dev_empty({rows, v}, DType::BF16);
    kernels::fill(gpu(), gdx, NAN);
    kernels::fill(gpu(), gdx16, NAN);
    kernels::cross_entropy_backward(gpu(), up(dloss), glogits, gtargets, up(norm), glse, -100, 0, gdx, classes);
    kernels::cross_entropy_backward(gpu(), up(dloss), glogits, gtargets, up(norm), glse, -100, 0, gdx16, classes);
    for (size_t i = 0; i <= random_rows.size(); ++i) {
      const bool zero = i == random_rows.size();
      const int64_t r = zero ? zero_row : random_rows[i];
      const NDArray& x = zero ? zeros : host_rows[i];
      const NDArray& lse1 = zero ? zero_lse : row_lse[i];
      const NDArray t1 = NDArray::from_vector_i32({1}, {t[r]});
      NDArray dx = NDArray::empty({1, v}, DType::F32), dx16 = NDArray::empty({1, v}, DType::BF16);
      kernels::cross_entropy_backward(cpu(), dloss, x, t1, norm, lse1, -100, 0, dx, classes);
      kernels::cross_entropy_backward(cpu(), dloss, x, t1, norm, lse1, -100, 0, dx16, classes);
      e_dx = std::max(e_dx, worst_rel(down(gdx.slice(0, r, r + 1)), dx));
      e_dx16 = std::max(e_dx16, worst_rel(down(gdx16.slice(0, r, r + 1)), dx16));
    }
    char d[128];
    std::snprintf(d, sizeof d, "rows=%lld lse=%.1e loss=%.1e dx=%.1e dx_bf16=%.1e", static_cast<long long>(rows),
                  e_lse, e_loss, e_dx, e_dx16);
    result("cross_entropy_past_2g", e_lse < 1e-6 && e_loss < 1e-6 && e_dx < 1e-5 && e_dx16 < 8e-3, d);
  });
  // The decoder's post-attention add and norm and the norm's backward at
  // Qwen2-1.5B's [16384, 1536] (a row fills 192 of a block's 256 threads;
  // the backward's blocks of 32 rows, 512 of them, and their partial sums
  // added by chunk_totals_kernel in slices of 64): a bf16 block input and
  // branch, the f32 sum, the bf16 norm; dx f32 with the residual stream's
  // gradient added and its bf16 copy. The sum and the copy exact (the f32
  // add; dx rounded once), the rest against the CPU's within f32 rounding
  // (a bf16 ulp for the bf16 norm). 40 rows on the device double.
  run_case("norm_model_shape", [] {
    const bool full = device_under_test != Device::host_double();
    const int64_t rows = full ? 16384 : 40, h = 1536;
    const Shape shape = {rows, h};
    const NDArray a = random_f32(shape, 80).to(DType::BF16), b = random_f32(shape, 81).to(DType::BF16);
    const NDArray w = random_f32({h}, 82), dy = random_f32(shape, 83), addend = random_f32(shape, 84);
    NDArray sum = NDArray::empty(shape, DType::F32), y = NDArray::empty(shape, DType::BF16);
    NDArray gsum = dev_empty(shape), gy = dev_empty(shape, DType::BF16);
    kernels::add_rms_norm(cpu(), a, b, w, 1e-6f, sum, y);
    kernels::add_rms_norm(gpu(), up(a), up(b), up(w), 1e-6f, gsum, gy);
    const double e_sum = max_diff(down(gsum), sum), e_y = rel_diff(down(gy), y);
    NDArray dx = NDArray::empty(shape, DType::F32), dw = NDArray::empty({h}, DType::F32);
    NDArray gdx = dev_empty(shape), gdw = dev_empty({h}), gdx16 = dev_empty(shape, DType::BF16);
    kernels::rms_norm_backward(cpu(), dy, sum, w, 1e-6f, dx, dw, &addend);
    const NDArray gaddend = up(addend);
    kernels::rms_norm_backward(gpu(), up(dy), gsum, up(w), 1e-6f, gdx, gdw, &gaddend, &gdx16);
    const NDArray got_dx = down(gdx);
    const double e_dx = rel_diff(got_dx, dx), e_dw = rel_diff(down(gdw), dw);
    const double e_copy = max_diff(down(gdx16).to(DType::F32), got_dx.to(DType::BF16).to(DType::F32));
    char d[160];
    std::snprintf(d, sizeof d, "rows=%lld sum=%.1e y_bf16=%.1e dx=%.1e dweight=%.1e dx_copy=%.1e",
                  static_cast<long long>(rows), e_sum, e_y, e_dx, e_dw, e_copy);
    result("norm_model_shape", e_sum == 0 && e_y < 4e-3 && e_dx < 1e-5 && e_dw < 1e-5 && e_copy == 0, d);
  });
}

// Attention against the CPU's flash-style kernels: GQA, odd lengths, head
// dims 16 and 40, documents as cu_seqlens and as positions, a sliding
// window; f32 products within 1e-5 (forward) and 1e-4 (gradients) of the
// largest value, bf16 products within 1e-2 (the probabilities are rounded to
// bf16 against a tile's running max on the CPU, the row's on the GPU).
// Then ring attention's blocks: two key blocks merged, and their backward
// from the whole attention's lse and delta. These are our kernels: cuDNN's
// fused attention is switched off here (conformance_attention checks it).
void attention() {
  const kernels::cuda::CudnnAttention mode = kernels::cuda::cudnn_attention_mode();
  kernels::cuda::set_cudnn_attention_mode(kernels::cuda::CudnnAttention::kOff);
  run_case("attention", [] {
    const float scale = 0.3f;
    double worst_f32 = 0, worst_bf16 = 0;
    const int64_t B = 2, S = 37, Hq = 4, Hkv = 2;
    for (int64_t D : {int64_t{16}, int64_t{40}}) {
      const NDArray q = random_f32({B, S, Hq, D}, 60), k = random_f32({B, S, Hkv, D}, 61);
      const NDArray v = random_f32({B, S, Hkv, D}, 62), go = random_f32({B, S, Hq, D}, 63);
      std::vector<int32_t> pos(B * S);
      for (int64_t t = 0; t < B * S; ++t) pos[t] = static_cast<int32_t>(t % S < 20 ? t % S : t % S - 20);
      const std::vector<NDArray> docs = {NDArray(), NDArray::from_vector_i32({5}, {0, 20, 37, 50, 74}),
                                         NDArray::from_vector_i32({B, S}, pos)};
      for (const NDArray& doc : docs)
        for (int64_t window : {int64_t{0}, int64_t{5}})
          for (DType products : {DType::F32, DType::BF16}) {
            const kernels::AttentionTiles tiles{8, 8};
            NDArray out = NDArray::empty(q.shape(), DType::F32), lse = NDArray::empty({B, Hq, S}, DType::F32);
            NDArray gout = dev_empty(q.shape()), glse = dev_empty({B, Hq, S});
            kernels::attention_forward(cpu(), q, k, v, doc, scale, out, lse, tiles, products, window);
            const NDArray gdoc = doc.valid() ? up(doc) : NDArray();
            kernels::attention_forward(gpu(), up(q), up(k), up(v), gdoc, scale, gout, glse, tiles, products, window);
            NDArray dq = NDArray::empty(q.shape(), DType::F32), dk = NDArray::empty(k.shape(), DType::F32);
            NDArray dv = NDArray::empty(v.shape(), DType::F32);
            NDArray gdq = dev_empty(q.shape()), gdk = dev_empty(k.shape()), gdv = dev_empty(v.shape());
            kernels::attention_backward(cpu(), q, k, v, out, lse, go, doc, scale, dq, dk, dv, tiles, products, window);
            kernels::attention_backward(gpu(), up(q), up(k), up(v), gout, glse, up(go), gdoc, scale, gdq, gdk, gdv,
                                        tiles, products, window);
            const double e = std::max({rel_diff(down(gout), out), rel_diff(down(glse), lse), rel_diff(down(gdq), dq),
                                       rel_diff(down(gdk), dk), rel_diff(down(gdv), dv)});
            double& w = products == DType::F32 ? worst_f32 : worst_bf16;
            w = std::max(w, e);
          }
    }
    char d[96];
    std::snprintf(d, sizeof d, "f32=%.1e bf16=%.1e", worst_f32, worst_bf16);
    result("attention", worst_f32 < 1e-4 && worst_bf16 < 1e-2, d);
  });
  run_case("attention_blocks", [] {
    const int64_t B = 1, S = 24, Hq = 4, Hkv = 1, D = 32;
    const float scale = 0.25f;
    const NDArray q = random_f32({B, S, Hq, D}, 70), k = random_f32({B, S, Hkv, D}, 71);
    const NDArray v = random_f32({B, S, Hkv, D}, 72), go = random_f32({B, S, Hq, D}, 73);
    std::vector<int64_t> all(S), lo(S / 2), hi(S / 2);
    for (int64_t i = 0; i < S; ++i) all[i] = i;
    for (int64_t i = 0; i < S / 2; ++i) lo[i] = i, hi[i] = S / 2 + i;
    const std::vector<int32_t> start(B * S, 0);
    NDArray k_lo = NDArray::empty({B, S / 2, Hkv, D}, DType::F32), k_hi = k_lo.clone();
    NDArray v_lo = k_lo.clone(), v_hi = k_lo.clone();
    kernels::slice(cpu(), k, 1, 0, k_lo);
    kernels::slice(cpu(), k, 1, S / 2, k_hi);
    kernels::slice(cpu(), v, 1, 0, v_lo);
    kernels::slice(cpu(), v, 1, S / 2, v_hi);
    const kernels::AttentionTiles tiles{4, 4};
    double e = 0;
    for (int64_t window : {int64_t{0}, int64_t{7}}) {
      // CPU and GPU: the block of each key half, merged into (out, lse).
      auto run = [&](Stream& st, bool dev) {
        auto put = [&](const NDArray& a) { return dev ? up(a) : a; };
        NDArray out = kernels::zeros(st, {B, S, Hq, D}, DType::F32);
        NDArray lse = NDArray::from_vector({B, Hq, S}, std::vector<float>(B * Hq * S, -INFINITY));
        lse = put(lse);
        std::vector<kernels::AttentionBlock> blocks(2);
        for (int h = 0; h < 2; ++h) {
          kernels::AttentionBlock& b = blocks[h];
          b.q = put(q), b.q_index = all, b.q_start = start;
          b.k = put(h == 0 ? k_lo : k_hi), b.v = put(h == 0 ? v_lo : v_hi);
          b.k_index = h == 0 ? std::span<const int64_t>(lo) : std::span<const int64_t>(hi);
          b.scale = scale, b.window = window;
          NDArray ob = kernels::zeros(st, {B, S, Hq, D}, DType::F32), lb = kernels::zeros(st, {B, Hq, S}, DType::F32);
          kernels::attention_block_forward(st, b, ob, lb, tiles);
          kernels::attention_merge(st, out, lse, ob, lb);
        }
        NDArray delta = kernels::zeros(st, {B, Hq, S}, DType::F32);
        kernels::attention_row_dots(st, out, put(go), delta);
        NDArray dq = kernels::zeros(st, q.shape(), DType::F32);
        std::vector<NDArray> dk, dv;
        for (int h = 0; h < 2; ++h) {
          dk.push_back(kernels::zeros(st, k_lo.shape(), DType::F32));
          dv.push_back(kernels::zeros(st, k_lo.shape(), DType::F32));
          kernels::attention_block_backward(st, blocks[h], put(go), lse, delta, dq, dk[h], dv[h], tiles);
        }
        auto get = [&](const NDArray& a) { return dev ? down(a) : a; };
        return std::vector<NDArray>{get(out), get(lse), get(delta), get(dq), get(dk[0]), get(dk[1]), get(dv[0]),
                                    get(dv[1])};
      };
      const std::vector<NDArray> want = run(cpu(), false), got = run(gpu(), true);
      for (size_t i = 0; i < want.size(); ++i) e = std::max(e, rel_diff(got[i], want[i]));
    }
    char d[64];
    std::snprintf(d, sizeof d, "rel=%.1e", e);
    result("attention_blocks", e < 1e-4, d);
  });
  kernels::cuda::set_cudnn_attention_mode(mode);
}

void runtime() {
  run_case("device_errors", [] {
    auto error_of = [](auto&& f) -> std::string {
      try {
        f();
      } catch (const Error& e) {
        return e.what();
      }
      return "";
    };
    const std::string e = error_of([] { require_device(Device::cuda(cuda_device_count())); });
    result("no_such_device", e.find("no such device") != std::string::npos, "error=\"" + e + "\"");
    Allocator& a = allocator_for(Device::cuda(0));
    const std::string oom = error_of([&] { a.allocate(size_t{1} << 50); });
    result("out_of_memory_one_line", oom.rfind("[cuda:0] out of memory allocating", 0) == 0 &&
                                         oom.find('\n') == std::string::npos,
           "error=\"" + oom + "\"");
  });
  run_case("allocator", [] {
    Allocator& a = allocator_for(Device::cuda(0));
    const size_t before = a.current_bytes();
    {
      NDArray x = NDArray::empty({1 << 20}, DType::F32, Device::cuda(0));
      result("allocator_accounts", a.current_bytes() == before + (4u << 20));
    }
    result("allocator_frees", a.current_bytes() == before);
  });
  run_case("events", [] {
    Event start, end;
    start.record(gpu());
    NDArray x = kernels::zeros(gpu(), {1 << 22}, DType::F32);
    for (int i = 0; i < 20; ++i) kernels::scale(gpu(), x, 1.5f, x);
    end.record(gpu());
    const double ms = end.elapsed_ms(start);
    char d[64];
    std::snprintf(d, sizeof d, "ms=%.3f", ms);
    result("event_timing", ms > 0 && ms < 1000, d);
  });
}

}  // namespace
}  // namespace hspmd

// usage: conformance_memory [--device cpu:1]
//   --device cpu:1: the cases against the device test double (docs/cuda.md),
//   whose arrays the CPU's kernels compute: runs on any machine and checks
//   the harness itself (each case's arrays are ones both kernels accept;
//   every comparison comes out exact). The CUDA runtime's own cases (device
//   errors, the allocator, events) and the device's deferred id checks need
//   a GPU and are left out there.
int main(int argc, char** argv) {
  using namespace hspmd;
  conformance::program = "conformance_memory";
  const bool on_double = argc == 3 && std::string(argv[1]) == "--device" && std::string(argv[2]) == "cpu:1";
  if (argc != 1 && !on_double) {
    std::fprintf(stderr, "usage: conformance_memory [--device cpu:1]\n");
    return 2;
  }
  if (on_double) {
    conformance::device_under_test = Device::host_double();
  } else if (cuda_device_count() == 0) {
    std::printf("RESULT probe=conformance_memory case=device status=SKIP (no CUDA device)\n");
    return 77;
  }
  transfers();
  fills_and_copies();
  elementwise();
  optimizer();
  ops();
  gemm();
  layout_and_model_ops();
  large_shapes();
  attention();
  if (!on_double) runtime();
  std::printf("conformance_memory: %d failure(s)\n", conformance::failures);
  return conformance::failures == 0 ? 0 : 1;
}

// The memory kernels (kernels/memory.h): fills, copies, block copies between
// boxes, host transfers, the ordered sum of squares and the multi-tensor
// AdamW; the host accessors of NDArray; and the stream-ordered communicator
// forms that take arrays.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/device.h"
#include "hspmd/optim/adam.h"
#include "hspmd/optim/lr_schedule.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"
#include "test_util.h"

namespace hspmd {
namespace {

Stream& cpu() { return default_stream(Device::cpu()); }

std::vector<float> iota(int64_t n, float from = 0) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = from + static_cast<float>(i);
  return v;
}

TEST(MemoryKernels, FillConvertsToEveryDtype) {
  NDArray f = NDArray::empty({3}, DType::F32), b = NDArray::empty({2}, DType::BF16),
          i = NDArray::empty({2}, DType::I32), l = NDArray::empty({2}, DType::I64);
  kernels::fill(cpu(), f, 1.5f);
  kernels::fill(cpu(), b, 1.00390625f);  // between two bf16 values: rounds to even (1.0)
  kernels::fill(cpu(), i, -2.7f);
  kernels::fill(cpu(), l, 3.0f);
  EXPECT_EQ(f.to_vector(), std::vector<float>({1.5f, 1.5f, 1.5f}));
  EXPECT_EQ(b.to_vector(), std::vector<float>({1.0f, 1.0f}));
  EXPECT_EQ(i.to_vector(), std::vector<float>({-2.0f, -2.0f}));
  EXPECT_EQ(l.to_vector(), std::vector<float>({3.0f, 3.0f}));
  EXPECT_EQ(kernels::zeros(cpu(), {2, 2}, DType::F32).to_vector(), std::vector<float>(4, 0.0f));
}

TEST(MemoryKernels, CopyBlockMovesABoxBetweenArrays) {
  // from [3, 4] = 0..11; its block [1:3, 1:3] goes to [0:2, 2:4] of a [2, 5] array.
  NDArray from = NDArray::from_vector({3, 4}, iota(12));
  NDArray to = kernels::zeros(cpu(), {2, 5}, DType::F32);
  kernels::copy_block(cpu(), from, {1, 1}, to, {0, 2}, {2, 2});
  EXPECT_EQ(to.to_vector(), std::vector<float>({0, 0, 5, 6, 0, 0, 0, 9, 10, 0}));
  // accumulate adds instead
  kernels::copy_block(cpu(), from, {0, 0}, to, {0, 0}, {1, 3}, true);
  EXPECT_EQ(to.to_vector(), std::vector<float>({0, 1, 7, 6, 0, 0, 0, 9, 10, 0}));
  // any dtype: i32, and a 3-d block
  std::vector<int32_t> ints(12);
  for (int i = 0; i < 12; ++i) ints[i] = i;
  NDArray a = NDArray::from_vector_i32({2, 2, 3}, ints);
  NDArray b = kernels::zeros(cpu(), {1, 2, 2}, DType::I32);
  kernels::copy_block(cpu(), a, {1, 0, 1}, b, {0, 0, 0}, {1, 2, 2});
  EXPECT_EQ(b.to_vector(), std::vector<float>({7, 8, 10, 11}));
  // an empty block moves nothing; scalars copy
  kernels::copy_block(cpu(), from, {0, 0}, to, {0, 0}, {0, 2});
  NDArray s = NDArray::from_vector({}, {4.0f}), t = kernels::zeros(cpu(), {}, DType::F32);
  kernels::copy_block(cpu(), s, {}, t, {}, {});
  EXPECT_EQ(t.to_vector(), std::vector<float>({4.0f}));
}

TEST(MemoryKernels, CopyBlockRefusesABlockOutsideItsArrays) {
  NDArray from = NDArray::from_vector({3, 4}, iota(12));
  NDArray to = kernels::zeros(cpu(), {2, 2}, DType::F32);
  EXPECT_THROW(kernels::copy_block(cpu(), from, {2, 0}, to, {0, 0}, {2, 2}), InternalError);
  EXPECT_THROW(kernels::copy_block(cpu(), from, {0, 0}, to, {1, 0}, {2, 2}), InternalError);
  NDArray other = kernels::zeros(cpu(), {2, 2}, DType::I32);
  EXPECT_THROW(kernels::copy_block(cpu(), from, {0, 0}, other, {0, 0}, {2, 2}), InternalError);
  EXPECT_THROW(kernels::copy_block(cpu(), other, {0, 0}, other, {0, 0}, {1, 1}, true), InternalError);
}

TEST(MemoryKernels, HostTransfersOnTheCpuAreTheArrayItself) {
  NDArray a = NDArray::from_vector({2}, {1, 2});
  EXPECT_EQ(kernels::to_host(cpu(), a).raw_data(), a.raw_data());
  EXPECT_EQ(kernels::to_device(cpu(), a).raw_data(), a.raw_data());
  NDArray out = NDArray::empty({2}, DType::F32);
  kernels::copy(cpu(), a, out);
  EXPECT_EQ(out.to_vector(), a.to_vector());
  EXPECT_NE(out.raw_data(), a.raw_data());
}

TEST(MemoryKernels, MissingDeviceKernelsAreOneLine) {
  Stream cuda(Device{DeviceType::CUDA, 0}, 1);  // a stream object only
  NDArray a = NDArray::from_vector({2}, {1, 2});
  // With the CUDA backend the copy needs a device; without it, a kernel.
  if (cuda_device_count() == 0) {  // with CUDA, then why the runtime says so (no driver here, say)
    const std::string want = built_with_cuda() ? "[device] cuda:0: no CUDA device is visible to this process"
                                               : "[kernels] to_device: no kernel for device cuda:0 in this build";
    const std::string got = testing::error_of([&] { kernels::to_device(cuda, a); });
    EXPECT_EQ(got.substr(0, want.size()), want);
    EXPECT_EQ(got.find('\n'), std::string::npos);
  }
  EXPECT_EQ(testing::error_of([&] { kernels::fill(cuda, a, 0); }),
            "[kernels] fill: an array lives on cpu:0 but the stream on cuda:0");
}

TEST(MemoryKernels, SumOfSquaresIsOrderedInDouble) {
  // The same bits as one double accumulator over the arrays in order.
  NDArray a = NDArray::from_vector({3}, {0.1f, 1e8f, -3.0f});
  NDArray b = NDArray::from_vector({2}, {1e-8f, 7.0f});
  double want = 0;
  for (float x : {0.1f, 1e8f, -3.0f, 1e-8f, 7.0f}) want += static_cast<double>(x) * x;
  EXPECT_EQ(kernels::sum_of_squares(cpu(), {a, b}), want);
  EXPECT_EQ(kernels::sum_of_squares(cpu(), {}), 0.0);
}

TEST(MemoryKernels, AdamStepMatchesTheScalarRule) {
  // Two tensors in one call, against the update written out in double-free
  // f32 (torch's order; the kernel fuses the last multiply-subtract where
  // the CPU has FMA, so compare to a few ulps).
  const kernels::AdamFactors f{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, 0.0f, 0.999f, 0.5f, 0.01f};
  NDArray p1 = NDArray::from_vector({3}, {1, -2, 3}), g1 = NDArray::from_vector({3}, {0.5f, 0.25f, -1});
  NDArray m1 = NDArray::from_vector({3}, {0.1f, 0, 0}), v1 = NDArray::from_vector({3}, {0.01f, 0, 0});
  NDArray p2 = NDArray::from_vector({1}, {4}), g2 = NDArray::from_vector({1}, {2});
  NDArray m2 = kernels::zeros(cpu(), {1}, DType::F32), v2 = kernels::zeros(cpu(), {1}, DType::F32);
  const auto p0 = p1.to_vector(), gv = g1.to_vector(), m0 = m1.to_vector(), v0 = v1.to_vector();
  kernels::adam_step(cpu(), {{&p1, &g1, &m1, &v1}, {&p2, &g2, &m2, &v2}}, f);
  for (int i = 0; i < 3; ++i) {
    const float m = f.beta1 * m0[i] + f.one_minus_beta1 * gv[i];
    const float v = f.beta2 * v0[i] + f.one_minus_beta2 * gv[i] * gv[i];
    const float p = p0[i] * f.decay_scale - f.step_size * (m / (std::sqrt(v) / f.sqrt_bc2 + f.eps));
    EXPECT_FLOAT_EQ(m1.to_vector()[i], m);
    EXPECT_FLOAT_EQ(v1.to_vector()[i], v);
    EXPECT_NEAR(p1.to_vector()[i], p, 4e-7f * std::fabs(p));
  }
  EXPECT_FLOAT_EQ(m2.to_vector()[0], 0.2f);
  EXPECT_NE(p2.to_vector()[0], 4.0f);  // the second tensor was updated too
  NDArray wrong = NDArray::from_vector({2}, {0, 0});
  EXPECT_THROW(kernels::adam_step(cpu(), {{&p1, &wrong, &m1, &v1}}, f), InternalError);
}

// An AdamW step's four f32 arrays of n elements, filled with fixed values
// (parameters, gradients, moments).
struct AdamArrays {
  NDArray p, g, m, v;
  explicit AdamArrays(int64_t n)
      : p(NDArray::empty({n}, DType::F32)), g(NDArray::empty({n}, DType::F32)), m(NDArray::empty({n}, DType::F32)),
        v(NDArray::empty({n}, DType::F32)) {
    for (int64_t i = 0; i < n; ++i) {
      p.host_data<float>("t")[i] = std::sin(0.37f * static_cast<float>(i)) + 0.5f;
      g.host_data<float>("t")[i] = std::cos(1.3f * static_cast<float>(i)) * 3.1f;
      m.host_data<float>("t")[i] = 0.01f * static_cast<float>(i % 7);
      v.host_data<float>("t")[i] = 0.001f * static_cast<float>(i % 5 + 1);
    }
  }
};

TEST(MemoryKernels, AdamStepGradScaleIsTheClipPassThenTheUpdate) {
  // grad_scale (the clip) gives the bits of kernels::scale on the gradient
  // and then the update, on tensors below and above the OpenMP threshold,
  // with L2 (the product beside the clip's) and AdamW; the gradient is left.
  for (float l2 : {0.0f, 0.01f}) {
    for (int64_t n : {5, 70001}) {
      AdamArrays a(n);
      NDArray &p = a.p, &g = a.g, &m = a.m, &v = a.v;
      NDArray p2 = p.clone(), g2 = g.clone(), m2 = m.clone(), v2 = v.clone();
      const auto g0 = g.to_vector();
      kernels::AdamFactors f{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, l2, 0.999f, 0.5f, 0.01f};
      const float coef = clip_coefficient(7.5, 1.0);
      kernels::scale(cpu(), g2, coef, g2);
      kernels::adam_step(cpu(), {{&p2, &g2, &m2, &v2}}, f);
      f.grad_scale = coef;
      kernels::adam_step(cpu(), {{&p, &g, &m, &v}}, f);
      EXPECT_EQ(p.to_vector(), p2.to_vector()) << "n " << n << " l2 " << l2;
      EXPECT_EQ(m.to_vector(), m2.to_vector());
      EXPECT_EQ(v.to_vector(), v2.to_vector());
      EXPECT_EQ(g.to_vector(), g0);
    }
  }
}

TEST(MemoryKernels, AdamStepReadsTheStepFactorsArray) {
  // AdamFactors::step (a CUDA graph's factors, refreshed in device memory
  // each step): its three values replace decay_scale, sqrt_bc2 and
  // step_size, the same bits as the fields; the other fields still count.
  for (int64_t n : {5, 70001}) {
    AdamArrays a(n), b(n);
    kernels::AdamFactors f{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, 0.0f, 0.999f, 0.5f, 0.01f};
    kernels::adam_step(cpu(), {{&a.p, &a.g, &a.m, &a.v}}, f);
    NDArray step = NDArray::from_vector({3}, {f.decay_scale, f.sqrt_bc2, f.step_size});
    kernels::AdamFactors stale = f;
    stale.decay_scale = 0.5f, stale.sqrt_bc2 = 3.0f, stale.step_size = 7.0f;  // what a replay must not use
    stale.step = &step;
    kernels::adam_step(cpu(), {{&b.p, &b.g, &b.m, &b.v}}, stale);
    EXPECT_EQ(a.p.to_vector(), b.p.to_vector()) << n;
    EXPECT_EQ(a.m.to_vector(), b.m.to_vector());
    EXPECT_EQ(a.v.to_vector(), b.v.to_vector());
  }
  AdamArrays a(5);
  NDArray wrong = NDArray::from_vector({2}, {1.0f, 1.0f});
  kernels::AdamFactors f;
  f.step = &wrong;
  EXPECT_THROW(kernels::adam_step(cpu(), {{&a.p, &a.g, &a.m, &a.v}}, f), InternalError);
}

TEST(RecordingScope, RefusesTheHostsWaitsWhileAStepIsRecorded) {
  using testing::error_of;
  // A CUDA graph records no host work: while a step is recorded, a wait for
  // the stream or an event and a read of device values fail in one line
  // naming the wait and the step, even on the CPU (where nothing waits: the
  // audit of HSPMD_CAPTURE_AUDIT); queued kernels and copies do not.
  NDArray a = NDArray::from_vector({3}, {1, 2, 3});
  Event e;
  e.record(cpu());
  {
    const RecordingScope recording("step 7 (test)");
    EXPECT_EQ(error_of([] { cpu().synchronize(); }),
              "[device] a wait for the stream while recording step 7 (test): the recorded work has not run, so the "
              "host cannot wait for it or read its values (a CUDA graph records no host work)");
    EXPECT_NE(error_of([&] { kernels::to_host(cpu(), a); }).find("kernels::to_host) while recording step 7"),
              std::string::npos);
    EXPECT_NE(error_of([&] { kernels::sum_of_squares(cpu(), {a}); }).find("kernels::sum_of_squares"),
              std::string::npos);
    EXPECT_NE(error_of([&] { e.synchronize(); }).find("a wait for an event while recording"), std::string::npos);
    EXPECT_NO_THROW(kernels::scale(cpu(), a, 2.0f, a));
    NDArray b = NDArray::empty({3}, DType::F32);
    EXPECT_NO_THROW(kernels::copy_from_host(cpu(), NDArray::from_vector({3}, {4, 5, 6}), b));
    EXPECT_EQ(b.to_vector(), std::vector<float>({4, 5, 6}));
    Event inside;
    EXPECT_NO_THROW(inside.record(cpu()));  // an event in the recorded work: no wait
  }
  EXPECT_NO_THROW(cpu().synchronize());
  EXPECT_EQ(kernels::sum_of_squares(cpu(), {a}), 4.0 + 16.0 + 36.0);
}

TEST(MemoryKernels, ClipControlIsTheHostsNormCoefficientAndGuard) {
  // control = {sum_of_squares, clip_coefficient(sqrt(sum), max), finite}: the
  // bits the trainer's host path computes, so the device path trains the same.
  NDArray a = NDArray::empty({70001}, DType::F32), b = NDArray::empty({3}, DType::F32);
  for (int64_t i = 0; i < a.numel(); ++i) a.host_data<float>("t")[i] = std::sin(0.11f * static_cast<float>(i));
  for (int64_t i = 0; i < b.numel(); ++i) b.host_data<float>("t")[i] = 2.0f + static_cast<float>(i);
  NDArray l0 = NDArray::from_vector({}, {3.25f}), l1 = NDArray::from_vector({}, {-1.0f});
  const double sum = kernels::sum_of_squares(cpu(), {a, b});
  for (double max_norm : {1.0, 1e9, 0.0, -1.0}) {
    NDArray c = NDArray::empty({3}, DType::F64);
    kernels::clip_control(cpu(), {a, b}, {l0, l1}, max_norm, c);
    EXPECT_EQ(c.host_data<double>("c")[0], sum);
    EXPECT_EQ(c.host_data<double>("c")[1], static_cast<double>(clip_coefficient(std::sqrt(sum), max_norm))) << max_norm;
    EXPECT_EQ(c.host_data<double>("c")[2], 1.0);
  }
  NDArray c = NDArray::empty({3}, DType::F64);
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    NDArray lb = NDArray::from_vector({}, {bad});
    kernels::clip_control(cpu(), {a, b}, {l0, lb}, 1.0, c);
    EXPECT_EQ(c.host_data<double>("c")[2], 0.0) << "a loss term " << bad;
    NDArray gb = b.clone();
    gb.host_data<float>("t")[1] = bad;
    kernels::clip_control(cpu(), {a, gb}, {l0}, 1.0, c);
    EXPECT_EQ(c.host_data<double>("c")[2], 0.0) << "a gradient " << bad;
  }
  kernels::clip_control(cpu(), {}, {}, 1.0, c);
  EXPECT_EQ(c.host_data<double>("c")[0], 0.0);
  EXPECT_EQ(c.host_data<double>("c")[1], 1.0);
  EXPECT_EQ(c.host_data<double>("c")[2], 1.0);
  NDArray wrong = NDArray::empty({2}, DType::F64);
  EXPECT_THROW(kernels::clip_control(cpu(), {a}, {l0}, 1.0, wrong), InternalError);
}

TEST(MemoryKernels, AdamStepReadsTheControlArray) {
  // With AdamFactors::control the coefficient is control[1] (grad_scale
  // unread) and control[2] != 1 leaves parameters and moments untouched.
  AdamArrays a(70001);
  NDArray &p = a.p, &g = a.g, &m = a.m, &v = a.v;
  NDArray p2 = p.clone(), m2 = m.clone(), v2 = v.clone();
  kernels::AdamFactors f{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, 0.0f, 0.999f, 0.5f, 0.01f};
  f.grad_scale = 0.37f;
  kernels::adam_step(cpu(), {{&p2, &g, &m2, &v2}}, f);
  NDArray control = NDArray::empty({3}, DType::F64);
  control.host_data<double>("c")[0] = 0.0;
  control.host_data<double>("c")[1] = static_cast<double>(0.37f);
  control.host_data<double>("c")[2] = 1.0;
  f.grad_scale = 5.0f;  // not read
  f.control = &control;
  kernels::adam_step(cpu(), {{&p, &g, &m, &v}}, f);
  EXPECT_EQ(p.to_vector(), p2.to_vector());
  EXPECT_EQ(m.to_vector(), m2.to_vector());
  EXPECT_EQ(v.to_vector(), v2.to_vector());
  control.host_data<double>("c")[2] = 0.0;
  const auto p0 = p.to_vector(), m0 = m.to_vector(), v0 = v.to_vector();
  kernels::adam_step(cpu(), {{&p, &g, &m, &v}}, f);
  EXPECT_EQ(p.to_vector(), p0);
  EXPECT_EQ(m.to_vector(), m0);
  EXPECT_EQ(v.to_vector(), v0);
}

TEST(MemoryKernels, AdamStepWritesTheParametersBf16Copies) {
  // AdamTensor::param_bf16: the updated parameter cast to bf16 (kernels::
  // cast's bits) in the update's pass, clipped or not, on tensors below and
  // above a chunk; the update itself the same bits as without it; nothing
  // written on a step the control array skips; a copy of the wrong dtype
  // or size refused.
  for (float scale : {1.0f, 0.37f}) {
    for (int64_t n : {5, 70001}) {
      AdamArrays a(n), b(n);
      NDArray copy = NDArray::empty({n}, DType::BF16);
      kernels::AdamFactors f{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, 0.0f, 0.999f, 0.5f, 0.01f, scale};
      kernels::adam_step(cpu(), {{&a.p, &a.g, &a.m, &a.v, &copy}}, f);
      kernels::adam_step(cpu(), {{&b.p, &b.g, &b.m, &b.v}}, f);
      EXPECT_EQ(a.p.to_vector(), b.p.to_vector()) << "n " << n << " scale " << scale;
      EXPECT_EQ(a.m.to_vector(), b.m.to_vector());
      const NDArray want = a.p.to(DType::BF16);
      EXPECT_EQ(std::memcmp(copy.raw_data(), want.raw_data(), want.nbytes()), 0) << "n " << n << " scale " << scale;
    }
  }
  AdamArrays a(70001);
  NDArray copy = a.p.to(DType::BF16);
  const NDArray before = copy.clone();
  NDArray control = NDArray::empty({3}, DType::F64);
  control.host_data<double>("c")[0] = 1.0;
  control.host_data<double>("c")[1] = 1.0;
  control.host_data<double>("c")[2] = 0.0;  // a non-finite step
  kernels::AdamFactors f{0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, 0.0f, 0.999f, 0.5f, 0.01f};
  f.control = &control;
  kernels::adam_step(cpu(), {{&a.p, &a.g, &a.m, &a.v, &copy}}, f);
  EXPECT_EQ(std::memcmp(copy.raw_data(), before.raw_data(), before.nbytes()), 0);
  NDArray f32_copy = NDArray::empty({70001}, DType::F32), short_copy = NDArray::empty({7}, DType::BF16);
  f.control = nullptr;
  EXPECT_THROW(kernels::adam_step(cpu(), {{&a.p, &a.g, &a.m, &a.v, &f32_copy}}, f), InternalError);
  EXPECT_THROW(kernels::adam_step(cpu(), {{&a.p, &a.g, &a.m, &a.v, &short_copy}}, f), InternalError);
}

TEST(GradClipping, OneRuleForTrainerAndTests) {
  EXPECT_EQ(clip_coefficient(5.0, 10.0), 1.0f);
  EXPECT_EQ(clip_coefficient(5.0, 0.0), 1.0f);
  EXPECT_EQ(clip_coefficient(5.0, -1.0), 1.0f);
  EXPECT_EQ(clip_coefficient(5.0, 1.0), static_cast<float>(1.0 / (5.0 + 1e-6)));
}

TEST(NDArrayHost, HostAccessorsOnTheCpu) {
  NDArray a = NDArray::from_vector({2}, {1, 2});
  EXPECT_EQ(a.host_data<float>(), a.data<float>());
  EXPECT_EQ(a.host_raw_data(), a.raw_data());
  EXPECT_THROW(a.host_data<int32_t>(), InternalError);  // the dtype is still checked
}

// A CPU stream that counts how often a communicator synchronizes it.
class CountingStream : public Stream {
 public:
  CountingStream() : Stream(Device::cpu(), 7) {}
  int syncs = 0;

 protected:
  void wait() override { ++syncs; }
};

TEST(CommunicatorStreams, OperationsAreOrderedAfterTheStreamsWork) {
  auto world = make_single_process_communicator();
  CountingStream s;
  NDArray a = NDArray::from_vector({3}, {1, 2, 3});
  NDArray gathered = NDArray::empty({3}, DType::F32);
  std::vector<Request> r;
  r.push_back(world->start_all_reduce(s, a));
  r.push_back(world->start_all_gather(s, a, gathered, {3}));
  EXPECT_EQ(s.syncs, 2);  // a host library waits for the stream before it reads
  world->wait_on(r, s);
  EXPECT_TRUE(r.empty());
  EXPECT_EQ(gathered.to_vector(), a.to_vector());
  EXPECT_EQ(world->bytes().sent, 0);  // one member: nothing travels
}

TEST(CommunicatorStreams, ArraysMustBeContiguousAndOnTheStreamsDevice) {
  auto world = make_single_process_communicator();
  Stream cuda(Device{DeviceType::CUDA, 0}, 1);
  NDArray a = NDArray::from_vector({2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(testing::error_of([&] { world->start_all_reduce(cuda, a); }),
            "[comm] all_reduce: the array lives on cpu:0 but the stream on cuda:0");
  NDArray t = a.transpose(0, 1);
  EXPECT_EQ(testing::error_of([&] { world->start_all_reduce(default_stream(Device::cpu()), t); }),
            "[comm] all_reduce: the buffer must be a valid contiguous array");
}

}  // namespace
}  // namespace hspmd

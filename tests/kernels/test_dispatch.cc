// Streams and the kernel dispatch: the CPU default stream, events, the one
// error of a missing backend kernel, and the device check of the dispatch.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "hspmd/core/device.h"
#include "hspmd/core/device_code.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"
#include "hspmd/exec/virtual_clock.h"
#include "test_util.h"

namespace hspmd {
namespace {

TEST(Stream, CpuDefaultStreamRunsInline) {
  Stream& s = default_stream(Device::cpu());
  EXPECT_EQ(&s, &default_stream(Device::cpu()));
  EXPECT_EQ(s.device(), Device::cpu());
  EXPECT_EQ(s.id(), 0);
  EXPECT_EQ(s.native_handle(), nullptr);
  NDArray a = NDArray::from_vector({3}, {1, 2, 3});
  NDArray out = NDArray::empty({3}, DType::F32);
  kernels::add(s, a, a, out);  // done when it returns
  s.synchronize();
  EXPECT_EQ(out.data<float>()[2], 6.0f);
}

TEST(Stream, CudaDeviceErrorsAreOneLine) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  // Without a usable device: why not, in one line, before any work.
  const std::string want = built_with_cuda() ? "[device] cuda:0: no CUDA device is visible to this process"
                                             : "[device] cuda:0: this build has no CUDA backend";
  // With CUDA built, the runtime's reason follows in parentheses when it
  // said more than "no device" (here, without a driver, it does).
  const auto starts_with_want = [&](const std::string& got) {
    return got.substr(0, want.size()) == want && got.find('\n') == std::string::npos;
  };
  EXPECT_PRED1(starts_with_want, testing::error_of([] { default_stream(Device::cuda(0)); }));
  EXPECT_PRED1(starts_with_want, testing::error_of([] { allocator_for(Device::cuda(0)); }));
  EXPECT_PRED1(starts_with_want, testing::error_of([] { require_device(Device::cuda(0)); }));
  EXPECT_EQ(testing::error_of([] { require_device(Device{DeviceType::CPU, 2}); }),
            "[device] cpu:2: the host is cpu:0 (and cpu:1 its device test double)");
  EXPECT_NO_THROW(require_device(Device::cpu()));
  EXPECT_NO_THROW(require_device(Device::host_double()));
}

// cpu:1, the device test double: the host may not touch its arrays (as a
// GPU's), kernels run on them, transfers and conversions copy.
TEST(DeviceDouble, HostAccessIsRefusedAndTransfersCopy) {
  const Device dbl = Device::host_double();
  EXPECT_EQ(parse_device_name("cpu:1", "--device"), dbl);
  Stream& s = default_stream(dbl);
  EXPECT_EQ(s.device(), dbl);
  EXPECT_NE(&s, &default_stream(Device::cpu()));
  const NDArray host = NDArray::from_vector({5}, {1.0f, -2.5f, 3.0f, 1.00390625f, 0.0f});
  NDArray a = kernels::to_device(s, host);
  EXPECT_EQ(a.device(), dbl);
  {
    const DeviceCodeScope code;  // the double's pointers: device code only (the next test)
    EXPECT_NE(a.raw_data(), host.raw_data());  // a copy
  }
  EXPECT_EQ(testing::error_of([&] { a.host_data<float>(); }),
            "[ndarray] host_data: the array lives on cpu:1, not on the host");
  EXPECT_EQ(testing::error_of([&] { (void)a.clone(); }),
            "[ndarray] NDArray::clone: the array lives on cpu:1, not on the host");
  EXPECT_NE(testing::error_of([&] { (void)a.transpose(0, 0).to(DType::BF16); }), "");
  const NDArray b = kernels::cast(s, a, DType::BF16);
  EXPECT_EQ(b.device(), dbl);
  const NDArray back = kernels::to_host(s, kernels::cast(s, b, DType::F32));
  EXPECT_EQ(back.device(), Device::cpu());
  EXPECT_EQ(back.to_vector(), host.to(DType::BF16).to(DType::F32).to_vector());
  NDArray c = kernels::clone(s, a);
  kernels::scale(s, a, 2.0f, c);  // a CPU kernel on the double's arrays
  EXPECT_EQ(kernels::to_host(s, c).to_vector(), (std::vector<float>{2.0f, -5.0f, 6.0f, 2.0078125f, 0.0f}));
  EXPECT_EQ(kernels::to_host(s, a).to_vector(), host.to_vector());
  EXPECT_EQ(kernels::to_host(s, kernels::zeros(s, {3}, DType::F32)).to_vector(), std::vector<float>(3, 0.0f));
  // Mixing it with host arrays is the dispatch's one-line error.
  EXPECT_EQ(testing::error_of([&] { kernels::scale(s, host, 2.0f, c); }),
            "[kernels] scale: an array lives on cpu:0 but the stream on cpu:1");
}

// The double's host-read rule (device_code.h): the pointers of its arrays
// only in the dispatch (a DeviceCodeScope), as a GPU's arrays are readable
// by its kernels only. A host helper brings them to the host first, as
// document_starts_from_positions does (positions on cuda:0 once ended in
// "no kernel for device cuda:0" while the double passed).
TEST(DeviceDouble, HostReadsOfItsArraysOnlyInDeviceCode) {
  const Device dbl = Device::host_double();
  Stream& s = default_stream(dbl);
  const NDArray host_pos = NDArray::from_vector_i32({1, 4}, {0, 1, 0, 1});
  const NDArray pos = kernels::to_device(s, host_pos);
  const std::string rule =
      "[ndarray] data: a cpu:1 (device test double) array read outside the kernel dispatch: host code may not "
      "read a device's elements (rule: a host helper brings them to the host with kernels::to_host first, or "
      "runs as a dispatched kernel; docs/cuda.md, \"Host helpers\")";
  EXPECT_EQ(testing::error_of([&] { pos.data<int32_t>(); }), rule);
  EXPECT_EQ(testing::error_of([&] { pos.raw_data(); }), rule);
  EXPECT_FALSE(DeviceCodeScope::active());
  {
    const DeviceCodeScope code;
    EXPECT_TRUE(DeviceCodeScope::active());
    EXPECT_EQ(pos.data<int32_t>()[3], 1);
  }
  EXPECT_FALSE(DeviceCodeScope::active());
  EXPECT_EQ(host_pos.data<int32_t>()[3], 1);  // the host's arrays: no rule
  // The helper on the double and on the host: the same starts (first = 4).
  const std::vector<int32_t> want = {4, 4, 6, 6};
  EXPECT_EQ(kernels::document_starts_from_positions(s, pos, 4), want);
  EXPECT_EQ(kernels::document_starts_from_positions(default_stream(Device::cpu()), host_pos, 4), want);
  EXPECT_EQ(testing::error_of([&] { kernels::document_starts_from_positions(s, host_pos, 0); }),
            "[kernels] document_starts_from_positions: an array lives on cpu:0 but the stream on cpu:1");
  const NDArray negative = kernels::to_device(s, NDArray::from_vector_i32({1, 2}, {0, -1}));
  EXPECT_EQ(testing::error_of([&] { kernels::document_starts_from_positions(s, negative, 0); }),
            "[attention] document positions: position -1 of row 0, token 1 is negative (rule: positions >= 0)");
}

TEST(Event, TimesCpuWork) {
  Stream& s = default_stream(Device::cpu());
  Event start, end;
  EXPECT_FALSE(start.recorded());
  start.record(s);
  end.record(s);
  end.synchronize();
  EXPECT_GE(end.elapsed_ms(start), 0.0);
}

// The one timing interface: process CPU time counts the work this thread
// does; stream events count the time that passes (on the CPU, wall time),
// a sleep included.
TEST(WorkTimer, CpuTimeAndStreamEvents) {
  WorkTimer cpu = WorkTimer::process_cpu();
  WorkTimer events = WorkTimer::events(default_stream(Device::cpu()));
  EXPECT_FALSE(cpu.uses_events());
  EXPECT_TRUE(events.uses_events());
  events.begin();
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  EXPECT_GE(events.end_s(), 0.055);
  cpu.begin();
  const double until = process_cpu_seconds() + 0.05;
  volatile double x = 0;
  while (process_cpu_seconds() < until) x = x + 1.0;
  EXPECT_GE(cpu.end_s(), 0.05);
}

TEST(WorkTimer, TheEmulatorsClockReadsItsTimer) {
  VirtualClock clock(2.0);
  clock.set_timer(WorkTimer::events(default_stream(Device::cpu())));
  clock.begin_compute();
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  clock.end_compute();
  EXPECT_GE(clock.compute_s(), 2.0 * 0.035);  // slowdown x the timed 40 ms
  VirtualClock model(2.0, ClockMode::kModel);
  model.set_timer(WorkTimer::events(default_stream(Device::cpu())));
  model.begin_compute();
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  model.end_compute();
  EXPECT_EQ(model.compute_s(), 0.0);  // model mode reads no time
}

TEST(KernelDispatch, MissingKernelIsOneLine) {
  EXPECT_EQ(testing::error_of([] { kernels::no_kernel("matmul", Device{DeviceType::CUDA, 1}); }),
            "[kernels] matmul: no kernel for device cuda:1 in this build");
}

TEST(KernelDispatch, ArraysMustLiveOnTheStreamsDevice) {
  Stream cuda(Device{DeviceType::CUDA, 0}, 1);  // a stream object only: nothing runs on it
  NDArray a = NDArray::from_vector({2}, {1, 2});
  NDArray out = NDArray::empty({2}, DType::F32);
  EXPECT_EQ(testing::error_of([&] { kernels::add(cuda, a, a, out); }),
            "[kernels] add: an array lives on cpu:0 but the stream on cuda:0");
  EXPECT_EQ(testing::error_of([&] { kernels::matmul(cuda, a.reshape({1, 2}), a.reshape({2, 1}),
                                                    false, false, out); }),
            "[kernels] matmul: an array lives on cpu:0 but the stream on cuda:0");
}

// The message of the InternalError `f` throws (a broken caller contract), or "".
std::string internal_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InternalError& e) {
    return e.what();
  }
  return "";
}

TEST(KernelDispatch, EntryChecksRefuseMisfitOptionalArrays) {
  // The optional arrays of rms_norm_backward and swiglu_backward are
  // checked at the dispatch, before a backend writes past them.
  Stream& s = default_stream(Device::cpu());
  NDArray x = NDArray::empty({2, 4}, DType::F32), w = NDArray::empty({4}, DType::F32);
  x.fill(0.5f);
  w.fill(1.0f);
  NDArray dx = NDArray::empty({2, 4}, DType::F32), dw = NDArray::empty({4}, DType::F32);
  NDArray short_addend = NDArray::empty({7}, DType::F32), short_bf16 = NDArray::empty({7}, DType::BF16);
  NDArray f32_copy = NDArray::empty({2, 4}, DType::F32);
  EXPECT_NE(internal_error_of([&] { kernels::rms_norm_backward(s, x, x, w, 1e-5f, dx, dw, &short_addend, nullptr); })
                .find("rms_norm_backward: the addend must be"),
            std::string::npos);
  for (NDArray* bad : {&short_bf16, &f32_copy})
    EXPECT_NE(internal_error_of([&] { kernels::rms_norm_backward(s, x, x, w, 1e-5f, dx, dw, nullptr, bad); })
                  .find("rms_norm_backward: dx_bf16 must be bf16"),
              std::string::npos);
  NDArray g = NDArray::empty({8}, DType::F32), dg = NDArray::empty({8}, DType::F32), du = NDArray::empty({8}, DType::F32);
  g.fill(0.25f);
  NDArray short_out = NDArray::empty({3}, DType::F32);
  EXPECT_NE(internal_error_of([&] { kernels::swiglu_backward(s, g, g, g, dg, du, &short_out); })
                .find("swiglu_backward: out size"),
            std::string::npos);
}

}  // namespace
}  // namespace hspmd

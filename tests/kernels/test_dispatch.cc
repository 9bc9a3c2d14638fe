// Streams and the kernel dispatch: the CPU default stream, events, the one
// error of a missing backend kernel, and the device check of the dispatch.
#include <gtest/gtest.h>

#include <string>

#include "hspmd/core/device.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"
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

TEST(Stream, NoCudaBackend) {
  EXPECT_EQ(testing::error_of([] { default_stream(Device{DeviceType::CUDA, 0}); }),
            "[device] cuda:0: this build has no CUDA backend");
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

}  // namespace
}  // namespace hspmd

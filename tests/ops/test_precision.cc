// Precision::for_device, the one place that decides the dtypes a device
// computes a training graph in (docs/precision.md).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "hspmd/core/error.h"
#include "hspmd/ops/precision.h"
#include "kernels/attention.h"

namespace hspmd {
namespace {

// Where attention's output is bf16: with bf16 compute on a GPU, whose
// cuDNN attention rounds it anyway; f32 on the CPU and its device double.
TEST(Precision, AttentionOutputFollowsTheDevice) {
  const Precision f32, bf16{.compute = DType::BF16};
  EXPECT_EQ(bf16.for_device(Device::cpu()).attention_output, DType::F32);
  EXPECT_EQ(bf16.for_device(Device::host_double()).attention_output, DType::F32);
  // On CUDA: where cuDNN's attention serves it (a build with it, not turned off).
  EXPECT_EQ(bf16.for_device(Device::cuda(1)).attention_output,
            kernels::fused_attention_rounds_output(Device::cuda(1)) ? DType::BF16 : DType::F32);
  EXPECT_FALSE(kernels::fused_attention_rounds_output(Device::cpu()));
  EXPECT_FALSE(kernels::fused_attention_rounds_output(Device::host_double()));
  for (Device d : {Device::cpu(), Device::host_double(), Device::cuda(0)})
    EXPECT_EQ(f32.for_device(d), f32) << d.str();
  Precision gpu = bf16;
  gpu.attention_output = DType::BF16;
  EXPECT_EQ(gpu.for_device(Device::cpu()), bf16);  // decided again, not kept
  // HSPMD_ATTENTION_IO=bf16: the GPU's graph on any device (bf16 compute only).
  ASSERT_EQ(setenv("HSPMD_ATTENTION_IO", "bf16", 1), 0);
  EXPECT_EQ(bf16.for_device(Device::cpu()).attention_output, DType::BF16);
  EXPECT_EQ(bf16.for_device(Device::host_double()).attention_output, DType::BF16);
  EXPECT_EQ(f32.for_device(Device::cpu()), f32);
  ASSERT_EQ(setenv("HSPMD_ATTENTION_IO", "auto", 1), 0);
  EXPECT_EQ(bf16.for_device(Device::cpu()).attention_output, DType::F32);
  // HSPMD_ATTENTION_IO=f32: f32 wherever cuDNN would have rounded it.
  ASSERT_EQ(setenv("HSPMD_ATTENTION_IO", "f32", 1), 0);
  for (Device d : {Device::cpu(), Device::host_double(), Device::cuda(0)})
    EXPECT_EQ(bf16.for_device(d).attention_output, DType::F32) << d.str();
  ASSERT_EQ(setenv("HSPMD_ATTENTION_IO", "f16", 1), 0);
  try {
    (void)bf16.for_device(Device::cpu());
    ADD_FAILURE() << "HSPMD_ATTENTION_IO=f16 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[precision] HSPMD_ATTENTION_IO: 'f16'"), std::string::npos) << e.what();
  }
  ASSERT_EQ(unsetenv("HSPMD_ATTENTION_IO"), 0);
}

// The names the flags and the plan JSON take.
TEST(Precision, ParsesItsNames) {
  EXPECT_EQ(parse_precision_name("fp32", "--precision"), DType::F32);
  EXPECT_EQ(parse_precision_name("f32", "--precision"), DType::F32);
  EXPECT_EQ(parse_precision_name("bf16", "--precision"), DType::BF16);
  try {
    (void)parse_precision_name("fp16", "--precision");
    ADD_FAILURE() << "fp16 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "[precision] --precision: 'fp16' (expected fp32 or bf16)");
  }
}

}  // namespace
}  // namespace hspmd

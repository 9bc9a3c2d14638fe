// Precision: the dtypes a training graph computes, reduces and keeps
// attention's output in, and the one place that decides them for a device
// (for_device: the attention kernels' rounding and HSPMD_ATTENTION_IO). The
// models build the graph they are given (ModelBuildOptions::precision); the
// callers decide it here first. docs/precision.md.
#pragma once

#include <string>

#include "hspmd/core/device.h"
#include "hspmd/core/dtype.h"

namespace hspmd {

// Mixed precision of the training graph (docs/precision.md). With
// compute = BF16: the GEMMs take bf16 operands (bf16 compute copies of the
// weights, cast from the f32 masters in the graph; bf16 activations, which is
// also what the GEMMs keep for their backward) and accumulate in f32; the
// activations that Reshards carry between blocks, the tensor-parallel
// partial sums and the sequence-parallel gathers travel in bf16; RMSNorm,
// RoPE, attention's softmax, SwiGLU, the residual adds and cross-entropy
// compute in f32. grad_reduce: the dtype gradients are synchronized in
// (f32 by default; bf16 halves the bytes; the f32 sum comes back). The graph
// itself keeps f32 gradients: the executor casts around the once-per-step
// grad.{parameter} Reshards (AnnotatedTraining::reshards gives them this dtype).
//
// attention_output: the dtype attention writes its output O in, and with
// it its backward dq, dk and dv, and the dtype that backward reads dO in.
// F32 (the default, the CPU's) keeps O unrounded for the backward's row
// dots (dO . O); BF16 (bf16 compute only) is what cuDNN's fused attention
// writes and reads back in its backward whatever the graph holds, so on a
// GPU f32 arrays there are only widenings and roundings of bf16 ones.
// for_device() picks it.
struct Precision {
  DType compute = DType::F32;
  DType grad_reduce = DType::F32;
  DType attention_output = DType::F32;
  bool operator==(const Precision&) const = default;
  bool mixed() const { return compute == DType::BF16; }
  // This precision as a run on `device` computes it: a bf16 attention
  // output with bf16 compute on a GPU whose attention goes to cuDNN
  // (kernels::fused_attention_rounds_output: a build with cuDNN,
  // HSPMD_CUDNN_ATTENTION not 0), else f32. The device test double
  // cpu:1 keeps the CPU's f32 output: the CPU's attention kernels are not
  // cuDNN's, and with a rounded O the Qwen2 key bias's gradient (near zero
  // by softmax's shift invariance) leaves the PyTorch oracle's tolerance
  // (docs/precision.md); a GPU has that rounding either way.
  // HSPMD_ATTENTION_IO=bf16 in the environment builds the GPU's graph on
  // any device (the CPU then rounds as cuDNN does: for testing that graph
  // without a GPU, or comparing a GPU run's numerics on a CPU);
  // HSPMD_ATTENTION_IO=f32 keeps the CPU's f32 output and gradients on a
  // GPU too (cuDNN is then asked for an fp32 O, which its backward's row
  // sums read unrounded, and its bf16 O is widened where it refuses one);
  // HSPMD_ATTENTION_IO=auto or unset: the rule above. Another value throws
  // hspmd::Error "[precision] HSPMD_ATTENTION_IO: ...".
  Precision for_device(const Device& device) const;
};

// "fp32" / "bf16" -> the compute dtype; throws hspmd::Error "[precision] ...".
DType parse_precision_name(const std::string& name, const std::string& what);

}  // namespace hspmd

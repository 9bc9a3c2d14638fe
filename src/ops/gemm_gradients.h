// Gradient pieces that linear_bias (linear_bias.cc) shares with the ops it
// fuses (matmul.cc, add_bias.cc), so that its backward is theirs node for
// node. Internal to src/ops/.
#pragma once

#include <vector>

#include "hspmd/graph/graph.h"

namespace hspmd::ops {

// matmul's gradients of a and b for the output gradient g: {da, db}, the
// nodes MatmulOp's gradient appends. `fold` is a's gradient so far (as
// Op::gradient_into's addends[0]); reset to invalid when da's GEMM adds it.
std::vector<Tensor> matmul_input_gradients(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                                           const Tensor& g, Tensor& fold);

// add_bias's bias gradient for dy [..., N]: dy summed over its leading dims
// in f32 (the bias_grad node over cast(dy, f32)), [N].
Tensor bias_gradient(const Tensor& dy);

}  // namespace hspmd::ops

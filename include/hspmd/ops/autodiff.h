// Reverse-mode automatic differentiation over the defined graph. It sits in
// the ops layer, not in graph: it builds nodes with ops (add sums the
// gradients of a tensor, fill_like seeds the loss's gradient).
#pragma once

#include <vector>

#include "hspmd/graph/graph.h"

namespace hspmd {

// Appends the backward graph of scalar `loss` to its graph and returns
// d(loss)/d(x) for each x in `wrt` (same order). A tensor that the loss does
// not depend on gets an invalid Tensor. Gradients reaching a tensor along
// several paths are summed. Throws hspmd::Error if loss is not a scalar.
std::vector<Tensor> gradients(const Tensor& loss, const std::vector<Tensor>& wrt);

}  // namespace hspmd

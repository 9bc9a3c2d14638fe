// Op: the interface every operator implements, in one file per op
// (src/ops/<name>.cc): its shape rule, its kernel calls and its gradient.
#pragma once

#include <string>
#include <vector>

#include "hspmd/core/ndarray.h"
#include "hspmd/graph/graph.h"

namespace hspmd {

// What compute() gets besides its inputs: the concrete output shapes and
// dtypes (from the shape rule under the run's symbol bindings) and the device.
struct OpContext {
  std::vector<Shape> out_shapes;
  std::vector<DType> out_dtypes;
  Device device;
  const Bindings* bindings = nullptr;

  // A new contiguous array for output i (uninitialized).
  NDArray alloc(int i) const { return NDArray::empty(out_shapes[i], out_dtypes[i], device); }
};

class Op {
 public:
  virtual ~Op() = default;

  // Short type name, e.g. "matmul".
  virtual std::string type() const = 0;

  // Shape rule: output metas from input metas. Throws hspmd::Error
  // ("[op] ...") when the inputs do not fit.
  virtual std::vector<TensorMeta> infer(const std::vector<TensorMeta>& inputs) const = 0;

  // Computes the outputs. `outputs` has one invalid slot per output; the op
  // fills each with ctx.alloc(i) or with a view of an input.
  virtual void compute(const OpContext& ctx, const std::vector<NDArray>& inputs,
                       std::vector<NDArray>& outputs) const = 0;

  // Reverse mode: appends the backward nodes of `node` to its graph and
  // returns one gradient per input (an invalid Tensor where an input gets
  // none). grad_outputs[i] is invalid when output i received no gradient.
  // The default throws: the op is not differentiable.
  virtual std::vector<Tensor> gradient(const Node& node,
                                       const std::vector<Tensor>& grad_outputs) const;
};

}  // namespace hspmd

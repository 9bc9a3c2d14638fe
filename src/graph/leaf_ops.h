// Leaf ops: placeholders and parameters carry no computation; the executor
// binds their values by name.
#pragma once

#include "hspmd/graph/op.h"

namespace hspmd {

class LeafOp final : public Op {
 public:
  enum class Kind { kPlaceholder, kParameter };
  LeafOp(Kind kind, TensorMeta meta) : kind_(kind), meta_(std::move(meta)) {}
  std::string type() const override { return kind_ == Kind::kParameter ? "parameter" : "placeholder"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>&) const override { return {meta_}; }
  void compute(const OpContext&, const std::vector<NDArray>&, std::vector<NDArray>&) const override;
  // Leaves end the backward pass: no inputs, nothing to return.
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>&) const override {
    return {};
  }
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
  TensorMeta meta_;
};

}  // namespace hspmd

// Leaf ops: placeholders and parameters carry no computation; the executor
// binds their values by name.
#pragma once

#include "hspmd/graph/op.h"

namespace hspmd {

class LeafOp : public Op {
 public:
  LeafOp(std::string type, TensorMeta meta) : type_(std::move(type)), meta_(std::move(meta)) {}
  std::string type() const override { return type_; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>&) const override { return {meta_}; }
  void compute(const OpContext&, const std::vector<NDArray>&, std::vector<NDArray>&) const override;
  // Leaves end the backward pass: no inputs, nothing to return.
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>&) const override {
    return {};
  }
  bool is_parameter() const { return type_ == "parameter"; }

 private:
  std::string type_;
  TensorMeta meta_;
};

}  // namespace hspmd

// reshard: the point where a tensor may change layout. Identity on one
// device (the output is the input array); the annotation layer turns it into
// communication.
#include "hspmd/ops/ops.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

class ReshardOp final : public Op {
 public:
  std::string type() const override { return "reshard"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("reshard", in, 1);
    return {in[0]};
  }
  void compute(const OpContext&, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = in[0];
  }
  std::vector<Tensor> gradient(const Node&, const std::vector<Tensor>& g) const override {
    return {reshard(g[0])};
  }
};

}  // namespace

Tensor reshard(const Tensor& x) { return x.graph()->add1(std::make_shared<ReshardOp>(), {x}); }

}  // namespace hspmd::ops

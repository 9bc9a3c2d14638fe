// embedding: rows of weight[V, H] picked by i32 ids. The gradient w.r.t. the
// weight is a dense [V, H] scatter-add (embedding_grad); ids get none.
#include "hspmd/ops/ops.h"
#include "kernels/basic.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

// dweight [V, H] from (grad [..., H], ids [...]).
class EmbeddingGradOp final : public Op {
 public:
  explicit EmbeddingGradOp(SymShape weight_shape) : weight_shape_(std::move(weight_shape)) {}
  std::string type() const override { return "embedding_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("embedding_grad", in, 2);
    return {TensorMeta{weight_shape_, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::embedding_backward(in[0].contiguous(), in[1].contiguous(), out[0]);
  }

 private:
  SymShape weight_shape_;
};

class EmbeddingOp final : public Op {
 public:
  std::string type() const override { return "embedding"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("embedding", in, 2);
    expect_dtype("embedding", "weight", in[0], DType::F32);
    expect_dtype("embedding", "ids", in[1], DType::I32);
    if (in[0].shape.size() != 2)
      fail("[embedding] weight must be [V, H], got ", sym_shape_str(in[0].shape));
    SymShape out = in[1].shape;
    out.push_back(in[0].shape[1]);
    return {TensorMeta{out, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    out[0] = ctx.alloc(0);
    kernels::embedding(in[0].contiguous(), in[1].contiguous(), out[0]);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    const Tensor weight = node.inputs[0], ids = node.inputs[1];
    auto op = std::make_shared<EmbeddingGradOp>(weight.shape());
    return {g[0].graph()->add1(op, {g[0], ids}), Tensor()};
  }
};

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  return weight.graph()->add1(std::make_shared<EmbeddingOp>(), {weight, ids});
}

}  // namespace hspmd::ops

#include "hspmd/graph/graph.h"

#include <algorithm>
#include <optional>

#include "hspmd/core/error.h"
#include "hspmd/graph/op.h"
#include "leaf_ops.h"

namespace hspmd {

const Node& Tensor::node() const {
  HSPMD_CHECK(valid(), "use of an invalid Tensor");
  return graph_->node(node_);
}

const TensorMeta& Tensor::meta() const { return node().outputs.at(index_); }

Tensor Node::output(int i) const {
  HSPMD_CHECK(i >= 0 && i < static_cast<int>(outputs.size()));
  return Tensor(graph, id, i);
}

std::vector<Tensor> Graph::add(std::shared_ptr<const Op> op, const std::vector<Tensor>& inputs,
                               const std::string& name) {
  std::vector<TensorMeta> in_metas;
  in_metas.reserve(inputs.size());
  for (const auto& t : inputs) {
    if (!t.valid()) fail("[", op->type(), "] an input tensor is undefined");
    if (t.graph() != this) fail("[", op->type(), "] an input belongs to another graph");
    in_metas.push_back(t.meta());
  }
  Node node;
  node.graph = this;
  node.id = num_nodes();
  node.outputs = op->infer(in_metas);
  node.op = std::move(op);
  node.inputs = inputs;
  node.name = name;
  for (const auto& t : node.inputs) readers_[t.node_id()][t.index()].push_back(node.id);
  readers_.emplace_back(node.outputs.size());
  nodes_.push_back(std::move(node));
  std::vector<Tensor> outs;
  for (int i = 0; i < static_cast<int>(nodes_.back().outputs.size()); ++i)
    outs.emplace_back(this, nodes_.back().id, i);
  return outs;
}

void Graph::set_origin(int first_node, const std::string& origin) {
  for (int i = std::max(first_node, 0); i < num_nodes(); ++i)
    if (nodes_[i].origin.empty()) nodes_[i].origin = origin;
}

Tensor Graph::add1(std::shared_ptr<const Op> op, const std::vector<Tensor>& inputs,
                   const std::string& name) {
  auto outs = add(std::move(op), inputs, name);
  HSPMD_CHECK(outs.size() == 1, "op has ", outs.size(), " outputs");
  return outs[0];
}

Tensor Graph::placeholder(const std::string& name, const SymShape& shape, DType dtype) {
  if (placeholder_names_.count(name)) fail("[graph] placeholder '", name, "' defined twice");
  Tensor t =
      add1(std::make_shared<LeafOp>(LeafOp::Kind::kPlaceholder, TensorMeta{shape, dtype}), {}, name);
  placeholders_.push_back(t);
  placeholder_names_.emplace(name, t);
  return t;
}

Tensor Graph::parameter(const std::string& name, const Shape& shape, DType dtype) {
  if (parameter_names_.count(name)) fail("[graph] parameter '", name, "' defined twice");
  const TensorMeta meta{sym_shape(shape), dtype};
  Tensor t = add1(std::make_shared<LeafOp>(LeafOp::Kind::kParameter, meta), {}, name);
  parameters_.push_back(t);
  parameter_names_.emplace(name, t);
  return t;
}

Tensor Graph::find(const std::string& name) const {
  for (const auto* names : {&parameter_names_, &placeholder_names_})
    if (auto it = names->find(name); it != names->end()) return it->second;
  fail("[graph] no placeholder or parameter named '", name, "'");
}

const std::vector<int>& Graph::readers(const Tensor& t) const {
  HSPMD_CHECK(t.valid() && t.graph() == this, "readers() of a tensor of another graph");
  return readers_.at(t.node_id()).at(t.index());
}

namespace {

// The leaf kind of `node`, or none when it is no leaf.
std::optional<LeafOp::Kind> leaf_kind(const Node& node) {
  const auto* leaf = dynamic_cast<const LeafOp*>(node.op.get());
  if (leaf == nullptr) return std::nullopt;
  return leaf->kind();
}

}  // namespace

bool is_placeholder(const Node& node) { return leaf_kind(node) == LeafOp::Kind::kPlaceholder; }
bool is_parameter(const Node& node) { return leaf_kind(node) == LeafOp::Kind::kParameter; }
bool is_leaf(const Node& node) { return leaf_kind(node).has_value(); }

void LeafOp::compute(const OpContext&, const std::vector<NDArray>&, std::vector<NDArray>&) const {
  HSPMD_CHECK(false, "leaf ops are bound by the executor, not computed");
}

std::vector<Tensor> Op::gradient(const Node& node, const std::vector<Tensor>&) const {
  fail("[autodiff] op '", type(), "' (node ", node.id, ") is not differentiable");
}

// The default (elementwise) deduction rule, with the Op interface that
// declares it: the deduction engine (src/deduce) sits above the graph.
std::vector<Annotation> Op::deduce(const DeduceContext& ctx,
                                   const std::vector<Annotation>& inputs) const {
  if (inputs.empty()) fail_at(ctx, "has no inputs to take its devices from and no rule of its own");
  if (!is_linear())
    for (size_t i = 0; i < inputs.size(); ++i)
      if (has_partial(inputs[i]))
        fail_at(ctx, "input ", i, " is partial; insert a Reshard to reduce it first");
  for (size_t i = 1; i < inputs.size(); ++i)
    if (!same_layout(inputs[0], inputs[i]))
      fail_at(ctx, "inputs 0 and ", i, " are sharded differently (", to_string(inputs[0]), ") vs (",
              to_string(inputs[i]), "); insert a Reshard");
  return std::vector<Annotation>(ctx.node.outputs.size(), inputs[0]);
}

std::string DeduceContext::where() const {
  std::string s = "op '" + node.op->type() + "' ";
  if (!node.name.empty()) s += "'" + node.name + "' ";
  s += "(node " + std::to_string(node.id);
  if (!node.origin.empty()) s += ", from " + node.origin;
  return s + ")";
}

double Op::flops(const std::vector<Shape>&, const std::vector<Shape>& outputs, const ShardContext*) const {
  double n = 0;
  for (const Shape& s : outputs) n += static_cast<double>(shape_numel(s));
  return n;
}

double Op::flops_on(const std::vector<NDArray>& inputs, const std::vector<Shape>& outputs,
                    const ShardContext* shard) const {
  std::vector<Shape> shapes;
  for (const NDArray& a : inputs) shapes.push_back(a.valid() ? a.shape() : Shape{0});
  return flops(shapes, outputs, shard);
}

}  // namespace hspmd

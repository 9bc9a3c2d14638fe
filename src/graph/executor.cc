#include "hspmd/graph/executor.h"

#include "hspmd/core/error.h"
#include "hspmd/graph/op.h"

namespace hspmd {

Executor::Executor(const Graph& graph, std::vector<Tensor> fetches, Device device)
    : graph_(graph), fetches_(std::move(fetches)), device_(device) {
  std::vector<bool> needed(graph.num_nodes(), false);
  for (const auto& t : fetches_) {
    HSPMD_CHECK(t.valid() && t.graph() == &graph, "fetch of a tensor from another graph");
    needed[t.node_id()] = true;
  }
  for (int id = graph.num_nodes() - 1; id >= 0; --id)
    if (needed[id])
      for (const auto& in : graph.node(id).inputs) needed[in.node_id()] = true;
  uses_.resize(graph.num_nodes());
  for (int id = 0; id < graph.num_nodes(); ++id) {
    if (!needed[id]) continue;
    order_.push_back(id);
    uses_[id].assign(graph.node(id).outputs.size(), 0);
  }
  for (int id : order_)
    for (const auto& in : graph.node(id).inputs) ++uses_[in.node_id()][in.index()];
  for (const auto& t : fetches_) ++uses_[t.node_id()][t.index()];  // never released
}

namespace {

void bind_placeholder(const Node& node, const NDArray& value, Bindings& bindings) {
  const TensorMeta& meta = node.outputs[0];
  if (value.dtype() != meta.dtype)
    fail("[input] '", node.name, "' must be ", dtype_name(meta.dtype), ", got ",
         dtype_name(value.dtype()));
  if (value.ndim() != static_cast<int>(meta.shape.size()))
    fail("[input] '", node.name, "' must have shape ", sym_shape_str(meta.shape), ", got ",
         shape_str(value.shape()));
  for (int d = 0; d < value.ndim(); ++d) {
    const SymDim& dim = meta.shape[d];
    if (!dim.is_symbol()) continue;
    auto [it, inserted] = bindings.emplace(dim.symbol_name(), value.dim(d));
    if (!inserted && it->second != value.dim(d))
      fail("[input] '", node.name, "' dim ", d, " = ", value.dim(d), " but ",
           dim.symbol_name(), " = ", it->second);
  }
}

}  // namespace

std::vector<NDArray> Executor::run(const ValueMap& values) const {
  const int n = graph_.num_nodes();
  std::vector<std::vector<NDArray>> slots(n);
  std::vector<std::vector<int>> remaining = uses_;
  Bindings bindings;

  // Bind leaves first so every symbol is known before any shape is evaluated.
  for (int id : order_) {
    const Node& node = graph_.node(id);
    if (!is_leaf(node)) continue;
    auto it = values.find(node.name);
    if (it == values.end()) fail("[input] no value given for ", node.op->type(), " '", node.name, "'");
    if (is_placeholder(node)) bind_placeholder(node, it->second, bindings);
    slots[id] = {it->second};
  }
  for (int id : order_) {
    const Node& node = graph_.node(id);
    if (!slots[id].empty()) {
      const Shape want = eval_shape(node.outputs[0].shape, bindings);
      if (slots[id][0].shape() != want || slots[id][0].dtype() != node.outputs[0].dtype)
        fail("[input] ", node.op->type(), " '", node.name, "' must be ", shape_str(want), " ",
             dtype_name(node.outputs[0].dtype), ", got ", shape_str(slots[id][0].shape()), " ",
             dtype_name(slots[id][0].dtype()));
      continue;
    }
    OpContext ctx;
    ctx.device = device_;
    ctx.bindings = &bindings;
    for (const auto& meta : node.outputs) {
      ctx.out_shapes.push_back(eval_shape(meta.shape, bindings));
      ctx.out_dtypes.push_back(meta.dtype);
    }
    std::vector<NDArray> inputs;
    inputs.reserve(node.inputs.size());
    for (const auto& in : node.inputs) inputs.push_back(slots[in.node_id()][in.index()]);
    std::vector<NDArray> outputs(node.outputs.size());
    node.op->compute(ctx, inputs, outputs);
    for (size_t i = 0; i < outputs.size(); ++i)
      HSPMD_CHECK(outputs[i].valid() && outputs[i].shape() == ctx.out_shapes[i], "op ",
                  node.op->type(), " output ", i, " has shape ",
                  outputs[i].valid() ? shape_str(outputs[i].shape()) : "none", ", expected ",
                  shape_str(ctx.out_shapes[i]));
    inputs.clear();
    slots[id] = std::move(outputs);
    for (const auto& in : node.inputs)
      if (--remaining[in.node_id()][in.index()] == 0) slots[in.node_id()][in.index()] = NDArray();
  }

  std::vector<NDArray> result;
  for (const auto& t : fetches_) result.push_back(slots[t.node_id()][t.index()]);
  return result;
}

}  // namespace hspmd

#include "hspmd/graph/executor.h"

#include <algorithm>

#include "hspmd/core/error.h"

namespace hspmd {

UseCounts count_consumers(const Graph& graph, std::span<const int> runs,
                          std::initializer_list<std::span<const int>> consumers) {
  UseCounts uses(graph.num_nodes());
  for (int id : runs) uses[id].assign(graph.node(id).outputs.size(), 0);
  for (std::span<const int> ids : consumers)
    for (int id : ids)
      for (const Tensor& in : graph.node(id).inputs)
        if (!uses[in.node_id()].empty()) ++uses[in.node_id()][in.index()];
  return uses;
}

void keep_value(UseCounts& uses, const Tensor& t) {
  if (!uses[t.node_id()].empty()) ++uses[t.node_id()][t.index()];
}

void run_nodes(const Graph& graph, std::span<const int> ids, NodeValues& values,
               const NodeRunner& runner) {
  auto& slots = values.slots;
  for (int id : ids) {
    const Node& n = graph.node(id);
    if (is_leaf(n)) {
      slots[id] = runner.leaf(n);
      continue;
    }
    std::vector<NDArray> inputs;
    inputs.reserve(n.inputs.size());
    for (const Tensor& in : n.inputs) {
      const auto& s = slots[in.node_id()];
      inputs.push_back(s.empty() ? NDArray() : s[in.index()]);
    }
    std::vector<NDArray> outputs = runner.compute(n, inputs);
    inputs.clear();
    slots[id] = std::move(outputs);
    for (size_t i = 0; i < slots[id].size(); ++i)  // outputs nothing reads
      if (values.remaining[id][i] == 0) slots[id][i] = NDArray();
    if (runner.after) runner.after(n);
    for (const Tensor& in : n.inputs) {
      auto& left = values.remaining[in.node_id()];
      if (!left.empty() && --left[in.index()] == 0 && !slots[in.node_id()].empty())
        slots[in.node_id()][in.index()] = NDArray();
    }
  }
}

std::vector<NDArray> run_op(const Node& node, const OpContext& ctx,
                            const std::vector<NDArray>& inputs) {
  std::vector<NDArray> outputs(node.outputs.size());
  node.op->compute(ctx, inputs, outputs);
  for (size_t i = 0; i < outputs.size(); ++i) {
    // An output this rank does not hold (an op spanning devices) stays invalid.
    const bool absent = ctx.shard && i < ctx.shard->output_held.size() && !ctx.shard->output_held[i];
    if (absent && !outputs[i].valid()) continue;
    HSPMD_CHECK(outputs[i].valid() && outputs[i].shape() == ctx.out_shapes[i], "op ",
                node.op->type(), " output ", i, " has shape ",
                outputs[i].valid() ? shape_str(outputs[i].shape()) : "none", ", expected ",
                shape_str(ctx.out_shapes[i]));
  }
  return outputs;
}

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
  for (int id = 0; id < graph.num_nodes(); ++id)
    if (needed[id]) order_.push_back(id);
  uses_ = count_consumers(graph, order_, {order_});
  for (const auto& t : fetches_) keep_value(uses_, t);  // never released
  // An output no scheduled node reads stays until the run ends (run_nodes
  // would release it at once).
  for (int id : order_)
    for (int& n : uses_[id]) n = std::max(n, 1);
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

// Every leaf of `order` must be fed; placeholders bind their symbols. Runs
// before any node, so that every symbol is known before a shape is evaluated.
Bindings bind_leaves(const Graph& graph, const std::vector<int>& order, const ValueMap& values) {
  Bindings bindings;
  for (int id : order) {
    const Node& node = graph.node(id);
    if (!is_leaf(node)) continue;
    auto it = values.find(node.name);
    if (it == values.end()) fail("[input] no value given for ", node.op->type(), " '", node.name, "'");
    if (is_placeholder(node)) bind_placeholder(node, it->second, bindings);
  }
  return bindings;
}

// A fed leaf value, checked against the shape the bindings give.
NDArray checked_leaf(const Node& node, const NDArray& value, const Bindings& bindings) {
  const Shape want = eval_shape(node.outputs[0].shape, bindings);
  if (value.shape() != want || value.dtype() != node.outputs[0].dtype)
    fail("[input] ", node.op->type(), " '", node.name, "' must be ", shape_str(want), " ",
         dtype_name(node.outputs[0].dtype), ", got ", shape_str(value.shape()), " ",
         dtype_name(value.dtype()));
  return value;
}

}  // namespace

std::vector<NDArray> Executor::run(const ValueMap& values) const {
  const Bindings bindings = bind_leaves(graph_, order_, values);
  Stream& stream = default_stream(device_);
  NodeRunner runner;
  runner.leaf = [&](const Node& node) {
    return std::vector<NDArray>{checked_leaf(node, values.at(node.name), bindings)};
  };
  runner.compute = [&](const Node& node, const std::vector<NDArray>& inputs) {
    OpContext ctx;
    ctx.device = device_;
    ctx.stream = &stream;
    ctx.bindings = &bindings;
    for (const auto& meta : node.outputs) {
      ctx.out_shapes.push_back(eval_shape(meta.shape, bindings));
      ctx.out_dtypes.push_back(meta.dtype);
    }
    return run_op(node, ctx, inputs);
  };
  NodeValues run{std::vector<std::vector<NDArray>>(graph_.num_nodes()), uses_};
  run_nodes(graph_, order_, run, runner);

  std::vector<NDArray> result;
  for (const auto& t : fetches_) result.push_back(run.slots[t.node_id()][t.index()]);
  return result;
}

}  // namespace hspmd

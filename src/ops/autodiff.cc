#include "hspmd/ops/autodiff.h"

#include <algorithm>
#include <map>
#include <utility>

#include "hspmd/core/error.h"
#include "hspmd/graph/op.h"
#include "hspmd/ops/ops.h"

namespace hspmd {

namespace {

// Nodes whose value depends on some tensor of `wrt` (forward reachability).
std::vector<bool> depends_on(const Graph& g, const std::vector<Tensor>& wrt, int last) {
  std::vector<bool> dep(last + 1, false);
  for (const auto& t : wrt)
    if (t.node_id() <= last) dep[t.node_id()] = true;
  for (int id = 0; id <= last; ++id)
    for (const auto& in : g.node(id).inputs)
      if (dep[in.node_id()]) dep[id] = true;
  return dep;
}

// Inside gradients(): the loss's node id, the last forward node (the
// backward's nodes come after it).
thread_local int t_forward_last = -1;

struct ForwardScope {
  int saved;
  explicit ForwardScope(int last) : saved(t_forward_last) { t_forward_last = last; }
  ~ForwardScope() { t_forward_last = saved; }
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;
};

}  // namespace

bool ops::gradient_rounded(const Tensor& t) {
  if (!t.valid()) return false;
  const Node& producer = t.node();
  // The producer's answer first: it is false for almost every tensor.
  if (!producer.op || producer.inputs.empty() || !producer.op->rounds_gradient(producer, t.index())) return false;
  const Graph& g = *t.graph();
  const int last = t_forward_last >= 0 ? std::min(t_forward_last, g.num_nodes() - 1) : g.num_nodes() - 1;
  // The forward's reads of t: its readers up to `last` (the graph keeps
  // them ascending; a scan of the graph here made autodiff quadratic).
  const std::vector<int>& readers = g.readers(t);
  return std::upper_bound(readers.begin(), readers.end(), last) - readers.begin() == 1;
}

Tensor ops::recompute_for_backward(const Tensor& t) {
  const Node& producer = t.node();
  if (!producer.op || producer.inputs.empty() || !producer.op->recompute_for_backward()) return t;
  // Copies: add() may move the node storage.
  const std::shared_ptr<const Op> op = producer.op;
  const std::vector<Tensor> inputs = producer.inputs;
  return t.graph()->add(op, inputs).at(t.index());
}

Tensor ops::recompute_for_backward(const Tensor& t, const Tensor& grad) {
  const Node& producer = t.node();
  if (!grad.valid() || !producer.op || producer.inputs.empty() || !producer.op->recompute_for_backward())
    return recompute_for_backward(t);
  if (t.graph()->readers(t).size() != 1) return recompute_for_backward(t);  // grad is only part of t's gradient
  const std::shared_ptr<const Op> op = producer.op;  // kept: adding nodes may move `producer`
  const Tensor fused = op->recompute_with_gradient(producer, grad);
  return fused.valid() ? fused : recompute_for_backward(t);
}

std::vector<Tensor> gradients(const Tensor& loss, const std::vector<Tensor>& wrt) {
  if (!loss.valid()) fail("[autodiff] the loss tensor is undefined");
  if (!loss.shape().empty())
    fail("[autodiff] the loss must be a scalar, got shape ", sym_shape_str(loss.shape()));
  Graph& g = *loss.graph();
  const int last = loss.node_id();
  const ForwardScope forward(last);
  const std::vector<bool> on_path = depends_on(g, wrt, last);

  std::map<std::pair<int, int>, Tensor> grads;
  auto accumulate = [&](const Tensor& t, const Tensor& grad) {
    auto key = std::make_pair(t.node_id(), t.index());
    auto it = grads.find(key);
    if (it == grads.end())
      grads.emplace(key, grad);
    else
      it->second = ops::add(it->second, grad);
  };
  // The seed lives on the loss's devices (a dup 1 where the loss is partial).
  accumulate(loss, ops::fill_like(loss, 1.0f));

  for (int id = last; id >= 0; --id) {
    if (!on_path[id]) continue;
    const Node& node = g.node(id);
    if (node.inputs.empty()) continue;
    std::vector<Tensor> grad_out(node.outputs.size());
    bool any = false;
    for (size_t i = 0; i < grad_out.size(); ++i) {
      auto it = grads.find({id, static_cast<int>(i)});
      if (it != grads.end()) grad_out[i] = it->second, any = true;
    }
    if (!any) continue;
    // Copy what we need: gradient() appends nodes and may reallocate storage.
    std::vector<Tensor> inputs = node.inputs;
    // The gradients the inputs have so far, offered to the op to fold into
    // its own terms (once per distinct input tensor).
    std::vector<Tensor> addends(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!on_path[inputs[i].node_id()]) continue;
      bool repeated = false;
      for (size_t j = 0; j < i; ++j) repeated = repeated || inputs[j] == inputs[i];
      auto it = grads.find({inputs[i].node_id(), inputs[i].index()});
      if (!repeated && it != grads.end()) addends[i] = it->second;
    }
    const std::vector<Tensor> offered = addends;
    std::vector<Tensor> grad_in = node.op->gradient_into(g.node(id), grad_out, addends);
    HSPMD_CHECK(grad_in.size() == inputs.size(), "op ", g.node(id).op->type(), " returned ",
                grad_in.size(), " gradients for ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!grad_in[i].valid() || !on_path[inputs[i].node_id()]) continue;
      if (offered[i].valid() && !addends[i].valid())  // folded: the sum so far
        grads[{inputs[i].node_id(), inputs[i].index()}] = grad_in[i];
      else
        accumulate(inputs[i], grad_in[i]);
    }
  }

  std::vector<Tensor> result;
  for (const auto& t : wrt) {
    auto it = grads.find({t.node_id(), t.index()});
    result.push_back(it == grads.end() ? Tensor() : it->second);
  }
  return result;
}

}  // namespace hspmd

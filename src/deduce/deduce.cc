// The deduction engine: walks the graph in order, leaves from the plan, every
// other node through its op's rule (the default elementwise rule, Op::deduce,
// is the graph layer's: src/graph/graph.cc); plus the helpers the rules share.
#include "hspmd/deduce/deduce.h"

#include <algorithm>
#include <numeric>

#include "hspmd/graph/op.h"

namespace hspmd {

namespace {

std::string weights_str(const std::vector<int64_t>& w) {
  std::string s = "[";
  for (size_t i = 0; i < w.size(); ++i) s += (i ? ", " : "") + std::to_string(w[i]);
  return s + "]";
}

// "" when every split of `a` divides the dims of `shape` whose size is known,
// else the first problem found.
std::string size_problem(const Annotation& a, const SymShape& shape) {
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    if (!shape[d].is_const()) continue;
    const int64_t size = shape[d].value();
    std::vector<int64_t> parts(a.hsize(), size);
    if (d == a.hdim && a.hsize() > 1) {
      std::vector<int64_t> w = a.part_weights;
      if (w.empty()) w.assign(a.hsize(), 1);
      const int64_t total = std::accumulate(w.begin(), w.end(), int64_t{0});
      for (int i = 0; i < a.hsize(); ++i) {
        if (size * w[i] % total != 0)
          return detail::concat("dim ", d, " of size ", size, " does not split across the ",
                                a.hsize(), " subgroups in the proportions ", weights_str(w));
        parts[i] = size * w[i] / total;
      }
    }
    for (int i = 0; i < a.hsize(); ++i) {
      const int n = a.subgroups[i].states.degree(split_key(d));
      if (n > 1 && parts[i] % n != 0)
        return detail::concat("subgroup ", i, " splits dim ", d, " (size ", parts[i], ") by ", n,
                              ", which does not divide it");
    }
  }
  return "";
}

// Leaves and the checks the engine does around each op's rule.
std::vector<Annotation> deduce_node(const DeduceContext& ctx) {
  const Node& node = ctx.node;
  if (is_leaf(node))
    return {annotation_from_plan(ctx, node.name, static_cast<int>(node.outputs[0].shape.size()),
                                 is_parameter(node))};
  std::vector<Annotation> inputs;
  for (const Tensor& t : node.inputs) inputs.push_back(ctx.graph.of(t));
  // A Reshard is exempt without being named here: it has exactly one input
  // (its shape rule rejects any other count), so it never enters this loop.
  for (size_t i = 1; i < inputs.size() && !node.op->spans_devices(); ++i)
    if (!same_devices(inputs[0], inputs[i]))
      fail_at(ctx, "inputs 0 and ", i, " live on different subgroups (", to_string(inputs[0]),
              ") vs (", to_string(inputs[i]), "); insert a Reshard");
  return node.op->deduce(ctx, inputs);
}

// A deduced annotation must be structurally valid (a bug otherwise) and fit
// the sizes known at deduction (a plan mistake otherwise).
void check_output(const DeduceContext& ctx, int index, const Annotation& a) {
  const SymShape& shape = ctx.node.outputs[index].shape;
  try {
    validate(a, "node " + std::to_string(ctx.node.id), static_cast<int>(shape.size()),
             ctx.world_size, false);
  } catch (const Error& e) {
    HSPMD_CHECK(false, ctx.where(), " deduced an invalid annotation: ", e.what());
  }
  const std::string problem = size_problem(a, shape);
  if (problem.empty()) return;
  if (is_leaf(ctx.node))
    fail("[deduce] tensor '", ctx.node.name, "' ", sym_shape_str(shape), ": ", problem);
  fail_at(ctx, "output ", index, " ", sym_shape_str(shape), ": ", problem);
}

}  // namespace

const Annotation& AnnotatedGraph::of(const Tensor& t) const {
  HSPMD_CHECK(has(t), "tensor ", t.node_id(), ":", t.index(), " has no deduced annotation");
  return by_node_[t.node_id()][t.index()];
}

bool AnnotatedGraph::has(const Tensor& t) const {
  if (!t.valid() || t.node_id() < 0 || t.node_id() >= static_cast<int>(by_node_.size()))
    return false;
  const auto& outs = by_node_[t.node_id()];
  return t.index() >= 0 && t.index() < static_cast<int>(outs.size()) &&
         !outs[t.index()].subgroups.empty();
}

void AnnotatedGraph::set(const Tensor& t, Annotation annotation) {
  HSPMD_CHECK(t.valid() && t.node_id() >= 0 && t.index() >= 0);
  if (t.node_id() >= static_cast<int>(by_node_.size())) by_node_.resize(t.node_id() + 1);
  auto& outs = by_node_[t.node_id()];
  if (t.index() >= static_cast<int>(outs.size())) outs.resize(t.index() + 1);
  outs[t.index()] = std::move(annotation);
}

AnnotatedGraph deduce(const Graph& graph, const std::map<std::string, Annotation>& plan,
                      int world_size) {
  AnnotatedGraph result(graph);
  for (int id = 0; id < graph.num_nodes(); ++id) {
    const Node& node = graph.node(id);
    const DeduceContext ctx{node, plan, result, world_size};
    std::vector<Annotation> outs = deduce_node(ctx);
    HSPMD_CHECK(outs.size() == node.outputs.size(), ctx.where(), " deduced ", outs.size(),
                " annotations for ", node.outputs.size(), " outputs");
    for (int i = 0; i < static_cast<int>(outs.size()); ++i) {
      check_output(ctx, i, outs[i]);
      result.set(node.output(i), std::move(outs[i]));
    }
  }
  return result;
}

Annotation annotation_from_plan(const DeduceContext& ctx, const std::string& name, int tensor_rank,
                                bool is_parameter) {
  auto it = ctx.plan.find(name);
  if (name.empty() || it == ctx.plan.end())
    fail("[deduce] tensor '", name, "' has no annotation in the plan");
  validate(it->second, name, tensor_rank, ctx.world_size, is_parameter);
  return it->second;
}

Annotation without_partial(const DeduceContext& ctx, const Annotation& a) {
  Annotation out = a;
  if (out.hdim == kPartial) out.hdim = kDup;
  for (int i = 0; i < out.hsize(); ++i) {
    DistStates& s = out.subgroups[i].states;
    const int p = s.degree(kPartial);
    s.degrees.erase(kPartial);
    if (p <= 1) continue;
    auto ip = std::find(s.order.begin(), s.order.end(), kPartial);
    auto id = std::find(s.order.begin(), s.order.end(), kDup);
    if (id == s.order.end()) {
      *ip = kDup;
    } else if (std::abs(ip - id) == 1) {
      // Two adjacent digits of the mixed radix read as one.
      s.order.erase(ip);
    } else {
      fail_at(ctx, "cannot turn partial into dup in subgroup ", i, " of (", to_string(a),
              "): partial and dup are not adjacent in its order");
    }
    s.degrees[kDup] = s.degree(kDup) * p;
  }
  return out;
}

std::vector<std::string> numbered_labels(const std::string& prefix, int n) {
  std::vector<std::string> labels;
  for (int i = 0; i < n; ++i) labels.push_back(prefix + std::to_string(i));
  return labels;
}

ShardContext shard_context(const AnnotatedGraph& annotated, const Node& node,
                           const Bindings& bindings, int rank) {
  auto box_of = [&](const Tensor& t, const Shape& global) {
    auto box = local_box(annotated.of(t), global, rank);
    HSPMD_CHECK(box.has_value(), "rank ", rank, " does not hold a tensor of node ", node.id);
    return *box;
  };
  ShardContext shard;
  // An op spanning devices gets an empty box where this rank holds none.
  const bool spans = node.op->spans_devices();
  auto held_box = [&](const Tensor& t, const Shape& global, std::vector<char>& held) {
    if (!spans) return box_of(t, global);
    held.push_back(annotated.of(t).contains(rank) ? 1 : 0);
    if (held.back()) return box_of(t, global);
    return Box{Shape(global.size(), 0), Shape(global.size(), 0)};
  };
  for (const Tensor& in : node.inputs) {
    shard.input_global_shapes.push_back(eval_shape(in.shape(), bindings));
    shard.input_boxes.push_back(held_box(in, shard.input_global_shapes.back(), shard.input_held));
    if (spans) shard.input_annotations.push_back(annotated.of(in));
  }
  for (int i = 0; i < static_cast<int>(node.outputs.size()); ++i) {
    shard.output_global_shapes.push_back(eval_shape(node.outputs[i].shape, bindings));
    shard.output_boxes.push_back(held_box(node.output(i), shard.output_global_shapes.back(), shard.output_held));
  }
  if (spans) shard.rank = rank;
  const AnnotatedGraph* ag = &annotated;
  std::vector<Tensor> inputs = node.inputs;
  shard.ranks_along = [ag, inputs, rank](int input, int dim) {
    return ranks_along(ag->of(inputs.at(input)), rank, dim);
  };
  return shard;
}

}  // namespace hspmd

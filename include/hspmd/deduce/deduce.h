// Annotation deduction (paper §6.1, docs/deduction.md): from the
// annotations of the leaf tensors (placeholders, parameters) and of the named
// Reshard outputs, derive the annotation of every tensor of a graph, forward
// and backward. Each op owns its rule (Op::deduce, next to its shape rule;
// its context, DeduceContext and fail_at, is declared with the Op interface
// in hspmd/graph/op.h); this file holds the engine and the helpers the rules
// share (the annotation predicates same_devices, same_layout and has_partial
// are value functions of hspmd/annotation/annotation.h).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/error.h"
#include "hspmd/graph/graph.h"
#include "hspmd/graph/op.h"

namespace hspmd {

// The result of deduce(): one annotation per output of every node.
class AnnotatedGraph {
 public:
  explicit AnnotatedGraph(const Graph& graph) : graph_(&graph) {}
  const Graph& graph() const { return *graph_; }
  // Throws InternalError when `t` has not been deduced.
  const Annotation& of(const Tensor& t) const;
  bool has(const Tensor& t) const;
  void set(const Tensor& t, Annotation annotation);

 private:
  const Graph* graph_;
  std::vector<std::vector<Annotation>> by_node_;
};

// Deduces every node of `graph` in order. Placeholders and parameters take
// their annotation from `plan` by name (validated against the tensor's rank
// and `world_size`; a parameter's with is_parameter = true). Reshards: see
// ops::reshard (named: from the plan; made by a Reshard's gradient: the
// mirror of the forward one; unnamed: the identity). Every other node: its
// op's rule (Op::deduce). Every result is checked against the dims whose size
// is known (a bottom-tier split, or a top-tier part, that does not divide it
// is an error). Throws hspmd::Error:
//  "[deduce] tensor '<name>' has no annotation in the plan" for a leaf or a
//  named Reshard the plan misses, the annotation's validate() errors
//  ("[annotation] tensor '<name>': ..."), "[deduce] op 'add' (node 40):
//  inputs 0 and 1 live on different subgroups (...) vs (...); insert a
//  Reshard" when a non-Reshard op's inputs differ in devices or hsize, and
//  the rules' errors ("[deduce] <where>: ...").
AnnotatedGraph deduce(const Graph& graph, const std::map<std::string, Annotation>& plan,
                      int world_size);

// Where `rank`'s local arrays of `node` sit in the global tensors under the
// symbol bindings: global shapes and boxes of every input and output, and
// ranks_along (group_along is left to an executor). Throws InternalError
// when the rank does not hold one of them.
struct ShardContext;
ShardContext shard_context(const AnnotatedGraph& annotated, const Node& node,
                           const Bindings& bindings, int rank);

// ---- helpers shared by the rules ----

// plan[name], validated against `tensor_rank` and ctx.world_size. Throws
// "[deduce] tensor '<name>' has no annotation in the plan" and validate()'s
// errors.
Annotation annotation_from_plan(const DeduceContext& ctx, const std::string& name,
                                int tensor_rank, bool is_parameter);

// The annotation of a value that every holder of `a` has in full where `a`
// holds a partial sum: bottom-tier partial becomes dup (merged with an
// existing dup key, which must then be adjacent to it in the order) and hdim
// -2 becomes -1. Used by fill_like and by mirror Reshards. Throws
// fail_at(ctx, ...) when partial and dup are not adjacent in some order.
Annotation without_partial(const DeduceContext& ctx, const Annotation& a);

// How an output that lacks a dim label treats a split of it (see DimRule).
enum class Reduction {
  kForbidden,   // error: the op needs the whole dim
  kSum,         // the op sums over the dim: the output becomes partial
  kCollective,  // the kernel reduces over the dim itself with a collective
                // across the devices that split it: the output is dup there
                // (inside a subgroup only: an error across subgroups)
};

// An op's sharding rule in einsum form: every dim of every input and output
// gets a label; a label shared by several inputs must be split the same way
// in all of them (same degree, and the same chunk on every device), and an
// output dim with a label is split like that label. A label that an output
// lacks is reduced as `reductions` says (absent: kForbidden). The rule is
// applied per subgroup to the local-form DistStates (plain SPMD), and once
// more to the top tier, where hdim acts as one key of degree hsize over the
// subgroups (the same reasoning with the subgroups as devices; part weights
// of a label shared by several inputs must agree and follow it to outputs).
struct DimRule {
  // Label of each dim of each input; "" marks a dim whose sharding the op
  // ignores (no constraint, never in an output).
  std::vector<std::vector<std::string>> inputs = {};
  // Names of the inputs for messages ("x", "weight"); may be empty.
  std::vector<std::string> input_names = {};
  // Label of each dim of each output. A label no input has (a new dim) is
  // whole on every device.
  std::vector<std::vector<std::string>> outputs = {};
  // Per input: the op is linear in it, so it may be partial (the output then
  // is partial too). At most one input may be partial. Missing: false.
  std::vector<bool> linear = {};
  std::map<std::string, Reduction> reductions = {};
  // Labels that may not be split at all, with the reason ("rms_norm reduces
  // over it"), checked on both tiers.
  std::map<std::string, std::string> unsplittable = {};
  // Per input: the input only guides the layout (a tensor the kernel does not
  // read, e.g. the forward input whose splits a gradient's new dims copy):
  // its splits constrain and name chunks like any input's, its partial is
  // ignored. Missing: false.
  std::vector<bool> layout_only = {};
};

// Applies `rule` to `inputs` (which share devices and hsize): one annotation
// per rule output, on the inputs' devices. Each device's output chunk is
// computable from its local input chunks; the output's `order` is found by
// checking every device position (the first of: each input's order mapped
// to the output's keys, then every permutation). Throws fail_at(ctx, ...):
// "input I is partial; insert a Reshard to reduce it first" (non-linear
// input), "inputs I and J are both partial ...", "input I (<name>) is split
// along dim d ...: <unsplittable reason>", "inputs I and J split ... by
// different degrees", "inputs I and J order their devices differently ...",
// "input I is split along dim d, which output O does not keep ..." and
// "the inputs' shardings do not combine into one layout of output O".
std::vector<Annotation> deduce_by_dims(const DeduceContext& ctx, const DimRule& rule,
                                       const std::vector<Annotation>& inputs);

// Labels "<prefix>0", "<prefix>1", ... for n dims (e.g. the token dims of
// an input of any rank).
std::vector<std::string> numbered_labels(const std::string& prefix, int n);

}  // namespace hspmd

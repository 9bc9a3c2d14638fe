// Annotation deduction (paper §6.1, DESIGN §4): from the annotations of the
// leaf tensors (placeholders, parameters) and of the named Reshard outputs,
// derive the annotation of every tensor of a graph, forward and backward.
// Each op owns its rule (Op::deduce, next to its shape rule); this file holds
// the engine and the helpers the rules share.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "hspmd/annotation/annotation.h"
#include "hspmd/graph/graph.h"

namespace hspmd {

class AnnotatedGraph;

// What an op's deduction rule sees besides its input annotations.
struct DeduceContext {
  const Node& node;
  // Annotations from the plan (leaves and named Reshards), by tensor name.
  const std::map<std::string, Annotation>& plan;
  // Annotations of every tensor deduced so far (all nodes before `node`).
  const AnnotatedGraph& graph;

  // "op 'matmul' (node 12)" or "op 'reshard' 'model.layers.3.input'": the
  // prefix of the rule's error messages.
  std::string where() const;
};

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
// their annotation from `plan` by name (a parameter's is validated with
// is_parameter = true). Throws hspmd::Error:
//  "[deduce] tensor '<name>' has no annotation in the plan" for a leaf or a
//  named Reshard the plan misses, the annotation's validate() errors, and the
//  rules' errors, e.g. "[deduce] op 'add' (node 40): inputs 0 and 1 live on
//  different subgroups (...) vs (...); insert a Reshard".
AnnotatedGraph deduce(const Graph& graph, const std::map<std::string, Annotation>& plan,
                      int world_size);

}  // namespace hspmd

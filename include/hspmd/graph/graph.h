// The defined graph: one device-agnostic program of ops over tensors.
//
// A Graph owns Nodes; each Node applies one Op to input Tensors and produces
// output Tensors with symbolic shapes. Tensor is a light handle (graph, node,
// output index). Graphs are append-only and not copyable; Tensors stay valid
// as long as their Graph lives.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "hspmd/core/ndarray.h"
#include "hspmd/graph/sym.h"

namespace hspmd {

class Graph;
class Op;
struct Node;

struct TensorMeta {
  SymShape shape;
  DType dtype = DType::F32;
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(Graph* graph, int node, int index) : graph_(graph), node_(node), index_(index) {}

  bool valid() const { return graph_ != nullptr; }
  Graph* graph() const { return graph_; }
  int node_id() const { return node_; }
  int index() const { return index_; }
  const Node& node() const;
  const TensorMeta& meta() const;
  const SymShape& shape() const { return meta().shape; }
  DType dtype() const { return meta().dtype; }
  int ndim() const { return static_cast<int>(shape().size()); }
  bool operator==(const Tensor& o) const = default;

 private:
  Graph* graph_ = nullptr;
  int node_ = -1;
  int index_ = 0;
};

struct Node {
  Graph* graph = nullptr;
  int id = -1;
  std::shared_ptr<const Op> op;
  std::vector<Tensor> inputs;
  std::vector<TensorMeta> outputs;
  std::string name;  // unique for placeholders and parameters
  // What the user wrote that made this node, for error messages (a custom
  // program's op, "hspmd_custom program: block op 8 (add -> out) of layer
  // 0"); empty for the built-in models.
  std::string origin;
  Tensor output(int i = 0) const;
};

class Graph {
 public:
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Adds a node: runs the op's shape rule on the inputs' metas. Throws
  // hspmd::Error (from the shape rule) when the inputs do not fit the op.
  std::vector<Tensor> add(std::shared_ptr<const Op> op, const std::vector<Tensor>& inputs,
                          const std::string& name = "");
  // add() for single-output ops.
  Tensor add1(std::shared_ptr<const Op> op, const std::vector<Tensor>& inputs,
              const std::string& name = "");

  // A value fed at run time, e.g. token ids with shape {B, S}.
  Tensor placeholder(const std::string& name, const SymShape& shape, DType dtype);
  // A trainable tensor with a fixed shape, bound by name at run time.
  Tensor parameter(const std::string& name, const Shape& shape, DType dtype = DType::F32);

  const Node& node(int id) const { return nodes_.at(id); }
  // Sets `origin` on the nodes from `first_node` on that have none.
  void set_origin(int first_node, const std::string& origin);
  int num_nodes() const { return static_cast<int>(nodes_.size()); }
  // Parameter tensors in creation order.
  const std::vector<Tensor>& parameters() const { return parameters_; }
  const std::vector<Tensor>& placeholders() const { return placeholders_; }
  // The placeholder or parameter with this name (a parameter first); throws
  // hspmd::Error if none. A hash lookup: building a model looks up every
  // parameter by name, and a scan per lookup made that quadratic in the
  // layer count.
  Tensor find(const std::string& name) const;
  // The ids of the nodes that read `t`, ascending, one entry per input slot
  // (a node that reads it twice appears twice). Kept as nodes are added, so
  // that "how many readers" costs no scan of the graph.
  const std::vector<int>& readers(const Tensor& t) const;

 private:
  std::vector<Node> nodes_;
  std::vector<Tensor> parameters_;
  std::vector<Tensor> placeholders_;
  std::unordered_map<std::string, Tensor> parameter_names_, placeholder_names_;
  std::vector<std::vector<std::vector<int>>> readers_;  // [node][output] -> reader ids
};

// What a node is, by the op it applies (not by its type() string, which is
// for reports): a placeholder or a parameter made by Graph::placeholder() or
// Graph::parameter(); a leaf is either. Ops of other kinds declare their own
// predicates next to their builders (e.g. ops::is_reshard).
bool is_placeholder(const Node& node);
bool is_parameter(const Node& node);
bool is_leaf(const Node& node);

}  // namespace hspmd

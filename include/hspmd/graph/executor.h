// Runs a graph on one device: binds symbolic dims from the fed arrays,
// executes the nodes needed for the fetches in order, and frees every
// intermediate array after its last use.
//
// The loop underneath, run_nodes (run node ids in order over per-node slots,
// releasing each value after its last counted read), is the one both
// executors share: Executor supplies the op kernels on concrete shapes from
// the bindings; the per-rank ExecGraph (hspmd/exec/exec_graph.h) supplies
// local op shapes and runs Reshards through its communicator.
#pragma once

#include <functional>
#include <initializer_list>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "hspmd/core/ndarray.h"
#include "hspmd/graph/graph.h"
#include "hspmd/graph/op.h"

namespace hspmd {

// Arrays of placeholders and parameters, by node name. Not owned by the
// executor beyond a run (NDArray storage is shared).
using ValueMap = std::map<std::string, NDArray>;

// Per node id, per output: how many reads of the value are (still) to come.
// Empty for a node that does not run: its outputs are neither counted nor
// released.
using UseCounts = std::vector<std::vector<int>>;

// Per output of each node of `runs`: how many inputs of the nodes of
// `consumers` read it (a node reading it twice counts twice); empty for the
// nodes outside `runs`.
UseCounts count_consumers(const Graph& graph, std::span<const int> runs,
                          std::initializer_list<std::span<const int>> consumers);
// One more use of `t` when its node runs: it outlives its consumers.
void keep_value(UseCounts& uses, const Tensor& t);

// The values of one run, by node id: the arrays of its outputs (empty: not
// produced in this run; an invalid array: released) and the reads of each
// still to come, which run_nodes counts down.
struct NodeValues {
  std::vector<std::vector<NDArray>> slots;
  UseCounts remaining;
};

// What a node of run_nodes computes, supplied by the executor.
struct NodeRunner {
  // A leaf's outputs (placeholder or parameter).
  std::function<std::vector<NDArray>(const Node&)> leaf;
  // Any other node's outputs from its inputs, in input order; an input whose
  // node has no slots in this run is an invalid array.
  std::function<std::vector<NDArray>(const Node&, const std::vector<NDArray>&)> compute;
  // Optional: after each computed node, once its outputs that nothing reads
  // are released and before its inputs are.
  std::function<void(const Node&)> after;
};

// Runs `ids` in order into `values`: a leaf's slots get runner.leaf (nothing
// of it is released, `after` is not called); another node's get
// runner.compute of its inputs, then each of its outputs with no read left is
// released, runner.after runs, and each input whose last read this was is
// released (an input from a node with no counts is left alone). Every node of
// `ids` must have counts in values.remaining. Exceptions of the callbacks
// propagate, leaving `values` partly run.
void run_nodes(const Graph& graph, std::span<const int> ids, NodeValues& values,
               const NodeRunner& runner);

// Runs the node's op under `ctx` and checks (HSPMD_CHECK) that it produced
// every output with the shape ctx.out_shapes gives.
std::vector<NDArray> run_op(const Node& node, const OpContext& ctx,
                            const std::vector<NDArray>& inputs);

class Executor {
 public:
  // Plans the execution of the nodes `fetches` depend on. The graph must
  // outlive the executor.
  Executor(const Graph& graph, std::vector<Tensor> fetches, Device device = Device::cpu());

  // Runs once. `values` must hold every placeholder and parameter that the
  // fetches depend on, with matching dtypes and shapes (placeholders' symbols
  // are bound from their arrays). Returns the fetched arrays in order.
  // Throws hspmd::Error on a missing or mismatched value.
  std::vector<NDArray> run(const ValueMap& values) const;

 private:
  const Graph& graph_;
  std::vector<Tensor> fetches_;
  Device device_;
  std::vector<int> order_;  // node ids in execution order
  // Per node output: number of consumers among scheduled nodes, +1 for a
  // fetch and for an output no scheduled node reads (both kept to the end).
  UseCounts uses_;
};

}  // namespace hspmd

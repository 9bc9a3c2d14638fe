// Runs a graph on one device: binds symbolic dims from the fed arrays,
// executes the nodes needed for the fetches in order, and frees every
// intermediate array after its last use.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "hspmd/core/ndarray.h"
#include "hspmd/graph/graph.h"

namespace hspmd {

// Arrays of placeholders and parameters, by node name. Not owned by the
// executor beyond a run (NDArray storage is shared).
using ValueMap = std::map<std::string, NDArray>;

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
  // Per node output slot: number of consumers among scheduled nodes.
  std::vector<std::vector<int>> uses_;
};

}  // namespace hspmd

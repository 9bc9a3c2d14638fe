// The work of one op on one rank, and the per-op time model of the model
// clock (`hspmd train --clock model`, docs/profiling.md): an op of type T on
// local arrays takes
//     t = overhead_s + s_per_flop * flops + s_per_element * elements
// seconds of this machine, with the fit Profile::ops[T] (planner/profile.h; OpFit: exec/op_fit.h)
// that `hspmd profile` measured over every op it ran.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "hspmd/graph/graph.h"
#include "hspmd/graph/op.h"
#include "hspmd/exec/op_fit.h"

namespace hspmd {

struct OpWork {
  double flops = 0;     // Op::flops: 2mnk for matmuls, attention's products, one per output element otherwise
  double elements = 0;  // elements of the inputs and outputs together (memory traffic)
  bool operator==(const OpWork&) const = default;
};

// What `node` does on local arrays of these shapes (`shard`: where they sit
// in the global tensors, nullptr on one device).
OpWork op_work(const Node& node, const std::vector<Shape>& inputs, const std::vector<Shape>& outputs,
               const ShardContext* shard = nullptr);
// The same on the call's arrays (Op::flops_on: value-dependent work, such
// as attention's document mask, counts what the inputs hold).
OpWork op_work(const Node& node, const std::vector<NDArray>& inputs, const std::vector<NDArray>& outputs,
               const ShardContext* shard = nullptr);

// Predicts op times from a profile's per-op fits. Immutable, shareable.
class OpTimeModel {
 public:
  // `fits`: op type -> fit; the kAnyOp entry serves types with no fit of
  // their own. Throws hspmd::Error "[profile] <source>: no per-op fits ..."
  // when `fits` is empty.
  OpTimeModel(std::map<std::string, OpFit> fits, const std::string& source);

  // Seconds of one op of `type` doing `work` (never negative). Throws
  // hspmd::Error "[profile] <source>: no fit for op type '<type>' ..." when
  // neither the type nor kAnyOp has one.
  double seconds(const std::string& type, const OpWork& work) const;

 private:
  std::map<std::string, OpFit> fits_;
  std::string source_;
};

}  // namespace hspmd

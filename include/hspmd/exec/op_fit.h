// The per-op-type time model of the model clock (`hspmd train --clock
// model`, docs/profiling.md): one fit per op type, as `hspmd profile`
// measures it into Profile::ops (planner/profile.h). Declared here, in the
// exec layer that uses it (OpTimeModel, exec/op_work.h), so that exec needs
// nothing from the planner above it.
#pragma once

namespace hspmd {

// Per-op-type model for `hspmd train --clock model`:
//   t = overhead_s + s_per_flop * flops + s_per_element * elements
// where flops and elements are those op_work() (exec layer) counts for one
// op run on its local shapes.
struct OpFit {
  double overhead_s = 0, s_per_flop = 0, s_per_element = 0;
  double max_rel_error = 0;
  int samples = 0;

  double at(double flops, double elements) const {
    return overhead_s + s_per_flop * flops + s_per_element * elements;
  }
};
// The key of Profile::ops whose fit (over every op measured) serves op types
// that have no fit of their own.
inline constexpr const char* kAnyOp = "*";

}  // namespace hspmd

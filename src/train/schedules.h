// Pipeline schedules (docs/execution.md "The step"): the order in which one
// rank runs the forwards and backwards of its pipeline's micro-batches. The
// training loop picks one by the plan's "schedule" and gives it the two
// calls; a schedule never sees graphs, data or communication.
#pragma once

#include <functional>
#include <string>

#include "hspmd/exec/exec_graph.h"

namespace hspmd {

// Runs micro-batch `micro`'s forward and returns what its backward needs.
using ForwardCall = std::function<ExecGraph::Activations(int micro)>;
// Runs micro-batch `micro`'s backward.
using BackwardCall = std::function<void(ExecGraph::Activations, int micro)>;

// Where the rank sits: its stage of `stages` in a pipeline of
// `micro_batches` micro-batches (0 on an idle rank: nothing runs).
struct SchedulePosition {
  int stage = 0;
  int stages = 1;
  int micro_batches = 0;
};

// GPipe: every forward, then every backward; activations of all
// micro-batches are kept.
void run_gpipe(const SchedulePosition& at, const ForwardCall& forward, const BackwardCall& backward);

// 1F1B: stage s of S runs S-s-1 warm-up forwards, then alternates one
// forward and one backward, then drains the backwards; at most S-s
// micro-batches of activations live at once.
void run_1f1b(const SchedulePosition& at, const ForwardCall& forward, const BackwardCall& backward);

// The schedule named `name` ("gpipe" or "1f1b"); hspmd::Error "[strategy]
// unknown schedule '<name>'" otherwise.
using Schedule = void (*)(const SchedulePosition&, const ForwardCall&, const BackwardCall&);
Schedule schedule_by_name(const std::string& name);

}  // namespace hspmd

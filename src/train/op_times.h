// `hspmd train --op-times FILE`: where one step's time goes, op type by op
// type (docs/profiling.md, "Op times of a training step").
#pragma once

#include <string>
#include <vector>

#include "hspmd/exec/exec_graph.h"

namespace hspmd {

// Waits for the timed ops' events and writes, as JSON, the step's ops summed
// by type (calls, seconds, share of the step), largest first, the step's
// wall time and what the ops leave of it (communication outside ops, the
// gradient synchronization, the optimizer, host work). Rank r of a world
// larger than one writes FILE.rank<r>. Throws hspmd::Error naming the file
// when it cannot be written.
void write_op_times(const std::string& path, int rank, int world_size, int64_t step, double step_time_s,
                    const std::string& device, const std::vector<ExecGraph::OpTiming>& timings);

}  // namespace hspmd

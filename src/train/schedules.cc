#include "train/schedules.h"

#include <algorithm>
#include <deque>
#include <vector>

#include "hspmd/core/error.h"

namespace hspmd {

void run_gpipe(const SchedulePosition& at, const ForwardCall& forward, const BackwardCall& backward) {
  std::vector<ExecGraph::Activations> kept;
  for (int micro = 0; micro < at.micro_batches; ++micro) kept.push_back(forward(micro));
  for (int micro = 0; micro < at.micro_batches; ++micro) backward(std::move(kept[micro]), micro);
}

void run_1f1b(const SchedulePosition& at, const ForwardCall& forward, const BackwardCall& backward) {
  const int warmup = std::min(at.stages - at.stage - 1, at.micro_batches);
  std::deque<ExecGraph::Activations> live;
  int next = 0, done = 0;
  for (; next < warmup; ++next) live.push_back(forward(next));
  for (; next < at.micro_batches; ++next) {
    live.push_back(forward(next));
    backward(std::move(live.front()), done++);
    live.pop_front();
  }
  for (; !live.empty(); live.pop_front()) backward(std::move(live.front()), done++);
}

Schedule schedule_by_name(const std::string& name) {
  if (name == "gpipe") return run_gpipe;
  if (name == "1f1b") return run_1f1b;
  fail("[strategy] unknown schedule '", name, "' (expected 1f1b or gpipe)");
}

}  // namespace hspmd

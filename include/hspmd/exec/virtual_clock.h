// The emulated cluster's per-rank virtual clock (docs/cluster.md "slowdown", docs/execution.md "Emulated cluster"): a
// rank's compute advances it by the CPU time it measured times the rank's
// slowdown; communication synchronizes it with the peers' clocks and adds
// the transfer time over the topology's links. Step times read from it are
// the step times of the EMULATED cluster, independent of how many ranks share
// this machine's cores.
//
// The compute time comes from a WorkTimer (core/device.h), the one timing
// interface: process CPU time by default (CPU ranks), events on a stream for
// device work (set_timer).
//
// In model mode (`hspmd train --clock model`, docs/profiling.md) no CPU time
// is ever read: compute advances the clock only through advance(), by a
// prediction from a measured profile, so the emulated times are
// deterministic and independent of the machine's load.
#pragma once

#include <string>
#include <vector>

#include "hspmd/core/device.h"

namespace hspmd {

// One span of a rank's timeline, in virtual seconds.
struct TraceEvent {
  std::string name;
  std::string category;  // "forward", "backward", "comm", "post"
  double begin = 0, end = 0;
};

// How compute advances a clock: by the measured process CPU time of its
// begin_compute / end_compute brackets (kCpu), or only by advance() (kModel).
enum class ClockMode { kCpu, kModel };

class VirtualClock {
 public:
  explicit VirtualClock(double slowdown = 1.0, ClockMode mode = ClockMode::kCpu)
      : slowdown_(slowdown), mode_(mode) {}

  ClockMode mode() const { return mode_; }
  double slowdown() const { return slowdown_; }
  // A device that changes speed (elastic training's slowdown events).
  void set_slowdown(double slowdown) { slowdown_ = slowdown; }
  bool modeled() const { return mode_ == ClockMode::kModel; }

  double now() const { return now_; }
  double compute_s() const { return compute_; }  // virtual seconds spent computing
  double comm_s() const { return comm_; }        // virtual seconds waiting or transferring

  // Brackets a computation: advances by its time on the timer (process CPU
  // time unless set_timer chose another) x slowdown. Model mode: both do
  // nothing (no time is read).
  void begin_compute() {
    if (mode_ == ClockMode::kCpu) timer_.begin();
  }
  void end_compute() {
    if (mode_ == ClockMode::kCpu) advance(timer_.end_s());
  }
  // How compute brackets are timed (WorkTimer::events(stream) for a device).
  void set_timer(WorkTimer timer) { timer_ = timer; }
  const WorkTimer& timer() const { return timer_; }
  // Bills `seconds` of compute on this machine: advances by seconds x
  // slowdown (model mode: a prediction for the work just done).
  void advance(double seconds) {
    const double dt = seconds * slowdown_;
    now_ += dt;
    compute_ += dt;
  }
  // A communication that could start only at `ready` (the peers' clocks) and
  // takes `transfer` seconds on the links.
  void communicate(double ready, double transfer) {
    const double end = (ready > now_ ? ready : now_) + transfer;
    comm_ += end - now_;
    now_ = end;
  }

  // Timeline spans (kept only when tracing is on).
  void set_tracing(bool on) { tracing_ = on; }
  void record(std::string name, std::string category, double begin) {
    if (tracing_) events_.push_back({std::move(name), std::move(category), begin, now_});
  }
  const std::vector<TraceEvent>& events() const { return events_; }

 private:
  double slowdown_;
  ClockMode mode_;
  double now_ = 0, compute_ = 0, comm_ = 0;
  WorkTimer timer_ = WorkTimer::process_cpu();
  bool tracing_ = false;
  std::vector<TraceEvent> events_;
};

}  // namespace hspmd

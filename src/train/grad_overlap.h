// The overlapped gradient synchronization (docs/comm.md "Overlap"): while
// the last micro-batch's backward goes on, a communication thread runs each
// bucket's gradient sync (ExecGraph::sync_bucket) as soon as its raw
// gradients are final, over a duplicate of the world (so its collectives and
// messages never interleave with the graph's) and on the device's
// communication stream (ordered after the gradient's work by an event).
// The thread takes the buckets of ExecGraph::grad_buckets, one total order
// on every rank, waiting for each in turn until all its gradients are
// ready: a gradient ready early waits for the buckets before it, which keeps
// the ranks' collectives in the same order without any agreement at run
// time.
#pragma once

#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/device.h"
#include "hspmd/exec/exec_graph.h"

namespace hspmd::dist {

class GradOverlap {
 public:
  // Starts the thread. `grad_world`: a duplicate of the graph's world, used
  // by this object's thread only while it lives.
  GradOverlap(const ExecGraph& graph, Communicator& grad_world);
  // Joins the thread when finish() was called; unwinding before, lets a
  // thread that is inside a collective go (the job is ending).
  ~GradOverlap();
  GradOverlap(const GradOverlap&) = delete;
  GradOverlap& operator=(const GradOverlap&) = delete;

  // `param`'s raw gradient is final (work queued on the graph's stream
  // included); the array must not change afterwards. Once per parameter.
  void ready(const std::string& param, const NDArray& raw);
  // Hands over every gradient not yet ready (from `raw`; a parameter absent
  // there syncs nothing of this rank's), waits for the thread, and returns
  // the synced gradients as ExecGraph::sync_gradients does. Rethrows the
  // thread's error.
  std::map<std::string, NDArray> finish(const std::map<std::string, NDArray>& raw);
  // The resolutions' predicted bytes of the syncs run (after finish()).
  int64_t predicted_bytes() const { return state_->predicted; }
  // Whether a thread was let go in this process (its world must then
  // outlive everything: the thread may still be inside a collective on it).
  static bool any_abandoned();
  // How many gradients ready() handed over so far.
  int64_t ready_count() const { return ready_count_; }

 private:
  struct Item {
    NDArray raw;
    Event event;  // the raw gradient's point in the graph's stream
    bool given = false;
  };
  // Shared with the thread, which may outlive this object when abandoned.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::map<std::string, Item> items;
    bool abandoned = false;
    std::map<std::string, NDArray> synced;
    int64_t predicted = 0;
    std::exception_ptr error;
  };
  static void run(std::shared_ptr<State> state, const ExecGraph* graph, Communicator* world,
                  std::vector<ExecGraph::GradBucket> buckets, int threads);

  const ExecGraph& graph_;
  std::shared_ptr<State> state_;
  std::thread thread_;
  bool finished_ = false;
  int64_t ready_count_ = 0;
};

}  // namespace hspmd::dist

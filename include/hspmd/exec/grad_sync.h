// Gradient synchronization (docs/comm.md, "Gradient sync"): every rank's
// accumulated raw gradients through their grad.<param> Reshards, in buckets,
// after the backward or overlapped with it. Everything about moving
// gradients lives here: how the buckets are formed, how one bucket syncs
// (its own resolution, one fused all-reduce, or one fused ZeRO
// reduce-scatter), the communication thread that overlaps them with the
// last backward, and the step's start/finish with its measurements.
//
// The graph (ExecGraph) owns the resolutions; this module only reads them
// (grad_resolution, grad_spec) and runs an unfused sync through the graph
// (run_grad_sync) so that the clock, deferred sends and the byte ledger
// see it as any other Reshard.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/device.h"
#include "hspmd/exec/exec_graph.h"

namespace hspmd {

// The gradient syncs a rank takes part in, in buckets, in the order every
// rank runs them: the reverse of the model's parameters (roughly the order
// the backward finishes them; one total order, so ranks that share several
// syncs cannot deadlock). Consecutive parameters whose sync is, on every
// member, one all-reduce of the member's whole gradient over the same group
// in the same dtype share a bucket of at most kGradBucketElements elements,
// synced as one flat all-reduce (Megatron-LM and DDP bucket the same way);
// so do consecutive ZeRO syncs that are, on every member, one reduce-scatter
// of the whole gradient into the same pieces' layout over one group (one
// reduce-scatter, each member's pieces of all the bucket's gradients
// together). Every member forms the same buckets, from the resolutions
// alone. Any other sync is a bucket of its own; so is every sync under an
// emulated clock (each parameter syncs alone there).
struct GradBucket {
  std::vector<std::string> params;
  std::vector<int> group;  // the fused collective's members; empty: one parameter, its own resolution
  bool scatter = false;    // a reduce-scatter (ZeRO), else an all-reduce
  DType dtype = DType::F32;
  int64_t elements = 0;    // of this rank's gradients, summed
};
inline constexpr int64_t kGradBucketElements = 40'000'000;

// The buckets of `graph`'s rank (a pure function of its resolutions; it
// resolves each fusable sync for every rank once, so a runtime forms them
// once per plan).
std::vector<GradBucket> grad_buckets(const ExecGraph& graph);

// One bucket's sync over `world` (a duplicate of the graph's world: same
// ranks) in `stream`'s order: the synced local gradients (f32, optimizer
// layout) of its parameters go into `synced`; `raw(param)` gives a raw
// gradient (an invalid array: none on this rank). Adds the predicted bytes
// to `*predicted`: the resolutions' for a single parameter, the resolver's
// ring rule over the bucket's elements for a fused one. Touches no state of
// the graph (no ledger, clock or deferred sends), so another thread may run
// it while one runs the graph.
void sync_bucket(const ExecGraph& graph, const GradBucket& bucket,
                 const std::function<NDArray(const std::string&)>& raw, Communicator& world, Stream& stream,
                 int64_t* predicted, std::map<std::string, NDArray>& synced);

// Every bucket after the backward, on the graph's stream and world: fused
// buckets as sync_bucket runs them (bytes to the graph's ledger), single
// syncs through the graph (ExecGraph::run_grad_sync). Returns the synced
// local gradients.
std::map<std::string, NDArray> sync_gradients(const ExecGraph& graph, const std::vector<GradBucket>& buckets,
                                              const std::map<std::string, NDArray>& raw, Communicator& world);

// The overlapped sync (docs/comm.md "Overlap"): while the last micro-batch's
// backward goes on, a communication thread runs each bucket's sync as soon
// as its raw gradients are final, over a duplicate of the world (its
// collectives and messages never interleave with the graph's) and on the
// device's communication stream (ordered after the gradient's work by an
// event). The thread takes the buckets in their one order, waiting for each
// in turn until all its gradients are ready: a gradient ready early waits
// for the buckets before it, which keeps the ranks' collectives in the same
// order without any agreement at run time.
class GradOverlap {
 public:
  // Starts the thread. `grad_world`: a duplicate of the graph's world, used
  // by this object's thread only while it lives.
  GradOverlap(const ExecGraph& graph, std::vector<GradBucket> buckets, Communicator& grad_world);
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
  // the synced gradients as sync_gradients does. Rethrows the thread's error.
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
                  std::vector<GradBucket> buckets, int threads);

  const ExecGraph& graph_;
  std::shared_ptr<State> state_;
  std::thread thread_;
  bool finished_ = false;
  int64_t ready_count_ = 0;
};

// A run's gradient sync, step by step (Megatron-core's start_grad_sync /
// finish_grad_sync shape, apart from the loop): it owns the duplicate world
// the overlap's thread talks over, and measures each step's sync.
class GradSync {
 public:
  // `overlap`: whether the steps overlap their sync with the last backward;
  // then, collectively, the world is duplicated for the thread. An MPI
  // without MPI_THREAD_MULTIPLE cannot: unless `overlap_asked` (the user
  // asked for it, so the run fails), rank 0 notes it and the steps sync
  // after the backward.
  GradSync(Communicator& world, bool overlap, bool overlap_asked);
  // A thread let go after an error may still be inside a collective on the
  // duplicate world: that world is then left alive (the job is ending).
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;
  bool overlapping() const { return grad_world_ != nullptr; }

  // One step's sync of `graph` (its buckets formed by grad_buckets).
  class Step {
   public:
    // The overlap the last backward hands its final gradients to; null when
    // the step syncs after the backward.
    GradOverlap* overlap() { return overlap_ ? &*overlap_ : nullptr; }
    // Waits for the graph's stream, then syncs what is left (or all), and
    // measures: seconds of the sync after the schedule, gradients handed
    // over early, bytes sent over the duplicate world (added to the graph's
    // ledger with their prediction).
    std::map<std::string, NDArray> finish(const std::map<std::string, NDArray>& raw);
    double seconds() const { return seconds_; }
    int64_t overlapped() const { return overlapped_; }
    int64_t duplicate_bytes_sent() const { return duplicate_sent_; }

   private:
    friend class GradSync;
    Step(const ExecGraph& graph, const std::vector<GradBucket>& buckets, Communicator& world,
         Communicator* grad_world);
    const ExecGraph& graph_;
    const std::vector<GradBucket>& buckets_;
    Communicator& world_;
    Communicator* grad_world_;
    std::optional<GradOverlap> overlap_;
    double seconds_ = 0;
    int64_t overlapped_ = 0, duplicate_sent_ = 0;
  };
  // Starts a step: with the overlap, its thread waits for gradients.
  Step start(const ExecGraph& graph, const std::vector<GradBucket>& buckets) {
    return Step(graph, buckets, world_, grad_world_.get());
  }

 private:
  Communicator& world_;
  std::unique_ptr<Communicator> grad_world_;  // overlapping: the world's duplicate
};

}  // namespace hspmd

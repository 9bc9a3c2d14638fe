#include "train/grad_overlap.h"

#include <algorithm>
#include <atomic>

#include "hspmd/core/error.h"
#include "hspmd/core/threads.h"

namespace hspmd::dist {

namespace {
std::atomic<bool> g_abandoned{false};
}

bool GradOverlap::any_abandoned() { return g_abandoned.load(); }

GradOverlap::GradOverlap(const ExecGraph& graph, Communicator& grad_world)
    : graph_(graph), state_(std::make_shared<State>()) {
  std::vector<ExecGraph::GradBucket> buckets = graph.grad_buckets();
  for (const ExecGraph::GradBucket& b : buckets) {
    for (const std::string& name : b.params) state_->items.emplace(name, Item{});
    // The fused buckets' groups made here, in bucket order on every member,
    // while no collective is in flight (cached: once per plan). The thread
    // would otherwise create them (an NCCL communicator's init) in the
    // middle of the backward, beside the graph's own NCCL kernels.
    if (!b.group.empty()) (void)grad_world.group(b.group);
  }
  thread_ = std::thread(run, state_, &graph, &grad_world, std::move(buckets), num_threads());
}

GradOverlap::~GradOverlap() {
  if (!thread_.joinable()) return;
  if (finished_) {
    thread_.join();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->abandoned = true;
  }
  state_->cv.notify_all();
  g_abandoned = true;
  thread_.detach();  // it may be inside a collective whose peers are gone
}

void GradOverlap::ready(const std::string& param, const NDArray& raw) {
  Event event;
  event.record(graph_.stream());
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->items.find(param);
    if (it == state_->items.end()) return;  // this rank takes no part in its sync
    HSPMD_CHECK(!it->second.given, "gradient of '", param, "' handed over twice");
    it->second = Item{raw, event, true};
  }
  ++ready_count_;
  state_->cv.notify_all();
}

std::map<std::string, NDArray> GradOverlap::finish(const std::map<std::string, NDArray>& raw) {
  Event event;
  event.record(graph_.stream());
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (auto& [name, item] : state_->items)
      if (!item.given) {
        auto it = raw.find(name);
        item = Item{it == raw.end() ? NDArray() : it->second, event, true};
      }
  }
  state_->cv.notify_all();
  finished_ = true;
  thread_.join();
  if (state_->error) std::rethrow_exception(state_->error);
  return std::move(state_->synced);
}

void GradOverlap::run(std::shared_ptr<State> state, const ExecGraph* graph, Communicator* world,
                      std::vector<ExecGraph::GradBucket> buckets, int threads) {
  try {
    set_num_threads(threads);  // a new thread starts with the runtime's default team size
    bind_thread(graph->device());
    Stream& stream = comm_stream(graph->device());
    // This thread's blocks never mix with the graph stream's while either
    // stream may still use them (the allocators do not track streams).
    SideStreamScope held;
    // Leaving early (an error, an abandoned step), the stream's queued
    // work may still use blocks `held` returns: drain it first (this
    // guard, declared after `held`, is destroyed before it).
    struct DrainFirst {
      Stream& stream;
      ~DrainFirst() {
        try {
          stream.synchronize();
        } catch (...) {  // the error that brought us here is the one reported
        }
      }
    } drain{stream};
    int64_t predicted = 0;
    for (const ExecGraph::GradBucket& bucket : buckets) {
      std::map<std::string, Item> items;
      {
        std::unique_lock<std::mutex> lock(state->mu);
        state->cv.wait(lock, [&] {
          return state->abandoned || std::all_of(bucket.params.begin(), bucket.params.end(),
                                                 [&](const std::string& p) { return state->items.at(p).given; });
        });
        if (state->abandoned) return;
        for (const std::string& p : bucket.params) items.emplace(p, std::move(state->items.at(p)));
      }
      for (const auto& [name, item] : items) stream_wait(stream, item.event);
      std::map<std::string, NDArray> out;
      graph->sync_bucket(
          bucket, [&](const std::string& p) { return items.at(p).raw; }, *world, stream, &predicted, out);
      items.clear();
      stream.synchronize();
      held.release();
      std::lock_guard<std::mutex> lock(state->mu);
      for (auto& [name, g] : out) state->synced.emplace(name, std::move(g));
    }
    std::lock_guard<std::mutex> lock(state->mu);
    state->predicted = predicted;
  } catch (...) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->error = std::current_exception();
  }
}

}  // namespace hspmd::dist

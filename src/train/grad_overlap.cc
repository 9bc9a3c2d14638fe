#include "train/grad_overlap.h"

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
  std::vector<std::string> order = graph.grad_sync_order();
  for (const std::string& name : order) state_->items.emplace(name, Item{});
  thread_ = std::thread(run, state_, &graph, &grad_world, std::move(order), num_threads());
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
                      std::vector<std::string> order, int threads) {
  try {
    set_num_threads(threads);  // a new thread starts with the runtime's default team size
    bind_thread(graph->device());
    Stream& stream = comm_stream(graph->device());
    // This thread's blocks never mix with the graph stream's while either
    // stream may still use them (the allocators do not track streams).
    SideStreamScope held;
    int64_t predicted = 0;
    for (const std::string& name : order) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(state->mu);
        state->cv.wait(lock, [&] { return state->abandoned || state->items.at(name).given; });
        if (state->abandoned) return;
        item = std::move(state->items.at(name));
      }
      stream_wait(stream, item.event);
      NDArray out = graph->sync_gradient(name, item.raw, *world, stream, &predicted);
      item.raw = NDArray();
      stream.synchronize();
      held.release();
      if (out.valid()) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->synced.emplace(name, std::move(out));
      }
    }
    std::lock_guard<std::mutex> lock(state->mu);
    state->predicted = predicted;
  } catch (...) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->error = std::current_exception();
  }
}

}  // namespace hspmd::dist

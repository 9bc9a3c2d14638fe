// One step's schedule of micro-batches on this rank (DistTrainer::
// accumulate_schedule): forwards and backwards in the strategy's pipeline
// order, raw gradients accumulated across micro-batches, the loss terms read
// once the schedule is queued, and, with the overlap, each gradient handed
// to the communication thread as the last backward finishes it.
#include "train/dist_trainer.h"

#include <unordered_map>

#include "kernels/kernels.h"
#include "kernels/memory.h"
#include "train/router_stats.h"
#include "train/schedules.h"

namespace hspmd {
namespace dist {

namespace {

// A step's raw gradients as the micro-batches' backwards make them. The
// first micro-batch's gradient is kept and later ones are added into it in
// place. After a backward, its raw gradients are the backward's own fresh
// arrays: kept as they are, unless one is the same array as a gradient
// already kept (the in-place sums would then add twice). During the
// overlapped last backward the graph still reads a gradient after handing
// it over (its Reshard), while the communication thread reduces the kept
// array: that one is copied (keep(..., copy = true)).
class RawGrads {
 public:
  RawGrads(Stream& stream, std::map<std::string, NDArray>& raw) : stream_(stream), raw_(raw) {
    for (const auto& [name, kept] : raw_) views_.emplace(kept.view_hash(), kept);
  }
  void keep(const std::string& name, const NDArray& g, bool copy) {
    auto it = raw_.find(name);
    if (it != raw_.end()) return kernels::accumulate(stream_, g, it->second);
    const auto [first, last] = views_.equal_range(g.view_hash());
    for (auto v = first; v != last && !copy; ++v) copy = v->second.same_view(g);
    const NDArray& held = raw_.emplace(name, copy || !g.is_contiguous() ? kernels::clone(stream_, g) : g).first->second;
    views_.emplace(held.view_hash(), held);
  }

 private:
  Stream& stream_;
  std::map<std::string, NDArray>& raw_;
  // The kept arrays by view_hash: whether one is `g` is a lookup, not a
  // scan of every kept gradient (that made the first step quadratic in the
  // number of parameters: 12,000 of a 4,000-layer model).
  std::unordered_multimap<size_t, NDArray> views_;
};

}  // namespace

std::map<int, NDArray> DistTrainer::take_weight_copies(const ExecGraph& graph) {
  std::map<int, NDArray> given;
  if (copies_.graph == &graph && copies_.step == current_step_)
    for (auto& [node, c] : copies_.by_node)
      if (const Shard& sh = state_->slot(c.param, StateSlot::kParam); sh.held() && sh.data.same_view(c.source))
        given.emplace(node, std::move(c.copy));
  copies_ = {};
  return given;
}

void DistTrainer::keep_step_casts(const ExecGraph& graph, const ExecGraph::StepScope& scope) {
  step_casts_.clear();
  if (!optimizer_writes_copies()) return;
  for (const ExecGraph::ParameterCast& c : graph.parameter_casts())
    if (NDArray v = scope.value(c.node); c.dtype == DType::BF16 && v.valid())
      step_casts_.emplace(c.param, std::pair{c.node, v});
}

void DistTrainer::accumulate_schedule(std::map<std::string, NDArray>& raw, double& loss, float normalizer,
                                      GradOverlap* overlap, std::vector<NDArray>* loss_terms) {
  ExecGraph& graph = *rt_->graph;
  RawGrads grads(graph.stream(), raw);
  auto keep = [&](const std::string& name, const NDArray& g, bool copy) { grads.keep(name, g, copy); };
  auto add = [&](const std::string& name, const NDArray& g) { keep(name, g, true); };
  // The micro-batches' loss terms stay on the device until the schedule is
  // queued: reading each at its backward would make the host wait there.
  std::vector<NDArray> losses;
  auto accumulate = [&](const ExecGraph::MicroBatch& mb) {
    if (mb.loss_array.valid()) losses.push_back(mb.loss_array);
    for (auto& [name, g] : mb.raw_grads) keep(name, g, false);
  };
  const int micro_batches = tokens_ ? tokens_->micro_batches(rt_->pipeline) : rt_->micro_batches();
  int backwards = 0;
  // A mixture of experts' router statistics (router_stats.h); with the
  // auxiliary loss every forward runs before the first backward, which
  // fills the weights its gradient needs.
  RouterStats router(config_);
  router.begin_step(graph.stream());
  auto forward = [&](int micro) {
    const double t0 = clock_ ? clock_->now() : 0;
    Bindings bindings;
    // A capture's feeds are on the device already (step_graphs.cc).
    ValueMap values = capturing_ != nullptr ? capturing_->feeds.at(micro) : feeds(micro, normalizer, bindings);
    if (capturing_ != nullptr) bindings = capturing_->bindings.at(micro);
    router.feed(graph, values);
    ExecGraph::Activations a = graph.forward(values, world_, bindings);
    router.after_forward(graph, a);
    if (clock_) clock_->record("F" + std::to_string(micro), "forward", t0);
    return a;
  };
  auto backward = [&](ExecGraph::Activations a, int micro) {
    if (router.aux_loss() && !router.finished()) router.finish(graph.stream(), world_);
    const double t0 = clock_ ? clock_->now() : 0;
    if (overlap != nullptr && ++backwards == micro_batches) {
      // The last backward: each gradient is final as it is computed.
      std::set<std::string> handed;
      ExecGraph::MicroBatch mb = graph.backward(
          std::move(a), world_,
          [&](const std::string& name, const NDArray& g) {
            add(name, g);
            overlap->ready(name, raw.at(name));
            handed.insert(name);
          },
          false);
      for (const std::string& name : handed) mb.raw_grads.erase(name);
      accumulate(mb);
    } else {
      accumulate(graph.backward(std::move(a), world_, {}, false));
    }
    if (clock_) clock_->record("B" + std::to_string(micro), "backward", t0);
  };
  // Sends are deferred (set_deferred_sends): a stage sending activations
  // never waits on a neighbour sending gradients.
  // Weight casts once per step, or none where the last update wrote them.
  const ExecGraph::StepScope pre_processing(graph, take_weight_copies(graph));
  const Schedule schedule = router.aux_loss() ? run_gpipe : schedule_by_name(rt_->strategy.schedule);
  schedule(SchedulePosition{rt_->stage, rt_->stages, micro_batches}, forward, backward);
  keep_step_casts(graph, pre_processing);
  if (router.active() && !router.finished()) router.finish(graph.stream(), world_);
  if (router.active()) step_router_.add(router);
  if (loss_terms != nullptr)
    *loss_terms = std::move(losses);  // read by the caller after the update is queued
  else
    for (const NDArray& l : losses)  // in micro-batch order, in double: as each read at its backward
      loss += kernels::to_host(graph.stream(), l).host_data<float>("the loss")[0];
  if (micro_batches == 0 && rt_->pipeline >= 0) {
    // A pipeline that got no piece this step contributes zero gradients.
    for (const std::string& name : graph.model().names) {
      const Shard& sh = state_->slot(name, StateSlot::kParam);
      if (sh.held() && !raw.count(name))
        raw.emplace(name, kernels::zeros(graph.stream(), sh.data.shape(), DType::F32));
    }
  }
}

}  // namespace dist
}  // namespace hspmd

// --replace-experts: re-placing a mixture of experts' experts online
// (docs/moe.md, "Re-placing experts online"). Before each step, the last
// step's routing (expert_tokens, the same on every rank) gives a placement
// (plan/expert_placement.h); the run switches to it when the work it takes
// off the busiest member of a group, over the steps left, outweighs the
// switch's predicted time.
#include <algorithm>

#include "hspmd/models/model.h"
#include "hspmd/plan/expert_placement.h"
#include "train/dist_trainer.h"

namespace hspmd::dist {

namespace {

// The experts' share of a token's matmul work: k expert MLPs per sparse
// layer, against every layer's matmuls and the head's.
double expert_share(const ModelConfig& c) {
  const ModelFamily::LayerCompute lc = model_family(c.model_type).layer_compute(c);
  const double experts = static_cast<double>(c.sparse_layers()) * static_cast<double>(c.moe.top_k) * 3.0 *
                         static_cast<double>(c.hidden_size) * static_cast<double>(c.moe.expert_intermediate_size);
  const double all = static_cast<double>(c.num_hidden_layers) * (lc.tp_split + lc.whole) +
                     static_cast<double>(c.table_rows()) * static_cast<double>(c.hidden_size);
  return all > 0 ? std::min(1.0, experts / all) : 0.0;
}

}  // namespace

void DistTrainer::maybe_replace_experts(int64_t step) {
  const Strategy& now = rt_->strategy;
  if (records_.empty() || now.expert_parallel <= 1 || records_.back().expert_tokens.empty()) return;
  const StepRecord& last = records_.back();
  const int g = now.expert_parallel;
  const int64_t experts = config_.moe.num_experts;
  std::vector<int64_t> sparse;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l)
    if (config_.moe.sparse_layer(l)) sparse.push_back(l);
  if (last.expert_tokens.size() != sparse.size()) return;
  std::vector<std::vector<double>> loads;
  for (const auto& layer : last.expert_tokens) loads.emplace_back(layer.begin(), layer.end());
  const std::vector<ExpertPlacement> placed = place_experts(sparse, loads, g, experts);
  // Per layer the better of the current placement and the new one (a new
  // one must cut the busiest member's load by 1% to be worth moving).
  double before = 0, after = 0;
  Strategy next = now;
  next.expert_placement.clear();
  for (size_t i = 0; i < sparse.size(); ++i) {
    std::vector<std::vector<int>> cur = layer_placement(now, sparse[i], experts);
    std::vector<std::vector<int>> fresh = cur;
    for (const ExpertPlacement& p : placed)
      if (p.first_layer <= sparse[i] && sparse[i] <= p.last_layer) fresh = p.members;
    const double b_now = placement_bottleneck(cur, loads[i], g), b_new = placement_bottleneck(fresh, loads[i], g);
    const bool better = b_new < b_now * 0.99;
    before += b_now;
    after += better ? b_new : b_now;
    append_placement(next.expert_placement, static_cast<int>(sparse[i]), better ? std::move(fresh) : std::move(cur));
  }
  if (!(after < before) || before <= 0) return;
  // The step's time and the last specialization's (the slowest rank's:
  // every rank must decide alike).
  double times[2] = {clock_ ? last.emulated_step_time_s : last.step_time_s, last_specialize_s_};
  world_.all_reduce(times, 2, ReduceOp::kMax);
  const double gain = times[0] * expert_share(config_) * (before - after) / before * static_cast<double>(o_.steps - step);
  std::shared_ptr<const AnnotationPlan> plan = compile(next);
  const SwitchPlan& sp = switch_plans_.get(*rt_->plan, *plan, *topology_, base_switch_options());
  const double cost = sp.predicted_s + times[1];
  const bool go = gain > cost;
  log_.write({{"event", "expert_placement"}, {"step", step}, {"busiest_before", before}, {"busiest_after", after},
              {"expected_gain_s", gain}, {"predicted_cost_s", cost}, {"switched", go}});
  if (go) switch_now(std::move(plan));
}

}  // namespace hspmd::dist

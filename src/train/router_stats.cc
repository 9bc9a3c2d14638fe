// A mixture-of-experts model's router statistics over a step (router_stats.h).
#include "train/router_stats.h"

#include <cmath>

#include "hspmd/core/error.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd::dist {

RouterStats::RouterStats(const ModelConfig& config)
    : sparse_(config.sparse_layers()),
      experts_(config.moe.num_experts),
      top_k_(config.moe.top_k),
      aux_(config.moe.aux_loss()),
      coef_(config.moe.router_aux_loss_coef) {
  if (aux_)
    for (int64_t l = 0; l < config.num_hidden_layers; ++l)
      if (config.moe.sparse_layer(l)) names_.push_back("moe_aux_weights." + std::to_string(l));
}

void RouterStats::begin_step(Stream& stream) {
  if (!active()) return;
  if (aux_) weights_ = kernels::zeros(stream, {experts_}, DType::F32);
  counts_.clear();
  prob_sums_.clear();
  finished_ = false;
  aux_value_ = 0;
  expert_tokens_.clear();
}

void RouterStats::feed(const ExecGraph& graph, ValueMap& values) const {
  for (const std::string& name : names_)
    if (graph.local_box(name, {experts_})) values[name] = weights_;
}

void RouterStats::after_forward(const ExecGraph& graph, const ExecGraph::Activations& a) {
  if (!active()) return;
  HSPMD_CHECK(!finished_, "router statistics: a forward after the step's statistics were summed");
  const ModelGraph& m = graph.model();
  for (size_t l = 0; l < m.router_counts.size(); ++l) {
    const NDArray counts = graph.forward_value(a, m.router_counts[l]);
    if (counts.valid() && graph.represents(m.router_counts[l])) counts_.emplace_back(l, counts);
    if (!aux_) continue;
    const NDArray probs = graph.forward_value(a, m.router_prob_sums[l]);
    if (probs.valid() && graph.represents(m.router_prob_sums[l])) prob_sums_.emplace_back(l, probs);
  }
}

void RouterStats::finish(Stream& stream, Communicator& world) {
  HSPMD_CHECK(active() && !finished_, "router statistics: finish twice in a step");
  finished_ = true;
  // Per sparse layer [counts (E), prob sums (E)], summed over the
  // micro-batches here, then over the world.
  const int64_t row = 2 * experts_;
  std::vector<double> sums(static_cast<size_t>(sparse_ * row), 0.0);
  auto add = [&](const std::vector<std::pair<int64_t, NDArray>>& arrays, int64_t at) {
    for (const auto& [layer, a] : arrays) {
      const NDArray host = kernels::to_host(stream, a);
      const float* v = host.host_data<float>("router statistics");
      for (int64_t e = 0; e < experts_; ++e) sums[layer * row + at + e] += v[e];
    }
  };
  add(counts_, 0);
  add(prob_sums_, experts_);
  counts_.clear();
  prob_sums_.clear();
  world.all_reduce(sums.data(), static_cast<int64_t>(sums.size()));
  std::vector<double> c(static_cast<size_t>(experts_), 0.0), p(static_cast<size_t>(experts_), 0.0);
  for (int64_t l = 0; l < sparse_; ++l) {
    std::vector<int64_t>& tokens = expert_tokens_.emplace_back();
    for (int64_t e = 0; e < experts_; ++e) {
      tokens.push_back(std::llround(sums[l * row + e]));
      c[e] += sums[l * row + e];
      p[e] += sums[l * row + experts_ + e];
    }
  }
  if (!aux_) return;
  double pairs = 0;
  for (double n : c) pairs += n;
  const double rows = pairs / static_cast<double>(top_k_);
  if (rows <= 0) return;
  NDArray w = NDArray::empty({experts_}, DType::F32);
  double aux = 0;
  for (int64_t e = 0; e < experts_; ++e) {
    aux += c[e] / rows * (p[e] / rows);
    w.host_data<float>("aux weights")[e] = static_cast<float>(coef_ * static_cast<double>(experts_) * c[e] / (rows * rows));
  }
  kernels::copy(stream, kernels::to_device(stream, w), weights_);
  aux_value_ = coef_ * static_cast<double>(experts_) * aux;
}

}  // namespace hspmd::dist

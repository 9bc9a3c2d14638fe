// The auxiliary load-balancing loss's step statistics (moe_aux.h).
#include "train/moe_aux.h"

#include "hspmd/core/error.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd::dist {

MoeAuxLoss::MoeAuxLoss(const ModelConfig& config)
    : active_(config.moe.aux_loss()),
      experts_(config.moe.num_experts),
      top_k_(config.moe.top_k),
      coef_(config.moe.router_aux_loss_coef) {
  if (active_)
    for (int64_t l = 0; l < config.num_hidden_layers; ++l)
      if (config.moe.sparse_layer(l)) names_.push_back("moe_aux_weights." + std::to_string(l));
}

void MoeAuxLoss::begin_step(Stream& stream) {
  if (!active_) return;
  weights_ = kernels::zeros(stream, {experts_}, DType::F32);
  counts_.clear();
  prob_sums_.clear();
  finished_ = false;
}

void MoeAuxLoss::feed(const ExecGraph& graph, ValueMap& values) const {
  for (const std::string& name : names_)
    if (graph.local_box(name, {experts_})) values[name] = weights_;
}

void MoeAuxLoss::after_forward(const ExecGraph& graph, const ExecGraph::Activations& a) {
  if (!active_) return;
  HSPMD_CHECK(!finished_, "moe aux loss: a forward after the step's first backward");
  const ModelGraph& m = graph.model();
  for (size_t l = 0; l < m.router_counts.size(); ++l) {
    const NDArray counts = graph.forward_value(a, m.router_counts[l]);
    if (counts.valid() && graph.represents(m.router_counts[l])) counts_.push_back(counts);
    const NDArray probs = graph.forward_value(a, m.router_prob_sums[l]);
    if (probs.valid() && graph.represents(m.router_prob_sums[l])) prob_sums_.push_back(probs);
  }
}

double MoeAuxLoss::finish_forwards(Stream& stream, Communicator& world) {
  HSPMD_CHECK(active_ && !finished_, "moe aux loss: finish_forwards twice in a step");
  finished_ = true;
  // [counts (E), prob sums (E)] summed over the layers and micro-batches, then the world.
  std::vector<double> sums(static_cast<size_t>(2 * experts_), 0.0);
  auto add = [&](const std::vector<NDArray>& arrays, int64_t at) {
    for (const NDArray& a : arrays) {
      const NDArray host = kernels::to_host(stream, a);
      const float* v = host.host_data<float>("router statistics");
      for (int64_t e = 0; e < experts_; ++e) sums[at + e] += v[e];
    }
  };
  add(counts_, 0);
  add(prob_sums_, experts_);
  counts_.clear();
  prob_sums_.clear();
  world.all_reduce(sums.data(), static_cast<int64_t>(sums.size()));
  double pairs = 0;
  for (int64_t e = 0; e < experts_; ++e) pairs += sums[e];
  const double rows = pairs / static_cast<double>(top_k_);
  if (rows <= 0) return 0;
  NDArray w = NDArray::empty({experts_}, DType::F32);
  double aux = 0;
  for (int64_t e = 0; e < experts_; ++e) {
    aux += sums[e] / rows * (sums[experts_ + e] / rows);
    w.host_data<float>("aux weights")[e] =
        static_cast<float>(coef_ * static_cast<double>(experts_) * sums[e] / (rows * rows));
  }
  kernels::copy(stream, kernels::to_device(stream, w), weights_);
  return coef_ * static_cast<double>(experts_) * aux;
}

}  // namespace hspmd::dist

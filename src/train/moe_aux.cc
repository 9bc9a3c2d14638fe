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
      coef_(config.moe.router_aux_loss_coef) {}

void MoeAuxLoss::begin_step(Stream& stream) {
  if (!active_) return;
  weights_ = kernels::zeros(stream, {experts_}, DType::F32);
  pending_.clear();
  finished_ = false;
}

void MoeAuxLoss::after_forward(const ExecGraph& graph, const ExecGraph::Activations& a) {
  if (!active_) return;
  HSPMD_CHECK(!finished_, "moe aux loss: a forward after the step's first backward");
  const NDArray counts = graph.forward_value(a, graph.model().router_counts);
  const NDArray probs = graph.forward_value(a, graph.model().router_prob_sums);
  if (counts.valid() && probs.valid()) {  // this rank holds sparse layers
    pending_.push_back(counts);
    pending_.push_back(probs);
  }
}

double MoeAuxLoss::finish_forwards(Stream& stream, Communicator& world) {
  HSPMD_CHECK(active_ && !finished_, "moe aux loss: finish_forwards twice in a step");
  finished_ = true;
  // [counts (E), prob sums (E)] summed over the micro-batches, then the world.
  std::vector<double> sums(static_cast<size_t>(2 * experts_), 0.0);
  for (size_t i = 0; i < pending_.size(); ++i) {
    const NDArray host = kernels::to_host(stream, pending_[i]);
    const float* v = host.host_data<float>("router statistics");
    for (int64_t e = 0; e < experts_; ++e) sums[(i % 2) * experts_ + e] += v[e];
  }
  pending_.clear();
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

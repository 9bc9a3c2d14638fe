// The auxiliary load-balancing loss of a mixture-of-experts model over one
// step (docs/moe.md), as Hugging Face computes it over a batch: with C_e the
// (token, slot) pairs routed to expert e and P_e the router's probabilities
// summed over the tokens, both over every sparse layer of every micro-batch,
// and N = sum_e C_e / k the rows of all layers,
//   aux = coef * E * sum_e (C_e / N) (P_e / N).
// C is known only once every forward of the step has routed, and the
// backward of any micro-batch needs it (d aux / d probs[t, e] = coef * E *
// C_e / N^2): the step runs all its forwards before its first backward
// (GPipe's order), then finish_forwards() sums the statistics and fills the
// weights the model's moe_aux_weights placeholder feeds to the backwards.
#pragma once

#include <vector>

#include "hspmd/comm/communicator.h"
#include "hspmd/exec/exec_graph.h"
#include "hspmd/models/config.h"

namespace hspmd::dist {

class MoeAuxLoss {
 public:
  explicit MoeAuxLoss(const ModelConfig& config);
  // Whether the model has the loss (output_router_logits with a non-zero coefficient).
  bool active() const { return active_; }

  // A new step: the weights' array (what feeds() gives moe_aux_weights) on
  // `stream`'s device, zeros until finish_forwards().
  void begin_step(Stream& stream);
  const NDArray& weights() const { return weights_; }
  // After each forward: its router statistics (kept by the graph).
  void after_forward(const ExecGraph& graph, const ExecGraph::Activations& a);
  // Once, after the step's last forward and before its first backward, on
  // every rank: the statistics summed over the micro-batches and the world,
  // the weights filled; returns coef * aux (the term the loss gains).
  double finish_forwards(Stream& stream, Communicator& world);
  bool finished() const { return finished_; }

 private:
  bool active_ = false;
  int64_t experts_ = 0, top_k_ = 1;
  double coef_ = 0;
  NDArray weights_;
  std::vector<double> counts_, prob_sums_;
  std::vector<NDArray> pending_;  // the step's statistics arrays (counts, prob sums, ...), on the device
  bool finished_ = false;
};

}  // namespace hspmd::dist

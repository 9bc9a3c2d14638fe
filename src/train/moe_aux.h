// The auxiliary load-balancing loss of a mixture-of-experts model over one
// step (docs/moe.md), as Hugging Face computes it over a batch: with C_e the
// (token, slot) pairs routed to expert e and P_e the router's probabilities
// summed over the tokens, both over every sparse layer of every micro-batch
// on every rank, and N = sum_e C_e / k the rows of all layers,
//   aux = coef * E * sum_e (C_e / N) (P_e / N).
// C is known only once every forward of the step has routed, and the
// backward of any micro-batch needs it (d aux / d probs[t, e] = coef * E *
// C_e / N^2): the step runs all its forwards before its first backward
// (GPipe's order), then finish_forwards() sums the statistics over the
// world and fills the weights each sparse layer's moe_aux_weights.<i>
// placeholder feeds to the backwards.
#pragma once

#include <string>
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

  // A new step: the weights' array on `stream`'s device, zeros until
  // finish_forwards().
  void begin_step(Stream& stream);
  // The weights' feeds of the sparse layers this rank holds into `values`.
  void feed(const ExecGraph& graph, ValueMap& values) const;
  // After each forward: its router statistics (kept by the graph) where
  // this rank's values are the ones to count.
  void after_forward(const ExecGraph& graph, const ExecGraph::Activations& a);
  // Once per step on every rank, after its last forward and before its
  // first backward (an idle rank: after its empty schedule): the statistics
  // summed over the micro-batches and the world, the weights filled; returns
  // coef * aux (the term the loss gains). A world collective.
  double finish_forwards(Stream& stream, Communicator& world);
  bool finished() const { return finished_; }

 private:
  bool active_ = false;
  int64_t experts_ = 0, top_k_ = 1;
  double coef_ = 0;
  std::vector<std::string> names_;  // the sparse layers' placeholders
  NDArray weights_;
  std::vector<NDArray> counts_, prob_sums_;  // the step's statistics arrays, on the device
  bool finished_ = false;
};

}  // namespace hspmd::dist

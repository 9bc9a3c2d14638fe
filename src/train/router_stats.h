// A mixture-of-experts model's router statistics over one step (docs/moe.md):
// the tokens each expert of each sparse layer took, for the step record
// (`expert_tokens`), and the auxiliary load-balancing loss, computed as
// Hugging Face computes it over a batch. With C_e the (token, slot) pairs
// routed to expert e and P_e the router's probabilities summed over the
// tokens, both over every sparse layer of every micro-batch on every rank,
// and N = sum_e C_e / k the rows of all layers,
//   aux = coef * E * sum_e (C_e / N) (P_e / N).
// C is known only once every forward of the step has routed, and the
// backward of any micro-batch needs it (d aux / d probs[t, e] = coef * E *
// C_e / N^2): with the loss the step runs all its forwards before its first
// backward (GPipe's order), then finish() sums the statistics over the world
// and fills the weights each sparse layer's moe_aux_weights.<i> placeholder
// feeds to the backwards. Without it, finish() runs after the schedule.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hspmd/comm/communicator.h"
#include "hspmd/exec/exec_graph.h"
#include "hspmd/models/config.h"

namespace hspmd::dist {

class RouterStats {
 public:
  explicit RouterStats(const ModelConfig& config);
  // Whether the model has sparse layers / the auxiliary loss (output_router_logits
  // with a non-zero coefficient).
  bool active() const { return sparse_ > 0; }
  bool aux_loss() const { return aux_; }

  // A new step: the aux weights' array on `stream`'s device, zeros until finish().
  void begin_step(Stream& stream);
  // The aux weights' feeds of the sparse layers this rank holds into `values`.
  void feed(const ExecGraph& graph, ValueMap& values) const;
  // After each forward: its router statistics (kept by the graph) where
  // this rank's values are the ones to count.
  void after_forward(const ExecGraph& graph, const ExecGraph::Activations& a);
  // Once per step on every rank, after its last forward (with the loss:
  // before its first backward; an idle rank after its empty schedule): the
  // statistics summed over the micro-batches and the world (one all-reduce),
  // the aux weights filled. A world collective.
  void finish(Stream& stream, Communicator& world);
  bool finished() const { return finished_; }
  // After finish(): coef * aux (0 without the loss), and the tokens each
  // expert took in each sparse layer (layer order) over the step.
  double aux_loss_value() const { return aux_value_; }
  const std::vector<std::vector<int64_t>>& expert_tokens() const { return expert_tokens_; }

 private:
  int64_t sparse_ = 0, experts_ = 0, top_k_ = 1;
  bool aux_ = false;
  double coef_ = 0;
  std::vector<std::string> names_;  // the sparse layers' aux-weights placeholders
  NDArray weights_;
  // The step's statistics arrays (on the device) with their sparse layer's index.
  std::vector<std::pair<int64_t, NDArray>> counts_, prob_sums_;
  bool finished_ = false;
  double aux_value_ = 0;
  std::vector<std::vector<int64_t>> expert_tokens_;
};

// A step's router results summed over its schedules (token-budget steps
// with bucket switching run one per bucket).
struct StepRouterResult {
  double aux_loss = 0;
  std::vector<std::vector<int64_t>> expert_tokens;  // per sparse layer, per expert
  void clear() { *this = StepRouterResult{}; }
  void add(const RouterStats& s) {
    aux_loss += s.aux_loss_value();
    if (expert_tokens.empty()) expert_tokens.assign(s.expert_tokens().size(), {});
    for (size_t l = 0; l < s.expert_tokens().size(); ++l) {
      std::vector<int64_t>& mine = expert_tokens[l];
      mine.resize(s.expert_tokens()[l].size(), 0);
      for (size_t e = 0; e < mine.size(); ++e) mine[e] += s.expert_tokens()[l][e];
    }
  }
};

}  // namespace hspmd::dist

// The straggler watch's window (docs/elastic.md, "Stragglers"): per step
// and rank the compute the clock saw, the compute the cost model predicted
// under the assumed speeds, and the rank's role. What it answers is, per
// rank, how far its speed is from the assumed one, with the cost model's
// own error per role taken out.
//
// Why roles: the prediction of a rank comes from the profile entry of its
// stage's (tp, cp); the clock's bill (the CPU, or the model clock's per-op
// fits) agrees with that entry up to a factor that differs between entries
// (a profile measured on a busy machine put one entry 26% off another).
// Compared with the median of all ranks, every rank of such a role looks
// like a straggler (or a faster device) although no device changed. So
// each role's factor (its ranks' ratio seen / predicted, relative to the
// median rank) is learned the first window it appears in, and every later
// window judges a rank by its ratio divided by its role's factor.
#pragma once

#include <compare>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "hspmd/plan/strategy.h"

namespace hspmd::dist {

struct StragglerRole {
  int tp = 0, cp = 0;  // 0: no work in the step
  auto operator<=>(const StragglerRole&) const = default;
  std::string name() const;  // "tp2cp1"
};

// Per rank of a world of `world` ranks, the role its stage gives it under
// `strategy` ({0, 0} for an idle rank).
std::vector<StragglerRole> straggler_roles(const Strategy& strategy, int world);

class StragglerWindow {
 public:
  // One watched step: per rank the seen and the predicted compute (seconds;
  // a predicted 0 means no work) and the rank's role in that step.
  void add(std::vector<double> seen, std::vector<double> predicted, std::vector<StragglerRole> roles);
  size_t size() const { return steps_.size(); }
  // Forgets the steps; the learned role factors stay (they describe the
  // cost model, not the devices).
  void clear() { steps_.clear(); }

  // Per rank, its speed relative to the assumed one times an unknown
  // common factor (1 = as assumed, up to that factor): the ratio seen /
  // predicted over the window (sums of the steps with `sums`, else the
  // median of the per-step ratios), divided by its role's factor. Roles
  // not seen before are learned here first. Ranks in `excluded` and ranks
  // without predicted work get 0 and stay out of `active`.
  std::vector<double> ratios(const std::set<int>& excluded, bool sums, std::vector<int>& active);

  // The learned factor of every role seen so far (relative to the median
  // rank of the window it was learned in).
  const std::map<StragglerRole, double>& factors() const { return factors_; }

 private:
  struct Step {
    std::vector<double> seen, predicted;
    std::vector<StragglerRole> roles;
  };
  std::vector<Step> steps_;
  std::map<StragglerRole, double> factors_;
};

}  // namespace hspmd::dist

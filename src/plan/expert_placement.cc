// place_layer_experts and its helpers (expert_placement.h, docs/moe.md).
#include "hspmd/plan/expert_placement.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "hspmd/core/error.h"

namespace hspmd {

namespace {

std::vector<double> member_speeds(const std::vector<double>& speeds, int members) {
  if (speeds.empty()) return std::vector<double>(members, 1.0);
  if (static_cast<int>(speeds.size()) != members)
    fail("[experts] ", speeds.size(), " speeds for ", members, " members");
  for (double v : speeds)
    if (!(v > 0)) fail("[experts] a member's speed must be positive, got ", v);
  return speeds;
}

// Pieces largest first onto the member that ends least loaded relative to
// its speed, an expert's replicas on distinct members (ties: lowest index).
std::vector<std::vector<int>> assign(const std::vector<double>& loads, const std::vector<int>& replicas,
                                     const std::vector<double>& speed) {
  const int m = static_cast<int>(speed.size());
  std::vector<std::pair<double, int>> pieces;  // (load, expert)
  for (size_t e = 0; e < loads.size(); ++e)
    for (int r = 0; r < replicas[e]; ++r) pieces.emplace_back(loads[e] / replicas[e], static_cast<int>(e));
  std::stable_sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<double> busy(m, 0);
  std::vector<std::vector<int>> out(loads.size());
  std::vector<int> held(m, 0);
  for (const auto& [load, e] : pieces) {
    int best = -1;
    for (int k = 0; k < m; ++k) {
      if (std::find(out[e].begin(), out[e].end(), k) != out[e].end()) continue;
      // An empty member first (every member holds some expert), then the
      // least loaded after taking the piece; within 2% of that, the one
      // holding fewer experts (each costs its weights' optimizer step and
      // gradient sync whatever its tokens).
      if (best < 0) {
        best = k;
        continue;
      }
      if ((held[k] > 0) != (held[best] > 0)) {
        if (held[k] == 0) best = k;
        continue;
      }
      const double tk = (busy[k] + load) / speed[k], tb = (busy[best] + load) / speed[best];
      if (tk < tb * 0.98 || (tk <= tb * 1.02 && held[k] < held[best])) best = k;
    }
    out[e].push_back(best);
    busy[best] += load;
    ++held[best];
  }
  for (auto& v : out) std::sort(v.begin(), v.end());
  return out;
}

}  // namespace

double placement_bottleneck(const std::vector<std::vector<int>>& placement, const std::vector<double>& loads,
                            int members, const std::vector<double>& speeds) {
  const std::vector<double> speed = member_speeds(speeds, members);
  std::vector<double> busy(members, 0);
  for (size_t e = 0; e < placement.size(); ++e)
    for (int k : placement[e]) busy[k] += loads[e] / static_cast<double>(placement[e].size());
  double worst = 0;
  for (int k = 0; k < members; ++k) worst = std::max(worst, busy[k] / speed[k]);
  return worst;
}

std::vector<std::vector<int>> place_layer_experts(const std::vector<double>& loads, int members,
                                                  const std::vector<double>& speeds) {
  if (loads.empty()) fail("[experts] no experts to place");
  if (members < 1) fail("[experts] a group needs at least one member, got ", members);
  for (double l : loads)
    if (!(l >= 0)) fail("[experts] an expert's load must not be negative, got ", l);
  const std::vector<double> speed = member_speeds(speeds, members);
  const int n = static_cast<int>(loads.size());
  std::vector<int> replicas(n, 1);
  // Every member needs a piece: replicate the heaviest experts until there
  // are as many pieces as members.
  // An expert gets at most the replicas that bring its load down to an even
  // share (more would hold its weights on more members for little).
  const double even = std::accumulate(loads.begin(), loads.end(), 0.0) / members;
  std::vector<int> cap(n);
  for (int e = 0; e < n; ++e)
    cap[e] = even > 0 ? std::clamp(static_cast<int>(std::ceil(loads[e] / even - 1e-9)), 1, members) : 1;
  auto heaviest_piece = [&](const std::vector<int>& limit) {
    int best = -1;
    for (int e = 0; e < n; ++e)
      if (replicas[e] < limit[e] && (best < 0 || loads[e] / replicas[e] > loads[best] / replicas[best])) best = e;
    return best;
  };
  const std::vector<int> all(n, members);
  while (std::accumulate(replicas.begin(), replicas.end(), 0) < members) ++replicas[heaviest_piece(all)];
  std::vector<std::vector<int>> best = assign(loads, replicas, speed);
  double best_time = placement_bottleneck(best, loads, members, speeds);
  // Keep replicating the heaviest piece (a step that does not help may
  // open one that does), keeping the best placement seen.
  for (int step = 0; step < n * members; ++step) {
    const int e = heaviest_piece(cap);
    if (e < 0) break;
    ++replicas[e];
    std::vector<std::vector<int>> trial = assign(loads, replicas, speed);
    const double t = placement_bottleneck(trial, loads, members, speeds);
    if (t < best_time * (1 - 1e-9)) best = std::move(trial), best_time = t;
  }
  return best;
}

std::vector<ExpertPlacement> place_experts(const std::vector<int64_t>& sparse_layers,
                                           const std::vector<std::vector<double>>& loads, int members,
                                           int64_t experts, const std::vector<double>& speeds) {
  if (loads.size() != sparse_layers.size())
    fail("[experts] loads of ", loads.size(), " sparse layers, the model has ", sparse_layers.size());
  std::vector<ExpertPlacement> out;
  for (size_t i = 0; i < loads.size(); ++i) {
    if (static_cast<int64_t>(loads[i].size()) != experts)
      fail("[experts] sparse layer ", sparse_layers[i], " has loads of ", loads[i].size(), " experts, the model ",
           experts);
    append_placement(out, static_cast<int>(sparse_layers[i]), place_layer_experts(loads[i], members, speeds));
  }
  return out;
}

std::vector<std::vector<int>> layer_placement(const Strategy& strategy, int64_t layer, int64_t experts) {
  std::vector<std::vector<int>> out;
  for (int64_t e = 0; e < experts; ++e) out.push_back(expert_members(strategy, layer, e, experts));
  return out;
}

void append_placement(std::vector<ExpertPlacement>& out, int layer, std::vector<std::vector<int>> members) {
  if (!out.empty() && out.back().members == members && out.back().last_layer + 1 == layer)
    out.back().last_layer = layer;
  else
    out.push_back({layer, layer, std::move(members)});
}

}  // namespace hspmd

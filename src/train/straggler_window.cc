#include "train/straggler_window.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "hspmd/core/error.h"

namespace hspmd::dist {
namespace {

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

std::string StragglerRole::name() const { return "tp" + std::to_string(tp) + "cp" + std::to_string(cp); }

std::vector<StragglerRole> straggler_roles(const Strategy& strategy, int world) {
  std::vector<StragglerRole> roles(world);
  for (const Pipeline& p : strategy.pipelines)
    for (const Stage& s : p.stages)
      for (int r : s.ranks)
        if (r >= 0 && r < world) roles[r] = {s.tp(), s.cp};
  return roles;
}

void StragglerWindow::add(std::vector<double> seen, std::vector<double> predicted, std::vector<StragglerRole> roles) {
  if (seen.size() != predicted.size() || seen.size() != roles.size() ||
      (!steps_.empty() && seen.size() != steps_[0].seen.size()))
    fail("[straggler] a window step gives ", seen.size(), " seen, ", predicted.size(), " predicted and ",
         roles.size(), " roles for a world of ", steps_.empty() ? seen.size() : steps_[0].seen.size(), " ranks");
  steps_.push_back({std::move(seen), std::move(predicted), std::move(roles)});
}

std::vector<double> StragglerWindow::ratios(const std::set<int>& excluded, bool sums, std::vector<int>& active) {
  active.clear();
  if (steps_.empty()) return {};
  const int world = static_cast<int>(steps_[0].seen.size());
  // A rank's steps under one role: seen / predicted as the mode says.
  const auto ratio_of = [&](int k, auto&& keep, auto&& scale) {
    double seen = 0, predicted = 0;
    std::vector<double> per_step;
    for (const Step& st : steps_) {
      if (!(st.predicted[k] > 0) || !keep(st.roles[k])) continue;
      const double p = st.predicted[k] * scale(st.roles[k]);
      seen += st.seen[k], predicted += p;
      per_step.push_back(st.seen[k] / p);
    }
    if (per_step.empty()) return 0.0;
    return sums ? seen / predicted : median_of(per_step);
  };
  const auto one = [](const StragglerRole&) { return 1.0; };

  // Raw ratios per (rank, role); the median over all of them is the window's
  // common factor (machine load, emulation, the profile's overall scale).
  std::map<StragglerRole, std::vector<double>> by_role;
  std::vector<double> all;
  for (int k = 0; k < world; ++k) {
    if (excluded.count(k)) continue;
    std::set<StragglerRole> roles;
    for (const Step& st : steps_)
      if (st.predicted[k] > 0) roles.insert(st.roles[k]);
    for (const StragglerRole& role : roles) {
      const double q = ratio_of(k, [&](const StragglerRole& r) { return r == role; }, one);
      if (q > 0 && std::isfinite(q)) by_role[role].push_back(q), all.push_back(q);
    }
  }
  if (all.empty()) return std::vector<double>(world, 0.0);
  const double mid = median_of(all);
  // A new role's factor: the median of its ranks when it has three or more
  // (one of them off its speed from the start does not move it); with one
  // or two, the rank closest to the window's median (a single rank's speed
  // and its role's model error cannot be told apart: it is taken as
  // assumed, and only later changes are found).
  for (auto& [role, qs] : by_role) {
    if (factors_.count(role)) continue;
    double f = 0;
    if (qs.size() >= 3) {
      f = median_of(qs);
    } else {
      f = *std::min_element(qs.begin(), qs.end(), [&](double a, double b) {
        return std::abs(std::log(a / mid)) < std::abs(std::log(b / mid));
      });
    }
    factors_[role] = f / mid;
  }
  std::vector<double> out(world, 0.0);
  for (int k = 0; k < world; ++k) {
    if (excluded.count(k)) continue;
    const double n = ratio_of(
        k, [](const StragglerRole&) { return true; },
        [&](const StragglerRole& r) {
          auto it = factors_.find(r);
          return it == factors_.end() ? 1.0 : it->second;
        });
    if (!(n > 0) || !std::isfinite(n)) continue;
    out[k] = n;
    active.push_back(k);
  }
  return out;
}

}  // namespace hspmd::dist

// Bottom tier (paper §5.1; docs/resolver.md, rule 1): communication inside one
// sharding subgroup whose devices do not change. Box-based: partial terms are
// reduced first (reduce_scatter when the targets tile the reduced box, else
// all_reduce), then data moves by local slices, all_gathers, or a BSR inside
// the subgroup when neither fits.
#include <algorithm>
#include <set>

#include "hspmd/core/error.h"
#include "resolve/internal.h"

namespace hspmd::resolve_internal {
namespace {

bool same_device_set(const DeviceGroup& a, const DeviceGroup& b) {
  return std::set<int>(a.ranks.begin(), a.ranks.end()) == std::set<int>(b.ranks.begin(), b.ranks.end());
}

// Whether `pieces` are disjoint, inside `box`, and cover it.
bool tiles(const std::vector<Box>& pieces, const Box& box) {
  int64_t volume = 0;
  for (size_t a = 0; a < pieces.size(); ++a) {
    if (!contains(box, pieces[a])) return false;
    volume += pieces[a].numel();
    for (size_t b = a + 1; b < pieces.size(); ++b)
      if (overlaps(pieces[a], pieces[b])) return false;
  }
  return volume == box.numel();
}

// The bounding box of what any rank of the task needs from `box`; `box`
// itself when nobody needs anything from it.
Box needed_part(const BottomTask& task, const Box& box) {
  std::optional<Box> bound;
  for (const Box& t : task.to) {
    std::optional<Box> part = intersect(t, box);
    if (!part) continue;
    if (!bound) {
      bound = part;
      continue;
    }
    for (size_t d = 0; d < box.begin.size(); ++d) {
      bound->begin[d] = std::min(bound->begin[d], part->begin[d]);
      bound->end[d] = std::max(bound->end[d], part->end[d]);
    }
  }
  return bound ? *bound : box;
}

// Reduces every sum set at step k; updates `cur`.
void reduce_partial(PhasePlan& plan, size_t k, const BottomTask& task, std::vector<Box>& cur) {
  for (const std::vector<int>& set : task.sum_sets) {
    const Box reduced = needed_part(task, cur[set[0]]);
    std::vector<int> group;
    std::vector<Box> pieces;
    for (int q : set) {
      group.push_back(task.ranks[q]);
      pieces.push_back(task.to[q]);
    }
    const std::vector<bool> all(set.size(), true);
    const bool scatter = tiles(pieces, reduced);
    if (scatter)
      plan.add_collective(k, CommKind::kReduceScatter, group, reduced, pieces, all);
    else
      plan.add_collective(k, CommKind::kAllReduce, group, reduced, {}, all);
    for (int q : set) {
      cur[q] = scatter ? task.to[q] : reduced;
      plan.step(k).out[task.ranks[q]] = cur[q];
    }
  }
}

// One destination box and the ranks (indices) that want it.
struct TargetClass {
  Box target;
  std::vector<int> members;
};

std::vector<TargetClass> by_target(const std::vector<int>& cls, const std::vector<Box>& to) {
  std::vector<TargetClass> out;
  for (int q : cls) {
    auto it = std::find_if(out.begin(), out.end(), [&](const TargetClass& t) { return t.target == to[q]; });
    if (it == out.end()) out.push_back(TargetClass{to[q], {q}});
    else it->members.push_back(q);
  }
  return out;
}

// All-gather groups for one target class: the distinct current boxes must
// tile the target and be held equally often; group j takes the j-th holder
// of each. Empty when the class does not fit.
std::vector<std::vector<int>> gather_groups(const TargetClass& tc, const std::vector<Box>& cur) {
  std::vector<Box> distinct;
  for (int q : tc.members)
    if (std::find(distinct.begin(), distinct.end(), cur[q]) == distinct.end()) distinct.push_back(cur[q]);
  std::sort(distinct.begin(), distinct.end(), box_less);
  if (!tiles(distinct, tc.target) || tc.members.size() % distinct.size() != 0) return {};
  const size_t copies = tc.members.size() / distinct.size();
  std::vector<std::vector<int>> groups(copies);
  for (const Box& piece : distinct) {
    std::vector<int> holders;
    for (int q : tc.members)
      if (cur[q] == piece) holders.push_back(q);
    if (holders.size() != copies) return {};
    for (size_t j = 0; j < copies; ++j) groups[j].push_back(holders[j]);
  }
  return groups;
}

// Collective data movement of one class at step k (slices and all_gathers);
// false when some target fits neither.
bool move_collectively(PhasePlan& plan, size_t k, const BottomTask& task, const std::vector<int>& cls,
                       const std::vector<Box>& cur) {
  std::vector<TargetClass> targets = by_target(cls, task.to);
  std::vector<std::vector<std::vector<int>>> groups(targets.size());
  for (size_t t = 0; t < targets.size(); ++t) {
    const bool sliceable = std::all_of(targets[t].members.begin(), targets[t].members.end(),
                                       [&](int q) { return contains(cur[q], targets[t].target); });
    if (sliceable) continue;
    groups[t] = gather_groups(targets[t], cur);
    if (groups[t].empty()) return false;
  }
  for (size_t t = 0; t < targets.size(); ++t) {
    const Box& target = targets[t].target;
    if (groups[t].empty()) {
      for (int q : targets[t].members)
        if (cur[q] != target) plan.add_local_slice(k, task.ranks[q], target);
      continue;
    }
    for (const std::vector<int>& g : groups[t]) {
      std::vector<int> group;
      std::vector<Box> pieces;
      for (int q : g) {
        group.push_back(task.ranks[q]);
        pieces.push_back(cur[q]);
      }
      if (group.size() > 1)
        plan.add_collective(k, CommKind::kAllGather, group, target, pieces, std::vector<bool>(g.size(), true));
    }
  }
  return true;
}

// Moves one class from `cur` to its targets at step k; false when nothing moves.
bool move_class(PhasePlan& plan, size_t k, const BottomTask& task, const std::vector<int>& cls,
                const std::vector<Box>& cur, const Topology& topology) {
  if (std::all_of(cls.begin(), cls.end(), [&](int q) { return cur[q] == task.to[q]; })) return false;
  if (!move_collectively(plan, k, task, cls, cur)) {
    std::vector<Holding> owners, needers;
    for (int q : cls) {
      owners.push_back(Holding{task.ranks[q], cur[q]});
      needers.push_back(Holding{task.ranks[q], task.to[q]});
    }
    std::vector<Move> moves = bsr_moves(plan.shape(), owners, needers, topology, plan.element_size());
    Step& s = plan.step(k);
    s.moves.insert(s.moves.end(), moves.begin(), moves.end());
  }
  for (int q : cls)
    if (cur[q] != task.to[q]) plan.step(k).out[task.ranks[q]] = task.to[q];
  return true;
}

// Every rank of subgroup i (either side) ends phase k with its destination box.
void set_outs(PhasePlan& plan, const Layout& src, const Layout& dst, int i, size_t k = 0) {
  Step& s = plan.step(k);
  for (int r : src.subgroup(i).devices.ranks) s.out[r] = dst.box_of(r);
  for (int r : dst.subgroup(i).devices.ranks) s.out[r] = dst.box_of(r);
}

// Same states, other devices: position p sends its box to position p. A
// receiver that already holds the same (non-partial) box of this subgroup keeps it.
void plan_pairwise(PhasePlan& plan, const Layout& src, const Layout& dst, int i, size_t k = 0) {
  const Subgroup& s = src.subgroup(i);
  const Subgroup& d = dst.subgroup(i);
  Step& step = plan.step(k);
  for (int p = 0; p < s.devices.size(); ++p) {
    const int a = s.devices.ranks[p];
    const int b = d.devices.ranks[p];
    const Box& box = src.ranks.at(a).box;
    const Placement* own = src.find(b);
    const bool keeps = !src.bottom_partial(i) && own && own->subgroup == i && own->box == box;
    step.moves.push_back(Move{keeps ? b : a, b, box, true});
  }
  set_outs(plan, src, dst, i, k);
}

// A non-partial source into partial destination states (e.g. a gradient
// joining a parameter's partial gradients): the value is one partial term,
// so the ranks of partial coordinate 0 receive their boxes by a BSR and the
// others hold zeros.
void plan_partial_from_whole(PhasePlan& plan, const Layout& src, const Layout& dst, int i,
                             const Topology& topology, size_t k = 0) {
  const Subgroup& d = dst.subgroup(i);
  std::vector<Holding> owners, needers;
  for (int r : src.subgroup(i).devices.ranks) owners.push_back(Holding{r, src.ranks.at(r).box});
  Step& step = plan.step(k);
  for (int p = 0; p < d.devices.size(); ++p) {
    const int r = d.devices.ranks[p];
    if (d.states.coordinate(p, kPartial) == 0)
      needers.push_back(Holding{r, dst.ranks.at(r).box});
    else
      step.zero_fill.insert(r);
  }
  std::vector<Move> moves = bsr_moves(plan.shape(), owners, needers, topology, plan.element_size());
  step.moves.insert(step.moves.end(), moves.begin(), moves.end());
  set_outs(plan, src, dst, i, k);
}

// Other devices and other states, no partial: a BSR inside the subgroup.
void plan_subgroup_bsr(PhasePlan& plan, const Layout& src, const Layout& dst, int i, const Topology& topology,
                       size_t k = 0) {
  std::vector<Holding> owners, needers;
  for (int r : src.subgroup(i).devices.ranks) owners.push_back(Holding{r, src.ranks.at(r).box});
  for (int r : dst.subgroup(i).devices.ranks) needers.push_back(Holding{r, dst.ranks.at(r).box});
  std::vector<Move> moves = bsr_moves(plan.shape(), owners, needers, topology, plan.element_size());
  Step& step = plan.step(k);
  step.moves.insert(step.moves.end(), moves.begin(), moves.end());
  set_outs(plan, src, dst, i, k);
}

}  // namespace

namespace {

// Partial terms that stay partial: one class per term, each rank keeping its
// partial coordinate. False (and `why`) when the terms do not line up.
bool partial_classes(const DistStates& s, const DistStates& d, const DeviceGroup& dst_devices, int i,
                     BottomTask& task, std::string* why) {
  const std::string where = "subgroup " + std::to_string(i);
  if (s.degree(kPartial) != d.degree(kPartial)) {
    *why = where + (s.has_partial() ? ": the partial degree changes from " + std::to_string(s.degree(kPartial)) +
                                          " to " + std::to_string(d.degree(kPartial))
                                    : ": partial destination from a non-partial source");
    return false;
  }
  std::map<int, std::vector<int>> by_term;
  for (int q = 0; q < static_cast<int>(task.ranks.size()); ++q) {
    const int term = s.coordinate(q, kPartial);
    if (term != d.coordinate(dst_devices.index_of(task.ranks[q]), kPartial)) {
      *why = where + ": rank " + std::to_string(task.ranks[q]) + " would hold a different partial term";
      return false;
    }
    by_term[term].push_back(q);
  }
  for (auto& [term, members] : by_term) task.classes.push_back(std::move(members));
  return true;
}

// The sum sets of a partial source: ranks that differ only in their partial
// coordinate, each set in partial-coordinate order.
std::vector<std::vector<int>> sum_sets(const DistStates& s, int n) {
  std::map<std::vector<int>, std::map<int, int>> sets;  // other coordinates -> partial coordinate -> index
  const auto at = std::find(s.order.begin(), s.order.end(), kPartial) - s.order.begin();
  for (int q = 0; q < n; ++q) {
    std::vector<int> digits = s.coordinates(q);
    const int term = digits[at];
    digits.erase(digits.begin() + at);
    sets[digits][term] = q;
  }
  std::vector<std::vector<int>> out;
  for (auto& [key, members] : sets) {
    out.emplace_back();
    for (auto [term, q] : members) out.back().push_back(q);
  }
  return out;
}

}  // namespace

std::optional<BottomTask> make_bottom_task(const Layout& src, int i, const std::map<int, Box>& targets,
                                           const DistStates* dst_states, const DeviceGroup* dst_devices,
                                           std::string* why) {
  const Subgroup& g = src.subgroup(i);
  BottomTask task;
  task.ranks = g.devices.ranks;
  for (int r : task.ranks) {
    task.from.push_back(src.ranks.at(r).box);
    task.to.push_back(targets.at(r));
  }
  if (dst_states && dst_states->has_partial()) {
    if (!partial_classes(g.states, *dst_states, *dst_devices, i, task, why)) return std::nullopt;
    return task;
  }
  task.classes.emplace_back();
  for (int q = 0; q < static_cast<int>(task.ranks.size()); ++q) task.classes[0].push_back(q);
  if (g.states.has_partial()) task.sum_sets = sum_sets(g.states, static_cast<int>(task.ranks.size()));
  return task;
}

size_t plan_bottom(PhasePlan& plan, size_t first, const BottomTask& task, const Topology& topology) {
  size_t k = first;
  std::vector<Box> cur = task.from;
  if (!task.sum_sets.empty()) reduce_partial(plan, k++, task, cur);
  bool moved = false;
  for (const std::vector<int>& cls : task.classes) moved = move_class(plan, k, task, cls, cur, topology) || moved;
  return k + (moved ? 1 : 0) - first;
}

namespace {

// A partial source whose subgroup moves to other devices reduces its partial
// sums inside the source subgroup first (phase 0, into copies); the result
// is the source annotation with subgroup i's partial read as dup, or nullopt
// (and `why`) when the subgroup holds copies already.
std::optional<Annotation> reduce_in_place(PhasePlan& plan, const Layout& src, int i,
                                          const Topology& topology, std::string* why) {
  Annotation reduced = *src.annotation;
  DistStates& r = reduced.subgroups[i].states;
  if (r.degree(kDup) > 1) {
    *why = "subgroup " + std::to_string(i) + " changes its devices and holds both partial sums and copies";
    return std::nullopt;
  }
  r.degrees[kDup] = r.degrees.at(kPartial);
  r.degrees.erase(kPartial);
  std::replace(r.order.begin(), r.order.end(), kPartial, kDup);
  const Layout mid = make_layout(reduced, src.shape, "", "intermediate", topology.world_size());
  std::map<int, Box> targets;
  for (int rank : src.subgroup(i).devices.ranks) targets[rank] = mid.ranks.at(rank).box;
  const Subgroup& m = mid.subgroup(i);
  std::optional<BottomTask> task = make_bottom_task(src, i, targets, &m.states, &m.devices, why);
  if (!task) return std::nullopt;
  plan_bottom(plan, 0, *task, topology);
  return reduced;
}

}  // namespace

bool plan_bottom_tier(PhasePlan& plan, const Layout& src, const Layout& dst, const Topology& topology,
                      std::string* why) {
  // Subgroups whose partial sums must be reduced before they move to other
  // devices take phase 0 for that; every other movement then runs in
  // phase k = 1, so no rank is asked for two boxes in one phase.
  std::map<int, Annotation> reduced;
  for (int i = 0; i < src.hsize(); ++i) {
    const Subgroup& s = src.subgroup(i);
    const Subgroup& d = dst.subgroup(i);
    if (src.bottom_partial(i) && !(s.states == d.states) && !same_device_set(s.devices, d.devices)) {
      std::optional<Annotation> r = reduce_in_place(plan, src, i, topology, why);
      if (!r) return false;
      reduced.emplace(i, std::move(*r));
    }
  }
  const size_t k = reduced.empty() ? 0 : 1;
  for (int i = 0; i < src.hsize(); ++i) {
    const Subgroup& s = src.subgroup(i);
    const Subgroup& d = dst.subgroup(i);
    if (s.states == d.states && s.devices == d.devices) continue;
    if (reduced.count(i)) {
      const Layout mid = make_layout(reduced.at(i), src.shape, "", "intermediate", topology.world_size());
      if (dst.bottom_partial(i))
        plan_partial_from_whole(plan, mid, dst, i, topology, k);
      else
        plan_subgroup_bsr(plan, mid, dst, i, topology, k);
      continue;
    }
    if (s.states == d.states) {
      plan_pairwise(plan, src, dst, i, k);
      continue;
    }
    if (!src.bottom_partial(i) && dst.bottom_partial(i)) {
      plan_partial_from_whole(plan, src, dst, i, topology, k);
      continue;
    }
    if (same_device_set(s.devices, d.devices)) {
      std::map<int, Box> targets;
      for (int r : d.devices.ranks) targets[r] = dst.ranks.at(r).box;
      std::optional<BottomTask> task = make_bottom_task(src, i, targets, &d.states, &d.devices, why);
      if (!task) return false;
      plan_bottom(plan, k, *task, topology);
      continue;
    }
    plan_subgroup_bsr(plan, src, dst, i, topology, k);
  }
  return true;
}

}  // namespace hspmd::resolve_internal

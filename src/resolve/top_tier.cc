// Top tier (paper §5.2; docs/resolver.md, rule 2): the subgroups keep their devices
// and the top-tier relation (hdim) changes. Each subgroup is first aligned by
// bottom-tier phases to the boxes the top-tier op needs ("held" boxes), then
// one phase runs split_all_reduce / split_reduce_scatter / split_all_gather
// over the finest slices, merged back into boxes where the groups agree.
#include <algorithm>

#include "hspmd/core/error.h"
#include "resolve/internal.h"

namespace hspmd::resolve_internal {
namespace {

// One top-tier collective over whole grid cells, before it is handed to
// every member as a CommOp.
struct TopOp {
  std::vector<int> group;
  std::vector<bool> contributes;
  CellBox box;
  std::vector<CellBox> pieces;  // none for split_all_reduce; `empty`: nothing for that member
};

// The destination's ranks in subgroup order, with the boxes each holds
// before the top-tier op and needs after it.
struct Members {
  std::vector<int> rank;
  std::vector<int> subgroup;
  std::vector<const Box*> held;
  std::vector<const Box*> need;
};

// The ranks (of `m`) listed for `cell`, split by subgroup.
void by_subgroup(const CellLists& lists, int64_t cell, const Members& m, std::vector<std::vector<int>>& out) {
  for (std::vector<int>& v : out) v.clear();
  for (const int* i = lists.begin(cell); i != lists.end(cell); ++i) out[m.subgroup[*i]].push_back(m.rank[*i]);
}

int part_of(const std::vector<Box>& parts, const Box& cell) {
  for (size_t i = 0; i < parts.size(); ++i)
    if (contains(parts[i], cell)) return static_cast<int>(i);
  return -1;
}

bool subset(const std::vector<int>& a, const std::vector<int>& b) {
  return std::all_of(a.begin(), a.end(), [&](int r) { return std::find(b.begin(), b.end(), r) != b.end(); });
}

// The ops of one finest slice: k groups when every subgroup has k members,
// else one group in which only the first member of each subgroup contributes.
// `owner`: the subgroup whose members receive (RS) or send (AG) the slice.
void cell_ops(CommKind kind, const CellBox& cell, const std::vector<std::vector<int>>& members, int owner,
              std::vector<TopOp>& out) {
  const size_t k = members[0].size();
  const bool even = std::all_of(members.begin(), members.end(), [&](const auto& m) { return m.size() == k; });
  CellBox none = cell;
  none.empty = true;
  for (size_t j = 0; j < (even ? k : 1); ++j) {
    TopOp op;
    op.box = cell;
    for (size_t i = 0; i < members.size(); ++i)
      for (size_t m = 0; m < members[i].size(); ++m) {
        if (even && m != j) continue;
        const bool first = even || m == 0;
        op.group.push_back(members[i][m]);
        op.contributes.push_back(first);
        const bool gets = static_cast<int>(i) == owner && (kind == CommKind::kSplitReduceScatter || first);
        if (kind != CommKind::kSplitAllReduce) op.pieces.push_back(gets ? cell : none);
      }
    out.push_back(std::move(op));
  }
}

// Checks one cell against the rule of `kind` and appends its ops.
// `members`: scratch, one list per subgroup.
bool plan_cell(CommKind kind, const Box& cell, const CellBox& cells, const std::vector<std::vector<int>>& held,
               const std::vector<std::vector<int>>& need, const Layout& src, const Layout& dst,
               std::vector<std::vector<int>>& members, std::vector<TopOp>& out, std::string* why) {
  const int h = static_cast<int>(held.size());
  const int owner = kind == CommKind::kSplitReduceScatter ? part_of(dst.parts, cell)
                    : kind == CommKind::kSplitAllGather   ? part_of(src.parts, cell)
                                                          : -1;
  for (int i = 0; i < h; ++i) {
    if (kind == CommKind::kSplitAllReduce && held[i] != need[i]) {
      *why = "slice " + to_string(cell) + " is held and needed by different ranks of subgroup " + std::to_string(i);
      return false;
    }
    const bool receives = kind == CommKind::kSplitAllGather || i == owner;
    members[i] = receives && kind != CommKind::kSplitAllReduce ? need[i] : held[i];
    if (members[i].empty() || (i == owner && !subset(need[i], held[i]))) {
      *why = "no clean top-tier group for slice " + to_string(cell) + " in subgroup " + std::to_string(i);
      return false;
    }
  }
  cell_ops(kind, cells, members, owner, out);
  return true;
}

// Whether member pieces a and b (of ops adjacent along `dim`) merge into one box.
bool pieces_merge(const CellBox& a, const CellBox& b, size_t dim, size_t rank) {
  return a.empty || b.empty || cell_adjacent(a, b, dim, rank);
}

bool try_merge(TopOp& a, const TopOp& b, size_t dim, size_t rank) {
  if (!cell_adjacent(a.box, b.box, dim, rank)) return false;
  for (size_t m = 0; m < a.pieces.size(); ++m)
    if (!pieces_merge(a.pieces[m], b.pieces[m], dim, rank)) return false;
  a.box.hi[dim] = b.box.hi[dim];
  for (size_t m = 0; m < a.pieces.size(); ++m) {
    if (b.pieces[m].empty) continue;
    if (a.pieces[m].empty) a.pieces[m] = b.pieces[m];
    else a.pieces[m].hi[dim] = b.pieces[m].hi[dim];
  }
  return true;
}

// Merges the ops of one (group, contributes) bucket dim by dim, last dim first.
void merge_ops(std::vector<TopOp>& ops, size_t rank) {
  for (size_t dim = rank; dim-- > 0;) {
    std::sort(ops.begin(), ops.end(),
              [&](const TopOp& a, const TopOp& b) { return cell_less_along(a.box, b.box, dim, rank); });
    size_t kept = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (kept > 0 && try_merge(ops[kept - 1], ops[i], dim, rank)) continue;
      if (kept != i) ops[kept] = std::move(ops[i]);
      ++kept;
    }
    ops.resize(kept);
  }
}

// The top-tier ops from the held boxes to the destination boxes, merged, in
// one global order, handed to the plan at step k; false (and `why`) when
// some slice has no rule (the plan is then untouched).
bool top_ops(PhasePlan& plan, size_t k, CommKind kind, const Layout& src, const Layout& dst,
             const std::map<int, Box>& held, std::string* why) {
  Members m;
  for (int i = 0; i < dst.hsize(); ++i)
    for (int r : dst.subgroup(i).devices.ranks) {
      m.rank.push_back(r);
      m.subgroup.push_back(i);
      m.held.push_back(&held.at(r));
      m.need.push_back(&dst.ranks.at(r).box);
    }
  std::vector<const Box*> boxes = m.held;
  boxes.insert(boxes.end(), m.need.begin(), m.need.end());
  for (const Box& p : src.parts) boxes.push_back(&p);
  for (const Box& p : dst.parts) boxes.push_back(&p);
  const Grid grid(dst.shape, boxes);
  const CellLists holders = cell_lists(grid, m.held);
  const CellLists needers = cell_lists(grid, m.need);
  std::vector<std::vector<int>> h(dst.hsize()), n(dst.hsize()), members(dst.hsize());
  std::map<std::pair<std::vector<int>, std::vector<bool>>, std::vector<TopOp>> buckets;
  std::vector<TopOp> ops;
  for (int64_t c = 0; c < grid.num_cells(); ++c) {
    by_subgroup(holders, c, m, h);
    by_subgroup(needers, c, m, n);
    ops.clear();
    if (!plan_cell(kind, grid.cell_box(c), cell_box_of(grid, c), h, n, src, dst, members, ops, why)) return false;
    for (TopOp& op : ops) buckets[{op.group, op.contributes}].push_back(std::move(op));
  }
  for (auto& [key, list] : buckets) {
    merge_ops(list, grid.rank());
    for (const TopOp& op : list) {
      const Box box = to_box(grid, op.box);
      std::vector<Box> pieces;
      for (const CellBox& p : op.pieces) pieces.push_back(p.empty ? empty_box_at(box) : to_box(grid, p));
      plan.add_collective(k, kind, op.group, box, pieces, op.contributes);
    }
  }
  return true;
}

// The boxes each rank must hold before the top-tier op (see the file comment);
// nullopt when some rank would hold nothing.
std::optional<std::map<int, Box>> held_boxes(CommKind kind, const Layout& src, const Layout& dst) {
  std::map<int, Box> held;
  for (const auto& [r, p] : dst.ranks) {
    Box box = p.box;
    if (kind == CommKind::kSplitReduceScatter) {
      box.begin[dst.hdim] = 0;
      box.end[dst.hdim] = dst.shape[dst.hdim];
    } else if (kind == CommKind::kSplitAllGather) {
      std::optional<Box> mine = intersect(box, src.parts[p.subgroup]);
      if (!mine) return std::nullopt;
      box = *mine;
    }
    held[r] = box;
  }
  return held;
}

// -1 -> d: every subgroup keeps its own part (bottom-tier moves inside it).
bool plan_keep_part(PhasePlan& plan, const Layout& src, const Layout& dst, const Topology& topology,
                    std::string* why) {
  for (int i = 0; i < src.hsize(); ++i) {
    std::map<int, Box> targets;
    const Subgroup& d = dst.subgroup(i);
    for (int r : d.devices.ranks) targets[r] = dst.ranks.at(r).box;
    std::optional<BottomTask> task = make_bottom_task(src, i, targets, &d.states, &d.devices, why);
    if (!task) return false;
    plan_bottom(plan, 0, *task, topology);
  }
  return true;
}

std::optional<CommKind> top_kind(int from, int to, std::string* why) {
  if (from == kPartial && to == kDup) return CommKind::kSplitAllReduce;
  if (from == kPartial && to >= 0) return CommKind::kSplitReduceScatter;
  if (from >= 0 && to == kDup) return CommKind::kSplitAllGather;
  if (to == kPartial) *why = "the destination is partial across subgroups (hdim -2) but the source is not";
  else *why = "the top-tier split moves from dim " + std::to_string(from) + " to dim " + std::to_string(to);
  return std::nullopt;
}

}  // namespace

bool plan_top_tier(PhasePlan& plan, const Layout& src, const Layout& dst, const Topology& topology,
                   std::string* why) {
  if (src.hdim == kDup && dst.hdim >= 0) return plan_keep_part(plan, src, dst, topology, why);
  std::optional<CommKind> kind = top_kind(src.hdim, dst.hdim, why);
  if (!kind) return false;
  for (int i = 0; i < dst.hsize(); ++i)
    if (dst.bottom_partial(i)) {
      *why = "subgroup " + std::to_string(i) + " of the destination is partial";
      return false;
    }
  std::optional<std::map<int, Box>> held = held_boxes(*kind, src, dst);
  if (!held) {
    *why = "a rank's destination box does not meet its own subgroup's source part";
    return false;
  }
  // Build the top-tier ops first (at a provisional step) so that a slice
  // without a rule leaves the plan untouched; then align and move them after the alignment.
  PhasePlan top_plan(src, dst, plan.element_size());
  if (!top_ops(top_plan, 0, *kind, src, dst, *held, why)) return false;
  size_t top = 0;
  for (int i = 0; i < src.hsize(); ++i) {
    const std::vector<int>& ranks = src.subgroup(i).devices.ranks;
    if (!src.bottom_partial(i) &&
        std::all_of(ranks.begin(), ranks.end(), [&](int r) { return src.ranks.at(r).box == held->at(r); }))
      continue;  // already aligned
    std::optional<BottomTask> task = make_bottom_task(src, i, *held, nullptr, nullptr, why);
    HSPMD_CHECK(task, "alignment to non-partial boxes cannot fail");
    top = std::max(top, plan_bottom(plan, 0, *task, topology));
  }
  plan.step(top) = std::move(top_plan.step(0));
  for (const auto& [r, p] : dst.ranks) plan.step(top).out[r] = p.box;
  return true;
}

}  // namespace hspmd::resolve_internal

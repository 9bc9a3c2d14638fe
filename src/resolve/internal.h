// Internals of the resolver (not public API): box geometry, the layouts of
// both annotations, the phase plan under construction, and the three tiers.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <set>
#include <optional>
#include <string>
#include <vector>

#include "hspmd/annotation/annotation.h"
#include "hspmd/resolve/resolver.h"
#include "hspmd/resolve/topology.h"

namespace hspmd::resolve_internal {

// ---- Boxes (boxes.cc) -------------------------------------------------------

Box whole_box(const Shape& shape);
// A zero-volume box anchored at `at`'s begin (an "empty piece").
Box empty_box_at(const Box& at);
bool is_empty(const Box& box);
// `rank`'s position in the group of collective `op` (InternalError if absent).
int member_index(const CommOp& op, int rank);
bool contains(const Box& outer, const Box& inner);
// Whether a and b share an element (no allocation).
bool overlaps(const Box& a, const Box& b);
// The intersection, or nullopt when it has no element.
std::optional<Box> intersect(const Box& a, const Box& b);
// Lexicographic order on (begin, end): the canonical order of box lists.
bool box_less(const Box& a, const Box& b);
// Whether a ends where b begins along `dim` and they agree on every other dim.
bool adjacent(const Box& a, const Box& b, size_t dim);
// Order putting boxes that may merge along `dim` next to each other.
bool less_along(const Box& a, const Box& b, size_t dim);
// Merges adjacent boxes of a disjoint list into larger boxes where the union
// is a box (dim by dim, last dim first); returns them in canonical order.
std::vector<Box> merge_boxes(std::vector<Box> boxes);
int64_t box_bytes(const Box& box, int64_t element_size);

// The finest slices of a tensor: the grid cut at every begin/end of a set of
// boxes. Cells are numbered row-major over the grid. Tensors of rank <= 8.
class Grid {
 public:
  static constexpr size_t kMaxRank = 8;
  using Index = std::array<int64_t, kMaxRank>;

  Grid(const Shape& shape, const std::vector<const Box*>& boxes);
  int64_t num_cells() const { return num_cells_; }
  Box cell_box(int64_t cell) const;
  int64_t cell_numel(int64_t cell) const;
  // The cells as few boxes: adjacent cells merged dim by dim, last dim
  // first (like merge_boxes), in canonical order.
  std::vector<Box> merge_cells(const std::vector<int64_t>& cells) const;
  size_t rank() const { return cuts_.size(); }
  const std::vector<int64_t>& cuts(size_t dim) const { return cuts_[dim]; }
  int64_t stride(size_t dim) const { return strides_[dim]; }
  // Calls f(cell) for every cell inside `box` (whose faces lie on cuts), in
  // increasing cell order.
  template <typename F>
  void for_each_cell(const Box& box, F&& f) const;

 private:
  std::vector<std::vector<int64_t>> cuts_;  // per dim, sorted, from 0 to the dim's size
  std::vector<int64_t> strides_;            // per dim, in cells
  int64_t num_cells_ = 1;
  void cell_range(const Box& box, Index& lo, Index& hi) const;
};

// A box of whole cells in grid coordinates (no allocation); `empty` marks a
// box with no cell (a member's empty piece).
struct CellBox {
  Grid::Index lo{}, hi{};
  bool empty = false;
};
CellBox cell_box_of(const Grid& grid, int64_t cell);
Box to_box(const Grid& grid, const CellBox& box);
bool cell_adjacent(const CellBox& a, const CellBox& b, size_t dim, size_t rank);
bool cell_less_along(const CellBox& a, const CellBox& b, size_t dim, size_t rank);

// For every cell of a grid, the indices of the boxes (of a list) that
// contain it, ascending; stored compressed.
struct CellLists {
  std::vector<int64_t> start;  // per cell, plus one
  std::vector<int> items;

  int64_t size(int64_t cell) const { return start[cell + 1] - start[cell]; }
  const int* begin(int64_t cell) const { return items.data() + start[cell]; }
  const int* end(int64_t cell) const { return items.data() + start[cell + 1]; }
};
CellLists cell_lists(const Grid& grid, const std::vector<const Box*>& boxes);

template <typename F>
void Grid::for_each_cell(const Box& box, F&& f) const {
  const size_t n = cuts_.size();
  Index lo, hi;
  cell_range(box, lo, hi);
  for (size_t d = 0; d < n; ++d)
    if (lo[d] >= hi[d]) return;
  Index idx = lo;
  while (true) {
    int64_t cell = 0;
    for (size_t d = 0; d < n; ++d) cell += idx[d] * strides_[d];
    f(cell);
    size_t d = n;
    while (d > 0) {
      --d;
      if (++idx[d] < hi[d]) break;
      idx[d] = lo[d];
      if (d == 0) return;
    }
    if (n == 0) return;
  }
}

// ---- Layouts (layout.cc) ----------------------------------------------------

// Where one rank sits in an annotation and what it holds.
struct Placement {
  int subgroup = -1;
  int position = -1;
  Box box;
};

// One annotation laid over a concrete shape: every rank's box, computed once.
struct Layout {
  const Annotation* annotation = nullptr;
  Shape shape;
  int hdim = kDup;          // normalized: -1 whenever hsize == 1
  std::vector<Box> parts;   // per subgroup: its top-tier part
  std::map<int, Placement> ranks;

  int hsize() const { return annotation->hsize(); }
  const Subgroup& subgroup(int i) const { return annotation->subgroups[i]; }
  bool bottom_partial(int i) const { return subgroup(i).states.has_partial(); }
  bool any_partial() const;
  const Placement* find(int rank) const;
  std::optional<Box> box_of(int rank) const;
};

// Validates `annotation` (structure, world size, divisibility) and lays it
// out. Throws hspmd::Error "[resolve] reshard '<name>': <role>: <rule>".
Layout make_layout(const Annotation& annotation, const Shape& shape, const std::string& name,
                   const char* role, int world_size);

// ---- The plan under construction (plan.cc) ---------------------------------

// One point-to-point piece of data; from == to is a local keep.
struct Move {
  int from = -1;
  int to = -1;
  Box box;
  bool pairwise = false;  // bottom-tier send/recv (reported as send/recv, not bsr)
};

// One global phase under construction. Every rank's ops are appended in one
// global order, so ranks sharing two ops list them in the same order.
struct Step {
  std::map<int, std::vector<CommOp>> ops;        // collectives and local slices
  std::map<int, std::optional<Box>> out;         // ranks whose box is set by this phase
  std::vector<Move> moves;                       // point-to-point, emitted by finish()
  std::set<int> zero_fill;                       // ranks whose out box starts as zeros
};

class PhasePlan {
 public:
  PhasePlan(const Layout& src, const Layout& dst, int64_t element_size);
  Step& step(size_t k);
  size_t num_steps() const { return steps_.size(); }
  int64_t element_size() const { return element_size_; }
  const Shape& shape() const { return src_.shape; }
  // Appends one collective over `group` to every member (same op, own piece
  // and contributes flag). `pieces` empty for all_reduce kinds.
  void add_collective(size_t k, CommKind kind, const std::vector<int>& group, const Box& box,
                      const std::vector<Box>& pieces, const std::vector<bool>& contributes);
  void add_local_slice(size_t k, int rank, const Box& box);
  // Per-rank phases, kinds and bytes (moves the steps out: call once).
  // Checks that every rank ends with its destination box (InternalError otherwise).
  Resolution finish(const std::string& name, const std::string& tier);

 private:
  void emit_step(Step& step, std::map<int, std::optional<Box>>& cur, Resolution& res) const;

  const Layout& src_;
  const Layout& dst_;
  int64_t element_size_;
  std::vector<Step> steps_;
};

// ---- BSR (bsr.cc) -----------------------------------------------------------

struct Holding {
  int rank = -1;
  Box box;
};

// The BSR table and scheme (paper §5.3): finest slices of the owners' and
// needers' boxes; for each slice and needer in one scan: keep a slice the
// needer owns, else take it from the owner with the fastest link, then the
// fewest bytes sent so far, then the lowest rank. Same-pair slices are merged
// into few boxes. Every needed element must have an owner (InternalError).
std::vector<Move> bsr_moves(const Shape& shape, const std::vector<Holding>& owners,
                            const std::vector<Holding>& needers, const Topology& topology,
                            int64_t element_size);

// ---- Bottom tier (bottom_tier.cc) -------------------------------------------

// Moving the ranks of one subgroup (same devices before and after) from their
// current boxes to target boxes.
struct BottomTask {
  std::vector<int> ranks;
  std::vector<Box> from;                      // per rank of `ranks`
  std::vector<Box> to;                        // per rank of `ranks`
  std::vector<std::vector<int>> sum_sets;     // indices into ranks: partial terms of one sum, to reduce first
  std::vector<std::vector<int>> classes;      // indices into ranks: data moves only inside a class
};

// Builds the task of subgroup `i` of `src` towards `targets` (rank -> box;
// `dst_partial`: the targets are partial terms laid out by `dst_states`).
// Returns nullopt and sets `why` when partial terms cannot be lined up.
std::optional<BottomTask> make_bottom_task(const Layout& src, int i, const std::map<int, Box>& targets,
                                           const DistStates* dst_states, const DeviceGroup* dst_devices,
                                           std::string* why);

// Appends the phases of `task` from step `first`; returns how many it used.
size_t plan_bottom(PhasePlan& plan, size_t first, const BottomTask& task, const Topology& topology);

// Case 1 (same hsize, hdim and parts): each subgroup on its own. Returns
// false and sets `why` when partial values have no rule.
bool plan_bottom_tier(PhasePlan& plan, const Layout& src, const Layout& dst, const Topology& topology,
                      std::string* why);

// ---- Top tier (top_tier.cc) -------------------------------------------------

// Case 2 (same hsize and subgroup devices, different hdim). Returns false and
// sets `why` when no clean top-tier rule applies (the caller falls back to
// BSR, or reports the reshard unsupported when partial is involved).
bool plan_top_tier(PhasePlan& plan, const Layout& src, const Layout& dst, const Topology& topology,
                   std::string* why);

}  // namespace hspmd::resolve_internal

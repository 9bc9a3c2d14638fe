// Box geometry and the grid of finest slices.
#include <algorithm>

#include "hspmd/core/error.h"
#include "resolve/internal.h"

namespace hspmd::resolve_internal {

Box whole_box(const Shape& shape) { return Box{Shape(shape.size(), 0), shape}; }

Box empty_box_at(const Box& at) { return Box{at.begin, at.begin}; }

int member_index(const CommOp& op, int rank) {
  auto it = std::find(op.group.begin(), op.group.end(), rank);
  HSPMD_CHECK(it != op.group.end(), "rank ", rank, " runs a ", kind_name(op.kind), " whose group lacks it");
  return static_cast<int>(it - op.group.begin());
}

bool is_empty(const Box& box) {
  for (size_t d = 0; d < box.begin.size(); ++d)
    if (box.end[d] <= box.begin[d]) return true;
  return false;
}

bool contains(const Box& outer, const Box& inner) {
  if (is_empty(inner)) return true;
  for (size_t d = 0; d < outer.begin.size(); ++d)
    if (inner.begin[d] < outer.begin[d] || inner.end[d] > outer.end[d]) return false;
  return true;
}

bool overlaps(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.begin.size(); ++d)
    if (std::max(a.begin[d], b.begin[d]) >= std::min(a.end[d], b.end[d])) return false;
  return true;
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  if (!overlaps(a, b)) return std::nullopt;
  Box out = a;
  for (size_t d = 0; d < a.begin.size(); ++d) {
    out.begin[d] = std::max(a.begin[d], b.begin[d]);
    out.end[d] = std::min(a.end[d], b.end[d]);
  }
  return out;
}

bool box_less(const Box& a, const Box& b) {
  if (a.begin != b.begin) return a.begin < b.begin;
  return a.end < b.end;
}

bool adjacent(const Box& a, const Box& b, size_t dim) {
  if (a.end[dim] != b.begin[dim]) return false;
  for (size_t d = 0; d < a.begin.size(); ++d)
    if (d != dim && (a.begin[d] != b.begin[d] || a.end[d] != b.end[d])) return false;
  return true;
}

bool less_along(const Box& a, const Box& b, size_t dim) {
  for (size_t d = 0; d < a.begin.size(); ++d) {
    if (d == dim) continue;
    if (a.begin[d] != b.begin[d]) return a.begin[d] < b.begin[d];
    if (a.end[d] != b.end[d]) return a.end[d] < b.end[d];
  }
  return a.begin[dim] < b.begin[dim];
}

std::vector<Box> merge_boxes(std::vector<Box> boxes) {
  const size_t rank = boxes.empty() ? 0 : boxes[0].begin.size();
  for (size_t dim = rank; dim-- > 0;) {
    std::sort(boxes.begin(), boxes.end(), [dim](const Box& a, const Box& b) { return less_along(a, b, dim); });
    std::vector<Box> merged;
    for (Box& b : boxes) {
      if (!merged.empty() && adjacent(merged.back(), b, dim))
        merged.back().end[dim] = b.end[dim];
      else
        merged.push_back(std::move(b));
    }
    boxes = std::move(merged);
  }
  std::sort(boxes.begin(), boxes.end(), box_less);
  return boxes;
}

int64_t box_bytes(const Box& box, int64_t element_size) {
  return is_empty(box) ? 0 : box.numel() * element_size;
}

Grid::Grid(const Shape& shape, const std::vector<const Box*>& boxes) : cuts_(shape.size()), strides_(shape.size()) {
  HSPMD_CHECK(shape.size() <= kMaxRank, "tensors of rank ", shape.size(), " > ", kMaxRank);
  for (size_t d = 0; d < shape.size(); ++d) {
    std::vector<int64_t>& c = cuts_[d];
    c.reserve(2 * boxes.size() + 2);
    c.push_back(0);
    c.push_back(shape[d]);
    for (const Box* b : boxes) {
      if (is_empty(*b)) continue;
      c.push_back(b->begin[d]);
      c.push_back(b->end[d]);
    }
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
  }
  for (size_t d = shape.size(); d-- > 0;) {
    strides_[d] = num_cells_;
    num_cells_ *= static_cast<int64_t>(cuts_[d].size()) - 1;
  }
}

void Grid::cell_range(const Box& box, Index& lo, Index& hi) const {
  for (size_t d = 0; d < cuts_.size(); ++d) {
    const std::vector<int64_t>& c = cuts_[d];
    auto b = std::lower_bound(c.begin(), c.end(), box.begin[d]);
    auto e = std::lower_bound(c.begin(), c.end(), box.end[d]);
    HSPMD_CHECK(b != c.end() && *b == box.begin[d] && e != c.end() && *e == box.end[d], "box ", to_string(box),
                " is not aligned to the grid");
    lo[d] = b - c.begin();
    hi[d] = e - c.begin();
  }
}

CellLists cell_lists(const Grid& grid, const std::vector<const Box*>& boxes) {
  CellLists lists;
  lists.start.assign(grid.num_cells() + 1, 0);
  for (const Box* b : boxes) grid.for_each_cell(*b, [&](int64_t c) { ++lists.start[c + 1]; });
  for (int64_t c = 0; c < grid.num_cells(); ++c) lists.start[c + 1] += lists.start[c];
  lists.items.resize(lists.start.back());
  std::vector<int64_t> fill(lists.start.begin(), lists.start.end() - 1);
  for (size_t i = 0; i < boxes.size(); ++i)
    grid.for_each_cell(*boxes[i], [&](int64_t c) { lists.items[fill[c]++] = static_cast<int>(i); });
  return lists;
}

CellBox cell_box_of(const Grid& grid, int64_t cell) {
  CellBox c;
  for (size_t d = 0; d < grid.rank(); ++d) {
    c.lo[d] = cell / grid.stride(d);
    c.hi[d] = c.lo[d] + 1;
    cell %= grid.stride(d);
  }
  return c;
}

Box to_box(const Grid& grid, const CellBox& c) {
  const size_t n = grid.rank();
  Box b{Shape(n), Shape(n)};
  for (size_t d = 0; d < n; ++d) {
    b.begin[d] = grid.cuts(d)[c.lo[d]];
    b.end[d] = grid.cuts(d)[c.hi[d]];
  }
  return b;
}

bool cell_adjacent(const CellBox& a, const CellBox& b, size_t dim, size_t n) {
  if (a.hi[dim] != b.lo[dim]) return false;
  for (size_t d = 0; d < n; ++d)
    if (d != dim && (a.lo[d] != b.lo[d] || a.hi[d] != b.hi[d])) return false;
  return true;
}

bool cell_less_along(const CellBox& a, const CellBox& b, size_t dim, size_t n) {
  for (size_t d = 0; d < n; ++d) {
    if (d == dim) continue;
    if (a.lo[d] != b.lo[d]) return a.lo[d] < b.lo[d];
    if (a.hi[d] != b.hi[d]) return a.hi[d] < b.hi[d];
  }
  return a.lo[dim] < b.lo[dim];
}

std::vector<Box> Grid::merge_cells(const std::vector<int64_t>& cells) const {
  const size_t n = cuts_.size();
  std::vector<CellBox> boxes(cells.size());
  for (size_t i = 0; i < cells.size(); ++i) boxes[i] = cell_box_of(*this, cells[i]);
  for (size_t dim = n; dim-- > 0;) {
    std::sort(boxes.begin(), boxes.end(),
              [&](const CellBox& a, const CellBox& b) { return cell_less_along(a, b, dim, n); });
    size_t kept = 0;
    for (size_t i = 0; i < boxes.size(); ++i) {
      if (kept > 0 && cell_adjacent(boxes[kept - 1], boxes[i], dim, n)) boxes[kept - 1].hi[dim] = boxes[i].hi[dim];
      else boxes[kept++] = boxes[i];
    }
    boxes.resize(kept);
  }
  std::vector<Box> out;
  out.reserve(boxes.size());
  for (const CellBox& c : boxes) out.push_back(to_box(*this, c));
  std::sort(out.begin(), out.end(), box_less);
  return out;
}

int64_t Grid::cell_numel(int64_t cell) const {
  int64_t n = 1;
  for (size_t d = 0; d < cuts_.size(); ++d) {
    const int64_t i = cell / strides_[d];
    cell %= strides_[d];
    n *= cuts_[d][i + 1] - cuts_[d][i];
  }
  return n;
}

Box Grid::cell_box(int64_t cell) const {
  Box box{Shape(cuts_.size()), Shape(cuts_.size())};
  for (size_t d = 0; d < cuts_.size(); ++d) {
    const int64_t i = cell / strides_[d];
    cell %= strides_[d];
    box.begin[d] = cuts_[d][i];
    box.end[d] = cuts_[d][i + 1];
  }
  return box;
}

}  // namespace hspmd::resolve_internal

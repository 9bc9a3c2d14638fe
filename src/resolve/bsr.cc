// The BSR table and scheme (paper §5.3; docs/resolver.md, rule 3).
#include <algorithm>
#include <map>

#include "hspmd/core/error.h"
#include "resolve/internal.h"

namespace hspmd::resolve_internal {
namespace {

// The scheme's choice among the owners of one cell for `needer`: fastest
// link, then fewest bytes sent so far, then lowest rank.
int pick_owner(const CellLists& owners_of, int64_t cell, const std::vector<Holding>& owners, int needer,
               const std::map<int, int64_t>& sent, const Topology& topology) {
  int best = -1;
  double best_bw = -1;
  int64_t best_sent = 0;
  for (const int* o = owners_of.begin(cell); o != owners_of.end(cell); ++o) {
    const int rank = owners[*o].rank;
    const double bw = topology.bandwidth(rank, needer);
    auto it = sent.find(rank);
    const int64_t s = it == sent.end() ? 0 : it->second;
    const bool better = bw > best_bw || (bw == best_bw && (s < best_sent || (s == best_sent && rank < best)));
    if (best < 0 || better) {
      best = rank;
      best_bw = bw;
      best_sent = s;
    }
  }
  return best;
}

}  // namespace

std::vector<Move> bsr_moves(const Shape& shape, const std::vector<Holding>& owners,
                            const std::vector<Holding>& needers, const Topology& topology,
                            int64_t element_size) {
  std::vector<const Box*> owned, needed;
  for (const Holding& h : owners) owned.push_back(&h.box);
  for (const Holding& h : needers) needed.push_back(&h.box);
  std::vector<const Box*> all = owned;
  all.insert(all.end(), needed.begin(), needed.end());
  const Grid grid(shape, all);
  const CellLists owners_of = cell_lists(grid, owned);
  const CellLists needers_of = cell_lists(grid, needed);
  std::map<int, int64_t> sent;                                 // owner rank -> bytes so far
  std::map<std::pair<int, int>, std::vector<int64_t>> by_pair;  // (from, to) -> cells
  for (int64_t cell = 0; cell < grid.num_cells(); ++cell) {
    if (needers_of.size(cell) == 0) continue;
    const int64_t bytes = grid.cell_numel(cell) * element_size;
    for (const int* n = needers_of.begin(cell); n != needers_of.end(cell); ++n) {
      const int needer = needers[*n].rank;
      const bool owns = std::any_of(owners_of.begin(cell), owners_of.end(cell),
                                    [&](int o) { return owners[o].rank == needer; });
      const int from = owns ? needer : pick_owner(owners_of, cell, owners, needer, sent, topology);
      HSPMD_CHECK(from >= 0, "no owner holds slice ", to_string(grid.cell_box(cell)), " needed by rank ", needer);
      if (from != needer) sent[from] += bytes;
      by_pair[{from, needer}].push_back(cell);
    }
  }
  std::vector<Move> moves;
  for (auto& [pair, cells] : by_pair)
    for (Box& b : grid.merge_cells(cells)) moves.push_back(Move{pair.first, pair.second, std::move(b), false});
  return moves;
}

}  // namespace hspmd::resolve_internal

// The switch planner (docs/switching.md): each state tensor cut into its
// finest slices, one source per (slice, needer) — a keep, a sender chosen by
// the algorithm, or a checkpoint read — then rounds of batched send/receive
// with one message per (sender, receiver) pair, their link volumes and the
// predicted time. Works on boxes and cells, never on elements.
#include <algorithm>
#include <numeric>
#include <map>
#include <optional>
#include <tuple>

#include "hspmd/core/error.h"
#include "hspmd/plan/strategy.h"
#include "hspmd/plan/switch.h"
#include "resolve/internal.h"

namespace hspmd {
namespace {

using resolve_internal::CellLists;
using resolve_internal::Grid;

// ---- The finest slices of one tensor ----------------------------------------

// Every holding inside its shape, every rank inside the topology.
void check_holdings(const StateTensor& t, const std::vector<StateHolding>& hs, const Shape& shape, int world,
                    const char* role) {
  const Box whole = resolve_internal::whole_box(shape);
  for (const StateHolding& h : hs) {
    if (h.rank < 0 || h.rank >= world)
      fail("[switch] tensor '", t.name(), "': ", role, " rank ", h.rank, " is outside the topology of ", world,
           " ranks");
    if (h.box.begin.size() != shape.size() || h.box.end.size() != shape.size() ||
        !resolve_internal::contains(whole, h.box))
      fail("[switch] tensor '", t.name(), "': ", role, " box ", to_string(h.box), " of rank ", h.rank,
           " is outside its shape ", shape_str(shape));
  }
}

void check_tensor(const StateTensor& t, int world) {
  bool same = t.shape.size() == t.source_shape.size() && !t.shape.empty();
  for (size_t d = 1; same && d < t.shape.size(); ++d) same = t.shape[d] == t.source_shape[d];
  if (!same)
    fail("[switch] tensor '", t.name(), "': source shape ", shape_str(t.source_shape), " and shape ",
         shape_str(t.shape), " may differ along dim 0 only");
  HSPMD_CHECK(t.shape.size() <= Grid::kMaxRank, "tensor '", t.name(), "' of rank ", t.shape.size());
  check_holdings(t, t.owners, t.source_shape, world, "owner");
  check_holdings(t, t.needers, t.shape, world, "needer");
}

void sort_by_rank(std::vector<StateHolding>& hs) {
  std::sort(hs.begin(), hs.end(), [](const StateHolding& a, const StateHolding& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.slot < b.slot;
  });
}

// The grid of one tensor: its available owners (boxes cut to the
// destination shape) and needers, both sorted by (rank, slot), and which
// cells the source shape covers (the others are zeros: nothing moves).
struct TensorCells {
  std::vector<StateHolding> owners, needers;
  std::optional<Grid> grid;
  CellLists owners_of, needers_of;
  std::vector<char> in_source;
};

TensorCells make_cells(const StateTensor& t, const std::set<int>& lost) {
  TensorCells c;
  const Box dst = resolve_internal::whole_box(t.shape);
  for (const StateHolding& h : t.owners)
    if (!lost.count(h.rank))
      if (auto b = resolve_internal::intersect(h.box, dst)) c.owners.push_back(StateHolding{h.rank, *b, h.slot});
  for (const StateHolding& h : t.needers)
    if (!resolve_internal::is_empty(h.box)) c.needers.push_back(h);
  sort_by_rank(c.owners);
  sort_by_rank(c.needers);
  Box source = dst;
  source.end[0] = std::min(t.shape[0], t.source_shape[0]);
  std::vector<const Box*> owned, needed;
  for (const StateHolding& h : c.owners) owned.push_back(&h.box);
  for (const StateHolding& h : c.needers) needed.push_back(&h.box);
  std::vector<const Box*> all = owned;
  all.insert(all.end(), needed.begin(), needed.end());
  all.push_back(&source);
  c.grid.emplace(t.shape, all);
  c.owners_of = resolve_internal::cell_lists(*c.grid, owned);
  c.needers_of = resolve_internal::cell_lists(*c.grid, needed);
  c.in_source.assign(c.grid->num_cells(), 0);
  if (!resolve_internal::is_empty(source)) c.grid->for_each_cell(source, [&](int64_t cell) { c.in_source[cell] = 1; });
  return c;
}

// Calls f(cell, rank) once per (cell inside the source, rank needing it):
// a rank needing a cell in two slots receives it once.
template <typename F>
void for_each_need(const TensorCells& c, F&& f) {
  for (int64_t cell = 0; cell < c.grid->num_cells(); ++cell) {
    if (!c.in_source[cell]) continue;
    int prev = -1;
    for (const int* n = c.needers_of.begin(cell); n != c.needers_of.end(cell); ++n) {
      const int rank = c.needers[*n].rank;
      if (rank != prev) f(cell, rank);
      prev = rank;
    }
  }
}

// The slot `rank` holds `cell` in (the FP32 master before the compute copy),
// or -1 when it holds it in none.
int owned_slot(const TensorCells& c, int64_t cell, int rank) {
  int slot = -1;
  for (const int* o = c.owners_of.begin(cell); o != c.owners_of.end(cell); ++o)
    if (c.owners[*o].rank == rank) slot = std::max(slot, static_cast<int>(c.owners[*o].slot));
  return slot;
}

int64_t element_size(const StateTensor& t) { return static_cast<int64_t>(dtype_size(t.dtype)); }

// ---- Choosing senders --------------------------------------------------------

// One (cell, needer) that must come from another rank.
struct Demand {
  int tensor = 0;
  int64_t cell = 0;
  int rank = 0;
  int64_t bytes = 0;
};

double intra_bytes_per_s(const Topology& t, int r) { return t.device_type(r).intra_node_gbps * 1e9; }
double inter_bytes_per_s(const Topology& t, int r) { return t.device_type(r).inter_node_gbps * 1e9; }

// The algorithms' sender rules. Link load: seconds of sending so far per
// rank and link class (bytes / that class's bandwidth of the rank's device).
class SenderChooser {
 public:
  SenderChooser(SwitchAlgorithm algorithm, const Topology& topology)
      : algorithm_(algorithm), topology_(topology), intra_(topology.world_size()), inter_(topology.world_size()) {}

  void reset() {
    std::fill(intra_.begin(), intra_.end(), 0.0);
    std::fill(inter_.begin(), inter_.end(), 0.0);
  }

  // Naive: the lowest-ranked owner. Otherwise same-node owners first, then
  // the least link load in the class the slice would take, then the lowest
  // rank; the chosen owner's load grows by the slice.
  int choose(const TensorCells& c, const Demand& d) {
    int best = -1;
    std::tuple<bool, double, int> best_key;  // (other node, load, rank)
    for (const int* o = c.owners_of.begin(d.cell); o != c.owners_of.end(d.cell); ++o) {
      const int r = c.owners[*o].rank;
      if (algorithm_ == SwitchAlgorithm::kNaive) return r;  // owners sorted by rank
      const bool local = topology_.same_node(r, d.rank);
      const std::tuple<bool, double, int> key{!local, load(r, local), r};
      if (best < 0 || key < best_key) best = r, best_key = key;
    }
    if (best < 0) return best;
    const bool local = !std::get<0>(best_key);
    load(best, local) += static_cast<double>(d.bytes) /
                         (local ? intra_bytes_per_s(topology_, best) : inter_bytes_per_s(topology_, best));
    return best;
  }

 private:
  double& load(int rank, bool local) { return local ? intra_[rank] : inter_[rank]; }

  SwitchAlgorithm algorithm_;
  const Topology& topology_;
  std::vector<double> intra_, inter_;
};

// Where each needed cell of one tensor comes from.
struct TensorPieces {
  std::map<std::tuple<int, int, int>, std::vector<int64_t>> moves;  // (sender, receiver, src slot) -> cells
  std::map<std::pair<int, int>, std::vector<int64_t>> keeps;        // (rank, slot) -> cells
  std::map<int, std::vector<int64_t>> reads;                        // rank -> cells
};

[[noreturn]] void no_source(const StateTensor& t, const TensorCells& c, int64_t cell, const std::set<int>& lost) {
  const std::string ranks = lost.empty() ? "none" : format_ranks(std::vector<int>(lost.begin(), lost.end()));
  fail("[switch] tensor '", t.name(), "': slice ", to_string(c.grid->cell_box(cell)),
       " is held by no available rank (lost: ", ranks, ") and there is no checkpoint");
}

// Keeps and checkpoint reads; everything else becomes a Demand.
void classify(const std::vector<StateTensor>& tensors, const std::vector<TensorCells>& cells, const SwitchOptions& o,
              std::vector<TensorPieces>& pieces, std::vector<Demand>& demands) {
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorCells& c = cells[t];
    for_each_need(c, [&](int64_t cell, int rank) {
      const int slot = owned_slot(c, cell, rank);  // lost ranks own nothing
      if (slot >= 0) {
        pieces[t].keeps[{rank, slot}].push_back(cell);
      } else if (c.owners_of.size(cell) > 0) {
        demands.push_back(Demand{static_cast<int>(t), cell, rank, c.grid->cell_numel(cell) * element_size(tensors[t])});
      } else if (o.have_checkpoint) {
        pieces[t].reads[rank].push_back(cell);
      } else {
        no_source(tensors[t], c, cell, o.lost_ranks);
      }
    });
  }
}

// Senders in the order of the demands (tensor by tensor, cells row-major,
// needers by rank); per-tensor starts its load counters afresh per tensor.
void assign_senders(const std::vector<TensorCells>& cells, const Topology& topology, SwitchAlgorithm algorithm,
                    const std::vector<Demand>& demands, std::vector<TensorPieces>& pieces) {
  SenderChooser chooser(algorithm, topology);
  int tensor = -1;
  for (const Demand& d : demands) {
    if (algorithm == SwitchAlgorithm::kPerTensor && d.tensor != tensor) chooser.reset();
    tensor = d.tensor;
    const TensorCells& c = cells[d.tensor];
    const int from = chooser.choose(c, d);
    HSPMD_CHECK(from >= 0 && from != d.rank, "no sender for a demanded slice");
    pieces[d.tensor].moves[{from, d.rank, owned_slot(c, d.cell, from)}].push_back(d.cell);
  }
}

// ---- Rounds -------------------------------------------------------------------

// naive, per-tensor: one round per tensor. fused: consecutive groups packed
// while the round's tensors stay within bucket_bytes (0: one round).
std::vector<std::vector<int>> round_tensors(const std::vector<StateTensor>& tensors, const SwitchOptions& o) {
  std::vector<std::vector<int>> rounds;
  if (o.algorithm != SwitchAlgorithm::kFused) {
    for (size_t t = 0; t < tensors.size(); ++t) rounds.push_back({static_cast<int>(t)});
    return rounds;
  }
  int64_t round_bytes = 0;
  for (size_t begin = 0, end = 0; begin < tensors.size(); begin = end) {
    int64_t block = 0;
    for (end = begin; end < tensors.size() && tensors[end].group == tensors[begin].group; ++end)
      block += shape_numel(tensors[end].shape) * element_size(tensors[end]);
    const bool fits = o.bucket_bytes == 0 || round_bytes + block <= o.bucket_bytes;
    if (rounds.empty() || !fits) {
      rounds.emplace_back();
      round_bytes = 0;
    }
    for (size_t t = begin; t < end; ++t) rounds.back().push_back(static_cast<int>(t));
    round_bytes += block;
  }
  return rounds;
}

int64_t slices_bytes(const std::vector<SliceRef>& slices, const std::vector<StateTensor>& tensors) {
  int64_t bytes = 0;
  for (const SliceRef& s : slices) bytes += s.box.numel() * element_size(tensors[s.tensor]);
  return bytes;
}

void add_message(SwitchPlan& plan, SwitchRound& round, int from, int to, std::vector<SliceRef> slices,
                 const Topology& topology) {
  const int64_t bytes = slices_bytes(slices, plan.tensors);
  round.ranks[to].recvs.push_back(SwitchMessage{from, slices, bytes});
  round.ranks[from].sends.push_back(SwitchMessage{to, std::move(slices), bytes});
  RankSwitchStats& s = plan.stats[from];
  RankSwitchStats& r = plan.stats[to];
  if (topology.same_node(from, to)) {
    s.intra_sent += bytes;
    r.intra_received += bytes;
  } else {
    s.inter_sent += bytes;
    r.inter_received += bytes;
  }
  ++s.messages_sent;
  ++r.messages_received;
}

// One round: the keeps, reads and messages of its tensors, one message per
// (sender, receiver) pair with its slices in (tensor, slot, box) order.
SwitchRound make_round(SwitchPlan& plan, const std::vector<int>& members, const std::vector<TensorCells>& cells,
                       const std::vector<TensorPieces>& pieces, const Topology& topology) {
  SwitchRound round;
  round.tensors = members;
  std::map<std::pair<int, int>, std::vector<SliceRef>> messages;
  for (int t : members) {
    const Grid& grid = *cells[t].grid;
    for (const StateHolding& h : cells[t].needers) round.ranks[h.rank];
    for (const auto& [key, cs] : pieces[t].keeps)
      for (Box& b : grid.merge_cells(cs))
        round.ranks[key.first].keeps.push_back(SliceRef{t, std::move(b), static_cast<StateSlot>(key.second)});
    for (const auto& [rank, cs] : pieces[t].reads)
      for (Box& b : grid.merge_cells(cs)) {
        plan.stats[rank].checkpoint_read += b.numel() * element_size(plan.tensors[t]);
        round.ranks[rank].checkpoint.push_back(SliceRef{t, std::move(b), StateSlot::kParam});
      }
    for (const auto& [key, cs] : pieces[t].moves) {
      const auto [from, to, slot] = key;
      for (Box& b : grid.merge_cells(cs))
        messages[{from, to}].push_back(SliceRef{t, std::move(b), static_cast<StateSlot>(slot)});
    }
  }
  for (auto& [pair, slices] : messages) add_message(plan, round, pair.first, pair.second, std::move(slices), topology);
  return round;
}

// ---- Costs ------------------------------------------------------------------

double link_seconds(int64_t intra, int64_t inter, const Topology& topology, int r) {
  return std::max(static_cast<double>(intra) / intra_bytes_per_s(topology, r),
                  static_cast<double>(inter) / inter_bytes_per_s(topology, r));
}

double worst_link_seconds(const std::vector<int64_t>& intra, const std::vector<int64_t>& inter,
                          const Topology& topology) {
  double worst = 0;
  for (int r = 0; r < topology.world_size(); ++r)
    worst = std::max(worst, link_seconds(intra[r], inter[r], topology, r));
  return worst;
}

double predicted_seconds(const std::vector<RankSwitchStats>& stats, const Topology& topology) {
  double worst = 0;
  for (size_t r = 0; r < stats.size(); ++r) {
    const RankSwitchStats& s = stats[r];
    worst = std::max(worst, link_seconds(std::max(s.intra_sent, s.intra_received),
                                         std::max(s.inter_sent, s.inter_received), topology, static_cast<int>(r)));
  }
  return worst;
}

// Per rank, the most of any round's new holdings plus send and receive buffers.
std::vector<int64_t> round_peaks(const SwitchPlan& plan, int world) {
  std::vector<int64_t> peak(world, 0);
  for (const SwitchRound& round : plan.rounds) {
    std::vector<int64_t> bytes(world, 0);
    for (int t : round.tensors)
      for (const StateHolding& h : plan.tensors[t].needers)
        bytes[h.rank] += h.box.numel() * element_size(plan.tensors[t]);
    for (const auto& [rank, rr] : round.ranks) {
      for (const SwitchMessage& m : rr.sends) bytes[rank] += m.bytes;
      for (const SwitchMessage& m : rr.recvs) bytes[rank] += m.bytes;
    }
    for (int r = 0; r < world; ++r) peak[r] = std::max(peak[r], bytes[r]);
  }
  return peak;
}

void check_lost(const std::set<int>& lost, int world) {
  for (int r : lost)
    if (r < 0 || r >= world) fail("[switch] lost rank ", r, " is outside the topology of ", world, " ranks");
}

std::vector<TensorCells> all_cells(const std::vector<StateTensor>& tensors, const Topology& topology,
                                   const std::set<int>& lost) {
  check_lost(lost, topology.world_size());
  std::vector<TensorCells> cells;
  cells.reserve(tensors.size());
  for (const StateTensor& t : tensors) {
    check_tensor(t, topology.world_size());
    cells.push_back(make_cells(t, lost));
  }
  return cells;
}

// The ranks that may send `cell` to `rank` under the same-node rule: its
// same-node owners when there are any (`*local` true), else every owner;
// ascending, each once.
std::vector<int> candidate_senders(const TensorCells& c, int64_t cell, int rank, const Topology& topology,
                                   bool* local) {
  std::vector<int> near, all;
  for (const int* o = c.owners_of.begin(cell); o != c.owners_of.end(cell); ++o) {
    const int r = c.owners[*o].rank;
    if (!all.empty() && all.back() == r) continue;  // owners sorted by (rank, slot)
    all.push_back(r);
    if (topology.same_node(r, rank)) near.push_back(r);
  }
  *local = !near.empty();
  return *local ? near : all;
}

}  // namespace

SwitchPlan plan_switch(std::vector<StateTensor> tensors, const Topology& topology, const SwitchOptions& options) {
  const std::vector<TensorCells> cells = all_cells(tensors, topology, options.lost_ranks);
  std::vector<TensorPieces> pieces(tensors.size());
  std::vector<Demand> demands;
  classify(tensors, cells, options, pieces, demands);
  assign_senders(cells, topology, options.algorithm, demands, pieces);
  SwitchPlan plan;
  plan.algorithm = options.algorithm;
  plan.tensors = std::move(tensors);
  plan.stats.assign(topology.world_size(), RankSwitchStats{});
  for (const std::vector<int>& members : round_tensors(plan.tensors, options))
    plan.rounds.push_back(make_round(plan, members, cells, pieces, topology));
  plan.predicted_s = predicted_seconds(plan.stats, topology);
  plan.round_peak_bytes = round_peaks(plan, topology.world_size());
  return plan;
}

double switch_lower_bound(const std::vector<StateTensor>& tensors, const Topology& topology,
                          const std::set<int>& lost_ranks) {
  const std::vector<TensorCells> cells = all_cells(tensors, topology, lost_ranks);
  std::vector<int64_t> intra(topology.world_size(), 0), inter(topology.world_size(), 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorCells& c = cells[t];
    for_each_need(c, [&](int64_t cell, int rank) {
      if (owned_slot(c, cell, rank) >= 0) return;
      bool any = false, local = false;
      for (const int* o = c.owners_of.begin(cell); o != c.owners_of.end(cell); ++o) {
        any = true;
        local = local || topology.same_node(c.owners[*o].rank, rank);
      }
      const int64_t bytes = c.grid->cell_numel(cell) * element_size(tensors[t]);
      if (local)
        intra[rank] += bytes;
      else if (any)
        inter[rank] += bytes;
    });
  }
  return worst_link_seconds(intra, inter, topology);
}

double switch_sender_bound(const std::vector<StateTensor>& tensors, const Topology& topology,
                           const std::set<int>& lost_ranks) {
  const std::vector<TensorCells> cells = all_cells(tensors, topology, lost_ranks);
  std::map<std::vector<int>, int64_t> by_senders[2];  // per link class (inter, intra): candidate set -> bytes
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorCells& c = cells[t];
    for_each_need(c, [&](int64_t cell, int rank) {
      if (c.owners_of.size(cell) == 0 || owned_slot(c, cell, rank) >= 0) return;
      bool local = false;
      std::vector<int> senders = candidate_senders(c, cell, rank, topology, &local);
      by_senders[local][std::move(senders)] += c.grid->cell_numel(cell) * element_size(tensors[t]);
    });
  }
  double worst = 0;
  for (int local = 0; local < 2; ++local)
    for (const auto& [set, unused] : by_senders[local]) {
      int64_t bytes = 0;  // every slice whose candidates all lie in `set`
      for (const auto& [other, b] : by_senders[local])
        if (std::includes(set.begin(), set.end(), other.begin(), other.end())) bytes += b;
      double rate = 0;
      for (int r : set) rate += local ? intra_bytes_per_s(topology, r) : inter_bytes_per_s(topology, r);
      worst = std::max(worst, static_cast<double>(bytes) / rate);
    }
  return worst;
}

namespace {

// Bytes of `rank`'s holdings in a list (each holding is one local array).
int64_t held_bytes(const std::vector<StateHolding>& list, int rank) {
  int64_t n = 0;
  for (const StateHolding& h : list)
    if (h.rank == rank) n += h.box.numel() * 4;
  return n;
}

}  // namespace

int64_t switch_memory_bound(const SwitchPlan& sp, int rank) {
  std::vector<int64_t> old_b(sp.rounds.size()), new_b(sp.rounds.size()), work(sp.rounds.size());
  for (size_t r = 0; r < sp.rounds.size(); ++r) {
    for (int t : sp.rounds[r].tensors) {
      old_b[r] += held_bytes(sp.tensors[t].owners, rank);
      new_b[r] += held_bytes(sp.tensors[t].needers, rank);
    }
    auto it = sp.rounds[r].ranks.find(rank);
    if (it == sp.rounds[r].ranks.end()) continue;
    int64_t temp = 0;  // keeps and checkpoint reads go through one temporary at a time
    for (const auto* list : {&it->second.keeps, &it->second.checkpoint})
      for (const SliceRef& s : *list) temp = std::max(temp, s.box.numel() * 4);
    for (const auto* list : {&it->second.sends, &it->second.recvs})
      for (const SwitchMessage& m : *list) work[r] += m.bytes;
    work[r] += temp;
  }
  const int64_t old_total = std::accumulate(old_b.begin(), old_b.end(), int64_t{0});
  const int64_t new_total = std::accumulate(new_b.begin(), new_b.end(), int64_t{0});
  int64_t peak = 0, done_new = 0, left_old = old_total;
  for (size_t r = 0; r < sp.rounds.size(); ++r) {  // during round r: rounds before moved, r both, later old
    peak = std::max(peak, done_new + new_b[r] + left_old + work[r]);
    done_new += new_b[r];
    left_old -= old_b[r];
  }
  return std::max<int64_t>(0, peak - std::max(old_total, new_total));
}

}  // namespace hspmd

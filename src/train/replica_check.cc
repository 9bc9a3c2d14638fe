// Loaded weights agree among the ranks holding the same elements (see
// replica_check.h).
#include "train/replica_check.h"

#include <algorithm>
#include <bit>
#include <optional>
#include <sstream>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/models/model.h"
#include "hspmd/plan/switch.h"
#include "hspmd/train/trainer.h"

namespace hspmd {

namespace {

// The boxes of `param` (global `shape`, padded) that `rank` fills from the
// full array: its parameter slot and, under ZeRO, its master slot (as
// TrainingState's constructor places them), cut to `extent` (the given
// array's shape: padding rows are zeros on every rank).
std::vector<Box> held_boxes(const AnnotationPlan& plan, const std::string& param, const Shape& shape,
                            const Shape& extent, int rank) {
  std::vector<Box> out;
  for (StateSlot s : {StateSlot::kParam, StateSlot::kMaster}) {
    const Annotation* a = slot_layout(plan, param, s);
    if (!a) continue;
    std::optional<Box> box = local_box(*a, shape, rank);
    if (!box) continue;
    bool empty = false;
    for (size_t d = 0; d < box->begin.size(); ++d) {
      box->end[d] = std::min(box->end[d], extent[d]);
      box->begin[d] = std::min(box->begin[d], box->end[d]);
      empty = empty || box->begin[d] >= box->end[d];
    }
    if (!empty && std::find(out.begin(), out.end(), *box) == out.end()) out.push_back(*box);
  }
  return out;
}

bool inside(const Box& cell, const Box& box) {
  for (size_t d = 0; d < cell.begin.size(); ++d)
    if (cell.begin[d] < box.begin[d] || cell.end[d] > box.end[d]) return false;
  return true;
}

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t finalize(uint64_t h) {  // splitmix64's
  h ^= h >> 30;
  h *= 0xBF58476D1CE4E5B9ULL;
  h ^= h >> 27;
  h *= 0x94D049BB133111EBULL;
  return h ^ (h >> 31);
}

}  // namespace

std::vector<SharedCell> shared_weight_cells(const AnnotationPlan& plan, int world_size,
                                            const std::map<std::string, Shape>& array_shapes) {
  std::vector<SharedCell> out;
  const auto params = model_parameter_shapes(plan.model);
  for (size_t t = 0; t < params.size(); ++t) {
    const auto& [name, shape] = params[t];
    const auto given = array_shapes.find(name);
    if (given == array_shapes.end() || given->second.size() != shape.size()) continue;  // validated before
    const Shape& extent = given->second;
    std::vector<std::vector<Box>> held(world_size);
    int holders = 0;
    for (int r = 0; r < world_size; ++r) {
      held[r] = held_boxes(plan, name, shape, extent, r);
      holders += held[r].empty() ? 0 : 1;
    }
    if (holders < 2) continue;
    // The grid: every holder's box boundaries along every dim.
    const size_t n = shape.size();
    std::vector<std::vector<int64_t>> cuts(n);
    for (size_t d = 0; d < n; ++d) {
      cuts[d] = {0, extent[d]};
      for (const auto& boxes : held)
        for (const Box& b : boxes) {
          cuts[d].push_back(b.begin[d]);
          cuts[d].push_back(b.end[d]);
        }
      std::sort(cuts[d].begin(), cuts[d].end());
      cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
      if (cuts[d].size() < 2) cuts[d] = {0, 0};
    }
    std::vector<size_t> at(n, 0);  // the cell's interval along each dim
    while (true) {
      Box cell;
      cell.begin.resize(n);
      cell.end.resize(n);
      bool empty = false;
      for (size_t d = 0; d < n; ++d) {
        cell.begin[d] = cuts[d][at[d]];
        cell.end[d] = cuts[d][at[d] + 1];
        empty = empty || cell.begin[d] >= cell.end[d];
      }
      if (!empty) {
        SharedCell c{t, cell, {}};
        for (int r = 0; r < world_size; ++r)
          for (const Box& b : held[r])
            if (inside(cell, b)) {
              c.holders.push_back(r);
              break;
            }
        if (c.holders.size() >= 2) out.push_back(std::move(c));
      }
      size_t d = n;  // the next cell, the last dim fastest
      while (d > 0 && ++at[d - 1] + 1 >= cuts[d - 1].size()) at[--d] = 0;
      if (d == 0) break;
    }
  }
  return out;
}

uint64_t box_checksum(const NDArray& array, const Box& box) {
  const size_t n = box.begin.size();
  const float* data = array.host_data<float>("load_state_dict checksum");
  const Shape& shape = array.shape();
  uint64_t h = 0x9E3779B97F4A7C15ULL;
  int64_t count = 0;
  auto mix_run = [&](const float* p, int64_t len) {
    for (int64_t i = 0; i < len; ++i) {
      uint32_t u = std::bit_cast<uint32_t>(p[i]);
      if (u == 0x80000000u) u = 0;  // -0.0 trains as +0.0
      h ^= static_cast<uint64_t>(u) * 0xC2B2AE3D27D4EB4FULL;
      h = rotl(h, 31) * 0x9E3779B97F4A7C15ULL;
    }
    count += len;
  };
  if (n == 0) {
    mix_run(data, 1);
    return finalize(h ^ static_cast<uint64_t>(count));
  }
  Shape strides(n, 1);
  for (size_t d = n - 1; d > 0; --d) strides[d - 1] = strides[d] * shape[d];
  std::vector<int64_t> at(box.begin.begin(), box.begin.end());
  const int64_t run = box.end[n - 1] - box.begin[n - 1];
  while (true) {
    int64_t offset = 0;
    for (size_t d = 0; d < n; ++d) offset += at[d] * strides[d];
    mix_run(data + offset, run);
    size_t d = n - 1;  // the next run: the dims before the last
    while (d > 0 && ++at[d - 1] >= box.end[d - 1]) {
      at[d - 1] = box.begin[d - 1];
      --d;
    }
    if (d == 0) break;
  }
  return finalize(h ^ static_cast<uint64_t>(count));
}

void check_weight_replicas(const AnnotationPlan& plan, Communicator& world,
                           const std::map<std::string, NDArray>& full, const std::string& source) {
  if (world.size() < 2) return;
  std::map<std::string, Shape> shapes;
  for (const auto& [name, array] : full) shapes[name] = array.shape();
  const std::vector<SharedCell> cells = shared_weight_cells(plan, world.size(), shapes);
  const auto params = model_parameter_shapes(plan.model);
  const int me = world.rank();
  // Every rank knows every rank's cells: the counts of the all-gather, and
  // each rank's checksums in the cells' order.
  std::vector<int64_t> counts(world.size(), 0);
  std::vector<int64_t> mine;
  std::map<std::string, NDArray> contiguous;
  for (const SharedCell& c : cells) {
    for (int r : c.holders) ++counts[r];
    if (!std::binary_search(c.holders.begin(), c.holders.end(), me)) continue;
    const std::string& name = params[c.tensor].first;
    auto it = contiguous.find(name);
    if (it == contiguous.end()) it = contiguous.emplace(name, full.at(name).contiguous()).first;
    mine.push_back(static_cast<int64_t>(box_checksum(it->second, c.box)));
  }
  std::vector<int64_t> offsets(world.size() + 1, 0);
  for (int r = 0; r < world.size(); ++r) offsets[r + 1] = offsets[r] + counts[r];
  if (offsets.back() == 0) return;  // no element held twice (the same count on every rank)
  std::vector<int64_t> all(static_cast<size_t>(offsets.back()));
  world.all_gather(mine.data(), all.data(), counts);
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);  // each rank's next checksum
  for (const SharedCell& c : cells) {
    const int first = c.holders.front();
    const int64_t want = all[next[first]];
    int other = -1;
    for (int r : c.holders)
      if (all[next[r]++] != want && other < 0) other = r;
    if (other < 0) continue;
    std::vector<int> also;  // the other holders, when there are more than the two named
    for (int r : c.holders)
      if (r != first && r != other) also.push_back(r);
    std::ostringstream more;
    for (size_t i = 0; i < also.size(); ++i)
      more << (i ? ", " : also.size() > 1 ? " (also held by ranks " : " (also held by rank ") << also[i];
    if (!also.empty()) more << ")";
    throw SetupFailure(
        "[weights] " + source + ": " + params[c.tensor].first + " differs between ranks " + std::to_string(first) +
            " and " + std::to_string(other) + ", which both hold its elements " + to_string(c.box) +
            " under the plan" + more.str() +
            "; every rank must pass the same values wherever it holds the tensor; nothing loaded",
        me == first);
  }
}

}  // namespace hspmd

#include "hspmd/annotation/annotation.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <sstream>

#include "hspmd/core/error.h"

namespace hspmd {
namespace {

// Throws "[annotation] tensor '<name>': <args>" ("[annotation] <args>" when
// the caller has no tensor name, as in local_box).
template <typename... Args>
[[noreturn]] void fail_tensor(const std::string& name, const Args&... args) {
  if (name.empty()) fail("[annotation] ", args...);
  fail("[annotation] tensor '", name, "': ", args...);
}

std::string join_ints(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

std::string join_keys(const std::vector<int>& keys) {
  std::string s = "[";
  for (size_t i = 0; i < keys.size(); ++i) s += (i ? ", " : "") + key_name(keys[i]);
  return s + "]";
}

// Whether every rank is in [0, world_size) and listed once in all: one sort
// instead of a tree per rank.
bool ranks_distinct_in_world(const Annotation& a, int world_size) {
  std::vector<int> all;
  for (const Subgroup& g : a.subgroups) {
    if (g.devices.ranks.empty()) return false;
    all.insert(all.end(), g.devices.ranks.begin(), g.devices.ranks.end());
  }
  std::sort(all.begin(), all.end());
  return all.front() >= 0 && all.back() < world_size && std::adjacent_find(all.begin(), all.end()) == all.end();
}

void check_ranks(const Annotation& a, const std::string& name, int world_size) {
  if (ranks_distinct_in_world(a, world_size)) return;
  std::map<int, int> owner;  // rank -> subgroup; finds the first problem in listing order
  for (int i = 0; i < a.hsize(); ++i) {
    const std::vector<int>& ranks = a.subgroups[i].devices.ranks;
    if (ranks.empty()) fail_tensor(name, "subgroup ", i, " has an empty device group");
    std::set<int> seen;
    for (int r : ranks) {
      if (r < 0 || r >= world_size)
        fail_tensor(name, "subgroup ", i, ": rank ", r, " is outside the world [0, ", world_size, ")");
      if (!seen.insert(r).second) fail_tensor(name, "subgroup ", i, " lists rank ", r, " twice");
      auto [it, fresh] = owner.emplace(r, i);
      if (!fresh) fail_tensor(name, "subgroups ", it->second, " and ", i, " share rank ", r);
    }
  }
}

void check_states(const DistStates& s, int i, int group_size, const std::string& name,
                  int tensor_rank, bool is_parameter) {
  for (auto [key, n] : s.degrees) {
    if (key < kPartial) fail_tensor(name, "subgroup ", i, ": invalid key ", key);
    if (key >= tensor_rank)
      fail_tensor(name, "subgroup ", i, ": ", key_name(key), " is outside the tensor's rank ", tensor_rank);
    if (n <= 0) fail_tensor(name, "subgroup ", i, ": ", key_name(key), " has degree ", n, "; degrees must be positive");
  }
  if (s.device_count() != group_size)
    fail_tensor(name, "subgroup ", i, ": degrees multiply to ", s.device_count(), " but the device group has ",
                group_size, " ranks");
  std::set<int> listed;
  for (int key : s.order) {
    if (!listed.insert(key).second) fail_tensor(name, "subgroup ", i, ": order lists ", key_name(key), " twice");
    if (s.degree(key) <= 1)
      fail_tensor(name, "subgroup ", i, ": order lists ", key_name(key), " whose degree is 1");
  }
  for (auto [key, n] : s.degrees)
    if (n > 1 && !listed.count(key))
      fail_tensor(name, "subgroup ", i, ": order ", join_keys(s.order), " misses ", key_name(key), " (degree ", n, ")");
  if (is_parameter && s.has_partial())
    fail_tensor(name, "subgroup ", i, ": a parameter or optimizer state cannot be partial");
}

// Sizes of the top-tier parts along hdim >= 0 (checked), one per subgroup.
std::vector<int64_t> resolve_part_sizes(const Annotation& a, const std::string& name, int64_t dim_size,
                                        const std::vector<int64_t>& part_sizes) {
  if (part_sizes.empty()) {
    if (!a.part_weights.empty()) return hspmd::part_sizes(a, name, dim_size);
    if (dim_size % a.hsize() != 0)
      fail_tensor(name, "dim ", a.hdim, " of size ", dim_size, " does not split into ", a.hsize(), " equal parts");
    return std::vector<int64_t>(a.hsize(), dim_size / a.hsize());
  }
  if (static_cast<int>(part_sizes.size()) != a.hsize())
    fail_tensor(name, part_sizes.size(), " part sizes given for ", a.hsize(), " subgroups");
  int64_t sum = 0;
  for (int64_t p : part_sizes) {
    if (p < 0) fail_tensor(name, "negative part size ", p);
    sum += p;
  }
  if (sum != dim_size)
    fail_tensor(name, "part sizes sum to ", sum, " but dim ", a.hdim, " has size ", dim_size);
  return part_sizes;
}

Box whole(const Shape& shape) { return Box{Shape(shape.size(), 0), shape}; }

// Part weights reduced to lowest terms; equal parts (or hsize 1) -> empty.
std::vector<int64_t> normalized_weights(const Annotation& a) {
  if (a.part_weights.empty() || a.hdim < 0 || a.hsize() == 1) return {};
  int64_t g = 0;
  for (int64_t w : a.part_weights) g = std::gcd(g, w);
  std::vector<int64_t> out;
  for (int64_t w : a.part_weights) out.push_back(g ? w / g : w);
  if (std::all_of(out.begin(), out.end(), [](int64_t w) { return w == 1; })) return {};
  return out;
}

}  // namespace

std::vector<int64_t> part_sizes(const Annotation& a, const std::string& name, int64_t dim_size) {
  if (a.part_weights.empty()) return resolve_part_sizes(a, name, dim_size, {});
  if (static_cast<int>(a.part_weights.size()) != a.hsize())
    fail_tensor(name, a.part_weights.size(), " part weights given for ", a.hsize(), " subgroups");
  int64_t total = 0;
  for (int64_t w : a.part_weights) {
    if (w <= 0) fail_tensor(name, "part weight ", w, " is not positive");
    total += w;
  }
  std::vector<int64_t> sizes;
  for (int64_t w : a.part_weights) {
    if ((dim_size * w) % total != 0)
      fail_tensor(name, "dim ", a.hdim, " of size ", dim_size, " does not split in the proportions ",
                  join_ints(a.part_weights));
    sizes.push_back(dim_size * w / total);
  }
  return sizes;
}

NDArray box_slice(const NDArray& array, const Box& box) {
  HSPMD_CHECK(static_cast<int>(box.begin.size()) == array.ndim(), "box ", to_string(box),
              " for an array of rank ", array.ndim());
  NDArray v = array;
  for (int d = 0; d < array.ndim(); ++d) v = v.slice(d, box.begin[d], box.end[d]);
  return v.contiguous().clone();
}

std::string key_name(int key) {
  if (key >= 0) return "split(" + std::to_string(key) + ")";
  if (key == kDup) return "dup";
  if (key == kPartial) return "partial";
  return "key(" + std::to_string(key) + ")";
}

int DeviceGroup::index_of(int rank) const {
  auto it = std::find(ranks.begin(), ranks.end(), rank);
  return it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
}

int DistStates::degree(int key) const {
  auto it = degrees.find(key);
  return it == degrees.end() ? 1 : it->second;
}

int DistStates::device_count() const {
  int n = 1;
  for (auto [key, d] : degrees) n *= d;
  return n;
}

std::vector<int> DistStates::split_dims() const {
  std::vector<int> dims;
  for (auto [key, d] : degrees)
    if (key >= 0 && d > 1) dims.push_back(key);
  return dims;
}

std::vector<int> DistStates::coordinates(int position) const {
  std::vector<int> digits(order.size());
  int rest = position;
  HSPMD_CHECK(position >= 0, "position ", position);
  for (size_t i = order.size(); i-- > 0;) {
    const int n = degree(order[i]);
    HSPMD_CHECK(n > 0, key_name(order[i]), " has degree ", n);
    digits[i] = rest % n;
    rest /= n;
  }
  HSPMD_CHECK(rest == 0, "position ", position, " beyond ", to_string(*this));
  return digits;
}

int DistStates::coordinate(int position, int key) const {
  auto it = std::find(order.begin(), order.end(), key);
  if (it == order.end()) return 0;
  return coordinates(position)[it - order.begin()];
}

bool DistStates::operator==(const DistStates& other) const {
  auto non_trivial = [](const std::map<int, int>& m) {
    std::map<int, int> out;
    for (auto [key, d] : m)
      if (d != 1) out.emplace(key, d);
    return out;
  };
  return order == other.order && non_trivial(degrees) == non_trivial(other.degrees);
}

Shape Box::shape() const {
  Shape s(begin.size());
  for (size_t i = 0; i < s.size(); ++i) s[i] = end[i] - begin[i];
  return s;
}

int64_t Box::numel() const { return shape_numel(shape()); }

std::string to_string(const Box& box) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < box.begin.size(); ++i) os << (i ? ", " : "") << box.begin[i] << ":" << box.end[i];
  os << "]";
  return os.str();
}

Box chunk_box(const DistStates& states, const Shape& part_shape, int position) {
  Box box = whole(part_shape);
  for (int d : states.split_dims()) {
    if (d >= static_cast<int>(part_shape.size()))
      fail("[annotation] ", key_name(d), " is outside the rank ", part_shape.size(), " of the part");
    const int n = states.degree(d);
    if (part_shape[d] % n != 0)
      fail("[annotation] split(", d, "): ", n, " does not divide the part's size ", part_shape[d]);
    const int64_t chunk = part_shape[d] / n;
    box.begin[d] = chunk * states.coordinate(position, d);
    box.end[d] = box.begin[d] + chunk;
  }
  return box;
}

std::vector<int> Annotation::all_ranks() const {
  std::vector<int> ranks;
  for (const Subgroup& g : subgroups) ranks.insert(ranks.end(), g.devices.ranks.begin(), g.devices.ranks.end());
  return ranks;
}

int Annotation::subgroup_of(int rank) const {
  for (int i = 0; i < hsize(); ++i)
    if (subgroups[i].devices.contains(rank)) return i;
  return -1;
}

std::string to_string(const DistStates& states) {
  std::ostringstream os;
  os << "{";
  bool first = true;
  for (auto [key, d] : states.degrees) {
    os << (first ? "" : ", ") << key_name(key) << ":" << d;
    first = false;
  }
  os << "} order " << join_keys(states.order);
  return os.str();
}

std::string to_string(const Annotation& a) {
  std::ostringstream os;
  os << "hdim " << a.hdim << ":";
  for (const Subgroup& g : a.subgroups) {
    os << " [";
    for (size_t i = 0; i < g.devices.ranks.size(); ++i) os << (i ? "," : "") << g.devices.ranks[i];
    os << "] " << to_string(g.states) << ";";
  }
  if (!a.part_weights.empty()) os << " weights " << join_ints(a.part_weights);
  return os.str();
}

void validate(const Annotation& a, const std::string& name, int tensor_rank, int world_size,
              bool is_parameter) {
  if (a.subgroups.empty()) fail_tensor(name, "has no subgroups");
  if (a.hdim < kPartial || a.hdim >= tensor_rank)
    fail_tensor(name, "hdim ", a.hdim, " is neither -2, -1 nor a dim of the tensor's rank ", tensor_rank);
  if (is_parameter && a.hdim == kPartial)
    fail_tensor(name, "hdim -2 (partial) on a parameter or optimizer state");
  if (!a.part_weights.empty()) {
    if (a.hdim < 0) fail_tensor(name, "part weights given but hdim is ", a.hdim);
    if (static_cast<int>(a.part_weights.size()) != a.hsize())
      fail_tensor(name, a.part_weights.size(), " part weights given for ", a.hsize(), " subgroups");
    for (int64_t w : a.part_weights)
      if (w <= 0) fail_tensor(name, "part weight ", w, " is not positive");
  }
  check_ranks(a, name, world_size);
  for (int i = 0; i < a.hsize(); ++i)
    check_states(a.subgroups[i].states, i, a.subgroups[i].devices.size(), name, tensor_rank, is_parameter);
}

void check_divisible(const Annotation& a, const std::string& name, const Shape& global_shape,
                     const std::vector<int64_t>& part_sizes) {
  const int rank = static_cast<int>(global_shape.size());
  if (a.subgroups.empty()) fail_tensor(name, "has no subgroups");
  for (int d = 0; d < rank; ++d)
    if (global_shape[d] < 0)
      fail_tensor(name, "shape ", shape_str(global_shape), " has the negative size ", global_shape[d], " along dim ",
                  d);
  if (a.hdim >= rank) fail_tensor(name, "hdim ", a.hdim, " is outside the shape ", shape_str(global_shape));
  if (a.hdim < 0 && !part_sizes.empty()) fail_tensor(name, "part sizes given but hdim is ", a.hdim);
  // Part sizes once (errors name the tensor), not once per part_box: O(hsize), not O(hsize^2).
  std::vector<int64_t> sizes;
  if (a.hdim >= 0) sizes = resolve_part_sizes(a, name, global_shape[a.hdim], part_sizes);
  for (int i = 0; i < a.hsize(); ++i) {
    Shape part = global_shape;  // the shape of part_box(a, global_shape, i, part_sizes)
    if (a.hdim >= 0) part[a.hdim] = sizes[i];
    const DistStates& s = a.subgroups[i].states;
    for (int d : s.split_dims()) {
      if (d >= rank) fail_tensor(name, "subgroup ", i, ": ", key_name(d), " is outside the shape ", shape_str(global_shape));
      if (part[d] % s.degree(d) != 0)
        fail_tensor(name, "subgroup ", i, ": split(", d, "): ", s.degree(d), " does not divide size ", part[d],
                    " of its part along dim ", d);
    }
  }
}

Box part_box(const Annotation& a, const Shape& global_shape, int subgroup,
             const std::vector<int64_t>& part_sizes) {
  HSPMD_CHECK(subgroup >= 0 && subgroup < a.hsize(), "subgroup ", subgroup);
  Box box = whole(global_shape);
  if (a.hdim < 0) return box;
  if (a.hdim >= static_cast<int>(global_shape.size()))
    fail("[annotation] hdim ", a.hdim, " is outside the shape ", shape_str(global_shape));
  std::vector<int64_t> sizes = resolve_part_sizes(a, "", global_shape[a.hdim], part_sizes);
  for (int i = 0; i < subgroup; ++i) box.begin[a.hdim] += sizes[i];
  box.end[a.hdim] = box.begin[a.hdim] + sizes[subgroup];
  return box;
}

std::optional<Box> local_box(const Annotation& a, const Shape& global_shape, int rank,
                             const std::vector<int64_t>& part_sizes) {
  const int i = a.subgroup_of(rank);
  if (i < 0) return std::nullopt;
  check_divisible(a, "", global_shape, part_sizes);
  Box part = part_box(a, global_shape, i, part_sizes);
  const Subgroup& g = a.subgroups[i];
  Box chunk = chunk_box(g.states, part.shape(), g.devices.index_of(rank));
  for (size_t d = 0; d < global_shape.size(); ++d) {
    chunk.begin[d] += part.begin[d];
    chunk.end[d] += part.begin[d];
  }
  return chunk;
}

bool holds_partial_sum(const Annotation& a, int rank) {
  const int i = a.subgroup_of(rank);
  if (i < 0) return false;
  return a.subgroups[i].states.has_partial() || (a.hdim == kPartial && a.hsize() > 1);
}

bool same_devices(const Annotation& a, const Annotation& b) {
  if (a.hsize() != b.hsize()) return false;
  for (int i = 0; i < a.hsize(); ++i)
    if (!(a.subgroups[i].devices == b.subgroups[i].devices)) return false;
  return true;
}

bool same_layout(const Annotation& a, const Annotation& b) {
  if (!same_devices(a, b)) return false;
  for (int i = 0; i < a.hsize(); ++i)
    if (!(a.subgroups[i].states == b.subgroups[i].states)) return false;
  if (a.hsize() == 1) return true;
  return a.hdim == b.hdim && normalized_weights(a) == normalized_weights(b);
}

bool has_partial(const Annotation& a) {
  if (a.hdim == kPartial && a.hsize() > 1) return true;
  return std::any_of(a.subgroups.begin(), a.subgroups.end(),
                     [](const Subgroup& g) { return g.states.has_partial(); });
}

std::vector<int> ranks_along(const Annotation& a, int rank, int dim) {
  if (a.subgroup_of(rank) < 0) fail("[annotation] rank ", rank, " holds no part of the tensor");
  const Subgroup& g = a.subgroups.at(a.subgroup_of(rank));
  const std::vector<int> mine = g.states.coordinates(g.devices.index_of(rank));
  std::vector<std::pair<int, int>> found;  // (chunk, rank)
  for (int q = 0; q < g.devices.size(); ++q) {
    const std::vector<int> c = g.states.coordinates(q);
    bool same = true;
    for (size_t k = 0; k < c.size(); ++k)
      if (g.states.order[k] != dim && c[k] != mine[k]) same = false;
    if (same) found.push_back({g.states.coordinate(q, dim), g.devices.ranks[q]});
  }
  std::sort(found.begin(), found.end());
  std::vector<int> ranks;
  for (auto [chunk, r] : found) ranks.push_back(r);
  return ranks;
}

}  // namespace hspmd

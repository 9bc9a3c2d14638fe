// HSPMD annotations: the layout of one tensor over the devices (docs/annotation.md,
// paper §3). Pure data and arithmetic: no MPI, no processes.
//
// A tensor of global shape G is annotated by Annotation{subgroups, hdim}:
//  * top tier: with hdim = d >= 0 the tensor is cut along dim d into hsize
//    consecutive parts (sizes given, or equal), part i owned by subgroup i;
//    hdim = -1: every subgroup holds the whole tensor; hdim = -2: the tensor
//    is the elementwise sum of the subgroups' tensors;
//  * bottom tier: subgroup i shards its part like ordinary SPMD with its
//    DistStates in local form (degrees multiply to the subgroup's size).
//
// Nothing here validates on construction: build the values, then call
// validate() (structure) and check_divisible() (against a concrete shape).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/core/ndarray.h"

namespace hspmd {

// DistStates keys: split(d) is the tensor dim d >= 0 itself; these two are
// the non-split keys. The same values are used for Annotation::hdim.
constexpr int kDup = -1;
constexpr int kPartial = -2;

// The key of a split along tensor dim d (just d; spelled out for readability).
constexpr int split_key(int d) { return d; }

// "split(0)", "dup", "partial"; any other negative key prints as "key(-3)".
std::string key_name(int key);

// An ordered list of global ranks. The position of a rank in the list is its
// position in the subgroup's mixed-radix numbering (see DistStates).
struct DeviceGroup {
  std::vector<int> ranks;

  int size() const { return static_cast<int>(ranks.size()); }
  bool contains(int rank) const { return index_of(rank) >= 0; }
  // Position of `rank` in the list, or -1 when absent.
  int index_of(int rank) const;
  bool operator==(const DeviceGroup&) const = default;
};

// Per-key shard counts over one device group, in local form, plus `order`.
//
// degrees[key] = n: split(d) cuts dim d into n equal chunks, dup replicates n
// times, partial means the value is the sum of n partial values. A key that
// is absent has degree 1. `order` lists exactly the keys with degree > 1; a
// device's position in its group is read as a mixed-radix number over
// `order`, the LAST key varying fastest. Example: degrees {split(0): 2,
// dup: 2}, order [split(0), dup] -> positions 0,1 hold chunk 0 and positions
// 2,3 hold chunk 1.
struct DistStates {
  std::map<int, int> degrees;
  std::vector<int> order;

  // Degree of `key` (1 when absent).
  int degree(int key) const;
  // Product of all degrees: the number of devices these states describe.
  int device_count() const;
  bool is_split(int d) const { return degree(split_key(d)) > 1; }
  bool has_partial() const { return degree(kPartial) > 1; }
  // The tensor dims with a split degree > 1, ascending.
  std::vector<int> split_dims() const;

  // Digits of `position` over `order` (one per key of `order`, same order).
  // Throws InternalError unless 0 <= position < product of the order's degrees.
  std::vector<int> coordinates(int position) const;
  // The digit of `position` along `key`; 0 for a key not in `order`.
  int coordinate(int position, int key) const;

  // Same sharding: equal degrees (absent == 1) and equal order.
  bool operator==(const DistStates& other) const;
};

// Per-dim half-open ranges [begin[i], end[i]) of a tensor's index space.
struct Box {
  Shape begin;
  Shape end;

  Shape shape() const;
  int64_t numel() const;
  bool operator==(const Box&) const = default;
};
std::string to_string(const Box& box);  // "[0:2, 4:8]"

// A contiguous copy of the elements of `array` inside `box` (array
// coordinates; any dtype). Throws InternalError when the box is outside.
NDArray box_slice(const NDArray& array, const Box& box);

// The box that device `position` of a subgroup holds inside a part of shape
// `part_shape`, relative to the part's origin: for every split dim d the
// chunk coordinate(position, split(d)) of degree(split(d)) equal chunks; the
// whole range of every other dim. Throws hspmd::Error "[annotation] ..." when
// a split dim is outside part_shape or a degree does not divide its size.
Box chunk_box(const DistStates& states, const Shape& part_shape, int position);

// One sharding subgroup: a device group and its bottom-tier states.
struct Subgroup {
  DeviceGroup devices;
  DistStates states;
  bool operator==(const Subgroup&) const = default;
};

// The whole layout of one tensor.
struct Annotation {
  std::vector<Subgroup> subgroups;
  int hdim = kDup;  // -1 dup, -2 partial, d >= 0 split along dim d
  // Top-tier part proportions along hdim >= 0, one positive weight per
  // subgroup (empty = equal parts). Part i of a dim of size n has size
  // n * w[i] / sum(w), which must be exact. Weights, not sizes, so that the
  // layout survives symbolic dims and reshapes: a batch cut 3:1 between two
  // pipelines stays cut 3:1 when [B, S] is flattened to [B*S].
  std::vector<int64_t> part_weights = {};

  int hsize() const { return static_cast<int>(subgroups.size()); }
  // Every rank of every subgroup, subgroup by subgroup, in group order.
  std::vector<int> all_ranks() const;
  // Index of the subgroup holding `rank`, or -1 when no subgroup does.
  int subgroup_of(int rank) const;
  bool contains(int rank) const { return subgroup_of(rank) >= 0; }
  bool operator==(const Annotation&) const = default;
};
std::string to_string(const DistStates& states);   // "{split(0):2, dup:2} order [split(0), dup]"
std::string to_string(const Annotation& annotation);

// Structural checks (the rules of docs/annotation.md, "Checks",
// that need no concrete shape).
// Throws hspmd::Error, one line "[annotation] tensor '<name>': <rule>", for:
// no subgroups; an empty device group; a rank twice in one group; a rank
// shared by two subgroups; a rank outside [0, world_size); a key that is
// neither split(d >= 0), dup nor partial; a non-positive degree; degrees not
// multiplying to the group's size; an order that does not list exactly the
// keys with degree > 1, each once; a split dim >= tensor_rank; hdim not in
// {-2, -1} nor in [0, tensor_rank); partial (bottom tier, or hdim -2) on a
// parameter (is_parameter: parameters and optimizer states).
void validate(const Annotation& annotation, const std::string& tensor_name, int tensor_rank,
              int world_size, bool is_parameter);

// Shape checks against a concrete global shape. `part_sizes` are the sizes of
// the top-tier parts along hdim, one per subgroup (empty = from the
// annotation's part_weights, or hsize equal parts without weights; must be
// empty unless hdim >= 0). Throws hspmd::Error "[annotation] tensor
// '<name>': <rule>" when: a size of the shape is negative; a split dim or
// hdim is outside the shape's rank;
// part_sizes has the wrong count, a negative size, or does not sum to the
// dim's size; equal parts do not divide the dim; a bottom-tier split degree
// does not divide the size of its subgroup's part along that dim.
void check_divisible(const Annotation& annotation, const std::string& tensor_name,
                     const Shape& global_shape, const std::vector<int64_t>& part_sizes);

// The global box of subgroup `subgroup`'s top-tier part: with hdim = d >= 0
// the d-range [sum of earlier parts, + own part) (sizes from part_sizes, or
// equal), every other dim whole; with hdim < 0 the whole tensor. Throws like
// check_divisible.
Box part_box(const Annotation& annotation, const Shape& global_shape, int subgroup,
             const std::vector<int64_t>& part_sizes = {});

// THE SEMANTIC CORE: the global-tensor box that `rank` holds, or nullopt when
// no subgroup contains it. It is the rank's subgroup's part (part_box), and
// inside it the rank's bottom-tier chunk (chunk_box at the rank's position in
// its device group), in global coordinates. Ranks that hold the same box hold
// copies, unless the value is a partial sum (see holds_partial_sum). Calls
// check_divisible first and throws like it (the message names no tensor).
std::optional<Box> local_box(const Annotation& annotation, const Shape& global_shape, int rank,
                             const std::vector<int64_t>& part_sizes = {});

// The ranks of `rank`'s subgroup under `annotation` whose coordinates equal
// its own on every key but split(dim) (the ranks sharing its split along
// tensor dim `dim`), ordered by their chunk along dim; {rank} when dim is
// not split there. Throws hspmd::Error for a rank outside the annotation.
std::vector<int> ranks_along(const Annotation& annotation, int rank, int dim);

// The sizes of the top-tier parts along hdim >= 0 for a dim of `dim_size`:
// from part_weights (exact proportions) or equal. Throws hspmd::Error
// "[annotation] tensor '<name>': ..." when the weights are not one positive
// value per subgroup or do not divide the size exactly, or equal parts do not.
std::vector<int64_t> part_sizes(const Annotation& annotation, const std::string& tensor_name,
                                int64_t dim_size);

// Whether `rank`'s local value is a partial sum that must be added to other
// ranks' values to give the tensor: its subgroup has partial degree > 1, or
// hdim = -2 with hsize > 1. False for a rank outside the annotation.
bool holds_partial_sum(const Annotation& annotation, int rank);

// Same hsize and, subgroup by subgroup, the same device lists (same order).
bool same_devices(const Annotation& a, const Annotation& b);

// Same layout: same devices, equal DistStates, same hdim (ignored when hsize
// is 1) and the same part proportions (empty = equal; [2, 2] == [1, 1]).
bool same_layout(const Annotation& a, const Annotation& b);

// Whether any subgroup has partial degree > 1, or hdim = -2 with hsize > 1.
bool has_partial(const Annotation& a);

// JSON form (docs/annotation.md):
//   {"hdim": -1, "subgroups": [{"ranks": [0, 1, 2, 3],
//     "states": {"split0": 2, "dup": 2}, "order": ["split0", "dup"]}]}
// plus "part_weights": [3, 1] when set. to_json writes every field; from_json reads it back (equal Annotation).
nlohmann::json to_json(const Annotation& annotation);
// Parses the form above; "hdim" defaults to -1 and "order" to the keys with
// degree > 1 in the order partial, dup, split0, split1, ... Throws
// hspmd::Error "[annotation] tensor '<name>': field '<path>': <problem>" for
// a missing field, a wrong JSON type, an unknown key or field. Does not
// validate(): call it with the tensor's rank and the world size.
Annotation annotation_from_json(const nlohmann::json& j, const std::string& tensor_name);

}  // namespace hspmd

// make_shards / check_shards (simulate.h) and the box-array helpers.
#include <cmath>
#include <climits>
#include <sstream>
#include <tuple>

#include "hspmd/core/error.h"
#include "hspmd/core/rng.h"
#include "resolve/internal.h"
#include "resolve/simulator/box_arrays.h"
#include "resolve/simulator/simulate.h"

namespace hspmd {

using namespace resolve_internal;

namespace resolve_internal {

NDArray extract(const NDArray& a, const Box& a_box, const Box& region) {
  NDArray out = NDArray::empty(region.shape(), DType::F32);
  copy_region(a, a_box, out, region, region);
  return out;
}

void copy_region(const NDArray& from, const Box& from_box, NDArray& to, const Box& to_box, const Box& region) {
  const float* src = from.host_data<float>();
  float* dst = to.host_data<float>();
  for_rows(region, from_box, to_box, [&](int64_t a, int64_t b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[b + i] = src[a + i];
  });
}

void add_region(const NDArray& from, const Box& from_box, NDArray& to, const Box& to_box, const Box& region) {
  const float* src = from.host_data<float>();
  float* dst = to.host_data<float>();
  for_rows(region, from_box, to_box, [&](int64_t a, int64_t b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[b + i] += src[a + i];
  });
}

}  // namespace resolve_internal

namespace {

NDArray f32_contiguous(const NDArray& a, const char* what) {
  if (!a.valid() || a.dtype() != DType::F32) fail("[simulate] ", what, " must be a valid f32 array");
  return a.contiguous();
}

// `total` split into `n` terms: n-1 of random small integers, the last one
// completing the sum.
std::vector<NDArray> split_terms(const NDArray& total, int n, Rng& rng) {
  std::vector<NDArray> terms;
  NDArray last = total.clone();
  for (int t = 0; t + 1 < n; ++t) {
    NDArray term = NDArray::empty(total.shape(), DType::F32);
    float* p = term.host_data<float>();
    float* l = last.host_data<float>();
    for (int64_t i = 0; i < term.numel(); ++i) {
      p[i] = static_cast<float>(std::floor(rng.uniform() * 17.0) - 8.0);
      l[i] -= p[i];
    }
    terms.push_back(term);
  }
  terms.push_back(last);
  return terms;
}

std::string index_str(const Box& region, int64_t flat) {
  const Shape shape = region.shape();
  Shape idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = region.begin[d] + flat % shape[d];
    flat /= shape[d];
  }
  return shape_str(idx);
}

// First element where a (holding `region`) differs from b (same box); "" when equal.
std::string compare(const NDArray& a, const NDArray& b, const Box& region, const std::string& who) {
  const float* x = a.host_data<float>();
  const float* y = b.host_data<float>();
  for (int64_t i = 0; i < a.numel(); ++i)
    if (x[i] != y[i]) {
      std::ostringstream os;
      os << who << ": element " << index_str(region, i) << " is " << x[i] << ", expected " << y[i];
      return os.str();
    }
  return "";
}

// Subgroup i's value over its part: the sum of its partial terms, each
// assembled from the ranks holding it (dup copies must agree).
std::string subgroup_value(const Layout& l, int i, const std::map<int, NDArray>& outputs, NDArray* value) {
  const Subgroup& g = l.subgroup(i);
  const Box& part = l.parts[i];
  *value = NDArray::zeros(part.shape(), DType::F32);
  std::map<std::tuple<int, Shape, Shape>, int> first;  // (term, box) -> the first rank holding it
  for (int pos = 0; pos < g.devices.size(); ++pos) {
    const int r = g.devices.ranks[pos];
    const Box& box = l.ranks.at(r).box;
    const NDArray& mine = outputs.at(r);
    auto [it, fresh] = first.emplace(std::make_tuple(g.states.coordinate(pos, kPartial), box.begin, box.end), r);
    if (fresh) {
      add_region(mine, box, *value, part, box);
      continue;
    }
    std::string diff = compare(mine, outputs.at(it->second), box, "rank " + std::to_string(r));
    if (!diff.empty()) return diff + " (its copy on rank " + std::to_string(it->second) + ")";
  }
  return "";
}

std::string check_present(const Layout& l, const std::map<int, NDArray>& outputs) {
  for (const auto& [r, p] : l.ranks) {
    auto it = outputs.find(r);
    if (it == outputs.end() || !it->second.valid()) return "rank " + std::to_string(r) + ": missing";
    if (it->second.shape() != p.box.shape() || it->second.dtype() != DType::F32)
      return "rank " + std::to_string(r) + ": shape " + shape_str(it->second.shape()) + ", expected " +
             shape_str(p.box.shape());
  }
  for (const auto& [r, a] : outputs)
    if (!l.ranks.count(r)) return "rank " + std::to_string(r) + ": holds a buffer but is not in the annotation";
  return "";
}

std::string check_partial(const NDArray& global, const Layout& l, const std::map<int, NDArray>& outputs) {
  const Box all = whole_box(l.shape);
  NDArray total = NDArray::zeros(l.shape, DType::F32);
  for (int i = 0; i < l.hsize(); ++i) {
    NDArray value;
    std::string diff = subgroup_value(l, i, outputs, &value);
    if (!diff.empty()) return diff;
    if (l.hdim == kPartial) {
      add_region(value, l.parts[i], total, all, l.parts[i]);
      continue;
    }
    diff = compare(value, extract(global, all, l.parts[i]), l.parts[i], "subgroup " + std::to_string(i) + " sum");
    if (!diff.empty()) return diff;
  }
  return l.hdim == kPartial ? compare(total, global, all, "sum over subgroups") : "";
}

}  // namespace

std::map<int, NDArray> make_shards(const NDArray& global_in, const Annotation& annotation, uint64_t seed) {
  const NDArray global = f32_contiguous(global_in, "make_shards: the global tensor");
  validate(annotation, "", static_cast<int>(global.ndim()), INT_MAX, false);
  check_divisible(annotation, "", global.shape(), {});
  const Layout l = make_layout(annotation, global.shape(), "make_shards", "shards", INT_MAX);
  const Box all = whole_box(l.shape);
  Rng rng(seed);
  std::vector<NDArray> top = l.hdim == kPartial ? split_terms(global, l.hsize(), rng) : std::vector<NDArray>{};
  std::map<int, NDArray> out;
  for (int i = 0; i < l.hsize(); ++i) {
    const Subgroup& g = l.subgroup(i);
    const Box& part = l.parts[i];
    const NDArray term = l.hdim == kPartial ? top[i] : extract(global, all, part);
    const std::vector<NDArray> terms = split_terms(term, g.states.degree(kPartial), rng);
    for (int pos = 0; pos < g.devices.size(); ++pos) {
      const Box& box = l.ranks.at(g.devices.ranks[pos]).box;
      out[g.devices.ranks[pos]] = extract(terms[g.states.coordinate(pos, kPartial)], part, box);
    }
  }
  return out;
}

std::string check_shards(const NDArray& global_in, const Annotation& annotation,
                         const std::map<int, NDArray>& outputs) {
  const NDArray global = f32_contiguous(global_in, "check_shards: the global tensor");
  validate(annotation, "", static_cast<int>(global.ndim()), INT_MAX, false);
  const Layout l = make_layout(annotation, global.shape(), "check_shards", "shards", INT_MAX);
  std::map<int, NDArray> contiguous;
  for (const auto& [r, a] : outputs) contiguous[r] = a.valid() ? a.contiguous() : a;
  std::string diff = check_present(l, contiguous);
  if (!diff.empty() || l.any_partial()) return diff.empty() ? check_partial(global, l, contiguous) : diff;
  const Box all = whole_box(l.shape);
  for (const auto& [r, p] : l.ranks) {
    diff = compare(contiguous.at(r), extract(global, all, p.box), p.box, "rank " + std::to_string(r));
    if (!diff.empty()) return diff;
  }
  return "";
}

}  // namespace hspmd

// Laying an annotation over a concrete shape, once per reshard side.
#include "hspmd/core/error.h"
#include "resolve/internal.h"

namespace hspmd::resolve_internal {

bool Layout::any_partial() const {
  if (hdim == kPartial) return true;
  for (int i = 0; i < hsize(); ++i)
    if (bottom_partial(i)) return true;
  return false;
}

const Placement* Layout::find(int rank) const {
  auto it = ranks.find(rank);
  return it == ranks.end() ? nullptr : &it->second;
}

std::optional<Box> Layout::box_of(int rank) const {
  const Placement* p = find(rank);
  if (!p) return std::nullopt;
  return p->box;
}

namespace {

// The annotation layer's checks, rethrown under the reshard's name.
void check_annotation(const Annotation& a, const Shape& shape, const std::string& name, const char* role,
                      int world_size) {
  try {
    validate(a, "", static_cast<int>(shape.size()), world_size, false);
    check_divisible(a, "", shape, {});
  } catch (const Error& e) {
    std::string what = e.what();
    const std::string prefix = "[annotation] ";
    if (what.compare(0, prefix.size(), prefix) == 0) what = what.substr(prefix.size());
    fail("[resolve] reshard '", name, "': ", role, " annotation: ", what);
  }
}

std::vector<Box> part_boxes(const Layout& l) {
  std::vector<Box> parts(l.hsize(), whole_box(l.shape));
  if (l.hdim < 0) return parts;
  const std::vector<int64_t> sizes = part_sizes(*l.annotation, "", l.shape[l.hdim]);
  int64_t offset = 0;
  for (int i = 0; i < l.hsize(); ++i) {
    parts[i].begin[l.hdim] = offset;
    offset += sizes[i];
    parts[i].end[l.hdim] = offset;
  }
  return parts;
}

}  // namespace

Layout make_layout(const Annotation& annotation, const Shape& shape, const std::string& name, const char* role,
                   int world_size) {
  check_annotation(annotation, shape, name, role, world_size);
  Layout l;
  l.annotation = &annotation;
  l.shape = shape;
  l.hdim = annotation.hsize() == 1 ? kDup : annotation.hdim;
  l.parts = part_boxes(l);
  for (int i = 0; i < l.hsize(); ++i) {
    const Subgroup& g = annotation.subgroups[i];
    const Box& part = l.parts[i];
    for (int pos = 0; pos < g.devices.size(); ++pos) {
      Box box = chunk_box(g.states, part.shape(), pos);
      for (size_t d = 0; d < shape.size(); ++d) {
        box.begin[d] += part.begin[d];
        box.end[d] += part.begin[d];
      }
      l.ranks[g.devices.ranks[pos]] = Placement{i, pos, std::move(box)};
    }
  }
  return l;
}

}  // namespace hspmd::resolve_internal

// Annotations as Python values: DS (DistStates), DeviceGroup and Annotation
// (a DGUnion with its DSUnion); their repr is the C++ to_string notation.
#include <pybind11/stl.h>

#include "bindings.h"
#include "hspmd/annotation/annotation.h"
#include "hspmd/annotation/deduce.h"
#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"
#include "hspmd/graph/graph.h"
#include "hspmd/ops/ops.h"

namespace hspmd::python {

namespace {

// Keys in the order the dict gives them: the default order of a DS.
DistStates make_states(const py::dict& degrees, const std::optional<std::vector<int>>& order) {
  DistStates s;
  std::vector<int> given;
  for (auto [key, value] : degrees) {
    const int k = key.cast<int>(), n = value.cast<int>();
    if (n < 1) fail("[annotation] DS: degree of ", key_name(k), " must be >= 1, got ", n);
    if (k < kPartial) fail("[annotation] DS: unknown key ", k, " (split dims are >= 0, DUP -1, PARTIAL -2)");
    if (n == 1) continue;
    s.degrees[k] = n;
    given.push_back(k);
  }
  s.order = order ? *order : given;
  for (int k : s.order)
    if (s.degree(k) == 1) fail("[annotation] DS: order lists ", key_name(k), ", which has no degree > 1");
  if (s.order.size() != s.degrees.size())
    fail("[annotation] DS: order must list every key with a degree > 1 exactly once");
  return s;
}

py::dict degrees_dict(const DistStates& s) {
  py::dict d;
  for (int k : s.order) d[py::int_(k)] = s.degree(k);
  return d;
}

// The ops hspmd.deduce builds, by name: the output from the inputs and the
// keyword attributes.
using OpBuilder = std::function<Tensor(const std::vector<Tensor>&, const py::dict&)>;

template <typename T>
T attr(const py::dict& attrs, const char* name, T fallback) {
  return attrs.contains(name) ? attrs[name].cast<T>() : fallback;
}

const std::map<std::string, std::pair<size_t, OpBuilder>>& op_builders() {
  static const std::map<std::string, std::pair<size_t, OpBuilder>> table = {
      {"add", {2, [](const auto& in, const auto&) { return ops::add(in[0], in[1]); }}},
      {"mul", {2, [](const auto& in, const auto&) { return ops::mul(in[0], in[1]); }}},
      {"matmul", {2, [](const auto& in, const auto& a) {
         return ops::matmul(in[0], in[1], attr(a, "trans_a", false), attr(a, "trans_b", false));
       }}},
      {"linear", {2, [](const auto& in, const auto&) { return ops::linear(in[0], in[1]); }}},
      {"transpose", {1, [](const auto& in, const auto& a) {
         return ops::transpose(in[0], attr(a, "dim0", 0), attr(a, "dim1", 1));
       }}},
      {"reduce_sum", {1, [](const auto& in, const auto& a) {
         return ops::reduce_sum(in[0], attr(a, "axes", std::vector<int>{}));
       }}},
      {"swiglu", {2, [](const auto& in, const auto&) { return ops::swiglu(in[0], in[1]); }}},
      {"rms_norm", {2, [](const auto& in, const auto& a) {
         return ops::rms_norm(in[0], in[1], attr(a, "eps", 1e-6f));
       }}},
      {"embedding", {2, [](const auto& in, const auto&) { return ops::embedding(in[0], in[1]); }}},
  };
  return table;
}

// The annotation of op(inputs): a graph of the inputs (placeholders in0,
// in1, ...; embedding's ids are int32) and the op, deduced by the C++ rules.
Annotation deduce_op(const std::string& op, const std::vector<std::pair<Shape, Annotation>>& inputs,
                     int world_size, const py::kwargs& attrs) {
  const auto it = op_builders().find(op);
  if (it == op_builders().end()) {
    std::string known;
    for (const auto& [name, entry] : op_builders()) known += (known.empty() ? "" : ", ") + name;
    fail("[deduce] op '", op, "': not available from Python yet (", known, ")");
  }
  if (inputs.size() != it->second.first)
    fail("[deduce] op '", op, "' takes ", it->second.first, " inputs, got ", inputs.size());
  Graph g;
  std::vector<Tensor> in;
  std::map<std::string, Annotation> plan;
  int world = world_size;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string name = "in" + std::to_string(i);
    const DType dtype = op == "embedding" && i == 1 ? DType::I32 : DType::F32;
    in.push_back(g.placeholder(name, sym_shape(inputs[i].first), dtype));
    plan[name] = inputs[i].second;
    for (int r : inputs[i].second.all_ranks()) world = std::max(world, r + 1);
  }
  const Tensor out = it->second.second(in, attrs);
  return deduce(g, plan, world).of(out);
}

}  // namespace

void bind_annotation(py::module_& m) {
  m.def("deduce", &deduce_op, py::arg("op"), py::arg("inputs"), py::arg("world_size") = 0,
        "The annotation of op's output from [(shape, Annotation)] inputs (the C++ deduction rules); "
        "attributes as keywords (matmul: trans_a, trans_b; transpose: dim0, dim1; reduce_sum: axes; "
        "rms_norm: eps)");
  m.attr("DUP") = kDup;
  m.attr("PARTIAL") = kPartial;

  py::class_<DistStates>(m, "DS", "Bottom-tier distributed states: per key (split dim d >= 0, DUP, PARTIAL) "
                                  "a degree, and the order of the keys over a device group's positions")
      .def(py::init(&make_states), py::arg("degrees") = py::dict(), py::arg("order") = py::none())
      .def_property_readonly("degrees", &degrees_dict)
      .def_property_readonly("order", [](const DistStates& s) { return s.order; })
      .def_property_readonly("device_count", &DistStates::device_count)
      .def("degree", &DistStates::degree, py::arg("key"))
      .def("__eq__", [](const DistStates& a, const DistStates& b) { return a == b; })
      .def("__repr__", [](const DistStates& s) { return "DS" + to_string(s); });

  py::class_<DeviceGroup>(m, "DeviceGroup", "An ordered list of global ranks")
      .def(py::init([](std::vector<int> ranks) { return DeviceGroup{std::move(ranks)}; }), py::arg("ranks"))
      .def_readonly("ranks", &DeviceGroup::ranks)
      .def_property_readonly("size", &DeviceGroup::size)
      .def("__len__", &DeviceGroup::size)
      .def("__eq__", [](const DeviceGroup& a, const DeviceGroup& b) { return a == b; })
      .def("__repr__", [](const DeviceGroup& g) {
        std::string s = "DeviceGroup([";
        for (size_t i = 0; i < g.ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(g.ranks[i]);
        return s + "])";
      });

  py::class_<Annotation>(m, "Annotation", "A tensor's layout: subgroups (a DGUnion with its DSUnion) and the "
                                          "hetero dim (-1 duplicate, -2 partial, d >= 0 split)")
      .def(py::init([](const std::vector<DeviceGroup>& groups, const std::vector<DistStates>& states, int hdim,
                       std::vector<int64_t> weights) {
             if (groups.size() != states.size())
               fail("[annotation] DGUnion of ", groups.size(), " device groups with a DSUnion of ", states.size(),
                    " states: one DS per device group");
             Annotation a;
             for (size_t i = 0; i < groups.size(); ++i) a.subgroups.push_back(Subgroup{groups[i], states[i]});
             a.hdim = hdim;
             a.part_weights = std::move(weights);
             return a;
           }),
           py::arg("groups"), py::arg("states"), py::arg("hetero_dim") = kDup,
           py::arg("part_weights") = std::vector<int64_t>{})
      .def_property_readonly("groups", [](const Annotation& a) {
        std::vector<DeviceGroup> out;
        for (const Subgroup& s : a.subgroups) out.push_back(s.devices);
        return out;
      })
      .def_property_readonly("states", [](const Annotation& a) {
        std::vector<DistStates> out;
        for (const Subgroup& s : a.subgroups) out.push_back(s.states);
        return out;
      })
      .def_readonly("hetero_dim", &Annotation::hdim)
      .def_readonly("part_weights", &Annotation::part_weights)
      .def_property_readonly("hsize", &Annotation::hsize)
      .def_property_readonly("ranks", &Annotation::all_ranks)
      .def("validate",
           [](const Annotation& a, int world_size, int tensor_rank, const std::string& name) {
             validate(a, name, tensor_rank, world_size, false);
           },
           py::arg("world_size"), py::arg("tensor_rank"), py::arg("name") = "tensor",
           "Structural checks (docs/annotation.md); raises hspmd.Error naming the broken rule")
      .def("local_box",
           [](const Annotation& a, const Shape& shape, int rank) -> std::optional<std::pair<Shape, Shape>> {
             const std::optional<Box> box = local_box(a, shape, rank);
             if (!box) return std::nullopt;
             return std::pair{box->begin, box->end};
           },
           py::arg("shape"), py::arg("rank"), "(begin, end) of the rank's local block, or None")
      .def("to_json", [](const Annotation& a) { return to_json(a).dump(); })
      .def_static("from_json",
                  [](const std::string& text, const std::string& name) {
                    return annotation_from_json(parse_json_text(text, "annotation", "tensor '" + name + "'"), name);
                  },
                  py::arg("text"), py::arg("name") = "tensor")
      .def("__eq__", [](const Annotation& a, const Annotation& b) { return a == b; })
      .def("__repr__", [](const Annotation& a) { return to_string(a); });
}

}  // namespace hspmd::python

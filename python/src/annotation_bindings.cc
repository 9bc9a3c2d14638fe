// Annotations as Python values: DS (DistStates), DeviceGroup and Annotation
// (a DGUnion with its DSUnion); their repr is the C++ to_string notation.
// Every argument is read here, not by pybind11's casts: a value of the wrong
// type or range is hspmd.Error naming the argument (python/src/int_arg.h),
// never a cast error naming none.
#include <limits>
#include <type_traits>

#include <pybind11/stl.h>

#include "bindings.h"
#include "hspmd/annotation/annotation.h"
#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"
#include "hspmd/core/limits.h"
#include "hspmd/deduce/deduce.h"
#include "hspmd/graph/graph.h"
#include "hspmd/ops/ops.h"
#include "int_arg.h"

namespace hspmd::python {

namespace {

std::string type_name(const py::handle& v) { return py::str(py::type::handle_of(v).attr("__name__")); }

// `v` (a list, tuple or other iterable, not a string or a dict) as integers,
// each through the one integer-range check as "<what>[i]".
std::vector<int64_t> int_list(const py::handle& v, const std::string& what, const IntRange& range) {
  if (py::isinstance<py::str>(v) || py::isinstance<py::bytes>(v) || py::isinstance<py::dict>(v) ||
      !py::isinstance<py::iterable>(v))
    fail(what, " must be a list of integers, got ", type_name(v), " ", shorten(py::repr(v).cast<std::string>()));
  std::vector<int64_t> out;
  for (py::handle x : v) out.push_back(int_arg(x, what + "[" + std::to_string(out.size()) + "]", range));
  return out;
}

// The same as one list of Python objects (a sequence argument whose items
// are objects: groups, states, inputs).
std::vector<py::object> object_list(const py::handle& v, const std::string& what, const char* items) {
  if (py::isinstance<py::str>(v) || py::isinstance<py::bytes>(v) || py::isinstance<py::dict>(v) ||
      !py::isinstance<py::iterable>(v))
    fail(what, " must be a list of ", items, ", got ", type_name(v), " ", shorten(py::repr(v).cast<std::string>()));
  std::vector<py::object> out;
  for (py::handle x : v) out.push_back(py::reinterpret_borrow<py::object>(x));
  return out;
}

// A DS key: split(d >= 0), DUP (-1) or PARTIAL (-2).
int ds_key(const py::handle& v, const std::string& what) {
  const int64_t k = int_arg(v, what, IntRange{});
  if (k < kPartial || k > std::numeric_limits<int>::max())
    fail(what, " ", k, " is not a key (split dims are >= 0, DUP -1, PARTIAL -2)");
  return static_cast<int>(k);
}

// Keys in the order the dict gives them: the default order of a DS. Every
// key and degree goes through the integer-range check (a cast error would
// name no argument); the degrees multiply to at most the largest world.
DistStates make_states(const py::object& degrees, const py::object& order) {
  if (!py::isinstance<py::dict>(degrees))
    fail("[annotation] DS: degrees must be a dict {key: degree} (split dims >= 0, DUP -1, PARTIAL -2), got ",
         type_name(degrees), " ", shorten(py::repr(degrees).cast<std::string>()));
  DistStates s;
  std::vector<int> given;
  int64_t product = 1;
  for (auto [key, value] : py::reinterpret_borrow<py::dict>(degrees)) {
    const int k = ds_key(key, "[annotation] DS: key");
    const int n = static_cast<int>(int_arg(value, "[annotation] DS: degree of " + key_name(k), {1, kMaxWorldSize}));
    product *= n;
    if (product > kMaxWorldSize)
      fail("[annotation] DS: degrees multiply to more than the largest world, ", kMaxWorldSize, " ranks");
    if (n == 1) continue;
    s.degrees[k] = n;
    given.push_back(k);
  }
  if (order.is_none()) {
    s.order = given;
  } else {
    for (int64_t k : int_list(order, "[annotation] DS: order", IntRange{})) {
      if (k < kPartial || k > std::numeric_limits<int>::max())
        fail("[annotation] DS: order lists ", k, ", which is not a key (split dims are >= 0, DUP -1, PARTIAL -2)");
      s.order.push_back(static_cast<int>(k));
    }
  }
  for (int k : s.order)
    if (s.degree(k) == 1) fail("[annotation] DS: order lists ", key_name(k), ", which has no degree > 1");
  if (s.order.size() != s.degrees.size())
    fail("[annotation] DS: order must list every key with a degree > 1 exactly once");
  return s;
}

// A device group from a DeviceGroup or a list of ranks in [0, the largest world).
DeviceGroup make_group(const py::handle& v, const std::string& what) {
  if (py::isinstance<DeviceGroup>(v)) return v.cast<DeviceGroup>();
  DeviceGroup g;
  for (int64_t r : int_list(v, what, {0, kMaxWorldSize - 1})) g.ranks.push_back(static_cast<int>(r));
  return g;
}

// A shape: sizes >= 0.
Shape shape_arg(const py::handle& v, const std::string& what) {
  return int_list(v, what, {0, std::numeric_limits<int64_t>::max()});
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
  if (!attrs.contains(name)) return fallback;
  const py::object v = attrs[name];
  if constexpr (std::is_same_v<T, bool>) {
    if (!py::isinstance<py::bool_>(v))
      fail("[deduce] attribute ", name, "=", shorten(py::repr(v).cast<std::string>()), ": must be True or False");
    return v.cast<bool>();
  } else if constexpr (std::is_same_v<T, int>) {
    return static_cast<int>(int_arg(v, std::string("[deduce] attribute ") + name, kIntRange));
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    std::vector<int> out;
    for (int64_t x : int_list(v, std::string("[deduce] attribute ") + name, kIntRange))
      out.push_back(static_cast<int>(x));
    return out;
  } else {
    try {
      return v.cast<T>();
    } catch (const py::cast_error&) {
      fail("[deduce] attribute ", name, "=", shorten(py::repr(v).cast<std::string>()), ": must be a number");
    }
  }
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
Annotation deduce_op(const std::string& op, const py::object& input_list, const py::object& world_arg,
                     const py::kwargs& attrs) {
  const auto it = op_builders().find(op);
  if (it == op_builders().end()) {
    std::string known;
    for (const auto& [name, entry] : op_builders()) known += (known.empty() ? "" : ", ") + name;
    fail("[deduce] op '", op, "': not available from Python yet (", known, ")");
  }
  const int world_size = static_cast<int>(int_arg(world_arg, "[deduce] world_size", {0, kMaxWorldSize}));
  std::vector<std::pair<Shape, Annotation>> inputs;
  for (const py::object& item : object_list(input_list, "[deduce] inputs", "(shape, Annotation) pairs")) {
    const std::string what = "[deduce] inputs[" + std::to_string(inputs.size()) + "]";
    if (!py::isinstance<py::tuple>(item) && !py::isinstance<py::list>(item))
      fail(what, " must be a (shape, Annotation) pair, got ", type_name(item));
    const py::sequence pair = py::reinterpret_borrow<py::sequence>(item);
    if (pair.size() != 2 || !py::isinstance<Annotation>(pair[1]))
      fail(what, " must be a (shape, Annotation) pair, got ", shorten(py::repr(item).cast<std::string>()));
    inputs.emplace_back(shape_arg(pair[0], what + " shape"), pair[1].cast<Annotation>());
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
      .def("degree",
           [](const DistStates& s, const py::object& key) {
             return s.degree(ds_key(key, "[annotation] DS.degree: key"));
           },
           py::arg("key"))
      .def("__eq__", [](const DistStates& a, const DistStates& b) { return a == b; })
      .def("__repr__", [](const DistStates& s) { return "DS" + to_string(s); });

  py::class_<DeviceGroup>(m, "DeviceGroup", "An ordered list of global ranks")
      .def(py::init([](const py::object& ranks) { return make_group(ranks, "[annotation] DeviceGroup: ranks"); }),
           py::arg("ranks"))
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
      .def(py::init([](const py::object& group_list, const py::object& state_list, const py::object& hdim_arg,
                       const py::object& weight_list) {
             std::vector<DeviceGroup> groups;
             for (const py::object& g : object_list(group_list, "[annotation] Annotation: groups", "DeviceGroups"))
               groups.push_back(
                   make_group(g, "[annotation] Annotation: groups[" + std::to_string(groups.size()) + "]"));
             std::vector<DistStates> states;
             for (const py::object& ds : object_list(state_list, "[annotation] Annotation: states", "DS")) {
               if (py::isinstance<DistStates>(ds)) states.push_back(ds.cast<DistStates>());
               else if (py::isinstance<py::dict>(ds)) states.push_back(make_states(ds, py::none()));
               else fail("[annotation] Annotation: states[", states.size(), "] must be a DS, got ", type_name(ds));
             }
             const int64_t hdim = int_arg(hdim_arg, "[annotation] Annotation: hetero_dim", IntRange{});
             if (hdim < kPartial || hdim > std::numeric_limits<int>::max())
               fail("[annotation] Annotation: hetero_dim ", hdim,
                    " is neither -2 (PARTIAL), -1 (DUP) nor a tensor dim d >= 0");
             std::vector<int64_t> weights = int_list(weight_list, "[annotation] Annotation: part_weights",
                                                     {1, std::numeric_limits<int64_t>::max()});
             if (groups.size() != states.size())
               fail("[annotation] DGUnion of ", groups.size(), " device groups with a DSUnion of ", states.size(),
                    " states: one DS per device group");
             Annotation a;
             for (size_t i = 0; i < groups.size(); ++i) a.subgroups.push_back(Subgroup{groups[i], states[i]});
             a.hdim = static_cast<int>(hdim);
             a.part_weights = std::move(weights);
             return a;
           }),
           py::arg("groups"), py::arg("states"), py::arg("hetero_dim") = kDup, py::arg("part_weights") = py::list())
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
           [](const Annotation& a, const py::object& world_size, const py::object& tensor_rank,
              const std::string& name) {
             const int64_t rank = int_arg(tensor_rank, "[annotation] validate: tensor_rank", kNonNegativeInt);
             const int64_t world = int_arg(world_size, "[annotation] validate: world_size", {1, kMaxWorldSize});
             validate(a, name, static_cast<int>(rank), static_cast<int>(world), false);
           },
           py::arg("world_size"), py::arg("tensor_rank"), py::arg("name") = "tensor",
           "Structural checks (docs/annotation.md); raises hspmd.Error naming the broken rule")
      .def("local_box",
           [](const Annotation& a, const py::object& shape_list, const py::object& rank_arg,
              const std::string& name) -> std::optional<std::pair<Shape, Shape>> {
             const Shape shape = shape_arg(shape_list, "[annotation] local_box: shape");
             const int rank = static_cast<int>(int_arg(rank_arg, "[annotation] local_box: rank", kIntRange));
             // The structural rules first (an annotation built in Python may
             // break them): hspmd.Error naming the rule, not an internal check.
             validate(a, name, static_cast<int>(shape.size()), kMaxWorldSize, false);
             const std::optional<Box> box = local_box(a, shape, rank);
             if (!box) return std::nullopt;
             return std::pair{box->begin, box->end};
           },
           py::arg("shape"), py::arg("rank"), py::arg("name") = "tensor",
           "(begin, end) of the rank's local block, or None; hspmd.Error for an annotation that breaks a rule "
           "(validate's) or does not divide the shape")
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

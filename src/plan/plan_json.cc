// The annotation plan's JSON form (docs/plan.md). Reading it checks every
// annotation against the tensor it names: the tensor must be a leaf or a
// Reshard point of the model's training graph.
#include <algorithm>

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"
#include "hspmd/models/model.h"
#include "hspmd/ops/ops.h"
#include "hspmd/plan/plan.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace hspmd {

using nlohmann::json;

namespace {

constexpr const char* kFormat = "hspmd-annotation-plan";

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

json annotations_json(const std::map<std::string, Annotation>& m) {
  json out = json::object();
  for (const auto& [name, a] : m) out[name] = to_json(a);
  return out;
}

void only_fields(const json& j, const std::string& where, const std::vector<std::string>& allowed) {
  for (auto it = j.begin(); it != j.end(); ++it)
    if (std::find(allowed.begin(), allowed.end(), it.key()) == allowed.end())
      fail("[plan] ", where, "unknown field '", shorten(it.key()), "'");
}

const json& require(const json& j, const char* field) {
  if (!j.contains(field)) fail("[plan] missing field '", field, "'");
  return j[field];
}

// The rank of every tensor a plan may annotate: leaves and named Reshards of
// the training graph built with Reshard points.
struct Annotatable {
  int rank = 0;
  bool is_parameter = false;
};

std::map<std::string, Annotatable> annotatable(const ModelConfig& c) {
  ModelBuildOptions o;
  o.reshard_points = true;
  o.context_parallel = true;
  o.packed_documents = true;  // the same graph the dry run and the executor build
  const ModelGraph m = build_model(c, o);
  std::map<std::string, Annotatable> out;
  for (int id = 0; id < m.graph->num_nodes(); ++id) {
    const Node& n = m.graph->node(id);
    if (!n.name.empty() && ops::reshard_mirror_of(n) < 0) out[n.name].rank = static_cast<int>(n.outputs[0].shape.size());
  }
  for (const std::string& name : m.names) out[name].is_parameter = true;
  return out;
}

std::map<std::string, Annotation> read_annotations(const json& j, const char* field,
                                                   const std::map<std::string, Annotatable>& known,
                                                   int world, bool parameters_only) {
  if (!j.is_object()) fail("[plan] field '", field, "' must be an object of annotations");
  std::map<std::string, Annotation> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    auto k = known.find(name);
    if (k == known.end())
      fail("[plan] ", field, ": tensor '", shorten(name), "' is not a leaf or Reshard point of the model");
    if (parameters_only && !k->second.is_parameter)
      fail("[plan] ", field, ": tensor '", shorten(name), "' is not a parameter");
    Annotation a = annotation_from_json(it.value(), name);
    validate(a, name, k->second.rank, world, k->second.is_parameter);
    out.emplace(name, std::move(a));
  }
  return out;
}

}  // namespace

json to_json(const AnnotationPlan& plan) {
  json j = {{"format", kFormat},
            {"version", 1},
            {"world_size", plan.world_size},
            {"model", plan.model.to_json()},
            {"bindings", plan.bindings},
            {"tensors", annotations_json(plan.tensors)},
            {"optimizer_states", annotations_json(plan.optimizer_states)}};
  if (plan.strategy) j["strategy"] = to_json(*plan.strategy);
  if (plan.precision.mixed() || plan.precision.grad_reduce != DType::F32)
    j["precision"] = {{"compute", plan.precision.mixed() ? "bf16" : "fp32"},
                      {"grad_reduce", plan.precision.grad_reduce == DType::BF16 ? "bf16" : "fp32"}};
  return j;
}

AnnotationPlan plan_from_json(const json& j) {
  if (!j.is_object()) fail("[plan] a plan must be a JSON object");
  only_fields(j, "", {"format", "version", "world_size", "model", "bindings", "tensors",
                      "optimizer_states", "strategy", "precision"});
  if (require(j, "format") != kFormat) fail("[plan] field 'format' must be \"", kFormat, "\"");
  if (require(j, "version") != 1) fail("[plan] unsupported version ", json_excerpt(j["version"]));
  AnnotationPlan plan;
  const json& world = require(j, "world_size");
  if (!world.is_number_integer() || world.get<int64_t>() < 1)
    fail("[plan] field 'world_size' must be a positive integer, got ", json_excerpt(world));
  if (world.get<int64_t>() > kMaxWorldSize)
    fail("[plan] field 'world_size' ", json_excerpt(world), " is above the limit of ", kMaxWorldSize, " ranks");
  plan.world_size = world.get<int>();
  plan.model = ModelConfig::from_json(require(j, "model"), "plan field 'model'");
  if (j.contains("bindings")) {
    if (!j["bindings"].is_object()) fail("[plan] field 'bindings' must be an object");
    for (auto it = j["bindings"].begin(); it != j["bindings"].end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 1)
        fail("[plan] bindings: '", shorten(it.key()), "' must be a positive integer");
      plan.bindings[it.key()] = it.value().get<int64_t>();
    }
  }
  const auto known = annotatable(plan.model);
  plan.tensors = read_annotations(require(j, "tensors"), "tensors", known, plan.world_size, false);
  if (j.contains("optimizer_states"))
    plan.optimizer_states =
        read_annotations(j["optimizer_states"], "optimizer_states", known, plan.world_size, true);
  if (j.contains("precision")) {
    const nlohmann::json& p = j["precision"];
    if (!p.is_object()) fail("[plan] field 'precision' must be an object");
    only_fields(p, "precision", {"compute", "grad_reduce"});
    auto read = [&](const char* key) {
      if (!p.contains(key)) return DType::F32;
      if (!p[key].is_string()) fail("[plan] precision.", key, " must be \"fp32\" or \"bf16\"");
      return parse_precision_name(p[key].get<std::string>(), std::string("plan precision.") + key);
    };
    plan.precision = {read("compute"), read("grad_reduce")};
  }
  if (j.contains("strategy")) {
    plan.strategy = strategy_from_json(j["strategy"]);
    validate(*plan.strategy, plan.model, plan.world_size);
  }
  return plan;
}

bool is_plan_file(const std::string& path) {
  // Never open a FIFO or a device: the loader that follows names the problem.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  // Lenient here: load_plan applies the strict rules to a plan.
  const json j = json::parse(read_text(path), nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("tensors");
}

AnnotationPlan load_plan(const std::string& path) {
  const json j = read_json_file(path, "plan");
  try {
    return plan_from_json(j);
  } catch (const Error& e) {
    fail(e.what(), " (in ", path, ")");
  }
}

}  // namespace hspmd

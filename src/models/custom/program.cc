// Parsing and checking a custom model's program (program.h).
#include "models/custom/program.h"

#include <map>
#include <set>

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"

namespace hspmd::custom {

namespace {

using nlohmann::json;

// What an op takes: its input count (max -1: any) and the attributes it reads.
struct OpSpec {
  int min_inputs, max_inputs;
  std::set<std::string> attrs, required;
};

const std::map<std::string, OpSpec>& op_specs() {
  static const std::map<std::string, OpSpec> specs = {
      {"embedding", {2, 2, {}, {}}},
      {"linear", {2, 2, {}, {}}},
      {"matmul", {2, 2, {"trans_a", "trans_b"}, {}}},
      {"add", {2, 2, {}, {}}},
      {"add_bias", {2, 2, {}, {}}},
      {"mul", {2, 2, {}, {}}},
      {"scale", {1, 1, {"factor"}, {"factor"}}},
      {"rms_norm", {2, 2, {"eps"}, {}}},
      {"rope", {2, 2, {"theta"}, {}}},
      {"swiglu", {2, 2, {}, {}}},
      {"attention", {3, 4, {"scale", "window"}, {}}},
      {"cross_entropy", {3, 3, {"ignore_index"}, {}}},
      {"reshape", {1, 1, {"shape"}, {"shape"}}},
      {"transpose", {1, 1, {"dim0", "dim1"}, {"dim0", "dim1"}}},
      {"slice", {1, 1, {"axis", "begin", "end"}, {"axis", "begin", "end"}}},
      {"concat", {1, -1, {"axis"}, {"axis"}}},
      {"reduce_sum", {1, 1, {"axes"}, {}}},
      {"cast", {1, 1, {"dtype"}, {"dtype"}}},
      {"mark", {1, 1, {"kind", "name"}, {"kind", "name"}}},
  };
  return specs;
}

std::string op_names() {
  std::string out;
  for (const auto& [name, spec] : op_specs()) out += (out.empty() ? "" : ", ") + name;
  return out;
}

bool has_layer(const std::string& s) { return s.find(kLayer) != std::string::npos; }

class Parser {
 public:
  explicit Parser(const std::string& prefix) : prefix_(prefix + "program: ") {}

  template <typename... Args>
  [[noreturn]] void error(const Args&... args) const {
    fail(prefix_, args...);
  }

  Program parse(const json& j) {
    if (!j.is_object()) error("must be an object, got ", j.type_name());
    only_fields(j, {"parameters", "embedding", "block", "head"}, "the program");
    Program p;
    if (!j.contains("parameters") || !j["parameters"].is_array()) error("'parameters' must be a list");
    for (const json& pj : j["parameters"]) p.parameters.push_back(parameter(pj));
    for (const char* part : {"embedding", "block", "head"})
      if (!j.contains(part) || !j[part].is_object()) error("'", part, "' must be an object");
    p.embedding = part(j["embedding"], "embedding", false, true);
    p.block = part(j["block"], "block", true, true);
    p.head = part(j["head"], "head", true, true);
    return p;
  }

 private:
  void only_fields(const json& j, const std::set<std::string>& known, const std::string& what) const {
    for (const auto& [key, value] : j.items())
      if (!known.count(key)) error(what, ": unknown field '", shorten(key), "'");
  }

  static std::string text(const json& j, const char* key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
  }

  ProgramParameter parameter(const json& j) {
    if (!j.is_object()) error("each parameter must be an object, got ", json_excerpt(j));
    ProgramParameter p;
    p.name = text(j, "name");
    const std::string what = "parameter '" + shorten(p.name) + "'";
    if (p.name.empty()) error("a parameter has no 'name' string: ", json_excerpt(j));
    only_fields(j, {"name", "shape", "role", "init", "part"}, what);
    if (!names_.insert(p.name).second) error(what, ": defined twice");
    params_.insert(p.name);
    if (!j.contains("shape") || !j["shape"].is_array() || j["shape"].empty())
      error(what, ": 'shape' must be a non-empty list of sizes");
    for (const json& d : j["shape"]) {
      const bool ok = (d.is_number_integer() && d.get<int64_t>() > 0) || d == "vocab";
      if (!ok) error(what, ": shape entry ", json_excerpt(d), " is not a positive integer or \"vocab\"");
      p.dims.push_back(d);
    }
    const std::string role = j.contains("role") ? text(j, "role") : "replicated";
    static const std::map<std::string, ParamRole> roles = {{"column", ParamRole::kColumnParallel},
                                                           {"row", ParamRole::kRowParallel},
                                                           {"vocabulary", ParamRole::kVocabulary},
                                                           {"replicated", ParamRole::kReplicated}};
    if (!roles.count(role)) error(what, ": role '", shorten(role), "' (expected column, row, vocabulary or replicated)");
    p.role = roles.at(role);
    const std::string init = j.contains("init") ? text(j, "init") : "normal";
    static const std::map<std::string, ParamInit> inits = {
        {"normal", ParamInit::kNormal}, {"ones", ParamInit::kOnes}, {"zeros", ParamInit::kZeros}};
    if (!inits.count(init)) error(what, ": init '", shorten(init), "' (expected normal, ones or zeros)");
    p.init = inits.at(init);
    const std::string part = text(j, "part");
    static const std::map<std::string, ModelPart> parts = {
        {"embedding", ModelPart::kEmbedding}, {"block", ModelPart::kBlock}, {"head", ModelPart::kHead}};
    if (!parts.count(part)) error(what, ": part '", shorten(part), "' (expected embedding, block or head)");
    p.part = parts.at(part);
    if ((p.part == ModelPart::kBlock) != has_layer(p.name))
      error(what, p.part == ModelPart::kBlock ? ": a block parameter's name must hold {i} (the layer)"
                                              : ": only block parameters have {i} in their names");
    if (p.role == ParamRole::kVocabulary && (p.dims.size() != 2 || p.dims[0] != "vocab"))
      error(what, ": a vocabulary parameter's shape must be [\"vocab\", n]");
    return p;
  }

  ProgramPart part(const json& j, const std::string& name, bool has_input, bool has_output) {
    only_fields(j, {"input", "ops", "output"}, name);
    ProgramPart out;
    std::set<std::string> scope = {"input_ids", "targets", "positions", "normalizer"};
    if (has_input) {
      out.input = text(j, "input");
      if (out.input.empty()) error(name, ": 'input' must name the tensor the ", name, " reads");
      scope.insert(out.input);
    }
    if (!j.contains("ops") || !j["ops"].is_array()) error(name, ": 'ops' must be a list");
    for (const json& oj : j["ops"]) out.ops.push_back(op(oj, name, out.ops.size(), scope));
    if (has_output) {
      out.output = text(j, "output");
      if (!scope.count(out.output))
        error(name, ": 'output' ", json_excerpt(j.value("output", json())), " is not a tensor of the ", name);
    }
    return out;
  }

  ProgramOp op(const json& j, const std::string& part, size_t index, std::set<std::string>& scope) {
    if (!j.is_object()) error(part, " op ", index, ": must be an object, got ", json_excerpt(j));
    ProgramOp o;
    o.op = text(j, "op");
    o.output = text(j, "output");
    o.where = part + " op " + std::to_string(index) + " (" + shorten(o.op) + " -> " + shorten(o.output) + ")";
    const auto spec = op_specs().find(o.op);
    if (spec == op_specs().end()) error(o.where, ": unknown op (ops: ", op_names(), ")");
    if (o.output.empty()) error(o.where, ": 'output' must name its result");
    if (!j.contains("inputs") || !j["inputs"].is_array()) error(o.where, ": 'inputs' must be a list of names");
    for (const json& in : j["inputs"]) {
      if (!in.is_string()) error(o.where, ": input ", json_excerpt(in), " is not a name");
      o.inputs.push_back(in.get<std::string>());
      const std::string& n = o.inputs.back();
      if (!scope.count(n) && !params_.count(n)) error(o.where, ": input '", shorten(n), "' is not defined before it");
      if (has_layer(n) && part != "block") error(o.where, ": input '", shorten(n), "' holds {i} outside the block");
    }
    const int count = static_cast<int>(o.inputs.size());
    if (count < spec->second.min_inputs || (spec->second.max_inputs >= 0 && count > spec->second.max_inputs))
      error(o.where, ": takes ", spec->second.min_inputs,
            spec->second.max_inputs == spec->second.min_inputs ? "" : " or more", " inputs, got ", count);
    for (const auto& [key, value] : j.items()) {
      if (key == "op" || key == "inputs" || key == "output") continue;
      if (!spec->second.attrs.count(key)) error(o.where, ": unknown attribute '", shorten(key), "'");
      o.attrs[key] = value;
    }
    for (const std::string& key : spec->second.required)
      if (!o.attrs.contains(key)) error(o.where, ": missing attribute '", key, "'");
    if (scope.count(o.output) || names_.count(o.output)) error(o.where, ": output '", shorten(o.output), "' is already defined");
    if (has_layer(o.output)) error(o.where, ": an op's output name holds no {i} (names are local to the part)");
    scope.insert(o.output);
    if (o.op == "mark") check_mark(o, part);
    return o;
  }

  void check_mark(const ProgramOp& o, const std::string& part) {
    ReshardKind kind;
    if (!o.attrs["kind"].is_string() || !reshard_kind_from_name(o.attrs["kind"].get<std::string>(), kind))
      error(o.where, ": kind ", json_excerpt(o.attrs["kind"]),
            " (expected embedding_output, block_input, positions, sublayer_input, sublayer_output, head_input or "
            "tied_head)");
    if (!o.attrs["name"].is_string() || o.attrs["name"].get<std::string>().empty())
      error(o.where, ": 'name' must be the point's name (a string)");
    const std::string name = o.attrs["name"];
    if ((part == "block") != has_layer(name))
      error(o.where, part == "block" ? ": a block point's name must hold {i}" : ": only block points hold {i}");
    if (!names_.insert(name).second) error(o.where, ": point name '", shorten(name), "' is already a parameter or point");
    const bool in_block = kind == ReshardKind::kBlockInput || kind == ReshardKind::kSublayerInput ||
                          kind == ReshardKind::kSublayerOutput;
    const bool allowed = part == "block" ? in_block || kind == ReshardKind::kPositions
                         : part == "embedding"
                             ? kind == ReshardKind::kEmbeddingOutput || kind == ReshardKind::kPositions
                             : kind == ReshardKind::kHeadInput || kind == ReshardKind::kTiedHead ||
                                   kind == ReshardKind::kPositions;
    if (!allowed) error(o.where, ": kind ", o.attrs["kind"].get<std::string>(), " is not a point of the ", part);
    if (kind == ReshardKind::kTiedHead && (!params_.count(o.inputs[0]) || has_layer(o.inputs[0])))
      error(o.where, ": a tied_head point marks an embedding parameter itself");
  }

  std::string prefix_;
  std::set<std::string> names_;   // parameters and points (unsubstituted)
  std::set<std::string> params_;  // parameters
};

}  // namespace

Program parse_program(const json& j, const std::string& prefix) { return Parser(prefix).parse(j); }

std::string at_layer(const std::string& name, int64_t layer) {
  if (layer < 0) return name;
  std::string out = name;
  const std::string index = std::to_string(layer);
  for (size_t at = out.find(kLayer); at != std::string::npos; at = out.find(kLayer, at + index.size()))
    out.replace(at, 3, index);
  return out;
}

bool reshard_kind_from_name(const std::string& name, ReshardKind& kind) {
  static const std::map<std::string, ReshardKind> kinds = {
      {"embedding_output", ReshardKind::kEmbeddingOutput}, {"block_input", ReshardKind::kBlockInput},
      {"positions", ReshardKind::kPositions},               {"sublayer_input", ReshardKind::kSublayerInput},
      {"sublayer_output", ReshardKind::kSublayerOutput},   {"head_input", ReshardKind::kHeadInput},
      {"tied_head", ReshardKind::kTiedHead}};
  const auto it = kinds.find(name);
  if (it == kinds.end()) return false;
  kind = it->second;
  return true;
}

}  // namespace hspmd::custom

// The program of a user-defined model (model_type "hspmd_custom"): the JSON
// a config's "program" field holds, parsed and checked (docs/models.md,
// "Custom models"). Parsing builds no graph.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/models/model.h"

namespace hspmd::custom {

// The placeholder every layer-dependent name holds: "blocks.{i}.w" is
// "blocks.3.w" in block 3.
inline constexpr const char* kLayer = "{i}";

// One op: `op` applied to the named `inputs` (tensors of its part's scope,
// graph inputs or parameters), its result named `output`; `attrs` holds the
// other fields of its JSON object.
struct ProgramOp {
  std::string op;
  std::vector<std::string> inputs;
  std::string output;
  nlohmann::json attrs = nlohmann::json::object();
  std::string where;  // "block op 3 (linear -> q)", for errors
};

// The ops of one part: the embedding reads the graph inputs and yields
// `output`; the block (instantiated for every layer) reads `input` and
// yields `output`; the head reads `input` and yields the scalar loss `output`.
struct ProgramPart {
  std::string input, output;
  std::vector<ProgramOp> ops;
};

struct ProgramParameter {
  std::string name;                 // with {i} for a block parameter
  std::vector<nlohmann::json> dims; // integers, or "vocab" (the table's rows)
  ParamRole role = ParamRole::kReplicated;
  ParamInit init = ParamInit::kNormal;
  ModelPart part = ModelPart::kBlock;
};

struct Program {
  std::vector<ProgramParameter> parameters;
  ProgramPart embedding, block, head;
};

// Parses `j` (the "program" field); throws hspmd::Error "<prefix>program:
// <what>: <rule>" for a malformed program: unknown fields, ops or kinds, a
// wrong number of inputs, a name used before it is defined or defined twice,
// {i} in a name outside the block (or missing from a block parameter's).
Program parse_program(const nlohmann::json& j, const std::string& prefix);

// `name` with every {i} replaced by `layer` (unchanged when layer < 0).
std::string at_layer(const std::string& name, int64_t layer);

// The kinds of the "mark" op (Reshard points): "embedding_output",
// "block_input", "positions", "sublayer_input", "sublayer_output",
// "head_input", "tied_head"; nullptr-safe parse.
bool reshard_kind_from_name(const std::string& name, ReshardKind& kind);

}  // namespace hspmd::custom

// Helpers of the custom-family tests (test_custom_family.cc,
// test_custom_scale.cc): one op of an hspmd_custom program as JSON.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace hspmd::custom_program {

using nlohmann::json;

// {"op": name, "inputs": inputs, "output": output, ...attrs}
inline json op(const std::string& name, std::vector<std::string> inputs, const std::string& output,
               json attrs = json::object()) {
  attrs["op"] = name;
  attrs["inputs"] = inputs;
  attrs["output"] = output;
  return attrs;
}

// A Reshard point of the given kind and name.
inline json mark(const std::string& in, const std::string& out, const std::string& kind, const std::string& name) {
  return op("mark", {in}, out, {{"kind", kind}, {"name", name}});
}

}  // namespace hspmd::custom_program

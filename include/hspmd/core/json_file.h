// Reading a JSON file with the project's one-line errors.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace hspmd {

// Parses the JSON file at `path`. Throws hspmd::Error "[<object>] <path>:
// cannot open file" or "[<object>] <path>: not valid JSON (<parser message>)",
// one line, where `object` names what the file holds ("config", "strategy").
nlohmann::json read_json_file(const std::string& path, const std::string& object);

}  // namespace hspmd

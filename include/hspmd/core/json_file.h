// Reading JSON with the project's one-line errors and strict rules: every
// JSON text hspmd reads (configs, strategies, clusters, plans, profiles,
// safetensors headers, checkpoint indexes) goes through parse_json_text.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "hspmd/core/limits.h"

namespace hspmd {

// Parses `text` strictly: a key repeated within one object and nesting deeper
// than kMaxJsonDepth are errors. Throws hspmd::Error, one line, "[<object>]
// <source>: not valid JSON (<parser message, shortened>)", "[<object>]
// <source>: duplicate key '<key>'" or "[<object>] <source>: JSON nested deeper
// than 128 levels", where `object` names what the text holds ("config",
// "strategy") and `source` the file.
nlohmann::json parse_json_text(const std::string& text, const std::string& object, const std::string& source);

// Reads the JSON file at `path` with parse_json_text. Also throws "[<object>]
// <path>: cannot open file" and "[<object>] <path>: is not a regular file"
// (a FIFO or a device is refused before it is opened, so reading never blocks).
nlohmann::json read_json_file(const std::string& path, const std::string& object);

// Throws hspmd::Error "[<object>] <path>: is not a regular file" when `path`
// exists and is not a regular file; "[<object>] <path>: no such file" when it
// does not exist.
void require_regular_file(const std::string& path, const std::string& object);

// `text` cut to kMaxEchoChars characters followed by "..." when longer.
std::string shorten(const std::string& text, std::size_t max_chars = kMaxEchoChars);

// The JSON text of `v` for an error message, shortened like shorten().
std::string json_excerpt(const nlohmann::json& v, std::size_t max_chars = kMaxEchoChars);

}  // namespace hspmd

#include "hspmd/core/json_file.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include "hspmd/core/error.h"

namespace hspmd {

std::string shorten(const std::string& text, std::size_t max_chars) {
  if (text.size() <= max_chars) return text;
  return text.substr(0, max_chars) + "...";
}

std::string json_excerpt(const nlohmann::json& v, std::size_t max_chars) {
  // Strings are echoed by hand so that a 10 MB string is not copied twice.
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    std::string out(1, '"');
    out += shorten(s, max_chars);
    if (s.size() <= max_chars) out += '"';
    return out;
  }
  return shorten(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), max_chars);
}

nlohmann::json parse_json_text(const std::string& text, const std::string& object, const std::string& source) {
  using nlohmann::json;
  // One set of keys per open object; the callback sees every key in order.
  std::vector<std::set<std::string>> open;
  auto check = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > kMaxJsonDepth) fail("[", object, "] ", source, ": JSON nested deeper than ", kMaxJsonDepth, " levels");
    if (event == json::parse_event_t::object_start) open.emplace_back();
    else if (event == json::parse_event_t::object_end && !open.empty()) open.pop_back();
    else if (event == json::parse_event_t::key && !open.empty() &&
             !open.back().insert(parsed.get<std::string>()).second)
      fail("[", object, "] ", source, ": duplicate key '", shorten(parsed.get<std::string>()), "'");
    return true;
  };
  try {
    return json::parse(text, check);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e309
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    fail("[", object, "] ", source, ": not valid JSON (", shorten(what, 2 * kMaxEchoChars), ")");
  }
}

void require_regular_file(const std::string& path, const std::string& object) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) fail("[", object, "] ", path, ": no such file");
  if (!std::filesystem::is_regular_file(status)) fail("[", object, "] ", path, ": is not a regular file");
}

nlohmann::json read_json_file(const std::string& path, const std::string& object) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status))
    fail("[", object, "] ", path, ": is not a regular file");
  std::ifstream in(path);
  if (!in) fail("[", object, "] ", path, ": cannot open file");
  std::stringstream text;
  text << in.rdbuf();
  return parse_json_text(text.str(), object, path);
}

}  // namespace hspmd

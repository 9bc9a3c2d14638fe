#include "hspmd/core/json_file.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "hspmd/core/error.h"

namespace hspmd {

nlohmann::json read_json_file(const std::string& path, const std::string& object) {
  std::ifstream in(path);
  if (!in) fail("[", object, "] ", path, ": cannot open file");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    fail("[", object, "] ", path, ": not valid JSON (", what, ")");
  }
}

}  // namespace hspmd

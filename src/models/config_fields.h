// Reading the fields of a Hugging Face config.json (models/config.h), for
// the shared decoder fields and each family's own (models/model.h).
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"

namespace hspmd {

// Reads fields of one config object, naming `source` in every error.
class ConfigFields {
 public:
  ConfigFields(const nlohmann::json& j, const std::string& source) : j_(j), source_(source) {}

  template <typename... Args>
  [[noreturn]] void fail_rule(const Args&... args) const {
    fail("[config] ", source_, ": ", args...);
  }

  // Required fields: absent -> error. Optional: absent or null -> `out` unchanged.
  void integer(const char* name, int64_t& out, bool required) const {
    if (const nlohmann::json* v = find(name, required)) {
      if (!v->is_number_integer()) wrong_type(name, "an integer", *v);
      out = v->get<int64_t>();
    }
  }
  void number(const char* name, double& out) const {
    if (const nlohmann::json* v = find(name, false)) {
      if (!v->is_number()) wrong_type(name, "a number", *v);
      out = v->get<double>();
    }
  }
  void string(const char* name, std::string& out) const {
    if (const nlohmann::json* v = find(name, false)) {
      if (!v->is_string()) wrong_type(name, "a string", *v);
      out = v->get<std::string>();
    }
  }
  void boolean(const char* name, bool& out) const {
    if (const nlohmann::json* v = find(name, false)) {
      if (!v->is_boolean()) wrong_type(name, "a boolean", *v);
      out = v->get<bool>();
    }
  }
  // Hugging Face allows a list of EOS ids; the first one ends documents.
  void integer_or_first_of_list(const char* name, int64_t& out) const {
    const nlohmann::json* v = find(name, false);
    if (!v) return;
    if (v->is_array()) {
      if (v->empty()) fail_rule("field '", name, "' is an empty list");
      v = &(*v)[0];
    }
    if (!v->is_number_integer()) wrong_type(name, "an integer or a list of integers", *v);
    out = v->get<int64_t>();
  }

  // Whether `name` is in the object, null or not / with a non-null value.
  bool present(const char* name) const { return j_.contains(name); }
  bool given(const char* name) const { return j_.contains(name) && !j_[name].is_null(); }
  const nlohmann::json& object() const { return j_; }

 private:
  const nlohmann::json* find(const char* name, bool required) const {
    auto it = j_.find(name);
    if (it == j_.end() || (!required && it->is_null())) {
      if (required) fail_rule("missing required field '", name, "'");
      return nullptr;
    }
    return &*it;
  }
  [[noreturn]] void wrong_type(const char* name, const char* expected, const nlohmann::json& v) const {
    fail_rule("field '", name, "' must be ", expected, ", got ", v.type_name(), " ", json_excerpt(v));
  }

  const nlohmann::json& j_;
  const std::string& source_;
};

}  // namespace hspmd

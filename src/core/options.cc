#include "hspmd/core/options.h"

#include <atomic>

namespace hspmd {

namespace {
std::atomic<OptionSpelling> g_spelling{OptionSpelling::kFlag};
}

void set_option_spelling(OptionSpelling spelling) { g_spelling = spelling; }
OptionSpelling option_spelling() { return g_spelling.load(); }

std::string option_name(std::string_view field) {
  std::string out(field);
  if (option_spelling() == OptionSpelling::kKeyword) return out;
  for (char& c : out)
    if (c == '_') c = '-';
  return "--" + out;
}

std::string options_tag() { return option_spelling() == OptionSpelling::kFlag ? "[flags]" : "[options]"; }

std::string option_ref(std::string_view field) { return options_tag() + " " + option_name(field); }

namespace {
template <typename V>
const V& alternative(const OptionValue& v) {
  const V* p = std::get_if<V>(&v);
  HSPMD_CHECK(p != nullptr, "an option value of another type than its schema row's");
  return *p;
}
}  // namespace

bool option_bool(const OptionValue& v) { return alternative<bool>(v); }
int64_t option_int(const OptionValue& v) { return alternative<int64_t>(v); }
double option_double(const OptionValue& v) { return alternative<double>(v); }
const std::string& option_string(const OptionValue& v) { return alternative<std::string>(v); }

const char* option_placeholder(OptionType type) {
  switch (type) {
    case OptionType::kBool: return "";
    case OptionType::kInt: return "N";
    case OptionType::kDouble: return "X";
    case OptionType::kString: return "STR";
  }
  return "";
}

}  // namespace hspmd

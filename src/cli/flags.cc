#include "flags.h"

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <sstream>

#include "hspmd/core/error.h"
#include "hspmd/core/limits.h"

namespace hspmd::cli {

std::vector<std::string> expand_short_output(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (const auto& a : args) out.push_back(a == "-o" ? "--output" : a);
  return out;
}

int64_t parse_int(const std::string& flag, const std::string& v, const IntRange& range) {
  int64_t out = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (end != v.data() + v.size() || v.empty() || (ec != std::errc() && ec != std::errc::result_out_of_range))
    fail("[flags] --", flag, ": '", v, "' is not an integer");
  if (ec == std::errc::result_out_of_range) fail_int_range("[flags] --" + flag, v, range);
  return check_int_range("[flags] --" + flag, out, range);
}

std::set<int> parse_ranks(const std::string& text, int world, const char* flag) {
  std::set<int> out;
  std::stringstream ss(text);
  // A rank is below kMaxWorldSize: a larger number is refused by the one
  // range check, never cut to 32 bits (nor a range walked for billions).
  const std::string name = std::string(flag).substr(std::string(flag).rfind("--", 0) == 0 ? 2 : 0);
  const IntRange ranks{0, kMaxWorldSize - 1};
  auto trim = [](const std::string& s) {
    const size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  auto is_number = [](const std::string& s) {
    return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
  };
  for (std::string item; std::getline(ss, item, ',');) {
    item = trim(item);
    const size_t dash = item.find('-', 1);
    const std::string a = trim(item.substr(0, dash)), b = dash == std::string::npos ? a : trim(item.substr(dash + 1));
    if (!is_number(a) || !is_number(b))
      fail("[flags] ", flag, ": '", item, "' is not a rank or a range first-last");
    const int first = static_cast<int>(parse_int(name, a, ranks));
    const int last = static_cast<int>(parse_int(name, b, ranks));
    if (last < first) fail("[flags] ", flag, ": range '", item, "' ends before it begins");
    for (int r = first; r <= last; ++r) {
      if (r < 0 || (world > 0 && r >= world))
        fail("[flags] ", flag, ": rank ", r, " is outside the world of ", world, " ranks");
      out.insert(r);
    }
  }
  return out;
}

void check_input_file(const std::string& flag, const std::string& path) {
  struct stat st;
  if (path.empty() || stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return;
  const char* what = S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                                            : "a device";
  fail("[flags] ", flag, " ", path, " is ", what, ", not a regular file");
}

void check_outputs(const std::vector<NamedPath>& inputs, const std::vector<OutputFlag>& outputs) {
  std::vector<NamedPath> named;
  for (const OutputFlag& o : outputs) {
    check_output_file("[flags] " + o.flag, o.path, o.how);
    named.push_back({o.flag, o.path});
  }
  check_outputs_apart(inputs, named);
}

namespace {

double parse_double(const std::string& flag, const std::string& v) {
  try {
    size_t pos = 0;
    double out = std::stod(v, &pos);
    if (pos == v.size()) return out;
  } catch (const std::exception&) {
  }
  fail("[flags] --", flag, ": '", v, "' is not a number");
}

}  // namespace

void FlagSet::add_string(const std::string& name, std::string* target, const std::string& help,
                         bool required) {
  flags_.push_back({name, help, "STR", required, false, [target](const std::string& v) { *target = v; }});
}

void FlagSet::add_list(const std::string& name, std::vector<std::string>* target, const std::string& help) {
  flags_.push_back({name, help, "STR", false, false, [target](const std::string& v) { target->push_back(v); }});
  flags_.back().repeats = true;
}

void FlagSet::add_int(const std::string& name, int64_t* target, const std::string& help, bool required,
                      IntRange range) {
  flags_.push_back({name, help, "N", required, false,
                    [name, target, range](const std::string& v) { *target = parse_int(name, v, range); }});
}

void FlagSet::add_int(const std::string& name, int* target, const std::string& help, bool required,
                      IntRange range) {
  range.lo = std::max(range.lo, kIntRange.lo);
  range.hi = std::min(range.hi, kIntRange.hi);
  flags_.push_back({name, help, "N", required, false, [name, target, range](const std::string& v) {
                      *target = static_cast<int>(parse_int(name, v, range));
                    }});
}

void FlagSet::add_double(const std::string& name, double* target, const std::string& help,
                         bool required) {
  flags_.push_back({name, help, "X", required, false,
                    [name, target](const std::string& v) { *target = parse_double(name, v); }});
}

void FlagSet::add_value(const std::string& name, OptionType type, const std::string& help, bool required,
                        IntRange range, std::function<void(const OptionValue&)> set) {
  flags_.push_back({name, help, option_placeholder(type), required, false,
                    [name, type, range, set = std::move(set)](const std::string& v) {
                      switch (type) {
                        case OptionType::kBool: set(OptionValue{true}); break;
                        case OptionType::kInt: set(OptionValue{parse_int(name, v, range)}); break;
                        case OptionType::kDouble: set(OptionValue{parse_double(name, v)}); break;
                        case OptionType::kString: set(OptionValue{v}); break;
                      }
                    }});
}

void FlagSet::add_bool(const std::string& name, bool* target, const std::string& help) {
  flags_.push_back({name, help, "", false, false, [target](const std::string&) { *target = true; }});
}

bool FlagSet::given(const std::string& name) const {
  for (const auto& f : flags_)
    if (f.name == name) return f.seen;
  return false;
}

FlagSet::Flag* FlagSet::find(const std::string& name) {
  for (auto& f : flags_)
    if (f.name == name) return &f;
  return nullptr;
}

bool FlagSet::parse(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    if (a.rfind("--", 0) != 0) {
      if (positional_usage_.empty()) fail("[flags] ", command_, ": unexpected argument '", a, "'");
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    const bool inline_value = name.find('=') != std::string::npos;
    if (inline_value) {
      value = name.substr(name.find('=') + 1);
      name = name.substr(0, name.find('='));
    }
    Flag* f = find(name);
    if (f == nullptr) fail("[flags] ", command_, ": unknown flag --", name, " (see --help)");
    if (f->seen && !f->repeats) fail("[flags] --", name, " given twice");
    f->seen = true;
    if (f->kind.empty()) {
      if (inline_value) fail("[flags] --", name, " takes no value");
      f->set("");
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= args.size()) fail("[flags] --", name, " needs a value");
      value = args[++i];
    }
    f->set(value);
  }
  for (const auto& f : flags_)
    if (f.required && !f.seen) fail("[flags] ", command_, ": --", f.name, " is required");
  return true;
}

std::string FlagSet::help() const {
  std::ostringstream os;
  os << "usage: hspmd " << command_ << " [flags]"
     << (positional_usage_.empty() ? "" : " " + positional_usage_) << "\n\n"
     << summary_ << "\n\nflags:\n";
  for (const auto& f : flags_) {
    std::string lhs = "  --" + f.name + (f.kind.empty() ? "" : " " + f.kind);
    if (lhs.size() < 28) lhs.resize(28, ' ');
    os << lhs << " " << f.help << (f.required ? " (required)" : "") << (f.repeats ? " (repeatable)" : "") << "\n";
  }
  os << "  --help                       show this help\n";
  return os.str();
}

}  // namespace hspmd::cli

// How an option is named to the user. Library code names an option by its
// field ("seq_len", the Python keyword); the front end that read it decides
// the spelling once, at its start: the `hspmd` command line as a flag
// ("--seq-len"), the Python module as the keyword. So an error raised
// anywhere in a run names the option the way the user gave it:
//   command line: [flags] --seq-len must be positive, got 0
//   Python:       [options] seq_len must be positive, got 0
// No library file spells a flag (tests/options/flag_literal_lint.py).
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/core/int_range.h"

namespace hspmd {

enum class OptionSpelling {
  kFlag,     // "--seq-len" (the hspmd command line; the default)
  kKeyword,  // "seq_len" (the Python module)
};

// Set by a front end before it reads options (process-wide; the ranks of a
// job are all started by the same front end).
void set_option_spelling(OptionSpelling spelling);
OptionSpelling option_spelling();

// `field` as the user spells it: "--seq-len" or "seq_len".
std::string option_name(std::string_view field);
// The prefix of an error about the option: "[flags] --seq-len" or
// "[options] seq_len".
std::string option_ref(std::string_view field);

// Throws hspmd::Error "<option_ref(field)><rest...>", e.g.
// fail_option("steps", " must be positive, got ", 0).
template <typename... Args>
[[noreturn]] void fail_option(std::string_view field, const Args&... rest) {
  throw Error(option_ref(field) + detail::concat(rest...));
}

// The prefix of an error about the options in general: "[flags]" or "[options]".
std::string options_tag();

// An options schema: one row per option of an options struct `T`, from
// which the front ends generate their interfaces (the command line its
// flags and --help, Python its keyword arguments), so an option is declared
// once. The row's `set` writes a value read by a front end into `T`,
// converting it (e.g. "adamw" to AdamConfig::decoupled_weight_decay) and
// refusing a value outside the option's set of choices; every rule between
// values is the schema's validate(), run after all are set.
enum class OptionType { kBool, kInt, kDouble, kString };
using OptionValue = std::variant<bool, int64_t, double, std::string>;

template <typename T>
struct OptionSpec {
  const char* name;  // the field: "seq_len" (the flag --seq-len, the keyword seq_len)
  OptionType type;
  const char* doc;   // one line for the help, with the default
  std::function<void(T&, const OptionValue&)> set;
  bool required = false;  // the command line refuses a run without it
  IntRange range = {};    // kInt: values outside are refused as they are read
};

// The options a user gave (by field; a default is not given): the rules
// that depend on it ("seq_len is not read with batch_tokens") read it.
using GivenOptions = std::set<std::string>;

// `v`'s alternative for `type` (InternalError when the front end passed another).
bool option_bool(const OptionValue& v);
int64_t option_int(const OptionValue& v);
double option_double(const OptionValue& v);
const std::string& option_string(const OptionValue& v);
// "N", "X", "STR" or "" (a switch): the value's placeholder in a help line.
const char* option_placeholder(OptionType type);

}  // namespace hspmd

// A small command-line flag parser: "--name value" and "--name=value",
// boolean switches, required flags, generated --help.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "hspmd/core/int_range.h"
#include "hspmd/core/options.h"
#include "hspmd/io/output_file.h"

namespace hspmd::cli {

// `v` as an integer in `range` (the one integer-range check,
// hspmd/core/int_range.h); hspmd::Error "[flags] --<flag>: '<v>' is not an
// integer" or "[flags] --<flag> <v> is outside [lo, hi]" (also for a value
// beyond 64 bits).
int64_t parse_int(const std::string& flag, const std::string& v, const IntRange& range = {});

// FlagSet knows only long flags: `-o X` is the conventional spelling of
// `--output X`.
std::vector<std::string> expand_short_output(const std::vector<std::string>& args);

// "3,5,8-15" -> ranks; each must lie in [0, world) when world > 0.
// hspmd::Error "[flags] <flag>: ..." for an item that is no rank or range.
std::set<int> parse_ranks(const std::string& text, int world, const char* flag);

// An input file named by `flag` must be a regular file when it exists:
// hspmd::Error "[flags] <flag> <path> is a directory, not a file" (or a FIFO,
// a device, ...), so that a loader never blocks on a FIFO nor reports a
// directory as missing. A path that does not exist is left to the loader.
void check_input_file(const std::string& flag, const std::string& path);

// A file a command writes: the flag that names it, its path (empty: not
// written) and how the writer puts it there.
struct OutputFlag {
  std::string flag;  // e.g. "--output"
  std::string path;
  OutputWrite how = OutputWrite::kStream;
};

// The output check of every command, made before any work (one rule in one
// place, docs/reliability.md): each output passes check_output_file (its
// directory takes a new file; it is no directory, FIFO or socket, symbolic
// links followed; kRename: no device either) and none is one of `inputs` or
// another output (check_outputs_apart). hspmd::Error "[flags] <flag> <path>:
// <why>". The writers check again as they write (write_output_file,
// include/hspmd/io/text_output.h).
void check_outputs(const std::vector<NamedPath>& inputs, const std::vector<OutputFlag>& outputs);

class FlagSet {
 public:
  FlagSet(std::string command, std::string summary)
      : command_(std::move(command)), summary_(std::move(summary)) {}

  void add_string(const std::string& name, std::string* target, const std::string& help,
                  bool required = false);
  // An integer flag; a value outside `range` is refused by the parser
  // (parse_int). The int overload refuses what an int cannot hold, so a flag
  // read into an int is never cut to 32 bits.
  void add_int(const std::string& name, int64_t* target, const std::string& help,
               bool required = false, IntRange range = {});
  void add_int(const std::string& name, int* target, const std::string& help,
               bool required = false, IntRange range = kIntRange);
  void add_double(const std::string& name, double* target, const std::string& help,
                  bool required = false);
  void add_bool(const std::string& name, bool* target, const std::string& help);
  // A flag whose value (of `type`, an integer within `range`) goes to `set`:
  // an options schema's row (hspmd/core/options.h).
  void add_value(const std::string& name, OptionType type, const std::string& help, bool required, IntRange range,
                 std::function<void(const OptionValue&)> set);
  // A flag that may repeat: each value is appended to `target`.
  void add_list(const std::string& name, std::vector<std::string>* target, const std::string& help);
  // Positional arguments are collected when allowed, with this usage text.
  void allow_positional(const std::string& usage) { positional_usage_ = usage; }

  // Parses args (without the program and command names). Returns false when
  // --help was given (the help text is then printed to stdout). Throws
  // hspmd::Error "[flags] ..." for an unknown flag, a missing or malformed
  // value, or a missing required flag.
  bool parse(const std::vector<std::string>& args);
  const std::vector<std::string>& positional() const { return positional_; }
  // Whether the last parse() saw --<name> (a default is not "given").
  bool given(const std::string& name) const;
  std::string help() const;

 private:
  struct Flag {
    std::string name, help, kind;
    bool required = false;
    bool seen = false;
    std::function<void(const std::string&)> set;
    bool repeats = false;
  };
  Flag* find(const std::string& name);

  std::string command_, summary_, positional_usage_;
  std::vector<Flag> flags_;
  std::vector<std::string> positional_;
};

}  // namespace hspmd::cli

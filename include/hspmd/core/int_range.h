// The one integer-range check: every parser of a user's integer (the CLI's
// flags, src/cli/flags.h; the Python bindings, python/src/int_arg.h) goes
// through it, so that no value is cut to 32 bits or wraps on its way to the
// code that reads it (docs/reliability.md "Outputs, integer ranges and
// hspmd launch").
#pragma once

#include <cstdint>
#include <limits>
#include <string>

namespace hspmd {

// The integers [lo, hi], both included.
struct IntRange {
  int64_t lo = std::numeric_limits<int64_t>::min();
  int64_t hi = std::numeric_limits<int64_t>::max();
};

// Every value an int holds, and its positive and non-negative parts.
constexpr IntRange kIntRange{std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
constexpr IntRange kPositiveInt{1, std::numeric_limits<int32_t>::max()};
constexpr IntRange kNonNegativeInt{0, std::numeric_limits<int32_t>::max()};

// "[lo, hi]".
std::string to_string(const IntRange& range);

// Returns `value` when it lies in `range`; else throws hspmd::Error
// "<what> <value> is outside [lo, hi]" (one line), where `what` names the
// flag or argument ("[flags] --world", "[python] compile_plan: world").
int64_t check_int_range(const std::string& what, int64_t value, const IntRange& range);

// The same for an integer written in decimal that does not fit in 64 bits
// (`text` is echoed, shortened): always throws "<what> <text> is outside
// [lo, hi]".
[[noreturn]] void fail_int_range(const std::string& what, const std::string& text, const IntRange& range);

}  // namespace hspmd

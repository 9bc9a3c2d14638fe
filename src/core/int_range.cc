#include "hspmd/core/int_range.h"

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"

namespace hspmd {

std::string to_string(const IntRange& range) {
  return "[" + std::to_string(range.lo) + ", " + std::to_string(range.hi) + "]";
}

int64_t check_int_range(const std::string& what, int64_t value, const IntRange& range) {
  if (value < range.lo || value > range.hi) fail(what, " ", value, " is outside ", to_string(range));
  return value;
}

void fail_int_range(const std::string& what, const std::string& text, const IntRange& range) {
  fail(what, " ", shorten(text), " is outside ", to_string(range));
}

}  // namespace hspmd

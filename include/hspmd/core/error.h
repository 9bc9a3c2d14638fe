// Error reporting for hspmd.
//
// Two families:
//  * hspmd::Error — a user mistake (bad config, plan, data, flags). The message
//    is one line: "[object] what is wrong". The CLI prints it and exits non-zero.
//  * hspmd::InternalError — a broken internal invariant (a bug). Raised through
//    HSPMD_CHECK; library code never aborts the process.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace hspmd {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

// Throws hspmd::Error with the concatenation of `args`.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(detail::concat(args...));
}

}  // namespace hspmd

// Internal invariant: throws InternalError naming the file, line and condition.
#define HSPMD_CHECK(cond, ...)                                                  \
  do {                                                                          \
    if (!(cond))                                                                \
      throw ::hspmd::InternalError(::hspmd::detail::concat(                     \
          __FILE__, ":", __LINE__, ": check failed: " #cond " ", ##__VA_ARGS__)); \
  } while (0)

// Helpers shared by the unit tests.
#pragma once

#include <functional>
#include <string>

#include "hspmd/core/error.h"

namespace hspmd::testing {

// The message of the hspmd::Error that `f` throws, or "" when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace hspmd::testing

// Bounds on what hspmd reads from files, so that a malformed or hostile input
// fails with one line instead of exhausting the stack or the memory.
#pragma once

#include <cstddef>

namespace hspmd {

// Deepest nesting of arrays and objects a JSON file may have.
constexpr int kMaxJsonDepth = 128;

// Largest world (ranks) a plan, strategy or cluster may describe.
constexpr int kMaxWorldSize = 1 << 20;

// Characters of a value that an error message echoes before "...".
constexpr std::size_t kMaxEchoChars = 80;

}  // namespace hspmd

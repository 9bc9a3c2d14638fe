// Writing a command's text output (a plan, a strategy, a profile, an SVG):
// every such writer goes through write_output_file, which makes the shared
// output check (check_output_file, include/hspmd/io/output_file.h) and never
// blocks on a FIFO (docs/reliability.md "Outputs, integer ranges and hspmd
// launch").
#pragma once

#include <string>

namespace hspmd {

// Writes `text` to `path` in place (a device such as /dev/null is a valid,
// discarding target). Throws hspmd::Error "<what> <path>: <why>" (one line)
// when check_output_file(what, path, OutputWrite::kStream) refuses the path
// (a directory, a FIFO or socket -- symbolic links followed --, a missing
// directory, no permission), when it cannot be opened, or when a write
// fails. The file is opened without blocking, so a FIFO that appears after
// the check is refused too, not waited on.
void write_output_file(const std::string& what, const std::string& path, const std::string& text);

}  // namespace hspmd

// Subcommands of the hspmd executable. Each takes its arguments (after the
// subcommand name) and returns the process exit code; user errors are thrown
// as hspmd::Error and printed by main().
#pragma once

#include <string>
#include <vector>

namespace hspmd::cli {

int train_command(const std::vector<std::string>& args);
int tokenize_command(const std::vector<std::string>& args);
// "plan compile" and "plan explain"; args start with the subcommand.
int plan_command(const std::vector<std::string>& args);
// "data stats": document-length statistics of a token file; args start with the subcommand.
int data_command(const std::vector<std::string>& args);
// "profile": time a model's parts on this machine (docs/profiling.md).
int profile_command(const std::vector<std::string>& args);

}  // namespace hspmd::cli

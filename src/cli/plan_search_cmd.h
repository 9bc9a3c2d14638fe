// hspmd plan cost and hspmd plan search (docs/planner.md).
#pragma once

#include <string>
#include <vector>

namespace hspmd::cli {

// args: the flags after "plan cost" / "plan search".
int plan_cost_command(const std::vector<std::string>& args);
int plan_search_command(const std::vector<std::string>& args);

}  // namespace hspmd::cli

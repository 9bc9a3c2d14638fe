#include "train/op_times.h"

#include <algorithm>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"

namespace hspmd {

void write_op_times(const std::string& path, int rank, int world_size, int64_t step, double step_time_s,
                    const std::string& device, const std::vector<ExecGraph::OpTiming>& timings) {
  struct Sum {
    int64_t calls = 0;
    double seconds = 0, bytes = 0, flops = 0;
  };
  std::map<std::string, Sum> by_type;
  double total = 0;
  for (const ExecGraph::OpTiming& t : timings) {
    t.end.synchronize();
    const double s = t.end.elapsed_ms(t.start) / 1e3;
    Sum& sum = by_type[t.type];
    ++sum.calls;
    sum.seconds += s;
    sum.bytes += t.bytes;
    sum.flops += t.flops;
    total += s;
  }
  std::vector<std::pair<std::string, Sum>> rows(by_type.begin(), by_type.end());
  std::stable_sort(rows.begin(), rows.end(),
                   [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  nlohmann::json ops = nlohmann::json::array();
  for (const auto& [type, sum] : rows)
    ops.push_back({{"type", type},
                   {"calls", sum.calls},
                   {"seconds", sum.seconds},
                   {"share_of_step", step_time_s > 0 ? sum.seconds / step_time_s : 0.0},
                   {"bytes", sum.bytes},
                   {"flops", sum.flops},
                   {"gb_per_s", sum.seconds > 0 ? sum.bytes / sum.seconds / 1e9 : 0.0},
                   {"tflop_per_s", sum.seconds > 0 ? sum.flops / sum.seconds / 1e12 : 0.0}});
  const nlohmann::json j = {{"step", step},
                            {"rank", rank},
                            {"device", device},
                            {"step_time_s", step_time_s},
                            {"ops_total_s", total},
                            {"outside_ops_s", step_time_s - total},
                            {"ops", ops}};
  const std::string file = world_size > 1 ? path + ".rank" + std::to_string(rank) : path;
  std::ofstream out(file);
  out << j.dump(1) << "\n";
  out.close();
  if (!out) fail("[train] ", option_name("op_times"), " ", file, ": cannot write it");
}

}  // namespace hspmd

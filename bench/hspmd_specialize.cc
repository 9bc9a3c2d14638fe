// One rank's specialization of a plan, as the distributed trainer does it
// when it starts or switches plans: the rank's ExecGraph, its dry run (the
// Reshards it takes part in), the groups this rank creates, and the
// discovered pipelines. --full takes the dry run of every rank instead (the
// trainer's path before ExecGraph::dry_run). Prints each part's seconds and
// the process's peak RSS on one JSON line (bench/specialize_scale.py runs it
// at several world sizes).
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "hspmd/core/error.h"
#include "hspmd/exec/exec_graph.h"
#include "hspmd/plan/pipelines.h"
#include "hspmd/plan/plan.h"

using namespace hspmd;

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

// The resident set now (VmRSS), in MB: what the process holds at this point.
double rss_mb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;
  return 0;
}

struct Args {
  std::string plan, cluster;
  int rank = 0;
  bool full = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--rank" && i + 1 < argc) a.rank = std::atoi(argv[++i]);
    else if (arg == "--cluster" && i + 1 < argc) a.cluster = argv[++i];
    else if (arg == "--full") a.full = true;
    else if (a.plan.empty() && arg.rfind("--", 0) != 0) a.plan = arg;
    else fail("[flags] hspmd_specialize PLAN.json [--rank R] [--cluster C.json] [--full]: unexpected '", arg, "'");
  }
  if (a.plan.empty()) fail("[flags] hspmd_specialize: missing PLAN.json");
  return a;
}

int run(const Args& a) {
  auto t0 = Clock::now();
  const auto plan = std::make_shared<const AnnotationPlan>(load_plan(a.plan));
  const auto topology = std::make_shared<const Topology>(
      a.cluster.empty() ? Topology::uniform(plan->world_size) : Topology::load(a.cluster));
  if (a.rank < 0 || a.rank >= plan->world_size) fail("[flags] --rank ", a.rank, " is outside the world");
  nlohmann::json out = {{"world", plan->world_size}, {"rank", a.rank}, {"load_s", since(t0)},
                        {"plan_rss_mb", rss_mb()}};
  const Bindings bindings(plan->bindings.begin(), plan->bindings.end());

  t0 = Clock::now();
  ExecGraph graph(plan, topology, a.rank, bindings);
  out["exec_graph_s"] = since(t0);

  t0 = Clock::now();
  std::vector<PlannedOpTraffic> traffic;
  const std::vector<PlannedReshard> reshards = a.full ? dry_run(*plan, *topology, &traffic) : graph.dry_run(&traffic);
  std::set<std::vector<int>> groups;
  for (const PlannedReshard& r : reshards) {
    auto it = r.resolution().ranks.find(a.rank);
    if (it == r.resolution().ranks.end()) continue;
    for (const CommPhase& phase : it->second.phases)
      for (const CommOp& op : phase.ops)
        if (is_collective(op.kind) && op.group.size() > 1) groups.insert(op.group);
  }
  out["dry_run_s"] = since(t0);

  t0 = Clock::now();
  const auto pipelines = a.full ? discover_pipelines(*plan, reshards) : graph.discover_pipelines();
  const PipelinePosition at = pipeline_positions(pipelines, plan->world_size).at(a.rank);
  out["pipelines_s"] = since(t0);

  out["pipeline"] = at.pipeline;
  out["stage"] = at.stage;
  out["groups"] = groups.size();
  out["rss_mb"] = rss_mb();  // the graph, the dry run and the pipelines still held
  out["max_rss_mb"] = peak_rss_mb();
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hspmd_specialize: error: %s\n", e.what());
    return 1;
  }
}

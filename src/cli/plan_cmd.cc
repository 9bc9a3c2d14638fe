// hspmd plan compile | explain: strategy -> annotation plan, and the dry run
// of a plan's communication, rank by rank.
#include <climits>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include "commands.h"
#include "flags.h"
#include "hspmd/core/error.h"
#include "hspmd/plan/pipelines.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/strategy.h"
#include "hspmd/resolve/resolver.h"
#include "hspmd/resolve/topology.h"

namespace hspmd::cli {
namespace {

constexpr const char* kPlanUsage =
    "usage: hspmd plan <subcommand> [flags]\n\n"
    "Annotation plans: compile a strategy into one, and show the communication it implies.\n\n"
    "subcommands:\n"
    "  compile    strategy JSON + model config -> annotation plan JSON\n"
    "  explain    dry run of a plan: every Reshard, each rank's primitives and bytes\n\n"
    "Run 'hspmd plan <subcommand> --help' for its flags.\n";

// FlagSet knows only long flags; `-o X` is the conventional spelling of --output.
std::vector<std::string> expand_short_output(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (const auto& a : args) out.push_back(a == "-o" ? "--output" : a);
  return out;
}

std::string human_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

std::string list(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

// Writes `text` to `path` in one go, so that nothing is written on an earlier error.
void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  if (!out) fail("[cli] ", path, ": cannot open for writing");
  out << text;
  if (!out.flush()) fail("[cli] ", path, ": write failed");
}

int stage_count(const Strategy& s) {
  int n = 0;
  for (const auto& p : s.pipelines) n += static_cast<int>(p.stages.size());
  return n;
}

int compile_command(const std::vector<std::string>& args) {
  std::string model, strategy_path, output;
  int64_t world = 0, seq_len = 0;
  FlagSet f("plan compile", "Compile a strategy (docs/strategy.md) into an annotation plan (docs/plan.md).");
  f.add_string("model", &model, "Hugging Face config.json of the model", true);
  f.add_string("strategy", &strategy_path, "strategy JSON", true);
  f.add_int("world", &world, "number of ranks of the world", true);
  f.add_int("seq-len", &seq_len, "sequence length for byte counts (default: max_position_embeddings)");
  f.add_string("output", &output, "plan JSON to write (also -o)", true);
  if (!f.parse(expand_short_output(args))) return 0;
  if (world < 1) fail("[flags] --world must be >= 1, got ", world);
  if (seq_len < 0) fail("[flags] --seq-len must be >= 0, got ", seq_len);

  const LlamaConfig config = LlamaConfig::load(model);
  const Strategy strategy = load_strategy(strategy_path);
  const AnnotationPlan plan = compile_plan(config, strategy, static_cast<int>(world), {seq_len});
  write_file(output, to_json(plan).dump(1) + "\n");
  const std::vector<int> idle = idle_ranks(strategy, static_cast<int>(world));
  std::fprintf(stderr,
               "hspmd: plan: %zu pipelines, %d stages, world %lld, global batch %d, idle ranks: %s -> %s\n",
               strategy.pipelines.size(), stage_count(strategy), static_cast<long long>(world),
               strategy.global_batch(), idle.empty() ? "none" : format_ranks(idle).c_str(), output.c_str());
  return 0;
}

// ---- explain ----

struct ExplainOptions {
  int rank = -1;  // -1: every rank
  bool all = false;
};

// The kind a reshard is listed and counted under: the rank's own with --rank.
std::optional<CommKind> kind_for(const PlannedReshard& r, const ExplainOptions& o) {
  if (o.rank < 0) return r.resolution().kind;
  auto it = r.resolution().ranks.find(o.rank);
  if (it == r.resolution().ranks.end()) return std::nullopt;
  return it->second.kind;
}

bool listed(const PlannedReshard& r, const ExplainOptions& o) {
  const auto kind = kind_for(r, o);
  return kind && (o.all || *kind != CommKind::kIdentity);
}

std::string describe_transfers(const char* dir, const std::vector<Transfer>& ts) {
  std::string s;
  for (const auto& t : ts)
    s += std::string(" ") + dir + " " + std::to_string(t.peer) + " (" + human_bytes(t.bytes) + ")";
  return s;
}

std::string describe_op(const CommOp& op) {
  std::string s = kind_name(op.kind);
  if (!op.group.empty()) s += " group " + list(op.group);
  s += describe_transfers("to", op.sends) + describe_transfers("from", op.recvs);
  if (!op.keeps.empty()) s += " keeps " + std::to_string(op.keeps.size()) + " box(es)";
  if (!op.contributes) s += " (adds zeros)";
  return s + ": sent " + human_bytes(op.bytes_sent) + ", received " + human_bytes(op.bytes_received);
}

void print_rank(std::ostream& os, const RankResolution& rr) {
  os << "    rank " << rr.rank << ": " << kind_name(rr.kind) << ", sent " << human_bytes(rr.bytes_sent)
     << ", received " << human_bytes(rr.bytes_received) << "\n";
  for (size_t p = 0; p < rr.phases.size(); ++p)
    for (const CommOp& op : rr.phases[p].ops)
      os << "      " << (rr.phases.size() > 1 ? "phase " + std::to_string(p) + ": " : "") << describe_op(op)
         << "\n";
}

void print_reshard(std::ostream& os, const PlannedReshard& r, const ExplainOptions& o) {
  const Resolution& res = r.resolution();
  os << r.name << "  [" << r.phase << "] " << kind_name(res.kind) << " (" << res.tier << "), total "
     << human_bytes(res.total_bytes) << "\n";
  // Ranks that only keep their data are noise in a big world; --all or --rank shows them.
  for (const auto& [rank, rr] : res.ranks) {
    const bool idle = rr.kind == CommKind::kIdentity && rr.bytes_sent == 0 && rr.bytes_received == 0;
    if (o.rank < 0 ? (o.all || !idle) : rank == o.rank) print_rank(os, rr);
  }
}

std::map<std::string, int> summarize(const std::vector<PlannedReshard>& reshards, const ExplainOptions& o) {
  std::map<std::string, int> counts;
  for (const auto& r : reshards)
    if (auto kind = kind_for(r, o)) ++counts[kind_name(*kind)];
  return counts;
}

std::string layer_range(const DiscoveredStage& s) {
  if (s.first_layer < 0) return "no layers";
  return "layers " + std::to_string(s.first_layer) + "-" + std::to_string(s.last_layer);
}

// "pipeline 0: stage 0 ranks 0-3 layers 0-14 -> stage 1 ranks 4-7 layers 15-29", then idle ranks.
void print_pipelines(std::ostream& os, const std::vector<DiscoveredPipeline>& pipelines, int world) {
  for (size_t p = 0; p < pipelines.size(); ++p) {
    os << "pipeline " << p << ":";
    for (size_t s = 0; s < pipelines[p].stages.size(); ++s) {
      const DiscoveredStage& st = pipelines[p].stages[s];
      os << (s ? " -> " : " ") << "stage " << s << " ranks " << format_ranks(st.ranks) << " "
         << layer_range(st);
    }
    os << "\n";
  }
  std::vector<int> idle;
  const std::vector<PipelinePosition> where = pipeline_positions(pipelines, world);
  for (int r = 0; r < world; ++r)
    if (where[r].idle()) idle.push_back(r);
  os << "idle ranks: " << (idle.empty() ? "none" : format_ranks(idle)) << "\n";
}

nlohmann::json pipelines_json(const std::vector<DiscoveredPipeline>& pipelines) {
  nlohmann::json out = nlohmann::json::array();
  for (const DiscoveredPipeline& p : pipelines) {
    nlohmann::json stages = nlohmann::json::array();
    for (const DiscoveredStage& st : p.stages)
      stages.push_back({{"ranks", st.ranks}, {"layers", {st.first_layer, st.last_layer}}});
    out.push_back(std::move(stages));
  }
  return out;
}

// Op-internal communication: per op type and phase, each rank's group and bytes.
void print_op_traffic(std::ostream& os, const std::vector<PlannedOpTraffic>& traffic,
                      const ExplainOptions& o) {
  os << "\nop-internal communication (inside ops, not Reshards; per micro-batch):\n";
  bool any = false;
  for (const PlannedOpTraffic& t : traffic) {
    if (o.rank >= 0 && !t.ranks.count(o.rank)) continue;
    any = true;
    os << t.op << "  [" << t.phase << "] " << t.kind << ", " << t.calls << " call(s)\n";
    for (const auto& [rank, r] : t.ranks)
      if (o.rank < 0 || rank == o.rank)
        os << "    rank " << rank << ": group " << list(r.group) << ", sent " << human_bytes(r.sent)
           << ", received " << human_bytes(r.received) << "\n";
  }
  if (!any) os << "  none\n";
}

nlohmann::json op_traffic_json(const std::vector<PlannedOpTraffic>& traffic, const ExplainOptions& o) {
  nlohmann::json out = nlohmann::json::array();
  for (const PlannedOpTraffic& t : traffic) {
    nlohmann::json ranks = nlohmann::json::object();
    for (const auto& [rank, r] : t.ranks)
      if (o.rank < 0 || rank == o.rank)
        ranks[std::to_string(rank)] = {{"group", r.group}, {"bytes_sent", r.sent},
                                       {"bytes_received", r.received}};
    if (ranks.empty()) continue;
    out.push_back({{"op", t.op}, {"kind", t.kind}, {"phase", t.phase}, {"calls", t.calls},
                   {"ranks", ranks}});
  }
  return out;
}

void print_text(const std::vector<PlannedReshard>& reshards, const std::vector<DiscoveredPipeline>& pipelines,
                const std::vector<PlannedOpTraffic>& traffic, const ExplainOptions& o, int world) {
  std::ostringstream os;
  print_pipelines(os, pipelines, world);
  os << "\n";
  os << "dry run over " << world << " ranks" << (o.rank >= 0 ? ", rank " + std::to_string(o.rank) : "")
     << (o.all ? "" : " (identity reshards hidden; --all shows them)") << "\n\n";
  for (const auto& r : reshards)
    if (listed(r, o)) print_reshard(os, r, o);
  os << "\nsummary (reshards per kind" << (o.rank >= 0 ? " for rank " + std::to_string(o.rank) : "")
     << "):\n";
  for (const auto& [kind, n] : summarize(reshards, o)) os << "  " << kind << ": " << n << "\n";
  print_op_traffic(os, traffic, o);
  std::fputs(os.str().c_str(), stdout);
}

void print_json(const std::vector<PlannedReshard>& reshards, const std::vector<DiscoveredPipeline>& pipelines,
                const std::vector<PlannedOpTraffic>& traffic, const ExplainOptions& o, int world) {
  nlohmann::json out = {{"world_size", world},
                        {"pipelines", pipelines_json(pipelines)},
                        {"reshards", nlohmann::json::array()}};
  if (o.rank >= 0) out["rank"] = o.rank;
  for (const auto& r : reshards) {
    if (!listed(r, o)) continue;
    nlohmann::json j = to_json(r.resolution(), o.rank);
    j["name"] = r.name;  // a shared resolution carries the first alike Reshard's name
    j["phase"] = r.phase;
    out["reshards"].push_back(std::move(j));
  }
  out["summary"] = summarize(reshards, o);
  out["op_traffic"] = op_traffic_json(traffic, o);
  std::fputs((out.dump(1) + "\n").c_str(), stdout);
}

int explain_command(const std::vector<std::string>& args) {
  std::string cluster;
  int64_t rank = INT64_MIN;  // not given
  bool json = false;
  ExplainOptions o;
  FlagSet f("plan explain",
            "Dry run of an annotation plan: the pipelines discovered from it, then every Reshard\n"
            "of the training graph resolved over a virtual world: its phase, kind and bytes, and\n"
            "what every rank (or one) executes, then the communication inside ops (ring\n"
            "attention, vocab-parallel loss). Identity reshards are hidden unless --all. Needs\n"
            "no devices.");
  f.add_int("rank", &rank, "show only this rank's primitives");
  f.add_bool("json", &json, "print one JSON document instead of text");
  f.add_string("cluster", &cluster, "cluster JSON (docs/cluster.md); default: uniform nodes of 8 ranks");
  f.add_bool("all", &o.all, "also list identity reshards");
  f.allow_positional("PLAN.json");
  if (!f.parse(args)) return 0;
  if (f.positional().size() != 1)
    fail("[flags] plan explain: expected one PLAN.json, got ", f.positional().size(), " arguments");

  const AnnotationPlan plan = load_plan(f.positional()[0]);
  const int world = plan.world_size;
  if (rank != INT64_MIN) {
    if (rank < 0 || rank >= world)
      fail("[flags] --rank ", rank, " is outside the plan's world of ", world, " ranks");
    o.rank = static_cast<int>(rank);
  }
  const Topology topology = cluster.empty() ? Topology::uniform(world) : Topology::load(cluster);
  if (topology.world_size() != world)
    fail("[cli] ", cluster, ": the cluster has ", topology.world_size(), " ranks but the plan's world has ",
         world);
  std::vector<PlannedOpTraffic> traffic;
  const std::vector<PlannedReshard> reshards = dry_run(plan, topology, &traffic);
  const std::vector<DiscoveredPipeline> pipelines = discover_pipelines(plan, reshards);
  if (json)
    print_json(reshards, pipelines, traffic, o, world);
  else
    print_text(reshards, pipelines, traffic, o, world);
  return 0;
}

}  // namespace

int plan_command(const std::vector<std::string>& args) {
  if (args.empty()) fail("[flags] plan: missing subcommand (compile or explain; see hspmd plan --help)");
  const std::string& sub = args[0];
  if (sub == "--help" || sub == "-h") {
    std::fputs(kPlanUsage, stdout);
    return 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (sub == "compile") return compile_command(rest);
  if (sub == "explain") return explain_command(rest);
  fail("[flags] plan: unknown subcommand '", sub, "' (expected compile or explain)");
}

}  // namespace hspmd::cli

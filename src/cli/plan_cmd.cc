// hspmd plan compile | explain | switch: strategy -> annotation plan, the
// dry run of a plan's communication rank by rank, and the plan that moves the
// training state from one plan to another (docs/switching.md).
#include <algorithm>
#include <cmath>
#include <climits>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>

#include "commands.h"
#include "flags.h"
#include "plan_search_cmd.h"
#include "hspmd/core/error.h"
#include "hspmd/core/limits.h"
#include "hspmd/io/output_file.h"
#include "hspmd/io/text_output.h"
#include "hspmd/plan/expert_placement.h"
#include "hspmd/plan/pipelines.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/strategy.h"
#include "hspmd/plan/switch.h"
#include "hspmd/resolve/resolver.h"
#include "hspmd/resolve/topology.h"

namespace hspmd::cli {
namespace {

// --seq-len of plan compile and plan switch: 0 (not given) means the
// model's longest; a given value must be positive.
void check_seq_len(const FlagSet& f, int64_t seq_len) {
  if (seq_len < 0 || (f.given("seq-len") && seq_len == 0)) fail("[flags] --seq-len must be positive, got ", seq_len);
}

constexpr const char* kPlanUsage =
    "usage: hspmd plan <subcommand> [flags]\n\n"
    "Annotation plans: compile a strategy into one, and show the communication it implies.\n\n"
    "subcommands:\n"
    "  compile    strategy JSON + model config -> annotation plan JSON\n"
    "  explain    dry run of a plan: every Reshard, each rank's primitives and bytes\n"
    "  switch     how the training state moves from one plan to another: volumes, time\n"
    "  cost       a strategy's predicted step time and memory on a cluster (cost model)\n"
    "  search     the best strategy for a model, cluster and batch (planner)\n"
    "  experts    an expert-parallel strategy's expert placement from measured routing\n\n"
    "Run 'hspmd plan <subcommand> --help' for its flags.\n";


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
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s + "]";
}

int stage_count(const Strategy& s) {
  int n = 0;
  for (const auto& p : s.pipelines) n += static_cast<int>(p.stages.size());
  return n;
}

int compile_command(const std::vector<std::string>& args) {
  std::string model, strategy_path, output;
  int world = 0;
  int64_t seq_len = 0;
  FlagSet f("plan compile", "Compile a strategy (docs/strategy.md) into an annotation plan (docs/plan.md).");
  f.add_string("model", &model, "Hugging Face config.json of the model", true);
  f.add_string("strategy", &strategy_path, "strategy JSON", true);
  f.add_int("world", &world, "number of ranks of the world", true, {1, kMaxWorldSize});
  f.add_int("seq-len", &seq_len, "sequence length for byte counts (default: max_position_embeddings)", false,
            kPositiveInt);
  f.add_string("output", &output, "plan JSON to write (also -o)", true);
  std::string precision = "fp32", grad_reduce = "fp32";
  f.add_string("precision", &precision, "fp32 (default) or bf16: the dtypes the Reshards carry (docs/precision.md)");
  f.add_string("grad-reduce-dtype", &grad_reduce, "fp32 (default) or bf16 gradient sync");
  if (!f.parse(expand_short_output(args))) return 0;
  CompileOptions co;
  co.seq_len = seq_len;
  co.precision = {parse_precision_name(precision, "--precision"),
                  parse_precision_name(grad_reduce, "--grad-reduce-dtype")};
  check_seq_len(f, seq_len);
  check_input_file("--model", model);
  check_input_file("--strategy", strategy_path);
  check_outputs({{"--model", model}, {"--strategy", strategy_path}}, {{"--output", output}});

  const ModelConfig config = ModelConfig::load(model);
  const Strategy strategy = load_strategy(strategy_path);
  const AnnotationPlan plan = compile_plan(config, strategy, world, co);
  // Written in one go after the work, so that nothing is written on an earlier error.
  write_output_file("[plan] --output", output, to_json(plan).dump(1) + "\n");
  const std::vector<int> idle = idle_ranks(strategy, world);
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
  f.add_int("rank", &rank, "show only this rank's primitives", false, {0, kMaxWorldSize - 1});
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
  std::vector<PlannedReshard> reshards;
  std::vector<DiscoveredPipeline> pipelines;
  if (o.rank >= 0) {  // only the rank's Reshards: time and memory do not grow with the world
    const AnnotatedTraining training = annotate_training_graph(plan);
    ResolutionCache resolve_cached(topology, o.rank);
    reshards = rank_dry_run(plan, training, resolve_cached, &traffic);
    pipelines = discover_pipelines(plan, topology, training);
  } else {
    reshards = dry_run(plan, topology, &traffic);
    pipelines = discover_pipelines(plan, reshards);
  }
  if (json)
    print_json(reshards, pipelines, traffic, o, world);
  else
    print_text(reshards, pipelines, traffic, o, world);
  return 0;
}

// ---- switch ----

AnnotationPlan load_side(const std::string& path, const std::string& model, int world, int64_t seq_len,
                         const char* flag) {
  if (is_plan_file(path)) {
    AnnotationPlan plan = load_plan(path);
    if (plan.world_size != world)
      fail("[flags] ", flag, " ", path, ": the plan's world has ", plan.world_size, " ranks, --world is ", world);
    return plan;
  }
  if (model.empty()) fail("[flags] ", flag, " ", path, " is a strategy: --model is required to compile it");
  const Strategy strategy = load_strategy(path);
  CompileOptions co;
  co.seq_len = seq_len;
  return compile_plan(ModelConfig::load(model), strategy, world, co);
}

std::vector<SwitchAlgorithm> switch_algorithms(const std::string& name) {
  if (name == "all") return {SwitchAlgorithm::kNaive, SwitchAlgorithm::kPerTensor, SwitchAlgorithm::kFused};
  return {parse_switch_algorithm(name, "--algorithm")};
}

std::string gb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", static_cast<double>(bytes) / 1e9);
  return buf;
}

// One row of the volume table: GB over NVLink and the network, messages.
std::string switch_row(const std::string& label, const RankSwitchStats& s) {
  char line[256];
  std::snprintf(line, sizeof line, "  %4s  %10s  %10s  %10s  %10s  %9d  %9d  %9s\n", label.c_str(),
                gb(s.intra_sent).c_str(), gb(s.intra_received).c_str(), gb(s.inter_sent).c_str(),
                gb(s.inter_received).c_str(), s.messages_sent, s.messages_received, gb(s.checkpoint_read).c_str());
  return line;
}

// The paper's communication-volume table: per rank the GB sent and received
// over NVLink (intra-node) and the network (inter-node), and messages; ranks
// that neither send, receive nor read are left out.
void print_switch_table(std::ostream& os, const SwitchPlan& sp, double bound, double sender_bound) {
  RankSwitchStats total;
  int64_t max_sent = 0;
  std::string rows;
  for (size_t r = 0; r < sp.stats.size(); ++r) {
    const RankSwitchStats& s = sp.stats[r];
    max_sent = std::max(max_sent, s.sent());
    total.intra_sent += s.intra_sent, total.intra_received += s.intra_received;
    total.inter_sent += s.inter_sent, total.inter_received += s.inter_received;
    total.messages_sent += s.messages_sent, total.messages_received += s.messages_received;
    total.checkpoint_read += s.checkpoint_read;
    if (s.sent() + s.received() + s.checkpoint_read > 0) rows += switch_row(std::to_string(r), s);
  }
  const double best = std::max(bound, sender_bound);
  char head[256];
  std::snprintf(head, sizeof head,
                "%s: %zu round(s), predicted %.4g s (%.2fx the lower bound, %.2fx the larger bound)\n",
                algorithm_name(sp.algorithm).c_str(), sp.rounds.size(), sp.predicted_s,
                bound > 0 ? sp.predicted_s / bound : 1.0, best > 0 ? sp.predicted_s / best : 1.0);
  os << head << "  total sent " << gb(total.sent()) << " GB, most by one rank " << gb(max_sent) << " GB\n"
     << "  rank  intra sent  intra recv  inter sent  inter recv  msgs sent  msgs recv  ckpt read  (GB)\n"
     << rows << switch_row("all", total) << "\n";
}

struct SwitchFlags {
  std::string model, from, to, cluster, algorithm = "all", lost;
  int world = 0;
  int64_t seq_len = 0;
  double bucket_mb = 0;
  bool json = false, no_checkpoint = false;
};

// Parses and checks the flags; false when --help was given.
bool parse_switch_flags(const std::vector<std::string>& args, SwitchFlags& s) {
  FlagSet f("plan switch",
            "Plan a switch of the training state (weights, ZeRO master weights, Adam moments)\n"
            "from one parallel plan to another (docs/switching.md) and report each algorithm's\n"
            "per-rank link volumes and predicted time against the lower bounds. --from and --to\n"
            "are each a strategy JSON (compiled for --world) or an annotation plan JSON. Needs\n"
            "no devices.");
  f.add_string("model", &s.model, "Hugging Face config.json (required for a strategy)");
  f.add_string("from", &s.from, "the current strategy or plan JSON", true);
  f.add_string("to", &s.to, "the next strategy or plan JSON", true);
  f.add_int("world", &s.world, "number of ranks of the world (both plans)", true, {1, kMaxWorldSize});
  f.add_string("cluster", &s.cluster, "cluster JSON (docs/cluster.md); default: uniform nodes of 8 ranks");
  f.add_string("algorithm", &s.algorithm, "naive, per-tensor, fused or all (default all)");
  f.add_int("seq-len", &s.seq_len, "sequence length to compile strategies with (default: max_position_embeddings)",
            false, kPositiveInt);
  f.add_double("bucket-mb", &s.bucket_mb, "fused: MiB of state per round, whole layers (default 0: one round)");
  f.add_string("lost-ranks", &s.lost,
               "ranks whose memory is gone, e.g. 3,5 or 8-15; what only they held is read from the checkpoint");
  f.add_bool("no-checkpoint", &s.no_checkpoint, "there is no training checkpoint: slices only lost ranks held fail");
  f.add_bool("json", &s.json, "print one JSON document instead of text");
  if (!f.parse(args)) return false;
  check_seq_len(f, s.seq_len);
  if (!(s.bucket_mb >= 0) || !std::isfinite(s.bucket_mb))
    fail("[flags] --bucket-mb must be a finite number >= 0, got ", s.bucket_mb);
  return true;
}

std::string switch_header(const SwitchFlags& s, size_t tensors, const Topology& topology, double bound,
                          double sender_bound) {
  char bounds[256];
  std::snprintf(bounds, sizeof bounds,
                "lower bound %.4g s (receivers' links, unlimited senders); sender bound %.4g s (senders' links)\n\n",
                bound, sender_bound);
  return "switch " + s.from + " -> " + s.to + ": " + std::to_string(tensors) + " state tensors over " +
         std::to_string(s.world) + " ranks in " + std::to_string(topology.num_nodes()) + " node(s)\n" + bounds;
}

int switch_command(const std::vector<std::string>& args) {
  SwitchFlags s;
  if (!parse_switch_flags(args, s)) return 0;
  const std::vector<SwitchAlgorithm> algorithms = switch_algorithms(s.algorithm);
  const int n = s.world;
  SwitchOptions o;
  o.lost_ranks = parse_ranks(s.lost, n, "--lost-ranks");
  o.have_checkpoint = !s.no_checkpoint;
  o.bucket_bytes = static_cast<int64_t>(s.bucket_mb * 1024 * 1024);
  const Topology topology = s.cluster.empty() ? Topology::uniform(n) : Topology::load(s.cluster);
  if (topology.world_size() != n)
    fail("[cli] ", s.cluster, ": the cluster has ", topology.world_size(), " ranks but --world is ", n);
  const AnnotationPlan from = load_side(s.from, s.model, n, s.seq_len, "--from");
  const AnnotationPlan to = load_side(s.to, s.model, n, s.seq_len, "--to");
  const std::vector<StateTensor> tensors = state_tensors(from, to);
  const double bound = switch_lower_bound(tensors, topology, o.lost_ranks);
  const double sender_bound = switch_sender_bound(tensors, topology, o.lost_ranks);
  nlohmann::json out = {{"world_size", n},
                        {"lower_bound_s", bound},
                        {"sender_bound_s", sender_bound},
                        {"algorithms", nlohmann::json::object()}};
  std::ostringstream text;
  text << switch_header(s, tensors.size(), topology, bound, sender_bound);
  for (SwitchAlgorithm a : algorithms) {
    o.algorithm = a;
    const SwitchPlan sp = plan_switch(tensors, topology, o);
    out["algorithms"][algorithm_name(a)] = to_json(sp);
    print_switch_table(text, sp, bound, sender_bound);
  }
  std::fputs(s.json ? (out.dump(1) + "\n").c_str() : text.str().c_str(), stdout);
  return 0;
}

}  // namespace

// Per sparse layer, the tokens each expert took in a step record of `log`
// (`expert_tokens`): step `step`, or the last record that has them.
std::vector<std::vector<double>> expert_loads(const std::string& log, int64_t step) {
  std::ifstream in(log);
  if (!in) fail("[experts] --log ", log, ": cannot open file");
  std::string line;
  nlohmann::json found;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    nlohmann::json r;
    try {
      r = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      fail("[experts] --log ", log, ": line ", n, " is not JSON");
    }
    if (!r.is_object() || !r.contains("expert_tokens")) continue;
    if (step < 0 || (r.contains("step") && r["step"] == step)) found = r;
  }
  if (found.is_null())
    fail("[experts] --log ", log, ": no step record ", step >= 0 ? "of step " + std::to_string(step) + " " : "",
         "with expert_tokens (a mixture-of-experts run's --log)");
  std::vector<std::vector<double>> loads;
  try {
    for (const auto& layer : found["expert_tokens"]) loads.push_back(layer.get<std::vector<double>>());
  } catch (const nlohmann::json::exception&) {
    fail("[experts] --log ", log, ": expert_tokens must be a list of lists of numbers");
  }
  return loads;
}

// Member m's speed: its slowest slot over the groups of `layer` (tflops x
// efficiency / slowdown of the slot's ranks).
std::vector<double> member_speeds(const Strategy& s, int64_t layer, const Topology& t) {
  std::vector<double> speed(s.expert_parallel, 0);
  for (const auto& group : expert_groups(s, layer).slots)
    for (size_t m = 0; m < group.size(); ++m)
      for (int r : group[m]) {
        const double v = t.device_type(r).tflops * t.device_type(r).efficiency / t.rank(r).slowdown;
        speed[m] = speed[m] == 0 ? v : std::min(speed[m], v);
      }
  return speed;
}

int experts_command(const std::vector<std::string>& args) {
  std::string model, strategy_path, log, cluster, output;
  int64_t step = -1;
  FlagSet f("plan experts",
            "Place the experts of an expert-parallel strategy from measured routing (docs/moe.md, \"Choosing a\n"
            "placement\"): replicas for the experts that took the most tokens, spread so that the busiest\n"
            "member of a group has as little as the loads allow. Writes the strategy with expert_placement.");
  f.add_string("model", &model, "Hugging Face config.json of the model", true);
  f.add_string("strategy", &strategy_path, "strategy JSON with expert_parallel > 1", true);
  f.add_string("log", &log, "a run's --log (step records with expert_tokens)", true);
  f.add_int("step", &step, "the step record to read (default: the last with expert_tokens)", false, {0, INT64_MAX});
  f.add_string("cluster", &cluster, "cluster JSON (docs/cluster.md): members weighed by their devices' speed");
  f.add_string("output", &output, "strategy JSON to write (also -o)", true);
  if (!f.parse(expand_short_output(args))) return 0;
  check_input_file("--model", model);
  check_input_file("--strategy", strategy_path);
  check_input_file("--log", log);
  if (!cluster.empty()) check_input_file("--cluster", cluster);
  check_outputs({{"--model", model}, {"--strategy", strategy_path}, {"--log", log}, {"--cluster", cluster}},
                {{"--output", output}});
  const ModelConfig config = ModelConfig::load(model);
  Strategy strategy = load_strategy(strategy_path);
  if (strategy.expert_parallel <= 1)
    fail("[experts] --strategy ", strategy_path, ": expert_parallel is ", strategy.expert_parallel,
         "; placing experts needs groups of more than one member");
  std::vector<int64_t> sparse;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l)
    if (config.moe.num_experts > 0 && config.moe.sparse_layer(l)) sparse.push_back(l);
  const std::vector<std::vector<double>> loads = expert_loads(log, step);
  std::vector<double> speeds;
  if (!cluster.empty() && !sparse.empty())
    speeds = member_speeds(strategy, sparse.front(), Topology::load(cluster));
  const int g = strategy.expert_parallel;
  std::vector<ExpertPlacement> placed = place_experts(sparse, loads, g, config.moe.num_experts, speeds);
  for (size_t i = 0; i < sparse.size(); ++i) {
    const std::vector<std::vector<int>> now = layer_placement(strategy, sparse[i], config.moe.num_experts);
    const std::vector<std::vector<int>>* next = nullptr;
    for (const ExpertPlacement& p : placed)
      if (p.first_layer <= sparse[i] && sparse[i] <= p.last_layer) next = &p.members;
    const double total = std::accumulate(loads[i].begin(), loads[i].end(), 0.0);
    const double even = total / g, hot = *std::max_element(loads[i].begin(), loads[i].end());
    std::printf("layer %lld: hottest expert %.2fx the mean; busiest member %.2fx an even share now, %.2fx placed\n",
                static_cast<long long>(sparse[i]), total > 0 ? hot * config.moe.num_experts / total : 0.0,
                even > 0 ? placement_bottleneck(now, loads[i], g, speeds) / even : 0.0,
                even > 0 ? placement_bottleneck(*next, loads[i], g, speeds) / even : 0.0);
  }
  strategy.expert_placement = std::move(placed);
  validate(strategy, config, static_cast<int>(strategy.ranks().back()) + 1);
  write_output_file("[experts] --output", output, to_json(strategy).dump(1) + "\n");
  return 0;
}

int plan_command(const std::vector<std::string>& args) {
  if (args.empty()) fail("[flags] plan: missing subcommand (compile, explain, switch, cost, search or experts; see hspmd plan --help)");
  const std::string& sub = args[0];
  if (sub == "--help" || sub == "-h") {
    std::fputs(kPlanUsage, stdout);
    return 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (sub == "compile") return compile_command(rest);
  if (sub == "explain") return explain_command(rest);
  if (sub == "switch") return switch_command(rest);
  if (sub == "cost") return plan_cost_command(rest);
  if (sub == "experts") return experts_command(rest);
  if (sub == "search") return plan_search_command(rest);
  fail("[flags] plan: unknown subcommand '", sub, "' (expected compile, explain, switch, cost, search or experts)");
}

}  // namespace hspmd::cli

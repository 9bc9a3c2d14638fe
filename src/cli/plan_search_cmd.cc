// hspmd plan cost | search: the planner's cost model on one strategy, and the
// search for the best strategy (docs/planner.md).
#include "plan_search_cmd.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "flags.h"
#include "hspmd/core/error.h"
#include "hspmd/io/output_file.h"
#include "hspmd/io/text_output.h"
#include "hspmd/core/threads.h"
#include "hspmd/data/token_data.h"
#include "hspmd/models/config.h"
#include "hspmd/planner/cost_model.h"
#include "hspmd/planner/mixed_length.h"
#include "hspmd/planner/search.h"
#include "hspmd/plan/strategy.h"
#include "hspmd/resolve/topology.h"

namespace hspmd::cli {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

void print_cost(std::ostream& os, const CostReport& rep) {
  os << "predicted step " << fmt("%.6g", rep.predicted_step_s) << " s (the slowest rank)\n";
  for (size_t p = 0; p < rep.pipeline_s.size(); ++p)
    os << "  pipeline " << p << ": last backward ends at " << fmt("%.6g", rep.pipeline_s[p]) << " s\n";
  os << "\n rank  pipe stage   compute_s      comm_s    bubble_s      step_s  memory_gib   cap_gib\n";
  for (const RankCost& r : rep.ranks) {
    char line[256];
    if (r.pipeline < 0) {
      std::snprintf(line, sizeof line, "%5d  idle\n", r.rank);
    } else {
      std::snprintf(line, sizeof line, "%5d %5d %5d %11.5g %11.5g %11.5g %11.5g %11.4g %9.4g%s\n", r.rank,
                    r.pipeline, r.stage, r.compute_s, r.comm_s, r.bubble_s, r.step_s, r.memory.total() / kGiB,
                    r.capacity_bytes / kGiB, r.memory.total() > r.capacity_bytes && r.capacity_bytes > 0 ? "  OVER" : "");
    }
    os << line;
  }
  for (const std::string& n : rep.notes) os << "note: " << n << "\n";
}

struct CostFlags {
  std::string model, cluster, strategy, profile, lengths, dispatch = "cost", links;
  int64_t seq_len = 0, batch_tokens = 0, max_seq_len = 0;
  bool json = false;
};

// The cluster file, with the links `hspmd profile --links` measured (if
// any) replacing its typed links for the host pairs measured.
Topology load_cluster(const std::string& cluster, const std::string& links) {
  const Topology t = Topology::load(cluster);
  return links.empty() ? t : t.with_links(LinkTable::load(links));
}

constexpr const char* kLinksHelp =
    "links JSON measured by `hspmd profile --links`: its links replace the cluster file's for the\n"
    "host pairs it measured (host i = node i; docs/cluster.md, \"Measured links\")";

// The pieces of a token file (documents cut at eos, pieces of at most L), as
// the trainer cuts them.
std::vector<int64_t> file_pieces(const std::string& path, const ModelConfig& config, int64_t max_seq_len) {
  const TokenData data = TokenData::load(path, config.vocab_size);
  const PackedDocuments docs(data, max_seq_len, config.eos_token_id);
  std::vector<int64_t> pieces(static_cast<size_t>(docs.num_pieces()));
  for (int64_t i = 0; i < docs.num_pieces(); ++i) pieces[static_cast<size_t>(i)] = docs.piece_size(i);
  return pieces;
}

// train refuses a token budget below the longest piece; so does the cost of
// a strategy under one (the planner refuses a budget below --max-seq-len).
void check_budget_holds_pieces(const std::vector<int64_t>& pieces, int64_t batch_tokens, const std::string& path,
                               int64_t max_seq_len) {
  const int64_t longest = pieces.empty() ? 0 : *std::max_element(pieces.begin(), pieces.end());
  if (batch_tokens < longest)
    fail("[flags] --batch-tokens ", batch_tokens, " is smaller than the longest piece of ", path, " (", longest,
         " tokens; pieces are at most --max-seq-len ", max_seq_len, ")");
}

// plan cost --lengths: the strategy's predicted token-budget steps over a
// token file (the trainer's dispatch, docs/mixed_length.md, plus the sync).
int token_cost(const CostFlags& c, const ModelConfig& config, const Topology& topology, const Strategy& strategy) {
  if (c.batch_tokens < 1 || c.max_seq_len < 1)
    fail("[flags] --lengths needs --batch-tokens T >= 1 and --max-seq-len L >= 1");
  if (c.seq_len != 0) fail("[flags] --seq-len is not read with --lengths (steps are token budgets)");
  check_input_file("--lengths", c.lengths);
  const CostModel model = CostModel::load(config, topology, c.profile);
  model.require_profiles_for_emulation(c.cluster);
  const std::vector<int64_t> pieces = file_pieces(c.lengths, config, c.max_seq_len);
  if (pieces.empty()) fail("[data] ", c.lengths, ": no piece");
  check_budget_holds_pieces(pieces, c.batch_tokens, c.lengths, c.max_seq_len);
  const PieceCosts costs(model, strategy);
  const DispatchRule rule = parse_dispatch_rule(c.dispatch);
  const double sync = token_step_sync_seconds(model, strategy);
  int64_t accepted = 0;
  for (const Pipeline& p : strategy.pipelines) accepted = std::max(accepted, accepted_piece(strategy, p, c.max_seq_len));
  std::vector<double> times;
  double tokens = 0, seconds = 0;
  int64_t skipped = 0;
  for (const auto& step : token_steps(pieces, c.batch_tokens)) {
    if (*std::max_element(step.begin(), step.end()) > accepted) {
      ++skipped;
      continue;
    }
    const double t = dispatch_token_step(costs, strategy, step, c.max_seq_len, rule).predicted_s + sync;
    times.push_back(t);
    seconds += t;
    for (int64_t len : step) tokens += static_cast<double>(len);
  }
  if (times.empty())
    fail("[strategy] ", c.strategy, ": no pipeline accepts the longest piece of any step (at most ", accepted,
         " tokens)");
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted.size() % 2 ? sorted[sorted.size() / 2]
                                          : 0.5 * (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]);
  if (c.json) {
    nlohmann::json j = {{"steps", times.size()},      {"skipped_steps", skipped},
                        {"max_accepted", accepted},   {"sync_s", sync},
                        {"median_step_s", median},    {"mean_step_s", seconds / static_cast<double>(times.size())},
                        {"tokens", tokens},           {"tokens_per_s", tokens / seconds},
                        {"step_s", times}};
    std::fputs((j.dump(1) + "\n").c_str(), stdout);
    return 0;
  }
  std::ostringstream os;
  os << times.size() << " token-budget steps of at most " << c.batch_tokens << " tokens (" << skipped
     << " skipped: a piece above " << accepted << "); predicted step median " << fmt("%.6g", median) << " s, mean "
     << fmt("%.6g", seconds / static_cast<double>(times.size())) << " s (sync and optimizer " << fmt("%.4g", sync)
     << " s of it); " << fmt("%.0f", tokens / seconds) << " tokens per predicted second\n";
  std::fputs(os.str().c_str(), stdout);
  return 0;
}

int cost_command(const std::vector<std::string>& args) {
  CostFlags c;
  FlagSet f("plan cost",
            "Predict a strategy's step time and memory on a cluster with the planner's cost model\n"
            "(docs/planner.md): per rank compute, communication, pipeline bubble, step time and\n"
            "memory. Compute comes from a profile (hspmd profile; --profile, or the catalog's\n"
            "\"profile\" per device type) times the rank's slowdown, else from the roofline.");
  f.add_string("model", &c.model, "Hugging Face config.json", true);
  f.add_string("cluster", &c.cluster, "cluster JSON (docs/cluster.md); its ranks are the world", true);
  f.add_string("strategy", &c.strategy, "strategy JSON (docs/strategy.md)", true);
  f.add_int("seq-len", &c.seq_len, "tokens per sample (required without --lengths)", false, kPositiveInt);
  f.add_string("profile", &c.profile, "profile JSON for device types without their own (hspmd profile)");
  f.add_string("lengths", &c.lengths,
               "token file: predict token-budget steps of its pieces instead (docs/mixed_length.md; needs "
               "--batch-tokens and --max-seq-len)");
  f.add_int("batch-tokens", &c.batch_tokens, "with --lengths: tokens per step");
  f.add_int("max-seq-len", &c.max_seq_len, "with --lengths: the longest piece");
  f.add_string("dispatch", &c.dispatch,
               "with --lengths: cost (default) or symmetric, as `hspmd train --dispatch` (docs/mixed_length.md)");
  f.add_string("links", &c.links, kLinksHelp);
  f.add_bool("json", &c.json, "print one JSON document instead of text");
  if (!f.parse(args)) return 0;
  if (c.lengths.empty() && (c.batch_tokens != 0 || c.max_seq_len != 0 || c.dispatch != "cost"))
    fail("[flags] --batch-tokens, --max-seq-len and --dispatch are read only with --lengths");
  if (c.lengths.empty() && c.seq_len < 1) fail("[flags] --seq-len must be >= 1, got ", c.seq_len);
  const ModelConfig config = ModelConfig::load(c.model);
  const Topology topology = load_cluster(c.cluster, c.links);
  const Strategy strategy = load_strategy(c.strategy);
  validate(strategy, config, topology.world_size());
  if (!c.lengths.empty()) return token_cost(c, config, topology, strategy);
  const CostModel model = CostModel::load(config, topology, c.profile);
  model.require_profiles_for_emulation(c.cluster);
  const CostReport rep = model.evaluate(strategy, c.seq_len);
  if (c.json) {
    std::fputs((rep.to_json().dump(1) + "\n").c_str(), stdout);
  } else {
    std::ostringstream os;
    print_cost(os, rep);
    std::fputs(os.str().c_str(), stdout);
  }
  return 0;
}

struct SearchFlags {
  std::string links;
  std::string model, cluster, profile, schedule = "1f1b", out, from, unavailable, tp, mbs, solver = "cbc";
  int global_batch = 0, top = 5, max_cp = 1, min_pipelines = 1, expert_parallel = 1;  // ints: the parser refuses what does not fit
  int64_t seq_len = 0;
  double time_limit = 60;
  bool zero = false, json = false, no_recompute = false;
};

std::vector<int> int_list(const std::string& text, const char* flag) {
  std::vector<int> out;
  if (text.empty()) return out;
  std::stringstream ss(text);
  std::string item;
  const std::string name = std::string(flag).substr(std::string(flag).rfind("--", 0) == 0 ? 2 : 0);
  while (std::getline(ss, item, ',')) out.push_back(static_cast<int>(parse_int(name, item, kPositiveInt)));
  return out;
}

struct MixedFlags {
  std::string model, cluster, lengths, profile, strategies_out, unavailable, dispatch = "cost";
  int64_t batch_tokens = 0, max_seq_len = 0;
  int buckets = 2, max_cp = 0;  // ints: the parser refuses what does not fit
  bool zero = false, json = false, no_recompute = false, homogeneous = false;
};

std::string pipeline_summary(const Pipeline& p) {
  std::ostringstream os;
  os << "<=" << p.max_seq_len << " (mb " << p.micro_batch_tokens << "):";
  for (const Stage& st : p.stages)
    os << " R" << format_ranks(st.ranks) << " tp" << st.tp() << (st.cp > 1 ? " cp" + std::to_string(st.cp) : "")
       << " L" << st.first_layer << "-" << st.last_layer << (st.recompute ? " rc" : "") << " |";
  return os.str();
}

void add_mixed_flags(FlagSet& f, MixedFlags& c) {
  f.add_string("model", &c.model, "Hugging Face config.json (its eos_token_id cuts the documents)", true);
  f.add_string("cluster", &c.cluster, "cluster JSON (docs/cluster.md)", true);
  f.add_string("lengths", &c.lengths, "token file whose piece lengths the plan is for", true);
  f.add_int("batch-tokens", &c.batch_tokens, "tokens per step", true);
  f.add_int("max-seq-len", &c.max_seq_len, "the longest piece (documents are cut into pieces of at most this)", true);
  f.add_string("profile", &c.profile, "profile JSON for device types without their own (hspmd profile)");
  f.add_int("buckets", &c.buckets, "at most this many maximum-length buckets, one strategy each (default 2)");
  f.add_int("max-cp", &c.max_cp, "largest context-parallel degree (default: up to the node size)");
  f.add_bool("zero", &c.zero, "ZeRO-1 across each strategy's pipelines");
  f.add_bool("no-recompute", &c.no_recompute, "never use activation recomputation");
  f.add_bool("homogeneous", &c.homogeneous,
             "one layout per bucket: every pipeline the same tp, cp, pp and max_seq_len (the best such; the\n"
             "bucket-switching baseline's strategies)");
  f.add_string("dispatch", &c.dispatch,
               "how the plans are scored: cost (default) or symmetric, as `hspmd train --dispatch` (with "
               "--homogeneous: the plans of a symmetric bucket-switching baseline)");
  f.add_string("unavailable", &c.unavailable, "ranks that take no work, e.g. 3,5 or 8-15 (failed devices)");
  f.add_string("strategies-out", &c.strategies_out, "directory to write one strategy JSON per bucket into");
  f.add_bool("json", &c.json, "print one JSON document instead of text");
}

void check_mixed_flags(const MixedFlags& c) {
  if (c.max_seq_len < 1) fail("[flags] --max-seq-len must be >= 1, got ", c.max_seq_len);
  if (c.batch_tokens < 1) fail("[flags] --batch-tokens must be >= 1, got ", c.batch_tokens);
  if (c.buckets < 1) fail("[flags] --buckets must be >= 1, got ", c.buckets);
  if (c.max_cp < 0) fail("[flags] --max-cp must be >= 0, got ", c.max_cp);
  check_input_file("--lengths", c.lengths);
}

MixedLengthOptions mixed_options(const MixedFlags& c, const Topology& topology) {
  MixedLengthOptions o;  // the planner refuses a budget below --max-seq-len itself
  o.batch_tokens = c.batch_tokens;
  o.max_seq_len = c.max_seq_len;
  o.buckets = c.buckets;
  o.max_cp = c.max_cp;
  o.zero = c.zero;
  o.allow_recompute = !c.no_recompute;
  o.homogeneous = c.homogeneous;
  o.dispatch = parse_dispatch_rule(c.dispatch);
  o.unavailable = parse_ranks(c.unavailable, topology.world_size(), "--unavailable");
  return o;
}

// Describes and validates each bucket's strategy and writes it under
// --strategies-out when given; returns the paths written.
std::vector<std::string> finish_buckets(MixedLengthPlan& plan, const MixedFlags& c, const ModelConfig& config,
                                        const Topology& topology) {
  std::vector<std::string> written;
  for (LengthBucket& b : plan.buckets) {
    char desc[200];
    std::snprintf(desc, sizeof desc, "hspmd plan search --lengths: bucket max_seq_len %lld, predicted step %.6g s",
                  static_cast<long long>(b.max_seq_len), b.predicted_step_s);
    b.strategy.description = desc;
    validate(b.strategy, config, topology.world_size());
    if (c.strategies_out.empty()) continue;
    const std::string path = c.strategies_out + "/bucket_" + std::to_string(b.max_seq_len) + ".json";
    write_output_file("[plan] --strategies-out", path, to_json(b.strategy).dump(2) + "\n");
    written.push_back(path);
  }
  return written;
}

void print_mixed_plan(const MixedFlags& c, const MixedLengthPlan& plan, const std::vector<std::string>& written) {
  if (c.json) {
    nlohmann::json j = plan.to_json();
    j["written"] = written;
    std::fputs((j.dump(1) + "\n").c_str(), stdout);
    return;
  }
  std::ostringstream os;
  os << plan.pieces << " pieces, " << plan.steps << " steps of at most " << c.batch_tokens << " tokens; planned "
     << plan.buckets.size() << " bucket(s) in " << fmt("%.3f", plan.planning_s) << " s\n";
  for (size_t i = 0; i < plan.buckets.size(); ++i) {
    const LengthBucket& b = plan.buckets[i];
    os << "bucket " << i << ": max_seq_len " << b.max_seq_len << ", " << b.steps << " steps, predicted step "
       << fmt("%.6g", b.predicted_step_s) << " s (dynamic program " << fmt("%.6g", b.dp_step_s) << " s + sync "
       << fmt("%.4g", b.sync_s) << " s)\n";
    for (const Pipeline& p : b.strategy.pipelines) os << "    " << pipeline_summary(p) << "\n";
  }
  for (const std::string& w : written) os << "wrote " << w << "\n";
  std::fputs(os.str().c_str(), stdout);
}

// hspmd plan search --lengths: one strategy per maximum-length bucket for
// token-budget steps (docs/planner.md "Mixed lengths").
int mixed_command(const std::vector<std::string>& args) {
  MixedFlags c;
  FlagSet f("plan search --lengths",
            "Plan token-budget steps for mixed lengths (docs/planner.md \"Mixed lengths\"): from the\n"
            "pieces of a token file (documents cut at eos, pieces of at most --max-seq-len), one\n"
            "strategy per maximum-length bucket, each of pipelines tailored to length intervals by a\n"
            "dynamic program over intervals x devices. The strategies are for\n"
            "hspmd train --batch-tokens T --max-seq-len L --strategies A.json,B.json.");
  add_mixed_flags(f, c);
  if (!f.parse(args)) return 0;
  check_mixed_flags(c);
  set_num_threads(1);
  const ModelConfig config = ModelConfig::load(c.model);
  const Topology topology = Topology::load(c.cluster);
  const CostModel model = CostModel::load(config, topology, c.profile);
  model.require_profiles_for_emulation(c.cluster);
  const std::vector<int64_t> pieces = file_pieces(c.lengths, config, c.max_seq_len);
  MixedLengthPlan plan = plan_mixed_lengths(model, pieces, mixed_options(c, topology));
  const std::vector<std::string> written = finish_buckets(plan, c, config, topology);
  print_mixed_plan(c, plan, written);
  return 0;
}

void add_search_flags(FlagSet& f, SearchFlags& c) {
  f.add_string("model", &c.model, "Hugging Face config.json", true);
  f.add_string("cluster", &c.cluster, "cluster JSON (docs/cluster.md)", true);
  // The search's work grows with the batch (measured: 10^7 samples 2 s and 200 MB, 2^31 samples past any
  // --time-limit and tens of GB), so the range stops at 2^24, far above any real batch.
  f.add_int("global-batch", &c.global_batch, "samples per optimizer step", true, {1, 1 << 24});
  f.add_int("seq-len", &c.seq_len, "tokens per sample", true, kPositiveInt);
  f.add_bool("zero", &c.zero, "ZeRO-1 (fp32 master weights and Adam states split across the pipelines)");
  f.add_string("schedule", &c.schedule, "1f1b (default) or gpipe");
  f.add_double("time-limit", &c.time_limit,
               "seconds the search may take (default 60): it then answers with the best so far, saying so on\n"
               "stderr (docs/planner.md, \"Time limit\")");
  f.add_int("top", &c.top, "how many strategies to report (default 5)", false, kPositiveInt);
  f.add_string("profile", &c.profile, "profile JSON for device types without their own (hspmd profile)");
  f.add_string("tp", &c.tp, "TP degrees to consider, e.g. 1,2,4 (default: powers of two dividing the heads)");
  f.add_int("max-cp", &c.max_cp, "largest context-parallel degree to consider (power of two, default 1)", false,
            kPositiveInt);
  f.add_int("min-pipelines", &c.min_pipelines,
            "at least this many pipelines (replicas that survive one failed device; default 1)", false, kPositiveInt);
  f.add_string("micro-batch-sizes", &c.mbs, "micro-batch sizes to consider (default: powers of two up to 8 dividing the batch)");
  f.add_bool("no-recompute", &c.no_recompute, "never use activation recomputation");
  f.add_int("expert-parallel", &c.expert_parallel,
            "expert parallelism of every strategy (docs/moe.md; default 1): those it cannot run are skipped",
            false, kPositiveInt);
  f.add_string("from", &c.from, "re-plan: the previous strategy (its TP degrees and micro-batch size prune the search)");
  f.add_string("unavailable", &c.unavailable, "ranks that take no work, e.g. 3,5 or 8-15 (failed devices)");
  f.add_string("solver", &c.solver, "cbc (default) or exact: who solves the integer programs");
  f.add_string("output", &c.out, "write the best strategy JSON here (also -o)");
  f.add_string("links", &c.links, kLinksHelp);
  f.add_bool("json", &c.json, "print one JSON document instead of text");
}

// The search's options from its flags, checking each as it is read.
SearchOptions search_options(const SearchFlags& c, const Topology& topology) {
  SearchOptions o;
  o.global_batch = c.global_batch;
  o.seq_len = c.seq_len;
  o.zero = c.zero;
  o.schedule = c.schedule;
  o.time_limit_s = c.time_limit;
  o.top_k = c.top;
  o.max_cp = c.max_cp;
  if (c.min_pipelines < 1) fail("[flags] --min-pipelines must be >= 1, got ", c.min_pipelines);
  o.min_pipelines = c.min_pipelines;
  o.tp_degrees = int_list(c.tp, "--tp");
  o.micro_batch_sizes = int_list(c.mbs, "--micro-batch-sizes");
  o.allow_recompute = !c.no_recompute;
  o.expert_parallel = c.expert_parallel;
  if (c.solver == "cbc") o.solver = IlpSolver::kCbc;
  else if (c.solver == "exact") o.solver = IlpSolver::kExact;
  else fail("[flags] --solver must be cbc or exact, got '", c.solver, "'");
  if (!(c.time_limit > 0) || !std::isfinite(c.time_limit))
    fail("[flags] --time-limit must be a positive number of seconds, got ", c.time_limit);
  o.unavailable = parse_ranks(c.unavailable, topology.world_size(), "--unavailable");
  return o;
}

// The best candidate's strategy, described by its prediction and validated.
Strategy best_strategy(const SearchResult& res, const ModelConfig& config, const Topology& topology) {
  Strategy best = res.best.front().strategy;
  char desc[160];
  std::snprintf(desc, sizeof desc, "hspmd plan search: predicted step %.6g s (%s)", res.best.front().predicted_step_s,
                res.best.front().family.c_str());
  best.description = desc;
  validate(best, config, topology.world_size());
  return best;
}

void print_search_result(const SearchFlags& c, const SearchResult& res) {
  if (c.json) {
    std::fputs((res.to_json().dump(1) + "\n").c_str(), stdout);
    return;
  }
  std::ostringstream os;
  os << "searched " << res.configurations << " configurations (" << res.pruned << " pruned by their bound), "
     << res.ilps << " integer programs, in "
     << fmt("%.3f", res.search_s) << " s" << (res.timed_out ? " (time limit reached)" : "") << "\n";
  for (size_t i = 0; i < res.best.size(); ++i) {
    const SearchCandidate& cand = res.best[i];
    os << (i == 0 ? "best" : "alt ") << " " << fmt("%.6g", cand.predicted_step_s) << " s  [" << cand.family << "]";
    for (const Pipeline& p : cand.strategy.pipelines) {
      os << "\n    " << p.micro_batches << " x bs" << p.micro_batch_size << ":";
      for (const Stage& st : p.stages)
        os << " R" << st.ranks.front() << "-" << st.ranks.back() << " L" << st.first_layer << "-" << st.last_layer
           << (st.cp > 1 ? " cp" + std::to_string(st.cp) : "") << (st.recompute ? " rc" : "") << " |";
    }
    os << "\n";
  }
  if (!c.out.empty()) os << "wrote " << c.out << "\n";
  std::fputs(os.str().c_str(), stdout);
}

int search_command(const std::vector<std::string>& args) {
  for (const std::string& a : args)
    if (a == "--lengths" || a.rfind("--lengths=", 0) == 0) return mixed_command(args);
  SearchFlags c;
  FlagSet f("plan search",
            "Search the best strategy for a model on a cluster at a global batch (docs/planner.md):\n"
            "pipeline configurations enumerated with pruning, layers per stage and micro-batches\n"
            "per pipeline by integer programs (CBC), every candidate scored by the cost model.\n"
            "Writes the best strategy (-o) and prints it with its predicted step time, the top\n"
            "alternatives and the search time.");
  add_search_flags(f, c);
  const std::vector<std::string> expanded = expand_short_output(args);
  if (!f.parse(expanded)) return 0;
  check_outputs({{"--model", c.model}, {"--cluster", c.cluster}, {"--profile", c.profile}, {"--from", c.from},
                 {"--links", c.links}},
                {{"--output", c.out}});
  // CBC's LP solver calls BLAS on tiny matrices; pool threads spinning
  // between those calls cost more than the calls (measured: 2x the search).
  set_num_threads(1);
  const ModelConfig config = ModelConfig::load(c.model);
  const Topology topology = load_cluster(c.cluster, c.links);
  const CostModel model = CostModel::load(config, topology, c.profile);
  model.require_profiles_for_emulation(c.cluster);
  SearchOptions o = search_options(c, topology);
  Strategy previous;
  if (!c.from.empty()) {
    previous = load_strategy(c.from);
    validate(previous, config, topology.world_size());
    o.previous = &previous;
  }
  const SearchResult res = search_strategy(model, o);
  if (!res.note.empty()) std::fprintf(stderr, "%s\n", res.note.c_str());
  const Strategy best = best_strategy(res, config, topology);
  if (!c.out.empty()) write_output_file("[plan] --output", c.out, to_json(best).dump(2) + "\n");
  print_search_result(c, res);
  return 0;
}

}  // namespace

int plan_search_command(const std::vector<std::string>& args) { return search_command(args); }

int plan_cost_command(const std::vector<std::string>& args) { return cost_command(args); }

}  // namespace hspmd::cli

// The training options' schema (hspmd/options/train_options.h): the
// subsystems' tables made one, and validate(): the subsystems' rules, then
// the rules between subsystems.
#include "hspmd/options/train_options.h"

#include <algorithm>
#include <cstdlib>
#include <string_view>
#include <thread>
#include <utility>

#include "hspmd/core/error.h"

namespace hspmd {

namespace {

using Spec = OptionSpec<TrainOptions>;

// A subsystem's rows, each setting its part of TrainOptions.
template <typename Part>
void append(std::vector<Spec>& t, std::vector<OptionSpec<Part>> rows) {
  for (OptionSpec<Part>& r : rows) {
    auto set = [set = std::move(r.set)](TrainOptions& o, const OptionValue& v) { set(static_cast<Part&>(o), v); };
    t.push_back({r.name, r.type, r.doc, std::move(set), r.required, r.range});
  }
}

// The one row that writes two subsystems: the first of `strategies` is the
// run's strategy (ParallelOptions::strategy_path), which the front ends and
// the trainer read to train distributed.
void strategies_name_the_strategy(std::vector<Spec>& t) {
  for (Spec& s : t) {
    if (std::string_view(s.name) != "strategies") continue;
    s.set = [set = std::move(s.set)](TrainOptions& o, const OptionValue& v) {
      set(o, v);
      o.strategy_path = o.strategy_choices.front();
    };
  }
}

// ---- Rules between subsystems ----

// Token budgets (data) and how their pieces are dispatched or their
// strategies chosen (switching).
void validate_token_budgets(const TrainOptions& o, const GivenOptions& given) {
  const auto gave = [&](const char* name) { return given.count(name) > 0; };
  if (o.batch_tokens <= 0 && gave("dispatch"))
    fail_option("dispatch", " is read only with ", option_name("batch_tokens"));
  if (!o.strategy_choices.empty() && o.batch_tokens == 0)
    fail_option("strategies", " needs ", option_name("batch_tokens"), " (a strategy is chosen per step)");
}

// Where the strategies come from: one strategy or plan (parallel), several
// or switches (switching), events (elastic).
void validate_strategy_sources(const TrainOptions& o, const GivenOptions& given) {
  const auto gave = [&](const char* name) { return given.count(name) > 0; };
  if (!o.strategy_choices.empty() && (gave("strategy") || gave("plan")))
    fail(options_tag(), " give ", option_name("strategies"), " or ", option_name("strategy"), " / ",
         option_name("plan"), ", not both");
  if (o.bucket_switching && !o.events_path.empty())
    fail_option("events", " does not go with ", option_name("bucket_switching"),
                " yet (each step's per-bucket plans are fixed)");
  if (!o.strategy_path.empty() && !o.plan_path.empty() && o.strategy_choices.empty())
    fail(options_tag(), " give ", option_name("strategy"), " or ", option_name("plan"), ", not both");
  if (!o.events_path.empty() && !o.switches.empty())
    fail(options_tag(), " give ", option_name("events"), " or ", option_name("switch"),
         ", not both (an event may name its \"strategy\")");
}

// The profile (parallel) is the cost model's: read by the model clock, by
// re-planning (elastic) and by token budgets' dispatch (data).
void validate_profile_use(const TrainOptions& o) {
  if (!o.model_clock && !o.profile_path.empty() && o.events_path.empty() && o.batch_tokens == 0)
    fail_option("profile", " is read only with ", option_name("clock"), " model, ", option_name("events"), " or ",
                option_name("batch_tokens"), " (the cost model's profile)");
}

}  // namespace

TrainOptions default_train_options() {
  TrainOptions o;
  o.schedule.lr = 3e-4;
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  int64_t local = 1;  // the node's ranks share its cores
  if (const char* env = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) local = std::max(1, std::atoi(env));
  o.threads = static_cast<int>(std::clamp<int64_t>(cores / local, 1, kMaxThreads));
  return o;
}

std::vector<OptionSpec<TrainOptions>> train_option_table() {
  std::vector<Spec> t;
  append(t, data_option_table());
  append(t, optimizer_option_table());
  append(t, output_option_table());
  append(t, parallel_option_table());
  append(t, switching_option_table());
  append(t, elastic_option_table());
  append(t, checkpoint_option_table());
  strategies_name_the_strategy(t);
  return t;
}

const OptionSpec<TrainOptions>* find_train_option(const std::string& name) {
  static const std::vector<Spec> table = train_option_table();
  for (const Spec& s : table)
    if (name == s.name) return &s;
  return nullptr;
}

void validate(const TrainOptions& o, const GivenOptions& given) {
  validate(static_cast<const DataOptions&>(o), given);
  validate(static_cast<const OptimizerOptions&>(o), given);
  validate(static_cast<const OutputOptions&>(o), given);
  validate(static_cast<const ParallelOptions&>(o), given);
  validate(static_cast<const SwitchingOptions&>(o), given);
  validate(static_cast<const ElasticOptions&>(o), given);
  validate(static_cast<const CheckpointOptions&>(o), given);
  validate_token_budgets(o, given);
  validate_strategy_sources(o, given);
  validate_profile_use(o);
}

}  // namespace hspmd

// Token-budget steps (docs/mixed_length.md): the step's pieces, their
// dispatch, strategy selection ahead of the step, and bucket switching.
#include "train/token_steps.h"

#include <algorithm>
#include <numeric>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"
#include "train/dist_trainer.h"

namespace hspmd::dist {

void TokenSteps::check_pieces(const std::vector<const Strategy*>& strategies, const std::string& what) const {
  int64_t longest = 0;
  for (int64_t i = 0; i < pieces_->num_pieces(); ++i) longest = std::max(longest, pieces_->piece_size(i));
  if (t_.o_.batch_tokens < longest)
    fail_option("batch_tokens", " ", t_.o_.batch_tokens, " is smaller than the longest piece of ", t_.o_.data_path, " (",
         longest, " tokens; pieces are at most ", option_name("max_seq_len"), " ", t_.o_.seq_len, ")");
  int64_t most = 0;
  for (const Strategy* s : strategies)
    for (size_t k = 0; k < s->pipelines.size(); ++k) {
      const Pipeline& p = s->pipelines[k];
      const int64_t takes = accepted_piece(*s, p, t_.o_.seq_len), holds = micro_batch_capacity(*s, p, t_.o_.seq_len);
      if (holds < takes)
        fail("[strategy] pipeline ", k, ": micro_batch_tokens=", holds, " cannot hold a piece of ", takes,
             " tokens, the longest it accepts");
      most = std::max(most, takes);
    }
  if (most < longest)
    fail("[data] ", t_.o_.data_path, ": a piece of ", longest, " tokens, but no pipeline of ", what,
         " accepts more than ", most, " (its max_seq_len)");
}

const PieceCosts& TokenSteps::piece_costs(const Strategy& s, int key) const {
  std::unique_ptr<PieceCosts>& c = piece_costs_[key];
  if (!c) c = std::make_unique<PieceCosts>(*dispatch_model_, s);
  return *c;
}

std::vector<int64_t> TokenSteps::step_pieces(int64_t cursor) const {
  const int64_t n = pieces_->num_pieces();
  std::vector<int64_t> chosen;
  int64_t tokens = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t piece = (cursor + k) % n;
    const int64_t size = pieces_->piece_size(piece);
    if (!chosen.empty() && tokens + size > t_.o_.batch_tokens) break;
    chosen.push_back(piece);
    tokens += size;
  }
  return chosen;
}

int64_t TokenSteps::longest_piece() const {
  int64_t longest = 0;
  for (int64_t i = 0; i < pieces_->num_pieces(); ++i) longest = std::max(longest, pieces_->piece_size(i));
  return longest;
}

int64_t TokenSteps::most_accepted(const std::vector<const Strategy*>& strategies) const {
  int64_t most = 0;
  for (const Strategy* s : strategies)
    for (const Pipeline& p : s->pipelines) most = std::max(most, accepted_piece(*s, p, t_.o_.seq_len));
  return most;
}

void TokenSteps::discard_prepared() {
  if (next_.valid()) next_.wait();  // it reads the strategies and the piece costs
  next_ = {};
  ++generation_;
}

TokenSteps::Step TokenSteps::plan_step(int64_t cursor, const Strategy& s, int key) const {
  return plan_pieces(step_pieces(cursor), s, key);
}

TokenSteps::Step TokenSteps::plan_pieces(const std::vector<int64_t>& chosen, const Strategy& s, int key) const {
  std::vector<int64_t> lengths;
  for (int64_t piece : chosen) lengths.push_back(pieces_->piece_size(piece));
  const TokenDispatch d = dispatch_token_step(piece_costs(s, key), s, lengths, t_.o_.seq_len,
                                              t_.o_.symmetric_dispatch ? DispatchRule::kSymmetric : DispatchRule::kCost);
  Step t;
  t.pieces = static_cast<int64_t>(chosen.size());
  for (int64_t n : lengths) t.tokens += n;
  t.counted = t.tokens - t.pieces;
  t.pipeline_tokens = d.pipeline_tokens;
  t.predicted_s = d.predicted_s;
  t.micro.resize(d.micro.size());
  for (size_t p = 0; p < d.micro.size(); ++p)
    for (const std::vector<size_t>& mb : d.micro[p]) {
      t.micro[p].emplace_back();
      for (size_t i : mb) t.micro[p].back().push_back(chosen[i]);
    }
  return t;
}

TokenSteps::Prepared TokenSteps::prepare(int64_t cursor, int current,
                                                     const AnnotationPlan* plan) const {
  Prepared pr;
  pr.cursor = cursor;
  pr.plan = plan;
  pr.current = current;
  if (choices_.empty()) {
    pr.by_choice.push_back(plan_step(cursor, *plan->strategy, -1));
    return pr;
  }
  int64_t longest = 0;
  for (int64_t piece : step_pieces(cursor)) longest = std::max(longest, pieces_->piece_size(piece));
  pr.by_choice.resize(choices_.size());
  pr.pick = -1;
  double best = 0;
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Strategy& s = *choices_[i]->strategy;
    int64_t most = 0;
    for (const Pipeline& p : s.pipelines) most = std::max(most, accepted_piece(s, p, t_.o_.seq_len));
    if (most < longest) continue;
    pr.by_choice[i] = plan_step(cursor, s, static_cast<int>(i));
    const double cost = pr.by_choice[i]->predicted_s +  // graphs specialized already
                        (current >= 0 ? choice_switch_s_[current][i] : 0.0);
    if (pr.pick < 0 || cost < best) pr.pick = static_cast<int>(i), best = cost;
  }
  HSPMD_CHECK(pr.pick >= 0, "no strategy accepts the step's longest piece (checked before the first step)");
  return pr;
}

void TokenSteps::plan_choice_switches() {
  choice_switch_s_.assign(choices_.size(), std::vector<double>(choices_.size(), 0.0));
  for (size_t i = 0; i < choices_.size(); ++i)
    for (size_t j = 0; j < choices_.size(); ++j) {
      if (i == j) continue;
      choice_switch_s_[i][j] =
          t_.switch_plans_.get(*choices_[i], *choices_[j], *t_.topology_, t_.base_switch_options()).predicted_s;
    }
}

void TokenSteps::switch_choice(int pick, int64_t step, const std::string& cause) {
  nlohmann::json j = {{"event", "switch"}, {"step", step}, {"strategy", pick}, {"cause", cause}};
  const int old = choice_;
  j.update(t_.move_runtime(std::move(choice_rt_[pick]), t_.base_switch_options(), 0.0, &choice_rt_[old]));
  choice_ = pick;
  t_.log_.write(j);
}

double TokenSteps::run_buckets(int64_t step, float normalizer, std::map<std::string, NDArray>& synced, size_t held,
                               size_t& activations) {
  const std::vector<int64_t> chosen = step_pieces(t_.state_->samples);
  std::vector<int64_t> longest(choices_.size(), 0);  // per choice, the longest piece it accepts
  for (size_t c = 0; c < choices_.size(); ++c)
    for (const Pipeline& p : choices_[c]->strategy->pipelines)
      longest[c] = std::max(longest[c], accepted_piece(*choices_[c]->strategy, p, t_.o_.seq_len));
  std::vector<int> order(choices_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return longest[a] < longest[b]; });
  std::map<int, std::vector<int64_t>> buckets;
  for (int64_t piece : chosen)
    for (int c : order)
      if (pieces_->piece_size(piece) <= longest[c]) {
        buckets[c].push_back(piece);
        break;
      }
  Step whole;
  whole.pieces = static_cast<int64_t>(chosen.size());
  for (int64_t piece : chosen) whole.tokens += pieces_->piece_size(piece);
  whole.counted = whole.tokens - whole.pieces;
  double loss = 0;
  std::map<std::string, Annotation> layout;  // where the gradients summed so far lie
  // The switches inside the step belong to it: the emulated step runs from
  // the previous step's end through every bucket and switch.
  const int64_t step_start = t_.meter_.emulated_end();
  for (int c : order) {
    auto bucket = buckets.find(c);
    if (bucket == buckets.end()) continue;
    if (c != choice_) switch_choice(c, step, "bucket of pieces up to " + std::to_string(longest[c]) + " tokens");
    loss += train_bucket(bucket->second, c, normalizer, synced, layout, held, activations);
    whole.predicted_s += step_->predicted_s;
    whole.pipeline_tokens.insert(whole.pipeline_tokens.end(), step_->pipeline_tokens.begin(),
                                 step_->pipeline_tokens.end());
  }
  t_.meter_.set_emulated_end(step_start);
  step_ = std::move(whole);
  return loss;
}

double TokenSteps::train_bucket(const std::vector<int64_t>& pieces, int choice, float normalizer,
                                std::map<std::string, NDArray>& synced, std::map<std::string, Annotation>& layout,
                                size_t held, size_t& activations) {
  Runtime& rt = *t_.rt_;
  step_ = plan_pieces(pieces, rt.strategy, choice);
  std::map<std::string, NDArray> raw;
  double loss = 0;
  t_.accumulate_schedule(raw, loss, normalizer);
  ExecGraph& graph = *rt.graph;
  Communicator& world = t_.world_;
  graph.wait_sends(world);
  activations = std::max(activations, allocator_for(graph.device()).peak_bytes() - held);
  const double total = all_reduce_scalar(is_representative(graph.loss_annotation(), world.rank()) ? loss : 0.0, world);
  std::map<std::string, NDArray> now = sync_gradients(graph, rt.grad_buckets, raw, world);
  for (const std::string& name : graph.model().names) {  // the same order on every rank
    const Annotation& to = graph.annotation("grad." + name);
    NDArray sum;
    if (auto was = layout.find(name); was != layout.end()) {
      auto held_sum = synced.find(name);
      sum = graph.reshard("bucket_sum." + name, rt.shapes.at(name), was->second, to,
                          held_sum == synced.end() ? NDArray() : held_sum->second, world);
    }
    auto g = now.find(name);
    if (g != now.end()) {
      if (sum.valid()) kernels::accumulate(graph.stream(), g->second, sum);
      else sum = g->second;
    }
    if (sum.valid()) synced[name] = sum;
    else synced.erase(name);
    layout.insert_or_assign(name, to);
  }
  return total;
}

double TokenSteps::select_and_dispatch(int64_t step) {
  const auto t0 = Clock::now();
  double spent_before_switch = -1;  // the switch itself is not selection or dispatch
  const int64_t cursor = t_.state_->samples;
  std::optional<Prepared> pr;
  if (next_.valid()) pr = next_.get();
  // Worked out again when a switch, resume, rollback or re-plan came between
  // (the generation: a re-planned set may reuse a freed plan's address).
  if (!pr || pr->cursor != cursor || pr->plan != t_.rt_->plan.get() || pr->current != choice_ ||
      pr->generation != generation_) {
    pr = prepare(cursor, choice_, t_.rt_->plan.get());
    pr->generation = generation_;
  }
  if (!choices_.empty()) {
    int64_t pick = pr->pick;
    t_.world_.broadcast(&pick, 1, 0);  // one decision for all ranks
    if (pick != choice_) {
      spent_before_switch = seconds_since(t0);
      switch_choice(static_cast<int>(pick), step, "the step's pieces (strategy " + std::to_string(pick) + ")");
    }
    step_ = *pr->by_choice.at(choice_);
  } else {
    step_ = std::move(*pr->by_choice.at(0));
  }
  const double spent = spent_before_switch >= 0 ? spent_before_switch : seconds_since(t0);
  // The next step's, while this one trains.
  if (step + 1 < t_.o_.steps)
    next_ = std::async(std::launch::async, [this, next = cursor + step_->pieces, c = choice_,
                                            plan = t_.rt_->plan.get(), gen = generation_] {
      Prepared p = prepare(next, c, plan);
      p.generation = gen;
      return p;
    });
  return spent;
}

// ---- The part's life: set-up, resume, re-plans ----

TokenSteps::TokenSteps(DistTrainer& trainer) : t_(trainer) {
  const TrainOptions& o = t_.o_;
  if (!o.strategy_choices.empty()) {
    choices_.push_back(t_.plans_[0]);
    replan_buckets_ = static_cast<int>(o.strategy_choices.size());
    for (size_t i = 1; i < o.strategy_choices.size(); ++i)
      choices_.push_back(t_.load_named_plan_file(o.strategy_choices[i], option_name("strategies")));
  }
  if (o.bucket_switching)
    for (const auto& c : choices_)  // gradients move between the plans' layouts: one vocabulary padding
      if (c->model.padded_vocab_size != choices_[0]->model.padded_vocab_size)
        fail_option("bucket_switching", ": the strategies pad the vocabulary differently (", c->model.padded_vocab_size,
             " and ", choices_[0]->model.padded_vocab_size, " rows: their tensor-parallel degrees); give strategies "
             "whose vocabulary splits alike");
}

void TokenSteps::load_pieces(const TokenData& data) {
  pieces_ = std::make_unique<PackedDocuments>(data, t_.o_.seq_len, t_.config_.eos_token_id);
  if (!choices_.empty()) {
    std::vector<const Strategy*> all;
    for (const auto& c : choices_) all.push_back(&*c->strategy);
    check_pieces(all, ("any of " + option_name("strategies")));
  } else {
    for (const auto& p : t_.plans_) check_pieces({&*p->strategy}, "the strategy");
  }
}

void TokenSteps::set_speeds(const Topology& speeds) {
  piece_costs_.clear();
  dispatch_model_.emplace(CostModel::load(t_.config_, speeds, t_.o_.profile_path));
}

void TokenSteps::specialize_choices() {
  choice_rt_.resize(choices_.size());
  for (size_t i = 0; i < choices_.size(); ++i)
    if (static_cast<int>(i) != choice_) choice_rt_[i] = t_.specialize(choices_[i]);
  plan_choice_switches();
}

int64_t TokenSteps::counted(int64_t cursor) const {
  if (!t_.o_.bucket_switching) return step_->counted;
  int64_t counted = 0;
  for (int64_t piece : step_pieces(cursor)) counted += pieces_->piece_size(piece) - 1;
  return counted;
}

int TokenSteps::micro_batches(int pipeline) const {
  return pipeline < 0 ? 0 : static_cast<int>(step_->micro.at(pipeline).size());
}

std::shared_ptr<const AnnotationPlan> TokenSteps::resume_choices(const nlohmann::json& meta) {
  choices_.clear();
  for (const nlohmann::json& s : meta.at("strategies")) choices_.push_back(t_.compile(strategy_from_json(s)));
  choice_ = meta.value("choice", 0);
  return choices_.at(choice_);
}

void TokenSteps::describe(nlohmann::json& meta) const {
  nlohmann::json set = nlohmann::json::array();
  for (const auto& c : choices_) set.push_back(to_json(*c->strategy));
  meta["strategies"] = set;
  meta["choice"] = choice_;
}

std::vector<double> TokenSteps::step_rank_compute(const Strategy& strategy, int world_size) const {
  std::vector<std::vector<std::vector<int64_t>>> lengths(step_->micro.size());
  for (size_t p = 0; p < lengths.size(); ++p)
    for (const std::vector<int64_t>& mb : step_->micro[p]) {
      lengths[p].emplace_back();
      for (int64_t piece : mb) lengths[p].back().push_back(pieces_->piece_size(piece));
    }
  return token_step_rank_compute(*dispatch_model_, strategy, lengths, world_size);
}

void TokenSteps::before_plan_change() {
  if (next_.valid()) next_.wait();  // the next step's preparation reads the plan's piece costs
}

std::unique_ptr<Runtime> TokenSteps::replace_choices(std::vector<std::shared_ptr<const AnnotationPlan>> set,
                                                     int64_t cursor, double& specialize_s, nlohmann::json& extra) {
  choice_rt_.clear();
  choices_ = std::move(set);
  const auto t0 = Clock::now();
  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (const auto& p : choices_) runtimes.push_back(t_.specialize(p));
  specialize_s = seconds_since(t0);
  t_.last_specialize_s_ = specialize_s;
  const auto t1 = Clock::now();
  plan_choice_switches();
  extra["switch_plans_s"] = seconds_since(t1);
  // The pick: the least predicted step among the choices that accept the
  // step's longest piece (every one is a switch from the old plan).
  int64_t pick = prepare(cursor, -1, t_.rt_->plan.get()).pick;
  t_.world_.broadcast(&pick, 1, 0);  // one decision for all ranks
  extra["choice"] = pick;
  choice_ = static_cast<int>(pick);
  std::unique_ptr<Runtime> ready = std::move(runtimes[choice_]);
  choice_rt_ = std::move(runtimes);
  ++generation_;
  return ready;
}

}  // namespace hspmd::dist

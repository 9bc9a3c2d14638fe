// Token-budget steps (docs/mixed_length.md): the step's pieces, their
// dispatch, strategy selection ahead of the step, and bucket switching.
#include "train/dist_trainer.h"

namespace hspmd::dist {

void DistTrainer::check_pieces(const std::vector<const Strategy*>& strategies, const std::string& what) const {
  int64_t longest = 0;
  for (int64_t i = 0; i < pieces_->num_pieces(); ++i) longest = std::max(longest, pieces_->piece_size(i));
  if (o_.batch_tokens < longest)
    fail("[flags] --batch-tokens ", o_.batch_tokens, " is smaller than the longest piece of ", o_.data_path, " (",
         longest, " tokens; pieces are at most --max-seq-len ", o_.seq_len, ")");
  int64_t most = 0;
  for (const Strategy* s : strategies)
    for (size_t k = 0; k < s->pipelines.size(); ++k) {
      const Pipeline& p = s->pipelines[k];
      const int64_t takes = accepted_piece(*s, p, o_.seq_len), holds = micro_batch_capacity(*s, p, o_.seq_len);
      if (holds < takes)
        fail("[strategy] pipeline ", k, ": micro_batch_tokens=", holds, " cannot hold a piece of ", takes,
             " tokens, the longest it accepts");
      most = std::max(most, takes);
    }
  if (most < longest)
    fail("[data] ", o_.data_path, ": a piece of ", longest, " tokens, but no pipeline of ", what,
         " accepts more than ", most, " (its max_seq_len)");
}

const PieceCosts& DistTrainer::piece_costs(const Strategy& s, int key) const {
  std::unique_ptr<PieceCosts>& c = piece_costs_[key];
  if (!c) c = std::make_unique<PieceCosts>(*dispatch_model_, s);
  return *c;
}

std::vector<int64_t> DistTrainer::step_pieces(int64_t cursor) const {
  const int64_t n = pieces_->num_pieces();
  std::vector<int64_t> chosen;
  int64_t tokens = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t piece = (cursor + k) % n;
    const int64_t size = pieces_->piece_size(piece);
    if (!chosen.empty() && tokens + size > o_.batch_tokens) break;
    chosen.push_back(piece);
    tokens += size;
  }
  return chosen;
}

int64_t DistTrainer::longest_piece() const {
  int64_t longest = 0;
  for (int64_t i = 0; i < pieces_->num_pieces(); ++i) longest = std::max(longest, pieces_->piece_size(i));
  return longest;
}

int64_t DistTrainer::most_accepted(const std::vector<const Strategy*>& strategies) const {
  int64_t most = 0;
  for (const Strategy* s : strategies)
    for (const Pipeline& p : s->pipelines) most = std::max(most, accepted_piece(*s, p, o_.seq_len));
  return most;
}

void DistTrainer::discard_prepared() {
  if (next_.valid()) next_.wait();  // it reads the strategies and the piece costs
  next_ = {};
  ++generation_;
}

DistTrainer::TokenStep DistTrainer::plan_token_step(int64_t cursor, const Strategy& s, int key) const {
  return plan_pieces(step_pieces(cursor), s, key);
}

DistTrainer::TokenStep DistTrainer::plan_pieces(const std::vector<int64_t>& chosen, const Strategy& s, int key) const {
  std::vector<int64_t> lengths;
  for (int64_t piece : chosen) lengths.push_back(pieces_->piece_size(piece));
  const TokenDispatch d = dispatch_token_step(piece_costs(s, key), s, lengths, o_.seq_len,
                                              o_.symmetric_dispatch ? DispatchRule::kSymmetric : DispatchRule::kCost);
  TokenStep t;
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

DistTrainer::Prepared DistTrainer::prepare_token_step(int64_t cursor, int current,
                                                     const AnnotationPlan* plan) const {
  Prepared pr;
  pr.cursor = cursor;
  pr.plan = plan;
  pr.current = current;
  if (choices_.empty()) {
    pr.by_choice.push_back(plan_token_step(cursor, *plan->strategy, -1));
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
    for (const Pipeline& p : s.pipelines) most = std::max(most, accepted_piece(s, p, o_.seq_len));
    if (most < longest) continue;
    pr.by_choice[i] = plan_token_step(cursor, s, static_cast<int>(i));
    const double cost = pr.by_choice[i]->predicted_s +  // graphs specialized already
                        (current >= 0 ? choice_switch_s_[current][i] : 0.0);
    if (pr.pick < 0 || cost < best) pr.pick = static_cast<int>(i), best = cost;
  }
  HSPMD_CHECK(pr.pick >= 0, "no strategy accepts the step's longest piece (checked before the first step)");
  return pr;
}

void DistTrainer::plan_choice_switches() {
  choice_switch_s_.assign(choices_.size(), std::vector<double>(choices_.size(), 0.0));
  for (size_t i = 0; i < choices_.size(); ++i)
    for (size_t j = 0; j < choices_.size(); ++j) {
      if (i == j) continue;
      SwitchOptions so;
      so.algorithm = algorithm_;
      so.bucket_bytes = static_cast<int64_t>(o_.switch_bucket_mb * 1024 * 1024);
      choice_switch_s_[i][j] = switch_plans_.get(*choices_[i], *choices_[j], *topology_, so).predicted_s;
    }
}

void DistTrainer::switch_choice(int pick, int64_t step, const std::string& cause, std::ofstream& log) {
  SwitchOptions so;
  so.algorithm = algorithm_;
  so.bucket_bytes = static_cast<int64_t>(o_.switch_bucket_mb * 1024 * 1024);
  nlohmann::json j = {{"event", "switch"}, {"step", step}, {"strategy", pick}, {"cause", cause}};
  const int old = choice_;
  j.update(move_runtime(std::move(choice_rt_[pick]), so, 0.0, &choice_rt_[old]));
  choice_ = pick;
  write_log(log, j);
}

double DistTrainer::run_buckets(int64_t step, float normalizer, std::ofstream& log,
                                std::map<std::string, NDArray>& synced, size_t held, size_t& activations,
                                TokenStep& whole) {
  const std::vector<int64_t> chosen = step_pieces(state_->samples);
  std::vector<int64_t> longest(choices_.size(), 0);  // per choice, the longest piece it accepts
  for (size_t c = 0; c < choices_.size(); ++c)
    for (const Pipeline& p : choices_[c]->strategy->pipelines)
      longest[c] = std::max(longest[c], accepted_piece(*choices_[c]->strategy, p, o_.seq_len));
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
  whole = TokenStep{};
  whole.pieces = static_cast<int64_t>(chosen.size());
  for (int64_t piece : chosen) whole.tokens += pieces_->piece_size(piece);
  whole.counted = whole.tokens - whole.pieces;
  double loss_total = 0;
  std::map<std::string, Annotation> layout;  // where the gradients summed so far lie
  // The switches inside the step belong to it: the emulated step runs from
  // the previous step's end through every bucket and switch.
  const int64_t step_start = emulated_end_;
  for (int c : order) {
    auto bucket = buckets.find(c);
    if (bucket == buckets.end()) continue;
    if (c != choice_) switch_choice(c, step, "bucket of pieces up to " + std::to_string(longest[c]) + " tokens", log);
    token_step_ = plan_pieces(bucket->second, rt_->strategy, c);
    whole.predicted_s += token_step_->predicted_s;
    whole.pipeline_tokens.insert(whole.pipeline_tokens.end(), token_step_->pipeline_tokens.begin(),
                                 token_step_->pipeline_tokens.end());
    std::map<std::string, NDArray> raw;
    double loss = 0;
    accumulate_schedule(raw, loss, normalizer);
    ExecGraph& graph = *rt_->graph;
    graph.wait_sends(world_);
    activations = std::max(activations, allocator_for(graph.device()).peak_bytes() - held);
    loss_total += all_reduce_scalar(is_representative(graph.loss_annotation(), world_.rank()) ? loss : 0.0, world_);
    std::map<std::string, NDArray> now = graph.sync_gradients(raw, world_);
    for (const std::string& name : graph.model().names) {  // the same order on every rank
      const Annotation& to = graph.annotation("grad." + name);
      NDArray sum;
      if (auto was = layout.find(name); was != layout.end()) {
        auto held_sum = synced.find(name);
        sum = graph.reshard("bucket_sum." + name, rt_->shapes.at(name), was->second, to,
                            held_sum == synced.end() ? NDArray() : held_sum->second, world_);
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
  }
  emulated_end_ = step_start;
  return loss_total;
}

double DistTrainer::select_and_dispatch(int64_t step, std::ofstream& log) {
  const auto t0 = Clock::now();
  double spent_before_switch = -1;  // the switch itself is not selection or dispatch
  const int64_t cursor = state_->samples;
  std::optional<Prepared> pr;
  if (next_.valid()) pr = next_.get();
  // Worked out again when a switch, resume, rollback or re-plan came between
  // (the generation: a re-planned set may reuse a freed plan's address).
  if (!pr || pr->cursor != cursor || pr->plan != rt_->plan.get() || pr->current != choice_ ||
      pr->generation != generation_) {
    pr = prepare_token_step(cursor, choice_, rt_->plan.get());
    pr->generation = generation_;
  }
  if (!choices_.empty()) {
    int64_t pick = pr->pick;
    world_.broadcast(&pick, 1, 0);  // one decision for all ranks
    if (pick != choice_) {
      spent_before_switch = std::chrono::duration<double>(Clock::now() - t0).count();
      switch_choice(static_cast<int>(pick), step, "the step's pieces (strategy " + std::to_string(pick) + ")", log);
    }
    token_step_ = *pr->by_choice.at(choice_);
  } else {
    token_step_ = std::move(*pr->by_choice.at(0));
  }
  const double spent =
      spent_before_switch >= 0 ? spent_before_switch : std::chrono::duration<double>(Clock::now() - t0).count();
  // The next step's, while this one trains.
  if (step + 1 < o_.steps)
    next_ = std::async(std::launch::async, [this, next = cursor + token_step_->pieces, c = choice_,
                                            plan = rt_->plan.get(), gen = generation_] {
      Prepared p = prepare_token_step(next, c, plan);
      p.generation = gen;
      return p;
    });
  return spent;
}

}  // namespace hspmd::dist

// The distributed training loop: one ExecGraph per rank, pipelines fed with
// their own samples, gradient sync and the ZeRO gathers through the plan's
// Reshards, AdamW on local shards (the class: train/dist_trainer.h).
#include "train/dist_trainer.h"
#include "train/op_times.h"
#include "train/resume_checks.h"

#include <cstdlib>

#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd {
namespace dist {

std::shared_ptr<const AnnotationPlan> DistTrainer::load_plan_file(const std::string& path) const {
  if (is_plan_file(path)) return trainable_plan(load_plan(path), path);
  return compile(load_strategy(path));
}

std::shared_ptr<const AnnotationPlan> DistTrainer::compile(const Strategy& strategy) const {
  const int64_t g = sequence_granularity(strategy);
  if (!o_.pack_documents && o_.batch_tokens == 0 && o_.seq_len % g != 0)
    fail("[strategy] --seq-len ", o_.seq_len, " must be a multiple of ", g,
         " (stages split the sequence over their cp x tp ranks, and cp > 1 into 2 x cp chunks)");
  CompileOptions co;
  co.seq_len = (o_.seq_len + g - 1) / g * g;  // packed lengths vary: compile for the longest, rounded up
  co.precision = precision();
  return std::make_shared<const AnnotationPlan>(compile_plan(config_, strategy, world_.size(), co));
}

std::unique_ptr<Runtime> DistTrainer::specialize(std::shared_ptr<const AnnotationPlan> plan) const {
  auto rt = std::make_unique<Runtime>();
  rt->plan = plan;
  rt->strategy = *plan->strategy;
  for (auto& [name, shape] : model_parameter_shapes(plan->model)) rt->shapes[name] = shape;
  // Every rank's view of the stacked micro-batch must divide along every
  // pipeline's splits, so the granularity is common to all pipelines.
  rt->granularity = sequence_granularity(rt->strategy);
  const int64_t seq = (o_.seq_len + rt->granularity - 1) / rt->granularity * rt->granularity;
  int64_t batch = 0;
  for (const Pipeline& p : rt->strategy.pipelines) batch += p.micro_batch_size;
  rt->graph =
      std::make_unique<ExecGraph>(plan, topology_, world_.rank(), Bindings{{"B", batch}, {"S", seq}}, o_.device);
  rt->gather_dtypes = zero_gather_dtypes(*plan, rt->graph->model());
  // Pipelines are discovered from the resolved plan (appendix A.2), not
  // read from the strategy; the strategy only gives micro-batch counts.
  std::vector<PlannedOpTraffic> traffic;
  const std::vector<PlannedReshard> reshards = rt->graph->dry_run(&traffic);  // this rank's Reshards only
  create_groups(reshards, traffic);
  const auto pipelines = rt->graph->discover_pipelines();
  const PipelinePosition at = pipeline_positions(pipelines, world_.size()).at(world_.rank());
  HSPMD_CHECK(at.pipeline == pipeline_of(rt->strategy, world_.rank()),
              "discovered pipeline ", at.pipeline, " of rank ", world_.rank(), " differs from the strategy's");
  rt->pipeline = at.pipeline;
  if (!at.idle()) {
    rt->stage = at.stage;
    rt->stages = static_cast<int>(pipelines[at.pipeline].stages.size());
    for (const Stage& st : rt->strategy.pipelines[rt->pipeline].stages)
      if (std::count(st.ranks.begin(), st.ranks.end(), world_.rank())) rt->graph->set_recompute(st.recompute);
  }
  rt->graph->set_deferred_sends(true);
  if (clock_) {
    rt->graph->set_clock(clock_.get());
    rt->graph->set_op_time_model(time_model_);
    rt->graph->set_memory_cap(static_cast<size_t>(topology_->rank(world_.rank()).memory_cap_gib * 1024.0 *
                                                  1024.0 * 1024.0));
  }
  return rt;
}

SwitchOptions DistTrainer::switch_options(size_t index) const {
  const TrainOptions::Switch& sw = o_.switches.at(index - 1);
  SwitchOptions so;
  so.algorithm = algorithm_;
  so.bucket_bytes = static_cast<int64_t>(o_.switch_bucket_mb * 1024 * 1024);
  so.lost_ranks = std::set<int>(sw.lost_ranks.begin(), sw.lost_ranks.end());
  so.have_checkpoint = !o_.checkpoint_dir.empty() && o_.save_every > 0 && sw.step % o_.save_every == 0;
  return so;
}

// Every communicator group the plan's Reshards and ops use on this rank,
// created now in sorted member-list order: creation is collective over the
// members, and one global order on every rank cannot deadlock (the smallest
// group still waited for has all its members at it).
void DistTrainer::create_groups(const std::vector<PlannedReshard>& reshards,
                                const std::vector<PlannedOpTraffic>& traffic) const {
  std::set<std::vector<int>> groups;
  for (const PlannedReshard& r : reshards) {
    auto it = r.resolution().ranks.find(world_.rank());
    if (it == r.resolution().ranks.end()) continue;
    for (const CommPhase& phase : it->second.phases)
      for (const CommOp& op : phase.ops)
        if (is_collective(op.kind) && op.group.size() > 1) groups.insert(op.group);
  }
  for (const PlannedOpTraffic& t : traffic) {
    auto it = t.ranks.find(world_.rank());
    if (it != t.ranks.end() && it->second.group.size() > 1) groups.insert(it->second.group);
  }
  for (const std::vector<int>& g : groups) world_.group(g);
}

size_t DistTrainer::plan_at(int64_t step) const {
  size_t k = 0;
  for (size_t i = 0; i < o_.switches.size(); ++i)
    if (o_.switches[i].step <= step) k = i + 1;
  return k;
}

// The conceptual micro-batch step stacks every pipeline's micro-batch (part
// k = pipeline k's samples); the rank reads only its own pipeline's samples
// into it and keeps its local box. Rows are as wide as the pipeline's
// widest sample, rounded up to the granularity (packed documents), so
// pipelines see different lengths; they never exchange activations.
ValueMap DistTrainer::feeds(int micro, float normalizer, Bindings& bindings) const {
  const Strategy& strategy = rt_->strategy;
  int64_t rows = 0, row = 0, width = 0;
  std::function<void(int32_t*, int32_t*, int32_t*)> fill;  // this pipeline's rows, from row `row` on
  if (pieces_) {  // token-budget steps: one row per pipeline, its packed pieces
    const std::vector<int64_t>& mine = token_step_->micro.at(rt_->pipeline).at(micro);
    int64_t n = 0;
    for (int64_t p : mine) n += pieces_->piece_size(p);
    width = (std::max<int64_t>(n, 1) + rt_->granularity - 1) / rt_->granularity * rt_->granularity;
    rows = static_cast<int64_t>(strategy.pipelines.size());
    row = rt_->pipeline;
    fill = [&](int32_t* ids, int32_t* targets, int32_t* positions) {
      pieces_->pack(mine, width, ids, targets, positions);
    };
  } else {
    int64_t mine = 0, first = state_->samples;
    for (int k = 0; k < static_cast<int>(strategy.pipelines.size()); ++k) {
      const Pipeline& p = strategy.pipelines[k];
      if (k == rt_->pipeline) row = rows, mine = first + micro * p.micro_batch_size;
      rows += p.micro_batch_size;
      first += p.batch();
    }
    const int count = strategy.pipelines.at(rt_->pipeline).micro_batch_size;
    width = source_->width(mine, count, rt_->granularity);
    fill = [&, mine, count](int32_t* ids, int32_t* targets, int32_t* positions) {
      for (int b = 0; b < count; ++b)
        source_->fill(mine + b, width, ids + b * width, targets + b * width, positions + b * width);
    };
  }
  NDArray ids = NDArray::zeros({rows, width}, DType::I32);
  NDArray targets = NDArray::zeros({rows, width}, DType::I32);
  NDArray positions = NDArray::zeros({rows, width}, DType::I32);
  const int64_t at = row * width;
  fill(ids.host_data<int32_t>() + at, targets.host_data<int32_t>() + at, positions.host_data<int32_t>() + at);
  NDArray norm = NDArray::empty({}, DType::F32);
  norm.fill(normalizer);
  bindings = Bindings{{"B", rows}, {"S", width}};
  ValueMap v;
  for (const std::string& name : rt_->graph->model().names) {
    const Shard& sh = state_->slot(name, StateSlot::kParam);
    if (sh.held()) v[name] = sh.data;
  }
  for (auto& [name, full] : ValueMap{{"input_ids", ids}, {"targets", targets},
                                     {"positions", positions}, {"normalizer", norm}})
    if (auto box = rt_->graph->local_box(name, full.shape())) v[name] = box_slice(full, *box);
  return v;
}

double DistTrainer::global_grad_norm(std::map<std::string, NDArray>& synced) const {
  // Each gradient once over the ranks: the representative holders'.
  std::vector<NDArray> mine;
  for (const auto& [name, g] : synced)
    if (is_representative(rt_->graph->annotation("grad." + name), world_.rank())) mine.push_back(g);
  const double sumsq = kernels::sum_of_squares(rt_->graph->stream(), mine);
  const double norm = std::sqrt(all_reduce_scalar(sumsq, world_));
  scale_grads(synced, clip_coefficient(norm, o_.clip_grad));
  return norm;
}

// AdamW on the rank's optimized shards, with the state's moments (imported
// into the optimizer for the update only); ZeRO then gathers the parameter.
void DistTrainer::optimizer_step(Adam& adam, std::map<std::string, NDArray>& synced, double lr) {
  adam.set_step_count(state_->step);
  adam.begin_step();
  state_->step = adam.step_count();
  const AnnotationPlan& plan = *rt_->plan;
  // Model clock: the profile's optimizer fit, its fixed part once per step.
  const OptimizerFit* modeled = clock_ && clock_->modeled() ? &profile_->optimizer : nullptr;
  double fixed_s = modeled ? modeled->fixed_s : 0.0;
  for (const std::string& name : rt_->graph->model().names) {  // the same order on every rank
    const bool decay = rt_->shapes.at(name).size() >= 2;
    Shard& target = state_->optimized(name);
    auto g = synced.find(name);
    if (g != synced.end() && target.held()) {
      if (clock_) clock_->begin_compute();
      adam.import_moments(name, state_->slot(name, StateSlot::kExpAvg).data,
                          state_->slot(name, StateSlot::kExpAvgSq).data);
      adam.update(name, target.data, g->second, lr, decay);
      adam.export_moments(name);
      if (clock_) clock_->end_compute();
      if (modeled) {
        clock_->advance(std::exchange(fixed_s, 0.0) +
                        modeled->per_param_s * static_cast<double>(target.data.numel()));
      }
    }
    auto st = plan.optimizer_states.find(name);
    if (st == plan.optimizer_states.end()) continue;
    Shard& param = state_->slot(name, StateSlot::kParam);
    // Mixed precision: the linear weights travel as their bf16 compute copies
    // (exact in f32, and all the graph reads of them).
    NDArray gathered = rt_->graph->reshard("zero_gather." + name, rt_->shapes.at(name), st->second,
                                           rt_->graph->annotation(name), target.data, world_,
                                           rt_->gather_dtypes.at(name));
    if (gathered.valid()) param.data = gathered;
  }
}

// Per parameter, its local array under `layout(name)` gathered to rank 0
// (padding rows dropped) and written there at once: rank 0 holds one full
// tensor at a time.
std::string DistTrainer::nonfinite_parameter() {
  const std::vector<std::string>& names = rt_->graph->model().names;
  int64_t mine = static_cast<int64_t>(names.size());
  for (size_t k = 0; k < names.size() && mine == static_cast<int64_t>(names.size()); ++k) {
    const Shard& s = state_->slot(names[k], StateSlot::kParam);
    if (s.held() && train_common::first_nonfinite(s.data) >= 0) mine = static_cast<int64_t>(k);
  }
  const std::vector<int64_t> all = gather_counts({mine}, world_)[0];
  const int64_t first = *std::min_element(all.begin(), all.end());
  return first < static_cast<int64_t>(names.size()) ? names[first] : "";
}

bool DistTrainer::skip_nonfinite(StepRecord& r, int64_t& skipped) const {
  if (std::isfinite(r.loss) && std::isfinite(r.grad_norm)) return false;
  const auto num = [](double v) { return std::isnan(v) ? std::string("nan") : detail::concat(v); };  // not "-nan"
  if (skipped >= o_.skip_nonfinite_steps)
    fail("[train] step ", r.step, ": loss ", num(r.loss), ", gradient norm ", num(r.grad_norm),
         ": not finite; stopped before updating the weights",
         o_.skip_nonfinite_steps > 0 ? " (--skip-nonfinite-steps " + std::to_string(o_.skip_nonfinite_steps) +
                                           " already skipped)"
                                     : std::string(" (--skip-nonfinite-steps N skips such steps)"));
  ++skipped;
  r.skipped = true;
  if (world_.rank() == 0)
    std::fprintf(stderr, "hspmd: warning: step %lld: loss %s, gradient norm %s: not finite; step skipped (%lld of "
                 "--skip-nonfinite-steps %lld)\n", static_cast<long long>(r.step), num(r.loss).c_str(),
                 num(r.grad_norm).c_str(),
                 static_cast<long long>(skipped), static_cast<long long>(o_.skip_nonfinite_steps));
  return true;
}

void DistTrainer::write_log(std::ofstream& log, const nlohmann::json& j) const {
  if (!log.is_open()) return;
  // Every record carries the wall-clock time it was written (seconds since
  // the epoch): spans between records, and across a restart, are then
  // measured on one clock (bench/restart_vs_online.py).
  nlohmann::json stamped = j;
  stamped["unix_time"] =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  log << stamped.dump() << "\n" << std::flush;
  if (!log) fail("[train] --log ", o_.log_path, ": write failed (disk full or I/O error)");
}

void DistTrainer::prepare() {
  data_ = std::make_unique<TokenData>(TokenData::load(o_.data_path, config_.vocab_size));
  if (o_.batch_tokens > 0) {
    pieces_ = std::make_unique<PackedDocuments>(*data_, o_.seq_len, config_.eos_token_id);
    if (!choices_.empty()) {
      std::vector<const Strategy*> all;
      for (const auto& c : choices_) all.push_back(&*c->strategy);
      check_pieces(all, "any of --strategies");
    } else {
      for (const auto& p : plans_) check_pieces({&*p->strategy}, "the strategy");
    }
    for (const ElasticEvent& e : events_) {  // an event's strategy becomes the only choice: it takes every piece
      if (e.strategy_path.empty()) continue;
      const Strategy& s = *event_plans_.at(e.step)->strategy;
      const int64_t longest = longest_piece(), most = most_accepted({&s});
      if (most < longest)
        fail("[events] ", o_.events_path, ": step ", e.step, ": strategy ", e.strategy_path, ": a piece of ", longest,
             " tokens of ", o_.data_path, ", but no pipeline accepts more than ", most, " (its max_seq_len)");
      try {
        check_pieces({&s}, "its strategy");
      } catch (const Error& err) {
        fail("[events] ", o_.events_path, ": step ", e.step, ": strategy ", e.strategy_path, ": ", err.what());
      }
    }
  } else {
    source_ = std::make_unique<train_common::SampleSource>(*data_, o_.seq_len, o_.pack_documents,
                                                           config_.eos_token_id);
  }
  int64_t start = 0;
  std::unique_ptr<CheckpointReader> reader;
  if (!o_.resume_dir.empty()) {
    reader = std::make_unique<CheckpointReader>(o_.resume_dir);
    start = reader->index().step;
    resume_run_id_ = reader->index().meta.value("run_id", std::string());
    std::error_code ec;
    if (!o_.checkpoint_dir.empty() && std::filesystem::equivalent(o_.resume_dir, o_.checkpoint_dir, ec))
      resumed_run_id_ = reader->index().meta.value("run_id", std::string());
    if (start >= o_.steps)
      fail("[checkpoint] ", o_.resume_dir, ": it is at step ", start, ", not before --steps ", o_.steps);
    // Before any state is read: the meta's fields, and the model and data
    // mode it was written under (docs/checkpoint.md, "What a resume checks").
    train_common::read_resume_cursor(reader->index().meta, o_.resume_dir);
    train_common::check_resume_matches(reader->index().meta, config_, o_, o_.resume_dir);
  }
  plan_index_ = plan_at(start);
  std::shared_ptr<const AnnotationPlan> first = plans_[plan_index_];
  if (reader && !events_.empty()) {
    // Elastic: the plan in force when the checkpoint was written (re-planned,
    // perhaps), and the cluster as the events before the step left it.
    const nlohmann::json& meta = reader->index().meta;
    if (!choices_.empty() && meta.contains("strategies")) {  // token-budget steps: the set in force, re-planned perhaps
      choices_.clear();
      for (const nlohmann::json& s : meta.at("strategies")) choices_.push_back(compile(strategy_from_json(s)));
      choice_ = meta.value("choice", 0);
      first = choices_.at(choice_);
    } else if (meta.contains("strategy")) {
      first = compile(strategy_from_json(meta.at("strategy")));
    }
    failed_ = failed_after(events_, start - 1);
    events_done_ = start - 1;
    for (const ElasticEvent& e : events_) {
      if (e.step >= start) break;
      for (const auto& [r, factor] : e.slowdown) {
        if (r == world_.rank() && clock_) clock_->set_slowdown(factor);
        assumed_ = std::make_shared<const Topology>(assumed_->with_slowdown(r, factor));
      }
    }
  }
  // The dispatch's cost model: the speeds as the planner assumes them.
  if (pieces_) dispatch_model_.emplace(CostModel::load(config_, assumed_ ? *assumed_ : *topology_, o_.profile_path));
  const auto t0 = Clock::now();
  rt_ = specialize(first);
  if (reader && !events_.empty()) replan_failed_at_resume(start);
  last_specialize_s_ = std::chrono::duration<double>(Clock::now() - t0).count();
  // --strategies: every choice specialized now (the same order on every
  // rank: creating communicator groups is collective); a per-step switch
  // then only moves the state.
  choice_rt_.resize(choices_.size());
  for (size_t i = 0; i < choices_.size(); ++i)
    if (static_cast<int>(i) != choice_) choice_rt_[i] = specialize(choices_[i]);
  plan_choice_switches();
  // Every switch is planned now, so that one that cannot be done (a lost
  // rank's slices with no checkpoint) fails before the first step.
  for (size_t k = plan_index_ + 1; k < plans_.size(); ++k)
    switch_plans_.get(*plans_[k - 1], *plans_[k], *topology_, switch_options(k));
  if (reader) {
    state_ = TrainingState::load(rt_->plan, world_.rank(), *reader);
    state_->move_to_device(o_.device);
    const nlohmann::json& meta = reader->index().meta;
    state_->step = start;
    const train_common::ResumeCursor cursor = train_common::read_resume_cursor(meta, o_.resume_dir);
    state_->samples = cursor.samples;
    state_->seed = cursor.seed;
    return;
  }
  std::map<std::string, NDArray> full =
      o_.init_path.empty()
          ? init_model_parameters(config_, o_.seed)
          : validate_model_weights(config_, load_safetensors(o_.init_path), o_.init_path);
  if (!o_.init_path.empty()) train_common::check_finite_weights(full, o_.init_path);
  state_ = TrainingState::from_full(rt_->plan, world_.rank(), full);
  state_->move_to_device(o_.device);
  state_->seed = o_.seed;
}

nlohmann::json DistTrainer::move_to(std::shared_ptr<const AnnotationPlan> plan, const SwitchOptions& so) {
  finish_checkpoint(true);  // the switch may read the checkpoint of this step
  const auto t0 = Clock::now();
  std::unique_ptr<Runtime> next = specialize(std::move(plan));
  const double specialize_s = std::chrono::duration<double>(Clock::now() - t0).count();
  last_specialize_s_ = specialize_s;
  return move_runtime(std::move(next), so, specialize_s, nullptr);
}

nlohmann::json DistTrainer::move_runtime(std::unique_ptr<Runtime> next, const SwitchOptions& so, double specialize_s,
                                         std::unique_ptr<Runtime>* keep_old) {
  finish_checkpoint(true);
  if (next_.valid()) next_.wait();  // the next step's preparation reads the plan's piece costs
  std::unique_ptr<CheckpointReader> reader;
  if (so.have_checkpoint) reader = std::make_unique<CheckpointReader>(o_.checkpoint_dir);
  const SwitchPlan& sp = switch_plans_.get(*rt_->plan, *next->plan, *topology_, so);
  if (keep_old) *keep_old = std::move(rt_);
  rt_.reset();  // the old graph goes before the state moves: less memory at the peak
  SwitchReport rep;
  state_ = std::move(*state_).reshard_to(next->plan, sp, *topology_, world_, reader.get(), clock_.get(), &rep);
  rt_ = std::move(next);
  piece_costs_.erase(-1);  // the current plan's
  const auto all = gather_counts({rep.bytes_sent, rep.predicted_bytes, rep.checkpoint_bytes, rep.peak_extra_bytes,
                                  rep.bound_bytes}, world_);
  if (clock_) emulated_end_ = static_cast<int64_t>(clock_->now() * 1e9);
  skip_next_ = true;
  window_.clear();
  window_steps_.clear();
  predicted_.clear();
  nlohmann::json j = {{"algorithm", algorithm_name(algorithm_)},
                      {"specialize_s", specialize_s}, {"switch_s", rep.switch_s},
                      {"bytes_sent", all[0]},     {"predicted_bytes", all[1]},
                      {"checkpoint_bytes", all[2]}, {"peak_extra_bytes", all[3]},
                      {"extra_bytes_bound", all[4]}, {"rounds", sp.rounds.size()},
                      {"predicted_switch_s", sp.predicted_s}};
  if (clock_) j["emulated_switch_s"] = rep.emulated_s;
  return j;
}

// Moves the run to plans_[index] at `step` (--switch).
void DistTrainer::switch_to(size_t index, int64_t step, std::ofstream& log) {
  nlohmann::json j = {{"event", "switch"}, {"step", step}};
  j.update(move_to(plans_[index], switch_options(index)));
  plan_index_ = index;
  write_log(log, j);
}

// Every rank writes its shards, then rank 0 commits the index (the
// checkpoint's atomic point) once all have.
void DistTrainer::fill_record(const std::vector<StepMetrics>& all, StepRecord& r) {
  int64_t end = 0;
  emulated_compute_.resize(all.size(), 0);
  for (size_t k = 0; k < all.size(); ++k) {
    const StepMetrics& m = all[k];
    r.bytes_sent.push_back(m.bytes_sent);
    r.reshard_bytes_sent.push_back(m.reshard_sent);
    r.predicted_reshard_bytes.push_back(m.reshard_predicted);
    r.op_bytes_sent.push_back(m.op_sent);
    r.predicted_op_bytes.push_back(m.op_predicted);
    r.peak_memory_bytes.push_back(m.peak_bytes);
    r.peak_activation_bytes.push_back(m.activation_bytes);
    r.grad_sync_s.push_back(m.grad_sync_ns * 1e-9);
    r.sm_percent.push_back(m.sm_percent);
    r.grad_sync_overlapped.push_back(m.grad_sync_overlapped);
    r.attention_fallbacks.push_back(m.attention_fallbacks);
    end = std::max(end, m.clock_ns);
    if (!clock_) continue;
    r.emulated_compute_s.push_back((m.compute_ns - emulated_compute_[k]) * 1e-9);
    emulated_compute_[k] = m.compute_ns;
  }
  if (!clock_) return;
  // The emulated cluster's step: from the last rank's end to the last rank's end.
  r.emulated_step_time_s = (end - emulated_end_) * 1e-9;
  emulated_end_ = end;
}

// One step's micro-batches under the plan's schedule.
void DistTrainer::agree_on_run_id() {
  std::string id = o_.run_id;
  if (const char* env = std::getenv("HSPMD_RUN_ID"); id.empty() && env != nullptr) id = env;
  if (!id.empty()) {
    run_id_ = id;
    return;
  }
  uint64_t value = 0;  // rank 0 draws it; the others take rank 0's
  if (world_.rank() == 0) value = std::stoull(new_run_id(), nullptr, 16);
  world_.broadcast(&value, 1, DType::I64, 0);
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(value));
  run_id_ = buf;
}

std::vector<StepRecord> DistTrainer::run() {
  begin();
  while (!done()) step();
  return end();
}

void DistTrainer::begin() {
  agree_on_run_id();
  adam_.emplace(o_.adam);
  if (overlapping() && !grad_world_) {  // collective: every rank is here
    try {
      grad_world_ = world_.duplicate();
    } catch (const Error& e) {
      // An MPI without MPI_THREAD_MULTIPLE (every rank has the same library,
      // so every rank takes this branch, before any rank communicates):
      // overlap only if it was asked for. Any other failure is the run's.
      if (o_.overlap.has_value() || std::string(e.what()).find("MPI_THREAD_MULTIPLE") == std::string::npos) throw;
      if (world_.rank() == 0)
        std::fprintf(stderr, "hspmd: note: gradients synchronized after the backward, not overlapped: %s\n", e.what());
    }
  }
  schedule_ = o_.schedule;
  schedule_.total_steps = o_.steps;
  if (world_.rank() == 0 && !o_.log_path.empty()) {
    log_.open(o_.log_path, state_->step > 0 ? std::ios::app : std::ios::trunc);
    if (!log_) fail("[train] --log ", o_.log_path, ": cannot open for writing: ", std::strerror(errno));
  }
  if (!resume_replan_.is_null()) write_log(log_, resume_replan_);  // the re-plan at a resume (setup)
  skipped_ = 0;
  records_.clear();
  next_step_ = state_->step;
  start_ = Clock::now();
}

StepRecord DistTrainer::step() {
  HSPMD_CHECK(adam_.has_value() && !done(), "DistTrainer::step before begin() or after the last step");
  std::ofstream& log = log_;
  std::vector<StepRecord>& records = records_;
  Adam& adam = *adam_;
  const LrSchedule& schedule = schedule_;
  int64_t& skipped = skipped_;
  const auto start = start_;
  int64_t step = next_step_;
  if (!events_.empty()) {
    auto ev = std::find_if(events_.begin(), events_.end(), [&](const ElasticEvent& e) { return e.step == step; });
    if (ev != events_.end() && step > events_done_) {
      events_done_ = step;
      const int64_t from = apply_event(*ev, step, log);
      if (from != step) {  // rolled back: those steps are trained again
        std::erase_if(records, [&](const StepRecord& r) { return r.step >= from; });
        step = from;
      }
    }
  } else if (!o_.switches.empty() && plan_at(step) != plan_index_) {  // (switch_now: no --switch)
    switch_to(plan_at(step), step, log);
  }
  const auto t0 = Clock::now();
  std::vector<ExecGraph::OpTiming> op_timings;  // --op-times: the last step's ops
  const bool time_ops = !o_.op_times_path.empty() && step == o_.steps - 1;
  if (time_ops) rt_->graph->set_op_timing(&op_timings);
  world_.reset_bytes();
  rt_->graph->reset_ledger();
  allocator_for(rt_->graph->device()).reset_peak();
  const int64_t global_batch = pieces_ ? 0 : rt_->strategy.global_batch();
  const int64_t first = state_->samples;
  const bool bucketed = pieces_ && o_.bucket_switching;
  const double dispatch_s = pieces_ && !bucketed ? select_and_dispatch(step, log) : 0.0;
  int64_t counted = 0;
  if (bucketed)
    for (int64_t piece : step_pieces(first)) counted += pieces_->piece_size(piece) - 1;
  else if (pieces_)
    counted = token_step_->counted;
  if (!pieces_) counted = source_->targets(first, global_batch);
  // A step with no target (its documents all one token long) would train
  // on nothing and report loss 0: the same answer on every rank.
  if (counted == 0)
    fail("[data] ", o_.data_path, ": step ", step, " has no target token (every document in it is one token "
         "long: nothing to predict)");
  const float normalizer = static_cast<float>(counted);
  // What the rank holds before its micro-batches: parameters, optimizer
  // states; the schedule's peak above it is activations (and raw grads).
  const size_t held = allocator_for(rt_->graph->device()).current_bytes();
  StepRecord r;
  r.step = step;
  std::map<std::string, NDArray> synced;
  size_t activations = 0;
  double post0 = 0, grad_sync_s = 0;
  int64_t overlap_sent = 0, overlapped = 0;
  if (bucketed) {
    TokenStep whole;
    r.loss = run_buckets(step, normalizer, log, synced, held, activations, whole);
    token_step_ = std::move(whole);
    post0 = clock_ ? clock_->now() : 0;
  } else {
    std::map<std::string, NDArray> raw;
    double loss = 0;
    std::optional<GradOverlap> overlap;
    if (grad_world_) overlap.emplace(*rt_->graph, *grad_world_);
    accumulate_schedule(raw, loss, normalizer, overlap ? &*overlap : nullptr);
    rt_->graph->wait_sends(world_);
    activations = allocator_for(rt_->graph->device()).peak_bytes() - held;
    r.loss = all_reduce_scalar(is_representative(rt_->graph->loss_annotation(), world_.rank()) ? loss : 0.0,
                               world_);
    post0 = clock_ ? clock_->now() : 0;
    // The schedule's compute is done: what follows is the sync alone (what
    // the overlap left of it).
    rt_->graph->stream().synchronize();
    const auto sync0 = Clock::now();
    if (overlap) overlapped = overlap->ready_count();
    synced = overlap ? overlap->finish(raw) : rt_->graph->sync_gradients(raw, world_);
    rt_->graph->stream().synchronize();
    grad_sync_s = std::chrono::duration<double>(Clock::now() - sync0).count();
    if (overlap) {  // the duplicate world's bytes count with the step's
      overlap_sent = grad_world_->bytes().sent;
      rt_->graph->add_to_ledger(overlap_sent, overlap->predicted_bytes());
      grad_world_->reset_bytes();
    }
  }
  ExecGraph& graph = *rt_->graph;
  if (step == 0 && !o_.dump_grads_path.empty())
    gather_and_write(o_.dump_grads_path, "dump.", [&](const std::string& name) {
      auto g = synced.find(name);
      return std::pair{graph.annotation("grad." + name), g == synced.end() ? NDArray() : g->second};
    }, DType::F32);
  r.grad_norm = global_grad_norm(synced);
  r.lr = schedule.at(step);
  if (skip_nonfinite(r, skipped)) state_->step = step + 1;  // weights and moments stay as they were
  else optimizer_step(adam, synced, r.lr);
  state_->samples += pieces_ ? token_step_->pieces : global_batch;
  if (clock_) clock_->record("step " + std::to_string(step) + " post", "post", post0);
  if (pieces_) {
    r.tokens = token_step_->tokens;
    r.pieces = token_step_->pieces;
    r.pipeline_tokens = token_step_->pipeline_tokens;
    r.predicted_step_s = token_step_->predicted_s;
    r.dispatch_s = dispatch_s;
    if (!choices_.empty()) r.strategy = choice_;
  } else {
    r.tokens = source_->tokens(first, global_batch);
  }
  graph.wait_sends(world_);
  const auto ns = [](double s) { return static_cast<int64_t>(s * 1e9); };
  StepMetrics mine;
  mine.bytes_sent = world_.bytes().sent + overlap_sent;
  mine.reshard_sent = graph.ledger().measured;
  mine.reshard_predicted = graph.ledger().predicted;
  mine.op_sent = graph.ledger().op_measured;
  mine.op_predicted = graph.ledger().op_predicted;
  mine.clock_ns = clock_ ? ns(clock_->now()) : 0;
  mine.compute_ns = clock_ ? ns(clock_->compute_s()) : 0;
  mine.peak_bytes = static_cast<int64_t>(allocator_for(rt_->graph->device()).peak_bytes());
  mine.activation_bytes = static_cast<int64_t>(activations);
  mine.grad_sync_ns = ns(grad_sync_s);
  mine.grad_sync_overlapped = overlapped;
  static const int64_t sm_percent = [] {  // set before the process's first CUDA call (--mps-percent)
    const char* p = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    return p ? int64_t{std::atoi(p)} : int64_t{0};
  }();
  mine.sm_percent = sm_percent;
  const kernels::FusedAttentionReport attention = kernels::fused_attention_report();
  mine.attention_fallbacks = attention.fallbacks;
  if (attention.fallbacks > 0 && !warned_attention_fallback_) {  // once per rank: the step is far slower
    warned_attention_fallback_ = true;
    std::fprintf(stderr,
                 "hspmd: warning: rank %d: attention fell back from cuDNN's fused attention to hspmd's own, much "
                 "slower kernels (%lld calls so far): %s (HSPMD_CUDNN_ATTENTION=1 makes it an error)\n",
                 world_.rank(), static_cast<long long>(attention.fallbacks), attention.last_fallback.c_str());
  }
  fill_record(gather_metrics(mine, world_), r);
  r.step_time_s = std::chrono::duration<double>(Clock::now() - t0).count();
  r.tokens_per_s = r.tokens / r.step_time_s;
  if (time_ops) {
    rt_->graph->set_op_timing(nullptr);
    write_op_times(o_.op_times_path, world_.rank(), world_.size(), step, r.step_time_s,
                   rt_->graph->device().str(), op_timings);
  }
  nlohmann::json record = train_common::record_json(r);
  if (precision().mixed()) {
    // bf16 compute: the dtype of attention's output (and its gradients) in
    // the graph this run built (Precision::for_device: bf16 on a GPU whose
    // attention goes to cuDNN, or with HSPMD_ATTENTION_IO=bf16; else f32),
    // and whether attention's backward reads O rounded to bf16 (a bf16 O,
    // or cuDNN's, which rounds it whatever the graph holds), so a test can
    // tell which graph and which numerics a device ran.
    const bool bf16_o = precision().attention_output == DType::BF16;
    record["attention_output"] = dtype_name(precision().attention_output);
    record["attention_rounds_output"] = bf16_o || kernels::fused_attention_rounds_output(rt_->graph->device());
  }
  write_log(log, record);
  if (world_.rank() == 0 && o_.progress)
    train_common::print_progress(r, o_.steps,
                                 std::chrono::duration<double>(Clock::now() - start).count());
  records.push_back(r);
  finish_checkpoint(false);
  // --checkpoint without --save-every: one checkpoint, after the last step.
  if ((o_.save_every > 0 && (step + 1) % o_.save_every == 0) ||
      (o_.save_every == 0 && !o_.checkpoint_dir.empty() && step + 1 == o_.steps))
    save_checkpoint();
  watch_stragglers(step, r, log);
  if (o_.on_step) o_.on_step(step);
  next_step_ = step + 1;
  return r;
}

std::vector<StepRecord> DistTrainer::end() {
  finish_checkpoint(true);
  if (!o_.save_path.empty()) save();
  if (!o_.trace_path.empty()) write_trace();
  return records_;
}

// Each rank writes its spans next to the trace, then rank 0 merges them into
// one Chrome-trace JSON (one process per rank, virtual microseconds).
void DistTrainer::write_trace() const {
  const std::string part = o_.trace_path + ".rank" + std::to_string(world_.rank());
  {
    nlohmann::json events = nlohmann::json::array();
    for (const TraceEvent& e : clock_->events())
      events.push_back({{"name", e.name}, {"cat", e.category}, {"ph", "X"}, {"pid", world_.rank()},
                        {"tid", 0}, {"ts", e.begin * 1e6}, {"dur", (e.end - e.begin) * 1e6}});
    std::ofstream out(part);
    out << events.dump();
    out.close();
    if (!out) fail("[train] --trace ", o_.trace_path, ": cannot write ", part, " (disk full or I/O error)");
  }
  world_.barrier();
  if (world_.rank() != 0) return;
  nlohmann::json all = nlohmann::json::array();
  for (int r = 0; r < world_.size(); ++r) {
    const std::string p = o_.trace_path + ".rank" + std::to_string(r);
    all.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", r},
                   {"args", {{"name", "rank " + std::to_string(r) + " (emulated)"}}}});
    std::ifstream in(p);
    for (auto& e : nlohmann::json::parse(in)) all.push_back(std::move(e));
    std::remove(p.c_str());
  }
  std::ofstream out(o_.trace_path);
  out << nlohmann::json{{"traceEvents", all},
                        {"displayTimeUnit", "ms"},
                        {"otherData", {{"clock", "virtual time of the EMULATED cluster (hspmd --cluster)"}}}}
             .dump();
  out.close();
  if (!out) fail("[train] --trace ", o_.trace_path, ": write failed (disk full or I/O error)");
}

}  // namespace dist

}  // namespace hspmd

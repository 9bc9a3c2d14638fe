// The distributed training loop (the class: train/dist_trainer.h): one
// ExecGraph per rank, pipelines fed with their own samples, the gradient
// sync (hspmd/exec/grad_sync.h), AdamW on local shards and the ZeRO gathers
// through the plan's Reshards.
#include "hspmd/core/options.h"
#include "train/dist_trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"
#include "train/op_times.h"

namespace hspmd {
namespace dist {

// The conceptual micro-batch step stacks every pipeline's micro-batch (part
// k = pipeline k's samples); the rank reads only its own pipeline's samples
// into it and keeps its local box. Rows are as wide as the pipeline's
// widest sample, rounded up to the granularity (packed documents), so
// pipelines see different lengths; they never exchange activations.
ValueMap DistTrainer::feeds(int micro, float normalizer, Bindings& bindings) const {
  const Strategy& strategy = rt_->strategy;
  int64_t rows = 0, row = 0, width = 0;
  std::function<void(int32_t*, int32_t*, int32_t*)> fill;  // this pipeline's rows, from row `row` on
  if (tokens_) {  // token-budget steps: one row per pipeline, its packed pieces
    const PackedDocuments& pieces = tokens_->pieces();
    const std::vector<int64_t>& mine = tokens_->step().micro.at(rt_->pipeline).at(micro);
    int64_t n = 0;
    for (int64_t p : mine) n += pieces.piece_size(p);
    width = (std::max<int64_t>(n, 1) + rt_->granularity - 1) / rt_->granularity * rt_->granularity;
    rows = static_cast<int64_t>(strategy.pipelines.size());
    row = rt_->pipeline;
    fill = [&](int32_t* ids, int32_t* targets, int32_t* positions) {
      pieces.pack(mine, width, ids, targets, positions);
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

std::vector<NDArray> DistTrainer::norm_terms(const std::map<std::string, NDArray>& synced) const {
  // Each gradient once over the ranks: the representative holders'.
  std::vector<NDArray> mine;
  for (const auto& [name, g] : synced)
    if (is_representative(rt_->graph->annotation("grad." + name), world_.rank())) mine.push_back(g);
  return mine;
}

double DistTrainer::global_grad_norm(const std::map<std::string, NDArray>& synced) const {
  const double sumsq = kernels::sum_of_squares(rt_->graph->stream(), norm_terms(synced));
  return std::sqrt(all_reduce_scalar(sumsq, world_));
}

namespace {

// HSPMD_WEIGHT_COPIES: "optimizer" (the default, unset or empty) or "graph"
// (every step casts the weights itself, as before; for comparisons).
bool weight_copies_by_optimizer() {
  const char* v = std::getenv("HSPMD_WEIGHT_COPIES");
  const std::string mode = v == nullptr ? "" : v;
  if (mode.empty() || mode == "optimizer") return true;
  if (mode == "graph") return false;
  fail("[train] HSPMD_WEIGHT_COPIES must be \"optimizer\" or \"graph\", got \"", mode, "\"");
}

}  // namespace

bool DistTrainer::optimizer_writes_copies() const {
  static const bool by_optimizer = weight_copies_by_optimizer();
  return by_optimizer && precision().mixed() && !clock_ && !elastic_ && o_.switches.empty() && !o_.replace_experts;
}

bool DistTrainer::reads_after_update() const {
  return world_.size() == 1 && !clock_ && config_.moe.num_experts == 0 && !(tokens_ && o_.bucket_switching);
}

// AdamW on the rank's optimized shards, with the state's moments (imported
// into the optimizer for the update only); ZeRO then gathers the parameter.
// `grad_scale`: the clip's coefficient, applied as the update reads each
// gradient (no pass of its own over the gradients).
void DistTrainer::optimizer_step(Adam& adam, std::map<std::string, NDArray>& synced, double lr, float grad_scale,
                                 const NDArray* control) {
  adam.set_step_count(state_->step);
  adam.begin_step();
  state_->step = adam.step_count();
  const AnnotationPlan& plan = *rt_->plan;
  // Model clock: the profile's optimizer fit, its fixed part once per step.
  const OptimizerFit* modeled = clock_ && clock_->modeled() ? &profile_->optimizer : nullptr;
  double fixed_s = modeled ? modeled->fixed_s : 0.0;
  // The rank's held shards, in two weight-decay groups, each updated in one
  // kernel call (one launch on a GPU).
  std::vector<Adam::Update> groups[2];
  // The bf16 copies written with the update (optimizer_writes_copies): of
  // the parameters the update writes in place, the array the step's cast
  // read (not a ZeRO shard, whose parameter is gathered after).
  std::map<int, WeightCopy> written;
  for (const std::string& name : rt_->graph->model().names) {  // the same order on every rank
    Shard& target = state_->optimized(name);
    auto g = synced.find(name);
    if (g == synced.end() || !target.held()) continue;
    adam.import_moments(name, state_->slot(name, StateSlot::kExpAvg).data,
                        state_->slot(name, StateSlot::kExpAvgSq).data);
    NDArray* copy = nullptr;
    if (auto c = step_casts_.find(name); c != step_casts_.end() && &target == &state_->slot(name, StateSlot::kParam) &&
                                         c->second.second.numel() == target.data.numel())
      copy = &written.emplace(c->second.first, WeightCopy{name, target.data, c->second.second}).first->second.copy;
    groups[rt_->shapes.at(name).size() >= 2 ? 1 : 0].push_back({name, &target.data, &g->second, copy});
    if (modeled)
      clock_->advance(std::exchange(fixed_s, 0.0) + modeled->per_param_s * static_cast<double>(target.data.numel()));
  }
  if (clock_) clock_->begin_compute();
  for (int decay : {0, 1}) adam.update_group(groups[decay], lr, decay == 1, grad_scale, control);
  if (clock_) clock_->end_compute();
  step_casts_.clear();
  copies_ = {rt_->graph.get(), current_step_ + 1, std::move(written)};
  for (const auto& group : groups)
    for (const Adam::Update& u : group) adam.export_moments(u.name);
  for (const std::string& name : rt_->graph->model().names) {
    Shard& target = state_->optimized(name);
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

bool DistTrainer::skip_nonfinite(StepRecord& r, int64_t& skipped) const {
  if (std::isfinite(r.loss) && std::isfinite(r.grad_norm)) return false;
  const auto num = [](double v) { return std::isnan(v) ? std::string("nan") : detail::concat(v); };  // not "-nan"
  if (skipped >= o_.skip_nonfinite_steps)
    fail("[train] step ", r.step, ": loss ", num(r.loss), ", gradient norm ", num(r.grad_norm),
         ": not finite; stopped before updating the weights",
         " (", option_name("skip_nonfinite_steps"),
         o_.skip_nonfinite_steps > 0 ? " " + std::to_string(o_.skip_nonfinite_steps) + " already skipped)"
                                     : std::string(" N skips such steps)"));
  ++skipped;
  r.skipped = true;
  if (world_.rank() == 0)
    std::fprintf(stderr, "hspmd: warning: step %lld: loss %s, gradient norm %s: not finite; step skipped (%lld of "
                 "%s %lld)\n", static_cast<long long>(r.step), num(r.loss).c_str(), num(r.grad_norm).c_str(),
                 static_cast<long long>(skipped), option_name("skip_nonfinite_steps").c_str(),
                 static_cast<long long>(o_.skip_nonfinite_steps));
  return true;
}

std::vector<StepRecord> DistTrainer::run() {
  begin();
  while (!done()) step();
  return end();
}

void DistTrainer::begin() {
  optimizer_writes_copies();  // HSPMD_WEIGHT_COPIES refused here, before step 0
  checkpoints_.agree_on_run_id();
  adam_.emplace(o_.adam);
  if (!grad_sync_) grad_sync_.emplace(world_, overlapping(), o_.overlap.has_value());  // collective
  schedule_ = o_.schedule;
  schedule_.total_steps = o_.steps;
  log_.open(o_.log_path, world_.rank(), state_->step > 0);
  if (elastic_ && !elastic_->resume_record().is_null()) log_.write(elastic_->resume_record());  // a resume's re-plan
  skipped_ = 0;
  records_.clear();
  next_step_ = state_->step;
  start_ = Clock::now();
  begin_graphs();
}

// One step, as the system runs it: the changes due before it (an elastic
// event or a --switch), the step's data, the micro-batches under the plan's
// schedule and the gradient sync, the update, the record, and what follows
// it (a checkpoint, the straggler watch).
StepRecord DistTrainer::step() {
  HSPMD_CHECK(adam_.has_value() && !done(), "DistTrainer::step before begin() or after the last step");
  int64_t step = next_step_;
  if (elastic()) {
    const int64_t from = elastic_->before_step(step);
    if (from != step) {  // rolled back: those steps are trained again
      std::erase_if(records_, [&](const StepRecord& r) { return r.step >= from; });
      step = from;
    }
  } else if (!o_.switches.empty() && plan_at(step) != plan_index_) {  // (switch_now: no --switch)
    switch_to(plan_at(step), step);
  } else if (o_.replace_experts) {
    maybe_replace_experts(step);
  }
  const auto t0 = Clock::now();
  std::vector<ExecGraph::OpTiming> op_timings;  // --op-times: the last step's ops
  const bool time_ops = !o_.op_times_path.empty() && step == o_.steps - 1;
  if (time_ops) rt_->graph->set_op_timing(&op_timings);
  world_.reset_bytes();
  rt_->graph->reset_ledger();
  allocator_for(rt_->graph->device()).reset_peak();
  StepRecord r;
  r.step = step;
  r.dispatch_s = tokens_ && !o_.bucket_switching ? tokens_->select_and_dispatch(step) : 0.0;
  const float normalizer = static_cast<float>(counted_targets(step));
  StepWork work;
  work.t0 = t0;
  if (!graph_step(step, normalizer, r, work)) {  // --cuda-graphs: captured or replayed
    std::map<std::string, NDArray> synced;
    work = compute_and_sync(step, normalizer, synced, r);
    work.t0 = t0;
    update(step, synced, work, r);
    if (o_.cuda_graphs || capture_audit_) r.cuda_graph = "eager";
  }
  report(step, r, work, time_ops ? &op_timings : nullptr);
  after_step(step, r);
  return r;
}

int64_t DistTrainer::counted_targets(int64_t step) const {
  const int64_t counted = tokens_ ? tokens_->counted(state_->samples)
                                  : source_->targets(state_->samples, rt_->strategy.global_batch());
  // A step with no target (its documents all one token long) would train
  // on nothing and report loss 0: the same answer on every rank.
  if (counted == 0)
    fail("[data] ", o_.data_path, ": step ", step, " has no target token (every document in it is one token "
         "long: nothing to predict)");
  return counted;
}

DistTrainer::StepWork DistTrainer::compute_and_sync(int64_t step, float normalizer,
                                                    std::map<std::string, NDArray>& synced, StepRecord& r) {
  StepWork work;
  current_step_ = step;
  // What the rank holds before its micro-batches: parameters, optimizer
  // states; the schedule's peak above it is activations (and raw grads).
  const size_t held = allocator_for(rt_->graph->device()).current_bytes();
  step_router_.clear();
  if (tokens_ && o_.bucket_switching) {
    r.loss = tokens_->run_buckets(step, normalizer, synced, held, work.activations);
    r.expert_tokens = step_router_.expert_tokens;
    work.post0 = clock_ ? clock_->now() : 0;
    return work;
  }
  std::map<std::string, NDArray> raw;
  double loss = 0;
  GradSync::Step sync = grad_sync_->start(*rt_->graph, rt_->grad_buckets);
  work.loss_deferred = reads_after_update();
  accumulate_schedule(raw, loss, normalizer, sync.overlap(), work.loss_deferred ? &work.loss_terms : nullptr);
  rt_->graph->wait_sends(world_);
  work.activations = allocator_for(rt_->graph->device()).peak_bytes() - held;
  // The mixture of experts' auxiliary loss, the same on every rank (router_stats.h).
  if (!work.loss_deferred)
    r.loss = all_reduce_scalar(is_representative(rt_->graph->loss_annotation(), world_.rank()) ? loss : 0.0, world_) +
             step_router_.aux_loss;
  r.expert_tokens = step_router_.expert_tokens;
  work.post0 = clock_ ? clock_->now() : 0;
  synced = sync.finish(raw);
  work.grad_sync_s = sync.seconds();
  work.overlapped = sync.overlapped();
  work.duplicate_sent = sync.duplicate_bytes_sent();
  return work;
}

void DistTrainer::update(int64_t step, std::map<std::string, NDArray>& synced, const StepWork& work, StepRecord& r) {
  const int64_t first = state_->samples;
  const int64_t global_batch = tokens_ ? 0 : rt_->strategy.global_batch();
  const ExecGraph& graph = *rt_->graph;
  if (step == 0 && !o_.dump_grads_path.empty())
    gather_and_write(o_.dump_grads_path, "dump.", [&](const std::string& name) {
      auto g = synced.find(name);
      return std::pair{graph.annotation("grad." + name), g == synced.end() ? NDArray() : g->second};
    }, DType::F32);
  r.lr = schedule_.at(step);
  if (work.loss_deferred) {
    // The coefficient and the guard on the device, the update queued behind
    // them, and only then the step's one wait: the norm and the loss terms
    // (the same values and bits as the host path below).
    Stream& stream = rt_->graph->stream();
    NDArray control = NDArray::empty({3}, DType::F64, rt_->graph->device());
    kernels::clip_control(stream, norm_terms(synced), work.loss_terms, o_.clip_grad, control);
    optimizer_step(*adam_, synced, r.lr, 1.0f, &control);
    r.queued_s = seconds_since(work.t0);
    r.grad_norm = std::sqrt(kernels::to_host(stream, control).host_data<double>("the gradient norm")[0]);
    double loss = 0;
    for (const NDArray& l : work.loss_terms)  // in micro-batch order, in double
      loss += kernels::to_host(stream, l).host_data<float>("the loss")[0];
    r.loss = loss;
    skip_nonfinite(r, skipped_);  // the update did nothing then (control[2] was 0)
  } else {
    r.grad_norm = global_grad_norm(synced);
    if (skip_nonfinite(r, skipped_)) state_->step = step + 1;  // weights and moments stay as they were
    else optimizer_step(*adam_, synced, r.lr, clip_coefficient(r.grad_norm, o_.clip_grad));
  }
  state_->samples += tokens_ ? tokens_->step().pieces : global_batch;
  if (clock_) clock_->record("step " + std::to_string(step) + " post", "post", work.post0);
  if (tokens_) {
    const TokenSteps::Step& t = tokens_->step();
    r.tokens = t.tokens;
    r.pieces = t.pieces;
    r.pipeline_tokens = t.pipeline_tokens;
    r.predicted_step_s = t.predicted_s;
    if (!tokens_->choices().empty()) r.strategy = tokens_->choice();
  } else {
    r.tokens = source_->tokens(first, global_batch);
  }
}

void DistTrainer::report(int64_t step, StepRecord& r, const StepWork& work,
                         std::vector<ExecGraph::OpTiming>* op_timings) {
  ExecGraph& graph = *rt_->graph;
  graph.wait_sends(world_);
  StepMetrics metrics = meter_.measure(graph, clock_.get(), work.duplicate_sent, work.activations, work.grad_sync_s,
                                       work.overlapped);
  // A replayed CUDA graph's arrays live in its pool, not counted in use
  // between steps: its step's peak is the one measured at the capture.
  metrics.peak_bytes = std::max(metrics.peak_bytes, work.graph_peak_bytes);
  meter_.fill(metrics, clock_.get(), r);
  r.step_time_s = seconds_since(work.t0);
  r.tokens_per_s = r.tokens / r.step_time_s;
  if (op_timings != nullptr) {
    graph.set_op_timing(nullptr);
    write_op_times(o_.op_times_path, world_.rank(), world_.size(), step, r.step_time_s, graph.device().str(),
                   *op_timings);
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
    record["attention_rounds_output"] = bf16_o || kernels::fused_attention_rounds_output(graph.device());
  }
  log_.write(record);
  if (world_.rank() == 0 && o_.progress) train_common::print_progress(r, o_.steps, seconds_since(start_));
}

void DistTrainer::after_step(int64_t step, const StepRecord& r) {
  records_.push_back(r);
  finish_checkpoint(false);
  // --checkpoint without --save-every: one checkpoint, after the last step.
  if ((o_.save_every > 0 && (step + 1) % o_.save_every == 0) ||
      (o_.save_every == 0 && !o_.checkpoint_dir.empty() && step + 1 == o_.steps))
    save_checkpoint_to(o_.checkpoint_dir, ("[checkpoint] " + option_name("checkpoint")));
  if (elastic_) elastic_->after_step(step, r);
  if (o_.on_step) o_.on_step(step);
  next_step_ = step + 1;
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
    if (!out) fail("[train] ", option_name("trace"), " ", o_.trace_path, ": cannot write ", part, " (disk full or I/O error)");
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
                        {"otherData", {{"clock", ("virtual time of the EMULATED cluster (hspmd " + option_name("cluster") + ")")}}}}
             .dump();
  out.close();
  if (!out) fail("[train] ", option_name("trace"), " ", o_.trace_path, ": write failed (disk full or I/O error)");
}

}  // namespace dist

}  // namespace hspmd

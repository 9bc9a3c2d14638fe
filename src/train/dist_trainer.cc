// The distributed training loop: one ExecGraph per rank, pipelines fed with
// their own samples, gradient sync and the ZeRO gathers through the plan's
// Reshards, AdamW on local shards.
#include <algorithm>
#include <chrono>
#include <deque>
#include <cmath>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/core/threads.h"
#include "hspmd/exec/exec_graph.h"
#include "hspmd/exec/virtual_clock.h"
#include "hspmd/io/safetensors.h"
#include "hspmd/optim/adam.h"
#include "hspmd/plan/pipelines.h"
#include "hspmd/plan/plan.h"
#include "kernels/kernels.h"
#include "train/train_common.h"

namespace hspmd {

namespace {

using Clock = std::chrono::steady_clock;

// The pipeline a rank belongs to, or -1 when idle.
int pipeline_of(const Strategy& s, int rank) {
  for (size_t p = 0; p < s.pipelines.size(); ++p)
    for (const Stage& st : s.pipelines[p].stages)
      for (int r : st.ranks)
        if (r == rank) return static_cast<int>(p);
  return -1;
}

// Every rank's values of `mine`, exactly (int64 travel as two f32 halves).
std::vector<std::vector<int64_t>> gather_counts(const std::vector<int64_t>& mine,
                                                Communicator& world) {
  const int k = static_cast<int>(mine.size());
  std::vector<float> send;
  for (int64_t v : mine) {
    send.push_back(static_cast<float>(v >> 24));
    send.push_back(static_cast<float>(v & 0xFFFFFF));
  }
  std::vector<float> all(send.size() * world.size());
  world.all_gather(send.data(), all.data(), std::vector<int64_t>(world.size(), 2 * k));
  std::vector<std::vector<int64_t>> out(k, std::vector<int64_t>(world.size()));
  for (int r = 0; r < world.size(); ++r)
    for (int i = 0; i < k; ++i)
      out[i][r] = (static_cast<int64_t>(all[r * 2 * k + 2 * i]) << 24) +
                  static_cast<int64_t>(all[r * 2 * k + 2 * i + 1]);
  return out;
}

// The tensors with one row per vocabulary entry (padded by the plan when tp
// does not divide the vocabulary).
bool is_vocab_table(const std::string& name) {
  return name == "model.embed_tokens.weight" || name == "lm_head.weight";
}

double all_reduce_scalar(double v, Communicator& world) {
  float x = static_cast<float>(v);
  std::vector<Request> req;
  req.push_back(world.start_all_reduce(&x, 1));
  world.wait_all(req);
  return x;
}

class DistTrainer {
 public:
  DistTrainer(const TrainOptions& o, Communicator& world)
      : o_(o), world_(world), config_(LlamaConfig::load(o.model_path)),
        strategy_(load_strategy(o.strategy_path)) {
    if (o.seq_len <= 0 || o.seq_len > config_.max_position_embeddings)
      fail("[flags] --seq-len ", o.seq_len, " must be in [1, max_position_embeddings ",
           config_.max_position_embeddings, "] of ", o.model_path);
    if (o.steps <= 0) fail("[flags] --steps must be positive, got ", o.steps);
    if (o.clip_grad < 0) fail("[flags] --clip-grad must be >= 0, got ", o.clip_grad);
    if (!(o.schedule.lr > 0)) fail("[flags] --lr must be positive, got ", o.schedule.lr);
    train_common::check_output_path("--save", o.save_path);
    train_common::check_output_path("--log", o.log_path);
    if (o.global_batch != 0 && o.global_batch != strategy_.global_batch())
      fail("[flags] --global-batch ", o.global_batch, " differs from the strategy's global batch ",
           strategy_.global_batch());
    CompileOptions co;
    co.seq_len = o.seq_len;
    // Every rank's view of the stacked micro-batch must divide along every
    // pipeline's splits, so the granularity is common to all pipelines.
    granularity_ = sequence_granularity(strategy_);
    if (o.pack_documents)  // lengths vary per micro-batch: compile for the longest, rounded up
      co.seq_len = (o.seq_len + granularity_ - 1) / granularity_ * granularity_;
    else if (o.seq_len % granularity_ != 0)
      fail("[strategy] --seq-len ", o.seq_len, " must be a multiple of ", granularity_,
           " (stages split the sequence over their cp x tp ranks, and cp > 1 into 2 x cp chunks)");
    plan_ = compile_plan(config_, strategy_, world.size(), co);
    topology_ = o.cluster_path.empty() ? Topology::uniform(world.size()) : Topology::load(o.cluster_path);
    if (topology_.world_size() != world.size())
      fail("[cluster] ", o.cluster_path, " has ", topology_.world_size(), " ranks but the job has ",
           world.size());
    int64_t batch = 0;
    for (const Pipeline& p : strategy_.pipelines) batch += p.micro_batch_size;
    graph_ = std::make_unique<ExecGraph>(plan_, topology_, world.rank(),
                                         Bindings{{"B", batch}, {"S", co.seq_len}});
    // Pipelines are discovered from the resolved plan (appendix A.2), not
    // read from the strategy; the strategy only gives micro-batch counts.
    const auto pipelines = discover_pipelines(plan_, dry_run(plan_, topology_));
    const PipelinePosition at = pipeline_positions(pipelines, world.size()).at(world.rank());
    HSPMD_CHECK(at.pipeline == pipeline_of(strategy_, world.rank()),
                "discovered pipeline ", at.pipeline, " of rank ", world.rank(), " differs from the strategy's");
    pipeline_ = at.pipeline;
    if (!at.idle()) {
      stage_ = at.stage;
      stages_ = static_cast<int>(pipelines[at.pipeline].stages.size());
      for (const Stage& st : strategy_.pipelines[pipeline_].stages)
        if (std::count(st.ranks.begin(), st.ranks.end(), world.rank()))
          graph_->set_recompute(st.recompute);
    }
    graph_->set_deferred_sends(true);
    if (!o.cluster_path.empty() || !o.trace_path.empty()) {  // emulate: a virtual clock per rank
      clock_ = std::make_unique<VirtualClock>(topology_.rank(world.rank()).slowdown);
      clock_->set_tracing(!o.trace_path.empty());
      graph_->set_clock(clock_.get());
      graph_->set_memory_cap(static_cast<size_t>(topology_.rank(world.rank()).memory_cap_gib *
                                                 1024.0 * 1024.0 * 1024.0));
    }
    train_common::check_output_path("--trace", o.trace_path);
  }

  // Reads the data and the initial weights (errors before any step).
  void prepare();
  std::vector<StepRecord> run();

 private:
  void init_parameters();
  // This rank's placeholders for micro-batch `micro` of `step` (the loss
  // divided by `normalizer`), and the bindings of their symbolic dims (S
  // varies with packed documents).
  ValueMap feeds(int64_t step, int micro, float normalizer, Bindings& bindings) const;
  double global_grad_norm(std::map<std::string, NDArray>& synced) const;
  void optimizer_step(Adam& adam, std::map<std::string, NDArray>& synced, double lr);
  void save() const;
  void write_trace() const;

  const TrainOptions& o_;
  Communicator& world_;
  LlamaConfig config_;
  Strategy strategy_;
  AnnotationPlan plan_;
  Topology topology_ = Topology::uniform(1);
  std::unique_ptr<ExecGraph> graph_;
  int pipeline_ = -1;
  int stage_ = 0, stages_ = 1;         // this rank's stage and its pipeline's stage count
  int64_t granularity_ = 1;            // every micro-batch's sequence length is a multiple of it
  std::unique_ptr<VirtualClock> clock_;
  int64_t emulated_end_ = 0;                 // ns, the previous step's end
  std::vector<int64_t> emulated_compute_;    // ns, per rank, up to the previous step
  std::unique_ptr<TokenData> data_;
  std::unique_ptr<train_common::SampleSource> source_;
  std::map<std::string, Shape> shapes_;
  std::map<std::string, NDArray> params_;  // local shards, parameter layout
  std::map<std::string, NDArray> master_;  // ZeRO: local shards, optimizer-state layout
};

void DistTrainer::init_parameters() {
  std::map<std::string, NDArray> full =
      o_.init_path.empty()
          ? init_llama_parameters(config_, o_.seed)
          : validate_llama_weights(config_, load_safetensors(o_.init_path), o_.init_path);
  const int64_t rows = plan_.model.table_rows();
  for (auto& [name, array] : full) {
    if (is_vocab_table(name) && rows != array.dim(0)) {
      // The plan pads the vocabulary (docs/vocab_parallel.md): zero rows.
      NDArray padded = NDArray::zeros({rows, array.dim(1)}, DType::F32);
      std::copy(array.data<float>(), array.data<float>() + array.numel(), padded.data<float>());
      array = padded;
    }
    shapes_[name] = array.shape();
    if (auto box = graph_->local_box(name, array.shape())) params_[name] = box_slice(array, *box);
    auto st = plan_.optimizer_states.find(name);
    if (st == plan_.optimizer_states.end()) continue;
    if (auto box = hspmd::local_box(st->second, array.shape(), world_.rank()))
      master_[name] = box_slice(array, *box);
  }
}

// The conceptual micro-batch step stacks every pipeline's micro-batch (part
// k = pipeline k's samples); the rank reads only its own pipeline's samples
// into it and keeps its local box. Rows are as wide as the pipeline's
// widest sample, rounded up to the granularity (packed documents), so
// pipelines see different lengths; they never exchange activations.
ValueMap DistTrainer::feeds(int64_t step, int micro, float normalizer, Bindings& bindings) const {
  int64_t rows = 0, row = 0, mine = 0;
  int64_t first = step * strategy_.global_batch();
  for (int k = 0; k < static_cast<int>(strategy_.pipelines.size()); ++k) {
    const Pipeline& p = strategy_.pipelines[k];
    if (k == pipeline_) row = rows, mine = first + micro * p.micro_batch_size;
    rows += p.micro_batch_size;
    first += p.batch();
  }
  const Pipeline& p = strategy_.pipelines.at(pipeline_);
  const int64_t width = source_->width(mine, p.micro_batch_size, granularity_);
  NDArray ids = NDArray::zeros({rows, width}, DType::I32);
  NDArray targets = NDArray::zeros({rows, width}, DType::I32);
  NDArray positions = NDArray::zeros({rows, width}, DType::I32);
  for (int b = 0; b < p.micro_batch_size; ++b) {
    const int64_t at = (row + b) * width;
    source_->fill(mine + b, width, ids.data<int32_t>() + at, targets.data<int32_t>() + at,
                  positions.data<int32_t>() + at);
  }
  NDArray norm = NDArray::empty({}, DType::F32);
  norm.fill(normalizer);
  bindings = Bindings{{"B", rows}, {"S", width}};
  ValueMap v(params_.begin(), params_.end());
  for (auto& [name, full] : ValueMap{{"input_ids", ids}, {"targets", targets},
                                     {"positions", positions}, {"normalizer", norm}})
    if (auto box = graph_->local_box(name, full.shape())) v[name] = box_slice(full, *box);
  return v;
}

double DistTrainer::global_grad_norm(std::map<std::string, NDArray>& synced) const {
  double sumsq = 0;
  for (const auto& [name, g] : synced) {
    if (!is_representative(graph_->annotation("grad." + name), world_.rank())) continue;
    const float* x = g.data<float>();
    for (int64_t i = 0; i < g.numel(); ++i) sumsq += static_cast<double>(x[i]) * x[i];
  }
  const double norm = std::sqrt(all_reduce_scalar(sumsq, world_));
  if (o_.clip_grad > 0 && norm > o_.clip_grad) {
    const float scale = static_cast<float>(o_.clip_grad / (norm + 1e-6));
    for (auto& [name, g] : synced)
      for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] *= scale;
  }
  return norm;
}

void DistTrainer::optimizer_step(Adam& adam, std::map<std::string, NDArray>& synced, double lr) {
  adam.begin_step();
  for (const std::string& name : graph_->model().names) {  // the same order on every rank
    const bool decay = shapes_.at(name).size() >= 2;
    auto st = plan_.optimizer_states.find(name);
    auto g = synced.find(name);
    if (st == plan_.optimizer_states.end()) {
      if (clock_) clock_->begin_compute();
      if (g != synced.end()) adam.update(name, params_.at(name), g->second, lr, decay);
      if (clock_) clock_->end_compute();
      continue;
    }
    if (clock_) clock_->begin_compute();
    if (g != synced.end()) adam.update(name, master_.at(name), g->second, lr, decay);
    if (clock_) clock_->end_compute();
    auto m = master_.find(name);
    NDArray gathered = graph_->reshard("zero_gather." + name, shapes_.at(name), st->second,
                                       graph_->annotation(name),
                                       m == master_.end() ? NDArray() : m->second, world_);
    if (gathered.valid()) params_[name] = gathered;
  }
}

void DistTrainer::save() const {
  Annotation rank0;
  rank0.subgroups = {Subgroup{DeviceGroup{{0}}, DistStates{}}};
  std::map<std::string, NDArray> out;
  for (const std::string& name : graph_->model().names) {
    auto p = params_.find(name);
    NDArray full = graph_->reshard("save." + name, shapes_.at(name), graph_->annotation(name), rank0,
                                   p == params_.end() ? NDArray() : p->second, world_);
    if (world_.rank() == 0 && is_vocab_table(name) && full.dim(0) != config_.vocab_size)
      full = full.slice(0, 0, config_.vocab_size).contiguous();  // drop the padding rows
    if (world_.rank() == 0) out.emplace(name, full.to(o_.save_dtype));
  }
  if (world_.rank() == 0) save_safetensors(o_.save_path, out);
}

void DistTrainer::prepare() {
  data_ = std::make_unique<TokenData>(TokenData::load(o_.data_path, config_.vocab_size));
  source_ = std::make_unique<train_common::SampleSource>(*data_, o_.seq_len, o_.pack_documents,
                                                         config_.eos_token_id);
  init_parameters();
}

std::vector<StepRecord> DistTrainer::run() {
  Adam adam(o_.adam);
  LrSchedule schedule = o_.schedule;
  schedule.total_steps = o_.steps;
  std::ofstream log;
  if (world_.rank() == 0 && !o_.log_path.empty()) log.open(o_.log_path);
  const int micro_batches = pipeline_ < 0 ? 0 : strategy_.pipelines[pipeline_].micro_batches;
  const Annotation& loss_annotation = graph_->loss_annotation();
  std::vector<StepRecord> records;
  const auto start = Clock::now();
  for (int64_t step = 0; step < o_.steps; ++step) {
    const auto t0 = Clock::now();
    world_.reset_bytes();
    graph_->reset_ledger();
    allocator_for(Device::cpu()).reset_peak();
    const int64_t first = step * strategy_.global_batch();
    const float normalizer = source_->normalizer(first, strategy_.global_batch());
    // What the rank holds before its micro-batches: parameters, optimizer
    // states; the schedule's peak above it is activations (and raw grads).
    const size_t held = allocator_for(Device::cpu()).current_bytes();
    std::map<std::string, NDArray> raw;
    double loss = 0;
    auto accumulate = [&](const ExecGraph::MicroBatch& mb) {
      if (mb.loss) loss += *mb.loss;
      for (auto& [name, g] : mb.raw_grads) {
        auto it = raw.find(name);
        if (it == raw.end()) raw.emplace(name, g.clone());
        else kernels::accumulate(g, it->second);
      }
    };
    auto forward = [&](int micro) {
      const double t0 = clock_ ? clock_->now() : 0;
      Bindings bindings;
      const ValueMap values = feeds(step, micro, normalizer, bindings);
      ExecGraph::Activations a = graph_->forward(values, world_, bindings);
      if (clock_) clock_->record("F" + std::to_string(micro), "forward", t0);
      return a;
    };
    auto backward = [&](ExecGraph::Activations a, int micro) {
      const double t0 = clock_ ? clock_->now() : 0;
      accumulate(graph_->backward(std::move(a), world_));
      if (clock_) clock_->record("B" + std::to_string(micro), "backward", t0);
    };
    if (strategy_.schedule == "gpipe") {
      // Every forward, then every backward: stages overlap on different
      // micro-batches; activations of all micro-batches are kept.
      std::vector<ExecGraph::Activations> kept;
      for (int micro = 0; micro < micro_batches; ++micro) kept.push_back(forward(micro));
      for (int micro = 0; micro < micro_batches; ++micro) backward(std::move(kept[micro]), micro);
    } else {
      // 1F1B: stage s of S runs S-s-1 warm-up forwards, then alternates one
      // forward and one backward, then drains the backwards; at most S-s
      // micro-batches of activations live at once. Sends are deferred so a
      // stage sending activations never waits on a neighbour sending
      // gradients.
      const int warmup = std::min(stages_ - stage_ - 1, micro_batches);
      std::deque<ExecGraph::Activations> live;
      int next = 0, done = 0;
      for (; next < warmup; ++next) live.push_back(forward(next));
      for (; next < micro_batches; ++next) {
        live.push_back(forward(next));
        backward(std::move(live.front()), done++);
        live.pop_front();
      }
      for (; !live.empty(); live.pop_front()) backward(std::move(live.front()), done++);
    }
    graph_->wait_sends(world_);
    const size_t activations = allocator_for(Device::cpu()).peak_bytes() - held;
    StepRecord r;
    r.step = step;
    r.loss = all_reduce_scalar(is_representative(loss_annotation, world_.rank()) ? loss : 0.0, world_);
    const double post0 = clock_ ? clock_->now() : 0;
    std::map<std::string, NDArray> synced = graph_->sync_gradients(raw, world_);
    r.grad_norm = global_grad_norm(synced);
    r.lr = schedule.at(step);
    optimizer_step(adam, synced, r.lr);
    if (clock_) clock_->record("step " + std::to_string(step) + " post", "post", post0);
    r.tokens = source_->tokens(first, strategy_.global_batch());
    graph_->wait_sends(world_);
    const auto ns = [](double s) { return static_cast<int64_t>(s * 1e9); };
    const auto counts = gather_counts(
        {world_.bytes().sent, graph_->ledger().measured, graph_->ledger().predicted,
         clock_ ? ns(clock_->now()) : 0, clock_ ? ns(clock_->compute_s()) : 0,
         static_cast<int64_t>(allocator_for(Device::cpu()).peak_bytes()),
         static_cast<int64_t>(activations), graph_->ledger().op_measured,
         graph_->ledger().op_predicted}, world_);
    r.peak_memory_bytes = counts[5];
    r.peak_activation_bytes = counts[6];
    r.op_bytes_sent = counts[7];
    r.predicted_op_bytes = counts[8];
    r.bytes_sent = counts[0];
    r.reshard_bytes_sent = counts[1];
    r.predicted_reshard_bytes = counts[2];
    if (clock_) {  // the emulated cluster's step: from the last rank's end to the last rank's end
      const int64_t end = *std::max_element(counts[3].begin(), counts[3].end());
      r.emulated_step_time_s = (end - emulated_end_) * 1e-9;
      emulated_end_ = end;
      for (size_t k = 0; k < counts[4].size(); ++k) {
        if (emulated_compute_.size() < counts[4].size()) emulated_compute_.resize(counts[4].size(), 0);
        r.emulated_compute_s.push_back((counts[4][k] - emulated_compute_[k]) * 1e-9);
        emulated_compute_[k] = counts[4][k];
      }
    }
    r.step_time_s = std::chrono::duration<double>(Clock::now() - t0).count();
    r.tokens_per_s = r.tokens / r.step_time_s;
    if (log.is_open()) log << train_common::record_json(r).dump() << "\n" << std::flush;
    if (world_.rank() == 0 && o_.progress)
      train_common::print_progress(r, o_.steps,
                                   std::chrono::duration<double>(Clock::now() - start).count());
    records.push_back(r);
  }
  if (!o_.save_path.empty()) save();
  if (!o_.trace_path.empty()) write_trace();
  return records;
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
    std::ofstream(part) << events.dump();
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
  std::ofstream(o_.trace_path) << nlohmann::json{
      {"traceEvents", all},
      {"displayTimeUnit", "ms"},
      {"otherData", {{"clock", "virtual time of the EMULATED cluster (hspmd --cluster)"}}}}
                                      .dump();
}

}  // namespace

std::vector<StepRecord> train_distributed(const TrainOptions& options, Communicator& world) {
  set_num_threads(options.threads);
  // Setup errors (strategy, world size, data, weights) are agreed on by all
  // ranks before any step: the lowest failing rank reports, every rank exits.
  std::unique_ptr<DistTrainer> trainer;
  std::string error;
  try {
    trainer = std::make_unique<DistTrainer>(options, world);
    trainer->prepare();
  } catch (const Error& e) {
    error = e.what();
  }
  std::vector<float> failed(world.size(), 0.0f);
  const float mine = error.empty() ? 0.0f : 1.0f;
  world.all_gather(&mine, failed.data(), std::vector<int64_t>(world.size(), 1));
  const auto first = std::find(failed.begin(), failed.end(), 1.0f);
  if (first != failed.end())
    throw SetupFailure(error.empty() ? "[train] setup failed on another rank" : error,
                       first - failed.begin() == world.rank());
  return trainer->run();
}

}  // namespace hspmd

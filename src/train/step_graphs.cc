// The training step as a CUDA graph (--cuda-graphs; docs/cuda.md, "CUDA
// graphs"): after two warm-up steps, one step's device work (forwards,
// backwards, the clip's control and AdamW) is recorded on the compute stream
// instead of run, and every later step copies its batch into the recorded
// feeds, refreshes AdamW's step factors and launches the graph: one launch
// instead of a step's thousands, and no host work between the device's
// kernels. What a replay would get wrong is checked before each launch (the
// graph, the state's arrays, the batch's shapes); a capture that fails
// leaves the host as it was and the run continues uncaptured, with a note.
//
// HSPMD_CAPTURE_AUDIT=1 runs the same recording on a CPU device, where
// nothing is recorded (its kernels run as they are called): step 2 goes
// through this file's capture path (the feeds made first, the allocator's
// pool, the host waits refused by RecordingScope) and then the run goes on
// op by op. So the CPU's tests check that a step has no host wait before
// its update and that the capture path trains the same step.
#include "train/dist_trainer.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "hspmd/core/device_runtime.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd {
namespace dist {

namespace {

// The leaves a step's batch feeds (DistTrainer::feeds); the parameters are
// the state's own arrays.
constexpr const char* kBatchLeaves[] = {"input_ids", "targets", "positions", "normalizer"};

// Steps run uncaptured at the start of a run: the first one chooses GEMM
// algorithms, builds attention plans and fills the allocator's cache; the
// second takes the weights' bf16 copies from the first update, as every
// later step does.
constexpr int64_t kWarmupSteps = 2;

// New captures after the first before the run stops capturing: a batch
// whose shape changes every step (packed documents of varying width) would
// otherwise capture every step.
constexpr int kMaxRecaptures = 3;

// HSPMD_CAPTURE_AUDIT: "1" audits the capture path on a CPU device (above);
// unset, empty or "0": off; anything else is refused before step 0.
bool capture_audit_asked() {
  const char* v = std::getenv("HSPMD_CAPTURE_AUDIT");
  const std::string mode = v == nullptr ? "" : v;
  if (mode.empty() || mode == "0") return false;
  if (mode == "1") return true;
  fail("[train] HSPMD_CAPTURE_AUDIT must be 1 or 0, got \"", mode, "\"");
}

}  // namespace

void DistTrainer::begin_graphs() {
  captured_.reset();
  graphs_off_.clear();
  recaptures_ = 0;
  graph_warmup_end_ = next_step_ + kWarmupSteps;
  // The audit where no real capture runs: a CPU device (on CUDA,
  // --cuda-graphs records under the same RecordingScope).
  capture_audit_ = capture_audit_asked() && rt_->graph->device().type != DeviceType::CUDA;
  if (!o_.cuda_graphs && !capture_audit_) return;
  if (const std::string why = graphs_unavailable(); !why.empty()) return graphs_off(why);
  adam_->set_factors_on_device(true);  // the same bits; what a replay refreshes
}

std::string DistTrainer::graphs_unavailable() const {
  const Device device = rt_->graph->device();
  if (!capture_audit_) {
    if (device.type != DeviceType::CUDA) return "the run is on " + device.str() + ", not a CUDA device";
    DeviceRuntime* runtime = device_runtime(device.type);
    if (runtime == nullptr || !runtime->can_capture()) return "this build's CUDA runtime cannot capture";
  }
  if (world_.size() > 1) return "the job has several ranks (their steps wait for each other on the host)";
  if (clock_) return "the cluster is emulated";
  if (tokens_) return "token-budget steps change their shapes from step to step";
  if (config_.moe.num_experts > 0) return "a mixture of experts reads its router statistics on the host";
  if (elastic_) return "an elastic run changes its plan between steps";
  if (!o_.switches.empty()) return option_name("switch") + " changes the plan between steps";
  if (o_.replace_experts) return "expert replacement moves weights between steps";
  if (!rt_->plan->optimizer_states.empty()) return "ZeRO gathers the parameters after the update";
  if (!reads_after_update()) return "this step reads its loss before the update";
  return "";
}

void DistTrainer::graphs_off(const std::string& why) {
  captured_.reset();
  graphs_off_ = why;
  if (world_.rank() == 0)
    std::fprintf(stderr, "hspmd: note: %s: the steps run uncaptured: %s\n",
                 capture_audit_ ? "HSPMD_CAPTURE_AUDIT" : option_name("cuda_graphs").c_str(), why.c_str());
}

bool DistTrainer::captured_fits(const std::vector<ValueMap>& host, const std::vector<Bindings>& bindings) const {
  const CapturedStep& c = *captured_;
  if (c.exec != rt_->graph.get() || c.feeds.size() != host.size() || c.bindings != bindings) return false;
  for (size_t m = 0; m < host.size(); ++m)
    for (const char* leaf : kBatchLeaves) {
      auto h = host[m].find(leaf);
      auto d = c.feeds[m].find(leaf);
      if ((h == host[m].end()) != (d == c.feeds[m].end())) return false;
      if (h != host[m].end() && (h->second.shape() != d->second.shape() || h->second.dtype() != d->second.dtype()))
        return false;
    }
  // The arrays the graph updates in place are still the state's.
  for (const CapturedStep::Held& h : c.held)
    if (const Shard& sh = state_->slot(h.name, h.slot); !sh.held() || !sh.data.same_view(h.array)) return false;
  return true;
}

bool DistTrainer::graph_step(int64_t step, float normalizer, StepRecord& r, StepWork& work) {
  if ((!o_.cuda_graphs && !capture_audit_) || !graphs_off_.empty()) return false;
  if (step < graph_warmup_end_ || (!o_.op_times_path.empty() && step == o_.steps - 1)) {
    // Warm-up, or the (last) step whose ops are timed one by one: its arrays
    // come from the shared cache, so the graph's pool goes first (else the
    // step would hold two steps' activations).
    if (step >= graph_warmup_end_) captured_.reset();
    r.cuda_graph = "eager";
    return false;
  }
  ExecGraph& graph = *rt_->graph;
  Stream& stream = graph.stream();
  // This step's batch on the host, one map per micro-batch.
  std::vector<ValueMap> host;
  std::vector<Bindings> bindings;
  for (int micro = 0; micro < rt_->micro_batches(); ++micro) {
    Bindings b;
    host.push_back(feeds(micro, normalizer, b));
    bindings.push_back(std::move(b));
  }
  if (captured_ && !captured_fits(host, bindings)) {
    captured_.reset();
    if (++recaptures_ > kMaxRecaptures) {
      graphs_off("the batch's shapes or the state's arrays changed " + std::to_string(recaptures_) +
                 " times since the first capture (each change needs a new graph)");
      r.cuda_graph = "eager";
      return false;
    }
  }
  const int64_t first = state_->samples;
  const int64_t global_batch = rt_->strategy.global_batch();
  current_step_ = step;
  r.lr = schedule_.at(step);
  if (!captured_) {
    if (!capture_step(step, normalizer, host, bindings, r)) {
      r.cuda_graph = "eager";
      return false;
    }
    r.cuda_graph = capture_audit_ ? "audited" : "captured";
  } else {
    // The batch into the recorded feeds, the step's factors where the
    // recorded copy reads them, and the host's side of the update.
    for (size_t m = 0; m < host.size(); ++m)
      for (const char* leaf : kBatchLeaves)
        if (auto h = host[m].find(leaf); h != host[m].end())
          kernels::copy_from_host(stream, h->second, captured_->feeds[m].at(leaf));
    adam_->set_step_count(state_->step);
    adam_->begin_step();
    state_->step = adam_->step_count();
    adam_->refresh_factors(r.lr);
    r.cuda_graph = "replayed";
  }
  CapturedStep& c = *captured_;
  if (c.graph != nullptr) device_runtime(DeviceType::CUDA)->launch_graph(c.graph, stream);  // else audited: it ran
  r.queued_s = seconds_since(work.t0);
  // The step's one wait: the norm and the loss terms, as update() reads them.
  r.grad_norm = std::sqrt(kernels::to_host(stream, c.control).host_data<double>("the gradient norm")[0]);
  double loss = 0;
  for (const NDArray& l : c.loss_terms) loss += kernels::to_host(stream, l).host_data<float>("the loss")[0];
  r.loss = loss;
  skip_nonfinite(r, skipped_);  // the update did nothing then (control[2] was 0)
  // The copies the update wrote are the next step's, as after an uncaptured
  // update (the same arrays every replay).
  copies_.step = step + 1;
  work.activations = c.activations;
  work.graph_peak_bytes = c.peak_bytes;
  work.loss_deferred = true;
  state_->samples += global_batch;
  r.tokens = source_->tokens(first, global_batch);
  if (capture_audit_)  // a CPU device cannot replay: the audit is done
    graphs_off("step " + std::to_string(step) + " went through the capture path with no host wait before its "
               "update (a CUDA graph can record it); the CPU cannot replay it");
  return true;
}

bool DistTrainer::capture_step(int64_t step, float normalizer, const std::vector<ValueMap>& host,
                               const std::vector<Bindings>& bindings, StepRecord& r) {
  ExecGraph& graph = *rt_->graph;
  Stream& stream = graph.stream();
  DeviceRuntime& runtime = *device_runtime(graph.device().type);
  Allocator& allocator = allocator_for(graph.device());
  CapturedStep c;
  c.exec = &graph;
  c.bindings = bindings;
  c.captured_at = step;
  // The batch on the device before the capture: the graph reads these
  // arrays, which each replay refills.
  for (const ValueMap& h : host) {
    ValueMap v = h;
    for (const char* leaf : kBatchLeaves)
      if (auto it = v.find(leaf); it != v.end()) it->second = kernels::to_device(stream, it->second);
    c.feeds.push_back(std::move(v));
  }
  // What the capture changes on the host, restored if it fails.
  const int64_t state_step = state_->step;
  const WeightCopies copies = copies_;
  const size_t held = allocator.current_bytes();
  c.pool = allocator.new_pool();
  allocator.use_pool(c.pool);
  capturing_ = &c;
  std::string failure;
  try {
    if (!capture_audit_) runtime.begin_capture(stream);
    try {
      // Our own host waits fail here with their name (RecordingScope),
      // before the runtime would fail the capture with its own reason.
      const RecordingScope recording("step " + std::to_string(step) +
                                     " (" + (capture_audit_ ? std::string("HSPMD_CAPTURE_AUDIT") : option_name("cuda_graphs")) + ")");
      std::map<std::string, NDArray> synced;
      StepRecord scratch;
      StepWork work = compute_and_sync(step, normalizer, synced, scratch);
      c.control = NDArray::empty({3}, DType::F64, graph.device());
      kernels::clip_control(stream, norm_terms(synced), work.loss_terms, o_.clip_grad, c.control);
      optimizer_step(*adam_, synced, r.lr, 1.0f, &c.control);
      c.loss_terms = std::move(work.loss_terms);
      c.activations = allocator.peak_bytes() > held ? allocator.peak_bytes() - held : 0;
      c.peak_bytes = static_cast<int64_t>(allocator.peak_bytes());
    } catch (const std::exception& e) {
      failure = e.what();
    }
    try {
      if (!capture_audit_) c.graph = runtime.end_capture(stream);
    } catch (const std::exception& e) {
      if (failure.empty()) failure = e.what();
    }
  } catch (const std::exception& e) {  // begin_capture
    failure = e.what();
  }
  capturing_ = nullptr;
  allocator.use_pool(nullptr);
  if (!failure.empty() && capture_audit_)  // the CPU ran the step's work as it went: no way back
    fail("[train] HSPMD_CAPTURE_AUDIT: step ", step, " could not be recorded as a CUDA graph: ", failure);
  if (!failure.empty()) {
    // Nothing recorded ran: the host goes back to where the step began.
    state_->step = state_step;
    adam_->set_step_count(state_step);
    copies_ = copies;
    step_casts_.clear();
    graphs_off("capturing step " + std::to_string(step) + " failed: " + failure);
    return false;
  }
  for (const std::string& name : graph.model().names)
    for (StateSlot slot : {StateSlot::kParam, StateSlot::kExpAvg, StateSlot::kExpAvgSq}) {
      const Shard& sh = state_->slot(name, slot);
      if (sh.held()) c.held.push_back({name, slot, sh.data});
    }
  captured_ = std::move(c);
  return true;
}

}  // namespace dist
}  // namespace hspmd

// The distributed trainer's checkpoints and saved weights: every rank's
// shards gathered to rank 0 and written (safetensors), the full parameters
// on every rank, and the step checkpoints written in the background (the
// class: train/dist_trainer.h; the loop: dist_trainer.cc).
#include "train/dist_trainer.h"
#include "train/resume_checks.h"

#include <cstdlib>

#include "kernels/basic.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd {
namespace dist {

void DistTrainer::gather_and_write(const std::string& path, const std::string& prefix,
                                   const std::function<std::pair<Annotation, NDArray>(const std::string&)>& local,
                                   DType dtype) const {
  Annotation rank0;
  rank0.subgroups = {Subgroup{DeviceGroup{{0}}, DistStates{}}};
  std::unique_ptr<SafetensorsWriter> writer;
  if (world_.rank() == 0) {
    std::map<std::string, SafetensorsWriter::Declared> declared;
    for (const auto& [name, shape] : model_parameter_shapes(config_)) declared[name] = {dtype, shape};
    writer = std::make_unique<SafetensorsWriter>(path, declared);
  }
  for (const ModelParameter& p : model_parameters(rt_->plan->model)) {
    const std::string& name = p.name;
    auto [layout, array] = local(name);
    NDArray full = rt_->graph->reshard(prefix + name, p.shape, layout, rank0, array, world_);
    if (!writer) continue;
    if (p.role == ParamRole::kVocabulary && full.dim(0) != config_.vocab_size)
      full = full.slice(0, 0, config_.vocab_size).contiguous();  // drop the padding rows
    Stream& stream = rt_->graph->stream();
    writer->write(name, kernels::to_host(stream, kernels::cast(stream, full, dtype)));
  }
  if (writer) writer->finish();
}

std::map<std::string, NDArray> DistTrainer::full_parameters() {
  Annotation rank0;
  rank0.subgroups = {Subgroup{DeviceGroup{{0}}, DistStates{}}};
  std::map<std::string, NDArray> out;
  for (const ModelParameter& p : model_parameters(rt_->plan->model)) {
    // As save() writes them: with ZeRO the f32 master shards.
    const auto zero = rt_->plan->optimizer_states.find(p.name);
    const Annotation& layout = zero != rt_->plan->optimizer_states.end() ? zero->second
                                                                         : rt_->graph->annotation(p.name);
    NDArray full = rt_->graph->reshard("state." + p.name, p.shape, layout, rank0, state_->optimized(p.name).data,
                                       world_);
    Stream& stream = rt_->graph->stream();
    full = world_.rank() == 0 ? kernels::to_host(stream, kernels::cast(stream, full, DType::F32))
                              : NDArray::empty(p.shape, DType::F32);
    world_.broadcast(full.host_data<float>(), full.numel(), 0);  // every rank returns the same tensors
    if (p.role == ParamRole::kVocabulary && full.dim(0) != config_.vocab_size)
      full = full.slice(0, 0, config_.vocab_size).contiguous();
    out[p.name] = full;
  }
  return out;
}

void DistTrainer::checkpoint_now(const std::string& dir) {
  save_checkpoint_to(dir, "[checkpoint] save_checkpoint");
  finish_checkpoint(true);
}

void DistTrainer::check_checkpoint_owner_agreed(const std::string& dir, const std::string& what) {
  std::string error;
  if (world_.rank() == 0) {
    CheckpointWriter w;
    w.what = what;
    std::error_code ec;
    w.overwrite = o_.overwrite_checkpoint && !o_.checkpoint_dir.empty() &&
                  std::filesystem::equivalent(dir, o_.checkpoint_dir, ec);
    w.resume_dir = o_.resume_dir;
    w.resume_run_id = resume_run_id_;
    w.run_id = run_id_;
    w.fix = what == "[checkpoint] save_checkpoint"
                ? "a run writes over its own checkpoints and the one it resumed only; give another directory "
                  "(or load_checkpoint " + dir + " to continue that run)"
                : "a run writes over its own checkpoints and the one it resumed only (another run committed "
                  "there after this one started); give another --checkpoint";
    try {
      check_checkpoint_owner(dir, w);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  broadcast_text(error, world_);
  if (!error.empty()) fail(error);
}

void DistTrainer::save() {
  if (const std::string bad = nonfinite_parameter(); !bad.empty())
    fail("[train] --save ", o_.save_path, ": parameter '", bad, "' holds non-finite values after step ",
         state_->step - 1, "; not written (an existing file is kept)");
  // The weights as the optimizer holds them: with ZeRO the f32 master shards
  // (under mixed precision the gathered parameters are bf16 compute copies).
  gather_and_write(o_.save_path, "save.", [&](const std::string& name) {
    const bool zero = rt_->plan->optimizer_states.count(name) > 0;
    return std::pair{zero ? rt_->plan->optimizer_states.at(name) : rt_->graph->annotation(name),
                     state_->optimized(name).data};
  }, o_.save_dtype);
}

void DistTrainer::save_checkpoint_to(const std::string& dir, const std::string& what) {
  finish_checkpoint(true);  // one write at a time
  check_checkpoint_owner_agreed(dir, what);  // before any shard is written
  if (const std::string bad = nonfinite_parameter(); !bad.empty())
    fail("[train] --checkpoint ", dir, ": parameter '", bad, "' holds non-finite values after step ",
         state_->step - 1, "; checkpoint not written (the last one is kept)");
  std::vector<CheckpointShard> shards;
  for (TrainingState::NamedShard& s : state_->checkpoint_shards())  // copies: the next steps update the state
    shards.push_back(CheckpointShard{s.tensor, s.shape, s.shard.box, train_common::host_copy(s.shard.data)});
  auto p = std::make_unique<PendingCheckpoint>();
  p->step = state_->step;
  p->dir = dir;
  p->meta = {{"samples", state_->samples}, {"seed", state_->seed}, {"world_size", world_.size()},
             {"strategy", to_json(rt_->strategy)}, {"run_id", run_id_}};
  p->meta.update(train_common::resume_meta(config_, o_));  // "model", "data": what a resume must match
  if (!events_.empty() && !choices_.empty()) {  // the strategy set in force (re-planned perhaps), for --resume
    nlohmann::json set = nlohmann::json::array();
    for (const auto& c : choices_) set.push_back(to_json(*c->strategy));
    p->meta["strategies"] = set;
    p->meta["choice"] = choice_;
  }
  PendingCheckpoint* raw = p.get();
  const int rank = world_.rank();
  p->writer = std::thread([raw, rank, dir, shards = std::move(shards)] {
    try {
      write_checkpoint_shards(dir, raw->step, rank, shards);
    } catch (const std::exception& e) {
      raw->error = e.what();
    }
    raw->done = true;
  });
  pending_ = std::move(p);
  if (o_.checkpoint_sync) finish_checkpoint(true);
}

void DistTrainer::finish_checkpoint(bool wait) {
  if (!pending_) return;  // the same on every rank: saves are collective
  int64_t busy = !wait && !pending_->done ? 1 : 0;
  world_.all_reduce(&busy, 1, ReduceOp::kMax);
  if (busy) return;
  pending_->writer.join();
  int64_t failed = pending_->error.empty() ? 0 : 1;
  world_.all_reduce(&failed, 1, ReduceOp::kMax);
  if (failed) {
    const std::string error = pending_->error, dir = pending_->dir;
    pending_.reset();
    fail(error.empty() ? std::string("[checkpoint] ") + dir + ": another rank failed to write its shards"
                       : error);
  }
  if (world_.rank() == 0) commit_checkpoint(pending_->dir, pending_->step, world_.size(), pending_->meta);
  world_.barrier();  // committed before any rank reads index.json
  pending_.reset();
}

}  // namespace dist
}  // namespace hspmd

// The distributed trainer's checkpoints and saved weights: every rank's
// shards gathered to rank 0 and written (safetensors), the full parameters
// on every rank, and the step checkpoints written in the background (the
// class: train/dist_trainer.h; the loop: dist_trainer.cc).
#include "hspmd/core/options.h"
#include "train/dist_trainer.h"
#include "train/resume_checks.h"

#include "hspmd/io/safetensors.h"
#include "hspmd/models/model.h"

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

void DistTrainer::save() {
  if (const std::string bad = nonfinite_parameter(); !bad.empty())
    fail("[train] ", option_name("save"), " ", o_.save_path, ": parameter '", bad, "' holds non-finite values after step ",
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
  checkpoints_.check_owner_agreed(dir, what);  // before any shard is written
  if (const std::string bad = nonfinite_parameter(); !bad.empty())
    fail("[train] ", option_name("checkpoint"), " ", dir, ": parameter '", bad, "' holds non-finite values after step ",
         state_->step - 1, "; checkpoint not written (the last one is kept)");
  std::vector<CheckpointShard> shards;
  for (TrainingState::NamedShard& s : state_->checkpoint_shards())  // copies: the next steps update the state
    shards.push_back(CheckpointShard{s.tensor, s.shape, s.shard.box, train_common::host_copy(s.shard.data)});
  nlohmann::json meta = {{"samples", state_->samples}, {"seed", state_->seed}, {"world_size", world_.size()},
                         {"strategy", to_json(rt_->strategy)}, {"run_id", checkpoints_.run_id()}};
  meta.update(train_common::resume_meta(config_, o_));  // "model", "data": what a resume must match
  // The strategy set in force (re-planned perhaps), for --resume.
  if (elastic() && tokens_ && !tokens_->choices().empty()) tokens_->describe(meta);
  checkpoints_.start(dir, state_->step, std::move(shards), std::move(meta));
}

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

void DistTrainer::load_weights(const std::map<std::string, NDArray>& weights) {
  finish_checkpoint(true);  // the pending write holds copies; the state is replaced after it
  copies_ = {};              // the weights' bf16 copies were the old weights'
  const int64_t step = state_->step, samples = state_->samples;
  const uint64_t seed = state_->seed;
  state_ = TrainingState::from_full(rt_->plan, world_.rank(), weights);
  state_->move_to_device(o_.device);
  state_->step = step;
  state_->samples = samples;
  state_->seed = seed;
}

}  // namespace dist
}  // namespace hspmd

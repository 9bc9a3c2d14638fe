#include "hspmd/train/trainer.h"

#include <memory>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/models/config.h"
#include "train/train_common.h"

namespace hspmd {

namespace {

void check_options(const TrainOptions& o, const LlamaConfig& c) {
  train_common::check_finite_options(o);
  if (o.seq_len <= 0) fail("[flags] --seq-len must be positive, got ", o.seq_len);
  if (o.seq_len > c.max_position_embeddings)
    fail("[flags] --seq-len ", o.seq_len, " exceeds max_position_embeddings ",
         c.max_position_embeddings, " of ", o.model_path);
  if (o.steps <= 0) fail("[flags] --steps must be positive, got ", o.steps);
  if (o.batch_tokens > 0) return;  // token-budget steps: no batch of samples
  if (o.global_batch <= 0) fail("[flags] --global-batch must be positive, got ", o.global_batch);
  if (o.micro_batches <= 0 || o.global_batch % o.micro_batches != 0)
    fail("[flags] --micro-batches ", o.micro_batches, " must divide --global-batch ",
         o.global_batch);
}

}  // namespace

std::vector<StepRecord> train(const TrainOptions& o) {
  const LlamaConfig config = LlamaConfig::load(o.model_path);
  check_options(o, config);
  TrainOptions one = o;
  Strategy strategy;
  strategy.description = "one process";
  Pipeline p;
  if (o.batch_tokens <= 0) {
    p.micro_batch_size = static_cast<int>(o.global_batch / o.micro_batches);
    p.micro_batches = static_cast<int>(o.micro_batches);
  }
  p.stages.push_back(Stage{{0}, 0, static_cast<int>(config.num_hidden_layers) - 1});
  strategy.pipelines.push_back(p);
  one.strategy = strategy;
  std::unique_ptr<Communicator> world = make_single_process_communicator();
  return train_distributed(one, *world);
}

}  // namespace hspmd

#include "hspmd/train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "hspmd/core/error.h"
#include "hspmd/core/threads.h"
#include "hspmd/data/token_data.h"
#include "hspmd/graph/executor.h"
#include "hspmd/io/safetensors.h"
#include "hspmd/models/llama.h"
#include "kernels/kernels.h"
#include "train/train_common.h"

namespace hspmd {

namespace {

using Clock = std::chrono::steady_clock;
using namespace train_common;

void check_options(const TrainOptions& o, const LlamaConfig& c) {
  if (o.seq_len <= 0) fail("[flags] --seq-len must be positive, got ", o.seq_len);
  if (o.seq_len > c.max_position_embeddings)
    fail("[flags] --seq-len ", o.seq_len, " exceeds max_position_embeddings ",
         c.max_position_embeddings, " of ", o.model_path);
  if (o.global_batch <= 0) fail("[flags] --global-batch must be positive, got ", o.global_batch);
  if (o.steps <= 0) fail("[flags] --steps must be positive, got ", o.steps);
  if (o.micro_batches <= 0 || o.global_batch % o.micro_batches != 0)
    fail("[flags] --micro-batches ", o.micro_batches, " must divide --global-batch ",
         o.global_batch);
  if (o.clip_grad < 0) fail("[flags] --clip-grad must be >= 0, got ", o.clip_grad);
  if (!(o.schedule.lr > 0)) fail("[flags] --lr must be positive, got ", o.schedule.lr);
  check_output_path("--save", o.save_path);
  check_output_path("--log", o.log_path);
  check_output_path("--dump-grads", o.dump_grads_path);
}

}  // namespace

std::vector<StepRecord> train(const TrainOptions& o) {
  const LlamaConfig config = LlamaConfig::load(o.model_path);
  check_options(o, config);
  const TokenData data = TokenData::load(o.data_path, config.vocab_size);
  const SampleSource source(data, o.seq_len, o.pack_documents, config.eos_token_id);
  std::map<std::string, NDArray> params =
      o.init_path.empty()
          ? init_llama_parameters(config, o.seed)
          : validate_llama_weights(config, load_safetensors(o.init_path), o.init_path);
  set_num_threads(o.threads);

  LlamaGraph model = build_llama(config, o.pack_documents);
  std::vector<Tensor> fetches = {model.loss};
  fetches.insert(fetches.end(), model.grads.begin(), model.grads.end());
  Executor executor(*model.graph, fetches);
  Adam adam(o.adam);
  LrSchedule schedule = o.schedule;
  schedule.total_steps = o.steps;

  std::ofstream log;
  if (!o.log_path.empty()) {
    log.open(o.log_path);
    if (!log) fail("[flags] --log ", o.log_path, ": cannot open for writing");
  }
  const int64_t micro = o.global_batch / o.micro_batches;
  std::vector<StepRecord> records;
  const auto start = Clock::now();
  for (int64_t step = 0; step < o.steps; ++step) {
    const auto t0 = Clock::now();
    ValueMap values(params.begin(), params.end());
    std::map<std::string, NDArray> grads;
    double loss = 0.0;
    const int64_t first = step * o.global_batch;
    const float normalizer = source.normalizer(first, o.global_batch);
    for (int64_t mb = 0; mb < o.micro_batches; ++mb) {
      const int64_t at = first + mb * micro;
      ValueMap feeds = make_batch(source, at, micro, source.width(at, micro, 1), normalizer);
      for (auto& [k, v] : feeds) values[k] = v;
      std::vector<NDArray> out = executor.run(values);
      loss += out[0].data<float>()[0];
      for (size_t i = 0; i < model.names.size(); ++i) {
        auto it = grads.find(model.names[i]);
        if (it == grads.end())
          grads.emplace(model.names[i], out[i + 1]);
        else
          kernels::accumulate(out[i + 1], it->second);
      }
    }
    if (step == 0 && !o.dump_grads_path.empty()) save_safetensors(o.dump_grads_path, grads);
    StepRecord r;
    r.step = step;
    r.loss = loss;
    r.lr = schedule.at(step);
    r.grad_norm = clip_grad_norm(grads, o.clip_grad);
    adam.begin_step();
    for (auto& [name, p] : params)
      adam.update(name, p, grads.at(name), r.lr, /*decay=*/p.ndim() >= 2);
    r.tokens = source.tokens(first, o.global_batch);
    r.step_time_s = std::chrono::duration<double>(Clock::now() - t0).count();
    r.tokens_per_s = r.tokens / r.step_time_s;
    if (log.is_open()) log << record_json(r).dump() << "\n" << std::flush;
    if (o.progress)
      print_progress(r, o.steps, std::chrono::duration<double>(Clock::now() - start).count());
    records.push_back(r);
  }
  if (!o.save_path.empty()) {
    std::map<std::string, NDArray> out;
    for (const auto& [name, p] : params) out.emplace(name, p.to(o.save_dtype));
    save_safetensors(o.save_path, out);
  }
  return records;
}

}  // namespace hspmd

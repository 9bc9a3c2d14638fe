// One training step (forward, backward, AdamW) of a model config on random
// tokens, timed over several steps after warm-up. Prints one JSON line with
// the median step time, tokens/s and the process's peak RSS, in the format of
// bench/torch_step.py so bench/train_step.py can compare them side by side.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/core/rng.h"
#include "hspmd/core/threads.h"
#include "hspmd/graph/executor.h"
#include "hspmd/models/model.h"
#include "hspmd/optim/adam.h"

using namespace hspmd;

namespace {

struct Args {
  std::string model;
  int64_t seq_len = 256, batch = 8, steps = 5, warmup = 2, threads = 1;
  std::string precision = "fp32";
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") a.model = v;
    else if (k == "--seq-len") a.seq_len = std::stoll(v);
    else if (k == "--global-batch") a.batch = std::stoll(v);
    else if (k == "--steps") a.steps = std::stoll(v);
    else if (k == "--warmup") a.warmup = std::stoll(v);
    else if (k == "--threads") a.threads = std::stoll(v);
    else if (k == "--precision") a.precision = v;
    else fail("[bench] unknown flag ", k);
  }
  if (a.model.empty()) fail("[bench] --model is required");
  return a;
}

ValueMap random_batch(const ModelConfig& c, int64_t batch, int64_t seq, uint64_t seed) {
  Rng rng(seed);
  NDArray ids = NDArray::empty({batch, seq}, DType::I32);
  NDArray tgt = NDArray::empty({batch, seq}, DType::I32);
  NDArray pos = NDArray::empty({batch, seq}, DType::I32);
  for (int64_t i = 0; i < batch * seq; ++i) {
    ids.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u64() % c.vocab_size);
    tgt.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u64() % c.vocab_size);
    pos.data<int32_t>()[i] = static_cast<int32_t>(i % seq);
  }
  NDArray norm = NDArray::empty({}, DType::F32);
  norm.fill(static_cast<float>(batch * seq));
  return {{"input_ids", ids}, {"targets", tgt}, {"positions", pos}, {"normalizer", norm}};
}

}  // namespace

int main(int argc, char** argv) {
  ensure_passive_omp_wait(argv);
  tune_host_malloc();
  try {
    Args a = parse(argc, argv);
    set_num_threads(static_cast<int>(a.threads));
    ModelConfig c = ModelConfig::load(a.model);
    std::map<std::string, NDArray> params = init_model_parameters(c, 0);
    ModelBuildOptions options;
    options.precision.compute = parse_precision_name(a.precision, "--precision");
    ModelGraph m = build_model(c, options);
    std::vector<Tensor> fetches = {m.loss};
    fetches.insert(fetches.end(), m.grads.begin(), m.grads.end());
    Executor exec(*m.graph, fetches);
    Adam adam(AdamConfig{});
    std::vector<double> times;
    double loss = 0;
    for (int64_t s = 0; s < a.warmup + a.steps; ++s) {
      ValueMap values = random_batch(c, a.batch, a.seq_len, s);
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& [k, v] : params) values[k] = v;
      std::vector<NDArray> out = exec.run(values);
      loss = out[0].data<float>()[0];
      adam.begin_step();
      for (size_t i = 0; i < m.names.size(); ++i) {
        NDArray& p = params.at(m.names[i]);
        adam.update(m.names[i], p, out[i + 1], 1e-4, p.ndim() >= 2);
      }
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s >= a.warmup) times.push_back(dt);
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    std::printf(
        "{\"impl\": \"hspmd\", \"precision\": \"%s\", \"threads\": %lld, \"step_time_s_median\": %.6f, "
        "\"tokens_per_s\": %.1f, \"peak_rss_mb\": %.1f, \"loss\": %.5f}\n",
        a.precision.c_str(), static_cast<long long>(a.threads), median, a.batch * a.seq_len / median,
        ru.ru_maxrss / 1024.0, loss);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hspmd_step: %s\n", e.what());
    return 1;
  }
}

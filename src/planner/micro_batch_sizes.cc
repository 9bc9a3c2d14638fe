// The search's micro-batch sizes pass (docs/planner.md, "Micro-batch sizes
// per pipeline"): a strategy's pipelines each get their own micro-batch
// size and count, the batch split by dynamic programming over sample counts.
#include "planner/micro_batch_sizes.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace hspmd {

std::optional<Strategy> resize_micro_batches(const CostModel& model, const SearchOptions& o, const Strategy& st) {
  const int G = o.global_batch;
  const int P = static_cast<int>(st.pipelines.size());
  if (static_cast<double>(P) * G * G > 5e7) return std::nullopt;  // the program's table
  const double inf = std::numeric_limits<double>::infinity();
  // Sizes: the ones the user allows (--micro-batch-sizes), else 1 .. 64.
  std::vector<int> sizes = o.micro_batch_sizes;
  if (sizes.empty())
    for (int b = 1; b <= std::min(G, 64); ++b) sizes.push_back(b);
  std::sort(sizes.begin(), sizes.end());
  std::vector<std::vector<double>> time(P, std::vector<double>(G + 1, inf));  // [p][S]
  std::vector<std::vector<int>> size(P, std::vector<int>(G + 1, 0));
  for (int p = 0; p < P; ++p) {
    const std::vector<Stage>& stages = st.pipelines[p].stages;
    const int K = static_cast<int>(stages.size());
    std::vector<StageShape> shapes(K);
    for (int k = 0; k < K; ++k) {
      shapes[k].ranks = stages[k].ranks;
      shapes[k].cp = stages[k].cp;
      shapes[k].layers = stages[k].num_layers();
      shapes[k].first = k == 0;
      shapes[k].last = k + 1 == K;
      shapes[k].recompute = stages[k].recompute;
    }
    const int min_n = o.schedule == "gpipe" ? 1 : K;
    for (int b : sizes) {
      double worst = 0, sum = 0;
      bool fits = true;
      for (int k = 0; k < K && fits; ++k) {
        const StageCost c = model.stage_cost(shapes[k], o.seq_len, b);
        double t = c.fwd + c.bwd + c.fwd_comm + c.bwd_comm;
        if (k + 1 < K) t += 2 * model.boundary_seconds(shapes[k], shapes[k + 1], o.seq_len, b);
        if (k > 0) t += 2 * model.boundary_seconds(shapes[k - 1], shapes[k], o.seq_len, b);
        worst = std::max(worst, t);
        sum += t;
        const int in_flight = o.schedule == "gpipe" ? std::max(1, G / (b * P)) : K - k;
        const double bytes =
            model.stage_memory(shapes[k], o.seq_len, b, in_flight, o.zero ? P : 1.0, o.zero).total();
        for (int r : shapes[k].ranks) fits = fits && bytes <= model.capacity_bytes(r);
      }
      if (!fits) break;  // larger micro-batches hold more activations
      for (int n = min_n; n * b <= G; ++n) {
        const double t = sum - worst + worst * n;
        if (t < time[p][n * b]) time[p][n * b] = t, size[p][n * b] = b;
      }
    }
  }
  // best[s]: the least slowest-pipeline time of pipelines 0..p with s samples.
  std::vector<double> best(G + 1, inf);
  best[0] = 0;
  std::vector<std::vector<int>> take(P, std::vector<int>(G + 1, 0));
  for (int p = 0; p < P; ++p) {
    std::vector<double> next(G + 1, inf);
    for (int S = 1; S <= G; ++S) {
      if (!std::isfinite(time[p][S])) continue;
      for (int s = S; s <= G; ++s) {
        if (!std::isfinite(best[s - S])) continue;
        const double t = std::max(best[s - S], time[p][S]);
        if (t < next[s]) next[s] = t, take[p][s] = S;
      }
    }
    best = std::move(next);
  }
  if (!std::isfinite(best[G])) return std::nullopt;
  Strategy out = st;
  for (int p = P - 1, left = G; p >= 0; --p) {
    const int S = take[p][left];
    out.pipelines[p].micro_batch_size = size[p][S];
    out.pipelines[p].micro_batches = S / size[p][S];
    left -= S;
  }
  if (out == st) return std::nullopt;
  return out;
}

}  // namespace hspmd

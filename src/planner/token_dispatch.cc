#include "hspmd/planner/token_dispatch.h"

#include <algorithm>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"

namespace hspmd {

std::vector<std::vector<int64_t>> token_steps(const std::vector<int64_t>& pieces, int64_t batch_tokens) {
  std::vector<std::vector<int64_t>> steps;
  int64_t tokens = 0;
  for (int64_t p : pieces) {
    if (steps.empty() || tokens + p > batch_tokens) steps.emplace_back(), tokens = 0;
    steps.back().push_back(p);
    tokens += p;
  }
  return steps;
}

int64_t accepted_piece(const Strategy& s, const Pipeline& p, int64_t default_max) {
  const int64_t own = p.max_seq_len > 0 ? p.max_seq_len : s.max_seq_len > 0 ? s.max_seq_len : default_max;
  return default_max > 0 ? std::min(own, default_max) : own;
}

int64_t micro_batch_capacity(const Strategy& s, const Pipeline& p, int64_t default_max) {
  return p.micro_batch_tokens > 0 ? p.micro_batch_tokens : accepted_piece(s, p, default_max);
}

StageShape pipeline_stage_shape(const Pipeline& p, size_t k) {
  const Stage& st = p.stages.at(k);
  StageShape sh;
  sh.ranks = st.ranks;
  sh.cp = st.cp;
  sh.layers = st.num_layers();
  sh.first = k == 0;
  sh.last = k + 1 == p.stages.size();
  sh.recompute = st.recompute;
  return sh;
}

std::vector<double> token_step_rank_compute(const CostModel& model, const Strategy& strategy,
                                            const std::vector<std::vector<std::vector<int64_t>>>& micro, int world) {
  std::vector<double> out(static_cast<size_t>(world), 0.0);
  // The optimizer: a rank's compute in a step of one micro-batch of one
  // sample at the granularity, less that micro-batch.
  Strategy one = strategy;
  for (Pipeline& p : one.pipelines) p.micro_batch_size = 1, p.micro_batches = 1;
  const int64_t g = sequence_granularity(one);
  const CostReport rep = model.evaluate(one, g);
  for (size_t p = 0; p < strategy.pipelines.size(); ++p) {
    const Pipeline& pl = strategy.pipelines[p];
    for (size_t k = 0; k < pl.stages.size(); ++k) {
      const StageShape sh = pipeline_stage_shape(pl, k);
      for (int r : sh.ranks) {
        if (r < 0 || r >= world) continue;
        auto cost = [&](int64_t len) {
          const auto [f, b] = model.rank_compute(r, sh, len, 1);
          return f + b;
        };
        double& t = out[static_cast<size_t>(r)];
        t += std::max(0.0, rep.ranks.at(static_cast<size_t>(r)).compute_s - cost(g));
        const double fixed = std::max(0.0, 2 * cost(1) - cost(2));
        if (p >= micro.size()) continue;
        for (const std::vector<int64_t>& mb : micro[p]) {
          if (sh.cp > 1) {  // attention's bill under context parallelism: the row as one sequence (ops/attention.cc)
            int64_t row = 0;
            for (int64_t len : mb) row += len;
            t += cost(row);
            continue;
          }
          t += fixed;
          for (int64_t len : mb) t += std::max(0.0, cost(len) - fixed);
        }
      }
    }
  }
  return out;
}

double PieceCosts::per_micro_batch(size_t pipeline) const {
  if (fixed_.empty()) fixed_.assign(strategy_.pipelines.size(), -1.0);
  double& f = fixed_.at(pipeline);
  // The constant of a cost a + b*s + c*s^2 from s = 1, 2 (2 y(1) - y(2) =
  // a - 2c, c is tiny): the fixed cost of a call, with the communication's
  // latencies, which a length of 0 would leave out.
  if (f < 0) f = std::max(0.0, 2 * seconds(pipeline, 1) - seconds(pipeline, 2));
  return f;
}

double PieceCosts::marginal(size_t pipeline, int64_t length) const {
  return std::max(0.0, seconds(pipeline, length) - per_micro_batch(pipeline));
}

double PieceCosts::seconds(size_t pipeline, int64_t length) const {
  auto [it, fresh] = cache_.try_emplace({pipeline, length}, 0.0);
  if (!fresh) return it->second;
  const Pipeline& pl = strategy_.pipelines.at(pipeline);
  for (size_t k = 0; k < pl.stages.size(); ++k)
    it->second = std::max(it->second, model_.stage_cost(pipeline_stage_shape(pl, k), length, 1).piece());
  return it->second;
}

namespace {

// The slowest pipeline's predicted time under a dispatch: per pipeline its
// pieces' marginal costs, the fixed cost once per micro-batch, and a fill
// and drain of (stages - 1) average micro-batches.
double dispatch_seconds(const PieceCosts& costs, const Strategy& strategy, const std::vector<int64_t>& lengths,
                        const TokenDispatch& d) {
  double slowest = 0;
  for (size_t p = 0; p < d.micro.size(); ++p) {
    if (d.micro[p].empty()) continue;
    const double n = static_cast<double>(d.micro[p].size());
    double total = n * costs.per_micro_batch(p);
    for (const std::vector<size_t>& mb : d.micro[p])
      for (size_t i : mb) total += costs.marginal(p, lengths[i]);
    slowest = std::max(slowest, total * (1 + static_cast<double>(strategy.pipelines[p].stages.size() - 1) / n));
  }
  return slowest;
}

std::vector<size_t> longest_first(const std::vector<int64_t>& lengths) {
  std::vector<size_t> order(lengths.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return lengths[a] > lengths[b]; });
  return order;
}

// First-fit decreasing of `items` (longest first already) into bins of `cap`.
std::vector<std::vector<size_t>> first_fit(const std::vector<size_t>& items, const std::vector<int64_t>& lengths,
                                           int64_t cap) {
  std::vector<std::vector<size_t>> bins;
  std::vector<int64_t> used;
  for (size_t i : items) {
    size_t bin = 0;
    while (bin < used.size() && used[bin] + lengths[i] > cap) ++bin;
    if (bin == used.size()) used.push_back(0), bins.emplace_back();
    used[bin] += lengths[i];
    bins[bin].push_back(i);
  }
  return bins;
}

// kCost: pieces longest first to the accepting pipeline that would finish
// first (its load: the pieces' marginal costs, and the fixed cost once per
// micro-batch its tokens fill), then first-fit decreasing per pipeline.
TokenDispatch dispatch_by_cost(const PieceCosts& costs, const Strategy& strategy, const std::vector<int64_t>& lengths,
                               int64_t default_max) {
  const size_t P = strategy.pipelines.size();
  TokenDispatch d;
  d.micro.resize(P);
  d.pipeline_tokens.assign(P, 0);
  std::vector<double> load(P, 0.0);
  std::vector<int64_t> cap(P);
  for (size_t p = 0; p < P; ++p) cap[p] = micro_batch_capacity(strategy, strategy.pipelines[p], default_max);
  auto filled = [&](size_t p, int64_t tokens) {
    return static_cast<double>((tokens + cap[p] - 1) / cap[p]) * costs.per_micro_batch(p);
  };
  std::vector<std::vector<size_t>> got(P);
  for (size_t i : longest_first(lengths)) {
    const int64_t len = lengths[i];
    int best = -1;
    double best_end = 0;
    for (size_t p = 0; p < P; ++p) {
      if (len > accepted_piece(strategy, strategy.pipelines[p], default_max)) continue;
      const double end = load[p] + costs.marginal(p, len) + filled(p, d.pipeline_tokens[p] + len);
      if (best < 0 || end < best_end) best = static_cast<int>(p), best_end = end;
    }
    if (best < 0) fail("[search] a piece of ", len, " tokens that no pipeline of the strategy accepts");
    load[best] += costs.marginal(best, len);
    got[best].push_back(i);
    d.pipeline_tokens[best] += len;
  }
  for (size_t p = 0; p < P; ++p) d.micro[p] = first_fit(got[p], lengths, cap[p]);
  return d;
}

// kSymmetric: SPMD data parallelism, blind to device speeds (what a
// homogeneous system such as HotSPa or Megatron does): the pieces, longest
// first, packed first-fit decreasing into micro-batches of the pipelines'
// smallest capacity (a longer piece alone in its own), then each
// micro-batch, most tokens first, to the accepting pipeline holding the
// fewest tokens so far (then the fewest micro-batches, then the first).
TokenDispatch dispatch_symmetric(const Strategy& strategy, const std::vector<int64_t>& lengths, int64_t default_max) {
  const size_t P = strategy.pipelines.size();
  TokenDispatch d;
  d.micro.resize(P);
  d.pipeline_tokens.assign(P, 0);
  int64_t cap = 0;
  for (const Pipeline& p : strategy.pipelines) {
    const int64_t c = micro_batch_capacity(strategy, p, default_max);
    cap = cap == 0 ? c : std::min(cap, c);
  }
  std::vector<std::vector<size_t>> bins = first_fit(longest_first(lengths), lengths, std::max<int64_t>(1, cap));
  auto tokens = [&](const std::vector<size_t>& mb) {
    int64_t n = 0;
    for (size_t i : mb) n += lengths[i];
    return n;
  };
  std::stable_sort(bins.begin(), bins.end(),
                   [&](const auto& a, const auto& b) { return tokens(a) > tokens(b); });
  for (const std::vector<size_t>& mb : bins) {
    int64_t longest = 0;
    for (size_t i : mb) longest = std::max(longest, lengths[i]);
    int best = -1;
    for (size_t p = 0; p < P; ++p) {
      if (longest > accepted_piece(strategy, strategy.pipelines[p], default_max)) continue;
      if (best < 0 || d.pipeline_tokens[p] < d.pipeline_tokens[best] ||
          (d.pipeline_tokens[p] == d.pipeline_tokens[best] && d.micro[p].size() < d.micro[best].size()))
        best = static_cast<int>(p);
    }
    if (best < 0) fail("[search] a piece of ", longest, " tokens that no pipeline of the strategy accepts");
    d.micro[best].push_back(mb);
    d.pipeline_tokens[best] += tokens(mb);
  }
  return d;
}

}  // namespace

TokenDispatch dispatch_token_step(const PieceCosts& costs, const Strategy& strategy,
                                  const std::vector<int64_t>& lengths, int64_t default_max, DispatchRule rule) {
  TokenDispatch d = rule == DispatchRule::kSymmetric ? dispatch_symmetric(strategy, lengths, default_max)
                                                     : dispatch_by_cost(costs, strategy, lengths, default_max);
  d.predicted_s = dispatch_seconds(costs, strategy, lengths, d);
  return d;
}

double predict_token_step(const CostModel& model, const Strategy& strategy, const std::vector<int64_t>& pieces,
                          DispatchRule rule) {
  const PieceCosts costs(model, strategy);
  return dispatch_token_step(costs, strategy, pieces, 0, rule).predicted_s;
}

double token_step_sync_seconds(const CostModel& model, const Strategy& strategy) {
  Strategy s = strategy;
  for (Pipeline& p : s.pipelines) p.micro_batch_size = 1, p.micro_batches = static_cast<int>(p.stages.size());
  const CostReport rep = model.evaluate(s, sequence_granularity(s));
  double pipelines = 0;
  for (double x : rep.pipeline_s) pipelines = std::max(pipelines, x);
  return std::max(0.0, rep.predicted_step_s - pipelines);
}

}  // namespace hspmd

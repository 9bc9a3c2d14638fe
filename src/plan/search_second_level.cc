// The strategy search (docs/planner.md), second level: for a configuration
// from the first level (search.cc), its layers per stage and micro-batches
// per pipeline by the two ILPs (or exhaustively), lower bounds that order
// and prune the configurations, scoring by the cost model, and the
// per-pipeline micro-batch sizes pass over the best strategies.
#include "plan/search_internal.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "hspmd/plan/ilp.h"
#include "plan/micro_batch_sizes.h"

namespace hspmd {
namespace search_detail {

StageShape Searcher::shape(const std::vector<Group>& pipe, size_t k, int cp, int layers, bool recompute) const {
  StageShape s;
  s.ranks = pipe[k].ranks;
  s.cp = cp;
  s.layers = layers;
  s.first = k == 0;
  s.last = k + 1 == pipe.size();
  s.recompute = recompute;
  return s;
}

void Searcher::score(Strategy s, const std::string& family) {
  s.schedule = o_.schedule;
  s.zero = o_.zero;
  const std::string key = to_json(s).dump();
  if (scored_.count(key)) return;
  const CostReport rep = model_.evaluate(s, o_.seq_len);
  const int over = rep.overflow_rank();
  if (over >= 0) {
    const RankCost& r = rep.ranks[over];
    const double missing = r.memory.total() - r.capacity_bytes;
    if (missing < least_missing_) least_missing_ = missing, least_missing_rank_ = over;
    return;
  }
  scored_[key] = {std::move(s), rep.predicted_step_s, family, key};
}

// Layers per stage and micro-batches per pipeline by the two ILPs.
LayerStage Searcher::stage_program(const std::vector<Group>& pipe, int k, int cp, int b, bool recompute,
                                   int pipelines) const {
  const int K = static_cast<int>(pipe.size());
  const StageShape none = shape(pipe, k, cp, 0, recompute), one = shape(pipe, k, cp, 1, recompute);
  auto total = [](const StageCost& x) { return x.fwd + x.bwd + x.fwd_comm + x.bwd_comm; };
  const double t0 = total(model_.stage_cost(none, o_.seq_len, b)), t1 = total(model_.stage_cost(one, o_.seq_len, b));
  LayerStage ls;
  ls.time_per_layer = t1 - t0;
  ls.fixed_time = t0 + transfers(pipe, k, cp, b);
  const int in_flight = o_.schedule == "gpipe" ? std::max(1, o_.global_batch / (b * pipelines)) : K - k;
  const double share = o_.zero ? static_cast<double>(pipelines) : 1.0;  // ZeRO splits a rank's states over the pipelines
  const double m0 = model_.stage_memory(none, o_.seq_len, b, in_flight, share, o_.zero).total();
  ls.fixed_memory = m0;
  ls.memory_per_layer = model_.stage_memory(one, o_.seq_len, b, in_flight, share, o_.zero).total() - m0;
  ls.memory_capacity = std::numeric_limits<double>::infinity();
  for (int r : pipe[k].ranks) ls.memory_capacity = std::min(ls.memory_capacity, model_.capacity_bytes(r));
  return ls;
}

void Searcher::second_level(const Config& c, int b, bool recompute) {
  const int P = static_cast<int>(c.pipelines.size());
  const int L = static_cast<int>(m_.num_hidden_layers);
  std::vector<MicroBatchPipeline> mbp;
  Strategy s;
  for (const std::vector<Group>& pipe : c.pipelines) {
    const int K = static_cast<int>(pipe.size());
    if (K > L) return;
    std::vector<LayerStage> stages;
    for (int k = 0; k < K; ++k) stages.push_back(stage_program(pipe, k, c.cp, b, recompute, P));
    const LayerAssignment la = layers_for(stages, L);
    if (!la.feasible) {
      if (la.worst_stage >= 0 && la.bytes_missing < least_missing_)
        least_missing_ = la.bytes_missing, least_missing_rank_ = pipe[la.worst_stage].ranks.front();
      return;
    }
    Pipeline pl;
    pl.micro_batch_size = b;
    int first = 0;
    double worst = 0, sum = 0;
    for (int k = 0; k < K; ++k) {
      Stage st;
      st.ranks = pipe[k].ranks;
      st.cp = c.cp;
      st.first_layer = first;
      st.last_layer = first + la.layers[k] - 1;
      st.recompute = recompute;
      first = st.last_layer + 1;
      pl.stages.push_back(st);
      const double t = stages[k].fixed_time + stages[k].time_per_layer * la.layers[k];
      worst = std::max(worst, t);
      sum += t;
    }
    s.pipelines.push_back(pl);
    MicroBatchPipeline mp;
    mp.micro_batch_size = b;
    mp.time_per_micro_batch = worst;
    mp.fixed_time = sum - worst;  // fill and drain: every other stage once
    mp.min_micro_batches = o_.schedule == "gpipe" ? 1 : K;
    mbp.push_back(mp);
  }
  int least = 0;
  for (const MicroBatchPipeline& mp : mbp) least += mp.micro_batch_size * mp.min_micro_batches;
  if (least > o_.global_batch) return;  // too many pipelines or stages for the batch
  MicroBatchAssignment ma;
  bool identical = true;
  for (const MicroBatchPipeline& mp : mbp)
    identical = identical && mp.micro_batch_size == mbp[0].micro_batch_size &&
                mp.time_per_micro_batch == mbp[0].time_per_micro_batch && mp.fixed_time == mbp[0].fixed_time &&
                mp.min_micro_batches == mbp[0].min_micro_batches && mp.max_micro_batches == mbp[0].max_micro_batches;
  if (identical && o_.global_batch % b == 0) {
    // Identical pipelines need no program: the most even split is optimal
    // (any other gives some pipeline more micro-batches than the ceiling).
    const int n = o_.global_batch / b;
    for (int p = 0; p < P; ++p) ma.counts.push_back(n / P + (p < n % P ? 1 : 0));
    ma.feasible = true;
  } else {
    ++ilps_;
    ma = assign_micro_batches(mbp, o_.global_batch, ilp_limit(), o_.solver);
  }
  if (!ma.feasible) return;
  for (int p = 0; p < P; ++p) s.pipelines[p].micro_batches = ma.counts[p];
  score(std::move(s), c.family);
}

// Every composition of the layers over each pipeline's stages and every
// split of the batch over the pipelines, each scored by the full model.
void Searcher::exhaustive(const Config& c, int b, bool recompute) {
  const int P = static_cast<int>(c.pipelines.size());
  const int L = static_cast<int>(m_.num_hidden_layers);
  if (o_.global_batch % b != 0) return;
  const int total_mb = o_.global_batch / b;
  std::vector<std::vector<std::vector<int>>> splits(P);  // per pipeline, its layer compositions
  for (int p = 0; p < P; ++p) {
    const int K = static_cast<int>(c.pipelines[p].size());
    if (K > L) return;
    std::vector<int> cur;
    std::function<void(int, int)> rec = [&](int k, int left) {
      if (k == K - 1) {
        cur.push_back(left);
        splits[p].push_back(cur);
        cur.pop_back();
        return;
      }
      for (int x = 1; x <= left - (K - 1 - k); ++x) {
        cur.push_back(x);
        rec(k + 1, left - x);
        cur.pop_back();
      }
    };
    rec(0, L);
  }
  std::vector<int> counts(P, 0), choice(P, 0);
  std::function<void(int, int)> mb = [&](int p, int left) {
    if (p == P - 1) {
      const int K = static_cast<int>(c.pipelines[p].size());
      if (left < (o_.schedule == "gpipe" ? 1 : K)) return;
      counts[p] = left;
      std::function<void(int)> lay = [&](int q) {
        if (q == P) {
          Strategy s;
          for (int i = 0; i < P; ++i) {
            Pipeline pl;
            pl.micro_batch_size = b;
            pl.micro_batches = counts[i];
            int first = 0;
            for (size_t k = 0; k < c.pipelines[i].size(); ++k) {
              Stage st;
              st.ranks = c.pipelines[i][k].ranks;
              st.cp = c.cp;
              st.first_layer = first;
              st.last_layer = first + splits[i][choice[i]][k] - 1;
              st.recompute = recompute;
              first = st.last_layer + 1;
              pl.stages.push_back(st);
            }
            s.pipelines.push_back(pl);
          }
          score(std::move(s), c.family);
          return;
        }
        for (size_t x = 0; x < splits[q].size(); ++x) choice[q] = static_cast<int>(x), lay(q + 1);
      };
      lay(0);
      return;
    }
    const int K = static_cast<int>(c.pipelines[p].size());
    for (int n = o_.schedule == "gpipe" ? 1 : K; n <= left; ++n) counts[p] = n, mb(p + 1, left - n);
  };
  mb(0, total_mb);
}

// A lower bound of the step time of a configuration at micro-batch size b,
// from the continuous relaxation of the two programs. In pipeline p a stage
// k spends f_k + x_k t_k per micro-batch (x_k layers); the slowest stage is
// at least T_p = (L + sum_k f_k / t_k) / sum_k 1 / t_k (all stages equal,
// layers fractional), and n_p micro-batches take at least n_p T_p; with
// sum_p n_p = G / b the step takes at least (G / b) / sum_p 1 / T_p. Memory
// enters as feasibility: when the stages' memory cannot hold the L layers
// (fractional) even with recomputation, the bound is infinite; when only
// recomputation fits, the recomputing stage times are used; the fill and
// drain of each pipeline and the gradient sync and optimizer step of its
// fullest stage (each at least ceil(L / K) layers) are added at their least.
// Transfers between stages only add.
double Searcher::lower_bound(const Config& c, int b) const {
  const double L = static_cast<double>(m_.num_hidden_layers);
  const int P = static_cast<int>(c.pipelines.size());
  double rate = 0, fill = 0, after = 0, at_least = 0;
  // The links: a bandwidth depends only on whether two ranks share a node and
  // on their device types, so the ranks are grouped by (node, type) "sites",
  // each with how many ranks of every pipeline it holds: the fastest link
  // from a group to another pipeline's rank costs one pass over the sites,
  // not over every rank (measured on 1000 ranks: a 30 s search now ends in
  // 19 s; before, 22 s of bounds found nothing under --time-limit 3).
  struct Site {
    int rep[2] = {-1, -1};  // two of its ranks (one that is not the asking rank)
    int total = 0;
    std::map<size_t, int> per_pipeline;
  };
  std::map<std::pair<int, std::string>, Site> sites;
  for (size_t q = 0; q < c.pipelines.size(); ++q)
    for (const Group& other : c.pipelines[q])
      for (int r : other.ranks) {
        Site& st = sites[{model_.topology().rank(r).node, model_.topology().rank(r).device_type}];
        if (st.rep[0] < 0) st.rep[0] = r;
        else if (st.rep[1] < 0) st.rep[1] = r;
        ++st.total;
        ++st.per_pipeline[q];
      }
  auto fastest_link = [&](int r0, size_t p) {
    double fastest = 0;
    const RankInfo& me = model_.topology().rank(r0);
    for (const auto& [where, st] : sites) {
      const auto mine = st.per_pipeline.find(p);
      const int own = mine == st.per_pipeline.end() ? 0 : mine->second;
      const bool here = where.first == me.node && where.second == me.device_type;  // r0 is one of its ranks
      const int eligible = (st.total - own) + (c.cp > 1 ? own - (here ? 1 : 0) : 0);
      if (eligible <= 0) continue;
      const int other = st.rep[0] != r0 ? st.rep[0] : st.rep[1];
      if (other >= 0) fastest = std::max(fastest, model_.topology().bandwidth(r0, other));
    }
    return fastest;
  };
  for (size_t p = 0; p < c.pipelines.size(); ++p) {
    const std::vector<Group>& pipe = c.pipelines[p];
    const int K = static_cast<int>(pipe.size());
    // After the schedule every rank reduces its layers' gradients over the
    // replicas (P pipelines x cp) and steps the optimizer; some stage of
    // each pipeline holds at least ceil(L / K) layers. Its ring all-reduce
    // can use no link faster than its fastest one to another pipeline.
    const int replicas = P * c.cp;
    const int most = (static_cast<int>(L) + K - 1) / K;
    double least_after = std::numeric_limits<double>::infinity();
    for (const Group& g : pipe) {
      const double per_layer = static_cast<double>(model_.layer_params() - model_.layer_tp_params()) +
                               static_cast<double>(model_.layer_tp_params()) / (static_cast<double>(g.ranks.size()) / c.cp);
      double sync = 0;
      if (replicas > 1) {
        const double fastest = fastest_link(g.ranks.front(), p);
        if (fastest > 0) sync = 2.0 * per_layer * 4 * (replicas - 1) / replicas / (fastest * 1e9);
      }
      const double opt = model_.optimizer_seconds(g.ranks.front(), static_cast<int64_t>(per_layer)) -
                         model_.optimizer_seconds(g.ranks.front(), 0);
      // A GPU overlaps the sync with the last backward but one layer's
      // share (CostModel::evaluate): only that is left for sure.
      const double sync_after = model_.overlaps_grad_sync(g.ranks.front()) ? sync : most * sync;
      least_after = std::min(least_after, sync_after + most * (o_.zero ? opt / P : opt));
    }
    after = std::max(after, least_after);
    double best_T = std::numeric_limits<double>::infinity(), least_stage = 0;
    for (bool recompute : {false, true}) {
      if (recompute && !o_.allow_recompute) break;
      std::vector<double> fk(K), tk(K), mk(K);
      double room = 0;
      for (int k = 0; k < K; ++k) {
        const LayerStage ls = stage_program(pipe, k, c.cp, b, recompute, P);
        fk[k] = ls.fixed_time;
        tk[k] = std::max(1e-30, ls.time_per_layer);
        mk[k] = ls.memory_per_layer > 0
                    ? std::max(0.0, std::floor((ls.memory_capacity - ls.fixed_memory) / ls.memory_per_layer))
                    : L;  // whole layers
        room += std::min(mk[k], L);
        if (mk[k] < 1) room = -1;  // every stage holds at least one layer
      }
      if (room + 1e-9 < L) continue;  // the layers do not fit
      // The LP relaxation of the layer program: the least T at which the
      // stages, each taking (T - f_k) / t_k layers clamped to [1, M_k],
      // hold all L.
      auto held = [&](double T) {
        double x = 0;
        for (int k = 0; k < K; ++k) x += std::clamp((T - fk[k]) / tk[k], 1.0, mk[k]);
        return x;
      };
      double lo = 0, hi = 0;
      for (int k = 0; k < K; ++k) lo = std::max(lo, fk[k] + tk[k]);  // one layer each
      for (int k = 0; k < K; ++k) hi = std::max(hi, fk[k] + tk[k] * L);
      for (int it = 0; it < 60; ++it) {
        const double mid = 0.5 * (lo + hi);
        (held(mid) >= L ? hi : lo) = mid;
      }
      best_T = hi;
      // The least sum of the stages' times over whole-layer assignments:
      // one layer each, the rest on the cheapest stages up to their memory.
      std::vector<int> order(K);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int x, int y) { return tk[x] < tk[y]; });
      double left = L - K, sum = 0;
      for (int k = 0; k < K; ++k) sum += fk[k] + tk[k];
      for (int k : order) {
        const double take = std::min(left, std::max(0.0, mk[k] - 1));
        sum += take * tk[k];
        left -= take;
      }
      least_stage = sum;  // the stages' sum, at least
      break;  // recomputation only when the plain stages do not fit
    }
    if (!std::isfinite(best_T)) return std::numeric_limits<double>::infinity();
    // n micro-batches take at least (n - 1) T_max + sum_k T_k (the
    // bottleneck's n slots plus every other stage's first forward and
    // last backward) >= n T_p + (least sum - T_p).
    const double B = std::max(0.0, least_stage - best_T);
    rate += 1 / best_T;
    fill += B / best_T;
    // 1F1B runs at least K micro-batches per pipeline.
    const int least_n = o_.schedule == "gpipe" ? 1 : K;
    at_least = std::max(at_least, least_n * best_T + B);
  }
  // min over n of max_p n_p T_p + B_p with sum_p n_p = G / b and n_p at
  // least its minimum (fractional).
  return std::max(at_least, (static_cast<double>(o_.global_batch) / b + fill) / rate) + after;
}

// The k-th best step time found so far (infinity while fewer than k).
double Searcher::kth_best() const {
  if (static_cast<int>(scored_.size()) < o_.top_k) return std::numeric_limits<double>::infinity();
  std::vector<double> steps;
  for (const auto& [key, sc] : scored_) steps.push_back(sc.step);
  std::nth_element(steps.begin(), steps.begin() + (o_.top_k - 1), steps.end());
  return steps[o_.top_k - 1];
}

void Searcher::second_levels() {
  struct Item {
    double bound;
    size_t config;
    int b;
  };
  std::vector<Item> items;
  // Bounds cost time too (every group of every configuration): under the
  // limit only those computed before it run out are used.
  for (size_t i = 0; i < configs_.size() && !out_of_time(); ++i)
    for (int b : micro_batch_sizes()) {
      if (o_.previous && !o_.previous->pipelines.empty() && b != o_.previous->pipelines[0].micro_batch_size) continue;
      items.push_back({o_.exhaustive ? 0.0 : lower_bound(configs_[i], b), i, b});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.bound < y.bound; });
  std::vector<Item> unfit;  // memory rules them out: solved only to name the shortfall if nothing fits
  for (const Item& it : items) {
    if (out_of_time()) break;
    // Best-bound first: once the bound reaches the k-th best, nothing later
    // can enter the top k (exhaustive runs score everything).
    if (!o_.exhaustive && it.bound >= kth_best()) {
      if (!std::isfinite(it.bound)) unfit.push_back(it);
      ++pruned_;
      continue;
    }
    ++configurations_;
    const Config& c = configs_[it.config];
    for (bool recompute : {false, true}) {
      if (recompute && !o_.allow_recompute) break;
      const size_t before = scored_.size();
      if (o_.exhaustive) exhaustive(c, it.b, recompute);
      else second_level(c, it.b, recompute);
      // Recomputation only where the plain configuration does not fit.
      if (scored_.size() > before) break;
    }
  }
  if (scored_.empty())
    for (const Item& it : unfit)
      for (bool recompute : {false, true}) second_level(configs_[it.config], it.b, recompute && o_.allow_recompute);
  // Out of time before anything was scored (a cluster too large for the
  // limit): the symmetric (Megatron-like) configurations, enumerated first,
  // are scored until one fits, so that a search always answers.
  for (size_t i = 0; scored_.empty() && timed_out_ && i < configs_.size(); ++i) {
    if (configs_[i].family != "symmetric") continue;
    ++configurations_;
    for (int b : micro_batch_sizes())
      for (bool recompute : {false, true}) {
        if (recompute && !o_.allow_recompute) break;
        if (scored_.empty()) second_level(configs_[i], b, recompute);
      }
  }
}

// The second level gives every pipeline of a configuration one micro-batch
// size b, from {1, 2, 4, 8} dividing the batch. Pipelines of different
// speeds want different sizes: a call's fixed cost is paid per micro-batch,
// so a one-stage pipeline does best with one large micro-batch, and the
// fast replicas of proportional data parallelism take 5 samples where the
// slow take 2 (batch 30 on speeds 1, 1/1.5, 1/2.5), sizes the second level
// never tries (unless --micro-batch-sizes names them). Here each of the best strategies found is taken again with
// its stages and layers as they are: per pipeline and per sample count S,
// the best (size b, count n = S / b) by the stage costs (the bottleneck
// stage n times plus the others once, as the micro-batch program counts;
// a size whose activations overflow a rank's memory ends the sizes), then
// the split of the batch over the pipelines that minimises the slowest, by
// dynamic programming over sample counts; the result is scored by the
// whole model like any candidate. A re-plan, whose second level keeps the
// previous micro-batch size, gets the pass too: it is cheap.
void Searcher::refine_sizes() {
  std::vector<const Scored*> all;
  for (const auto& [key, sc] : scored_) all.push_back(&sc);
  std::sort(all.begin(), all.end(), [](const Scored* a, const Scored* b) {
    return a->step != b->step ? a->step < b->step : a->key < b->key;
  });
  std::vector<std::pair<Strategy, std::string>> best;
  for (size_t i = 0; i < all.size() && i < static_cast<size_t>(std::max(o_.top_k, 8)); ++i)
    best.emplace_back(all[i]->strategy, all[i]->family);
  for (const auto& [st, family] : best) {
    if (out_of_time()) return;
    if (std::optional<Strategy> s = resize_micro_batches(model_, o_, st)) score(std::move(*s), family + "+sizes");
  }
}

}  // namespace search_detail

}  // namespace hspmd

// The strategy search (docs/planner.md), second level: for a configuration
// from the first level (search.cc), its layers per stage and micro-batches
// per pipeline by the two ILPs (or exhaustively), lower bounds that order
// and prune the configurations, scoring by the cost model, and the
// per-pipeline micro-batch sizes pass over the best strategies.
#include "planner/search_internal.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "hspmd/core/error.h"
#include "hspmd/planner/ilp.h"
#include "planner/micro_batch_sizes.h"

namespace hspmd {
namespace search_detail {

StageShape Searcher::shape(const Pipe& pipe, size_t k, int cp, int layers, bool recompute) const {
  StageShape s;
  s.ranks = pipe[k]->ranks;
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
  s.expert_parallel = o_.expert_parallel;
  const std::string key = to_json(s).dump();
  if (scored_.count(key)) return;
  if (s.expert_parallel > 1) {  // skip the layouts expert parallelism cannot run (uneven slots, ...)
    try {
      validate(s, model_.model(), model_.topology().world_size());
    } catch (const Error&) {
      return;
    }
  }
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

// A stage's program depends on its ranks only through their classes (speed,
// memory, device type) and nodes (links): a group of one class on one node
// costs what every group of that class and size costs, and its transfers
// depend on the neighbours' class, size and whether they share its node.
// Cached by that (a bound or program of a 2,048-device configuration asks
// for up to 2,048 stages, mostly alike).
LayerStage Searcher::stage_program(const Pipe& pipe, int k, int cp, int b, bool recompute,
                                   int pipelines) const {
  const int K = static_cast<int>(pipe.size());
  const Group& g = *pipe[k];
  bool cacheable = g.cls >= 0;
  StageKey key;
  key.v = {g.cls, static_cast<int64_t>(g.ranks.size()), cp, b, recompute, k == 0, k + 1 == K,
           o_.schedule == "gpipe" ? std::max(1, o_.global_batch / (b * pipelines)) : K - k,
           o_.zero ? pipelines : 1, -1, -1, -1, -1};
  auto neighbour = [&](int at, size_t slot) {
    const Group& n = *pipe[at];
    cacheable = cacheable && n.cls >= 0;
    key.v[slot] = n.cls;
    key.v[slot + 1] = static_cast<int64_t>(n.ranks.size()) * 2 + (n.node == g.node ? 1 : 0);
  };
  if (k > 0) neighbour(k - 1, 9);
  if (k + 1 < K) neighbour(k + 1, 11);
  if (!cacheable) return compute_stage_program(pipe, k, cp, b, recompute, pipelines);
  auto it = stage_cache_.find(key);
  if (it != stage_cache_.end()) return it->second;
  return stage_cache_[key] = compute_stage_program(pipe, k, cp, b, recompute, pipelines);
}

// Layers per stage and micro-batches per pipeline by the two ILPs.
LayerStage Searcher::compute_stage_program(const Pipe& pipe, int k, int cp, int b, bool recompute,
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
  for (int r : pipe[k]->ranks) ls.memory_capacity = std::min(ls.memory_capacity, model_.capacity_bytes(r));
  return ls;
}

void Searcher::second_level(const Config& c, int b, bool recompute) {
  const int P = static_cast<int>(c.pipelines.size());
  const int L = static_cast<int>(m_.num_hidden_layers);
  std::vector<MicroBatchPipeline> mbp;
  Strategy s;
  for (const Pipe& pipe : c.pipelines) {
    const int K = static_cast<int>(pipe.size());
    if (K > L) return;
    std::vector<LayerStage> stages;
    for (int k = 0; k < K; ++k) stages.push_back(stage_program(pipe, k, c.cp, b, recompute, P));
    const LayerAssignment la = layers_for(stages, L);
    if (!la.feasible) {
      if (la.worst_stage >= 0 && la.bytes_missing < least_missing_)
        least_missing_ = la.bytes_missing, least_missing_rank_ = pipe[la.worst_stage]->ranks.front();
      return;
    }
    Pipeline pl;
    pl.micro_batch_size = b;
    int first = 0;
    double worst = 0, sum = 0;
    for (int k = 0; k < K; ++k) {
      Stage st;
      st.ranks = pipe[k]->ranks;
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
    ma = assign_micro_batches(mbp, o_.global_batch, ilp_limit(), solver(mbp.size()));
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
              st.ranks = c.pipelines[i][k]->ranks;
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

namespace {

// The links of a bound: a bandwidth depends only on whether two ranks share
// a node and on their device types (one a node), so the ranks are grouped
// by node "sites", each knowing whether it holds ranks of one pipeline
// only, and the sites by device type: the fastest link from a group to
// another pipeline's rank costs a look at its own site and one per device
// type, not a pass over every rank (measured on 1000 ranks: a 30 s search
// now ends in 19 s; before, 22 s of bounds found nothing under --time-limit
// 3) or over every site (2,048 devices: 256 sites for each of 256 groups).
class LinkSites {
 public:
  // `rank_type`, `types` and `link_gbps` as the Searcher's rank_type_,
  // type_names_ and link_gbps_.
  LinkSites(const Config& c, const Topology& topo, int num_nodes, const std::vector<int>& rank_type, int types,
            const std::vector<double>& link_gbps)
      : cp_(c.cp), topo_(topo), rank_type_(rank_type), types_(types), link_gbps_(link_gbps), sites_(num_nodes) {
    for (size_t q = 0; q < c.pipelines.size(); ++q)
      for (const Group* g : c.pipelines[q]) {
        const Group& other = *g;
        if (other.node >= 0) {  // all on one node
          add(other.node, other.ranks.data(), other.ranks.size(), static_cast<int>(q));
          continue;
        }
        for (const int& r : other.ranks) add(topo.node_of(r), &r, 1, static_cast<int>(q));
      }
    index_types(static_cast<int>(c.pipelines.size()));
  }

  // The fastest link from g's first rank (pipeline p) to a rank it could
  // reduce with: another pipeline's, or under cp > 1 also its own
  // pipeline's. 0 when there is none.
  double fastest_link(const Group& g, size_t p) const {
    double fastest = 0;
    const int r0 = g.ranks.front();
    const int n0 = g.node >= 0 ? g.node : topo_.node_of(r0), t0 = rank_type_[r0];
    const Site& own = sites_[n0];
    const bool other_here = own.multi || own.pipeline != static_cast<int>(p);
    if (other_here || (cp_ > 1 && own.total >= 2)) {
      const int other = own.rep[0] != r0 ? own.rep[0] : own.rep[1];
      if (other >= 0) fastest = std::max(fastest, link_gbps_[(t0 * types_ + rank_type_[other]) * 2]);
    }
    for (int t = 0; t < types_; ++t) {
      int eligible = cp_ > 1 ? type_sites_[t] : type_sites_[t] - only_[t][p];
      if (t == t0 && (cp_ > 1 || other_here)) --eligible;  // its own site is not another node
      if (eligible <= 0) continue;
      const int other = type_rep_node_[t][0] != n0 ? type_rep_[t][0] : type_rep_[t][1];
      if (other >= 0) fastest = std::max(fastest, link_gbps_[(t0 * types_ + t) * 2 + 1]);
    }
    return fastest;
  }

 private:
  struct Site {
    int rep[2] = {-1, -1};  // two of its ranks (one that is not the asking rank)
    int total = 0;
    int pipeline = -1;   // the pipeline of its first rank
    bool multi = false;  // ranks of another pipeline too
  };

  void add(int node, const int* ranks, size_t n, int q) {
    Site& st = sites_[node];
    if (st.total == 0) touched_.push_back(node);
    for (size_t i = 0; i < n && st.rep[1] < 0; ++i) (st.rep[0] < 0 ? st.rep[0] : st.rep[1]) = ranks[i];
    st.total += static_cast<int>(n);
    if (st.pipeline < 0) st.pipeline = q;
    else if (st.pipeline != q) st.multi = true;
  }

  // Per device type: its sites, the sites holding only pipeline p's ranks,
  // and ranks of it on two nodes.
  void index_types(int pipelines) {
    type_sites_.assign(types_, 0);
    only_.assign(types_, std::vector<int>(pipelines, 0));
    type_rep_.assign(types_, {-1, -1});
    type_rep_node_.assign(types_, {-1, -1});
    for (int node : touched_) {
      const Site& st = sites_[node];
      const int t = rank_type_[st.rep[0]];
      ++type_sites_[t];
      if (!st.multi) ++only_[t][st.pipeline];
      for (int i : {0, 1})
        if (type_rep_[t][i] < 0) {
          type_rep_[t][i] = st.rep[0], type_rep_node_[t][i] = node;
          break;
        }
    }
  }

  int cp_;
  const Topology& topo_;
  const std::vector<int>& rank_type_;
  int types_;
  const std::vector<double>& link_gbps_;
  std::vector<Site> sites_;
  std::vector<int> touched_;
  std::vector<int> type_sites_;
  std::vector<std::vector<int>> only_;
  std::vector<std::array<int, 2>> type_rep_, type_rep_node_;
};

}  // namespace

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
//
// The bound of every micro-batch size is computed at once: the gradient
// sync and optimizer part does not depend on the size.
std::vector<double> Searcher::lower_bounds(const Config& c, const std::vector<int>& sizes) const {
  const double after = after_schedule_bound(c);
  const std::vector<int> shapes = pipe_shapes(c);
  std::vector<double> out;
  for (int b : sizes) out.push_back(size_bound(c, b, shapes, after));
  return out;
}

double Searcher::after_schedule_bound(const Config& c) const {
  const double L = static_cast<double>(m_.num_hidden_layers);
  const int P = static_cast<int>(c.pipelines.size());
  const LinkSites links(c, model_.topology(), num_nodes_, rank_type_, static_cast<int>(type_names_), link_gbps_);
  double after = 0;
  for (size_t p = 0; p < c.pipelines.size(); ++p) {
    const Pipe& pipe = c.pipelines[p];
    const int K = static_cast<int>(pipe.size());
    // After the schedule every rank reduces its layers' gradients over the
    // replicas (P pipelines x cp) and steps the optimizer; some stage of
    // each pipeline holds at least ceil(L / K) layers. Its ring all-reduce
    // can use no link faster than its fastest one to another pipeline.
    const int replicas = P * c.cp;
    const int most = (static_cast<int>(L) + K - 1) / K;
    double least_after = std::numeric_limits<double>::infinity();
    for (const Group* gp : pipe) {
      const Group& g = *gp;
      const double per_layer = static_cast<double>(model_.layer_params() - model_.layer_tp_params()) +
                               static_cast<double>(model_.layer_tp_params()) / (static_cast<double>(g.ranks.size()) / c.cp);
      double sync = 0;
      if (replicas > 1) {
        const double fastest = links.fastest_link(g, p);
        if (fastest > 0) sync = 2.0 * per_layer * 4 * (replicas - 1) / replicas / (fastest * 1e9);
      }
      const auto [opt, overlaps] = optimizer_facts(g, c.cp, per_layer);
      // A GPU overlaps the sync with the last backward but one layer's
      // share (CostModel::evaluate): only that is left for sure.
      const double sync_after = overlaps ? sync : most * sync;
      least_after = std::min(least_after, sync_after + most * (o_.zero ? opt / P : opt));
    }
    after = std::max(after, least_after);
  }
  return after;
}

std::pair<double, bool> Searcher::optimizer_facts(const Group& g, int cp, double per_layer) const {
  auto rank_facts = [&] {
    const double opt = model_.optimizer_seconds(g.ranks.front(), static_cast<int64_t>(per_layer)) -
                       model_.optimizer_seconds(g.ranks.front(), 0);
    return std::make_pair(opt, model_.overlaps_grad_sync(g.ranks.front()));
  };
  if (g.cls < 0) return rank_facts();
  const int64_t key = (static_cast<int64_t>(g.cls) << 42) | (static_cast<int64_t>(cp) << 21) |
                      static_cast<int64_t>(g.ranks.size());
  auto it = optimizer_cache_.find(key);
  return it != optimizer_cache_.end() ? it->second : (optimizer_cache_[key] = rank_facts());
}

std::vector<int> Searcher::pipe_shapes(const Config& c) const {
  const int P = static_cast<int>(c.pipelines.size());
  std::vector<int> shapes(c.pipelines.size());
  // Pipelines of a configuration mostly repeat the one before.
  std::vector<int64_t> now, before;
  for (size_t p = 0; p < c.pipelines.size(); ++p) {
    now.clear();
    const Pipe& pipe = c.pipelines[p];
    for (size_t k = 0; k < pipe.size() && (now.empty() || now.back() >= 0); ++k)
      now.push_back(pipe[k]->cls < 0 ? -1
                                     : (static_cast<int64_t>(pipe[k]->cls) << 32) +
                                           static_cast<int64_t>(pipe[k]->ranks.size()) * 2 +
                                           (k > 0 && pipe[k]->node == pipe[k - 1]->node ? 1 : 0));
    if (!now.empty() && now.back() < 0) shapes[p] = -1;
    else if (p > 0 && now == before) shapes[p] = shapes[p - 1];
    else shapes[p] = pipe_shape(now, c.cp, P);
    std::swap(now, before);
  }
  return shapes;
}

double Searcher::size_bound(const Config& c, int b, const std::vector<int>& shapes, double after) const {
  const int P = static_cast<int>(c.pipelines.size());
  double rate = 0, fill = 0, at_least = 0;
  bool fits = true;
  for (size_t p = 0; p < c.pipelines.size() && fits; ++p) {
    const auto [best_T, least_stage] = pipeline_bound(c.pipelines[p], c.cp, b, P, shapes[p]);
    if (!std::isfinite(best_T)) fits = false;
    const int K = static_cast<int>(c.pipelines[p].size());
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
  return fits ? std::max(at_least, (static_cast<double>(o_.global_batch) / b + fill) / rate) + after
              : std::numeric_limits<double>::infinity();
}

// Per pipeline of a bound: the least bottleneck T_p of the LP relaxation of
// the layer program and the least sum of its stages' times (infinite when
// its memory cannot hold the layers even with recomputation). Pipelines of
// the same stage classes, sizes and node sharing recur across
// configurations: cached by those (pipe_shape) and b.
int Searcher::pipe_shape(const std::vector<int64_t>& stages, int cp, int P) const {
  std::string key;
  auto put = [&key](int64_t x) { key.append(reinterpret_cast<const char*>(&x), sizeof x); };
  put(cp), put(o_.zero || o_.schedule == "gpipe" ? P : 0);
  for (int64_t x : stages) put(x);
  return pipe_shapes_.emplace(std::move(key), static_cast<int>(pipe_shapes_.size())).first->second;
}

std::pair<double, double> Searcher::pipeline_bound(const Pipe& pipe, int cp, int b, int P, int shape) const {
  const bool cacheable = shape >= 0 && b < (1 << 26);
  const int64_t key = (static_cast<int64_t>(shape) << 26) | b;
  if (cacheable) {
    auto it = pipeline_bound_cache_.find(key);
    if (it != pipeline_bound_cache_.end()) return it->second;
  }
  const double L = static_cast<double>(m_.num_hidden_layers);
  const int K = static_cast<int>(pipe.size());
  double best_T = std::numeric_limits<double>::infinity(), least_stage = 0;
  for (bool recompute : {false, true}) {
    if (recompute && !o_.allow_recompute) break;
    std::vector<double> fk(K), tk(K), mk(K);
    double room = 0;
    for (int k = 0; k < K; ++k) {
      const LayerStage ls = stage_program(pipe, k, cp, b, recompute, P);
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
  const std::pair<double, double> out{best_T, least_stage};
  if (cacheable) pipeline_bound_cache_[key] = out;
  return out;
}

// The k-th best step time found so far (infinity while fewer than k);
// computed again only when a strategy was scored since.
double Searcher::kth_best() const {
  if (kth_at_ == scored_.size()) return kth_;
  kth_at_ = scored_.size();
  kth_ = std::numeric_limits<double>::infinity();
  if (static_cast<int>(scored_.size()) < o_.top_k) return kth_;
  std::vector<double> steps;
  for (const auto& [key, sc] : scored_) steps.push_back(sc.step);
  std::nth_element(steps.begin(), steps.begin() + (o_.top_k - 1), steps.end());
  return kth_ = steps[o_.top_k - 1];
}

namespace {

// The low `bits` bits of j, reversed.
uint64_t reverse_low_bits(uint64_t j, int bits) {
  j = ((j >> 1) & 0x5555555555555555ull) | ((j & 0x5555555555555555ull) << 1);
  j = ((j >> 2) & 0x3333333333333333ull) | ((j & 0x3333333333333333ull) << 2);
  j = ((j >> 4) & 0x0F0F0F0F0F0F0F0Full) | ((j & 0x0F0F0F0F0F0F0F0Full) << 4);
  j = ((j >> 8) & 0x00FF00FF00FF00FFull) | ((j & 0x00FF00FF00FF00FFull) << 8);
  j = ((j >> 16) & 0x0000FFFF0000FFFFull) | ((j & 0x0000FFFF0000FFFFull) << 16);
  j = (j >> 32) | (j << 32);
  return bits == 0 ? uint64_t{0} : j >> (64 - bits);
}

}  // namespace

size_t BoundOrder::at(size_t next) const {
  if (next < symmetric) return next;
  const size_t i = reverse_low_bits(next - symmetric, bits);
  return i < rest ? symmetric + i : static_cast<size_t>(-1);
}

// Bounds cost time too (every group of every configuration): the symmetric
// configurations first, then the others in an order that spreads over all
// of them (bit-reversed indices: every TP combination and pipeline count
// sampled evenly), so that a limit that stops them leaves a fair sample
// rather than the first TP combinations only. (The symmetric configurations
// are enumerated first: configs_[0 .. S).)
BoundOrder Searcher::bound_order() const {
  BoundOrder order;
  while (order.symmetric < configs_.size() && configs_[order.symmetric].symmetric >= 0) ++order.symmetric;
  order.rest = configs_.size() - order.symmetric;
  while ((size_t{1} << order.bits) < order.rest) ++order.bits;
  return order;
}

std::vector<int> Searcher::second_level_sizes() const {
  std::vector<int> sizes;
  for (int b : micro_batch_sizes()) {
    if (o_.previous && !o_.previous->pipelines.empty() && b != o_.previous->pipelines[0].micro_batch_size) continue;
    sizes.push_back(b);
  }
  return sizes;
}

void Searcher::second_levels() {
  const std::vector<int> sizes = second_level_sizes();
  const BoundOrder order = bound_order();
  // Rounds: bounds, then the programs of what they bounded, best bound
  // first. Without a binding limit that is one round over everything.
  // Under a limit too short for everything the time left is shared: a
  // round's bounds may take half of what is left until 90% of the limit,
  // its programs the rest of that (a next round bounds more when they end
  // early); the last 10% are the micro-batch sizes pass's (docs/planner.md,
  // "Time limit").
  const double t0 = elapsed();
  const double programs_until = t0 + 0.9 * std::max(0.0, o_.time_limit_s - t0);
  std::vector<BoundItem> unfit;  // memory rules them out: solved only to name the shortfall if nothing fits
  size_t next = 0;               // a position of the order
  bool stopped = sizes.empty() || configs_.empty();
  while (!stopped && next < order.positions()) {
    const std::vector<BoundItem> items = bound_round(order, sizes, programs_until, next, stopped);
    if (solve_round(items, sizes, programs_until, unfit)) stopped = true;
  }
  if (scored_.empty() && !timed_out_) solve_unfit(unfit, sizes);
  if (scored_.empty() && timed_out_) fallback();
}

std::vector<BoundItem> Searcher::bound_round(const BoundOrder& order, const std::vector<int>& sizes,
                                             double programs_until, size_t& next, bool& stopped) {
  phase_ = "the lower bounds";
  const double bounds_until = elapsed() + 0.5 * std::max(0.0, programs_until - elapsed());
  std::vector<BoundItem> items;
  for (; next < order.positions(); ++next) {
    const size_t config_at = order.at(next);
    if (config_at == static_cast<size_t>(-1)) continue;
    if (out_of_time()) {
      stopped = true;
      break;
    }
    if (elapsed() > bounds_until && !items.empty()) break;  // their programs first
    const uint32_t i = static_cast<uint32_t>(config_at);
    ++bounded_;
    if (o_.exhaustive) {
      for (size_t j = 0; j < sizes.size(); ++j) items.push_back({0.0, i, static_cast<uint32_t>(j)});
      continue;
    }
    const std::vector<double> bounds = lower_bounds(config(i), sizes);
    for (size_t j = 0; j < sizes.size(); ++j) items.push_back({bounds[j], i, static_cast<uint32_t>(j)});
  }
  // Best bound first; ties in enumeration order (configuration, then size).
  std::sort(items.begin(), items.end(), [](const BoundItem& x, const BoundItem& y) {
    if (x.bound != y.bound) return x.bound < y.bound;
    return x.config != y.config ? x.config < y.config : x.b_index < y.b_index;
  });
  return items;
}

bool Searcher::solve_round(const std::vector<BoundItem>& items, const std::vector<int>& sizes, double programs_until,
                           std::vector<BoundItem>& unfit) {
  phase_ = "the second level (integer programs, scoring)";
  for (const BoundItem& it : items) {
    if (out_of_time()) return true;
    if (elapsed() > programs_until && !scored_.empty()) {
      limit("the second level stopped at 90% of it");
      return true;
    }
    // Best-bound first: once the bound reaches the k-th best, nothing later
    // can enter the top k (exhaustive runs score everything).
    if (!o_.exhaustive && it.bound >= kth_best()) {
      if (!std::isfinite(it.bound)) unfit.push_back(it);
      ++pruned_;
      continue;
    }
    ++configurations_;
    solve_config(config(it.config), sizes[it.b_index]);
  }
  return false;
}

void Searcher::solve_config(const Config& c, int b) {
  for (bool recompute : {false, true}) {
    if (recompute && !o_.allow_recompute) break;
    const size_t before = scored_.size();
    if (o_.exhaustive) exhaustive(c, b, recompute);
    else second_level(c, b, recompute);
    // Recomputation only where the plain configuration does not fit.
    if (scored_.size() > before) break;
  }
}

void Searcher::solve_unfit(const std::vector<BoundItem>& unfit, const std::vector<int>& sizes) {
  for (const BoundItem& it : unfit) {
    if (out_of_time()) break;
    const Config c = config(it.config);
    for (bool recompute : {false, true}) second_level(c, sizes[it.b_index], recompute && o_.allow_recompute);
  }
}

// Out of time before anything was scored (a cluster too large for the
// limit): the symmetric (Megatron-like) configurations, enumerated first,
// are scored until one fits, so that a search always answers. Fewest
// stages first (they hold the most replicas and waste the least on
// bubbles; a pipeline that does not hold the model is refused by its layer
// program before anything is scored), by the exact algorithm, whose
// answers take microseconds.
void Searcher::fallback() {
  phase_ = "the fallback";
  std::vector<size_t> order;
  for (size_t i = 0; i < configs_.size(); ++i)
    if (configs_[i].symmetric >= 0) order.push_back(i);
  auto stages = [&](size_t i) {
    const Config& c = symmetric_[configs_[i].symmetric];
    return c.pipelines.empty() ? 0 : c.pipelines.front().size();
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return stages(x) < stages(y); });
  for (size_t i : order) {
    if (!scored_.empty()) break;
    ++configurations_;
    const Config& c = symmetric_[configs_[i].symmetric];
    for (int b : micro_batch_sizes())
      for (bool recompute : {false, true}) {
        if (recompute && !o_.allow_recompute) break;
        if (scored_.empty()) second_level(c, b, recompute);
      }
  }
  fell_back_ = !scored_.empty();
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

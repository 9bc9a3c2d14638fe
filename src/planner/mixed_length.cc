#include "hspmd/planner/mixed_length.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <tuple>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"

namespace hspmd {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kIntervals = 5;  // (0, m/16], (m/16, m/8], ..., (m/2, m], as hspmd data stats

// Interchangeable devices: (type, slowdown, memory cap), ranks per node.
struct DeviceClass {
  std::vector<std::vector<int>> nodes;
  int ranks = 0, max_per_node = 0;
};

std::vector<DeviceClass> device_classes(const CostModel& model, const std::set<int>& unavailable) {
  const Topology& t = model.topology();
  std::map<std::tuple<std::string, double, double>, std::map<int, std::vector<int>>> by_key;
  for (int r = 0; r < t.world_size(); ++r) {
    if (unavailable.count(r)) continue;
    const RankInfo& info = t.rank(r);
    by_key[{info.device_type, info.slowdown, info.memory_cap_gib}][info.node].push_back(r);
  }
  std::vector<DeviceClass> out;
  for (auto& [key, nodes] : by_key) {
    DeviceClass c;
    for (auto& [node, ranks] : nodes) {
      c.nodes.push_back(ranks);
      c.ranks += static_cast<int>(ranks.size());
      c.max_per_node = std::max(c.max_per_node, static_cast<int>(ranks.size()));
    }
    out.push_back(c);
  }
  return out;
}

// A pipeline of one class: pp stages of tp x cp ranks, layers split evenly.
struct PipelineType {
  int cls = 0, tp = 1, cp = 1, pp = 1;
  int width() const { return tp * cp; }
  int size() const { return tp * cp * pp; }
};

std::vector<int> even_layers(int layers, int pp) {
  std::vector<int> out(pp, layers / pp);
  for (int k = 0; k < layers % pp; ++k) ++out[pp - 2 - k >= 0 ? pp - 2 - k : 0];  // extras off the head stage
  return out;
}

StageShape type_stage(const PipelineType& t, const DeviceClass& c, int k, int layers, bool recompute) {
  StageShape s;
  s.ranks.assign(c.nodes.front().begin(), c.nodes.front().begin() + t.width());
  s.cp = t.cp;
  s.layers = layers;
  s.first = k == 0;
  s.last = k + 1 == t.pp;
  s.recompute = recompute;
  return s;
}


// Per stage, the cost of one piece of s tokens as a*s^2 + b*s + c (the
// profile's and the roofline's forms in s at b = 1; exact for them).
struct Quadratic {
  double a = 0, b = 0, c = 0;
  double at(double s) const { return (a * s + b) * s + c; }
};

Quadratic fit(double s1, double y1, double s2, double y2, double s3, double y3) {
  const double d12 = (y2 - y1) / (s2 - s1), d23 = (y3 - y2) / (s3 - s2);
  Quadratic q;
  q.a = (d23 - d12) / (s3 - s1);
  q.b = d12 - q.a * (s1 + s2);
  q.c = y1 - (q.a * s1 + q.b) * s1;
  return q;
}

class BucketPlanner {
 public:
  BucketPlanner(const CostModel& model, const MixedLengthOptions& o, std::vector<DeviceClass> classes)
      : model_(model), o_(o), classes_(std::move(classes)) {
    enumerate_types();
  }
  // The best strategy for the bucket's expected step from pipelines of at
  // least `min_ranks[c]` ranks on class c; `share` is the ZeRO share assumed
  // for memory (the strategy must have at least that many pipelines).
  // Returns false when nothing fits.
  bool plan(LengthBucket& bucket, int share, const std::vector<int>& min_ranks);
  // The homogeneous strategies (--homogeneous): for each pipeline type
  // (tp, cp, pp) that holds a micro-batch of the bucket's maximum on every
  // class, as many such pipelines as the available ranks place, every one
  // accepting the maximum, with its expected step as the program computes
  // one (all intervals on every pipeline). `share` as for plan(); empty
  // when none fits.
  std::vector<std::pair<Strategy, double>> homogeneous(const LengthBucket& bucket, int share);
  // The last plan()'s strategy with every pipeline accepting the longest
  // interval top (up to the bucket's maximum) whose micro-batch its memory
  // holds: the program gives each pipeline its run of intervals, while the
  // dispatch balances better when pipelines may take longer pieces too.
  Strategy widened(const LengthBucket& bucket) const;
  int classes() const { return static_cast<int>(classes_.size()); }
  int class_ranks(int c) const { return classes_[c].ranks; }

 private:
  struct Fitted {
    bool feasible = false, recompute = false;
    std::vector<Quadratic> stages;
  };
  void enumerate_types();
  const Fitted& fitted(size_t type, int64_t max_len, int share);
  double work(const Fitted& f, const std::vector<LengthInterval>& iv, int a, int e) const;
  Strategy build(const LengthBucket& bucket, const std::vector<std::tuple<int, size_t, int>>& runs,
                 std::vector<int>& caps);

  const CostModel& model_;
  const MixedLengthOptions& o_;
  std::vector<DeviceClass> classes_;
  std::vector<PipelineType> types_;
  std::map<std::tuple<size_t, int64_t, int>, Fitted> fitted_;
  int share_ = 1;  // the ZeRO share of the current plan()
  std::vector<size_t> last_types_;  // the type of each pipeline of the last built strategy
};

void BucketPlanner::enumerate_types() {
  const ModelConfig& m = model_.model();
  const int L = static_cast<int>(m.num_hidden_layers);
  for (size_t c = 0; c < classes_.size(); ++c) {
    const DeviceClass& dc = classes_[c];
    for (int tp = 1; tp <= dc.max_per_node; tp *= 2) {
      if (m.num_attention_heads % tp || m.kv_heads() % tp || m.intermediate_size % tp || m.vocab_size % tp) continue;
      for (int cp = 1; tp * cp <= dc.max_per_node && (o_.max_cp == 0 || cp <= o_.max_cp); cp *= 2)
        for (int pp = 1; pp <= L && tp * cp * pp <= dc.ranks && pp <= 16; ++pp)
          types_.push_back({static_cast<int>(c), tp, cp, pp});
    }
  }
}

// Whether the type holds a micro-batch of max_len tokens (1F1B: pp - k in
// flight on stage k), with recomputation only when needed, and its fits.
const BucketPlanner::Fitted& BucketPlanner::fitted(size_t type, int64_t max_len, int share) {
  auto [it, fresh] = fitted_.try_emplace({type, max_len, share});
  if (!fresh) return it->second;
  const PipelineType& t = types_[type];
  const DeviceClass& c = classes_[t.cls];
  const std::vector<int> layers = even_layers(static_cast<int>(model_.model().num_hidden_layers), t.pp);
  const double cap = model_.capacity_bytes(c.nodes.front().front());
  for (bool recompute : {false, true}) {
    if (recompute && !o_.allow_recompute) break;
    bool fits = true;
    for (int k = 0; k < t.pp && fits; ++k) {
      const MemoryBreakdown mem = model_.stage_memory(type_stage(t, c, k, layers[k], recompute), max_len, 1,
                                                      t.pp - k, o_.zero ? share : 1.0, o_.zero);
      fits = cap <= 0 || mem.total() <= cap;
    }
    if (!fits) continue;
    Fitted& f = it->second;
    f.feasible = true;
    f.recompute = recompute;
    const double L = static_cast<double>(o_.max_seq_len), s1 = std::max(1.0, L / 4), s2 = std::max(2.0, L / 2),
                 s3 = std::max(3.0, L);
    for (int k = 0; k < t.pp; ++k) {
      const StageShape sh = type_stage(t, c, k, layers[k], recompute);
      auto y = [&](double s) { return model_.stage_cost(sh, static_cast<int64_t>(s), 1).piece(); };
      f.stages.push_back(fit(s1, y(s1), s2, y(s2), s3, y(s3)));
    }
    break;
  }
  return it->second;
}

// One pipeline's seconds for all expected pieces of intervals [a, e): its
// slowest stage's. The constant term is paid once per micro-batch, not per
// piece (a micro-batch packs pieces into one call of every op): the
// pieces' tokens fill micro-batches of the run's longest length.
double BucketPlanner::work(const Fitted& f, const std::vector<LengthInterval>& iv, int a, int e) const {
  double tokens = 0;
  for (int j = a; j < e; ++j) tokens += iv[j].tokens;
  const double micro = std::max(1.0, tokens / static_cast<double>(iv[a].hi));
  double worst = 0;
  for (const Quadratic& q : f.stages) {
    double w = std::max(0.0, q.c) * micro;
    for (int j = a; j < e; ++j) w += q.a * iv[j].squares + q.b * iv[j].tokens;
    worst = std::max(worst, w);
  }
  return worst;
}

}  // namespace

namespace {

// Rates of pipelines of one class on a run of intervals: n pipelines of a
// type take the run's work at n / (work x fill), fill = 1 + (pp - 1) / the
// expected micro-batches per pipeline (the trainer's fill and drain).
struct ClassBest {
  double rate = 0, longest = kInf;  // longest: one piece of the run's top length
  int type = -1, count = 0;
};

}  // namespace

bool BucketPlanner::plan(LengthBucket& bucket, int share, const std::vector<int>& min_ranks) {
  const std::vector<LengthInterval>& iv = bucket.intervals;
  const int J = static_cast<int>(iv.size()), C = static_cast<int>(classes_.size());
  share_ = share;
  std::vector<int> caps(C);
  for (int c = 0; c < C; ++c) caps[c] = classes_[c].ranks;
  for (int attempt = 0; attempt < 256; ++attempt) {
    std::vector<int> radix(C);
    int states = 1, most = 0;
    for (int c = 0; c < C; ++c) radix[c] = states, states *= caps[c] + 1, most = std::max(most, caps[c]);
    auto at = [&](int a, int e, int c, int r) { return ((a * (J + 1) + e) * C + c) * (most + 1) + r; };
    std::vector<ClassBest> best(static_cast<size_t>(J * (J + 1) * C * (most + 1)));
    for (int a = 0; a < J; ++a)
      for (int e = a + 1; e <= J; ++e) {
        double tokens = 0;
        for (int j = a; j < e; ++j) tokens += iv[j].tokens;
        for (size_t t = 0; t < types_.size(); ++t) {
          const PipelineType& ty = types_[t];
          if (ty.size() < min_ranks[ty.cls]) continue;
          const Fitted& f = fitted(t, iv[a].hi, share);
          if (!f.feasible) continue;
          const double w = std::max(1e-300, work(f, iv, a, e));
          double longest = 0;
          for (const Quadratic& q : f.stages) longest = std::max(longest, q.at(static_cast<double>(iv[a].hi)));
          for (int r = ty.size(); r <= caps[ty.cls]; ++r) {
            const int n = r / ty.size();
            const double micro = std::max(1.0, tokens / (n * static_cast<double>(iv[a].hi)));
            const double rate = n / (w * (1 + (ty.pp - 1) / micro));
            ClassBest& b = best[at(a, e, ty.cls, r)];
            if (rate > b.rate) b = {rate, longest, static_cast<int>(t), n};
          }
        }
      }
    auto decode = [&](int idx, int c) { return idx / radix[c] % (caps[c] + 1); };
    auto run_time = [&](int a, int e, int r) {
      double rate = 0, longest = kInf, pieces = 0;
      for (int j = a; j < e; ++j) pieces += iv[j].pieces;
      for (int c = 0; c < C; ++c) {
        const ClassBest& b = best[at(a, e, c, decode(r, c))];
        if (b.type >= 0) rate += b.rate, longest = std::min(longest, b.longest);
      }
      if (rate <= 0) return a == 0 || pieces > 0 ? kInf : 0.0;
      return pieces > 0 ? std::max(1 / rate, longest) : 0.0;
    };
    // g[a][u]: the least slowest run over intervals a.. with u ranks used.
    std::vector<double> g(static_cast<size_t>((J + 1) * states), kInf);
    std::vector<std::pair<int, int>> choice(static_cast<size_t>((J + 1) * states), {-1, -1});
    for (int u = 0; u < states; ++u) g[J * states + u] = 0;
    for (int a = J - 1; a >= 0; --a)
      for (int u = 0; u < states; ++u)
        for (int e = a + 1; e <= J; ++e)
          for (int r = 0; r < states; ++r) {
            bool fits = true;
            for (int c = 0; c < C && fits; ++c) fits = decode(u, c) + decode(r, c) <= caps[c];
            if (!fits) continue;
            const double v = std::max(run_time(a, e, r), g[e * states + u + r]);
            if (v < g[a * states + u]) g[a * states + u] = v, choice[a * states + u] = {e, r};
          }
    if (!std::isfinite(g[0])) return false;
    bucket.dp_step_s = g[0];
    // Runs: (first interval, type, count).
    std::vector<std::tuple<int, size_t, int>> runs;
    for (int a = 0, u = 0; a < J;) {
      const auto [e, r] = choice[a * states + u];
      for (int c = 0; c < C; ++c) {
        const ClassBest& b = best[at(a, e, c, decode(r, c))];
        if (b.type >= 0) runs.emplace_back(a, static_cast<size_t>(b.type), b.count);
      }
      a = e, u += r;
    }
    const Strategy s = build(bucket, runs, caps);
    if (!s.pipelines.empty()) {
      bucket.strategy = s;
      return true;
    }
  }
  return false;
}

// Places the runs' pipelines on ranks: per class, stages widest first, each
// on consecutive free ranks of the first node with room. Empty when a class
// cannot place them (its cap is lowered by one in `caps` for a retry).
Strategy BucketPlanner::build(const LengthBucket& bucket, const std::vector<std::tuple<int, size_t, int>>& runs,
                              std::vector<int>& caps) {
  struct Want {
    int a;
    size_t type;
  };
  std::vector<Want> wants;
  for (const auto& [a, type, count] : runs)
    for (int i = 0; i < count; ++i) wants.push_back({a, type});
  std::stable_sort(wants.begin(), wants.end(), [&](const Want& x, const Want& y) {
    return types_[x.type].width() > types_[y.type].width();
  });
  std::vector<std::vector<std::vector<int>>> free_ranks;
  for (const DeviceClass& c : classes_) free_ranks.push_back(c.nodes);
  std::vector<std::tuple<int, Pipeline, size_t>> placed;
  const int L = static_cast<int>(model_.model().num_hidden_layers);
  for (const Want& w : wants) {
    const PipelineType& t = types_[w.type];
    const std::vector<int> layers = even_layers(L, t.pp);
    Pipeline p;
    p.max_seq_len = static_cast<int>(bucket.intervals[w.a].hi);
    p.micro_batch_tokens = p.max_seq_len;
    p.micro_batches = t.pp;
    int first = 0;
    for (int k = 0; k < t.pp; ++k) {
      auto node = std::find_if(free_ranks[t.cls].begin(), free_ranks[t.cls].end(),
                               [&](const std::vector<int>& n) { return static_cast<int>(n.size()) >= t.width(); });
      if (node == free_ranks[t.cls].end()) {
        --caps[t.cls];
        return {};
      }
      Stage st;
      st.ranks.assign(node->begin(), node->begin() + t.width());
      node->erase(node->begin(), node->begin() + t.width());
      st.cp = t.cp;
      st.first_layer = first;
      st.last_layer = first + layers[k] - 1;
      st.recompute = fitted_.at({w.type, bucket.intervals[w.a].hi, share_}).recompute;
      first = st.last_layer + 1;
      p.stages.push_back(st);
    }
    placed.emplace_back(w.a, std::move(p), w.type);
  }
  std::stable_sort(placed.begin(), placed.end(),
                   [](const auto& x, const auto& y) { return std::get<0>(x) < std::get<0>(y); });
  Strategy s;
  s.max_seq_len = static_cast<int>(bucket.max_seq_len);
  s.zero = o_.zero;
  last_types_.clear();
  for (auto& [a, p, type] : placed) s.pipelines.push_back(std::move(p)), last_types_.push_back(type);
  return s;
}

Strategy BucketPlanner::widened(const LengthBucket& bucket) const {
  Strategy s = bucket.strategy;
  for (size_t p = 0; p < s.pipelines.size() && p < last_types_.size(); ++p) {
    Pipeline& pl = s.pipelines[p];
    for (const LengthInterval& x : bucket.intervals) {  // longest first
      if (x.hi <= pl.max_seq_len) break;
      auto it = fitted_.find({last_types_[p], x.hi, share_});
      if (it == fitted_.end() || !it->second.feasible) continue;
      pl.max_seq_len = pl.micro_batch_tokens = static_cast<int>(x.hi);
      for (Stage& st : pl.stages) st.recompute = it->second.recompute;
      break;
    }
  }
  return s;
}

std::vector<std::pair<Strategy, double>> BucketPlanner::homogeneous(const LengthBucket& bucket, int share) {
  share_ = share;
  const int64_t m = bucket.max_seq_len;
  const int L = static_cast<int>(model_.model().num_hidden_layers);
  // One layout (tp, cp, pp) per candidate, whatever the class: its types
  // on every class with a rank, each fitted at m (recomputation only where
  // some class needs it, then on every pipeline).
  std::map<std::tuple<int, int, int>, std::vector<size_t>> layouts;
  for (size_t t = 0; t < types_.size(); ++t) layouts[{types_[t].tp, types_[t].cp, types_[t].pp}].push_back(t);
  std::vector<std::pair<Strategy, double>> out;
  const std::vector<LengthInterval>& iv = bucket.intervals;
  const int J = static_cast<int>(iv.size());
  double pieces = 0, tokens = 0;
  for (const LengthInterval& x : iv) pieces += x.pieces, tokens += x.tokens;
  for (const auto& [key, types] : layouts) {
    bool feasible = true, recompute = false;
    for (size_t t : types) {
      const Fitted& f = fitted(t, m, share);
      feasible = feasible && f.feasible;
      recompute = recompute || (f.feasible && f.recompute);
    }
    if (!feasible) continue;
    const auto [tp, cp, pp] = key;
    const std::vector<int> layers = even_layers(L, pp);
    Strategy s;
    s.max_seq_len = static_cast<int>(m);
    s.zero = o_.zero;
    std::vector<std::pair<size_t, int>> counts;  // (type, pipelines)
    for (size_t t : types) {
      counts.emplace_back(t, 0);
      // As many pipelines as the class's nodes place: stages on consecutive
      // free ranks of the first node with room.
      std::vector<std::vector<int>> free_ranks = classes_[types_[t].cls].nodes;
      while (true) {
        Pipeline p;
        p.max_seq_len = static_cast<int>(m);
        p.micro_batch_tokens = p.max_seq_len;
        p.micro_batches = pp;
        std::vector<std::vector<int>> left = free_ranks;
        int first = 0;
        for (int k = 0; k < pp; ++k) {
          auto node = std::find_if(left.begin(), left.end(),
                                   [&](const std::vector<int>& n) { return static_cast<int>(n.size()) >= tp * cp; });
          if (node == left.end()) break;
          Stage st;
          st.ranks.assign(node->begin(), node->begin() + tp * cp);
          node->erase(node->begin(), node->begin() + tp * cp);
          st.cp = cp;
          st.first_layer = first;
          st.last_layer = first + layers[k] - 1;
          st.recompute = recompute;
          first = st.last_layer + 1;
          p.stages.push_back(st);
        }
        if (static_cast<int>(p.stages.size()) < pp) break;
        free_ranks = std::move(left);
        s.pipelines.push_back(std::move(p));
        ++counts.back().second;
      }
    }
    if (s.pipelines.empty() || (o_.zero && static_cast<int>(s.pipelines.size()) < share)) continue;
    // The expected step: every interval's work shared by rate, at least
    // one piece of m on the fastest pipeline.
    double rate = 0, longest = kInf;
    for (const auto& [t, n] : counts) {
      if (n == 0) continue;
      const Fitted& f = fitted(t, m, share);
      const double micro = std::max(1.0, tokens / (n * static_cast<double>(m)));
      rate += n / (std::max(1e-300, work(f, iv, 0, J)) * (1 + (pp - 1) / micro));
      double one = 0;
      for (const Quadratic& q : f.stages) one = std::max(one, q.at(static_cast<double>(m)));
      longest = std::min(longest, one);
    }
    out.emplace_back(std::move(s), pieces > 0 ? std::max(1 / rate, longest) : 0.0);
  }
  return out;
}

namespace {

// Bucket maxima: L, and for b = 1 .. K-1 the smallest L / 2^j at or above
// the b/K quantile of the steps' longest pieces (nearest rank).
std::vector<int64_t> bucket_maxima(const std::vector<std::vector<int64_t>>& steps, const MixedLengthOptions& o) {
  std::vector<int64_t> longest;
  for (const auto& s : steps) longest.push_back(*std::max_element(s.begin(), s.end()));
  std::sort(longest.begin(), longest.end());
  std::vector<int64_t> out{o.max_seq_len};
  for (int b = 1; b < o.buckets; ++b) {
    const size_t rank = static_cast<size_t>(std::ceil(static_cast<double>(b) / o.buckets * longest.size()));
    const int64_t q = longest[std::max<size_t>(rank, 1) - 1];
    int64_t m = o.max_seq_len;
    while (m / 2 >= q && m / 2 >= 1) m /= 2;
    out.push_back(m);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// Intervals (m/2, m], (m/4, m/2], ..., (0, m/16], longest first; what a
// step of the bucket holds in each: the mean over the bucket's steps, or,
// without any, the pieces of at most m scaled to T tokens.
std::vector<LengthInterval> bucket_intervals(int64_t m, int64_t lo, const std::vector<std::vector<int64_t>>& steps,
                                             const std::vector<int64_t>& pieces, int64_t batch_tokens, int& count) {
  std::vector<int64_t> his;
  for (int j = 0; j < kIntervals && (m >> j) >= 1; ++j)
    if (his.empty() || his.back() != (m >> j)) his.push_back(m >> j);
  std::vector<LengthInterval> iv(his.size());
  for (size_t j = 0; j < his.size(); ++j) iv[j].hi = his[j], iv[j].lo = j + 1 < his.size() ? his[j + 1] : 0;
  auto add = [&](int64_t len, double weight) {
    for (LengthInterval& x : iv)
      if (len > x.lo && len <= x.hi) {
        x.pieces += weight, x.tokens += weight * len, x.squares += weight * static_cast<double>(len) * len;
        return;
      }
  };
  count = 0;
  for (const auto& s : steps) {
    const int64_t longest = *std::max_element(s.begin(), s.end());
    if (longest > lo && longest <= m) ++count;
  }
  if (count > 0) {
    for (const auto& s : steps) {
      const int64_t longest = *std::max_element(s.begin(), s.end());
      if (longest > lo && longest <= m)
        for (int64_t len : s) add(len, 1.0 / count);
    }
    return iv;
  }
  double total = 0;
  for (int64_t len : pieces)
    if (len <= m) total += static_cast<double>(len);
  for (int64_t len : pieces)
    if (len <= m) add(len, static_cast<double>(batch_tokens) / total);
  return iv;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Plans the bucket; under ZeRO again with fewer assumed sharers until the
// strategy has at least as many pipelines as its memory assumed.
bool plan_bucket(BucketPlanner& planner, LengthBucket& b, const MixedLengthOptions& o, int world,
                 const std::vector<int>& min_ranks) {
  int share = o.zero ? world : 1;
  while (true) {
    if (!planner.plan(b, share, min_ranks)) return false;
    const int P = static_cast<int>(b.strategy.pipelines.size());
    if (!o.zero || P >= share) return true;
    share = P;
  }
}

// The per-class least pipeline sizes to plan with: every combination of
// 1, 2, 4, ... up to each class's ranks while there are at most 64, else
// the same least size on every class (1, 2, 4, ... up to the largest class).
std::vector<std::vector<int>> min_rank_sweep(const BucketPlanner& planner) {
  const int C = planner.classes();
  std::vector<std::vector<int>> values(C);
  size_t combos = 1;
  int most = 1;
  for (int c = 0; c < C; ++c) {
    for (int v = 1; v <= planner.class_ranks(c); v *= 2) values[c].push_back(v);
    combos *= values[c].size();
    most = std::max(most, planner.class_ranks(c));
  }
  std::vector<std::vector<int>> out;
  if (combos > 64) {
    for (int v = 1; v <= most; v *= 2) out.emplace_back(C, v);
    return out;
  }
  std::vector<size_t> at(C, 0);
  while (true) {
    std::vector<int> v(C);
    for (int c = 0; c < C; ++c) v[c] = values[c][at[c]];
    out.push_back(std::move(v));
    int c = 0;
    while (c < C && ++at[c] == values[c].size()) at[c] = 0, ++c;
    if (c == C) return out;
  }
}

void score_bucket(const CostModel& model, LengthBucket& b, const std::vector<std::vector<int64_t>>& steps, int64_t lo,
                  DispatchRule rule) {
  b.sync_s = token_step_sync_seconds(model, b.strategy);
  std::vector<double> times;
  for (const auto& s : steps) {
    const int64_t top = *std::max_element(s.begin(), s.end());
    if (top > lo && top <= b.max_seq_len) times.push_back(predict_token_step(model, b.strategy, s, rule) + b.sync_s);
  }
  b.predicted_step_s = times.empty() ? b.dp_step_s + b.sync_s : median(times);
}

// The options against the length file, in the order they are checked.
void check_mixed_length_options(const std::vector<int64_t>& pieces, const MixedLengthOptions& o) {
  if (o.max_seq_len < 1) fail("[search] ", option_name("max_seq_len"), " must be >= 1, got ", o.max_seq_len);
  if (o.buckets < 1) fail("[search] ", option_name("buckets"), " must be >= 1, got ", o.buckets);
  if (o.max_cp < 0) fail("[search] ", option_name("max_cp"), " must be >= 0, got ", o.max_cp);
  if (pieces.empty()) fail("[search] the length file holds no piece");
  const int64_t longest = *std::max_element(pieces.begin(), pieces.end());
  if (longest > o.max_seq_len) fail("[search] a piece of ", longest, " tokens is longer than ", option_name("max_seq_len"), " ", o.max_seq_len);
  if (o.batch_tokens < o.max_seq_len)
    fail("[search] ", option_name("batch_tokens"), " ", o.batch_tokens, " is smaller than ", option_name("max_seq_len"), " ", o.max_seq_len,
         " (a step must hold the longest piece)");
}

// One bucket's search: the best candidate so far by its full prediction
// over the bucket's steps (longest piece in (lo, best.max_seq_len]). A new
// candidate starts as a copy of the best so far.
struct BucketSearch {
  const CostModel& model;
  const std::vector<std::vector<int64_t>>& steps;
  int64_t lo;
  DispatchRule rule;
  LengthBucket best;
  bool any = false;

  void keep(LengthBucket& cand) {
    score_bucket(model, cand, steps, lo, rule);
    if (!any || cand.predicted_step_s < best.predicted_step_s) best = std::move(cand);
    any = true;
  }
};

// --homogeneous: every layout that fits, as many pipelines as place, each
// scored by its full prediction over the bucket's steps (under ZeRO the
// memory assumes the layout's own pipeline count).
void search_homogeneous(BucketPlanner& planner, int ranks, const MixedLengthOptions& o, BucketSearch& search) {
  for (int share = o.zero ? 1 : ranks; share <= ranks; ++share)
    for (auto& [s, expected] : planner.homogeneous(search.best, share)) {
      if (o.zero && static_cast<int>(s.pipelines.size()) != share) continue;
      LengthBucket cand = search.best;
      cand.strategy = std::move(s);
      cand.dp_step_s = expected;
      search.keep(cand);
    }
}

// The program leaves out the gradient sync and the optimizer, which fall
// as pipelines get more ranks (fewer replicas, smaller shards) and cost
// more on a slower class: plans from pipelines of at least 1, 2, 4, ...
// ranks, that least per class (a slow class may want wider pipelines than a
// fast one), are compared by their full prediction over the bucket's steps.
void search_min_ranks(BucketPlanner& planner, int ranks, const MixedLengthOptions& o, BucketSearch& search) {
  for (const std::vector<int>& min_ranks : min_rank_sweep(planner)) {
    LengthBucket cand = search.best;
    if (!plan_bucket(planner, cand, o, ranks, min_ranks)) continue;
    LengthBucket wide = cand;
    wide.strategy = planner.widened(cand);
    search.keep(cand);
    search.keep(wide);
  }
}

// The bucket of pieces up to m (its steps' longest in (lo, m]) with its
// best strategy.
LengthBucket plan_length_bucket(const CostModel& model, const MixedLengthOptions& o,
                                const std::vector<DeviceClass>& classes, const std::vector<std::vector<int64_t>>& steps,
                                const std::vector<int64_t>& pieces, int64_t m, int64_t lo) {
  BucketSearch search{model, steps, lo, o.dispatch, LengthBucket{}};
  search.best.max_seq_len = m;
  search.best.intervals = bucket_intervals(m, lo, steps, pieces, o.batch_tokens, search.best.steps);
  // On every device class, and with several classes also on each class
  // alone: the programs leave out the gradient sync and the optimizer, on
  // which a slow class can cost more than its pipelines save.
  std::vector<std::vector<DeviceClass>> class_sets = {classes};
  if (classes.size() > 1)
    for (const DeviceClass& c : classes) class_sets.push_back({c});
  for (const std::vector<DeviceClass>& set : class_sets) {
    BucketPlanner planner(model, o, set);
    int ranks = 0;
    for (const DeviceClass& c : set) ranks += c.ranks;
    if (o.homogeneous) search_homogeneous(planner, ranks, o, search);
    else search_min_ranks(planner, ranks, o, search);
  }
  if (!search.any)
    fail("[search] no pipeline holds a micro-batch of ", m, " tokens in memory (tp x cp up to a node, up to 16 "
         "stages", o.allow_recompute ? ", with recomputation" : "", ", ",
         model.capacity_bytes(classes.front().nodes.front().front()) / (1 << 30), " GiB on rank ",
         classes.front().nodes.front().front(), o.unavailable.empty() ? "" : ", failed ranks left out", ")");
  return std::move(search.best);
}

// Per step of the file: its longest piece, tokens, and its predicted time
// on each bucket's strategy that accepts it.
std::vector<StepPrediction> predict_steps(const CostModel& model, const std::vector<LengthBucket>& buckets,
                                          const std::vector<std::vector<int64_t>>& steps, DispatchRule rule) {
  std::vector<StepPrediction> out;
  for (const auto& st : steps) {
    StepPrediction sp;
    for (int64_t len : st) sp.longest = std::max(sp.longest, len), sp.tokens += len;
    for (const LengthBucket& b : buckets)
      sp.bucket_s.push_back(sp.longest <= b.max_seq_len ? predict_token_step(model, b.strategy, st, rule) + b.sync_s
                                                         : -1.0);
    out.push_back(std::move(sp));
  }
  return out;
}

}  // namespace

MixedLengthPlan plan_mixed_lengths(const CostModel& model, const std::vector<int64_t>& pieces,
                                   const MixedLengthOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  check_mixed_length_options(pieces, o);
  MixedLengthPlan plan;
  plan.pieces = static_cast<int64_t>(pieces.size());
  const auto steps = token_steps(pieces, o.batch_tokens);
  plan.steps = static_cast<int64_t>(steps.size());
  const std::vector<DeviceClass> classes = device_classes(model, o.unavailable);
  int available = 0;
  for (const DeviceClass& c : classes) available += c.ranks;
  if (available == 0) fail("[search] no available rank: every rank of the cluster is unavailable");
  int64_t lo = 0;
  for (int64_t m : bucket_maxima(steps, o)) {
    plan.buckets.push_back(plan_length_bucket(model, o, classes, steps, pieces, m, lo));
    lo = m;
  }
  plan.step_predictions = predict_steps(model, plan.buckets, steps, o.dispatch);
  plan.planning_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return plan;
}

nlohmann::json MixedLengthPlan::to_json() const {
  nlohmann::json bs = nlohmann::json::array();
  for (const LengthBucket& b : buckets) {
    nlohmann::json iv = nlohmann::json::array();
    for (const LengthInterval& x : b.intervals)
      iv.push_back({{"lo", x.lo}, {"hi", x.hi}, {"pieces_per_step", x.pieces}, {"tokens_per_step", x.tokens}});
    bs.push_back({{"max_seq_len", b.max_seq_len},
                  {"steps", b.steps},
                  {"intervals", iv},
                  {"dp_step_s", b.dp_step_s},
                  {"sync_s", b.sync_s},
                  {"predicted_step_s", b.predicted_step_s},
                  {"strategy", hspmd::to_json(b.strategy)}});
  }
  nlohmann::json per_step = nlohmann::json::array();
  for (const StepPrediction& sp : step_predictions)
    per_step.push_back({{"longest", sp.longest}, {"tokens", sp.tokens}, {"bucket_s", sp.bucket_s}});
  return {{"pieces", pieces}, {"steps", steps}, {"buckets", bs}, {"planning_s", planning_s}, {"step_predictions", per_step}};
}

}  // namespace hspmd

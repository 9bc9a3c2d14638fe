// deduce_by_dims: the einsum-style rule most ops use (DimRule). One tier at a
// time: the bottom tier per subgroup on the local-form DistStates, then the
// top tier with hdim as one key over the subgroups. Devices are enumerated
// (a subgroup has at most a few hundred), so every conclusion is checked on
// every device position rather than assumed from the keys' names.
#include <algorithm>
#include <numeric>
#include <set>

#include "hspmd/deduce/deduce.h"

namespace hspmd {

namespace {

// One tier: `n` device positions (devices of a subgroup, or subgroups) and
// the inputs' states over them.
struct Tier {
  bool top = false;
  int n = 1;
  std::vector<DistStates> in;
  std::string desc;  // " in subgroup 1" / " across subgroups"
};

// Where a label was first seen, and its degree.
struct LabelInfo {
  int degree = 1;
  int input = -1;
  int dim = -1;
};

class TierSolver {
 public:
  TierSolver(const DeduceContext& ctx, const DimRule& rule, const Tier& tier)
      : ctx_(ctx), rule_(rule), tier_(tier) {}

  std::vector<DistStates> solve() {
    check_partials();
    collect_degrees();
    collect_coordinates();
    std::vector<DistStates> out;
    for (int o = 0; o < static_cast<int>(rule_.outputs.size()); ++o) out.push_back(solve_output(o));
    return out;
  }

 private:
  std::string input_desc(int i) const {
    std::string s = "input " + std::to_string(i);
    if (i < static_cast<int>(rule_.input_names.size()) && !rule_.input_names[i].empty())
      s += " (" + rule_.input_names[i] + ")";
    return s;
  }
  const std::vector<std::string>& labels_of(int i) const { return rule_.inputs[i]; }
  bool linear(int i) const { return i < static_cast<int>(rule_.linear.size()) && rule_.linear[i]; }
  bool layout_only(int i) const {
    return i < static_cast<int>(rule_.layout_only.size()) && rule_.layout_only[i];
  }

  void check_partials();
  void collect_degrees();
  void collect_coordinates();
  DistStates solve_output(int o) const;
  std::vector<std::string> sum_labels_of(int o) const;
  std::vector<std::vector<int>> candidate_orders(int o, const std::vector<int>& keys,
                                                 const std::vector<std::string>& sums) const;
  bool order_fits(const DistStates& s, const std::vector<std::vector<int>>& chunk,
                  const std::vector<std::vector<int>>& identity) const;

  const DeduceContext& ctx_;
  const DimRule& rule_;
  const Tier& tier_;
  std::map<std::string, LabelInfo> labels_;
  std::vector<std::map<std::string, int>> coords_;  // per position: label -> chunk
  int partial_input_ = -1;
  std::vector<int> partial_coord_;  // per position, of partial_input_
};

void TierSolver::check_partials() {
  for (int i = 0; i < static_cast<int>(tier_.in.size()); ++i) {
    if (!tier_.in[i].has_partial() || layout_only(i)) continue;
    if (!linear(i)) fail_at(ctx_, "input ", i, " is partial; insert a Reshard to reduce it first");
    if (partial_input_ >= 0)
      fail_at(ctx_, "inputs ", partial_input_, " and ", i, " are both partial", tier_.desc,
              "; the op is not linear in both at once: insert a Reshard to reduce one first");
    partial_input_ = i;
  }
}

void TierSolver::collect_degrees() {
  for (int i = 0; i < static_cast<int>(tier_.in.size()); ++i) {
    const auto& labels = labels_of(i);
    for (int d : tier_.in[i].split_dims())
      HSPMD_CHECK(d < static_cast<int>(labels.size()), ctx_.where(), ": the rule labels ",
                  labels.size(), " dims of input ", i, ", which is split along dim ", d);
    for (int d = 0; d < static_cast<int>(labels.size()); ++d) {
      const std::string& label = labels[d];
      if (label.empty()) continue;
      const int degree = tier_.in[i].degree(split_key(d));
      auto why = rule_.unsplittable.find(label);
      if (degree > 1 && why != rule_.unsplittable.end())
        fail_at(ctx_, input_desc(i), " is split along dim ", d, tier_.desc, ", but ", why->second,
                "; insert a Reshard");
      auto [it, fresh] = labels_.emplace(label, LabelInfo{degree, i, d});
      if (!fresh && it->second.degree != degree)
        fail_at(ctx_, input_desc(it->second.input), " splits dim ", it->second.dim, " by ",
                it->second.degree, " but ", input_desc(i), " splits dim ", d, " by ", degree,
                tier_.desc, "; their chunks do not line up: insert a Reshard");
    }
  }
}

void TierSolver::collect_coordinates() {
  coords_.assign(tier_.n, {});
  partial_coord_.assign(tier_.n, 0);
  std::map<std::string, int> first;  // label -> input that set the coordinate
  for (int p = 0; p < tier_.n; ++p) {
    for (int i = 0; i < static_cast<int>(tier_.in.size()); ++i) {
      const DistStates& s = tier_.in[i];
      const auto& labels = labels_of(i);
      for (int d = 0; d < static_cast<int>(labels.size()); ++d) {
        if (labels[d].empty() || s.degree(split_key(d)) <= 1) continue;
        const int c = s.coordinate(p, split_key(d));
        auto [it, fresh] = coords_[p].emplace(labels[d], c);
        if (fresh) first[labels[d]] = i;
        if (!fresh && it->second != c)
          fail_at(ctx_, "inputs ", first[labels[d]], " and ", i, " order their devices differently",
                  tier_.desc, ": position ", p, " holds chunk ", it->second, " of dim ",
                  labels_.at(labels[d]).dim, " of input ", first[labels[d]], " but chunk ", c,
                  " of dim ", d, " of input ", i, "; insert a Reshard");
      }
    }
    if (partial_input_ >= 0) partial_coord_[p] = tier_.in[partial_input_].coordinate(p, kPartial);
  }
}

// Split labels that output `o` lacks and sums over (checked: the others are
// collective, or errors).
std::vector<std::string> TierSolver::sum_labels_of(int o) const {
  const auto& out = rule_.outputs[o];
  std::vector<std::string> sums;
  for (const auto& [label, info] : labels_) {
    if (info.degree <= 1 || std::find(out.begin(), out.end(), label) != out.end()) continue;
    auto it = rule_.reductions.find(label);
    const Reduction r = it == rule_.reductions.end() ? Reduction::kForbidden : it->second;
    if (r == Reduction::kForbidden)
      fail_at(ctx_, input_desc(info.input), " is split along dim ", info.dim, tier_.desc,
              ", which output ", o, " does not keep; insert a Reshard to gather it first");
    if (r == Reduction::kCollective && tier_.top)
      fail_at(ctx_, input_desc(info.input), " is split along dim ", info.dim,
              " across subgroups, but the op reduces over it only inside a subgroup; insert a "
              "Reshard");
    if (r == Reduction::kSum) sums.push_back(label);
  }
  return sums;
}

DistStates TierSolver::solve_output(int o) const {
  const auto& out = rule_.outputs[o];
  const std::vector<std::string> sums = sum_labels_of(o);

  DistStates result;
  int splits = 1, partial = partial_input_ >= 0 ? tier_.in[partial_input_].degree(kPartial) : 1;
  std::vector<int> split_dims;
  for (int d = 0; d < static_cast<int>(out.size()); ++d) {
    auto it = labels_.find(out[d]);
    if (it == labels_.end() || it->second.degree <= 1) continue;
    result.degrees[split_key(d)] = it->second.degree;
    splits *= it->second.degree;
    split_dims.push_back(d);
  }
  for (const auto& l : sums) partial *= labels_.at(l).degree;
  // Per position: the output chunk, and which partial term it holds.
  std::vector<std::vector<int>> chunk(tier_.n), identity(tier_.n);
  std::map<std::vector<int>, std::set<std::vector<int>>> terms;
  for (int p = 0; p < tier_.n; ++p) {
    for (int d : split_dims) chunk[p].push_back(coords_[p].at(out[d]));
    for (const auto& l : sums) identity[p].push_back(coords_[p].at(l));
    identity[p].push_back(partial_coord_[p]);
    terms[chunk[p]].insert(identity[p]);
  }
  bool complete = static_cast<int>(terms.size()) == splits && tier_.n % (splits * partial) == 0;
  for (const auto& [c, ids] : terms) complete = complete && static_cast<int>(ids.size()) == partial;
  if (!complete)
    fail_at(ctx_, "the inputs' shardings", tier_.desc, " do not combine into one layout of output ",
            o, ": no device would compute some of its chunks or partial terms; insert a Reshard");
  if (partial > 1) result.degrees[kPartial] = partial;
  if (tier_.n / (splits * partial) > 1) result.degrees[kDup] = tier_.n / (splits * partial);

  std::vector<int> keys;
  for (const auto& [key, degree] : result.degrees) keys.push_back(key);
  for (const auto& order : candidate_orders(o, keys, sums)) {
    result.order = order;
    if (order_fits(result, chunk, identity)) return result;
  }
  fail_at(ctx_, "no device order", tier_.desc, " gives output ", o,
          " the chunks its devices compute; insert a Reshard");
}

// Each input's order mapped to the output's keys (split(d) of a kept label ->
// the output's split, of a summed label -> partial, others -> dup), then
// every permutation of the keys.
std::vector<std::vector<int>> TierSolver::candidate_orders(
    int o, const std::vector<int>& keys, const std::vector<std::string>& sums) const {
  const auto& out = rule_.outputs[o];
  const std::set<std::string> summed(sums.begin(), sums.end());
  auto map_key = [&](int i, int key) {
    if (key < 0) return key;
    const std::string& label = key < static_cast<int>(labels_of(i).size()) ? labels_of(i)[key] : "";
    auto it = std::find(out.begin(), out.end(), label);
    if (!label.empty() && it != out.end()) return static_cast<int>(it - out.begin());
    return summed.count(label) ? kPartial : kDup;
  };
  std::vector<std::vector<int>> candidates;
  for (int i = 0; i < static_cast<int>(tier_.in.size()); ++i) {
    std::vector<int> order;
    for (int key : tier_.in[i].order) {
      const int k = map_key(i, key);
      if (std::find(keys.begin(), keys.end(), k) != keys.end() &&
          std::find(order.begin(), order.end(), k) == order.end())
        order.push_back(k);
    }
    for (int k : keys)
      if (std::find(order.begin(), order.end(), k) == order.end()) order.push_back(k);
    candidates.push_back(order);
  }
  std::vector<int> perm = keys;
  std::sort(perm.begin(), perm.end());
  do candidates.push_back(perm);
  while (std::next_permutation(perm.begin(), perm.end()));
  return candidates;
}

// Whether `s` puts the right chunk on every position, and its partial digit
// names one partial term per chunk consistently (both ways).
bool TierSolver::order_fits(const DistStates& s, const std::vector<std::vector<int>>& chunk,
                            const std::vector<std::vector<int>>& identity) const {
  std::vector<int> split_keys;
  for (const auto& [key, degree] : s.degrees)
    if (key >= 0) split_keys.push_back(key);
  std::map<std::vector<int>, std::vector<int>> term_of_digit, digit_of_term;
  for (int p = 0; p < tier_.n; ++p) {
    const std::vector<int> digits = s.coordinates(p);
    auto digit = [&](int key) {
      auto it = std::find(s.order.begin(), s.order.end(), key);
      return it == s.order.end() ? 0 : digits[it - s.order.begin()];
    };
    for (size_t j = 0; j < split_keys.size(); ++j)
      if (digit(split_keys[j]) != chunk[p][j]) return false;
    std::vector<int> by_digit = chunk[p], by_term = chunk[p];
    by_digit.push_back(digit(kPartial));
    by_term.insert(by_term.end(), identity[p].begin(), identity[p].end());
    auto [a, fresh_a] = term_of_digit.emplace(by_digit, identity[p]);
    auto [b, fresh_b] = digit_of_term.emplace(by_term, std::vector<int>{digit(kPartial)});
    if (a->second != identity[p] || b->second[0] != digit(kPartial)) return false;
  }
  return true;
}

// Field by field (DistStates::operator== also equates trivial degrees).
bool identical(const std::vector<DistStates>& a, const std::vector<DistStates>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].degrees != b[i].degrees || a[i].order != b[i].order) return false;
  return true;
}

DistStates top_states(const Annotation& a) {
  if (a.hsize() <= 1) return {};
  return DistStates{{{a.hdim, a.hsize()}}, {a.hdim}};
}

int hdim_of(const DistStates& s) {
  for (const auto& [key, degree] : s.degrees)
    if (degree > 1) return key == kPartial ? kPartial : key;
  return kDup;
}

std::vector<int64_t> reduced(const std::vector<int64_t>& w, int hsize) {
  std::vector<int64_t> out = w.empty() ? std::vector<int64_t>(hsize, 1) : w;
  const int64_t g = std::accumulate(out.begin(), out.end(), int64_t{0},
                                    [](int64_t a, int64_t b) { return std::gcd(a, b); });
  for (int64_t& x : out) x /= g;
  return out;
}

std::string weights_str(const std::vector<int64_t>& w) {
  std::string s = "[";
  for (size_t i = 0; i < w.size(); ++i) s += (i ? ", " : "") + std::to_string(w[i]);
  return s + "]";
}

// Part weights of each top-tier split label; inputs sharing one must agree.
std::map<std::string, std::vector<int64_t>> label_weights(const DeduceContext& ctx,
                                                          const DimRule& rule,
                                                          const std::vector<Annotation>& in) {
  std::map<std::string, std::vector<int64_t>> weights;
  std::map<std::string, int> source;
  for (int i = 0; i < static_cast<int>(in.size()); ++i) {
    const Annotation& a = in[i];
    if (a.hsize() <= 1 || a.hdim < 0 || a.hdim >= static_cast<int>(rule.inputs[i].size())) continue;
    const std::string& label = rule.inputs[i][a.hdim];
    if (label.empty()) continue;
    auto [it, fresh] = weights.emplace(label, a.part_weights);
    if (fresh) {
      source[label] = i;
    } else if (reduced(it->second, a.hsize()) != reduced(a.part_weights, a.hsize())) {
      fail_at(ctx, "inputs ", source[label], " and ", i,
              " cut the same dim across subgroups in different proportions ",
              weights_str(reduced(it->second, a.hsize())), " vs ",
              weights_str(reduced(a.part_weights, a.hsize())), "; insert a Reshard");
    }
  }
  return weights;
}

}  // namespace

std::vector<Annotation> deduce_by_dims(const DeduceContext& ctx, const DimRule& rule,
                                       const std::vector<Annotation>& inputs) {
  HSPMD_CHECK(!inputs.empty() && rule.inputs.size() == inputs.size(), ctx.where(), ": rule has ",
              rule.inputs.size(), " inputs, got ", inputs.size());
  const Annotation& first = inputs[0];
  std::vector<Annotation> out(rule.outputs.size());
  for (auto& a : out) a.subgroups.resize(first.hsize());

  // Subgroups with the same device count and input states (the pipelines'
  // copies of one stage) solve alike: each distinct tier is solved once.
  std::vector<std::pair<Tier, std::vector<DistStates>>> solved;
  for (int g = 0; g < first.hsize(); ++g) {
    Tier tier{false,
              first.subgroups[g].devices.size(),
              {},
              first.hsize() > 1 ? " in subgroup " + std::to_string(g) : ""};
    for (const Annotation& a : inputs) tier.in.push_back(a.subgroups[g].states);
    auto same = [&](const auto& s) { return s.first.n == tier.n && identical(s.first.in, tier.in); };
    auto it = std::find_if(solved.begin(), solved.end(), same);
    if (it == solved.end()) {
      std::vector<DistStates> states = TierSolver(ctx, rule, tier).solve();
      it = solved.insert(solved.end(), {std::move(tier), std::move(states)});
    }
    for (size_t o = 0; o < out.size(); ++o)
      out[o].subgroups[g] = Subgroup{first.subgroups[g].devices, it->second[o]};
  }

  Tier top{true, first.hsize(), {}, " across subgroups"};
  for (const Annotation& a : inputs) top.in.push_back(top_states(a));
  std::vector<DistStates> states = TierSolver(ctx, rule, top).solve();
  const auto weights = label_weights(ctx, rule, inputs);
  for (size_t o = 0; o < out.size(); ++o) {
    out[o].hdim = first.hsize() > 1 ? hdim_of(states[o]) : kDup;
    if (out[o].hdim >= 0) out[o].part_weights = weights.at(rule.outputs[o][out[o].hdim]);
  }
  return out;
}

}  // namespace hspmd

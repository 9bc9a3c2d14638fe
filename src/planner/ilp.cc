#include "hspmd/planner/ilp.h"

#include <coin/Cbc_C_Interface.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <utility>

#include "hspmd/core/error.h"

namespace hspmd {

namespace {

// The shape both programs share: member i takes an integer count n_i in
// [lo_i, hi_i], sum_i weight_i * n_i = total, and costs
// time_i(n) = fixed_i + slope_i * n (slope_i >= 0); minimise max_i time_i(n_i).
struct MinMax {
  std::vector<int> weight, lo, hi;
  std::vector<double> fixed, slope;
  int total = 0;

  int size() const { return static_cast<int>(weight.size()); }
  double time(int i, int n) const { return fixed[i] + slope[i] * n; }
  double max_time(const std::vector<int>& n) const {
    double t = 0;
    for (int i = 0; i < size(); ++i) t = std::max(t, time(i, n[i]));
    return t;
  }
};

struct Allocation {
  bool feasible = false;
  std::vector<int> counts;
  bool optimal = true;
};

// ---------------------------------------------------------------------------
// Reachability: which sums sum_i weight_i * n_i, lo_i <= n_i <= upper_i, exist.

// table[i][s] != 0 when members [0, i) reach s exactly. Each member is one
// sliding-window pass per residue class mod its weight, O(members * total).
std::vector<std::vector<uint8_t>> reach_tables(const MinMax& m, const std::vector<int>& upper) {
  const int total = m.total;
  std::vector<std::vector<uint8_t>> table(m.size() + 1, std::vector<uint8_t>(total + 1, 0));
  table[0][0] = 1;
  std::vector<int> prefix;
  for (int i = 0; i < m.size(); ++i) {
    const int w = m.weight[i], lo = m.lo[i], hi = std::min(upper[i], total / w);
    if (lo > hi) continue;  // nothing reachable past member i
    for (int r = 0; r < w && r <= total; ++r) {
      const int len = (total - r) / w + 1;  // positions s = r + w * j
      prefix.assign(len + 1, 0);
      for (int j = 0; j < len; ++j) prefix[j + 1] = prefix[j] + table[i][r + w * j];
      // s = r + w*j is reached when some j - n, n in [lo, hi], was reached before.
      for (int j = lo; j < len; ++j) {
        const int from = std::max(0, j - hi), to = j - lo;
        table[i + 1][r + w * j] = prefix[to + 1] - prefix[from] > 0;
      }
    }
  }
  return table;
}

// Counts reaching m.total under `upper`, taking for each member from the last
// the largest count that keeps the rest reachable; empty when none exists.
std::vector<int> reach_total(const MinMax& m, const std::vector<int>& upper) {
  const auto table = reach_tables(m, upper);
  if (!table.back()[m.total]) return {};
  std::vector<int> counts(m.size());
  int s = m.total;
  for (int i = m.size() - 1; i >= 0; --i) {
    int n = std::min(upper[i], s / m.weight[i]);
    while (n >= m.lo[i] && !table[i][s - m.weight[i] * n]) --n;
    HSPMD_CHECK(n >= m.lo[i], "reachability backtrack");
    counts[i] = n;
    s -= m.weight[i] * n;
  }
  return counts;
}

// ---------------------------------------------------------------------------
// The exact fast path.

// Equal weights: hand out the units above the lower bounds one at a time to
// the member whose time after taking it is smallest (ties: lowest index).
// The result selects the smallest increments of a family of nondecreasing
// sequences, so no assignment has a smaller maximum.
std::vector<int> exact_greedy(const MinMax& m) {
  const int w = m.weight[0];
  std::vector<int> counts = m.lo;
  int64_t left = m.total / w;
  for (int c : counts) left -= c;
  using Entry = std::pair<double, int>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> next;
  for (int i = 0; i < m.size(); ++i)
    if (counts[i] < m.hi[i]) next.emplace(m.time(i, counts[i] + 1), i);
  for (; left > 0; --left) {
    HSPMD_CHECK(!next.empty(), "greedy ran out of room");
    const int i = next.top().second;
    next.pop();
    if (++counts[i] < m.hi[i]) next.emplace(m.time(i, counts[i] + 1), i);
  }
  return counts;
}

// The largest count of member i whose time is <= t (lo - 1 when none).
int count_within(const MinMax& m, int i, double t) {
  int a = m.lo[i] - 1, b = m.hi[i];  // time(a) <= t is the invariant (a = lo - 1: vacuous)
  while (a < b) {
    const int mid = a + (b - a + 1) / 2;
    if (m.time(i, mid) <= t) a = mid; else b = mid - 1;
  }
  return a;
}

// Any weights: the optimum is one of the values time_i(n); binary search the
// smallest such T whose per-member limits count_within(T) still reach total.
std::vector<int> exact_parametric(const MinMax& m) {
  std::vector<double> candidates;
  for (int i = 0; i < m.size(); ++i)
    for (int n = m.lo[i]; n <= m.hi[i]; ++n) candidates.push_back(m.time(i, n));
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  auto limits = [&](double t) {
    std::vector<int> upper(m.size());
    for (int i = 0; i < m.size(); ++i) upper[i] = count_within(m, i, t);
    return upper;
  };
  size_t a = 0, b = candidates.size() - 1;  // candidates[b] is feasible (all of [lo, hi])
  while (a < b) {
    const size_t mid = a + (b - a) / 2;
    if (!reach_total(m, limits(candidates[mid])).empty()) b = mid; else a = mid + 1;
  }
  return reach_total(m, limits(candidates[a]));
}

std::vector<int> solve_exact(const MinMax& m) {
  const bool equal = std::all_of(m.weight.begin(), m.weight.end(),
                                 [&](int w) { return w == m.weight[0]; });
  return equal ? exact_greedy(m) : exact_parametric(m);
}

// ---------------------------------------------------------------------------
// CBC.

struct CbcDeleter {
  void operator()(Cbc_Model* model) const { Cbc_deleteModel(model); }
};
using CbcModelPtr = std::unique_ptr<Cbc_Model, CbcDeleter>;

// Cbc_solve runs CBC's command-line driver, which is not documented as
// reentrant; one model solves at a time.
std::mutex& cbc_mutex() {
  static std::mutex mutex;
  return mutex;
}

// A time of the order of the optimum (each member at an even share of the
// total), so that the scaled objective is near 1 and CBC's absolute
// tolerances are relative ones.
double time_scale(const MinMax& m) {
  double t = 0;
  for (int i = 0; i < m.size(); ++i) {
    const int64_t share = (int64_t{m.total} + m.weight[i] * m.size() - 1) / (int64_t{m.weight[i]} * m.size());
    const int n = static_cast<int>(std::clamp<int64_t>(share, m.lo[i], std::max(m.lo[i], m.hi[i])));
    t = std::max(t, m.time(i, n));
  }
  return t > 0 ? t : 1.0;
}

// Columns n_0..n_{P-1} (integer, [lo, hi]) and T (continuous, >= 0);
// rows: sum weight * n = total, and slope_i * n_i - T <= -fixed_i (scaled).
CbcModelPtr build_cbc_model(const MinMax& m, double time_limit_s) {
  CbcModelPtr model(Cbc_newModel());
  Cbc_setLogLevel(model.get(), 0);
  Cbc_setMaximumSeconds(model.get(), time_limit_s);
  // Stop only at a proven optimum: no absolute, relative or improvement slack.
  Cbc_setParameter(model.get(), "allowableGap", "0");
  Cbc_setParameter(model.get(), "ratioGap", "0");
  Cbc_setParameter(model.get(), "increment", "1e-12");
  // A few columns with a tight relaxation: branching alone closes the gap, and
  // presolve, preprocessing, cuts and heuristics would cost more than they save.
  for (const char* stage : {"presolve", "preprocess", "cuts", "heuristicsOnOff"})
    Cbc_setParameter(model.get(), stage, "off");
  const int p = m.size(), t_col = p;
  for (int i = 0; i < p; ++i) Cbc_addCol(model.get(), "", m.lo[i], m.hi[i], 0.0, 1, 0, nullptr, nullptr);
  Cbc_addCol(model.get(), "", 0.0, std::numeric_limits<double>::max(), 1.0, 0, 0, nullptr, nullptr);

  std::vector<int> cols(p);
  std::vector<double> coefs(p);
  for (int i = 0; i < p; ++i) cols[i] = i, coefs[i] = m.weight[i];
  Cbc_addRow(model.get(), "", p, cols.data(), coefs.data(), 'E', m.total);
  const double scale = 1.0 / time_scale(m);
  for (int i = 0; i < p; ++i) {
    const int row_cols[2] = {t_col, i};
    const double row_coefs[2] = {-1.0, m.slope[i] * scale};
    Cbc_addRow(model.get(), "", m.slope[i] > 0 ? 2 : 1, row_cols, row_coefs, 'L', -m.fixed[i] * scale);
  }
  return model;
}

// Solves with CBC. When the time limit stops CBC before its first integer
// solution, the fast path answers (still optimal = false: CBC proved nothing).
Allocation solve_cbc(const MinMax& m, double time_limit_s) {
  std::lock_guard<std::mutex> lock(cbc_mutex());
  CbcModelPtr model = build_cbc_model(m, time_limit_s);
  Cbc_solve(model.get());
  const double* best = Cbc_bestSolution(model.get());
  if (!best) {
    HSPMD_CHECK(!Cbc_isProvenInfeasible(model.get()), "CBC calls a feasible program infeasible");
    return {true, solve_exact(m), false};
  }
  Allocation out{true, std::vector<int>(m.size()), Cbc_isProvenOptimal(model.get()) != 0};
  int64_t sum = 0;
  for (int i = 0; i < m.size(); ++i) {
    out.counts[i] = static_cast<int>(std::lround(best[i]));
    HSPMD_CHECK(out.counts[i] >= m.lo[i] && out.counts[i] <= m.hi[i], "CBC column ", i, " out of bounds");
    sum += int64_t{m.weight[i]} * out.counts[i];
  }
  HSPMD_CHECK(sum == m.total, "CBC solution sums to ", sum, ", not ", m.total);
  return out;
}

// Feasibility from the data first; one member or no freedom needs no solver.
Allocation solve(const MinMax& m, IlpSolver solver, double time_limit_s) {
  std::vector<int> any = reach_total(m, m.hi);
  if (any.empty()) return {};
  int64_t at_lo = 0;
  for (int i = 0; i < m.size(); ++i) at_lo += int64_t{m.weight[i]} * m.lo[i];
  if (m.size() == 1 || at_lo == m.total) return {true, any, true};
  if (solver == IlpSolver::kExact) return {true, solve_exact(m), true};
  return solve_cbc(m, time_limit_s);
}

// ---------------------------------------------------------------------------
// Exhaustive enumeration.

// Calls visit(n) for every n with lo_i <= n_i <= hi_i and
// sum_i weight_i * n_i = total, in lexicographic order.
void enumerate(const std::vector<int>& weight, const std::vector<int>& lo, const std::vector<int>& hi,
               int total, const std::function<void(const std::vector<int>&)>& visit) {
  std::vector<int> n(weight.size());
  std::function<void(size_t, int64_t)> rec = [&](size_t i, int64_t left) {
    if (i + 1 == weight.size()) {
      if (left % weight[i] != 0) return;
      const int64_t last = left / weight[i];
      if (last < lo[i] || last > hi[i]) return;
      n[i] = static_cast<int>(last);
      visit(n);
      return;
    }
    for (int c = lo[i]; c <= hi[i] && int64_t{weight[i]} * c <= left; ++c) {
      n[i] = c;
      rec(i + 1, left - int64_t{weight[i]} * c);
    }
  };
  rec(0, total);
}

// ---------------------------------------------------------------------------
// Validation and the layer-specific parts.

void check_time_limit(double time_limit_s) {
  if (!(time_limit_s > 0)) fail("[ilp] time_limit_s=", time_limit_s, " is not positive");
}

void check_amount(const char* what, int index, const char* field, double value) {
  if (!(value >= 0) || !std::isfinite(value))
    fail("[ilp] ", what, " ", index, ": ", field, "=", value, " is negative or not finite");
}

void validate_layers(const std::vector<LayerStage>& stages, int num_layers) {
  if (stages.empty()) fail("[ilp] assign_layers: no stages");
  if (num_layers < 1) fail("[ilp] num_layers=", num_layers, " is not positive");
  int64_t min_sum = 0;
  for (size_t k = 0; k < stages.size(); ++k) {
    const LayerStage& s = stages[k];
    const int i = static_cast<int>(k);
    check_amount("stage", i, "time_per_layer", s.time_per_layer);
    check_amount("stage", i, "fixed_time", s.fixed_time);
    check_amount("stage", i, "memory_per_layer", s.memory_per_layer);
    check_amount("stage", i, "fixed_memory", s.fixed_memory);
    if (!std::isfinite(s.memory_capacity)) fail("[ilp] stage ", i, ": memory_capacity is not finite");
    if (s.min_layers < 0) fail("[ilp] stage ", i, ": min_layers=", s.min_layers, " is negative");
    min_sum += s.min_layers;
  }
  if (min_sum > num_layers)
    fail("[ilp] num_layers=", num_layers, " is less than the sum of min_layers (", min_sum, ") over ",
         stages.size(), " stages");
}

bool fits(const LayerStage& s, int64_t layers) {
  return s.memory_capacity <= 0 || s.fixed_memory + s.memory_per_layer * layers <= s.memory_capacity;
}

// The most layers in [0, num_layers] the stage's memory holds; -1 when none.
int max_layers_by_memory(const LayerStage& s, int num_layers) {
  if (fits(s, num_layers)) return num_layers;
  if (!fits(s, 0)) return -1;
  // fits(0) and not fits(num_layers): memory_per_layer > 0, the quotient is in range.
  int x = static_cast<int>(std::clamp((s.memory_capacity - s.fixed_memory) / s.memory_per_layer, 0.0,
                                      static_cast<double>(num_layers)));
  while (x + 1 <= num_layers && fits(s, x + 1)) ++x;  // the division's rounding, either way
  while (x > 0 && !fits(s, x)) --x;
  return x;
}

double bytes_over(const LayerStage& s, int64_t layers) {
  return s.fixed_memory + s.memory_per_layer * layers - s.memory_capacity;
}

// Fills worst_stage and bytes_missing of an infeasible layer assignment.
void explain_memory(const std::vector<LayerStage>& stages, int num_layers, LayerAssignment& out) {
  std::vector<int> most(stages.size());
  int64_t placed = 0;
  for (size_t k = 0; k < stages.size(); ++k) {
    most[k] = max_layers_by_memory(stages[k], num_layers);
    placed += std::max(most[k], 0);
    if (most[k] < stages[k].min_layers) {
      const double over = bytes_over(stages[k], stages[k].min_layers);
      if (out.worst_stage < 0 || over > out.bytes_missing) out.worst_stage = static_cast<int>(k), out.bytes_missing = over;
    }
  }
  if (out.worst_stage >= 0) return;
  const int64_t unplaced = num_layers - placed;
  HSPMD_CHECK(unplaced > 0, "explain_memory on a feasible instance");
  for (size_t k = 0; k < stages.size(); ++k) {
    const double over = bytes_over(stages[k], most[k] + unplaced);
    if (out.worst_stage < 0 || over < out.bytes_missing) out.worst_stage = static_cast<int>(k), out.bytes_missing = over;
  }
}

MinMax layer_program(const std::vector<LayerStage>& stages, int num_layers) {
  MinMax m;
  m.total = num_layers;
  for (const LayerStage& s : stages) {
    m.weight.push_back(1);
    m.lo.push_back(s.min_layers);
    m.hi.push_back(max_layers_by_memory(s, num_layers));
    m.fixed.push_back(s.fixed_time);
    m.slope.push_back(s.time_per_layer);
  }
  return m;
}

LayerAssignment to_layer_assignment(const std::vector<LayerStage>& stages, int num_layers,
                                    const Allocation& a) {
  LayerAssignment out;
  if (!a.feasible) {
    explain_memory(stages, num_layers, out);
    return out;
  }
  out.feasible = true;
  out.layers = a.counts;
  out.optimal = a.optimal;
  for (size_t k = 0; k < stages.size(); ++k)
    out.max_stage_time = std::max(out.max_stage_time, stages[k].fixed_time + stages[k].time_per_layer * a.counts[k]);
  return out;
}

// ---------------------------------------------------------------------------
// The micro-batch-specific parts.

MinMax micro_batch_program(const std::vector<MicroBatchPipeline>& pipelines, int global_batch,
                           bool with_maxima) {
  MinMax m;
  m.total = global_batch;
  for (const MicroBatchPipeline& p : pipelines) {
    const int most = global_batch / p.micro_batch_size;
    m.weight.push_back(p.micro_batch_size);
    m.lo.push_back(p.min_micro_batches);
    m.hi.push_back(with_maxima && p.max_micro_batches > 0 ? std::min(p.max_micro_batches, most) : most);
    m.fixed.push_back(p.fixed_time);
    m.slope.push_back(p.time_per_micro_batch);
  }
  return m;
}

void validate_micro_batches(const std::vector<MicroBatchPipeline>& pipelines, int global_batch) {
  if (pipelines.empty()) fail("[ilp] assign_micro_batches: no pipelines");
  if (global_batch < 1) fail("[ilp] global_batch=", global_batch, " is not positive");
  int64_t min_sum = 0;
  std::string sizes;
  for (size_t k = 0; k < pipelines.size(); ++k) {
    const MicroBatchPipeline& p = pipelines[k];
    const int i = static_cast<int>(k);
    if (p.micro_batch_size < 1) fail("[ilp] pipeline ", i, ": micro_batch_size=", p.micro_batch_size, " is not positive");
    check_amount("pipeline", i, "time_per_micro_batch", p.time_per_micro_batch);
    check_amount("pipeline", i, "fixed_time", p.fixed_time);
    if (p.min_micro_batches < 1) fail("[ilp] pipeline ", i, ": min_micro_batches=", p.min_micro_batches, " is not positive");
    if (p.max_micro_batches < 0) fail("[ilp] pipeline ", i, ": max_micro_batches=", p.max_micro_batches, " is negative");
    min_sum += int64_t{p.micro_batch_size} * p.min_micro_batches;
    sizes += (k ? ", " : "") + std::to_string(p.micro_batch_size);
  }
  if (min_sum > global_batch)
    fail("[ilp] global_batch=", global_batch, " is below sum of micro_batch_size * min_micro_batches (",
         min_sum, ")");
  const MinMax unbounded = micro_batch_program(pipelines, global_batch, false);
  if (reach_total(unbounded, unbounded.hi).empty())
    fail("[ilp] global_batch=", global_batch, " is not reachable as sum of micro_batch_size * micro-batches (sizes ",
         sizes, ") with at least min_micro_batches each");
}

MicroBatchAssignment to_micro_batch_assignment(const std::vector<MicroBatchPipeline>& pipelines,
                                               const Allocation& a) {
  MicroBatchAssignment out;
  if (!a.feasible) return out;
  out.feasible = true;
  out.counts = a.counts;
  out.optimal = a.optimal;
  for (size_t k = 0; k < pipelines.size(); ++k)
    out.max_time = std::max(out.max_time, pipelines[k].fixed_time + pipelines[k].time_per_micro_batch * a.counts[k]);
  return out;
}

}  // namespace

LayerAssignment assign_layers(const std::vector<LayerStage>& stages, int num_layers, double time_limit_s,
                              IlpSolver solver) {
  validate_layers(stages, num_layers);
  check_time_limit(time_limit_s);
  return to_layer_assignment(stages, num_layers, solve(layer_program(stages, num_layers), solver, time_limit_s));
}

MicroBatchAssignment assign_micro_batches(const std::vector<MicroBatchPipeline>& pipelines, int global_batch,
                                          double time_limit_s, IlpSolver solver) {
  validate_micro_batches(pipelines, global_batch);
  check_time_limit(time_limit_s);
  return to_micro_batch_assignment(
      pipelines, solve(micro_batch_program(pipelines, global_batch, true), solver, time_limit_s));
}

LayerAssignment assign_layers_exhaustive(const std::vector<LayerStage>& stages, int num_layers) {
  validate_layers(stages, num_layers);
  const std::vector<int> ones(stages.size(), 1), all(stages.size(), num_layers);
  std::vector<int> lo;
  for (const LayerStage& s : stages) lo.push_back(s.min_layers);
  Allocation best;
  double best_time = 0;
  enumerate(ones, lo, all, num_layers, [&](const std::vector<int>& x) {
    double t = 0;
    for (size_t k = 0; k < stages.size(); ++k) {
      if (!fits(stages[k], x[k])) return;
      t = std::max(t, stages[k].fixed_time + stages[k].time_per_layer * x[k]);
    }
    if (!best.feasible || t < best_time) best = {true, x, true}, best_time = t;
  });
  return to_layer_assignment(stages, num_layers, best);
}

MicroBatchAssignment assign_micro_batches_exhaustive(const std::vector<MicroBatchPipeline>& pipelines,
                                                     int global_batch) {
  validate_micro_batches(pipelines, global_batch);
  std::vector<int> sizes, lo, hi;
  for (const MicroBatchPipeline& p : pipelines) {
    sizes.push_back(p.micro_batch_size);
    lo.push_back(p.min_micro_batches);
    hi.push_back(p.max_micro_batches > 0 ? p.max_micro_batches : global_batch);
  }
  Allocation best;
  double best_time = 0;
  enumerate(sizes, lo, hi, global_batch, [&](const std::vector<int>& n) {
    double t = 0;
    for (size_t k = 0; k < pipelines.size(); ++k)
      t = std::max(t, pipelines[k].fixed_time + pipelines[k].time_per_micro_batch * n[k]);
    if (!best.feasible || t < best_time) best = {true, n, true}, best_time = t;
  });
  return to_micro_batch_assignment(pipelines, best);
}

}  // namespace hspmd

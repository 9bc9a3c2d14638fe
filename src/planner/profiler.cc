#include "hspmd/planner/profiler.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>

#include "hspmd/comm/communicator.h"
#include "hspmd/comm/shadow.h"
#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/core/threads.h"
#include "hspmd/optim/adam.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/strategy.h"
#include "kernels/memory.h"

namespace hspmd {

namespace {

double median(std::vector<double> v) {
  HSPMD_CHECK(!v.empty(), "median of nothing");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Arbitrary small values, deterministic: the values do not change the time.
void fill_small(NDArray& a, uint32_t seed) {
  float* p = a.host_data<float>("fill_small");
  uint32_t x = seed * 2654435761u + 1;
  for (int64_t i = 0; i < a.numel(); ++i) {
    x = x * 1664525u + 1013904223u;
    p[i] = (static_cast<float>(x >> 8) / 16777216.0f - 0.5f) * 0.04f;
  }
}

Strategy pipeline_of_stages(const std::vector<int>& layers, int tp, int cp) {
  Pipeline p;
  const int g = tp * cp;
  int first = 0;
  for (size_t k = 0; k < layers.size(); ++k) {
    Stage st;
    for (int r = 0; r < g; ++r) st.ranks.push_back(static_cast<int>(k) * g + r);
    st.first_layer = first;
    st.last_layer = first + layers[k] - 1;
    st.cp = cp;
    first += layers[k];
    p.stages.push_back(st);
  }
  Strategy s;
  s.description = "profile probe";
  s.pipelines.push_back(p);
  return s;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      std::string name = line.substr(line.find(':') + 1);
      name.erase(0, name.find_first_not_of(' '));
      return name;
    }
  return "unknown CPU";
}

// `a` (a host array) on `device`.
NDArray on_device(const NDArray& a, Device device) {
  return device == Device::cpu() ? a : kernels::to_device(default_stream(device), a);
}

// One member of a shadow group; on a device, staged through host memory
// (the shadow fills and copies host buffers).
std::unique_ptr<Communicator> shadow_world(int size, int rank, Device device) {
  std::unique_ptr<Communicator> shadow = make_shadow_communicator(size, rank);
  return device == Device::cpu() ? std::move(shadow) : make_staged_communicator(std::move(shadow));
}

// How a device's work is timed: process CPU time on the CPU, CUDA events on
// the default stream of a device.
WorkTimer timer_for(Device device) {
  return device == Device::cpu() ? WorkTimer::process_cpu() : WorkTimer::events(default_stream(device));
}

}  // namespace

struct StageProbe::Impl {
  std::shared_ptr<const AnnotationPlan> plan;
  std::unique_ptr<Communicator> world;  // outlives the graph (its pending sends)
  VirtualClock clock;
  std::unique_ptr<ExecGraph> graph;
  int rank = 0;
  int64_t max_seq_len = 0;
  ValueMap params;                       // this rank's parameter shards
  std::vector<std::string> block_params;  // those of the stage's blocks
  std::vector<OpSample>* sink = nullptr;  // where the observer records ops

  explicit Impl(ClockMode mode) : clock(1.0, mode) {}
  ValueMap feeds(int64_t s, int64_t b) const;
};

StageProbe::StageProbe(const ModelConfig& config, int tp, int cp, std::vector<int> stage_layers, int stage,
                       int64_t max_seq_len, std::shared_ptr<const OpTimeModel> model, Precision precision,
                       Device device)
    : impl_(std::make_unique<Impl>(model ? ClockMode::kModel : ClockMode::kCpu)) {
  HSPMD_CHECK(stage >= 0 && stage < static_cast<int>(stage_layers.size()), "probe stage out of range");
  ModelConfig c = config;
  c.num_hidden_layers = std::accumulate(stage_layers.begin(), stage_layers.end(), 0);
  const int group = tp * cp, world = group * static_cast<int>(stage_layers.size());
  CompileOptions co;
  co.seq_len = max_seq_len;
  co.precision = precision.for_device(device);  // as training on the device builds it
  Impl& m = *impl_;
  m.plan = std::make_shared<const AnnotationPlan>(compile_plan(c, pipeline_of_stages(stage_layers, tp, cp), world, co));
  m.rank = stage * group;
  m.max_seq_len = max_seq_len;
  m.graph = std::make_unique<ExecGraph>(m.plan, std::make_shared<const Topology>(Topology::uniform(world)), m.rank,
                                        Bindings{{"B", 1}, {"S", max_seq_len}}, device);
  m.world = shadow_world(world, m.rank, device);
  m.clock.set_timer(timer_for(device));
  m.graph->set_clock(&m.clock);
  if (model) m.graph->set_op_time_model(std::move(model));
  m.graph->set_op_observer([&m](const Node& n, const OpWork& w, double seconds) {
    if (m.sink) m.sink->push_back(OpSample{n.id, n.op->type(), w, seconds});
  });
  uint32_t seed = 1;
  for (const ModelParameter& p : model_parameters(m.plan->model)) {
    auto box = m.graph->local_box(p.name, p.shape);
    if (!box) continue;
    NDArray a = NDArray::empty(box->shape(), DType::F32);
    if (p.init == ParamInit::kOnes) a.fill(1.0f);
    else fill_small(a, seed++);
    m.params[p.name] = on_device(a, device);
    if (p.part == ModelPart::kBlock) m.block_params.push_back(p.name);
  }
}

StageProbe::~StageProbe() = default;

int StageProbe::rank() const { return impl_->rank; }

ValueMap StageProbe::Impl::feeds(int64_t s, int64_t b) const {
  NDArray ids = NDArray::empty({b, s}, DType::I32), targets = NDArray::empty({b, s}, DType::I32),
          positions = NDArray::empty({b, s}, DType::I32);
  const int64_t vocab = plan->model.vocab_size;
  uint32_t x = 12345;
  for (int64_t i = 0; i < b * s; ++i) {
    x = x * 1664525u + 1013904223u;
    ids.host_data<int32_t>()[i] = static_cast<int32_t>((x >> 8) % vocab);
    targets.host_data<int32_t>()[i] = static_cast<int32_t>((x >> 4) % vocab);
    positions.host_data<int32_t>()[i] = static_cast<int32_t>(i % s);
  }
  NDArray norm = NDArray::empty({}, DType::F32);
  norm.fill(static_cast<float>(b * s));
  ValueMap v = params;
  for (auto& [name, full] : ValueMap{{"input_ids", ids}, {"targets", targets}, {"positions", positions},
                                     {"normalizer", norm}})
    if (auto box = graph->local_box(name, full.shape())) v[name] = box_slice(full, *box);
  return v;
}

StageRun StageProbe::run(int64_t s, int64_t b, bool recompute) {
  Impl& m = *impl_;
  HSPMD_CHECK(s <= m.max_seq_len, "probe sequence ", s, " beyond its plan's ", m.max_seq_len);
  const ValueMap values = m.feeds(s, b);
  m.graph->set_recompute(recompute);
  Allocator& alloc = allocator_for(m.graph->device());
  StageRun r;
  const auto held = static_cast<int64_t>(alloc.current_bytes());
  m.sink = &r.fwd_ops;
  double c0 = m.clock.compute_s();
  ExecGraph::Activations a = m.graph->forward(values, *m.world, Bindings{{"B", b}, {"S", s}});
  r.fwd_s = m.clock.compute_s() - c0;
  r.kept_bytes = static_cast<int64_t>(alloc.current_bytes()) - held;
  m.sink = &r.bwd_ops;
  c0 = m.clock.compute_s();
  const ExecGraph::MicroBatch mb = m.graph->backward(std::move(a), *m.world);
  r.bwd_s = m.clock.compute_s() - c0;
  m.sink = nullptr;
  m.graph->wait_sends(*m.world);  // the clock messages (discarded)
  for (const std::string& name : m.block_params) {
    auto g = mb.raw_grads.find(name);
    if (g != mb.raw_grads.end()) r.block_grad_bytes += static_cast<int64_t>(g->second.nbytes());
  }
  return r;
}

std::vector<Shape> StageProbe::block_param_shapes() const {
  std::vector<Shape> out;
  for (const std::string& name : impl_->block_params) out.push_back(impl_->params.at(name).shape());
  return out;
}

int64_t StageProbe::block_param_bytes() const {
  int64_t n = 0;
  for (const std::string& name : impl_->block_params) n += static_cast<int64_t>(impl_->params.at(name).nbytes());
  return n;
}

namespace {

// Each op of the runs (alike, op i the same node in every run) at its
// median over the runs.
std::vector<OpSample> median_ops(const std::vector<StageRun>& runs, bool backward) {
  std::vector<OpSample> out = backward ? runs.at(0).bwd_ops : runs.at(0).fwd_ops;
  for (size_t i = 0; i < out.size(); ++i) {
    std::vector<double> t;
    for (const StageRun& r : runs) {
      const auto& ops = backward ? r.bwd_ops : r.fwd_ops;
      HSPMD_CHECK(ops.size() == out.size() && ops[i].node == out[i].node, "runs of one probe differ");
      t.push_back(ops[i].seconds);
    }
    out[i].seconds = median(t);
  }
  return out;
}

// Seconds of the ops of `with` that `without` has no match for (same type
// and work), each taken once per unmatched occurrence.
double extra_seconds(const std::vector<OpSample>& with, const std::vector<OpSample>& without) {
  std::map<std::tuple<std::string, double, double>, int> count;
  for (const OpSample& o : without) ++count[{o.type, o.work.flops, o.work.elements}];
  double extra = 0;
  for (const OpSample& o : with) {
    int& n = count[{o.type, o.work.flops, o.work.elements}];
    if (n > 0) --n;
    else extra += o.seconds;
  }
  return extra;
}

double median_of(const std::vector<StageRun>& runs, bool backward) {
  std::vector<double> t;
  for (const StageRun& r : runs) t.push_back(backward ? r.bwd_s : r.fwd_s);
  return median(t);
}

}  // namespace

std::map<std::string, double> split_parts(const std::vector<StageRun>& first, const std::vector<StageRun>& middle,
                                          const std::vector<StageRun>& last) {
  std::map<std::string, double> parts;
  for (bool bwd : {false, true}) {
    const std::string suffix = bwd ? "_bwd" : "_fwd";
    const std::vector<OpSample> mid = median_ops(middle, bwd);
    parts["block" + suffix] = median_of(middle, bwd);
    parts["embed" + suffix] = extra_seconds(median_ops(first, bwd), mid);
    parts["head" + suffix] = extra_seconds(median_ops(last, bwd), mid);
  }
  return parts;
}

double predict_stage(const std::map<std::string, double>& parts, int layers, bool first, bool last, bool backward) {
  const std::string suffix = backward ? "_bwd" : "_fwd";
  return (first ? parts.at("embed" + suffix) : 0.0) + layers * parts.at("block" + suffix) +
         (last ? parts.at("head" + suffix) : 0.0);
}

namespace {

// Weighted least squares of y on the chosen columns of `rows` minimizing
// squared relative errors; empty when singular or a coefficient is negative.
std::vector<double> relative_fit(const std::vector<std::vector<double>>& rows, const std::vector<double>& y,
                                 const std::vector<int>& cols) {
  const size_t n = cols.size();
  std::vector<std::vector<double>> a(n, std::vector<double>(n + 1, 0));
  for (size_t i = 0; i < rows.size(); ++i) {
    const double w = 1.0 / std::max(y[i] * y[i], 1e-24);
    for (size_t p = 0; p < n; ++p) {
      a[p][n] += w * rows[i][cols[p]] * y[i];
      for (size_t q = 0; q < n; ++q) a[p][q] += w * rows[i][cols[p]] * rows[i][cols[q]];
    }
  }
  std::vector<double> scale(n);
  for (size_t p = 0; p < n; ++p) {
    if (!(a[p][p] > 0)) return {};
    scale[p] = 1.0 / std::sqrt(a[p][p]);
  }
  for (size_t p = 0; p < n; ++p)
    for (size_t q = 0; q <= n; ++q) a[p][q] *= scale[p] * (q < n ? scale[q] : 1.0);
  for (size_t c = 0; c < n; ++c) {  // Gauss-Jordan with partial pivoting
    size_t piv = c;
    for (size_t i = c + 1; i < n; ++i)
      if (std::abs(a[i][c]) > std::abs(a[piv][c])) piv = i;
    if (std::abs(a[piv][c]) < 1e-10) return {};
    std::swap(a[piv], a[c]);
    for (size_t i = 0; i < n; ++i) {
      if (i == c) continue;
      const double f = a[i][c] / a[c][c];
      for (size_t k = c; k <= n; ++k) a[i][k] -= f * a[c][k];
    }
  }
  std::vector<double> x(n);
  for (size_t p = 0; p < n; ++p) {
    x[p] = a[p][n] / a[p][p] * scale[p];
    if (x[p] < 0) return {};
  }
  return x;
}

// The best non-negative fit over the subsets of the columns (fewest terms
// first; a subset must lower the squared relative error to win). Returns
// the coefficient of every column (0 when unused) and the max relative error.
std::pair<std::vector<double>, double> best_fit(const std::vector<std::vector<double>>& rows,
                                                const std::vector<double>& y) {
  const int ncol = static_cast<int>(rows.at(0).size());
  std::vector<double> best(ncol, 0);
  double best_sse = INFINITY;
  std::vector<std::vector<int>> subsets;
  for (int mask = 1; mask < (1 << ncol); ++mask) {
    std::vector<int> cols;
    for (int c = 0; c < ncol; ++c)
      if (mask & (1 << c)) cols.push_back(c);
    subsets.push_back(cols);
  }
  std::stable_sort(subsets.begin(), subsets.end(), [](auto& a, auto& b) { return a.size() < b.size(); });
  for (const auto& cols : subsets) {
    const std::vector<double> x = relative_fit(rows, y, cols);
    if (x.empty()) continue;
    std::vector<double> coef(ncol, 0);
    for (size_t p = 0; p < cols.size(); ++p) coef[cols[p]] = x[p];
    double sse = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      double t = 0;
      for (int c = 0; c < ncol; ++c) t += coef[c] * rows[i][c];
      const double e = (t - y[i]) / std::max(y[i], 1e-12);
      sse += e * e;
    }
    if (sse < best_sse * (1 - 1e-9)) best_sse = sse, best = coef;
  }
  double worst = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    double t = 0;
    for (int c = 0; c < ncol; ++c) t += best[c] * rows[i][c];
    worst = std::max(worst, std::abs(t - y[i]) / std::max(y[i], 1e-12));
  }
  return {best, worst};
}

}  // namespace

OpFit fit_op(const std::vector<OpSample>& samples, const OpFit* fallback) {
  OpFit f;
  f.samples = static_cast<int>(samples.size());
  if (samples.empty()) return fallback ? *fallback : f;
  std::set<std::pair<double, double>> works;
  for (const OpSample& s : samples) works.insert({s.work.flops, s.work.elements});
  auto max_error = [&](const OpFit& fit) {
    double worst = 0;
    for (const OpSample& s : samples)
      worst = std::max(worst, std::abs(fit.at(s.work.flops, s.work.elements) - s.seconds) /
                                  std::max(s.seconds, 1e-12));
    return worst;
  };
  if (works.size() < 3 && fallback) {  // too few to fit: the fallback's shape at the samples' level
    std::vector<double> ratio;
    for (const OpSample& s : samples) {
      const double p = fallback->at(s.work.flops, s.work.elements);
      if (p > 0) ratio.push_back(s.seconds / p);
    }
    const double k = ratio.empty() ? 1.0 : median(ratio);
    f.overhead_s = k * fallback->overhead_s;
    f.s_per_flop = k * fallback->s_per_flop;
    f.s_per_element = k * fallback->s_per_element;
    f.max_rel_error = max_error(f);
    return f;
  }
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (const OpSample& s : samples) {
    rows.push_back({1.0, s.work.flops, s.work.elements});
    y.push_back(s.seconds);
  }
  auto [coef, worst] = best_fit(rows, y);
  f.overhead_s = coef[0];
  f.s_per_flop = coef[1];
  f.s_per_element = coef[2];
  f.max_rel_error = worst;
  return f;
}

void check_profile_precision(const Profile& profile, const Precision& precision, const std::string& source) {
  const std::string run = precision.mixed() ? "bf16" : "fp32";
  if (profile.precision != run)
    fail("[profile] ", source, ": measured in ", profile.precision, ", but this run computes in ", run,
         " (make one with `hspmd profile ", option_name("precision"), " ", run, "`)");
}

void check_profile_model(const Profile& profile, const ModelConfig& model, const std::string& source,
                         const std::string& model_source) {
  auto dims = [](const ModelConfig& c) {
    std::ostringstream os;
    os << c.model_type << (c.sliding_window > 0 ? " window " + std::to_string(c.sliding_window) : std::string())
       << ", hidden " << c.hidden_size << ", heads " << c.num_attention_heads << ", kv heads " << c.kv_heads()
       << ", intermediate " << c.intermediate_size << ", vocab " << c.vocab_size;
    return os.str();
  };
  if (dims(profile.config) != dims(model))
    fail("[profile] ", source, ": made for ", dims(profile.config), ", but ", model_source, " has ", dims(model));
}

void check_profile_options(const ProfileOptions& o) {
  const ModelConfig& c = o.config;
  if (o.tp.empty() || o.cp.empty() || o.seq_lens.empty() || o.micro_batch_sizes.empty())
    fail("[profile] ", option_name("tp"), ", ", option_name("cp"), ", ", option_name("seq_lens"), " and ", option_name("micro_batch_sizes"), " need at least one value each");
  if (o.repetitions < 1) fail("[profile] ", option_name("repetitions"), " must be >= 1, got ", o.repetitions);
  if (o.threads < 1) fail("[profile] ", option_name("threads"), " must be >= 1, got ", o.threads);
  for (int64_t b : o.micro_batch_sizes)
    if (b < 1) fail("[profile] ", option_name("micro_batch_sizes"), ": ", b, " is not positive");
  for (int cp : o.cp)
    if (cp < 1) fail("[profile] ", option_name("cp"), ": ", cp, " is not positive");
  for (int tp : o.tp) {
    if (tp < 1) fail("[profile] ", option_name("tp"), ": ", tp, " is not positive");
    for (auto [what, n] : {std::pair{"num_attention_heads", c.num_attention_heads},
                           std::pair{"num_key_value_heads", c.kv_heads()},
                           std::pair{"intermediate_size", c.intermediate_size}})
      if (n % tp != 0) fail("[profile] ", option_name("tp"), " ", tp, " does not divide ", what, " = ", n);
  }
  for (int64_t s : o.seq_lens) {
    if (s < 1 || s > c.max_position_embeddings)
      fail("[profile] ", option_name("seq_lens"), ": ", s, " is outside [1, max_position_embeddings ", c.max_position_embeddings, "]");
    for (int tp : o.tp)
      for (int cp : o.cp) {
        const int64_t g = sequence_granularity(pipeline_of_stages({1}, tp, cp));
        if (s % g != 0)
          fail("[profile] ", option_name("seq_lens"), ": ", s, " is not a multiple of ", g, ", the granularity of tp ", tp, " x cp ",
               cp, " (the sequence is split over tp x cp ranks, and into 2 x cp chunks under cp)");
      }
  }
}

namespace {

// The optimizer step (the trainer's AdamW calls, each tensor bracketed by
// the clock) over k copies of one block's tensors, k = 1, 2, 4, capped in
// size; fitted t = per_param_s * n + fixed_s.
OptimizerFit time_optimizer(const std::vector<Shape>& block, int repetitions, Device device) {
  constexpr int64_t kMaxBlockElements = int64_t{1} << 22;  // 16 MiB per array
  int64_t n_block = 0;
  for (const Shape& s : block) n_block += shape_numel(s);
  const auto tensors = static_cast<int64_t>(std::max<size_t>(block.size(), 1));
  const int64_t each = std::max<int64_t>(1, std::min(n_block, kMaxBlockElements) / tensors);
  OptimizerFit fit;
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (int k : {1, 2, 4}) {
    std::vector<NDArray> p, g, m, v;
    for (int64_t t = 0; t < k * tensors; ++t) {
      NDArray host_p = NDArray::zeros({each}, DType::F32), host_g = NDArray::zeros({each}, DType::F32);
      fill_small(host_p, static_cast<uint32_t>(t + 1));
      fill_small(host_g, static_cast<uint32_t>(t + 7));
      p.push_back(on_device(host_p, device));
      g.push_back(on_device(host_g, device));
      for (auto* list : {&m, &v}) list->push_back(on_device(NDArray::zeros({each}, DType::F32), device));
    }
    Adam adam(AdamConfig{});
    VirtualClock clock;
    clock.set_timer(timer_for(device));
    std::vector<double> times;
    for (int rep = 0; rep <= repetitions; ++rep) {
      adam.set_step_count(rep);
      adam.begin_step();
      const double c0 = clock.compute_s();
      for (size_t t = 0; t < p.size(); ++t) {
        const std::string name = std::to_string(t);
        clock.begin_compute();
        adam.import_moments(name, m[t], v[t]);
        adam.update(name, p[t], g[t], 1e-4, true);
        std::tie(m[t], v[t]) = adam.export_moments(name);
        clock.end_compute();
      }
      if (rep > 0) times.push_back(clock.compute_s() - c0);  // the first is the warm-up
    }
    const int64_t n = k * tensors * each;
    fit.samples.emplace_back(n, median(times));
    rows.push_back({static_cast<double>(n), 1.0});
    y.push_back(fit.samples.back().second);
  }
  auto [coef, worst] = best_fit(rows, y);
  fit.per_param_s = coef[0];
  fit.fixed_s = coef[1];
  fit.max_rel_error = worst;
  return fit;
}

// Kept bytes per token of one micro-batch (b x s tokens) of a middle stage
// of 1 and of 2 blocks: the per-layer slope and the stage's intercept.
std::pair<double, double> kept_per_token(StageProbe& one, StageProbe& two, int64_t s, int64_t b, bool recompute) {
  one.run(s, b, recompute);  // warm-up: shape instances, resolutions
  two.run(s, b, recompute);
  const auto k1 = static_cast<double>(one.run(s, b, recompute).kept_bytes);
  const auto k2 = static_cast<double>(two.run(s, b, recompute).kept_bytes);
  const double tokens = static_cast<double>(b * s);
  return {(k2 - k1) / tokens, (2 * k1 - k2) / tokens};
}

// What the op fits are calibrated on: a stage's measured time (the median
// of its runs) and its ops (each at its median).
struct MeasuredStage {
  double seconds = 0;
  std::vector<OpSample> ops;
};

// Scales every op fit by one factor so that, summed over the measured
// stages' ops, the fits give the stages' measured time: fits of relative
// errors over per-op medians lean low, and a stage is what the model clock
// must get right.
void calibrate_ops(std::map<std::string, OpFit>& fits, const std::vector<MeasuredStage>& stages,
                   const std::map<std::string, std::vector<OpSample>>& samples) {
  double measured = 0, predicted = 0;
  for (const MeasuredStage& st : stages) {
    measured += st.seconds;
    for (const OpSample& op : st.ops) predicted += fits.at(op.type).at(op.work.flops, op.work.elements);
  }
  if (!(measured > 0 && predicted > 0)) return;
  const double k = measured / predicted;
  for (auto& [type, f] : fits) {
    f.overhead_s *= k;
    f.s_per_flop *= k;
    f.s_per_element *= k;
    f.max_rel_error = 0;
    for (const auto& [t, list] : samples)
      if (t == type || type == kAnyOp)
        for (const OpSample& op : list)
          f.max_rel_error = std::max(f.max_rel_error, std::abs(f.at(op.work.flops, op.work.elements) - op.seconds) /
                                                          std::max(op.seconds, 1e-12));
  }
}

struct EntryResult {
  ProfileEntry entry;
  LayerMemory memory;
  std::vector<Shape> block_shapes;
};

EntryResult profile_entry(const ProfileOptions& o, int tp, int cp, std::map<std::string, std::vector<OpSample>>& ops,
                          std::vector<MeasuredStage>& stages) {
  const int64_t max_s = *std::max_element(o.seq_lens.begin(), o.seq_lens.end());
  const int64_t max_b = *std::max_element(o.micro_batch_sizes.begin(), o.micro_batch_sizes.end());
  EntryResult out;
  out.entry.tp = tp;
  out.entry.cp = cp;
  std::vector<std::unique_ptr<StageProbe>> probes;
  for (int stage = 0; stage < 3; ++stage)
    probes.push_back(
        std::make_unique<StageProbe>(o.config, tp, cp, std::vector<int>{1, 1, 1}, stage, max_s, nullptr, o.precision,
                                     o.device));
  // The largest point first, twice: the heap grows to its size and the
  // kernels' first-use costs (page faults, buffers) stay out of the samples.
  for (int k = 0; k < 2; ++k)
    for (auto& p : probes) p->run(max_s, max_b);
  std::vector<std::pair<int64_t, int64_t>> points;
  for (int64_t s : o.seq_lens)
    for (int64_t b : o.micro_batch_sizes) points.emplace_back(s, b);
  for (auto [s, b] : points)  // warm-up: each point's shape instance
    for (auto& p : probes) p->run(s, b);
  // Repetitions outermost, then points, then stages: a burst of load on the
  // machine touches one repetition of several points, which the medians drop.
  std::vector<std::vector<std::vector<StageRun>>> runs(points.size(), std::vector<std::vector<StageRun>>(3));
  for (int rep = 0; rep < o.repetitions; ++rep)
    for (size_t i = 0; i < points.size(); ++i)
      for (size_t k = 0; k < 3; ++k) runs[i][k].push_back(probes[k]->run(points[i].first, points[i].second));
  for (size_t i = 0; i < points.size(); ++i) {
    for (const auto& [part, seconds] : split_parts(runs[i][0], runs[i][1], runs[i][2]))
      out.entry.parts[part].samples.push_back(FitSample{points[i].first, points[i].second, seconds});
    for (const auto& r : runs[i])
      for (bool bwd : {false, true}) {
        stages.push_back({median_of(r, bwd), median_ops(r, bwd)});
        for (const OpSample& op : stages.back().ops) ops[op.type].push_back(op);
      }
  }
  for (auto& [part, fit] : out.entry.parts) fit.fit();
  StageProbe& mid = *probes[1];
  StageProbe two(o.config, tp, cp, {1, 2, 1}, 1, max_s, nullptr, o.precision, o.device);
  LayerMemory& m = out.memory;
  m.tp = tp;
  m.cp = cp;
  m.param_bytes = mid.block_param_bytes();
  m.grad_bytes = mid.run(max_s, max_b).block_grad_bytes;
  m.optimizer_bytes = 2 * m.param_bytes;  // Adam's two fp32 moments
  std::tie(m.activation_bytes_per_token, m.stage_activation_bytes_per_token) =
      kept_per_token(mid, two, max_s, max_b, false);
  std::tie(m.activation_bytes_per_token_recompute, m.stage_activation_bytes_per_token_recompute) =
      kept_per_token(mid, two, max_s, max_b, true);
  out.block_shapes = mid.block_param_shapes();
  return out;
}

}  // namespace

Profile profile_model(const ProfileOptions& o) {
  check_profile_options(o);
  set_num_threads(o.threads);
  const bool on_cpu = o.device == Device::cpu();
  if (o.threads == 1 && on_cpu) {
    // One kernel thread: stay on the core we start on. Measured on a 2-vCPU
    // machine, an unpinned single-threaded profile took about 2x the CPU
    // time per op of a pinned one (and of the same ops inside emulated
    // ranks), run to run.
    // Every thread of the process (the BLAS and OpenMP pools too).
    cpu_set_t one;
    CPU_ZERO(&one);
    const int cpu = sched_getcpu();
    if (cpu >= 0) {
      CPU_SET(cpu, &one);
      std::error_code ec;
      for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec))
        sched_setaffinity(std::stoi(task.path().filename().string()), sizeof one, &one);  // best effort
    }
  }
  Profile prof;
  prof.model = o.model_path;
  prof.config = o.config;
  // A device's own name is not known to core's runtime: its index.
  prof.device = on_cpu ? cpu_name() : o.device.str();
  prof.threads = o.threads;
  prof.precision = o.precision.mixed() ? "bf16" : "fp32";
  prof.repetitions = o.repetitions;
  std::map<std::string, std::vector<OpSample>> ops;
  std::vector<MeasuredStage> stages;
  std::vector<Shape> optimizer_block;
  for (int tp : o.tp)
    for (int cp : o.cp) {
      if (o.progress) o.progress("tp " + std::to_string(tp) + " cp " + std::to_string(cp));
      EntryResult r = profile_entry(o, tp, cp, ops, stages);
      prof.entries.push_back(std::move(r.entry));
      prof.memory.push_back(r.memory);
      if (optimizer_block.empty()) optimizer_block = r.block_shapes;
    }
  if (o.progress) o.progress("optimizer");
  prof.optimizer = time_optimizer(optimizer_block, o.repetitions, o.device);
  std::vector<OpSample> all;
  for (const auto& [type, samples] : ops) all.insert(all.end(), samples.begin(), samples.end());
  const OpFit any = fit_op(all);
  prof.ops[kAnyOp] = any;
  for (const auto& [type, samples] : ops) prof.ops[type] = fit_op(samples, &any);
  calibrate_ops(prof.ops, stages, ops);
  return prof;
}

}  // namespace hspmd

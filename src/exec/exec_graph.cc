#include "hspmd/exec/exec_graph.h"

#include <algorithm>
#include <limits>
#include <set>
#include <span>

#include "exec/clocked_comm.h"
#include "hspmd/comm/execute.h"
#include "hspmd/core/error.h"
#include "hspmd/graph/op.h"
#include "hspmd/ops/ops.h"
#include "kernels/memory.h"

namespace hspmd {

namespace {

using ops::is_reshard;

std::vector<int> device_set(const Annotation& a) {
  std::vector<int> ranks = a.all_ranks();
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

// A forward Reshard is a stage boundary when its source and destination live
// on different devices, or when some rank of it talks to a rank of another
// subgroup (another pipeline): those peers run it at other times, so the
// recomputation must reuse its output instead of running it again. Every
// rank of the Reshard decides alike (crosses_subgroups covers all ranks).
bool is_boundary(const Annotation& src, const Annotation& dst, const Resolution& r) {
  return r.crosses_subgroups || device_set(src) != device_set(dst);
}

}  // namespace

bool is_representative(const Annotation& a, int rank) {
  const int g = a.subgroup_of(rank);
  if (g < 0 || (a.hdim == kDup && g != 0)) return false;
  const Subgroup& sub = a.subgroups[g];
  return sub.states.coordinate(sub.devices.index_of(rank), kDup) == 0;
}

ExecGraph::ExecGraph(const AnnotationPlan& plan, const Topology& topology, int rank,
                     Bindings bindings, Device device)
    : ExecGraph(std::make_shared<const AnnotationPlan>(plan), std::make_shared<const Topology>(topology), rank,
                std::move(bindings), device) {}

ExecGraph::ExecGraph(std::shared_ptr<const AnnotationPlan> plan, std::shared_ptr<const Topology> topology,
                     int rank, Bindings bindings, Device device)
    : plan_(std::move(plan)), topology_(std::move(topology)), rank_(rank), bindings_(std::move(bindings)),
      device_(device), training_(annotate_training_graph(*plan_)), resolve_(*topology_, rank) {
  annotated_ = training_.annotated.get();
  // The Reshards this rank takes part in, each resolved for it alone.
  std::map<int, std::shared_ptr<const Resolution>> resolved;  // forward and backward Reshards
  for (const auto& [id, point] : model_.points)
    if (point.kind == ReshardKind::kGradSync) grad_sync_node_[point.parameter] = id;
  for (auto& [id, spec] : training_.reshards(bindings_, rank_)) {
    const ReshardPoint* point = model_.point(id);
    const bool grad_sync = point && point->kind == ReshardKind::kGradSync;  // once per step
    (grad_sync ? grad_resolutions_ : resolved).emplace(id, resolve_(spec));
    if (grad_sync) grad_specs_.emplace(id, spec);
  }
  select_nodes(resolved);
  find_parameter_only();
  plan_recompute(resolved);
  count_uses();
  instance(bindings_);  // built now, so that its errors surface at construction
}

void ExecGraph::find_parameter_only() {
  const Graph& g = *model_.graph;
  const std::set<std::string> params(model_.names.begin(), model_.names.end());
  parameter_only_.assign(g.num_nodes(), 0);
  for (size_t k = 0; k < forward_end_; ++k) {
    const Node& n = g.node(order_[k]);
    if (is_leaf(n)) {
      parameter_only_[n.id] = params.count(n.name) > 0;
      continue;
    }
    if (is_reshard(n) || n.op->may_communicate() || n.inputs.empty()) continue;
    parameter_only_[n.id] = std::all_of(n.inputs.begin(), n.inputs.end(),
                                        [&](const Tensor& t) { return parameter_only_[t.node_id()] != 0; });
  }
}

std::vector<ExecGraph::ParameterCast> ExecGraph::parameter_casts() const {
  const Graph& g = *model_.graph;
  std::vector<ParameterCast> out;
  for (size_t k = 0; k < forward_end_; ++k) {
    const Node& n = g.node(order_[k]);
    if (!parameter_only(n.id) || is_leaf(n) || n.op->type() != "cast" || n.inputs.size() != 1) continue;
    const Node& in = n.inputs[0].node();
    if (is_leaf(in) && parameter_only(in.id)) out.push_back({n.id, in.name, n.outputs.at(0).dtype});
  }
  return out;
}

ExecGraph::StepScope::StepScope(const ExecGraph& graph, std::map<int, NDArray> given) : graph_(graph) {
  HSPMD_CHECK(!graph_.step_open_, "ExecGraph::StepScope: a step is already open");
  for (auto& [id, array] : given) {
    HSPMD_CHECK(graph_.parameter_only(id) && array.valid(), "ExecGraph::StepScope: node ", id,
                " given is not a parameter-only node, or its array is invalid");
    graph_.step_values_[id] = {std::move(array)};
    graph_.step_given_.insert(id);
  }
  graph_.step_open_ = true;
}

ExecGraph::StepScope::~StepScope() {
  graph_.step_values_.clear();
  graph_.step_given_.clear();
  graph_.step_open_ = false;
}

NDArray ExecGraph::StepScope::value(int id) const {
  auto it = graph_.step_values_.find(id);
  return it == graph_.step_values_.end() || it->second.empty() ? NDArray() : it->second[0];
}

void ExecGraph::select_nodes(const std::map<int, std::shared_ptr<const Resolution>>& resolved) {
  const Graph& g = *model_.graph;
  for (int id = 0; id < g.num_nodes(); ++id) {
    const Node& n = g.node(id);
    if (is_reshard(n)) {
      auto it = resolved.find(id);
      if (it != resolved.end() && it->second->ranks.count(rank_)) order_.push_back(id);
    } else if (annotated_->of(n.output(0)).contains(rank_)) {
      order_.push_back(id);
    }
  }
  const int loss_id = model_.loss.node_id();
  forward_end_ = std::find_if(order_.begin(), order_.end(), [&](int id) { return id > loss_id; }) -
                 order_.begin();
}

// With recompute the forward keeps the leaves, the loss and the boundary
// Reshards' outputs; backward() re-runs every other forward node.
void ExecGraph::plan_recompute(const std::map<int, std::shared_ptr<const Resolution>>& resolved) {
  const Graph& g = *model_.graph;
  saved_.assign(g.num_nodes(), false);
  for (size_t k = 0; k < forward_end_; ++k) {
    const int id = order_[k];
    const Node& n = g.node(id);
    const bool boundary = is_reshard(n) && is_boundary(annotated_->of(n.inputs[0]),
                                                       annotated_->of(n.output(0)), *resolved.at(id));
    saved_[id] = is_leaf(n) || boundary || id == model_.loss.node_id();
    if (!saved_[id]) recompute_order_.push_back(id);
  }
}

// Intermediates are released after their last local consumer; the loss and
// the raw gradients are kept for the caller.
void ExecGraph::count_uses() {
  const Graph& g = *model_.graph;
  const std::span<const int> all(order_);
  const std::span<const int> fwd = all.first(forward_end_), bwd = all.subspan(forward_end_);
  // The router statistics (mixture of experts) outlive the forward: the
  // trainer reads them before the backward.
  auto keep_statistics = [&](UseCounts& uses) {
    for (const std::vector<Tensor>* stats : {&model_.router_counts, &model_.router_prob_sums})
      for (const Tensor& t : *stats)
        if (annotated_->of(t).contains(rank_)) keep_value(uses, t);
  };
  auto keep_results = [&](UseCounts& uses) {
    keep_value(uses, model_.loss);
    for (const auto& [name, id] : grad_sync_node_) keep_value(uses, g.node(id).inputs[0]);
    keep_statistics(uses);
  };
  uses_ = count_consumers(g, order_, {all});
  keep_results(uses_);
  recompute_forward_uses_ = count_consumers(g, order_, {fwd});
  keep_statistics(recompute_forward_uses_);
  for (int id : fwd)  // every output of a saved node (the loss's statistics too)
    if (saved_[id])
      for (int& n : recompute_forward_uses_[id]) ++n;
  recompute_backward_uses_ = count_consumers(g, order_, {recompute_order_, bwd});
  keep_results(recompute_backward_uses_);
}

std::vector<PlannedReshard> ExecGraph::dry_run(std::vector<PlannedOpTraffic>* traffic) const {
  return rank_dry_run(*plan_, training_, resolve_, traffic);  // the graph's resolutions are reused
}

std::vector<DiscoveredPipeline> ExecGraph::discover_pipelines() const {
  return hspmd::discover_pipelines(*plan_, *topology_, training_);
}

const Annotation& ExecGraph::annotation(const std::string& name) const {
  auto it = plan_->tensors.find(name);
  if (it == plan_->tensors.end()) fail("[exec] no annotation for '", name, "'");
  return it->second;
}

std::optional<Box> ExecGraph::local_box(const std::string& name, const Shape& global_shape) const {
  return hspmd::local_box(annotation(name), global_shape, rank_);
}

// What an op needs to run on this rank under one shape instance: its local
// output shapes and where its arrays sit in the global tensors.
struct ExecGraph::LocalOp {
  ShardContext shard;
  OpContext ctx;
  OpTraffic traffic;  // the op's own prediction of its communication per call
};

// Everything of this rank's graph that depends on the symbol bindings.
struct ExecGraph::Instance {
  Bindings bindings;                                            // the ops' ctx.bindings point here
  std::map<int, Shape> leaf_shapes;                             // leaf node id -> local shape
  std::vector<std::unique_ptr<LocalOp>> local_ops;              // per node id, for this rank's ops
  std::map<int, std::shared_ptr<const Resolution>> resolutions;  // this rank's Reshard node ids ->
};

ExecGraph::~ExecGraph() = default;

const ExecGraph::Instance& ExecGraph::instance(const Bindings& bindings) const {
  auto found = instances_.find(bindings);
  if (found != instances_.end()) return *found->second;
  auto inst = std::make_unique<Instance>();
  inst->bindings = bindings;
  const Graph& g = *model_.graph;
  inst->local_ops.resize(g.num_nodes());
  for (int id : order_) {  // leaves first: an unbound symbol is named by eval_shape
    const Node& n = g.node(id);
    if (is_leaf(n)) {
      auto box = hspmd::local_box(annotated_->of(n.output(0)), eval_shape(n.outputs[0].shape, bindings),
                                  rank_);
      HSPMD_CHECK(box.has_value(), "rank ", rank_, " does not hold leaf '", n.name, "'");
      inst->leaf_shapes.emplace(id, box->shape());
    }
  }
  std::vector<bool> runs(g.num_nodes(), false);
  for (int id : order_) runs[id] = true;
  for (auto& [id, spec] : training_.reshards(bindings, rank_))
    if (runs[id]) inst->resolutions.emplace(id, resolve_(spec));
  for (int id : order_)
    if (!is_leaf(g.node(id)) && !is_reshard(g.node(id)))
      inst->local_ops[id] = make_local_op(g.node(id), inst->bindings);
  return *instances_.emplace(bindings, std::move(inst)).first->second;
}

std::unique_ptr<ExecGraph::LocalOp> ExecGraph::make_local_op(const Node& node,
                                                             const Bindings& bindings) const {
  auto op = std::make_unique<LocalOp>();
  op->shard = shard_context(*annotated_, node, bindings, rank_);
  ShardContext& shard = op->shard;
  for (int i = 0; i < static_cast<int>(node.outputs.size()); ++i) {
    op->ctx.out_shapes.push_back(shard.output_boxes[i].shape());
    op->ctx.out_dtypes.push_back(node.outputs[i].dtype);
  }
  op->traffic = node.op->traffic(shard);
  shard.group_along = [this, &node](int input, int dim) -> Communicator& {
    const std::vector<int> ranks = ranks_along(annotated_->of(node.inputs.at(input)), rank_, dim);
    Communicator& group = world_->group(ranks);
    if (!clock_) return group;
    // Emulation: op-internal communication advances the virtual clock too.
    auto& clocked = clocked_groups_[ranks];
    if (!clocked) clocked = std::make_unique<ClockedCommunicator>(group, *clock_, *topology_, ranks);
    return *clocked;
  };
  if (node.op->spans_devices()) {  // the op resolves its own exchanges (expert parallelism)
    shard.topology = topology_.get();
    shard.group = [this](const std::vector<int>& ranks) -> Communicator& {
      Communicator& group = world_->group(ranks);
      if (!clock_) return group;
      auto& clocked = clocked_groups_[ranks];
      if (!clocked) clocked = std::make_unique<ClockedCommunicator>(group, *clock_, *topology_, ranks);
      return *clocked;
    };
  }
  op->ctx.device = device_;
  op->ctx.stream = &default_stream(device_);
  op->ctx.bindings = &bindings;
  op->ctx.shard = &op->shard;
  return op;
}

std::vector<NDArray> ExecGraph::compute(const LocalOp& op, const Node& node,
                                        const std::vector<NDArray>& inputs) const {
  const int64_t before = world_->bytes().sent;
  const double billed = clock_ ? clock_->compute_s() : 0;
  if (clock_) clock_->begin_compute();
  OpTiming* timing = nullptr;
  if (op_timing_) {
    timing = &op_timing_->emplace_back();
    timing->type = node.op->type();
    timing->start.record(*op.ctx.stream);
  }
  int64_t runtime_sent = 0;  // what a data-dependent op predicts for this call
  double runtime_flops = -1;  // ... and the work it did
  std::vector<NDArray> outputs;
  if (node.op->spans_devices()) {
    OpContext ctx = op.ctx;
    ctx.traffic_sent = &runtime_sent;
    ctx.work_flops = &runtime_flops;
    outputs = run_op(node, ctx, inputs);
  } else {
    outputs = run_op(node, op.ctx, inputs);
  }
  if (timing) {
    timing->end.record(*op.ctx.stream);
    for (const std::vector<NDArray>* arrays : {&inputs, static_cast<const std::vector<NDArray>*>(&outputs)})
      for (const NDArray& a : *arrays) timing->bytes += a.valid() ? static_cast<double>(a.nbytes()) : 0.0;
    timing->flops = runtime_flops >= 0 ? runtime_flops : op_work(node, inputs, outputs, &op.shard).flops;
  }
  if (clock_) clock_->end_compute();
  ledger_.op_measured += world_->bytes().sent - before;
  ledger_.op_predicted += op.traffic.sent + runtime_sent;
  if (node.op->spans_devices()) {
    ledger_.expert_measured += world_->bytes().sent - before;
    ledger_.expert_predicted += runtime_sent;
  }
  const bool modeled = clock_ && clock_->modeled();
  if (modeled || observer_) {
    OpWork work = op_work(node, inputs, outputs, &op.shard);
    if (runtime_flops >= 0) work.flops = runtime_flops;
    if (modeled) {
      HSPMD_CHECK(time_model_ != nullptr, "a model-mode clock needs an op time model (set_op_time_model)");
      clock_->advance(time_model_->seconds(node.op->type(), work));
    }
    if (observer_) observer_(node, work, clock_ ? clock_->compute_s() - billed : 0.0);
  }
  return outputs;
}

void ExecGraph::check_feeds(const ValueMap& values, const Instance& inst) const {
  for (const auto& [id, want] : inst.leaf_shapes) {
    const std::string& name = model_.graph->node(id).name;
    auto it = values.find(name);
    if (it == values.end()) fail("[exec] rank ", rank_, ": no local value for '", name, "'");
    if (it->second.shape() != want)
      fail("[exec] rank ", rank_, ": '", name, "' has local shape ", shape_str(it->second.shape()),
           " but the bindings give ", shape_str(want));
  }
}

void ExecGraph::run_nodes(std::span<const int> ids, const ValueMap* values, Activations& a,
                          Communicator& world, const char* trace_prefix, const GradReady* on_grad) const {
  const Instance& inst = *a.instance;
  world_ = &world;  // for the ops' group_along
  NodeRunner runner;
  runner.leaf = [&](const Node& n) {
    HSPMD_CHECK(values != nullptr, "leaf '", n.name, "' after the loss");
    // check_feeds found it; a host feed (a batch) moves to the graph's device.
    return std::vector<NDArray>{kernels::to_device(stream(), values->at(n.name))};
  };
  runner.compute = [&](const Node& n, const std::vector<NDArray>& inputs) {
    if (step_open_ && parameter_only(n.id)) {  // the step's pre-processing
      auto it = step_values_.find(n.id);
      if (it == step_values_.end())
        it = step_values_.emplace(n.id, compute(*inst.local_ops.at(n.id), n, inputs)).first;
      else if (step_given_.count(n.id) > 0)  // the caller's copy of this cast: its shape and dtype
        HSPMD_CHECK(inputs.size() == 1 && it->second[0].shape() == inputs[0].shape() &&
                        it->second[0].dtype() == n.outputs.at(0).dtype,
                    "[exec] node ", n.id, " ('", n.name, "'): the given copy is ", shape_str(it->second[0].shape()),
                    " ", dtype_name(it->second[0].dtype()), ", the cast of its input gives ",
                    shape_str(inputs[0].shape()), " ", dtype_name(n.outputs.at(0).dtype));
      return it->second;
    }
    if (!is_reshard(n)) return compute(*inst.local_ops.at(n.id), n, inputs);
    const std::string name = trace_prefix + (n.name.empty() ? std::string("reshard") : n.name);
    return std::vector<NDArray>{run_reshard(*inst.resolutions.at(n.id), name, inputs[0], world)};
  };
  // Raw gradients by the id of the node that computes them (on_grad).
  std::map<int, std::vector<std::pair<std::string, int>>> grads_of;
  if (on_grad != nullptr && *on_grad)
    for (const auto& [param, id] : grad_sync_node_) {
      const Tensor raw = model_.graph->node(id).inputs[0];
      grads_of[raw.node_id()].emplace_back(param, raw.index());
    }
  if (memory_cap_ > 0 || !grads_of.empty())
    runner.after = [&](const Node& n) {
      if (memory_cap_ > 0) check_memory(n);
      auto found = grads_of.find(n.id);
      if (found == grads_of.end()) return;
      for (const auto& [param, index] : found->second)
        if (const NDArray& g = a.slots[n.id][index]; g.valid()) (*on_grad)(param, g);
    };
  hspmd::run_nodes(*model_.graph, ids, a, runner);
}

ExecGraph::Activations ExecGraph::forward(const ValueMap& values, Communicator& world) const {
  return forward(values, world, bindings_);
}

ExecGraph::Activations ExecGraph::forward(const ValueMap& values, Communicator& world,
                                          const Bindings& bindings) const {
  const Instance& inst = instance(bindings);
  check_feeds(values, inst);
  Activations a{{std::vector<std::vector<NDArray>>(model_.graph->num_nodes()),
                 recompute_ ? recompute_forward_uses_ : uses_},
                &inst,
                recompute_};
  run_nodes(std::span<const int>(order_).first(forward_end_), &values, a, world);
  return a;
}

ExecGraph::MicroBatch ExecGraph::backward(Activations a, Communicator& world, const GradReady& on_grad,
                                          bool read_loss) const {
  HSPMD_CHECK(a.instance != nullptr, "backward() of activations no forward() produced");
  if (a.recompute) {  // the forward kept only the saved values: rebuild the rest first
    a.remaining = recompute_backward_uses_;
    run_nodes(recompute_order_, nullptr, a, world, "recompute.");
  }
  run_nodes(std::span<const int>(order_).subspan(forward_end_), nullptr, a, world, "", &on_grad);
  const Graph& g = *model_.graph;
  MicroBatch out;
  const auto& loss = a.slots[model_.loss.node_id()];
  if (!loss.empty() && loss[0].valid()) {
    out.loss_array = loss[0];
    if (read_loss) out.loss = kernels::to_host(stream(), loss[0]).host_data<float>("the loss")[0];
  }
  for (const auto& [name, id] : grad_sync_node_) {
    const Tensor raw = g.node(id).inputs[0];
    const auto& s = a.slots[raw.node_id()];
    if (!s.empty() && s[raw.index()].valid()) out.raw_grads[name] = s[raw.index()];
  }
  return out;
}

bool ExecGraph::represents(const Tensor& t) const { return is_representative(annotated_->of(t), rank_); }

NDArray ExecGraph::forward_value(const Activations& a, const Tensor& t) const {
  if (!t.valid() || t.node_id() >= static_cast<int>(a.slots.size())) return NDArray();
  const auto& slot = a.slots[t.node_id()];
  return slot.size() > static_cast<size_t>(t.index()) ? slot[t.index()] : NDArray();
}

ExecGraph::MicroBatch ExecGraph::run_micro_batch(const ValueMap& values, Communicator& world) const {
  return backward(forward(values, world), world);
}

ExecGraph::MicroBatch ExecGraph::run_micro_batch(const ValueMap& values, Communicator& world,
                                                 const Bindings& bindings) const {
  return backward(forward(values, world, bindings), world);
}

const Resolution* ExecGraph::grad_resolution(const std::string& param) const {
  auto found = grad_resolutions_.find(grad_sync_node_.at(param));
  if (found == grad_resolutions_.end() || !found->second->ranks.count(rank_)) return nullptr;
  return found->second.get();
}

const ReshardSpec& ExecGraph::grad_spec(const std::string& param) const {
  return grad_specs_.at(grad_sync_node_.at(param));
}

NDArray ExecGraph::run_grad_sync(const std::string& param, const NDArray& local, Communicator& world) const {
  const Resolution* r = grad_resolution(param);
  HSPMD_CHECK(r != nullptr, "rank ", rank_, " takes no part in the gradient sync of '", param, "'");
  return run_reshard(*r, model_.graph->node(grad_sync_node_.at(param)).name, local, world);
}

NDArray ExecGraph::reshard(const std::string& name, const Shape& shape, const Annotation& from,
                           const Annotation& to, const NDArray& local, Communicator& world, DType dtype) const {
  const auto r = resolve_(ReshardSpec{name, shape, dtype, from, to});
  if (!r || !r->ranks.count(rank_)) return NDArray();
  const DType back = local.valid() ? local.dtype() : DType::F32;
  NDArray out = run_reshard(*r, name, local.valid() && local.dtype() != dtype ? kernels::cast(stream(), local, dtype) : local,
                            world);
  return out.valid() && out.dtype() != back ? kernels::cast(stream(), out, back) : out;
}

void ExecGraph::check_memory(const Node& node) const {
  const size_t used = allocator_for(device_).current_bytes();
  if (used > memory_cap_)
    fail("[emulate] rank ", rank_, ": out of memory: ", used / 1048576.0, " MiB in use after ",
         node.op->type(), node.name.empty() ? "" : " '" + node.name + "'", " exceeds its cap of ",
         memory_cap_ / 1048576.0, " MiB");
}

// Clock values travel as two floats (hi, lo) on their own tag.
constexpr int kClockTag = 0x434b;

void ExecGraph::sync_clock(const Resolution& r, Communicator& world) const {
  const RankResolution& me = r.ranks.at(rank_);
  std::set<int> to, from;
  double transfer = 0;
  auto link = [&](int peer) { return topology_->bandwidth(rank_, peer) * 1e9; };
  for (const CommPhase& ph : me.phases)
    for (const CommOp& op : ph.ops) {
      if (op.group.size() > 1) {
        double bw = std::numeric_limits<double>::infinity();
        for (int m : op.group)
          if (m != rank_) to.insert(m), from.insert(m), bw = std::min(bw, link(m));
        transfer += static_cast<double>(std::max(op.bytes_sent, op.bytes_received)) / bw;
      }
      for (const Transfer& t : op.sends) to.insert(t.peer), transfer += t.bytes / link(t.peer);
      for (const Transfer& t : op.recvs) from.insert(t.peer), transfer += t.bytes / link(t.peer);
    }
  const double now = clock_->now();
  const float hi = static_cast<float>(now), lo = static_cast<float>(now - hi);
  for (int peer : to) pending_.send({hi, lo}, peer, kClockTag, world);
  std::vector<float> theirs(2 * from.size());
  std::vector<Request> recvs;
  size_t k = 0;
  for (int peer : from) recvs.push_back(world.start_recv(theirs.data() + 2 * k++, 2, peer, kClockTag));
  world.wait_all(recvs);
  double ready = now;
  for (size_t i = 0; i < from.size(); ++i)
    ready = std::max(ready, static_cast<double>(theirs[2 * i]) + theirs[2 * i + 1]);
  clock_->communicate(ready, transfer);
}

NDArray ExecGraph::run_reshard(const Resolution& r, const std::string& name, const NDArray& in,
                               Communicator& world) const {
  const double t0 = clock_ ? clock_->now() : 0;
  if (clock_) sync_clock(r, world);
  const int64_t before = world.bytes().sent;
  NDArray out = execute(r, rank_, in, world, defer_sends_ ? &pending_ : nullptr, &stream());
  ledger_.measured += world.bytes().sent - before;
  ledger_.predicted += r.ranks.at(rank_).bytes_sent;
  if (clock_ && !r.ranks.at(rank_).phases.empty())  // identities are not communication
    clock_->record(name.empty() ? "reshard" : name, "comm", t0);
  return out;
}

}  // namespace hspmd

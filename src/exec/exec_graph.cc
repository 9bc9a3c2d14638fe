#include "hspmd/exec/exec_graph.h"

#include <algorithm>
#include <limits>
#include <set>

#include "hspmd/comm/execute.h"
#include "hspmd/core/error.h"
#include "hspmd/graph/op.h"
#include "hspmd/ops/ops.h"

namespace hspmd {

namespace {

bool is_leaf(const Node& n) {
  const std::string t = n.op->type();
  return t == "placeholder" || t == "parameter";
}

bool is_reshard(const Node& n) { return n.op->type() == "reshard"; }

// The communication layer moves f32; token ids and positions (i32, < 2^24)
// travel exactly as f32.
NDArray execute_any(const Resolution& r, int rank, const NDArray& in, Communicator& world,
                    PendingSends* deferred) {
  if (!in.valid() || in.dtype() == DType::F32) return execute(r, rank, in, world, deferred);
  NDArray out = execute(r, rank, in.to(DType::F32), world, deferred);
  if (!out.valid()) return out;
  NDArray back = NDArray::empty(out.shape(), in.dtype());
  const float* src = out.data<float>();
  int32_t* dst = back.data<int32_t>();
  for (int64_t i = 0; i < out.numel(); ++i) dst[i] = static_cast<int32_t>(src[i]);
  return back;
}

// The ranks of `rank`'s subgroup under `a` whose coordinates equal its own on
// every key but split(dim), ordered by their chunk along dim.
std::vector<int> ranks_along(const Annotation& a, int rank, int dim) {
  const Subgroup& g = a.subgroups.at(a.subgroup_of(rank));
  const std::vector<int> mine = g.states.coordinates(g.devices.index_of(rank));
  std::vector<std::pair<int, int>> found;  // (chunk, rank)
  for (int q = 0; q < g.devices.size(); ++q) {
    const std::vector<int> c = g.states.coordinates(q);
    bool same = true;
    for (size_t k = 0; k < c.size(); ++k)
      if (g.states.order[k] != dim && c[k] != mine[k]) same = false;
    if (same) found.push_back({g.states.coordinate(q, dim), g.devices.ranks[q]});
  }
  std::sort(found.begin(), found.end());
  std::vector<int> ranks;
  for (auto [chunk, r] : found) ranks.push_back(r);
  return ranks;
}

}  // namespace

bool is_representative(const Annotation& a, int rank) {
  const int g = a.subgroup_of(rank);
  if (g < 0 || (a.hdim == kDup && g != 0)) return false;
  const Subgroup& sub = a.subgroups[g];
  return sub.states.coordinate(sub.devices.index_of(rank), kDup) == 0;
}

ExecGraph::ExecGraph(const AnnotationPlan& plan, const Topology& topology, int rank,
                     Bindings bindings)
    : plan_(plan), topology_(topology), rank_(rank), bindings_(std::move(bindings)),
      training_(annotate_training_graph(plan)), resolve_(topology) {
  annotated_ = training_.annotated.get();
  const Graph& g = *model_.graph;
  for (auto& [id, spec] : training_.reshards(bindings_))
    resolutions_.emplace(id, resolve_(spec));
  for (int id = 0; id < g.num_nodes(); ++id) {
    const Node& n = g.node(id);
    if (is_reshard(n)) {
      if (n.name.rfind("grad.", 0) == 0) {
        grad_sync_node_[n.name.substr(5)] = id;
        continue;  // gradient sync runs once per step, not per micro-batch
      }
      if (resolutions_.at(id)->ranks.count(rank_)) order_.push_back(id);
    } else if (annotated_->of(n.output(0)).contains(rank_)) {
      order_.push_back(id);
    }
  }
  local_ops_.resize(g.num_nodes());
  for (int id : order_)
    if (!is_leaf(g.node(id)) && !is_reshard(g.node(id))) local_ops_[id] = make_local_op(g.node(id));
  // Intermediates are released after their last local consumer; the loss and
  // the raw gradients are kept for the caller.
  uses_.resize(g.num_nodes());
  for (int id : order_) uses_[id].assign(g.node(id).outputs.size(), 0);
  for (int id : order_)
    for (const Tensor& in : g.node(id).inputs)
      if (!uses_[in.node_id()].empty()) ++uses_[in.node_id()][in.index()];
  auto keep = [&](const Tensor& t) {
    if (!uses_[t.node_id()].empty()) ++uses_[t.node_id()][t.index()];
  };
  keep(model_.loss);
  for (const auto& [name, id] : grad_sync_node_) keep(g.node(id).inputs[0]);
  const int loss_id = model_.loss.node_id();
  forward_end_ = std::find_if(order_.begin(), order_.end(), [&](int id) { return id > loss_id; }) -
                 order_.begin();
}

const Annotation& ExecGraph::annotation(const std::string& name) const {
  auto it = plan_.tensors.find(name);
  if (it == plan_.tensors.end()) fail("[exec] no annotation for '", name, "'");
  return it->second;
}

std::optional<Box> ExecGraph::local_box(const std::string& name, const Shape& global_shape) const {
  return hspmd::local_box(annotation(name), global_shape, rank_);
}

// What an op needs to run on this rank, fixed once the bindings are: its
// local output shapes and where its arrays sit in the global tensors.
struct ExecGraph::LocalOp {
  ShardContext shard;
  OpContext ctx;
};

ExecGraph::~ExecGraph() = default;

std::unique_ptr<ExecGraph::LocalOp> ExecGraph::make_local_op(const Node& node) const {
  auto op = std::make_unique<LocalOp>();
  auto box_of = [&](const Tensor& t, const Shape& global) {
    auto box = hspmd::local_box(annotated_->of(t), global, rank_);
    HSPMD_CHECK(box.has_value(), "rank ", rank_, " does not hold a tensor of node ", node.id);
    return *box;
  };
  ShardContext& shard = op->shard;
  for (const Tensor& in : node.inputs) {
    shard.input_global_shapes.push_back(eval_shape(in.shape(), bindings_));
    shard.input_boxes.push_back(box_of(in, shard.input_global_shapes.back()));
  }
  for (int i = 0; i < static_cast<int>(node.outputs.size()); ++i) {
    shard.output_global_shapes.push_back(eval_shape(node.outputs[i].shape, bindings_));
    shard.output_boxes.push_back(box_of(node.output(i), shard.output_global_shapes.back()));
    op->ctx.out_shapes.push_back(shard.output_boxes.back().shape());
    op->ctx.out_dtypes.push_back(node.outputs[i].dtype);
  }
  shard.group_along = [this, &node](int input, int dim) -> Communicator& {
    return world_->group(ranks_along(annotated_->of(node.inputs.at(input)), rank_, dim));
  };
  op->ctx.bindings = &bindings_;
  op->ctx.shard = &op->shard;
  return op;
}

std::vector<NDArray> ExecGraph::compute(const Node& node, const std::vector<NDArray>& inputs) const {
  const OpContext& ctx = local_ops_.at(node.id)->ctx;
  std::vector<NDArray> outputs(node.outputs.size());
  if (clock_) clock_->begin_compute();
  node.op->compute(ctx, inputs, outputs);
  if (clock_) clock_->end_compute();
  for (size_t i = 0; i < outputs.size(); ++i)
    HSPMD_CHECK(outputs[i].valid() && outputs[i].shape() == ctx.out_shapes[i], "op ",
                node.op->type(), " output ", i, " has the wrong local shape");
  return outputs;
}

void ExecGraph::run_nodes(size_t begin, size_t end, const ValueMap* values, Activations& a,
                          Communicator& world) const {
  const Graph& g = *model_.graph;
  auto& slots = a.slots;
  world_ = &world;  // for the ops' group_along
  for (size_t k = begin; k < end; ++k) {
    const int id = order_[k];
    const Node& n = g.node(id);
    if (is_leaf(n)) {
      HSPMD_CHECK(values != nullptr, "leaf '", n.name, "' after the loss");
      auto it = values->find(n.name);
      if (it == values->end()) fail("[exec] rank ", rank_, ": no local value for '", n.name, "'");
      slots[id] = {it->second};
      continue;
    }
    std::vector<NDArray> inputs;
    for (const Tensor& in : n.inputs) {
      const auto& s = slots[in.node_id()];
      inputs.push_back(s.empty() ? NDArray() : s[in.index()]);
    }
    if (is_reshard(n))
      slots[id] = {run_reshard(*resolutions_.at(id), n.name, inputs[0], world)};
    else
      slots[id] = compute(n, inputs);
    inputs.clear();
    if (memory_cap_ > 0) check_memory(n);
    for (const Tensor& in : n.inputs) {
      auto& left = a.remaining[in.node_id()];
      if (!left.empty() && --left[in.index()] == 0 && !slots[in.node_id()].empty())
        slots[in.node_id()][in.index()] = NDArray();
    }
  }
}

ExecGraph::Activations ExecGraph::forward(const ValueMap& values, Communicator& world) const {
  Activations a{std::vector<std::vector<NDArray>>(model_.graph->num_nodes()), uses_};
  run_nodes(0, forward_end_, &values, a, world);
  return a;
}

ExecGraph::MicroBatch ExecGraph::backward(Activations a, Communicator& world) const {
  run_nodes(forward_end_, order_.size(), nullptr, a, world);
  const Graph& g = *model_.graph;
  MicroBatch out;
  const auto& loss = a.slots[model_.loss.node_id()];
  if (!loss.empty()) out.loss = loss[0].data<float>()[0];
  for (const auto& [name, id] : grad_sync_node_) {
    const Tensor raw = g.node(id).inputs[0];
    const auto& s = a.slots[raw.node_id()];
    if (!s.empty() && s[raw.index()].valid()) out.raw_grads[name] = s[raw.index()];
  }
  return out;
}

ExecGraph::MicroBatch ExecGraph::run_micro_batch(const ValueMap& values, Communicator& world) const {
  return backward(forward(values, world), world);
}

std::map<std::string, NDArray> ExecGraph::sync_gradients(const std::map<std::string, NDArray>& raw,
                                                         Communicator& world) const {
  std::map<std::string, NDArray> synced;
  for (const std::string& name : model_.names) {  // the same order on every rank
    const int id = grad_sync_node_.at(name);
    const Resolution& r = *resolutions_.at(id);
    if (!r.ranks.count(rank_)) continue;
    auto it = raw.find(name);
    NDArray out = run_reshard(r, "grad." + name, it == raw.end() ? NDArray() : it->second, world);
    if (out.valid()) synced[name] = out;
  }
  return synced;
}

NDArray ExecGraph::reshard(const std::string& name, const Shape& shape, const Annotation& from,
                           const Annotation& to, const NDArray& local, Communicator& world) const {
  const auto r = resolve_(ReshardSpec{name, shape, DType::F32, from, to});
  if (!r->ranks.count(rank_)) return NDArray();
  return run_reshard(*r, name, local, world);
}

void ExecGraph::check_memory(const Node& node) const {
  const size_t used = allocator_for(Device::cpu()).current_bytes();
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
  auto link = [&](int peer) { return topology_.bandwidth(rank_, peer) * 1e9; };
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
  NDArray out = execute_any(r, rank_, in, world, defer_sends_ ? &pending_ : nullptr);
  ledger_.measured += world.bytes().sent - before;
  ledger_.predicted += r.ranks.at(rank_).bytes_sent;
  if (clock_ && !r.ranks.at(rank_).phases.empty())  // identities are not communication
    clock_->record(name.empty() ? "reshard" : name, "comm", t0);
  return out;
}

}  // namespace hspmd

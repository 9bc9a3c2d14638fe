// TrainingState: slots of one rank, the switch executor and the checkpoint
// shards (docs/switching.md).
#include "hspmd/train/training_state.h"

#include <algorithm>
#include <chrono>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/device.h"
#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/exec/exec_graph.h"
#include "hspmd/exec/virtual_clock.h"
#include "hspmd/io/checkpoint.h"
#include "hspmd/models/model.h"
#include "kernels/memory.h"

namespace hspmd {

namespace {

constexpr int kSwitchTag = 0x5357;

constexpr std::array<StateSlot, 4> kSlots = {StateSlot::kParam, StateSlot::kMaster, StateSlot::kExpAvg,
                                             StateSlot::kExpAvgSq};

// The slots holding state tensor `kind` (the weights live in two).
bool slot_of_kind(StateSlot slot, StateSlot kind) {
  if (kind == StateSlot::kParam) return slot == StateSlot::kParam || slot == StateSlot::kMaster;
  return slot == kind;
}

// `box`'s corner relative to `holder`'s.
Shape corner_in(const Box& holder, const Box& box) {
  Shape at(box.begin.size());
  for (size_t d = 0; d < at.size(); ++d) at[d] = box.begin[d] - holder.begin[d];
  return at;
}

// Copies `box` (global coordinates, inside both) from `src`, holding
// `src_box`, into `dst`, holding `dst_box` (f32, contiguous), on `stream`.
void copy_box(Stream& stream, const NDArray& src, const Box& src_box, NDArray& dst, const Box& dst_box,
              const Box& box) {
  if (box.numel() == 0) return;
  NDArray to = dst.reshape(dst_box.shape());
  kernels::copy_block(stream, src.reshape(src_box.shape()), corner_in(src_box, box), to,
                      corner_in(dst_box, box), box.shape());
}

// Elements [offset, offset + box.numel()) of the flat array `flat`, as an
// array holding `box`.
NDArray flat_box(const NDArray& flat, int64_t offset, const Box& box) {
  return flat.slice(0, offset, offset + box.numel()).reshape(box.shape());
}

}  // namespace

TrainingState::TrainingState(std::shared_ptr<const AnnotationPlan> plan, int rank)
    : plan_(std::move(plan)), rank_(rank) {
  for (const auto& [name, shape] : model_parameter_shapes(plan_->model)) {
    auto& slots = params_[name];
    for (StateSlot s : kSlots) {
      const Annotation* a = slot_layout(*plan_, name, s);
      if (!a) continue;
      if (auto box = local_box(*a, shape, rank_)) slots[static_cast<int>(s)].box = *box;
    }
  }
}

Shard& TrainingState::slot(const std::string& param, StateSlot s) {
  auto it = params_.find(param);
  HSPMD_CHECK(it != params_.end(), "no training state for parameter '", param, "'");
  return it->second[static_cast<int>(s)];
}

const Shard& TrainingState::slot(const std::string& param, StateSlot s) const {
  return const_cast<TrainingState*>(this)->slot(param, s);
}

Shard& TrainingState::optimized(const std::string& param) {
  return slot(param, zero(param) ? StateSlot::kMaster : StateSlot::kParam);
}

void TrainingState::move_to_device(Device device) {
  device_ = device;
  Stream& stream = default_stream(device);
  for (auto& [name, slots] : params_)
    for (Shard& s : slots)
      if (s.held() && !(s.data.device() == device)) s.data = kernels::to_device(stream, s.data);
}

int64_t TrainingState::bytes() const {
  int64_t n = 0;
  for (const auto& [name, slots] : params_)
    for (const Shard& s : slots)
      if (s.held()) n += static_cast<int64_t>(s.data.nbytes());
  return n;
}

TrainingState TrainingState::from_full(std::shared_ptr<const AnnotationPlan> plan, int rank,
                                       const std::map<std::string, NDArray>& full) {
  TrainingState st(std::move(plan), rank);
  for (const auto& [name, shape] : model_parameter_shapes(st.plan_->model)) {
    NDArray array = full.at(name);
    if (array.dim(0) != shape[0]) {  // a padded vocabulary: zero rows (docs/vocab_parallel.md)
      Stream& host = default_stream(Device::cpu());
      NDArray padded = kernels::zeros(host, shape, DType::F32);
      NDArray head = padded.slice(0, 0, array.dim(0));
      kernels::copy(host, array.contiguous(), head);
      array = padded;
    }
    for (StateSlot s : kSlots) {
      Shard& sh = st.slot(name, s);
      if (!sh.placed()) continue;
      sh.data = s == StateSlot::kParam || s == StateSlot::kMaster ? box_slice(array, sh.box)
                                                                  : NDArray::zeros(sh.box.shape(), DType::F32);
    }
  }
  return st;
}

namespace {

// Writes every part of a slice (box `box` of state tensor `t`, the array
// `src` holding `box`) into the new state's shards of that tensor it overlaps.
void deliver(Stream& stream, TrainingState& to, const StateTensor& t, const NDArray& src, const Box& box) {
  for (StateSlot s : kSlots) {
    if (!slot_of_kind(s, t.kind)) continue;
    Shard& sh = to.slot(t.param, s);
    if (!sh.held()) continue;
    Box part = box;
    bool empty = false;
    for (size_t d = 0; d < box.begin.size(); ++d) {
      part.begin[d] = std::max(box.begin[d], sh.box.begin[d]);
      part.end[d] = std::min(box.end[d], sh.box.end[d]);
      empty = empty || part.begin[d] >= part.end[d];
    }
    if (!empty) copy_box(stream, src, box, sh.data, sh.box, part);
  }
}

// The round's transfer time on this rank's links (the predicted_s rule).
double link_seconds(const RankSwitchRound& r, int rank, const Topology& topology) {
  int64_t intra[2] = {0, 0}, inter[2] = {0, 0};
  for (int dir = 0; dir < 2; ++dir)
    for (const SwitchMessage& m : dir == 0 ? r.sends : r.recvs)
      (topology.same_node(rank, m.peer) ? intra : inter)[dir] += m.bytes;
  const DeviceSpec& dev = topology.device_type(rank);
  return std::max(std::max(intra[0], intra[1]) / (dev.intra_node_gbps * 1e9),
                  std::max(inter[0], inter[1]) / (dev.inter_node_gbps * 1e9));
}

// The latest clock of every rank (emulation only).
std::vector<double> all_clocks(const VirtualClock& clock, Communicator& world) {
  std::vector<double> all(world.size());
  const double mine = clock.now();
  world.all_gather(&mine, all.data(), std::vector<int64_t>(world.size(), 1));
  return all;
}

}  // namespace


namespace {

// One message of a round, packed from `from`'s slots in the message's order.
NDArray pack(Stream& stream, const TrainingState& from, const SwitchPlan& sp, const SwitchMessage& m) {
  NDArray out = NDArray::empty({m.bytes / 4}, DType::F32, stream.device());
  int64_t offset = 0;
  for (const SliceRef& s : m.slices) {
    const Shard& src = from.slot(sp.tensors[s.tensor].param, s.src_slot);
    HSPMD_CHECK(src.held(), "rank ", from.rank(), " sends a slot it does not hold");
    NDArray part = flat_box(out, offset, s.box);
    copy_box(stream, src.data, src.box, part, s.box, s.box);
    offset += s.box.numel();
  }
  return out;
}

void unpack(Stream& stream, TrainingState& to, const SwitchPlan& sp, const SwitchMessage& m,
            const NDArray& buffer) {
  int64_t offset = 0;
  for (const SliceRef& s : m.slices) {
    deliver(stream, to, sp.tensors[s.tensor], flat_box(buffer, offset, s.box), s.box);
    offset += s.box.numel();
  }
}

// The rank's new arrays of the round's tensors, zero-filled (padding rows
// of a vocabulary need no transfer).
void allocate_round(Stream& stream, TrainingState& next, const SwitchPlan& sp, const SwitchRound& round) {
  for (int t : round.tensors)
    for (const StateHolding& h : sp.tensors[t].needers) {
      if (h.rank != next.rank()) continue;
      Shard& sh = next.slot(sp.tensors[t].param, h.slot);
      if (!sh.held()) sh.data = kernels::zeros(stream, h.box.shape(), DType::F32);
    }
}

}  // namespace

// Keeps and checkpoint reads of one round (no communication).
void TrainingState::copy_local(const RankSwitchRound& r, const SwitchPlan& sp, TrainingState& next,
                               CheckpointReader* checkpoint, SwitchReport& rep) const {
  Stream& stream = default_stream(device());
  for (const SliceRef& s : r.keeps) {
    const Shard& src = slot(sp.tensors[s.tensor].param, s.src_slot);
    NDArray tmp = NDArray::empty(s.box.shape(), DType::F32, stream.device());
    copy_box(stream, src.data, src.box, tmp, s.box, s.box);
    deliver(stream, next, sp.tensors[s.tensor], tmp, s.box);
  }
  for (const SliceRef& s : r.checkpoint) {
    if (!checkpoint)
      fail("[switch] rank ", rank_, ": slices of '", sp.tensors[s.tensor].name(),
           "' must come from a checkpoint but none was given (", option_name("checkpoint"), ")");
    NDArray got = checkpoint->read(sp.tensors[s.tensor].name(), s.box);
    rep.checkpoint_bytes += static_cast<int64_t>(got.nbytes());
    deliver(stream, next, sp.tensors[s.tensor], kernels::to_device(stream, got), s.box);
  }
}

// One round on this rank: pack, keep and read, exchange every message at
// once, unpack; then free the old arrays of the round's tensors. Under a
// clock, packing and unpacking are compute and the exchange waits for the
// peers' clocks, then takes the rank's link time.
void TrainingState::run_round(const SwitchRound& round, const SwitchPlan& sp, TrainingState& next,
                              const Topology& topology, Communicator& world, CheckpointReader* checkpoint,
                              VirtualClock* clock, SwitchReport& rep) {
  Stream& stream = default_stream(device());
  allocate_round(stream, next, sp, round);
  std::vector<double> clocks;
  if (clock) clocks = all_clocks(*clock, world);
  auto mine = round.ranks.find(rank_);
  if (mine != round.ranks.end()) {
    const RankSwitchRound& r = mine->second;
    if (clock) clock->begin_compute();
    std::vector<NDArray> out, in;
    std::vector<SendBuffer> sends;
    std::vector<RecvBuffer> recvs;
    for (const SwitchMessage& m : r.sends) {
      out.push_back(pack(stream, *this, sp, m));
      sends.push_back(send_buffer(m.peer, out.back()));
    }
    for (const SwitchMessage& m : r.recvs) {
      in.push_back(NDArray::empty({m.bytes / 4}, DType::F32, stream.device()));
      recvs.push_back(recv_buffer(m.peer, in.back()));
    }
    copy_local(r, sp, next, checkpoint, rep);
    if (clock) {
      clock->end_compute();
      double ready = clock->now();
      for (const auto* list : {&r.sends, &r.recvs})
        for (const SwitchMessage& m : *list) ready = std::max(ready, clocks[m.peer]);
      clock->communicate(ready, link_seconds(r, rank_, topology));
    }
    const int64_t sent0 = world.bytes().sent;  // the clocks' exchanges are not the switch's
    world.batched_send_recv(stream, sends, recvs, kSwitchTag);
    rep.bytes_sent += world.bytes().sent - sent0;
    if (clock) clock->begin_compute();
    for (size_t k = 0; k < r.recvs.size(); ++k) unpack(stream, next, sp, r.recvs[k], in[k]);
    if (clock) clock->end_compute();
  }
  for (int t : round.tensors)
    for (StateSlot s : kSlots)
      if (slot_of_kind(s, sp.tensors[t].kind)) slot(sp.tensors[t].param, s).data = NDArray();
}

TrainingState TrainingState::reshard_to(std::shared_ptr<const AnnotationPlan> to, const SwitchPlan& sp,
                                        const Topology& topology, Communicator& world,
                                        CheckpointReader* checkpoint, VirtualClock* clock,
                                        SwitchReport* report) && {
  const auto t0 = std::chrono::steady_clock::now();
  Allocator& alloc = allocator_for(device());
  const int64_t before = static_cast<int64_t>(alloc.current_bytes());
  alloc.reset_peak();
  TrainingState next(std::move(to), rank_);
  next.device_ = device_;
  next.step = step;
  next.samples = samples;
  next.seed = seed;
  SwitchReport rep;
  rep.predicted_bytes = sp.stats.at(rank_).sent();
  double start = 0;
  if (clock) {
    const auto clocks = all_clocks(*clock, world);
    start = *std::max_element(clocks.begin(), clocks.end());
    clock->communicate(start, 0);
  }
  for (const SwitchRound& round : sp.rounds)
    run_round(round, sp, next, topology, world, checkpoint, clock, rep);
  const int64_t after = static_cast<int64_t>(alloc.current_bytes());
  rep.peak_extra_bytes = static_cast<int64_t>(alloc.peak_bytes()) - std::max(before, after);
  rep.bound_bytes = switch_memory_bound(sp, rank_);
  rep.switch_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (clock) {
    const auto clocks = all_clocks(*clock, world);
    rep.emulated_s = *std::max_element(clocks.begin(), clocks.end()) - start;
  }
  if (report) *report = rep;
  return next;
}

TrainingState TrainingState::load(std::shared_ptr<const AnnotationPlan> plan, int rank,
                                  CheckpointReader& checkpoint) {
  TrainingState st(std::move(plan), rank);
  for (auto& [name, slots] : st.params_)
    for (StateSlot s : kSlots) {
      Shard& sh = slots[static_cast<int>(s)];
      if (!sh.placed()) continue;
      const StateSlot kind = s == StateSlot::kMaster ? StateSlot::kParam : s;
      const std::string tensor = state_tensor_name(name, kind);
      Stream& host = default_stream(Device::cpu());  // a loaded state starts on the host
      sh.data = kernels::zeros(host, sh.box.shape(), DType::F32);
      // A vocabulary padded otherwise: rows beyond the checkpoint's stay zero.
      Box box = sh.box;
      const Shape& stored = checkpoint.index().tensors.at(tensor).shape;
      if (stored.empty() || box.begin[0] >= stored[0]) continue;
      box.end[0] = std::min(box.end[0], stored[0]);
      NDArray got = checkpoint.read(tensor, box);
      copy_box(host, got, box, sh.data, sh.box, box);
    }
  return st;
}

std::vector<TrainingState::NamedShard> TrainingState::checkpoint_shards() const {
  std::vector<NamedShard> out;
  for (const auto& [name, shape] : model_parameter_shapes(plan_->model)) {
    const bool z = zero(name);
    const Annotation& opt = *slot_layout(*plan_, name, StateSlot::kExpAvg);
    if (!is_representative(opt, rank_)) continue;
    const StateSlot weights = z ? StateSlot::kMaster : StateSlot::kParam;
    for (auto [kind, s] : {std::pair{StateSlot::kParam, weights}, std::pair{StateSlot::kExpAvg, StateSlot::kExpAvg},
                           std::pair{StateSlot::kExpAvgSq, StateSlot::kExpAvgSq}}) {
      const Shard& sh = slot(name, s);
      if (!sh.held()) continue;
      Shard host = sh;  // the files are written from host memory
      host.data = kernels::to_host(default_stream(sh.data.device()), sh.data);
      out.push_back(NamedShard{state_tensor_name(name, kind), shape, host});
    }
  }
  return out;
}

}  // namespace hspmd

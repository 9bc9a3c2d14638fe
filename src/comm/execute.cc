// The executor of a resolved Reshard over a communicator (execute.h). Each
// phase: pack what the rank sends, start every collective and message of the
// phase, wait them all, then unpack what arrived into the fresh buffer.
#include "hspmd/comm/execute.h"

#include <set>

#include "hspmd/comm/pack.h"
#include "hspmd/core/error.h"
#include "kernels/memory.h"
#include "resolve/internal.h"

namespace hspmd {
namespace {

using resolve_internal::contains;
using resolve_internal::member_index;

// Data that lands in the fresh buffer once the phase's requests complete:
// `boxes` packed one after the other in `data` (a flat array).
struct Arrival {
  NDArray data;
  std::vector<Box> boxes;
};

// Elements [offset, offset + count) of a flat array (a view).
NDArray flat_part(const NDArray& a, int64_t offset, int64_t count) { return a.slice(0, offset, offset + count); }

}  // namespace

class PhaseRun {
 public:
  PhaseRun(int rank, const std::optional<Box>& in_box, const NDArray& current, DType dtype, Communicator& world,
           Stream& stream)
      : rank_(rank), in_box_(in_box), current_(current), dtype_(dtype), world_(world), stream_(stream) {}

  void start(const CommOp& op);
  // Waits everything started (but the sends, when `deferred` takes them) and
  // writes the arrivals and local copies.
  NDArray finish(const std::optional<Box>& out_box, PendingSends* deferred);

 private:
  // A zeroed flat buffer of `count` elements of the Reshard's dtype, on the
  // stream's device, kept alive until the phase is finished (a started
  // operation reads or writes it until it is waited).
  NDArray buffer(int64_t count) { return buffers_.emplace_back(kernels::zeros(stream_, {count}, dtype_)); }
  // Packs `region` into `out` from element `offset` on; returns region.numel().
  int64_t pack(const Box& region, const NDArray& out, int64_t offset) const;
  void start_collective(const CommOp& op);

  int rank_;
  const std::optional<Box>& in_box_;
  const NDArray& current_;
  DType dtype_;
  Communicator& world_;
  Stream& stream_;
  std::vector<NDArray> buffers_;
  std::vector<Request> requests_;
  std::vector<Request> sends_;
  std::vector<NDArray> send_buffers_;  // kept alive until the sends complete (deferred: by PendingSends)
  std::vector<Arrival> arrivals_;
};

int64_t PhaseRun::pack(const Box& region, const NDArray& out, int64_t offset) const {
  HSPMD_CHECK(in_box_ && contains(*in_box_, region), "rank ", rank_, " reads ", to_string(region),
              " outside its in_box");
  NDArray part = flat_part(out, offset, region.numel());
  return pack_box(stream_, current_, *in_box_, region, part);
}

void PhaseRun::start_collective(const CommOp& op) {
  const int me = member_index(op, rank_);
  const bool contributes = op.contributes || is_all_gather(op.kind);
  std::vector<Box> send_boxes = is_all_gather(op.kind) ? std::vector<Box>{op.pieces[me]}
                                : is_reduce_scatter(op.kind) ? op.pieces
                                                    : std::vector<Box>{op.box};
  int64_t send_count = 0;
  for (const Box& b : send_boxes) send_count += b.numel();
  NDArray send = buffer(send_count);
  if (contributes)
    for (int64_t off = 0; const Box& b : send_boxes) off += pack(b, send, off);
  std::vector<int64_t> counts;
  for (const Box& b : op.pieces) counts.push_back(b.numel());
  const bool alone = op.group.size() == 1;  // no communicator needed (nor possible on a stub)
  if (op.kind == CommKind::kAllReduce || op.kind == CommKind::kSplitAllReduce) {
    if (!alone) requests_.push_back(world_.group(op.group).start_all_reduce(stream_, send));
    arrivals_.push_back({send, {op.box}});
  } else if (is_reduce_scatter(op.kind)) {
    NDArray recv = alone ? send : buffer(counts[me]);
    if (!alone) requests_.push_back(world_.group(op.group).start_reduce_scatter(stream_, send, recv, counts));
    arrivals_.push_back({recv, {op.pieces[me]}});
  } else {
    HSPMD_CHECK(op.pieces.size() == op.group.size(), "all_gather with ", op.pieces.size(), " pieces");
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    NDArray recv = alone ? send : buffer(total);
    if (!alone) requests_.push_back(world_.group(op.group).start_all_gather(stream_, send, recv, counts));
    arrivals_.push_back({recv, op.pieces});
  }
}

void PhaseRun::start(const CommOp& op) {
  if (is_collective(op.kind)) start_collective(op);
  if (op.kind == CommKind::kLocalSlice) {
    NDArray copy = buffer(op.box.numel());
    pack(op.box, copy, 0);
    arrivals_.push_back({copy, {op.box}});
  }
  for (const Box& b : op.keeps) {
    NDArray copy = buffer(b.numel());
    pack(b, copy, 0);
    arrivals_.push_back({copy, {b}});
  }
  for (const Transfer& t : op.sends) {
    int64_t count = 0;
    for (const Box& b : t.boxes) count += b.numel();
    NDArray msg = buffer(count);
    send_buffers_.push_back(msg);
    for (int64_t off = 0; const Box& b : t.boxes) off += pack(b, msg, off);
    sends_.push_back(world_.start_send(stream_, msg, t.peer, kReshardTag));
  }
  for (const Transfer& t : op.recvs) {
    int64_t count = 0;
    for (const Box& b : t.boxes) count += b.numel();
    NDArray msg = buffer(count);
    requests_.push_back(world_.start_recv(stream_, msg, t.peer, kReshardTag));
    arrivals_.push_back({msg, t.boxes});
  }
}

NDArray PhaseRun::finish(const std::optional<Box>& out_box, PendingSends* deferred) {
  if (deferred == nullptr) {
    for (Request& r : sends_) requests_.push_back(std::move(r));
    sends_.clear();
  }
  // A phase whose only operations are deferred sends waits for nothing
  // now. On NCCL a wait issues everything queued in one group on the
  // stream, and a send issued alone blocks its stream until the peer
  // receives: in a pipeline both stages' streams would then wait on each
  // other (each one's receive queued behind its own send). Left queued, the
  // sends go out in one group with this rank's next receive (or at
  // PendingSends::wait), as Megatron pairs send_forward with recv_backward.
  if (!requests_.empty() || deferred == nullptr) world_.wait_all(requests_);
  if (deferred != nullptr && !sends_.empty()) {
    // The arrays share their storage: the in-flight sends stay valid.
    for (NDArray& b : send_buffers_) deferred->buffers_.push_back(std::move(b));
    for (Request& r : sends_) deferred->requests_.push_back(std::move(r));
    deferred->world_ = &world_;
  }
  if (!out_box) return NDArray();
  NDArray fresh = kernels::zeros(stream_, out_box->shape(), dtype_);
  for (const Arrival& a : arrivals_) {
    int64_t off = 0;
    for (const Box& b : a.boxes) {
      HSPMD_CHECK(contains(*out_box, b), "rank ", rank_, " writes ", to_string(b), " outside its out_box");
      off += unpack_box(stream_, flat_part(a.data, off, a.data.numel() - off), fresh, *out_box, b);
    }
  }
  return fresh;
}

namespace {

// Creates every group of more than one member this rank will use, in sorted
// order: with one global order, collective creation cannot deadlock.
void create_groups(const RankResolution& plan, Communicator& world) {
  std::set<std::vector<int>> groups;
  for (const CommPhase& ph : plan.phases)
    for (const CommOp& op : ph.ops)
      if (is_collective(op.kind) && op.group.size() > 1) groups.insert(op.group);
  for (const std::vector<int>& g : groups) world.group(g);
}

}  // namespace

void PendingSends::send(Stream& stream, NDArray data, int peer, int tag, Communicator& world) {
  buffers_.push_back(std::move(data));
  requests_.push_back(world.start_send(stream, buffers_.back(), peer, tag));
  world_ = &world;
}

void PendingSends::send(const std::vector<float>& data, int peer, int tag, Communicator& world) {
  send(default_stream(Device::cpu()), NDArray::from_vector({static_cast<int64_t>(data.size())}, data), peer,
       tag, world);
}

void PendingSends::wait(Communicator& world) {
  world.wait_all(requests_);
  buffers_.clear();
}

PendingSends::~PendingSends() {
  if (requests_.empty() || world_ == nullptr) return;
  try {
    wait(*world_);
  } catch (...) {  // a destructor must not throw; wait() reports errors
  }
}

NDArray execute(const Resolution& resolution, int rank, const NDArray& local_input, Communicator& world,
                PendingSends* deferred, Stream* stream) {
  Stream& s = stream != nullptr ? *stream : default_stream(Device::cpu());
  if (world.size() > 1 && rank != world.rank())
    fail("[comm] reshard '", resolution.name, "': execute for rank ", rank, " on rank ", world.rank());
  auto it = resolution.ranks.find(rank);
  if (it == resolution.ranks.end()) return NDArray();
  const RankResolution& plan = it->second;
  if (plan.phases.empty()) return local_input.valid() ? local_input.contiguous() : NDArray();
  std::optional<Box> box = plan.phases[0].in_box;
  NDArray current;
  if (box) {
    if (!local_input.valid() || local_input.dtype() != resolution.dtype || local_input.shape() != box->shape())
      fail("[comm] reshard '", resolution.name, "': rank ", rank, " needs ", resolution.dtype == DType::BF16 ? "a " : "an ",
           dtype_name(resolution.dtype), " input of shape ", shape_str(box->shape()), " (its source box ", to_string(*box), ")");
    current = local_input.contiguous();
  }
  create_groups(plan, world);
  for (size_t p = 0; p < plan.phases.size(); ++p) {
    const CommPhase& ph = plan.phases[p];
    HSPMD_CHECK(ph.in_box == box, "rank ", rank, " phase ", p, ": in_box does not match its buffer");
    PhaseRun run(rank, box, current, resolution.dtype, world, s);
    for (const CommOp& op : ph.ops) run.start(op);
    current = run.finish(ph.out_box, deferred);
    box = ph.out_box;
  }
  return box ? current : NDArray();
}

}  // namespace hspmd

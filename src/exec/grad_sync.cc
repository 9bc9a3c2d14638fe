// Gradient synchronization (hspmd/exec/grad_sync.h): bucket forming, one
// bucket's sync (single, fused all-reduce, fused ZeRO reduce-scatter), the
// overlap's communication thread, and a run's per-step start/finish.
#include "hspmd/exec/grad_sync.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>

#include "hspmd/comm/execute.h"
#include "hspmd/comm/pack.h"
#include "hspmd/core/error.h"
#include "hspmd/core/threads.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd {

namespace {

// The group of the one all-reduce or reduce-scatter that `param`'s gradient
// sync is when, on every member, it is the member's whole part of the sync
// (one phase, one op over its whole box, the same pieces), else an empty
// group: the syncs a bucket may fuse.
struct Fusable {
  std::vector<int> group;
  bool scatter = false;
};

// One all-reduce or reduce-scatter (split or not: execute runs them alike)
// of the member's whole box, nothing else; a reduce-scatter leaves the
// member its own piece.
const CommOp* whole_sync(const RankResolution& rr, int rank) {
  if (rr.phases.size() != 1) return nullptr;
  const CommPhase& ph = rr.phases[0];
  if (ph.ops.size() != 1 || !ph.in_box || !ph.out_box || ph.zero_fill) return nullptr;
  const CommOp& op = ph.ops[0];
  if (op.group.size() < 2 || !op.contributes || !(op.box == *ph.in_box) || !op.sends.empty() || !op.recvs.empty() ||
      !op.keeps.empty())
    return nullptr;
  if (op.kind == CommKind::kAllReduce || op.kind == CommKind::kSplitAllReduce)
    return ph.out_box == ph.in_box ? &op : nullptr;
  if (op.kind == CommKind::kReduceScatter || op.kind == CommKind::kSplitReduceScatter) {
    const auto me = std::find(op.group.begin(), op.group.end(), rank);
    if (op.pieces.size() != op.group.size() || me == op.group.end()) return nullptr;
    return *ph.out_box == op.pieces[static_cast<size_t>(me - op.group.begin())] ? &op : nullptr;
  }
  return nullptr;
}

Fusable fusable_group(const ExecGraph& graph, const std::string& param, const Resolution& mine_resolution) {
  Fusable f;
  const int rank = graph.rank();
  const CommOp* mine = whole_sync(mine_resolution.ranks.at(rank), rank);
  if (mine == nullptr) return f;
  // Every member must see the same: this rank's resolution holds its own
  // entry only, so the Reshard is resolved for every rank once here.
  const Resolution all = resolve(graph.grad_spec(param), graph.topology());
  f.group = mine->group;
  f.scatter = is_reduce_scatter(mine->kind);
  for (int m : mine->group) {
    auto it = all.ranks.find(m);
    const CommOp* theirs = it == all.ranks.end() ? nullptr : whole_sync(it->second, m);
    if (theirs == nullptr || theirs->group != mine->group || !(theirs->box == mine->box) ||
        theirs->pieces != mine->pieces || is_reduce_scatter(theirs->kind) != f.scatter)
      f.group.clear();
  }
  return f;
}

NDArray to_f32(Stream& s, const NDArray& a) {
  return !a.valid() || a.dtype() == DType::F32 ? a : kernels::cast(s, a, DType::F32);
}

// A fused all-reduce bucket: the gradients one after the other in one flat
// buffer (a missing one stays zero), one all-reduce, then each its part.
void sync_reduce_bucket(const ExecGraph& graph, const GradBucket& b,
                        const std::function<NDArray(const std::string&)>& raw, Communicator& world, Stream& s,
                        int64_t* predicted, std::map<std::string, NDArray>& synced) {
  const int rank = graph.rank();
  NDArray flat = kernels::zeros(s, {b.elements}, b.dtype);
  std::vector<std::pair<int64_t, Box>> parts;
  int64_t offset = 0;
  for (const std::string& name : b.params) {
    const Resolution& r = *graph.grad_resolution(name);
    const Box box = *r.ranks.at(rank).phases[0].in_box;
    const int64_t n = box.numel();
    const NDArray g = raw(name);
    if (g.valid()) {
      if (g.shape() != box.shape())
        fail("[comm] reshard '", r.name, "': rank ", rank, " needs an input of shape ", shape_str(box.shape()),
             " (its source box ", to_string(box), ")");
      NDArray part = flat.slice(0, offset, offset + n);
      kernels::copy(s, (g.dtype() == b.dtype ? g : kernels::cast(s, g, b.dtype)).contiguous().reshape({n}), part);
    }
    parts.emplace_back(offset, box);
    offset += n;
  }
  Communicator& group = world.group(b.group);
  std::vector<Request> requests;
  requests.push_back(group.start_all_reduce(s, flat));
  group.wait_all(requests);
  if (predicted != nullptr) {  // the resolver's ring rule over the whole bucket
    const int64_t members = static_cast<int64_t>(b.group.size());
    *predicted += 2 * (members - 1) * (b.elements * static_cast<int64_t>(dtype_size(b.dtype))) / members;
  }
  for (size_t i = 0; i < b.params.size(); ++i) {
    const auto& [at, box] = parts[i];
    synced[b.params[i]] = to_f32(s, flat.slice(0, at, at + box.numel()).reshape(box.shape()));
  }
}

// A fused ZeRO bucket: member i's pieces of every gradient of the bucket
// one after the other in the send buffer's i-th part, one reduce-scatter,
// then this rank's pieces split back.
void sync_scatter_bucket(const ExecGraph& graph, const GradBucket& b,
                         const std::function<NDArray(const std::string&)>& raw, Communicator& world, Stream& s,
                         int64_t* predicted, std::map<std::string, NDArray>& synced) {
  const int rank = graph.rank();
  const size_t members = b.group.size();
  const size_t me = static_cast<size_t>(std::find(b.group.begin(), b.group.end(), rank) - b.group.begin());
  std::vector<int64_t> counts(members, 0);
  for (const std::string& name : b.params) {
    const CommOp& op = graph.grad_resolution(name)->ranks.at(rank).phases[0].ops[0];
    for (size_t i = 0; i < members; ++i) counts[i] += op.pieces[i].numel();
  }
  std::vector<int64_t> at(members, 0);  // where member i's next piece goes
  for (size_t i = 1; i < members; ++i) at[i] = at[i - 1] + counts[i - 1];
  NDArray send = kernels::zeros(s, {at[members - 1] + counts[members - 1]}, b.dtype);
  const int64_t element = static_cast<int64_t>(dtype_size(b.dtype));
  for (const std::string& name : b.params) {
    const Resolution& r = *graph.grad_resolution(name);
    const CommPhase& ph = r.ranks.at(rank).phases[0];
    const CommOp& op = ph.ops[0];
    const NDArray g = raw(name);
    if (g.valid() && g.shape() != ph.in_box->shape())
      fail("[comm] reshard '", r.name, "': rank ", rank, " needs an input of shape ", shape_str(ph.in_box->shape()),
           " (its source box ", to_string(*ph.in_box), ")");
    const NDArray local = !g.valid() ? g : (g.dtype() == b.dtype ? g : kernels::cast(s, g, b.dtype)).contiguous();
    int64_t packed = 0;
    for (size_t i = 0; i < members; ++i) {
      const int64_t n = op.pieces[i].numel();
      if (local.valid() && n > 0) {
        NDArray part = send.slice(0, at[i], at[i] + n);
        pack_box(s, local, *ph.in_box, op.pieces[i], part);
      }
      at[i] += n;
      packed += n;
    }
    if (predicted != nullptr)  // the resolver's rule: the pieces packed, but its own
      *predicted += (packed - op.pieces[me].numel()) * element;
  }
  NDArray recv = kernels::zeros(s, {counts[me]}, b.dtype);
  Communicator& group = world.group(b.group);
  std::vector<Request> requests;
  requests.push_back(group.start_reduce_scatter(s, send, recv, counts));
  group.wait_all(requests);
  int64_t offset = 0;
  for (const std::string& name : b.params) {
    const Box& mine = graph.grad_resolution(name)->ranks.at(rank).phases[0].ops[0].pieces[me];
    NDArray part = recv.slice(0, offset, offset + mine.numel()).reshape(mine.shape());
    synced[name] = to_f32(s, part);
    offset += mine.numel();
  }
}

}  // namespace

std::vector<GradBucket> grad_buckets(const ExecGraph& graph) {
  const int rank = graph.rank();
  std::vector<GradBucket> out;
  GradBucket open;
  auto close = [&] {
    if (!open.params.empty()) {
      if (open.params.size() == 1) {  // alone: its own resolution
        open.group.clear();
        open.scatter = false;
      }
      out.push_back(std::move(open));
    }
    open = GradBucket{};
  };
  const std::vector<std::string>& names = graph.model().names;
  for (auto it = names.rbegin(); it != names.rend(); ++it) {
    const Resolution* r = graph.grad_resolution(*it);
    if (r == nullptr) {  // not this rank's: the members of any open bucket break here too
      close();
      continue;
    }
    const Fusable f = graph.clocked() ? Fusable{} : fusable_group(graph, *it, *r);
    const auto& phases = r->ranks.at(rank).phases;
    const int64_t n = !phases.empty() && phases[0].in_box ? phases[0].in_box->numel() : 0;
    if (f.group.empty()) {
      close();
      out.push_back(GradBucket{{*it}, {}, false, r->dtype, n});
      continue;
    }
    if (!open.params.empty() && (open.group != f.group || open.scatter != f.scatter || open.dtype != r->dtype ||
                                 open.elements + n > kGradBucketElements))
      close();
    open.params.push_back(*it);
    open.group = f.group;
    open.scatter = f.scatter;
    open.dtype = r->dtype;
    open.elements += n;
  }
  close();
  return out;
}

void sync_bucket(const ExecGraph& graph, const GradBucket& b, const std::function<NDArray(const std::string&)>& raw,
                 Communicator& world, Stream& s, int64_t* predicted, std::map<std::string, NDArray>& synced) {
  if (!b.group.empty()) {
    (b.scatter ? sync_scatter_bucket : sync_reduce_bucket)(graph, b, raw, world, s, predicted, synced);
    return;
  }
  for (const std::string& name : b.params) {  // one parameter: its resolution
    const Resolution& r = *graph.grad_resolution(name);
    const NDArray g = raw(name);
    const NDArray local = g.valid() && g.dtype() != r.dtype ? kernels::cast(s, g, r.dtype) : g;
    if (predicted != nullptr) *predicted += r.ranks.at(graph.rank()).bytes_sent;
    NDArray out = to_f32(s, execute(r, graph.rank(), local, world, nullptr, &s));
    if (out.valid()) synced[name] = out;
  }
}

std::map<std::string, NDArray> sync_gradients(const ExecGraph& graph, const std::vector<GradBucket>& buckets,
                                              const std::map<std::string, NDArray>& raw, Communicator& world) {
  std::map<std::string, NDArray> synced;
  auto raw_of = [&](const std::string& name) {
    auto it = raw.find(name);
    return it == raw.end() ? NDArray() : it->second;
  };
  Stream& s = graph.stream();
  for (const GradBucket& b : buckets) {
    if (!b.group.empty()) {
      const int64_t before = world.bytes().sent;
      int64_t predicted = 0;
      sync_bucket(graph, b, raw_of, world, s, &predicted, synced);
      graph.add_to_ledger(world.bytes().sent - before, predicted);
      continue;
    }
    for (const std::string& name : b.params) {  // through the graph: the clock and deferred sends
      NDArray local = raw_of(name);
      const DType wire = graph.grad_resolution(name)->dtype;
      if (local.valid() && local.dtype() != wire) local = kernels::cast(s, local, wire);  // --grad-reduce-dtype bf16
      NDArray out = graph.run_grad_sync(name, local, world);
      if (out.valid()) synced[name] = to_f32(s, out);
    }
  }
  return synced;
}

// ---- The overlap's thread ----

namespace {
std::atomic<bool> g_abandoned{false};
}

bool GradOverlap::any_abandoned() { return g_abandoned.load(); }

GradOverlap::GradOverlap(const ExecGraph& graph, std::vector<GradBucket> buckets, Communicator& grad_world)
    : graph_(graph), state_(std::make_shared<State>()) {
  for (const GradBucket& b : buckets) {
    for (const std::string& name : b.params) state_->items.emplace(name, Item{});
    // The fused buckets' groups made here, in bucket order on every member,
    // while no collective is in flight (cached: once per plan). The thread
    // would otherwise create them (an NCCL communicator's init) in the
    // middle of the backward, beside the graph's own NCCL kernels.
    if (!b.group.empty()) (void)grad_world.group(b.group);
  }
  thread_ = std::thread(run, state_, &graph, &grad_world, std::move(buckets), num_threads());
}

GradOverlap::~GradOverlap() {
  if (!thread_.joinable()) return;
  if (finished_) {
    thread_.join();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->abandoned = true;
  }
  state_->cv.notify_all();
  g_abandoned = true;
  thread_.detach();  // it may be inside a collective whose peers are gone
}

void GradOverlap::ready(const std::string& param, const NDArray& raw) {
  Event event;
  event.record(graph_.stream());
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->items.find(param);
    if (it == state_->items.end()) return;  // this rank takes no part in its sync
    HSPMD_CHECK(!it->second.given, "gradient of '", param, "' handed over twice");
    it->second = Item{raw, event, true};
  }
  ++ready_count_;
  state_->cv.notify_all();
}

std::map<std::string, NDArray> GradOverlap::finish(const std::map<std::string, NDArray>& raw) {
  Event event;
  event.record(graph_.stream());
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (auto& [name, item] : state_->items)
      if (!item.given) {
        auto it = raw.find(name);
        item = Item{it == raw.end() ? NDArray() : it->second, event, true};
      }
  }
  state_->cv.notify_all();
  finished_ = true;
  thread_.join();
  if (state_->error) std::rethrow_exception(state_->error);
  return std::move(state_->synced);
}

void GradOverlap::run(std::shared_ptr<State> state, const ExecGraph* graph, Communicator* world,
                      std::vector<GradBucket> buckets, int threads) {
  try {
    set_num_threads(threads);  // a new thread starts with the runtime's default team size
    bind_thread(graph->device());
    Stream& stream = comm_stream(graph->device());
    // This thread's blocks never mix with the graph stream's while either
    // stream may still use them (the allocators do not track streams).
    SideStreamScope held;
    // Leaving early (an error, an abandoned step), the stream's queued
    // work may still use blocks `held` returns: drain it first (this
    // guard, declared after `held`, is destroyed before it).
    struct DrainFirst {
      Stream& stream;
      ~DrainFirst() {
        try {
          stream.synchronize();
        } catch (...) {  // the error that brought us here is the one reported
        }
      }
    } drain{stream};
    int64_t predicted = 0;
    for (const GradBucket& bucket : buckets) {
      std::map<std::string, Item> items;
      {
        std::unique_lock<std::mutex> lock(state->mu);
        state->cv.wait(lock, [&] {
          return state->abandoned || std::all_of(bucket.params.begin(), bucket.params.end(),
                                                 [&](const std::string& p) { return state->items.at(p).given; });
        });
        if (state->abandoned) return;
        for (const std::string& p : bucket.params) items.emplace(p, std::move(state->items.at(p)));
      }
      for (const auto& [name, item] : items) stream_wait(stream, item.event);
      std::map<std::string, NDArray> out;
      sync_bucket(*graph, bucket, [&](const std::string& p) { return items.at(p).raw; }, *world, stream, &predicted,
                  out);
      items.clear();
      stream.synchronize();
      held.release();
      std::lock_guard<std::mutex> lock(state->mu);
      for (auto& [name, g] : out) state->synced.emplace(name, std::move(g));
    }
    std::lock_guard<std::mutex> lock(state->mu);
    state->predicted = predicted;
  } catch (...) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->error = std::current_exception();
  }
}

// ---- A run's sync, step by step ----

GradSync::GradSync(Communicator& world, bool overlap, bool overlap_asked) : world_(world) {
  if (!overlap) return;
  try {  // collective: every rank is here
    grad_world_ = world.duplicate();
  } catch (const Error& e) {
    // An MPI without MPI_THREAD_MULTIPLE (every rank has the same library,
    // so every rank takes this branch, before any rank communicates):
    // overlap only if it was asked for. Any other failure is the run's.
    if (overlap_asked || std::string(e.what()).find("MPI_THREAD_MULTIPLE") == std::string::npos) throw;
    if (world.rank() == 0)
      std::fprintf(stderr, "hspmd: note: gradients synchronized after the backward, not overlapped: %s\n", e.what());
  }
}

GradSync::~GradSync() {
  if (GradOverlap::any_abandoned()) (void)grad_world_.release();
}

GradSync::Step::Step(const ExecGraph& graph, const std::vector<GradBucket>& buckets, Communicator& world,
                     Communicator* grad_world)
    : graph_(graph), buckets_(buckets), world_(world), grad_world_(grad_world) {
  if (grad_world_ != nullptr) overlap_.emplace(graph, buckets, *grad_world_);
}

std::map<std::string, NDArray> GradSync::Step::finish(const std::map<std::string, NDArray>& raw) {
  // The schedule's compute is done: what follows is the sync alone (what
  // the overlap left of it), timed between two waits for the device. One
  // rank alone has nothing to synchronize and does not wait: its step
  // queues the update behind the backward (and a captured step may not wait
  // at all: docs/cuda.md, "CUDA graphs").
  const bool timed = overlap_.has_value() || world_.size() > 1;
  if (timed) graph_.stream().synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  if (overlap_) overlapped_ = overlap_->ready_count();
  std::map<std::string, NDArray> synced =
      overlap_ ? overlap_->finish(raw) : sync_gradients(graph_, buckets_, raw, world_);
  if (timed) graph_.stream().synchronize();
  seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (overlap_) {  // the duplicate world's bytes count with the step's
    duplicate_sent_ = grad_world_->bytes().sent;
    graph_.add_to_ledger(duplicate_sent_, overlap_->predicted_bytes());
    grad_world_->reset_bytes();
  }
  return synced;
}

}  // namespace hspmd

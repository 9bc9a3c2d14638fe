// Expert parallelism (docs/moe.md, "Expert parallelism"): a sparse layer's
// experts as one op whose weights live on other ranks than its tokens.
//
// The layout is the plan's annotations, nothing else: the token rows
// [..., k, H] on the ranks that hold the layer's tokens, and each expert's
// weights on its owners, one subgroup per expert-parallel group (subgroup j
// of every expert's annotation: its owner in group j). The ranks holding
// the same tokens (a stage's tp copies) form a slot; a group is the slots
// whose ranks own its experts. Each call:
//  1. counts its rows per expert (the router's indices) and all-gathers the
//     counts over its group (E int32 per rank);
//  2. moves every expert's rows to its owners: a Reshard of the tensor
//     "expert e's rows" [n_e, H] from a cut between the group's slots in
//     proportion to their counts (top tier, hdim 0) to whole on the owner
//     (Dup over its ranks), resolved by the resolver for this call's counts
//     (resolve_for_rank) and run, all experts at once, as one batched
//     send/receive over the group;
//  3. runs each owned expert's SwiGLU MLP over the rows it received;
//  4. moves the outputs back by the inverse Reshard.
// The backward moves the rows and the output gradient (in the compute
// dtype) to the owners again, recomputes the gate and up products there,
// and moves the input gradient back: one exchange more than keeping the
// owner's activations, which would need shapes bound in the middle of the
// forward. An expert's weight gradient is whole within its group and summed
// across the groups (top-tier partial): the gradient sync reduces it.
// Every shape outside the op is static; the counts only decide what moves.
#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <utility>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/ops/ops.h"
#include "hspmd/resolve/resolver.h"
#include "kernels/basic.h"
#include "kernels/memory.h"
#include "moe_routing.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

constexpr int kTagDispatch = 7201;
constexpr int kTagReturn = 7202;

using Fail = std::function<void(const std::string&)>;

// The expert-parallel layout of one sparse layer.
struct EpLayout {
  struct Slot {
    std::vector<int> ranks;  // the ranks holding these tokens (copies), ascending
    int group = -1;
  };
  std::vector<Slot> slots;                            // in token order
  std::vector<std::vector<int>> groups;               // per group: its slots, in token order
  std::vector<std::vector<std::vector<int>>> owners;  // [expert][group]: the ranks holding its weights
  // [expert][group]: its replicas, each the owners in one slot (slot order).
  std::vector<std::vector<std::vector<std::vector<int>>>> replicas;

  int slot_of(int rank) const {
    for (size_t s = 0; s < slots.size(); ++s)
      if (std::find(slots[s].ranks.begin(), slots[s].ranks.end(), rank) != slots[s].ranks.end())
        return static_cast<int>(s);
    return -1;
  }
  // Every rank of group g's slots, ascending: the group's communicator.
  std::vector<int> group_ranks(int g) const {
    std::vector<int> out;
    for (int s : groups[g]) out.insert(out.end(), slots[s].ranks.begin(), slots[s].ranks.end());
    std::sort(out.begin(), out.end());
    return out;
  }
};

std::string ranks_str(const std::vector<int>& r) {
  std::string s = "[";
  for (size_t i = 0; i < r.size(); ++i) s += (i ? ", " : "") + std::to_string(r[i]);
  return s + "]";
}

// The token slots of rows annotated `rows` (rank `rows_rank`): ranks of one
// subgroup at the same coordinates but dup hold the same tokens.
std::vector<EpLayout::Slot> token_slots(const Annotation& rows, int rows_rank, const Fail& fail) {
  std::map<std::pair<int, std::vector<int>>, std::vector<int>> slots;
  for (int i = 0; i < rows.hsize(); ++i) {
    const Subgroup& sub = rows.subgroups[i];
    if (sub.states.is_split(rows_rank - 1) || sub.states.is_split(rows_rank - 2))
      fail("the token rows split a token's k rows or its features; only the token dims may be split");
    for (int p = 0; p < sub.devices.size(); ++p) {
      std::vector<int> key;
      const std::vector<int> coords = sub.states.coordinates(p);
      for (size_t q = 0; q < sub.states.order.size(); ++q)
        if (sub.states.order[q] != kDup) key.push_back(coords[q]);
      slots[{i, key}].push_back(sub.devices.ranks[p]);
    }
  }
  std::vector<EpLayout::Slot> out;
  for (auto& [key, ranks] : slots) {
    std::sort(ranks.begin(), ranks.end());
    out.push_back({ranks, -1});
  }
  return out;
}

// The layout from the rows' annotation (rank `rows_rank`) and each expert's
// weight annotation; `fail` reports a layout the op cannot run.
EpLayout ep_layout(const Annotation& rows, int rows_rank, const std::vector<const Annotation*>& experts,
                   const Fail& fail) {
  if (has_partial(rows)) fail("the token rows are partial sums; reduce them first");
  if (rows.hsize() > 1 && rows.hdim != 0)
    fail("the token rows must be cut between subgroups along the batch (dim 0), not " + key_name(rows.hdim));
  EpLayout ep;
  ep.slots = token_slots(rows, rows_rank, fail);
  const int groups = experts.front()->hsize();
  std::map<int, int> group_of_rank;
  ep.owners.resize(experts.size());
  for (size_t e = 0; e < experts.size(); ++e) {
    const Annotation& a = *experts[e];
    const std::string who = "expert " + std::to_string(e) + "'s weights";
    if (a.hsize() != groups)
      fail(who + " are held by " + std::to_string(a.hsize()) + " subgroups and expert 0's by " +
           std::to_string(groups) + ": every expert-parallel group (one subgroup) holds every expert once");
    if (has_partial(a) || (a.hsize() > 1 && a.hdim != kDup))
      fail(who + " must be copies across their subgroups (hdim dup), one subgroup per expert-parallel group");
    for (int j = 0; j < groups; ++j) {
      const Subgroup& sub = a.subgroups[j];
      if (!sub.states.split_dims().empty())
        fail(who + " are split inside subgroup " + std::to_string(j) +
             ": an expert is whole on each owner (tensor parallelism inside experts is not built)");
      std::vector<int> owners = sub.devices.ranks;
      std::sort(owners.begin(), owners.end());
      for (int r : owners) {
        auto [it, fresh] = group_of_rank.emplace(r, j);
        if (!fresh && it->second != j)
          fail("rank " + std::to_string(r) + " holds experts in subgroups " + std::to_string(it->second) +
               " and " + std::to_string(j) + ": a rank belongs to one expert-parallel group");
      }
      ep.owners[e].push_back(std::move(owners));
    }
  }
  ep.groups.resize(groups);
  for (size_t s = 0; s < ep.slots.size(); ++s) {
    EpLayout::Slot& slot = ep.slots[s];
    for (int r : slot.ranks) {
      auto it = group_of_rank.find(r);
      if (it == group_of_rank.end()) continue;
      if (slot.group >= 0 && slot.group != it->second)
        fail("ranks " + ranks_str(slot.ranks) + " hold the same tokens but experts of two groups (" +
             std::to_string(slot.group) + " and " + std::to_string(it->second) + ")");
      slot.group = it->second;
    }
    if (slot.group < 0)
      fail("ranks " + ranks_str(slot.ranks) +
           " hold tokens of the layer but no expert: every token holder belongs to an expert-parallel group "
           "through the experts it or a copy of its tokens owns");
    ep.groups[slot.group].push_back(static_cast<int>(s));
  }
  for (const auto& [r, j] : group_of_rank)
    if (ep.slot_of(r) < 0)
      fail("rank " + std::to_string(r) + " holds expert weights but none of the layer's tokens");
  ep.replicas.resize(experts.size());
  for (size_t e = 0; e < experts.size(); ++e)
    for (int j = 0; j < groups; ++j) {
      std::map<int, std::vector<int>> by_slot;
      for (int r : ep.owners[e][j]) by_slot[ep.slot_of(r)].push_back(r);
      auto& reps = ep.replicas[e].emplace_back();
      for (auto& [slot, ranks] : by_slot) reps.push_back(std::move(ranks));
    }
  return ep;
}

DistStates copies(int n) {
  DistStates s;
  if (n > 1) {
    s.degrees[kDup] = n;
    s.order = {kDup};
  }
  return s;
}

// Rows cut between device groups in proportion to `parts` (rows each; the
// empty ones left out), each group holding copies of its part; one part:
// whole on its group.
Annotation cut_rows(const std::vector<std::pair<const std::vector<int>*, int64_t>>& parts) {
  Annotation a;
  for (const auto& [ranks, n] : parts) {
    if (n == 0) continue;
    a.subgroups.push_back({DeviceGroup{*ranks}, copies(static_cast<int>(ranks->size()))});
    a.part_weights.push_back(n);
  }
  a.hdim = a.hsize() > 1 ? 0 : kDup;
  if (a.hsize() <= 1) a.part_weights.clear();
  return a;
}

// Expert e's rows of group g on its sources: cut between the group's slots
// in proportion to their counts.
Annotation ragged_rows(const EpLayout& ep, int g, int e, const std::vector<std::vector<int64_t>>& counts) {
  std::vector<std::pair<const std::vector<int>*, int64_t>> parts;
  for (size_t i = 0; i < ep.groups[g].size(); ++i) parts.emplace_back(&ep.slots[ep.groups[g][i]].ranks, counts[i][e]);
  return cut_rows(parts);
}

// ... on its owners: whole on them, or, with replicas, cut between them in
// near-equal parts (replica r the r-th).
Annotation on_owners(const EpLayout& ep, int g, int e, int64_t rows) {
  const auto& reps = ep.replicas[e][g];
  const int64_t n = static_cast<int64_t>(reps.size());
  std::vector<std::pair<const std::vector<int>*, int64_t>> parts;
  for (int64_t r = 0; r < n; ++r) parts.emplace_back(&reps[r], rows / n + (r < rows % n ? 1 : 0));
  return cut_rows(parts);
}

// One expert's rows moving by a resolved Reshard. `src` holds this rank's
// source rows from row src_row0 on (its in_box's first row there); `dst`
// receives its destination box from row dst_row0 on (allocated [rows,
// width] when left invalid).
struct Move {
  Resolution res;
  bool in_dst = false;
  NDArray src;
  int64_t src_row0 = 0, src_rows = 0;
  NDArray dst;
  int64_t dst_row0 = 0;
};

struct Piece {
  Move* move;
  int64_t row, rows;  // rows of the move's source (sends) or destination (receives) array
};

// Runs every move's primitives for `rank` at once: its local copies, and one
// message per peer (the pieces of every move in move order, both sides
// listing them alike) over `comm`, whose members are `members` (ascending
// world ranks). Every box spans the rows' whole width.
void run_moves(Stream& s, Communicator& comm, const std::vector<int>& members, int rank, std::vector<Move>& moves,
               DType dtype, int64_t width, int tag) {
  std::map<int, std::vector<Piece>> sends, recvs;
  auto copy_rows = [&](const NDArray& from, int64_t from_row, NDArray& to, int64_t to_row, int64_t rows) {
    if (rows > 0) kernels::copy_block(s, from, {from_row, 0}, to, {to_row, 0}, {rows, width});
  };
  for (Move& m : moves) {
    auto found = m.res.ranks.find(rank);
    if (found == m.res.ranks.end()) continue;
    const RankResolution& rr = found->second;
    if (rr.phases.empty()) {  // the identity: the rank keeps what it holds
      if (m.in_dst && m.src.valid()) {
        if (!m.dst.valid()) m.dst = NDArray::empty({m.src_rows, width}, dtype, s.device());
        copy_rows(m.src, m.src_row0, m.dst, m.dst_row0, m.src_rows);
      }
      continue;
    }
    HSPMD_CHECK(rr.phases.size() == 1, "an expert's exchange resolved into ", rr.phases.size(), " phases");
    const CommPhase& ph = rr.phases.front();
    const int64_t in0 = ph.in_box ? ph.in_box->begin[0] : 0, out0 = ph.out_box ? ph.out_box->begin[0] : 0;
    if (ph.out_box && !m.dst.valid())
      m.dst = NDArray::empty({ph.out_box->shape()[0], width}, dtype, s.device());
    auto local = [&](const Box& b) {
      copy_rows(m.src, m.src_row0 + b.begin[0] - in0, m.dst, m.dst_row0 + b.begin[0] - out0, b.end[0] - b.begin[0]);
    };
    for (const CommOp& op : ph.ops) {
      HSPMD_CHECK(op.kind == CommKind::kSend || op.kind == CommKind::kRecv || op.kind == CommKind::kBsr ||
                      op.kind == CommKind::kLocalSlice,
                  "an expert's exchange resolved into ", kind_name(op.kind));
      if (op.kind == CommKind::kLocalSlice) local(op.box);
      for (const Box& b : op.keeps) local(b);
      for (const Transfer& t : op.sends)
        for (const Box& b : t.boxes)
          sends[t.peer].push_back({&m, m.src_row0 + b.begin[0] - in0, b.end[0] - b.begin[0]});
      for (const Transfer& t : op.recvs)
        for (const Box& b : t.boxes)
          recvs[t.peer].push_back({&m, m.dst_row0 + b.begin[0] - out0, b.end[0] - b.begin[0]});
    }
  }
  auto member = [&](int peer) {
    auto it = std::lower_bound(members.begin(), members.end(), peer);
    HSPMD_CHECK(it != members.end() && *it == peer, "rank ", peer, " is outside the expert-parallel group");
    return static_cast<int>(it - members.begin());
  };
  auto total = [](const std::vector<Piece>& pieces) {
    int64_t n = 0;
    for (const Piece& p : pieces) n += p.rows;
    return n;
  };
  std::vector<NDArray> out_buffers, in_buffers;
  std::vector<SendBuffer> send_list;
  std::vector<RecvBuffer> recv_list;
  for (auto& [peer, pieces] : sends) {
    NDArray& buf = out_buffers.emplace_back(NDArray::empty({total(pieces), width}, dtype, s.device()));
    int64_t at = 0;
    for (const Piece& p : pieces) copy_rows(p.move->src, p.row, buf, at, p.rows), at += p.rows;
    send_list.push_back(send_buffer(member(peer), buf));
  }
  for (auto& [peer, pieces] : recvs) {
    NDArray& buf = in_buffers.emplace_back(NDArray::empty({total(pieces), width}, dtype, s.device()));
    recv_list.push_back(recv_buffer(member(peer), buf));
  }
  if (!send_list.empty() || !recv_list.empty()) comm.batched_send_recv(s, send_list, recv_list, tag);
  size_t k = 0;
  for (auto& [peer, pieces] : recvs) {
    int64_t at = 0;
    for (const Piece& p : pieces) copy_rows(in_buffers[k], at, p.move->dst, p.row, p.rows), at += p.rows;
    ++k;
  }
}

// One call's view of the layout on this rank.
struct EpCall {
  EpLayout ep;
  int group = -1, slot_index = -1;     // slot_index: this rank's slot's position in its group
  std::vector<int> members;            // the group's ranks, ascending
  std::vector<std::vector<int64_t>> counts;  // [slot of the group][expert]
  std::vector<int64_t> offsets;        // this rank's rows per expert (RoutingMap offsets)
  int64_t sent = 0;                    // predicted bytes this rank sends
};

// Steps 1 (layout and counts) of a call; `first_weight` is the input of
// expert 0's first weight, `indices` the router's indices.
EpCall start_call(const OpContext& ctx, const NDArray& indices, int first_weight, int64_t experts) {
  const ShardContext& sh = *ctx.shard;
  std::vector<const Annotation*> weights;
  for (int64_t e = 0; e < experts; ++e) weights.push_back(&sh.input_annotations.at(first_weight + e));
  const int rows_input = first_weight - 2;
  EpCall c;
  c.ep = ep_layout(sh.input_annotations.at(rows_input), static_cast<int>(sh.input_global_shapes.at(rows_input).size()),
                   weights, [](const std::string& m) { HSPMD_CHECK(false, "[moe_experts] ", m); });
  const int slot = c.ep.slot_of(sh.rank);
  HSPMD_CHECK(slot >= 0, "rank ", sh.rank, " runs moe_experts without tokens");
  c.group = c.ep.slots[slot].group;
  c.members = c.ep.group_ranks(c.group);
  const std::vector<int>& slots = c.ep.groups[c.group];
  c.slot_index = static_cast<int>(std::find(slots.begin(), slots.end(), slot) - slots.begin());
  Stream& s = *ctx.stream;
  c.offsets = routing_map(s, indices, experts, false).offsets;
  std::vector<int32_t> mine(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) mine[e] = static_cast<int32_t>(c.offsets[e + 1] - c.offsets[e]);
  Communicator& comm = sh.group(c.members);
  const int64_t n = static_cast<int64_t>(c.members.size());
  NDArray send = kernels::to_device(s, NDArray::from_vector_i32({experts}, mine));
  NDArray all = NDArray::empty({n * experts}, DType::I32, ctx.device);
  std::vector<Request> requests;
  requests.push_back(comm.start_all_gather(s, send, all, std::vector<int64_t>(n, experts)));
  comm.wait_all(requests);
  c.sent += (n - 1) * experts * static_cast<int64_t>(sizeof(int32_t));
  const NDArray host = kernels::to_host(s, all);
  const int32_t* got = host.host_data<int32_t>("the expert counts");
  for (int si : slots) {  // a slot's counts from its first rank
    const int r = c.ep.slots[si].ranks.front();
    const int64_t pos = std::lower_bound(c.members.begin(), c.members.end(), r) - c.members.begin();
    c.counts.emplace_back(got + pos * experts, got + (pos + 1) * experts);
  }
  return c;
}

bool owns(const EpCall& c, int64_t e, int rank) {
  const std::vector<int>& o = c.ep.owners[e][c.group];
  return std::find(o.begin(), o.end(), rank) != o.end();
}

// Whether `rank` is the first of its replica of expert e (always, without
// replicas: then every copy holds the whole gradient).
bool first_copy(const EpCall& c, int64_t e, int rank) {
  const auto& reps = c.ep.replicas[e][c.group];
  if (reps.size() < 2) return true;
  for (const std::vector<int>& r : reps)
    if (std::find(r.begin(), r.end(), rank) != r.end()) return r.front() == rank;
  return true;
}

int64_t expert_rows(const EpCall& c, int64_t e) {
  int64_t n = 0;
  for (const auto& slot : c.counts) n += slot[e];
  return n;
}

// The Reshard of expert e's rows (width columns) to its owners (or back),
// resolved for this rank and this call's counts.
Move expert_move(const OpContext& ctx, EpCall& c, int64_t e, int64_t width, DType dtype, bool back) {
  ReshardSpec spec;
  spec.name = std::string(back ? "expert " : "rows of expert ") + std::to_string(e) + (back ? " output" : "");
  spec.shape = {expert_rows(c, e), width};
  spec.dtype = dtype;
  const Annotation ragged = ragged_rows(c.ep, c.group, static_cast<int>(e), c.counts);
  const Annotation owner = on_owners(c.ep, c.group, static_cast<int>(e), expert_rows(c, e));
  spec.src = back ? owner : ragged;
  spec.dst = back ? ragged : owner;
  Move m;
  m.res = resolve_for_rank(spec, *ctx.shard->topology, ctx.shard->rank);
  m.in_dst = spec.dst.contains(ctx.shard->rank);
  if (auto it = m.res.ranks.find(ctx.shard->rank); it != m.res.ranks.end()) c.sent += it->second.bytes_sent;
  return m;
}

NDArray f32_empty(const OpContext& ctx, int64_t rows, int64_t cols) {
  return NDArray::empty({rows, cols}, DType::F32, ctx.device);
}

// An expert's SwiGLU MLP over rows x [n, H] (weights' dtype): [n, H] f32.
NDArray expert_forward(const OpContext& ctx, const NDArray& x, const NDArray& wg, const NDArray& wu,
                       const NDArray& wd) {
  Stream& s = *ctx.stream;
  const int64_t n = x.dim(0), f = wg.dim(0), h = wd.dim(0);
  NDArray g = f32_empty(ctx, n, f), u = f32_empty(ctx, n, f), a = f32_empty(ctx, n, f), y = f32_empty(ctx, n, h);
  kernels::matmul(s, x, wg.contiguous(), false, true, g);
  kernels::matmul(s, x, wu.contiguous(), false, true, u);
  kernels::swiglu(s, g, u, a);
  kernels::matmul(s, kernels::cast(s, a, x.dtype()), wd.contiguous(), false, true, y);
  return y;
}

// Its backward from x and dy [n, H] (both in the weights' dtype): writes the
// weights' gradients (f32) and returns dx [n, H] f32.
NDArray expert_backward(const OpContext& ctx, const NDArray& x, const NDArray& dy, const NDArray& wg,
                        const NDArray& wu, const NDArray& wd, NDArray& dwg, NDArray& dwu, NDArray& dwd) {
  Stream& s = *ctx.stream;
  const int64_t n = x.dim(0), f = wg.dim(0), h = wd.dim(0);
  const DType act = x.dtype();
  NDArray g = f32_empty(ctx, n, f), u = f32_empty(ctx, n, f), da = f32_empty(ctx, n, f);
  kernels::matmul(s, x, wg.contiguous(), false, true, g);
  kernels::matmul(s, x, wu.contiguous(), false, true, u);
  kernels::matmul(s, dy, wd.contiguous(), false, false, da);
  NDArray dg = f32_empty(ctx, n, f), du = f32_empty(ctx, n, f), a = f32_empty(ctx, n, f);
  kernels::swiglu_backward(s, da, g, u, dg, du, &a);
  kernels::matmul(s, dy, kernels::cast(s, a, act), true, false, dwd);
  const NDArray dg_lo = kernels::cast(s, dg, act), du_lo = kernels::cast(s, du, act);
  kernels::matmul(s, dg_lo, x, true, false, dwg);
  kernels::matmul(s, du_lo, x, true, false, dwu);
  NDArray dx_up = f32_empty(ctx, n, h), dx = f32_empty(ctx, n, h);
  kernels::matmul(s, du_lo, wu.contiguous(), false, false, dx_up);
  kernels::matmul(s, dg_lo, wg.contiguous(), false, false, dx, kernels::GemmCompute::kF32, &dx_up);
  return dx;
}

// The layout checks both ops' rules share: rows, indices and dy on the same
// devices, each expert's three weights on the same devices, ep_layout's rules.
EpLayout check_layout(const DeduceContext& ctx, const std::vector<Annotation>& in, int first_weight, int64_t experts) {
  for (int i = 1; i < first_weight; ++i)
    if (!same_devices(in[0], in[i]))
      fail_at(ctx, "inputs 0 and ", i, " live on different subgroups (", to_string(in[0]), ") vs (",
              to_string(in[i]), ")");
  std::vector<const Annotation*> weights;
  for (int64_t e = 0; e < experts; ++e) {
    weights.push_back(&in[first_weight + e]);
    for (int64_t w = 1; w < 3; ++w)
      if (!same_devices(in[first_weight + e], in[first_weight + w * experts + e]))
        fail_at(ctx, "expert ", e, "'s three weights live on different subgroups");
  }
  const int rows = first_weight - 2;
  return ep_layout(in[rows], static_cast<int>(ctx.node.inputs[rows].ndim()), weights,
                   [&](const std::string& m) { fail_at(ctx, m); });
}

// The work of the rows this rank's experts received (`moves` of the
// dispatch): `gemms` GEMMs of 2 x rows x F x H each (w: a gate weight [F, H]).
double owned_flops(const Shape& w, std::span<const Move> moves, double gemms) {
  double rows = 0;
  for (const Move& m : moves)
    if (m.in_dst && m.dst.valid()) rows += static_cast<double>(m.dst.dim(0));
  return 2.0 * gemms * rows * static_cast<double>(w[0]) * static_cast<double>(w[1]);
}

double expert_flops(const std::vector<Shape>& in, int rows_input, int first_weight, double gemms) {
  const Shape& x = in[rows_input];
  double rows = 1;
  for (size_t d = 0; d + 1 < x.size(); ++d) rows *= static_cast<double>(x[d]);
  const Shape& w = in[first_weight];
  return 2.0 * gemms * rows * static_cast<double>(w[0]) * static_cast<double>(w[1]);
}

// (dy [..., k, H], rows [..., k, H], indices [..., k], gate, up, down) ->
// (drows [..., k, H] f32, each weight's gradient f32).
class MoeExpertsGradOp final : public Op {
 public:
  explicit MoeExpertsGradOp(int64_t experts) : experts_(experts) {}
  std::string type() const override { return "moe_experts_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("moe_experts_grad", in, static_cast<size_t>(3 * experts_ + 3));
    std::vector<TensorMeta> out{TensorMeta{in[1].shape, DType::F32}};
    for (int64_t i = 0; i < 3 * experts_; ++i) out.push_back(TensorMeta{in[3 + i].shape, DType::F32});
    return out;
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    Stream& s = *ctx.stream;
    const int64_t E = experts_, h = in[1].dim(-1);
    const int me = ctx.shard->rank;
    EpCall c = start_call(ctx, in[2], 3, E);
    const NDArray x = flat_rows(in[1].contiguous());
    const NDArray dy = flat_rows(kernels::cast(s, in[0].contiguous(), in[1].dtype()));
    std::vector<Move> there;  // x of every expert, then dy
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t e = 0; e < E; ++e) {
        if (expert_rows(c, e) == 0) continue;
        Move m = expert_move(ctx, c, e, h, in[1].dtype(), false);
        m.src = pass == 0 ? x : dy;
        m.src_row0 = c.offsets[e];
        m.src_rows = c.offsets[e + 1] - c.offsets[e];
        there.push_back(std::move(m));
      }
    run_moves(s, ctx.shard->group(c.members), c.members, me, there, in[1].dtype(), h, kTagDispatch);
    const size_t half = there.size() / 2;
    out[0] = ctx.alloc(0);
    NDArray dx = flat_rows(out[0]);
    std::vector<Move> back;
    size_t k = 0;
    for (int64_t e = 0; e < E; ++e) {
      const bool mine = owns(c, e, me);
      const int64_t n = expert_rows(c, e);
      NDArray expert_dx;
      if (mine) {
        for (int w = 0; w < 3; ++w) out[1 + w * E + e] = ctx.alloc(static_cast<int>(1 + w * E + e));
        if (n == 0 || !there[k].dst.valid()) {  // no rows for it (or for this replica)
          for (int w = 0; w < 3; ++w) kernels::fill(s, out[1 + w * E + e], 0.0f);
        } else {
          expert_dx = expert_backward(ctx, there[k].dst, there[half + k].dst, in[3 + e], in[3 + E + e],
                                      in[3 + 2 * E + e], out[1 + e], out[1 + E + e], out[1 + 2 * E + e]);
          if (!first_copy(c, e, me))  // a replica's share counts once (the deduced partial)
            for (int w = 0; w < 3; ++w) kernels::fill(s, out[1 + w * E + e], 0.0f);
        }
      }
      if (n == 0) continue;
      ++k;
      Move m = expert_move(ctx, c, e, h, DType::F32, true);
      m.src = expert_dx;
      m.src_rows = expert_dx.valid() ? expert_dx.dim(0) : 0;
      m.dst = dx;
      m.dst_row0 = c.offsets[e];
      back.push_back(std::move(m));
    }
    run_moves(s, ctx.shard->group(c.members), c.members, me, back, DType::F32, h, kTagReturn);
    if (ctx.traffic_sent) *ctx.traffic_sent += c.sent;
    if (ctx.work_flops)
      *ctx.work_flops =
          owned_flops(ctx.shard->input_global_shapes[3], std::span<const Move>(there).first(there.size() / 2), 8);
  }
  double flops(const std::vector<Shape>& in, const std::vector<Shape>&, const ShardContext*) const override {
    return expert_flops(in, 1, 3, 8);  // two GEMMs recomputed, six of the backward
  }
  bool may_communicate() const override { return true; }
  bool spans_devices() const override { return true; }
  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    const EpLayout ep = check_layout(ctx, in, 3, experts_);
    if (has_partial(in[0])) fail_at(ctx, "the output gradient is partial; reduce it first");
    std::vector<Annotation> out{in[1]};
    for (int64_t i = 0; i < 3 * experts_; ++i) {
      // Summed across the groups; within a group whole on each owner, or
      // with replicas each replica's share: partial over the subgroup's
      // ranks, a replica's first rank holding its share and its other
      // ranks (copies of its tokens) zeros, so that replicas of unlike
      // sizes (a tp 2 slot beside a tp 1 slot) sum alike.
      Annotation a = in[3 + i];
      if (a.hsize() > 1) a.hdim = kPartial;
      const int64_t e = i % experts_;
      for (int j = 0; j < a.hsize(); ++j)
        if (ep.replicas[e][j].size() >= 2) {
          DistStates& st = a.subgroups[j].states;
          st = DistStates{};
          st.degrees[kPartial] = a.subgroups[j].devices.size();
          st.order = {kPartial};
        }
      out.push_back(std::move(a));
    }
    return out;
  }

 private:
  int64_t experts_;
};

// (rows [..., k, H] in expert order, indices [..., k], gate_0.., up_0..,
// down_0..) -> [..., k, H] f32: each row through its expert's SwiGLU MLP.
class MoeExpertsOp final : public Op {
 public:
  explicit MoeExpertsOp(int64_t experts) : experts_(experts) {}
  std::string type() const override { return "moe_experts"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    expect_inputs("moe_experts", in, static_cast<size_t>(3 * experts_ + 2));
    expect_dtype("moe_experts", "indices", in[1], DType::I32);
    const SymShape& rows = in[0].shape;
    if (rows.size() != in[1].shape.size() + 1)
      fail("[moe_experts] rows must be [..., k, H] for indices [..., k], got ", sym_shape_str(rows), " and ",
           sym_shape_str(in[1].shape));
    const SymShape& g = in[2].shape;
    if (g.size() != 2 || !(g[1] == rows.back()))
      fail("[moe_experts] expert 0's gate weight ", sym_shape_str(g), " does not take rows of ",
           rows.back().str(), " features");
    for (int64_t e = 0; e < experts_; ++e) {
      if (in[2 + e].shape != g || in[2 + experts_ + e].shape != g)
        fail("[moe_experts] expert ", e, "'s gate and up weights must be ", sym_shape_str(g));
      if (in[2 + 2 * experts_ + e].shape != SymShape{g[1], g[0]})
        fail("[moe_experts] expert ", e, "'s down weight must be [", g[1].str(), ", ", g[0].str(), "]");
      for (int w = 0; w < 3; ++w)
        if (in[2 + w * experts_ + e].dtype != in[0].dtype)
          fail("[moe_experts] the weights must be in the rows' dtype ", dtype_name(in[0].dtype));
    }
    return {TensorMeta{rows, DType::F32}};
  }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in, std::vector<NDArray>& out) const override {
    Stream& s = *ctx.stream;
    const int64_t E = experts_, h = in[0].dim(-1);
    const int me = ctx.shard->rank;
    EpCall c = start_call(ctx, in[1], 2, E);
    const NDArray x = flat_rows(in[0].contiguous());
    std::vector<Move> there;
    for (int64_t e = 0; e < E; ++e) {
      if (expert_rows(c, e) == 0) continue;
      Move m = expert_move(ctx, c, e, h, in[0].dtype(), false);
      m.src = x;
      m.src_row0 = c.offsets[e];
      m.src_rows = c.offsets[e + 1] - c.offsets[e];
      there.push_back(std::move(m));
    }
    run_moves(s, ctx.shard->group(c.members), c.members, me, there, in[0].dtype(), h, kTagDispatch);
    out[0] = ctx.alloc(0);
    NDArray y = flat_rows(out[0]);
    std::vector<Move> back;
    size_t k = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (expert_rows(c, e) == 0) continue;
      Move m = expert_move(ctx, c, e, h, DType::F32, true);
      if (owns(c, e, me) && there[k].dst.valid())  // this owner's rows (a replica's share)
        m.src = expert_forward(ctx, there[k].dst, in[2 + e], in[2 + E + e], in[2 + 2 * E + e]);
      m.src_rows = m.src.valid() ? m.src.dim(0) : 0;
      ++k;
      m.dst = y;
      m.dst_row0 = c.offsets[e];
      back.push_back(std::move(m));
    }
    run_moves(s, ctx.shard->group(c.members), c.members, me, back, DType::F32, h, kTagReturn);
    if (ctx.traffic_sent) *ctx.traffic_sent += c.sent;
    if (ctx.work_flops) *ctx.work_flops = owned_flops(ctx.shard->input_global_shapes[2], there, 3);
  }
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    Graph& graph = *g[0].graph();
    const std::vector<Tensor> in = node.inputs;  // adding nodes may move `node`
    std::vector<Tensor> inputs{g[0]};
    inputs.insert(inputs.end(), in.begin(), in.end());
    const std::vector<Tensor> outs = graph.add(std::make_shared<MoeExpertsGradOp>(experts_), inputs);
    std::vector<Tensor> grads{outs[0], Tensor()};
    grads.insert(grads.end(), outs.begin() + 1, outs.end());
    return grads;
  }
  double flops(const std::vector<Shape>& in, const std::vector<Shape>&, const ShardContext*) const override {
    return expert_flops(in, 0, 2, 3);
  }
  bool may_communicate() const override { return true; }
  bool spans_devices() const override { return true; }
  std::vector<Annotation> deduce(const DeduceContext& ctx, const std::vector<Annotation>& in) const override {
    check_layout(ctx, in, 2, experts_);
    return {in[0]};
  }

 private:
  int64_t experts_;
};

}  // namespace

Tensor moe_experts(const Tensor& rows, const Tensor& indices, const std::vector<Tensor>& gate,
                   const std::vector<Tensor>& up, const std::vector<Tensor>& down) {
  if (gate.empty() || gate.size() != up.size() || gate.size() != down.size())
    fail("[moe_experts] needs the same positive number of gate, up and down weights");
  std::vector<Tensor> inputs{rows, indices};
  for (const std::vector<Tensor>* w : {&gate, &up, &down}) inputs.insert(inputs.end(), w->begin(), w->end());
  return rows.graph()->add1(std::make_shared<MoeExpertsOp>(static_cast<int64_t>(gate.size())), inputs);
}

}  // namespace hspmd::ops

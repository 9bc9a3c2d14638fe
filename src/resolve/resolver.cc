// resolve(): validation and the choice between the three cases of docs/resolver.md
// ("The rules").
#include "hspmd/resolve/resolver.h"

#include <set>

#include "hspmd/core/error.h"
#include "resolve/internal.h"

namespace hspmd {

using namespace resolve_internal;

bool is_all_reduce(CommKind k) { return k == CommKind::kAllReduce || k == CommKind::kSplitAllReduce; }
bool is_reduce_scatter(CommKind k) { return k == CommKind::kReduceScatter || k == CommKind::kSplitReduceScatter; }
bool is_all_gather(CommKind k) { return k == CommKind::kAllGather || k == CommKind::kSplitAllGather; }
bool is_collective(CommKind k) { return is_all_reduce(k) || is_reduce_scatter(k) || is_all_gather(k); }

std::string kind_name(CommKind kind) {
  switch (kind) {
    case CommKind::kIdentity: return "identity";
    case CommKind::kSend: return "send";
    case CommKind::kRecv: return "recv";
    case CommKind::kLocalSlice: return "local_slice";
    case CommKind::kAllReduce: return "all_reduce";
    case CommKind::kReduceScatter: return "reduce_scatter";
    case CommKind::kAllGather: return "all_gather";
    case CommKind::kSplitAllReduce: return "split_all_reduce";
    case CommKind::kSplitReduceScatter: return "split_reduce_scatter";
    case CommKind::kSplitAllGather: return "split_all_gather";
    case CommKind::kBsr: return "bsr";
  }
  return "unknown";
}

namespace {

// to_string(annotation) without its trailing ';'.
std::string describe(const Annotation& a) {
  std::string s = to_string(a);
  if (!s.empty() && s.back() == ';') s.pop_back();
  return s;
}

[[noreturn]] void unsupported(const ReshardSpec& spec, const std::string& why) {
  fail("[resolve] reshard '", spec.name, "': unsupported reshard from ", describe(spec.src), " to ",
       describe(spec.dst), ": ", why);
}

bool same_parts(const Layout& a, const Layout& b) { return a.hdim < 0 || a.parts == b.parts; }

bool same_device_sets(const Layout& a, const Layout& b) {
  for (int i = 0; i < a.hsize(); ++i) {
    const std::vector<int>& x = a.subgroup(i).devices.ranks;
    const std::vector<int>& y = b.subgroup(i).devices.ranks;
    if (std::set<int>(x.begin(), x.end()) != std::set<int>(y.begin(), y.end())) return false;
  }
  return true;
}

// Why BSR cannot take over (partial values involved), for the error message.
std::string bsr_refusal(const Layout& src, const Layout& dst) {
  std::string what;
  if (src.hsize() != dst.hsize())
    what = "hsize changes from " + std::to_string(src.hsize()) + " to " + std::to_string(dst.hsize());
  else if (src.hdim == dst.hdim)
    what = "the top-tier parts change";
  else
    what = "the subgroups' devices change along with hdim";
  return what + ", and BSR cannot move partial values";
}

// Case 3: one BSR from every source rank to every destination rank.
Resolution plan_bsr(const ReshardSpec& spec, const Layout& src, const Layout& dst, const Topology& topology) {
  PhasePlan plan(src, dst, dtype_size(spec.dtype));
  std::vector<Holding> owners, needers;
  for (const auto& [r, p] : src.ranks) owners.push_back(Holding{r, p.box});
  for (const auto& [r, p] : dst.ranks) needers.push_back(Holding{r, p.box});
  Step& step = plan.step(0);
  step.moves = bsr_moves(src.shape, owners, needers, topology, plan.element_size());
  for (const auto& [r, p] : src.ranks) step.out[r] = dst.box_of(r);
  for (const auto& [r, p] : dst.ranks) step.out[r] = p.box;
  return plan.finish(spec.name, "bsr");
}

// An empty tensor: every rank takes its (empty) destination box, nothing moves.
Resolution plan_empty(const ReshardSpec& spec, const Layout& src, const Layout& dst) {
  PhasePlan plan(src, dst, dtype_size(spec.dtype));
  for (const auto& [r, p] : src.ranks) plan.step(0).out[r] = dst.box_of(r);
  for (const auto& [r, p] : dst.ranks) plan.step(0).out[r] = p.box;
  return plan.finish(spec.name, "bottom");
}

// Whether some rank exchanges data with a rank that sits in another subgroup
// of the source or of the destination (holding none counts as one more).
bool crosses_subgroups(const Resolution& r, const Layout& src, const Layout& dst) {
  auto subgroup = [](const Layout& l, int rank) {
    const Placement* p = l.find(rank);
    return p ? p->subgroup : -1;
  };
  auto apart = [&](int rank, int peer) {
    return peer != rank &&
           (subgroup(src, peer) != subgroup(src, rank) || subgroup(dst, peer) != subgroup(dst, rank));
  };
  for (const auto& [rank, me] : r.ranks)
    for (const CommPhase& phase : me.phases)
      for (const CommOp& op : phase.ops) {
        for (int m : op.group)
          if (apart(rank, m)) return true;
        for (const Transfer& t : op.sends)
          if (apart(rank, t.peer)) return true;
        for (const Transfer& t : op.recvs)
          if (apart(rank, t.peer)) return true;
      }
  return false;
}

Resolution plan_resolution(const ReshardSpec& spec, const Layout& src, const Layout& dst,
                           const Topology& topology) {
  const int64_t element_size = static_cast<int64_t>(dtype_size(spec.dtype));
  if (shape_numel(spec.shape) == 0) return plan_empty(spec, src, dst);
  std::string why;
  if (src.hsize() == dst.hsize() && src.hdim == dst.hdim && same_parts(src, dst)) {
    PhasePlan plan(src, dst, element_size);
    if (!plan_bottom_tier(plan, src, dst, topology, &why)) unsupported(spec, why);
    return plan.finish(spec.name, "bottom");
  }
  const bool partial = src.any_partial() || dst.any_partial();
  if (src.hsize() == dst.hsize() && src.hdim != dst.hdim && same_device_sets(src, dst)) {
    PhasePlan plan(src, dst, element_size);
    if (plan_top_tier(plan, src, dst, topology, &why)) return plan.finish(spec.name, "top");
    if (partial) unsupported(spec, why);
  } else if (partial) {
    unsupported(spec, bsr_refusal(src, dst));
  }
  return plan_bsr(spec, src, dst, topology);
}

}  // namespace

Resolution resolve(const ReshardSpec& spec, const Topology& topology) {
  const int world = topology.world_size();
  const Layout src = make_layout(spec.src, spec.shape, spec.name, "source", world);
  const Layout dst = make_layout(spec.dst, spec.shape, spec.name, "destination", world);
  Resolution r = plan_resolution(spec, src, dst, topology);
  r.dtype = spec.dtype;
  r.crosses_subgroups = crosses_subgroups(r, src, dst);
  return r;
}

Resolution resolve_for_rank(const ReshardSpec& spec, const Topology& topology, int rank) {
  Resolution r = resolve(spec, topology);
  auto mine = r.ranks.extract(rank);
  r.ranks.clear();
  if (!mine.empty()) r.ranks.insert(std::move(mine));
  return r;
}

namespace {

nlohmann::json op_json(const CommOp& op, size_t phase) {
  nlohmann::json j = {{"phase", phase}, {"kind", kind_name(op.kind)}};
  const bool p2p = op.kind == CommKind::kSend || op.kind == CommKind::kRecv || op.kind == CommKind::kBsr;
  if (p2p) {
    std::set<int> peers;
    for (const Transfer& t : op.sends) peers.insert(t.peer);
    for (const Transfer& t : op.recvs) peers.insert(t.peer);
    j["peers"] = peers;
  } else if (!op.group.empty()) {
    j["group"] = op.group;
  }
  if (!p2p) j["box"] = to_string(op.box);
  j["bytes"] = op.bytes_sent + op.bytes_received;
  j["bytes_sent"] = op.bytes_sent;
  j["bytes_received"] = op.bytes_received;
  return j;
}

nlohmann::json rank_json(const RankResolution& rr) {
  nlohmann::json ops = nlohmann::json::array();
  for (size_t k = 0; k < rr.phases.size(); ++k)
    for (const CommOp& op : rr.phases[k].ops) ops.push_back(op_json(op, k));
  return {{"rank", rr.rank},
          {"kind", kind_name(rr.kind)},
          {"bytes_sent", rr.bytes_sent},
          {"bytes_received", rr.bytes_received},
          {"ops", ops}};
}

}  // namespace

nlohmann::json to_json(const Resolution& resolution, int only_rank) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& [rank, rr] : resolution.ranks)
    if (only_rank < 0 || rank == only_rank) ranks.push_back(rank_json(rr));
  return {{"name", resolution.name},
          {"kind", kind_name(resolution.kind)},
          {"tier", resolution.tier},
          {"total_bytes", resolution.total_bytes},
          {"ranks", ranks}};
}

}  // namespace hspmd

// The phase plan: global phases under construction -> per-rank resolution.
#include <algorithm>
#include <set>

#include "hspmd/core/error.h"
#include "resolve/internal.h"

namespace hspmd::resolve_internal {
namespace {

// Headline priority: a rank (and a resolution) reports its "largest" op.
int priority(CommKind kind) {
  switch (kind) {
    case CommKind::kIdentity: return 0;
    case CommKind::kLocalSlice: return 1;
    case CommKind::kRecv: return 2;
    case CommKind::kSend: return 3;
    case CommKind::kAllGather: return 4;
    case CommKind::kReduceScatter: return 5;
    case CommKind::kAllReduce: return 6;
    case CommKind::kBsr: return 7;
    case CommKind::kSplitAllGather: return 8;
    case CommKind::kSplitReduceScatter: return 9;
    case CommKind::kSplitAllReduce: return 10;
  }
  return 0;
}


CommOp slice_op(const Box& box) {
  CommOp op;
  op.kind = CommKind::kLocalSlice;
  op.box = box;
  return op;
}

// A rank's point-to-point traffic in one phase.
struct RankMoves {
  std::map<int, std::vector<Box>> sends;
  std::map<int, std::vector<Box>> recvs;
  std::vector<Box> keeps;
  bool bsr = false;  // some move is not a pairwise send/recv
};

std::map<int, RankMoves> group_moves(const std::vector<Move>& moves, bool* single_pair) {
  std::map<int, RankMoves> out;
  std::set<std::pair<int, int>> pairs;
  for (const Move& m : moves) {
    if (m.from == m.to) {
      out[m.from].keeps.push_back(m.box);
    } else {
      out[m.from].sends[m.to].push_back(m.box);
      out[m.to].recvs[m.from].push_back(m.box);
      pairs.emplace(m.from, m.to);
      out[m.to].bsr = out[m.to].bsr || !m.pairwise;
    }
    out[m.from].bsr = out[m.from].bsr || !m.pairwise;
  }
  *single_pair = pairs.size() == 1;
  return out;
}

std::vector<Transfer> transfers(const std::map<int, std::vector<Box>>& by_peer, int64_t element_size,
                                int64_t* bytes) {
  std::vector<Transfer> out;
  for (const auto& [peer, boxes] : by_peer) {
    Transfer t{peer, boxes.size() > 1 ? merge_boxes(boxes) : boxes, 0};
    for (const Box& b : t.boxes) t.bytes += box_bytes(b, element_size);
    *bytes += t.bytes;
    out.push_back(std::move(t));
  }
  return out;
}

// The ops of one rank's point-to-point traffic. Keep-only ranks become local
// slices (nothing when the box does not change and nothing else happens).
void append_p2p_ops(const RankMoves& rm, bool single_pair, bool box_changes, bool has_other_ops,
                    int64_t element_size, std::vector<CommOp>& ops) {
  std::vector<Box> keeps = rm.keeps.size() > 1 ? merge_boxes(rm.keeps) : rm.keeps;
  if (rm.sends.empty() && rm.recvs.empty()) {
    if (!box_changes && !has_other_ops) return;
    for (const Box& b : keeps) ops.push_back(slice_op(b));
    return;
  }
  CommOp send, recv;
  send.kind = CommKind::kSend;
  recv.kind = CommKind::kRecv;
  send.sends = transfers(rm.sends, element_size, &send.bytes_sent);
  recv.recvs = transfers(rm.recvs, element_size, &recv.bytes_received);
  if (rm.bsr && !single_pair) {
    send.kind = CommKind::kBsr;
    send.recvs = std::move(recv.recvs);
    send.keeps = std::move(keeps);
    send.bytes_received = recv.bytes_received;
    ops.push_back(std::move(send));
    return;
  }
  (recv.recvs.empty() ? send : recv).keeps = std::move(keeps);
  if (!send.sends.empty()) ops.push_back(std::move(send));
  if (!recv.recvs.empty()) ops.push_back(std::move(recv));
}

void summarize(RankResolution& rr) {
  for (const CommPhase& ph : rr.phases)
    for (const CommOp& op : ph.ops) {
      if (priority(op.kind) > priority(rr.kind)) rr.kind = op.kind;
      rr.bytes_sent += op.bytes_sent;
      rr.bytes_received += op.bytes_received;
    }
}

}  // namespace

PhasePlan::PhasePlan(const Layout& src, const Layout& dst, int64_t element_size)
    : src_(src), dst_(dst), element_size_(element_size) {}

Step& PhasePlan::step(size_t k) {
  if (steps_.size() <= k) steps_.resize(k + 1);
  return steps_[k];
}

void PhasePlan::add_collective(size_t k, CommKind kind, const std::vector<int>& group, const Box& box,
                               const std::vector<Box>& pieces, const std::vector<bool>& contributes) {
  const int64_t n = static_cast<int64_t>(group.size());
  const int64_t all = box_bytes(box, element_size_);
  Step& s = step(k);
  for (size_t m = 0; m < group.size(); ++m) {
    CommOp op;
    op.kind = kind;
    op.group = group;
    op.box = box;
    op.pieces = pieces;
    op.contributes = contributes[m];
    if (is_all_reduce(kind)) {
      op.bytes_sent = op.bytes_received = 2 * (n - 1) * all / n;
    } else if (is_reduce_scatter(kind)) {
      // Each member's piece is packed on its own (pieces may repeat when a
      // subgroup holds a slice twice): the send buffer is their sum.
      int64_t packed = 0;
      for (const Box& p : pieces) packed += box_bytes(p, element_size_);
      const int64_t mine = box_bytes(pieces[m], element_size_);
      op.bytes_sent = packed - mine;
      op.bytes_received = (n - 1) * mine;
    } else {  // all_gather kinds
      const int64_t mine = box_bytes(pieces[m], element_size_);
      op.bytes_sent = (n - 1) * mine;
      op.bytes_received = all - mine;
    }
    s.ops[group[m]].push_back(std::move(op));
  }
}

void PhasePlan::add_local_slice(size_t k, int rank, const Box& box) {
  step(k).ops[rank].push_back(slice_op(box));
}

// Appends step `s` to the ranks it touches; `cur` tracks each rank's box.
void PhasePlan::emit_step(Step& s, std::map<int, std::optional<Box>>& cur, Resolution& res) const {
  bool single_pair = false;
  const std::map<int, RankMoves> moves = group_moves(s.moves, &single_pair);
  std::vector<int> touched;
  for (const auto& [rank, ops] : s.ops) touched.push_back(rank);
  for (const auto& [rank, box] : s.out) touched.push_back(rank);
  for (const auto& [rank, rm] : moves) touched.push_back(rank);
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (int rank : touched) {
    HSPMD_CHECK(cur.count(rank), "rank ", rank, " is in neither annotation");
    CommPhase ph;
    std::optional<Box>& now = cur[rank];
    ph.in_box = now;
    auto out = s.out.find(rank);
    ph.out_box = out == s.out.end() ? now : std::move(out->second);
    ph.zero_fill = s.zero_fill.count(rank) > 0;
    auto ops = s.ops.find(rank);
    if (ops != s.ops.end()) ph.ops = std::move(ops->second);
    auto rm = moves.find(rank);
    if (rm != moves.end())
      append_p2p_ops(rm->second, single_pair, ph.in_box != ph.out_box, !ph.ops.empty(), element_size_, ph.ops);
    if (ph.ops.empty() && ph.in_box == ph.out_box && !ph.zero_fill) continue;
    now = ph.out_box;
    res.ranks[rank].phases.push_back(std::move(ph));
  }
}

Resolution PhasePlan::finish(const std::string& name, const std::string& tier) {
  Resolution res;
  res.name = name;
  res.tier = tier;
  std::map<int, std::optional<Box>> cur;
  for (const auto& [rank, p] : src_.ranks) cur[rank] = p.box;
  for (const auto& [rank, p] : dst_.ranks) cur.emplace(rank, std::nullopt);
  for (const auto& [rank, box] : cur) res.ranks[rank].rank = rank;
  for (Step& s : steps_) emit_step(s, cur, res);
  for (auto& [rank, rr] : res.ranks) {
    const Placement* want = dst_.find(rank);
    const std::optional<Box>& got = cur[rank];
    HSPMD_CHECK(want ? got && *got == want->box : !got, "reshard '", name, "': rank ", rank,
                " ends with the wrong box");
    summarize(rr);
    if (priority(rr.kind) > priority(res.kind)) res.kind = rr.kind;
    res.total_bytes += rr.bytes_sent;
  }
  return res;
}

}  // namespace hspmd::resolve_internal

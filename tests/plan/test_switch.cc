// The switch planner (docs/switching.md): state tensors of two plans, the
// plans of the three algorithms executed element by element on small
// tensors (every needer ends with exactly its box of the global tensor, each
// element arriving once), their statistics, rounds and errors, and random
// plans and annotations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "hspmd/core/error.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/switch.h"
#include "plan/plan_test_util.h"
#include "resolve/random_annotations.h"

namespace hspmd {
namespace {

using testing::stage;
constexpr SwitchAlgorithm kAlgorithms[] = {SwitchAlgorithm::kNaive, SwitchAlgorithm::kPerTensor,
                                           SwitchAlgorithm::kFused};

using testing::pipeline;
using testing::strategy;

// Data parallel: one single-rank pipeline per rank.
Strategy dp(const std::vector<int>& ranks, int layers = 4, bool zero = false) {
  std::vector<Pipeline> ps;
  for (int r : ranks) ps.push_back(pipeline({stage({r}, 0, layers - 1)}));
  return strategy(std::move(ps), zero);
}

// Tensor parallel: one pipeline of one stage.
Strategy tp(const std::vector<int>& ranks, int layers = 4) {
  return strategy({pipeline({stage(ranks, 0, layers - 1)})});
}

AnnotationPlan compile(const Strategy& s, int world, ModelConfig config = testing::tiny_config()) {
  return compile_plan(config, s, world);
}

// Two nodes of 4 ranks with different devices (the paper's H800 + H20 mix).
Topology hetero_topology() {
  return Topology::from_json(nlohmann::json::parse(R"({
    "catalog": {"fast": {"tflops": 990, "memory_gib": 80, "intra_node_gbps": 400, "inter_node_gbps": 25},
                "slow": {"tflops": 148, "memory_gib": 96, "intra_node_gbps": 900, "inter_node_gbps": 25}},
    "nodes": [{"type": "fast", "ranks": [0, 3]}, {"type": "slow", "ranks": [4, 7]}]})"));
}

// ---- Element-wise execution of a switch plan ----------------------------------

// One local array: a box of a tensor and, per element, its value and how
// often it was written.
struct Local {
  Box box;
  std::vector<double> values;
  std::vector<int> writes;
};

int64_t offset_in(const Box& box, const Shape& idx) {
  int64_t off = 0;
  for (size_t d = 0; d < idx.size(); ++d) off = off * (box.end[d] - box.begin[d]) + (idx[d] - box.begin[d]);
  return off;
}

template <typename F>
void for_each_index(const Box& box, F&& f) {
  if (box.numel() == 0) return;
  Shape idx = box.begin;
  while (true) {
    f(idx);
    size_t d = idx.size();
    while (d > 0) {
      --d;
      if (++idx[d] < box.end[d]) break;
      idx[d] = box.begin[d];
      if (d == 0) return;
    }
    if (idx.empty()) return;
  }
}

// The global value of element `idx` of tensor t before the switch: distinct
// for every element of every tensor.
double source_value(int t, const Shape& shape, const Shape& idx) {
  return 1 + t * 1e6 + static_cast<double>(offset_in(Box{Shape(shape.size(), 0), shape}, idx));
}

bool inside(const Box& outer, const Box& inner) {
  for (size_t d = 0; d < outer.begin.size(); ++d)
    if (inner.begin[d] < outer.begin[d] || inner.end[d] > outer.end[d]) return false;
  return true;
}

bool holds_index(const Box& box, const Shape& idx) {
  for (size_t d = 0; d < idx.size(); ++d)
    if (idx[d] < box.begin[d] || idx[d] >= box.end[d]) return false;
  return true;
}

using Key = std::tuple<int, int, int>;  // tensor, rank, slot

class Executor {
 public:
  Executor(const SwitchPlan& sp, const std::set<int>& lost) : sp_(sp) {
    for (size_t t = 0; t < sp.tensors.size(); ++t) {
      const StateTensor& st = sp.tensors[t];
      for (const StateHolding& h : st.owners) {
        Local& l = old_[{static_cast<int>(t), h.rank, static_cast<int>(h.slot)}];
        l.box = h.box;
        for_each_index(h.box, [&](const Shape& i) {
          // A lost rank's memory is garbage: reading it shows up as NaN.
          l.values.push_back(lost.count(h.rank) ? std::nan("") : source_value(static_cast<int>(t), st.source_shape, i));
        });
      }
      for (const StateHolding& h : st.needers) {
        Local& l = new_[{static_cast<int>(t), h.rank, static_cast<int>(h.slot)}];
        l.box = h.box;
        l.values.assign(h.box.numel(), 0.0);  // the executor zero-fills new arrays
        l.writes.assign(h.box.numel(), 0);
      }
    }
  }

  // Runs every round; returns "" or the first problem.
  std::string run() {
    for (size_t k = 0; k < sp_.rounds.size() && error_.empty(); ++k) run_round(sp_.rounds[k]);
    if (error_.empty()) check_result();
    return error_;
  }

 private:
  void problem(const std::string& what) {
    if (error_.empty()) error_ = what;
  }

  std::vector<double> read(const SliceRef& s, int rank) {
    std::vector<double> out;
    auto it = old_.find({s.tensor, rank, static_cast<int>(s.src_slot)});
    if (it == old_.end() || !inside(it->second.box, s.box)) {
      problem("rank " + std::to_string(rank) + " reads " + to_string(s.box) + " of tensor " + std::to_string(s.tensor) +
              " from slot " + slot_name(s.src_slot) + " it does not hold");
      return out;
    }
    for_each_index(s.box, [&](const Shape& i) { out.push_back(it->second.values[offset_in(it->second.box, i)]); });
    return out;
  }

  std::vector<double> read_checkpoint(const SliceRef& s) {
    std::vector<double> out;
    const StateTensor& t = sp_.tensors[s.tensor];
    if (!inside(Box{Shape(t.shape.size(), 0), t.source_shape}, s.box)) problem("checkpoint read outside the source");
    for_each_index(s.box, [&](const Shape& i) { out.push_back(source_value(s.tensor, t.source_shape, i)); });
    return out;
  }

  // Writes `values` (of s.box, row-major) into every destination holding of
  // `rank` for s.tensor that overlaps the box.
  void write(const SliceRef& s, int rank, const std::vector<double>& values) {
    if (!error_.empty()) return;
    bool any = false;
    for (auto& [key, l] : new_) {
      if (std::get<0>(key) != s.tensor || std::get<1>(key) != rank) continue;
      for_each_index(s.box, [&](const Shape& i) {
        if (!holds_index(l.box, i)) return;
        any = true;
        const int64_t o = offset_in(l.box, i);
        l.values[o] = values[offset_in(s.box, i)];
        ++l.writes[o];
      });
    }
    if (!any) problem("rank " + std::to_string(rank) + " gets " + to_string(s.box) + " it does not need");
  }

  void run_round(const SwitchRound& round) {
    const std::set<int> members(round.tensors.begin(), round.tensors.end());
    for (const auto& [rank, rr] : round.ranks) {
      for (const SliceRef& s : rr.keeps) {
        if (!members.count(s.tensor)) problem("a keep of a tensor outside its round");
        write(s, rank, read(s, rank));
      }
      for (const SliceRef& s : rr.checkpoint) write(s, rank, read_checkpoint(s));
      std::set<int> peers;
      for (const SwitchMessage& m : rr.sends) {
        if (!peers.insert(m.peer).second) problem("two messages from one sender to one receiver in a round");
        if (m.peer == rank) problem("a message to itself");
        deliver(round, members, rank, m);
      }
    }
  }

  void deliver(const SwitchRound& round, const std::set<int>& members, int from, const SwitchMessage& m) {
    auto it = round.ranks.find(m.peer);
    const SwitchMessage* match = nullptr;
    if (it != round.ranks.end())
      for (const SwitchMessage& r : it->second.recvs)
        if (r.peer == from) match = &r;
    if (!match) return problem("a send without its receive");
    int64_t bytes = 0;
    bool same = match->slices.size() == m.slices.size() && match->bytes == m.bytes;
    for (size_t i = 0; same && i < m.slices.size(); ++i)
      same = match->slices[i].tensor == m.slices[i].tensor && match->slices[i].box == m.slices[i].box &&
             match->slices[i].src_slot == m.slices[i].src_slot;
    if (!same) return problem("sender and receiver list different slices");
    for (const SliceRef& s : m.slices) {
      if (!members.count(s.tensor)) problem("a slice of a tensor outside its round");
      bytes += s.box.numel() * 4;
      write(s, m.peer, read(s, from));
    }
    if (bytes != m.bytes) problem("message bytes differ from its slices");
  }

  void check_result() {
    for (const auto& [key, l] : new_) {
      const auto [t, rank, slot] = key;
      const StateTensor& st = sp_.tensors[t];
      int64_t k = 0;
      for_each_index(l.box, [&](const Shape& i) {
        const bool in_source = i[0] < st.source_shape[0];
        const double want = in_source ? source_value(t, st.source_shape, i) : 0.0;
        if (l.writes[k] != (in_source ? 1 : 0) || !(l.values[k] == want))
          problem(st.name() + " rank " + std::to_string(rank) + " slot " + slot_name(static_cast<StateSlot>(slot)) +
                  ": element " + shape_str(i) + " is " + std::to_string(l.values[k]) + " written " +
                  std::to_string(l.writes[k]) + " times, expected " + std::to_string(want));
        ++k;
      });
    }
  }

  const SwitchPlan& sp_;
  std::map<Key, Local> old_, new_;
  std::string error_;
};

// Statistics recomputed from the messages; sent == received per link class.
void check_stats(const SwitchPlan& sp, const Topology& topology) {
  std::vector<RankSwitchStats> want(topology.world_size());
  for (const SwitchRound& round : sp.rounds)
    for (const auto& [rank, rr] : round.ranks)
      for (const SwitchMessage& m : rr.sends) {
        const bool local = topology.same_node(rank, m.peer);
        (local ? want[rank].intra_sent : want[rank].inter_sent) += m.bytes;
        (local ? want[m.peer].intra_received : want[m.peer].inter_received) += m.bytes;
        ++want[rank].messages_sent;
        ++want[m.peer].messages_received;
      }
  ASSERT_EQ(sp.stats.size(), want.size());
  int64_t intra_s = 0, intra_r = 0, inter_s = 0, inter_r = 0;
  for (size_t r = 0; r < want.size(); ++r) {
    EXPECT_EQ(sp.stats[r].intra_sent, want[r].intra_sent) << r;
    EXPECT_EQ(sp.stats[r].inter_received, want[r].inter_received) << r;
    EXPECT_EQ(sp.stats[r].messages_received, want[r].messages_received) << r;
    intra_s += sp.stats[r].intra_sent, intra_r += sp.stats[r].intra_received;
    inter_s += sp.stats[r].inter_sent, inter_r += sp.stats[r].inter_received;
  }
  EXPECT_EQ(intra_s, intra_r);
  EXPECT_EQ(inter_s, inter_r);
  EXPECT_EQ(sp.round_peak_bytes.size(), want.size());
}

// Plans with every algorithm, executes each and checks it; returns the plans.
std::vector<SwitchPlan> plan_all(const std::vector<StateTensor>& tensors, const Topology& topology,
                                 SwitchOptions o = {}) {
  std::vector<SwitchPlan> out;
  const double lower = switch_lower_bound(tensors, topology, o.lost_ranks);
  const double sender = switch_sender_bound(tensors, topology, o.lost_ranks);
  for (SwitchAlgorithm a : kAlgorithms) {
    o.algorithm = a;
    SwitchPlan sp = plan_switch(tensors, topology, o);
    EXPECT_EQ(Executor(sp, o.lost_ranks).run(), "") << algorithm_name(a);
    check_stats(sp, topology);
    EXPECT_LE(lower, sp.predicted_s * (1 + 1e-12)) << algorithm_name(a);
    // The sender bound holds for plans that follow the same-node rule.
    if (a != SwitchAlgorithm::kNaive) {
      EXPECT_LE(sender, sp.predicted_s * (1 + 1e-12)) << algorithm_name(a);
    }
    out.push_back(std::move(sp));
  }
  return out;
}

std::vector<SwitchPlan> switch_plans(const AnnotationPlan& from, const AnnotationPlan& to, const Topology& topology,
                                     SwitchOptions o = {}) {
  return plan_all(state_tensors(from, to), topology, o);
}

int64_t total_sent(const SwitchPlan& sp) {
  int64_t n = 0;
  for (const RankSwitchStats& s : sp.stats) n += s.sent();
  return n;
}

// ---- Names and state tensors ---------------------------------------------------

TEST(Switch, Names) {
  for (SwitchAlgorithm a : kAlgorithms) EXPECT_EQ(parse_switch_algorithm(algorithm_name(a)), a);
  EXPECT_EQ(algorithm_name(SwitchAlgorithm::kPerTensor), "per-tensor");
  try {
    parse_switch_algorithm("fast", "--algorithm");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "[flags] --algorithm: unknown switch algorithm 'fast' (expected naive, per-tensor or fused)");
  }
  EXPECT_EQ(slot_name(StateSlot::kExpAvgSq), "exp_avg_sq");
  StateTensor t;
  t.param = "w";
  t.kind = StateSlot::kExpAvg;
  EXPECT_EQ(t.name(), "w.exp_avg");
}

TEST(Switch, StateTensorsOfZeroPlans) {
  const AnnotationPlan from = compile(dp({0, 1}, 4, true), 4);
  const AnnotationPlan to = compile(tp({0, 1, 2, 3}), 4);
  const std::vector<StateTensor> ts = state_tensors(from, to);
  ASSERT_EQ(ts.size(), 3 * (2 + 4 * 9 + 1));
  EXPECT_EQ(ts[0].name(), "model.embed_tokens.weight");
  EXPECT_EQ(ts[1].name(), "model.embed_tokens.weight.exp_avg");
  EXPECT_EQ(ts[0].group, 0);
  EXPECT_EQ(ts[3].group, 1);      // model.layers.0.*
  EXPECT_EQ(ts.back().group, 5);  // lm_head
  EXPECT_EQ(ts.back().name(), "lm_head.weight.exp_avg_sq");
  // Weights: the compute copy on both ranks plus the ZeRO master halves.
  int masters = 0;
  for (const StateHolding& h : ts[0].owners) masters += h.slot == StateSlot::kMaster;
  EXPECT_EQ(ts[0].owners.size(), 4u);
  EXPECT_EQ(masters, 2);
  // Moments live only in the optimizer-state layout (the halves).
  ASSERT_EQ(ts[1].owners.size(), 2u);
  EXPECT_EQ(ts[1].owners[0].slot, StateSlot::kExpAvg);
  EXPECT_EQ(ts[1].owners[0].box.numel() * 2, shape_numel(ts[1].shape));
  // No ZeRO in the destination: moments at the parameter layout.
  EXPECT_EQ(ts[1].needers.size(), 4u);
}

TEST(Switch, StateTensorsRejectOtherModelsAndWorlds) {
  const AnnotationPlan a = compile(tp({0, 1}), 4);
  try {
    state_tensors(a, compile(tp({0, 1}), 2));
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "[switch] plans of different world sizes: 4 ranks in the source plan, 2 in the destination plan");
  }
  try {
    state_tensors(a, compile(tp({0, 1}, 3), 4, testing::tiny_config(3)));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[switch] plans of different models: ", 0), 0u) << e.what();
  }
  ModelConfig wide = testing::tiny_config();
  wide.intermediate_size = 128;
  EXPECT_THROW(state_tensors(a, compile(tp({0, 1}), 4, wide)), Error);
}

// ---- Executed switches -----------------------------------------------------------

TEST(Switch, DataParallelToTensorParallelAndBack) {
  const Topology topo = Topology::uniform(4, 2);
  const AnnotationPlan d = compile(dp({0, 1, 2, 3}), 4), t = compile(tp({0, 1, 2, 3}), 4);
  // Every rank holds the whole model: DP -> TP moves nothing.
  for (const SwitchPlan& sp : switch_plans(d, t, topo)) EXPECT_EQ(total_sent(sp), 0) << algorithm_name(sp.algorithm);
  for (const SwitchPlan& sp : switch_plans(t, d, topo)) EXPECT_GT(total_sent(sp), 0);
  // DP 2 x TP 2 -> DP 4: rank 3 lacks shard 0, held by ranks 0 (other node)
  // and 2 (its node). Naive takes the lowest rank, the others the same node.
  const AnnotationPlan dt = compile(strategy({pipeline({stage({0, 1}, 0, 3)}), pipeline({stage({2, 3}, 0, 3)})}), 4);
  const std::vector<SwitchPlan> sps = switch_plans(dt, d, topo);
  EXPECT_GT(sps[0].stats[3].inter_received, 0);
  EXPECT_EQ(sps[1].stats[3].inter_received, 0);
  EXPECT_EQ(sps[2].stats[3].inter_received, 0);
  EXPECT_LT(sps[2].predicted_s, sps[0].predicted_s);
}

TEST(Switch, ZeroToNoZeroAndBack) {
  const Topology topo = Topology::uniform(8, 4);
  const AnnotationPlan z = compile(dp({0, 1, 2, 3}, 4, true), 8);
  const AnnotationPlan n = compile(strategy({pipeline({stage({4, 5}, 0, 1), stage({6, 7}, 2, 3)})}), 8);
  switch_plans(z, n, topo);
  switch_plans(n, z, topo);
  // ZeRO on the same ranks: the master halves come from the compute copies
  // and keeps; moments are cut from their halves.
  const AnnotationPlan z2 =
      compile(strategy({pipeline({stage({0, 1}, 0, 3)}), pipeline({stage({2, 3}, 0, 3)})}, true), 8);
  switch_plans(z, z2, topo);
  switch_plans(z2, z, topo);
}

TEST(Switch, WorldChangeWithIdleRanks) {
  const Topology topo = hetero_topology();
  const AnnotationPlan eight = compile(strategy({pipeline({stage({0, 1}, 0, 1), stage({2, 3}, 2, 3)}),
                                                 pipeline({stage({4}, 0, 1), stage({5}, 2, 2), stage({6, 7}, 3, 3)})}),
                                       8);
  const AnnotationPlan five = compile(strategy({pipeline({stage({4, 5, 6, 7}, 0, 2), stage({3}, 3, 3)})}), 8);
  for (const SwitchPlan& sp : switch_plans(eight, five, topo)) {
    for (int idle : {0, 1, 2}) EXPECT_EQ(sp.stats[idle].received(), 0);
    // An idle rank of the destination holds nothing new: only its send buffers.
    if (sp.rounds.size() == 1) {
      EXPECT_EQ(sp.round_peak_bytes[0], sp.stats[0].sent());
    }
  }
  switch_plans(five, eight, topo);
}

TEST(Switch, PaddedVocabularyChanges) {
  ModelConfig c = testing::tiny_config();
  c.vocab_size = 66;  // tp 2 keeps 66 rows, tp 4 pads to 68
  const AnnotationPlan two = compile(tp({0, 1}), 4, c), four = compile(tp({0, 1, 2, 3}), 4, c);
  ASSERT_EQ(two.model.table_rows(), 66);
  ASSERT_EQ(four.model.table_rows(), 68);
  const std::vector<StateTensor> ts = state_tensors(two, four);
  EXPECT_EQ(ts[0].shape, (Shape{68, 32}));
  EXPECT_EQ(ts[0].source_shape, (Shape{66, 32}));
  switch_plans(two, four, Topology::uniform(4, 2));
  switch_plans(four, two, Topology::uniform(4, 2));
  switch_plans(four, compile(dp({2, 3}), 4, c), Topology::uniform(4, 2));
}

TEST(Switch, LostRanks) {
  const Topology topo = Topology::uniform(4, 2);
  const AnnotationPlan t = compile(tp({0, 1, 2, 3}), 4), d = compile(dp({0, 2, 3}), 4);
  SwitchOptions o;
  o.lost_ranks = {1};
  // Replicas elsewhere: nothing comes from rank 1.
  for (const SwitchPlan& sp : switch_plans(d, t, topo, o)) EXPECT_EQ(sp.stats[1].sent(), 0);
  // Rank 1's tensor-parallel shard is gone.
  try {
    plan_switch(state_tensors(t, d), topo, o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "[switch] tensor 'model.embed_tokens.weight': slice [16:32, 0:32] is held by no available rank "
                 "(lost: 1) and there is no checkpoint");
  }
  o.have_checkpoint = true;
  for (const SwitchPlan& sp : switch_plans(t, d, topo, o)) {
    EXPECT_GT(sp.stats[0].checkpoint_read, 0);
    EXPECT_EQ(sp.stats[1].sent(), 0);
  }
  o.lost_ranks = {0, 1, 2, 3};  // everything from the checkpoint
  for (const SwitchPlan& sp : switch_plans(t, d, topo, o)) EXPECT_EQ(total_sent(sp), 0);
}

TEST(Switch, FusedNeverWorseThanNaiveOnHeteroCluster) {
  const Topology topo = hetero_topology();
  const AnnotationPlan a = compile(strategy({pipeline({stage({0, 1, 2, 3}, 0, 1), stage({4, 5}, 2, 3)}),
                                             pipeline({stage({6}, 0, 1), stage({7}, 2, 3)})}),
                                   8);
  const AnnotationPlan b = compile(strategy({pipeline({stage({4, 5, 6, 7}, 0, 3)}), pipeline({stage({0, 1}, 0, 3)}),
                                             pipeline({stage({2, 3}, 0, 3)})}),
                                   8);
  for (const auto& [from, to] : {std::pair{&a, &b}, std::pair{&b, &a}}) {
    const std::vector<SwitchPlan> sps = switch_plans(*from, *to, topo);
    EXPECT_LE(sps[2].predicted_s, sps[0].predicted_s);
    EXPECT_LE(sps[2].predicted_s, sps[1].predicted_s * (1 + 1e-9));
    EXPECT_EQ(total_sent(sps[0]), total_sent(sps[2]));  // same slices, other senders
  }
}

// One 8x4 f32 tensor (128 bytes) held whole by `owners`, needed whole by `needers`.
StateTensor whole_tensor(const std::vector<int>& owners, const std::vector<int>& needers) {
  StateTensor t;
  t.param = "w";
  t.shape = t.source_shape = {8, 4};
  for (int r : owners) t.owners.push_back({r, Box{{0, 0}, {8, 4}}, StateSlot::kParam});
  for (int r : needers) t.needers.push_back({r, Box{{0, 0}, {8, 4}}, StateSlot::kParam});
  return t;
}

TEST(Switch, BoundsAndPredictedTime) {
  const Topology topo = Topology::uniform(4, 2);  // nodes {0, 1}, {2, 3}: 100 GB/s inside, 25 across
  // Rank 0 alone holds it: it sends 128 bytes to rank 1 and twice 128 across.
  const std::vector<StateTensor> one = {whole_tensor({0}, {1, 2, 3})};
  EXPECT_DOUBLE_EQ(switch_lower_bound(one, topo), 128 / 25e9);
  EXPECT_DOUBLE_EQ(switch_sender_bound(one, topo), 256 / 25e9);
  for (const SwitchPlan& sp : plan_all(one, topo)) {
    EXPECT_DOUBLE_EQ(sp.predicted_s, 256 / 25e9);
    EXPECT_EQ(sp.stats[0].intra_sent, 128);
    EXPECT_EQ(sp.stats[0].inter_sent, 256);
  }
  // A copy on the other node: rank 3 takes it from rank 2 (same node) except
  // under naive (lowest rank).
  const std::vector<StateTensor> two = {whole_tensor({0, 2}, {1, 3})};
  EXPECT_DOUBLE_EQ(switch_lower_bound(two, topo), 128 / 100e9);
  EXPECT_DOUBLE_EQ(switch_sender_bound(two, topo), 128 / 100e9);  // each copy serves its node
  const std::vector<SwitchPlan> sps = plan_all(two, topo);
  EXPECT_DOUBLE_EQ(sps[0].predicted_s, 128 / 25e9);
  EXPECT_DOUBLE_EQ(sps[1].predicted_s, 128 / 100e9);
  EXPECT_DOUBLE_EQ(sps[2].predicted_s, 128 / 100e9);
  // Lost: rank 2's copy is no source; its own need comes from rank 0.
  SwitchOptions o;
  o.lost_ranks = {2};
  const std::vector<StateTensor> lost = {whole_tensor({0, 2}, {1, 2, 3})};
  EXPECT_DOUBLE_EQ(switch_sender_bound(lost, topo, o.lost_ranks), 256 / 25e9);
  for (const SwitchPlan& sp : plan_all(lost, topo, o)) EXPECT_EQ(sp.stats[2].inter_received, 128);
}

TEST(Switch, RoundsAndBuckets) {
  const Topology topo = Topology::uniform(4, 2);
  const AnnotationPlan from = compile(tp({0, 1}), 4), to = compile(dp({2, 3}), 4);
  const std::vector<StateTensor> ts = state_tensors(from, to);
  SwitchOptions o;
  o.algorithm = SwitchAlgorithm::kNaive;
  EXPECT_EQ(plan_switch(ts, topo, o).rounds.size(), ts.size());
  o.algorithm = SwitchAlgorithm::kFused;
  const SwitchPlan one = plan_switch(ts, topo, o);
  ASSERT_EQ(one.rounds.size(), 1u);
  EXPECT_EQ(one.rounds[0].tensors.size(), ts.size());
  // A bucket of one byte: a round per layer group (6 groups).
  o.bucket_bytes = 1;
  const SwitchPlan per_group = plan_switch(ts, topo, o);
  ASSERT_EQ(per_group.rounds.size(), 6u);
  for (const SwitchRound& r : per_group.rounds)
    for (int t : r.tensors) EXPECT_EQ(ts[t].group, ts[r.tensors[0]].group);
  EXPECT_EQ(Executor(per_group, {}).run(), "");
  // Bigger rounds hold more at once.
  EXPECT_GT(one.round_peak_bytes[2], per_group.round_peak_bytes[2]);
  // One layer's tensors: 2 layers per round.
  int64_t layer = 0;
  for (const StateTensor& t : ts)
    if (t.group == 1) layer += shape_numel(t.shape) * 4;
  o.bucket_bytes = 2 * layer;
  const SwitchPlan two = plan_switch(ts, topo, o);
  // {embedding, layer 0}, {layers 1, 2}, {layer 3, head}: whole groups, greedy.
  ASSERT_EQ(two.rounds.size(), 3u);
  EXPECT_EQ(ts[two.rounds[1].tensors.front()].group, 2);
  EXPECT_EQ(ts[two.rounds[2].tensors.back()].group, 5);
  EXPECT_EQ(Executor(two, {}).run(), "");
}

// The reference executor itself notices broken plans.
TEST(Switch, ExecutorCatchesBrokenPlans) {
  const Topology topo = Topology::uniform(4, 2);
  const SwitchPlan good = plan_switch(state_tensors(compile(tp({0, 1}), 4), compile(dp({1, 2, 3}), 4)), topo, {});
  ASSERT_EQ(Executor(good, {}).run(), "");
  ASSERT_FALSE(good.rounds[0].ranks.at(2).recvs.empty());
  SwitchPlan dropped = good;
  dropped.rounds[0].ranks.at(2).recvs[0].slices.pop_back();  // receiver lists fewer slices
  EXPECT_NE(Executor(dropped, {}).run(), "");
  SwitchPlan no_keep = good;
  ASSERT_FALSE(no_keep.rounds[0].ranks.at(1).keeps.empty());
  no_keep.rounds[0].ranks.at(1).keeps.pop_back();  // elements never arrive
  EXPECT_NE(Executor(no_keep, {}).run(), "");
  SwitchPlan twice = good;
  auto& keeps = twice.rounds[0].ranks.at(1).keeps;
  keeps.push_back(keeps.front());  // an element arrives twice
  EXPECT_NE(Executor(twice, {}).run(), "");
  EXPECT_NE(Executor(good, {0}).run(), "");  // a sender's memory is garbage
}

TEST(Switch, RejectsBadHoldings) {
  StateTensor t;
  t.param = "w";
  t.shape = t.source_shape = {4, 4};
  t.owners = {StateHolding{0, Box{{0, 0}, {4, 4}}, StateSlot::kParam}};
  t.needers = {StateHolding{5, Box{{0, 0}, {4, 4}}, StateSlot::kParam}};
  EXPECT_THROW(plan_switch({t}, Topology::uniform(4), {}), Error);
  t.needers = {StateHolding{1, Box{{0, 0}, {4, 5}}, StateSlot::kParam}};
  try {
    plan_switch({t}, Topology::uniform(4), {});
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "[switch] tensor 'w': needer box [0:4, 0:5] of rank 1 is outside its shape [4, 4]");
  }
  t.needers = {StateHolding{1, Box{{0, 0}, {4, 4}}, StateSlot::kParam}};
  t.source_shape = {4, 2};
  EXPECT_THROW(plan_switch({t}, Topology::uniform(4), {}), Error);
}

TEST(Switch, CacheServesEachPairOnce) {
  const Topology topo = Topology::uniform(4, 2);
  const AnnotationPlan a = compile(tp({0, 1}), 4), b = compile(dp({2, 3}), 4);
  SwitchPlanCache cache;
  const SwitchPlan& ab = cache.get(a, b, topo, {});
  EXPECT_EQ(&cache.get(a, b, topo, {}), &ab);
  EXPECT_EQ(cache.misses(), 1);
  cache.get(b, a, topo, {});
  SwitchOptions naive;
  naive.algorithm = SwitchAlgorithm::kNaive;
  cache.get(a, b, topo, naive);
  EXPECT_EQ(cache.misses(), 3);
}

TEST(Switch, JsonReport) {
  const Topology topo = Topology::uniform(4, 2);
  const SwitchPlan sp = plan_switch(state_tensors(compile(tp({0, 1}), 4), compile(dp({2, 3}), 4)), topo, {});
  const nlohmann::json j = to_json(sp);
  EXPECT_EQ(j["algorithm"], "fused");
  ASSERT_EQ(j["ranks"].size(), 4u);
  int64_t total = 0, most = 0;
  for (const auto& r : j["ranks"]) {
    const int64_t sent = r["intra_sent"].get<int64_t>() + r["inter_sent"].get<int64_t>();
    total += sent;
    most = std::max(most, sent);
  }
  EXPECT_EQ(j["total_bytes"], total);
  EXPECT_EQ(j["max_rank_bytes"], most);
  EXPECT_GT(total, 0);
  EXPECT_DOUBLE_EQ(j["predicted_s"].get<double>(), sp.predicted_s);
}

// ---- Random plans and annotations ------------------------------------------------

// A random strategy over up to 8 ranks of the tiny model: pipelines of
// stages with tp 1, 2 or 4, random layer cuts, maybe ZeRO.
Strategy random_strategy(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<int> pool(8);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<Pipeline> ps;
  const int pipelines = pick(1, 3);
  for (int p = 0; p < pipelines && !pool.empty(); ++p) {
    const int stages = pick(1, std::min<int>(3, static_cast<int>(pool.size())));
    std::vector<Stage> st;
    int first = 0;
    for (int s = 0; s < stages; ++s) {
      int size = std::min<int>(1 << pick(0, 2), static_cast<int>(pool.size()) - (stages - s - 1));
      while (size & (size - 1)) --size;  // 1, 2 or 4
      const int last = s + 1 == stages ? 3 : pick(first, 3 - (stages - s - 1));
      st.push_back(stage(std::vector<int>(pool.begin(), pool.begin() + size), first, last));
      pool.erase(pool.begin(), pool.begin() + size);
      first = last + 1;
    }
    ps.push_back(pipeline(std::move(st)));
  }
  return strategy(std::move(ps), pick(0, 1) == 1);
}

TEST(Switch, RandomPlans) {
  std::mt19937 rng(20261122);
  const Topology topo = hetero_topology();
  ModelConfig c = testing::tiny_config();
  c.vocab_size = 66;
  int cases = 0;
  for (int tries = 0; cases < 24 && tries < 200; ++tries) {
    AnnotationPlan a, b;
    try {
      a = compile(random_strategy(rng), 8, c);
      b = compile(random_strategy(rng), 8, c);
    } catch (const Error&) {
      continue;
    }
    ++cases;
    SwitchOptions o;
    o.bucket_bytes = std::uniform_int_distribution<int>(0, 1)(rng) * 40000;
    SCOPED_TRACE("case " + std::to_string(cases));
    switch_plans(a, b, topo, o);
  }
  EXPECT_EQ(cases, 24);
}

// Random annotations (any hdim, weights, orders) as holdings of one tensor.
TEST(Switch, RandomAnnotations) {
  testing::Generator gen(7);
  const Topology topo = hetero_topology();
  for (int n = 0; n < 150;) {
    const Shape shape = gen.shape();
    const int ndim = static_cast<int>(shape.size());
    const Annotation src = gen.annotation(gen.ranks(), ndim, false);
    const Annotation dst = gen.annotation(gen.ranks(), ndim, false);
    if (!testing::fits(src, shape) || !testing::fits(dst, shape)) continue;
    ++n;
    StateTensor t;
    t.param = "t" + std::to_string(n);
    t.shape = t.source_shape = shape;
    for (int r : src.all_ranks()) t.owners.push_back({r, *local_box(src, shape, r), StateSlot::kExpAvg});
    for (int r : dst.all_ranks()) t.needers.push_back({r, *local_box(dst, shape, r), StateSlot::kExpAvg});
    SwitchOptions o;
    if (gen.chance(0.3)) {
      o.lost_ranks = {gen.uniform(0, 7)};
      o.have_checkpoint = true;
    }
    SCOPED_TRACE(to_string(src) + " -> " + to_string(dst));
    plan_all({t}, topo, o);
  }
}

}  // namespace
}  // namespace hspmd

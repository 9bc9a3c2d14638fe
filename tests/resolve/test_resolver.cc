// Every branch of the resolver, each executed through the simulator.
#include <gtest/gtest.h>

#include "hspmd/core/error.h"
#include "resolve/resolve_test_util.h"

namespace hspmd {
namespace {

using namespace hspmd::testing;

const Topology kWorld8 = Topology::uniform(8, 8);

std::vector<std::vector<int>> groups_of(const Resolution& res, int rank, CommKind kind) {
  std::vector<std::vector<int>> out;
  for (const CommOp& op : ops_of(res, rank))
    if (op.kind == kind) out.push_back(op.group);
  return out;
}

void expect_unsupported(const ReshardSpec& s, const std::string& fragment, const Topology& t = kWorld8) {
  try {
    resolve(s, t);
    ADD_FAILURE() << "no error, expected: " << fragment;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[resolve] reshard '" + s.name + "': ", 0), 0u) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// ---- bottom tier -----------------------------------------------------------

TEST(ResolveBottom, Identity) {
  Annotation a = ann({sg({0, 1}, {{S0, 2}})});
  Resolution r = resolve_and_check(spec({4, 6}, a, a), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kIdentity);
  EXPECT_EQ(r.tier, "bottom");
  EXPECT_EQ(r.total_bytes, 0);
  EXPECT_TRUE(r.ranks.at(0).phases.empty());
  EXPECT_EQ(r.ranks.size(), 2u);
}

TEST(ResolveBottom, SendRecvPairwise) {
  Resolution r = resolve_and_check(spec({4, 6}, ann({sg({0, 1}, {{S0, 2}})}), ann({sg({2, 3}, {{S0, 2}})})), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kSend);
  EXPECT_EQ(r.ranks.at(0).kind, CommKind::kSend);
  EXPECT_EQ(r.ranks.at(3).kind, CommKind::kRecv);
  EXPECT_EQ(r.total_bytes, 4 * 6 * 4);
  ASSERT_EQ(r.ranks.at(1).phases.size(), 1u);
  EXPECT_FALSE(r.ranks.at(1).phases[0].out_box.has_value());
  EXPECT_EQ(r.ranks.at(1).phases[0].ops[0].sends[0].peer, 3);
}

TEST(ResolveBottom, SendRecvMovesPartialTermsAndPermutations) {
  resolve_and_check(spec({4, 6}, ann({sg({0, 1}, {{PART, 2}})}), ann({sg({3, 2}, {{PART, 2}})})), kWorld8);
  // A permutation of the same dup copies needs no transfer at all.
  Resolution r = resolve_and_check(spec({4}, ann({sg({0, 1}, {{DUP, 2}})}), ann({sg({1, 0}, {{DUP, 2}})})), kWorld8);
  EXPECT_EQ(r.total_bytes, 0);
}

TEST(ResolveBottom, LocalSlice) {
  Resolution r = resolve_and_check(spec({4, 6}, ann({sg({0, 1}, {{DUP, 2}})}), ann({sg({0, 1}, {{S1, 2}})})), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kLocalSlice);
  EXPECT_EQ(r.total_bytes, 0);
}

TEST(ResolveBottom, AllReduce) {
  Resolution r = resolve_and_check(spec({4, 6}, ann({sg({0, 1}, {{PART, 2}})}), ann({sg({0, 1}, {{DUP, 2}})})), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kAllReduce);
  EXPECT_EQ(groups_of(r, 1, CommKind::kAllReduce), (std::vector<std::vector<int>>{{0, 1}}));
  EXPECT_EQ(r.ranks.at(0).bytes_sent, 4 * 6 * 4);  // ring: 2 (n-1)/n of the buffer
}

TEST(ResolveBottom, AllReduceKeepsOtherCoordinates) {
  // [partial, split1] -> [dup, split1] on 4 ranks: reduce across ranks sharing the split1 coordinate.
  Annotation src = ann({sg({0, 1, 2, 3}, {{PART, 2}, {S1, 2}}, {PART, S1})});
  Annotation dst = ann({sg({0, 1, 2, 3}, {{DUP, 2}, {S1, 2}}, {DUP, S1})});
  Resolution r = resolve_and_check(spec({4, 8}, src, dst), kWorld8);
  EXPECT_EQ(groups_of(r, 0, CommKind::kAllReduce), (std::vector<std::vector<int>>{{0, 2}}));
  EXPECT_EQ(groups_of(r, 3, CommKind::kAllReduce), (std::vector<std::vector<int>>{{1, 3}}));
}

TEST(ResolveBottom, ReduceScatter) {
  Resolution r =
      resolve_and_check(spec({4, 6}, ann({sg({0, 1}, {{PART, 2}})}), ann({sg({0, 1}, {{S0, 2}})})), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kReduceScatter);
  const CommOp op = ops_of(r, 1)[0];
  EXPECT_EQ(op.pieces[1], (Box{{2, 0}, {4, 6}}));
}

TEST(ResolveBottom, AllGather) {
  Resolution r =
      resolve_and_check(spec({4, 6}, ann({sg({0, 1, 2, 3}, {{S1, 2}, {DUP, 2}}, {DUP, S1})}),
                              ann({sg({0, 1, 2, 3}, {{DUP, 4}})})),
                        kWorld8);
  EXPECT_EQ(r.kind, CommKind::kAllGather);
  EXPECT_EQ(groups_of(r, 2, CommKind::kAllGather), (std::vector<std::vector<int>>{{2, 3}}));
}

TEST(ResolveBottom, PartialToSplitWithCopiesTakesTwoPhases) {
  Resolution r = resolve_and_check(
      spec({8, 2}, ann({sg({0, 1, 2, 3}, {{PART, 4}})}), ann({sg({0, 1, 2, 3}, {{S0, 2}, {DUP, 2}}, {S0, DUP})})),
      kWorld8);
  EXPECT_EQ(r.kind, CommKind::kAllReduce);
  EXPECT_EQ(r.ranks.at(0).phases.size(), 2u);
  EXPECT_EQ(r.ranks.at(0).phases[1].ops[0].kind, CommKind::kLocalSlice);
}

TEST(ResolveBottom, PartialStaysPartialWhileGathering) {
  Annotation src = ann({sg({0, 1, 2, 3}, {{PART, 2}, {S0, 2}}, {PART, S0})});
  Annotation dst = ann({sg({0, 1, 2, 3}, {{PART, 2}, {DUP, 2}}, {PART, DUP})});
  Resolution r = resolve_and_check(spec({4, 2}, src, dst), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kAllGather);
}

TEST(ResolveBottom, AllToAllFallsBackToBsrInsideTheSubgroup) {
  Resolution r =
      resolve_and_check(spec({4, 6}, ann({sg({0, 1}, {{S0, 2}})}), ann({sg({0, 1}, {{S1, 2}})})), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kBsr);
  EXPECT_EQ(r.tier, "bottom");
  EXPECT_EQ(r.total_bytes, 2 * 2 * 3 * 4);
}

TEST(ResolveBottom, SubgroupsResolveIndependently) {
  Annotation src = ann({sg({0, 1}, {{PART, 2}}), sg({2, 3}, {{S1, 2}}), sg({4}), sg({5, 6}, {{S1, 2}})}, 0);
  Annotation dst = ann({sg({0, 1}, {{S1, 2}}), sg({2, 3}, {{DUP, 2}}), sg({7}), sg({6, 5}, {{S1, 2}})}, 0);
  Resolution r = resolve_and_check(spec({8, 4}, src, dst), kWorld8);
  EXPECT_EQ(ops_of(r, 0)[0].kind, CommKind::kReduceScatter);
  EXPECT_EQ(ops_of(r, 2)[0].kind, CommKind::kAllGather);
  EXPECT_EQ(r.ranks.at(7).kind, CommKind::kRecv);
  EXPECT_EQ(r.tier, "bottom");
}

TEST(ResolveBottom, OtherDevicesAndStatesUseBsrInsideTheSubgroup) {
  Resolution r =
      resolve_and_check(spec({4, 4}, ann({sg({0, 1}, {{S0, 2}})}), ann({sg({2, 3, 4, 5}, {{S1, 4}})})), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kBsr);
}

TEST(ResolveBottom, TopTierPartialTermsMoveWithTheirSubgroups) {
  Annotation src = ann({sg({0}), sg({1, 2}, {{S0, 2}})}, PART);
  Annotation dst = ann({sg({3}), sg({4, 5}, {{S1, 2}})}, PART);
  Resolution r = resolve_and_check(spec({4, 4}, src, dst), kWorld8);
  EXPECT_EQ(r.ranks.at(3).kind, CommKind::kRecv);  // subgroup 0: pairwise
  EXPECT_EQ(ops_of(r, 3)[0].recvs[0].peer, 0);
  EXPECT_EQ(r.ranks.at(4).kind, CommKind::kBsr);   // subgroup 1: BSR among its own ranks
  EXPECT_EQ(r.kind, CommKind::kBsr);
  EXPECT_EQ(r.tier, "bottom");
}

// ---- top tier --------------------------------------------------------------

TEST(ResolveTop, SplitAllReduceOverQuartersWithDifferentTpDegrees) {
  Annotation src = ann({sg({0, 1}, {{S0, 2}}), sg({2, 3, 4, 5}, {{S0, 4}})}, PART);
  Annotation dst = ann({sg({0, 1}, {{S0, 2}}), sg({2, 3, 4, 5}, {{S0, 4}})}, DUP);
  Resolution r = resolve_and_check(spec({8, 3}, src, dst), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kSplitAllReduce);
  EXPECT_EQ(r.tier, "top");
  EXPECT_EQ(groups_of(r, 0, CommKind::kSplitAllReduce), (std::vector<std::vector<int>>{{0, 2}, {0, 3}}));
  EXPECT_EQ(groups_of(r, 1, CommKind::kSplitAllReduce), (std::vector<std::vector<int>>{{1, 4}, {1, 5}}));
  EXPECT_EQ(ops_of(r, 4)[0].box, (Box{{4, 0}, {6, 3}}));
}

TEST(ResolveTop, SplitAllReduceWithUnevenCopiesUsesOneGroup) {
  Annotation src = ann({sg({0, 1}, {{DUP, 2}}), sg({2})}, PART);
  Annotation dst = ann({sg({0, 1}, {{DUP, 2}}), sg({2})}, DUP);
  Resolution r = resolve_and_check(spec({5}, src, dst), kWorld8);
  const CommOp op = ops_of(r, 1)[0];
  EXPECT_EQ(op.group, (std::vector<int>{0, 1, 2}));
  EXPECT_FALSE(op.contributes);
  EXPECT_TRUE(ops_of(r, 0)[0].contributes);
}

TEST(ResolveTop, SplitAllReduceAfterBottomAlignment) {
  Annotation src = ann({sg({0, 1}, {{PART, 2}}), sg({2, 3}, {{S0, 2}})}, PART);
  Annotation dst = ann({sg({0, 1}, {{S0, 2}}), sg({2, 3}, {{S0, 2}})}, DUP);
  Resolution r = resolve_and_check(spec({4, 2}, src, dst), kWorld8);
  EXPECT_EQ(r.ranks.at(0).phases.size(), 2u);
  EXPECT_EQ(r.ranks.at(0).phases[0].ops[0].kind, CommKind::kReduceScatter);
  EXPECT_EQ(r.ranks.at(0).phases[1].ops[0].kind, CommKind::kSplitAllReduce);
}

TEST(ResolveTop, SplitReduceScatter) {
  Annotation src = ann({sg({0, 1}, {{S1, 2}}), sg({2, 3, 4, 5}, {{S1, 4}})}, PART);
  Annotation dst = ann({sg({0, 1}, {{S1, 2}}), sg({2, 3, 4, 5}, {{S1, 4}})}, 0);
  Resolution r = resolve_and_check(spec({4, 8}, src, dst), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kSplitReduceScatter);
  const std::vector<CommOp> ops = ops_of(r, 3);
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].group, (std::vector<int>{0, 3}));
  EXPECT_EQ(ops[0].box, (Box{{0, 2}, {4, 4}}));
  EXPECT_EQ(ops[0].pieces, (std::vector<Box>{{{0, 2}, {2, 4}}, {{2, 2}, {4, 4}}}));
}

TEST(ResolveTop, SplitAllGatherWithWeights) {
  Annotation src = ann({sg({0, 1}, {{S1, 2}}), sg({2, 3, 4, 5}, {{S1, 4}})}, 0, {1, 3});
  Annotation dst = ann({sg({0, 1}, {{S1, 2}}), sg({2, 3, 4, 5}, {{S1, 4}})}, DUP);
  Resolution r = resolve_and_check(spec({8, 8}, src, dst), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kSplitAllGather);
  EXPECT_EQ(groups_of(r, 1, CommKind::kSplitAllGather), (std::vector<std::vector<int>>{{1, 4}, {1, 5}}));
}

TEST(ResolveTop, DupToSplitKeepsEachPart) {
  Annotation src = ann({sg({0, 1}, {{S1, 2}}), sg({2, 3}, {{DUP, 2}})}, DUP);
  Annotation dst = ann({sg({0, 1}, {{S1, 2}}), sg({2, 3}, {{S0, 2}})}, 0, {1, 1});
  Resolution r = resolve_and_check(spec({4, 4}, src, dst), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kLocalSlice);
  EXPECT_EQ(r.tier, "top");
  EXPECT_EQ(r.total_bytes, 0);
}

TEST(ResolveTop, SplitMovingToAnotherDimFallsBackToBsr) {
  Annotation src = ann({sg({0}), sg({1})}, 0);
  Annotation dst = ann({sg({0}), sg({1})}, 1);
  Resolution r = resolve_and_check(spec({4, 4}, src, dst), kWorld8);
  EXPECT_EQ(r.tier, "bsr");
  EXPECT_EQ(r.kind, CommKind::kBsr);
}

// ---- BSR -------------------------------------------------------------------

TEST(ResolveBsr, PrefersTheFastestLink) {
  const Topology two_nodes = Topology::uniform(8, 4);
  Annotation src = ann({sg({0}), sg({4})}, DUP);
  Resolution r = resolve_and_check(spec({4, 4}, src, ann({sg({5})})), two_nodes);
  EXPECT_EQ(r.tier, "bsr");
  EXPECT_EQ(r.kind, CommKind::kSend);
  EXPECT_EQ(r.ranks.at(4).bytes_sent, 64);
  EXPECT_EQ(r.ranks.at(0).bytes_sent, 0);
}

TEST(ResolveBsr, BalancesBytesBetweenEqualLinks) {
  Annotation src = ann({sg({0}), sg({1})}, DUP);
  Resolution r = resolve_and_check(spec({8, 2}, src, ann({sg({2, 3, 4, 5}, {{S0, 4}})})), kWorld8);
  EXPECT_EQ(r.kind, CommKind::kBsr);
  EXPECT_EQ(r.ranks.at(0).bytes_sent, 2 * 2 * 2 * 4);
  EXPECT_EQ(r.ranks.at(1).bytes_sent, 2 * 2 * 2 * 4);
}

TEST(ResolveBsr, MergesOnePairIntoOneMessage) {
  // Rank 5 needs four quarters; the owner on its node (rank 4) sends all of them in one box.
  const Topology two_nodes = Topology::uniform(8, 4);
  Annotation src = ann({sg({4}), sg({0, 1, 2, 3}, {{S0, 4}})}, DUP);
  Resolution r = resolve_and_check(spec({8, 2}, src, ann({sg({5})})), two_nodes);
  const std::vector<CommOp> ops = ops_of(r, 4);
  ASSERT_EQ(ops.size(), 1u);
  ASSERT_EQ(ops[0].sends.size(), 1u);
  EXPECT_EQ(ops[0].sends[0].boxes, (std::vector<Box>{{{0, 0}, {8, 2}}}));
  EXPECT_EQ(r.ranks.at(0).phases[0].ops.size(), 0u);  // dropped without sending
}

TEST(ResolveBsr, NothingMovesButBoxesShrink) {
  Annotation src = ann({sg({0}), sg({1})}, DUP);
  Annotation dst = ann({sg({0}), sg({1}), sg({2})}, 0);
  Resolution r = resolve_and_check(spec({6}, src, dst), kWorld8);
  EXPECT_EQ(r.ranks.at(1).kind, CommKind::kLocalSlice);
  EXPECT_EQ(r.ranks.at(2).kind, CommKind::kRecv);
}

// ---- errors ----------------------------------------------------------------

TEST(ResolveErrors, PartialWithoutRule) {
  expect_unsupported(spec({4, 4}, ann({sg({0, 1, 2, 3}, {{PART, 2}, {DUP, 2}})}), ann({sg({4, 5}, {{S0, 2}})})),
                     "changes its devices and holds both partial sums and copies");
  expect_unsupported(spec({4, 4}, ann({sg({0}), sg({1})}, PART), ann({sg({0, 1}, {{DUP, 2}})})),
                     "hsize changes from 2 to 1");
  expect_unsupported(spec({4, 4}, ann({sg({0}), sg({1})}, DUP), ann({sg({0}), sg({1})}, PART)),
                     "the destination is partial across subgroups");
}

// A non-partial value into partial states (a parameter's gradient from one
// use joining its partial gradients from others): the ranks of partial
// coordinate 0 receive it, the others hold zeros, and the terms add up.
TEST(ResolvePartial, WholeValueBecomesOnePartialTerm) {
  const Resolution same = resolve_and_check(
      spec({4, 4}, ann({sg({0, 1}, {{DUP, 2}})}), ann({sg({0, 1}, {{PART, 2}})})), kWorld8);
  EXPECT_EQ(same.total_bytes, 0);
  ASSERT_EQ(same.ranks.at(1).phases.size(), 1u);
  EXPECT_TRUE(same.ranks.at(1).phases[0].zero_fill);
  EXPECT_TRUE(same.ranks.at(0).phases.empty());  // keeps its copy
  // Other devices, a split kept: [4, 5] row halves -> partial 2 x row halves
  // on [0..3] (the tied LM head's gradient back to a cp x tp first stage).
  const Resolution moved = resolve_and_check(
      spec({4, 4}, ann({sg({4, 5}, {{S0, 2}})}), ann({sg({0, 1, 2, 3}, {{PART, 2}, {S0, 2}}, {PART, S0})})),
      kWorld8);
  EXPECT_EQ(moved.total_bytes, 64);  // each row half once, to partial coordinate 0
  for (int r : {2, 3}) {
    ASSERT_EQ(moved.ranks.at(r).phases.size(), 1u);
    EXPECT_TRUE(moved.ranks.at(r).phases[0].zero_fill);
    EXPECT_TRUE(moved.ranks.at(r).phases[0].ops.empty());
  }
}

// Partial sums that move to other devices are reduced inside their subgroup
// first (phase 0), then moved (phase 1): e.g. a tied LM head's partial
// gradient on a cp stage going back to the embedding's stage.
TEST(ResolvePartial, PartialSumsReduceBeforeTheyMove) {
  const Resolution r = resolve_and_check(
      spec({4, 4}, ann({sg({0, 1}, {{PART, 2}})}), ann({sg({2, 3}, {{S0, 2}})})), kWorld8);
  ASSERT_EQ(r.ranks.at(0).phases.size(), 2u);
  EXPECT_EQ(r.ranks.at(0).phases[0].ops.at(0).kind, CommKind::kAllReduce);
  EXPECT_EQ(r.ranks.at(2).phases.size(), 1u);
  // Into partial terms on other devices: reduce, then place on coordinate 0.
  resolve_and_check(spec({4, 4}, ann({sg({4, 5}, {{PART, 2}})}),
                         ann({sg({0, 1, 2, 3}, {{PART, 2}, {S0, 2}}, {PART, S0})})),
                    kWorld8);
}

TEST(ResolveErrors, ShapesAndRanks) {
  expect_unsupported(spec({3, 4}, ann({sg({0, 1}, {{S0, 2}})}), ann({sg({0, 1}, {{DUP, 2}})})),
                     "source annotation: subgroup 0: split(0): 2 does not divide size 3");
  expect_unsupported(spec({4, 4}, ann({sg({0, 1}, {{S0, 2}})}), ann({sg({0, 9}, {{DUP, 2}})})),
                     "destination annotation: subgroup 0: rank 9 is outside the world [0, 8)");
  expect_unsupported(spec({4, 4}, ann({sg({0}), sg({1})}, 0, {1, 2}), ann({sg({0, 1}, {{DUP, 2}})})),
                     "does not split in the proportions");
}

// ---- reports and scale -----------------------------------------------------

TEST(ResolveReport, Json) {
  Resolution r = resolve(spec({4, 6}, ann({sg({0, 1}, {{PART, 2}})}), ann({sg({0, 1}, {{DUP, 2}})}), "g"), kWorld8);
  nlohmann::json j = to_json(r);
  EXPECT_EQ(j["name"], "g");
  EXPECT_EQ(j["kind"], "all_reduce");
  EXPECT_EQ(j["tier"], "bottom");
  EXPECT_EQ(j["total_bytes"], r.total_bytes);
  ASSERT_EQ(j["ranks"].size(), 2u);
  EXPECT_EQ(j["ranks"][1]["ops"][0]["group"], nlohmann::json({0, 1}));
  nlohmann::json one = to_json(r, 1);
  ASSERT_EQ(one["ranks"].size(), 1u);
  EXPECT_EQ(one["ranks"][0]["rank"], 1);
  Resolution s = resolve(spec({4}, ann({sg({0})}), ann({sg({1})}), "p"), kWorld8);
  EXPECT_EQ(to_json(s, 1)["ranks"][0]["ops"][0]["peers"], nlohmann::json({0}));
  EXPECT_EQ(kind_name(CommKind::kSplitReduceScatter), "split_reduce_scatter");
}

TEST(ResolveScale, SixtyFourRanks) {
  const Topology world = Topology::uniform(64, 8);
  std::vector<Subgroup> tp_groups, dp_split;
  for (int g = 0; g < 8; ++g) {
    std::vector<int> ranks;
    for (int i = 0; i < 8; ++i) ranks.push_back(8 * g + i);
    tp_groups.push_back(sg(ranks, {{S1, 8}}));
  }
  std::vector<int> all;
  for (int r = 0; r < 64; ++r) all.push_back(r);
  const Shape shape{1024, 4096};
  Resolution ar = resolve(spec(shape, ann(tp_groups, PART), ann(tp_groups, DUP)), world);
  EXPECT_EQ(ar.kind, CommKind::kSplitAllReduce);
  EXPECT_EQ(ops_of(ar, 63).size(), 1u);
  Resolution bsr = resolve(spec(shape, ann(tp_groups, 0), ann({sg(all, {{S1, 64}})})), world);
  EXPECT_EQ(bsr.ranks.size(), 64u);
  Resolution rs = resolve(spec(shape, ann({sg(all, {{PART, 64}})}), ann({sg(all, {{S0, 64}})})), world);
  EXPECT_EQ(rs.kind, CommKind::kReduceScatter);
}

}  // namespace
}  // namespace hspmd

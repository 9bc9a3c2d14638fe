// The simulator and the shard helpers, including the inconsistencies the
// simulator must catch.
#include <gtest/gtest.h>

#include "hspmd/core/error.h"
#include "resolve/resolve_test_util.h"

namespace hspmd {
namespace {

using namespace hspmd::testing;

const Topology kWorld8 = Topology::uniform(8, 8);

TEST(Shards, PartialTermsAddUpAndCopiesAgree) {
  const NDArray global = iota({4, 2});
  Annotation a = ann({sg({0, 1, 2, 3}, {{PART, 2}, {DUP, 2}}, {PART, DUP})});
  std::map<int, NDArray> shards = make_shards(global, a, 3);
  ASSERT_EQ(shards.size(), 4u);
  EXPECT_EQ(shards[0].to_vector(), shards[1].to_vector());  // dup copies of term 0
  std::vector<float> t0 = shards[0].to_vector(), t1 = shards[2].to_vector(), g = global.to_vector();
  EXPECT_NE(t0, g);
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(t0[i] + t1[i], g[i]);
  EXPECT_EQ(check_shards(global, a, shards), "");
}

TEST(Shards, TopTierPartialAndParts) {
  const NDArray global = iota({6, 2});
  Annotation partial = ann({sg({0}), sg({1, 2}, {{S0, 2}})}, PART);
  EXPECT_EQ(check_shards(global, partial, make_shards(global, partial, 1)), "");
  Annotation parts = ann({sg({0}), sg({1, 2}, {{S0, 2}})}, 0, {2, 4});
  std::map<int, NDArray> shards = make_shards(global, parts, 1);
  EXPECT_EQ(shards[2].shape(), (Shape{2, 2}));
  EXPECT_EQ(shards[2].to_vector()[0], global.to_vector()[8]);
  EXPECT_EQ(check_shards(global, parts, shards), "");
}

TEST(Shards, CheckNamesTheFirstMismatch) {
  const NDArray global = iota({4, 2});
  Annotation a = ann({sg({0, 1}, {{S0, 2}})});
  std::map<int, NDArray> shards = make_shards(global, a, 0);
  shards[1].data<float>()[3] += 1;
  EXPECT_EQ(check_shards(global, a, shards), "rank 1: element [3, 1] is -117, expected -118");
  shards.erase(1);
  EXPECT_EQ(check_shards(global, a, shards), "rank 1: missing");
  std::map<int, NDArray> extra = make_shards(global, a, 0);
  extra[5] = iota({1});
  EXPECT_NE(check_shards(global, a, extra).find("rank 5: holds a buffer"), std::string::npos);
  Annotation p = ann({sg({0, 1}, {{PART, 2}})});
  std::map<int, NDArray> terms = make_shards(global, p, 0);
  terms[0].data<float>()[0] += 1;
  EXPECT_NE(check_shards(global, p, terms), "");
  EXPECT_THROW(make_shards(global.to(DType::BF16), a, 0), Error);
}

Resolution all_gather() {
  return resolve(spec({4, 2}, ann({sg({0, 1}, {{S0, 2}})}), ann({sg({0, 1}, {{DUP, 2}})})), kWorld8);
}

std::map<int, NDArray> inputs_of(const Annotation& a) { return make_shards(iota({4, 2}), a, 0); }

TEST(Simulate, RunsAndChecks) {
  Annotation src = ann({sg({0, 1}, {{S0, 2}})});
  std::map<int, NDArray> out = simulate(all_gather(), inputs_of(src));
  EXPECT_EQ(check_shards(iota({4, 2}), ann({sg({0, 1}, {{DUP, 2}})}), out), "");
}

TEST(Simulate, CatchesDisagreeingMembers) {
  Resolution r = all_gather();
  r.ranks.at(1).phases[0].ops[0].box = Box{{0, 0}, {4, 1}};
  EXPECT_THROW(simulate(r, inputs_of(ann({sg({0, 1}, {{S0, 2}})}))), InternalError);
}

TEST(Simulate, CatchesAMissingPartner) {
  Resolution r = all_gather();
  r.ranks.at(1).phases[0].ops[0].group = {1};
  r.ranks.at(1).phases[0].ops[0].pieces = {Box{{2, 0}, {4, 2}}};
  EXPECT_THROW(simulate(r, inputs_of(ann({sg({0, 1}, {{S0, 2}})}))), InternalError);
}

TEST(Simulate, CatchesUnwrittenAndOutOfBoxWrites) {
  Annotation src = ann({sg({0})});
  Resolution r = resolve(spec({4, 2}, src, ann({sg({1})})), kWorld8);
  Resolution partial = r;
  partial.ranks.at(1).phases[0].ops[0].recvs[0].boxes = {Box{{0, 0}, {2, 2}}};
  partial.ranks.at(0).phases[0].ops[0].sends[0].boxes = {Box{{0, 0}, {2, 2}}};
  EXPECT_THROW(simulate(partial, inputs_of(src)), InternalError);
  Resolution mismatched = r;
  mismatched.ranks.at(1).phases[0].ops[0].recvs[0].boxes = {Box{{0, 0}, {2, 2}}};
  EXPECT_THROW(simulate(mismatched, inputs_of(src)), InternalError);
  Resolution outside = r;
  outside.ranks.at(1).phases[0].out_box = Box{{0, 0}, {2, 2}};
  EXPECT_THROW(simulate(outside, inputs_of(src)), InternalError);
  Resolution wrong_in = r;
  wrong_in.ranks.at(0).phases[0].in_box = Box{{0, 0}, {2, 2}};
  EXPECT_THROW(simulate(wrong_in, inputs_of(src)), InternalError);
}

TEST(Simulate, UnreceivedMessageIsAnError) {
  Annotation src = ann({sg({0})});
  Resolution r = resolve(spec({4, 2}, src, ann({sg({1})})), kWorld8);
  r.ranks.at(1).phases[0].ops[0].recvs.clear();
  EXPECT_THROW(simulate(r, inputs_of(src)), InternalError);
}

}  // namespace
}  // namespace hspmd

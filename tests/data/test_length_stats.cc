#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/data/length_stats.h"

namespace hspmd {
namespace {

template <typename F>
void expect_error(F&& f, const std::string& message) {
  try {
    f();
    FAIL() << "no error; expected: " << message;
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

TEST(DocumentLengths, CutAfterEachEosAndKeepTheTail) {
  const uint32_t eos = 9;
  EXPECT_EQ(document_lengths({1, 2, 9, 3, 9, 9, 4, 5}, eos), (std::vector<int64_t>{3, 2, 1, 2}));
  EXPECT_EQ(document_lengths({1, 2, 9}, eos), (std::vector<int64_t>{3}));
  EXPECT_EQ(document_lengths({1, 2, 3}, eos), (std::vector<int64_t>{3}));  // no eos: one document
  EXPECT_TRUE(document_lengths({}, eos).empty());
}

TEST(LengthStats, NearestRankPercentiles) {
  std::vector<int64_t> sorted;
  for (int i = 1; i <= 100; ++i) sorted.push_back(i);
  EXPECT_EQ(nearest_rank_percentile(sorted, 50), 50);
  EXPECT_EQ(nearest_rank_percentile(sorted, 97), 97);
  EXPECT_EQ(nearest_rank_percentile(sorted, 100), 100);
  EXPECT_EQ(nearest_rank_percentile({4, 8, 15}, 50), 8);  // rank ceil(1.5) = 2
  EXPECT_EQ(nearest_rank_percentile({4, 8, 15}, 90), 15);
  EXPECT_EQ(nearest_rank_percentile({7}, 1), 7);
  EXPECT_THROW(nearest_rank_percentile({}, 50), InternalError);
  EXPECT_THROW(nearest_rank_percentile({1}, 0), InternalError);
}

TEST(LengthStats, SummaryAndPowersOfTwoHistogram) {
  const LengthStats s = length_stats({1, 2, 3, 4, 5, 100}, {}, "x.bin");
  EXPECT_EQ(s.documents, 6);
  EXPECT_EQ(s.tokens, 115);
  EXPECT_EQ(s.p50, 3);
  EXPECT_EQ(s.p90, 100);
  EXPECT_EQ(s.max, 100);
  EXPECT_DOUBLE_EQ(s.mean, 115.0 / 6);
  ASSERT_EQ(s.histogram.size(), 8u);  // (0,1] (1,2] (2,4] (4,8] ... (64,128]
  EXPECT_EQ(s.histogram[0].lo, 0);
  EXPECT_EQ(s.histogram[0].hi, 1);
  EXPECT_EQ(s.histogram[2].lo, 2);
  EXPECT_EQ(s.histogram[2].hi, 4);
  EXPECT_EQ(s.histogram[2].count, 2);  // 3 and 4
  EXPECT_EQ(s.histogram[2].tokens, 7);
  EXPECT_EQ(s.histogram[3].count, 1);  // 5
  EXPECT_EQ(s.histogram[5].count, 0);  // (16, 32] is empty but kept
  EXPECT_EQ(s.histogram[7].count, 1);  // 100 in (64, 128]
  EXPECT_TRUE(s.pieces.empty());
  const LengthStats t = length_stats({700, 40}, {}, "x.bin");
  ASSERT_EQ(t.histogram.size(), 5u);  // (32, 64] to (512, 1024]
  EXPECT_EQ(t.histogram.front().lo, 32);
  EXPECT_EQ(t.histogram.back().hi, 1024);
}

TEST(LengthStats, PiecesAndTheirIntervals) {
  // L = 64: intervals (0,4] (4,8] (8,16] (16,32] (32,64].
  const LengthStats s = length_stats({3, 20, 64, 150}, {64}, "x.bin");
  ASSERT_EQ(s.pieces.size(), 1u);
  const PieceStats& p = s.pieces[0];
  EXPECT_EQ(p.max_seq_len, 64);
  EXPECT_EQ(p.cut_documents, 1);  // 150 -> 64 + 64 + 22
  EXPECT_EQ(p.pieces, 6);
  ASSERT_EQ(p.intervals.size(), 5u);
  EXPECT_EQ(p.intervals[0].lo, 0);
  EXPECT_EQ(p.intervals[0].hi, 4);
  EXPECT_EQ(p.intervals[0].count, 1);
  EXPECT_EQ(p.intervals[3].count, 2);  // 20 and 22
  EXPECT_EQ(p.intervals[3].tokens, 42);
  EXPECT_EQ(p.intervals[4].lo, 32);
  EXPECT_EQ(p.intervals[4].hi, 64);
  EXPECT_EQ(p.intervals[4].count, 3);  // a piece of exactly L is in (L/2, L]
  int64_t tokens = 0;
  for (const LengthBin& b : p.intervals) tokens += b.tokens;
  EXPECT_EQ(tokens, s.tokens);
}

TEST(LengthStats, SmallMaxSeqLenDropsEmptyIntervals) {
  const LengthStats s = length_stats({1, 5}, {4, 1}, "x.bin");
  ASSERT_EQ(s.pieces.size(), 2u);
  ASSERT_EQ(s.pieces[0].intervals.size(), 3u);  // L/16 = L/8 = 0: (0,1] (1,2] (2,4]
  EXPECT_EQ(s.pieces[0].intervals[2].count, 1);  // 5 -> 4 + 1
  EXPECT_EQ(s.pieces[0].intervals[0].count, 2);
  ASSERT_EQ(s.pieces[1].intervals.size(), 1u);
  EXPECT_EQ(s.pieces[1].pieces, 6);
  EXPECT_EQ(s.pieces[1].cut_documents, 1);
}

TEST(LengthStats, Errors) {
  expect_error([] { length_stats({}, {}, "e.bin"); }, "[data] e.bin: no documents");
  expect_error([] { length_stats({3, 0}, {}, "e.bin"); },
               "[data] e.bin: a document length of 0 tokens is not positive");
  expect_error([] { length_stats({3}, {8, -2}, "e.bin"); }, "[data] e.bin: max_seq_len -2 must be positive");
}

TEST(LengthStats, JsonHoldsEveryFigure) {
  const nlohmann::json j = to_json(length_stats({2, 6, 8}, {4}, "x.bin"));
  EXPECT_EQ(j["documents"], 3);
  EXPECT_EQ(j["tokens"], 16);
  EXPECT_EQ(j["document_length"]["p50"], 6);
  EXPECT_EQ(j["histogram"].size(), 3u);  // from (1, 2], the shortest document's bin
  EXPECT_EQ(j["histogram"][0]["lo"], 1);
  EXPECT_EQ(j["histogram"][2]["documents"], 2);
  EXPECT_DOUBLE_EQ(j["histogram"][2]["token_share"].get<double>(), 14.0 / 16);
  EXPECT_DOUBLE_EQ(j["histogram"][2]["document_share"].get<double>(), 2.0 / 3);
  const nlohmann::json& p = j["pieces"][0];
  EXPECT_EQ(p["max_seq_len"], 4);
  EXPECT_EQ(p["pieces"], 5);  // 2 | 4 2 | 4 4
  EXPECT_EQ(p["cut_documents"], 2);
  EXPECT_DOUBLE_EQ(p["intervals"].back()["piece_share"].get<double>(), 3.0 / 5);
}

TEST(LengthStats, SvgIsOneEscapedImageWithABarPerNonEmptyShare) {
  const std::string svg = histogram_svg(length_stats({2, 6, 8}, {16}, "x.bin"), "a<b & c");
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  EXPECT_NE(svg.find("a&lt;b &amp; c"), std::string::npos);
  EXPECT_EQ(svg.find("a<b"), std::string::npos);
  EXPECT_NE(svg.find("L=16"), std::string::npos);
  size_t rects = 0;
  for (size_t at = svg.find("<rect"); at != std::string::npos; at = svg.find("<rect", at + 1)) ++rects;
  EXPECT_EQ(rects, 1u + 4u + 2u);  // background, two bins x two shares, legend
}

}  // namespace
}  // namespace hspmd

#include "hspmd/data/length_stats.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "hspmd/core/error.h"

namespace hspmd {
namespace {

// Index of the powers-of-two bin holding `length` >= 1: 0 for (0, 1], k for (2^(k-1), 2^k].
int bin_index(int64_t length) {
  return static_cast<int>(std::bit_width(static_cast<uint64_t>(length - 1)));
}

std::vector<LengthBin> power_of_two_bins(const std::vector<int64_t>& lengths, int64_t shortest, int64_t longest) {
  const int first = bin_index(shortest);
  std::vector<LengthBin> bins(bin_index(longest) - first + 1);
  for (size_t k = 0; k < bins.size(); ++k) {
    bins[k].hi = int64_t{1} << (first + static_cast<int>(k));
    bins[k].lo = bins[k].hi == 1 ? 0 : bins[k].hi / 2;
  }
  for (int64_t n : lengths) {
    LengthBin& b = bins[bin_index(n) - first];
    ++b.count;
    b.tokens += n;
  }
  return bins;
}

// (0, L/16], (L/16, L/8], ..., (L/2, L], dropping intervals that rounding empties.
std::vector<LengthBin> piece_intervals(int64_t max_seq_len) {
  std::vector<LengthBin> intervals;
  int64_t lo = 0;
  for (int shift = 4; shift >= 0; --shift) {
    const int64_t hi = max_seq_len >> shift;
    if (hi <= lo) continue;
    intervals.push_back({lo, hi, 0, 0});
    lo = hi;
  }
  return intervals;
}

void add_piece(std::vector<LengthBin>& intervals, int64_t length) {
  for (LengthBin& b : intervals)
    if (length <= b.hi) {
      ++b.count;
      b.tokens += length;
      return;
    }
  HSPMD_CHECK(false, "piece of ", length, " tokens is longer than the last interval");
}

PieceStats cut_into_pieces(const std::vector<int64_t>& lengths, int64_t max_seq_len) {
  PieceStats s;
  s.max_seq_len = max_seq_len;
  s.intervals = piece_intervals(max_seq_len);
  for (int64_t n : lengths) {
    if (n > max_seq_len) ++s.cut_documents;
    for (int64_t left = n; left > 0; left -= max_seq_len) {
      add_piece(s.intervals, std::min(left, max_seq_len));
      ++s.pieces;
    }
  }
  return s;
}

double share(int64_t part, int64_t whole) {
  return whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

nlohmann::json bin_json(const LengthBin& b, const char* count_name, const char* share_name, int64_t count_total,
                        int64_t token_total) {
  return {{"lo", b.lo},
          {"hi", b.hi},
          {count_name, b.count},
          {"tokens", b.tokens},
          {share_name, share(b.count, count_total)},
          {"token_share", share(b.tokens, token_total)}};
}

}  // namespace

std::vector<int64_t> document_lengths(const std::vector<uint32_t>& tokens, uint32_t eos_token_id) {
  std::vector<int64_t> lengths;
  int64_t start = 0;
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] == eos_token_id || i + 1 == n) {
      lengths.push_back(i + 1 - start);
      start = i + 1;
    }
  return lengths;
}

int64_t nearest_rank_percentile(const std::vector<int64_t>& sorted, int percent) {
  HSPMD_CHECK(!sorted.empty() && percent > 0 && percent <= 100);
  const int64_t n = static_cast<int64_t>(sorted.size());
  const int64_t rank = (percent * n + 99) / 100;  // ceil(percent / 100 * n), exact in integers
  return sorted[rank - 1];
}

LengthStats length_stats(const std::vector<int64_t>& lengths, const std::vector<int64_t>& max_seq_lens,
                         const std::string& source) {
  if (lengths.empty()) fail("[data] ", source, ": no documents");
  for (int64_t n : lengths)
    if (n <= 0) fail("[data] ", source, ": a document length of ", n, " tokens is not positive");
  for (int64_t L : max_seq_lens)
    if (L <= 0) fail("[data] ", source, ": max_seq_len ", L, " must be positive");
  std::vector<int64_t> sorted = lengths;
  std::sort(sorted.begin(), sorted.end());
  LengthStats s;
  s.documents = static_cast<int64_t>(sorted.size());
  s.tokens = std::accumulate(sorted.begin(), sorted.end(), int64_t{0});
  s.p50 = nearest_rank_percentile(sorted, 50);
  s.p90 = nearest_rank_percentile(sorted, 90);
  s.p97 = nearest_rank_percentile(sorted, 97);
  s.p99 = nearest_rank_percentile(sorted, 99);
  s.max = sorted.back();
  s.mean = static_cast<double>(s.tokens) / static_cast<double>(s.documents);
  s.histogram = power_of_two_bins(sorted, sorted.front(), s.max);
  for (int64_t L : max_seq_lens) s.pieces.push_back(cut_into_pieces(sorted, L));
  return s;
}

nlohmann::json to_json(const LengthStats& s) {
  nlohmann::json j = {{"documents", s.documents},
                      {"tokens", s.tokens},
                      {"document_length",
                       {{"p50", s.p50}, {"p90", s.p90}, {"p97", s.p97}, {"p99", s.p99}, {"max", s.max},
                        {"mean", s.mean}}},
                      {"histogram", nlohmann::json::array()},
                      {"pieces", nlohmann::json::array()}};
  for (const LengthBin& b : s.histogram)
    j["histogram"].push_back(bin_json(b, "documents", "document_share", s.documents, s.tokens));
  for (const PieceStats& p : s.pieces) {
    nlohmann::json intervals = nlohmann::json::array();
    for (const LengthBin& b : p.intervals) intervals.push_back(bin_json(b, "pieces", "piece_share", p.pieces, s.tokens));
    j["pieces"].push_back({{"max_seq_len", p.max_seq_len},
                           {"pieces", p.pieces},
                           {"cut_documents", p.cut_documents},
                           {"intervals", intervals}});
  }
  return j;
}

}  // namespace hspmd

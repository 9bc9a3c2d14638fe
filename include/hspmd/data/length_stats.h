// Document-length statistics of a token file (`hspmd data stats`,
// docs/data.md, "Document-length statistics").
//
// Documents are cut as packed-documents mode cuts them: after each eos token
// (the eos belongs to the document it ends); tokens after the last eos form a
// last document. With a maximum sequence length L, a document longer than L
// is cut into pieces of L tokens, the last one shorter, as
// `hspmd train --pack-documents --seq-len L` cuts it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace hspmd {

// Lengths in (lo, hi]: `count` documents (or pieces) holding `tokens` tokens.
struct LengthBin {
  int64_t lo = 0, hi = 0;
  int64_t count = 0;
  int64_t tokens = 0;
};

// Documents cut into pieces of at most max_seq_len tokens.
struct PieceStats {
  int64_t max_seq_len = 0;
  int64_t pieces = 0;
  int64_t cut_documents = 0;  // documents longer than max_seq_len
  // Piece lengths by interval: (0, L/16], (L/16, L/8], (L/8, L/4], (L/4, L/2],
  // (L/2, L], bounds rounded down; an interval that rounding empties is left
  // out, so a small L has fewer intervals.
  std::vector<LengthBin> intervals;
};

struct LengthStats {
  int64_t documents = 0;
  int64_t tokens = 0;
  // Document lengths in tokens; percentiles by nearest rank (see
  // nearest_rank_percentile).
  int64_t p50 = 0, p90 = 0, p97 = 0, p99 = 0, max = 0;
  double mean = 0;
  // Powers-of-two bins (0, 1], (1, 2], (2, 4], ..., (2^(k-1), 2^k], from the
  // bin holding the shortest document to the one holding the longest; empty
  // bins in between are kept.
  std::vector<LengthBin> histogram;
  std::vector<PieceStats> pieces;  // one per requested max_seq_len, in order
};

// Lengths of the documents of `tokens`, in file order. Empty for no tokens.
std::vector<int64_t> document_lengths(const std::vector<uint32_t>& tokens, uint32_t eos_token_id);

// The smallest value v of `sorted` (ascending, non-empty) such that at least
// `percent`% of the values are <= v. Throws hspmd::InternalError for an empty
// input or percent outside (0, 100].
int64_t nearest_rank_percentile(const std::vector<int64_t>& sorted, int percent);

// Statistics of `lengths` (any order). Throws hspmd::Error "[data] <source>:
// ..." when there is no document, a length is not positive, or a
// max_seq_len is not positive.
LengthStats length_stats(const std::vector<int64_t>& lengths, const std::vector<int64_t>& max_seq_lens,
                         const std::string& source);

// Every figure of `stats` as one JSON object (shares as fractions in [0, 1]).
nlohmann::json to_json(const LengthStats& stats);

// A self-contained SVG image: per powers-of-two bin, the share of documents
// and the share of tokens, with a dashed line at each max_seq_len. `title`
// is escaped. Throws hspmd::InternalError for stats without documents (not
// made by length_stats).
std::string histogram_svg(const LengthStats& stats, const std::string& title);

}  // namespace hspmd

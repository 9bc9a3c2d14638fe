#include "hspmd/data/token_data.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <filesystem>
#include <fstream>

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"
#include "hspmd/io/output_file.h"

namespace hspmd {

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian uint32 and are read with raw copies");

TokenData TokenData::load(const std::string& path, int64_t vocab_size) {
  if (vocab_size <= 0) fail("[data] ", path, ": vocab_size ", vocab_size, " must be positive");
  require_regular_file(path, "data");
  std::error_code ec;
  const uint64_t bytes = std::filesystem::file_size(path, ec);
  if (ec) fail("[data] ", path, ": cannot read the file size: ", ec.message());
  if (bytes == 0) fail("[data] ", path, ": file is empty");
  if (bytes % 4 != 0)
    fail("[data] ", path, ": size ", bytes, " bytes is not a multiple of 4 (uint32 token ids)");
  std::vector<uint32_t> tokens(bytes / 4);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(tokens.data()), static_cast<std::streamsize>(bytes));
  if (!in) fail("[data] ", path, ": cannot read file");
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= static_cast<uint64_t>(vocab_size))
      fail("[data] ", path, ": token id ", tokens[i], " at position ", i, " is >= vocab_size ", vocab_size);
  TokenData data(std::move(tokens));
  data.path_ = path;
  return data;
}

int64_t TokenData::num_samples(int64_t seq_len) const {
  const std::string& name = path_.empty() ? std::string("tokens") : path_;
  if (seq_len <= 0) fail("[data] ", name, ": seq_len ", seq_len, " must be positive");
  const int64_t n = size() > 0 ? (size() - 1) / seq_len : 0;
  if (n == 0)
    fail("[data] ", name, ": ", size(), " tokens are fewer than one sample of seq_len ", seq_len, " + 1");
  return n;
}

void TokenData::sample(int64_t index, int64_t seq_len, int32_t* inputs, int32_t* targets) const {
  const int64_t n = num_samples(seq_len);
  const int64_t i = ((index % n) + n) % n;
  const uint32_t* s = tokens_.data() + i * seq_len;
  for (int64_t t = 0; t < seq_len; ++t) {
    inputs[t] = static_cast<int32_t>(s[t]);
    targets[t] = static_cast<int32_t>(s[t + 1]);
  }
}

PackedDocuments::PackedDocuments(const TokenData& data, int64_t seq_len, int64_t eos_token_id)
    : data_(data), seq_len_(seq_len), eos_(static_cast<int32_t>(eos_token_id)) {
  const std::string& name = data.path_.empty() ? std::string("tokens") : data.path_;
  if (seq_len <= 0) fail("[data] ", name, ": seq_len ", seq_len, " must be positive");
  if (eos_token_id < 0 || eos_token_id > INT32_MAX)
    fail("[data] ", name, ": eos_token_id ", eos_token_id, " is not a valid token id");
  if (data.size() == 0) fail("[data] ", name, ": no tokens to pack");
  const std::vector<uint32_t>& t = data.tokens();
  int64_t used = seq_len;  // tokens in the current sequence; full: the first piece opens one
  auto add_piece = [&](int64_t begin, int64_t size) {
    if (used + size > seq_len) {
      first_piece_.push_back(static_cast<int64_t>(pieces_.size()));
      used = 0;
    }
    pieces_.push_back({begin, size});
    used += size;
  };
  int64_t doc = 0;
  for (int64_t i = 0; i < data.size(); ++i) {
    if (t[i] != static_cast<uint32_t>(eos_token_id) && i + 1 < data.size()) continue;
    for (int64_t b = doc; b <= i; b += seq_len) add_piece(b, std::min(seq_len, i + 1 - b));
    doc = i + 1;
  }
  first_piece_.push_back(static_cast<int64_t>(pieces_.size()));
}

int64_t PackedDocuments::wrap(int64_t index) const {
  const int64_t n = num_samples();
  return ((index % n) + n) % n;
}

int64_t PackedDocuments::length(int64_t index) const {
  const int64_t i = wrap(index);
  int64_t n = 0;
  for (int64_t p = first_piece_[i]; p < first_piece_[i + 1]; ++p) n += pieces_[p].size;
  return n;
}

int64_t PackedDocuments::counted_targets(int64_t index) const {
  const int64_t i = wrap(index);
  return length(i) - (first_piece_[i + 1] - first_piece_[i]);
}

void PackedDocuments::sample(int64_t index, int64_t width, int32_t* inputs, int32_t* targets,
                             int32_t* positions) const {
  const int64_t i = wrap(index), n = length(i);
  if (width < n) fail("[data] packed sample ", i, " has ", n, " tokens, more than the row width ", width);
  std::vector<int64_t> pieces;
  for (int64_t p = first_piece_[i]; p < first_piece_[i + 1]; ++p) pieces.push_back(p);
  pack(pieces, width, inputs, targets, positions);
}

void PackedDocuments::pack(const std::vector<int64_t>& pieces, int64_t width, int32_t* inputs, int32_t* targets,
                           int32_t* positions) const {
  const uint32_t* t = data_.tokens().data();
  int64_t at = 0;
  for (int64_t p : pieces) {
    const Piece& piece = pieces_.at(static_cast<size_t>(p));
    if (at + piece.size > width)
      fail("[data] pieces of ", at + piece.size, "+ tokens do not fit a row of ", width);
    for (int64_t k = 0; k < piece.size; ++k, ++at) {
      inputs[at] = static_cast<int32_t>(t[piece.begin + k]);
      targets[at] = k + 1 < piece.size ? static_cast<int32_t>(t[piece.begin + k + 1]) : kIgnore;
      positions[at] = static_cast<int32_t>(k);
    }
  }
  for (int64_t k = 0; at < width; ++k, ++at) {
    inputs[at] = eos_;
    targets[at] = kIgnore;
    positions[at] = static_cast<int32_t>(k);
  }
}

void TokenData::save(const std::string& path, const std::vector<uint32_t>& tokens) {
  check_replaceable("[data]", path);  // the rename would replace a device or FIFO
  // Write beside the target and rename, so a failure never leaves a half file.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("[data] ", path, ": cannot open ", tmp, " for writing");
    out.write(reinterpret_cast<const char*>(tokens.data()),
              static_cast<std::streamsize>(tokens.size() * sizeof(uint32_t)));
    out.close();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      fail("[data] ", path, ": write failed (disk full or I/O error)");
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    std::filesystem::remove(tmp, ec);
    fail("[data] ", path, ": cannot rename ", tmp, " into place: ", why);
  }
}

}  // namespace hspmd

// Token files and fixed-length sampling (docs/data.md).
//
// A token file (.bin) is a flat array of little-endian uint32 token ids;
// documents are separated by eos_token_id. In fixed-length mode, sample i is
// tokens[i*L : i*L + L + 1]: inputs are its first L tokens, targets the same
// shifted by one. Step s of batch size B uses samples s*B .. s*B+B-1, modulo
// the number of samples.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hspmd {

class TokenData {
 public:
  // Loads and validates a token file. Throws hspmd::Error "[data] <path>: ..."
  // when the file is missing, empty, not a multiple of 4 bytes, or holds a
  // token id >= vocab_size (naming the first bad id and its position), or
  // when vocab_size <= 0. The path names the data in later errors.
  static TokenData load(const std::string& path, int64_t vocab_size);
  explicit TokenData(std::vector<uint32_t> tokens) : tokens_(std::move(tokens)) {}

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  const std::vector<uint32_t>& tokens() const { return tokens_; }

  // Number of fixed-length samples of length seq_len: (size - 1) / seq_len.
  // Throws hspmd::Error "[data] <path, or 'tokens' when not loaded from a
  // file>: N tokens are fewer than one sample of seq_len L + 1" when it is 0,
  // and for seq_len <= 0.
  int64_t num_samples(int64_t seq_len) const;

  // Writes sample `index` (taken modulo num_samples; negative indices wrap
  // too) into inputs[0..L) and targets[0..L). Throws as num_samples does.
  void sample(int64_t index, int64_t seq_len, int32_t* inputs, int32_t* targets) const;

  // Writes a token file (to a temporary beside it, then renamed, so a
  // failure leaves any old file intact). Throws hspmd::Error when it cannot
  // be written, or when `path` exists and is not a regular file (a device,
  // FIFO or directory, symbolic links followed: the rename would replace it).
  static void save(const std::string& path, const std::vector<uint32_t>& tokens);

 private:
  std::vector<uint32_t> tokens_;
  std::string path_;
  friend class PackedDocuments;
};

// Packed-documents mode (`hspmd train --pack-documents`, docs/data.md).
// Documents end at each eos token (the eos belongs to its document; tokens
// after the last eos form a last document). A document longer than seq_len
// is cut into pieces of seq_len tokens. Pieces are packed in file order:
// a piece joins the current sequence when it fits in seq_len tokens, else
// it starts the next one (next-fit). Sample i is packed sequence i (modulo
// their number); its length varies up to seq_len. In a sample, positions
// restart at 0 at each piece, every token's target is the next token of its
// piece, and a piece's last token has no target (ignore_index), so neither
// attention (masked by positions) nor the loss crosses a document boundary.
class PackedDocuments {
 public:
  static constexpr int32_t kIgnore = -100;  // the cross-entropy's ignore_index

  // Throws hspmd::Error "[data] <path>: ..." for seq_len <= 0 or an eos id
  // outside [0, 2^31).
  PackedDocuments(const TokenData& data, int64_t seq_len, int64_t eos_token_id);

  int64_t num_samples() const { return static_cast<int64_t>(first_piece_.size()) - 1; }
  int64_t seq_len() const { return seq_len_; }
  // Tokens of sample `index` (wrapping like TokenData::sample).
  int64_t length(int64_t index) const;
  // Targets of sample `index` that count in the loss: length - pieces.
  int64_t counted_targets(int64_t index) const;
  // Writes sample `index` into rows of `width` >= length(index) entries.
  // Padding after the sample: input eos, target ignore_index, positions
  // 0, 1, ... (a document of its own, which no real token attends to).
  // Throws hspmd::Error when width is too small.
  void sample(int64_t index, int64_t width, int32_t* inputs, int32_t* targets,
              int32_t* positions) const;

  // The pieces themselves (token-budget steps, docs/mixed_length.md): in
  // file order, each at most seq_len tokens.
  int64_t num_pieces() const { return static_cast<int64_t>(pieces_.size()); }
  int64_t piece_size(int64_t piece) const { return pieces_.at(static_cast<size_t>(piece)).size; }
  // Writes the listed pieces one after the other into a row of `width`
  // entries, padded as sample() pads; throws when they do not fit.
  void pack(const std::vector<int64_t>& pieces, int64_t width, int32_t* inputs, int32_t* targets,
            int32_t* positions) const;

 private:
  struct Piece {
    int64_t begin, size;  // a range of the token file
  };
  int64_t wrap(int64_t index) const;
  const TokenData& data_;
  int64_t seq_len_;
  int32_t eos_;
  std::vector<Piece> pieces_;
  std::vector<int64_t> first_piece_;  // per sample, its first piece; one past the end last
};

}  // namespace hspmd

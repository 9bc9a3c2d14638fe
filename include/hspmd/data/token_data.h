// Token files and fixed-length sampling (DESIGN §7).
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
  // be written.
  static void save(const std::string& path, const std::vector<uint32_t>& tokens);

 private:
  std::vector<uint32_t> tokens_;
  std::string path_;
};

}  // namespace hspmd

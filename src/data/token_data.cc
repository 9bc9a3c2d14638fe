#include "hspmd/data/token_data.h"

#include <unistd.h>

#include <bit>
#include <filesystem>
#include <fstream>

#include "hspmd/core/error.h"

namespace hspmd {

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian uint32 and are read with raw copies");

TokenData TokenData::load(const std::string& path, int64_t vocab_size) {
  if (vocab_size <= 0) fail("[data] ", path, ": vocab_size ", vocab_size, " must be positive");
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) fail("[data] ", path, ": no such file");
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

void TokenData::save(const std::string& path, const std::vector<uint32_t>& tokens) {
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

#include "hspmd/data/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include "hspmd/core/error.h"
#include "hspmd/data/token_data.h"

namespace hspmd {

std::vector<uint32_t> byte_tokenize(std::string_view text) {
  std::vector<uint32_t> tokens;
  tokens.reserve(text.size());
  for (char c : text) tokens.push_back(static_cast<unsigned char>(c));
  return tokens;
}

int64_t tokenize_files(const std::vector<std::string>& inputs, const std::string& output,
                       uint32_t eos_token_id) {
  if (eos_token_id < 256)
    fail("[tokenizer] eos_token_id ", eos_token_id, " is a byte value; it must be >= 256");
  if (inputs.empty()) fail("[tokenizer] ", output, ": no input files");
  std::vector<uint32_t> tokens;
  for (const std::string& path : inputs) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) fail("[tokenizer] ", path, ": no such file");
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("[tokenizer] ", path, ": cannot open file");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) fail("[tokenizer] ", path, ": cannot read file");
    std::vector<uint32_t> doc = byte_tokenize(text);
    tokens.insert(tokens.end(), doc.begin(), doc.end());
    tokens.push_back(eos_token_id);
  }
  TokenData::save(output, tokens);
  return static_cast<int64_t>(tokens.size());
}

}  // namespace hspmd

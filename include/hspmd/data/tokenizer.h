// The byte-level tokenizer: token id = byte value (0..255); each document
// ends with eos_token_id (which must not be a byte value, i.e. >= 256).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace hspmd {

// Tokens of one document, without the trailing EOS.
std::vector<uint32_t> byte_tokenize(std::string_view text);

// Turns each input text file into one document (its bytes, then EOS) and
// writes them, in order, to the token file `output`. Returns the number of
// tokens written. Throws hspmd::Error for an unreadable input, an empty input
// list, or eos_token_id < 256.
int64_t tokenize_files(const std::vector<std::string>& inputs, const std::string& output,
                       uint32_t eos_token_id);

}  // namespace hspmd

// safetensors files (https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length, a JSON header mapping each tensor name to
// {dtype, shape, data_offsets}, then the raw little-endian data.
#pragma once

#include <map>
#include <string>

#include "hspmd/core/ndarray.h"

namespace hspmd {

// Reads every tensor of `path`, in its stored dtype (F32, BF16, I32, I64 are
// supported). Throws hspmd::Error "[safetensors] <path>: <rule>" for a missing
// file, a truncated file, a malformed header, an unsupported dtype, or
// offsets that do not match the shape.
std::map<std::string, NDArray> load_safetensors(const std::string& path);

// Writes `tensors` (any of the supported dtypes, in their own dtype) to
// `path`, sorted by name, with metadata {"format": "pt"}. Throws
// hspmd::Error when the file cannot be written.
void save_safetensors(const std::string& path, const std::map<std::string, NDArray>& tensors);

}  // namespace hspmd

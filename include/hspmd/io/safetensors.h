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
// offsets that do not match the shape or lie beyond the data. Arrays come
// back contiguous on the CPU. Overlapping data ranges are not checked.
std::map<std::string, NDArray> load_safetensors(const std::string& path);

// Writes `tensors` (any of the supported dtypes, in their own dtype) to
// `path`, sorted by name, with metadata {"format": "pt"}; the header is
// space-padded to a multiple of 8 bytes and the data is contiguous. Writes a
// temporary file beside `path` and renames it, so on failure an existing file
// is left intact. Throws hspmd::Error "[safetensors] <path>: ..." when the
// file cannot be written, a tensor is invalid or not on the CPU, or a tensor
// is named "__metadata__".
void save_safetensors(const std::string& path, const std::map<std::string, NDArray>& tensors);

}  // namespace hspmd

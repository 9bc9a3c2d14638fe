// safetensors files (https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length, a JSON header mapping each tensor name to
// {dtype, shape, data_offsets}, then the raw little-endian data.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "hspmd/core/ndarray.h"

namespace hspmd {

// The safetensors dtype names: "F32", "BF16", "I32", "I64", "F64"
// (InternalError for another dtype), and back: the dtype of a name that
// load_safetensors reads (F32, BF16, I32, I64), nullopt for any other.
const char* safetensors_dtype_name(DType dtype);
std::optional<DType> safetensors_dtype(const std::string& name);

// Reads every tensor of `path`, in its stored dtype (F32, BF16, I32, I64 are
// supported). Throws hspmd::Error "[safetensors] <path>: <rule>" for a missing
// or non-regular file (a FIFO is refused unopened), a truncated file, a
// malformed header (not JSON, a duplicate key, nesting deeper than 128), a
// "__metadata__" that is not an object of strings, an unsupported dtype,
// offsets that do not match the shape or lie beyond the data, two tensors
// whose data ranges overlap, or bytes after the last tensor's data. Arrays
// come back contiguous on the CPU.
std::map<std::string, NDArray> load_safetensors(const std::string& path);

// Writes `tensors` (any of the supported dtypes, in their own dtype) to
// `path`, sorted by name, with metadata {"format": "pt"}; the header is
// space-padded to a multiple of 8 bytes and the data is contiguous. Writes a
// temporary file beside `path` and renames it, so on failure an existing file
// is left intact. Throws hspmd::Error "[safetensors] <path>: ..." when the
// file cannot be written, `path` exists and is not a regular file (a device,
// FIFO or directory, symbolic links followed: the rename would replace it), a
// tensor is invalid or not on the CPU, or a tensor is named "__metadata__".
void save_safetensors(const std::string& path, const std::map<std::string, NDArray>& tensors);

// Writes one safetensors file tensor by tensor, so that the writer never
// holds more than one tensor (a distributed --save gathers them one at a
// time). The header (every name, dtype and shape, sorted by name as
// save_safetensors writes it) goes first; write() places each tensor's data
// at its offset, in any order. Data go to a temporary file beside `path`;
// finish() checks that every tensor was written and renames it into place,
// so a failure leaves an existing file intact. Throws hspmd::Error
// "[safetensors] <path>: ..." like save_safetensors (the constructor refuses
// a `path` that is not a regular file), and for a tensor that is
// not declared, written twice, or of another dtype or shape.
class SafetensorsWriter {
 public:
  struct Declared {
    DType dtype = DType::F32;
    Shape shape;
  };
  SafetensorsWriter(std::string path, std::map<std::string, Declared> tensors);
  ~SafetensorsWriter();  // removes the temporary file unless finished
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void write(const std::string& name, const NDArray& tensor);
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hspmd

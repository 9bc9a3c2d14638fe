#include "hspmd/io/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"
#include "hspmd/io/output_file.h"

namespace hspmd {
namespace {

using nlohmann::json;
constexpr uint64_t kHeaderLengthBytes = 8;

static_assert(std::endian::native == std::endian::little,
              "safetensors I/O copies raw little-endian bytes");

template <typename... Args>
[[noreturn]] void fail_file(const std::string& path, const Args&... args) {
  fail("[safetensors] ", path, ": ", args...);
}

}  // namespace

std::optional<DType> safetensors_dtype(const std::string& name) {
  if (name == "F32") return DType::F32;
  if (name == "BF16") return DType::BF16;
  if (name == "I32") return DType::I32;
  if (name == "I64") return DType::I64;
  return std::nullopt;
}

const char* safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::F64: return "F64";
  }
  HSPMD_CHECK(false, "unknown dtype");
}

namespace {

bool is_count(const json& v) { return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0); }

// Everything the header says about one tensor, after validation.
struct Entry {
  DType dtype;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

Shape parse_shape(const std::string& path, const std::string& name, const json& v) {
  if (!v.is_array()) fail_file(path, "tensor '", name, "': \"shape\" is not a list");
  Shape shape;
  for (const json& d : v) {
    if (!is_count(d)) fail_file(path, "tensor '", name, "': \"shape\" holds ", json_excerpt(d), ", not a non-negative integer");
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

// Byte size of `shape` elements of `dtype`, or nullopt on overflow.
std::optional<uint64_t> byte_size(const Shape& shape, DType dtype) {
  uint64_t bytes = dtype_size(dtype);
  for (int64_t d : shape)
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) return std::nullopt;
  return bytes;
}

Entry parse_entry(const std::string& path, const std::string& name, const json& v, uint64_t data_bytes) {
  if (!v.is_object()) fail_file(path, "tensor '", name, "': entry is not a JSON object");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!v.contains(field)) fail_file(path, "tensor '", name, "': missing field \"", field, "\"");
  if (!v["dtype"].is_string()) fail_file(path, "tensor '", name, "': \"dtype\" is not a string");
  const std::string dtype_str = v["dtype"].get<std::string>();
  std::optional<DType> dtype = safetensors_dtype(dtype_str);
  if (!dtype) fail_file(path, "tensor '", name, "': unsupported dtype '", shorten(dtype_str), "' (supported: F32, BF16, I32, I64)");
  Entry e{*dtype, parse_shape(path, name, v["shape"])};
  const json& offs = v["data_offsets"];
  if (!offs.is_array() || offs.size() != 2 || !is_count(offs[0]) || !is_count(offs[1]))
    fail_file(path, "tensor '", name, "': \"data_offsets\" is not a pair of non-negative integers");
  e.begin = offs[0].get<uint64_t>();
  e.end = offs[1].get<uint64_t>();
  std::optional<uint64_t> expected = byte_size(e.shape, e.dtype);
  if (e.end < e.begin || !expected || e.end - e.begin != *expected)
    fail_file(path, "tensor '", name, "': data_offsets [", e.begin, ", ", e.end, "] span ",
              e.end >= e.begin ? e.end - e.begin : 0, " bytes but shape ", shape_str(e.shape), " of ",
              dtype_str, " needs ", expected ? std::to_string(*expected) : std::string("too many"));
  if (e.end > data_bytes)
    fail_file(path, "tensor '", name, "': data_offsets end ", e.end, " is beyond the ", data_bytes,
              "-byte data section");
  return e;
}

uint64_t read_header_length(std::ifstream& in, const std::string& path, uint64_t file_bytes) {
  if (file_bytes < kHeaderLengthBytes)
    fail_file(path, "file is ", file_bytes, " bytes, shorter than the 8-byte header length");
  unsigned char buf[kHeaderLengthBytes];
  in.read(reinterpret_cast<char*>(buf), kHeaderLengthBytes);
  if (!in) fail_file(path, "cannot read the header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | buf[i];
  if (n > file_bytes - kHeaderLengthBytes)
    fail_file(path, "header length ", n, " exceeds the ", file_bytes - kHeaderLengthBytes,
              " bytes that follow it");
  return n;
}

json read_header(std::ifstream& in, const std::string& path, uint64_t header_bytes) {
  std::string text(header_bytes, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_bytes));
  if (!in) fail_file(path, "cannot read the ", header_bytes, "-byte header");
  // Duplicate keys and deep nesting are refused here, with the JSON rules.
  json header = parse_json_text(text, "safetensors", path + ": header");
  if (!header.is_object()) fail_file(path, "header is not a JSON object");
  return header;
}

void check_metadata(const std::string& path, const json& header) {
  auto it = header.find("__metadata__");
  if (it == header.end()) return;
  if (!it->is_object()) fail_file(path, "\"__metadata__\" is not an object of strings");
  for (const auto& [key, value] : it->items())
    if (!value.is_string())
      fail_file(path, "\"__metadata__\" value of '", shorten(key), "' is ", json_excerpt(value),
                ", not a string");
}

// The data section holds the tensors back to back: no two ranges overlap and
// nothing follows the last one (gaps between ranges are allowed).
void check_layout(const std::string& path, const std::map<std::string, Entry>& entries, uint64_t data_bytes) {
  std::vector<std::pair<const std::string*, const Entry*>> by_begin;
  for (const auto& [name, e] : entries) by_begin.push_back({&name, &e});
  std::sort(by_begin.begin(), by_begin.end(), [](const auto& a, const auto& b) {
    return std::make_pair(a.second->begin, a.second->end) < std::make_pair(b.second->begin, b.second->end);
  });
  uint64_t end = 0;
  const std::string* last = nullptr;
  for (const auto& [name, e] : by_begin) {
    if (e->begin < end && e->end > e->begin)
      fail_file(path, "tensor '", shorten(*name), "': data_offsets [", e->begin, ", ", e->end, "] overlap tensor '",
                shorten(*last), "', which ends at ", end);
    if (e->end >= end) end = e->end, last = name;
  }
  if (end != data_bytes)
    fail_file(path, data_bytes - end, " trailing bytes after the last tensor (data ends at ", end, " of ",
              data_bytes, ")");
}

void read_tensor(std::ifstream& in, const std::string& path, const std::string& name, uint64_t data_start,
                 const Entry& e, NDArray& out) {
  if (e.end == e.begin) return;
  in.seekg(static_cast<std::streamoff>(data_start + e.begin));
  in.read(static_cast<char*>(out.host_raw_data("safetensors read")), static_cast<std::streamsize>(e.end - e.begin));
  if (!in) fail_file(path, "tensor '", name, "': cannot read its data");
}

}  // namespace

std::map<std::string, NDArray> load_safetensors(const std::string& path) {
  require_regular_file(path, "safetensors");
  std::error_code ec;
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_file(path, "cannot open file for reading");
  const uint64_t file_bytes = std::filesystem::file_size(path, ec);
  if (ec) fail_file(path, "cannot read the file size: ", ec.message());

  const uint64_t header_bytes = read_header_length(in, path, file_bytes);
  const json header = read_header(in, path, header_bytes);
  const uint64_t data_start = kHeaderLengthBytes + header_bytes;
  const uint64_t data_bytes = file_bytes - data_start;

  check_metadata(path, header);
  std::map<std::string, Entry> entries;
  for (const auto& [name, value] : header.items())
    if (name != "__metadata__") entries.emplace(name, parse_entry(path, shorten(name), value, data_bytes));
  check_layout(path, entries, data_bytes);
  std::map<std::string, NDArray> tensors;
  for (const auto& [name, e] : entries) {
    NDArray array = NDArray::empty(e.shape, e.dtype);
    read_tensor(in, path, name, data_start, e, array);
    tensors.emplace(name, std::move(array));
  }
  return tensors;
}

namespace {

// The JSON header for `tensors` (already contiguous), padded with spaces to a
// multiple of 8 bytes so the data section stays aligned.
std::string make_header(const std::map<std::string, NDArray>& tensors) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t bytes = t.nbytes();
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

// Writes the whole file to `path`; returns "" or what went wrong.
std::string write_file(const std::string& path, const std::string& header,
                       const std::map<std::string, NDArray>& tensors) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return "cannot open " + path + " for writing";
  unsigned char len[kHeaderLengthBytes];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(uint64_t{header.size()} >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), kHeaderLengthBytes);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const auto& [name, t] : tensors)
    out.write(static_cast<const char*>(t.host_raw_data("safetensors write")), static_cast<std::streamsize>(t.nbytes()));
  out.close();
  if (!out) return "writing " + path + " failed (disk full or I/O error)";
  return "";
}

}  // namespace

void save_safetensors(const std::string& path, const std::map<std::string, NDArray>& tensors) {
  std::map<std::string, NDArray> contiguous;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") fail_file(path, "'__metadata__' is reserved and cannot name a tensor");
    if (!t.valid()) fail_file(path, "tensor '", name, "' is an empty (invalid) array");
    if (!(t.device() == Device::cpu()))
      fail_file(path, "tensor '", name, "' lives on ", t.device().str(), "; copy it to the CPU first");
    contiguous.emplace(name, t.contiguous());
  }
  const std::string header = make_header(contiguous);
  check_replaceable("[safetensors]", path);  // the rename would replace a device or FIFO
  // Write beside the target and rename, so a failure never leaves a half file.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  if (std::string error = write_file(tmp, header, contiguous); !error.empty()) {
    std::filesystem::remove(tmp, ec);
    fail_file(path, error);
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    std::filesystem::remove(tmp, ec);
    fail_file(path, "cannot rename ", tmp, " into place: ", why);
  }
}

struct SafetensorsWriter::Impl {
  std::string path, tmp;
  std::map<std::string, Declared> tensors;
  std::map<std::string, uint64_t> offsets;  // absolute file offsets of each tensor's data
  std::set<std::string> written;
  std::ofstream out;
  bool finished = false;
};

SafetensorsWriter::SafetensorsWriter(std::string path, std::map<std::string, Declared> tensors)
    : impl_(std::make_unique<Impl>()) {
  Impl& w = *impl_;
  w.path = std::move(path);
  w.tensors = std::move(tensors);
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto& [name, d] : w.tensors) {
    if (name == "__metadata__") fail_file(w.path, "'__metadata__' is reserved and cannot name a tensor");
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
    header[name] = {{"dtype", safetensors_dtype_name(d.dtype)}, {"shape", d.shape}, {"data_offsets", {offset, offset + bytes}}};
    w.offsets[name] = offset;
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  for (auto& [name, o] : w.offsets) o += kHeaderLengthBytes + text.size();
  check_replaceable("[safetensors]", w.path);  // the rename would replace a device or FIFO
  w.tmp = w.path + ".tmp." + std::to_string(::getpid());
  w.out.open(w.tmp, std::ios::binary | std::ios::trunc);
  if (!w.out) fail_file(w.path, "cannot open ", w.tmp, " for writing");
  unsigned char len[kHeaderLengthBytes];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(uint64_t{text.size()} >> (8 * i));
  w.out.write(reinterpret_cast<const char*>(len), kHeaderLengthBytes);
  w.out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (impl_->finished) return;
  impl_->out.close();
  std::error_code ec;
  std::filesystem::remove(impl_->tmp, ec);
}

void SafetensorsWriter::write(const std::string& name, const NDArray& tensor) {
  Impl& w = *impl_;
  auto it = w.tensors.find(name);
  if (it == w.tensors.end()) fail_file(w.path, "tensor '", name, "' was not declared");
  if (!w.written.insert(name).second) fail_file(w.path, "tensor '", name, "' written twice");
  if (!tensor.valid() || tensor.dtype() != it->second.dtype || tensor.shape() != it->second.shape)
    fail_file(w.path, "tensor '", name, "' is not the declared ", safetensors_dtype_name(it->second.dtype), " ",
              shape_str(it->second.shape));
  const NDArray c = tensor.contiguous();
  w.out.seekp(static_cast<std::streamoff>(w.offsets.at(name)));
  w.out.write(static_cast<const char*>(c.host_raw_data("safetensors write")), static_cast<std::streamsize>(c.nbytes()));
  if (!w.out) fail_file(w.path, "writing ", w.tmp, " failed (disk full or I/O error)");
}

void SafetensorsWriter::finish() {
  Impl& w = *impl_;
  for (const auto& [name, d] : w.tensors)
    if (!w.written.count(name)) fail_file(w.path, "tensor '", name, "' was declared but never written");
  w.out.close();
  if (!w.out) fail_file(w.path, "writing ", w.tmp, " failed (disk full or I/O error)");
  std::error_code ec;
  std::filesystem::rename(w.tmp, w.path, ec);
  if (ec) fail_file(w.path, "cannot rename ", w.tmp, " into place: ", ec.message());
  w.finished = true;
}

}  // namespace hspmd

// NDArray: a typed, strided view of device memory.
//
// Storage is reference-counted and shared between views (reshape, transpose,
// slice); copying an NDArray never copies data. Memory comes from the device's
// Allocator, so current and peak bytes are accounted. Kernels take contiguous
// arrays; call contiguous() to materialize a strided view.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/dtype.h"

namespace hspmd {

using Shape = std::vector<int64_t>;

// Number of elements of a shape (1 for a scalar shape {}).
int64_t shape_numel(const Shape& shape);
// "[2, 3, 4]".
std::string shape_str(const Shape& shape);

// Owns one allocation; frees it through its allocator on destruction.
class Storage {
 public:
  Storage(size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
};

class NDArray {
 public:
  NDArray() = default;  // an invalid (empty) array; valid() is false.

  // New uninitialized contiguous array on `device`; zero-filled host array
  // (kernels::zeros makes one on a device).
  static NDArray empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static NDArray zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  // Contiguous f32 array holding `values` (size must equal the shape's numel).
  static NDArray from_vector(const Shape& shape, const std::vector<float>& values);
  static NDArray from_vector_i32(const Shape& shape, const std::vector<int32_t>& values);

  bool valid() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }  // in elements
  int64_t dim(int i) const;                           // negative i counts from the end
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  Device device() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;

  // Typed pointer to the first element, in the array's device memory.
  // Checks the dtype matches T (float f32, uint16_t bf16, int32_t i32,
  // int64_t i64, double f64). For kernels (src/kernels/) and communicator
  // backends only, which know the device; everything above them reaches
  // tensor bytes through kernels, or host_data() for host staging arrays
  // (scripts/lint_tensor_bytes.py keeps it so, in CI).
  template <typename T>
  T* data() const;
  void* raw_data() const;
  // The same pointers for arrays that must live in host memory: batches
  // built on the host, values read back for logging, files read and written,
  // checkers. Throws hspmd::Error "[ndarray] <what>: the array lives on
  // <device>, not on the host" for any other device, so that a device array
  // never reaches a host loop unnoticed (copy it with kernels::to_host).
  template <typename T>
  T* host_data(const char* what = "host_data") const;
  void* host_raw_data(const char* what = "host_raw_data") const;

  // Views (no copy). reshape requires a contiguous array and equal numel;
  // transpose swaps two dims; slice keeps [begin, end) of dim `axis`.
  NDArray reshape(const Shape& shape) const;
  NDArray transpose(int dim0, int dim1) const;
  NDArray slice(int axis, int64_t begin, int64_t end) const;

  // Host conveniences. Each touches the elements in host memory, so it
  // refuses an array on another device (the host_data error naming the
  // method); device code uses the kernels of the same name (kernels/memory.h).
  // Copies (always new storage):
  // The same elements of the same storage (a copy of this handle, or an
  // identical view): a cache keyed by it cannot see another array's data,
  // since it holds the storage alive.
  bool same_view(const NDArray& o) const {
    return storage_ == o.storage_ && offset_ == o.offset_ && shape_ == o.shape_ && strides_ == o.strides_ &&
           dtype_ == o.dtype_;
  }
  // Equal for arrays that are the same view (a hash of the storage and the
  // offset, for a hash table of views; compare its entries with same_view).
  size_t view_hash() const {
    return std::hash<const void*>()(storage_.get()) ^ (std::hash<int64_t>()(offset_) * 0x9e3779b97f4a7c15ull);
  }
  NDArray contiguous() const;  // returns *this when already contiguous (any device)
  NDArray clone() const;
  NDArray to(DType dtype) const;  // f32 <-> bf16, i32 <-> i64, i32/i64 -> f32
  // Fills a contiguous array with a constant.
  void fill(float value);
  // Copies the elements as f32 (converting from any dtype) into a vector.
  std::vector<float> to_vector() const;

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::F32;
};

// Row-major strides of a shape.
Shape contiguous_strides(const Shape& shape);

}  // namespace hspmd

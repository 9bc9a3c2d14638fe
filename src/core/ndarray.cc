#include "hspmd/core/ndarray.h"

#include <omp.h>

#include <cstring>
#include <sstream>

#include "hspmd/core/device_code.h"
#include "hspmd/core/error.h"

namespace hspmd {

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

Storage::Storage(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  data_ = allocator_for(device).allocate(bytes);
}

Storage::~Storage() { allocator_for(device_).deallocate(data_, bytes_); }

NDArray NDArray::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) HSPMD_CHECK(d >= 0, "negative dim in ", shape_str(shape));
  NDArray a;
  a.shape_ = shape;
  a.strides_ = contiguous_strides(shape);
  a.dtype_ = dtype;
  a.storage_ = std::make_shared<Storage>(shape_numel(shape) * dtype_size(dtype), device);
  return a;
}

NDArray NDArray::zeros(const Shape& shape, DType dtype, Device device) {
  NDArray a = empty(shape, dtype, device);
  std::memset(a.host_raw_data("NDArray::zeros"), 0, a.nbytes());
  return a;
}

NDArray NDArray::from_vector(const Shape& shape, const std::vector<float>& values) {
  HSPMD_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape));
  NDArray a = empty(shape, DType::F32);
  std::memcpy(a.host_raw_data(), values.data(), a.nbytes());
  return a;
}

NDArray NDArray::from_vector_i32(const Shape& shape, const std::vector<int32_t>& values) {
  HSPMD_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape));
  NDArray a = empty(shape, DType::I32);
  std::memcpy(a.host_raw_data(), values.data(), a.nbytes());
  return a;
}

int64_t NDArray::dim(int i) const {
  int n = ndim();
  if (i < 0) i += n;
  HSPMD_CHECK(i >= 0 && i < n, "dim ", i, " of shape ", shape_str(shape_));
  return shape_[i];
}

Device NDArray::device() const { return storage_ ? storage_->device() : Device::cpu(); }

bool NDArray::is_contiguous() const { return strides_ == contiguous_strides(shape_); }

namespace {

thread_local int t_device_code_depth = 0;

// data<T>() or raw_data() of a cpu:1 array outside the device's code
// (device_code.h): the bug a GPU would show as a host read of device memory.
[[noreturn]] void refuse_host_read(Device device) {
  fail("[ndarray] data: a ", device.str(),
       " (device test double) array read outside the kernel dispatch: host code may not read a device's "
       "elements (rule: a host helper brings them to the host with kernels::to_host first, or runs as a "
       "dispatched kernel; docs/cuda.md, \"Host helpers\")");
}

}  // namespace

DeviceCodeScope::DeviceCodeScope() { ++t_device_code_depth; }
DeviceCodeScope::~DeviceCodeScope() { --t_device_code_depth; }
bool DeviceCodeScope::active() { return t_device_code_depth > 0 || omp_in_parallel(); }

void* NDArray::raw_data() const {
  HSPMD_CHECK(valid(), "use of an invalid NDArray");
  const Device d = storage_->device();
  if (d.index != 0 && d.type == DeviceType::CPU && !DeviceCodeScope::active()) refuse_host_read(d);
  return static_cast<char*>(storage_->data()) + offset_ * dtype_size(dtype_);
}

void* NDArray::host_raw_data(const char* what) const {
  HSPMD_CHECK(valid(), "use of an invalid NDArray");
  if (!(storage_->device() == Device::cpu()))
    fail("[ndarray] ", what, ": the array lives on ", storage_->device().str(), ", not on the host");
  return raw_data();
}

template <typename T>
T* NDArray::host_data(const char* what) const {
  (void)host_raw_data(what);
  return data<T>();
}
template float* NDArray::host_data<float>(const char*) const;
template uint16_t* NDArray::host_data<uint16_t>(const char*) const;
template int32_t* NDArray::host_data<int32_t>(const char*) const;
template int64_t* NDArray::host_data<int64_t>(const char*) const;
template double* NDArray::host_data<double>(const char*) const;

template <typename T>
T* NDArray::data() const {
  constexpr DType expected = std::is_same_v<T, float>      ? DType::F32
                             : std::is_same_v<T, uint16_t> ? DType::BF16
                             : std::is_same_v<T, int32_t>  ? DType::I32
                             : std::is_same_v<T, double>   ? DType::F64
                                                           : DType::I64;
  HSPMD_CHECK(dtype_ == expected, "array is ", dtype_name(dtype_), ", accessed as ",
              dtype_name(expected));
  return static_cast<T*>(raw_data());
}
template float* NDArray::data<float>() const;
template uint16_t* NDArray::data<uint16_t>() const;
template int32_t* NDArray::data<int32_t>() const;
template int64_t* NDArray::data<int64_t>() const;
template double* NDArray::data<double>() const;

NDArray NDArray::reshape(const Shape& shape) const {
  HSPMD_CHECK(is_contiguous(), "reshape of a strided view");
  HSPMD_CHECK(shape_numel(shape) == numel(), "reshape ", shape_str(shape_), " -> ",
              shape_str(shape));
  NDArray a = *this;
  a.shape_ = shape;
  a.strides_ = contiguous_strides(shape);
  return a;
}

NDArray NDArray::transpose(int dim0, int dim1) const {
  int n = ndim();
  if (dim0 < 0) dim0 += n;
  if (dim1 < 0) dim1 += n;
  HSPMD_CHECK(dim0 >= 0 && dim0 < n && dim1 >= 0 && dim1 < n);
  NDArray a = *this;
  std::swap(a.shape_[dim0], a.shape_[dim1]);
  std::swap(a.strides_[dim0], a.strides_[dim1]);
  return a;
}

NDArray NDArray::slice(int axis, int64_t begin, int64_t end) const {
  if (axis < 0) axis += ndim();
  HSPMD_CHECK(axis >= 0 && axis < ndim());
  HSPMD_CHECK(0 <= begin && begin <= end && end <= shape_[axis]);
  NDArray a = *this;
  a.offset_ += begin * strides_[axis];
  a.shape_[axis] = end - begin;
  return a;
}

namespace {

// Copies a strided array element by element into contiguous memory.
void gather_strided(const NDArray& src, char* dst) {
  const size_t es = dtype_size(src.dtype());
  const char* base = static_cast<const char*>(src.host_raw_data("NDArray::contiguous"));
  const int n = src.ndim();
  const int64_t total = src.numel();
  std::vector<int64_t> idx(n, 0);
  for (int64_t k = 0; k < total; ++k) {
    int64_t off = 0;
    for (int d = 0; d < n; ++d) off += idx[d] * src.strides()[d];
    std::memcpy(dst + k * es, base + off * es, es);
    for (int d = n - 1; d >= 0; --d) {
      if (++idx[d] < src.shape()[d]) break;
      idx[d] = 0;
    }
  }
}

}  // namespace

NDArray NDArray::contiguous() const {
  if (is_contiguous()) return *this;
  (void)host_raw_data("NDArray::contiguous");  // a strided device array needs a kernel
  NDArray out = empty(shape_, dtype_, device());
  gather_strided(*this, static_cast<char*>(out.raw_data()));
  return out;
}

NDArray NDArray::clone() const {
  NDArray src = contiguous();
  NDArray out = empty(shape_, dtype_, device());
  std::memcpy(out.raw_data(), src.host_raw_data("NDArray::clone"), nbytes());
  return out;
}

NDArray NDArray::to(DType dtype) const {
  (void)host_raw_data("NDArray::to");
  NDArray src = contiguous();
  if (dtype == dtype_) return src.clone();
  NDArray out = empty(shape_, dtype, device());
  const int64_t n = numel();
  // Typed pointers hoisted out of the loops, so that they vectorize.
  auto convert = [n](const auto* s, auto* o, auto f) {
    for (int64_t i = 0; i < n; ++i) o[i] = f(s[i]);
  };
  if (dtype == DType::F32) {
    float* o = out.data<float>();
    switch (dtype_) {
      case DType::BF16: bf16_to_f32_n(src.data<uint16_t>(), o, n); break;
      case DType::I32: convert(src.data<int32_t>(), o, [](int32_t v) { return static_cast<float>(v); }); break;
      case DType::I64: convert(src.data<int64_t>(), o, [](int64_t v) { return static_cast<float>(v); }); break;
      case DType::F32:
      case DType::F64: fail("[ndarray] no conversion from ", dtype_name(dtype_), " to f32");
    }
  } else if (dtype == DType::BF16 && dtype_ == DType::F32) {
    f32_to_bf16_n(src.data<float>(), out.data<uint16_t>(), n);
  } else if (dtype == DType::I64 && dtype_ == DType::I32) {
    convert(src.data<int32_t>(), out.data<int64_t>(), [](int32_t v) { return static_cast<int64_t>(v); });
  } else if (dtype == DType::I32 && dtype_ == DType::I64) {
    convert(src.data<int64_t>(), out.data<int32_t>(), [](int64_t v) { return static_cast<int32_t>(v); });
  } else {
    fail("[ndarray] no conversion from ", dtype_name(dtype_), " to ", dtype_name(dtype));
  }
  return out;
}

void NDArray::fill(float value) {
  (void)host_raw_data("NDArray::fill");
  HSPMD_CHECK(is_contiguous());
  const int64_t n = numel();
  switch (dtype_) {
    case DType::F32: std::fill_n(data<float>(), n, value); break;
    case DType::BF16: std::fill_n(data<uint16_t>(), n, f32_to_bf16(value)); break;
    case DType::I32: std::fill_n(data<int32_t>(), n, static_cast<int32_t>(value)); break;
    case DType::I64: std::fill_n(data<int64_t>(), n, static_cast<int64_t>(value)); break;
    case DType::F64: std::fill_n(data<double>(), n, static_cast<double>(value)); break;
  }
}

std::vector<float> NDArray::to_vector() const {
  (void)host_raw_data("NDArray::to_vector");
  NDArray f = dtype_ == DType::F32 ? contiguous() : to(DType::F32);
  const float* p = f.data<float>();
  return std::vector<float>(p, p + f.numel());
}

}  // namespace hspmd

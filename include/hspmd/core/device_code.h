// The device test double's host-read rule (docs/cuda.md, "Host helpers and
// the double's host-read rule").
//
// The elements of a GPU's array cannot be read by host code: only the
// kernels (src/kernels/, through the dispatch) and the communicator backends
// (which hand the pointer to a library) may take its pointer. The device test
// double cpu:1 keeps its arrays in host memory, so a host helper that reads
// them with NDArray::data<T>() or raw_data() would work there and fail only
// on a GPU. To fail on the double too, data<T>() and raw_data() of a cpu:1
// array throw hspmd::Error "[ndarray] data: a cpu:1 (device test double)
// array read outside the kernel dispatch ..." unless the calling thread is
// inside a DeviceCodeScope (the dispatch opens one around every kernel, the
// communicator backends around taking a buffer) or an OpenMP parallel region
// (a kernel's worker threads). Arrays on the host (cpu:0) and on CUDA are
// not checked; the check costs one comparison per access of a host array.
#pragma once

namespace hspmd {

class DeviceCodeScope {
 public:
  DeviceCodeScope();
  ~DeviceCodeScope();
  DeviceCodeScope(const DeviceCodeScope&) = delete;
  DeviceCodeScope& operator=(const DeviceCodeScope&) = delete;
  // Whether the calling thread may take pointers of cpu:1 arrays now: inside
  // a scope (they nest), or in an OpenMP parallel region.
  static bool active();
};

}  // namespace hspmd

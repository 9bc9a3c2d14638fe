// Host bytes into an existing array (memory.h, copy_from_host): what a
// replayed CUDA graph reads is refreshed in place, never reallocated.
#include "hspmd/core/device_code.h"
#include "hspmd/core/error.h"
#include "kernels/memory.h"

namespace hspmd::kernels {

// Kernel-layer code: the target's pointer goes to the device's copy (the
// device double's host-read rule lets the dispatch's code take it).
void copy_from_host(Stream& s, const void* host, NDArray& out) {
  const DeviceCodeScope code;
  HSPMD_CHECK(out.valid() && out.is_contiguous() && out.device() == s.device(),
              "copy_from_host: the target must be a contiguous array on the stream's device ", s.device().str());
  copy_bytes(s, out.raw_data(), host, out.nbytes());
}

void copy_from_host(Stream& s, const NDArray& host, NDArray& out) {
  HSPMD_CHECK(host.device() == Device::cpu() && host.shape() == out.shape() && host.dtype() == out.dtype(),
              "copy_from_host: a host array of the target's shape ", shape_str(out.shape()), " and dtype ",
              dtype_name(out.dtype()), " expected, got ", shape_str(host.shape()), " ", dtype_name(host.dtype()),
              " on ", host.device().str());
  const NDArray h = host.contiguous();
  const DeviceCodeScope code;
  copy_from_host(s, h.raw_data(), out);
}

}  // namespace hspmd::kernels

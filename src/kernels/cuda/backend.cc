// The CUDA backend's registration (backend.h), compiled only in a build with
// CUDA (src/kernels/CMakeLists.txt lists `cuda` in backends.inc): its table
// is &cuda::<name> for every kernel of kernel_list.inc, so a kernel without
// a CUDA implementation (or with another signature) fails this file's
// compilation, not a run on a GPU. It also registers the CUDA device
// runtime (runtime.h) with core.
#include "hspmd/core/device_runtime.h"
#include "kernels/backend.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/runtime.h"

namespace hspmd::kernels::cuda {
namespace {

// cuda::to_device uploads a host array; one already on the stream's device
// (or none) is returned as it is, as on every backend.
NDArray to_device_entry(Stream& s, const NDArray& a) {
  if (!a.valid() || a.device() == s.device()) return a;
  return to_device(s, a);
}

bool rounds_output(Device) { return sdpa::built() && cudnn_attention_mode() != CudnnAttention::kOff; }

FusedAttentionReport report() {
  FusedAttentionReport r;
  r.cudnn_calls = cudnn_attention_calls();
  r.fallbacks = cudnn_attention_fallbacks();
  r.last_fallback = cudnn_attention_last_fallback();
  return r;
}

constexpr Backend make_backend() {
  Backend b;
  b.name = "cuda";
  b.device_type = DeviceType::CUDA;
#define HSPMD_KERNEL(name, ret, params, args, cpu) b.kernels.name = &cuda::name;
#define HSPMD_CPU_ONLY_KERNEL(name, ret, params, args, cpu)  // no CUDA entry: the dispatch says no_kernel
#include "kernels/kernel_list.inc"
#undef HSPMD_CPU_ONLY_KERNEL
#undef HSPMD_KERNEL
  b.kernels.to_device = &to_device_entry;
  b.fused_attention_rounds_output = &rounds_output;
  b.fused_attention_report = &report;
  return b;
}

constinit const Backend kBackend = make_backend();

}  // namespace

void register_backend() {
  register_device_runtime(DeviceType::CUDA, cuda_rt::runtime());
  kernels::register_backend(kBackend);
}

}  // namespace hspmd::kernels::cuda

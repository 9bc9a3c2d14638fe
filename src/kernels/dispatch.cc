// The kernel dispatch: every kernel of kernel_list.inc gets its public entry
// point here, generated from the list. The entry checks that its arrays live
// on the stream's device (each argument by its type: arrays, pointers to
// arrays, lists of them, attention blocks, Adam tensors), plus a kernel's
// own preconditions where it has some (entry_checks below), then calls the
// entry of the backend registered for the stream's device type
// (backend.h). A device type without a backend ends in no_kernel(), the one
// place that declares missing backend support. The call runs inside a
// DeviceCodeScope (device_code.h): the only code that may take the pointers
// of the device test double's arrays. The kernels composed of listed ones
// (clone, as_f32, document_starts_from_positions) follow.
#include <vector>

#include "hspmd/core/device_code.h"
#include "hspmd/core/error.h"
#include "kernels/attention.h"
#include "kernels/backend.h"
#include "kernels/basic.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd::kernels {

void no_kernel(const char* kernel, Device device) {
  fail("[kernels] ", kernel, ": no kernel for device ", device.str(), " in this build");
}

namespace {

// ---- the device check, one overload per kind of argument ----

void on_stream(const char* kernel, Device d, const NDArray& a) {
  if (a.valid() && !(a.device() == d))
    fail("[kernels] ", kernel, ": an array lives on ", a.device().str(), " but the stream on ", d.str());
}
void on_stream(const char* kernel, Device d, const NDArray* a) {
  if (a != nullptr) on_stream(kernel, d, *a);
}
void on_stream(const char* kernel, Device d, NDArray* a) { on_stream(kernel, d, static_cast<const NDArray*>(a)); }
void on_stream(const char* kernel, Device d, const std::vector<NDArray>& arrays) {
  for (const NDArray& a : arrays) on_stream(kernel, d, a);
}
void on_stream(const char* kernel, Device d, const AttentionBlock& blk) {
  for (const NDArray* a : {&blk.q, &blk.k, &blk.v}) on_stream(kernel, d, *a);
}
void on_stream(const char* kernel, Device d, const std::vector<AdamTensor>& tensors) {
  for (const AdamTensor& t : tensors)
    for (const NDArray* a : {static_cast<const NDArray*>(t.param), t.grad, static_cast<const NDArray*>(t.exp_avg),
                             static_cast<const NDArray*>(t.exp_avg_sq), static_cast<const NDArray*>(t.param_bf16)})
      on_stream(kernel, d, a);
}
void on_stream(const char* kernel, Device d, const GemmEpilogue& e) {
  on_stream(kernel, d, e.addend);
  on_stream(kernel, d, e.bias);
}
void on_stream(const char* kernel, Device d, const AdamFactors& f) {
  if (f.control != nullptr) on_stream(kernel, d, f.control);  // the only array among the factors
}
template <typename T>
void on_stream(const char*, Device, const T&) {}  // not an array: shapes, flags, factors

template <typename... A>
void arrays_on_stream(const char* kernel, const Stream& s, const A&... args) {
  (on_stream(kernel, s.device(), args), ...);
}

// ---- a kernel's own preconditions, before the device check ----
// An overload whose parameters drift from its kernel's list entry is never
// called (the generic one is chosen instead) and only shows as unused: an
// error here, not a warning.
#pragma GCC diagnostic error "-Wunused-function"
// entry_checks(KernelTag<K>, ...) returns true when it has also checked the
// devices (the generic device check is then skipped).

template <KernelId K>
struct KernelTag {};

template <KernelId K, typename... A>
bool entry_checks(KernelTag<K>, const char*, Stream&, const A&...) {
  return false;
}

bool entry_checks(KernelTag<KernelId::matmul>, const char*, Stream&, const NDArray&, const NDArray& b, bool,
                  bool trans_b, NDArray& out, GemmCompute, GemmEpilogue e) {
  const NDArray* addend = e.addend;
  if (addend != nullptr)
    HSPMD_CHECK(out.dtype() == DType::F32 && addend->dtype() == DType::F32 && addend->shape() == out.shape() &&
                    addend->raw_data() != out.raw_data(),
                "matmul: the addend must be f32 of the output's shape, the output f32 and not the addend");
  if (e.bias != nullptr) {
    HSPMD_CHECK(addend == nullptr, "matmul: an addend and a bias together");
    const int64_t n = b.ndim() == 2 ? b.dim(trans_b ? 0 : 1) : -1;
    HSPMD_CHECK(e.bias->dtype() == DType::F32 && e.bias->ndim() == 1 && e.bias->dim(0) == n &&
                    e.bias->is_contiguous() && out.ndim() >= 1 && out.dim(-1) == n,
                "matmul: the bias must be f32 [N], contiguous, N = b's output dim and out's last dim, got ",
                dtype_name(e.bias->dtype()), shape_str(e.bias->shape()), " for ", shape_str(out.shape()));
  }
  return false;
}

bool entry_checks(KernelTag<KernelId::rms_norm_backward>, const char*, Stream&, const NDArray&, const NDArray& x,
                  const NDArray&, float, NDArray&, NDArray&, const NDArray* addend, NDArray* dx_bf16) {
  if (addend != nullptr)
    HSPMD_CHECK((addend->dtype() == DType::F32 || addend->dtype() == DType::BF16) &&
                    addend->numel() == x.numel() && addend->is_contiguous(),
                "rms_norm_backward: the addend must be f32 or bf16 and contiguous, of x's size");
  if (dx_bf16 != nullptr)
    HSPMD_CHECK(dx_bf16->dtype() == DType::BF16 && dx_bf16->numel() == x.numel() && dx_bf16->is_contiguous(),
                "rms_norm_backward: dx_bf16 must be bf16 and contiguous, of x's size");
  return false;
}

bool entry_checks(KernelTag<KernelId::swiglu_backward>, const char*, Stream&, const NDArray&, const NDArray& gate,
                  const NDArray&, NDArray&, NDArray&, NDArray* out) {
  if (out != nullptr)
    HSPMD_CHECK(out->numel() == gate.numel() && out->is_contiguous(), "swiglu_backward: out size");
  return false;
}

// to_host and sum_of_squares read device values on the host: a wait, which
// a step being recorded cannot have (RecordingScope). Then the generic
// checks (false).
bool entry_checks(KernelTag<KernelId::to_host>, const char*, Stream&, const NDArray&) {
  refuse_host_wait("a read of device values (kernels::to_host)");
  return false;
}

bool entry_checks(KernelTag<KernelId::sum_of_squares>, const char*, Stream&, const std::vector<NDArray>&) {
  refuse_host_wait("a read of device values (kernels::sum_of_squares)");
  return false;
}

// to_device's array comes from the host (or is there already).
bool entry_checks(KernelTag<KernelId::to_device>, const char*, Stream& s, const NDArray& a) {
  if (a.valid() && !(a.device() == s.device()) && !(a.device() == Device::cpu()))
    fail("[kernels] to_device: the array lives on ", a.device().str(), ", neither on the host nor on ",
         s.device().str());
  return true;
}

// The backend's entry `f` for the stream's device type; no_kernel when the
// type has no backend, or its backend leaves a CPU-only kernel out.
template <typename F>
F entry_of(const char* kernel, const Stream& s, F KernelTable::*f) {
  const Backend* b = backend_for(s.device().type);
  if (b == nullptr || b->kernels.*f == nullptr) no_kernel(kernel, s.device());
  return b->kernels.*f;
}

}  // namespace

// ---- the entry points, one per kernel of the list ----

#define HSPMD_KERNEL(name, ret, params, args, cpu)                                       \
  ret name(Stream& s, HSPMD_UNPAREN params) {                                            \
    const DeviceCodeScope code;                                                          \
    if (!entry_checks(KernelTag<KernelId::name>{}, #name, s, HSPMD_UNPAREN args))        \
      arrays_on_stream(#name, s, HSPMD_UNPAREN args);                                    \
    return entry_of(#name, s, &KernelTable::name)(s, HSPMD_UNPAREN args);                \
  }
#include "kernels/kernel_list.inc"
#undef HSPMD_KERNEL

// ---- composed of the listed kernels ----

// A host helper: the positions come to the host (a copy from a device; the
// array itself on the CPU), then the CPU backend's rules run there.
std::vector<int32_t> document_starts_from_positions(Stream& s, const NDArray& positions, int64_t first) {
  arrays_on_stream("document_starts_from_positions", s, positions);
  cpu::require_contiguous("attention", positions);
  return cpu::document_starts_from_positions(to_host(s, positions), first);
}

NDArray clone(Stream& s, const NDArray& a) {
  arrays_on_stream("clone", s, a);
  if (s.device() == Device::cpu()) return a.clone();  // the host's own copy
  NDArray out = NDArray::empty(a.shape(), a.dtype(), s.device());
  copy(s, a, out);
  return out;
}

NDArray as_f32(Stream& s, const NDArray& a) {
  return a.valid() && a.dtype() == DType::BF16 ? cast(s, a, DType::F32) : a;
}

bool fused_attention_rounds_output(Device device) {
  const Backend* b = backend_for(device.type);
  return b != nullptr && b->fused_attention_rounds_output != nullptr && b->fused_attention_rounds_output(device);
}

FusedAttentionReport fused_attention_report() {
  for (const Backend* b : registered_backends())
    if (b->fused_attention_report != nullptr) return b->fused_attention_report();
  return {};
}

}  // namespace hspmd::kernels

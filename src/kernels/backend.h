// Backends as a registry (docs/architecture.md, "Kernels and devices"): a
// backend is a table with one function per kernel of kernel_list.inc, bound
// to a device type, and registered once at start-up. The dispatch
// (dispatch.cc) looks the stream's device type up here and calls the
// table's entry; nothing in src/kernels/ switches over device types.
//
// Which backends a build has is the build's choice (src/kernels/
// CMakeLists.txt writes backends.inc: cpu, and cuda when the build has
// CUDA); registry.cc registers each listed backend `name` by calling
// kernels::name::register_backend(), defined in the backend's own folder.
// A backend also registers its device runtime with core
// (hspmd/core/device_runtime.h) there. Only src/kernels/ and the kernel
// tests include this header.
#pragma once

#include <vector>

#include "hspmd/core/cpu_isa.h"
#include "hspmd/core/device.h"
#include "hspmd/core/ndarray.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

// The parameter list or argument list of a kernel_list.inc line, unwrapped.
#define HSPMD_UNPAREN(...) __VA_ARGS__

namespace hspmd::kernels {

// The kernels of the list, by name: KernelId::add, ... (and kCount).
enum class KernelId : int {
#define HSPMD_KERNEL(name, ret, params, args, cpu) name,
#include "kernels/kernel_list.inc"
#undef HSPMD_KERNEL
  kCount
};

// A backend's implementation of every kernel: the public kernel's contract,
// the stream first (one of the backend's device type; the dispatch has
// checked that the arrays live on its device). Filled from the list by each
// backend (a missing function is a compile error there), never null in a
// registered backend.
struct KernelTable {
#define HSPMD_KERNEL(name, ret, params, args, cpu) ret (*name)(Stream & s, HSPMD_UNPAREN params) = nullptr;
#include "kernels/kernel_list.inc"
#undef HSPMD_KERNEL
};

struct Backend {
  const char* name = "";                  // "cpu", "cuda", "cpu-avx2" (a CPU variant, for tests)
  DeviceType device_type = DeviceType::CPU;
  KernelTable kernels;
  // attention.h's fused_attention_rounds_output / fused_attention_report
  // for this backend's devices; nullptr: false / an empty report.
  bool (*fused_attention_rounds_output)(Device device) = nullptr;
  FusedAttentionReport (*fused_attention_report)() = nullptr;
};

// Makes `backend` the one for its device type (the last registration wins).
// Called from the backends' register_backend() functions, which registry.cc
// calls once, before main and before the first kernel runs; `backend` must
// outlive the process. Not thread-safe: not for use after start-up.
void register_backend(const Backend& backend);

// The backend registered for `type`, or nullptr.
const Backend* backend_for(DeviceType type);

// Every registered backend, CPU first.
std::vector<const Backend*> registered_backends();

// The names of the kernels of the list, in its order.
std::vector<const char*> kernel_names();

namespace cpu {
// The CPU backend with the ISA variant `isa` in place of the chosen one
// (tests compare every variant with the baseline); nullptr when the build
// has no such variant. backend_for(DeviceType::CPU) runs the chosen one.
const Backend* variant_backend(CpuIsa isa);
}  // namespace cpu

}  // namespace hspmd::kernels

// The backend registry (backend.h). The backends this build has are listed
// in backends.inc, which src/kernels/CMakeLists.txt writes into the build
// folder (HSPMD_BACKEND(cpu), and HSPMD_BACKEND(cuda) with CUDA): the build,
// not an #ifdef, says which exist.
#include <array>

#include "hspmd/core/error.h"
#include "kernels/backend.h"

namespace hspmd::kernels {

#define HSPMD_BACKEND(name) \
  namespace name {          \
  void register_backend();  \
  }
#include "backends.inc"
#undef HSPMD_BACKEND

namespace {

constexpr size_t kDeviceTypes = static_cast<size_t>(DeviceType::CUDA) + 1;

std::array<const Backend*, kDeviceTypes>& slots() {
  static std::array<const Backend*, kDeviceTypes> s{};
  return s;
}

// Registers the build's backends once; the first lookup or the static
// initializer below, whichever runs first.
bool register_all() {
#define HSPMD_BACKEND(name) name::register_backend();
#include "backends.inc"
#undef HSPMD_BACKEND
  return true;
}

bool registered() {
  static const bool done = register_all();
  return done;
}

// Before main: a device runtime (core's allocators and streams of a CUDA
// device) must be there before the first array is allocated on it.
[[maybe_unused]] const bool g_registered = registered();

}  // namespace

void register_backend(const Backend& backend) {
  const auto t = static_cast<size_t>(backend.device_type);
  HSPMD_CHECK(t < kDeviceTypes, "register_backend: device type of backend ", backend.name);
  slots()[t] = &backend;
}

const Backend* backend_for(DeviceType type) {
  registered();
  const auto t = static_cast<size_t>(type);
  return t < kDeviceTypes ? slots()[t] : nullptr;
}

std::vector<const Backend*> registered_backends() {
  registered();
  std::vector<const Backend*> out;
  for (const Backend* b : slots())
    if (b != nullptr) out.push_back(b);
  return out;
}

std::vector<const char*> kernel_names() {
  return {
#define HSPMD_KERNEL(name, ret, params, args, cpu) #name,
#include "kernels/kernel_list.inc"
#undef HSPMD_KERNEL
  };
}

}  // namespace hspmd::kernels

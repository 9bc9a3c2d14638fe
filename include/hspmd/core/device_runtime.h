// A device type's runtime, registered with core: what Device, Allocator,
// Stream and Event need from a backend (docs/architecture.md, "Kernels and
// devices"). Core has the CPU's (host memory, inline streams); another
// device type's runtime is registered by its backend from the backend's own
// files (CUDA: src/kernels/cuda/backend.cc, compiled only in a build with
// CUDA), before main. Core never names a backend: a device type without a
// registered runtime is one "this build has no <TYPE> backend".
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "hspmd/core/device.h"

namespace hspmd {

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  // Devices of this type this process sees (0: none; see device_count_error).
  virtual int device_count() = 0;
  // Why device_count() is 0 when the runtime said more than "no device"; "".
  virtual std::string device_count_error() { return ""; }
  // The process-wide allocator of device `index` (thread-safe; throws
  // hspmd::Error when memory is exhausted).
  virtual Allocator& allocator(int index) = 0;
  // Stream `id` of device `index`: 0 the default, 1 the communication one.
  virtual Stream& stream(int index, int id) = 0;
  // Later work of `stream` waits for `event` (recorded on this type's stream).
  virtual void stream_wait(Stream& stream, const Event& event) = 0;
  // Makes `index` the calling thread's current device.
  virtual void bind_thread(int index) = 0;
  // Copies `bytes` in `stream`'s order (device.h, copy_bytes).
  virtual void copy_bytes(Stream& stream, void* dst, const void* src, size_t bytes) = 0;
  // A native event recorded on `stream` (shared by copies of an Event), or
  // nullptr: then Event synchronizes the stream and takes a timestamp.
  virtual std::shared_ptr<void> record_event(Stream& stream) = 0;
  virtual void synchronize_event(void* event) = 0;
  virtual double elapsed_ms(void* start, void* end) = 0;
  // Page-locked host memory for staging this type's buffers, or nullptr.
  virtual Allocator* staging_allocator() { return nullptr; }

  // Device graphs (CUDA graphs; docs/cuda.md, "CUDA graphs"): whether this
  // type's streams can be captured and replayed. The CPU's cannot.
  virtual bool can_capture() { return false; }
  // From now until end_capture, the work the calling thread queues on
  // `stream` is recorded, not run. Host copies queued meanwhile are staged
  // in page-locked blocks the graph keeps; what must happen on the host at
  // each launch (a kernel's pending checks) is kept with it too.
  virtual void begin_capture(Stream& stream);
  // The recorded work as a graph (held by the handle), or hspmd::Error with
  // the runtime's reason, the capture discarded; `stream` is no longer
  // capturing either way, and nothing recorded has run.
  virtual std::shared_ptr<void> end_capture(Stream& stream);
  // Queues one run of `graph` (from end_capture on the same stream).
  virtual void launch_graph(const std::shared_ptr<void>& graph, Stream& stream);
};

// Makes `runtime` the one of device type `type` (it must outlive the
// process). For backends' registration before main: not thread-safe.
void register_device_runtime(DeviceType type, DeviceRuntime& runtime);

// The runtime of `type` (the CPU's always), or nullptr when none is registered.
DeviceRuntime* device_runtime(DeviceType type);

}  // namespace hspmd

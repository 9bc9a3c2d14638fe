// The CUDA device runtime behind core's Device, Allocator, Stream and Event
// (built only with HSPMD_HAVE_CUDA; docs/cuda.md), registered with core as
// its DeviceRuntime by the CUDA backend (backend.cc). Internal to the CUDA
// backend: nothing outside src/kernels/cuda/ includes it.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "hspmd/core/device.h"
#include "hspmd/core/device_runtime.h"

namespace hspmd::cuda_rt {

// CUDA devices this process sees (0 when the driver or a device is missing).
int device_count();

// Why device_count() is 0 when the runtime said more than "no device"
// (cudaGetDeviceCount's error: no driver, a driver older than this
// runtime, an MPS server that refused the client, ...); "" otherwise.
std::string device_count_error();

// The caching allocator of device `index`: freed blocks are kept by size and
// reused (no cudaMalloc / cudaFree in a step once the sizes repeat); when
// cudaMalloc fails the cache is released and the allocation tried once more,
// then "[cuda:N] out of memory allocating B bytes (C in use, peak P): ..."
// is thrown.
Allocator& allocator(int index);

// The default stream (id 0) of device `index`: a stream of its own (not the
// legacy NULL stream), so that work on it can be captured in CUDA graphs.
Stream& default_stream(int index);

// The communication stream (id 1) of device `index`, non-blocking too.
Stream& comm_stream(int index);
// cudaStreamWaitEvent(stream, event).
void stream_wait(Stream& stream, void* event);

// Page-locked host memory (cudaHostAlloc), blocks cached by size.
Allocator& pinned_allocator();

// cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault) on `stream`.
void copy_bytes(Stream& stream, void* dst, const void* src, size_t bytes);

// Events on a CUDA stream (timing enabled), shared by copies of an Event.
std::shared_ptr<void> record_event(Stream& stream);
void synchronize_event(void* event);
double elapsed_ms(void* start, void* end);

// CUDA graphs (DeviceRuntime::begin_capture). Whether `stream` is being
// captured now.
bool capturing(Stream& stream);
// DeviceRuntime's capture calls (device_runtime.h) on CUDA: capture in
// relaxed mode (the allocator may still call cudaMalloc), the token-id
// checks flushed first.
void begin_capture(Stream& stream);
std::shared_ptr<void> end_capture(Stream& stream);
void launch_graph(const std::shared_ptr<void>& graph, Stream& stream);
// Keeps `held` as long as the graph the calling thread is capturing (a
// page-locked block a recorded copy reads at each launch).
void keep_for_graph(std::shared_ptr<void> held);
// Runs `f` on the host at each launch of the graph the calling thread is
// capturing, before the graph's work is queued (a kernel's pending checks).
void at_each_launch(std::function<void()> f);
// `bytes` of host memory `src` on the device at `dst`, in `stream`'s order;
// while `stream` is captured, through a page-locked copy the graph keeps
// (a recorded copy from pageable memory is not allowed).
void copy_from_host(Stream& stream, void* dst, const void* src, size_t bytes);

// Throws "[cuda] <call>: <error string>" unless `status` (a cudaError_t) is
// cudaSuccess.
void check(int status, const char* call);

// Makes `index` the calling thread's current device.
void set_device(int index);

// The functions above as core's DeviceRuntime (process lifetime).
DeviceRuntime& runtime();

}  // namespace hspmd::cuda_rt

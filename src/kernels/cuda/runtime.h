// The CUDA device runtime behind core's Device, Allocator, Stream and Event
// (built only with HSPMD_HAVE_CUDA; docs/cuda.md), registered with core as
// its DeviceRuntime by the CUDA backend (backend.cc). Internal to the CUDA
// backend: nothing outside src/kernels/cuda/ includes it.
#pragma once

#include <cstddef>
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

// Throws "[cuda] <call>: <error string>" unless `status` (a cudaError_t) is
// cudaSuccess.
void check(int status, const char* call);

// Makes `index` the calling thread's current device.
void set_device(int index);

// The functions above as core's DeviceRuntime (process lifetime).
DeviceRuntime& runtime();

}  // namespace hspmd::cuda_rt

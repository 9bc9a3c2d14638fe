#include "hspmd/core/device.h"

#include <algorithm>
#include <ctime>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "hspmd/core/device_runtime.h"
#include "hspmd/core/error.h"
#include "hspmd/core/options.h"

namespace hspmd {

std::string Device::str() const {
  return (type == DeviceType::CPU ? "cpu:" : "cuda:") + std::to_string(index);
}

void Allocator::account_alloc(size_t bytes) {
  size_t now = current_.fetch_add(bytes) + bytes;
  size_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

namespace {

// "CPU", "CUDA": a device type as error messages name its backend.
const char* backend_name(DeviceType type) { return type == DeviceType::CPU ? "CPU" : "CUDA"; }

// The runtime of `device` after require_device().
DeviceRuntime& runtime_of(Device device) {
  require_device(device);
  return *device_runtime(device.type);
}

}  // namespace

bool built_with_cuda() { return device_runtime(DeviceType::CUDA) != nullptr; }

int cuda_device_count() {
  DeviceRuntime* r = device_runtime(DeviceType::CUDA);
  return r != nullptr ? r->device_count() : 0;
}

Device parse_device_name(const std::string& text, const std::string& flag) {
  if (text == "cpu" || text == "cpu:0") return Device::cpu();
  if (text == "cpu:1") return Device::host_double();
  if (text == "cuda") return Device::cuda(0);
  if (text.rfind("cuda:", 0) == 0 && text.size() > 5 && text.size() <= 9 &&
      text.find_first_not_of("0123456789", 5) == std::string::npos)
    return Device::cuda(std::stoi(text.substr(5)));
  fail(options_tag(), " ", flag, ": '", text.size() > 40 ? text.substr(0, 40) + "..." : text,
       "' (expected cpu, cuda or cuda:N)");
}

Device rank_device(const std::string& text, const std::string& flag, int fallback_rank) {
  const Device parsed = parse_device_name(text, flag);
  if (text != "cuda") return parsed;
  int local = fallback_rank;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"})
    if (const char* v = std::getenv(var)) {
      local = std::atoi(v);
      break;
    }
  const int n = cuda_device_count();
  return Device::cuda(n > 0 ? std::max(0, local) % n : 0);
}

void require_device(Device device) {
  if (device.type == DeviceType::CPU) {
    if (device.index != 0 && !(device == Device::host_double()))
      fail("[device] ", device.str(), ": the host is cpu:0 (and cpu:1 its device test double)");
    return;
  }
  DeviceRuntime* r = device_runtime(device.type);
  if (r == nullptr) fail("[device] ", device.str(), ": this build has no ", backend_name(device.type), " backend");
  const int n = r->device_count();
  if (n == 0) {
    const std::string why = r->device_count_error();  // a broken driver or MPS is not "no device"
    fail("[device] ", device.str(), ": no ", backend_name(device.type), " device is visible to this process",
         why.empty() ? "" : " (cudaGetDeviceCount: " + why + ")");
  }
  if (device.index < 0 || device.index >= n)
    fail("[device] ", device.str(), ": no such device (", n, " ", backend_name(device.type), " device",
         n == 1 ? "" : "s", " visible)");
}

Allocator& allocator_for(Device device) {
  if (device.type == DeviceType::CPU) return device_runtime(DeviceType::CPU)->allocator(0);
  return runtime_of(device).allocator(device.index);
}

Stream& default_stream(Device device) { return runtime_of(device).stream(device.index, 0); }

Stream& comm_stream(Device device) { return runtime_of(device).stream(device.index, 1); }

void stream_wait(Stream& stream, const Event& event) {
  HSPMD_CHECK(event.recorded(), "stream_wait on an event never recorded");
  device_runtime(stream.device().type)->stream_wait(stream, event);
}

void bind_thread(Device device) {
  if (DeviceRuntime* r = device_runtime(device.type)) r->bind_thread(device.index);
}

namespace {
thread_local SideStreamScope* t_side_stream = nullptr;
}

SideStreamScope::SideStreamScope() {
  HSPMD_CHECK(t_side_stream == nullptr, "SideStreamScope nested on one thread");
  t_side_stream = this;
}

SideStreamScope::~SideStreamScope() {
  t_side_stream = nullptr;
  for (auto& f : held_) f();
}

void SideStreamScope::release() {
  SideStreamScope* self = t_side_stream;
  t_side_stream = nullptr;  // the frees below happen now
  std::vector<std::function<void()>> held = std::move(held_);
  held_.clear();
  for (auto& f : held) f();
  t_side_stream = self;
}

SideStreamScope* SideStreamScope::current() { return t_side_stream; }

Allocator& staging_host_allocator() {
  // A device type's page-locked memory when it has a visible device.
  for (int t = 0; t <= static_cast<int>(DeviceType::CUDA); ++t)
    if (DeviceRuntime* r = device_runtime(static_cast<DeviceType>(t)); r != nullptr && t != 0 && r->device_count() > 0)
      if (Allocator* staging = r->staging_allocator()) return *staging;
  return allocator_for(Device::cpu());
}

void copy_bytes(Stream& stream, void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  DeviceRuntime* r = device_runtime(stream.device().type);
  HSPMD_CHECK(r != nullptr, "copy_bytes on a ", stream.device().str(), " stream in a build without its backend");
  r->copy_bytes(stream, dst, src, bytes);
}

void Event::record(Stream& stream) {
  stream_ = &stream;
  native_ = device_runtime(stream.device().type)->record_event(stream);
  if (native_) return;
  // A stream without native events (the CPU's): its work ran when queued.
  // While recording, nothing to wait for either way.
  if (RecordingScope::current() == nullptr) stream.synchronize();
  at_ = std::chrono::steady_clock::now();
}

namespace {
thread_local const RecordingScope* t_recording = nullptr;
}

RecordingScope::RecordingScope(std::string what) : what_(std::move(what)), outer_(t_recording) { t_recording = this; }

RecordingScope::~RecordingScope() { t_recording = outer_; }

const RecordingScope* RecordingScope::current() { return t_recording; }

void refuse_host_wait(const char* wait) {
  if (t_recording != nullptr)
    fail("[device] ", wait, " while recording ", t_recording->what(),
         ": the recorded work has not run, so the host cannot wait for it or read its values (a CUDA graph "
         "records no host work)");
}

void Stream::synchronize() {
  refuse_host_wait("a wait for the stream");
  wait();
}

void Event::synchronize() const {
  HSPMD_CHECK(recorded(), "Event::synchronize before record");
  refuse_host_wait("a wait for an event");
  if (native_) device_runtime(stream_->device().type)->synchronize_event(native_.get());
}

double Event::elapsed_ms(const Event& start) const {
  HSPMD_CHECK(recorded() && start.recorded(), "Event::elapsed_ms of an event never recorded");
  if (native_ || start.native_) {
    HSPMD_CHECK(native_ && start.native_, "Event::elapsed_ms between a CUDA and a CPU event");
    return device_runtime(stream_->device().type)->elapsed_ms(start.native_.get(), native_.get());
  }
  return std::chrono::duration<double, std::milli>(at_ - start.at_).count();
}

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

void WorkTimer::begin() {
  if (stream_ != nullptr)
    start_.record(*stream_);
  else
    cpu0_ = process_cpu_seconds();
}

double WorkTimer::end_s() {
  if (stream_ == nullptr) return process_cpu_seconds() - cpu0_;
  HSPMD_CHECK(start_.recorded(), "WorkTimer::end_s before begin");
  Event end;
  end.record(*stream_);
  end.synchronize();
  return end.elapsed_ms(start_) * 1e-3;
}

}  // namespace hspmd

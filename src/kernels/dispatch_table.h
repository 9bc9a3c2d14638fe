// The dispatch's entry points and how each runs on CUDA: the listing that
// tests/kernels/test_cuda_paths.cc checks against the public kernel headers
// (kernels.h, basic.h, attention.h, memory.h), so that no kernel or host
// helper is added without a CUDA path (docs/cuda.md, "Host helpers").
#pragma once

#include <span>

namespace hspmd::kernels {

struct DispatchEntry {
  enum class Path {
    kCuda,      // the dispatch's switch calls cuda::<name> for a CUDA stream
    kComposed,  // made of other entries (and host code on their results): any device
  };
  const char* name;  // the public function's name
  Path path;
  // kCuda in a build with CUDA: the address of cuda::<name> (taking it fails
  // the build when the CUDA backend lacks the function); else nullptr.
  const void* cuda;
};

// Every public function of the four headers that takes a Stream (dispatch.cc).
std::span<const DispatchEntry> dispatch_entries();

}  // namespace hspmd::kernels

// The cuDNN graphs of attention_cudnn.h for a build without cuDNN's or the
// cudnn_frontend's headers (HSPMD_CUDNN off or not found): every graph is
// refused, so attention runs on our own kernels (docs/cuda.md).
#include "kernels/cuda/attention_cudnn.h"

namespace hspmd::kernels::cuda::sdpa {
namespace {

constexpr const char* kNoCudnn =
    "this build has no cuDNN attention (HSPMD_CUDNN=OFF, or cudnn.h or the cudnn_frontend headers were not found: "
    "scripts/fetch_cudnn_frontend.sh)";

}  // namespace

bool forward(Stream&, const Shape&, const Tensors&, std::string* why) {
  *why = kNoCudnn;
  return false;
}

bool backward(Stream&, const Shape&, const Tensors&, std::string* why) {
  *why = kNoCudnn;
  return false;
}

bool built() { return false; }

int cudnn_version(std::string* why) {
  *why = kNoCudnn;
  return 0;
}

}  // namespace hspmd::kernels::cuda::sdpa

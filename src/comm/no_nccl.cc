// The build without NCCL (no CUDA or no nccl.h): its factory refuses in one line.
#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"

namespace hspmd {

bool built_with_nccl() { return false; }

int nccl_version() { fail("[comm] NCCL: this build has no NCCL backend (it needs CUDA and nccl.h)"); }

std::unique_ptr<Communicator> make_nccl_communicator(Communicator&, Device device) {
  fail("[comm] NCCL: this build has no NCCL backend (it needs CUDA and nccl.h), so ", device.str(),
       " cannot communicate through it");
}

}  // namespace hspmd

// The build without MPI (HSPMD_MPI off or MPI not found): the world is the
// single-process stub.
#include "hspmd/comm/communicator.h"

namespace hspmd {

std::unique_ptr<Communicator> make_world_communicator() { return make_single_process_communicator(); }

bool built_with_mpi() { return false; }

}  // namespace hspmd

// A GoogleTest main for tests run under mpirun: one world communicator for
// the whole run (test_world()), full output from rank 0 only (other ranks
// print just their failed assertions, prefixed with their rank), and one exit
// status for all ranks: non-zero when any rank failed.
#pragma once

#include "hspmd/comm/communicator.h"

namespace hspmd::testing {

// The world of this run (MPI under mpirun, else the single-process stub).
Communicator& test_world();

}  // namespace hspmd::testing

// A shadow communicator: one member of a group of `size` ranks, run alone
// in this process (docs/profiling.md). It lets a single process execute one
// rank of a multi-rank plan, for timing: what the rank computes is real,
// what it would receive is not. Data values are meaningless afterwards.
//  * all_reduce and broadcast leave the buffer as it is (the local values);
//  * reduce_scatter copies the member's own piece of `send` into `recv`;
//  * all_gather copies the member's piece into its place of `recv` and
//    zero-fills the others' places;
//  * sends are discarded, receives are filled with zeros;
//  * every request completes at once (wait_all only empties the list);
//  * group(ranks) is a shadow of ranks.size() members in which this member
//    sits at its position in `ranks`, cached by member list.
// Byte counters count what a real backend would (communicator.h), shared by
// the world and its groups. Not thread-safe, like every communicator.
#pragma once

#include <memory>

#include "hspmd/comm/communicator.h"

namespace hspmd {

// Member `rank` of a shadow group of `size` members. Throws hspmd::Error
// "[comm] shadow: ..." for size < 1 or a rank outside [0, size).
std::unique_ptr<Communicator> make_shadow_communicator(int size, int rank);

}  // namespace hspmd

// A one-process simulator of the resolver's execution model
// (hspmd/resolve/resolver.h): the reference semantics that an executor (MPI,
// NCCL) must reproduce, and the way tests check a resolution on real data
// without any process. Test support (library hspmd_resolve_simulator, linked
// by the tests that use it): no production code runs it.
//
// All arrays are f32 and contiguous. Every function is pure: inputs are
// never modified, outputs are fresh arrays.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/ndarray.h"
#include "hspmd/resolve/resolver.h"

namespace hspmd {

// The shards of `global` (f32, of the annotation's global shape) under
// `annotation`: rank -> a fresh array of its local_box. Where the value is a
// partial sum, the terms are random integers (seeded by `seed`) completed by
// one last term so that they add up to the tensor exactly when `global` holds
// integer values (dup copies of a term are equal). Throws hspmd::Error
// "[simulate] ..." for a non-f32 array and the annotation layer's errors when
// the annotation does not fit the shape.
std::map<int, NDArray> make_shards(const NDArray& global, const Annotation& annotation, uint64_t seed);

// Runs `resolution` on `inputs` (rank -> its source shard, as make_shards
// gives) and returns rank -> final buffer for every rank that holds one
// afterwards. Phases run as the execution model says: each rank's phases in
// order; collectives matched across the members of their group by their order
// among that rank's ops with the same kind and group; point-to-point messages
// matched per (sender, receiver) pair in order. Throws InternalError on any
// inconsistency: a phase whose in_box is not what the rank holds, a read
// outside in_box, a write outside out_box, a fresh buffer not fully written,
// members disagreeing on a collective, a message whose boxes differ from
// what the receiver expects, a deadlock or an unmatched op.
std::map<int, NDArray> simulate(const Resolution& resolution, const std::map<int, NDArray>& inputs);

// "" when `outputs` are exactly the shards of `global` under `annotation`
// (where it is partial: dup copies of a term agree and the terms add up to
// the tensor), otherwise a one-line description of the first mismatch
// ("rank 3: element [0, 5] is 2, expected 7", "rank 4: missing", ...).
std::string check_shards(const NDArray& global, const Annotation& annotation,
                         const std::map<int, NDArray>& outputs);

}  // namespace hspmd

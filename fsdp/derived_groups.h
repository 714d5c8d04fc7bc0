#pragma once
// The groups fully_shard derives from a unit's communicator, made once per (communicator, kind)
// and shared by every unit that asks for the same, for as long as one of them holds it:
//   - reshard_after_forward(int) ([Note: post-forward group] in fsdp/flat_param_handle.h): k
//     consecutive ranks of the communicator (e.g. the ranks of one node), inside which a unit
//     resharded after forward all-gathers again for backward;
//   - separate_reduce_communicator(true): a duplicate of the communicator (same ranks, same
//     order) that the units' gradient reductions run on ([Note: reduce communicator]).
//
// [Note: reduce communicator] Collectives on one communicator complete in the order they were
// issued (NCCL runs them on one stream; the MPI backend progresses one queue per communicator), so
// a reduce-scatter issued after backward computed a unit's gradients waits behind the prefetched
// all-gather of the next unit, and the other way round. With separate_reduce_communicator(true)
// the reductions (reduce-scatters, NO_SHARD's all-reduces, quantized all-to-alls) run on a
// duplicate of the unit's communicator, so the two kinds can progress at once where the
// transport allows it; HSDP's replicate all-reduce stays on the replicate group. Each
// communicator keeps its own counters: the reductions are counted on the duplicate.
//
// [Note: derived group lifetime] The cache keeps weak references: a derived group is owned by the
// units that use it (their FSDPConfig) and by whoever else holds the returned pointer, and is
// freed (MPI_Comm_free on MPI) when the last of them is destroyed, so a program that destroys its
// model before it finalises MPI frees the groups in order. A unit made after that makes the group
// again (collective over the communicator, as the first time: every rank makes and destroys its
// units alike).

#include <cstddef>
#include <memory>
#include <string>

#include "fsdp_cpp/comm/communicator.h"

namespace fsdp {

/// "" when `ranks` is a valid post-forward group size for a communicator of `size` ranks (it
/// divides it and is at least 2), else what is wrong and which sizes would do.
std::string post_forward_group_size_error(int ranks, int size);

/// The group of `ranks` consecutive ranks of `comm` this rank belongs to (ranks r - r % `ranks`
/// to that plus `ranks` - 1, ranked in that order). Collective over `comm` the first time for a
/// (communicator, size) pair: every rank calls it in the same order with the same size. Later
/// calls return the same group without communicating, so units share their groups. `ranks` must
/// pass post_forward_group_size_error.
std::shared_ptr<comm::Communicator> post_forward_group(const std::shared_ptr<comm::Communicator>& comm, int ranks);

/// A duplicate of `comm`: the same ranks in the same order, its own collectives' order and
/// counters. Collective over `comm` the first time for a communicator, as post_forward_group.
std::shared_ptr<comm::Communicator> reduce_group(const std::shared_ptr<comm::Communicator>& comm);

/// How many derived groups are alive in the cache (for tests: 0 once every unit that used one,
/// and every other holder, is gone). [Note: derived group lifetime]
size_t cached_derived_groups();

}  // namespace fsdp

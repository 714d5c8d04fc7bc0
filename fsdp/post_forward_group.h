#pragma once
// The groups of reshard_after_forward(int) ([Note: post-forward group] in
// fsdp/flat_param_handle.h): k consecutive ranks of a unit's communicator (e.g. the ranks of one
// node), inside which a unit resharded after forward all-gathers again for backward.

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

}  // namespace fsdp

#pragma once
// A c10d::Backend for a world of one rank, in this process: every collective is a copy or a no-op.
// The fuzz harness uses it to run the collective loaders (fsdp::dcp::load, fsdp::load_pretrained)
// on a one-rank fully_shard model without MPI or threads.

#include <memory>

#include "fsdp_cpp/comm/communicator.h"

namespace fsdp::fuzz {

/// A Communicator over a one-rank world (world rank 0).
std::shared_ptr<comm::Communicator> one_rank_communicator();

}  // namespace fsdp::fuzz

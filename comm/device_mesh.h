#pragma once
// A 2-D mesh of ranks for hybrid sharding (HSDP): the world split into replicate groups of equal
// shard groups. With shard size S on W ranks, rank r belongs to shard group r / S (ranks
// S*(r/S) .. S*(r/S)+S-1, typically the ranks of one node) and to replicate group r % S (ranks
// r % S, r % S + S, ...). Parameters are sharded inside a shard group; gradients are
// reduce-scattered there and all-reduced across the replicate group.
//
//   auto mesh = fsdp::comm::DeviceMesh::hybrid(*pg.comm, /*shard_size=*/8);
//   fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));

#include <memory>

#include "comm/communicator.h"

namespace fsdp::comm {

class DeviceMesh {
 public:
  /// Collective over `world`: builds the shard and replicate groups. `shard_size` must divide the
  /// world size (a c10::Error says which sizes would). Needs a backend that can split (MPI).
  static std::shared_ptr<DeviceMesh> hybrid(const Communicator& world, int shard_size);

  const std::shared_ptr<Communicator>& shard_group() const { return shard_; }
  const std::shared_ptr<Communicator>& replicate_group() const { return replicate_; }
  int world_size() const { return shard_->size() * replicate_->size(); }

 private:
  DeviceMesh(std::shared_ptr<Communicator> shard, std::shared_ptr<Communicator> replicate)
      : shard_(std::move(shard)), replicate_(std::move(replicate)) {}
  std::shared_ptr<Communicator> shard_;
  std::shared_ptr<Communicator> replicate_;
};

}  // namespace fsdp::comm

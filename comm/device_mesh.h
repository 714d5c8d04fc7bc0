#pragma once
// An N-dimensional mesh of ranks with named dimensions, as PyTorch's init_device_mesh: the world's
// ranks laid out row-major over `sizes` (the last dimension varies fastest). Rank r has the
// coordinates of r in that layout; the group of a dimension is the ranks that differ from r only
// in that coordinate.
//
//   // 4 ranks as (dp, tp) = (2, 2): tp groups {0,1} {2,3}, dp groups {0,2} {1,3}
//   auto mesh = fsdp::comm::DeviceMesh::create(*pg.comm, {2, 2}, {"dp", "tp"});
//   fsdp::parallelize_module(*model, mesh->group("tp"), plan);
//   fsdp::fully_shard(*model, fsdp::FullyShardOptions().communicator(mesh->group("dp")));
//
//   // HSDP + TP on 8 ranks: (replicate, shard, tp) = (2, 2, 2)
//   auto mesh3 = fsdp::comm::DeviceMesh::create(*pg.comm, {2, 2, 2}, {"replicate", "shard", "tp"});
//   fsdp::fully_shard(*model, fsdp::FullyShardOptions().mesh(mesh3->submesh({"replicate", "shard"})));
//
// Hybrid sharding (HSDP) uses a 2-D mesh whose first dimension replicates and whose second shards:
// `DeviceMesh::hybrid(world, S)` is `create(world, {W / S, S}, {"replicate", "shard"})`. With shard
// size S on W ranks, rank r belongs to shard group r / S (ranks S*(r/S) .. S*(r/S)+S-1, typically
// the ranks of one node) and to replicate group r % S (ranks r % S, r % S + S, ...).
//
// Every group a mesh makes knows its members' world ranks (Communicator::world_ranks(), from the
// row-major layout; ranks of the communicator the mesh was created from, mapped to the world when
// that communicator knows its own).
//
// Creating a mesh and a flattened group are collectives over the world (every rank calls them in
// the same order). Groups are split from the world's backend: MpiBackend::split on MPI; on NCCL a
// new ProcessGroupNCCL per group, rendezvousing through the world's store ([Note: NCCL groups] in
// comm/nccl_backend.cc; compiled, not yet run on a GPU here); other backends are refused.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp_cpp/comm/communicator.h"

namespace fsdp::comm {

class DeviceMesh {
 public:
  /// Collective over `world`: lays its ranks out over `sizes` (row-major) with one name per
  /// dimension and builds each dimension's group. The product of `sizes` must be the world size,
  /// names must be distinct and non-empty (c10::Errors name what was expected and found).
  static std::shared_ptr<DeviceMesh> create(const Communicator& world, std::vector<int> sizes,
                                            std::vector<std::string> names);

  /// Collective over `world`: the 2-D mesh ("replicate", "shard") = (W / shard_size, shard_size)
  /// of hybrid sharding. `shard_size` must divide the world size (a c10::Error says which sizes
  /// would).
  static std::shared_ptr<DeviceMesh> hybrid(const Communicator& world, int shard_size);

  int ndim() const { return static_cast<int>(sizes_.size()); }
  const std::vector<int>& sizes() const { return sizes_; }
  const std::vector<std::string>& names() const { return names_; }
  /// The size of a dimension (c10::Error for an unknown name, listing the mesh's names).
  int size(const std::string& name) const { return sizes_[index_of(name)]; }
  /// This rank's coordinate along a dimension.
  int coordinate(const std::string& name) const { return coordinates_[index_of(name)]; }
  const std::vector<int>& coordinates() const { return coordinates_; }
  /// The product of the sizes (the world size of the mesh's world).
  int world_size() const;
  /// This rank's rank in the world the mesh was created from.
  int world_rank() const { return world_rank_; }

  /// The group of one dimension: the ranks whose other coordinates equal this rank's, ranked by
  /// their coordinate along `name`. Not collective.
  const std::shared_ptr<Communicator>& group(const std::string& name) const {
    return groups_[index_of(name)];
  }

  /// Collective over the mesh's world: one group over several dimensions (e.g. {"replicate",
  /// "shard"} for everything but tp), ranked row-major over the named dimensions in mesh order.
  /// One name returns group(name) without communicating; every name gives the whole mesh.
  std::shared_ptr<Communicator> flattened_group(const std::vector<std::string>& names) const;

  /// The mesh restricted to some dimensions (in the order given): shares this mesh's groups, no
  /// communication. E.g. {"replicate", "shard"} of a 3-D (replicate, shard, tp) mesh for HSDP.
  std::shared_ptr<DeviceMesh> submesh(const std::vector<std::string>& names) const;

  /// Hybrid sharding's groups: the mesh must be 2-D (replicate, shard): the first dimension's and
  /// the last dimension's groups. A c10::Error otherwise names the mesh's dimensions.
  const std::shared_ptr<Communicator>& shard_group() const;
  const std::shared_ptr<Communicator>& replicate_group() const;

  /// "(dp=2, tp=2)": the dimensions and their sizes, for messages.
  std::string describe() const;

 private:
  DeviceMesh() = default;
  int index_of(const std::string& name) const;

  std::vector<int> sizes_;
  std::vector<std::string> names_;
  std::vector<int> coordinates_;
  std::vector<std::shared_ptr<Communicator>> groups_;
  int world_rank_ = 0;
  // The world's backend (for flattened groups); null in a submesh whose parent is gone.
  c10::intrusive_ptr<c10d::Backend> world_backend_;
  // The world ranks of the communicator the mesh was created from, when it knows them.
  std::optional<std::vector<int>> world_world_ranks_;
  at::Device device_{at::kCPU};
  // Dimensions of this mesh inside the mesh the world was laid out on (for flattened groups of a
  // submesh): full_sizes_/full_coordinates_ describe that original layout.
  std::vector<int> dims_in_full_;
  std::vector<int> full_sizes_;
  std::vector<int> full_coordinates_;
};

}  // namespace fsdp::comm

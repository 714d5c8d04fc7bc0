#pragma once
// The parallel layout of one training job (torchtitan's ParallelDims): how many ranks replicate
// the model (dp_replicate, HSDP's replicate dimension), shard it (dp_shard, fully_shard's
// dimension), split its layers' features (tp, tensor parallel) and its depth (pp, pipeline
// stages). Validated against the world size, then laid out as one named DeviceMesh.
//
//   auto pg = fsdp::comm::init_process_group();
//   fsdp::parallel::ParallelDims dims{.dp_replicate = 1, .dp_shard = -1, .tp = 2, .pp = 1};
//   auto mesh = fsdp::parallel::ParallelMesh::create(*pg.comm, dims);   // dp_shard = W / 2
//   mesh.data_rank();     // which slice of the global batch this rank reads
//
// The mesh is (pp, dp_replicate, dp_shard, tp), row-major, so tp varies fastest: the ranks of a
// tensor-parallel group are consecutive (one node's GPUs), then the shard groups, then the
// replicas, then the pipeline stages (torchtitan's order). Every dimension is present, size 1
// included, so a group is always there to name.
//
// [Note: data ranks] The data-parallel ranks are dp_replicate x dp_shard: each reads its own slice
// of the global batch, data_rank() = dp_replicate coordinate * dp_shard + dp_shard coordinate, of
// data_world() slices. The ranks of one tp group, and the stages of one pipeline, read the same
// slice (the pipeline's first stage its inputs, the last its targets). Seed data with data_rank(),
// never with the world rank: the tp peers of a rank must see the same batch.

#include <memory>
#include <string>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/device_mesh.h"

namespace fsdp::parallel {

struct ParallelDims {
  /// Replicas of the sharded model (HSDP's replicate dimension); 1: plain fully_shard.
  int dp_replicate = 1;
  /// Ranks each replica is sharded over; -1: whatever the world size leaves.
  int dp_shard = -1;
  /// Tensor-parallel ranks.
  int tp = 1;
  /// Pipeline ranks.
  int pp = 1;

  /// The dimensions with dp_shard = -1 resolved for `world_size`. c10::Error, naming
  /// ParallelDims, each value and the world size, when a size is below 1 (or -1 for dp_shard),
  /// when the product differs from the world size, or when the others do not divide it.
  ParallelDims resolved(int world_size) const;
  int dp() const { return dp_replicate * dp_shard; }
  /// "(pp=1, dp_replicate=1, dp_shard=2, tp=2)".
  std::string describe() const;
  bool operator==(const ParallelDims&) const = default;
};

/// One job's mesh: the ranks laid out over ParallelDims (see the top of this file), with the
/// groups the composition root hands to each API.
class ParallelMesh {
 public:
  /// Collective over `world`: resolves and validates `dims` against the world size, then creates
  /// the mesh (pp, dp_replicate, dp_shard, tp) and the flattened data-parallel group
  /// (dp_replicate x dp_shard). A bad layout is refused on every rank before anything
  /// communicates (every rank computes the same check from the same arguments; ranks given
  /// different dims are refused when their layouts are compared, before the mesh exists).
  static ParallelMesh create(comm::Communicator& world, const ParallelDims& dims);

  const ParallelDims& dims() const { return dims_; }
  const comm::DeviceMesh& mesh() const { return *mesh_; }
  const std::shared_ptr<comm::DeviceMesh>& mesh_ptr() const { return mesh_; }

  /// The groups: "pp", "dp_replicate", "dp_shard", "tp" (the mesh's dimensions).
  const std::shared_ptr<comm::Communicator>& group(const std::string& dim) const { return mesh_->group(dim); }
  const std::shared_ptr<comm::Communicator>& pp() const { return group("pp"); }
  const std::shared_ptr<comm::Communicator>& tp() const { return group("tp"); }
  /// Every data-parallel rank of this rank's (pp, tp) coordinates: dp_replicate x dp_shard.
  const std::shared_ptr<comm::Communicator>& dp() const { return dp_; }
  /// The mesh fully_shard takes under HSDP: (dp_replicate, dp_shard).
  std::shared_ptr<comm::DeviceMesh> hsdp_mesh() const { return mesh_->submesh({"dp_replicate", "dp_shard"}); }

  /// [Note: data ranks].
  int data_rank() const;
  int data_world() const { return dims_.dp(); }
  int pp_rank() const { return mesh_->coordinate("pp"); }
  int tp_rank() const { return mesh_->coordinate("tp"); }

 private:
  ParallelMesh(ParallelDims dims, std::shared_ptr<comm::DeviceMesh> mesh, std::shared_ptr<comm::Communicator> dp)
      : dims_(dims), mesh_(std::move(mesh)), dp_(std::move(dp)) {}
  ParallelDims dims_;
  std::shared_ptr<comm::DeviceMesh> mesh_;
  std::shared_ptr<comm::Communicator> dp_;
};

}  // namespace fsdp::parallel

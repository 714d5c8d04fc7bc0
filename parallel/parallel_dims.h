#pragma once
// The parallel layout of one training job (torchtitan's ParallelDims): how many ranks replicate
// the model (dp_replicate, HSDP's replicate dimension), shard it (dp_shard, fully_shard's
// dimension), split its layers' features (tp, tensor parallel) and its depth (pp, pipeline
// stages), split its sequences (cp, context parallel: ring attention) and split its experts (ep,
// expert parallel, borrowed from the data-parallel ranks as torchtitan does). Validated against the
// world size, then laid out as named DeviceMeshes.
//
//   auto pg = fsdp::comm::init_process_group();
//   fsdp::parallel::ParallelDims dims{.dp_replicate = 1, .dp_shard = -1, .tp = 2, .pp = 1};
//   auto mesh = fsdp::parallel::ParallelMesh::create(*pg.comm, dims);   // dp_shard = W / 2
//   mesh.data_rank();     // which slice of the global batch this rank reads
//
// The mesh is (pp, dp_replicate, dp_shard, cp, tp), row-major, so tp varies fastest: the ranks of
// a tensor-parallel group are consecutive (one node's GPUs), then the context-parallel groups, the
// shard groups, the replicas, then the pipeline stages (torchtitan's order). Every dimension is
// present, size 1 included, so a group is always there to name.
//
// [Note: fully_shard over dp_shard x cp] The ranks of a cp group hold the same parameters and see
// different tokens of the same sequences, so fully_shard shards (and averages gradients) over the
// flattened (dp_shard, cp) group, "dp_shard_cp" (the dp_shard group when cp is 1).
//
// [Note: expert parallel mesh] ep does not add ranks: it splits the flattened (dp_shard, cp) ranks
// into (efsdp, ep), ep varying fastest. An expert lives on the ep ranks of one group (each holding
// num_experts / ep of them) and is sharded by fully_shard over "efsdp" (the ranks holding the same
// experts; torchtitan's dp_shard_mod_ep), HSDP-replicated over dp_replicate like the rest. Its
// gradient sums the tokens of the whole ep group, so its divide factor is the job's data-parallel
// degree dp_replicate x dp_shard x cp, not efsdp's size.
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
  /// Context-parallel ranks: each sequence split over cp ranks (ring attention).
  int cp = 1;
  /// Expert-parallel ranks, taken from dp_shard x cp: must divide it ([Note: expert parallel mesh]).
  int ep = 1;

  /// The dimensions with dp_shard = -1 resolved for `world_size`. c10::Error, naming
  /// ParallelDims, each value and the world size, when a size is below 1 (or -1 for dp_shard),
  /// when the product differs from the world size, or when the others do not divide it.
  ParallelDims resolved(int world_size) const;
  int dp() const { return dp_replicate * dp_shard; }
  /// The ranks fully_shard averages gradients over: dp_replicate x dp_shard x cp.
  int fsdp_degree() const { return dp_replicate * dp_shard * cp; }
  /// The ranks sharing one expert's shards: dp_shard x cp / ep.
  int efsdp() const { return dp_shard * cp / ep; }
  /// "(pp=1, dp_replicate=1, dp_shard=2, tp=2)", with cp and ep when they are not 1.
  std::string describe() const;
  bool operator==(const ParallelDims&) const = default;
};

/// One job's mesh: the ranks laid out over ParallelDims (see the top of this file), with the
/// groups the composition root hands to each API.
class ParallelMesh {
 public:
  /// Collective over `world`: resolves and validates `dims` against the world size, then creates
  /// the mesh (pp, dp_replicate, dp_shard, cp, tp), the flattened data-parallel group
  /// (dp_replicate x dp_shard), with cp > 1 the mesh (pp, dp_replicate, dp_shard_cp, tp), and with
  /// ep > 1 the mesh (pp, dp_replicate, efsdp, ep, tp). A bad layout is refused on every rank before anything
  /// communicates (every rank computes the same check from the same arguments; ranks given
  /// different dims are refused when their layouts are compared, before the mesh exists).
  static ParallelMesh create(comm::Communicator& world, const ParallelDims& dims);

  const ParallelDims& dims() const { return dims_; }
  const comm::DeviceMesh& mesh() const { return *mesh_; }
  const std::shared_ptr<comm::DeviceMesh>& mesh_ptr() const { return mesh_; }

  /// The groups: "pp", "dp_replicate", "dp_shard", "cp", "tp" (the mesh's dimensions).
  const std::shared_ptr<comm::Communicator>& group(const std::string& dim) const { return mesh_->group(dim); }
  const std::shared_ptr<comm::Communicator>& pp() const { return group("pp"); }
  const std::shared_ptr<comm::Communicator>& tp() const { return group("tp"); }
  const std::shared_ptr<comm::Communicator>& cp() const { return group("cp"); }
  /// The ranks fully_shard shards over ([Note: fully_shard over dp_shard x cp]), and its HSDP mesh
  /// (dp_replicate, dp_shard_cp).
  const std::shared_ptr<comm::Communicator>& fsdp_group() const;
  std::shared_ptr<comm::DeviceMesh> fsdp_hsdp_mesh() const;
  /// Expert parallel ([Note: expert parallel mesh]): the ep group (null when ep is 1),
  /// the group sharding this rank's experts, and its HSDP mesh (dp_replicate, efsdp).
  const std::shared_ptr<comm::Communicator>& ep() const;
  const std::shared_ptr<comm::Communicator>& efsdp_group() const;
  std::shared_ptr<comm::DeviceMesh> efsdp_hsdp_mesh() const;
  int cp_rank() const { return mesh_->coordinate("cp"); }
  int ep_rank() const;
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
  std::shared_ptr<comm::DeviceMesh> fsdp_mesh_;  // (pp, dp_replicate, dp_shard_cp, tp) when cp > 1
  std::shared_ptr<comm::DeviceMesh> ep_mesh_;    // (pp, dp_replicate, efsdp, ep, tp) when ep > 1
};

}  // namespace fsdp::parallel

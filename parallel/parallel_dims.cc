#include "fsdp_cpp/parallel/parallel_dims.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include <c10/util/Exception.h>

namespace fsdp::parallel {

std::string ParallelDims::describe() const {
  return "(pp=" + std::to_string(pp) + ", dp_replicate=" + std::to_string(dp_replicate) +
         ", dp_shard=" + std::to_string(dp_shard) + (cp != 1 ? ", cp=" + std::to_string(cp) : "") +
         ", tp=" + std::to_string(tp) + (ep != 1 ? ", ep=" + std::to_string(ep) : "") + ")";
}

ParallelDims ParallelDims::resolved(int world_size) const {
  TORCH_CHECK(dp_replicate >= 1 && tp >= 1 && pp >= 1 && cp >= 1 && ep >= 1 && (dp_shard >= 1 || dp_shard == -1),
              "ParallelDims: expected dp_replicate, tp, pp, cp and ep >= 1 and dp_shard >= 1 or -1 (the rest of the "
              "world), found ", describe());
  const int64_t others = int64_t{dp_replicate} * tp * pp * cp;
  ParallelDims out = *this;
  if (dp_shard == -1) {
    TORCH_CHECK(world_size % others == 0, "ParallelDims: ", describe(), ": dp_replicate x cp x tp x pp = ", others,
                " does not divide the world size ", world_size, "; expected a product that divides it");
    out.dp_shard = static_cast<int>(world_size / others);
  }
  const int64_t product = others * out.dp_shard;
  TORCH_CHECK(product == world_size, "ParallelDims: ", describe(), " multiply to ", product,
              ", expected the world size ", world_size);
  TORCH_CHECK((int64_t{out.dp_shard} * cp) % ep == 0, "ParallelDims: ", out.describe(), ": ep (", ep, ") must divide "
              "dp_shard x cp (", int64_t{out.dp_shard} * cp, "): expert parallelism splits the data-parallel ranks that "
              "shard the model");
  return out;
}

int ParallelMesh::data_rank() const {
  return mesh_->coordinate("dp_replicate") * dims_.dp_shard + mesh_->coordinate("dp_shard");
}

ParallelMesh ParallelMesh::create(comm::Communicator& world, const ParallelDims& dims) {
  // Ranks given different layouts would build different meshes (and hang in their splits), so the
  // layouts are compared first; then every rank checks the same arguments alike.
  if (world.size() > 1) {
    const int32_t mine[6] = {dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, dims.ep};
    std::vector<uint8_t> bytes(sizeof(mine));
    std::memcpy(bytes.data(), mine, sizeof(mine));
    const auto all = world.all_gather_bytes(bytes, "ParallelMesh::create");
    // Each rank compared with rank 0, so every rank reports the same pair.
    auto dims_of = [](const std::vector<uint8_t>& b) {
      int32_t v[6];
      std::memcpy(v, b.data(), sizeof(v));
      return ParallelDims{v[0], v[1], v[2], v[3], v[4], v[5]};
    };
    for (size_t r = 1; r < all.size(); ++r) {
      TORCH_CHECK(all[r] == all[0], "ParallelMesh::create: every rank must be given the same ParallelDims; rank 0 "
                  "was given ", dims_of(all[0]).describe(), ", rank ", r, " ", dims_of(all[r]).describe());
    }
  }
  const ParallelDims resolved = dims.resolved(world.size());
  const ParallelDims& d = resolved;
  auto mesh = comm::DeviceMesh::create(world, {d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp},
                                       {"pp", "dp_replicate", "dp_shard", "cp", "tp"});
  auto dp = mesh->flattened_group({"dp_replicate", "dp_shard"});
  ParallelMesh out(resolved, std::move(mesh), std::move(dp));
  // [Note: fully_shard over dp_shard x cp]: the same world ranks, row-major, dp_shard and cp merged.
  if (d.cp > 1) {
    out.fsdp_mesh_ = comm::DeviceMesh::create(world, {d.pp, d.dp_replicate, d.dp_shard * d.cp, d.tp},
                                              {"pp", "dp_replicate", "dp_shard_cp", "tp"});
  }
  // [Note: expert parallel mesh]: (dp_shard, cp) flattened, then split into (efsdp, ep).
  if (d.ep > 1) {
    out.ep_mesh_ = comm::DeviceMesh::create(world, {d.pp, d.dp_replicate, d.efsdp(), d.ep, d.tp},
                                            {"pp", "dp_replicate", "efsdp", "ep", "tp"});
  }
  return out;
}

const std::shared_ptr<comm::Communicator>& ParallelMesh::fsdp_group() const {
  return fsdp_mesh_ ? fsdp_mesh_->group("dp_shard_cp") : mesh_->group("dp_shard");
}

std::shared_ptr<comm::DeviceMesh> ParallelMesh::fsdp_hsdp_mesh() const {
  return fsdp_mesh_ ? fsdp_mesh_->submesh({"dp_replicate", "dp_shard_cp"}) : hsdp_mesh();
}

const std::shared_ptr<comm::Communicator>& ParallelMesh::ep() const {
  static const std::shared_ptr<comm::Communicator> none;
  return ep_mesh_ ? ep_mesh_->group("ep") : none;
}

const std::shared_ptr<comm::Communicator>& ParallelMesh::efsdp_group() const {
  return ep_mesh_ ? ep_mesh_->group("efsdp") : fsdp_group();
}

std::shared_ptr<comm::DeviceMesh> ParallelMesh::efsdp_hsdp_mesh() const {
  return ep_mesh_ ? ep_mesh_->submesh({"dp_replicate", "efsdp"}) : fsdp_hsdp_mesh();
}

int ParallelMesh::ep_rank() const { return ep_mesh_ ? ep_mesh_->coordinate("ep") : 0; }

}  // namespace fsdp::parallel

#include "fsdp_cpp/parallel/parallel_dims.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include <c10/util/Exception.h>

namespace fsdp::parallel {

std::string ParallelDims::describe() const {
  return "(pp=" + std::to_string(pp) + ", dp_replicate=" + std::to_string(dp_replicate) +
         ", dp_shard=" + std::to_string(dp_shard) + ", tp=" + std::to_string(tp) + ")";
}

ParallelDims ParallelDims::resolved(int world_size) const {
  TORCH_CHECK(dp_replicate >= 1 && tp >= 1 && pp >= 1 && (dp_shard >= 1 || dp_shard == -1),
              "ParallelDims: expected dp_replicate, tp and pp >= 1 and dp_shard >= 1 or -1 (the rest of the "
              "world), found ", describe());
  const int64_t others = int64_t{dp_replicate} * tp * pp;
  ParallelDims out = *this;
  if (dp_shard == -1) {
    TORCH_CHECK(world_size % others == 0, "ParallelDims: ", describe(), ": dp_replicate x tp x pp = ", others,
                " does not divide the world size ", world_size, "; expected a product that divides it");
    out.dp_shard = static_cast<int>(world_size / others);
  }
  const int64_t product = others * out.dp_shard;
  TORCH_CHECK(product == world_size, "ParallelDims: ", describe(), " multiply to ", product,
              ", expected the world size ", world_size);
  return out;
}

int ParallelMesh::data_rank() const {
  return mesh_->coordinate("dp_replicate") * dims_.dp_shard + mesh_->coordinate("dp_shard");
}

ParallelMesh ParallelMesh::create(comm::Communicator& world, const ParallelDims& dims) {
  // Ranks given different layouts would build different meshes (and hang in their splits), so the
  // layouts are compared first; then every rank checks the same arguments alike.
  if (world.size() > 1) {
    const int32_t mine[4] = {dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp};
    std::vector<uint8_t> bytes(sizeof(mine));
    std::memcpy(bytes.data(), mine, sizeof(mine));
    const auto all = world.all_gather_bytes(bytes, "ParallelMesh::create");
    // Each rank compared with rank 0, so every rank reports the same pair.
    auto dims_of = [](const std::vector<uint8_t>& b) {
      int32_t v[4];
      std::memcpy(v, b.data(), sizeof(v));
      return ParallelDims{v[0], v[1], v[2], v[3]};
    };
    for (size_t r = 1; r < all.size(); ++r) {
      TORCH_CHECK(all[r] == all[0], "ParallelMesh::create: every rank must be given the same ParallelDims; rank 0 "
                  "was given ", dims_of(all[0]).describe(), ", rank ", r, " ", dims_of(all[r]).describe());
    }
  }
  const ParallelDims resolved = dims.resolved(world.size());
  auto mesh = comm::DeviceMesh::create(world, {resolved.pp, resolved.dp_replicate, resolved.dp_shard, resolved.tp},
                                       {"pp", "dp_replicate", "dp_shard", "tp"});
  auto dp = mesh->flattened_group({"dp_replicate", "dp_shard"});
  return ParallelMesh(resolved, std::move(mesh), std::move(dp));
}

}  // namespace fsdp::parallel

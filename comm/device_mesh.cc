#include "fsdp_cpp/comm/device_mesh.h"

#include <algorithm>
#include <set>

#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/backend_registry.h"
#include "fsdp_cpp/comm/mpi_backend.h"

namespace fsdp::comm {
namespace {

std::string join(const std::vector<int>& values) {
  std::string out;
  for (int v : values) out += (out.empty() ? "" : ", ") + std::to_string(v);
  return out;
}

std::string join(const std::vector<std::string>& values) {
  std::string out;
  for (const auto& v : values) out += (out.empty() ? "" : ", ") + v;
  return out;
}

// The ranks whose coordinates outside `dims` equal this rank's form one group, ranked row-major
// over `dims`: color = row-major index over the other dimensions, key = index over `dims`.
std::shared_ptr<Communicator> split_backend(const c10::intrusive_ptr<c10d::Backend>& world,
                                            at::Device device, const std::vector<int>& sizes,
                                            const std::vector<int>& coords,
                                            const std::vector<int>& dims, const std::string& label,
                                            const char* api) {
  if (world->getSize() == 1) return std::make_shared<Communicator>(world, device);
  int color = 0, key = 0, size = 1;
  for (int d = 0; d < static_cast<int>(sizes.size()); ++d) {
    if (std::find(dims.begin(), dims.end(), d) != dims.end()) continue;
    color = color * sizes[d] + coords[d];
  }
  for (int d : dims) {
    key = key * sizes[d] + coords[d];
    size *= sizes[d];
  }
  if (dynamic_cast<MpiBackend*>(world.get()) == nullptr) {
    // Other backends (NCCL) make new groups through the splitter they registered.
    GroupSplitter splitter = find_group_splitter(world->getBackendName());
    TORCH_CHECK(splitter != nullptr, api, ": the ", world->getBackendName(), " backend cannot be split into "
                "groups (no group splitter registered for it); a device mesh needs the MPI or NCCL backend");
    return std::make_shared<Communicator>(splitter(world, color, key, size, label), device);
  }
  auto& mpi = static_cast<MpiBackend&>(*world);
  MpiBackend::Options options;
  options.timeout = mpi.timeout();
  options.name = mpi.name() + "/" + label + " group " + std::to_string(color);
  return std::make_shared<Communicator>(mpi.split(color, key, options), device);
}

// The ranks of the group over `dims` of the rank at `coords`, in group-rank order (row-major over
// `dims`), as ranks of the mesh's world mapped through `world_ranks` (that communicator's own world
// ranks) when it knows them.
std::vector<int> group_world_ranks(const std::vector<int>& sizes, const std::vector<int>& coords,
                                   const std::vector<int>& dims,
                                   const std::optional<std::vector<int>>& world_ranks) {
  int size = 1;
  for (int d : dims) size *= sizes[d];
  std::vector<int> ranks(size);
  for (int key = 0; key < size; ++key) {
    std::vector<int> c = coords;
    int rest = key;
    for (int i = static_cast<int>(dims.size()) - 1; i >= 0; --i) {
      c[dims[i]] = rest % sizes[dims[i]];
      rest /= sizes[dims[i]];
    }
    int rank = 0;
    for (size_t d = 0; d < sizes.size(); ++d) rank = rank * sizes[d] + c[d];
    ranks[key] = world_ranks ? (*world_ranks)[rank] : rank;
  }
  return ranks;
}

// A group of the mesh (split_backend) with its world ranks set.
std::shared_ptr<Communicator> split_group(const c10::intrusive_ptr<c10d::Backend>& world,
                                          at::Device device, const std::vector<int>& sizes,
                                          const std::vector<int>& coords,
                                          const std::vector<int>& dims, const std::string& label,
                                          const char* api,
                                          const std::optional<std::vector<int>>& world_ranks) {
  auto made = split_backend(world, device, sizes, coords, dims, label, api);
  made->set_world_ranks(group_world_ranks(sizes, coords, dims, world_ranks));
  return made;
}

}  // namespace

std::shared_ptr<DeviceMesh> DeviceMesh::create(const Communicator& world, std::vector<int> sizes,
                                               std::vector<std::string> names) {
  const int W = world.size();
  TORCH_CHECK(!sizes.empty(), "DeviceMesh::create: expected at least one dimension, found none");
  TORCH_CHECK(sizes.size() == names.size(), "DeviceMesh::create: expected one name per dimension (",
              sizes.size(), " sizes [", join(sizes), "]), found ", names.size(), " names [",
              join(names), "]");
  int64_t product = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    TORCH_CHECK(sizes[d] >= 1, "DeviceMesh::create: dimension '", names[d], "' has size ", sizes[d],
                "; expected at least 1");
    product *= sizes[d];
  }
  TORCH_CHECK(product == W, "DeviceMesh::create: the mesh sizes [", join(sizes), "] (",
              join(names), ") multiply to ", product, ", expected the world size ", W);
  std::set<std::string> seen;
  for (const auto& n : names) {
    TORCH_CHECK(!n.empty(), "DeviceMesh::create: a dimension name is empty (names [", join(names), "])");
    TORCH_CHECK(seen.insert(n).second, "DeviceMesh::create: the dimension name '", n,
                "' appears twice in [", join(names), "]");
  }

  std::shared_ptr<DeviceMesh> mesh(new DeviceMesh());
  mesh->sizes_ = std::move(sizes);
  mesh->names_ = std::move(names);
  mesh->world_rank_ = world.rank();
  mesh->world_backend_ = world.backend();
  mesh->world_world_ranks_ = world.world_ranks();
  mesh->device_ = world.device();
  const int n = mesh->ndim();
  mesh->coordinates_.assign(n, 0);
  int rest = world.rank();
  for (int d = n - 1; d >= 0; --d) {
    mesh->coordinates_[d] = rest % mesh->sizes_[d];
    rest /= mesh->sizes_[d];
  }
  mesh->full_sizes_ = mesh->sizes_;
  mesh->full_coordinates_ = mesh->coordinates_;
  for (int d = 0; d < n; ++d) {
    mesh->dims_in_full_.push_back(d);
    mesh->groups_.push_back(split_group(world.backend(), world.device(), mesh->sizes_,
                                        mesh->coordinates_, {d}, mesh->names_[d],
                                        "DeviceMesh::create", mesh->world_world_ranks_));
  }
  return mesh;
}

std::shared_ptr<DeviceMesh> DeviceMesh::hybrid(const Communicator& world, int shard_size) {
  const int W = world.size();
  std::string divisors;
  for (int d = 1; d <= W; ++d) {
    if (W % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
  }
  TORCH_CHECK(shard_size >= 1 && W % shard_size == 0, "DeviceMesh::hybrid: shard size ", shard_size,
              " does not divide the world size ", W, " (shard groups x replicate groups must equal the "
              "world); possible shard sizes: ", divisors);
  return create(world, {W / shard_size, shard_size}, {"replicate", "shard"});
}

int DeviceMesh::world_size() const {
  int p = 1;
  for (int s : full_sizes_) p *= s;
  return p;
}

int DeviceMesh::index_of(const std::string& name) const {
  for (int d = 0; d < ndim(); ++d) {
    if (names_[d] == name) return d;
  }
  TORCH_CHECK(false, "DeviceMesh: no dimension named '", name, "'; the mesh is ", describe());
}

std::shared_ptr<Communicator> DeviceMesh::flattened_group(const std::vector<std::string>& names) const {
  TORCH_CHECK(!names.empty(), "DeviceMesh::flattened_group: expected at least one dimension name");
  std::vector<int> dims;
  std::string label;
  for (const auto& name : names) {
    const int full = dims_in_full_[index_of(name)];
    TORCH_CHECK(std::find(dims.begin(), dims.end(), full) == dims.end(),
                "DeviceMesh::flattened_group: dimension '", name, "' named twice");
    dims.push_back(full);
    label += (label.empty() ? "" : "x") + name;
  }
  if (dims.size() == 1) return group(names[0]);
  return split_group(world_backend_, device_, full_sizes_, full_coordinates_, dims, label,
                     "DeviceMesh::flattened_group", world_world_ranks_);
}

std::shared_ptr<DeviceMesh> DeviceMesh::submesh(const std::vector<std::string>& names) const {
  TORCH_CHECK(!names.empty(), "DeviceMesh::submesh: expected at least one dimension name");
  std::shared_ptr<DeviceMesh> sub(new DeviceMesh());
  for (const auto& name : names) {
    const int d = index_of(name);
    TORCH_CHECK(std::find(sub->names_.begin(), sub->names_.end(), name) == sub->names_.end(),
                "DeviceMesh::submesh: dimension '", name, "' named twice");
    sub->sizes_.push_back(sizes_[d]);
    sub->names_.push_back(name);
    sub->coordinates_.push_back(coordinates_[d]);
    sub->groups_.push_back(groups_[d]);
    sub->dims_in_full_.push_back(dims_in_full_[d]);
  }
  sub->world_rank_ = world_rank_;
  sub->world_backend_ = world_backend_;
  sub->world_world_ranks_ = world_world_ranks_;
  sub->device_ = device_;
  sub->full_sizes_ = full_sizes_;
  sub->full_coordinates_ = full_coordinates_;
  return sub;
}

const std::shared_ptr<Communicator>& DeviceMesh::shard_group() const {
  TORCH_CHECK(ndim() == 2, "DeviceMesh: hybrid sharding needs a 2-D mesh (replicate, shard); this "
              "mesh is ", describe(), " (take a 2-D submesh, e.g. submesh({\"replicate\", \"shard\"}))");
  return groups_[1];
}

const std::shared_ptr<Communicator>& DeviceMesh::replicate_group() const {
  TORCH_CHECK(ndim() == 2, "DeviceMesh: hybrid sharding needs a 2-D mesh (replicate, shard); this "
              "mesh is ", describe(), " (take a 2-D submesh, e.g. submesh({\"replicate\", \"shard\"}))");
  return groups_[0];
}

std::string DeviceMesh::describe() const {
  std::string out = "(";
  for (int d = 0; d < ndim(); ++d) {
    out += (d ? ", " : "") + names_[d] + "=" + std::to_string(sizes_[d]);
  }
  return out + ")";
}

}  // namespace fsdp::comm

#include "fsdp_cpp/fsdp/derived_groups.h"

#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>

#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/device_mesh.h"

namespace fsdp {

std::string post_forward_group_size_error(int ranks, int size) {
  if (ranks >= 2 && size % ranks == 0) return "";
  std::string divisors;
  for (int d = 2; d <= size; ++d) {
    if (size % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
  }
  std::string message = "reshard_after_forward(" + std::to_string(ranks) + ") needs a number of ranks that divides the " +
                        std::to_string(size) + " ranks the unit shards across and is at least 2 (" +
                        (divisors.empty() ? std::string("none does on one rank") : "here: " + divisors) + ")";
  if (ranks == 1) message += "; to keep the unsharded parameters from forward to backward, use reshard_after_forward(false)";
  return message;
}

namespace {

// The cache of derived groups: weak references, so a group lives as long as the units (their
// FSDPConfig) holding it and is freed with the last of them, not at static destruction (a program
// that finalises MPI itself destroys its model, and so these communicators, before MPI_Finalize).
struct Cache {
  struct Entry {
    std::weak_ptr<comm::Communicator> parent;  // a new communicator at the same address is another key
    std::weak_ptr<comm::Communicator> group;
  };
  std::mutex mutex;
  std::map<std::pair<const comm::Communicator*, int>, Entry> groups;

  // Drops the entries whose group or parent is gone (under `mutex`).
  void prune() {
    for (auto it = groups.begin(); it != groups.end();) {
      it = it->second.group.expired() || it->second.parent.expired() ? groups.erase(it) : std::next(it);
    }
  }
};

Cache& cache() {
  static Cache* instance = new Cache();  // never destroyed: holds no communicator
  return *instance;
}

// The group of `comm` of `kind` (0: a duplicate; k >= 2: consecutive ranks), made by `make` the
// first time (collectively), then shared while some unit holds it.
std::shared_ptr<comm::Communicator> derived_group(const std::shared_ptr<comm::Communicator>& comm, int kind,
                                                  const std::function<std::shared_ptr<comm::Communicator>()>& make) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.prune();
  Cache::Entry& entry = c.groups[{comm.get(), kind}];
  if (entry.parent.lock() == comm) {
    if (auto group = entry.group.lock()) return group;
  }
  std::shared_ptr<comm::Communicator> group = make();
  entry = {comm, group};
  return group;
}

}  // namespace

size_t cached_derived_groups() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.prune();
  return c.groups.size();
}

std::shared_ptr<comm::Communicator> post_forward_group(const std::shared_ptr<comm::Communicator>& comm, int ranks) {
  TORCH_CHECK(comm != nullptr, "fully_shard: post_forward_group needs a communicator");
  const std::string error = post_forward_group_size_error(ranks, comm->size());
  TORCH_CHECK(error.empty(), "fully_shard: ", error);
  if (ranks == comm->size()) return comm;
  return derived_group(comm, ranks, [&] {
    // The inner dimension of a (size / ranks, ranks) mesh: consecutive ranks.
    auto mesh = comm::DeviceMesh::create(*comm, {comm->size() / ranks, ranks}, {"post_forward_replica", "post_forward"});
    return mesh->group("post_forward");
  });
}

std::shared_ptr<comm::Communicator> reduce_group(const std::shared_ptr<comm::Communicator>& comm) {
  TORCH_CHECK(comm != nullptr, "fully_shard: reduce_group needs a communicator");
  return derived_group(comm, 0, [&] {
    return comm::DeviceMesh::create(*comm, {comm->size()}, {"reduce"})->group("reduce");
  });
}

}  // namespace fsdp

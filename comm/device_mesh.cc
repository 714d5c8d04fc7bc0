#include "comm/device_mesh.h"

#include <c10/util/Exception.h>

#include "comm/mpi_backend.h"

namespace fsdp::comm {

std::shared_ptr<DeviceMesh> DeviceMesh::hybrid(const Communicator& world, int shard_size) {
  const int W = world.size();
  std::string divisors;
  for (int d = 1; d <= W; ++d) {
    if (W % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
  }
  TORCH_CHECK(shard_size >= 1 && W % shard_size == 0, "DeviceMesh::hybrid: shard size ", shard_size,
              " does not divide the world size ", W, " (shard groups x replicate groups must equal the "
              "world); possible shard sizes: ", divisors);
  auto* mpi = dynamic_cast<MpiBackend*>(world.backend().get());
  TORCH_CHECK(mpi != nullptr, "DeviceMesh::hybrid: the ", world.backend()->getBackendName(),
              " backend cannot be split into groups yet; hybrid sharding needs the MPI backend");
  const int r = world.rank();
  MpiBackend::Options shard_options;
  shard_options.timeout = mpi->timeout();
  shard_options.name = mpi->name() + "/shard group " + std::to_string(r / shard_size);
  auto shard = mpi->split(/*color=*/r / shard_size, /*key=*/r, shard_options);
  MpiBackend::Options replicate_options = shard_options;
  replicate_options.name = mpi->name() + "/replicate group " + std::to_string(r % shard_size);
  auto replicate = mpi->split(/*color=*/r % shard_size, /*key=*/r, replicate_options);
  return std::shared_ptr<DeviceMesh>(new DeviceMesh(std::make_shared<Communicator>(shard, world.device()),
                                                    std::make_shared<Communicator>(replicate, world.device())));
}

}  // namespace fsdp::comm

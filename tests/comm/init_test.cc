// init_process_group() under mpirun: the launcher is recognised, the CPU picks the MPI backend, and
// the default process group communicates.
#include <cstdlib>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

FSDP_RANKS_TEST_CASE("init_process_group reads mpirun's variables and picks MPI for the CPU", "[comm][init]") {
  auto group = fsdp::comm::init_process_group();
  CHECK(group.launch.launcher == fsdp::comm::Launcher::kMpirun);
  CHECK(group.launch.rank == fsdp::testing::rank());
  CHECK(group.launch.world_size == fsdp::testing::world_size());
  CHECK(group.device == at::Device(at::kCPU));
  REQUIRE(group.comm);
  CHECK(group.comm->backend()->getBackendName() == "mpi");
  CHECK(fsdp::comm::default_process_group().comm->backend().defined());
  CHECK(fsdp::comm::default_process_group().comm == group.comm);
  // The world communicator knows its world ranks: group rank r is world rank r.
  std::vector<int> ranks(group.launch.world_size);
  for (int r = 0; r < group.launch.world_size; ++r) ranks[r] = r;
  CHECK(group.comm->world_ranks() == ranks);
  CHECK(group.comm->world_rank() == group.launch.rank);
  at::Tensor t = at::full({3}, group.launch.rank, at::kLong);
  group.comm->all_reduce(t, c10d::ReduceOp::MAX).wait();
  CHECK(t.equal(at::full({3}, group.launch.world_size - 1, at::kLong)));
}

FSDP_RANKS_TEST_CASE("the collective timeout comes from the options or FSDP_COMM_TIMEOUT_S", "[comm][init]") {
  fsdp::comm::InitOptions options;
  ::unsetenv("FSDP_COMM_TIMEOUT_S");
  CHECK(fsdp::comm::resolve_timeout(options) == std::chrono::minutes(10));
  ::setenv("FSDP_COMM_TIMEOUT_S", "2.5", 1);
  CHECK(fsdp::comm::resolve_timeout(options) == std::chrono::milliseconds(2500));
  options.timeout = std::chrono::seconds(7);
  CHECK(fsdp::comm::resolve_timeout(options) == std::chrono::seconds(7));
  ::setenv("FSDP_COMM_TIMEOUT_S", "soon", 1);
  CHECK_THROWS_WITH(fsdp::comm::resolve_timeout(fsdp::comm::InitOptions{}),
                    Catch::Matchers::Contains("FSDP_COMM_TIMEOUT_S must be a positive number"));
  ::unsetenv("FSDP_COMM_TIMEOUT_S");
}

FSDP_RANKS_TEST_CASE("a launcher that announces more ranks than MPI sees is a clear error", "[comm][init]") {
  // As if torchrun had started this process as one of W + 1 ranks of a CPU job.
  const int W = fsdp::testing::world_size();
  ::setenv("RANK", std::to_string(fsdp::testing::rank()).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(W + 1).c_str(), 1);
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  CHECK_THROWS_WITH(fsdp::comm::init_process_group(),
                    Catch::Matchers::Contains("MPI sees " + std::to_string(W)) &&
                        Catch::Matchers::Contains("announced " + std::to_string(W + 1)) &&
                        Catch::Matchers::Contains("mpirun -np N"));
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
}

FSDP_RANKS_TEST_CASE("CUDA without a linked NCCL backend is a clear error", "[comm][init]") {
  fsdp::comm::InitOptions options;
  options.device = at::Device(at::kCUDA, 0);
  CHECK_THROWS_WITH(fsdp::comm::init_process_group(options),
                    Catch::Matchers::Contains("no backend for device cuda:0") &&
                        Catch::Matchers::Contains("//comm:nccl"));
}

FSDP_RANKS_TEST_CASE("device_id must be an indexed CUDA device that agrees with device", "[comm][init]") {
  fsdp::comm::InitOptions cpu;
  cpu.device_id = at::Device(at::kCPU);
  CHECK_THROWS_WITH(fsdp::comm::init_process_group(cpu),
                    Catch::Matchers::Contains("device_id=cpu") &&
                        Catch::Matchers::Contains("needs a CUDA device with an index"));
  fsdp::comm::InitOptions no_index;
  no_index.device_id = at::Device(at::kCUDA);
  CHECK_THROWS_WITH(fsdp::comm::init_process_group(no_index),
                    Catch::Matchers::Contains("needs a CUDA device with an index"));
  fsdp::comm::InitOptions both;
  both.device = at::Device(at::kCUDA, 0);
  both.device_id = at::Device(at::kCUDA, 1);
  CHECK_THROWS_WITH(fsdp::comm::init_process_group(both),
                    Catch::Matchers::Contains("device=cuda:0 and device_id=cuda:1") &&
                        Catch::Matchers::Contains("must name the same device"));
  // Without the NCCL backend linked, an indexed CUDA device_id reaches the registry's clear error.
  fsdp::comm::InitOptions cuda;
  cuda.device_id = at::Device(at::kCUDA, 0);
  CHECK_THROWS_WITH(fsdp::comm::init_process_group(cuda),
                    Catch::Matchers::Contains("no backend for device cuda:0"));
}

// A save killed midway leaves the previous checkpoint intact (tests/checkpoint/
// distributed_checkpoint_kill_test.sh runs this program under mpirun several times):
//   distributed_checkpoint_kill_main save DIR SEED    saves a fully_shard MlpStack built from SEED
//   distributed_checkpoint_kill_main check DIR SEED   loads DIR into a fresh sharded model and
//                                                     compares it with an unsharded model built from
//                                                     SEED; exit status 0 when they are equal
// With FSDP_DCP_TEST_KILL_RANK=r set, rank r truncates its first checkpoint file to half its size
// right after writing it and kills itself with SIGKILL: a crash in the middle of writing.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <ATen/ATen.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/mpi_backend.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/tests/composable/test_models.h"

namespace {

fsdp::testing::MlpStack make_model(uint64_t seed) {
  torch::manual_seed(seed);
  return fsdp::testing::MlpStack(6, 8, 16, 2, 3);
}

fsdp::FSDPModule shard(const fsdp::testing::MlpStack& model, const std::shared_ptr<fsdp::comm::Communicator>& comm) {
  const auto options = fsdp::FullyShardOptions().communicator(comm);
  for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::fully_shard(model->block(i), options);
  return fsdp::fully_shard(model, options);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s save|check DIR SEED\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const std::string dir = argv[2];
  const uint64_t seed = std::strtoull(argv[3], nullptr, 10);
  auto comm = std::make_shared<fsdp::comm::Communicator>(fsdp::comm::MpiBackend::create_world(), at::kCPU);
  const int rank = comm->rank();
  int status = 0;
  if (const char* victim = std::getenv("FSDP_DCP_TEST_KILL_RANK"); victim != nullptr && std::atoi(victim) == rank) {
    fsdp::dcp::testing::set_file_written_hook([rank](const std::string& path) {
      std::filesystem::resize_file(path, std::filesystem::file_size(path) / 2);
      std::printf("rank %d: killed while writing %s\n", rank, path.c_str());
      std::fflush(stdout);
      std::raise(SIGKILL);
    });
  }
  if (mode == "save") {
    auto model = make_model(seed);
    auto root = shard(model, comm);
    fsdp::dcp::save(dir, root, nullptr, {}, fsdp::dcp::SaveOptions().communicator(comm));
    if (rank == 0) std::printf("saved %s from seed %llu\n", dir.c_str(), static_cast<unsigned long long>(seed));
  } else if (mode == "check") {
    auto model = make_model(1000 + seed);
    auto root = shard(model, comm);
    fsdp::dcp::load(dir, root, nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(comm));
    const auto loaded = fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false));
    auto reference = make_model(seed);
    for (const auto& item : reference->named_parameters()) {
      const at::Tensor* value = loaded.find(item.key());
      if (value == nullptr || !value->equal(item.value())) {
        std::fprintf(stderr, "rank %d: '%s' differs from the model of seed %llu\n", rank, item.key().c_str(),
                     static_cast<unsigned long long>(seed));
        status = 1;
      }
    }
    if (status == 0 && rank == 0) {
      std::printf("%s holds the model of seed %llu\n", dir.c_str(), static_cast<unsigned long long>(seed));
    }
  } else {
    std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
    status = 2;
  }
  comm->barrier();
  return status;
}

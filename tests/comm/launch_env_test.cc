// Reading rank, world size and local rank from torchrun's and mpirun's variables.
#include <map>

#include "fsdp_cpp/comm/launch_env.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::comm::Launcher;
using fsdp::comm::read_launch_env;
using Catch::Matchers::Contains;

auto env(std::map<std::string, std::string> vars) {
  return [vars](const char* name) -> std::optional<std::string> {
    const auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

}  // namespace

TEST_CASE("no launcher variables: a single process", "[comm][launch]") {
  const auto info = read_launch_env(env({}));
  CHECK(info.launcher == Launcher::kNone);
  CHECK(info.rank == 0);
  CHECK(info.world_size == 1);
  CHECK(info.local_rank == 0);
}

TEST_CASE("torchrun's variables", "[comm][launch]") {
  const auto info = read_launch_env(env({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                         {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}}));
  CHECK(info.launcher == Launcher::kTorchrun);
  CHECK(info.rank == 5);
  CHECK(info.world_size == 8);
  CHECK(info.local_rank == 1);
  CHECK(info.master_addr == "node0");
  CHECK(info.master_port == 29500);
}

TEST_CASE("Open MPI's and MPICH's variables", "[comm][launch]") {
  const auto ompi = read_launch_env(env({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "3"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}));
  CHECK(ompi.launcher == Launcher::kMpirun);
  CHECK(ompi.rank == 2);
  CHECK(ompi.world_size == 3);
  CHECK(ompi.local_rank == 0);
  const auto mpich = read_launch_env(env({{"PMI_RANK", "1"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}}));
  CHECK(mpich.launcher == Launcher::kMpirun);
  CHECK(mpich.rank == 1);
  CHECK(mpich.world_size == 4);
  CHECK(mpich.local_rank == 1);
}

TEST_CASE("torchrun-style variables exported under mpirun must agree with it", "[comm][launch]") {
  const auto same = read_launch_env(env({{"RANK", "1"}, {"WORLD_SIZE", "2"},
                                         {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
  CHECK(same.launcher == Launcher::kMpirun);
  CHECK_THROWS_WITH(read_launch_env(env({{"RANK", "0"}, {"WORLD_SIZE", "2"},
                                         {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}})),
                    Contains("disagree") && Contains("OMPI_COMM_WORLD_RANK"));
}

TEST_CASE("partial or inconsistent variables are clear errors", "[comm][launch]") {
  CHECK_THROWS_WITH(read_launch_env(env({{"RANK", "0"}})), Contains("WORLD_SIZE is not set"));
  CHECK_THROWS_WITH(read_launch_env(env({{"WORLD_SIZE", "2"}})), Contains("RANK is not set"));
  CHECK_THROWS_WITH(read_launch_env(env({{"RANK", "2"}, {"WORLD_SIZE", "2"}})),
                    Contains("RANK=2 is outside the world of WORLD_SIZE=2"));
  CHECK_THROWS_WITH(read_launch_env(env({{"RANK", "x"}, {"WORLD_SIZE", "2"}})),
                    Contains("RANK must be an integer, got 'x'"));
  CHECK_THROWS_WITH(read_launch_env(env({{"OMPI_COMM_WORLD_RANK", "0"}})),
                    Contains("OMPI_COMM_WORLD_SIZE"));
  CHECK_THROWS_WITH(read_launch_env(env({{"RANK", "0"}, {"WORLD_SIZE", "0"}})),
                    Contains("WORLD_SIZE must be at least 1"));
}

TEST_CASE("torchrun's agent-store, node and run variables", "[comm][launch]") {
  const auto info = read_launch_env(env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                                         {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"},
                                         {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"},
                                         {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                         {"TORCHELASTIC_RUN_ID", "job7"}}));
  CHECK(info.launcher == Launcher::kTorchrun);
  CHECK(info.local_world_size == 2);
  CHECK(info.group_rank == 1);
  CHECK(info.use_agent_store);
  CHECK(info.run_id == "job7");
  // torchrun writes str(False) without the agent store; anything but "True" means no agent store.
  for (const char* value : {"False", "true", "1"}) {
    CHECK_FALSE(read_launch_env(env({{"RANK", "0"}, {"WORLD_SIZE", "1"},
                                     {"TORCHELASTIC_USE_AGENT_STORE", value}}))
                    .use_agent_store);
  }
  const auto ompi = read_launch_env(env({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  CHECK(ompi.local_world_size == 2);
  CHECK_FALSE(ompi.use_agent_store);
  CHECK_THROWS_WITH(read_launch_env(env({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"},
                                         {"LOCAL_WORLD_SIZE", "2"}})),
                    Contains("LOCAL_RANK=2 is outside LOCAL_WORLD_SIZE=2"));
}

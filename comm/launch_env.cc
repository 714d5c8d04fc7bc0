#include "comm/launch_env.h"

#include <cstdint>
#include <cstdlib>

#include <c10/util/Exception.h>

namespace fsdp::comm {
namespace {

using Getenv = std::function<std::optional<std::string>(const char*)>;

std::optional<int> read_int(const Getenv& getenv, const char* name) {
  const auto value = getenv(name);
  if (!value) return std::nullopt;
  char* end = nullptr;
  const long parsed = std::strtol(value->c_str(), &end, 10);
  TORCH_CHECK(!value->empty() && end != nullptr && *end == '\0' && parsed >= INT32_MIN &&
                  parsed <= INT32_MAX,
              "fsdp comm: environment variable ", name, " must be an integer, got '", *value, "'");
  return static_cast<int>(parsed);
}

void check_consistent(const LaunchInfo& info, const char* rank_var, const char* size_var) {
  TORCH_CHECK(info.world_size >= 1, "fsdp comm: ", size_var, " must be at least 1, got ",
              info.world_size);
  TORCH_CHECK(info.rank >= 0 && info.rank < info.world_size, "fsdp comm: ", rank_var, "=",
              info.rank, " is outside the world of ", size_var, "=", info.world_size, " ranks");
  TORCH_CHECK(info.local_rank >= 0, "fsdp comm: the local rank must be non-negative, got ",
              info.local_rank);
}

}  // namespace

const char* to_string(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone: return "none (single process)";
    case Launcher::kTorchrun: return "torchrun";
    case Launcher::kMpirun: return "mpirun";
  }
  return "?";
}

LaunchInfo read_launch_env(const Getenv& getenv_in) {
  const Getenv getenv = getenv_in ? getenv_in : Getenv([](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });

  LaunchInfo info;
  const auto rank = read_int(getenv, "RANK");
  const auto world = read_int(getenv, "WORLD_SIZE");
  if (rank || world) {
    TORCH_CHECK(rank && world, "fsdp comm: torchrun-style launch needs both RANK and WORLD_SIZE; ",
                rank ? "WORLD_SIZE" : "RANK", " is not set");
    info.launcher = Launcher::kTorchrun;
    info.rank = *rank;
    info.world_size = *world;
    info.local_rank = read_int(getenv, "LOCAL_RANK").value_or(0);
    info.master_addr = getenv("MASTER_ADDR").value_or("");
    info.master_port = read_int(getenv, "MASTER_PORT").value_or(0);
    check_consistent(info, "RANK", "WORLD_SIZE");
    // Under mpirun as well (a user exporting RANK/WORLD_SIZE themselves): the two must agree.
    const auto ompi_rank = read_int(getenv, "OMPI_COMM_WORLD_RANK");
    const auto ompi_size = read_int(getenv, "OMPI_COMM_WORLD_SIZE");
    if (ompi_rank && ompi_size) {
      TORCH_CHECK(*ompi_rank == info.rank && *ompi_size == info.world_size,
                  "fsdp comm: RANK/WORLD_SIZE (", info.rank, "/", info.world_size,
                  ") disagree with mpirun's OMPI_COMM_WORLD_RANK/SIZE (", *ompi_rank, "/",
                  *ompi_size, ")");
      info.launcher = Launcher::kMpirun;
    }
    return info;
  }

  struct MpiVars { const char* rank; const char* size; const char* local_rank; };
  for (const MpiVars vars : {MpiVars{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                     "OMPI_COMM_WORLD_LOCAL_RANK"},
                             MpiVars{"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"}}) {
    const auto mpi_rank = read_int(getenv, vars.rank);
    const auto mpi_size = read_int(getenv, vars.size);
    if (!mpi_rank && !mpi_size) continue;
    TORCH_CHECK(mpi_rank && mpi_size, "fsdp comm: mpirun-style launch needs both ", vars.rank,
                " and ", vars.size);
    info.launcher = Launcher::kMpirun;
    info.rank = *mpi_rank;
    info.world_size = *mpi_size;
    info.local_rank = read_int(getenv, vars.local_rank).value_or(0);
    info.master_addr = getenv("MASTER_ADDR").value_or("");
    info.master_port = read_int(getenv, "MASTER_PORT").value_or(0);
    check_consistent(info, vars.rank, vars.size);
    return info;
  }
  return info;  // a plain run: one process
}

}  // namespace fsdp::comm

#pragma once
// Who launched this process and where it stands in the job: rank, world size and local rank from
// torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), Open MPI's mpirun
// (OMPI_COMM_WORLD_*) or MPICH/Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID); a plain run is a
// single process of world size 1.

#include <functional>
#include <optional>
#include <string>

namespace fsdp::comm {

enum class Launcher { kNone, kTorchrun, kMpirun };

const char* to_string(Launcher launcher);

struct LaunchInfo {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  // torchrun's rendezvous address, if set
  int master_port = 0;      // torchrun's rendezvous port, if set
};

/// Reads the launch variables through `getenv` (defaults to the process environment). Inconsistent
/// or partial variables (e.g. RANK without WORLD_SIZE, a rank outside the world) are a c10::Error
/// naming the variables.
LaunchInfo read_launch_env(
    const std::function<std::optional<std::string>(const char*)>& getenv = nullptr);

}  // namespace fsdp::comm

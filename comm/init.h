#pragma once
// Setting up communication from the launcher's environment.
//
//   auto pg = fsdp::comm::init_process_group();   // under mpirun, torchrun, or a plain run
//   pg.comm->all_reduce(t).wait();
//
// The backend follows the device the program trains on: CPU tensors -> the Open MPI backend (launch
// with mpirun), CUDA tensors -> NCCL (link //comm:nccl; launch with torchrun or mpirun).

#include <chrono>
#include <memory>
#include <optional>

#include <c10/core/Device.h>

#include "comm/communicator.h"
#include "comm/launch_env.h"

namespace fsdp::comm {

struct InitOptions {
  /// The device this process computes on. Default: cuda:LOCAL_RANK when a GPU is visible and the
  /// NCCL backend is linked, else the CPU.
  std::optional<at::Device> device;
  /// How long one collective may take before the job is aborted with a report. Default: the
  /// FSDP_COMM_TIMEOUT_S environment variable, else 10 minutes.
  std::optional<std::chrono::milliseconds> timeout;
};

struct ProcessGroup {
  LaunchInfo launch;
  at::Device device = at::kCPU;
  std::shared_ptr<Communicator> comm;
};

/// Creates the process group for this job and makes it the default one. Every rank calls it.
ProcessGroup init_process_group(InitOptions options = {});

/// The default process group (the last one init_process_group made). A c10::Error when none was
/// made.
const ProcessGroup& default_process_group();

/// Whether init_process_group ran in this process.
bool is_initialized();

/// The collective timeout `options` resolve to (explicit value, FSDP_COMM_TIMEOUT_S, or 10 min).
std::chrono::milliseconds resolve_timeout(const InitOptions& options);

}  // namespace fsdp::comm

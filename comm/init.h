#pragma once
// Setting up communication from the launcher's environment.
//
//   auto pg = fsdp::comm::init_process_group();   // under mpirun, torchrun, or a plain run
//   pg.comm->all_reduce(t).wait();
//   ...
//   fsdp::comm::destroy_process_group();           // before main returns
//
//   // GPU: bind this rank to its GPU and create the NCCL communicators now (torch's device_id=).
//   auto pg = fsdp::comm::init_process_group(fsdp::comm::InitOptions{.device_id = at::Device(at::kCUDA, local_rank)});
//
// The backend follows the device the program trains on: CPU tensors -> the Open MPI backend (launch
// with mpirun), CUDA tensors -> NCCL (link //comm:nccl; launch with torchrun or mpirun). Under
// torchrun the ranks meet in the agent's store as torch.distributed's Python workers do (see
// [Note: torchrun rendezvous] in comm/launch_env.h).

#include <chrono>
#include <memory>
#include <optional>

#include <c10/core/Device.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/launch_env.h"

namespace fsdp::comm {

struct InitOptions {
  /// The device this process computes on. Default: cuda:LOCAL_RANK when a GPU is visible and the
  /// NCCL backend is linked, else the CPU.
  std::optional<at::Device> device;
  /// As torch.distributed.init_process_group(device_id=...): binds the group to this CUDA device
  /// (index required) and creates the NCCL communicators eagerly, inside init_process_group,
  /// instead of at the first collective; so a bad device or an unreachable peer fails here. Implies
  /// `device` (which, if also set, must be the same).
  std::optional<at::Device> device_id;
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
/// Under NCCL, before any communicator exists, the ranks check through the rendezvous store that no
/// two of them on one node use the same GPU (a c10::Error naming both ranks otherwise).
ProcessGroup init_process_group(InitOptions options = {});

/// The default process group (the last one init_process_group made). A c10::Error when none was
/// made.
const ProcessGroup& default_process_group();

/// Whether a default process group exists (init_process_group ran and destroy_process_group did
/// not since).
bool is_initialized();

/// Ends the default process group, as torch.distributed.destroy_process_group(): waits for the
/// collectives in flight, shuts the backend down (NCCL: ProcessGroupNCCL::shutdown, which destroys
/// its communicators; MPI: the progress thread stops, then MPI_Finalize), and forgets the default
/// group. Call it on every rank before main returns, so nothing is torn down during static
/// destruction. Idempotent: a second call (or one without a group) does nothing. Copies of the
/// ProcessGroup must not be used afterwards.
///
/// After it, init_process_group() works again for NCCL; for the CPU (MPI) backend it is a
/// c10::Error saying that MPI cannot be initialised twice in one process.
///
///   auto pg = fsdp::comm::init_process_group();
///   train(pg);
///   fsdp::comm::destroy_process_group();
void destroy_process_group();

/// The collective timeout `options` resolve to (explicit value, FSDP_COMM_TIMEOUT_S, or 10 min).
std::chrono::milliseconds resolve_timeout(const InitOptions& options);

}  // namespace fsdp::comm

#pragma once
// Who launched this process and where it stands in the job: rank, world size and local rank from
// torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RUN_ID), Open MPI's mpirun
// (OMPI_COMM_WORLD_*) or MPICH/Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID); a plain run is a
// single process of world size 1. Also the rendezvous store torchrun's workers meet in, and the
// check that no two ranks of one node drive the same GPU.
//
//   auto launch = fsdp::comm::read_launch_env();
//   auto store = fsdp::comm::rendezvous_store(launch, std::chrono::minutes(5));  // no CUDA needed
//   auto pg_store = fsdp::comm::default_group_store(store, "cuda");  // the keys Python's NCCL uses
//   store->set("my/key", {1, 2, 3});
//
// [Note: torchrun rendezvous] torch.distributed's env:// rendezvous (_create_c10d_store in
// torch/distributed/rendezvous.py, torch 2.15): when TORCHELASTIC_USE_AGENT_STORE=True and the
// address is the agent's own MASTER_ADDR:MASTER_PORT, the elastic agent already serves a TCPStore
// there and EVERY worker, rank 0 included, connects as a client; otherwise rank 0 serves a
// (multi-tenant) TCPStore on MASTER_PORT and the others connect. init_process_group then wraps
// that store in PrefixStore("default_pg"), the group in PrefixStore("0/") (the default group's
// name) and each device's backend in PrefixStore("<device type>/"); so Python's ProcessGroupNCCL
// of the default group keys its rendezvous as "default_pg/0//cuda//<key>". rendezvous_store() and
// default_group_store() build exactly that, so C++ and Python ranks of one job meet in the same
// keys.

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace fsdp::comm {

enum class Launcher { kNone, kTorchrun, kMpirun };

const char* to_string(Launcher launcher);

struct LaunchInfo {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  /// Processes on this node (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS); 0 when
  /// the launcher does not say.
  int local_world_size = 0;
  /// torchrun's node (agent) index, GROUP_RANK; 0 otherwise.
  int group_rank = 0;
  std::string master_addr;  // torchrun's rendezvous address, if set
  int master_port = 0;      // torchrun's rendezvous port, if set
  /// TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent serves the store at MASTER_ADDR:PORT.
  bool use_agent_store = false;
  /// TORCHELASTIC_RUN_ID (torchrun's --rdzv-id), for messages.
  std::string run_id;
};

/// Reads the launch variables through `getenv` (defaults to the process environment). Inconsistent
/// or partial variables (e.g. RANK without WORLD_SIZE, a rank outside the world) are a c10::Error
/// naming the variables.
LaunchInfo read_launch_env(
    const std::function<std::optional<std::string>(const char*)>& getenv = nullptr);

/// The job's rendezvous store at MASTER_ADDR:MASTER_PORT, created as torch.distributed's env://
/// rendezvous does (see [Note: torchrun rendezvous]): a client on every rank under torchrun's
/// agent store, else a server on rank 0 (multi-tenant) and clients elsewhere. Without MASTER_ADDR a
/// one-rank job gets a private store on a free port; a larger job is an error (the NCCL backend
/// handles mpirun without MASTER_ADDR itself, over MPI). Needs no CUDA. Waits at most `timeout` for
/// the server.
///
///   auto store = fsdp::comm::rendezvous_store(fsdp::comm::read_launch_env(), std::chrono::seconds(60));
c10::intrusive_ptr<c10d::Store> rendezvous_store(const LaunchInfo& launch,
                                                 std::chrono::milliseconds timeout);

/// `store` wrapped as torch.distributed wraps it for the default process group's backend on
/// `device_type` ("cuda" for NCCL, "cpu"): PrefixStore("default_pg") / ("0/") / ("<device_type>/").
c10::intrusive_ptr<c10d::Store> default_group_store(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const std::string& device_type);

/// One rank's claim on a GPU, as exchanged before NCCL communicators are created.
struct DeviceClaim {
  int rank = 0;
  int local_rank = 0;
  std::string host;         // the node (hostname)
  std::string device_uuid;  // the physical GPU (its UUID; the same GPU under any CUDA_VISIBLE_DEVICES)
  int device_index = 0;     // the CUDA device index this rank selected
};

/// Serialises a claim for the store ("rank\tlocal_rank\thost\tuuid\tindex") and back; a malformed
/// text is a c10::Error.
std::string to_store_value(const DeviceClaim& claim);
DeviceClaim device_claim_from_store_value(const std::string& text);

/// The error text when two claims name the same GPU on the same host (the ranks, local ranks, GPU
/// and the hint to map LOCAL_RANK to distinct devices), else nullopt. Pure.
///
///   if (auto error = fsdp::comm::find_shared_device(claims)) TORCH_CHECK(false, *error);
std::optional<std::string> find_shared_device(const std::vector<DeviceClaim>& claims);

/// Checks, before any communicator exists, that `device_index` (the device this rank picked) is
/// visible; when it is not and the device came from LOCAL_RANK (`from_local_rank`) while the node
/// runs more ranks (LOCAL_WORLD_SIZE) than it sees GPUs, the error says so. A c10::Error naming
/// LOCAL_RANK, LOCAL_WORLD_SIZE and the device count otherwise. Pure.
///
///   fsdp::comm::check_local_device(launch, launch.local_rank, device_count, /*from_local_rank=*/true);
void check_local_device(const LaunchInfo& launch, int device_index, int device_count,
                        bool from_local_rank);

}  // namespace fsdp::comm

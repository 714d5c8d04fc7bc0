#pragma once
// NCCL for CUDA tensors: LibTorch's own c10d::ProcessGroupNCCL, with rendezvous through a
// c10d::TCPStore. Linking //comm:nccl registers it as the backend for CUDA devices, which
// init_process_group() then picks for CUDA tensors.
//
//   fsdp::comm::InitOptions options;
//   options.device_id = at::Device(at::kCUDA, launch.local_rank);   // eager communicator init
//   auto pg = fsdp::comm::init_process_group(options);              // -> make_nccl_backend
//
// Rendezvous: with MASTER_ADDR/MASTER_PORT, fsdp::comm::rendezvous_store() (torchrun's protocol:
// under its agent store every rank is a client; see [Note: torchrun rendezvous]) and the backend
// keys under the same PrefixStore chain as torch.distributed's default group ("default_pg/0//cuda/").
// Under mpirun without MASTER_ADDR, rank 0 opens a store on a free port and shares host:port with
// the others over MPI.
//
// Before ProcessGroupNCCL exists the ranks exchange, through the store, which physical GPU (UUID)
// each one uses on which host: two ranks on one GPU are a c10::Error naming both (NCCL itself
// would fail later, less clearly, or hang).

#include <chrono>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "fsdp_cpp/comm/launch_env.h"

namespace fsdp::comm {

/// Whether this process sees at least one CUDA device.
bool cuda_device_available();

/// Creates ProcessGroupNCCL for `device` (a CUDA device; made the current one). With `eager_init`
/// the group is bound to `device` and its communicator is created now (as torch's
/// init_process_group(device_id=...)); otherwise at the first collective.
///
///   auto backend = fsdp::comm::make_nccl_backend(fsdp::comm::read_launch_env(),
///                                                at::Device(at::kCUDA, 0),
///                                                fsdp::comm::kDefaultCollectiveTimeout);
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const LaunchInfo& launch, at::Device device,
                                                    std::chrono::milliseconds timeout,
                                                    bool eager_init = false);

}  // namespace fsdp::comm

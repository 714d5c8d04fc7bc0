#pragma once
// NCCL for CUDA tensors: LibTorch's own c10d::ProcessGroupNCCL, with rendezvous through a
// c10d::TCPStore. Linking //comm:nccl registers it as the backend for CUDA devices, which
// init_process_group() then picks for CUDA tensors.
//
// Rendezvous: under torchrun, MASTER_ADDR:MASTER_PORT (rank 0 hosts the store). Under mpirun without
// MASTER_ADDR, rank 0 opens a store on a free port and shares host:port with the others over MPI.

#include <chrono>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/launch_env.h"

namespace fsdp::comm {

/// Whether this process sees at least one CUDA device.
bool cuda_device_available();

/// Creates ProcessGroupNCCL for `device` (a CUDA device; made the current one).
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const LaunchInfo& launch, at::Device device,
                                                    std::chrono::milliseconds timeout);

}  // namespace fsdp::comm

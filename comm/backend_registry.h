#pragma once
// Backends for device types that are linked in optionally. NCCL lives in //comm:nccl (which links
// libtorch_cuda) and registers itself here when linked, so CPU-only programs never load CUDA.

#include <chrono>
#include <string>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/collective_timeout.h"
#include "comm/launch_env.h"

namespace fsdp::comm {

/// What a backend factory gets besides the launch: the device, the collective timeout, and whether
/// to create the communicators now (eager init, InitOptions::device_id) instead of at the first
/// collective.
struct BackendRequest {
  at::Device device = at::kCPU;
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  bool eager_init = false;
};

using BackendFactory = c10::intrusive_ptr<c10d::Backend> (*)(const LaunchInfo& launch,
                                                              const BackendRequest& request);

/// Registers `factory` as the backend for tensors of `type` (called from static initialisers).
bool register_backend_factory(c10::DeviceType type, const char* name, BackendFactory factory);

/// The factory registered for `type`, or nullptr.
BackendFactory find_backend_factory(c10::DeviceType type);

}  // namespace fsdp::comm

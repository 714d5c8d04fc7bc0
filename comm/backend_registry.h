#pragma once
// Backends for device types that are linked in optionally. NCCL lives in //comm:nccl (which links
// libtorch_cuda) and registers itself here when linked, so CPU-only programs never load CUDA.

#include <chrono>
#include <string>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "fsdp_cpp/comm/collective_timeout.h"
#include "fsdp_cpp/comm/launch_env.h"

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

/// Makes the group of `parent`'s ranks that pass the same `color`: collective over `parent`'s ranks
/// (every rank calls it, in the same order, with its color), `key` this rank's rank in the new
/// group, `size` the group's size, `label` a name for the group (its rendezvous keys and
/// messages). For backends that cannot split themselves (MpiBackend::split can); DeviceMesh uses
/// it for every other backend.
using GroupSplitter = c10::intrusive_ptr<c10d::Backend> (*)(const c10::intrusive_ptr<c10d::Backend>& parent,
                                                             int color, int key, int size,
                                                             const std::string& label);

/// Registers `splitter` for backends whose getBackendName() is `backend_name` (static initialisers).
bool register_group_splitter(const char* backend_name, GroupSplitter splitter);

/// The splitter registered for `backend_name`, or nullptr.
GroupSplitter find_group_splitter(const std::string& backend_name);

}  // namespace fsdp::comm

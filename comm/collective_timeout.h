#pragma once
// The collective timeout when none is given, in one place: the MPI backend's options, the backend
// request and init_process_group's resolution (InitOptions::timeout, FSDP_COMM_TIMEOUT_S) use it.

#include <chrono>

namespace fsdp::comm {

/// How long one collective may take before the job is aborted, unless the caller says otherwise:
/// 10 minutes, as torch.distributed's default for its process groups.
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout = std::chrono::minutes(10);

}  // namespace fsdp::comm

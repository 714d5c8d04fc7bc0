#pragma once
// The progress thread of the MPI backend.
//
// [Note: MPI progress] Every collective of every MpiBackend in the process is issued as a
// non-blocking MPI call, in submission order, by one progress thread, which then polls all requests
// in flight. So the caller returns at once (communication overlaps compute), several collectives can
// be in flight together, and a collective that does not complete within its timeout is detected:
// a blocked MPI call cannot be cancelled, so the thread reports which collective it was and aborts
// the job (MPI_Abort) instead of leaving any rank hanging.

#include <mpi.h>

#include <chrono>
#include <exception>
#include <functional>
#include <string>

namespace fsdp::comm::mpi {

/// One collective handed to the progress thread.
struct PendingCollective {
  /// Names the collective for a timeout report: kind, sequence number, sizes, group.
  std::string description;
  std::chrono::milliseconds timeout{0};
  /// Issues the non-blocking MPI call (runs under the MPI lock); returns an MPI error code.
  std::function<int(MPI_Request*)> start;
  /// Runs once the request completed (outside the MPI lock); may throw.
  std::function<void()> after;
  /// Marks the caller's work finished, with the error if `start` or `after` failed.
  std::function<void(std::exception_ptr)> finish;
};

/// Queues `op`; it is issued after every collective submitted before it.
void submit(PendingCollective op);

}  // namespace fsdp::comm::mpi

#pragma once
// The progress engine of the MPI backend: the progress thread, and waits that drive progress
// themselves.
//
//   mpi::PendingCollective op;          // description, timeout, start, after, finish
//   auto submitted = mpi::submit(std::move(op), /*wait_drives_progress=*/true);
//   mpi::wait(submitted);               // returns once op.finish ran
//
// [Note: MPI progress] Every collective of every MpiBackend in the process is issued as a
// non-blocking MPI call, in submission order, and then polled (MPI_Test) until it completes, so the
// caller returns at once (communication overlaps compute), several collectives can be in flight
// together, and a collective that does not complete within its timeout is detected: a blocked MPI
// call cannot be cancelled, so the poller reports which collective it was and aborts the job
// (MPI_Abort) instead of leaving any rank hanging.
//
// Who issues and polls:
//  - A collective submitted with `wait_drives_progress` is issued at once on the submitting thread
//    (unless older collectives still wait to be issued: then the progress thread issues it after
//    them, keeping the order).
//  - One progress thread polls every collective in flight while nobody waits for it, with a short
//    back-off (yield, then 10-100 us sleeps) when nothing completes. With nothing to poll it naps
//    200 us at a time while collectives were active in the last 20 ms (so issuing one needs no
//    wake-up system call), then sleeps until the next submission wakes it.
//  - A thread that calls `wait()` on a collective that is the only one outstanding (nothing else in
//    flight, nothing queued) becomes the driver: the progress thread stands aside and the waiting
//    thread polls itself, runs the completion and returns without a thread hand-off. Collectives
//    submitted while it drives are issued in order and polled by it too until its own completes;
//    then the progress thread takes over. A wait on a collective with others outstanding sleeps
//    until the progress thread completes it, and becomes the driver if it is the only one left.
//  - Without `wait_drives_progress` (the previous behaviour, kept for comparisons), the progress
//    thread issues the collective and the waiter sleeps until the thread completes it.
//  - A collective submitted with a size check (`check_start`, see PendingCollective) goes through
//    two stages: first a small exchange of its kind and sizes on a separate communicator, then the
//    collective itself, issued in submission order among the collectives of its communicator
//    (`order`): once every rank's description matched, or at once, beside its check, when the
//    backend's `speculate` says that every rank can tell what it will be (the same collective at
//    the same point of earlier iterations: [Note: MPI size check] in mpi_backend.cc). Checks are
//    verified in submission order per communicator. A mismatch completes it with an error on every
//    rank at once; the collective itself ran on no rank, or, where some ranks started it
//    speculatively, the others ran a placeholder of the same shape (`mismatch_start`), so MPI
//    never sees mismatched calls and the group stays usable.
//  - Point-to-point operations ([Note: MPI point-to-point] in comm/mpi_point_to_point.cc) use the
//    same stages without the ordering: a recv's first stage receives the sender's envelope (in
//    place of the size check), its second receives the payload; `order` is null, so neither waits
//    for older operations, and a stage may issue several requests (payload and acknowledgement).
//  - Completion callbacks (`after`, `finish`, and through them the callbacks of the Work's future)
//    run on whichever thread completed the collective: the progress thread or a driving waiter.
//    A callback that waits for another collective through `wait()` drives progress itself on that
//    thread (it may be the only poller), so this works and cannot block the engine.
//  - Deadlines are enforced by a watchdog thread of their own, from submission to completion, so a
//    collective that does not complete in time aborts the job with a report even when nobody polls
//    (e.g. a completion callback blocked the progress thread in something other than `wait()`).
//    Before aborting, the watchdog dumps the flight recorder ([Note: flight recorder]) with the
//    report as the reason.
// Every MPI call runs under mpi_lock() (comm/mpi_runtime.h), whichever thread makes it, so
// MPI_THREAD_SERIALIZED is enough; only one thread drives at a time.

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

namespace fsdp::comm::mpi {

/// The most requests one stage of an operation may issue (a point-to-point send: its envelope, its
/// payload and the receiver's acknowledgement).
inline constexpr int kMaxRequestsPerStage = 3;

/// One collective (or point-to-point operation) handed to the progress engine.
struct PendingCollective {
  /// Names the collective for a timeout report: kind, sequence number, sizes, group, issuing API.
  std::string description;
  /// From submission to completion; past it, the job is aborted with a report.
  std::chrono::milliseconds timeout{0};
  /// Optional size check. `check_start` issues the exchange of this collective's description with
  /// the other ranks (non-blocking, under the MPI lock; returns an MPI error code); once it
  /// completed, `check_verify` runs (under the engine's lock, no MPI) and throws when the ranks'
  /// descriptions differ, which completes the collective with that error; else `start` follows.
  std::function<int(MPI_Request*)> check_start;
  std::function<void()> check_verify;
  /// Optional, with a check: asked at most once, under the engine's lock, after check_verify ran
  /// for every older collective of the same `order` and before it runs for this one; true lets
  /// `start` be issued (in order) before this collective's own check completed. The collective
  /// then completes once both finished, with check_verify's error if it threw.
  std::function<bool()> speculate;
  /// Optional: issued in `start`'s place (same order, same request array) when check_verify threw
  /// and `start` was not issued; may issue nothing. The collective then fails with the check's
  /// error once these requests completed.
  std::function<int(MPI_Request*)> mismatch_start;
  /// Collectives with the same `order` (their communicator) are started (`start`) in submission
  /// order, whatever order their checks complete in, as MPI requires. null: started as soon as its
  /// own first stage completed (point-to-point operations, matched by MPI tags instead).
  const void* order = nullptr;
  /// Issues the non-blocking MPI call (runs under the MPI lock); returns an MPI error code. It is
  /// given an array of kMaxRequestsPerStage requests (all MPI_REQUEST_NULL) and may issue up to
  /// that many; the stage completes when all of them completed. Collectives issue one.
  std::function<int(MPI_Request*)> start;
  /// Runs once the request completed (outside the MPI lock); may throw.
  std::function<void()> after;
  /// Marks the caller's work finished, with the error if `start` or `after` failed. Runs exactly
  /// once, on the thread that completed the collective; `start` and `after` (and what they own)
  /// are released before it runs.
  std::function<void(std::exception_ptr)> finish;
  /// Optional wording of the timeout report for operations that are not collectives
  /// (point-to-point): what the operation waits for while its first stage (`check_start`) is in
  /// flight, and once `start` issued it, and the advice that ends the report. Empty: the
  /// collectives' wording.
  std::string waiting_first_stage;
  std::string waiting_running;
  std::string timeout_advice;
  /// The flight recorder's entry of this operation (comm/flight_recorder.h): submit() takes it from
  /// flight_recorder::IssueScope::current() when 0. The engine records "started" when `start`
  /// issued it (its size check passed on every rank, or a recv's envelope arrived), and its
  /// completion or failure.
  uint64_t flight_id = 0;
};

/// A submitted collective, to pass to `wait()`. Opaque.
struct Submitted;

/// Queues `op`; it is issued after every collective submitted before it. With
/// `wait_drives_progress`, it is issued on this thread when nothing older waits to be issued, and
/// `wait()` may drive it (see [Note: MPI progress]); otherwise the progress thread issues it.
std::shared_ptr<Submitted> submit(PendingCollective op, bool wait_drives_progress);

/// Blocks until `submitted`'s `finish` ran. Drives progress on this thread while the collective is
/// the only one outstanding and it was submitted with `wait_drives_progress`, or when called from a
/// completion callback (which may run on the only poller); otherwise sleeps until the progress
/// thread completed it.
void wait(const std::shared_ptr<Submitted>& submitted);

/// Counts of completed collectives by who completed them (process-wide, since start).
struct ProgressCounters {
  uint64_t completed_by_waiter = 0;  // a thread inside wait() drove it to completion
  uint64_t completed_by_thread = 0;  // the progress thread did
  uint64_t drives = 0;               // times a waiting thread became the driver
  uint64_t nested_drives = 0;        // times a wait() inside a completion callback drove progress
  uint64_t check_mismatches = 0;     // collectives refused because the ranks' sizes differed
  uint64_t speculative_starts = 0;   // collectives started before their own check was verified
  uint64_t mismatch_placeholders = 0;  // placeholders issued after a failed check (mismatch_start)
};
ProgressCounters progress_counters();

}  // namespace fsdp::comm::mpi

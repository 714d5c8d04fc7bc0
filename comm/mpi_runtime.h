#pragma once
// Process-wide Open MPI life cycle: initialisation with thread support, the lock every MPI call in
// the project takes, finalisation at exit, and the job-wide abort used when a collective times out.
//
// Contract: every MPI call the project makes runs under `mpi_lock()`, from whichever thread makes it
// (the progress thread, a thread issuing a collective, a thread whose wait() drives progress: see
// [Note: MPI progress] in comm/mpi_progress.h). Open MPI is initialised with MPI_THREAD_MULTIPLE
// where available; the lock makes MPI_THREAD_SERIALIZED enough, and less is refused.
//
//   fsdp::comm::mpi::ensure_initialized();
//   std::lock_guard<std::mutex> guard(fsdp::comm::mpi::mpi_lock());
//   MPI_Comm_rank(MPI_COMM_WORLD, &rank);

#include <mutex>
#include <string>

namespace fsdp::comm::mpi {

/// Initialises MPI once per process (idempotent, thread-safe). Called by everything that uses MPI;
/// users never need to. Fails if MPI was finalised already: MPI cannot be initialised twice in one
/// process.
void ensure_initialized();

/// Stops the progress thread (after the collectives in flight complete) and calls MPI_Finalize, now
/// rather than at exit. Idempotent; a no-op when MPI was never initialised. After it, nothing in
/// this process can use MPI again. Called by fsdp::comm::destroy_process_group().
void finalize();

/// Whether MPI_Finalize has run, ours (finalize(), destroy_process_group, at exit) or the
/// program's own (MPI_Finalized): MPI handles must not be freed after it, and nothing of the
/// library makes an MPI call then (an MpiBackend destroyed afterwards frees nothing).
bool finalized();

/// The lock held around every MPI call.
std::mutex& mpi_lock();

/// The thread level MPI provides (MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE; initialises MPI).
///
///   if (fsdp::comm::mpi::thread_level() == MPI_THREAD_MULTIPLE) { ... }
int thread_level();

/// Size of MPI_COMM_WORLD (initialises MPI).
int world_size();

/// Prints `message` to stderr (prefixed with this rank) and aborts every process of the job through
/// MPI_Abort. Never returns.
[[noreturn]] void abort_job(const std::string& message, int exit_code = 3);

/// Error text for an MPI return code.
std::string error_string(int code);

}  // namespace fsdp::comm::mpi

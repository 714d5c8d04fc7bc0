#include "fsdp_cpp/comm/mpi_runtime.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

#include <c10/util/Exception.h>

namespace fsdp::comm::mpi {
namespace {

std::once_flag g_init_once;
bool g_finalized = false;

void finalize_at_exit();

void initialize() {
  int already = 0;
  MPI_Initialized(&already);
  if (already) {
    // Initialised by someone else (e.g. the program itself): the lock still needs SERIALIZED.
    int provided = 0;
    MPI_Query_thread(&provided);
    TORCH_CHECK(provided >= MPI_THREAD_SERIALIZED,
                "fsdp comm: MPI was initialised with thread level ", provided,
                ", but at least MPI_THREAD_SERIALIZED is needed (collectives are issued and polled "
                "from several threads, one at a time); initialise it with MPI_Init_thread");
  } else {
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    TORCH_CHECK(rc == MPI_SUCCESS, "fsdp comm: MPI_Init_thread failed: ", error_string(rc));
    TORCH_CHECK(provided >= MPI_THREAD_SERIALIZED,
                "fsdp comm: the MPI library provides thread level ", provided,
                ", but at least MPI_THREAD_SERIALIZED is needed (collectives run on a progress thread)");
    std::atexit(finalize_at_exit);
  }
}

}  // namespace

// Declared in mpi_progress.cc: stops the progress thread before MPI goes away.
void stop_progress_engine();

namespace {
void finalize_at_exit() { finalize(); }
}  // namespace

void finalize() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return;
  stop_progress_engine();
  std::lock_guard<std::mutex> guard(mpi_lock());
  int finalized_already = 0;
  MPI_Finalized(&finalized_already);
  if (!finalized_already) MPI_Finalize();
  g_finalized = true;
}

void ensure_initialized() {
  TORCH_CHECK(!finalized(),
              "fsdp comm: MPI was finalised already (by fsdp::comm::destroy_process_group(), at exit, or "
              "by the program's own MPI_Finalize), and MPI cannot be initialised again in the same process; keep one process "
              "group for the life of the program, or call destroy_process_group() only at its end");
  std::call_once(g_init_once, initialize);
}

bool finalized() {
  if (g_finalized) return true;
  // MPI_Finalized may be called at any time, before MPI_Init and after MPI_Finalize: it sees a
  // program that finalised MPI itself (an MPI application embedding the library).
  int done = 0;
  MPI_Finalized(&done);
  return done != 0;
}

std::mutex& mpi_lock() {
  static std::mutex* lock = new std::mutex();  // never destroyed: used from atexit handlers
  return *lock;
}

int thread_level() {
  ensure_initialized();
  int provided = 0;
  std::lock_guard<std::mutex> guard(mpi_lock());
  MPI_Query_thread(&provided);
  return provided;
}

int world_size() {
  ensure_initialized();
  int size = 0;
  std::lock_guard<std::mutex> guard(mpi_lock());  // like every MPI call (mpi_runtime.h)
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

void abort_job(const std::string& message, int exit_code) {
  int rank = -1;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized && !finalized()) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "[fsdp comm] rank %d: %s\n", rank, message.c_str());
  std::fflush(stderr);
  // No lock: another thread may hold it while blocked in MPI; MPI_Abort must still go through.
  if (initialized && !finalized()) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, length);
}

}  // namespace fsdp::comm::mpi

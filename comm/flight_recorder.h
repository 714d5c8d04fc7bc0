#pragma once
// The flight recorder: each process keeps a bounded ring of its last collectives and point-to-point
// operations, and writes it out as JSON when a job ends badly (a collective timeout, a fatal
// signal, a divergence error) or on request. tools/flight_recorder.py reads every rank's dump, lines
// the ranks up per communicator by sequence number and names the first operation on which they
// disagree, what each rank was doing and which ranks never arrived. See docs/flight_recorder.md.
//
//   fsdp::comm::flight_recorder::dump("before the checkpoint");   // <dir>/flight_recorder.rank<R>.json
//   // shell: python3 tools/flight_recorder.py <dir>
//
// [Note: flight recorder] One process-wide ring of `capacity()` entries (default kDefaultEntries,
// FSDP_FLIGHT_RECORDER_ENTRIES; 0 turns the recorder off: nothing is recorded, no handler is
// installed). The Communicator records every operation it issues (record_issue, before the backend
// sees it, so an operation whose issue throws is recorded as failed), and its completion when
// wait() returns or throws; the MPI progress engine adds "started" (its size check passed on every
// rank, or a point-to-point operation's first stage completed) and the completion of operations
// nobody waits for. An entry is fixed-size (strings are truncated), so recording allocates nothing
// and a dump can be written from a signal handler: the ring is formatted into a pre-allocated
// buffer and written with write(2). Entries are identified by a process-wide id; an update of an
// entry already overwritten by a newer one is dropped.
//
// Dumps go to `<dir>/flight_recorder.rank<R>.json` (written to a temporary name, then renamed):
// <dir> is FSDP_FLIGHT_RECORDER_DIR, else ./fsdp_flight_recorder under the working directory at
// the first record; R is the process's world rank (the first communicator that knows it, else
// OMPI_COMM_WORLD_RANK / PMIX_RANK / PMI_RANK / RANK / SLURM_PROCID, else "pid<PID>"). A later
// dump of the same process replaces the file and lists the earlier dumps' reasons.
//
// Dumped automatically: when the MPI backend's watchdog aborts the job for a collective timeout
// (comm/mpi_progress.cc), and on SIGTERM, SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL (then the
// previous handler runs, or the default action); SIGUSR1 dumps and the process goes on. Handlers
// are installed at the first record unless FSDP_FLIGHT_RECORDER_SIGNALS=0; SIGUSR1's only when
// nobody handles it yet.

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::comm::flight_recorder {

inline constexpr int kDefaultEntries = 2048;

enum class State : uint8_t { kIssued = 0, kStarted, kCompleted, kFailed };
const char* to_string(State state);

/// What the issuer knows of an operation. Strings are copied (truncated) by record_issue.
struct Issue {
  const char* comm_name = "";   // the communicator's name (its backend's group description)
  int comm_size = 0;
  int comm_rank = 0;
  int world_rank = -1;          // this rank's world rank, -1 when the communicator does not know
  const char* world_ranks = ""; // the group's world ranks as a JSON array ("[0,2]"), "" unknown
  uint64_t sequence = 0;        // collectives: Communicator::sequence_number() of this one;
                                // point-to-point: its own count within the communicator
  bool point_to_point = false;
  const char* kind = "";        // to_string(CollectiveKind)
  int peer = -1;                // point-to-point: the peer's rank in the group
  int tag = -1;                 // point-to-point: the tag
  uint64_t channel_sequence = 0;  // point-to-point: count of this direction/peer/tag, from 1
  const char* label = "";       // a collective's tag (a unit's FQN), a transfer's label
  const char* api = "";         // comm::IssuingApi::current() when issued
  const char* dtype = "";
  int64_t input_elements = -1;  // -1: not applicable
  int64_t output_elements = -1;
  int64_t bytes = 0;            // as the Communicator's stats count them
};

/// A copy of one entry (tests, tools).
struct Entry {
  uint64_t id = 0;  // process-wide record number, from 1
  std::string comm_name;
  int comm_size = 0;
  int comm_rank = 0;
  int world_rank = -1;
  std::string world_ranks;
  uint64_t sequence = 0;
  bool point_to_point = false;
  std::string kind;
  int peer = -1;
  int tag = -1;
  uint64_t channel_sequence = 0;
  uint64_t backend_sequence = 0;  // 0: not known
  std::string label;
  std::string api;
  std::string dtype;
  int64_t input_elements = -1;
  int64_t output_elements = -1;
  int64_t bytes = 0;
  State state = State::kIssued;
  std::string error;
  int64_t issued_ns = 0;    // wall clock (CLOCK_REALTIME), ns since the epoch
  int64_t started_ns = 0;   // 0: not known
  int64_t finished_ns = 0;  // completed or failed; 0: not yet
};

/// Whether the recorder records (capacity() > 0).
bool enabled();
/// Entries kept (FSDP_FLIGHT_RECORDER_ENTRIES at the first use, else kDefaultEntries).
int capacity();
/// Operations recorded since the start (or reset), including those overwritten.
uint64_t recorded();

/// Records an operation as issued; returns its id (0 when the recorder is off).
uint64_t record_issue(const Issue& issue);
/// Later states of entry `id` (0: ignored). A state never goes back (a completion recorded by the
/// progress engine and again by wait() is one completion).
void record_started(uint64_t id);
void record_completed(uint64_t id);
void record_failed(uint64_t id, const std::string& error);
/// The backend's own number of entry `id` (the MPI backend's "#N" in its error and timeout reports,
/// which also counts collectives the Communicator does not, e.g. all_gather_bytes' size exchange).
void record_backend_sequence(uint64_t id, uint64_t sequence);

/// The entries kept, oldest first.
std::vector<Entry> entries();

/// The dump as JSON text (what dump() writes).
std::string to_json(const std::string& reason);

/// Writes the dump file; returns its path, or "" when the recorder is off or the file could not be
/// written (a line on stderr says why). Thread-safe; prints one line on stderr naming the file.
///
///   fsdp::comm::flight_recorder::dump("fully_shard: the forward order differs across ranks");
std::string dump(const std::string& reason);
/// Where dump() writes.
std::string dump_path();

/// This process's world rank, which names the dump file (the Communicator sets it from the first
/// communicator that knows its world ranks; the launcher's variables are the fallback).
void set_rank(int world_rank);

/// Tests: clears the ring and gives it `entries` entries (0: off), dumping to `dir` when not empty;
/// forgets the rank set_rank() gave; installs the signal handlers again where something replaced
/// them (Catch2 restores its predecessors' handlers after each test case). Not thread-safe against
/// operations in flight.
void reset_for_testing(int entries, const std::string& dir = {});

/// The id of the operation being issued on this thread (the Communicator opens the scope around
/// the backend's call; the MPI backend's progress engine reads it to record "started" and
/// completions of the entry).
class IssueScope {
 public:
  explicit IssueScope(uint64_t id);
  ~IssueScope();
  IssueScope(const IssueScope&) = delete;
  IssueScope& operator=(const IssueScope&) = delete;
  static uint64_t current();

 private:
  uint64_t outer_;
};

}  // namespace fsdp::comm::flight_recorder

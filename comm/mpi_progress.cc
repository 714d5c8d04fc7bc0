#include "fsdp_cpp/comm/mpi_progress.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/flight_recorder.h"
#include "fsdp_cpp/comm/mpi_runtime.h"

namespace fsdp::comm::mpi {

using Clock = std::chrono::steady_clock;

struct Submitted {
  // Where the collective is (all guarded by the engine's mutex).
  enum class Stage {
    kQueued,    // submitted, nothing issued yet
    kChecking,  // its first stage (the size check) is in flight or done; `start` not issued yet
    kRunning,   // `start` (or `mismatch_start`) issued; a speculative start's check may still run
    kDone,      // completed in MPI (or failed); `finish` pending or done
  };
  PendingCollective op;
  bool wait_drives_progress = false;
  Stage stage = Stage::kQueued;
  bool check_done = false;      // the first stage's requests completed (true without a check)
  bool check_verified = false;  // check_verify ran (true without a check)
  std::exception_ptr check_error;  // what check_verify threw: the ranks' descriptions differ
  bool decided = false;         // `speculate` was asked (or can no longer be)
  bool speculative = false;     // `start` issued before its own check was verified
  bool transfer_done = false;   // kRunning: the requests of `start` completed
  // The first stage's requests (the size check, a recv's envelope) and those of `start`: apart,
  // since a speculative start runs while its check is still in flight.
  std::array<MPI_Request, kMaxRequestsPerStage> first_stage{};
  std::array<MPI_Request, kMaxRequestsPerStage> requests{};
  Clock::time_point submitted_at;
  Clock::time_point deadline;  // submission + timeout
  bool finished = false;       // op.finish ran
};

namespace {

using Entry = std::shared_ptr<Submitted>;
using Stage = Submitted::Stage;

// A collective whose request completed (or failed), to finish outside the lock.
struct Completed {
  Entry entry;
  int mpi_error = MPI_SUCCESS;  // the request's status
  std::exception_ptr error;     // set when issuing or the size check failed
};

// The text of a failure, for the flight recorder.
std::string error_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// Dumps the flight recorder, then aborts the job with `report`.
[[noreturn]] void dump_and_abort(const std::string& report) {
  flight_recorder::dump(report);
  abort_job(report);
}

// How deep this thread is inside completion callbacks (finish): a wait() there may be on the only
// thread that polls, so it drives progress itself.
thread_local int t_finishing_depth = 0;

// [Note: MPI progress] (mpi_progress.h). Lock order: mutex_, then mpi_lock().
class ProgressEngine {
  // With nothing to poll, the progress thread naps kNap at a time while collectives were active
  // within the last kStayAwake, then sleeps until woken.
  static constexpr std::chrono::microseconds kNap{200};
  static constexpr std::chrono::milliseconds kStayAwake{20};

  // Back-off of a thread that polls in-flight collectives without progress: yield first (a small
  // collective completes within microseconds, and on an oversubscribed machine the rank it waits
  // for needs the core), then sleep short, then long, so that a long wait does not hold a core.
  // The progress thread (run) counts its fruitless polls since the last progress:
  static constexpr int kIdleYieldPolls = 64;        // polls that only yield
  static constexpr int kIdleShortSleepPolls = 1024;  // polls up to which it sleeps kShortSleep
  // A waiter that drives (drive) measures how long it has waited:
  static constexpr std::chrono::milliseconds kDriveYieldFor{1};        // yields only
  static constexpr std::chrono::milliseconds kDriveShortSleepFor{50};  // sleeps kShortSleep
  // Then kLongSleep a poll. Short: a collective finishing between polls is seen within 10 us.
  static constexpr std::chrono::microseconds kShortSleep{10};
  // Long: ~10k polls a second at most once a collective is known to be slow.
  static constexpr std::chrono::microseconds kLongSleep{100};

 public:
  Entry submit(PendingCollective op, bool wait_drives_progress) {
    auto entry = std::make_shared<Submitted>();
    entry->requests.fill(MPI_REQUEST_NULL);
    entry->first_stage.fill(MPI_REQUEST_NULL);
    entry->op = std::move(op);
    if (entry->op.flight_id == 0) entry->op.flight_id = flight_recorder::IssueScope::current();
    entry->wait_drives_progress = wait_drives_progress;
    entry->submitted_at = Clock::now();
    entry->deadline = entry->submitted_at + entry->op.timeout;
    std::exception_ptr issue_error;
    bool wake = true;
    bool wake_watchdog = false;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      TORCH_CHECK(!stopping_, "fsdp comm: collective '", entry->op.description,
                  "' submitted while the process is shutting down MPI");
      if (!thread_.joinable()) {
        thread_ = std::thread([this] { run(); });
        watchdog_ = std::thread([this] { watch(); });
      }
      if (entry->deadline < watching_until_) wake_watchdog = true;
      if (wait_drives_progress && queue_.empty()) {
        // Issued here, under mutex_: nothing older waits to be issued and nobody else can issue
        // until this returns, so the submission order is the issue order.
        issue_error = issue_locked(*entry);
        if (!issue_error) {
          in_flight_.push_back(entry);
          // Without a check, or when it may start speculatively ([Note: MPI size check] in
          // mpi_backend.cc), the collective itself starts here (unless older ones of its
          // communicator have not started yet).
          advance_locked();
        }
        // The thread only needs waking from a long sleep: while collectives come and go it naps
        // and looks again by itself, so a caller that waits right away drives its collective
        // without a wake-up (a system call) and without the thread polling beside it.
        wake = !issue_error && thread_asleep_;
      } else {
        queue_.push_back(entry);  // the thread issues it
      }
    }
    if (wake_watchdog) watchdog_wake_.notify_one();
    if (issue_error) {
      entry->stage = Stage::kDone;
      Completed c{entry, MPI_SUCCESS, issue_error};
      finish(c, /*by_waiter=*/false);
    } else if (wake) {
      progress_wake_.notify_one();
    }
    return entry;
  }

  void wait(const Entry& entry) {
    std::unique_lock<std::mutex> guard(mutex_);
    while (!entry->finished) {
      const bool no_driver = driver_ == std::thread::id();
      if (t_finishing_depth > 0 && (no_driver || driver_ == std::this_thread::get_id())) {
        // Inside a completion callback: this thread may be the progress thread or the driver, the
        // only ones that poll, so waiting for someone else to poll could wait forever.
        nested_drives_.fetch_add(1);
        drive(guard, entry);
        continue;
      }
      const bool alone = entry->wait_drives_progress && no_driver && queue_.empty() && ready_.empty() &&
                         in_flight_.size() == 1 && in_flight_.front() == entry;
      if (alone) {
        drives_.fetch_add(1);
        drive(guard, entry);
      } else {
        // Woken when a collective finishes (this one, or one that leaves this one alone) and when
        // a driver stops driving.
        done_.wait(guard);
      }
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      stopping_ = true;
    }
    progress_wake_.notify_one();
    watchdog_wake_.notify_one();
    if (thread_.joinable()) thread_.join();
    if (watchdog_.joinable()) watchdog_.join();
  }

  ProgressCounters counters() const {
    ProgressCounters c;
    c.completed_by_waiter = completed_by_waiter_.load();
    c.completed_by_thread = completed_by_thread_.load();
    c.drives = drives_.load();
    c.nested_drives = nested_drives_.load();
    c.check_mismatches = check_mismatches_.load();
    c.speculative_starts = speculative_starts_.load();
    c.mismatch_placeholders = mismatch_placeholders_.load();
    return c;
  }

 private:
  // The progress thread.
  void run() {
    std::unique_lock<std::mutex> guard(mutex_);
    progress_thread_ = std::this_thread::get_id();
    int idle_polls = 0;
    auto last_active = Clock::now();
    while (true) {
      const bool no_driver = driver_ == std::thread::id();
      const bool issue = !queue_.empty();
      const bool poll = !in_flight_.empty() && no_driver;
      const bool ready = !ready_.empty();
      if (!issue && !poll && !ready) {
        if (stopping_ && in_flight_.empty()) return;  // stopping with nothing left to do
        // Nothing to do now: nobody's collective is in flight, or a waiting thread drives.
        if (Clock::now() - last_active < kStayAwake) {
          // Collectives come and go: nap and look again without being woken (see submit).
          progress_wake_.wait_for(guard, kNap);
        } else {
          thread_asleep_ = true;
          progress_wake_.wait(guard, [&] {
            return !queue_.empty() || !ready_.empty() ||
                   (!in_flight_.empty() && driver_ == std::thread::id()) ||
                   (stopping_ && in_flight_.empty());
          });
          thread_asleep_ = false;
        }
        idle_polls = 0;
        continue;
      }
      issue_queued_locked();
      if (issue) done_.notify_all();  // a waiter whose collective was queued may drive it now
      if (poll) poll_locked();
      const bool progressed = finish_ready(guard, /*by_waiter=*/false, nullptr);
      if (progressed || issue) {
        idle_polls = 0;
      } else {
        guard.unlock();
        if (++idle_polls < kIdleYieldPolls) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(idle_polls < kIdleShortSleepPolls ? kShortSleep : kLongSleep);
        }
        guard.lock();
      }
      last_active = Clock::now();
    }
  }

  // This thread drives until `entry` finished: it issues, polls and finishes everything. Called
  // and returns with `guard` locked. Re-entrant: a completion callback run here that waits for
  // another collective drives in a nested call (driver_ stays this thread).
  void drive(std::unique_lock<std::mutex>& guard, const Entry& entry) {
    const auto self = std::this_thread::get_id();
    const bool outermost = driver_ != self;
    driver_ = self;
    const auto started = Clock::now();
    while (!entry->finished) {
      // Collectives submitted behind this one while it drives (old mode, or another thread's).
      issue_queued_locked();
      poll_locked();
      bool mine = false;
      const bool progressed = finish_ready(guard, /*by_waiter=*/true, &entry);
      mine = entry->finished;
      if (!mine && !progressed) {
        // Spin (yielding to other ranks on an oversubscribed machine) while a small collective is
        // likely to complete any moment; then back off so a long wait does not hold a core.
        guard.unlock();
        const auto waited = Clock::now() - started;
        if (waited < kDriveYieldFor) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(waited < kDriveShortSleepFor ? kShortSleep : kLongSleep);
        }
        guard.lock();
      }
    }
    if (!outermost) return;
    driver_ = std::thread::id();
    // The progress thread takes over whatever is still in flight (a napping thread looks again by
    // itself); other waiters re-check.
    if (thread_asleep_ && (!in_flight_.empty() || !queue_.empty() || !ready_.empty())) {
      progress_wake_.notify_one();
    }
    done_.notify_all();
  }

  // Finishes the completed collectives one at a time, outside the lock (a completion callback may
  // wait for one completed after it: a nested drive takes it from ready_). Stops early once `mine`
  // finished. Returns whether any finished. `guard` is locked on entry and on return.
  bool finish_ready(std::unique_lock<std::mutex>& guard, bool by_waiter, const Entry* mine) {
    bool any = false;
    while (!ready_.empty()) {
      Completed c = std::move(ready_.front());
      ready_.pop_front();
      guard.unlock();
      finish(c, by_waiter);
      guard.lock();
      any = true;
      if (mine != nullptr && (*mine)->finished) break;
    }
    return any;
  }

  // Issues every queued collective in order (mutex_ held). Failures go to ready_.
  void issue_queued_locked() {
    bool issued = false;
    while (!queue_.empty()) {
      Entry entry = std::move(queue_.front());
      queue_.pop_front();
      if (auto error = issue_locked(*entry)) {
        entry->stage = Stage::kDone;
        ready_.push_back({std::move(entry), MPI_SUCCESS, error});
      } else {
        in_flight_.push_back(std::move(entry));
        issued = true;
      }
    }
    if (issued) advance_locked();
  }

  // First stage of a collective (mutex_ held): its size check, or, without one, nothing to issue
  // yet (advance_locked starts it in order). Returns the error if issuing failed.
  static std::exception_ptr issue_locked(Submitted& entry) {
    entry.stage = Stage::kChecking;
    if (!entry.op.check_start) {
      entry.check_done = true;
      entry.check_verified = true;
      entry.decided = true;
      return nullptr;
    }
    try {
      int rc = MPI_SUCCESS;
      {
        std::lock_guard<std::mutex> guard(mpi_lock());
        rc = entry.op.check_start(entry.first_stage.data());
      }
      TORCH_CHECK(rc == MPI_SUCCESS, "MPI backend ", entry.op.description,
                  ": issuing its size check failed: ", error_string(rc));
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }

  // Moves every collective in flight as far as it can go (mutex_ held), in issue order:
  //  - verifies completed checks, in issue order per communicator (`order`): check_verify of one
  //    collective runs only after those of every older one of its communicator;
  //  - asks `speculate` of a collective whose check is not verified yet, once every older one of
  //    its communicator was verified (so the backend answers from the same history on every rank);
  //  - starts collectives in issue order per communicator: once their check passed, or at once when
  //    `speculate` allowed it; a collective whose check failed issues `mismatch_start` instead (in
  //    the same order) and fails once that completed;
  //  - a started collective whose transfer finished completes once its check was verified, with the
  //    check's error if any.
  // A failed check is seen alike on every rank (every rank verifies the same exchanged values), so
  // every rank issues the same MPI calls on the collectives' communicator.
  void advance_locked() {
    std::vector<const void*> unverified;  // communicators with an older unverified check
    std::vector<const void*> unstarted;   // communicators with an older collective not started yet
    auto holds = [](const std::vector<const void*>& keys, const void* key) {
      return key != nullptr && std::find(keys.begin(), keys.end(), key) != keys.end();
    };
    bool removed = false;
    for (auto& entry : in_flight_) {
      if (entry->stage == Stage::kDone) continue;
      const void* key = entry->op.order;
      const bool older_unverified = holds(unverified, key);
      if (!entry->check_verified && !older_unverified) {
        if (!entry->decided && entry->stage == Stage::kChecking) {
          // Asked before this collective's own check is verified, whether or not it completed.
          entry->decided = true;
          entry->speculative = entry->op.speculate && entry->op.speculate();
        }
        if (entry->check_done) {
          try {
            if (entry->op.check_verify) entry->op.check_verify();
          } catch (...) {
            check_mismatches_.fetch_add(1);
            entry->check_error = std::current_exception();
          }
          entry->check_verified = true;
          // The flight recorder's "started" keeps its meaning (every rank issued it, with the same
          // sizes): a speculative start is recorded once its check passed.
          if (entry->speculative && entry->stage == Stage::kRunning && !entry->check_error) {
            flight_recorder::record_started(entry->op.flight_id);
          }
        }
      }
      if (entry->stage == Stage::kChecking && !holds(unstarted, key) &&
          (entry->check_verified || entry->speculative)) {
        // Its turn: the real collective (check passed, or speculative), or what keeps the group
        // consistent after a failed check.
        const bool real = !entry->check_error;
        std::exception_ptr error;
        try {
          int rc = MPI_SUCCESS;
          {
            std::lock_guard<std::mutex> guard(mpi_lock());
            if (real) {
              rc = entry->op.start(entry->requests.data());
            } else if (entry->op.mismatch_start) {
              rc = entry->op.mismatch_start(entry->requests.data());
            }
          }
          TORCH_CHECK(rc == MPI_SUCCESS, "MPI backend ", entry->op.description,
                      ": issuing it failed: ", error_string(rc));
          entry->stage = Stage::kRunning;
          entry->transfer_done = std::all_of(entry->requests.begin(), entry->requests.end(),
                                             [](MPI_Request r) { return r == MPI_REQUEST_NULL; });
          if (real && entry->check_verified) {
            flight_recorder::record_started(entry->op.flight_id);
          } else if (real) {
            speculative_starts_.fetch_add(1);
          } else if (!entry->transfer_done) {
            mismatch_placeholders_.fetch_add(1);
          }
        } catch (...) {
          error = std::current_exception();
        }
        if (error) {
          // Issuing failed on this rank only: nothing to keep consistent any more.
          entry->stage = Stage::kDone;
          ready_.push_back({entry, MPI_SUCCESS, error});
          removed = true;
          continue;
        }
      }
      if (entry->stage == Stage::kRunning && entry->transfer_done && entry->check_verified) {
        entry->stage = Stage::kDone;
        ready_.push_back({entry, MPI_SUCCESS, entry->check_error});
        removed = true;
        continue;
      }
      if (!entry->check_verified && key != nullptr) unverified.push_back(key);
      if (entry->stage == Stage::kChecking && key != nullptr) unstarted.push_back(key);
    }
    if (removed) remove_done_locked();
  }

  void remove_done_locked() {
    in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(),
                                    [](const Entry& e) { return e->stage == Stage::kDone; }),
                     in_flight_.end());
  }

  // Tests every request in flight once (mutex_ held), then moves what completed on (advance_locked).
  void poll_locked() {
    if (in_flight_.empty()) return;
    bool progressed = false;
    {
      std::lock_guard<std::mutex> guard(mpi_lock());
      for (auto& entry : in_flight_) {
        if (entry->stage == Stage::kDone) continue;
        // Unused entries are MPI_REQUEST_NULL, which count as complete.
        auto test = [&](std::array<MPI_Request, kMaxRequestsPerStage>& requests) {
          int flag = 0;
          const int rc = MPI_Testall(kMaxRequestsPerStage, requests.data(), &flag, MPI_STATUSES_IGNORE);
          if (rc != MPI_SUCCESS) {
            dump_and_abort("collective " + entry->op.description + " failed in MPI: " + error_string(rc));
          }
          return flag != 0;
        };
        if (!entry->check_done && test(entry->first_stage)) {
          entry->check_done = true;
          progressed = true;
        }
        if (entry->stage == Stage::kRunning && !entry->transfer_done && test(entry->requests)) {
          entry->transfer_done = true;
          progressed = true;
        }
      }
    }
    if (progressed) advance_locked();
  }

  // Runs `after` and `finish` of a completed collective (mutex_ not held).
  void finish(Completed& c, bool by_waiter) {
    std::exception_ptr error = c.error;
    if (!error) {
      try {
        // A mismatched collective that the size check could not see ends here.
        TORCH_CHECK(c.mpi_error == MPI_SUCCESS, "MPI backend ", c.entry->op.description,
                    " failed: ", error_string(c.mpi_error),
                    ". Every rank must call the same collectives in the same order; rerun with "
                    "FSDP_DEBUG=1 to have fully_shard name the ranks that diverge.");
        if (c.entry->op.after) c.entry->op.after();
      } catch (...) {
        error = std::current_exception();
      }
    }
    complete(c.entry, error, by_waiter);
  }

  void complete(const Entry& entry, std::exception_ptr error, bool by_waiter) {
    // Release the tensors the collective kept alive before the caller learns it finished: a caller
    // that frees its buffers after wait() then really frees them (no late release from this
    // thread). The finish callback goes too once it ran (it may own the caller's Work).
    entry->op.after = nullptr;
    entry->op.start = nullptr;
    entry->op.check_start = nullptr;
    entry->op.check_verify = nullptr;
    entry->op.speculate = nullptr;
    entry->op.mismatch_start = nullptr;
    auto finish = std::move(entry->op.finish);
    entry->op.finish = nullptr;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      finishing_.push_back({std::this_thread::get_id(), entry, Clock::now()});
    }
    // Recorded before the caller can learn it finished.
    if (error) {
      flight_recorder::record_failed(entry->op.flight_id, error_text(error));
    } else {
      flight_recorder::record_completed(entry->op.flight_id);
    }
    ++t_finishing_depth;
    try {
      finish(error);
    } catch (...) {
      // A callback's exception must not kill the thread that polls for everyone.
    }
    --t_finishing_depth;
    finish = nullptr;
    (by_waiter ? completed_by_waiter_ : completed_by_thread_).fetch_add(1);
    {
      std::lock_guard<std::mutex> guard(mutex_);
      entry->finished = true;
      finishing_.erase(std::find_if(finishing_.begin(), finishing_.end(),
                                    [&](const Finishing& f) { return f.entry == entry; }));
    }
    done_.notify_all();
  }

  // The watchdog: aborts the job when a collective is not finished by its deadline, whether or not
  // anybody polls.
  void watch() {
    std::unique_lock<std::mutex> guard(mutex_);
    while (!stopping_) {
      const auto now = Clock::now();
      Clock::time_point earliest = Clock::time_point::max();
      auto consider = [&](const Entry& e) {
        if (e->deadline <= now) dump_and_abort(timeout_report_locked(*e, now));
        earliest = std::min(earliest, e->deadline);
      };
      for (const auto& e : queue_) consider(e);
      for (const auto& e : in_flight_) consider(e);
      for (const auto& c : ready_) consider(c.entry);
      watching_until_ = earliest;
      if (earliest == Clock::time_point::max()) {
        watchdog_wake_.wait(guard);
      } else {
        watchdog_wake_.wait_until(guard, earliest);
      }
    }
  }

  // What a collective past its deadline was waiting for (mutex_ held).
  std::string timeout_report_locked(const Submitted& e, Clock::time_point now) const {
    std::string where;
    const bool custom_first = e.stage == Stage::kChecking && !e.check_done && !e.op.waiting_first_stage.empty();
    const bool custom_running = e.stage == Stage::kRunning && !e.op.waiting_running.empty();
    switch (e.stage) {
      case Stage::kQueued:
        where = "it was submitted on this rank but never issued to MPI, because no thread polled";
        break;
      case Stage::kChecking:
        where = e.check_done
                    ? "every rank issued it with the same sizes, but an older collective of its group "
                      "had not started yet"
                    : "this rank issued it, but not every rank of the group issued a collective at "
                      "this point";
        break;
      case Stage::kRunning:
        where = !e.check_done
                    ? "this rank issued it (started at once, as the sizes it expected from earlier "
                      "iterations), but not every rank of the group issued a collective at this point"
                : e.check_error
                    ? "the ranks issued different collectives here, and the placeholder that keeps "
                      "the group consistent did not finish"
                    : "every rank issued it with the same sizes, but the transfer did not finish";
        break;
      case Stage::kDone:
        where = "it completed in MPI, but its completion never ran, because no thread was free to run it";
        break;
    }
    if (custom_first) where = e.op.waiting_first_stage;
    if (custom_running) where = e.op.waiting_running;
    std::string blocked;
    for (const auto& f : finishing_) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - f.since).count();
      blocked += std::string("; the ") + (f.thread == progress_thread_ ? "progress thread" : "thread driving MPI") +
                 " has been running the completion callback of " + f.entry->op.description + " for " +
                 std::to_string(ms) + " ms (a completion callback must not block on another collective "
                 "except through Work::wait(), which drives progress itself)";
    }
    const std::string advice =
        !e.op.timeout_advice.empty()
            ? e.op.timeout_advice
            : "Every rank must call the same collectives in the same order: a rank that skipped this "
              "one, or is stuck before it, causes this; rerun with FSDP_DEBUG=1 to have fully_shard "
              "name the ranks that diverge.";
    return (e.op.timeout_advice.empty() ? "collective " : "") + e.op.description + " did not complete within " +
           std::to_string(e.op.timeout.count()) + " ms; aborting the job: " + where + blocked + ". " + advice;
  }

  struct Finishing {
    std::thread::id thread;
    Entry entry;
    Clock::time_point since;
  };

  std::mutex mutex_;
  std::condition_variable progress_wake_;  // the progress thread sleeps on it
  std::condition_variable watchdog_wake_;  // the watchdog sleeps on it
  std::condition_variable done_;           // waiters sleep on it
  std::deque<Entry> queue_;                // submitted, not issued yet (in submission order)
  std::vector<Entry> in_flight_;           // issued, not completed (in issue order)
  std::deque<Completed> ready_;            // completed, not finished yet (in completion order)
  std::vector<Finishing> finishing_;       // completion callbacks running now
  std::thread::id driver_;                 // the waiting thread that polls (the progress thread
                                           // stands aside), or none
  std::thread::id progress_thread_;
  bool stopping_ = false;
  bool thread_asleep_ = false;             // the progress thread sleeps until woken (not napping)
  Clock::time_point watching_until_ = Clock::time_point::max();  // the watchdog's next look
  std::thread thread_;
  std::thread watchdog_;
  std::atomic<uint64_t> completed_by_waiter_{0};
  std::atomic<uint64_t> completed_by_thread_{0};
  std::atomic<uint64_t> drives_{0};
  std::atomic<uint64_t> nested_drives_{0};
  std::atomic<uint64_t> check_mismatches_{0};
  std::atomic<uint64_t> speculative_starts_{0};
  std::atomic<uint64_t> mismatch_placeholders_{0};
};

ProgressEngine& engine() {
  static ProgressEngine* instance = new ProgressEngine();  // outlives static destructors
  return *instance;
}

}  // namespace

std::shared_ptr<Submitted> submit(PendingCollective op, bool wait_drives_progress) {
  return engine().submit(std::move(op), wait_drives_progress);
}

void wait(const std::shared_ptr<Submitted>& submitted) {
  TORCH_CHECK(submitted, "fsdp comm: wait() on no collective");
  engine().wait(submitted);
}

ProgressCounters progress_counters() { return engine().counters(); }

void stop_progress_engine() { engine().stop(); }

}  // namespace fsdp::comm::mpi

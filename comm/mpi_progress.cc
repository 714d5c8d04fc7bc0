#include "comm/mpi_progress.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "comm/mpi_runtime.h"

namespace fsdp::comm::mpi {

using Clock = std::chrono::steady_clock;

struct Submitted {
  PendingCollective op;
  bool wait_drives_progress = false;
  // Written when issued (under the engine's mutex); afterwards touched only by the poller, which
  // holds the engine's mutex too.
  MPI_Request request = MPI_REQUEST_NULL;
  Clock::time_point deadline;
  bool finished = false;  // op.finish ran (guarded by the engine's mutex)
};

namespace {

using Entry = std::shared_ptr<Submitted>;

// A collective whose request completed (or whose issue failed), to finish outside the lock.
struct Completed {
  Entry entry;
  int mpi_error = MPI_SUCCESS;      // the request's status
  std::exception_ptr issue_error;  // set when `start` failed
};

// [Note: MPI progress] (mpi_progress.h). Lock order: mutex_, then mpi_lock().
class ProgressEngine {
  // With nothing to poll, the progress thread naps kNap at a time while collectives were active
  // within the last kStayAwake, then sleeps until woken.
  static constexpr std::chrono::microseconds kNap{200};
  static constexpr std::chrono::milliseconds kStayAwake{20};

 public:
  Entry submit(PendingCollective op, bool wait_drives_progress) {
    auto entry = std::make_shared<Submitted>();
    entry->op = std::move(op);
    entry->wait_drives_progress = wait_drives_progress;
    std::exception_ptr issue_error;
    bool wake = true;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      TORCH_CHECK(!stopping_, "fsdp comm: collective '", entry->op.description,
                  "' submitted while the process is shutting down MPI");
      if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
      if (wait_drives_progress && queue_.empty()) {
        // Issued here, under mutex_: nothing older waits to be issued and nobody else can issue
        // until this returns, so the submission order is the issue order.
        issue_error = issue_locked(*entry);
        if (!issue_error) in_flight_.push_back(entry);
        // The thread only needs waking from a long sleep: while collectives come and go it naps
        // and looks again by itself, so a caller that waits right away drives its collective
        // without a wake-up (a system call) and without the thread polling beside it.
        wake = !issue_error && thread_asleep_;
      } else {
        queue_.push_back(entry);  // the thread issues it
      }
    }
    if (issue_error) {
      complete(entry, issue_error, /*by_waiter=*/false);
    } else if (wake) {
      progress_wake_.notify_one();
    }
    return entry;
  }

  void wait(const Entry& entry) {
    std::unique_lock<std::mutex> guard(mutex_);
    while (!entry->finished) {
      const bool alone = entry->wait_drives_progress && !driving_ && queue_.empty() &&
                         in_flight_.size() == 1 && in_flight_.front() == entry;
      if (alone) {
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
    if (thread_.joinable()) thread_.join();
  }

  ProgressCounters counters() const {
    ProgressCounters c;
    c.completed_by_waiter = completed_by_waiter_.load();
    c.completed_by_thread = completed_by_thread_.load();
    c.drives = drives_.load();
    return c;
  }

 private:
  // The progress thread.
  void run() {
    std::unique_lock<std::mutex> guard(mutex_);
    int idle_polls = 0;
    auto last_active = Clock::now();
    while (true) {
      const bool issue = !queue_.empty();
      const bool poll = !in_flight_.empty() && !driving_;
      if (!issue && !poll) {
        if (stopping_ && in_flight_.empty()) return;  // stopping with nothing left to do
        // Nothing to do now: nobody's collective is in flight, or a waiting thread drives.
        if (Clock::now() - last_active < kStayAwake) {
          // Collectives come and go: nap and look again without being woken (see submit).
          progress_wake_.wait_for(guard, kNap);
        } else {
          thread_asleep_ = true;
          progress_wake_.wait(guard, [&] {
            return !queue_.empty() || (!in_flight_.empty() && !driving_) ||
                   (stopping_ && in_flight_.empty());
          });
          thread_asleep_ = false;
        }
        idle_polls = 0;
        continue;
      }
      std::vector<Completed> completed;
      issue_queued_locked(completed);
      if (issue) done_.notify_all();  // a waiter whose collective was queued may drive it now
      if (poll) poll_locked(completed);
      guard.unlock();
      const bool progressed = !completed.empty();
      for (auto& c : completed) finish(c, /*by_waiter=*/false);
      completed.clear();
      if (progressed || issue) {
        idle_polls = 0;
      } else if (++idle_polls < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(idle_polls < 1024 ? 10 : 100));
      }
      guard.lock();
      last_active = Clock::now();
    }
  }

  // The waiting thread drives until `entry` finished. Called and returns with `guard` locked.
  void drive(std::unique_lock<std::mutex>& guard, const Entry& entry) {
    driving_ = true;
    drives_.fetch_add(1);
    const auto started = Clock::now();
    std::vector<Completed> completed;
    while (true) {
      // Collectives submitted behind this one while it drives (old mode, or another thread's).
      issue_queued_locked(completed);
      poll_locked(completed);
      const bool mine = std::any_of(completed.begin(), completed.end(),
                                    [&](const Completed& c) { return c.entry == entry; });
      guard.unlock();
      for (auto& c : completed) finish(c, /*by_waiter=*/true);
      const bool progressed = !completed.empty();
      completed.clear();
      if (!mine && !progressed) {
        // Spin (yielding to other ranks on an oversubscribed machine) while a small collective is
        // likely to complete any moment; then back off so a long wait does not hold a core.
        const auto waited = Clock::now() - started;
        if (waited < std::chrono::milliseconds(1)) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(
              waited < std::chrono::milliseconds(50) ? 10 : 100));
        }
      }
      guard.lock();
      if (mine) break;
    }
    driving_ = false;
    // The progress thread takes over whatever is still in flight (a napping thread looks again by
    // itself); other waiters re-check.
    if (thread_asleep_ && (!in_flight_.empty() || !queue_.empty())) progress_wake_.notify_one();
    done_.notify_all();
  }

  // Issues every queued collective in order (mutex_ held). Failures go to `completed`.
  void issue_queued_locked(std::vector<Completed>& completed) {
    while (!queue_.empty()) {
      Entry entry = std::move(queue_.front());
      queue_.pop_front();
      if (auto error = issue_locked(*entry)) {
        completed.push_back({std::move(entry), MPI_SUCCESS, error});
      } else {
        in_flight_.push_back(std::move(entry));
      }
    }
  }

  // Starts the non-blocking call (mutex_ held); returns the error if it failed.
  static std::exception_ptr issue_locked(Submitted& entry) {
    try {
      int rc = MPI_SUCCESS;
      {
        std::lock_guard<std::mutex> guard(mpi_lock());
        rc = entry.op.start(&entry.request);
      }
      TORCH_CHECK(rc == MPI_SUCCESS, "MPI backend ", entry.op.description,
                  ": issuing it failed: ", error_string(rc));
    } catch (...) {
      return std::current_exception();
    }
    entry.deadline = Clock::now() + entry.op.timeout;
    return nullptr;
  }

  // Tests every collective in flight once (mutex_ held), moves the completed ones to `completed`
  // and aborts the job if one is past its deadline.
  void poll_locked(std::vector<Completed>& completed) {
    if (in_flight_.empty()) return;
    std::vector<int> status_errors(in_flight_.size(), MPI_SUCCESS);
    std::vector<char> flags(in_flight_.size(), 0);
    {
      std::lock_guard<std::mutex> guard(mpi_lock());
      for (size_t i = 0; i < in_flight_.size(); ++i) {
        int flag = 0;
        MPI_Status status;
        status.MPI_ERROR = MPI_SUCCESS;
        const int rc = MPI_Test(&in_flight_[i]->request, &flag, &status);
        if (rc != MPI_SUCCESS) {
          abort_job("collective " + in_flight_[i]->op.description +
                    " failed in MPI: " + error_string(rc));
        }
        flags[i] = static_cast<char>(flag != 0);
        status_errors[i] = status.MPI_ERROR;
      }
    }
    const auto now = Clock::now();
    std::vector<Entry> still;
    still.reserve(in_flight_.size());
    for (size_t i = 0; i < in_flight_.size(); ++i) {
      if (flags[i]) {
        completed.push_back({std::move(in_flight_[i]), status_errors[i], nullptr});
        continue;
      }
      if (now > in_flight_[i]->deadline) {
        const auto& op = in_flight_[i]->op;
        abort_job("collective " + op.description + " did not complete within " +
                  std::to_string(op.timeout.count()) +
                  " ms; aborting the job. Every rank must call the same collectives in the same "
                  "order: a rank that skipped this one, or is stuck before it, causes this.");
      }
      still.push_back(std::move(in_flight_[i]));
    }
    in_flight_.swap(still);
  }

  // Runs `after` and `finish` of a completed collective (mutex_ not held).
  void finish(Completed& c, bool by_waiter) {
    std::exception_ptr error = c.issue_error;
    if (!error) {
      try {
        // A mismatched collective (ranks calling different ones at the same step) ends here.
        TORCH_CHECK(c.mpi_error == MPI_SUCCESS, "MPI backend ", c.entry->op.description,
                    " failed: ", error_string(c.mpi_error),
                    ". Every rank must call the same collectives in the same order.");
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
    auto finish = std::move(entry->op.finish);
    entry->op.finish = nullptr;
    finish(error);
    finish = nullptr;
    (by_waiter ? completed_by_waiter_ : completed_by_thread_).fetch_add(1);
    {
      std::lock_guard<std::mutex> guard(mutex_);
      entry->finished = true;
    }
    done_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable progress_wake_;  // the progress thread sleeps on it
  std::condition_variable done_;           // waiters sleep on it
  std::deque<Entry> queue_;                // submitted, not issued yet (in submission order)
  std::vector<Entry> in_flight_;           // issued, not completed (in issue order)
  bool driving_ = false;                   // a waiting thread polls (the progress thread stands aside)
  bool stopping_ = false;
  bool thread_asleep_ = false;             // the progress thread sleeps until woken (not napping)
  std::thread thread_;
  std::atomic<uint64_t> completed_by_waiter_{0};
  std::atomic<uint64_t> completed_by_thread_{0};
  std::atomic<uint64_t> drives_{0};
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

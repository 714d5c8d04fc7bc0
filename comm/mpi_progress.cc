#include "comm/mpi_progress.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "comm/mpi_runtime.h"

namespace fsdp::comm::mpi {
namespace {

using Clock = std::chrono::steady_clock;

struct InFlight {
  PendingCollective op;
  MPI_Request request = MPI_REQUEST_NULL;
  Clock::time_point deadline;
};

class ProgressEngine {
 public:
  void submit(PendingCollective op) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      TORCH_CHECK(!stopping_, "fsdp comm: collective '", op.description,
                  "' submitted while the process is shutting down MPI");
      queue_.push_back(std::move(op));
      if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    }
    wake_.notify_one();
  }

  void stop() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    std::vector<InFlight> in_flight;
    int idle_polls = 0;
    while (true) {
      std::deque<PendingCollective> arrived;
      {
        std::unique_lock<std::mutex> guard(mutex_);
        if (in_flight.empty()) {
          wake_.wait(guard, [&] { return stopping_ || !queue_.empty(); });
          if (queue_.empty()) return;  // stopping with nothing left to do
        }
        arrived.swap(queue_);
      }
      for (auto& op : arrived) issue(std::move(op), in_flight);
      if (in_flight.empty()) continue;
      if (poll(in_flight)) {
        idle_polls = 0;
      } else if (++idle_polls < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(idle_polls < 1024 ? 10 : 100));
      }
    }
  }

  static void issue(PendingCollective op, std::vector<InFlight>& in_flight) {
    InFlight entry;
    try {
      int rc = MPI_SUCCESS;
      {
        std::lock_guard<std::mutex> guard(mpi_lock());
        rc = op.start(&entry.request);
      }
      TORCH_CHECK(rc == MPI_SUCCESS, "MPI backend ", op.description,
                  ": issuing it failed: ", error_string(rc));
    } catch (...) {
      op.finish(std::current_exception());
      return;
    }
    entry.deadline = Clock::now() + op.timeout;
    entry.op = std::move(op);
    in_flight.push_back(std::move(entry));
  }

  // Returns whether any collective completed.
  static bool poll(std::vector<InFlight>& in_flight) {
    std::vector<size_t> done;
    std::vector<int> errors;  // per entry of `done`
    {
      std::lock_guard<std::mutex> guard(mpi_lock());
      for (size_t i = 0; i < in_flight.size(); ++i) {
        int flag = 0;
        MPI_Status status;
        status.MPI_ERROR = MPI_SUCCESS;
        const int rc = MPI_Test(&in_flight[i].request, &flag, &status);
        if (rc != MPI_SUCCESS) {
          abort_job("collective " + in_flight[i].op.description + " failed in MPI: " + error_string(rc));
        }
        if (flag) {
          done.push_back(i);
          errors.push_back(status.MPI_ERROR);
        }
      }
    }
    const auto now = Clock::now();
    for (const auto& entry : in_flight) {
      if (now > entry.deadline) {
        abort_job("collective " + entry.op.description + " did not complete within " +
                  std::to_string(entry.op.timeout.count()) +
                  " ms; aborting the job. Every rank must call the same collectives in the same "
                  "order: a rank that skipped this one, or is stuck before it, causes this.");
      }
    }
    for (size_t k = done.size(); k-- > 0;) {
      InFlight entry = std::move(in_flight[done[k]]);
      in_flight.erase(in_flight.begin() + static_cast<std::ptrdiff_t>(done[k]));
      std::exception_ptr error;
      try {
        // A mismatched collective (ranks calling different ones at the same step) ends here.
        TORCH_CHECK(errors[k] == MPI_SUCCESS, "MPI backend ", entry.op.description,
                    " failed: ", error_string(errors[k]),
                    ". Every rank must call the same collectives in the same order.");
        if (entry.op.after) entry.op.after();
      } catch (...) {
        error = std::current_exception();
      }
      // Release the tensors the collective kept alive before the caller learns it finished: a
      // caller that frees its buffers after wait() then really frees them (no late release from
      // this thread).
      entry.op.after = nullptr;
      entry.op.start = nullptr;
      entry.op.finish(error);
    }
    return !done.empty();
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<PendingCollective> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

ProgressEngine& engine() {
  static ProgressEngine* instance = new ProgressEngine();  // outlives static destructors
  return *instance;
}

}  // namespace

void submit(PendingCollective op) { engine().submit(std::move(op)); }

void stop_progress_engine() { engine().stop(); }

}  // namespace fsdp::comm::mpi

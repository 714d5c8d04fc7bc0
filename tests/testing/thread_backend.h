#pragma once
// A test-only c10d::Backend where the ranks are threads of one process: fast unit tests of code that
// communicates, without launching processes. End-to-end tests use the MPI backend.
//
//   fsdp::testing::run_ranks_as_threads(4, [](fsdp::comm::Communicator& comm) {
//     at::Tensor t = at::ones({2});
//     comm.all_reduce(t).wait();          // 4 everywhere
//   });
//
// Collectives complete synchronously. Ranks that call different collectives (or different sizes)
// at the same step get an error naming both, instead of hanging; a rank that never arrives makes
// the others fail after the group's timeout.

#include <chrono>
#include <functional>
#include <memory>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "fsdp_cpp/comm/communicator.h"

namespace fsdp::testing {

class ThreadGroup;

class ThreadBackend final : public c10d::Backend {
 public:
  ThreadBackend(std::shared_ptr<ThreadGroup> group, int rank);
  const std::string getBackendName() const override { return "threads"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = {}) override;

 private:
  std::shared_ptr<ThreadGroup> group_;
};

/// Runs `body` on `world_size` threads, each with a Communicator over a shared ThreadBackend group.
/// Exceptions from any rank are rethrown on the calling thread (the lowest rank's first), after all
/// threads ended. Catch2 assertions are not thread-safe: return results and assert on the caller.
void run_ranks_as_threads(int world_size, const std::function<void(comm::Communicator&)>& body,
                          std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace fsdp::testing

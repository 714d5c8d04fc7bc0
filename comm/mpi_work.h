#pragma once
// Internal to the MPI backend (//comm:mpi_backend): the Work its collectives and point-to-point
// operations return, and the input checks both share.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "fsdp_cpp/comm/mpi_progress.h"

namespace fsdp::comm::mpi {

// A Work whose completion the progress engine reports; its future carries the output tensors.
class MpiWork final : public c10d::Work {
 public:
  MpiWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors())) {}

  // Set once, by enqueue, before the Work is handed to the caller.
  void set_submitted(std::shared_ptr<Submitted> submitted) { submitted_ = std::move(submitted); }

  // Without a time limit, waits through the progress engine, which lets this thread drive the
  // collective when it is the only one outstanding and the backend's wait_drives_progress was on
  // at issue, and always inside a completion callback (this thread may be the only poller;
  // [Note: MPI progress]); then the base class rethrows the collective's error. With a time limit
  // (c10d's own timeout semantics), sleeps until the progress thread completed it.
  bool wait(std::chrono::milliseconds timeout) override {
    if (submitted_ && timeout == kNoTimeout && !isCompleted()) mpi::wait(submitted_);
    return c10d::Work::wait(timeout);
  }

  void complete(std::exception_ptr error) {
    // The future first: once wait() returns, the future is complete too.
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
    finish(error);
  }

  // A recv's sender (recvAnysource learns it from the sender's envelope); set before complete().
  void set_source_rank(int source) { source_rank_ = source; }
  int sourceRank() const override {
    TORCH_CHECK(source_rank_ >= 0, "MPI backend: sourceRank() is known for a recv once it completed "
                "(call wait() first); other operations have none");
    return source_rank_;
  }

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<Submitted> submitted_;
  int source_rank_ = -1;
};

inline std::string describe(const at::Tensor& t) {
  return fmt::format("{} elements of {}", t.numel(), c10::toString(t.scalar_type()));
}

inline void check_cpu_contiguous(const at::Tensor& t, const char* collective, const char* role) {
  TORCH_CHECK(t.defined(), "MPI backend ", collective, ": the ", role, " tensor is undefined");
  TORCH_CHECK(t.device().is_cpu(), "MPI backend ", collective, ": the ", role,
              " tensor must be on the CPU (CUDA tensors use the NCCL backend), got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "MPI backend ", collective, ": the ", role,
              " tensor must be contiguous, got sizes ", t.sizes(), " with strides ", t.strides());
}

}  // namespace fsdp::comm::mpi

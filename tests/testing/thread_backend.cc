#include "fsdp_cpp/tests/testing/thread_backend.h"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <sstream>
#include <thread>

#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>

namespace fsdp::testing {

// One step of the group: every rank posts what it calls with and its input, all wait, each reads
// what it needs, all wait again (so inputs stay untouched while others read them).
class ThreadGroup {
 public:
  ThreadGroup(int size, std::chrono::milliseconds timeout)
      : size_(size), timeout_(timeout), posted_(size) {}

  struct Post {
    std::string signature;  // collective and sizes: must agree across ranks
    at::Tensor input;
  };

  // Returns every rank's post; `read` runs between the two rendezvous.
  void exchange(int rank, Post post, const std::function<void(const std::vector<Post>&)>& read) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t step = step_;
    posted_[rank] = std::move(post);
    arrive(lock, step, "posting " + posted_[rank].signature);
    for (int r = 0; r < size_; ++r) {
      TORCH_CHECK(posted_[r].signature == posted_[0].signature, "thread backend: rank ", r,
                  " called '", posted_[r].signature, "' while rank 0 called '",
                  posted_[0].signature, "' at the same step");
    }
    lock.unlock();
    read(posted_);
    lock.lock();
    arrive(lock, step + 1, "reading " + posted_[rank].signature);
  }

  int size() const { return size_; }

 private:
  // A reusable barrier: the last of the ranks to arrive advances the step.
  void arrive(std::unique_lock<std::mutex>& lock, uint64_t step, const std::string& what) {
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++step_;
      cv_.notify_all();
      return;
    }
    const bool done = cv_.wait_for(lock, timeout_, [&] { return step_ > step; });
    TORCH_CHECK(done, "thread backend: timed out after ", timeout_.count(), " ms ", what,
                ": some rank never called it");
  }

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t step_ = 0;
  std::vector<Post> posted_;
};

namespace {

class DoneWork final : public c10d::Work {
 public:
  DoneWork(int rank, c10d::OpType type) : c10d::Work(rank, type) { finish(); }
};

std::string signature(const char* collective, const at::Tensor& t) {
  std::ostringstream s;
  s << collective << " of " << t.numel() << " x " << t.scalar_type();
  return s.str();
}

at::Tensor reduce_parts(const std::vector<at::Tensor>& parts, const c10d::ReduceOp& op) {
  at::Tensor stacked = at::stack(parts);
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return stacked.sum(0, false, stacked.scalar_type());
    case c10d::ReduceOp::AVG: {
      at::Tensor s = stacked.sum(0, false, stacked.scalar_type());
      return at::isIntegralType(s.scalar_type(), false) ? s.div(static_cast<int64_t>(parts.size()), "trunc")
                                                        : s.div(static_cast<int64_t>(parts.size()));
    }
    case c10d::ReduceOp::MAX: return std::get<0>(stacked.max(0));
    case c10d::ReduceOp::MIN: return std::get<0>(stacked.min(0));
    case c10d::ReduceOp::PRODUCT: return stacked.prod(0, false, stacked.scalar_type());
    default: break;
  }
  TORCH_CHECK(false, "thread backend: unsupported reduce op ", static_cast<int>(op.op_));
  return {};  // not reached
}

}  // namespace

ThreadBackend::ThreadBackend(std::shared_ptr<ThreadGroup> group, int rank)
    : c10d::Backend(rank, group->size()), group_(std::move(group)) {}

c10::intrusive_ptr<c10d::Work> ThreadBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                        const c10d::BroadcastOptions& opts) {
  at::Tensor t = tensors.at(0);
  at::Tensor result;
  group_->exchange(rank_, {signature("broadcast", t), t},
                   [&](const auto& posts) { result = posts[opts.rootRank].input.clone(); });
  t.copy_(result);
  return c10::make_intrusive<DoneWork>(rank_, c10d::OpType::BROADCAST);
}

c10::intrusive_ptr<c10d::Work> ThreadBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::AllreduceOptions& opts) {
  at::Tensor t = tensors.at(0);
  at::Tensor result;
  group_->exchange(rank_, {signature("allreduce", t), t}, [&](const auto& posts) {
    std::vector<at::Tensor> parts;
    for (const auto& p : posts) parts.push_back(p.input);
    result = reduce_parts(parts, opts.reduceOp);
  });
  t.copy_(result);
  return c10::make_intrusive<DoneWork>(rank_, c10d::OpType::ALLREDUCE);
}

c10::intrusive_ptr<c10d::Work> ThreadBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::AllgatherOptions& opts) {
  at::Tensor t = inputs.at(0);
  auto& outs = outputs.at(0);
  TORCH_CHECK(static_cast<int>(outs.size()) == size_, "thread backend allgather: expected ", size_,
              " outputs, got ", outs.size());
  group_->exchange(rank_, {signature("allgather", t), t}, [&](const auto& posts) {
    for (int r = 0; r < size_; ++r) outs[r].copy_(posts[r].input);
  });
  return c10::make_intrusive<DoneWork>(rank_, c10d::OpType::ALLGATHER);
}

c10::intrusive_ptr<c10d::Work> ThreadBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                              const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(output.numel() == input.numel() * size_,
              "thread backend all_gather_into_tensor: the output must hold ", input.numel() * size_,
              " elements, got ", output.numel());
  group_->exchange(rank_, {signature("all_gather_into_tensor", input), input}, [&](const auto& posts) {
    at::Tensor flat = output.view({size_, input.numel()});
    for (int r = 0; r < size_; ++r) flat[r].copy_(posts[r].input.reshape({-1}));
  });
  return c10::make_intrusive<DoneWork>(rank_, c10d::OpType::_ALLGATHER_BASE);
}

c10::intrusive_ptr<c10d::Work> ThreadBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(input.numel() == output.numel() * size_,
              "thread backend reduce_scatter_tensor: the input must hold ", output.numel() * size_,
              " elements, got ", input.numel());
  at::Tensor result;
  group_->exchange(rank_, {signature("reduce_scatter_tensor", input), input}, [&](const auto& posts) {
    std::vector<at::Tensor> parts;
    for (const auto& p : posts) parts.push_back(p.input.reshape({size_, -1})[rank_]);
    result = reduce_parts(parts, opts.reduceOp);
  });
  output.copy_(result.view(output.sizes()));
  return c10::make_intrusive<DoneWork>(rank_, c10d::OpType::_REDUCE_SCATTER_BASE);
}

c10::intrusive_ptr<c10d::Work> ThreadBackend::barrier(const c10d::BarrierOptions& opts) {
  group_->exchange(rank_, {"barrier", at::Tensor()}, [](const auto&) {});
  return c10::make_intrusive<DoneWork>(rank_, c10d::OpType::BARRIER);
}

void run_ranks_as_threads(int world_size, const std::function<void(comm::Communicator&)>& body,
                          std::chrono::milliseconds timeout) {
  auto group = std::make_shared<ThreadGroup>(world_size, timeout);
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        comm::Communicator comm(c10::make_intrusive<ThreadBackend>(group, r), at::kCPU);
        body(comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace fsdp::testing

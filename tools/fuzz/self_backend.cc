#include "self_backend.h"

#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace fsdp::fuzz {
namespace {

class DoneWork final : public c10d::Work {
 public:
  explicit DoneWork(c10d::OpType type) : c10d::Work(0, type) { finish(); }
};

// One rank: a reduction of one contribution is that contribution, a gather is a copy.
class SelfBackend final : public c10d::Backend {
 public:
  SelfBackend() : c10d::Backend(0, 1) {}
  const std::string getBackendName() const override { return "self"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>&, const c10d::BroadcastOptions&) override {
    return c10::make_intrusive<DoneWork>(c10d::OpType::BROADCAST);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLREDUCE);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions&) override {
    TORCH_CHECK(outputs.size() == 1 && outputs[0].size() == 1 && inputs.size() == 1, "self backend: allgather of ",
                inputs.size(), " inputs");
    outputs[0][0].copy_(inputs[0]);
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLGATHER);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    TORCH_CHECK(output.numel() == input.numel(), "self backend: all_gather_into_tensor of ", input.numel(),
                " elements into ", output.numel());
    output.view({-1}).copy_(input.reshape({-1}));
    return c10::make_intrusive<DoneWork>(c10d::OpType::_ALLGATHER_BASE);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions&) override {
    TORCH_CHECK(output.numel() == input.numel(), "self backend: reduce_scatter_tensor of ", input.numel(),
                " elements into ", output.numel());
    output.view({-1}).copy_(input.reshape({-1}));
    return c10::make_intrusive<DoneWork>(c10d::OpType::_REDUCE_SCATTER_BASE);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>&,
                                               std::vector<int64_t>&, const c10d::AllToAllOptions&) override {
    output.copy_(input);
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLTOALL_BASE);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return c10::make_intrusive<DoneWork>(c10d::OpType::BARRIER);
  }
};

}  // namespace

std::shared_ptr<comm::Communicator> one_rank_communicator() {
  auto comm = std::make_shared<comm::Communicator>(c10::make_intrusive<SelfBackend>(), at::kCPU);
  comm->set_world_ranks({0});
  return comm;
}

}  // namespace fsdp::fuzz

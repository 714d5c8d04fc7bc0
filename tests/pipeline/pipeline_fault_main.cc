// A pipeline stage that fails mid-step (tests/pipeline/pipeline_fault_test.sh): 3 ranks, one
// stage each, 1F1B over 2 microbatches. Steps 0 and 1 run everywhere; in step 2 stage 1 throws in
// the forward of microbatch 1 ("throw"), returns an output of another shape than microbatch 0's
// ("shape"), or its process is killed ("kill"). With "throw" and "shape" every rank gets the same
// error ([Note: pipeline step failures] in pipeline/schedule.h), prints it and goes on: step 3
// runs everywhere and the program exits 0. With "kill" the other ranks wait for the dead rank's
// transfers until the communicator's timeout report names the transfer.
//   pipeline_fault_main throw|shape|kill
#include <csignal>
#include <cstdio>
#include <exception>
#include <string>

#include <torch/torch.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/pipeline/schedule.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "throw" && mode != "shape" && mode != "kill") {
    std::fprintf(stderr, "usage: pipeline_fault_main throw|shape|kill\n");
    return 2;
  }
  const auto group = fsdp::comm::init_process_group();
  auto pp = group.comm;
  const int rank = pp->rank();
  torch::manual_seed(0);
  fsdp::contract::Linear layer(4, 4);
  int64_t step = 0;
  int calls_in_step_2 = 0;
  fsdp::pipeline::PipelineStage stage(
      [&](const at::Tensor& x) {
        if (step == 2 && rank == 1 && ++calls_in_step_2 == 2) {  // the forward of microbatch 1
          if (mode == "kill") {
            std::fprintf(stderr, "rank 1: SIGKILL in step 2\n");
            std::raise(SIGKILL);
          }
          if (mode == "shape") return torch::tanh(layer(x)).narrow(1, 0, 2);  // [2, 2], not [2, 4]
          throw std::runtime_error("stage 1 failed on purpose");
        }
        return torch::tanh(layer(x));
      },
      rank, pp->size(), pp);
  fsdp::pipeline::PipelineSchedule schedule(
      {&stage}, [](const at::Tensor& out, const at::Tensor& y) { return (out - y).pow(2).mean(); },
      fsdp::pipeline::ScheduleOptions().kind(fsdp::pipeline::ScheduleKind::k1F1B).n_microbatches(2));
  for (step = 0; step < 4; ++step) {
    try {
      schedule.step(torch::randn({4, 4}), torch::randn({4, 4}));
      std::fprintf(stderr, "rank %d: step %ld done\n", rank, static_cast<long>(step));
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "rank %d: error: %s\n", rank, e.what_without_backtrace());
    }
  }
  return 0;
}

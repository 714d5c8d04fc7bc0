// fully_shard jobs whose ranks diverge after the first iteration (no FSDP_DEBUG), for
// issuing_api_test.sh, which checks what every rank reports:
//   issuing_api_main save_rank0 DIR  rank 0 alone calls fsdp::dcp::save; the others stay alive:
//                                    the collective timeout (FSDP_COMM_TIMEOUT_S) names the API
//   issuing_api_main extra_forward   in iteration 3 rank 1 runs an extra forward before its
//                                    backward: the first collective where ranks differ is an
//                                    error on every rank naming it, its sizes and its API
// Every rank prints "rank R: error: ..." when an error leaves the job, then exits 1.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/contract/hookable_modules.h"

namespace {

// Units of different sizes, so that a rank one collective ahead issues another size.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", fsdp::contract::Linear(8, 16));
    b = register_module("b", fsdp::contract::Linear(16, 8));
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::tanh(a(x))); }
  fsdp::contract::Linear a{nullptr}, b{nullptr};
};
FSDP_HOOKABLE_MODULE(Net);

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const std::string dir = argc > 2 ? argv[2] : "/tmp";
  if (mode != "save_rank0" && mode != "extra_forward") {
    std::fprintf(stderr, "usage: %s save_rank0|extra_forward\n", argv[0]);
    return 2;
  }
  auto pg = fsdp::comm::init_process_group();
  const int rank = pg.comm->rank();
  try {
    torch::manual_seed(0);
    auto model = Net();
    fsdp::fully_shard(*model->a);
    fsdp::fully_shard(*model->b);
    auto root = fsdp::fully_shard(*model);
    for (int step = 0; step < 5; ++step) {
      const auto x = torch::randn({4, 8});
      auto loss = model(x).square().mean();
      if (mode == "extra_forward" && step == 3 && rank == 1) {
        std::fprintf(stderr, "rank 1: an extra forward in iteration 3\n");
        loss = loss + model(x).mean();
      }
      loss.backward();
      std::fprintf(stderr, "rank %d: step %d done\n", rank, step);
    }
    if (mode == "save_rank0") {
      if (rank == 0) {
        fsdp::dcp::save(dir + "/ckpt", root);
      } else {
        std::this_thread::sleep_for(std::chrono::seconds(60));
      }
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", rank, e.what_without_backtrace());
    return 1;
  }
  return 0;
}

// A small fully_shard training job in which rank 1 fails at step 2, for fault_test.sh:
//   fault_main kill           rank 1 SIGKILLs itself before its forward
//   fault_main stop           rank 1 SIGSTOPs itself before its forward (alive, never continues)
//   fault_main throw          rank 1's unit 'blocks.1' throws in its forward; the error leaves main
//                             on rank 1 (it exits 1) while the other ranks go on
//   fault_main throw_caught   as `throw`, but rank 1 catches the error and goes on with the next
//                             step (run with FSDP_DEBUG=1: the divergence check names it)
// Every rank prints "rank R: step S loss L" per step and "rank R: error: ..." when an error leaves
// a step, then exits 1. The collective timeout comes from FSDP_COMM_TIMEOUT_S.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/tests/composable/test_models.h"

namespace {

bool g_fail_now = false;  // set on rank 1 for the step that fails

// x + fc(x), throwing in its forward when g_fail_now is set.
struct FaultyBlockImpl : torch::nn::Module {
  explicit FaultyBlockImpl(int64_t dim) { fc = register_module("fc", fsdp::contract::Linear(dim, dim)); }
  torch::Tensor forward(torch::Tensor x) {
    if (g_fail_now) throw std::runtime_error("injected fault: rank 1 threw in the forward of blocks.1");
    return x + torch::tanh(fc(x));
  }
  fsdp::contract::Linear fc{nullptr};
};
FSDP_HOOKABLE_MODULE(FaultyBlock);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t dim) {
    blocks = register_module("blocks", fsdp::contract::ModuleList());
    blocks->push_back(fsdp::testing::MlpBlock(dim, 2 * dim));
    blocks->push_back(FaultyBlock(dim));
    blocks->push_back(fsdp::testing::MlpBlock(dim, 3 * dim));
    head = register_module("head", fsdp::contract::Linear(dim, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& block : *blocks) x = block.forward<torch::Tensor>(x);
    return head(x);
  }
  fsdp::contract::ModuleList blocks{nullptr};
  fsdp::contract::Linear head{nullptr};
};
FSDP_HOOKABLE_MODULE(Net);

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "kill" && mode != "stop" && mode != "throw" && mode != "throw_caught") {
    std::fprintf(stderr, "usage: %s kill|stop|throw|throw_caught\n", argv[0]);
    return 2;
  }
  auto pg = fsdp::comm::init_process_group();
  const int rank = pg.comm->rank();
  torch::manual_seed(0);
  auto model = Net(8);
  for (const auto& block : *model->blocks) fsdp::fully_shard(*block.ptr());
  fsdp::fully_shard(model);
  for (int step = 0; step < 5; ++step) {
    const bool faulty = rank == 1 && step == 2;
    if (faulty && mode == "kill") {
      std::fprintf(stderr, "rank 1: SIGKILL at step 2\n");
      std::raise(SIGKILL);
    }
    if (faulty && mode == "stop") {
      std::fprintf(stderr, "rank 1: SIGSTOP at step 2\n");
      std::raise(SIGSTOP);
    }
    g_fail_now = faulty && (mode == "throw" || mode == "throw_caught");
    try {
      torch::manual_seed(100 + 10 * step + rank);
      at::Tensor loss = model(torch::randn({4, 8})).pow(2).mean();
      loss.backward();
      std::fprintf(stderr, "rank %d: step %d loss %.6f\n", rank, step, loss.item<double>());
    } catch (const std::exception& e) {
      const bool go_on = g_fail_now && mode == "throw_caught";
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      std::fprintf(stderr, "rank %d: error: %s\n", rank, c10_error ? c10_error->what_without_backtrace() : e.what());
      if (!go_on) std::_Exit(1);  // the others may be inside a collective: no MPI_Finalize
      std::fprintf(stderr, "rank %d: skipping step %d and going on\n", rank, step);
    }
    g_fail_now = false;
  }
  std::fprintf(stderr, "rank %d: finished\n", rank);
  fsdp::comm::destroy_process_group();
  return 0;
}

#include <cstdio>

#include <torch/torch.h>

#include "fsdp_cpp/comm/init.h"                      // fsdp::comm::init_process_group
#include "fsdp_cpp/composable/fully_shard.h"         // fsdp::fully_shard
#include "fsdp_cpp/contract/hookable_modules.h"      // fsdp::contract::Linear
#include "fsdp_cpp/contract/hookable_sequential.h"   // fsdp::contract::Sequential
#include "fsdp_cpp/optim/adamw.h"                    // fsdp::optim::AdamW (//optim:flat_optimizers)

int main() {
  auto pg = fsdp::comm::init_process_group();   // under mpirun, or alone (1 rank)
  torch::manual_seed(0);
  fsdp::contract::Sequential model(fsdp::contract::Linear(64, 256), fsdp::contract::Linear(256, 64),
                                   fsdp::contract::Linear(64, 8));
  for (size_t i = 0; i < model->size(); ++i) fsdp::fully_shard(*(*model)[i].ptr());   // bottom-up
  fsdp::fully_shard(model);

  // torch::optim::AdamW's options, state and checkpoints; each FlatParameter's shard stepped as
  // one tensor (small ones packed together) instead of one parameter at a time.
  auto options = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  fsdp::optim::AdamW optim(model->parameters(), options);
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(1000 * step + pg.comm->rank());
    auto x = torch::randn({16, 64}), y = torch::randn({16, 8});
    auto loss = torch::nn::functional::mse_loss(model(x), y);
    loss.backward();
    optim.step();
    optim.zero_grad();
    const auto& s = optim.last_step();
    if (pg.comm->rank() == 0) {
      std::printf("step %d: loss %.4f; %lld parameters in runs, %lld in packs, %lld alone\n", step,
                  loss.item<double>(), static_cast<long long>(s.flat_params),
                  static_cast<long long>(s.packed_params), static_cast<long long>(s.single_params));
    }
  }
  fsdp::comm::destroy_process_group();
}

#include <cstdio>

#include <torch/torch.h>

#include "fsdp_cpp/comm/init.h"                      // fsdp::comm::init_process_group
#include "fsdp_cpp/composable/fully_shard.h"         // fsdp::fully_shard
#include "fsdp_cpp/contract/hookable_module_list.h"  // fsdp::contract::ModuleList
#include "fsdp_cpp/contract/hookable_modules.h"      // fsdp::contract::Linear, Embedding, LayerNorm, ...

// 1. Opt module classes into forward hooks: one line, FSDP_HOOKABLE_MODULE instead of
//    TORCH_MODULE; use the hook-able holders for LibTorch's modules (fsdp::contract::Linear,
//    Embedding, LayerNorm, Conv2d, MultiheadAttention, Sequential, ModuleList).
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", fsdp::contract::Linear(512, 2048));
    fc2 = register_module("fc2", fsdp::contract::Linear(2048, 512));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(x))); }
  fsdp::contract::Linear fc1{nullptr}, fc2{nullptr};
};
FSDP_HOOKABLE_MODULE(Block);

struct ModelImpl : torch::nn::Module {
  explicit ModelImpl(int n_blocks) {
    blocks = register_module("blocks", fsdp::contract::ModuleList());
    for (int i = 0; i < n_blocks; ++i) blocks->push_back(Block());
    head = register_module("head", fsdp::contract::Linear(512, 512));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (Block& block : blocks->holders<Block>()) x = block(x);   // through the holder: hooks run
    return head(x);
  }
  fsdp::contract::ModuleList blocks{nullptr};
  fsdp::contract::Linear head{nullptr};
};
FSDP_HOOKABLE_MODULE(Model);

int main() {
  auto pg = fsdp::comm::init_process_group();   // under mpirun, or alone (1 rank); torchrun: CUDA
  const int rank = pg.comm->rank();
  torch::manual_seed(0);                        // the same initial model on every rank
  Model model(4);

  // 2. Shard bottom-up: each block, then the root.
  for (size_t i = 0; i < model->blocks->size(); ++i)
    fsdp::fully_shard(model->blocks->at<Block>(i));
  auto root = fsdp::fully_shard(model);   // FullyShardOptions().strategy(...).device(...) ...

  // 3. Train as usual: the optimizer sees the original parameters, by their original names.
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-3));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(1000 * step + rank);     // each rank its own batch
    auto x = torch::randn({8, 512}), y = torch::randn({8, 512});
    auto loss = torch::nn::functional::mse_loss(model(x), y);   // call through the holder
    loss.backward();      // gradients reduce-scattered; each .grad is this rank's shard
    optim.step();
    optim.zero_grad();
    if (rank == 0) std::printf("step %d: loss %.4f\n", step, loss.item<double>());
  }
  fsdp::comm::destroy_process_group();
}

#include <cstdio>

#include <torch/torch.h>

#include "fsdp_cpp/comm/init.h"                      // fsdp::comm::init_process_group
#include "fsdp_cpp/composable/fully_shard.h"         // fsdp::fully_shard, fsdp::int8_block_codec
#include "fsdp_cpp/contract/hookable_module_list.h"  // fsdp::contract::ModuleList
#include "fsdp_cpp/contract/hookable_modules.h"      // fsdp::contract::Linear

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", fsdp::contract::Linear(256, 1024));
    fc2 = register_module("fc2", fsdp::contract::Linear(1024, 256));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(x))); }
  fsdp::contract::Linear fc1{nullptr}, fc2{nullptr};
};
FSDP_HOOKABLE_MODULE(Block);

struct ModelImpl : torch::nn::Module {
  ModelImpl() {
    blocks = register_module("blocks", fsdp::contract::ModuleList());
    for (int i = 0; i < 4; ++i) blocks->push_back(Block());
  }
  torch::Tensor forward(torch::Tensor x) {
    for (Block& block : blocks->holders<Block>()) x = block(x);
    return x;
  }
  fsdp::contract::ModuleList blocks{nullptr};
};
FSDP_HOOKABLE_MODULE(Model);

int main() {
  auto pg = fsdp::comm::init_process_group();
  torch::manual_seed(0);
  Model model;

  // Weights all-gathered in int8 with a float32 scale per 256 elements (ZeRO++'s qwZ), gradients
  // reduced as int8 chunks with bfloat16 scales, summed in float32 (qgZ).
  const auto options = fsdp::FullyShardOptions()
                           .all_gather_codec(fsdp::int8_block_codec(256))
                           .reduce_codec(fsdp::int8_block_codec(256, at::kBFloat16));
  for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::fully_shard(model->blocks->at<Block>(i), options);
  fsdp::fully_shard(model, options);

  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-3));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(1000 * step + pg.comm->rank());
    auto loss = model(torch::randn({8, 256})).pow(2).mean();
    loss.backward();   // an all-to-all of int8 gradient chunks per block, no reduce-scatter
    optim.step();
    optim.zero_grad();
    if (pg.comm->rank() == 0) std::printf("step %d: loss %.4f\n", step, loss.item<double>());
  }
  fsdp::comm::destroy_process_group();
}

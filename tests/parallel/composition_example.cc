#include <cstdio>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "fsdp_cpp/comm/init.h"                        // fsdp::comm::init_process_group
#include "fsdp_cpp/examples/gpt_model.h"               // the model: any hook-able module tree
#include "fsdp_cpp/examples/gpt_tensor_parallel.h"     // its tensor-parallel plan
#include "fsdp_cpp/parallel/parallel_model.h"          // fsdp::parallel::parallelize
#include "fsdp_cpp/pipeline/stage_split.h"             // fsdp::pipeline::split_blocks_evenly

int main() {
  auto pg = fsdp::comm::init_process_group();
  const int world = pg.comm->size();
  using fsdp::examples::GPT;
  const auto config = fsdp::examples::GPTConfig(/*vocab_size=*/64).n_layers(4).dropout(0.1).tie_embeddings(false);

  // What the model supplies: how to build stage s of n (the whole model when n is 1, every rank
  // from the same seed), its loss, its tensor-parallel plan, and which modules are units.
  fsdp::parallel::ModelSpec spec;
  spec.build = [&](int stage, int n_stages) {
    torch::manual_seed(0);
    GPT model(config);
    if (n_stages > 1) {
      auto ranges = fsdp::pipeline::split_blocks_evenly(config.n_layers(), n_stages);
      model->keep_stage(ranges[stage], stage == 0, stage == n_stages - 1);
    }
    return fsdp::parallel::ModelPart{model.ptr(), [model](const at::Tensor& x) mutable { return model(x); }};
  };
  spec.loss = fsdp::examples::next_token_loss;
  spec.units = fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>();
  spec.tensor_parallel = [](fsdp::parallel::ModelPart& part, const auto& tp) {
    GPT model(std::dynamic_pointer_cast<fsdp::examples::GPTImpl>(part.module));
    return fsdp::parallel::LossFn(fsdp::examples::parallelize_gpt(model, tp));
  };

  // The layout: tensor parallel over pairs of ranks when the world is even, fully_shard over the
  // rest (dp_shard = -1); add .pp = 2 for pipeline stages, dp_replicate for HSDP.
  const int tp = world % 2 == 0 ? 2 : 1;
  auto model = fsdp::parallel::parallelize(
      pg.comm, spec, fsdp::parallel::ParallelOptions().dims({.dp_shard = -1, .tp = tp}).n_microbatches(2));
  torch::optim::AdamW optim(model.parameters(), torch::optim::AdamWOptions(1e-3));

  for (int64_t step = 0; step < 3; ++step) {
    // Data by data rank (never world rank): the ranks of a tp group read the same batch.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + model.mesh().data_rank());
    at::Tensor tokens = at::randint(0, 64, {4, 17}, gen, at::kLong);
    at::Tensor loss = model.forward_backward(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16));
    double norm = model.clip_grad_norm_(1.0);   // the whole model's norm, every rank alike
    optim.step();
    model.zero_grad();                           // also what an abandoned step accumulated
    double mean = model.global_loss(loss);
    if (pg.comm->rank() == 0) std::printf("step %lld: loss %.4f, grad norm %.4f\n", (long long)step, mean, norm);
  }
  if (pg.comm->rank() == 0) std::printf("%s\n", model.describe().c_str());
}

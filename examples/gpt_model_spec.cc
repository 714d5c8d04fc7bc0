#include "fsdp_cpp/examples/gpt_model_spec.h"

#include <memory>

#include <torch/utils.h>

#include "fsdp_cpp/pipeline/stage_split.h"

namespace fsdp::examples {

parallel::ModelSpec gpt_model_spec(const GPTConfig& config, uint64_t init_seed, const GptTensorParallel& tp) {
  parallel::ModelSpec spec;
  spec.build = [config, init_seed](int stage, int n_stages) {
    torch::manual_seed(init_seed);  // every stage is cut from the same whole model
    GPT model(config);
    if (n_stages > 1) {
      const auto ranges = pipeline::split_blocks_evenly(config.n_layers(), n_stages);
      model->keep_stage(ranges[stage], stage == 0, stage == n_stages - 1);
    }
    return parallel::ModelPart{model.ptr(), [model](const at::Tensor& x) mutable { return model(x); }};
  };
  spec.loss = next_token_loss;
  spec.units = WrapPolicy::module_types<BlockImpl>();
  spec.tensor_parallel = [tp](parallel::ModelPart& part, const std::shared_ptr<comm::Communicator>& group) {
    GPT model(std::dynamic_pointer_cast<GPTImpl>(part.module));
    GptLossFunction loss = parallelize_gpt(model, group, tp);
    // Only loss parallel changes the loss (vocabulary-parallel logits); otherwise the spec's stays.
    return tp.loss_parallel() ? parallel::LossFn(std::move(loss)) : parallel::LossFn{};
  };
  return spec;
}

}  // namespace fsdp::examples

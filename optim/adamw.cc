#include "fsdp_cpp/optim/adamw.h"

#include <utility>

#include "adam_family_step.h"

namespace fsdp::optim {

AdamW::AdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
             torch::optim::AdamWOptions defaults, FlatAdamOptions flat_options)
    : torch::optim::AdamW(param_groups, std::move(defaults)), flat_options_(flat_options) {
  detail::check_flat_adam_options(flat_options_, param_groups_, "fsdp::optim::AdamW");
}

AdamW::AdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults, FlatAdamOptions flat_options)
    : AdamW(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
            std::move(defaults), flat_options) {}

torch::Tensor AdamW::step(LossClosure closure) {
  return detail::adam_family_step<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(
      closure, param_groups_, state_, /*decoupled=*/true, "AdamW", pack_max_numel_, flat_options_,
      stats_);
}

}  // namespace fsdp::optim

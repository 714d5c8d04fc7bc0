#include "fsdp_cpp/optim/adam.h"

#include <utility>

#include <c10/util/Exception.h>

#include "adam_family_step.h"

namespace fsdp::optim {

namespace detail {

void check_flat_adam_options(const FlatAdamOptions& options,
                             const std::vector<torch::optim::OptimizerParamGroup>& groups, const char* api) {
  const c10::ScalarType dtype = options.state_dtype();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, api,
              ": FlatAdamOptions::state_dtype must be Float (torch::optim's states, of each parameter's dtype) "
              "or BFloat16 (bfloat16 moments of float32 parameters); got ", dtype);
  if (dtype != at::kBFloat16) return;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK(params[i].scalar_type() == at::kFloat, api,
                  ": FlatAdamOptions::state_dtype(BFloat16) keeps the moments of float32 parameters in "
                  "bfloat16; parameter ", i, " of param group ", g, " (shape ", params[i].sizes(), ") is ",
                  params[i].scalar_type(), " (expected Float; fully_shard's shards are float32 under mixed "
                  "precision too)");
    }
  }
}

}  // namespace detail

Adam::Adam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, torch::optim::AdamOptions defaults,
           FlatAdamOptions flat_options)
    : torch::optim::Adam(param_groups, std::move(defaults)), flat_options_(flat_options) {
  detail::check_flat_adam_options(flat_options_, param_groups_, "fsdp::optim::Adam");
}

Adam::Adam(std::vector<at::Tensor> params, torch::optim::AdamOptions defaults, FlatAdamOptions flat_options)
    : Adam(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
           std::move(defaults), flat_options) {}

torch::Tensor Adam::step(LossClosure closure) {
  return detail::adam_family_step<torch::optim::AdamParamState, torch::optim::AdamOptions>(
      closure, param_groups_, state_, /*decoupled=*/false, "Adam", pack_max_numel_, flat_options_,
      stats_);
}

}  // namespace fsdp::optim

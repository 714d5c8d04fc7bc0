#include "fsdp_cpp/optim/adamw.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/GradMode.h>

#include "adam_family_step.h"

namespace fsdp::optim {

torch::Tensor AdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  detail::adam_family_step<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(
      param_groups_, state_, /*decoupled=*/true, "AdamW", pack_max_numel_, stats_);
  return loss;
}

}  // namespace fsdp::optim

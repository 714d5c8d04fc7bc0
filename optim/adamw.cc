#include "fsdp_cpp/optim/adamw.h"

#include "adam_family_step.h"

namespace fsdp::optim {

torch::Tensor AdamW::step(LossClosure closure) {
  return detail::adam_family_step<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(
      closure, param_groups_, state_, /*decoupled=*/true, "AdamW", pack_max_numel_, stats_);
}

}  // namespace fsdp::optim

#include "fsdp_cpp/optim/adam.h"

#include "adam_family_step.h"

namespace fsdp::optim {

torch::Tensor Adam::step(LossClosure closure) {
  return detail::adam_family_step<torch::optim::AdamParamState, torch::optim::AdamOptions>(
      closure, param_groups_, state_, /*decoupled=*/false, "Adam", pack_max_numel_, stats_);
}

}  // namespace fsdp::optim

#pragma once
// fsdp::optim::SGD: torch::optim::SGD stepping runs of adjacent parameters as one tensor.
//
// A drop-in replacement like fsdp::optim::AdamW (optim/adamw.h): the same options
// (torch::optim::SGDOptions: lr, momentum, dampening, weight_decay, nesterov), param groups and
// per-parameter state (SGDParamState::momentum_buffer, a view of the run's flat buffer: [Note:
// flat state]). step() updates each run ([Note: flat runs]) with LibTorch's op sequence ([Note:
// exact steps]); without momentum there is no state, as in torch::optim::SGD.
//
//   fsdp::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));

#include <vector>

#include <torch/optim/sgd.h>

#include "fsdp_cpp/optim/flat_step_stats.h"

namespace fsdp::optim {

class SGD : public torch::optim::SGD, public FlatStepping {
 public:
  using torch::optim::SGD::SGD;

  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace fsdp::optim

#pragma once
// fsdp::optim::Adam: torch::optim::Adam stepping runs of adjacent parameters as one tensor.
//
// A drop-in replacement: the same constructor, options (torch::optim::AdamOptions), param groups,
// per-parameter state (torch::optim::AdamParamState, the same keys and shapes), zero_grad and
// save/load, so the optimizer state dicts (checkpoint/optimizer_state_dict.h) and fsdp::dcp work
// unchanged and its checkpoints are interchangeable with torch::optim::Adam's. step() finds the runs
// of each param group ([Note: flat runs]: the original parameters of one FlatParameter after
// fully_shard), keeps their state as one tensor per state name ([Note: flat state]) and updates
// each run with whole-tensor ops, the values of torch::optim::Adam bit for bit ([Note: exact
// steps], optim/adam_family_step.h); anything else is stepped per parameter.
//
//   fsdp::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
//   loss.backward();
//   optimizer.step();

#include <vector>

#include <torch/optim/adam.h>

#include "fsdp_cpp/optim/flat_step_stats.h"

namespace fsdp::optim {

class Adam : public torch::optim::Adam, public FlatStepping {
 public:
  using torch::optim::Adam::Adam;

  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace fsdp::optim

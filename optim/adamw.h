#pragma once
// fsdp::optim::AdamW: torch::optim::AdamW stepping runs of adjacent parameters as one tensor.
//
// A drop-in replacement: the same constructor, options (torch::optim::AdamWOptions), param groups,
// per-parameter state (torch::optim::AdamWParamState, the same keys and shapes), zero_grad and
// save/load, so the optimizer state dicts (checkpoint/optimizer_state_dict.h) and fsdp::dcp work
// unchanged and its checkpoints are interchangeable with torch::optim::AdamW's. step() finds the runs
// of each param group ([Note: flat runs]: the original parameters of one FlatParameter after
// fully_shard), keeps their state as one tensor per state name ([Note: flat state]) and updates
// each run with whole-tensor ops, the values of torch::optim::AdamW bit for bit ([Note: exact
// steps], optim/adam_family_step.h); anything else is stepped per parameter.
//
//   fsdp::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
//   loss.backward();
//   optimizer.step();
//
// FlatAdamOptions (optim/adam.h) as the third argument: bfloat16 moments ([Note: bfloat16
// moments] in optim/adam_family_step.h).

#include <vector>

#include <torch/optim/adamw.h>

#include "fsdp_cpp/optim/adam.h"
#include "fsdp_cpp/optim/flat_step_stats.h"

namespace fsdp::optim {

class AdamW : public torch::optim::AdamW, public FlatStepping {
 public:
  explicit AdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                 torch::optim::AdamWOptions defaults = {}, FlatAdamOptions flat_options = {});
  explicit AdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {},
                 FlatAdamOptions flat_options = {});

  torch::Tensor step(LossClosure closure = nullptr) override;

  const FlatAdamOptions& flat_options() const { return flat_options_; }

 private:
  FlatAdamOptions flat_options_;
};

}  // namespace fsdp::optim

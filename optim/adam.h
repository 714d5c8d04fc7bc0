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
//
// A third argument, FlatAdamOptions, holds what torch::optim's options have not: bfloat16 moments
// ([Note: bfloat16 moments] in optim/adam_family_step.h), 12 instead of 16 bytes per parameter
// with fully_shard's float32 shards (parameter 4, gradient 4, exp_avg 2, exp_avg_sq 2):
//
//   fsdp::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3),
//                                fsdp::optim::FlatAdamOptions().state_dtype(at::kBFloat16));

#include <cstdint>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/optim/adam.h>

#include "fsdp_cpp/optim/flat_step_stats.h"

namespace fsdp::optim {

/// With bfloat16 moments, elements per chunk of their float32 working copies during a step: the
/// step's extra memory is a few times this many float32s, whatever the size of the run.
inline constexpr int64_t kBFloat16Chunk = int64_t{1} << 16;

/// How float32 moments are rounded to bfloat16 after each update ([Note: bfloat16 moments]).
enum class StateRounding {
  kStochastic,  // up or down with the probabilities that make the rounding unbiased (default)
  kNearest,     // to nearest, ties to even (LibTorch's float -> bfloat16 conversion)
};

/// fsdp::optim's options of Adam and AdamW beside torch::optim's (which the param groups and the
/// checkpoints carry): the optimizer keeps them, for all its param groups.
struct FlatAdamOptions {
  /// The dtype of exp_avg, exp_avg_sq and max_exp_avg_sq. at::kFloat (default): torch::optim's
  /// states, of each parameter's dtype (float32 for fully_shard's shards, mixed precision
  /// included). at::kBFloat16: bfloat16 moments of float32 parameters, updated in float32 and
  /// rounded back after every step (`rounding`); the state dicts and save() then hold bfloat16
  /// tensors. Any other dtype is refused by the constructor.
  TORCH_ARG(c10::ScalarType, state_dtype) = c10::ScalarType::Float;
  /// With bfloat16 states: how the updated moments are rounded.
  TORCH_ARG(StateRounding, rounding) = StateRounding::kStochastic;
  /// With stochastic rounding: the seed of the rounding's random bits. The bits of each step are
  /// a function of the seed, the parameters' step counter and the position of the run in the
  /// step, so a run resumed from a checkpoint rounds as the uninterrupted one would.
  TORCH_ARG(uint64_t, seed) = 0;
};

class Adam : public torch::optim::Adam, public FlatStepping {
 public:
  explicit Adam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                torch::optim::AdamOptions defaults = {}, FlatAdamOptions flat_options = {});
  explicit Adam(std::vector<at::Tensor> params, torch::optim::AdamOptions defaults = {},
                FlatAdamOptions flat_options = {});

  torch::Tensor step(LossClosure closure = nullptr) override;

  const FlatAdamOptions& flat_options() const { return flat_options_; }

 private:
  FlatAdamOptions flat_options_;
};

namespace detail {
/// Refuses a state dtype other than float32 and bfloat16, and with bfloat16 a parameter of
/// `groups` that is not float32; `api` names the optimizer ("fsdp::optim::AdamW").
void check_flat_adam_options(const FlatAdamOptions& options,
                             const std::vector<torch::optim::OptimizerParamGroup>& groups, const char* api);
}  // namespace detail

}  // namespace fsdp::optim

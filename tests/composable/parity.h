#pragma once
// Training parity against an unsharded reference, over MPI on the launch's world size.
//
// The sharded model and an unsharded reference (same initial weights on every rank; gradients
// averaged over all ranks' batches, DDP semantics, computed without the library) must give the
// same loss every iteration and the same parameters after training: bit-exact on 1 rank, within
// rtol/atol otherwise. Also checked every iteration: FQNs and parameter objects unchanged, no
// unsharded storage outside forward/backward, and the collective counts per handle from the
// second iteration on.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/tests/composable/test_models.h"

namespace fsdp::testing {

// One model instance and how to run and shard it.
struct Instance {
  std::shared_ptr<torch::nn::Module> module;
  // Forward on rank q's batch (a model may behave differently per rank).
  std::function<torch::Tensor(torch::Tensor, int)> forward;
  // Applies fully_shard bottom-up; returns the units, the root last.
  std::function<std::vector<fsdp::FSDPModule>(const fsdp::FullyShardOptions&)> shard;
};

struct Scenario {
  std::string name;
  int64_t in_dim;
  int64_t out_dim;
  std::function<Instance()> make;
  // All-gathers per backward pass that a unit's handle takes beyond the strategy's rule (e.g. a
  // unit called twice in forward).
  int extra_forward_calls = 0;
  // All-gathers per backward pass that do not happen because backward cannot reach a unit (its
  // outputs need no gradient: frozen parameters on inputs that need none).
  int unreachable_backward_all_gathers = 0;
};

enum class Optim { kSgdMomentum, kAdam, kAdamW };

struct CollectiveCounts {
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  int64_t all_reduces = 0;
};

struct ParityOptions {
  Optim optim = Optim::kAdam;
  bool set_to_none = true;
  /// Backward passes accumulated before each optimizer step.
  int micro_batches = 1;
  int iterations = 4;
  /// Options for every unit (the communicator is set by run_parity).
  fsdp::FullyShardOptions shard_options;
  double rtol = 1e-5;
  double atol = 1e-6;
  /// Builds the optimizer instead of `optim` (e.g. parameter groups).
  std::function<std::unique_ptr<torch::optim::Optimizer>(torch::nn::Module&)> make_optimizer;
  /// Build the sharded model's optimizer before fully_shard.
  bool optimizer_before_shard = false;
};

/// The collective counts per backward pass the rule gives for `units` (the root last).
CollectiveCounts expected_counts(const std::vector<fsdp::FSDPModule>& units, int forward_calls_per_unit);

void run_parity(const Scenario& scenario, const ParityOptions& options);

/// fully_shard on every block of `model`, then on the root: the units, the root last.
std::vector<fsdp::FSDPModule> shard_stack(const MlpStack& model, const fsdp::FullyShardOptions& options);

/// MlpStack(6, 8, 16, 3, 3) with a unit per block and the root; `prepare` runs on each fresh model
/// (e.g. to freeze parameters).
Scenario mlp_stack_scenario(std::string name, std::function<void(MlpStack&)> prepare = nullptr);

}  // namespace fsdp::testing

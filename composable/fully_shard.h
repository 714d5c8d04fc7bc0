#pragma once
// fully_shard: the public entry point (FSDP's composable API).
//
//   auto pg = fsdp::comm::init_process_group();
//   for (auto& block : model->blocks) fsdp::fully_shard(*block);   // bottom-up
//   fsdp::fully_shard(*model);                                      // the root last
//   torch::optim::AdamW optim(model->parameters(), 1e-3);          // original parameters
//   for (...) {
//     auto loss = model(x).pow(2).mean();    // call through hook-able holders
//     loss.backward();
//     optim.step();
//     optim.zero_grad();
//   }
//
// Each call makes the module a unit: its parameters not already in a unit below it become one
// FlatParameter per dtype, sharded across the ranks of the communicator. The module tree, every
// FQN and every parameter object stay as they were. Modules must be called through hook-able
// holders (FSDP_HOOKABLE_MODULE, fsdp::contract::Linear, Sequential, ...): `module->forward(x)`
// bypasses the hooks and is unsupported (the first iteration detects it and fails).

#include <memory>
#include <optional>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/pimpl.h>

#include "comm/communicator.h"
#include "fsdp/fsdp_state.h"

namespace fsdp {

/// Options of fully_shard, in the LibTorch style:
///
///   fsdp::fully_shard(*block, fsdp::FullyShardOptions().reshard_after_forward(false));
struct FullyShardOptions {
  /// The ranks to shard across. Default: fsdp::comm::default_process_group() (call
  /// fsdp::comm::init_process_group() first).
  TORCH_ARG(std::shared_ptr<comm::Communicator>, communicator) = nullptr;
  /// true (FULL_SHARD): free the unsharded parameters after forward and all-gather them again for
  /// backward. The root unit always keeps them from forward to backward.
  TORCH_ARG(bool, reshard_after_forward) = true;
};

/// What fully_shard returns: the unit, with on-demand unshard/reshard.
class FSDPModule {
 public:
  explicit FSDPModule(std::shared_ptr<FSDPState> state) : state_(std::move(state)) {}

  /// All-gathers this unit's parameters: they become full-shape views until reshard().
  void unshard() { state_->unshard(); }
  /// Frees the unsharded parameters: they become views of this rank's shard again.
  void reshard() { state_->reshard(); }

  torch::nn::Module& module() const { return state_->module(); }
  FSDPState& state() const { return *state_; }
  const std::vector<std::unique_ptr<FlatParamHandle>>& handles() const { return state_->handles(); }

 private:
  std::shared_ptr<FSDPState> state_;
};

/// Makes `module` a fully sharded unit (see the top of this file). Errors (applied twice, applied
/// top-down, parameters on another device than the communicator's) name the module's FQN and
/// leave the model as it was.
FSDPModule fully_shard(torch::nn::Module& module, const FullyShardOptions& options = {});

template <typename Contained>
FSDPModule fully_shard(const torch::nn::ModuleHolder<Contained>& module,
                       const FullyShardOptions& options = {}) {
  return fully_shard(*module.ptr(), options);
}

/// The unit fully_shard made of `module`, if any.
std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module& module);

}  // namespace fsdp

#pragma once
// moved to composable/activation_checkpoint.h: fsdp::checkpoint is now fsdp::checkpoint_activations
// (the word "checkpoint" alone names the distributed checkpoints of checkpoint/). The old names
// stay, for code written against them.

#include <type_traits>
#include <vector>

#include <torch/nn/pimpl.h>

#include "fsdp_cpp/composable/activation_checkpoint.h"

namespace fsdp {

inline constexpr const char* kCheckpointApi = kActivationCheckpointApi;

using CheckpointOptions = ActivationCheckpointOptions;

inline void checkpoint(torch::nn::Module& module, const CheckpointOptions& options = {}) {
  checkpoint_activations(module, options);
}

template <typename Holder>
  requires std::is_base_of_v<torch::detail::ModuleHolderIndicator, Holder>
void checkpoint(const Holder& module, const CheckpointOptions& options = {}) {
  checkpoint_activations(module, options);
}

inline std::vector<SelectedModule> checkpoint_tree(torch::nn::Module& root, const WrapPolicy& policy,
                                                   const CheckpointOptions& options = {}) {
  return checkpoint_activations_tree(root, policy, options);
}

inline bool is_checkpointed(const torch::nn::Module& module) { return is_activation_checkpointed(module); }

}  // namespace fsdp

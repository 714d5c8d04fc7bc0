#pragma once
// checkpoint_activations: activation checkpointing as a composable API (PyTorch's composable
// `checkpoint`, torch/distributed/_composable/checkpoint_activation.py; LibTorch has no C++
// torch.utils.checkpoint). Named apart from the distributed checkpoints of checkpoint/ (fsdp::dcp),
// which save state; this one trades compute for activation memory.
//
//   for (auto& block : model->blocks) {
//     fsdp::checkpoint_activations(block);  // keep only each block's inputs through forward
//     fsdp::fully_shard(block, opts);       // in either order
//   }
//   fsdp::fully_shard(model, opts);
//   auto loss = model(x).sum();  // each block's activations are freed as it finishes
//   loss.backward();             // and recomputed, block by block, during backward
//
// The module's forward runs without keeping its intermediate activations (under no-grad, as one
// autograd node that saves only the forward's tensor arguments); backward runs the forward again
// with the RNG state the first forward had (dropout draws the same mask), then backpropagates
// through the recomputed graph. Gradients equal those without checkpointing. The module tree and
// its FQNs do not change.
//
// Composition with fully_shard: on the same module, or on a module that contains it, the
// recomputation finds the unit already unsharded by its pre-backward: no extra all-gather, no
// prefetch and no hook from inside the recomputation. A module that contains fully_shard units
// cannot be checkpointed (the first forward names them): checkpoint the units, or modules inside
// them. Works with replicate on an enclosing module.
//
// Limits: the module must be called through a hook-able holder (as for fully_shard); a double
// backward (create_graph) through a checkpointed module is refused; LibTorch's autocast state is
// not replayed.

#include <memory>
#include <type_traits>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/pimpl.h>

#include "fsdp_cpp/composable/wrap_policy.h"
#include "fsdp_cpp/contract/forward_hooks.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

/// The name checkpoint_activations's state is registered under in the contract's registry
/// ("checkpoint", as PyTorch's composable API registers it).
inline constexpr const char* kActivationCheckpointApi = "checkpoint";

/// Options of checkpoint_activations, in the LibTorch style:
///
///   fsdp::checkpoint_activations(block, fsdp::ActivationCheckpointOptions().preserve_rng_state(false));
struct ActivationCheckpointOptions {
  /// Replay the forward's RNG state (the CPU generator and the CUDA generators of the devices the
  /// arguments live on) in the recomputation, so that dropout matches. Off: faster, but random
  /// ops draw new numbers in the recomputation.
  TORCH_ARG(bool, preserve_rng_state) = true;
};

/// Makes `module`'s forward recompute its activations in backward (see the top of this file).
/// Applying it twice to one module is an error naming the module's FQN.
void checkpoint_activations(torch::nn::Module& module, const ActivationCheckpointOptions& options = {});

/// checkpoint_activations on the module of a hook-able holder (LibTorch's own holders call forward
/// directly and are refused at compile time, as by fully_shard).
///
///   fsdp::checkpoint_activations(model->block(0));
template <typename Holder>
  requires std::is_base_of_v<torch::detail::ModuleHolderIndicator, Holder>
void checkpoint_activations(const Holder& module, const ActivationCheckpointOptions& options = {}) {
  static_assert(contract::HookableHolder<Holder>,
                "checkpoint_activations: expected a hook-able module holder (FSDP_HOOKABLE_MODULE, "
                "fsdp::contract::Linear, Sequential, ...), got one that calls forward directly "
                "(TORCH_MODULE, torch::nn::Linear, ...), so checkpointing would never run");
  checkpoint_activations(*module.ptr(), options);
}

/// checkpoint_activations on every module under `root` that `policy` selects (root excluded), with
/// the same policies as fully_shard_tree. Returns the modules, in the order they were checkpointed.
///
///   fsdp::checkpoint_activations_tree(*model, fsdp::WrapPolicy::module_types<BlockImpl>());
std::vector<SelectedModule> checkpoint_activations_tree(torch::nn::Module& root, const WrapPolicy& policy,
                                                        const ActivationCheckpointOptions& options = {});

/// Whether checkpoint_activations was applied to `module`.
bool is_activation_checkpointed(const torch::nn::Module& module);

}  // namespace fsdp

#pragma once
// checkpoint: activation checkpointing as a composable API (PyTorch's composable `checkpoint`;
// LibTorch has no C++ torch.utils.checkpoint).
//
//   for (auto& block : model->blocks) {
//     fsdp::checkpoint(block);        // keep only each block's inputs through forward
//     fsdp::fully_shard(block, opts); // in either order
//   }
//   fsdp::fully_shard(model, opts);
//   auto loss = model(x).sum();       // each block's activations are freed as it finishes
//   loss.backward();                  // and recomputed, block by block, during backward
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

#include "composable/wrap_policy.h"
#include "contract/forward_hooks.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

/// The name checkpoint's state is registered under in the contract's registry.
inline constexpr const char* kCheckpointApi = "checkpoint";

/// Options of checkpoint, in the LibTorch style:
///
///   fsdp::checkpoint(block, fsdp::CheckpointOptions().preserve_rng_state(false));
struct CheckpointOptions {
  /// Replay the forward's RNG state (the CPU generator and the CUDA generators of the devices the
  /// arguments live on) in the recomputation, so that dropout matches. Off: faster, but random
  /// ops draw new numbers in the recomputation.
  TORCH_ARG(bool, preserve_rng_state) = true;
};

/// Makes `module`'s forward recompute its activations in backward (see the top of this file).
/// Applying it twice to one module is an error naming the module's FQN.
void checkpoint(torch::nn::Module& module, const CheckpointOptions& options = {});

/// checkpoint on the module of a hook-able holder (LibTorch's own holders call forward directly
/// and are refused at compile time, as by fully_shard).
///
///   fsdp::checkpoint(model->block(0));
template <typename Holder>
  requires std::is_base_of_v<torch::detail::ModuleHolderIndicator, Holder>
void checkpoint(const Holder& module, const CheckpointOptions& options = {}) {
  static_assert(contract::HookableHolder<Holder>,
                "checkpoint: expected a hook-able module holder (FSDP_HOOKABLE_MODULE, "
                "fsdp::contract::Linear, Sequential, ...), got one that calls forward directly "
                "(TORCH_MODULE, torch::nn::Linear, ...), so checkpointing would never run");
  checkpoint(*module.ptr(), options);
}

/// checkpoint on every module under `root` that `policy` selects (root excluded), with the same
/// policies as fully_shard_tree. Returns the modules, in the order they were checkpointed.
///
///   fsdp::checkpoint_tree(*model, fsdp::WrapPolicy::module_types<BlockImpl>());
std::vector<SelectedModule> checkpoint_tree(torch::nn::Module& root, const WrapPolicy& policy,
                                            const CheckpointOptions& options = {});

/// Whether checkpoint was applied to `module`.
bool is_checkpointed(const torch::nn::Module& module);

}  // namespace fsdp

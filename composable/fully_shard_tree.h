#pragma once
// fully_shard_tree: fully_shard applied by an auto-wrap policy (FSDP1's auto_wrap_policy), built on
// fully_shard, never inside it.
//
//   auto units = fsdp::fully_shard_tree(model, fsdp::WrapPolicy::module_types<BlockImpl>(), opts);
//   // == for (auto& block : model->block_list()) fsdp::fully_shard(block, opts);
//   //    fsdp::fully_shard(model, opts);
//   torch::optim::AdamW optim(model->parameters(), 1e-3);
//   units.back().unshard();   // the root unit is the last one
//
// The selected modules are those fsdp::select_modules gives (composable/wrap_policy.h), bottom-up;
// every one of them and then the root becomes a unit with `options`. Ignored parameters and
// modules in `options` ([Note: ignored parameters] in docs/architecture.md) are never
// selected nor counted by size policies, and each unit receives those inside its own tree.

#include <type_traits>
#include <vector>

#include <torch/nn/pimpl.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/wrap_policy.h"
#include "fsdp_cpp/contract/forward_hooks.h"

namespace fsdp {

/// Applies fully_shard to every module under `root` that `policy` selects, bottom-up, then to
/// `root`, and returns the units in that order (the root last). Checked before any module
/// changes: no selected module nor the root may already be a unit, carry replicate, sit inside a
/// unit, or be unable to run forward hooks (torch::nn::Sequential, containers), and the ignored
/// parameters and modules must be in `root`'s tree, with no unit inside the ignored modules; the
/// error names fully_shard_tree, the policy
/// and the module's FQN. An error while sharding (e.g. a tied parameter that cannot move) names
/// the units already made, which stay units (fully_shard cannot be undone).
///
///   auto units = fsdp::fully_shard_tree(*model, fsdp::WrapPolicy::min_num_params(1 << 20));
std::vector<FSDPModule> fully_shard_tree(torch::nn::Module& root, const WrapPolicy& policy,
                                         const FullyShardOptions& options = {});

/// fully_shard_tree on the module of a hook-able holder (holders that cannot run forward hooks
/// are refused at compile time, as by fully_shard).
///
///   auto units = fsdp::fully_shard_tree(model, fsdp::WrapPolicy::module_types<BlockImpl>());
template <typename Holder>
  requires std::is_base_of_v<torch::detail::ModuleHolderIndicator, Holder>
std::vector<FSDPModule> fully_shard_tree(const Holder& root, const WrapPolicy& policy,
                                         const FullyShardOptions& options = {}) {
  static_assert(contract::HookableHolder<Holder>,
                "fully_shard_tree: expected a hook-able module holder, got one that cannot run forward "
                "hooks (LibTorch's holders, e.g. TORCH_MODULE's, call forward directly), so the root "
                "unit would never unshard its parameters. Declare the module class with "
                "FSDP_HOOKABLE_MODULE(Name) instead of TORCH_MODULE(Name) (contract/hookable_modules.h).");
  return fully_shard_tree(*root.ptr(), policy, options);
}

}  // namespace fsdp

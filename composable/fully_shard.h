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
//
// What ignored parameters and meta-device models mean for every API: [Note: ignored parameters] and
// [Note: meta-device models] in docs/architecture.md.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/pimpl.h>

#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/fsdp/options.h"
#include "fsdp_cpp/init/meta_init.h"

namespace fsdp {

class FSDPState;
namespace detail {
struct FSDPModuleAccess;  // composable/fully_shard_internal.h: the project's own access to the engine
}  // namespace detail

// FullyShardOptions, ShardingStrategy, BackwardPrefetch and MixedPrecision: fsdp/options.h.

/// What fully_shard returns: the unit, with on-demand unshard/reshard.
class FSDPModule {
 public:
  /// Made by fully_shard and fsdp_module_of.
  explicit FSDPModule(std::shared_ptr<FSDPState> state);

  /// All-gathers this unit's parameters: they become full-shape views until reshard().
  void unshard();
  /// Frees the unsharded parameters: they become views of this rank's shard again.
  void reshard();

  /// Gradient accumulation (FSDP2's set_requires_gradient_sync): with `sync` false, backward keeps
  /// accumulating unsharded gradients and issues no reduce-scatter; the next backward with sync
  /// reduces the sum, so micro-batches give the gradients of one large batch. `recurse`: also the
  /// units inside this one.
  ///
  ///   model_unit.set_requires_gradient_sync(false);
  ///   for (auto& mb : micro_batches_but_last) model(mb).sum().backward();
  ///   model_unit.set_requires_gradient_sync(true);
  ///   model(last).sum().backward();   // reduce-scatters the accumulated gradients
  void set_requires_gradient_sync(bool sync, bool recurse = true);
  /// FSDP2's set_gradient_divide_factor: a unit's reduced gradient is by default the sum over the
  /// data-parallel ranks divided by their number (the shard group's size, times the replicate
  /// group's under hybrid sharding). With `factor` it is that sum divided by `factor` instead
  /// (1.0: the sum itself, for recipes that scale the loss by the token count themselves). Under
  /// hybrid sharding `factor` replaces the whole division over shard x replicate ranks. With a
  /// 16-bit reduce dtype the division is split as the default one is (a power-of-two part before
  /// the reduce-scatter, the rest after it, in the parameters' dtype), so the 16-bit sum overflows
  /// no more than it must. On one rank the gradients are divided by `factor` too. Refused (a
  /// c10::Error naming the unit, before any unit changes): a factor <= 0, infinite or NaN.
  /// `recurse`: also the units inside this one.
  void set_gradient_divide_factor(double factor, bool recurse = true);
  /// FSDP2's set_requires_all_reduce (hybrid sharding micro-batches): with `all_reduce` false, each
  /// backward still reduce-scatters inside the shard group, but skips the all-reduce across the
  /// replicate group: the reduce-scattered gradient is summed into a shard-sized partial buffer
  /// (the parameters' dtype, on the compute device), and `.grad` is left as it was. The next
  /// backward with `all_reduce` true adds the partial buffer to its own reduce-scatter output,
  /// all-reduces the sum across the replicate group once, divides, and adds it to `.grad`. Under
  /// set_requires_gradient_sync(false) nothing is reduce-scattered at all (the unsharded
  /// accumulator, see there), so this flag does not apply to those passes. Without hybrid
  /// sharding (no replicate group, or one of size 1) it changes nothing.
  ///
  ///   root.set_requires_all_reduce(false);
  ///   for (auto& mb : micro_batches_but_last) model(mb).sum().backward();   // reduce-scatters only
  ///   root.set_requires_all_reduce(true);
  ///   model(last).sum().backward();   // one all-reduce across replicas per unit
  void set_requires_all_reduce(bool all_reduce, bool recurse = true);
  /// The unit's settings of the two above (nullopt: no custom factor).
  std::optional<double> gradient_divide_factor() const;
  bool requires_all_reduce() const;
  /// FSDP2's set_unshard_in_backward, for this unit only: false when its backward needs none of
  /// its parameters' values, e.g. an embedding whose input (token ids) needs no gradient (its
  /// weight's gradient is a scatter of the output's gradient). Its backward then all-gathers
  /// nothing and holds no unsharded parameters; its gradients are reduced as usual. A backward
  /// that does read the values (a Linear's input gradient) fails on every rank with LibTorch's
  /// "data is not allocated yet" error, and training can go on after setting it back to true.
  /// Units kept unsharded from forward (SHARD_GRAD_OP, NO_SHARD, the root) are not affected.
  /// Every rank must set it alike: the ranks compare it when each backward pass begins.
  ///
  ///   fsdp::fully_shard(*model->tok_emb).set_unshard_in_backward(false);
  void set_unshard_in_backward(bool unshard);
  bool unshard_in_backward() const;
  /// Explicit prefetching (FSDP2's set_modules_to_forward_prefetch / _backward_prefetch): this
  /// unit's pre-forward (pre-backward) issues the all-gathers of `units`, instead of the implicit
  /// next unit. An empty list turns prefetching off for this unit.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& units);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& units);

  /// nn.Module::zero_grad for a sharded model: this unit and every unit inside it drop the
  /// gradients of backward passes not yet reduced (the accumulator of
  /// set_requires_gradient_sync(false) and HSDP's replicate partial of
  /// set_requires_all_reduce(false), which optimizer.zero_grad() does not see), and every
  /// parameter of the unit's modules gets its `.grad` set to none (`set_to_none`) or zeroed. Call
  /// it on the root to abandon a step after some microbatches (a bad batch, a NaN check, a failed
  /// pipeline stage): the next step then equals a run without the abandoned microbatches.
  ///
  ///   root.set_requires_gradient_sync(false);
  ///   model(x0).sum().backward();          // accumulated, not reduced
  ///   if (bad_batch) root.zero_grad();     // abandoned: nothing of x0 reaches the next step
  ///
  /// Local: no collective, so a failure path may call it. Every rank must still call it alike:
  /// each unit counts the calls that dropped pending gradients, and the ranks compare the count
  /// when the next backward pass begins, so ranks that disagree (one discarded, its peers did
  /// not) are refused on every rank with an error naming the unit, instead of silently reducing
  /// different sums. Refused (c10::Error naming FSDPModule::zero_grad and the unit) inside a
  /// forward or a backward pass of the model and inside a SummonFullParams scope. A forward or
  /// backward that threw, and an iteration left open by set_is_last_backward(false), are
  /// abandoned first (on several ranks, graphs of that iteration are refused afterwards; on one
  /// rank every backward pass ends its iteration and a graph stays usable). [Note: discarding
  /// accumulated gradients] in fsdp/zero_grad.h.
  void zero_grad(bool set_to_none = true);

  /// FSDP2's set_is_last_backward, on the root: whether the next backward pass ends the
  /// iteration (default true). Pipeline schedules interleave microbatches (1F1B: forward 2 runs
  /// after backward 0, before backward 1); with false, a backward pass ends without ending the
  /// iteration, so the next forward continues it and backward passes through earlier forwards'
  /// graphs stay valid. Set it back to true before the step's last backward (pipeline/schedule.h
  /// does both). Every rank of the unit's group must set it alike (compared at each backward
  /// pass). [Note: backward passes within an iteration] in fsdp/backward.cc.
  ///
  /// Refused (c10::Error naming the unit): false on a unit that is not a root (only the root's
  /// is read). An optimizer step while an iteration is left open (the shards written after a
  /// backward pass that did not end it) is refused at the next forward or backward pass of the
  /// root, and fsdp::clip_grad_norm_ refuses to run in an open iteration: [Note: open iterations]
  /// in fsdp/open_iteration.h says what is and is not detected.
  ///
  ///   root.set_is_last_backward(false);
  ///   auto y0 = model(x0), y1 = model(x1);
  ///   y0.sum().backward();
  ///   auto y2 = model(x2);                  // continues the iteration
  ///   y1.sum().backward();
  ///   root.set_is_last_backward(true);
  ///   y2.sum().backward();                  // ends it
  void set_is_last_backward(bool last);
  bool is_last_backward() const;

  /// Whether backward reshards the units (false keeps them unsharded for the next forward while
  /// gradients accumulate without sync; a backward with sync always reshards).
  void set_reshard_after_backward(bool reshard, bool recurse = true);

  /// The unit's (first) module, and all of them (a unit of several sibling modules).
  torch::nn::Module& module() const;
  const std::vector<torch::nn::Module*>& modules() const;
  /// The unit's name in errors: its module's FQN (relative to the root once the root's first
  /// forward ran, "<root>" for the root).
  const std::string& fqn() const;
  /// The options the unit was made with, as given to fully_shard.
  const FullyShardOptions& options() const;
  /// Whether `param` (by tensor identity) is in one of the unit's FlatParameters.
  bool manages(const at::Tensor& param) const;
  /// Whether `param` is one of the unit's ignored parameters ([Note: ignored parameters]).
  bool ignores(const at::Tensor& param) const;
  /// Bytes this rank holds now for the unit: its shards of the FlatParameters, and the sharded
  /// gradients (the parameters' `.grad`, 0 after zero_grad with set_to_none).
  int64_t sharded_param_bytes() const;
  int64_t sharded_grad_bytes() const;

 private:
  friend struct detail::FSDPModuleAccess;
  static std::vector<FSDPState*> states_of(const std::vector<FSDPModule>& units);
  void for_each_unit(bool recurse, const std::function<void(FSDPState&)>& fn) const;
  std::shared_ptr<FSDPState> state_;
};

/// Makes `module` a fully sharded unit (see the top of this file). Errors (applied twice, applied
/// top-down, applied to a module that has replicate, parameters on another device than the
/// communicator's, ignored parameters or modules not in the module's tree, mixed-precision dtypes
/// that are not floating-point, parameters of one FlatParameter on several devices) name the
/// module's FQN and leave the model as it was: every check runs before anything changes, and a
/// call that communicates (sync_module_states, a mesh, units below it) first exchanges the
/// checks' outcome, so every rank refuses it with the same error ([Note: all-or-nothing] in
/// fully_shard.cc). Options that contradict each other (a strategy(...) and a
/// reshard_after_forward(...) that disagree, a mesh with a communicator or with NO_SHARD) are
/// refused on every rank before anything else.
FSDPModule fully_shard(torch::nn::Module& module, const FullyShardOptions& options = {});

/// One unit over several sibling modules: unsharded
/// before the first of them runs, resharded after the last of them ran.
///
///   fsdp::fully_shard({model->attn.ptr().get(), model->mlp.ptr().get()}, opts);
FSDPModule fully_shard(const std::vector<torch::nn::Module*>& modules,
                       const FullyShardOptions& options = {});

/// Makes the module of a hook-able holder a unit (see fully_shard(torch::nn::Module&)). Holders
/// that cannot run forward hooks (LibTorch's: TORCH_MODULE, torch::nn::Linear,
/// torch::nn::Sequential, ...) are refused at compile time: their call operator calls forward
/// directly, so the unit's pre-forward would never run.
///
///   fsdp::fully_shard(model->block(0), opts);   // a holder declared with FSDP_HOOKABLE_MODULE
template <typename Holder>
  requires std::is_base_of_v<torch::detail::ModuleHolderIndicator, Holder>
FSDPModule fully_shard(const Holder& module, const FullyShardOptions& options = {}) {
  static_assert(contract::HookableHolder<Holder>,
                "fully_shard: expected a hook-able module holder, got one that cannot run forward "
                "hooks (LibTorch's holders, e.g. TORCH_MODULE's, torch::nn::Linear or "
                "torch::nn::Sequential, call forward directly), so the unit would never unshard "
                "its parameters. Declare the module class with FSDP_HOOKABLE_MODULE(Name) instead "
                "of TORCH_MODULE(Name), use fsdp::contract::Linear, Embedding, LayerNorm, ... for "
                "LibTorch's modules and fsdp::contract::Sequential instead of "
                "torch::nn::Sequential (contract/hookable_modules.h). A container without forward "
                "(ModuleList, ModuleDict) cannot be a unit: shard the modules it holds.");
  return fully_shard(*module.ptr(), options);
}

/// The unit fully_shard made of `module`, if any.
std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module& module);

}  // namespace fsdp

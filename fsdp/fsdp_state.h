#pragma once
// FSDPState: the state of one `fully_shard` call (one unit). It owns the unit's FlatParamHandles
// (one per dtype and requires_grad, so frozen parameters never hold gradient memory), its
// training state, this iteration's calls, and, once lazily initialised, a pointer to the root's
// shared context. The runtime (fsdp/runtime.h, fsdp/backward.h) drives it from the forward hooks
// and from autograd.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/flat_param_handle.h"
#include "fsdp_cpp/fsdp/hidden_params.h"
#include "fsdp_cpp/fsdp/options.h"
#include "fsdp_cpp/fsdp/unit_iteration.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

class RootContext;

/// The name fully_shard's state is registered under in the contract's registry.
inline constexpr const char* kFullyShardApi = "fully_shard";

/// What a unit is doing. Each value is the phase after the transition that set it.
enum class TrainingState {
  kIdle,          // outside forward/backward; every handle sharded
  kForward,       // between pre-forward and post-forward (or from forward to backward)
  kPreBackward,   // its pre-backward ran: unsharded for gradient computation
  kPostBackward,  // its gradients are being or have been reduced this backward
};

const char* to_string(TrainingState state);

/// A unit's options: the user's FullyShardOptions, whole, and what fully_shard resolved from them.
/// Read the options' derived values through the functions of fsdp/options.h (the accessors below
/// call them), never by re-deriving them.
struct FSDPConfig {
  /// As given to fully_shard (communicator() and device() may be unset: use `comm` and `device`).
  FullyShardOptions options;
  /// The communicator the unit shards across: options.communicator(), the mesh's shard group, or
  /// the default process group.
  std::shared_ptr<comm::Communicator> comm;
  /// Hybrid sharding: the mesh's replicate group (gradients all-reduced across it); null otherwise.
  std::shared_ptr<comm::Communicator> replicate;
  /// reshard_after_forward(int) smaller than the shard group: the group of that many consecutive
  /// ranks of `comm` the backward all-gather runs in ([Note: post-forward group] in
  /// fsdp/flat_param_handle.h); null otherwise.
  std::shared_ptr<comm::Communicator> post_forward_group;
  /// separate_reduce_communicator(true): the duplicate of `comm` the gradient reductions run on;
  /// null otherwise ([Note: reduce communicator] in fsdp/derived_groups.h).
  std::shared_ptr<comm::Communicator> reduce_group;
  /// Where the shards live: options.device(), else the communicator's device.
  at::Device device = at::kCPU;
  /// The full values of a meta parameter (FlatParamHandleOptions::meta_values): options'
  /// param_init_fn, else its recorded initialization.
  std::function<at::Tensor(const std::string& fqn, const at::Tensor& param)> meta_values;

  bool reshard_after_forward() const { return reshards_after_forward(options.strategy()); }
  bool shard() const { return shards(options.strategy()); }
  std::optional<c10::ScalarType> cast_forward_inputs_to() const {
    return forward_input_dtype(options.mixed_precision());
  }
  /// What each of the unit's FlatParamHandles is given (the one translation to the handle).
  FlatParamHandleOptions handle_options() const;
};

class FSDPState final : public contract::ApiState {
 public:
  /// `modules`: the module of the unit, or several sibling modules forming one unit (unsharded
  /// before the first of them runs, resharded after the last). `fqn` names the unit in errors.
  FSDPState(std::vector<torch::nn::Module*> modules, std::string fqn, FSDPConfig config,
            std::vector<std::unique_ptr<FlatParamHandle>> handles);

  /// Groups `params` into FlatParameters: one per (dtype, requires_grad), in order of first
  /// appearance, so frozen parameters never hold gradient memory or join a reduce-scatter.
  static std::vector<std::unique_ptr<FlatParamHandle>> make_handles(
      const std::vector<FlatParamHandle::OrigParam>& params, const FSDPConfig& config,
      const std::string& fqn);

  /// Rebuilds the handles over `params` (which must hold full values: call unshard() first).
  /// fully_shard uses it when a tied parameter moves out of this unit into the one that owns it.
  void rebuild_handles(const std::vector<FlatParamHandle::OrigParam>& params);
  /// The original parameters of every handle, in handle order.
  std::vector<FlatParamHandle::OrigParam> params() const;

  /// The unit's (first) module.
  torch::nn::Module& module() const { return *modules_.front(); }
  const std::vector<torch::nn::Module*>& modules() const { return modules_; }
  const std::string& fqn() const { return fqn_; }
  /// Renames the unit (lazy initialisation names it relative to its root) and its handles.
  void set_fqn(std::string fqn);
  const FSDPConfig& config() const { return config_; }
  const std::vector<std::unique_ptr<FlatParamHandle>>& handles() const { return handles_; }
  /// The original parameters this unit's handles manage (by tensor identity); what the contract's
  /// queries see ([Note: managed parameters] in contract/module_state.h).
  bool manages(const at::Tensor& param) const override;

  /// Ignored parameters and buffers ([Note: ignored parameters]): parameters of the unit's trees
  /// that no FlatParameter holds (fully_shard's ignored_params, the parameters of its
  /// ignored_modules, and those the units inside it ignore), and the buffers of its ignored
  /// modules, which fully_shard neither moves nor casts nor broadcasts.
  void set_ignored(std::vector<at::Tensor> params, std::vector<at::Tensor> buffers);
  const std::vector<at::Tensor>& ignored_params() const { return ignored_params_; }
  const std::vector<at::Tensor>& ignored_buffers() const { return ignored_buffers_; }
  bool ignores(const at::Tensor& param) const;

  /// Vetoes torch::save / torch::load of a module with a parameter this unit manages ([Note:
  /// serialization veto] in contract/module_state.h): its parameters hold this rank's shards.
  std::string serialization_veto(const torch::nn::Module& module) const override;

  TrainingState training_state() const { return training_state_; }
  void set_training_state(TrainingState state) { training_state_ = state; }

  /// Set by lazy initialisation (every state in the root's tree shares the root's context).
  RootContext* root_context() const { return root_context_.get(); }
  void set_root_context(std::shared_ptr<RootContext> context) { root_context_ = std::move(context); }
  bool is_root() const;

  /// Unshards / reshards every handle of this unit (the user-facing FSDPModule calls these too).
  void unshard();
  void reshard(bool after_forward = false);  // after_forward: [Note: post-forward group]
  /// Issues the all-gathers of every handle without waiting (prefetch).
  void start_unshard();
  /// set_unshard_in_backward(false)'s pre-backward: the parameters become full-shape views of the
  /// unsharded buffers, without gathering them (the buffers hold no memory).
  void use_unsharded_views_without_data();
  bool unshard_in_flight() const;
  /// Whether every sharded handle is unsharded (true for a unit with nothing to gather).
  bool is_unsharded() const;

  /// Explicit prefetch targets (FSDP2's set_modules_to_forward_prefetch /
  /// set_modules_to_backward_prefetch): when set, they replace the implicit next unit. Null: not
  /// set.
  const std::vector<FSDPState*>* forward_prefetch_targets() const {
    return forward_prefetch_targets_ ? &*forward_prefetch_targets_ : nullptr;
  }
  const std::vector<FSDPState*>* backward_prefetch_targets() const {
    return backward_prefetch_targets_ ? &*backward_prefetch_targets_ : nullptr;
  }
  void set_forward_prefetch_targets(std::vector<FSDPState*> units) { forward_prefetch_targets_ = std::move(units); }
  void set_backward_prefetch_targets(std::vector<FSDPState*> units) { backward_prefetch_targets_ = std::move(units); }

  /// Gradient accumulation: without sync, gradients accumulate unsharded and no reduce-scatter is
  /// issued; the next backward with sync reduces the sum.
  bool requires_gradient_sync() const { return requires_gradient_sync_; }
  void set_requires_gradient_sync(bool sync) {
    requires_gradient_sync_ = sync;
    refresh_controls_hash();
  }
  /// FSDP2's set_gradient_divide_factor: the unit's reduced gradients are the sum over the
  /// data-parallel ranks divided by `factor` (finite, > 0) instead of by their number; nullopt:
  /// that number. Passed to every handle ([Note: gradient divide factor and replicate partial] in
  /// fsdp/flat_param_grad.h).
  const std::optional<double>& gradient_divide_factor() const { return gradient_divide_factor_; }
  void set_gradient_divide_factor(std::optional<double> factor);
  /// FSDP2's set_requires_all_reduce: false skips HSDP's all-reduce across the replicate group,
  /// keeping the reduce-scattered gradients in each handle's replicate partial until a backward
  /// with it (same Note). No effect without a replicate group.
  bool requires_all_reduce() const { return requires_all_reduce_; }
  void set_requires_all_reduce(bool all_reduce);
  /// [Note: passthrough backward] (one rank, autograd writes `.grad`): divides what this pass wrote
  /// into the parameters' `.grad` by the custom divide factor, if one is set. Called before the
  /// set-aside gradients are added back.
  void divide_passthrough_gradients() const;

  /// FSDP2's set_unshard_in_backward: false when backward needs none of the unit's parameter
  /// values (an embedding whose input needs no gradient): its pre-backward all-gathers nothing and
  /// makes the parameters full-shape views of the freed unsharded buffer, so autograd still
  /// accumulates their gradients in place ([Note: unshard in backward] in fsdp/backward.cc).
  bool unshard_in_backward() const { return unshard_in_backward_; }
  void set_unshard_in_backward(bool unshard) {
    unshard_in_backward_ = unshard;
    refresh_controls_hash();
  }
  /// How many times FSDPModule::zero_grad dropped gradients this unit held between backward passes
  /// (its no-sync accumulator or replicate partial): ranks that disagree would reduce different
  /// sums, so it is one of the controls the ranks compare ([Note: discarding accumulated
  /// gradients] in fsdp/zero_grad.h).
  int64_t gradient_discards() const { return gradient_discards_; }
  void count_gradient_discard() {
    ++gradient_discards_;
    refresh_controls_hash();
  }
  /// The controls above (gradient sync, divide factor, replicate all-reduce, unshard and reshard
  /// in backward, the discards) as one line, for the ranks to compare ([Note: backward reach]).
  std::string controls_string() const;
  /// A 62-bit FNV-1a hash of controls_string() (its negation stays representable in a MAX
  /// all-reduce), kept up to date by the setters: every backward pass compares it across the
  /// ranks, and formatting the line for every unit in every pass would be a per-step cost.
  int64_t controls_hash() const { return controls_hash_; }

  /// FSDP2's set_is_last_backward, read on the root: whether the next backward pass ends the
  /// iteration ([Note: backward passes within an iteration] in fsdp/backward.cc).
  bool is_last_backward() const { return is_last_backward_; }
  void set_is_last_backward(bool last) {
    is_last_backward_ = last;
    refresh_controls_hash();
  }

  /// Whether backward reshards the unit (false keeps it unsharded for the next forward while
  /// accumulating without sync).
  bool reshard_after_backward() const { return reshard_after_backward_; }
  void set_reshard_after_backward(bool reshard) {
    reshard_after_backward_ = reshard;
    refresh_controls_hash();
  }
  /// Whether the unit's parameters stay unsharded after its backward: only while accumulating
  /// without sync with set_reshard_after_backward(false); a backward with sync always reshards.
  /// Never with set_unshard_in_backward(false): its backward's parameters hold no data.
  bool keeps_unsharded_after_backward() const {
    return !reshard_after_backward_ && !requires_gradient_sync_ && unshard_in_backward_;
  }

  /// Set while a SummonFullParams scope (composable/summon_full_params.h) holds this unit's full
  /// parameters, so that a nested scope on the same unit is refused.
  bool full_params_summoned() const { return full_params_summoned_; }
  void set_full_params_summoned(bool summoned) { full_params_summoned_ = summoned; }

  /// This iteration's calls and backward progress (see [Note: forward calls]).
  UnitIteration& iteration() { return iteration_; }
  const UnitIteration& iteration() const { return iteration_; }

  /// The parameters hidden behind an empty placeholder ([Note: hidden parameters] in
  /// fsdp/sharded_use_guard.h).
  HiddenParams& hidden_params() { return hidden_params_; }
  const HiddenParams& hidden_params() const { return hidden_params_; }

 private:
  // Recomputes controls_hash_ from controls_string() (after any control changed).
  void refresh_controls_hash();

  std::vector<torch::nn::Module*> modules_;
  std::string fqn_;
  FSDPConfig config_;
  std::vector<std::unique_ptr<FlatParamHandle>> handles_;
  std::unordered_set<const void*> managed_;  // TensorImpl* of managed parameters
  std::vector<at::Tensor> ignored_params_;   // whole, local, in named_parameters order
  std::vector<at::Tensor> ignored_buffers_;
  std::unordered_set<const void*> ignored_;  // TensorImpl* of ignored_params_
  TrainingState training_state_ = TrainingState::kIdle;
  std::shared_ptr<RootContext> root_context_;
  std::optional<std::vector<FSDPState*>> forward_prefetch_targets_;
  std::optional<std::vector<FSDPState*>> backward_prefetch_targets_;
  bool requires_gradient_sync_ = true;
  std::optional<double> gradient_divide_factor_;
  bool requires_all_reduce_ = true;
  bool reshard_after_backward_ = true;
  bool is_last_backward_ = true;
  bool unshard_in_backward_ = true;
  int64_t gradient_discards_ = 0;
  int64_t controls_hash_ = 0;  // controls_hash(): set by the constructor and each control's setter
  bool full_params_summoned_ = false;
  UnitIteration iteration_;
  HiddenParams hidden_params_;
};

}  // namespace fsdp

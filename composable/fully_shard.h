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
// [Note: ignored parameters] FullyShardOptions::ignored_params and ignored_modules (FSDP's
// ignored_states) name parameters that a unit does not shard: they keep their shape, storage,
// device and dtype on every rank, enter no FlatParameter, and are never all-gathered, reduced,
// broadcast by sync_module_states, moved by `device` or cast by mixed precision (nor are the
// buffers of ignored modules). Autograd writes their full local gradient into `.grad` on each
// rank: averaging it across ranks (e.g. an all-reduce before the optimizer step) is up to the
// user. A parameter stays ignored for every unit above the one that ignores it. Elsewhere:
//   - state dicts (fsdp::full_state_dict, sharded_state_dict, the optimizer's) list ignored
//     parameters under their FQNs with this rank's local value (full dicts: rank 0's; sharded
//     dicts: whole, written by world rank 0 only), and loads copy the value into every rank;
//   - fsdp::clip_grad_norm_ adds their gradients' norm locally (not reduced across ranks, as
//     FSDP1 does for non-sharded parameters) and scales them with the others;
//   - summon_full_params leaves them as they are (already full).
// Refused, before anything changes: an ignored parameter that is not in the module's tree, one a
// unit already manages (ignore it in that unit's fully_shard), an ignored module that is the
// unit's module itself, is not inside it, or contains a unit. fully_shard on a module inside an
// ignored module is refused in both orders (before: the unit is inside the ignored module;
// after: fully_shard is applied bottom-up only).
//
// [Note: meta-device models] A model built under fsdp::MetaInitGuard (init/meta_init.h) has meta
// parameters and buffers: no memory. fully_shard allocates only this rank's shard of each
// FlatParameter (on `device`, default the communicator's device) and fills it with this rank's
// slice of each parameter, materialized one parameter at a time on the CPU (replaying its recorded
// construction, or FullyShardOptions::param_init_fn); a parameter this rank holds none of is never
// materialized. Buffers and ignored parameters are materialized whole. The values are those
// fsdp::materialize_module gives the unsharded model built the same way under the same seed, on any
// number of ranks ([Note: meta init]). sync_module_states broadcasts only tensors that were not on
// meta. Every meta tensor of the root's tree must belong to some unit (or be materialized with
// fsdp::materialize_module) before the first forward, which otherwise names it.
//
//   std::shared_ptr<GPT> model;
//   { fsdp::MetaInitGuard meta; model = std::make_shared<GPT>(config); }  // no memory
//   fsdp::fully_shard_tree(*model, fsdp::WrapPolicy::module_types<BlockImpl>());
//   fsdp::load_pretrained(*model, "model.safetensors");  // optional: weights straight into shards

#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/pimpl.h>

#include "comm/communicator.h"
#include "comm/device_mesh.h"
#include "contract/forward_hooks.h"
#include "fsdp/fsdp_state.h"
#include "init/meta_init.h"

namespace fsdp {

/// How a unit keeps its parameters (FSDP1's sharding strategies).
enum class ShardingStrategy {
  /// Sharded; unsharded for forward, freed, all-gathered again for backward (ZeRO-3).
  kFullShard,
  /// Sharded; unsharded from forward to the end of backward: no backward all-gather.
  kShardGradOp,
  /// Replicated on every rank; gradients all-reduced (DDP semantics), no all-gathers.
  kNoShard,
};

/// Mixed precision (FSDP's MixedPrecision): parameters all-gathered and computed in `param_dtype`,
/// gradients reduced in `reduce_dtype`; the sharded parameters, the gradients after sync and the
/// optimizer state stay in full precision.
///
///   fsdp::FullyShardOptions().mixed_precision(
///       fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
struct MixedPrecision {
  /// The dtype of the unsharded parameters (all-gathers carry it). Unset: no mixed precision.
  TORCH_ARG(std::optional<c10::ScalarType>, param_dtype) = std::nullopt;
  /// The dtype gradients are reduce-scattered (all-reduced) in. Unset: param_dtype if set.
  /// While accumulating without sync, gradients are kept in this dtype.
  TORCH_ARG(std::optional<c10::ScalarType>, reduce_dtype) = std::nullopt;
  /// The dtype the module's floating-point buffers are cast to. Unset: unchanged.
  TORCH_ARG(std::optional<c10::ScalarType>, buffer_dtype) = std::nullopt;
  /// Cast floating-point forward inputs to param_dtype in pre-forward.
  TORCH_ARG(bool, cast_forward_inputs) = true;
};

/// Options of fully_shard, in the LibTorch style:
///
///   fsdp::fully_shard(*block, fsdp::FullyShardOptions().reshard_after_forward(false));
struct FullyShardOptions {
  /// The ranks to shard across. Default: fsdp::comm::default_process_group() (call
  /// fsdp::comm::init_process_group() first).
  TORCH_ARG(std::shared_ptr<comm::Communicator>, communicator) = nullptr;
  /// FULL_SHARD by default. The root unit always keeps its parameters from forward to backward.
  TORCH_ARG(ShardingStrategy, strategy) = ShardingStrategy::kFullShard;
  /// Broadcast rank 0's parameters and buffers before sharding, so that ranks which initialised
  /// differently start equal.
  TORCH_ARG(bool, sync_module_states) = false;
  /// Hybrid sharding (HSDP): shard inside the mesh's shard groups, all-reduce gradients across its
  /// replicate groups (fsdp::comm::DeviceMesh::hybrid). Excludes `communicator`.
  TORCH_ARG(std::shared_ptr<comm::DeviceMesh>, mesh) = nullptr;
  /// Forward prefetch: a unit's pre-forward also issues the all-gather of the unit that ran after
  /// it in the previous iteration (overlapping it with this unit's forward).
  TORCH_ARG(bool, forward_prefetch) = false;
  /// When backward all-gathers the next unit: before (default) or after the current unit's
  /// gradient computation, or not at all.
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
  /// The most units unsharded at once (set on the root; default 2), counting the unit running and
  /// the ones prefetched for it, but not the root, the units running around it, nor units kept
  /// unsharded by SHARD_GRAD_OP: a prefetch that would exceed it is skipped, bounding the
  /// unsharded memory (1 turns prefetching off).
  TORCH_ARG(int, max_unshards_in_flight) = 2;
  /// CPU offload (FSDP's CPUOffload(offload_params=True)): shards and sharded gradients live in
  /// host memory, pinned when computing on CUDA; the optimizer steps on the host.
  TORCH_ARG(bool, offload_to_cpu) = false;
  /// Mixed precision (see MixedPrecision).
  TORCH_ARG(MixedPrecision, mixed_precision) = {};
  /// The device the shards (and the module's buffers) live on, e.g. cuda:LOCAL_RANK for a model
  /// built on the CPU: only the shards move. Default: where the parameters are.
  TORCH_ARG(std::optional<at::Device>, device) = std::nullopt;
  /// Parameters of the module's tree this unit leaves alone ([Note: ignored parameters]): they
  /// stay whole and local on every rank, in no FlatParameter, never all-gathered nor reduced.
  ///
  ///   fsdp::fully_shard(*model, fsdp::FullyShardOptions().ignored_params({model->scale}));
  TORCH_ARG(std::vector<at::Tensor>, ignored_params) = {};
  /// Modules inside the module whose parameters (those of their whole trees) and buffers this
  /// unit leaves alone, as ignored_params; no unit may be inside them.
  ///
  ///   fsdp::fully_shard(*model, fsdp::FullyShardOptions().ignored_modules({model->head.ptr()}));
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, ignored_modules) = {};
  /// Initializes the unit's meta parameters and buffers ([Note: meta-device models]) instead of
  /// replaying what MetaInitGuard recorded (FSDP1's param_init_fn, one tensor at a time): called
  /// with each meta tensor's FQN relative to the module (a unit of several modules prefixes it
  /// with the module's index and ':') and an uninitialized CPU tensor of its shape and dtype to
  /// fill. Called only for parameters this rank holds part of, and for every buffer. Must give
  /// every rank the same values.
  ///
  ///   fsdp::fully_shard(*block, fsdp::FullyShardOptions().param_init_fn(
  ///       [](const std::string& fqn, at::Tensor& v) { v.normal_(0, 0.02); }));
  TORCH_ARG(TensorInitFn, param_init_fn) = nullptr;

 public:
  /// Shorthand for the strategy: true = kFullShard, false = kShardGradOp (FSDP2's option).
  FullyShardOptions& reshard_after_forward(bool value) {
    strategy_ = value ? ShardingStrategy::kFullShard : ShardingStrategy::kShardGradOp;
    return *this;
  }
  bool reshard_after_forward() const { return strategy_ == ShardingStrategy::kFullShard; }
};

/// What fully_shard returns: the unit, with on-demand unshard/reshard.
class FSDPModule {
 public:
  explicit FSDPModule(std::shared_ptr<FSDPState> state) : state_(std::move(state)) {}

  /// All-gathers this unit's parameters: they become full-shape views until reshard().
  void unshard() { state_->unshard(); }
  /// Frees the unsharded parameters: they become views of this rank's shard again.
  void reshard() { state_->reshard(); }

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
  /// Explicit prefetching (FSDP2's set_modules_to_forward_prefetch / _backward_prefetch): this
  /// unit's pre-forward (pre-backward) issues the all-gathers of `units`, instead of the implicit
  /// next unit. An empty list turns prefetching off for this unit.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& units);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& units);

  /// Whether backward reshards the units (false keeps them unsharded for the next forward while
  /// gradients accumulate without sync; a backward with sync always reshards).
  void set_reshard_after_backward(bool reshard, bool recurse = true);

  torch::nn::Module& module() const { return state_->module(); }
  FSDPState& state() const { return *state_; }
  const std::vector<std::unique_ptr<FlatParamHandle>>& handles() const { return state_->handles(); }

 private:
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
/// fully_shard.cc).
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

#pragma once
// The options of fully_shard, as the user writes them. One value, FullyShardOptions, goes whole
// from the API (composable/fully_shard.h) into the engine (FSDPConfig in fsdp/fsdp_state.h keeps
// it next to what fully_shard resolved from it). What the engine derives from it is computed by
// the functions at the end of this file, and only there.
//
// This header is below the engine: it includes comm/, init/ and LibTorch only, so a user's code
// naming an option includes no engine header.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/fsdp/comm_codec.h"
#include "fsdp_cpp/init/meta_init.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

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

/// "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD" (FSDP1's names, as errors and the plan print them).
const char* to_string(ShardingStrategy strategy);

/// When backward all-gathers the next unit (FSDP1's BackwardPrefetch).
enum class BackwardPrefetch {
  kNone,
  /// In the current unit's pre-backward, before its gradients are computed (more overlap, two
  /// units unsharded at once).
  kBackwardPre,
  /// In the current unit's post-backward, after its gradients are computed.
  kBackwardPost,
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
  /// The most units unsharded at once, counting the unit running and the ones prefetched for it,
  /// but not the root, the units running around it, nor units kept unsharded by SHARD_GRAD_OP: a
  /// prefetch that would exceed it is skipped, bounding the unsharded memory (1 turns prefetching
  /// off; at least 1). The root's value applies to its whole tree; other units' are not read.
  TORCH_ARG(int, max_unshards_in_flight) = 2;
  /// CPU offload (FSDP's CPUOffload(offload_params=True)): shards and sharded gradients live in
  /// host memory, pinned when computing on CUDA; the optimizer steps on the host.
  TORCH_ARG(bool, offload_to_cpu) = false;
  /// Run the unit's gradient reductions on a duplicate of its communicator, made once per
  /// communicator and shared by the units that ask for it, so they need not wait behind
  /// all-gathers on one communicator ([Note: reduce communicator] in fsdp/derived_groups.h). Every
  /// rank must give the same value (fully_shard compares it).
  TORCH_ARG(bool, separate_reduce_communicator) = false;
  /// Mixed precision (see MixedPrecision).
  TORCH_ARG(MixedPrecision, mixed_precision) = {};
  /// The device the shards (and the module's buffers) live on, e.g. cuda:LOCAL_RANK for a model
  /// built on the CPU: only the shards move. Default: the communicator's device.
  TORCH_ARG(std::optional<at::Device>, device) = std::nullopt;
  /// Parameters of the module's tree this unit leaves alone ([Note: ignored parameters] in
  /// docs/architecture.md): they stay whole and local on every rank, in no FlatParameter,
  /// never all-gathered nor reduced.
  ///
  ///   fsdp::fully_shard(*model, fsdp::FullyShardOptions().ignored_params({model->scale}));
  TORCH_ARG(std::vector<at::Tensor>, ignored_params) = {};
  /// Modules inside the module whose parameters (those of their whole trees) and buffers this
  /// unit leaves alone, as ignored_params; no unit may be inside them.
  ///
  ///   fsdp::fully_shard(*model, fsdp::FullyShardOptions().ignored_modules({model->head.ptr()}));
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, ignored_modules) = {};
  /// Initializes the unit's meta parameters and buffers ([Note: meta-device models] in
  /// docs/architecture.md) instead of replaying what MetaInitGuard recorded (FSDP1's
  /// param_init_fn, one tensor at a time): called with each meta tensor's FQN relative to the
  /// module (a unit of several modules prefixes it with the module's index and ':') and an
  /// uninitialized CPU tensor of its shape and dtype to fill. Called only for parameters this rank
  /// holds part of, and for every buffer. Must give every rank the same values.
  ///
  ///   fsdp::fully_shard(*block, fsdp::FullyShardOptions().param_init_fn(
  ///       [](const std::string& fqn, at::Tensor& v) { v.normal_(0, 0.02); }));
  TORCH_ARG(TensorInitFn, param_init_fn) = nullptr;
  /// Quantized communication (DeepSpeed ZeRO++'s qwZ; [Note: communication codecs] in
  /// fsdp/comm_codec.h): each rank encodes its shard with this codec before the all-gather and
  /// decodes what was gathered into the unsharded parameters (in the compute dtype). With
  /// reshard_after_forward(int), only the forward all-gather over the whole shard group is
  /// encoded. Null: the shards are all-gathered as they are. Sharding strategies only (NO_SHARD
  /// gathers nothing: refused); on one rank nothing is gathered and the codec is not used.
  ///
  ///   fsdp::fully_shard(*block, fsdp::FullyShardOptions()
  ///       .all_gather_codec(fsdp::int8_block_codec(256))     // int8, a float32 scale per 256
  ///       .reduce_codec(fsdp::int8_block_codec(256)));
  TORCH_ARG(std::shared_ptr<const CommCodec>, all_gather_codec) = nullptr;
  /// Quantized gradient reduction (ZeRO++'s qgZ; [Note: quantized gradient reduction] in
  /// fsdp/flat_param_grad.h): the reduce-scatter inside the shard group becomes an all-to-all of
  /// the gradient chunks encoded with this codec, each rank summing the W chunks it receives in
  /// float32. HSDP's replicate all-reduce is not encoded. Null: reduce-scattered as they are.
  /// Sharding strategies only (NO_SHARD's all-reduce: refused); not used on one rank.
  TORCH_ARG(std::shared_ptr<const CommCodec>, reduce_codec) = nullptr;

 public:
  /// The sharding strategy. Unset, it is FULL_SHARD, or what reshard_after_forward(...) chose.
  FullyShardOptions& strategy(ShardingStrategy value) {
    strategy_ = value;
    return *this;
  }
  /// Shorthand for the strategy (FSDP2's option): true = FULL_SHARD, false = SHARD_GRAD_OP. Given
  /// together with strategy(...), it must agree with it (NO_SHARD reshards nothing: false);
  /// fully_shard refuses a contradiction.
  FullyShardOptions& reshard_after_forward(bool value) {
    reshard_after_forward_ = value;
    post_forward_group_size_.reset();
    return *this;
  }
  /// Reshard after forward to a smaller group (FSDP2's reshard_after_forward=int, ZeRO++'s hpZ;
  /// [Note: post-forward group] in fsdp/flat_param_handle.h): FULL_SHARD, except that after
  /// forward each rank keeps its 1/`ranks` slice of the unsharded parameters, so the backward
  /// all-gather runs inside a group of `ranks` consecutive ranks of the shard group (e.g. the
  /// ranks of one node) instead of across all of it. `ranks` must divide the shard group's size;
  /// equal to it, this is reshard_after_forward(true). Costs padded parameter bytes / `ranks` per
  /// unit between its forward and its backward.
  ///
  ///   fsdp::fully_shard(*block, fsdp::FullyShardOptions().reshard_after_forward(8));  // 8 GPUs a node
  FullyShardOptions& reshard_after_forward(int ranks) {
    reshard_after_forward_ = true;
    post_forward_group_size_ = ranks;
    return *this;
  }
  /// The strategy the unit gets: strategy(...) if given, else the shorthand's, else FULL_SHARD.
  ShardingStrategy strategy() const;
  /// Whether that strategy reshards after forward (FULL_SHARD).
  bool reshard_after_forward() const;
  /// What the user set, as given (unset: not given).
  const std::optional<ShardingStrategy>& strategy_setting() const { return strategy_; }
  const std::optional<bool>& reshard_after_forward_setting() const { return reshard_after_forward_; }
  /// reshard_after_forward(int)'s group size, as given (unset: not given).
  const std::optional<int>& post_forward_group_size() const { return post_forward_group_size_; }

 private:
  std::optional<ShardingStrategy> strategy_;
  std::optional<bool> reshard_after_forward_;
  std::optional<int> post_forward_group_size_;
};

// What the engine derives from the options: here and nowhere else.

/// Whether units of `strategy` free their unsharded parameters after forward and all-gather them
/// again for backward (FULL_SHARD). The root never does (the runtime keeps it unsharded from
/// forward to backward), whatever its strategy.
bool reshards_after_forward(ShardingStrategy strategy);
/// Whether units of `strategy` shard their parameters (false for NO_SHARD: replicated, gradients
/// all-reduced).
bool shards(ShardingStrategy strategy);
/// The dtype pre-forward casts floating-point inputs to (mixed precision's param_dtype, when
/// cast_forward_inputs), if any.
std::optional<c10::ScalarType> forward_input_dtype(const MixedPrecision& mixed_precision);
/// "" when strategy(...) and reshard_after_forward(...) agree (or only one is given); else what
/// contradicts, e.g. "strategy NO_SHARD with reshard_after_forward(true)".
std::string strategy_conflict(const FullyShardOptions& options);
/// "" when the codecs (all_gather_codec, reduce_codec) fit the strategy; else what does not, e.g.
/// "strategy NO_SHARD with reduce_codec(int8_block(256, Float scales))": NO_SHARD communicates
/// neither all-gathers nor reduce-scatters, so codecs are refused there.
std::string codec_conflict(const FullyShardOptions& options);
/// Refuses (a c10::Error naming the module `fqn`) the codecs codec_conflict finds.
void check_codecs_fit_strategy(const FullyShardOptions& options, const std::string& fqn);

}  // namespace fsdp

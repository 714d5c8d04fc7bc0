#pragma once
// State dicts of a fully_shard model, under the original FQNs, in two forms:
//
// Full: every parameter and buffer unsharded, as the unsharded model's named_parameters() /
// named_buffers() would give them, so a checkpoint is independent of the world size and loads into
// a sharded or unsharded model alike.
//
//   auto sd = fsdp::full_state_dict(root);            // collective; rank 0 gets the tensors
//   if (rank == 0) torch::save(...);
//   fsdp::load_full_state_dict(root, sd,              // collective; the other ranks may pass {}
//       fsdp::LoadFullStateDictOptions().broadcast_from_rank0(true));
//
// Sharded (see [Note: sharded state dicts] in checkpoint/local_shard.h): each rank's part of every
// value, as views of the live tensors; no communication. Checkpoint files are written from it by
// every rank at once, and a load writes into the views.
//
//   fsdp::ShardedStateDict sd = fsdp::sharded_state_dict(root);
//   for (auto& [key, shard] : sd) shard.local.copy_(read(key, shard.flat_offset, shard.local.numel()));
//
// Tensor parallelism (parallelize_module before fully_shard): every dict holds GLOBAL values and
// shapes. full_state_dict gathers each tensor-parallel parameter over its TP group after the FSDP
// gather (every rank of the group takes part, also with rank0_only, which keeps the values on
// world rank 0 only: rank 0 of the dp world and of the TP group); loads take this rank's piece of
// each global value; sharded dicts describe the pieces in global coordinates (LocalShard::piece),
// values the TP group holds whole written by its rank 0. So a checkpoint saved at one (dp, tp)
// loads at any other, on pure fully_shard, and into an unsharded model. See [Note: tensor
// parallelism in state dicts] in checkpoint/state_dict_support.h.
//
// Tied parameters: LibTorch's named_parameters() lists a tensor registered by several modules
// under each of its FQNs, and so does every state dict here: each FQN is a key with the full value
// (full dicts) or the same shard (sharded dicts, the same view and the same `write` flags, so a
// checkpoint stores it under every FQN). A checkpoint therefore loads into the tied model, where
// every key writes the same tensor, and into a model whose copies are not tied.

#include <functional>
#include <string>

#include <c10/util/Exception.h>
#include <torch/ordered_dict.h>

#include "fsdp_cpp/checkpoint/local_shard.h"
#include "fsdp_cpp/composable/fully_shard.h"

namespace fsdp {

struct FullStateDictOptions {
  /// Only rank 0 receives the tensors (the others get an empty dict), saving their memory. On by
  /// default, unlike SummonFullParamsOptions::rank0_only: a full state dict is for saving, which
  /// one rank does, so by default the other ranks do not hold the whole model.
  TORCH_ARG(bool, rank0_only) = true;
  /// Copies on the CPU (otherwise on the parameters' compute device). On by default, unlike
  /// SummonFullParamsOptions::offload_to_cpu: a saved state dict goes to files from host memory,
  /// while summoned parameters are computed with on their device.
  TORCH_ARG(bool, offload_to_cpu) = true;
};

/// How load_full_state_dict (and load_full_optimizer_state_dict) read their input. Always strict
/// (every key present, none unexpected), without the `strict` of dcp::LoadOptions and
/// LoadPretrainedOptions: a full state dict is the whole state, which files may hold only part of.
///
///   fsdp::load_full_state_dict(root, rank == 0 ? sd : decltype(sd){},
///                              fsdp::LoadFullStateDictOptions().broadcast_from_rank0(true));
struct LoadFullStateDictOptions {
  /// Only rank 0's dict is read (every other rank may pass an empty one): rank 0 validates it, and
  /// the values reach the other ranks by broadcast, one FlatParameter (or one tensor) at a time,
  /// so no rank holds more than one of them unsharded at once.
  TORCH_ARG(bool, broadcast_from_rank0) = false;
  /// A value whose dtype differs from the model's is converted (false: refused, naming the key and
  /// both dtypes).
  TORCH_ARG(bool, convert_dtype) = false;
  /// Without broadcast_from_rank0: refuse dicts whose values differ across ranks (compared by an
  /// exact checksum of every value, two small all-reduces), naming the first differing key.
  TORCH_ARG(bool, check_ranks_agree) = true;
};

/// full_state_dict one value at a time, for writers that stream (models/hf_checkpoint.h): each
/// unit is gathered in turn and `sink(fqn, value)` receives each of its parameters' full values (a
/// tied parameter once per FQN, the same tensor) on the ranks full_state_dict would give them to,
/// then the parameters in no unit, then the buffers; a value the sink does not keep is freed before
/// the next unit is gathered. Memory beyond the shards: one unit's full parameters and one value.
/// Collective as full_state_dict; the order is that of the units, not named_parameters'.
using FullValueSink = std::function<void(const std::string& fqn, const at::Tensor& value)>;
/// What full_state_dict and for_each_full_value give: each FQN (named_parameters, then
/// named_buffers), its full (global) shape and the dtype of its value (a unit's full precision).
/// Local: no communication.
struct FullValueSpec {
  std::string fqn;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
};
std::vector<FullValueSpec> full_value_specs(const FSDPModule& root);
/// The specs of the values for_each_full_value gives this rank with `options` (with rank0_only,
/// those this rank writes: the root's data and tp rank 0 for most, each expert's own rank 0 for
/// experts on a subset of the root's ranks), in no particular order. Local.
std::vector<FullValueSpec> full_value_specs(const FSDPModule& root, const FullStateDictOptions& options);
void for_each_full_value(const FSDPModule& root, const FullValueSink& sink, const FullStateDictOptions& options = {});

/// Parameters (unsharded, in the parameters' dtype) and buffers of `root`'s module, by FQN, in
/// named_parameters then named_buffers order. Collective: every rank calls it (one all-gather per
/// FlatParameter, of the full-precision shards, one at a time).
torch::OrderedDict<std::string, at::Tensor> full_state_dict(const FSDPModule& root,
                                                            const FullStateDictOptions& options = {});

/// Loads full values (e.g. a full_state_dict, or an unsharded model's named_parameters and
/// named_buffers) into the sharded model: each rank copies its shard of every parameter, and every
/// buffer. Collective, and validated on every rank before anything is loaded: missing and
/// unexpected keys (all named), shapes, dtypes (see `convert_dtype`) and, unless turned off,
/// values that differ across ranks. If any rank's check fails, every rank throws the same
/// c10::Error (naming the first failing rank) and no rank changes its model. Also refused while
/// the parameters are in use: between a forward and its backward (a unit unsharded then would
/// keep computing with the values it gathered), while a unit is unsharded, or inside a
/// SummonFullParams scope.
void load_full_state_dict(const FSDPModule& root, const torch::OrderedDict<std::string, at::Tensor>& state,
                          const LoadFullStateDictOptions& options = {});

/// This rank's part of every parameter and buffer of `root`'s module (see the top of this file):
/// per parameter (named_parameters order) a 1-D view of its slice of the live shard, with the
/// original shape as global_shape and the slice's first element as flat_offset; parameters of
/// NO_SHARD or one-rank units, parameters in no unit, and buffers (named_buffers order, after the
/// parameters) are whole on every rank and written by world rank 0 only. With hybrid sharding
/// only the first shard group (replicate rank 0) writes. No communication.
ShardedStateDict sharded_state_dict(const FSDPModule& root);

}  // namespace fsdp

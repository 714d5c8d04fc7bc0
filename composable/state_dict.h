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
// Sharded (see [Note: sharded state dicts] in composable/local_shard.h): each rank's part of every
// value, as views of the live tensors; no communication. Checkpoint files are written from it by
// every rank at once, and a load writes into the views.
//
//   fsdp::ShardedStateDict sd = fsdp::sharded_state_dict(root);
//   for (auto& [key, shard] : sd) shard.local.copy_(read(key, shard.flat_offset, shard.local.numel()));
//
// Tied parameters: LibTorch's named_parameters() lists a tensor registered by several modules
// under each of its FQNs, and so does every state dict here: each FQN is a key with the full value
// (full dicts) or the same shard (sharded dicts, the same view and the same `write` flags, so a
// checkpoint stores it under every FQN). A checkpoint therefore loads into the tied model, where
// every key writes the same tensor, and into a model whose copies are not tied.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/ordered_dict.h>

#include "composable/fully_shard.h"
#include "composable/local_shard.h"

namespace fsdp {

struct FullStateDictOptions {
  /// Only rank 0 receives the tensors (the others get an empty dict), saving their memory.
  TORCH_ARG(bool, rank0_only) = true;
  /// Copies on the CPU (otherwise on the parameters' compute device).
  TORCH_ARG(bool, offload_to_cpu) = true;
};

/// How load_full_state_dict (and load_full_optimizer_state_dict) read their input.
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
/// c10::Error (naming the first failing rank) and no rank changes its model.
void load_full_state_dict(const FSDPModule& root, const torch::OrderedDict<std::string, at::Tensor>& state,
                          const LoadFullStateDictOptions& options = {});

/// This rank's part of every parameter and buffer of `root`'s module (see the top of this file):
/// per parameter (named_parameters order) a 1-D view of its slice of the live shard, with the
/// original shape as global_shape and the slice's first element as flat_offset; parameters of
/// NO_SHARD or one-rank units, parameters in no unit, and buffers (named_buffers order, after the
/// parameters) are whole on every rank and written by world rank 0 only. With hybrid sharding
/// only the first shard group (replicate rank 0) writes. No communication.
ShardedStateDict sharded_state_dict(const FSDPModule& root);

/// Where one original parameter of a fully_shard model lives on this rank: the building block of
/// the sharded state dicts of the model and of its optimizer.
struct ParameterPlacement {
  std::string fqn;  // relative to the root's module
  at::Tensor param; // the original parameter object
  /// The handle holding it, and its entry in the handle's layout; null: in no unit.
  const FlatParamHandle* handle = nullptr;
  const FSDPState* unit = nullptr;
  int entry = -1;
  /// This rank's slice (the whole parameter where not sharded).
  ShardSlice slice;
  /// Whether the parameter is held as a 1-D slice while sharded (false: whole, in its own shape).
  bool sliced = false;
  std::vector<int64_t> global_shape;
  int64_t flat_offset = 0;
  int64_t local_numel = 0;
  bool write = true;
  /// A second (or later) FQN of a tied parameter: the same tensor as an earlier placement.
  bool alias = false;

  /// 1-D view of this rank's live elements (of the local shard, or of the parameter itself).
  at::Tensor local() const;
};

/// Every parameter of `root`'s module (named_parameters order, every FQN of a tied one).
std::vector<ParameterPlacement> parameter_placements(const FSDPModule& root);

/// Whether this rank writes values every rank holds whole: rank 0 of the root's communicator and,
/// with hybrid sharding, of its replicate group (world rank 0).
bool writes_replicated(const FSDPModule& root);

namespace state_dict_detail {
// Shared by the model's and the optimizer's full state dicts (composable/optimizer_state_dict.cc).

/// One value of a full state dict that a load expects.
struct ExpectedValue {
  std::string key;
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Float;
};

/// Values loaded together: the entries of one FlatParameter (`handle` set: `entries[i]` is the
/// layout entry of `values[i]`), broadcast as one padded flat tensor when loading from rank 0; or
/// one whole value (`handle` null, `values` of size 1).
struct LoadGroup {
  const FlatParamHandle* handle = nullptr;
  std::shared_ptr<comm::Communicator> comm;  // the handle's unit's communicator
  std::vector<int> entries;
  std::vector<ExpectedValue> values;
  /// Receives, per value, this rank's elements in the expected dtype: the 1-D slice
  /// [slice.param_begin, slice.param_end) of a handle's entry, or the whole value.
  std::function<void(size_t index, const at::Tensor& elements)> sink;
};

/// Validates `state` against `groups` (plus `also_expected`: keys that must be present and well
/// formed but are not loaded, e.g. a tied parameter's second FQN) on every rank, or on rank 0 only
/// with broadcast_from_rank0, and `extra_check` (returns an error or ""); agrees on the outcome
/// across ranks (every rank throws the first failing rank's error); checks, unless told not to,
/// that the ranks passed the same values (`key_order`: every expected key, in the order the
/// first differing one is looked for); then, only if all of that passed, feeds every group's
/// sinks, one group at a time. `api` names the caller in errors.
void load_full_groups(const FSDPModule& root, const std::string& api, const std::vector<LoadGroup>& groups,
                      const std::vector<ExpectedValue>& also_expected,
                      const torch::OrderedDict<std::string, at::Tensor>& state, const LoadFullStateDictOptions& options,
                      const std::vector<std::string>& key_order,
                      const std::function<std::string(const torch::OrderedDict<std::string, at::Tensor>&)>& extra_check);

}  // namespace state_dict_detail
}  // namespace fsdp

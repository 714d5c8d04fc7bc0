#pragma once
// Building blocks shared by the model's and the optimizer's state dicts (checkpoint/state_dict.cc,
// checkpoint/optimizer_state_dict.cc): where each original parameter lives on this rank, who
// writes replicated values, and the collective validate-then-load of full state dicts. Not a
// public API.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/fsdp/flat_param_layout.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"

namespace fsdp {

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
  /// The value's shape in state dicts and checkpoints: the global shape of a tensor-parallel
  /// parameter, else the parameter's shape.
  std::vector<int64_t> global_shape;
  /// The shape of the tensor this rank's FSDP layout holds: this rank's tensor-parallel piece, or
  /// global_shape. `slice`, `flat_offset` and `local_numel` index its flattened elements.
  std::vector<int64_t> piece_shape;
  /// A parameter sharded by tensor parallelism (parallelize_module): its placement.
  std::optional<TensorPlacement> tp;
  int64_t flat_offset = 0;
  int64_t local_numel = 0;
  bool write = true;
  /// A second (or later) FQN of a tied parameter: the same tensor as an earlier placement.
  bool alias = false;

  /// 1-D view of this rank's live elements (of the local shard, or of the parameter itself).
  at::Tensor local() const;
  /// The global ranges of this rank's tensor-parallel piece (see [Note: tensor-parallel pieces]).
  std::optional<TensorPiece> piece() const;
};

/// [Note: tensor parallelism in state dicts] A tensor-parallel model (parallelize_module before
/// fully_shard) holds a piece of each sharded parameter per rank of its TP group, and whole copies
/// of everything else on every rank of it. State dicts and checkpoints hold GLOBAL values: full
/// state dicts gather over the TP group after the FSDP gather (every rank of it takes part), loads
/// take this rank's piece of each global value, and sharded state dicts describe pieces in global
/// coordinates (LocalShard::piece). Values every rank of the TP group holds whole are written by
/// its rank 0 only. Every rank decides from the model alone, which all ranks share: the TP groups
/// are those of the parameters' placements (composable/tensor_placement.h).

/// The tensor-parallel group of `module`'s parameters (the first placement's group of more than
/// one rank, in named_parameters order), or null.
std::shared_ptr<comm::Communicator> tensor_parallel_group(const torch::nn::Module& module);
/// Whether this rank is rank 0 of every tensor-parallel group of `module`'s parameters (true
/// without tensor parallelism).
bool tensor_parallel_rank0(const torch::nn::Module& module);

/// Every parameter of `root`'s module (named_parameters order, every FQN of a tied one).
std::vector<ParameterPlacement> parameter_placements(const FSDPModule& root);

/// Whether this rank writes values every rank holds whole: rank 0 of the root's communicator and,
/// with hybrid sharding, of its replicate group, and with tensor parallelism of the TP group
/// (world rank 0).
bool writes_replicated(const FSDPModule& root);
/// The same for the parameters of `unit` inside `root`: a unit on a subset of the root's ranks
/// (an expert: [Note: units on a subset of the root's ranks] in fsdp/lazy_init.cc) is written by
/// rank 0 of its own groups, since the root's rank 0 does not hold it.
bool writes_replicated(const FSDPModule& root, const FSDPState& unit);

/// Why the values of `root`'s parameters cannot be replaced now ("" when they can), naming the
/// unit: a forward of the root is running, or ran and its backward may still run, or a backward is
/// running (units unsharded then keep computing with the values they gathered, since unshard()
/// of an unsharded unit gathers nothing), a unit is unsharded (FSDPModule::unshard(),
/// set_reshard_after_backward(false)) or being all-gathered, or a SummonFullParams scope holds a
/// unit's full parameters (its writeback would overwrite the values loaded). Loads of model state
/// (fsdp::dcp::load, load_full_state_dict, load_pretrained) refuse then, on every rank (each
/// checks in its collective validation). Local: reads only this rank's engine state.
std::string parameters_in_use(const FSDPModule& root);

namespace state_dict_detail {
// Shared by the model's and the optimizer's full state dicts (checkpoint/optimizer_state_dict.cc).

/// One value of a full state dict that a load expects.
struct ExpectedValue {
  std::string key;
  std::vector<int64_t> shape;  // global
  c10::ScalarType dtype = c10::ScalarType::Float;
  /// Set for a tensor-parallel parameter (or its optimizer state): the sinks receive this rank's
  /// piece of the value (their elements index the piece).
  std::optional<TensorPlacement> tp;
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
/// sinks, one group at a time. `api` names the caller in errors. `replaces_parameters`: every rank
/// also checks parameters_in_use(root) (the model's values, not the optimizer's).
void load_full_groups(const FSDPModule& root, const std::string& api, const std::vector<LoadGroup>& groups,
                      const std::vector<ExpectedValue>& also_expected,
                      const torch::OrderedDict<std::string, at::Tensor>& state, const LoadFullStateDictOptions& options,
                      const std::vector<std::string>& key_order,
                      const std::function<std::string(const torch::OrderedDict<std::string, at::Tensor>&)>& extra_check,
                      bool replaces_parameters = false);

}  // namespace state_dict_detail

}  // namespace fsdp

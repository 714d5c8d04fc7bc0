#pragma once
// Full state dicts of a fully_shard model: every parameter and buffer under its original FQN,
// unsharded, as the unsharded model's named_parameters()/named_buffers() would give them, so a
// checkpoint is independent of the world size and loads into a sharded or unsharded model alike.
//
//   auto sd = fsdp::full_state_dict(root);            // collective; rank 0 gets the tensors
//   if (rank == 0) torch::save(...);
//   fsdp::load_full_state_dict(root, sd);             // every rank passes the full values

#include <string>

#include <c10/util/Exception.h>
#include <torch/ordered_dict.h>

#include "composable/fully_shard.h"

namespace fsdp {

struct FullStateDictOptions {
  /// Only rank 0 receives the tensors (the others get an empty dict), saving their memory.
  TORCH_ARG(bool, rank0_only) = true;
  /// Copies on the CPU (otherwise on the parameters' compute device).
  TORCH_ARG(bool, offload_to_cpu) = true;
};

/// Parameters (unsharded, in the parameters' dtype) and buffers of `root`'s module, by FQN, in
/// named_parameters then named_buffers order. Collective: every rank calls it (one all-gather per
/// FlatParameter, of the full-precision shards, one at a time).
torch::OrderedDict<std::string, at::Tensor> full_state_dict(const FSDPModule& root,
                                                            const FullStateDictOptions& options = {});

/// Loads full values (e.g. a full_state_dict, or an unsharded model's named_parameters) into the
/// sharded model: each rank copies its shard of every parameter, and every buffer. Missing or
/// extra keys, and shape mismatches, are a c10::Error naming them; the model is unchanged then.
void load_full_state_dict(const FSDPModule& root, const torch::OrderedDict<std::string, at::Tensor>& state);

}  // namespace fsdp

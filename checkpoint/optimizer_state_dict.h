#pragma once
// Optimizer state dicts of a fully_shard model (torch::optim::Adam, AdamW and SGD), keyed by the
// parameters' original FQNs as PyTorch's flattened optimizer state dicts are, so a checkpoint is
// independent of the world size and of the order in which the optimizer holds its parameters:
//
//   state.<param fqn>.step                 Adam/AdamW: 0-d float32 (PyTorch's convention)
//   state.<param fqn>.exp_avg              Adam/AdamW: the parameter's shape and dtype
//   state.<param fqn>.exp_avg_sq           Adam/AdamW
//   state.<param fqn>.max_exp_avg_sq       Adam/AdamW with amsgrad
//   state.<param fqn>.momentum_buffer      SGD with momentum
//   param_groups.<param fqn>.<name>        0-d float64 hyperparameters of the parameter's group:
//       lr, betas (1-D float64 [2]), eps, weight_decay, amsgrad (0/1) for Adam/AdamW;
//       lr, momentum, dampening, weight_decay, nesterov (0/1) for SGD.
//
// All "state." keys come first (parameters in named_parameters order), then all "param_groups."
// keys. Only parameters of the model that the optimizer holds (by tensor identity) have keys; a
// tied parameter has keys under each of its FQNs (see checkpoint/state_dict.h).
//
// With sharding the optimizer holds the original parameters as 1-D views of this rank's slices,
// so LibTorch's per-parameter state tensors are 1-D slices too: the sharded form exposes them
// as they are, the full form gathers them into the parameters' shapes.
//
//   auto sd = fsdp::sharded_optimizer_state_dict(root, optim);   // views: no communication
//   ... write or fill every entry's `local` ...
//   fsdp::load_sharded_optimizer_state_dict(root, optim, sd);

#include <string>

#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include "fsdp_cpp/checkpoint/local_shard.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/composable/fully_shard.h"

namespace fsdp {

/// This rank's part of the optimizer state (see the top of this file): for every parameter the
/// optimizer holds, each state tensor as a LocalShard with the parameter's global_shape,
/// flat_offset and write flag (see sharded_state_dict) whose `local` is a 1-D view of the live
/// state tensor; where the optimizer has no state yet for a parameter (never stepped), `local` is
/// a freshly allocated zero tensor that load_sharded_optimizer_state_dict installs. Steps and
/// hyperparameters are 1-element (betas: 2) float entries every rank holds, written by world
/// rank 0. No communication.
ShardedStateDict sharded_optimizer_state_dict(const FSDPModule& root, torch::optim::Optimizer& optim);

/// Loads a sharded optimizer state dict (one made by sharded_optimizer_state_dict on a model of
/// the same structure, its `local` tensors filled, e.g. from a checkpoint): creates the state of
/// parameters that have none, copies every `local` that is not already a view of the live state
/// into it, sets steps and each parameter group's hyperparameters. Validates everything first
/// (every key present, none unexpected, shapes and sizes, the same hyperparameters for all
/// parameters of a group, amsgrad unchanged) and changes nothing if that fails. No communication.
void load_sharded_optimizer_state_dict(const FSDPModule& root, torch::optim::Optimizer& optim,
                                       const ShardedStateDict& state);

/// The optimizer state with every state tensor in its parameter's original shape (see the top of
/// this file). Collective: per FlatParameter and state name, the slices of the ranks are assembled
/// into one flat shard and all-gathered with the unit's communicator, one at a time; steps are
/// the largest over the ranks. With `rank0_only` the other ranks get an empty dict.
torch::OrderedDict<std::string, at::Tensor> full_optimizer_state_dict(const FSDPModule& root,
                                                                      torch::optim::Optimizer& optim,
                                                                      const FullStateDictOptions& options = {});

/// Loads a full optimizer state dict (e.g. full_optimizer_state_dict's, or one of an unsharded
/// model's optimizer in the same form): each rank takes its slices. Collective, validated like
/// load_full_state_dict (every rank, or rank 0 with broadcast_from_rank0; the same error on every
/// rank, nothing loaded if any rank fails), plus the hyperparameter checks of
/// load_sharded_optimizer_state_dict.
void load_full_optimizer_state_dict(const FSDPModule& root, torch::optim::Optimizer& optim,
                                    const torch::OrderedDict<std::string, at::Tensor>& state,
                                    const LoadFullStateDictOptions& options = {});

}  // namespace fsdp

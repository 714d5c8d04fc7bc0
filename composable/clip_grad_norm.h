#pragma once
// clip_grad_norm_ across shards: the total gradient norm of a fully_shard model (every unit in the
// tree) with one all-reduce, then every sharded gradient scaled so that the total is at most
// `max_norm` (what torch::nn::utils::clip_grad_norm_ does on an unsharded model).
//
//   loss.backward();
//   double norm = fsdp::clip_grad_norm_(root_unit, /*max_norm=*/1.0);
//   optim.step();

#include <limits>

#include "fsdp_cpp/composable/fully_shard.h"

namespace fsdp {

/// Returns the total norm (of order `norm_type`; infinity for the max norm) of the gradients of
/// every unit in `root`'s tree, as if computed on the unsharded model, and scales them by
/// max_norm / (total + 1e-6) when that is below 1. Collective over the root's ranks: every rank
/// calls it.
double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type = 2.0);

}  // namespace fsdp

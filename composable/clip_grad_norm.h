#pragma once
// clip_grad_norm_ across shards, tensor-parallel pieces and pipeline stages: the total gradient
// norm of the whole model, as torch::nn::utils::clip_grad_norm_ computes it on the unsharded model,
// then every gradient scaled by the same coefficient on every rank, so that the total is at most
// `max_norm`.
//
//   loss.backward();
//   double norm = fsdp::clip_grad_norm_(root_unit, /*max_norm=*/1.0);
//   optim.step();
//
//   // Pipeline parallelism: every stage chunk this rank holds, and the ranks of the other stages.
//   double norm = fsdp::clip_grad_norm_({chunk0_root, chunk1_root}, 1.0, 2.0, mesh->group("pp"));

#include <limits>
#include <memory>
#include <vector>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/fully_shard.h"

namespace fsdp {

/// Returns the total norm (of order `norm_type`; infinity for the max norm) of the gradients of
/// the whole model, and scales every gradient by max_norm / (total + 1e-6) when that is below 1,
/// as torch::nn::utils::clip_grad_norm_ does on the unsharded model.
///   - `roots`: every fully_shard root this rank holds (one per pipeline stage chunk, or the
///     model's root); each unit of their trees enters once, each parameter once. Gradients
///     sharded by fully_shard are summed over the roots' communicator, tensor-parallel pieces
///     ([Note: tensor placement] in composable/tensor_placement.h) over their tp group;
///     gradients every rank holds whole (NO_SHARD, one rank, HSDP's replicas, ignored parameters
///     and parameters no unit manages, tp-replicated parameters) enter once. HSDP's replicas hold
///     the same gradients: nothing is reduced across them.
///   - `pipeline_group` (may be null: no pipeline parallelism): the ranks that hold the model's
///     other stages (the ranks of the same data- and tensor-parallel coordinates), over which the
///     stages' totals are summed (the max taken for the max norm).
/// Collective: every rank of the job calls it, with the same groups. Before the first collective
/// the ranks exchange their checks' outcome over every group it communicates on (the roots'
/// communicators, their replicate groups, the tp group, the pipeline group, in that order:
/// [Note: error agreement] in comm/agreement.h), so a refusal on one rank is the same c10::Error
/// on every rank ("fsdp::clip_grad_norm_: rank R: ...", the lowest such rank's) and no rank is
/// left waiting: max_norm
/// negative or NaN (+infinity: never clips), norm_type <= 0 or NaN, a unit in `roots` that is not
/// a root (inside another unit: it would clip by its subtree's norm; detected before and after the
/// first forward), tensor-parallel parameters over several tp groups, a root whose iteration is
/// left open by set_is_last_backward(false) ([Note: open iterations] in fsdp/open_iteration.h).
/// Refused locally, before any exchange (the groups are not known): an empty `roots`.
double clip_grad_norm_(const std::vector<FSDPModule>& roots, double max_norm, double norm_type,
                       const std::shared_ptr<comm::Communicator>& pipeline_group);

/// One root, no pipeline parallelism: clip_grad_norm_({root}, max_norm, norm_type, nullptr).
double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type = 2.0);

}  // namespace fsdp

#pragma once
// Dropout under tensor parallelism: the same mask where an activation is replicated over the
// tensor-parallel group, distinct pieces of one mask where it is sharded (DTensor's random-op
// semantics: a sharded random op equals the op on the whole tensor, sliced).
//
//   // attention probabilities [B, H/n, T, T]: this rank's heads (dimension 1)
//   att = fsdp::tp::dropout(att, p, is_training(), /*sharded_dim=*/1, tp_group);
//   // the residual stream after a RowwiseParallel projection: replicated
//   y = fsdp::tp::dropout(y, p, is_training(), std::nullopt, tp_group);
//
// [Note: tensor-parallel RNG] Masks come from the current default generator, so the rule is the
// one that makes every rank of a tensor-parallel group hold the same generator state: seed it
// alike on the ranks of a tp group (fsdp::parallel::forward_seed, by data rank, microbatch and
// stage, never by world rank) and let every rank draw the same number of values in the same order.
// dropout() keeps that lockstep: a replicated activation draws its whole mask on every rank (the
// same mask), a sharded one draws the mask of the whole tensor (the same on every rank) and
// applies this rank's piece, so the ranks' pieces are distinct and together are exactly the mask
// the unsharded model draws with that generator state: dropout under tensor parallelism trains the
// same model as unsharded training with the same seeds (on the CPU generator; on CUDA the whole
// mask comes from bernoulli_, not from at::dropout's fused kernel, so the masks are the same
// across tp ranks but not those of an unsharded at::dropout). Drawing the whole mask costs n times
// the random numbers of the piece, not n times the memory of the activation's whole (the mask is
// allocated whole once and sliced).

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/composable/tp_collectives.h"  // fsdp::tp::Group

namespace fsdp::tp {

/// Dropout of `x` with probability `p` when `training` (identity otherwise, or when p is 0):
/// `sharded_dim` nullopt: `x` is replicated over `group` (or there is no group): at::dropout.
/// `sharded_dim` d: `x` is piece group->rank() of group->size() equal pieces of the whole along d:
/// the whole tensor's mask is drawn and this piece applied (see the note above). A c10::Error names
/// fsdp::tp::dropout and the values for p outside [0, 1) or a dimension out of range.
at::Tensor dropout(const at::Tensor& x, double p, bool training, std::optional<int64_t> sharded_dim,
                   const Group& group);

}  // namespace fsdp::tp

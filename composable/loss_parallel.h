#pragma once
// Loss parallel: cross-entropy on vocabulary-sharded logits without gathering them (PyTorch's
// `loss_parallel()`, Megatron's vocab_parallel_cross_entropy). The logits come from a
// column-parallel output layer (ColwiseParallel with its default Shard(-1) output, or a
// vocabulary-parallel tied embedding): rank r of the group holds the vocabulary entries
// [r * V/n, (r + 1) * V/n). Three all-reduces of one value per row in forward (the row maximum,
// the sum of exponentials, the target's logit), none in backward; the loss is the same on every
// rank of the group and equals at::cross_entropy_loss of the gathered logits (mean over rows).
//
//   at::Tensor loss = fsdp::tp::vocab_parallel_cross_entropy(local_logits.flatten(0, 1),
//                                                            targets.flatten(), tp_group);

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/composable/tp_collectives.h"

namespace fsdp::tp {

/// Mean cross-entropy of `local_logits` [N, V/n] (this rank's vocabulary columns) against
/// `targets` [N] (global vocabulary ids, int64). The vocabulary size is n times the local width.
/// A c10::Error names shapes that do not fit and target ids outside the vocabulary.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const Group& group);

}  // namespace fsdp::tp

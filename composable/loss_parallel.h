#pragma once
// Loss parallel: cross-entropy on vocabulary-sharded logits without gathering them (PyTorch's
// `loss_parallel()`, Megatron's vocab_parallel_cross_entropy). The logits come from a
// column-parallel output layer (ColwiseParallel with its default Shard(-1) output, or a
// vocabulary-parallel tied embedding): rank r of the group holds the columns
// [r * C/n, (r + 1) * C/n) of C = n x (local width) columns. Three all-reduces of one value per row
// in forward (the row maximum, the sum of exponentials, the target's logit), none in backward; the
// loss is the same on every rank of the group and equals at::cross_entropy_loss of the gathered
// logits (with the same ignore_index and reduction, the padding columns removed).
//
//   at::Tensor loss = fsdp::tp::vocab_parallel_cross_entropy(local_logits.flatten(0, 1),
//                                                            targets.flatten(), tp_group);
//
// Options (VocabParallelCrossEntropyOptions), as at::cross_entropy_loss has them:
//   - ignore_index (-100): rows whose target equals it count for nothing (loss and gradient 0);
//     the mean is over the other rows, and is NaN when every row is ignored (as in PyTorch; the
//     gradient is then zero).
//   - vocab_size (-1: all C columns): a padded vocabulary (padded to a multiple of the tp size). The
//     columns at or beyond vocab_size are padding: left out of the softmax as if their logits were
//     -inf, their gradient exactly zero, and a target there is an error. Padding may lie on the last
//     rank or span several (a rank may hold only padding).
//   - reduction: torch::kMean (default; over the rows that count), torch::kSum (a caller normalising
//     by a token count of its own: sum the losses, then divide by the tokens of every micro-batch),
//     torch::kNone (one loss per row, 0 for ignored rows).
//
//   auto loss = fsdp::tp::vocab_parallel_cross_entropy(
//       local_logits, targets, tp_group,
//       fsdp::tp::VocabParallelCrossEntropyOptions().vocab_size(50257).reduction(torch::kSum));
//
// Without ignored rows and padding, the default options compute exactly what the three-argument
// overload always computed (bit for bit).

#include <cstdint>
#include <variant>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/enum.h>

#include "fsdp_cpp/composable/tp_collectives.h"

namespace fsdp::tp {

/// Options of vocab_parallel_cross_entropy, in the LibTorch style.
struct VocabParallelCrossEntropyOptions {
  typedef std::variant<torch::enumtype::kNone, torch::enumtype::kMean, torch::enumtype::kSum> reduction_t;

  /// Rows whose target equals this count for nothing (at::cross_entropy_loss's ignore_index).
  TORCH_ARG(int64_t, ignore_index) = -100;
  /// The real vocabulary size, at most the n x (local width) columns; the columns beyond it are
  /// padding. -1: every column is a vocabulary entry.
  TORCH_ARG(int64_t, vocab_size) = -1;
  /// torch::kMean (over the rows that count), torch::kSum, or torch::kNone (a loss per row).
  TORCH_ARG(reduction_t, reduction) = torch::kMean;
};

/// Cross-entropy of `local_logits` [N, V/n] (this rank's vocabulary columns) against `targets` [N]
/// (global vocabulary ids, int64), reduced as `options` says (a scalar, or [N] with kNone); the
/// result is in the logits' dtype (computed in float32). A c10::Error names shapes that do not fit,
/// a vocab_size outside [1, n x local width], and target ids outside [0, vocab_size) other than
/// ignore_index.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const Group& group, const VocabParallelCrossEntropyOptions& options);

/// The mean over all rows, with the default options (the vocabulary is all n x local width columns).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const Group& group);

}  // namespace fsdp::tp

#include "fsdp_cpp/composable/loss_parallel.h"

#include <limits>
#include <sstream>
#include <string>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kApi = "vocab_parallel_cross_entropy";

enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };

struct GroupCapsule final : torch::CustomClassHolder {
  explicit GroupCapsule(Group g) : group(std::move(g)) {}
  Group group;
};

at::Tensor all_reduce(at::Tensor t, comm::Communicator& group, c10d::ReduceOp op) {
  if (group.size() > 1) group.all_reduce(t, op, "tensor_parallel: loss").wait();
  return t;
}

// The forward's inputs besides the tensors (one value each, so that apply() passes them through).
//   vocab_size: the real vocabulary (columns at or beyond it are padding);
//   ignore_index, any_ignored: whether some row's target is ignore_index (else no mask is built, and
//     the default options run exactly the operations of the original unmasked version);
//   counted: the rows that count; reduction: a Reduction.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                               c10::intrusive_ptr<GroupCapsule> capsule, int64_t vocab_size, int64_t ignore_index,
                               bool any_ignored, int64_t counted, int64_t reduction) {
    RECORD_FUNCTION("tensor_parallel::vocab_parallel_cross_entropy", std::vector<c10::IValue>());
    comm::Communicator& group = *capsule->group;
    const int64_t local_vocab = logits.size(1);
    const int64_t start = group.rank() * local_vocab;
    at::Tensor x = logits.to(at::kFloat);
    // A padded vocabulary: this rank's columns from `real` on are padding, -inf in the softmax
    // (exp gives exactly 0, so their probabilities and gradients are exactly 0).
    const int64_t real = std::clamp<int64_t>(vocab_size - start, 0, local_vocab);
    const bool padded = real < local_vocab;
    if (padded) {
      x = x.clone();  // (to() may return the caller's tensor)
      x.narrow(1, real, local_vocab - real).fill_(-std::numeric_limits<float>::infinity());
    }
    // Subtract the global row maximum (for stability; it cancels in the loss).
    at::Tensor max = all_reduce(std::get<0>(x.max(1)).contiguous(), group, c10d::ReduceOp::MAX);
    at::Tensor shifted = x - max.unsqueeze(1);
    at::Tensor exp = shifted.exp();
    at::Tensor sum_exp = all_reduce(exp.sum(1), group, c10d::ReduceOp::SUM);
    at::Tensor valid = any_ignored ? targets.ne(ignore_index) : at::Tensor();
    at::Tensor mine = (targets >= start) & (targets < start + local_vocab);
    if (any_ignored) mine = mine & valid;
    at::Tensor local_ids = (targets - start).clamp(0, local_vocab - 1);
    at::Tensor gathered = shifted.gather(1, local_ids.unsqueeze(1)).squeeze(1);
    // (With padding a clamped id may fall on a -inf column: select, since -inf * 0 is NaN.)
    at::Tensor target_logit = padded || any_ignored ? at::where(mine, gathered, at::zeros({}, gathered.options()))
                                                    : gathered * mine.to(shifted.dtype());
    target_logit = all_reduce(target_logit.contiguous(), group, c10d::ReduceOp::SUM);
    at::Tensor per_row = sum_exp.log() - target_logit;
    if (any_ignored) per_row = at::where(valid, per_row, at::zeros({}, per_row.options()));
    at::Tensor loss;
    if (reduction == kNone) {
      loss = per_row;
    } else if (reduction == kSum) {
      loss = per_row.sum();
    } else if (!any_ignored) {
      loss = per_row.mean();
    } else {
      loss = per_row.sum() / static_cast<double>(counted);  // 0 / 0 = NaN when every row is ignored
    }
    ctx->save_for_backward({exp / sum_exp.unsqueeze(1), local_ids, mine, any_ignored ? valid : at::Tensor()});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    ctx->saved_data["any_ignored"] = any_ignored;
    ctx->saved_data["counted"] = counted;
    ctx->saved_data["reduction"] = reduction;
    return {loss.to(logits.scalar_type())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& local_ids = saved[1];
    const at::Tensor& mine = saved[2];
    const at::Tensor& valid = saved[3];
    const bool any_ignored = ctx->saved_data["any_ignored"].toBool();
    const int64_t counted = ctx->saved_data["counted"].toInt();
    const int64_t reduction = ctx->saved_data["reduction"].toInt();
    const int64_t rows = softmax.size(0);
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(1, local_ids.unsqueeze(1), -mine.to(grad.dtype()).unsqueeze(1));
    const at::Tensor g = grads[0].to(grad.dtype());
    if (reduction == kMean && !any_ignored) {
      grad.mul_(g / static_cast<double>(rows));
    } else {
      // The gradient of each row's loss: g / counted (mean), g (sum) or g[i] (none); 0 where ignored
      // (selected, not multiplied, so that 1 / 0 with every row ignored gives 0, as PyTorch).
      at::Tensor scale = reduction == kMean ? g / static_cast<double>(counted) : g;
      if (reduction != kNone) scale = scale.expand({rows});
      if (any_ignored) scale = at::where(valid, scale, at::zeros({}, scale.options()));
      grad.mul_(scale.unsqueeze(1));
    }
    grad = grad.to(static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Up to 8 distinct ids of `bad` (a 1-D int64 tensor), for messages.
std::string some_ids(const at::Tensor& bad) {
  const at::Tensor ids = std::get<0>(at::_unique2(bad, /*sorted=*/true));
  std::ostringstream out;
  const int64_t shown = std::min<int64_t>(ids.numel(), 8);
  for (int64_t i = 0; i < shown; ++i) out << (i ? ", " : "") << ids[i].item<int64_t>();
  if (ids.numel() > shown) out << ", ... (" << ids.numel() << " distinct)";
  return out.str();
}

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const Group& group, const VocabParallelCrossEntropyOptions& options) {
  TORCH_CHECK(group != nullptr, kApi, ": no group given");
  TORCH_CHECK(local_logits.dim() == 2, kApi, ": expected logits [rows, vocab / ", group->size(), "], found ",
              local_logits.sizes());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == local_logits.size(0), kApi, ": expected targets [",
              local_logits.size(0), "] (one per row of the logits), found ", targets.sizes());
  TORCH_CHECK(targets.scalar_type() == at::kLong, kApi, ": expected int64 targets, found ", targets.scalar_type());
  const int64_t local = local_logits.size(1);
  const int64_t columns = local * group->size();
  const int64_t vocab = options.vocab_size() == -1 ? columns : options.vocab_size();
  TORCH_CHECK(vocab >= 1 && vocab <= columns, kApi, ": vocab_size must be in [1, ", columns, "] (", group->size(),
              " ranks x ", local, " local columns; -1 for all of them), got ", options.vocab_size());
  const int64_t ignore_index = options.ignore_index();
  const int64_t rows = targets.numel();
  bool any_ignored = false;
  int64_t counted = rows;
  if (rows > 0) {
    int64_t lo = targets.min().item<int64_t>(), hi = targets.max().item<int64_t>();
    at::Tensor valid;
    // (No mask unless ignore_index lies within the targets' range: the usual -100 never does.)
    if (lo <= ignore_index && ignore_index <= hi) {
      valid = targets.ne(ignore_index);
      counted = valid.sum().item<int64_t>();
      any_ignored = counted < rows;
      if (any_ignored && counted > 0) {
        const at::Tensor kept = targets.masked_select(valid);
        lo = kept.min().item<int64_t>();
        hi = kept.max().item<int64_t>();
      }
    }
    if (counted > 0 && (lo < 0 || hi >= vocab)) {
      at::Tensor bad = (targets < 0) | (targets >= vocab);
      if (any_ignored) bad = bad & valid;
      std::string padding;
      if (vocab < columns) {
        padding = ", columns [" + std::to_string(vocab) + ", " + std::to_string(columns) + ") are padding";
      }
      TORCH_CHECK(false, kApi, ": target ids must be in [0, ", vocab, ") (", group->size(), " ranks x ", local,
                  " local columns", padding, ") or equal ignore_index ", ignore_index, ", found [", lo, ", ", hi,
                  "]: ", some_ids(targets.masked_select(bad)));
    }
  }
  int64_t reduction = kMean;
  if (std::holds_alternative<torch::enumtype::kSum>(options.reduction())) reduction = kSum;
  if (std::holds_alternative<torch::enumtype::kNone>(options.reduction())) reduction = kNone;
  return VocabParallelCrossEntropy::apply(local_logits, targets, c10::make_intrusive<GroupCapsule>(group), vocab,
                                          ignore_index, any_ignored, counted, reduction)[0];
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const Group& group) {
  return vocab_parallel_cross_entropy(local_logits, targets, group, VocabParallelCrossEntropyOptions());
}

}  // namespace fsdp::tp

#include "fsdp_cpp/composable/loss_parallel.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GroupCapsule final : torch::CustomClassHolder {
  explicit GroupCapsule(Group g) : group(std::move(g)) {}
  Group group;
};

at::Tensor all_reduce(at::Tensor t, comm::Communicator& group, c10d::ReduceOp op) {
  if (group.size() > 1) group.all_reduce(t, op, "tensor_parallel: loss").wait();
  return t;
}

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                               c10::intrusive_ptr<GroupCapsule> capsule) {
    RECORD_FUNCTION("tensor_parallel::vocab_parallel_cross_entropy", std::vector<c10::IValue>());
    comm::Communicator& group = *capsule->group;
    const int64_t local_vocab = logits.size(1);
    const int64_t start = group.rank() * local_vocab;
    at::Tensor x = logits.to(at::kFloat);
    // Subtract the global row maximum (for stability; it cancels in the loss).
    at::Tensor max = all_reduce(std::get<0>(x.max(1)).contiguous(), group, c10d::ReduceOp::MAX);
    at::Tensor shifted = x - max.unsqueeze(1);
    at::Tensor exp = shifted.exp();
    at::Tensor sum_exp = all_reduce(exp.sum(1), group, c10d::ReduceOp::SUM);
    at::Tensor mine = (targets >= start) & (targets < start + local_vocab);
    at::Tensor local_ids = (targets - start).clamp(0, local_vocab - 1);
    at::Tensor target_logit = shifted.gather(1, local_ids.unsqueeze(1)).squeeze(1) * mine.to(shifted.dtype());
    target_logit = all_reduce(target_logit.contiguous(), group, c10d::ReduceOp::SUM);
    at::Tensor loss = (sum_exp.log() - target_logit).mean();
    ctx->save_for_backward({exp / sum_exp.unsqueeze(1), local_ids, mine});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return {loss.to(logits.scalar_type())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& local_ids = saved[1];
    const at::Tensor& mine = saved[2];
    const int64_t rows = softmax.size(0);
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(1, local_ids.unsqueeze(1), -mine.to(grad.dtype()).unsqueeze(1));
    grad.mul_(grads[0].to(grad.dtype()) / static_cast<double>(rows));
    grad = grad.to(static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()));
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const Group& group) {
  TORCH_CHECK(group != nullptr, "vocab_parallel_cross_entropy: no group given");
  TORCH_CHECK(local_logits.dim() == 2, "vocab_parallel_cross_entropy: expected logits [rows, vocab / ",
              group->size(), "], found ", local_logits.sizes());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == local_logits.size(0),
              "vocab_parallel_cross_entropy: expected targets [", local_logits.size(0), "] (one per row of "
              "the logits), found ", targets.sizes());
  TORCH_CHECK(targets.scalar_type() == at::kLong, "vocab_parallel_cross_entropy: expected int64 targets, found ",
              targets.scalar_type());
  const int64_t vocab = local_logits.size(1) * group->size();
  if (targets.numel() > 0) {
    const int64_t lo = targets.min().item<int64_t>(), hi = targets.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < vocab, "vocab_parallel_cross_entropy: target ids must be in [0, ", vocab,
                ") (", group->size(), " ranks x ", local_logits.size(1), " local columns), found [", lo, ", ", hi, "]");
  }
  return VocabParallelCrossEntropy::apply(local_logits, targets, c10::make_intrusive<GroupCapsule>(group))[0];
}

}  // namespace fsdp::tp

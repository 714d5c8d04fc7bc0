#include "fsdp_cpp/examples/gpt_tensor_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/composable/loss_parallel.h"
#include "fsdp_cpp/composable/tp_collectives.h"

namespace fsdp::examples {

namespace {

// What of the GPT a plan covers: the whole tied model, or what a pipeline stage holds.
struct GptParts {
  bool embeddings = true;  // tok_emb, pos_emb
  bool blocks = true;      // at least one block
  bool final_norm = true;  // ln_f
  bool head = false;       // an untied output layer
};

TensorParallelPlan plan_for(const GptParts& parts, const GptTensorParallel& options) {
  const bool sp = options.sequence_parallel();
  const Layout seq = Layout::shard(1);
  TensorParallelPlan plan;
  if (parts.embeddings) {
    plan.emplace_back("tok_emb", RowwiseParallel()
                                     .input_layout(Layout::replicate())
                                     .output_layout(sp ? seq : Layout::replicate()));
    if (sp) {
      plan.emplace_back("pos_emb", PrepareModuleOutput()
                                       .output_layout(Layout::replicate())
                                       .desired_output_layout(Layout::shard(0)));
    }
  }
  if (parts.blocks) {
    plan.emplace_back("blocks.*.attn.qkv", ColwiseParallel().chunks(3).input_layout(sp ? seq : Layout::replicate()));
    plan.emplace_back("blocks.*.attn.proj", RowwiseParallel().output_layout(sp ? seq : Layout::replicate()));
    plan.emplace_back("blocks.*.mlp.fc", ColwiseParallel().input_layout(sp ? seq : Layout::replicate()));
    plan.emplace_back("blocks.*.mlp.proj", RowwiseParallel().output_layout(sp ? seq : Layout::replicate()));
    if (sp) {
      plan.emplace_back("blocks.*.ln1", SequenceParallel());
      plan.emplace_back("blocks.*.ln2", SequenceParallel());
    }
  }
  if (parts.final_norm && sp) plan.emplace_back("ln_f", SequenceParallel());
  if (parts.head) {
    plan.emplace_back("head", ColwiseParallel()
                                  .input_layout(sp ? seq : Layout::replicate())
                                  .output_layout(options.loss_parallel() ? Layout::shard(-1) : Layout::replicate()));
  }
  return plan;
}

}  // namespace

TensorParallelPlan gpt_tensor_parallel_plan(const GptTensorParallel& options) {
  return plan_for(GptParts{}, options);
}

TensorParallelPlan gpt_tensor_parallel_plan(const GPTImpl& model, const GptTensorParallel& options) {
  GptParts parts;
  parts.embeddings = model.is_first_stage();
  parts.blocks = !model.blocks->is_empty();
  parts.final_norm = model.is_last_stage();
  parts.head = !model.head.is_empty();
  return plan_for(parts, options);
}

GptLossFunction parallelize_gpt(GPT& model, const std::shared_ptr<comm::Communicator>& group,
                                const GptTensorParallel& options) {
  const bool sp = options.sequence_parallel();
  TORCH_CHECK(model->config().n_heads() % group->size() == 0, "parallelize_gpt: the attention heads split over the ",
              group->size(), " tensor-parallel ranks; n_heads ", model->config().n_heads(), " is not a multiple of it");
  if (sp) {
    TORCH_CHECK(model->config().context_length() % group->size() == 0, "parallelize_gpt: sequence parallelism "
                "splits the sequence over ", group->size(), " ranks; the context length ",
                model->config().context_length(), " is not a multiple of it");
  }
  parallelize_module(*model, group, gpt_tensor_parallel_plan(*model, options));
  // Dropout: the same mask on every rank where activations are replicated, pieces of one mask
  // where they are sharded (heads; positions with SP): [Note: tensor-parallel RNG].
  model->set_dropout_layout(DropoutLayout{group, sp});
  const bool lp = options.loss_parallel();
  // The tied output layer: the hidden states enter the vocabulary-parallel matmul whole (their
  // gradient, partial on each rank, summed or reduce-scattered back). An untied head is
  // column-parallel through the plan.
  if (model->config().tie_embeddings() && model->is_last_stage()) {
    model->set_output_layer([group, sp, lp](const at::Tensor& hidden, const at::Tensor& weight) {
      at::Tensor h = sp ? tp::all_gather_tp(hidden, 1, group) : tp::copy_to_tp(hidden, group);
      at::Tensor logits = h.matmul(weight.t());
      return lp ? logits : tp::gather_from_tp(logits, -1, group);
    });
  }
  if (!lp) return next_token_loss;
  return [group](const at::Tensor& logits, const at::Tensor& targets) {
    return tp::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), group);
  };
}

}  // namespace fsdp::examples

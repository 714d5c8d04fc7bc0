#include "fsdp_cpp/composable/context_parallel.h"
#include "fsdp_cpp/models/llama_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include "fsdp_cpp/composable/loss_parallel.h"
#include "fsdp_cpp/composable/tp_collectives.h"
#include "fsdp_cpp/composable/wrap_policy.h"
#include "fsdp_cpp/pipeline/stage_split.h"

namespace fsdp::models {

TensorParallelPlan llama_tensor_parallel_plan(const LlamaForCausalLMImpl& model, const LlamaParallel& options) {
  const bool sp = options.sequence_parallel();
  const Layout seq = Layout::shard(1), rep = Layout::replicate();
  const Layout in = sp ? seq : rep;  // what the projections reading the residual stream get
  TensorParallelPlan plan;
  if (model.is_first_stage()) {
    plan.emplace_back("model.embed_tokens", RowwiseParallel().input_layout(rep).output_layout(in));
  }
  if (!model.model->layers->is_empty()) {
    for (const char* name : {"q_proj", "k_proj", "v_proj"}) {
      plan.emplace_back(std::string("model.layers.*.self_attn.") + name, ColwiseParallel().input_layout(in));
    }
    plan.emplace_back("model.layers.*.self_attn.o_proj", RowwiseParallel().output_layout(in));
    plan.emplace_back("model.layers.*.mlp.gate_proj", ColwiseParallel().input_layout(in));
    plan.emplace_back("model.layers.*.mlp.up_proj", ColwiseParallel().input_layout(in));
    plan.emplace_back("model.layers.*.mlp.down_proj", RowwiseParallel().output_layout(in));
    if (sp) {
      plan.emplace_back("model.layers.*.input_layernorm", SequenceParallel());
      plan.emplace_back("model.layers.*.post_attention_layernorm", SequenceParallel());
    }
  }
  if (model.is_last_stage() && sp) plan.emplace_back("model.norm", SequenceParallel());
  if (!model.lm_head.is_empty()) {
    plan.emplace_back("lm_head", ColwiseParallel().input_layout(in).output_layout(
                                     options.loss_parallel() ? Layout::shard(-1) : Layout::replicate()));
  }
  return plan;
}

namespace {

parallel::LossFn whole_logits_loss(int64_t ignore_index) {
  return [ignore_index](const at::Tensor& logits, const at::Tensor& targets) {
    return causal_lm_loss(logits, targets, ignore_index);
  };
}

}  // namespace

parallel::LossFn parallelize_llama(LlamaForCausalLM& model, const std::shared_ptr<comm::Communicator>& group,
                                   const LlamaParallel& options) {
  const LlamaConfig& c = model->config();
  const int64_t n = group->size();
  auto divisible = [&](int64_t value, const char* what) {
    TORCH_CHECK(value % n == 0, "parallelize_llama: ", what, " (", value, ") must be divisible by the tensor-parallel "
                "size ", n);
  };
  divisible(c.num_attention_heads(), "num_attention_heads");
  divisible(c.kv_heads(), "num_key_value_heads (grouped-query attention splits whole key/value heads)");
  divisible(c.intermediate_size(), "intermediate_size");
  TORCH_CHECK(c.padded_vocab_size() % n == 0, "parallelize_llama: the vocabulary (", c.vocab_size(), " rows, padded to ",
              c.padded_vocab_size(), " with LlamaConfig::vocab_multiple ", c.vocab_multiple(), ") must be divisible by "
              "the tensor-parallel size ", n, "; choose a vocab_multiple that is a multiple of it");
  parallelize_module(*model, group, llama_tensor_parallel_plan(*model, options));
  const bool lp = options.loss_parallel();
  if (c.tie_word_embeddings() && model->is_last_stage()) {
    // The tied output layer: the embedding's vocabulary rows of this rank (RowwiseParallel on the
    // embedding), the hidden states entering whole (their gradient summed over the group).
    const bool sp = options.sequence_parallel();
    model->set_output_layer([group, lp, sp](const at::Tensor& hidden, const at::Tensor& weight) {
      const at::Tensor h = sp ? tp::all_gather_tp(hidden, 1, group) : tp::copy_to_tp(hidden, group);
      const at::Tensor logits = h.matmul(weight.t());
      return lp ? logits : tp::gather_from_tp(logits, -1, group);
    });
  }
  if (!lp) return whole_logits_loss(options.ignore_index());
  model->set_keep_padded_logits(true);
  const int64_t vocab = c.vocab_size(), ignore = options.ignore_index();
  return [group, vocab, ignore](const at::Tensor& logits, const at::Tensor& targets) {
    return tp::vocab_parallel_cross_entropy(
        logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), group,
        tp::VocabParallelCrossEntropyOptions().ignore_index(ignore).vocab_size(vocab));
  };
}

void context_parallelize_llama(LlamaForCausalLM& model, const std::shared_ptr<comm::Communicator>& group) {
  TORCH_CHECK(group != nullptr, "context_parallelize_llama: expected a context-parallel group, found none");
  for (auto& layer : model->layer_list()) layer->self_attn->set_context_parallel(group);
}

int64_t llama_ring_bytes_per_step(const LlamaConfig& config, const parallel::ParallelDims& dims, int64_t rows,
                                  int64_t seq, int microbatches, bool activation_checkpointing) {
  if (dims.cp <= 1) return 0;
  const int64_t per_attention = cp::ring_attention_bytes_per_rank(
      rows / microbatches, config.kv_heads() / dims.tp, seq / dims.cp, config.head_size(), dims.cp, at::kFloat,
      /*backward=*/true);
  const int64_t recompute = activation_checkpointing
                                ? cp::ring_attention_bytes_per_rank(rows / microbatches, config.kv_heads() / dims.tp,
                                                                    seq / dims.cp, config.head_size(), dims.cp,
                                                                    at::kFloat, /*backward=*/false)
                                : 0;
  return (per_attention + recompute) * microbatches * (config.num_hidden_layers() / dims.pp);
}

parallel::ModelSpec llama_model_spec(const LlamaConfig& config, uint64_t init_seed, const LlamaParallel& options) {
  config.validate();
  parallel::ModelSpec spec;
  spec.build = [config, init_seed](int stage, int n_stages) {
    torch::manual_seed(init_seed);  // every stage is cut from the same whole model
    LlamaForCausalLM model(config);
    if (n_stages > 1) {
      const auto ranges = pipeline::split_blocks_evenly(config.num_hidden_layers(), n_stages);
      model->keep_stage(ranges[stage], stage == 0, stage == n_stages - 1);
    }
    return parallel::ModelPart{model.ptr(), [model](const at::Tensor& x) mutable { return model(x); }};
  };
  spec.loss = whole_logits_loss(options.ignore_index());
  spec.ignore_index = options.ignore_index();
  spec.units = WrapPolicy::module_types<LlamaDecoderLayerImpl>();
  spec.tensor_parallel = [options](parallel::ModelPart& part, const std::shared_ptr<comm::Communicator>& group) {
    LlamaForCausalLM model(std::dynamic_pointer_cast<LlamaForCausalLMImpl>(part.module));
    parallel::LossFn loss = parallelize_llama(model, group, options);
    return options.loss_parallel() ? loss : parallel::LossFn{};
  };
  spec.context_parallel = [](parallel::ModelPart& part, const std::shared_ptr<comm::Communicator>& group) {
    LlamaForCausalLM model(std::dynamic_pointer_cast<LlamaForCausalLMImpl>(part.module));
    context_parallelize_llama(model, group);
  };
  return spec;
}

}  // namespace fsdp::models

#include "fsdp_cpp/models/moe_parallel.h"

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include "fsdp_cpp/composable/loss_parallel.h"
#include "fsdp_cpp/composable/tp_collectives.h"
#include "fsdp_cpp/composable/wrap_policy.h"
#include "fsdp_cpp/parallel/parallel_dims.h"
#include "fsdp_cpp/pipeline/stage_split.h"

namespace fsdp::models {

TensorParallelPlan moe_tensor_parallel_plan(MoeForCausalLMImpl& model, const MoeParallel& options) {
  TensorParallelPlan plan;
  auto add = [&](const std::string& pattern, ParallelStyle style) {
    if (!match_modules(model, pattern).empty()) plan.emplace_back(pattern, std::move(style));
  };
  if (model.is_first_stage()) {
    plan.emplace_back("model.embed_tokens",
                      RowwiseParallel().input_layout(Layout::replicate()).output_layout(Layout::replicate()));
  }
  for (const char* name : {"q_proj", "k_proj", "v_proj"}) add(std::string("model.layers.*.self_attn.") + name, ColwiseParallel());
  add("model.layers.*.self_attn.o_proj", RowwiseParallel());
  // Dense layers, each expert, the shared experts: SwiGLU split by columns, then rows.
  for (const std::string prefix : {"model.layers.*.mlp.", "model.layers.*.mlp.experts.*.", "model.layers.*.mlp.shared_experts."}) {
    add(prefix + "gate_proj", ColwiseParallel());
    add(prefix + "up_proj", ColwiseParallel());
    add(prefix + "down_proj", RowwiseParallel());
  }
  if (!model.lm_head.is_empty()) {
    plan.emplace_back("lm_head", ColwiseParallel().output_layout(options.loss_parallel() ? Layout::shard(-1)
                                                                                           : Layout::replicate()));
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

parallel::LossFn moe_loss(const MoeConfig& config, parallel::LossFn base) {
  if (!config.has_aux_loss()) return base;
  return [config, base = std::move(base)](const at::Tensor& output, const at::Tensor& targets) {
    TORCH_CHECK(targets.dim() == 2, "moe_loss: expected targets [batch, time], got ", targets.sizes());
    auto [logits, stats] = split_router_stats(output, targets.size(1), config.num_experts());
    const at::Tensor ce = base(logits, targets);
    return ce + config.router_aux_loss_coef() * moe_aux_loss(stats, config, targets.numel()).to(ce.scalar_type());
  };
}

parallel::LossFn parallelize_moe(MoeForCausalLM& model, const std::shared_ptr<comm::Communicator>& group,
                                 const MoeParallel& options) {
  const MoeConfig& c = model->config();
  const int64_t n = group->size();
  auto divisible = [&](int64_t value, const char* what) {
    TORCH_CHECK(value % n == 0, "parallelize_moe: ", what, " (", value, ") must be divisible by the tensor-parallel "
                "size ", n);
  };
  divisible(c.num_attention_heads(), "num_attention_heads");
  divisible(c.kv_heads(), "num_key_value_heads (grouped-query attention splits whole key/value heads)");
  divisible(c.moe_intermediate_size(), "moe_intermediate_size (each expert's columns)");
  if (c.num_sparse_layers() < c.num_hidden_layers()) divisible(c.intermediate_size(), "intermediate_size (dense layers)");
  if (c.n_shared_experts() > 0) {
    divisible(c.moe_intermediate_size() * c.n_shared_experts(), "moe_intermediate_size * n_shared_experts");
  }
  TORCH_CHECK(c.padded_vocab_size() % n == 0, "parallelize_moe: the vocabulary (", c.vocab_size(), " rows, padded to ",
              c.padded_vocab_size(), " with MoeConfig::vocab_multiple ", c.vocab_multiple(), ") must be divisible by "
              "the tensor-parallel size ", n, "; choose a vocab_multiple that is a multiple of it");
  parallelize_module(*model, group, moe_tensor_parallel_plan(*model, options));
  if (n > 1) {
    // q_norm and k_norm normalize this rank's heads only: their gradients are summed over tp.
    for (auto& layer : model->layer_list()) {
      layer->self_attn->set_head_norm_weight_fn(
          [group](const at::Tensor& weight) { return tp::copy_to_tp(weight, group); });
    }
  }
  const bool lp = options.loss_parallel();
  if (c.tie_word_embeddings() && model->is_last_stage()) {
    model->set_output_layer([group, lp](const at::Tensor& hidden, const at::Tensor& weight) {
      const at::Tensor logits = tp::copy_to_tp(hidden, group).matmul(weight.t());
      return lp ? logits : tp::gather_from_tp(logits, -1, group);
    });
  }
  if (!lp) return moe_loss(c, whole_logits_loss(options.ignore_index()));
  model->set_keep_padded_logits(true);
  const int64_t vocab = c.vocab_size(), ignore = options.ignore_index();
  return moe_loss(c, [group, vocab, ignore](const at::Tensor& logits, const at::Tensor& targets) {
    return tp::vocab_parallel_cross_entropy(
        logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), group,
        tp::VocabParallelCrossEntropyOptions().ignore_index(ignore).vocab_size(vocab));
  });
}

int64_t moe_all_to_all_bytes_per_step(const MoeConfig& config, const parallel::ParallelDims& dims, int64_t rows,
                                      int64_t seq, int microbatches) {
  if (dims.ep <= 1) return 0;
  const int64_t pairs = rows / microbatches * (seq / dims.cp) * config.num_experts_per_tok();
  const int64_t row_bytes = config.hidden_size() * 4;
  const int64_t forward = 2 * pairs * row_bytes;  // dispatch, combine
  const int64_t per_layer = 2 * forward;  // the backward sends as much
  return per_layer * microbatches * (config.num_sparse_layers() / dims.pp);
}

void expert_parallelize_moe(MoeForCausalLM& model, const std::shared_ptr<comm::Communicator>& group) {
  const MoeConfig& c = model->config();
  TORCH_CHECK(group != nullptr, "expert_parallelize_moe: expected an expert-parallel group, found none");
  TORCH_CHECK(c.num_experts() % group->size() == 0, "expert_parallelize_moe: num_experts (", c.num_experts(),
              ") must be divisible by the expert-parallel size ", group->size(), ": each ep rank holds num_experts / ep "
              "experts");
  for (auto& layer : model->layer_list()) {
    if (layer->moe.is_empty()) continue;
    const std::string name = "model.layers." + std::to_string(layer->moe->last_routing().layer) + ".mlp";
    layer->moe->set_expert_parallel(std::make_shared<ep::ExpertParallel>(group, c.num_experts(), name));
  }
}

parallel::ModelSpec moe_model_spec(const MoeConfig& config, uint64_t init_seed, const MoeParallel& options) {
  config.validate();
  parallel::ModelSpec spec;
  spec.build = [config, init_seed](int stage, int n_stages) {
    torch::manual_seed(init_seed);  // every stage is cut from the same whole model
    MoeForCausalLM model(config);
    if (n_stages > 1) {
      const auto ranges = pipeline::split_blocks_evenly(config.num_hidden_layers(), n_stages);
      model->keep_stage(ranges[stage], stage == 0, stage == n_stages - 1);
    }
    if (config.has_aux_loss()) model->set_router_stats_output(true);
    return parallel::ModelPart{model.ptr(), [model](const at::Tensor& x) mutable { return model(x); }};
  };
  spec.loss = moe_loss(config, whole_logits_loss(options.ignore_index()));
  spec.ignore_index = options.ignore_index();
  spec.units = WrapPolicy::module_types<MoeDecoderLayerImpl, MoeExpertImpl>();
  spec.experts = WrapPolicy::module_types<MoeExpertImpl>();
  spec.expert_parallel = [](parallel::ModelPart& part, const std::shared_ptr<comm::Communicator>& group) {
    MoeForCausalLM model(std::dynamic_pointer_cast<MoeForCausalLMImpl>(part.module));
    expert_parallelize_moe(model, group);
  };
  // A module holding units cannot be checkpointed (composable/activation_checkpoint.h): the
  // attention and the MLPs (experts, shared, dense) are, not the decoder layers.
  spec.checkpoint = WrapPolicy::module_types<MoeAttentionImpl, LlamaMlpImpl>();
  spec.tensor_parallel = [options](parallel::ModelPart& part, const std::shared_ptr<comm::Communicator>& group) {
    MoeForCausalLM model(std::dynamic_pointer_cast<MoeForCausalLMImpl>(part.module));
    parallel::LossFn loss = parallelize_moe(model, group, options);
    return options.loss_parallel() ? loss : parallel::LossFn{};
  };
  return spec;
}

void update_moe_router_bias(parallel::ParallelModel& model) {
  std::vector<std::shared_ptr<MoeForCausalLMImpl>> parts;
  std::vector<at::Tensor> loads;
  int64_t total = 0;
  for (const auto& part : model.parts()) {
    auto m = std::dynamic_pointer_cast<MoeForCausalLMImpl>(part.module);
    TORCH_CHECK(m != nullptr, "update_moe_router_bias: a part of the model is not a MoeForCausalLM");
    parts.push_back(m);
    loads.push_back(m->router_loads());
    total += loads.back().numel();
  }
  if (total == 0) return;  // no sigmoid scoring: the same on every rank (one config)
  std::vector<at::Tensor> flat;
  for (const auto& l : loads) flat.push_back(l.reshape({-1}));
  at::Tensor sum = at::cat(flat);
  const auto& dp = model.mesh().dp();
  if (dp->size() > 1) {
    sum = sum.to(dp->device());
    dp->all_reduce(sum, c10d::ReduceOp::SUM, "update_moe_router_bias").wait();
    sum = sum.cpu();
  }
  int64_t offset = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t n = loads[i].numel();
    parts[i]->update_router_bias(sum.narrow(0, offset, n).view(loads[i].sizes()));
    offset += n;
  }
}

}  // namespace fsdp::models

#pragma once
// What the Qwen3-MoE model (models/moe.h) supplies to the composition root
// (parallel/parallel_model.h), as models/llama_parallel.h does for Llama: pipeline stages cut from
// the whole model built from a seed, the next-token loss (ignore_index -100) plus the auxiliary
// loss, the tensor-parallel plan, the units (each decoder layer and each expert) and the
// activation-checkpointing policy (each attention and each MLP: the experts, shared experts and
// dense layers' MLPs; a decoder layer holds units, which cannot be checkpointed from outside).
//
//   auto config = fsdp::models::read_moe_config(hf_dir, /*vocab_multiple=*/64);
//   auto model = fsdp::parallel::parallelize(pg.comm, fsdp::models::moe_model_spec(config, 0), options);
//   fsdp::models::load_moe_hf(model, config, hf_dir);            // models/moe_checkpoint.h
//   for (...) {
//     model.forward_backward(inputs, targets);
//     optim.step();
//     fsdp::models::update_moe_router_bias(model);               // sigmoid scoring with a rate
//     model.zero_grad();
//   }
//
// The tensor-parallel plan, FQNs of models/moe.h:
//   model.embed_tokens, model.layers.*.self_attn.*, lm_head    as Llama's (models/llama_parallel.h:
//                                    grouped-query attention splits whole key/value heads)
//   model.layers.*.self_attn.{q,k}_norm   replicated, their gradients all-reduced over tp (each
//                                    rank normalizes its own heads: transformers'
//                                    replicated_with_grad_allreduce)
//   model.layers.*.mlp.gate          the router: replicated (every tp rank routes the same tokens
//                                    alike; its gradient is whole on every tp rank, like the norms')
//   model.layers.*.mlp.experts.*.{gate,up}_proj    ColwiseParallel (each expert's own columns)
//   model.layers.*.mlp.experts.*.down_proj         RowwiseParallel (each expert's output
//                                    all-reduced over tp, an empty one when it got no rows: the tp
//                                    ranks route alike, so they call the same experts)
//   model.layers.*.mlp.shared_experts.*, dense layers' model.layers.*.mlp.*   as Llama's MLP
// tp must divide num_attention_heads, num_key_value_heads, moe_intermediate_size (and
// intermediate_size with dense layers, moe_intermediate_size * n_shared_experts) and the padded
// vocabulary: refused otherwise, naming the size.
//
// [Note: auxiliary loss in the training loss] With output_router_logits (and a non-zero
// router_aux_loss_coef) every stage's output carries its router statistics ([Note: router
// statistics in the output] in models/moe.h) and the loss of the last stage's output is
//   cross-entropy (mean over counted targets) + router_aux_loss_coef * aux (the microbatch's),
// transformers' loss for one batch. ModelSpec::ignore_index then weights each microbatch's whole
// loss by its counted targets ([Note: token-weighted loss]): the step trains
//   sum_j (n_j / N) * (cross-entropy_j + coef * aux_j)
// over the microbatches j of every data rank (n_j counted targets of N). That is transformers'
// loss on the whole batch at one data rank and one microbatch; otherwise the auxiliary term is
// that of each microbatch's own routing (its tokens' balance), weighted like its cross-entropy:
// the global loss depends on the split (dp x microbatches) only through aux.

#include <cstdint>
#include <memory>

#include <torch/arg.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/tensor_parallel.h"
#include "fsdp_cpp/models/moe.h"
#include "fsdp_cpp/parallel/parallel_model.h"

namespace fsdp::models {

struct MoeParallel {
  /// Vocabulary-parallel logits and loss.
  TORCH_ARG(bool, loss_parallel) = true;
  /// Target id that does not count in the loss.
  TORCH_ARG(int64_t, ignore_index) = -100;
};

/// The plan for `model` as it is (on a pipeline stage only the entries of what the stage holds).
TensorParallelPlan moe_tensor_parallel_plan(MoeForCausalLMImpl& model, const MoeParallel& options);

/// Applies the plan over `group` (before fully_shard; after keep_stage) and returns the loss of
/// the last stage's output (with the auxiliary loss when the config has it).
parallel::LossFn parallelize_moe(MoeForCausalLM& model, const std::shared_ptr<comm::Communicator>& group,
                                 const MoeParallel& options = {});

/// The loss of a MoeForCausalLM's output: `base` (cross-entropy of logits against targets) on the
/// logits, plus router_aux_loss_coef * aux when config.has_aux_loss() ([Note: auxiliary loss in
/// the training loss]).
parallel::LossFn moe_loss(const MoeConfig& config, parallel::LossFn base);

/// The spec above: units = MoeDecoderLayerImpl and MoeExpertImpl, checkpoint = MoeAttentionImpl and
/// LlamaMlpImpl (MoeExpertImpl derives from it).
/// Expert parallel on every sparse layer of `model` over `group` (ep): each keeps num_experts / ep
/// experts and dispatches tokens with all-to-alls (MoeSparseBlock::set_expert_parallel). Refused,
/// naming the layer, when ep does not divide num_experts.
void expert_parallelize_moe(MoeForCausalLM& model, const std::shared_ptr<comm::Communicator>& group);

/// The bytes of one training step's expert-parallel all-to-alls on one rank, as
/// comm::Communicator counts them (the inputs: each layer's N*k pair rows dispatched and the rows
/// received back, forward and backward; activation checkpointing recomputes the experts, not the
/// dispatch, so it adds nothing), with
/// balanced routing (a rank receives as many pair rows as it sends): `rows` sequences of `seq`
/// tokens per data rank in `microbatches`, float32, num_sparse_layers / pp sparse layers on the
/// rank. The measured figure moves with the routing; fsdp::ep::all_to_all_bytes gives it exactly
/// for one layer. 0 when ep is 1.
int64_t moe_all_to_all_bytes_per_step(const MoeConfig& config, const parallel::ParallelDims& dims, int64_t rows,
                                      int64_t seq, int microbatches);

parallel::ModelSpec moe_model_spec(const MoeConfig& config, uint64_t init_seed, const MoeParallel& options = {});

/// [Note: aux-loss-free balancing]: sums every held sparse layer's expert loads over the job's
/// data-parallel ranks (mesh().dp(): the ranks of this rank's stage and tp rank; the tp ranks of a
/// group route the same tokens, the stages hold different layers) and updates each router's
/// e_score_correction_bias from the sum. Collective over the data-parallel group; call it once per
/// step (after forward_backward), on every rank. Nothing to do (no collective) without sigmoid
/// scoring.
void update_moe_router_bias(parallel::ParallelModel& model);

}  // namespace fsdp::models

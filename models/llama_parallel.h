#pragma once
// What the Llama model supplies to the composition root (parallel/parallel_model.h): each
// pipeline stage cut from the whole model built from a seed (LlamaForCausalLM::keep_stage, so
// stages keep the whole model's FQNs and values), the next-token loss with ignore_index (-100,
// transformers' label padding), its tensor-parallel plan, its units (each decoder layer) and the
// activation-checkpointing policy (the same layers).
//
//   auto config = fsdp::models::read_llama_config(hf_dir, /*vocab_multiple=*/64);
//   auto spec = fsdp::models::llama_model_spec(config, /*init_seed=*/0);
//   auto model = fsdp::parallel::parallelize(pg.comm, spec, options);
//   fsdp::models::load_hf_checkpoint(model, hf_dir);            // models/hf_checkpoint.h
//
// The tensor-parallel plan (Megatron style, torchtitan's for Llama), FQNs of models/llama.h:
//   model.embed_tokens               RowwiseParallel: vocabulary rows (ids outside a rank's rows
//                                    give zeros), output Replicate (all-reduced)
//   model.layers.*.self_attn.{q,k,v}_proj   ColwiseParallel: this rank's query heads and its
//                                    key/value heads (grouped-query attention: num_key_value_heads
//                                    must be divisible by tp, refused otherwise, naming it)
//   model.layers.*.self_attn.o_proj  RowwiseParallel (output all-reduced)
//   model.layers.*.mlp.{gate,up}_proj     ColwiseParallel
//   model.layers.*.mlp.down_proj     RowwiseParallel
//   lm_head                          ColwiseParallel: output Shard(-1) with loss parallel (the
//                                    loss is vocab_parallel_cross_entropy on the pieces, the
//                                    padding columns excluded), else Replicate (all-gathered,
//                                    padding cut off). A tied model computes the same from the
//                                    embedding's rows.
// With sequence_parallel (Megatron's SP, torchtitan's default with tp), the residual stream
// between the projections is this rank's positions (Shard(1)): the embedding's output and
// o_proj/down_proj's are reduce-scattered, the norms (RMSNorm is a PerPositionModule) run on the
// local positions with their weights' gradients summed over the group, and each column-parallel
// projection all-gathers its input (q, k and v each gather: three all-gathers per attention, two
// per MLP, where a fused projection would need one); the sequence length must be divisible by tp.
// A pipeline stage then passes on this rank's positions. The padded vocabulary ([Note: padded
// vocabulary] in models/llama.h) must be divisible by tp: refused otherwise, naming
// LlamaConfig::vocab_multiple.

#include <cstdint>
#include <memory>

#include <torch/arg.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/tensor_parallel.h"
#include "fsdp_cpp/models/llama.h"
#include "fsdp_cpp/parallel/parallel_model.h"

namespace fsdp::models {

struct LlamaParallel {
  /// Sequence parallelism (see above): activations between the layers shrink by tp.
  TORCH_ARG(bool, sequence_parallel) = false;
  /// Vocabulary-parallel logits and loss (no [batch, time, vocab] tensor is gathered).
  TORCH_ARG(bool, loss_parallel) = true;
  /// Target id that does not count in the loss (transformers' label padding).
  TORCH_ARG(int64_t, ignore_index) = -100;
};

/// The plan for `model` as it is (on a pipeline stage only the entries of what the stage holds).
TensorParallelPlan llama_tensor_parallel_plan(const LlamaForCausalLMImpl& model, const LlamaParallel& options);

/// Applies the plan to `model` over `group` (before fully_shard; after keep_stage on a stage) and
/// returns the loss of the last stage's output. Refused with a c10::Error naming the sizes when
/// tp does not divide num_attention_heads, num_key_value_heads, intermediate_size or the padded
/// vocabulary.
parallel::LossFn parallelize_llama(LlamaForCausalLM& model, const std::shared_ptr<comm::Communicator>& group,
                                   const LlamaParallel& options = {});

/// Context parallel: every attention of `model` attends over the sequence split across `group`
/// (fsdp::cp::ring_attention; rotary positions global). The inputs and targets must be split the
/// same way (fsdp::cp::shard_sequence, load-balanced; the composition root does it with cp > 1).
void context_parallelize_llama(LlamaForCausalLM& model, const std::shared_ptr<comm::Communicator>& group);

/// The bytes one rank sends through the context-parallel ring in one training step (closed form:
/// fsdp::cp::ring_attention_bytes_per_rank per attention, forward and backward, again for the
/// forward recomputed under activation checkpointing), for `rows` sequences of `seq` tokens per
/// data rank in `microbatches`, float32 activations, on a rank holding num_hidden_layers / pp
/// layers. 0 when cp is 1.
int64_t llama_ring_bytes_per_step(const LlamaConfig& config, const parallel::ParallelDims& dims, int64_t rows,
                                  int64_t seq, int microbatches, bool activation_checkpointing);

/// The spec above.
parallel::ModelSpec llama_model_spec(const LlamaConfig& config, uint64_t init_seed, const LlamaParallel& options = {});

}  // namespace fsdp::models

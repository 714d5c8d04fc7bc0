#pragma once
// Tensor parallelism for the example GPT, Megatron-style: attention heads and the MLP's hidden
// features split over the tensor-parallel group, the tied token embedding split over the
// vocabulary (so the output layer gives vocabulary-parallel logits).
//
//   auto mesh = fsdp::comm::DeviceMesh::create(*pg.comm, {2, 2}, {"dp", "tp"});
//   auto loss_fn = fsdp::examples::parallelize_gpt(
//       model, mesh->group("tp"), fsdp::examples::GptTensorParallel().sequence_parallel(true));
//   for (auto& block : model->block_list())
//     fsdp::fully_shard(block, fsdp::FullyShardOptions().communicator(mesh->group("dp")));
//   fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(mesh->group("dp")));
//   at::Tensor loss = loss_fn(model(tokens), targets);
//
// The plan (FQNs of examples/gpt_model.h):
//   tok_emb              RowwiseParallel (vocabulary rows; output Replicate, or Shard(1) with SP)
//   pos_emb              with SP: PrepareModuleOutput Replicate -> Shard(0) (its positions)
//   blocks.*.attn.qkv    ColwiseParallel, 3 blocks (each rank its heads of q, k, v);
//                        input Replicate, or Shard(1) with SP (all-gathered)
//   blocks.*.attn.proj   RowwiseParallel (output Replicate: all-reduce; Shard(1) with SP:
//                        reduce-scatter)
//   blocks.*.mlp.fc      ColwiseParallel (as qkv, one block)
//   blocks.*.mlp.proj    RowwiseParallel (as attn.proj)
//   blocks.*.ln1/ln2, ln_f   with SP: SequenceParallel
//   output layer         ln_f's output (all-gathered with SP) times this rank's vocabulary rows:
//                        logits [B, T, V/n]; gathered to [B, T, V] unless loss_parallel.
//                        Tied: tok_emb's rows, through GPT::set_output_layer. Untied
//                        (tie_embeddings(false)): head is ColwiseParallel (input Replicate, or
//                        Shard(1) with SP; output Shard(-1) with loss_parallel, else Replicate).
// Dropout (GPTConfig::dropout): each site draws through fsdp::tp::dropout with its layout (the
// attention probabilities: this rank's heads; embeddings and residual branches: replicated, or this
// rank's positions with SP), so with the ranks' generators seeded alike the masks are those of the
// unsharded model ([Note: tensor-parallel RNG] in composable/tp_random.h).
// A pipeline stage (GPT::keep_stage) gets the entries of the modules it holds: tok_emb and pos_emb
// only on the first stage, ln_f and the output layer only on the last, the blocks' entries when it
// holds blocks. With SP the hidden states a stage passes on are this rank's positions.
// Needs n_heads, 4 * d_model and vocab_size divisible by the group size (and the sequence length
// with SP); parallelize_module names the dimension that does not divide.

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/tensor_parallel.h"
#include "fsdp_cpp/examples/gpt_model.h"

namespace fsdp::examples {

struct GptTensorParallel {
  /// LayerNorms and residual stream sharded along the sequence (activations shrink by n).
  TORCH_ARG(bool, sequence_parallel) = false;
  /// The model returns vocabulary-parallel logits [B, T, V/n]; gpt_loss computes the loss on them
  /// without gathering (fsdp::tp::vocab_parallel_cross_entropy).
  TORCH_ARG(bool, loss_parallel) = false;
};

/// The plan above as data (for printing or extending), for the whole tied model.
TensorParallelPlan gpt_tensor_parallel_plan(const GptTensorParallel& options);

/// The plan for `model` as it is: its output layer (tied or head) and, on a pipeline stage, only
/// the entries of the modules the stage holds.
TensorParallelPlan gpt_tensor_parallel_plan(const GPTImpl& model, const GptTensorParallel& options);

/// The next-token loss of the model's output (logits, targets) -> mean loss.
using GptLossFunction = std::function<at::Tensor(const at::Tensor& logits, const at::Tensor& targets)>;

/// Applies the plan and the tensor-parallel output layer to `model` over `group` (before
/// fully_shard; on a pipeline stage, after GPT::keep_stage). Returns the loss to use on the
/// model's output (the last stage's): next_token_loss on whole logits, or the
/// vocabulary-parallel cross-entropy with loss_parallel.
GptLossFunction parallelize_gpt(GPT& model, const std::shared_ptr<comm::Communicator>& group,
                                const GptTensorParallel& options = {});

}  // namespace fsdp::examples

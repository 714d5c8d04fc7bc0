#pragma once
// Qwen3-MoE (Hugging Face transformers' Qwen3MoeForCausalLM) in C++, with DeepSeek-V3-style
// routing options, written as models/llama.h is: every module that becomes a unit (each decoder
// layer, each expert, the root) is hook-able and called through its holder. FQNs are the keys
// transformers saves (its checkpoints hold one module per expert; transformers 5 fuses them into
// 3-d tensors in memory only), so a checkpoint loads by name (models/moe_checkpoint.h):
//
//   model.embed_tokens.weight                       [padded_vocab, hidden]
//   model.layers.<i>.input_layernorm.weight         x = x + self_attn(input_layernorm(x))
//   model.layers.<i>.self_attn.{q,k,v,o}_proj.weight   grouped-query attention (as Llama's)
//   model.layers.<i>.self_attn.{q,k}_norm.weight    RMSNorm over head_dim, applied to each head of
//                                                   q and k before the rotary embedding
//   model.layers.<i>.post_attention_layernorm.weight   x = x + mlp(post_attention_layernorm(x))
//   a sparse layer (see MoeConfig::is_sparse_layer):
//   model.layers.<i>.mlp.gate.weight                the router, Linear hidden -> num_experts, no bias
//   model.layers.<i>.mlp.gate.e_score_correction_bias   [num_experts] buffer, sigmoid scoring only
//   model.layers.<i>.mlp.experts.<e>.{gate,up,down}_proj.weight   expert e: SwiGLU of
//                                                   moe_intermediate_size
//   model.layers.<i>.mlp.shared_experts.{gate,up,down}_proj.weight   with n_shared_experts > 0:
//                                                   SwiGLU of moe_intermediate_size * n_shared_experts,
//                                                   on every token (DeepSeek's names)
//   a dense layer:
//   model.layers.<i>.mlp.{gate,up,down}_proj.weight     SwiGLU of intermediate_size
//   model.norm.weight, lm_head.weight               as Llama's ([Note: padded vocabulary])
//
// [Note: MoE routing] The router's logits are Linear(x) for the N = batch x time tokens, then:
//   softmax scoring (Qwen3-MoE, transformers' Qwen3MoeTopKRouter): p = softmax(logits) in float32,
//     the top num_experts_per_tok of p, divided by their sum when norm_topk_prob, cast back to the
//     logits' dtype;
//   sigmoid scoring (DeepSeek-V3, transformers' DeepseekV3TopkRouter): s = sigmoid(logits) in
//     float32; the choice ranks s + e_score_correction_bias (the bias only chooses: the weights
//     are s), limited to the topk_group best of n_group groups of experts (a group's score: the sum
//     of its two best), then the weights are s of the chosen experts, divided by their sum (+1e-20)
//     when norm_topk_prob.
//   Either way the weights are multiplied by routed_scaling_factor (1 by default). Then, as
//   transformers' experts loop: every expert e in order 0 .. num_experts - 1 is called, on every
//   rank, with the rows routed to it (in (top-k position, token) order, possibly none: an empty
//   batch, so that the expert's fully_shard collectives run on every rank; docs/fully_shard.md "Parameters some
//   ranks do not use"), its output multiplied by the rows' weights and added at the rows
//   (index_add); the shared experts' output is added to the sum.
//
// [Note: aux-loss-free balancing] With sigmoid scoring each router counts, in every forward run
// with gradients enabled, the tokens its experts got (the load; a recomputed forward counts again:
// every expert's count doubles, which changes no sign). MoeForCausalLMImpl::update_router_bias
// then adds router_bias_update_rate * sign(mean(load) - load) to e_score_correction_bias (outside
// autograd) and clears the counts; models/moe_parallel.h's update_moe_router_bias first sums the
// loads over the data-parallel ranks, so that every replica applies the same update, that of the
// whole global batch (the step's microbatches included).
//
// [Note: MoE auxiliary loss] transformers' load_balancing_loss_func, over the sparse layers:
//   aux = E * sum_e (C_e / (L * N)) * (P_e / (L * N)),
// C_e: the tokens whose top-k of softmax(logits) holds e, P_e: the sum of softmax(logits)[e], both
// summed over the L sparse layers and the N tokens; only P carries a gradient. The training loss
// (models/moe_parallel.h) adds router_aux_loss_coef * aux when output_router_logits is set, as
// transformers' forward with labels does. Softmax of the logits whatever the scoring (what
// load_balancing_loss_func computes from any router's logits). The sums are per row: the model
// carries them in its output (set_router_stats_output), the loss computes aux from them.
//
// [Note: router statistics in the output] With set_router_stats_output(true) forward returns
// [batch, K + 2E]: K = the usual output flattened per row (logits of time x width columns on the
// last stage, hidden states of time x hidden on the others), then per row P_b (E columns, with
// gradient) and C_b (E columns) summed over the sparse layers run so far. A later pipeline
// stage's forward takes such a tensor and continues the sums, so the last stage's output holds
// every sparse layer's sums and the gradient of aux reaches every stage's routers through the
// pipeline's ordinary backward. split_router_stats takes the parts apart.
//
// Pipeline stages: keep_stage(layers, first, last), as Llama's.

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/composable/expert_parallel.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_module_list.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/models/llama.h"
#include "fsdp_cpp/pipeline/stage_split.h"

namespace fsdp::models {

/// The shape of a Qwen3-MoE model: transformers' Qwen3MoeConfig fields, and DeepSeek-V3's routing
/// options (config.json keys of DeepseekV3Config where it has them).
///
///   auto config = fsdp::models::MoeConfig(/*vocab_size=*/512).hidden_size(64).num_experts(8);
///   auto config = fsdp::models::read_moe_config("/models/Qwen3-30B-A3B");   // config.json
struct MoeConfig {
  explicit MoeConfig(int64_t vocab_size = 151936) : vocab_size_(vocab_size) {}

  /// Fails with a c10::Error naming MoeConfig, the first invalid field and its value.
  void validate() const;

  TORCH_ARG(int64_t, vocab_size);
  TORCH_ARG(int64_t, hidden_size) = 2048;
  /// The dense layers' SwiGLU width.
  TORCH_ARG(int64_t, intermediate_size) = 6144;
  /// Each expert's SwiGLU width.
  TORCH_ARG(int64_t, moe_intermediate_size) = 768;
  TORCH_ARG(int64_t, num_hidden_layers) = 24;
  TORCH_ARG(int64_t, num_attention_heads) = 32;
  /// 0 means num_attention_heads.
  TORCH_ARG(int64_t, num_key_value_heads) = 4;
  /// 0 means hidden_size / num_attention_heads.
  TORCH_ARG(int64_t, head_dim) = 0;
  TORCH_ARG(int64_t, max_position_embeddings) = 32768;
  TORCH_ARG(double, rms_norm_eps) = 1e-6;
  TORCH_ARG(RopeParameters, rope) = {};
  TORCH_ARG(bool, tie_word_embeddings) = false;
  TORCH_ARG(bool, attention_bias) = false;
  TORCH_ARG(double, initializer_range) = 0.02;
  TORCH_ARG(int64_t, bos_token_id) = -1;
  TORCH_ARG(int64_t, eos_token_id) = -1;
  /// [Note: padded vocabulary] in models/llama.h.
  TORCH_ARG(int64_t, vocab_multiple) = 1;

  /// Routed experts per sparse layer (config.json: num_experts or num_local_experts).
  TORCH_ARG(int64_t, num_experts) = 128;
  /// Experts each token is routed to (top-k).
  TORCH_ARG(int64_t, num_experts_per_tok) = 8;
  /// Divide the top-k weights by their sum.
  TORCH_ARG(bool, norm_topk_prob) = false;
  /// Layer i is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
  TORCH_ARG(int64_t, decoder_sparse_step) = 1;
  TORCH_ARG(std::vector<int64_t>, mlp_only_layers) = {};
  /// [Note: MoE auxiliary loss]: in the training loss when output_router_logits.
  TORCH_ARG(bool, output_router_logits) = false;
  TORCH_ARG(double, router_aux_loss_coef) = 0.001;

  /// DeepSeek-V3 options ([Note: MoE routing]): "softmax" (Qwen3-MoE) or "sigmoid" (with the
  /// e_score_correction_bias buffer; config.json: scoring_func).
  TORCH_ARG(std::string, scoring_func) = "softmax";
  /// Group-limited choice (sigmoid scoring): n_group groups of num_experts / n_group experts, the
  /// best topk_group of them eligible.
  TORCH_ARG(int64_t, n_group) = 1;
  TORCH_ARG(int64_t, topk_group) = 1;
  /// Multiplies the routing weights.
  TORCH_ARG(double, routed_scaling_factor) = 1.0;
  /// Shared experts (always on): one SwiGLU of moe_intermediate_size * n_shared_experts.
  TORCH_ARG(int64_t, n_shared_experts) = 0;
  /// [Note: aux-loss-free balancing]: the bias update rate (sigmoid scoring; 0: no update;
  /// config.json: router_bias_update_rate, this project's key).
  TORCH_ARG(double, router_bias_update_rate) = 0.0;

 public:
  int64_t kv_heads() const { return num_key_value_heads_ > 0 ? num_key_value_heads_ : num_attention_heads_; }
  int64_t head_size() const { return head_dim_ > 0 ? head_dim_ : hidden_size_ / num_attention_heads_; }
  int64_t padded_vocab_size() const { return (vocab_size_ + vocab_multiple_ - 1) / vocab_multiple_ * vocab_multiple_; }
  /// Whether decoder layer `layer` has experts (transformers' Qwen3MoeDecoderLayer rule).
  bool is_sparse_layer(int64_t layer) const;
  /// The number of sparse layers of the whole model (L of [Note: MoE auxiliary loss]).
  int64_t num_sparse_layers() const;
  /// Whether routers have e_score_correction_bias (sigmoid scoring).
  bool has_score_correction_bias() const { return scoring_func_ == "sigmoid"; }
  /// Whether the training loss holds the auxiliary loss (output_router_logits and a non-zero coef).
  bool has_aux_loss() const { return output_router_logits_ && router_aux_loss_coef_ != 0.0; }
  /// The attention's fields as a LlamaConfig (for the shared building blocks).
  LlamaConfig attention_config() const;
  /// Matmul FLOPs of one token's forward and backward at `seq_len`, counting the parameters a
  /// token uses (attention, its top-k and the shared experts, the routers, the dense layers, the
  /// output layer) as in LlamaConfig::training_flops_per_token, for MFU.
  double training_flops_per_token(int64_t seq_len) const;

  /// config.json as transformers writes it for Qwen3MoeForCausalLM (float32); the DeepSeek options
  /// only when they differ from the defaults.
  std::string to_hf_json() const;
};

/// Reads a Hugging Face config.json of model_type "qwen3_moe" (a file, or a folder holding one).
/// A c10::Error names the file and the key: another architecture, a missing or ill-typed field,
/// sliding-window attention, an unsupported rope type, activation or scoring function.
MoeConfig read_moe_config(const std::string& path, int64_t vocab_multiple = 1);
MoeConfig parse_moe_config(const std::string& json_text, const std::string& where, int64_t vocab_multiple = 1);

/// Qwen3's attention: Llama's grouped-query attention with RMSNorm over head_dim on each query and
/// key head before the rotary embedding. [batch, time, hidden] -> same. Under tensor parallelism
/// each rank holds whole heads (as LlamaAttention).
class MoeAttentionImpl : public torch::nn::Module {
 public:
  explicit MoeAttentionImpl(const MoeConfig& config);
  at::Tensor forward(at::Tensor x);

  /// Under tensor parallelism each rank normalizes only its own heads with q_norm and k_norm, so
  /// their weights' gradients are partial: `fn` maps each weight before use (parallelize_moe sets
  /// tp::copy_to_tp: identity forward, gradient all-reduced over tp, transformers'
  /// "replicated_with_grad_allreduce"). The norms are then computed here, from their weights.
  void set_head_norm_weight_fn(std::function<at::Tensor(const at::Tensor&)> fn) { norm_weight_fn_ = std::move(fn); }
  /// Context parallel (see LlamaAttention::set_context_parallel).
  void set_context_parallel(std::shared_ptr<comm::Communicator> cp) { cp_ = std::move(cp); }

  contract::Linear q_proj{nullptr};
  contract::Linear k_proj{nullptr};
  contract::Linear v_proj{nullptr};
  contract::Linear o_proj{nullptr};
  RMSNorm q_norm{nullptr};
  RMSNorm k_norm{nullptr};

 private:
  int64_t head_dim_;
  int64_t group_;
  double eps_;
  at::Tensor inv_freq_;
  std::function<at::Tensor(const at::Tensor&)> norm_weight_fn_;
  std::shared_ptr<comm::Communicator> cp_;
};
FSDP_HOOKABLE_MODULE(MoeAttention);

/// The router ([Note: MoE routing]): tokens [N, hidden] -> (logits [N, E], weights [N, k], expert
/// ids [N, k] int64, in descending order of the choice's score).
class MoeRouterImpl : public torch::nn::Module {
 public:
  explicit MoeRouterImpl(const MoeConfig& config);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(at::Tensor x);

  at::Tensor weight;
  /// Sigmoid scoring only (undefined otherwise): a buffer, saved in checkpoints.
  at::Tensor e_score_correction_bias;
  /// Tokens per expert counted since the last update_router_bias (sigmoid scoring; float64 [E],
  /// on the device the router runs on).
  at::Tensor load;

 private:
  MoeConfig config_;
};
FSDP_HOOKABLE_MODULE(MoeRouter);

/// One routed expert: a SwiGLU (its own class, so that a WrapPolicy selects experts only).
class MoeExpertImpl : public LlamaMlpImpl {
 public:
  MoeExpertImpl(int64_t hidden_size, int64_t intermediate_size) : LlamaMlpImpl(hidden_size, intermediate_size, false) {}
};
FSDP_HOOKABLE_MODULE(MoeExpert);

/// The routing of one forward of one sparse layer (detached).
struct MoeRouting {
  /// The layer's index in the whole model.
  int64_t layer = 0;
  /// [N, k] int64 and [N, k]: the experts each token went to and their weights (tokens in
  /// row-major (batch, time) order).
  at::Tensor expert_ids;
  at::Tensor weights;
  /// The rows each expert was called with (0: called with an empty batch).
  std::vector<int64_t> rows_per_expert;
};

/// The sparse block: router ("gate"), experts, optional shared experts. [batch, time, hidden] ->
/// (same, router statistics [batch, 2E] of [Note: MoE auxiliary loss], undefined unless
/// config.has_aux_loss()).
class MoeSparseBlockImpl : public torch::nn::Module {
 public:
  explicit MoeSparseBlockImpl(const MoeConfig& config);
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x);

  MoeRouter gate{nullptr};
  contract::ModuleList experts{nullptr};
  /// Empty unless n_shared_experts > 0.
  LlamaMlp shared_experts{nullptr};

  /// The routing of the last forward (undefined tensors before the first).
  const MoeRouting& last_routing() const { return last_; }
  /// Set by the owning layer (the layer index in the whole model).
  void set_layer_index(int64_t layer) { last_.layer = layer; }

  /// Expert parallel: keeps the experts of this ep rank (ep->local_begin() .. + local_count(),
  /// under their global names) and sends each token's rows to the ranks holding its experts
  /// ([Note: expert-parallel dispatch] in composable/expert_parallel.h). Once, before fully_shard.
  void set_expert_parallel(std::shared_ptr<ep::ExpertParallel> ep);
  const std::shared_ptr<ep::ExpertParallel>& expert_parallel() const { return ep_; }

 private:
  MoeConfig config_;
  MoeRouting last_;
  std::shared_ptr<ep::ExpertParallel> ep_;
};
FSDP_HOOKABLE_MODULE(MoeSparseBlock);

/// One decoder layer: x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)),
/// mlp sparse or dense. Returns (x, router statistics of a sparse layer with the auxiliary loss,
/// else undefined).
class MoeDecoderLayerImpl : public torch::nn::Module {
 public:
  MoeDecoderLayerImpl(const MoeConfig& config, int64_t layer_index);
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x);

  RMSNorm input_layernorm{nullptr};
  MoeAttention self_attn{nullptr};
  RMSNorm post_attention_layernorm{nullptr};
  /// Exactly one is set, registered as "mlp".
  MoeSparseBlock moe{nullptr};
  LlamaMlp dense_mlp{nullptr};
};
FSDP_HOOKABLE_MODULE(MoeDecoderLayer);

/// The causal language model: token ids [batch, time] (int64) -> logits [batch, time, vocab_size];
/// on a pipeline stage, hidden states in or out; with set_router_stats_output, [Note: router
/// statistics in the output].
class MoeForCausalLMImpl : public torch::nn::Module {
 public:
  /// Builds the model and initialises it as transformers does from the global generator (call
  /// torch::manual_seed first): Linear, router and embedding weights N(0, initializer_range),
  /// norms 1, e_score_correction_bias 0, padding rows 0.
  explicit MoeForCausalLMImpl(MoeConfig config);

  at::Tensor forward(at::Tensor input);

  /// As LlamaForCausalLM::keep_stage.
  void keep_stage(pipeline::BlockRange layers, bool first, bool last);
  bool is_first_stage() const { return !model->embed_tokens.is_empty(); }
  bool is_last_stage() const { return !model->norm.is_empty(); }

  std::vector<MoeDecoderLayer> layer_list() const;
  const MoeConfig& config() const { return config_; }

  /// The routing of the last forward of every sparse layer this model (stage) holds, in order.
  std::vector<MoeRouting> last_routing() const;

  /// [Note: aux-loss-free balancing]: the loads counted since the last update, [sparse layers
  /// held, E] float64 (zeros [0, E] without sigmoid scoring).
  at::Tensor router_loads() const;
  /// Adds router_bias_update_rate * sign(mean(load) - load) to each held sparse layer's
  /// e_score_correction_bias (`loads` as router_loads() gives them, possibly summed over ranks)
  /// and clears the counts.
  void update_router_bias(const at::Tensor& loads);

  /// As LlamaForCausalLM's.
  using OutputLayer = std::function<at::Tensor(const at::Tensor& hidden, const at::Tensor& weight)>;
  void set_output_layer(OutputLayer layer) { output_layer_ = std::move(layer); }
  void set_keep_padded_logits(bool keep) { keep_padded_logits_ = keep; }
  /// [Note: router statistics in the output] (needs config.has_aux_loss()).
  void set_router_stats_output(bool on);
  bool router_stats_output() const { return stats_output_; }

  LlamaModel model{nullptr};
  contract::Linear lm_head{nullptr};

 private:
  MoeConfig config_;
  OutputLayer output_layer_;
  bool keep_padded_logits_ = false;
  bool stats_output_ = false;
};
FSDP_HOOKABLE_MODULE(MoeForCausalLM);

/// Takes a forward output with router statistics apart: (the output [batch, time, width], the
/// statistics [batch, 2E]); `time` is the input's (the targets') time dimension.
std::pair<at::Tensor, at::Tensor> split_router_stats(const at::Tensor& output, int64_t time, int64_t num_experts);

/// [Note: MoE auxiliary loss] from summed router statistics [batch, 2E] of `tokens` tokens (batch
/// x time): E * sum_e C_e * P_e / (L * tokens)^2, a float32 scalar.
at::Tensor moe_aux_loss(const at::Tensor& stats, const MoeConfig& config, int64_t tokens);

}  // namespace fsdp::models

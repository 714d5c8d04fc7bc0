#pragma once
// Llama 3 (Hugging Face transformers' LlamaForCausalLM) in C++, written as a fully_shard user
// writes a model: every module that becomes a unit (each decoder layer, the root) is hook-able and
// every child is called through its hook-able holder. FQNs are Hugging Face's, so a transformers
// checkpoint loads by name (models/hf_checkpoint.h) with no mapping:
//
//   model.embed_tokens.weight                      [padded_vocab, hidden]
//   model.layers.<i>.input_layernorm.weight        RMSNorm, x = x + self_attn(input_layernorm(x))
//   model.layers.<i>.self_attn.{q,k,v,o}_proj.weight   grouped-query attention with rotary
//                                                  positions (q: heads * head_dim rows, k and v:
//                                                  kv_heads * head_dim rows), [+ .bias with
//                                                  attention_bias]
//   model.layers.<i>.post_attention_layernorm.weight   x = x + mlp(post_attention_layernorm(x))
//   model.layers.<i>.mlp.{gate,up,down}_proj.weight     SwiGLU: down(silu(gate(x)) * up(x))
//   model.norm.weight                              final RMSNorm
//   lm_head.weight                                 [padded_vocab, hidden], only untied
//
// Numerics follow transformers (float32 reference): RMSNorm computes in float32 and multiplies
// the weight after casting back; rotary embeddings rotate halves (rotate_half: the layout of
// Hugging Face checkpoints, so no permutation is needed), with inverse frequencies computed in
// float32 by the rope type's rule ("default", or "llama3": Llama 3.1's frequency scaling);
// attention is scaled_dot_product_attention, causal, scale head_dim^-1/2, the k/v heads repeated
// for grouped-query attention.
//
// [Note: padded vocabulary] LlamaConfig::vocab_multiple pads the embedding and output rows to a
// multiple (e.g. of the tensor-parallel size, so that 128,256 or 151,936 rows split evenly; a
// multiple such as 64 keeps one padded size for every tp in {1, 2, 4, 8, ...}). The padding rows
// are zeros, never looked up (token ids are < vocab_size), and cut off the logits: forward returns
// [batch, time, vocab_size]; vocabulary-parallel logits (loss parallel) keep the padding columns,
// which the loss excludes (models/llama_parallel.h). Checkpoints in Hugging Face's format hold
// the real vocabulary only (models/hf_checkpoint.h loads into and exports from the padded rows).
//
// Pipeline stages: keep_stage(layers, first, last) prunes a whole model to one stage, keeping
// every FQN (embed_tokens on the first stage, norm and lm_head on the last), as GPT::keep_stage
// ([Note: GPT pipeline stages] in examples/gpt_model.h). A tied model cannot be split.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/tensor_parallel.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_module_list.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/pipeline/stage_split.h"

namespace fsdp::models {

/// Rotary position embedding parameters (transformers' `rope_parameters`).
struct RopeParameters {
  /// "default" or "llama3".
  std::string rope_type = "default";
  double rope_theta = 10000.0;
  /// llama3 only.
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

/// The shape of a Llama model: transformers' LlamaConfig fields, in the LibTorch options style.
///
///   auto config = fsdp::models::LlamaConfig(/*vocab_size=*/512).hidden_size(64).num_hidden_layers(2);
///   auto config = fsdp::models::read_llama_config("/models/Llama-3.2-1B");   // config.json
struct LlamaConfig {
  explicit LlamaConfig(int64_t vocab_size = 32000) : vocab_size_(vocab_size) {}

  /// Fails with a c10::Error naming LlamaConfig, the first invalid field and its value.
  void validate() const;

  TORCH_ARG(int64_t, vocab_size);
  TORCH_ARG(int64_t, hidden_size) = 4096;
  TORCH_ARG(int64_t, intermediate_size) = 11008;
  TORCH_ARG(int64_t, num_hidden_layers) = 32;
  TORCH_ARG(int64_t, num_attention_heads) = 32;
  /// Grouped-query attention: key/value heads (a divisor of num_attention_heads); 0 means
  /// num_attention_heads.
  TORCH_ARG(int64_t, num_key_value_heads) = 0;
  /// 0 means hidden_size / num_attention_heads.
  TORCH_ARG(int64_t, head_dim) = 0;
  TORCH_ARG(int64_t, max_position_embeddings) = 2048;
  TORCH_ARG(double, rms_norm_eps) = 1e-6;
  TORCH_ARG(RopeParameters, rope) = {};
  TORCH_ARG(bool, tie_word_embeddings) = false;
  TORCH_ARG(bool, attention_bias) = false;
  TORCH_ARG(bool, mlp_bias) = false;
  /// Standard deviation of the initial weights (a model trained from scratch).
  TORCH_ARG(double, initializer_range) = 0.02;
  /// Special token ids (kept for the exported config.json; -1: none).
  TORCH_ARG(int64_t, bos_token_id) = -1;
  TORCH_ARG(int64_t, eos_token_id) = -1;
  /// [Note: padded vocabulary]: rows of the embedding and output layer are rounded up to a
  /// multiple of this (1: none).
  TORCH_ARG(int64_t, vocab_multiple) = 1;

 public:
  int64_t kv_heads() const { return num_key_value_heads_ > 0 ? num_key_value_heads_ : num_attention_heads_; }
  int64_t head_size() const { return head_dim_ > 0 ? head_dim_ : hidden_size_ / num_attention_heads_; }
  int64_t padded_vocab_size() const { return (vocab_size_ + vocab_multiple_ - 1) / vocab_multiple_ * vocab_multiple_; }
  /// Parameters of the whole model (padding rows included), and the matmul FLOPs of one token's
  /// forward and backward at sequence length `seq_len` (6 * parameters in matmuls + attention's
  /// 6 * layers * heads * head_dim * seq_len, PaLM's estimate), for MFU.
  int64_t num_parameters() const;
  double training_flops_per_token(int64_t seq_len) const;

  /// config.json as transformers writes it for LlamaForCausalLM (float32).
  std::string to_hf_json() const;
};

/// Reads a Hugging Face config.json (a file, or a folder holding one). A c10::Error names the
/// file and the key: not a JSON object, an architecture other than LlamaForCausalLM (model_type
/// "llama"), a missing or ill-typed field, an unsupported rope type or hidden activation,
/// attention dropout. `vocab_multiple` is this program's choice, not the file's.
LlamaConfig read_llama_config(const std::string& path, int64_t vocab_multiple = 1);
/// The same from the text of a config.json; `where` names it in errors.
LlamaConfig parse_llama_config(const std::string& json_text, const std::string& where, int64_t vocab_multiple = 1);

/// Inverse rotary frequencies [head_dim / 2] (float32) of `rope` for `head_dim` (transformers'
/// default and llama3 rules).
at::Tensor rotary_inverse_frequencies(const RopeParameters& rope, int64_t head_dim);

/// RMSNorm over the last dimension: weight * (x / sqrt(mean(x^2) + eps)), computed in float32.
/// Acts per position, so sequence parallelism runs it on each rank's positions (PerPositionModule).
class RMSNormImpl : public torch::nn::Module, public PerPositionModule {
 public:
  RMSNormImpl(int64_t size, double eps);
  at::Tensor forward(at::Tensor x);
  std::vector<at::Tensor*> per_position_parameters() override { return {&weight}; }
  at::Tensor weight;

 private:
  double eps_;
};
FSDP_HOOKABLE_MODULE(RMSNorm);

/// Grouped-query causal self-attention with rotary positions. [batch, time, hidden] -> same.
/// Under tensor parallelism (models/llama_parallel.h) q_proj/k_proj/v_proj are column-parallel:
/// each rank computes its heads (sizes read from the projections' outputs) and o_proj sums.
class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaConfig& config);
  at::Tensor forward(at::Tensor x);

  contract::Linear q_proj{nullptr};
  contract::Linear k_proj{nullptr};
  contract::Linear v_proj{nullptr};
  contract::Linear o_proj{nullptr};

  /// Context parallel: attend over the sequence split across `cp` (ring attention, global rotary
  /// positions); null: the whole sequence is here.
  void set_context_parallel(std::shared_ptr<comm::Communicator> cp) { cp_ = std::move(cp); }

 private:
  int64_t head_dim_;
  int64_t group_;  // query heads per key/value head
  at::Tensor inv_freq_;  // not a buffer: transformers does not save it either
  std::shared_ptr<comm::Communicator> cp_;
};
FSDP_HOOKABLE_MODULE(LlamaAttention);

/// SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)).
class LlamaMlpImpl : public torch::nn::Module {
 public:
  LlamaMlpImpl(int64_t hidden_size, int64_t intermediate_size, bool bias);
  at::Tensor forward(at::Tensor x);

  contract::Linear gate_proj{nullptr};
  contract::Linear up_proj{nullptr};
  contract::Linear down_proj{nullptr};
};
FSDP_HOOKABLE_MODULE(LlamaMlp);

/// One decoder layer: x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)).
class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const LlamaConfig& config);
  at::Tensor forward(at::Tensor x);

  RMSNorm input_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  RMSNorm post_attention_layernorm{nullptr};
  LlamaMlp mlp{nullptr};
};
FSDP_HOOKABLE_MODULE(LlamaDecoderLayer);

/// transformers' LlamaModel: the container of embed_tokens, layers and norm (its FQN prefix
/// "model."). The causal LM calls its children; it has no forward of its own.
class LlamaModelImpl : public torch::nn::Module {
 public:
  LlamaModelImpl() = default;
  contract::Embedding embed_tokens{nullptr};
  contract::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

/// What the causal LMs of models/ (Llama, MoE) share around their layers: the `model` container
/// (embed_tokens, layers, norm) and `lm_head` registered on `root`, transformers' initialisation
/// and the pipeline-stage cut.
namespace causal_lm {

/// Registers root.model (embed_tokens [rows, hidden], an empty layers list, norm) and, unless
/// `tied`, root.lm_head [rows, hidden] without bias; the caller pushes its layers.
void build(torch::nn::Module& root, LlamaModel& model, contract::Linear& lm_head, int64_t rows, int64_t hidden,
           double rms_norm_eps, bool tied);
/// transformers' _init_weights from the global generator, in module order: every Linear and
/// Embedding weight N(0, std), biases 0, and what `also` initialises of other modules (e.g. a
/// router); norms keep their 1s. Then the padding rows beyond `vocab_size` are zeroed.
void init_weights(torch::nn::Module& root, LlamaModel& model, contract::Linear& lm_head, double std,
                  int64_t vocab_size, const std::function<void(torch::nn::Module&)>& also = {});
/// Prunes to one pipeline stage (see LlamaForCausalLM::keep_stage); `api` starts the errors.
void keep_stage(torch::nn::Module& root, LlamaModel& model, contract::Linear& lm_head, bool tied, int64_t n_layers,
                pipeline::BlockRange range, bool first, bool last, const std::string& api);
/// "layers 2 .. 3" or "no layers", for messages.
std::string layers_text(const contract::ModuleList& layers);
/// Rotary embeddings on q and k ([batch, heads, time, head_dim], k and v with kv heads), then
/// causal attention with `group` query heads per kv head: scaled_dot_product_attention, or with a
/// context-parallel group fsdp::cp::ring_attention over the sequence split across it (the
/// load-balanced head-tail layout of composable/context_parallel.h), the rotary positions then
/// this rank's global positions. Returns [batch, heads, time, head_dim].
at::Tensor rotary_causal_attention(at::Tensor q, at::Tensor k, at::Tensor v, const at::Tensor& inv_freq, int64_t group,
                                   int64_t head_dim, const std::shared_ptr<comm::Communicator>& cp);

}  // namespace causal_lm

/// The causal language model: token ids [batch, time] (int64) -> logits [batch, time,
/// vocab_size]; on a pipeline stage, hidden states [batch, time, hidden] in or out.
class LlamaForCausalLMImpl : public torch::nn::Module {
 public:
  /// Builds the model and initialises it as transformers does from the global generator (call
  /// torch::manual_seed first): Linear and embedding weights N(0, initializer_range), biases 0,
  /// norms 1, padding rows 0.
  explicit LlamaForCausalLMImpl(LlamaConfig config);

  at::Tensor forward(at::Tensor input);

  /// Prunes the model to one pipeline stage (see the top of this file); refusals as
  /// GPT::keep_stage's (a range outside [0, num_hidden_layers), a model already pruned, a tied
  /// model that is not both first and last).
  void keep_stage(pipeline::BlockRange layers, bool first, bool last);
  bool is_first_stage() const { return !model->embed_tokens.is_empty(); }
  bool is_last_stage() const { return !model->norm.is_empty(); }

  std::vector<LlamaDecoderLayer> layer_list() const;
  const LlamaConfig& config() const { return config_; }

  /// Replaces the output layer `hidden.matmul(weight.t())` (weight: lm_head's, or the tied
  /// embedding's): tensor parallelism computes vocabulary-parallel logits there for a tied model.
  using OutputLayer = std::function<at::Tensor(const at::Tensor& hidden, const at::Tensor& weight)>;
  void set_output_layer(OutputLayer layer) { output_layer_ = std::move(layer); }
  /// True: forward returns the output layer's logits as they are (vocabulary-parallel pieces,
  /// padding columns included), for loss parallel. False: [.., vocab_size].
  void set_keep_padded_logits(bool keep) { keep_padded_logits_ = keep; }

  LlamaModel model{nullptr};
  /// The output layer of an untied model; empty when tie_word_embeddings.
  contract::Linear lm_head{nullptr};

 private:
  LlamaConfig config_;
  OutputLayer output_layer_;
  bool keep_padded_logits_ = false;
};
FSDP_HOOKABLE_MODULE(LlamaForCausalLM);

/// Mean next-token cross-entropy of `logits` [batch, time, V] against `targets` [batch, time]
/// over the targets that are not `ignore_index` (torch's cross_entropy; NaN when none counts).
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index = -100);

}  // namespace fsdp::models

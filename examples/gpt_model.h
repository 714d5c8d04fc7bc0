#pragma once
// A small GPT-style decoder-only language model written as a fully_shard user would write it:
// every module that becomes an FSDP unit (each Block, and the GPT root) is hook-able
// (FSDP_HOOKABLE_MODULE), and every child is called through its hook-able holder.
//
//   torch::manual_seed(0);                                  // initialisation is deterministic
//   fsdp::examples::GPT model(fsdp::examples::GPTConfig(/*vocab_size=*/64).n_layers(4));
//   for (auto& block : model->block_list()) fsdp::fully_shard(block, opts);   // bottom-up
//   fsdp::fully_shard(model, opts);                                            // the root last
//   at::Tensor logits = model(tokens);          // [batch, time] -> [batch, time, vocab]
//   at::Tensor loss = fsdp::examples::next_token_loss(logits, targets);
//   at::Tensor text = fsdp::contract::call_method(model, &GPTImpl::generate, prompt, 100, 0.0, 0);
//
// Structure and FQNs (GPT-2 layout, pre-LayerNorm):
//   tok_emb.weight                    [vocab, d_model]  token embedding, TIED to the output layer
//   pos_emb.weight                    [context, d_model] learned position embedding
//   blocks.<i>.ln1.{weight,bias}      x = x + attn(ln1(x))
//   blocks.<i>.attn.qkv.{weight,bias}     causal self-attention: one projection to q, k, v,
//   blocks.<i>.attn.proj.{weight,bias}    scaled_dot_product_attention(is_causal), output proj
//   blocks.<i>.ln2.{weight,bias}      x = x + mlp(ln2(x))
//   blocks.<i>.mlp.fc.{weight,bias}       d_model -> mlp_ratio * d_model, GELU,
//   blocks.<i>.mlp.proj.{weight,bias}     back to d_model
//   ln_f.{weight,bias}                final LayerNorm
//   head.weight                       [vocab, d_model]  the output layer, only with
//                                                       tie_embeddings(false) (no bias)
//
// [Note: tied embedding] The output layer has no weight of its own: GPT::forward computes the
// logits as `ln_f(x).matmul(tok_emb->weight.t())`. The tied weight is registered once, by the
// embedding, so it is one parameter with one FQN; the root's fully_shard unit contains the
// embedding and runs the projection in its own forward, so the weight lives in the root's
// FlatParameter and is unsharded whenever either use runs (the root stays unsharded from its
// forward to the end of its backward). With GPTConfig::tie_embeddings(false) the output layer is
// its own Linear, `head` (what a pipeline needs: the embedding and the output layer live on
// different stages).
//
// [Note: GPT pipeline stages] keep_stage(blocks, first, last) prunes a model in place to one
// pipeline stage (pipeline/stage_split.h): the blocks outside `blocks` are removed and the others
// keep their FQNs (contract::ModuleList::keep_only), tok_emb and pos_emb stay only on the first
// stage, ln_f and head only on the last. Build every stage as the whole model from the same seed,
// then prune, so each stage's parameters equal the whole model's:
//
//   torch::manual_seed(0);
//   GPT stage(GPTConfig(64).n_layers(8).tie_embeddings(false));
//   stage->keep_stage({2, 4}, /*first=*/false, /*last=*/false);   // blocks.2, blocks.3
//
// A stage's forward: the first takes int64 token ids [batch, time], a later one the hidden states
// [batch, time, d_model] (float) the previous stage returned; the last returns the logits
// [batch, time, vocab], the others the hidden states. A tied model cannot be split (its weight
// would live on two stages): keep_stage refuses it unless the stage is both first and last.

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_module_list.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/pipeline/stage_split.h"

namespace fsdp::examples {

/// The shape of a GPT, in the LibTorch options style:
///
///   auto config = GPTConfig(/*vocab_size=*/65).context_length(128).d_model(256).n_layers(6);
struct GPTConfig {
  explicit GPTConfig(int64_t vocab_size) : vocab_size_(vocab_size) {}

  /// Fails with a c10::Error naming the first invalid field and its value.
  void validate() const;

  /// Number of distinct tokens.
  TORCH_ARG(int64_t, vocab_size);
  /// The longest sequence the model reads (rows of the position embedding).
  TORCH_ARG(int64_t, context_length) = 64;
  /// Width of the residual stream; a multiple of n_heads.
  TORCH_ARG(int64_t, d_model) = 128;
  /// Attention heads per block.
  TORCH_ARG(int64_t, n_heads) = 4;
  /// Number of blocks.
  TORCH_ARG(int64_t, n_layers) = 4;
  /// Hidden width of the MLP as a multiple of d_model.
  TORCH_ARG(int64_t, mlp_ratio) = 4;
  /// Dropout on the embeddings, attention weights and residual branches, in training mode only.
  /// 0 (the default) keeps a training step deterministic.
  TORCH_ARG(double, dropout) = 0.0;
  /// True: the output layer is the token embedding's weight ([Note: tied embedding]). False: the
  /// model has its own output layer `head` (Linear d_model -> vocab, no bias), needed to split the
  /// model into pipeline stages ([Note: GPT pipeline stages]).
  TORCH_ARG(bool, tie_embeddings) = true;
};

/// Where the model's dropout sites are laid out over a tensor-parallel group
/// (examples/gpt_tensor_parallel.h sets it; [Note: tensor-parallel RNG] in composable/tp_random.h):
/// attention probabilities hold this rank's heads; the embeddings' and residual branches' outputs
/// are replicated, or this rank's positions with sequence parallelism. Empty group: unsharded.
struct DropoutLayout {
  std::shared_ptr<comm::Communicator> group;
  bool sequence_parallel = false;
};

/// Multi-head causal self-attention: qkv projection, scaled_dot_product_attention with a causal
/// mask, output projection. [batch, time, d_model] -> [batch, time, d_model].
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTConfig& config);
  /// With dropout in training, attention is computed explicitly (softmax, then the probabilities'
  /// dropout through fsdp::tp::dropout, then the values), so the masks follow [Note:
  /// tensor-parallel RNG]; otherwise scaled_dot_product_attention.
  at::Tensor forward(at::Tensor x);
  void set_dropout_layout(DropoutLayout layout) { layout_ = std::move(layout); }

  contract::Linear qkv{nullptr};
  contract::Linear proj{nullptr};

 private:
  int64_t n_heads_;
  int64_t head_dim_;
  double dropout_;
  DropoutLayout layout_;
};
FSDP_HOOKABLE_MODULE(CausalSelfAttention);

/// fc -> GELU (tanh approximation, as GPT-2) -> proj.
class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const GPTConfig& config);
  at::Tensor forward(at::Tensor x);
  void set_dropout_layout(DropoutLayout layout) { layout_ = std::move(layout); }

  contract::Linear fc{nullptr};
  contract::Linear proj{nullptr};

 private:
  double dropout_;
  DropoutLayout layout_;
};
FSDP_HOOKABLE_MODULE(Mlp);

/// One pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)).
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTConfig& config);
  at::Tensor forward(at::Tensor x);

  contract::LayerNorm ln1{nullptr};
  CausalSelfAttention attn{nullptr};
  contract::LayerNorm ln2{nullptr};
  Mlp mlp{nullptr};
};
FSDP_HOOKABLE_MODULE(Block);

/// The language model: token ids [batch, time] (int64, time <= context_length) -> logits
/// [batch, time, vocab_size]. See the top of this file for the structure and the tied weight.
class GPTImpl : public torch::nn::Module {
 public:
  /// Builds the model and initialises it GPT-2 style from the global generator (call
  /// torch::manual_seed first for reproducible weights): weights N(0, 0.02), residual output
  /// projections N(0, 0.02 / sqrt(2 * n_layers)), biases 0, LayerNorms (1, 0). An untied model's
  /// `head.weight` is N(0, 0.02) too, drawn after every other parameter is initialised, so the
  /// other parameters equal those of the tied model built from the same seed.
  explicit GPTImpl(GPTConfig config);

  /// The whole model: token ids [batch, time] (int64) -> logits [batch, time, vocab]. A pipeline
  /// stage ([Note: GPT pipeline stages]): token ids on the first stage, hidden states [batch,
  /// time, d_model] on the others; logits from the last stage, hidden states from the others.
  at::Tensor forward(at::Tensor input);

  /// Prunes this model in place to one pipeline stage ([Note: GPT pipeline stages]): keeps the
  /// blocks [blocks.begin, blocks.end) under their names, tok_emb and pos_emb only if `first`,
  /// ln_f and head only if `last`. Call it once, on the whole model, before any parallelism is
  /// applied (fully_shard, parallelize_gpt). Fails with a c10::Error, changing nothing, on a range
  /// outside [0, n_layers) or reversed, on a model already pruned, and on a tied model unless the
  /// stage is both first and last (a one-stage pipeline): use tie_embeddings(false).
  ///
  ///   auto ranges = fsdp::pipeline::split_blocks_evenly(config.n_layers(), n_stages);
  ///   model->keep_stage(ranges[s], s == 0, s == n_stages - 1);
  void keep_stage(pipeline::BlockRange blocks, bool first, bool last);

  /// True when this model holds the embeddings (the first stage, or the whole model).
  bool is_first_stage() const { return !tok_emb.is_empty(); }
  /// True when this model holds ln_f and the output layer (the last stage, or the whole model).
  bool is_last_stage() const { return !ln_f.is_empty(); }

  /// Continues `prompt` (int64 token ids [batch, time], time >= 1) by `n_new` tokens and returns
  /// prompt and continuation, [batch, time + n_new]. Each new token takes one forward over the last
  /// context_length tokens: the most likely one when `temperature` is 0 (greedy), else one drawn
  /// from softmax(logits / temperature) by a CPU generator seeded with `seed` (the same seed and
  /// logits give the same tokens in every process). Runs without gradients. A method other than
  /// forward: under fully_shard call it through the root's hooks, on every rank (each token
  /// all-gathers the units), so the root's parameters are unsharded while it runs and each block
  /// runs its own hooks:
  ///
  ///   at::Tensor tokens = fsdp::contract::call_method(model, &GPTImpl::generate, prompt, 100, 0.0, 0);
  at::Tensor generate(at::Tensor prompt, int64_t n_new, double temperature, int64_t seed);

  /// The blocks in order, as hook-able holders (the units to shard before the root):
  ///
  ///   for (auto& block : model->block_list()) fsdp::fully_shard(block, opts);
  std::vector<Block> block_list() const;

  const GPTConfig& config() const { return config_; }

  /// Replaces the output layer `hidden.matmul(weight.t())` (hidden: ln_f's output, weight: the
  /// tied token embedding's, or head's on an untied model, whose head then is not called):
  /// tensor parallelism computes vocabulary-parallel logits there for a tied model
  /// (examples/gpt_tensor_parallel.h). Empty: the plain matmul (tied) or head (untied).
  using OutputLayer = std::function<at::Tensor(const at::Tensor& hidden, const at::Tensor& weight)>;
  void set_output_layer(OutputLayer layer) { output_layer_ = std::move(layer); }

  /// The layout of every dropout site of the model (its blocks' too): see DropoutLayout.
  void set_dropout_layout(const DropoutLayout& layout);

  contract::Embedding tok_emb{nullptr};
  contract::Embedding pos_emb{nullptr};
  contract::ModuleList blocks{nullptr};
  contract::LayerNorm ln_f{nullptr};
  /// The output layer of an untied model (tie_embeddings(false)); empty on a tied model.
  contract::Linear head{nullptr};

 private:
  void init_weights();

  GPTConfig config_;
  OutputLayer output_layer_;
  DropoutLayout dropout_layout_;
};
FSDP_HOOKABLE_MODULE(GPT);

/// Mean cross-entropy of next-token prediction: `logits` [batch, time, vocab] against `targets`
/// [batch, time] (int64).
at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace fsdp::examples

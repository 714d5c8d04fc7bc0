#include "fsdp_cpp/examples/gpt_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/composable/tp_random.h"

namespace fsdp::examples {

namespace {

// Dropout of an activation of the residual stream: replicated over the tensor-parallel group, or
// this rank's positions (dimension 1) with sequence parallelism ([Note: tensor-parallel RNG]).
at::Tensor residual_dropout(const at::Tensor& x, double p, bool training, const DropoutLayout& layout) {
  return tp::dropout(x, p, training, layout.sequence_parallel ? std::optional<int64_t>(1) : std::nullopt,
                     layout.group);
}

// "blocks 2 .. 3" or "no blocks": what a (pruned) block list holds, for messages.
std::string blocks_text(const contract::ModuleList& blocks) {
  if (blocks->is_empty()) return "no blocks";
  return "blocks " + std::to_string(blocks->first_name()) + " .. " +
         std::to_string(blocks->first_name() + static_cast<int64_t>(blocks->size()) - 1);
}

}  // namespace

void GPTConfig::validate() const {
  TORCH_CHECK(vocab_size_ > 0, "GPTConfig: vocab_size must be positive (got ", vocab_size_, ")");
  TORCH_CHECK(context_length_ > 0, "GPTConfig: context_length must be positive (got ",
              context_length_, ")");
  TORCH_CHECK(n_heads_ > 0, "GPTConfig: n_heads must be positive (got ", n_heads_, ")");
  TORCH_CHECK(d_model_ > 0 && d_model_ % n_heads_ == 0, "GPTConfig: d_model must be a positive "
              "multiple of n_heads (got d_model ", d_model_, ", n_heads ", n_heads_, ")");
  TORCH_CHECK(n_layers_ > 0, "GPTConfig: n_layers must be positive (got ", n_layers_, ")");
  TORCH_CHECK(mlp_ratio_ > 0, "GPTConfig: mlp_ratio must be positive (got ", mlp_ratio_, ")");
  TORCH_CHECK(dropout_ >= 0.0 && dropout_ < 1.0, "GPTConfig: dropout must be in [0, 1) (got ",
              dropout_, ")");
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& config)
    : n_heads_(config.n_heads()), head_dim_(config.d_model() / config.n_heads()), dropout_(config.dropout()) {
  const int64_t d = config.d_model();
  qkv = register_module("qkv", contract::Linear(d, 3 * d));
  proj = register_module("proj", contract::Linear(d, d));
}

at::Tensor CausalSelfAttentionImpl::forward(at::Tensor x) {
  // [B, T, 3C] -> three [B, H, T, C/H]. Under tensor parallelism (examples/gpt_tensor_parallel.h)
  // qkv is column-parallel: this rank's output is [B, T, 3C/n] (its heads of q, k and v), and the
  // sizes are read from it (with sequence parallelism x holds T/n positions, the output all T).
  const at::Tensor qkv_out = qkv(x);
  const int64_t batch = qkv_out.size(0), time = qkv_out.size(1), width = qkv_out.size(2) / 3;
  TORCH_CHECK(width % head_dim_ == 0, "CausalSelfAttention: this rank's q/k/v width ", width,
              " is not a whole number of heads of size ", head_dim_, " (n_heads ", n_heads_,
              " must be divisible by the tensor-parallel size)");
  const int64_t local_heads = width / head_dim_;
  auto heads = [&](const at::Tensor& t) {
    return t.view({batch, time, local_heads, head_dim_}).transpose(1, 2);
  };
  const auto parts = qkv_out.split(width, /*dim=*/2);
  at::Tensor y;
  if (is_training() && dropout_ > 0.0) {
    // Explicit attention, so the probabilities' dropout draws its mask through fsdp::tp::dropout:
    // under tensor parallelism this rank holds heads [r * H/n, (r + 1) * H/n) (dimension 1).
    const at::Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    const at::Tensor future = at::ones({time, time}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1);
    at::Tensor att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
    att = at::softmax(att.masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
    att = tp::dropout(att, dropout_, true, layout_.group ? std::optional<int64_t>(1) : std::nullopt, layout_.group);
    y = at::matmul(att, v);
  } else {
    y = at::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), /*attn_mask=*/{},
                                         /*dropout_p=*/0.0, /*is_causal=*/true);
  }
  y = y.transpose(1, 2).contiguous().view({batch, time, width});
  return residual_dropout(proj(y), dropout_, is_training(), layout_);
}

MlpImpl::MlpImpl(const GPTConfig& config) : dropout_(config.dropout()) {
  const int64_t d = config.d_model();
  fc = register_module("fc", contract::Linear(d, config.mlp_ratio() * d));
  proj = register_module("proj", contract::Linear(config.mlp_ratio() * d, d));
}

at::Tensor MlpImpl::forward(at::Tensor x) {
  return residual_dropout(proj(at::gelu(fc(x), "tanh")), dropout_, is_training(), layout_);
}

BlockImpl::BlockImpl(const GPTConfig& config) {
  const std::vector<int64_t> shape{config.d_model()};
  ln1 = register_module("ln1", contract::LayerNorm(torch::nn::LayerNormOptions(shape)));
  attn = register_module("attn", CausalSelfAttention(config));
  ln2 = register_module("ln2", contract::LayerNorm(torch::nn::LayerNormOptions(shape)));
  mlp = register_module("mlp", Mlp(config));
}

at::Tensor BlockImpl::forward(at::Tensor x) {
  x = x + attn(ln1(x));
  return x + mlp(ln2(x));
}

GPTImpl::GPTImpl(GPTConfig config) : config_(std::move(config)) {
  config_.validate();
  const int64_t d = config_.d_model();
  tok_emb = register_module(
      "tok_emb", contract::Embedding(torch::nn::EmbeddingOptions(config_.vocab_size(), d)));
  pos_emb = register_module(
      "pos_emb", contract::Embedding(torch::nn::EmbeddingOptions(config_.context_length(), d)));
  blocks = register_module("blocks", contract::ModuleList());
  for (int64_t i = 0; i < config_.n_layers(); ++i) blocks->push_back(Block(config_));
  ln_f = register_module("ln_f", contract::LayerNorm(torch::nn::LayerNormOptions({d})));
  init_weights();
  if (!config_.tie_embeddings()) {
    // Built and drawn after every other parameter's initialisation, so that the others equal
    // those of the tied model from the same seed (the Linear's own default initialisation draws
    // too, before its N(0, 0.02)).
    head = register_module(
        "head", contract::Linear(torch::nn::LinearOptions(d, config_.vocab_size()).bias(false)));
    c10::NoGradGuard no_grad;
    head->weight.normal_(0.0, 0.02);
  }
}

void GPTImpl::keep_stage(pipeline::BlockRange range, bool first, bool last) {
  const int64_t n_layers = config_.n_layers();
  TORCH_CHECK(config_.tie_embeddings() == false || (first && last), "GPT::keep_stage: a model with "
              "tied embeddings cannot be split into pipeline stages: its output layer is the token "
              "embedding's weight, which would live on the first and the last stage (asked for a ",
              (first ? "first" : (last ? "last" : "middle")), " stage holding blocks [", range.begin,
              ", ", range.end, ")). Build the model with GPTConfig::tie_embeddings(false)");
  TORCH_CHECK(is_first_stage() && is_last_stage() && !blocks->is_pruned(), "GPT::keep_stage: the "
              "model is already a pipeline stage (", blocks_text(blocks),
              (is_first_stage() ? ", embeddings" : ""), (is_last_stage() ? ", output layer" : ""),
              "); call keep_stage once, on the whole model");
  TORCH_CHECK(0 <= range.begin && range.begin <= range.end && range.end <= n_layers,
              "GPT::keep_stage: expected a range of blocks [begin, end) within [0, ", n_layers,
              ") (n_layers) with begin <= end, got [", range.begin, ", ", range.end, ")");
  blocks->keep_only(range.begin, range.end);
  if (!first) {
    unregister_module("tok_emb");
    unregister_module("pos_emb");
    tok_emb = nullptr;
    pos_emb = nullptr;
  }
  if (!last) {
    unregister_module("ln_f");
    ln_f = nullptr;
    if (!head.is_empty()) {
      unregister_module("head");
      head = nullptr;
    }
  }
}

void GPTImpl::init_weights() {
  c10::NoGradGuard no_grad;
  const double std = 0.02;
  const double residual_std = std / std::sqrt(2.0 * static_cast<double>(config_.n_layers()));
  tok_emb->weight.normal_(0.0, std);
  pos_emb->weight.normal_(0.0, std);
  auto init_linear = [](const contract::Linear& linear, double weight_std) {
    linear->weight.normal_(0.0, weight_std);
    linear->bias.zero_();
  };
  for (const Block& block : block_list()) {
    init_linear(block->attn->qkv, std);
    init_linear(block->attn->proj, residual_std);
    init_linear(block->mlp->fc, std);
    init_linear(block->mlp->proj, residual_std);
  }
}

at::Tensor GPTImpl::forward(at::Tensor input) {
  at::Tensor x;
  if (is_first_stage()) {
    const at::Tensor& tokens = input;
    TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
                "GPT::forward: expected int64 token ids of shape [batch, time] (got ",
                tokens.scalar_type(), " of shape ", tokens.sizes(), ")");
    const int64_t time = tokens.size(1);
    TORCH_CHECK(time <= config_.context_length(), "GPT::forward: sequence of ", time,
                " tokens is longer than the context length ", config_.context_length());
    const at::Tensor positions = at::arange(time, tokens.options());
    x = residual_dropout(tok_emb(tokens) + pos_emb(positions), config_.dropout(), is_training(), dropout_layout_);
  } else {
    // A later pipeline stage: the previous stage's hidden states ([Note: GPT pipeline stages]).
    // Under sequence parallelism they hold this rank's positions, so time is not checked.
    TORCH_CHECK(input.dim() == 3 && input.is_floating_point() && input.size(2) == config_.d_model(),
                "GPT::forward: this pipeline stage (", blocks_text(blocks), ", no embeddings) "
                "expected the previous stage's hidden states, floating point of shape [batch, "
                "time, ", config_.d_model(), "] (got ", input.scalar_type(), " of shape ",
                input.sizes(), ")");
    x = std::move(input);
  }
  for (const auto& block : *blocks) x = block.forward(x);
  if (!is_last_stage()) return x;
  if (!head.is_empty()) {
    if (output_layer_) return output_layer_(ln_f(x), head->weight);
    return head(ln_f(x));
  }
  // The output layer shares the token embedding's weight ([Note: tied embedding]).
  if (output_layer_) return output_layer_(ln_f(x), tok_emb->weight);
  return ln_f(x).matmul(tok_emb->weight.t());
}

at::Tensor GPTImpl::generate(at::Tensor prompt, int64_t n_new, double temperature, int64_t seed) {
  TORCH_CHECK(prompt.dim() == 2 && prompt.scalar_type() == at::kLong && prompt.size(1) >= 1,
              "GPT::generate: expected int64 token ids of shape [batch, time] with time >= 1 (got ",
              prompt.scalar_type(), " of shape ", prompt.sizes(), ")");
  TORCH_CHECK(n_new >= 0, "GPT::generate: expected n_new >= 0 (got ", n_new, ")");
  TORCH_CHECK(temperature >= 0.0, "GPT::generate: expected temperature >= 0 (got ", temperature, ")");
  TORCH_CHECK(is_first_stage() && is_last_stage(), "GPT::generate: needs the whole model (token ids "
              "in, logits out); this one is a pipeline stage (", (is_first_stage() ? "first" : (is_last_stage() ? "last" : "middle")),
              ", ", blocks_text(blocks), ")");
  c10::NoGradGuard no_grad;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
  at::Tensor tokens = prompt;
  for (int64_t i = 0; i < n_new; ++i) {
    const int64_t time = tokens.size(1);
    const at::Tensor window = tokens.narrow(1, std::max<int64_t>(0, time - config_.context_length()),
                                            std::min(time, config_.context_length()));
    // This module's own forward (its hooks, if any, are around the whole call); the blocks run
    // through their holders, with their hooks.
    const at::Tensor logits = forward(window).select(1, -1);  // [batch, vocab]
    TORCH_CHECK(logits.size(-1) == config_.vocab_size(), "GPT::generate: expected logits over the ",
                config_.vocab_size(), " tokens of the vocabulary, got ", logits.size(-1),
                " (vocabulary-parallel logits: build the model without loss_parallel to sample)");
    at::Tensor next;
    if (temperature == 0.0) {
      next = logits.argmax(-1, /*keepdim=*/true);
    } else {
      const at::Tensor probs = at::softmax(logits.to(at::kCPU, at::kFloat) / temperature, -1);
      next = at::multinomial(probs, 1, /*replacement=*/false, generator).to(tokens.device());
    }
    tokens = at::cat({tokens, next}, 1);
  }
  return tokens;
}

std::vector<Block> GPTImpl::block_list() const { return blocks->holders<Block>(); }

void GPTImpl::set_dropout_layout(const DropoutLayout& layout) {
  dropout_layout_ = layout;
  for (auto& block : block_list()) {
    block->attn->set_dropout_layout(layout);
    block->mlp->set_dropout_layout(layout);
  }
}

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.dim() == 3 && targets.dim() == 2 &&
                  logits.size(0) == targets.size(0) && logits.size(1) == targets.size(1),
              "next_token_loss: expected logits [batch, time, vocab] and targets [batch, time] "
              "(got ", logits.sizes(), " and ", targets.sizes(), ")");
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(2)}), targets.reshape({-1}));
}

}  // namespace fsdp::examples

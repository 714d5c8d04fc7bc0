#include "fsdp_cpp/composable/context_parallel.h"
#include "fsdp_cpp/models/llama.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp_cpp/models/hf_json.h"

namespace fsdp::models {

namespace {

// rotate_half of transformers: [x1, x2] -> [-x2, x1] over the last dimension's halves.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

void LlamaConfig::validate() const {
  auto positive = [](int64_t v, const char* name) {
    TORCH_CHECK(v > 0, "LlamaConfig: ", name, " must be positive (got ", v, ")");
  };
  positive(vocab_size_, "vocab_size");
  positive(hidden_size_, "hidden_size");
  positive(intermediate_size_, "intermediate_size");
  positive(num_hidden_layers_, "num_hidden_layers");
  positive(num_attention_heads_, "num_attention_heads");
  positive(max_position_embeddings_, "max_position_embeddings");
  positive(vocab_multiple_, "vocab_multiple");
  TORCH_CHECK(num_key_value_heads_ >= 0, "LlamaConfig: num_key_value_heads must be >= 0 (0: num_attention_heads), got ",
              num_key_value_heads_);
  TORCH_CHECK(num_attention_heads_ % kv_heads() == 0, "LlamaConfig: num_attention_heads (", num_attention_heads_,
              ") must be a multiple of num_key_value_heads (", kv_heads(), ")");
  TORCH_CHECK(head_dim_ > 0 || hidden_size_ % num_attention_heads_ == 0, "LlamaConfig: without head_dim, hidden_size (",
              hidden_size_, ") must be a multiple of num_attention_heads (", num_attention_heads_, ")");
  TORCH_CHECK(head_size() % 2 == 0, "LlamaConfig: the head dimension must be even for rotary embeddings (got ",
              head_size(), ")");
  TORCH_CHECK(rms_norm_eps_ > 0.0, "LlamaConfig: rms_norm_eps must be positive (got ", rms_norm_eps_, ")");
  TORCH_CHECK(rope_.rope_type == "default" || rope_.rope_type == "llama3",
              "LlamaConfig: rope type '", rope_.rope_type, "' is not supported (\"default\" or \"llama3\")");
  TORCH_CHECK(rope_.rope_theta > 0.0, "LlamaConfig: rope_theta must be positive (got ", rope_.rope_theta, ")");
  if (rope_.rope_type == "llama3") {
    TORCH_CHECK(rope_.factor > 0.0 && rope_.original_max_position_embeddings > 0 &&
                    rope_.high_freq_factor > rope_.low_freq_factor && rope_.low_freq_factor > 0.0,
                "LlamaConfig: llama3 rope parameters need factor > 0, original_max_position_embeddings > 0 and "
                "high_freq_factor > low_freq_factor > 0 (got factor ", rope_.factor, ", original_max_position_embeddings ",
                rope_.original_max_position_embeddings, ", low_freq_factor ", rope_.low_freq_factor,
                ", high_freq_factor ", rope_.high_freq_factor, ")");
  }
}

int64_t LlamaConfig::num_parameters() const {
  const int64_t h = hidden_size_, q = num_attention_heads_ * head_size(), kv = kv_heads() * head_size();
  const int64_t attn = h * q + 2 * h * kv + q * h + (attention_bias_ ? q + 2 * kv + h : 0);
  const int64_t mlp = 3 * h * intermediate_size_ + (mlp_bias_ ? 2 * intermediate_size_ + h : 0);
  const int64_t layer = attn + mlp + 2 * h;
  const int64_t embed = padded_vocab_size() * h;
  return embed * (tie_word_embeddings_ ? 1 : 2) + num_hidden_layers_ * layer + h;
}

double LlamaConfig::training_flops_per_token(int64_t seq_len) const {
  const double h = static_cast<double>(hidden_size_), q = static_cast<double>(num_attention_heads_ * head_size());
  const double kv = static_cast<double>(kv_heads() * head_size()), inter = static_cast<double>(intermediate_size_);
  // Matmul parameters: the layers' projections and the output layer (the embedding is a lookup).
  const double per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter;
  const double matmul_params = static_cast<double>(num_hidden_layers_) * per_layer + static_cast<double>(vocab_size_) * h;
  const double attention = 6.0 * static_cast<double>(num_hidden_layers_) * q * static_cast<double>(seq_len);
  return 6.0 * matmul_params + attention;
}

std::string LlamaConfig::to_hf_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["attention_bias"] = attention_bias_;
  j["attention_dropout"] = 0.0;
  j["bos_token_id"] = bos_token_id_ >= 0 ? nlohmann::ordered_json(bos_token_id_) : nlohmann::ordered_json();
  j["dtype"] = "float32";
  j["eos_token_id"] = eos_token_id_ >= 0 ? nlohmann::ordered_json(eos_token_id_) : nlohmann::ordered_json();
  j["head_dim"] = head_size();
  j["hidden_act"] = "silu";
  j["hidden_size"] = hidden_size_;
  j["initializer_range"] = initializer_range_;
  j["intermediate_size"] = intermediate_size_;
  j["max_position_embeddings"] = max_position_embeddings_;
  j["mlp_bias"] = mlp_bias_;
  j["model_type"] = "llama";
  j["num_attention_heads"] = num_attention_heads_;
  j["num_hidden_layers"] = num_hidden_layers_;
  j["num_key_value_heads"] = kv_heads();
  j["pretraining_tp"] = 1;
  j["rms_norm_eps"] = rms_norm_eps_;
  j["rope_parameters"] = nlohmann::ordered_json::parse(rope_parameters_json(rope_));
  j["tie_word_embeddings"] = tie_word_embeddings_;
  j["use_cache"] = true;
  j["vocab_size"] = vocab_size_;
  return j.dump(2) + "\n";
}

LlamaConfig parse_llama_config(const std::string& json_text, const std::string& where, int64_t vocab_multiple) {
  const HfJson j(json_text, where);
  j.expect_architecture("llama", "LlamaForCausalLM");
  LlamaConfig c(j.integer("vocab_size"));
  c.hidden_size(j.integer("hidden_size"))
      .intermediate_size(j.integer("intermediate_size"))
      .num_hidden_layers(j.integer("num_hidden_layers"))
      .num_attention_heads(j.integer("num_attention_heads"))
      .num_key_value_heads(j.integer_or("num_key_value_heads", 0))
      .head_dim(j.integer_or("head_dim", 0))
      .max_position_embeddings(j.integer_or("max_position_embeddings", 2048))
      .rms_norm_eps(j.number_or("rms_norm_eps", 1e-6))
      .rope(j.rope_parameters())
      .tie_word_embeddings(j.boolean_or("tie_word_embeddings", false))
      .attention_bias(j.boolean_or("attention_bias", false))
      .mlp_bias(j.boolean_or("mlp_bias", false))
      .initializer_range(j.number_or("initializer_range", 0.02))
      .bos_token_id(j.token_id_or("bos_token_id"))
      .eos_token_id(j.token_id_or("eos_token_id"))
      .vocab_multiple(vocab_multiple);
  j.expect_string_or("hidden_act", "silu");
  j.expect_zero_or_absent("attention_dropout");
  j.expect_one_or_absent("pretraining_tp");
  try {
    c.validate();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, ": ", e.what_without_backtrace());
  }
  return c;
}

LlamaConfig read_llama_config(const std::string& path, int64_t vocab_multiple) {
  const auto [file, text] = read_hf_config_text(path);
  return parse_llama_config(text, file, vocab_multiple);
}

at::Tensor rotary_inverse_frequencies(const RopeParameters& rope, int64_t head_dim) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // transformers: 1 / theta^(arange(0, dim, 2) / dim), computed in float32 (int64 arange, then float).
  const at::Tensor exponents = at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) /
                               static_cast<double>(head_dim);
  at::Tensor inv_freq = 1.0 / at::pow(rope.rope_theta, exponents);
  if (rope.rope_type != "llama3") return inv_freq;
  // Llama 3.1's scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend
  // between (transformers' _compute_llama3_parameters).
  const double old_context = static_cast<double>(rope.original_max_position_embeddings);
  const double low_freq_wavelen = old_context / rope.low_freq_factor;
  const double high_freq_wavelen = old_context / rope.high_freq_factor;
  const at::Tensor wavelen = 2.0 * M_PI / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq);
  const at::Tensor smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled;
  const at::Tensor medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return at::where(medium, smoothed, scaled).to(f32);
}

RMSNormImpl::RMSNormImpl(int64_t size, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({size}));
}

at::Tensor RMSNormImpl::forward(at::Tensor x) {
  const auto dtype = x.scalar_type();
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * h.to(dtype);
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& config)
    : head_dim_(config.head_size()), group_(config.num_attention_heads() / config.kv_heads()) {
  const int64_t h = config.hidden_size(), q = config.num_attention_heads() * head_dim_, kv = config.kv_heads() * head_dim_;
  const bool bias = config.attention_bias();
  q_proj = register_module("q_proj", contract::Linear(torch::nn::LinearOptions(h, q).bias(bias)));
  k_proj = register_module("k_proj", contract::Linear(torch::nn::LinearOptions(h, kv).bias(bias)));
  v_proj = register_module("v_proj", contract::Linear(torch::nn::LinearOptions(h, kv).bias(bias)));
  o_proj = register_module("o_proj", contract::Linear(torch::nn::LinearOptions(q, h).bias(bias)));
  inv_freq_ = rotary_inverse_frequencies(config.rope(), head_dim_);
}

at::Tensor LlamaAttentionImpl::forward(at::Tensor x) {
  const at::Tensor q_out = q_proj(x), k_out = k_proj(x), v_out = v_proj(x);
  const int64_t batch = q_out.size(0), time = q_out.size(1);
  // Under tensor parallelism each rank holds its heads (column-parallel projections): the head
  // counts come from the widths.
  const int64_t q_heads = q_out.size(2) / head_dim_, kv_heads = k_out.size(2) / head_dim_;
  TORCH_CHECK(q_heads * head_dim_ == q_out.size(2) && kv_heads * head_dim_ == k_out.size(2) &&
                  q_heads == kv_heads * group_,
              "LlamaAttention: this rank holds ", q_out.size(2), " query and ", k_out.size(2),
              " key features, not whole heads of ", head_dim_, " in the model's ratio ", group_,
              " (the tensor-parallel size must divide num_key_value_heads)");
  auto heads = [&](const at::Tensor& t, int64_t n) { return t.view({batch, time, n, head_dim_}).transpose(1, 2); };
  at::Tensor y = causal_lm::rotary_causal_attention(heads(q_out, q_heads), heads(k_out, kv_heads),
                                                    heads(v_out, kv_heads), inv_freq_, group_, head_dim_, cp_);
  y = y.transpose(1, 2).reshape({batch, time, q_heads * head_dim_});
  return o_proj(y);
}

LlamaMlpImpl::LlamaMlpImpl(int64_t hidden_size, int64_t intermediate_size, bool bias) {
  gate_proj = register_module("gate_proj", contract::Linear(torch::nn::LinearOptions(hidden_size, intermediate_size).bias(bias)));
  up_proj = register_module("up_proj", contract::Linear(torch::nn::LinearOptions(hidden_size, intermediate_size).bias(bias)));
  down_proj = register_module("down_proj", contract::Linear(torch::nn::LinearOptions(intermediate_size, hidden_size).bias(bias)));
}

at::Tensor LlamaMlpImpl::forward(at::Tensor x) { return down_proj(at::silu(gate_proj(x)) * up_proj(x)); }

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& config) {
  input_layernorm = register_module("input_layernorm", RMSNorm(config.hidden_size(), config.rms_norm_eps()));
  self_attn = register_module("self_attn", LlamaAttention(config));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(config.hidden_size(), config.rms_norm_eps()));
  mlp = register_module("mlp", LlamaMlp(config.hidden_size(), config.intermediate_size(), config.mlp_bias()));
}

at::Tensor LlamaDecoderLayerImpl::forward(at::Tensor x) {
  x = x + self_attn(input_layernorm(x));
  return x + mlp(post_attention_layernorm(x));
}

namespace causal_lm {

at::Tensor rotary_causal_attention(at::Tensor q, at::Tensor k, at::Tensor v, const at::Tensor& inv_freq, int64_t group,
                                   int64_t head_dim, const std::shared_ptr<comm::Communicator>& cp) {
  const int64_t time = q.size(2);
  // Rotary positions (0 .. time - 1, or this cp rank's global positions), in float32 as
  // transformers computes them, then the activations' dtype.
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(q.device());
  const at::Tensor positions = cp && cp->size() > 1
                                   ? cp::global_positions(time, cp->size(), cp->rank()).to(floats)
                                   : at::arange(time, floats);
  const at::Tensor freqs = at::outer(positions, inv_freq.to(q.device()));
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = angles.cos().to(q.scalar_type()), sin = angles.sin().to(q.scalar_type());
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  if (cp && cp->size() > 1) {
    return cp::ring_attention(q, k, v, *cp, cp::RingAttentionOptions().scale(scale));  // GQA inside
  }
  if (group > 1) {
    k = k.repeat_interleave(group, 1);
    v = v.repeat_interleave(group, 1);
  }
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true, scale);
}

std::string layers_text(const contract::ModuleList& layers) {
  if (layers->is_empty()) return "no layers";
  return "layers " + std::to_string(layers->first_name()) + " .. " +
         std::to_string(layers->first_name() + static_cast<int64_t>(layers->size()) - 1);
}

void build(torch::nn::Module& root, LlamaModel& model, contract::Linear& lm_head, int64_t rows, int64_t hidden,
           double rms_norm_eps, bool tied) {
  model = root.register_module("model", LlamaModel());
  model->embed_tokens = model->register_module("embed_tokens", contract::Embedding(torch::nn::EmbeddingOptions(rows, hidden)));
  model->layers = model->register_module("layers", contract::ModuleList());
  model->norm = model->register_module("norm", RMSNorm(hidden, rms_norm_eps));
  if (!tied) lm_head = root.register_module("lm_head", contract::Linear(torch::nn::LinearOptions(hidden, rows).bias(false)));
}

void init_weights(torch::nn::Module& root, LlamaModel& model, contract::Linear& lm_head, double std,
                  int64_t vocab_size, const std::function<void(torch::nn::Module&)>& also) {
  c10::NoGradGuard no_grad;
  for (auto& m : root.modules(/*include_self=*/false)) {
    if (auto* linear = m->as<torch::nn::LinearImpl>()) {
      linear->weight.normal_(0.0, std);
      if (linear->bias.defined()) linear->bias.zero_();
    } else if (auto* embedding = m->as<torch::nn::EmbeddingImpl>()) {
      embedding->weight.normal_(0.0, std);
    } else if (also) {
      also(*m);
    }
  }
  // [Note: padded vocabulary]: the padding rows are zeros.
  const int64_t rows = model->embed_tokens->weight.size(0);
  if (rows > vocab_size) {
    model->embed_tokens->weight.narrow(0, vocab_size, rows - vocab_size).zero_();
    if (!lm_head.is_empty()) lm_head->weight.narrow(0, vocab_size, rows - vocab_size).zero_();
  }
}

void keep_stage(torch::nn::Module& root, LlamaModel& model, contract::Linear& lm_head, bool tied, int64_t n_layers,
                pipeline::BlockRange range, bool first, bool last, const std::string& api) {
  const bool whole = !model->embed_tokens.is_empty() && !model->norm.is_empty() && !model->layers->is_pruned();
  TORCH_CHECK(!tied || (first && last), api, ": a model with tied embeddings cannot be split into pipeline stages: "
              "its output layer is the token embedding's weight, which would live on the first and the last stage "
              "(asked for a ", (first ? "first" : (last ? "last" : "middle")), " stage holding layers [", range.begin,
              ", ", range.end, ")). Use tie_word_embeddings(false)");
  TORCH_CHECK(whole, api, ": the model is already a pipeline stage (", layers_text(model->layers),
              "); call keep_stage once, on the whole model");
  TORCH_CHECK(0 <= range.begin && range.begin <= range.end && range.end <= n_layers, api,
              ": expected a range of layers [begin, end) within [0, ", n_layers,
              ") (num_hidden_layers) with begin <= end, got [", range.begin, ", ", range.end, ")");
  model->layers->keep_only(range.begin, range.end);
  if (!first) {
    model->unregister_module("embed_tokens");
    model->embed_tokens = nullptr;
  }
  if (!last) {
    model->unregister_module("norm");
    model->norm = nullptr;
    if (!lm_head.is_empty()) {
      root.unregister_module("lm_head");
      lm_head = nullptr;
    }
  }
}

}  // namespace causal_lm

LlamaForCausalLMImpl::LlamaForCausalLMImpl(LlamaConfig config) : config_(std::move(config)) {
  config_.validate();
  causal_lm::build(*this, model, lm_head, config_.padded_vocab_size(), config_.hidden_size(), config_.rms_norm_eps(),
                   config_.tie_word_embeddings());
  for (int64_t i = 0; i < config_.num_hidden_layers(); ++i) model->layers->push_back(LlamaDecoderLayer(config_));
  causal_lm::init_weights(*this, model, lm_head, config_.initializer_range(), config_.vocab_size());
}

void LlamaForCausalLMImpl::keep_stage(pipeline::BlockRange range, bool first, bool last) {
  causal_lm::keep_stage(*this, model, lm_head, config_.tie_word_embeddings(), config_.num_hidden_layers(), range,
                        first, last, "LlamaForCausalLM::keep_stage");
}

std::vector<LlamaDecoderLayer> LlamaForCausalLMImpl::layer_list() const {
  return model->layers->holders<LlamaDecoderLayer>();
}

at::Tensor LlamaForCausalLMImpl::forward(at::Tensor input) {
  at::Tensor x;
  if (is_first_stage()) {
    TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kLong, "LlamaForCausalLM::forward: expected int64 "
                "token ids of shape [batch, time] (got ", input.scalar_type(), " of shape ", input.sizes(), ")");
    x = model->embed_tokens(input);
  } else {
    TORCH_CHECK(input.dim() == 3 && input.is_floating_point() && input.size(2) == config_.hidden_size(),
                "LlamaForCausalLM::forward: this pipeline stage (", causal_lm::layers_text(model->layers), ", no embeddings) "
                "expected the previous stage's hidden states, floating point of shape [batch, time, ",
                config_.hidden_size(), "] (got ", input.scalar_type(), " of shape ", input.sizes(), ")");
    x = std::move(input);
  }
  for (const auto& layer : *model->layers) x = layer.forward(x);
  if (!is_last_stage()) return x;
  const at::Tensor h = model->norm(x);
  at::Tensor logits;
  if (output_layer_) {
    logits = output_layer_(h, lm_head.is_empty() ? model->embed_tokens->weight : lm_head->weight);
  } else {
    logits = lm_head.is_empty() ? h.matmul(model->embed_tokens->weight.t()) : lm_head(h);
  }
  if (keep_padded_logits_ || logits.size(-1) == config_.vocab_size()) return logits;
  return logits.narrow(-1, 0, config_.vocab_size());
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  TORCH_CHECK(logits.dim() == 3 && targets.dim() == 2 && logits.size(0) == targets.size(0) &&
                  logits.size(1) == targets.size(1),
              "causal_lm_loss: expected logits [batch, time, vocab] and targets [batch, time] (got ", logits.sizes(),
              " and ", targets.sizes(), ")");
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(2)}).to(at::kFloat), targets.reshape({-1}),
                                /*weight=*/{}, at::Reduction::Mean, ignore_index);
}

}  // namespace fsdp::models

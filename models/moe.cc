#include "fsdp_cpp/models/moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp_cpp/models/hf_json.h"

namespace fsdp::models {

namespace {

using causal_lm::layers_text;

}  // namespace

// ---------------------------------------------------------------------------------------------
// MoeConfig

bool MoeConfig::is_sparse_layer(int64_t layer) const {
  const bool dense_only = std::find(mlp_only_layers_.begin(), mlp_only_layers_.end(), layer) != mlp_only_layers_.end();
  return !dense_only && num_experts_ > 0 && (layer + 1) % decoder_sparse_step_ == 0;
}

int64_t MoeConfig::num_sparse_layers() const {
  int64_t n = 0;
  for (int64_t i = 0; i < num_hidden_layers_; ++i) n += is_sparse_layer(i) ? 1 : 0;
  return n;
}

LlamaConfig MoeConfig::attention_config() const {
  return LlamaConfig(vocab_size_)
      .hidden_size(hidden_size_)
      .intermediate_size(intermediate_size_)
      .num_hidden_layers(num_hidden_layers_)
      .num_attention_heads(num_attention_heads_)
      .num_key_value_heads(num_key_value_heads_)
      .head_dim(head_dim_)
      .max_position_embeddings(max_position_embeddings_)
      .rms_norm_eps(rms_norm_eps_)
      .rope(rope_)
      .tie_word_embeddings(tie_word_embeddings_)
      .attention_bias(attention_bias_)
      .initializer_range(initializer_range_)
      .vocab_multiple(vocab_multiple_);
}

void MoeConfig::validate() const {
  auto positive = [](int64_t v, const char* name) {
    TORCH_CHECK(v > 0, "MoeConfig: ", name, " must be positive (got ", v, ")");
  };
  // The attention's fields and the vocabulary: Llama's rules (errors renamed).
  try {
    attention_config().validate();
  } catch (const c10::Error& e) {
    std::string text = e.what_without_backtrace();
    if (text.rfind("LlamaConfig", 0) == 0) text = "MoeConfig" + text.substr(11);
    TORCH_CHECK(false, text);
  }
  positive(moe_intermediate_size_, "moe_intermediate_size");
  positive(num_experts_, "num_experts");
  positive(decoder_sparse_step_, "decoder_sparse_step");
  TORCH_CHECK(num_experts_per_tok_ > 0 && num_experts_per_tok_ <= num_experts_, "MoeConfig: num_experts_per_tok (",
              num_experts_per_tok_, ") must lie in [1, num_experts = ", num_experts_, "]");
  for (int64_t layer : mlp_only_layers_) {
    TORCH_CHECK(layer >= 0 && layer < num_hidden_layers_, "MoeConfig: mlp_only_layers names layer ", layer,
                ", outside [0, num_hidden_layers = ", num_hidden_layers_, ")");
  }
  TORCH_CHECK(scoring_func_ == "softmax" || scoring_func_ == "sigmoid", "MoeConfig: scoring_func '", scoring_func_,
              "' is not supported (\"softmax\" or \"sigmoid\")");
  positive(n_group_, "n_group");
  TORCH_CHECK(num_experts_ % n_group_ == 0, "MoeConfig: num_experts (", num_experts_,
              ") must be a multiple of n_group (", n_group_, ")");
  TORCH_CHECK(topk_group_ >= 1 && topk_group_ <= n_group_, "MoeConfig: topk_group (", topk_group_,
              ") must lie in [1, n_group = ", n_group_, "]");
  if (n_group_ > 1) {
    TORCH_CHECK(scoring_func_ == "sigmoid", "MoeConfig: group-limited routing (n_group ", n_group_,
                ") needs scoring_func \"sigmoid\" (DeepSeek-V3's router)");
    TORCH_CHECK(num_experts_ / n_group_ >= 2, "MoeConfig: each of the n_group (", n_group_,
                ") groups must hold at least 2 experts (a group's score sums its best two); num_experts is ",
                num_experts_);
    TORCH_CHECK(topk_group_ * (num_experts_ / n_group_) >= num_experts_per_tok_, "MoeConfig: topk_group (",
                topk_group_, ") groups of ", num_experts_ / n_group_, " experts hold fewer than num_experts_per_tok (",
                num_experts_per_tok_, ")");
  }
  TORCH_CHECK(routed_scaling_factor_ > 0.0, "MoeConfig: routed_scaling_factor must be positive (got ",
              routed_scaling_factor_, ")");
  TORCH_CHECK(n_shared_experts_ >= 0, "MoeConfig: n_shared_experts must be >= 0 (got ", n_shared_experts_, ")");
  TORCH_CHECK(router_bias_update_rate_ >= 0.0, "MoeConfig: router_bias_update_rate must be >= 0 (got ",
              router_bias_update_rate_, ")");
  TORCH_CHECK(router_bias_update_rate_ == 0.0 || scoring_func_ == "sigmoid", "MoeConfig: router_bias_update_rate (",
              router_bias_update_rate_, ") needs scoring_func \"sigmoid\" (the e_score_correction_bias it updates)");
  TORCH_CHECK(std::isfinite(router_aux_loss_coef_), "MoeConfig: router_aux_loss_coef must be finite");
}

double MoeConfig::training_flops_per_token(int64_t seq_len) const {
  const double h = static_cast<double>(hidden_size_), q = static_cast<double>(num_attention_heads_ * head_size());
  const double kv = static_cast<double>(kv_heads() * head_size());
  const double attention = h * q + 2 * h * kv + q * h;
  const double sparse = static_cast<double>(num_experts_per_tok_ + n_shared_experts_) * 3 * h *
                            static_cast<double>(moe_intermediate_size_) + h * static_cast<double>(num_experts_);
  const double dense = 3 * h * static_cast<double>(intermediate_size_);
  const double sparse_layers = static_cast<double>(num_sparse_layers());
  const double layers = static_cast<double>(num_hidden_layers_);
  const double matmul = layers * attention + sparse_layers * sparse + (layers - sparse_layers) * dense +
                        static_cast<double>(vocab_size_) * h;
  return 6.0 * matmul + 6.0 * layers * q * static_cast<double>(seq_len);
}

std::string MoeConfig::to_hf_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["attention_bias"] = attention_bias_;
  j["attention_dropout"] = 0.0;
  j["bos_token_id"] = bos_token_id_ >= 0 ? nlohmann::ordered_json(bos_token_id_) : nlohmann::ordered_json();
  j["decoder_sparse_step"] = decoder_sparse_step_;
  j["dtype"] = "float32";
  j["eos_token_id"] = eos_token_id_ >= 0 ? nlohmann::ordered_json(eos_token_id_) : nlohmann::ordered_json();
  j["head_dim"] = head_size();
  j["hidden_act"] = "silu";
  j["hidden_size"] = hidden_size_;
  j["initializer_range"] = initializer_range_;
  j["intermediate_size"] = intermediate_size_;
  j["max_position_embeddings"] = max_position_embeddings_;
  j["mlp_only_layers"] = mlp_only_layers_;
  j["model_type"] = "qwen3_moe";
  j["moe_intermediate_size"] = moe_intermediate_size_;
  j["norm_topk_prob"] = norm_topk_prob_;
  j["num_attention_heads"] = num_attention_heads_;
  // transformers 5 maps num_experts to num_local_experts; earlier versions read num_experts only.
  j["num_experts"] = num_experts_;
  j["num_experts_per_tok"] = num_experts_per_tok_;
  j["num_hidden_layers"] = num_hidden_layers_;
  j["num_key_value_heads"] = kv_heads();
  j["output_router_logits"] = output_router_logits_;
  j["rms_norm_eps"] = rms_norm_eps_;
  j["rope_parameters"] = nlohmann::ordered_json::parse(rope_parameters_json(rope_));
  j["router_aux_loss_coef"] = router_aux_loss_coef_;
  j["sliding_window"] = nullptr;
  j["tie_word_embeddings"] = tie_word_embeddings_;
  j["use_cache"] = true;
  j["use_sliding_window"] = false;
  j["vocab_size"] = vocab_size_;
  // DeepSeek-V3's keys, only when they change the model.
  if (scoring_func_ != "softmax") j["scoring_func"] = scoring_func_;
  if (n_group_ != 1 || topk_group_ != 1) {
    j["n_group"] = n_group_;
    j["topk_group"] = topk_group_;
  }
  if (routed_scaling_factor_ != 1.0) j["routed_scaling_factor"] = routed_scaling_factor_;
  if (n_shared_experts_ != 0) j["n_shared_experts"] = n_shared_experts_;
  if (router_bias_update_rate_ != 0.0) j["router_bias_update_rate"] = router_bias_update_rate_;
  return j.dump(2) + "\n";
}

MoeConfig parse_moe_config(const std::string& json_text, const std::string& where, int64_t vocab_multiple) {
  const HfJson j(json_text, where);
  j.expect_architecture("qwen3_moe", "Qwen3MoeForCausalLM");
  const int64_t experts = j.integer_or("num_experts", j.integer_or("num_local_experts", -1));
  TORCH_CHECK(experts != -1, where, ": key 'num_experts' (or 'num_local_experts') is missing (an integer is expected)");
  MoeConfig c(j.integer("vocab_size"));
  c.hidden_size(j.integer("hidden_size"))
      .intermediate_size(j.integer("intermediate_size"))
      .moe_intermediate_size(j.integer("moe_intermediate_size"))
      .num_hidden_layers(j.integer("num_hidden_layers"))
      .num_attention_heads(j.integer("num_attention_heads"))
      .num_key_value_heads(j.integer_or("num_key_value_heads", 0))
      .head_dim(j.integer_or("head_dim", 0))
      .max_position_embeddings(j.integer_or("max_position_embeddings", 32768))
      .rms_norm_eps(j.number_or("rms_norm_eps", 1e-6))
      .rope(j.rope_parameters())
      .tie_word_embeddings(j.boolean_or("tie_word_embeddings", false))
      .attention_bias(j.boolean_or("attention_bias", false))
      .initializer_range(j.number_or("initializer_range", 0.02))
      .bos_token_id(j.token_id_or("bos_token_id"))
      .eos_token_id(j.token_id_or("eos_token_id"))
      .vocab_multiple(vocab_multiple)
      .num_experts(experts)
      .num_experts_per_tok(j.integer("num_experts_per_tok"))
      .norm_topk_prob(j.boolean_or("norm_topk_prob", false))
      .decoder_sparse_step(j.integer_or("decoder_sparse_step", 1))
      .mlp_only_layers(j.integers_or_empty("mlp_only_layers"))
      .output_router_logits(j.boolean_or("output_router_logits", false))
      .router_aux_loss_coef(j.number_or("router_aux_loss_coef", 0.001))
      .scoring_func(j.string_or("scoring_func", "softmax"))
      .n_group(j.integer_or("n_group", 1))
      .topk_group(j.integer_or("topk_group", 1))
      .routed_scaling_factor(j.number_or("routed_scaling_factor", 1.0))
      .n_shared_experts(j.integer_or("n_shared_experts", 0))
      .router_bias_update_rate(j.number_or("router_bias_update_rate", 0.0));
  j.expect_string_or("hidden_act", "silu");
  j.expect_zero_or_absent("attention_dropout");
  TORCH_CHECK(!j.boolean_or("use_sliding_window", false), where,
              ": key 'use_sliding_window' is true; sliding-window attention is not supported");
  try {
    c.validate();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, ": ", e.what_without_backtrace());
  }
  return c;
}

MoeConfig read_moe_config(const std::string& path, int64_t vocab_multiple) {
  const auto [file, text] = read_hf_config_text(path);
  return parse_moe_config(text, file, vocab_multiple);
}

// ---------------------------------------------------------------------------------------------
// Modules

MoeAttentionImpl::MoeAttentionImpl(const MoeConfig& config)
    : head_dim_(config.head_size()),
      group_(config.num_attention_heads() / config.kv_heads()),
      eps_(config.rms_norm_eps()) {
  const int64_t h = config.hidden_size(), q = config.num_attention_heads() * head_dim_, kv = config.kv_heads() * head_dim_;
  const bool bias = config.attention_bias();
  q_proj = register_module("q_proj", contract::Linear(torch::nn::LinearOptions(h, q).bias(bias)));
  k_proj = register_module("k_proj", contract::Linear(torch::nn::LinearOptions(h, kv).bias(bias)));
  v_proj = register_module("v_proj", contract::Linear(torch::nn::LinearOptions(h, kv).bias(bias)));
  o_proj = register_module("o_proj", contract::Linear(torch::nn::LinearOptions(q, h).bias(bias)));
  q_norm = register_module("q_norm", RMSNorm(head_dim_, config.rms_norm_eps()));
  k_norm = register_module("k_norm", RMSNorm(head_dim_, config.rms_norm_eps()));
  inv_freq_ = rotary_inverse_frequencies(config.rope(), head_dim_);
}

at::Tensor MoeAttentionImpl::forward(at::Tensor x) {
  const at::Tensor q_out = q_proj(x), k_out = k_proj(x), v_out = v_proj(x);
  const int64_t batch = q_out.size(0), time = q_out.size(1);
  const int64_t q_heads = q_out.size(2) / head_dim_, kv_heads = k_out.size(2) / head_dim_;
  TORCH_CHECK(q_heads * head_dim_ == q_out.size(2) && kv_heads * head_dim_ == k_out.size(2) &&
                  q_heads == kv_heads * group_,
              "MoeAttention: this rank holds ", q_out.size(2), " query and ", k_out.size(2),
              " key features, not whole heads of ", head_dim_, " in the model's ratio ", group_,
              " (the tensor-parallel size must divide num_key_value_heads)");
  // transformers: q_norm(q_proj(x).view(b, t, heads, head_dim)).transpose(1, 2), the same for k.
  auto head_norm = [&](RMSNorm& norm, const at::Tensor& t) {
    if (!norm_weight_fn_) return norm(t);
    // RMSNormImpl::forward with the mapped weight.
    at::Tensor h = t.to(at::kFloat);
    h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
    return norm_weight_fn_(norm->weight) * h.to(t.scalar_type());
  };
  at::Tensor q = head_norm(q_norm, q_out.view({batch, time, q_heads, head_dim_})).transpose(1, 2);
  at::Tensor k = head_norm(k_norm, k_out.view({batch, time, kv_heads, head_dim_})).transpose(1, 2);
  at::Tensor v = v_out.view({batch, time, kv_heads, head_dim_}).transpose(1, 2);
  at::Tensor y = causal_lm::rotary_causal_attention(q, k, v, inv_freq_, group_, head_dim_, cp_);
  y = y.transpose(1, 2).reshape({batch, time, q_heads * head_dim_});
  return o_proj(y);
}

MoeRouterImpl::MoeRouterImpl(const MoeConfig& config) : config_(config) {
  weight = register_parameter("weight", at::zeros({config.num_experts(), config.hidden_size()}));
  if (config.has_score_correction_bias()) {
    e_score_correction_bias = register_buffer("e_score_correction_bias", at::zeros({config.num_experts()}));
  }
  load = at::zeros({config.num_experts()}, at::kDouble);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> MoeRouterImpl::forward(at::Tensor x) {
  const int64_t k = config_.num_experts_per_tok(), n_experts = config_.num_experts();
  at::Tensor logits, weights, ids;
  if (!config_.has_score_correction_bias()) {
    // transformers' Qwen3MoeTopKRouter.
    logits = at::linear(x, weight);
    const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
    auto [top, top_ids] = at::topk(probs, k, -1);
    if (config_.norm_topk_prob()) top = top / top.sum(-1, /*keepdim=*/true);
    weights = top.to(logits.scalar_type());
    ids = top_ids;
  } else {
    // transformers' DeepseekV3TopkRouter.
    logits = at::linear(x.to(at::kFloat), weight.to(at::kFloat));
    const at::Tensor scores = logits.sigmoid();
    at::Tensor choice = scores.detach() + e_score_correction_bias.to(scores.device());
    if (config_.n_group() > 1) {
      const int64_t n = choice.size(0), groups = config_.n_group(), per_group = n_experts / groups;
      const at::Tensor group_scores = std::get<0>(choice.view({n, groups, per_group}).topk(2, -1)).sum(-1);
      const at::Tensor group_idx = std::get<1>(at::topk(group_scores, config_.topk_group(), -1));
      const at::Tensor group_mask = at::zeros_like(group_scores).scatter_(1, group_idx, 1.0);
      const at::Tensor score_mask = group_mask.unsqueeze(-1).expand({n, groups, per_group}).reshape({n, n_experts});
      choice = choice.masked_fill(score_mask.logical_not(), -std::numeric_limits<double>::infinity());
    }
    ids = std::get<1>(at::topk(choice, k, -1));
    weights = scores.gather(1, ids);
    if (config_.norm_topk_prob()) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
    if (c10::GradMode::is_enabled()) {
      c10::NoGradGuard no_grad;
      if (load.device() != ids.device()) load = load.to(ids.device());  // counted where routed: no sync
      load.index_add_(0, ids.reshape({-1}), at::ones({ids.numel()}, load.options()));
    }
  }
  if (config_.routed_scaling_factor() != 1.0) weights = weights * config_.routed_scaling_factor();
  return {logits, weights, ids};
}

MoeSparseBlockImpl::MoeSparseBlockImpl(const MoeConfig& config) : config_(config) {
  gate = register_module("gate", MoeRouter(config));
  experts = register_module("experts", contract::ModuleList());
  for (int64_t e = 0; e < config.num_experts(); ++e) {
    experts->push_back(MoeExpert(config.hidden_size(), config.moe_intermediate_size()));
  }
  if (config.n_shared_experts() > 0) {
    shared_experts = register_module(
        "shared_experts",
        LlamaMlp(config.hidden_size(), config.moe_intermediate_size() * config.n_shared_experts(), false));
  }
}

std::tuple<at::Tensor, at::Tensor> MoeSparseBlockImpl::forward(at::Tensor x) {
  const int64_t batch = x.size(0), time = x.size(1), hidden = x.size(2), n_experts = config_.num_experts();
  const at::Tensor tokens = x.reshape({-1, hidden});
  auto [logits, weights, ids] = gate(tokens);
  // transformers' experts loop: each expert, in order, on the rows routed to it ((top-k position,
  // token) order, as torch.where over the [k, N] mask), weighted, added at the rows. Every expert
  // runs, with an empty batch when no row goes to it.
  at::Tensor out = at::zeros_like(tokens);
  const at::Tensor ids_t = ids.t();  // [k, N]
  std::vector<int64_t> rows_per_expert(n_experts, 0);
  auto expert_list = experts->holders<MoeExpert>();
  if (ep_) {
    // Expert parallel: every local expert on the rows routed to it from every ep rank (empty
    // batches included), the pairs' outputs weighted and summed per token on its own rank.
    const ep::Routed routed = ep_->dispatch(tokens, ids);
    std::vector<at::Tensor> outs;
    int64_t at = 0;
    for (int64_t e = 0; e < ep_->local_count(); ++e) {
      outs.push_back(expert_list[e](routed.rows.narrow(0, at, routed.rows_per_local_expert[e])));
      at += routed.rows_per_local_expert[e];
    }
    const at::Tensor pairs = ep_->combine(at::cat(outs), routed);  // [N, k, H]
    out = (pairs * weights.unsqueeze(-1)).sum(1).to(out.scalar_type());
    const at::Tensor counts = at::bincount(ids.reshape({-1}), {}, n_experts);
    for (int64_t e = 0; e < n_experts; ++e) rows_per_expert[e] = counts[e].item<int64_t>();
  }
  for (int64_t e = 0; e < n_experts && !ep_; ++e) {
    const at::Tensor where = (ids_t == e).nonzero();  // [M, 2]: (position, token)
    const at::Tensor position = where.select(1, 0), token = where.select(1, 1);
    rows_per_expert[e] = where.size(0);
    const at::Tensor y = expert_list[e](tokens.index_select(0, token));
    const at::Tensor w = weights.index({token, position}).unsqueeze(-1);
    out = out.index_add(0, token, (y * w).to(out.scalar_type()));
  }
  out = out.view({batch, time, hidden});
  if (!shared_experts.is_empty()) out = out + shared_experts(x);
  last_.expert_ids = ids.detach();
  last_.weights = weights.detach();
  last_.rows_per_expert = std::move(rows_per_expert);
  at::Tensor stats;
  if (config_.has_aux_loss()) {
    // [Note: MoE auxiliary loss]: per row, the sum over time of softmax(logits) and of the top-k
    // counts (load_balancing_loss_func's top-k of the softmax, whatever the scoring).
    const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
    at::Tensor counts;
    {
      c10::NoGradGuard no_grad;
      const at::Tensor chosen = std::get<1>(at::topk(probs, config_.num_experts_per_tok(), -1));
      counts = at::zeros_like(probs).scatter_add_(1, chosen, at::ones(chosen.sizes(), probs.options()));
    }
    stats = at::cat({probs.view({batch, time, n_experts}).sum(1), counts.view({batch, time, n_experts}).sum(1)}, -1);
  }
  return {out, stats};
}

void MoeSparseBlockImpl::set_expert_parallel(std::shared_ptr<ep::ExpertParallel> ep) {
  TORCH_CHECK(ep != nullptr, "MoeSparseBlock::set_expert_parallel: expected an ExpertParallel, found none");
  TORCH_CHECK(!ep_ && !experts->is_pruned(), "MoeSparseBlock::set_expert_parallel (layer ", last_.layer,
              "): the experts are already split over an ep group; call it once");
  TORCH_CHECK(ep->num_experts() == config_.num_experts(), "MoeSparseBlock::set_expert_parallel (layer ", last_.layer,
              "): the ExpertParallel routes ", ep->num_experts(), " experts, the layer has ", config_.num_experts());
  experts->keep_only(ep->local_begin(), ep->local_begin() + ep->local_count());
  ep_ = std::move(ep);
}

MoeDecoderLayerImpl::MoeDecoderLayerImpl(const MoeConfig& config, int64_t layer_index) {
  input_layernorm = register_module("input_layernorm", RMSNorm(config.hidden_size(), config.rms_norm_eps()));
  self_attn = register_module("self_attn", MoeAttention(config));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(config.hidden_size(), config.rms_norm_eps()));
  if (config.is_sparse_layer(layer_index)) {
    moe = register_module("mlp", MoeSparseBlock(config));
    moe->set_layer_index(layer_index);
  } else {
    dense_mlp = register_module("mlp", LlamaMlp(config.hidden_size(), config.intermediate_size(), false));
  }
}

std::tuple<at::Tensor, at::Tensor> MoeDecoderLayerImpl::forward(at::Tensor x) {
  x = x + self_attn(input_layernorm(x));
  const at::Tensor h = post_attention_layernorm(x);
  if (moe.is_empty()) return {x + dense_mlp(h), at::Tensor()};
  auto [y, stats] = moe(h);
  return {x + y, stats};
}

MoeForCausalLMImpl::MoeForCausalLMImpl(MoeConfig config) : config_(std::move(config)) {
  config_.validate();
  causal_lm::build(*this, model, lm_head, config_.padded_vocab_size(), config_.hidden_size(), config_.rms_norm_eps(),
                   config_.tie_word_embeddings());
  for (int64_t i = 0; i < config_.num_hidden_layers(); ++i) model->layers->push_back(MoeDecoderLayer(config_, i));
  // transformers' _init_weights, the routers' weights N(0, initializer_range) too;
  // e_score_correction_bias starts at 0 (its constructor).
  const double std = config_.initializer_range();
  causal_lm::init_weights(*this, model, lm_head, std, config_.vocab_size(), [std](torch::nn::Module& m) {
    if (auto* router = m.as<MoeRouterImpl>()) router->weight.normal_(0.0, std);
  });
}

void MoeForCausalLMImpl::keep_stage(pipeline::BlockRange range, bool first, bool last) {
  causal_lm::keep_stage(*this, model, lm_head, config_.tie_word_embeddings(), config_.num_hidden_layers(), range,
                        first, last, "MoeForCausalLM::keep_stage");
}

std::vector<MoeDecoderLayer> MoeForCausalLMImpl::layer_list() const {
  return model->layers->holders<MoeDecoderLayer>();
}

std::vector<MoeRouting> MoeForCausalLMImpl::last_routing() const {
  std::vector<MoeRouting> out;
  for (const auto& layer : layer_list()) {
    if (!layer->moe.is_empty()) out.push_back(layer->moe->last_routing());
  }
  return out;
}

at::Tensor MoeForCausalLMImpl::router_loads() const {
  std::vector<at::Tensor> loads;
  for (const auto& layer : layer_list()) {
    if (!layer->moe.is_empty() && config_.has_score_correction_bias()) loads.push_back(layer->moe->gate->load);
  }
  if (loads.empty()) return at::zeros({0, config_.num_experts()}, at::kDouble);
  return at::stack(loads);
}

void MoeForCausalLMImpl::update_router_bias(const at::Tensor& loads) {
  std::vector<MoeRouter> routers;
  for (const auto& layer : layer_list()) {
    if (!layer->moe.is_empty() && config_.has_score_correction_bias()) routers.push_back(layer->moe->gate);
  }
  TORCH_CHECK(loads.dim() == 2 && loads.size(0) == static_cast<int64_t>(routers.size()) &&
                  loads.size(1) == config_.num_experts(),
              "MoeForCausalLM::update_router_bias: expected loads [", routers.size(), ", ", config_.num_experts(),
              "] (router_loads() of this model), got ", loads.sizes());
  c10::NoGradGuard no_grad;
  const double rate = config_.router_bias_update_rate();
  for (size_t i = 0; i < routers.size(); ++i) {
    const at::Tensor load = loads[static_cast<int64_t>(i)].to(at::kDouble).cpu();
    if (rate != 0.0) {
      const at::Tensor delta = (rate * at::sign(load.mean() - load)).to(routers[i]->e_score_correction_bias.options());
      routers[i]->e_score_correction_bias.add_(delta);
    }
    routers[i]->load.zero_();
  }
}

void MoeForCausalLMImpl::set_router_stats_output(bool on) {
  TORCH_CHECK(!on || config_.has_aux_loss(), "MoeForCausalLM::set_router_stats_output: the model has no auxiliary "
              "loss (set output_router_logits and a non-zero router_aux_loss_coef)");
  stats_output_ = on;
}

at::Tensor MoeForCausalLMImpl::forward(at::Tensor input) {
  const int64_t n_experts = config_.num_experts();
  at::Tensor x, stats;
  if (is_first_stage()) {
    TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kLong, "MoeForCausalLM::forward: expected int64 "
                "token ids of shape [batch, time] (got ", input.scalar_type(), " of shape ", input.sizes(), ")");
    x = model->embed_tokens(input);
  } else if (stats_output_) {
    const int64_t h = config_.hidden_size();
    TORCH_CHECK(input.dim() == 2 && input.is_floating_point() && input.size(1) > 2 * n_experts &&
                    (input.size(1) - 2 * n_experts) % h == 0,
                "MoeForCausalLM::forward: this pipeline stage (", layers_text(model->layers), ", no embeddings) "
                "expected the previous stage's hidden states with router statistics, floating point of shape "
                "[batch, time x ", h, " + 2 x ", n_experts, "] (got ", input.scalar_type(), " of shape ",
                input.sizes(), ")");
    const int64_t time = (input.size(1) - 2 * n_experts) / h;
    x = input.narrow(1, 0, time * h).reshape({input.size(0), time, h});
    stats = input.narrow(1, time * h, 2 * n_experts);
  } else {
    TORCH_CHECK(input.dim() == 3 && input.is_floating_point() && input.size(2) == config_.hidden_size(),
                "MoeForCausalLM::forward: this pipeline stage (", layers_text(model->layers), ", no embeddings) "
                "expected the previous stage's hidden states, floating point of shape [batch, time, ",
                config_.hidden_size(), "] (got ", input.scalar_type(), " of shape ", input.sizes(), ")");
    x = std::move(input);
  }
  for (auto& layer : layer_list()) {
    auto [y, s] = layer(x);
    x = std::move(y);
    if (s.defined()) stats = stats.defined() ? stats + s : s;
  }
  auto with_stats = [&](const at::Tensor& out) {
    if (!stats_output_) return out;
    const at::Tensor st = stats.defined() ? stats.to(out.scalar_type())
                                          : at::zeros({out.size(0), 2 * n_experts}, out.options());
    return at::cat({out.reshape({out.size(0), -1}), st}, 1);
  };
  if (!is_last_stage()) return with_stats(x);
  const at::Tensor h = model->norm(x);
  at::Tensor logits;
  if (output_layer_) {
    logits = output_layer_(h, lm_head.is_empty() ? model->embed_tokens->weight : lm_head->weight);
  } else {
    logits = lm_head.is_empty() ? h.matmul(model->embed_tokens->weight.t()) : lm_head(h);
  }
  if (!keep_padded_logits_ && logits.size(-1) != config_.vocab_size()) logits = logits.narrow(-1, 0, config_.vocab_size());
  return with_stats(logits);
}

std::pair<at::Tensor, at::Tensor> split_router_stats(const at::Tensor& output, int64_t time, int64_t num_experts) {
  TORCH_CHECK(output.dim() == 2 && time > 0 && output.size(1) > 2 * num_experts &&
                  (output.size(1) - 2 * num_experts) % time == 0,
              "split_router_stats: expected [batch, time x width + 2 x ", num_experts, "] with time ", time, ", got ",
              output.sizes());
  const int64_t width = (output.size(1) - 2 * num_experts) / time;
  return {output.narrow(1, 0, time * width).reshape({output.size(0), time, width}),
          output.narrow(1, time * width, 2 * num_experts)};
}

at::Tensor moe_aux_loss(const at::Tensor& stats, const MoeConfig& config, int64_t tokens) {
  const int64_t e = config.num_experts();
  TORCH_CHECK(stats.dim() == 2 && stats.size(1) == 2 * e, "moe_aux_loss: expected router statistics [batch, ", 2 * e,
              "], got ", stats.sizes());
  const at::Tensor sums = stats.to(at::kFloat).sum(0);
  const double rows = static_cast<double>(config.num_sparse_layers()) * static_cast<double>(tokens);
  const at::Tensor tokens_per_expert = sums.narrow(0, e, e).detach() / rows;
  const at::Tensor prob_per_expert = sums.narrow(0, 0, e) / rows;
  return (tokens_per_expert * prob_per_expert).sum() * static_cast<double>(e);
}

}  // namespace fsdp::models

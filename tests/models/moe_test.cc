// models/moe.h on one process, against closed forms: config.json in and out (num_experts or
// num_local_experts, DeepSeek's keys, refusals), which layers are sparse and their FQNs, DeepSeek-V3
// routing (group-limited top-k, the correction bias choosing but not weighting, normalisation and
// scaling), the aux-loss-free bias update (loads counted in training forwards only), the auxiliary
// loss from router statistics, experts called with no row, and pipeline stages carrying the
// router statistics (chained stages = the whole model, outputs and gradients).
#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/utils.h>

#include "fsdp_cpp/models/moe.h"
#include "fsdp_cpp/models/moe_parallel.h"
#include "fsdp_cpp/pipeline/stage_split.h"
#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;
using fsdp::models::MoeConfig;
using fsdp::models::MoeForCausalLM;
using fsdp::testing::error_of;

MoeConfig tiny(bool deepseek = false) {
  auto c = MoeConfig(/*vocab_size=*/37)
               .hidden_size(16)
               .intermediate_size(24)
               .moe_intermediate_size(8)
               .num_hidden_layers(4)
               .num_attention_heads(2)
               .num_key_value_heads(1)
               .head_dim(8)
               .max_position_embeddings(32)
               .num_experts(8)
               .num_experts_per_tok(2)
               .norm_topk_prob(true)
               .output_router_logits(true)
               .router_aux_loss_coef(0.1);
  if (deepseek) {
    c.scoring_func("sigmoid").n_group(4).topk_group(2).routed_scaling_factor(2.5).n_shared_experts(1)
        .router_bias_update_rate(0.01).mlp_only_layers({0});
  }
  return c;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

const char* kQwen3Json = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 101,
  "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 4,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 8,
  "num_experts_per_tok": 2, "norm_topk_prob": true, "decoder_sparse_step": 2, "mlp_only_layers": [3],
  "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
  "router_aux_loss_coef": 0.001, "output_router_logits": false, "use_sliding_window": false,
  "sliding_window": null, "hidden_act": "silu", "attention_dropout": 0.0, "tie_word_embeddings": false
})";

}  // namespace

TEST_CASE("MoeConfig: config.json in and out", "[moe]") {
  const MoeConfig c = fsdp::models::parse_moe_config(kQwen3Json, "config.json");
  CHECK(c.num_experts() == 8);  // num_local_experts (transformers 5's key)
  CHECK(c.decoder_sparse_step() == 2);
  CHECK(c.num_sparse_layers() == 1);  // layers 1 and 3 by the step, 3 dense by mlp_only_layers
  CHECK(c.is_sparse_layer(1));
  CHECK_FALSE(c.is_sparse_layer(3));
  CHECK_FALSE(c.has_aux_loss());  // output_router_logits false, as transformers' default
  CHECK(c.scoring_func() == "softmax");

  const MoeConfig d = tiny(/*deepseek=*/true);
  const MoeConfig back = fsdp::models::parse_moe_config(d.to_hf_json(), "exported");
  CHECK(back.scoring_func() == "sigmoid");
  CHECK(back.n_group() == 4);
  CHECK(back.topk_group() == 2);
  CHECK(back.routed_scaling_factor() == 2.5);
  CHECK(back.n_shared_experts() == 1);
  CHECK(back.router_bias_update_rate() == 0.01);
  CHECK(back.mlp_only_layers() == std::vector<int64_t>{0});
  CHECK(back.num_experts() == 8);
  CHECK(back.has_aux_loss());
  CHECK(tiny().to_hf_json().find("scoring_func") == std::string::npos);  // DeepSeek keys only when set

  auto with = [](const std::string& key, const std::string& value) {
    std::string text = kQwen3Json;
    const auto at = text.find("\"" + key + "\"");
    if (at == std::string::npos) return text.substr(0, text.rfind('}')) + ", \"" + key + "\": " + value + "}";
    const auto colon = text.find(':', at), end = text.find_first_of(",}", colon);
    return text.substr(0, colon + 1) + " " + value + text.substr(end);
  };
  CHECK_THAT(error_of([&] { fsdp::models::parse_moe_config(with("use_sliding_window", "true"), "c.json"); }),
             Contains("c.json: key 'use_sliding_window' is true"));
  CHECK_THAT(error_of([&] { fsdp::models::parse_moe_config(with("num_local_experts", "null"), "c.json"); }),
             Contains("key 'num_experts' (or 'num_local_experts') is missing"));
  CHECK_THAT(error_of([&] { fsdp::models::parse_moe_config(with("scoring_func", "\"relu\""), "c.json"); }),
             Contains("scoring_func 'relu' is not supported"));
  CHECK_THAT(error_of([&] { fsdp::models::parse_moe_config(with("n_group", "4"), "c.json"); }),
             Contains("needs scoring_func \"sigmoid\""));
  CHECK_THAT(error_of([&] { fsdp::models::parse_moe_config(with("model_type", "\"llama\""), "c.json"); }),
             Contains("expected \"qwen3_moe\""));
  CHECK_THAT(error_of([] { tiny().num_experts_per_tok(9).validate(); }),
             Contains("num_experts_per_tok (9) must lie in [1, num_experts = 8]"));
}

TEST_CASE("MoeForCausalLM: transformers' FQNs, dense and sparse layers", "[moe]") {
  torch::manual_seed(0);
  MoeForCausalLM model(tiny(/*deepseek=*/true));
  const auto params = model->named_parameters();
  const auto buffers = model->named_buffers();
  CHECK(params.contains("model.layers.0.mlp.gate_proj.weight"));  // dense (mlp_only_layers)
  CHECK_FALSE(params.contains("model.layers.0.mlp.gate.weight"));
  CHECK(params.contains("model.layers.1.mlp.gate.weight"));
  CHECK(params.contains("model.layers.1.mlp.experts.7.down_proj.weight"));
  CHECK(params.contains("model.layers.1.mlp.shared_experts.up_proj.weight"));
  CHECK(params.contains("model.layers.2.self_attn.q_norm.weight"));
  CHECK(params["model.layers.1.mlp.experts.7.gate_proj.weight"].sizes() == at::IntArrayRef{8, 16});
  CHECK(params["model.layers.1.mlp.shared_experts.up_proj.weight"].sizes() == at::IntArrayRef{8, 16});
  CHECK(buffers.contains("model.layers.3.mlp.gate.e_score_correction_bias"));
  MoeForCausalLM plain(tiny());
  CHECK(plain->named_buffers().is_empty());  // softmax scoring: no bias (Qwen3-MoE's files)
}

TEST_CASE("Sigmoid routing: group-limited top-k, the bias chooses, the scores weigh (closed form)", "[moe]") {
  const MoeConfig c = tiny(/*deepseek=*/true);
  fsdp::models::MoeRouter router(c);
  const std::vector<double> logits = {2.0, 1.9, -1.0, -1.0, 0.5, 0.4, 3.0, -3.0};
  {
    torch::NoGradGuard no_grad;
    router->weight.zero_();
    for (int e = 0; e < 8; ++e) router->weight[e][0] = logits[e];
  }
  const at::Tensor x = at::zeros({1, 16});
  x[0][0] = 1.0;
  // Groups (0 1) (2 3) (4 5) (6 7), scored by their two best: 1.75, 0.54, 1.22, 1.00. Expert 6
  // scores best alone but its group is not among the best two: experts 0 and 1.
  {
    auto [l, w, ids] = router(x);
    CHECK(ids[0][0].item<int64_t>() == 0);
    CHECK(ids[0][1].item<int64_t>() == 1);
    const double s0 = sigmoid(2.0), s1 = sigmoid(1.9);
    CHECK(w[0][0].item<double>() == Approx(2.5 * s0 / (s0 + s1)).epsilon(1e-6));
    CHECK(w[0][1].item<double>() == Approx(2.5 * s1 / (s0 + s1)).epsilon(1e-6));
  }
  // A bias of 0.5 on expert 4 makes it the first choice (0.62 + 0.5 > 0.88), weighted by its
  // unbiased score.
  {
    torch::NoGradGuard no_grad;
    router->e_score_correction_bias[4] = 0.5;
  }
  auto [l, w, ids] = router(x);
  CHECK(ids[0][0].item<int64_t>() == 4);
  CHECK(ids[0][1].item<int64_t>() == 0);
  const double s4 = sigmoid(0.5), s0 = sigmoid(2.0);
  CHECK(w[0][0].item<double>() == Approx(2.5 * s4 / (s4 + s0)).epsilon(1e-6));
  CHECK(w[0][1].item<double>() == Approx(2.5 * s0 / (s4 + s0)).epsilon(1e-6));
}

TEST_CASE("Aux-loss-free balancing: loads of training forwards, bias += rate * sign(mean - load)", "[moe]") {
  torch::manual_seed(0);
  const MoeConfig c = tiny(/*deepseek=*/true);
  MoeForCausalLM model(c);
  const at::Tensor ids = at::randint(0, 37, {3, 5}, at::kLong);
  {
    torch::NoGradGuard no_grad;
    model(ids);  // not counted
  }
  CHECK(model->router_loads().sum().item<double>() == 0.0);
  model(ids);
  const at::Tensor loads = model->router_loads();
  REQUIRE(loads.sizes() == at::IntArrayRef{3, 8});  // layers 1-3
  CHECK(at::equal(loads.sum(1), at::full({3}, 3.0 * 5 * 2, at::kDouble)));  // tokens x k per layer
  std::vector<at::Tensor> before;
  for (const auto& layer : model->layer_list()) {
    if (!layer->moe.is_empty()) before.push_back(layer->moe->gate->e_score_correction_bias.clone());
  }
  model->update_router_bias(loads);
  size_t i = 0;
  for (const auto& layer : model->layer_list()) {
    if (layer->moe.is_empty()) continue;
    const at::Tensor load = loads[static_cast<int64_t>(i)];
    const at::Tensor want = before[i] + (0.01 * at::sign(load.mean() - load)).to(at::kFloat);
    CHECK(at::equal(layer->moe->gate->e_score_correction_bias, want));
    ++i;
  }
  CHECK(model->router_loads().sum().item<double>() == 0.0);  // cleared
  CHECK_THAT(error_of([&] { model->update_router_bias(at::zeros({2, 8}, at::kDouble)); }),
             Contains("expected loads [3, 8]"));
}

TEST_CASE("Auxiliary loss: load_balancing_loss_func from router statistics (closed form)", "[moe]") {
  auto c = tiny().num_experts(2).num_experts_per_tok(1).num_hidden_layers(2);  // L = 2 sparse layers
  // Two rows, statistics summed over both layers: P = (0.7 + 0.5, 0.3 + 0.5), C = (3, 1).
  const at::Tensor stats = at::tensor({0.7, 0.3, 2.0, 0.0, 0.5, 0.5, 1.0, 1.0}, at::kFloat).view({2, 4});
  const int64_t tokens = 2;  // per layer
  const double rows = 2.0 * tokens;
  const double want = 2.0 * ((3.0 / rows) * (1.2 / rows) + (1.0 / rows) * (0.8 / rows));
  CHECK(fsdp::models::moe_aux_loss(stats, c, tokens).item<double>() == Approx(want).epsilon(1e-6));
}

TEST_CASE("Experts with no row are called with an empty batch; their gradients are zeros", "[moe]") {
  torch::manual_seed(0);
  MoeForCausalLM model(tiny().output_router_logits(false));
  const at::Tensor ids = at::full({2, 6}, 5, at::kLong);  // one token everywhere: every token routes alike
  const at::Tensor logits = model(ids);
  fsdp::models::causal_lm_loss(logits, at::full({2, 6}, 3, at::kLong)).backward();
  for (const auto& routing : model->last_routing()) {
    int64_t empty = 0;
    for (int64_t e = 0; e < 8; ++e) {
      if (routing.rows_per_expert[e] != 0) continue;
      ++empty;
      const auto expert = model->layer_list()[routing.layer]->moe->experts->at<fsdp::models::MoeExpert>(e);
      for (const auto& p : expert->parameters()) {
        REQUIRE(p.grad().defined());
        CHECK(p.grad().abs().max().item<double>() == 0.0);
      }
    }
    CHECK(empty == 6);
    CHECK(routing.expert_ids.sizes() == at::IntArrayRef{12, 2});
  }
}

TEST_CASE("Pipeline stages carry the router statistics: chained stages = the whole model", "[moe]") {
  for (bool deepseek : {false, true}) {
    const MoeConfig c = tiny(deepseek);
    const at::Tensor ids = at::randint(0, 37, {3, 5}, at::kLong);
    const at::Tensor targets = at::randint(0, 37, {3, 5}, at::kLong);
    const auto loss_fn = fsdp::models::moe_loss(c, [](const at::Tensor& logits, const at::Tensor& y) {
      return fsdp::models::causal_lm_loss(logits, y);
    });
    torch::manual_seed(3);
    MoeForCausalLM whole(c);
    whole->set_router_stats_output(true);
    const at::Tensor out = whole(ids);
    REQUIRE(out.sizes() == at::IntArrayRef{3, 5 * 37 + 16});
    loss_fn(out, targets).backward();

    const auto ranges = fsdp::pipeline::split_blocks_evenly(4, 2);
    torch::manual_seed(3);
    MoeForCausalLM first(c);
    torch::manual_seed(3);
    MoeForCausalLM last(c);
    first->keep_stage(ranges[0], true, false);
    last->keep_stage(ranges[1], false, true);
    first->set_router_stats_output(true);
    last->set_router_stats_output(true);
    const at::Tensor hidden = first(ids);
    CHECK(hidden.sizes() == at::IntArrayRef{3, 5 * 16 + 16});
    const at::Tensor chained = last(hidden);
    CHECK(at::allclose(chained, out, 0.0, 1e-6));
    const at::Tensor loss = loss_fn(chained, targets);
    loss.backward();
    // The auxiliary loss's gradient reaches the first stage's routers through the stage boundary.
    const std::string router = deepseek ? "model.layers.1.mlp.gate.weight" : "model.layers.0.mlp.gate.weight";
    const at::Tensor g_whole = whole->named_parameters()[router].grad();
    const at::Tensor g_stage = first->named_parameters()[router].grad();
    CHECK(at::allclose(g_stage, g_whole, 1e-5, 1e-7));
    auto [logits, stats] = fsdp::models::split_router_stats(chained, 5, 8);
    CHECK(logits.sizes() == at::IntArrayRef{3, 5, 37});
    // C sums to tokens x k x sparse layers.
    CHECK(stats.narrow(1, 8, 8).sum().item<double>() == 3.0 * 5 * 2 * c.num_sparse_layers());
  }
}

// examples/gpt_model.h as pipeline stages ([Note: GPT pipeline stages]): for an untied GPT cut
// into 1-4 stages, each stage built from the seed of the whole model and pruned, the stages
// together hold exactly the whole model's parameters (same FQNs, bitwise-equal values, none on
// two stages), and chaining their forwards gives the whole model's logits and gradients bit for
// bit, both through one autograd graph and with the stage boundaries cut as a pipeline runtime
// cuts them (each stage's input a fresh leaf, its gradient passed back by hand). Tied models are
// refused for more than one stage.
#include <map>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/utils.h>

#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/pipeline/stage_split.h"
#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;
using fsdp::examples::GPT;
using fsdp::examples::GPTConfig;
using fsdp::examples::next_token_loss;
using fsdp::pipeline::BlockRange;
using fsdp::pipeline::split_blocks_evenly;
using fsdp::testing::error_of;
using fsdp::testing::kNoError;

constexpr int64_t kVocab = 32;
constexpr int64_t kContext = 8;
constexpr uint64_t kSeed = 1234;

GPTConfig config_of(int64_t n_layers, bool tied) {
  return GPTConfig(kVocab).context_length(kContext).d_model(16).n_heads(2).n_layers(n_layers).tie_embeddings(tied);
}

GPT build(const GPTConfig& config, uint64_t seed = kSeed) {
  torch::manual_seed(seed);
  return GPT(config);
}

std::vector<GPT> build_stages(const GPTConfig& config, int64_t n_stages) {
  const auto ranges = split_blocks_evenly(config.n_layers(), n_stages);
  std::vector<GPT> stages;
  for (int64_t s = 0; s < n_stages; ++s) {
    GPT stage = build(config);
    stage->keep_stage(ranges[static_cast<size_t>(s)], s == 0, s == n_stages - 1);
    stages.push_back(stage);
  }
  return stages;
}

at::Tensor token_batch(int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100 + salt));
  return at::randint(kVocab, {3, kContext}, gen);
}

std::vector<std::string> keys(const torch::nn::Module& module) {
  std::vector<std::string> out;
  for (const auto& item : module.named_parameters()) out.push_back(item.key());
  return out;
}

TEST_CASE("GPT stages: the stages hold exactly the whole model's parameters", "[pipeline][gpt]") {
  for (int64_t n_layers : {4, 5}) {
    const GPTConfig config = config_of(n_layers, /*tied=*/false);
    GPT whole = build(config);
    const auto whole_params = whole->named_parameters();
    for (int64_t n_stages = 1; n_stages <= 4; ++n_stages) {
      INFO(n_layers << " blocks, " << n_stages << " stages");
      auto stages = build_stages(config, n_stages);
      std::vector<std::string> concatenated;
      std::set<std::string> seen;
      for (int64_t s = 0; s < n_stages; ++s) {
        for (const auto& item : stages[static_cast<size_t>(s)]->named_parameters()) {
          INFO("stage " << s << ": " << item.key());
          CHECK(seen.insert(item.key()).second);  // no FQN on two stages
          const at::Tensor* reference = whole_params.find(item.key());
          REQUIRE(reference != nullptr);
          CHECK(at::equal(item.value(), *reference));
          CHECK(item.value().requires_grad());
          concatenated.push_back(item.key());
        }
      }
      // Every FQN of the whole model, once, and in the whole model's order.
      CHECK(concatenated == keys(*whole));
      // The first stage holds the embeddings, the last ln_f and head, the middle ones neither.
      CHECK(stages.front()->is_first_stage());
      CHECK(stages.back()->is_last_stage());
      CHECK(!stages.back()->head.is_empty());
      for (int64_t s = 1; s + 1 < n_stages; ++s) {
        CHECK_FALSE(stages[static_cast<size_t>(s)]->is_first_stage());
        CHECK_FALSE(stages[static_cast<size_t>(s)]->is_last_stage());
      }
    }
  }
}

TEST_CASE("GPT stages: chained forwards and gradients equal the whole model's bit for bit", "[pipeline][gpt]") {
  for (int64_t n_layers : {4, 5}) {
    const GPTConfig config = config_of(n_layers, /*tied=*/false);
    const at::Tensor tokens = token_batch(0);
    const at::Tensor targets = token_batch(1);
    GPT whole = build(config);
    const at::Tensor whole_logits = whole(tokens);
    next_token_loss(whole_logits, targets).backward();
    const auto whole_params = whole->named_parameters();
    for (int64_t n_stages = 1; n_stages <= 4; ++n_stages) {
      INFO(n_layers << " blocks, " << n_stages << " stages");
      SECTION("one autograd graph through the stages: " + std::to_string(n_layers) + " blocks, " +
              std::to_string(n_stages) + " stages") {
        auto stages = build_stages(config, n_stages);
        at::Tensor x = tokens;
        for (int64_t s = 0; s < n_stages; ++s) {
          x = stages[static_cast<size_t>(s)](x);
          if (s + 1 < n_stages) {
            CHECK(x.sizes() == at::IntArrayRef({3, kContext, 16}));
            CHECK(x.scalar_type() == at::kFloat);
          }
        }
        CHECK(x.sizes() == at::IntArrayRef({3, kContext, kVocab}));
        CHECK(at::equal(x, whole_logits));
        next_token_loss(x, targets).backward();
        for (const GPT& stage : stages) {
          for (const auto& item : stage->named_parameters()) {
            INFO(item.key());
            REQUIRE(item.value().grad().defined());
            CHECK(at::equal(item.value().grad(), whole_params[item.key()].grad()));
          }
        }
      }
      SECTION("boundaries cut as a pipeline runtime cuts them: " + std::to_string(n_layers) + " blocks, " +
              std::to_string(n_stages) + " stages") {
        auto stages = build_stages(config, n_stages);
        std::vector<at::Tensor> inputs, outputs;
        at::Tensor x = tokens;
        for (int64_t s = 0; s < n_stages; ++s) {
          if (s > 0) x = x.detach().requires_grad_(true);  // received from the previous stage
          inputs.push_back(x);
          x = stages[static_cast<size_t>(s)](x);
          outputs.push_back(x);
        }
        CHECK(at::equal(outputs.back(), whole_logits));
        next_token_loss(outputs.back(), targets).backward();
        for (int64_t s = n_stages - 2; s >= 0; --s) {
          const at::Tensor& received = inputs[static_cast<size_t>(s + 1)].grad();
          REQUIRE(received.defined());
          outputs[static_cast<size_t>(s)].backward(received);
        }
        for (const GPT& stage : stages) {
          for (const auto& item : stage->named_parameters()) {
            INFO(item.key());
            REQUIRE(item.value().grad().defined());
            CHECK(at::equal(item.value().grad(), whole_params[item.key()].grad()));
          }
        }
      }
    }
  }
}

TEST_CASE("GPT stages: explicit ranges, a stage without blocks", "[pipeline][gpt]") {
  const GPTConfig config = config_of(4, /*tied=*/false);
  GPT whole = build(config);
  const at::Tensor tokens = token_batch(2);
  const std::vector<BlockRange> ranges{{0, 0}, {0, 3}, {3, 4}};  // embeddings alone, then 3 + 1 blocks
  fsdp::pipeline::check_split(ranges, 4, /*allow_empty_stages=*/true);
  std::vector<GPT> stages;
  for (size_t s = 0; s < ranges.size(); ++s) {
    GPT stage = build(config);
    stage->keep_stage(ranges[s], s == 0, s + 1 == ranges.size());
    stages.push_back(stage);
  }
  CHECK(keys(*stages[0]) == std::vector<std::string>{"tok_emb.weight", "pos_emb.weight"});
  CHECK(keys(*stages[2]).front() == "blocks.3.ln1.weight");
  CHECK(keys(*stages[2]).back() == "head.weight");
  at::Tensor x = tokens;
  for (GPT& stage : stages) x = stage(x);
  CHECK(at::equal(x, whole(tokens)));
}

TEST_CASE("GPT: an untied model initialises every other parameter as the tied one", "[pipeline][gpt]") {
  GPT tied = build(config_of(4, /*tied=*/true));
  GPT untied = build(config_of(4, /*tied=*/false));
  CHECK(tied->head.is_empty());
  CHECK_FALSE(tied->named_parameters().contains("head.weight"));
  const auto untied_params = untied->named_parameters();
  for (const auto& item : tied->named_parameters()) {
    INFO(item.key());
    CHECK(at::equal(item.value(), untied_params[item.key()]));
  }
  const at::Tensor head = untied_params["head.weight"];
  CHECK(head.sizes() == at::IntArrayRef({kVocab, 16}));
  CHECK(keys(*untied).back() == "head.weight");
  CHECK(keys(*untied).size() == keys(*tied).size() + 1);
  // Deterministic, and its own values (not the embedding's); N(0, 0.02).
  CHECK(at::equal(head, build(config_of(4, false))->head->weight));
  CHECK_FALSE(at::equal(head, untied->tok_emb->weight));
  CHECK(std::abs(head.std().item<double>() - 0.02) < 0.004);
  // With the embedding's weight copied into head, the untied model computes the tied logits.
  {
    c10::NoGradGuard no_grad;
    untied->head->weight.copy_(untied->tok_emb->weight);
  }
  const at::Tensor tokens = token_batch(3);
  CHECK(at::allclose(untied(tokens), tied(tokens), 1e-5, 1e-6));
  // generate runs on the whole untied model, deterministically.
  const at::Tensor prompt = tokens.narrow(1, 0, 2);
  const at::Tensor a = untied->generate(prompt, 5, 0.0, 0);
  CHECK(a.sizes() == at::IntArrayRef({3, 7}));
  CHECK(at::equal(a, untied->generate(prompt, 5, 0.0, 0)));
  CHECK(at::equal(untied->generate(prompt, 5, 0.8, 7), untied->generate(prompt, 5, 0.8, 7)));
}

TEST_CASE("GPT::keep_stage: refused splits and misuse are named", "[pipeline][gpt]") {
  SECTION("a tied model cannot be split") {
    GPT tied = build(config_of(4, /*tied=*/true));
    const std::string error = error_of([&] { tied->keep_stage({0, 2}, true, false); });
    CHECK_THAT(error, Contains("GPT::keep_stage") && Contains("tied embeddings") &&
                          Contains("first and the last stage") && Contains("tie_embeddings(false)") &&
                          Contains("first stage holding blocks [0, 2)"));
    CHECK_THAT(error_of([&] { tied->keep_stage({2, 4}, false, true); }),
               Contains("last stage") && Contains("tie_embeddings(false)"));
    CHECK_THAT(error_of([&] { tied->keep_stage({1, 3}, false, false); }), Contains("middle stage"));
    CHECK(keys(*tied) == keys(*build(config_of(4, true))));  // unchanged
    // A one-stage pipeline keeps the tied weight on its one stage.
    CHECK(error_of([&] { tied->keep_stage({0, 4}, true, true); }) == kNoError);
    CHECK(at::equal(tied(token_batch(4)), build(config_of(4, true))(token_batch(4))));
  }
  SECTION("ranges outside the model, reversed ranges, a second keep_stage") {
    GPT model = build(config_of(4, /*tied=*/false));
    CHECK_THAT(error_of([&] { model->keep_stage({2, 5}, false, true); }),
               Contains("GPT::keep_stage") && Contains("within [0, 4)") && Contains("got [2, 5)"));
    CHECK_THAT(error_of([&] { model->keep_stage({3, 1}, false, true); }), Contains("got [3, 1)"));
    CHECK(keys(*model).size() == keys(*build(config_of(4, false))).size());
    model->keep_stage({1, 3}, false, false);
    CHECK_THAT(error_of([&] { model->keep_stage({1, 2}, false, false); }),
               Contains("GPT::keep_stage") && Contains("already a pipeline stage") && Contains("blocks 1 .. 2"));
  }
  SECTION("a later stage wants hidden states; generate wants the whole model") {
    GPT middle = build(config_of(4, /*tied=*/false));
    middle->keep_stage({1, 3}, false, false);
    CHECK_THAT(error_of([&] { middle(token_batch(5)); }),
               Contains("GPT::forward") && Contains("blocks 1 .. 2") && Contains("hidden states") &&
                   Contains("[batch, time, 16]") && Contains("Long"));
    CHECK_THAT(error_of([&] { middle->generate(token_batch(5), 1, 0.0, 0); }),
               Contains("GPT::generate") && Contains("whole model") && Contains("middle"));
    GPT first = build(config_of(4, /*tied=*/false));
    first->keep_stage({0, 2}, true, false);
    CHECK(first(token_batch(5)).sizes() == at::IntArrayRef({3, kContext, 16}));
    CHECK_THAT(error_of([&] { first(at::zeros({3, kContext, 16})); }),
               Contains("GPT::forward") && Contains("int64 token ids"));
  }
}

}  // namespace

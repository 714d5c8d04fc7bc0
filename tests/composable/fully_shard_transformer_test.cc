// Transformer parity over MPI on every world size: GPT-style models (token embedding tied to the
// output projection; blocks of LayerNorm + attention + MLP) with one unit per block plus the
// root, trained with AdamW on next-token prediction against an unsharded reference whose
// gradients are averaged over every rank's batch. Losses every iteration and parameters after
// training agree bit-exactly on 1 rank, within rtol 1e-4 otherwise.
#include <functional>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

constexpr int64_t kVocab = 23;
constexpr int64_t kContext = 12;

struct LanguageModel {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(at::Tensor)> forward;  // tokens -> logits
  std::function<std::vector<fsdp::FSDPModule>(const fsdp::FullyShardOptions&)> shard;
};

at::Tensor tokens(int64_t step, int q, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(5000 * salt + 50 * step + q));
  return at::randint(kVocab, {3, kContext}, gen);
}

at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

void run_lm_parity(const std::function<LanguageModel()>& make, fsdp::ShardingStrategy strategy,
                   int iterations = 4) {
  const int W = world_size();
  const bool exact = W == 1;
  auto close = [&](const at::Tensor& a, const at::Tensor& b) {
    return exact ? a.equal(b) : at::allclose(a, b, 1e-4, 1e-6);
  };
  torch::manual_seed(42);
  LanguageModel sharded = make();
  torch::manual_seed(42);
  LanguageModel reference = make();
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto units = sharded.shard(fsdp::FullyShardOptions().communicator(comm).strategy(strategy));
  torch::optim::AdamW opt(sharded.module->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  torch::optim::AdamW ref_opt(reference.module->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  for (int64_t it = 0; it < iterations; ++it) {
    at::Tensor loss = loss_of(sharded.forward(tokens(it, rank(), 1)), tokens(it, rank(), 2));
    loss.backward();
    opt.step();
    opt.zero_grad();
    at::Tensor ref_loss;
    for (int q = 0; q < W; ++q) {
      at::Tensor lq = loss_of(reference.forward(tokens(it, q, 1)), tokens(it, q, 2));
      (lq / W).backward();
      if (q == rank()) ref_loss = lq.detach();
    }
    ref_opt.step();
    ref_opt.zero_grad();
    INFO("iteration " << it << ": loss " << loss.item<double>() << ", reference " << ref_loss.item<double>());
    CHECK(close(loss.detach(), ref_loss));
    for (const auto& u : units) {
      for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->unsharded_bytes() == 0);
    }
  }
  for (auto& u : units) u.unshard();
  const auto ref_params = reference.module->named_parameters();
  for (const auto& item : sharded.module->named_parameters()) {
    INFO("parameter " << item.key());
    at::Tensor mine = item.value().detach();
    at::Tensor theirs = ref_params[item.key()].detach();
    if (item.key().find("in_proj_bias") != std::string::npos || item.key().find("qkv.bias") != std::string::npos) {
      // The key bias of attention has an exactly-zero gradient (it adds the same q.b to every
      // score of a row, which softmax ignores); numerically it is rounding noise, which AdamW's
      // normalisation turns into lr-sized steps that no two summation orders share. Compare the
      // query and value parts.
      const int64_t d = mine.numel() / 3;
      mine = at::cat({mine.narrow(0, 0, d), mine.narrow(0, 2 * d, d)});
      theirs = at::cat({theirs.narrow(0, 0, d), theirs.narrow(0, 2 * d, d)});
    }
    CHECK(close(mine, theirs));
  }
  for (auto& u : units) u.reshard();
}

// MultiheadAttention blocks; `embedding_unit` also makes the token embedding a unit of its own,
// so the tied weight (registered by the embedding and the head) must move to the root.
std::function<LanguageModel()> tiny_gpt(bool embedding_unit) {
  return [embedding_unit] {
    auto model = fsdp::testing::TinyGpt(kVocab, kContext, 16, 4, 2);
    LanguageModel lm;
    lm.module = model.ptr();
    lm.forward = [model](at::Tensor t) mutable { return model(t); };
    lm.shard = [model, embedding_unit](const fsdp::FullyShardOptions& o) {
      std::vector<fsdp::FSDPModule> units;
      if (embedding_unit) units.push_back(fsdp::fully_shard(model->tok, o));
      for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->block(i), o));
      units.push_back(fsdp::fully_shard(model, o));
      return units;
    };
    return lm;
  };
}

// The example's GPT (attention from Linears and scaled_dot_product_attention).
LanguageModel example_gpt() {
  auto model = fsdp::examples::GPT(
      fsdp::examples::GPTConfig(kVocab).context_length(kContext).d_model(24).n_heads(3).n_layers(2));
  LanguageModel lm;
  lm.module = model.ptr();
  lm.forward = [model](at::Tensor t) mutable { return model(t); };
  lm.shard = [model](const fsdp::FullyShardOptions& o) {
    std::vector<fsdp::FSDPModule> units;
    for (auto& block : model->block_list()) units.push_back(fsdp::fully_shard(block, o));
    units.push_back(fsdp::fully_shard(model, o));
    return units;
  };
  return lm;
}

}  // namespace

FSDP_RANKS_TEST_CASE("GPT with MultiheadAttention, tied embedding in the root: FULL_SHARD parity", "[transformer]") {
  run_lm_parity(tiny_gpt(false), fsdp::ShardingStrategy::kFullShard);
}

FSDP_RANKS_TEST_CASE("GPT with the embedding as its own unit: the tied weight moves to the root", "[transformer][tied]") {
  run_lm_parity(tiny_gpt(true), fsdp::ShardingStrategy::kFullShard);
}

FSDP_RANKS_TEST_CASE("GPT with MultiheadAttention: SHARD_GRAD_OP and NO_SHARD parity", "[transformer]") {
  run_lm_parity(tiny_gpt(false), fsdp::ShardingStrategy::kShardGradOp);
  run_lm_parity(tiny_gpt(false), fsdp::ShardingStrategy::kNoShard);
}

FSDP_RANKS_TEST_CASE("the example's GPT: FULL_SHARD parity", "[transformer]") {
  run_lm_parity(example_gpt, fsdp::ShardingStrategy::kFullShard);
}

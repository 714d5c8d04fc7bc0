// Tensor parallelism on GPT pipeline stages (examples/gpt_tensor_parallel.h on models pruned by
// GPT::keep_stage), over the world as the tp group on 1-4 ranks: each stage gets the plan entries
// of the modules it holds (no tok_emb after the first stage, no ln_f or head before the last, the
// untied head column-parallel), and the stages chained on one rank give the unsplit,
// unparallelized model's loss, logits and gradients (this rank's pieces) within rounding, with and
// without sequence parallelism and loss parallelism.
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/utils.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_tensor_parallel.h"
#include "fsdp_cpp/pipeline/stage_split.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::examples::GPT;
using fsdp::examples::GPTConfig;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

constexpr int64_t kVocab = 24;    // divisible by 1-4
constexpr int64_t kContext = 12;  // divisible by 1-4 (sequence parallelism)

GPTConfig config() {
  // 12 heads of 2, MLP 96 wide: every tp size of 1-4 divides them.
  return GPTConfig(kVocab).context_length(kContext).d_model(24).n_heads(12).n_layers(4).tie_embeddings(false);
}

GPT build() {
  torch::manual_seed(77);
  return GPT(config());
}

at::Tensor token_batch(int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(300 + salt));
  return at::randint(kVocab, {2, kContext}, gen);
}

FSDP_RANKS_TEST_CASE("GPT stages: tensor parallel on each stage equals the whole model", "[pipeline][gpt][tp]") {
  const int n = world_size(), r = rank();
  const at::Tensor tokens = token_batch(0), targets = token_batch(1);
  GPT whole = build();
  const at::Tensor whole_logits = whole(tokens);
  const at::Tensor whole_loss = fsdp::examples::next_token_loss(whole_logits, targets);
  whole_loss.backward();
  const auto whole_params = whole->named_parameters();
  for (bool sp : {false, true}) {
    for (bool lp : {false, true}) {
      for (int64_t n_stages : {1, 2, 3}) {
        INFO("tp " << n << ", sequence parallel " << sp << ", loss parallel " << lp << ", " << n_stages << " stages");
        const auto ranges = fsdp::pipeline::split_blocks_evenly(4, n_stages);
        const auto options = fsdp::examples::GptTensorParallel().sequence_parallel(sp).loss_parallel(lp);
        std::vector<GPT> stages;
        fsdp::examples::GptLossFunction loss_fn;
        for (int64_t s = 0; s < n_stages; ++s) {
          GPT stage = build();
          stage->keep_stage(ranges[static_cast<size_t>(s)], s == 0, s == n_stages - 1);
          auto group = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
          loss_fn = fsdp::examples::parallelize_gpt(stage, group, options);
          stages.push_back(stage);
        }
        at::Tensor x = tokens;
        for (GPT& stage : stages) x = stage(x);
        const int64_t local_vocab = lp ? kVocab / n : kVocab;
        REQUIRE(x.sizes() == at::IntArrayRef({2, kContext, local_vocab}));
        CHECK(at::allclose(x, whole_logits.narrow(2, lp ? r * local_vocab : 0, local_vocab), 1e-4, 1e-5));
        const at::Tensor loss = loss_fn(x, targets);
        CHECK(at::allclose(loss, whole_loss, 1e-5, 1e-6));
        loss.backward();
        for (const GPT& stage : stages) {
          for (const auto& item : stage->named_parameters()) {
            INFO(item.key());
            REQUIRE(item.value().grad().defined());
            at::Tensor expected = whole_params[item.key()].grad();
            if (auto placement = fsdp::tensor_placement(item.value()); placement && placement->sharded()) {
              expected = placement->local_piece(expected, r);
            }
            CHECK(at::allclose(item.value().grad(), expected, 1e-4, 1e-6));
          }
        }
      }
    }
  }
}

FSDP_RANKS_TEST_CASE("GPT stages: the plan holds the entries of the modules a stage holds", "[pipeline][gpt][tp]") {
  auto names = [](const fsdp::TensorParallelPlan& plan) {
    std::vector<std::string> out;
    for (const auto& entry : plan) out.push_back(entry.first);
    return out;
  };
  const auto sp = fsdp::examples::GptTensorParallel().sequence_parallel(true);
  GPT first = build(), middle = build(), last = build(), whole = build();
  first->keep_stage({0, 1}, true, false);
  middle->keep_stage({1, 3}, false, false);
  last->keep_stage({3, 4}, false, true);
  const std::vector<std::string> blocks{"blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.fc",
                                        "blocks.*.mlp.proj", "blocks.*.ln1",       "blocks.*.ln2"};
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  CHECK(names(fsdp::examples::gpt_tensor_parallel_plan(*first, sp)) == with({"tok_emb", "pos_emb"}, blocks));
  CHECK(names(fsdp::examples::gpt_tensor_parallel_plan(*middle, sp)) == blocks);
  CHECK(names(fsdp::examples::gpt_tensor_parallel_plan(*last, sp)) == with(blocks, {"ln_f", "head"}));
  CHECK(names(fsdp::examples::gpt_tensor_parallel_plan(*whole, sp)) ==
        with(with({"tok_emb", "pos_emb"}, blocks), {"ln_f", "head"}));
  // The tied whole model's plan is the one of the whole-model overload (no head entry).
  torch::manual_seed(77);
  GPT tied(config().tie_embeddings(true));
  CHECK(names(fsdp::examples::gpt_tensor_parallel_plan(*tied, sp)) ==
        names(fsdp::examples::gpt_tensor_parallel_plan(sp)));
}

}  // namespace

// Checkpoints of expert-parallel and context-parallel jobs resume at other layouts
// (parallel/checkpoint.h), over MPI: 2 steps at layout A, save, a new job at layout B loads and
// trains 2 more steps; its parameters equal the unsharded reference trained 4 steps with the same
// global batches (gradient clipping binds every step, so the norm over experts held by different
// ranks is checked too). The MoE moves between ep sizes (experts held by other ranks after the
// load), the Llama between cp and tp/pp layouts (the same data-parallel size on both sides, so
// the global batches are the same). Tolerance 2e-5 (float32 after 4 AdamW steps).
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/models/llama.h"
#include "fsdp_cpp/models/llama_parallel.h"
#include "fsdp_cpp/models/moe.h"
#include "fsdp_cpp/models/moe_parallel.h"
#include "fsdp_cpp/parallel/checkpoint.h"
#include "fsdp_cpp/parallel/parallel_model.h"
#include "fsdp_cpp/parallel/reference.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::parallel::ModelSpec;
using fsdp::parallel::ParallelDims;
using fsdp::parallel::ParallelOptions;

constexpr double kMaxNorm = 0.05, kTol = 2e-5;
constexpr int64_t kVocab = 48, kRows = 4;  // a vocabulary tp 2, 3 and 4 split

fsdp::parallel::Batch batch_of(int64_t step, int q, int64_t time) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(700 * step + q);
  const at::Tensor t = at::randint(0, kVocab, {kRows, time + 1}, gen, at::kLong);
  return {t.narrow(1, 0, time).contiguous(), t.narrow(1, 1, time).contiguous()};
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-3).weight_decay(0.1); }

void train(fsdp::parallel::ParallelModel& model, torch::optim::Optimizer& optim, int steps, int64_t time) {
  for (int i = 0; i < steps; ++i) {
    const auto b = batch_of(model.steps() + 1, model.mesh().data_rank(), time);
    model.forward_backward(b.inputs, b.targets);
    CHECK(model.clip_grad_norm_(kMaxNorm) > kMaxNorm);
    optim.step();
    model.zero_grad();
  }
}

// A at 2 steps -> checkpoint -> B at 2 more, against the reference's 4 steps.
void resume(const ModelSpec& spec, const ParallelDims& a, const ParallelDims& b, int64_t time, const std::string& name) {
  const std::string dir = fsdp::testing::shared_tmpdir() + "/" + name;
  auto options = [](const ParallelDims& d) { return ParallelOptions().dims(d).n_microbatches(std::max(2, d.pp)); };
  {
    auto model = fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec, options(a));
    torch::optim::AdamW optim(model.parameters(), adamw());
    train(model, optim, 2, time);
    fsdp::parallel::save_checkpoint(dir, model, optim);
  }
  auto model = fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec, options(b));
  torch::optim::AdamW optim(model.parameters(), adamw());
  fsdp::parallel::load_checkpoint(dir, model, optim);
  CHECK(model.steps() == 2);
  train(model, optim, 2, time);

  const int dp = model.mesh().data_world();
  fsdp::parallel::UnshardedReference reference(spec, options(b));
  torch::optim::AdamW ref_optim(reference.parameters(), adamw());
  for (int64_t step = 1; step <= 4; ++step) {
    std::vector<fsdp::parallel::Batch> global;
    for (int q = 0; q < dp; ++q) global.push_back(batch_of(step, q, time));
    reference.forward_backward(step, global);
    reference.clip_grad_norm_(kMaxNorm);
    ref_optim.step();
    reference.zero_grad();
  }
  int64_t checked = 0;
  for (size_t c = 0; c < model.parts().size(); ++c) {
    const auto full = fsdp::full_state_dict(model.roots()[c], fsdp::FullStateDictOptions().rank0_only(false));
    const auto expected = reference.parts()[model.stages()[c]].module->named_parameters();
    for (const auto& item : full) {
      INFO(name << ": parameter " << item.key());
      const at::Tensor* want = expected.find(item.key());
      REQUIRE(want != nullptr);
      CHECK((item.value() - *want).abs().max().item<double>() < kTol);
      ++checked;
    }
  }
  CHECK(checked > 0);
}

ModelSpec moe_spec() {
  const auto config = fsdp::models::MoeConfig(kVocab)
                          .hidden_size(16)
                          .intermediate_size(24)
                          .moe_intermediate_size(8)
                          .num_hidden_layers(2)
                          .num_attention_heads(4)
                          .num_key_value_heads(2)
                          .max_position_embeddings(64)
                          .num_experts(4)
                          .num_experts_per_tok(2)
                          .norm_topk_prob(true);
  return fsdp::models::moe_model_spec(config, /*init_seed=*/3);
}

ModelSpec llama_spec() {
  const auto config = fsdp::models::LlamaConfig(kVocab)
                          .hidden_size(24)
                          .intermediate_size(24)
                          .num_hidden_layers(2)
                          .num_attention_heads(6)
                          .num_key_value_heads(3)
                          .max_position_embeddings(64);
  return fsdp::models::llama_model_spec(config, /*init_seed=*/4);
}

}  // namespace

FSDP_RANKS_TEST_CASE("an expert-parallel MoE job resumes at another ep size as the uninterrupted job", "[ep]") {
  const int w = fsdp::testing::world_size();
  if (w == 2) {
    resume(moe_spec(), {.dp_shard = 2, .ep = 2}, {.dp_shard = 2}, 8, "moe_ep2_to_ep1");
    resume(moe_spec(), {.dp_shard = 2}, {.dp_shard = 2, .ep = 2}, 8, "moe_ep1_to_ep2");
  } else if (w == 4) {
    resume(moe_spec(), {.dp_shard = 4, .ep = 4}, {.dp_shard = 4, .ep = 2}, 8, "moe_ep4_to_ep2");
  }
}

FSDP_RANKS_TEST_CASE("a context-parallel Llama job resumes at another layout as the uninterrupted job", "[cp]") {
  const int w = fsdp::testing::world_size();
  if (w == 2) {
    resume(llama_spec(), {.dp_shard = 1, .cp = 2}, {.dp_shard = 1, .pp = 2}, 12, "llama_cp2_to_pp2");
  } else if (w == 3) {
    resume(llama_spec(), {.dp_shard = 1, .cp = 3}, {.dp_shard = 1, .tp = 3}, 12, "llama_cp3_to_tp3");
  } else if (w == 4) {
    resume(llama_spec(), {.dp_shard = 2, .cp = 2}, {.dp_shard = 2, .pp = 2}, 12, "llama_dp2cp2_to_dp2pp2");
  }
}
